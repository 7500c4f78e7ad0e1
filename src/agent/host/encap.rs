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
use dataplane::ipip::{IpipTable, UserspaceIpip, IPIP6_OVERHEAD, IPIP_OVERHEAD};
use ipnet::IpNet;

use crate::agent::shells::netlink::Link;
use crate::agent::shells::Kernel;

/// The kernel's IPIP fallback device.
pub const KERNEL_IPIP: &str = "tunl0";
/// The kernel's `ip6tnl` link (`ipip6` mode) kg creates beside `tunl0`, for IPv4 to nodes
/// with IPv6 internal IPs.
pub const KERNEL_IP6TNL: &str = "kilo-ip6tnl";
/// kilotun's userspace IPIP device.
pub const USERSPACE_IPIP: &str = "kilo-ipip";
/// flannel's VXLAN device.
pub const FLANNEL: &str = "flannel.1";
/// Cilium's IPIP device.
pub const CILIUM_TUNNEL: &str = "cilium_tunl";
/// Cilium's host device, whose IPv4 address is published as `cni-compatibility-ip`.
pub const CILIUM_HOST: &str = "cilium_host";

/// Which IPIP kg encapsulates with inside a location (`--ipip`), where `--compatibility`
/// leaves the choice to kg.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum IpipChoice {
    /// The kernel's `tunl0` where the kernel has IPIP, kilotun's userspace IPIP elsewhere.
    #[default]
    Auto,
    /// The kernel's `tunl0`; kg fails to start where the kernel has no IPIP.
    Kernel,
    /// kilotun's userspace IPIP even where the kernel has IPIP (for a host whose `tunl0`
    /// belongs to another agent, such as Calico in IPIP mode).
    Userspace,
}

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
        /// The kernel `ip6tnl` link kg creates beside it, when a node of the location has an
        /// IPv6 internal IP, to carry IPv4 there ([`KERNEL_IP6TNL`]); `None` beside a tunnel
        /// kg does not own.
        ipv6_outer: Option<&'static str>,
    },
    /// kilotun's userspace IPIP device.
    Userspace(UserspaceIpip),
    /// flannel's `flannel.1`, which flannel owns and may create after kg starts.
    Flannel,
}

