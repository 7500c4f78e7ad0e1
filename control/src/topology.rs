//! Kilo's topology: nodes grouped into segments, a leader per segment, WireGuard IPs
//! allocated in segment order, and the allowed IPs each segment and Peer is reached by.
//!
//! Everything here is a pure function of its inputs, so every node computes the same answer
//! without coordination.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use crate::ip::{host_net, is_public, Allocator, Endpoint};
use crate::key::Key;
use crate::node::{Granularity, Node};
use crate::peer::Peer;

/// One node's place in its segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Node name.
    pub name: String,
    /// Its pod CIDR (`spec.podCIDR`).
    pub pod_cidr: IpNet,
    /// Its pod CIDR of the other family, in a dual-stack cluster (from `spec.podCIDRs`).
    pub extra_pod_cidrs: Vec<IpNet>,
    /// Its private IP with mask, if it has one.
    pub private_ip: Option<IpNet>,
    /// Its private IP of the other family, on a dual-stack host.
    pub second_private_ip: Option<IpNet>,
    /// Its CNI compatibility IP (Cilium), if published.
    pub cni_compatibility_ip: Option<IpAddr>,
    /// Its own `allowed-location-ips` (before the segment's filtering), to name it as their
    /// owner.
    pub allowed_location_ips: Vec<IpNet>,
}

/// A group of nodes reached through one WireGuard peer: its leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// `location:<name>`, `location:<name>#share:<n>` or `location:<name>#<leader>` (a share,
    /// see [`shares`]) or `node:<name>`.
    pub key: String,
    /// Members sorted by name.
    pub members: Vec<Member>,
    /// Index of the leader in `members`.
    pub leader: usize,
    /// The leader's public key.
    pub public_key: Key,
    /// The leader's endpoint.
    pub endpoint: Option<Endpoint>,
    /// Every address the leader says it can be reached at (`kilotun.io/endpoints`), in its
    /// order; empty for Kilo's agent.
    pub endpoint_candidates: Vec<SocketAddr>,
    /// The leader's persistent keepalive (non-zero marks it as NATed).
    pub persistent_keepalive: u16,
    /// The leader's WireGuard IP.
    pub wireguard_ip: IpAddr,
    /// Pod CIDRs and private /32s of every member, then the WireGuard IP /32.
    pub allowed_ips: Vec<IpNet>,
    /// allowed-location-ips of every member, de-duplicated, sorted, filtered.
    pub allowed_location_ips: Vec<IpNet>,
    /// The location of its leader (of its only node, in full and cross granularity).
    pub location: String,
    /// A member is annotated `kilotun.io/relay`.
    pub relay: bool,
    /// One of the shares of a location that has several leaders ([`shares`]): the location's
    /// other shares are reached without WireGuard.
    pub shared: bool,
}

impl Segment {
    /// True when its leader is behind NAT: it keeps its tunnels alive (Kilo's mark of a NATed
    /// node), so nothing can reach it before it has sent first.
    pub fn behind_nat(&self) -> bool {
        self.persistent_keepalive > 0
    }
}

impl Member {
    /// Its pod CIDRs: `spec.podCIDR` first, then the other family's.
    pub fn pod_cidrs(&self) -> impl Iterator<Item = IpNet> + '_ {
        std::iter::once(self.pod_cidr).chain(self.extra_pod_cidrs.iter().copied())
    }
}

impl Segment {
    /// The leader member.
    pub fn leader_member(&self) -> &Member {
        &self.members[self.leader]
    }

    /// Private IPs of the members that have one, in member order.
    pub fn private_ips(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.members
            .iter()
            .filter_map(|m| m.private_ip.map(|n| n.addr()))
    }
}

