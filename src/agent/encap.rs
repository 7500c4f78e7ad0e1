//! Encapsulation inside a location: which tunnel link carries traffic between a
//! location's nodes, how kg sets it up, and, for the userspace path, which gateway each
//! destination goes to.
//!
//! IPIP goes through the kernel's `tunl0` where the kernel has IPIP (created through netlink,
//! like `ip tunnel add tunl0 mode ipip`), and through kilotun's own userspace IPIP device
//! otherwise: a TUN link plus a raw protocol-4 socket that puts the same bytes on the wire, so
//! a location may mix both kinds of node. kg picks the path by itself and logs which.

use std::net::IpAddr;

use anyhow::Result;
use control::routes::{Compatibility, Encapsulate, RoutePlan};
use control::Topology;
use dataplane::ipip::{IpipTable, UserspaceIpip, IPIP_OVERHEAD};
use ipnet::IpNet;

use super::shells::Kernel;

/// The kernel's IPIP fallback device.
pub const KERNEL_IPIP: &str = "tunl0";
/// kilotun's userspace IPIP device.
pub const USERSPACE_IPIP: &str = "kilo-ipip";
/// flannel's VXLAN device.
pub const FLANNEL: &str = "flannel.1";
/// Cilium's IPIP device.
pub const CILIUM_TUNNEL: &str = "cilium_tunl";
/// Cilium's host device, whose IPv4 address is published as `cni-compatibility-ip`.
pub const CILIUM_HOST: &str = "cilium_host";

/// The tunnel in use.
#[derive(Debug)]
pub enum Tunnel {
    /// `--encapsulate=never`: routes inside the location go straight over the private link.
    None,
    /// A kernel IPIP link: `tunl0`, which kg configures, or Cilium's `cilium_tunl`, which kg
    /// only brings up.
    Kernel {
        /// The link's name.
        name: &'static str,
        /// Whether kg sets its MTU and address.
        owned: bool,
    },
    /// kilotun's userspace IPIP device.
    Userspace(UserspaceIpip),
    /// flannel's `flannel.1`, which flannel owns and may create after kg starts.
    Flannel,
}

impl Tunnel {
    /// Picks the tunnel for `--encapsulate` and `--compatibility`, creating what is needed.
    pub async fn choose<N: Kernel>(
        netlink: &N,
        encapsulate: Encapsulate,
        compatibility: Compatibility,
    ) -> Result<Self> {
        if encapsulate == Encapsulate::Never {
            return Ok(Self::None);
        }
        match compatibility {
            Compatibility::Flannel => {
                tracing::info!("encapsulating inside locations over flannel's {FLANNEL}");
                return Ok(Self::Flannel);
            }
            Compatibility::Cilium if netlink.link_by_name(CILIUM_TUNNEL).await?.is_some() => {
                tracing::info!("encapsulating inside locations over Cilium's {CILIUM_TUNNEL}");
                return Ok(Self::Kernel {
                    name: CILIUM_TUNNEL,
                    owned: false,
                });
            }
            _ => {}
        }
        match netlink.add_ipip(KERNEL_IPIP).await {
            Ok(()) => {
                tracing::info!("encapsulating inside locations with the kernel's IPIP ({KERNEL_IPIP})");
                return Ok(Self::Kernel {
                    name: KERNEL_IPIP,
                    owned: true,
                });
            }
            Err(e) => tracing::info!(
                reason = format!("{e:#}"),
                "the kernel has no IPIP; encapsulating inside locations with kilotun's userspace IPIP ({USERSPACE_IPIP})"
            ),
        }
        Ok(Self::Userspace(UserspaceIpip::start(USERSPACE_IPIP)?))
    }

    /// The link's name, if there is a tunnel.
    pub fn name(&self) -> Option<&str> {
        match self {
            Self::None => None,
            Self::Kernel { name, .. } => Some(name),
            Self::Userspace(device) => Some(device.name()),
            Self::Flannel => Some(FLANNEL),
        }
    }

    /// True when the tunnel is IPIP, so the `KILO-IPIP` rules apply.
    pub fn is_ipip(&self) -> bool {
        matches!(self, Self::Kernel { .. } | Self::Userspace(_))
    }

    /// Sets the link up (and, for links kg owns, its MTU and address: the first IP of the pod
    /// CIDR, as Kilo puts on `tunl0`). Returns its index, or `None` when the link is missing.
    pub async fn prepare<N: Kernel>(
        &self,
        netlink: &N,
        pod_cidr: IpNet,
        private_mtu: Option<u32>,
    ) -> Result<Option<u32>> {
        let Some(name) = self.name() else {
            return Ok(None);
        };
        let Some(link) = netlink.link_by_name(name).await? else {
            return Ok(None);
        };
        let owned = matches!(self, Self::Kernel { owned: true, .. } | Self::Userspace(_));
        if owned {
            if let Some(mtu) = private_mtu.map(|m| m.saturating_sub(IPIP_OVERHEAD)) {
                if link.mtu != mtu {
                    netlink.set_mtu(link.index, mtu).await?;
                }
            }
            if let IpNet::V4(v4) = pod_cidr {
                let first = std::net::Ipv4Addr::from(u32::from(v4.network()).saturating_add(1));
                netlink
                    .set_address(link.index, Some(IpNet::from(IpAddr::V4(first))))
                    .await?;
            }
        }
        if !link.up && !matches!(self, Self::Flannel) {
            netlink.set_up(link.index, true).await?;
        }
        Ok(Some(link.index))
    }

    /// For the userspace device: the gateways of the routes `plan` sends over link `index`, and
    /// the location's private IPs as the only accepted sources.
    pub fn update(&self, plan: &RoutePlan, index: u32, topology: &Topology) {
        let Self::Userspace(device) = self else {
            return;
        };
        let routes = plan
            .routes
            .iter()
            .filter(|r| r.link == index)
            .filter_map(|r| r.gateway.map(|gateway| (r.dst, gateway)));
        let sources: Vec<IpAddr> = topology
            .local_segment()
            .map(|s| s.private_ips().collect())
            .unwrap_or_default();
        device.set_table(IpipTable::new(routes, sources));
    }
}
