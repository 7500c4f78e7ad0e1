//! Where each node's pods live, from the source the cluster's IPAM really uses (`--ipam`):
//! the Nodes' `spec.podCIDRs` (Kilo's, [`IpamSource::Node`]), Calico's block affinities and
//! the addresses it lent out of other nodes' blocks ([`IpamSource::Calico`]), Cilium's
//! `CiliumNode` ranges ([`IpamSource::Cilium`]), or the addresses of the node's pods
//! ([`IpamSource::Pods`]). Everything that follows a node's pod ranges (allowed IPs, routes,
//! the firewall's sets, the graph) takes them from here through the node table.
//!
//! A range two nodes claim, or two nodes' ranges that overlap, is refused for both, with a
//! problem naming them: it is never routed into the wrong tunnel. A single address inside
//! another node's range is no overlap but a borrowed address (Calico lends them), routed to
//! the node whose pod holds it by the longer prefix.
//!
//! Pure: no I/O.

pub mod objects;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

pub use objects::{BlockAffinity, CiliumNode, IpamBlock, ObjectError, PodAddresses};

/// Where the nodes' pod ranges come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum IpamSource {
    /// `Node.spec.podCIDRs`, as Kilo reads them.
    Node,
    /// Calico's confirmed `BlockAffinity` blocks, and its borrowed addresses.
    Calico,
    /// Cilium's `CiliumNode` pod ranges (cluster-pool and multi-pool).
    Cilium,
    /// The addresses of each node's pods (`status.podIPs`), aggregated into ranges.
    Pods,
}

impl IpamSource {
    /// The name `--ipam` takes and logs print.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Node => "node",
            Self::Calico => "calico",
            Self::Cilium => "cilium",
            Self::Pods => "pods",
        }
    }
}

/// The IPAM objects of the cluster, by object name (`namespace/name` for Pods).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IpamObjects {
    /// Calico's `BlockAffinity` objects.
    pub affinities: BTreeMap<String, BlockAffinity>,
    /// Calico's `IPAMBlock` objects.
    pub blocks: BTreeMap<String, IpamBlock>,
    /// Cilium's `CiliumNode` objects.
    pub cilium_nodes: BTreeMap<String, CiliumNode>,
    /// The Pods that hold addresses of their node's pod network.
    pub pods: BTreeMap<String, PodAddresses>,
}

/// `--ipam=auto`'s choice from what the cluster holds, and why, in words for one log line:
/// Calico's IPAM where it has given a node a block (Canal installs Calico's CRDs but leaves
/// IPAM to host-local, and holds none), Cilium's where a `CiliumNode` holds pod ranges, and
/// the Nodes' `spec.podCIDRs` otherwise. The pods' addresses are never guessed: they are a
/// choice.
pub fn detect(objects: &IpamObjects) -> (IpamSource, String) {
    let blocks = objects.affinities.values().filter(|a| a.confirmed).count();
    if blocks > 0 {
        return (
            IpamSource::Calico,
            format!("Calico's IPAM gave nodes {blocks} blocks (confirmed BlockAffinity objects)"),
        );
    }
    let cilium = objects
        .cilium_nodes
        .values()
        .filter(|n| !n.pod_cidrs.is_empty())
        .count();
    if cilium > 0 {
        return (
            IpamSource::Cilium,
            format!("{cilium} CiliumNode objects hold pod ranges"),
        );
    }
    (
        IpamSource::Node,
        "no confirmed BlockAffinity and no CiliumNode with pod ranges: the Nodes' spec.podCIDRs"
            .to_string(),
    )
}

/// Every node's pod ranges from `source`, and the problems found (`None` for
/// [`IpamSource::Node`], whose ranges the Nodes carry themselves). A node missing from the map
/// has no pod range.
pub fn pod_ranges(source: IpamSource, objects: &IpamObjects) -> Option<PodRanges> {
    let mut claims = Vec::new();
    match source {
        IpamSource::Node => return None,
        IpamSource::Calico => {
            for a in objects.affinities.values().filter(|a| a.confirmed) {
                claims.push(Claim::range(a.cidr, &a.node, "BlockAffinity"));
            }
            for block in objects.blocks.values() {
                for (node, address) in block.borrowed() {
                    claims.push(Claim::address(address, node, "IPAMBlock allocation"));
                }
            }
        }
        IpamSource::Cilium => {
            for n in objects.cilium_nodes.values() {
                for cidr in &n.pod_cidrs {
                    claims.push(Claim::range(*cidr, &n.node, "CiliumNode"));
                }
            }
        }
        IpamSource::Pods => {
            for pod in objects.pods.values() {
                for ip in &pod.ips {
                    claims.push(Claim::address(IpNet::from(*ip), &pod.node, "Pod"));
                }
            }
        }
    }
    let mut ranges = settle(claims);
    if source == IpamSource::Pods {
        for nets in ranges.by_node.values_mut() {
            *nets = IpNet::aggregate(nets);
        }
    }
    Some(ranges)
}