/// What the topology is computed from, besides the nodes and peers.
#[derive(Debug, Clone)]
pub struct TopologyParams {
    /// `--mesh-granularity`.
    pub granularity: Granularity,
    /// The local node's name.
    pub hostname: String,
    /// The local WireGuard listen port (the local endpoint's port).
    pub port: u16,
    /// `--subnet`: where leaders' WireGuard IPs come from.
    pub subnet: IpNet,
    /// The local node's persistent keepalive, applied to all its peers.
    pub persistent_keepalive: u16,
    /// Leaders per location in location granularity (`--leaders-per-location`, as every node
    /// runs it): 1 is Kilo's single leader; more split each location into shares
    /// ([`shares`]).
    pub leaders_per_location: usize,
    /// Nodes that may lead no share: the ones the leases keep out
    /// ([`crate::leader::Election::kept_out`]).
    pub kept_out: BTreeSet<String>,
}

/// A leader chosen by lease: which share of its location it leads (0 with one leader per
/// location), and its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareLeader {
    /// The share, as numbered by its lease ([`crate::leader::shares::share_lease_name`]).
    pub share: usize,
    /// The leader's node name.
    pub name: String,
    /// Earlier holders of the share's lease that lead nothing now (see
    /// [`crate::leader::Election::predecessors`]): they stay in the share and count for its
    /// load, so that a leader's loss moves no other node.
    pub predecessors: Vec<String>,
}

impl ShareLeader {
    /// The first share's leader `name`, as one leader per location has it.
    pub fn only(name: impl Into<String>) -> Vec<Self> {
        vec![ShareLeader {
            share: 0,
            name: name.into(),
            predecessors: Vec::new(),
        }]
    }
}

/// Why a topology could not be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    /// The local node is not among the ready nodes.
    #[error("the local node {0:?} is not among the ready nodes")]
    NoLocalNode(String),
    /// More segments than addresses in `--subnet`.
    #[error("--subnet {subnet} has no address left for segment {segment:?}")]
    SubnetExhausted {
        /// The Kilo subnet.
        subnet: IpNet,
        /// The first segment left without an address.
        segment: String,
    },
}

/// A dropped allowed IP and why: kept as data so the caller logs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// The segment or Peer that lost it.
    pub owner: String,
    /// The CIDR.
    pub cidr: IpNet,
    /// Why.
    pub reason: String,
}

/// The mesh as seen from one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Segments sorted by key.
    pub segments: Vec<Segment>,
    /// Ready Peers sorted by name, allowed IPs de-duplicated across peers.
    pub peers: Vec<Peer>,
    /// The local node's name.
    pub hostname: String,
    /// The local segment's key.
    pub location: String,
    /// True when the local node leads its segment.
    pub leader: bool,
    /// The local listen port.
    pub port: u16,
    /// The local keepalive, used for every peer.
    pub persistent_keepalive: u16,
    /// The local private IP.
    pub private_ip: Option<IpNet>,
    /// The local pod CIDR.
    pub subnet: IpNet,
    /// The local pod CIDR of the other family, in a dual-stack cluster.
    pub extra_subnets: Vec<IpNet>,
    /// The Kilo subnet.
    pub kilo_subnet: IpNet,
    /// Leaders: their WireGuard IP with the Kilo mask; others: the Kilo subnet.
    pub wireguard_cidr: IpNet,
    /// NAT endpoints known: the local node's, then other nodes' in segment order.
    pub discovered_endpoints: BTreeMap<Key, SocketAddr>,
    /// The candidate in use per leader that publishes several (see [`crate::endpoints`]):
    /// empty as computed, set by the agent's probing.
    pub chosen_endpoints: BTreeMap<Key, SocketAddr>,
    /// Allowed IPs dropped while building (conflicts), for logging.
    pub dropped: Vec<Dropped>,
    /// The granularity the topology was built with.
    pub granularity: Granularity,
    /// The local node's location.
    pub local_location: String,
    /// Peers for handshakes only, while a cut-off leader's location checks who can replace it
    /// (see the `standby` module).
    pub standby: Vec<StandbyPeer>,
    /// The next key of every node rotating its key, by its current key (see
    /// [`crate::rotation`]).
    pub successors: BTreeMap<Key, Key>,
}

/// The segment key of `node`.
pub fn segment_key(node: &Node, granularity: Granularity) -> String {
    match granularity {
        Granularity::Location if node.internal_ip.is_some() => {
            format!("location:{}", node.location)
        }
        _ => format!("node:{}", node.name),
    }
}