impl Tunnel {
    /// Picks the tunnel for `--encapsulate`, `--compatibility` and `--ipip`, creating what is
    /// needed.
    pub async fn choose<N: Kernel>(
        netlink: &N,
        encapsulate: Encapsulate,
        compatibility: Compatibility,
        ipip: IpipChoice,
    ) -> Result<Self> {
        if encapsulate == Encapsulate::Never {
            return Ok(Self::None);
        }
        if ipip != IpipChoice::Auto
            && matches!(
                compatibility,
                Compatibility::Flannel | Compatibility::Cilium
            )
        {
            anyhow::bail!(
                "--ipip={}: with --compatibility={} the CNI's tunnel carries traffic inside a location; leave --ipip at auto",
                if ipip == IpipChoice::Kernel { "kernel" } else { "userspace" },
                if compatibility == Compatibility::Flannel { "flannel" } else { "cilium" },
            );
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
                    ipv6_outer: None,
                });
            }
            // A tunl0 of kg's own next to Cilium makes the kernel detect TX recursion: wait for
            // Cilium's link instead, routing without encapsulation until it appears.
            Compatibility::Cilium if netlink.has_ipip().await? => {
                tracing::warn!("--compatibility=cilium: Cilium's {CILIUM_TUNNEL} does not exist; kg does not create {KERNEL_IPIP} next to Cilium (the kernel would detect TX recursion). Run Cilium with enable-ipip-termination=true so it creates {CILIUM_TUNNEL}; until then traffic inside the location is not encapsulated, and the WireGuard mesh between locations is unaffected");
                return Ok(Self::Kernel {
                    name: CILIUM_TUNNEL,
                    owned: false,
                    ipv6_outer: None,
                });
            }
            Compatibility::Cilium => {
                tracing::info!("--compatibility=cilium: the kernel has no IPIP; encapsulating inside locations with kilotun's userspace IPIP ({USERSPACE_IPIP})");
                return Ok(Self::Userspace(UserspaceIpip::start(USERSPACE_IPIP)?));
            }
            _ => {}
        }
        if ipip == IpipChoice::Userspace {
            tracing::info!("encapsulating inside locations with kilotun's userspace IPIP ({USERSPACE_IPIP}): --ipip=userspace");
            return Ok(Self::Userspace(UserspaceIpip::start(USERSPACE_IPIP)?));
        }
        match netlink.add_ipip(KERNEL_IPIP).await {
            Err(e) if ipip == IpipChoice::Kernel => {
                return Err(e.context(format!("--ipip=kernel: creating {KERNEL_IPIP}")))
            }
            Ok(()) => {
                tracing::info!("encapsulating inside locations with the kernel's IPIP ({KERNEL_IPIP})");
                return Ok(Self::Kernel {
                    name: KERNEL_IPIP,
                    owned: true,
                    ipv6_outer: Some(KERNEL_IP6TNL),
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

    /// True when the tunnel reaches gateways with IPv6 addresses (kilotun's userspace IPIP
    /// device on a host with IPv6).
    pub fn carries_ipv6_outer(&self) -> bool {
        matches!(self, Self::Userspace(device) if device.carries_ipv6_outer())
    }

    /// The kernel `ip6tnl` link kg made beside `tunl0`, if any (removed with the interface on
    /// shutdown).
    pub fn ipv6_outer(&self) -> Option<&'static str> {
        match self {
            Self::Kernel { ipv6_outer, .. } => *ipv6_outer,
            _ => None,
        }
    }

    /// True when the tunnel is IPIP, so the `KILO-IPIP` rules apply.
    pub fn is_ipip(&self) -> bool {
        matches!(self, Self::Kernel { .. } | Self::Userspace(_))
    }

    /// Sets the link up (and, for links kg owns, its MTU and address: the first IP of the pod
    /// CIDR, as Kilo puts on `tunl0`). The MTU leaves room for the outer header of the private
    /// IP's family (`private_ipv6`: 40 bytes, else 20). Returns its index, or `None` when the
    /// link is missing.
    pub async fn prepare<N: Kernel>(
        &self,
        netlink: &N,
        pod_cidr: IpNet,
        private_mtu: Option<u32>,
        private_ipv6: bool,
    ) -> Result<Option<u32>> {
        let Some(name) = self.name() else {
            return Ok(None);
        };
        let Some(link) = netlink.link_by_name(name).await? else {
            return Ok(None);
        };
        let owned = matches!(self, Self::Kernel { owned: true, .. } | Self::Userspace(_));
        if owned {
            let overhead = if private_ipv6 && self.carries_ipv6_outer() {
                IPIP6_OVERHEAD
            } else {
                IPIP_OVERHEAD
            };
            set_mtu_below(netlink, &link, private_mtu, overhead).await?;
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

    /// The kernel's `ip6tnl` link for IPv4 to IPv6 internal IPs, when `needed` (a node of the
    /// location has an IPv6 internal IP) and the tunnel is kg's `tunl0`: created over the
    /// private link `private` on first use, brought up with an MTU that leaves room for the
    /// 40-byte outer IPv6 header. Returns its index, or `None` (said once per call, which the
    /// agent makes only when its inputs change) when the kernel cannot have one.
    pub async fn prepare_ipv6_outer<N: Kernel>(
        &self,
        netlink: &N,
        needed: bool,
        private: u32,
        private_mtu: Option<u32>,
    ) -> Result<Option<u32>> {
        let Self::Kernel {
            ipv6_outer: Some(name),
            ..
        } = self
        else {
            return Ok(None);
        };
        if !needed || private == 0 {
            return Ok(None);
        }
        let link = match netlink.link_by_name(name).await? {
            Some(link) => link,
            None => {
                if let Err(e) = netlink.add_ip6tnl(name, private).await {
                    tracing::info!(
                        reason = format!("{e:#}"),
                        "no kernel ip6tnl: IPv4 to nodes with IPv6 internal IPs is routed without encapsulation"
                    );
                    return Ok(None);
                }
                tracing::info!("IPv4 to nodes with IPv6 internal IPs is encapsulated with the kernel's ip6tnl ({name}, ipip6 mode)");
                match netlink.link_by_name(name).await? {
                    Some(link) => link,
                    None => return Ok(None),
                }
            }
        };
        set_mtu_below(netlink, &link, private_mtu, IPIP6_OVERHEAD).await?;
        if !link.up {
            netlink.set_up(link.index, true).await?;
        }
        Ok(Some(link.index))
    }

    /// The encapsulation link as the desired state names it, if kg uses one.
    pub fn kind(&self) -> Option<control::desired::TunnelKind> {
        self.name().map(|name| control::desired::TunnelKind {
            name: name.to_string(),
            ipip: self.is_ipip(),
            ipv6_outer: self.carries_ipv6_outer(),
        })
    }

    /// For the userspace device: the gateways of the routes `plan` sends over link `index` (a
    /// route without one, to a node with an IPv6 internal IP, goes to that internal IP), and the
    /// location's private IPs as the only accepted sources.
    pub fn update(&self, plan: &RoutePlan, index: u32, topology: &Topology) {
        let Self::Userspace(device) = self else {
            return;
        };
        let routes = plan
            .routes
            .iter()
            .filter(|r| r.link == index)
            .filter_map(|r| {
                let gateway = r
                    .gateway
                    .or_else(|| plan.tunnel_gateways.get(&r.dst).copied())?;
                Some((r.dst, gateway))
            });
        let sources: Vec<IpAddr> = topology.local_location_private_ips();
        device.set_table(IpipTable::new(routes, sources));
    }
}

/// Sets `link`'s MTU to the private link's less `overhead` (the outer header), when the private
/// link's is known and the link's differs.
async fn set_mtu_below<N: Kernel>(
    netlink: &N,
    link: &Link,
    private_mtu: Option<u32>,
    overhead: u32,
) -> Result<()> {
    match private_mtu.map(|m| m.saturating_sub(overhead)) {
        Some(mtu) if link.mtu != mtu => netlink.set_mtu(link.index, mtu).await,
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::shells::twins::MemKernel;

    fn host() -> MemKernel {
        let eth0 = Link {
            index: 2,
            name: "eth0".into(),
            mtu: 1500,
            up: true,
        };
        MemKernel::new(vec![eth0], Vec::new(), Some(2))
    }

    /// The tunnel `--ipip=auto` picks on `kernel`.
    async fn choose_auto(kernel: &MemKernel, e: Encapsulate, c: Compatibility) -> Tunnel {
        Tunnel::choose(kernel, e, c, IpipChoice::Auto)
            .await
            .unwrap()
    }

    // This machine's kernel has no IPIP, so the kernel-with-IPIP side of the Cilium decision
    // is shown on the in-memory twin of the kernel.
    #[tokio::test]
    async fn cilium_without_its_tunnel_never_gets_a_tunl0_of_kg() {
        let kernel = host().with_ipip();
        let before = kernel.link_names();
        let tunnel = choose_auto(&kernel, Encapsulate::Always, Compatibility::Cilium).await;
        assert_eq!(tunnel.name(), Some(CILIUM_TUNNEL));
        assert!(matches!(tunnel, Tunnel::Kernel { owned: false, .. }));
        assert_eq!(kernel.link_names(), before, "no link created");
        assert_eq!(kernel.calls().writes, 0);
        // Until Cilium creates its link, the tunnel is missing: routes go unencapsulated.
        let index = tunnel
            .prepare(&kernel, "10.42.1.0/24".parse().unwrap(), Some(1500), false)
            .await
            .unwrap();
        assert_eq!(index, None);
    }

    #[tokio::test]
    async fn cilium_with_its_tunnel_uses_it() {
        let kernel = MemKernel::new(
            vec![Link {
                index: 7,
                name: CILIUM_TUNNEL.into(),
                mtu: 1480,
                up: false,
            }],
            Vec::new(),
            None,
        )
        .with_ipip();
        let tunnel = choose_auto(&kernel, Encapsulate::Always, Compatibility::Cilium).await;
        assert_eq!(tunnel.name(), Some(CILIUM_TUNNEL));
        let index = tunnel
            .prepare(&kernel, "10.42.1.0/24".parse().unwrap(), Some(1500), false)
            .await
            .unwrap();
        assert_eq!(index, Some(7));
        assert_eq!(
            kernel.link_names(),
            [CILIUM_TUNNEL, KERNEL_IPIP],
            "no link created"
        );
    }

    #[tokio::test]
    async fn without_cilium_the_kernels_ipip_is_used_where_it_exists() {
        let kernel = host().with_ipip();
        let tunnel = choose_auto(&kernel, Encapsulate::Always, Compatibility::Ipip).await;
        assert_eq!(tunnel.name(), Some(KERNEL_IPIP));
        assert!(matches!(tunnel, Tunnel::Kernel { owned: true, .. }));
        // Without ip6_tunnel there is no IPv6-outer link: such routes stay unencapsulated.
        assert_eq!(
            tunnel
                .prepare_ipv6_outer(&kernel, true, 2, Some(1500))
                .await
                .unwrap(),
            None
        );
        assert_eq!(kernel.link_names(), ["eth0", KERNEL_IPIP]);
    }

    #[tokio::test]
    async fn ipip_other_than_auto_beside_a_cnis_tunnel_is_an_error_naming_both_flags() {
        let kernel = host().with_ipip();
        for compatibility in [Compatibility::Cilium, Compatibility::Flannel] {
            let e = Tunnel::choose(
                &kernel,
                Encapsulate::Always,
                compatibility,
                IpipChoice::Userspace,
            )
            .await
            .unwrap_err();
            let text = format!("{e:#}");
            assert!(
                text.starts_with("--ipip=userspace: with --compatibility="),
                "{text}"
            );
        }
        assert_eq!(kernel.link_names(), ["eth0", KERNEL_IPIP]);
    }

    #[tokio::test]
    async fn forcing_the_kernels_ipip_where_it_has_none_is_an_error_naming_the_flag() {
        let kernel = host();
        let e = Tunnel::choose(
            &kernel,
            Encapsulate::Always,
            Compatibility::Ipip,
            IpipChoice::Kernel,
        )
        .await
        .unwrap_err();
        let text = format!("{e:#}");
        assert!(
            text.starts_with("--ipip=kernel: creating tunl0: "),
            "{text}"
        );
        assert_eq!(kernel.link_names(), ["eth0"]);
    }

    // This machine's kernel has neither IPIP nor ip6_tunnel, so the kernel path for IPv4 over
    // IPv6 internal IPs is shown on the in-memory twin.
    #[tokio::test]
    async fn kg_adds_an_ip6tnl_beside_tunl0_only_when_a_node_has_an_ipv6_internal_ip() {
        let kernel = host().with_ipip().with_ip6tnl();
        let tunnel = choose_auto(&kernel, Encapsulate::Always, Compatibility::Ipip).await;
        // An IPv4-only location: nothing created, nothing loaded.
        assert_eq!(
            tunnel
                .prepare_ipv6_outer(&kernel, false, 2, Some(1500))
                .await
                .unwrap(),
            None
        );
        assert!(!kernel.link_names().contains(&KERNEL_IP6TNL.to_string()));
        let index = tunnel
            .prepare_ipv6_outer(&kernel, true, 2, Some(1500))
            .await
            .unwrap()
            .expect("the ip6tnl link");
        let link = kernel
            .links()
            .await
            .unwrap()
            .into_iter()
            .find(|l| l.index == index)
            .unwrap();
        assert_eq!(link.name, KERNEL_IP6TNL);
        assert_eq!(link.mtu, 1460, "1500 less the 40-byte IPv6 header");
        assert!(link.up);
        // Asked again: the same link, nothing written.
        let writes = kernel.calls().writes;
        assert_eq!(
            tunnel
                .prepare_ipv6_outer(&kernel, true, 2, Some(1500))
                .await
                .unwrap(),
            Some(index)
        );
        assert_eq!(kernel.calls().writes, writes);
        // Cilium's own tunnel gets none.
        let cilium = choose_auto(&kernel, Encapsulate::Always, Compatibility::Cilium).await;
        assert_eq!(
            cilium
                .prepare_ipv6_outer(&kernel, true, 2, Some(1500))
                .await
                .unwrap(),
            None
        );
    }

    #[tokio::test]
    #[ignore = "needs root: the userspace IPIP device is a TUN link"]
    async fn cilium_on_a_kernel_without_ipip_uses_the_userspace_device() {
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        assert!(root, "the userspace IPIP device needs root");
        let kernel = host();
        // The userspace device is a real TUN link: create it in a namespace of its own.
        let tunnel = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            // SAFETY: unshare on this thread only, which then exits.
            assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
            runtime.block_on(async {
                let tunnel = choose_auto(&kernel, Encapsulate::Always, Compatibility::Cilium).await;
                (tunnel.name().map(str::to_string), kernel.calls().writes)
            })
        })
        .join()
        .unwrap();
        assert_eq!(tunnel, (Some(USERSPACE_IPIP.to_string()), 0));
    }
}