/// Each node whose agent is Kilo's kg, with a line saying so, when kg takes pod ranges from
/// `source` rather than the Nodes: Kilo's kg routes its peers' `spec.podCIDRs` whatever the cluster's IPAM,
/// so pod traffic between its location and the others is refused on its side. Kilo's agents
/// are the nodes that publish no lease-election marker, which kilotun's kg publishes when it
/// elects by lease (`--leader-election=lease`, as the manifests run it): a caller that does not
/// elect by lease cannot tell the agents apart, and should not ask.
pub fn kilo_agents_under(source: IpamSource, nodes: &[crate::Node]) -> Vec<(String, String)> {
    if source == IpamSource::Node {
        return Vec::new();
    }
    nodes
        .iter()
        .filter(|n| !n.lease_election)
        .map(|n| {
            let line = format!(
                "node {} (location {}) runs Kilo's kg, which routes the Nodes' spec.podCIDRs, not the {} pod ranges this kg routes: pod traffic between its location and the others is refused on its side until it runs kilotun (or its peers' kilo.squat.ai/allowed-location-ips name the pods' ranges)",
                n.name,
                n.location,
                source.as_str()
            );
            (n.name.clone(), line)
        })
        .collect()
}

/// Gives `node` its pod ranges from `by_node` (an IPAM source's; a node missing there has
/// none): the first as its pod CIDR, the rest beside it.
pub fn set_pod_ranges(node: &mut crate::Node, by_node: &BTreeMap<String, Vec<IpNet>>) {
    let own = by_node.get(&node.name).map_or(&[][..], Vec::as_slice);
    node.subnet = own.first().copied();
    node.extra_subnets = own.iter().skip(1).copied().collect();
}

/// Every node's pod ranges, and what was refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PodRanges {
    /// Each node's ranges, sorted.
    pub by_node: BTreeMap<String, Vec<IpNet>>,
    /// One line per refused claim, naming the range and the nodes.
    pub problems: Vec<String>,
}

/// A node's claim to a range.
#[derive(Debug, Clone)]
struct Claim<'a> {
    net: IpNet,
    node: &'a str,
    /// A single pod's address (a borrowed address, or a pod's own), not a block.
    single: bool,
    from: &'static str,
}

impl<'a> Claim<'a> {
    fn range(net: IpNet, node: &'a str, from: &'static str) -> Self {
        Self {
            net,
            node,
            single: false,
            from,
        }
    }

    fn address(net: IpNet, node: &'a str, from: &'static str) -> Self {
        Self {
            net,
            node,
            single: true,
            from,
        }
    }
}

/// The start of `net` as a number, with IPv4 before IPv6, for sorting.
fn start_of(net: &IpNet) -> (u8, u128) {
    match net.network() {
        IpAddr::V4(a) => (4, u128::from(u32::from(a))),
        IpAddr::V6(a) => (6, u128::from(a)),
    }
}

/// Sorts the claims so that a range comes before every range it contains, then keeps each
/// node's claims that no other node's contradicts: a range inside another node's range, or
/// the same range or address claimed twice, is refused for both nodes. A single address
/// inside another node's block is borrowed, and kept; a claim inside a range of its own node
/// that stays adds nothing, and goes.
fn settle(mut claims: Vec<Claim<'_>>) -> PodRanges {
    claims.sort_by(|a, b| {
        (start_of(&a.net), a.net.prefix_len(), a.node).cmp(&(
            start_of(&b.net),
            b.net.prefix_len(),
            b.node,
        ))
    });
    claims.dedup_by(|a, b| a.net == b.net && a.node == b.node);
    let mut refused = vec![false; claims.len()];
    // The same node's claims that contain each claim: it adds nothing if one of them stays.
    let mut covered_by: Vec<Vec<usize>> = vec![Vec::new(); claims.len()];
    let mut problems = Vec::new();
    // The claims that contain the current one, outermost first.
    let mut open: Vec<usize> = Vec::new();
    for i in 0..claims.len() {
        let c = &claims[i];
        while open
            .last()
            .is_some_and(|&o| !claims[o].net.contains(&c.net))
        {
            open.pop();
        }
        for &o in &open {
            let outer = &claims[o];
            let borrowed = c.single && !outer.single && outer.net != c.net;
            if outer.node == c.node {
                covered_by[i].push(o);
            } else if !borrowed {
                refused[o] = true;
                refused[i] = true;
                problems.push(format!(
                    "pod range {} of node {} ({}) and {} of node {} ({}) overlap; routing neither",
                    outer.net, outer.node, outer.from, c.net, c.node, c.from
                ));
            }
        }
        open.push(i);
    }
    let mut by_node: BTreeMap<String, Vec<IpNet>> = BTreeMap::new();
    for (i, c) in claims.iter().enumerate() {
        let redundant = covered_by[i].iter().any(|&o| !refused[o]);
        if !refused[i] && !redundant {
            by_node.entry(c.node.to_string()).or_default().push(c.net);
        }
    }
    PodRanges { by_node, problems }
}