/// Kilo's leader rule over nodes in the given order: the first annotated node with a
/// public endpoint, else the first annotated node, else the first public one, else index 0.
pub fn find_leader(nodes: &[&Node]) -> usize {
    let public = |n: &Node| {
        n.endpoint
            .as_ref()
            .and_then(Endpoint::ip)
            .is_some_and(is_public)
    };
    if let Some(i) = nodes.iter().position(|n| n.leader && public(n)) {
        return i;
    }
    if let Some(i) = nodes.iter().position(|n| n.leader) {
        return i;
    }
    nodes.iter().position(|n| public(n)).unwrap_or(0)
}

/// Kilo's `deduplicatePeerIPs`: in the given order, a CIDR (compared as written) already
/// claimed by an earlier peer, or earlier in the same peer, is dropped.
pub fn deduplicate_peer_ips(peers: &[Peer]) -> (Vec<Peer>, Vec<Dropped>) {
    let mut seen = BTreeSet::new();
    let mut dropped = Vec::new();
    let out = peers
        .iter()
        .map(|p| {
            let mut q = p.clone();
            q.allowed_ips.clear();
            for ip in &p.allowed_ips {
                if seen.insert(ip.to_string()) {
                    q.allowed_ips.push(*ip);
                } else {
                    dropped.push(Dropped {
                        owner: format!("peer {}", p.name),
                        cidr: *ip,
                        reason: "claimed by an earlier peer".into(),
                    });
                }
            }
            q
        })
        .collect();
    (out, dropped)
}

/// True when either network contains the other's address (Go's "intersect").
fn intersect(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.addr()) || b.contains(&a.addr())
}

impl Topology {
    /// Computes the topology from the ready `nodes` and `peers`. Nodes' DNS endpoints should
    /// already carry their resolution.
    pub fn new(
        nodes: &[Node],
        peers: &[Peer],
        params: &TopologyParams,
    ) -> Result<Self, TopologyError> {
        Self::with_leaders(nodes, peers, params, &BTreeMap::new())
    }

