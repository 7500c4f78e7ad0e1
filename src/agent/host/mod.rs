//! What kg reads from the host for its own node: the IP to publish (Kilo's detection order),
//! the default route's link, the private IP's link, `cilium_host`'s address and the MTU. The
//! host is listed once per resync (or kernel notification) into a [`HostView`]; everything
//! else is computed from that view.

use std::net::IpAddr;

use anyhow::{Context, Result};
use ipnet::IpNet;

use crate::agent::shells::netlink::Link;
use crate::agent::shells::Kernel;
use ipdetect::{Candidates, Detected, Exclusions};

pub mod encap;
pub mod ipdetect;
pub mod local;

/// The MTU used when the default route's cannot be read.
pub const DEFAULT_MTU: u32 = 1420;
/// WireGuard's overhead, subtracted by `--mtu=auto`.
pub const WIREGUARD_OVERHEAD: u32 = 80;

/// `--mtu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mtu {
    /// The default-route interface's MTU minus 80, re-detected every reconcile.
    Auto,
    /// A fixed MTU.
    Fixed(u32),
}

/// What detection takes from this node's own Node object: the read is repeated when they change.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct DetectionInputs {
    /// `spec.podCIDR` and `spec.podCIDRs`: the pod bridge's addresses are never the node's.
    pub pod_cidrs: Vec<IpNet>,
    /// The `InternalIP` addresses of `status.addresses` (Kilo #367).
    pub internal_ips: Vec<IpAddr>,
}

impl DetectionInputs {
    /// The inputs of `node` (none without a Node object yet).
    pub(crate) fn of(node: Option<&k8s_openapi::api::core::v1::Node>) -> Self {
        let spec = node.and_then(|n| n.spec.as_ref());
        let mut pod_cidrs: Vec<IpNet> = spec
            .and_then(|s| s.pod_cidrs.clone())
            .unwrap_or_default()
            .into_iter()
            .chain(spec.and_then(|s| s.pod_cidr.clone()))
            .filter_map(|c| c.parse::<IpNet>().ok())
            .collect();
        pod_cidrs.sort();
        pod_cidrs.dedup();
        let internal_ips = node
            .and_then(|n| n.status.as_ref()?.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == "InternalIP")
            .filter_map(|a| a.address.parse().ok())
            .collect();
        Self {
            pod_cidrs,
            internal_ips,
        }
    }
}

/// The host as last listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HostView {
    /// The node's IPs, chosen among the host's addresses.
    pub detected: Detected,
    /// The default route's link.
    pub default_link: Option<u32>,
    /// Every link.
    pub links: Vec<Link>,
    /// Every address with its link.
    pub addresses: Vec<(u32, IpNet)>,
    /// The main table's unicast routes, kg's among them.
    pub main_routes: Vec<control::routes::Route>,
    /// What detection left out.
    pub exclude: Exclusions,
}

impl HostView {
    /// The index of the link holding the private IP `private` (0 when there is none).
    pub(crate) fn private_link(&self, private: Option<IpNet>) -> u32 {
        let Some(private) = private else { return 0 };
        self.addresses
            .iter()
            .find(|(_, n)| n.addr() == private.addr())
            .map_or(0, |(i, _)| *i)
    }

    /// The host's address of the other family than `internal`'s, on `internal`'s link, the
    /// `published` one while the host still has it (see [`ipdetect::second_internal_ip`]).
    pub(crate) fn second_internal_ip(
        &self,
        internal: IpNet,
        published: Option<IpNet>,
    ) -> Option<IpNet> {
        let link = self.private_link(Some(internal));
        if link == 0 {
            return None;
        }
        let same_link: Vec<IpNet> = self
            .addresses
            .iter()
            .filter(|(i, _)| *i == link)
            .map(|(_, n)| *n)
            .collect();
        ipdetect::second_internal_ip(internal, &same_link, &self.exclude, published)
    }

    /// The link with index `index`.
    pub(crate) fn link(&self, index: u32) -> Option<&Link> {
        self.links.iter().find(|l| l.index == index)
    }

    /// The networks this node is directly connected to: the network of every address that
    /// gives the kernel a connected route (canonical, de-duplicated), leaving out kg's own links
    /// `own` (the WireGuard link, the tunnel), `lo`, loopback and link-local addresses, and
    /// host addresses (`/32`, `/128`: no connected route, only a local one, which no route of
    /// kg's overrides; kube-proxy's `kube-ipvs0` holds every Service IP so). The routes kg
    /// installs must never replace or cover these networks.
    pub(crate) fn connected_networks(&self, own: &[u32]) -> Vec<IpNet> {
        let mut nets: Vec<IpNet> = self
            .addresses
            .iter()
            .filter(|(i, _)| !own.contains(i) && self.link(*i).is_none_or(|l| l.name != "lo"))
            .map(|(_, n)| n.trunc())
            .filter(|n| n.prefix_len() < n.max_prefix_len())
            .filter(|n| match n.addr() {
                IpAddr::V4(a) => !a.is_loopback() && !a.is_link_local(),
                IpAddr::V6(a) => !a.is_loopback() && !a.is_unicast_link_local(),
            })
            .collect();
        nets.sort();
        nets.dedup();
        nets
    }

