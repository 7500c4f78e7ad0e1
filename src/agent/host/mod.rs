//! What kg reads from the host for its own node: the IP to publish (Kilo's detection order),
//! the default route's link, the private IP's link, `cilium_host`'s address and the MTU. The
//! host is listed once per resync (or kernel notification) into a [`HostView`]; everything
//! else is computed from that view.

use std::net::IpAddr;

use anyhow::{Context, Result};
use ipnet::IpNet;

use crate::agent::shells::Kernel;
use control::host::HostNet;
use control::routes::Route;
use ipdetect::{Candidates, Detected, Exclusions};

pub mod encap;
pub mod ipdetect;
pub mod local;

pub use control::host::{Mtu, DEFAULT_MTU, WIREGUARD_OVERHEAD};

/// What detection takes from this node's own Node object: the read is repeated when they change.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DetectionInputs {
    /// `spec.podCIDR` and `spec.podCIDRs`: the pod bridge's addresses are never the node's.
    pub pod_cidrs: Vec<IpNet>,
    /// The `InternalIP` addresses of `status.addresses` (Kilo #367).
    pub internal_ips: Vec<IpAddr>,
}

impl DetectionInputs {
    /// The inputs of `node` (none without a Node object yet).
    pub fn of(node: Option<&k8s_openapi::api::core::v1::Node>) -> Self {
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
pub struct HostView {
    /// The node's IPs, chosen among the host's addresses.
    pub detected: Detected,
    /// Its links, addresses and main-table routes.
    pub net: HostNet,
    /// What detection left out.
    pub exclude: Exclusions,
}

impl HostView {
    /// The host's address of the other family than `internal`'s, on `internal`'s link, the
    /// `published` one while the host still has it (see [`ipdetect::second_internal_ip`]).
    pub fn second_internal_ip(&self, internal: IpNet, published: Option<IpNet>) -> Option<IpNet> {
        let link = self.net.private_link(Some(internal));
        if link == 0 {
            return None;
        }
        let same_link: Vec<IpNet> = self
            .net
            .addresses
            .iter()
            .filter(|(i, _)| *i == link)
            .map(|(_, n)| *n)
            .collect();
        ipdetect::second_internal_ip(internal, &same_link, &self.exclude, published)
    }

    /// With `--compatibility=cilium`: the IPv4 address of `cilium_host`, which other nodes use
    /// as this node's gateway inside the location.
    pub fn cilium_host_ip(&self) -> Option<IpNet> {
        let host = self.net.link_index(encap::CILIUM_HOST)?;
        self.net
            .addresses
            .iter()
            .find(|(i, n)| *i == host && n.addr().is_ipv4())
            .map(|(_, n)| IpNet::from(n.addr()))
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

/// Lists the host's links, addresses and main-table routes through `kernel` (the routes only
/// when `kept_routes`, those of the last dump, is `None`), and chooses this node's IP among
/// its addresses, ignoring kg's own links, the pod CIDRs of `local` (this node's object) and
/// the Kilo subnet, and preferring the Node's `InternalIP` after the hostname's addresses.
pub(crate) async fn read_host(
    kernel: &impl Kernel,
    own: &OwnSide<'_>,
    local: &DetectionInputs,
    kept_routes: Option<Vec<Route>>,
) -> Result<HostView> {
    let main_routes = match kept_routes {
        Some(routes) => routes,
        None => kernel.main_routes().await?,
    };
    let net = HostNet {
        links: kernel.links().await?,
        addresses: kernel.addresses().await?,
        main_routes,
        default_link: None,
    };
    HostView::of(net, own, local)
}

impl HostView {
    /// The view of the host whose links, addresses and main-table routes `net` lists (its
    /// `default_link` is found here): [`read_host`]'s decisions, without the kernel.
    pub fn of(mut net: HostNet, own: &OwnSide<'_>, local: &DetectionInputs) -> Result<Self> {
        let HostNet {
            links,
            addresses,
            main_routes,
            ..
        } = &net;
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
        net.default_link = default_link;
        Ok(HostView {
            detected,
            net,
            exclude,
        })
    }
}