    /// [`Topology::new`], with the leaders of some locations already chosen (by lease, see
    /// [`crate::leader`]): `leaders` maps a location's name to its shares' leaders, the first
    /// share's first. Applies in location granularity; a named leader that is not a ready
    /// member is ignored.
    pub fn with_leaders(
        nodes: &[Node],
        peers: &[Peer],
        params: &TopologyParams,
        leaders: &BTreeMap<String, Vec<ShareLeader>>,
    ) -> Result<Self, TopologyError> {
        let local = nodes
            .iter()
            .find(|n| n.name == params.hostname)
            .ok_or_else(|| TopologyError::NoLocalNode(params.hostname.clone()))?;

        let mut groups: BTreeMap<String, Vec<&Node>> = BTreeMap::new();
        for node in nodes.iter().filter(|n| n.subnet.is_some()) {
            groups
                .entry(segment_key(node, params.granularity))
                .or_default()
                .push(node);
        }
        let mut plans = shares::plan_segments(groups, params, leaders);
        plans.sort_by(|a, b| a.key.cmp(&b.key));
        let location = plans
            .iter()
            .find(|p| p.group.iter().any(|n| n.name == params.hostname))
            .map_or_else(|| segment_key(local, params.granularity), |p| p.key.clone());

        let mut t = Topology {
            segments: Vec::with_capacity(plans.len()),
            peers: Vec::new(),
            hostname: params.hostname.clone(),
            location: location.clone(),
            leader: false,
            port: params.port,
            persistent_keepalive: params.persistent_keepalive,
            private_ip: local.internal_ip,
            subnet: local.subnet.unwrap_or(params.subnet),
            extra_subnets: local.extra_subnets.clone(),
            kilo_subnet: params.subnet,
            wireguard_cidr: params.subnet,
            discovered_endpoints: local.discovered_endpoints.clone(),
            chosen_endpoints: BTreeMap::new(),
            dropped: Vec::new(),
            granularity: params.granularity,
            local_location: local.location.clone(),
            standby: Vec::new(),
            successors: crate::rotation::successors(nodes),
        };

        let mut allocator = Allocator::new(params.subnet);
        for shares::SegmentPlan {
            key,
            group,
            leader,
            shared,
        } in plans
        {
            let wireguard_ip = allocator
                .next_ip()
                .ok_or_else(|| TopologyError::SubnetExhausted {
                    subnet: params.subnet,
                    segment: key.clone(),
                })?
                .addr();
            let mut allowed_ips = Vec::with_capacity(group.len() * 2 + 1);
            let mut location_ips = BTreeSet::new();
            let mut members = Vec::with_capacity(group.len());
            for node in &group {
                let pod_cidr = node.subnet.expect("filtered above");
                allowed_ips.push(pod_cidr);
                allowed_ips.extend(node.extra_subnets.iter().copied());
                if let Some(ip) = node.internal_ip {
                    allowed_ips.push(host_net(ip.addr()));
                }
                location_ips.extend(node.allowed_location_ips.iter().copied());
                members.push(Member {
                    name: node.name.clone(),
                    pod_cidr,
                    extra_pod_cidrs: node.extra_subnets.clone(),
                    private_ip: node.internal_ip,
                    second_private_ip: node.second_internal_ip,
                    cni_compatibility_ip: node.cni_compatibility_ip.map(|n| n.addr()),
                    allowed_location_ips: node.allowed_location_ips.clone(),
                });
                for (k, addr) in &node.discovered_endpoints {
                    t.discovered_endpoints.entry(*k).or_insert(*addr);
                }
            }
            let mut allowed_location_ips: Vec<IpNet> = location_ips.into_iter().collect();
            allowed_location_ips.sort_by_key(|n| n.to_string());
            let head = group[leader];
            if key == location && head.name == params.hostname {
                t.leader = true;
                t.wireguard_cidr = IpNet::new(wireguard_ip, params.subnet.prefix_len())
                    .expect("same family as the subnet");
            }
            t.segments.push(Segment {
                key,
                members,
                leader,
                public_key: head.key.unwrap_or(Key([0; 32])),
                endpoint: head.endpoint.clone(),
                endpoint_candidates: head.endpoint_candidates.clone(),
                persistent_keepalive: head.persistent_keepalive,
                wireguard_ip,
                allowed_ips,
                allowed_location_ips,
                location: head.location.clone(),
                relay: group.iter().any(|n| n.relay),
                shared,
            });
        }

        let mut sorted_peers: Vec<Peer> = peers.to_vec();
        sorted_peers.sort_by(|a, b| a.name.cmp(&b.name));
        let (deduped, dropped) = deduplicate_peer_ips(&sorted_peers);
        t.peers = deduped;
        t.dropped.extend(dropped);

        // Allowed IPs get each segment's WireGuard IP as the segments are walked, and the
        // allowed-location-ips are filtered in that same walk (so later segments are checked
        // without their WireGuard IP, as in Kilo).
        for i in 0..t.segments.len() {
            let wg_ip = host_net(t.segments[i].wireguard_ip);
            t.segments[i].allowed_ips.push(wg_ip);
            let candidates = std::mem::take(&mut t.segments[i].allowed_location_ips);
            let kept = t.filter_allowed_location_ips(&candidates, i);
            t.segments[i].allowed_location_ips = kept;
        }
        Ok(t)
    }