    /// With `--compatibility=cilium`: the IPv4 address of `cilium_host`, which other nodes use
    /// as this node's gateway inside the location.
    pub(crate) fn cilium_host_ip(&self) -> Option<IpNet> {
        let host = self.links.iter().find(|l| l.name == encap::CILIUM_HOST)?;
        self.addresses
            .iter()
            .find(|(i, n)| *i == host.index && n.addr().is_ipv4())
            .map(|(_, n)| IpNet::from(n.addr()))
    }

    /// The WireGuard link's MTU: `--mtu`, or with `auto` the default route's link's minus
    /// WireGuard's overhead, never under 1280 (1420 when the default route's link is unknown).
    pub(crate) fn mtu(&self, mtu: Mtu) -> u32 {
        match mtu {
            Mtu::Fixed(m) => m,
            Mtu::Auto => self
                .default_link
                .and_then(|i| self.link(i))
                .map_or(DEFAULT_MTU, |l| {
                    l.mtu.saturating_sub(WIREGUARD_OVERHEAD).max(1280)
                }),
        }
    }
}

/// What kg knows of its own node before it lists the host: its own links (never the node's
/// IP), the hostname's addresses, the Kilo subnet and `--internal-cidr`.
pub struct OwnSide<'a> {
    /// The WireGuard link's index.
    pub kilo_index: u32,
    /// The tunnel link's name, if kg uses one.
    pub tunnel: Option<&'a str>,
    /// The addresses the hostname resolved to.
    pub hostname_ips: &'a [IpAddr],
    /// `--subnet`.
    pub subnet: IpNet,
    /// `--internal-cidr`.
    pub internal_cidrs: &'a [IpNet],
}

/// Lists the host's links, addresses and default route through `kernel`, and chooses this
/// node's IP among its addresses, ignoring kg's own links, the pod CIDRs of `local` (this
/// node's object) and the Kilo subnet, and preferring the Node's `InternalIP` after the
/// hostname's addresses.
pub(crate) async fn read_host(
    kernel: &impl Kernel,
    own: &OwnSide<'_>,
    local: &DetectionInputs,
) -> Result<HostView> {
    let links = kernel.links().await?;
    let addresses = kernel.addresses().await?;
    let ignored_links: Vec<u32> = links
        .iter()
        .filter(|l| {
            l.index == own.kilo_index
                || l.name == "kube-bridge"
                || Some(l.name.as_str()) == own.tunnel
        })
        .map(|l| l.index)
        .collect();
    let exclude = Exclusions {
        addresses: addresses
            .iter()
            .filter(|(i, _)| ignored_links.contains(i))
            .map(|(_, n)| n.addr())
            .collect(),
        networks: local
            .pod_cidrs
            .iter()
            .copied()
            .chain([own.subnet])
            .collect(),
    };
    let node_internal = &local.internal_ips;
    let main_routes = kernel.main_routes().await?;
    let default_link = main_routes
        .iter()
        .find(|r| r.dst.prefix_len() == 0)
        .map(|r| r.link);
    let candidates = Candidates {
        hostname: addresses
            .iter()
            .filter(|(_, n)| own.hostname_ips.contains(&n.addr()))
            .map(|(_, n)| *n)
            .collect(),
        node_internal: addresses
            .iter()
            .filter(|(_, n)| node_internal.contains(&n.addr()))
            .map(|(_, n)| *n)
            .collect(),
        default_route: addresses
            .iter()
            .filter(|(i, _)| Some(*i) == default_link)
            .map(|(_, n)| *n)
            .collect(),
        all: addresses.iter().map(|(_, n)| *n).collect(),
    };
    let detected = ipdetect::choose(&candidates, &exclude, own.internal_cidrs)
        .context("no valid IP was found")?;
    Ok(HostView {
        detected,
        default_link,
        links,
        addresses,
        main_routes,
        exclude,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str) -> Link {
        Link {
            index,
            name: name.into(),
            mtu: 1500,
            up: true,
        }
    }

    #[test]
    fn connected_networks_leave_out_kgs_links_loopback_link_local_and_host_addresses() {
        let net = |s: &str| s.parse::<IpNet>().unwrap();
        let host = HostView {
            detected: Detected {
                private: Some(net("192.168.10.1/24")),
                public: net("192.168.10.1/24"),
                families: ipdetect::Families {
                    ipv4: true,
                    ipv6: true,
                },
            },
            default_link: Some(2),
            links: vec![
                link(1, "lo"),
                link(2, "eth0"),
                link(3, "kilo0"),
                link(4, "tunl0"),
                link(5, "kube-ipvs0"),
                link(6, "pods0"),
            ],
            addresses: vec![
                (1, net("127.0.0.1/8")),
                (1, net("::1/128")),
                (2, net("192.168.10.1/24")),
                (2, net("192.168.10.9/24")),
                (2, net("169.254.3.1/16")),
                (2, net("fe80::1/64")),
                (2, net("2001:db8::1/64")),
                (3, net("10.4.0.1/16")),
                (4, net("10.42.1.1/32")),
                (5, net("10.96.0.1/32")),
                (6, net("10.42.1.1/24")),
            ],
            main_routes: Vec::new(),
            exclude: Exclusions::default(),
        };
        assert_eq!(
            host.connected_networks(&[3, 4]),
            [
                net("10.42.1.0/24"),
                net("192.168.10.0/24"),
                net("2001:db8::/64")
            ]
        );
    }
}