    /// Kilo's `filterAllowedLocationIPs` for segment `index`.
    fn filter_allowed_location_ips(&mut self, candidates: &[IpNet], index: usize) -> Vec<IpNet> {
        let mut kept = Vec::with_capacity(candidates.len());
        let owner = self.segments[index].key.clone();
        'candidates: for ip in candidates {
            for (j, s) in self.segments.iter().enumerate() {
                if j != index {
                    if let Some(other) = s.allowed_location_ips.iter().find(|o| intersect(ip, o)) {
                        let reason = format!("overlaps allowed-location-ip {other} of {}", s.key);
                        self.dropped.push(Dropped {
                            owner: owner.clone(),
                            cidr: *ip,
                            reason,
                        });
                        continue 'candidates;
                    }
                }
                if let Some(a) = s.allowed_ips.iter().find(|a| a.contains(&ip.addr())) {
                    let reason = format!("overlaps allowed IP {a} of {}", s.key);
                    self.dropped.push(Dropped {
                        owner: owner.clone(),
                        cidr: *ip,
                        reason,
                    });
                    continue 'candidates;
                }
            }
            for p in &self.peers {
                if let Some(a) = p.allowed_ips.iter().find(|a| intersect(ip, a)) {
                    let reason = format!("overlaps allowed IP {a} of peer {}", p.name);
                    self.dropped.push(Dropped {
                        owner: owner.clone(),
                        cidr: *ip,
                        reason,
                    });
                    continue 'candidates;
                }
            }
            kept.push(*ip);
        }
        kept
    }

    /// True when `s` is reached without WireGuard: the local segment, in `cross` granularity
    /// every node of the local node's location, and the other shares of a location that has
    /// several leaders.
    pub fn in_local_location(&self, s: &Segment) -> bool {
        s.key == self.location
            || (s.location == self.local_location
                && (self.granularity == Granularity::Cross
                    || (s.shared && self.local_segment().is_some_and(|l| l.shared))))
    }

    /// The segment that carries traffic between segments `a` and `b` when both are behind NAT
    /// (neither can reach the other first): the first by key that is not behind NAT and has an
    /// endpoint, among those annotated `kilotun.io/relay` when any is. `None` when they can
    /// talk directly (or are shares of one location), or when no segment can relay (they are
    /// then peered directly, as Kilo does).
    pub fn relay_between(&self, a: &Segment, b: &Segment) -> Option<&Segment> {
        // Shares of one location have no tunnel between them (they reach each other inside
        // the location), and none relays for a sibling.
        let sibling = |r: &Segment, s: &Segment| r.shared && s.shared && r.location == s.location;
        if a.key == b.key || !a.behind_nat() || !b.behind_nat() || sibling(a, b) {
            return None;
        }
        let pinned = self.segments.iter().any(|s| s.relay);
        self.segments.iter().find(|r| {
            r.key != a.key
                && r.key != b.key
                && !sibling(r, a)
                && !sibling(r, b)
                && !r.behind_nat()
                && r.endpoint.is_some()
                && (r.relay || !pinned)
        })
    }

    /// The segment this leader reaches `s` through, when it must be relayed.
    pub fn relay_for(&self, s: &Segment) -> Option<&Segment> {
        if !self.leader {
            return None;
        }
        self.relay_between(self.local_segment()?, s)
    }

    /// The local node's pod CIDRs: `spec.podCIDR` first, then the other family's.
    pub fn local_pod_cidrs(&self) -> impl Iterator<Item = IpNet> + '_ {
        std::iter::once(self.subnet).chain(self.extra_subnets.iter().copied())
    }

    /// The private IPs of the nodes reached without WireGuard (see
    /// [`Topology::in_local_location`]): the local segment's members, the location's other
    /// shares' and, in `cross` granularity, every node of the location; in segment order.
    pub fn local_location_private_ips(&self) -> Vec<IpAddr> {
        let mut ips: Vec<IpAddr> = Vec::new();
        for s in self.segments.iter().filter(|s| self.in_local_location(s)) {
            for ip in s.private_ips() {
                if !ips.contains(&ip) {
                    ips.push(ip);
                }
            }
        }
        ips
    }

    /// The local segment.
    pub fn local_segment(&self) -> Option<&Segment> {
        self.segments.iter().find(|s| s.key == self.location)
    }
}

/// A WireGuard peer with no allowed IPs, kept for its handshakes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StandbyPeer {
    /// The node at the other end.
    pub name: String,
    /// Its public key.
    pub public_key: Key,
    /// Where to send the handshake (its discovered endpoint when it is behind NAT).
    pub endpoint: Option<Endpoint>,
    /// Keepalive seconds: the standby module's `STANDBY_KEEPALIVE_S` on the verifier's side,
    /// 0 on the leader's.
    pub persistent_keepalive: u16,
}

mod endpoint;
pub mod shares;
#[cfg(test)]
mod tests;
