//! The routes and policy rules a node needs, as data, and a pure diff against what the
//! kernel has.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;

use crate::ip::host_net;
use crate::topology::{Member, Topology};

mod cover;
pub mod guard;
mod plan;

pub use guard::{GuardMatch, TunnelGuard, UNDERLAY_TABLE};

/// Kilo's policy-routing table.
pub const KILO_TABLE: u32 = 1107;
/// The kernel's main table.
pub const MAIN_TABLE: u32 = 254;

/// `--encapsulate`: when traffic inside a location is IP-in-IP encapsulated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encapsulate {
    /// Never.
    Never,
    /// Only to nodes outside the local private subnet.
    CrossSubnet,
    /// Always (Kilo's default).
    #[default]
    Always,
}

impl Encapsulate {
    /// Parses `never`, `crosssubnet` or `always`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "never" => Some(Self::Never),
            "crosssubnet" => Some(Self::CrossSubnet),
            "always" => Some(Self::Always),
            _ => None,
        }
    }
}

/// `--compatibility`: which tunnel carries traffic inside a location, which decides the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compatibility {
    /// Plain IPIP through `tunl0`: the gateway is the node's private IP.
    #[default]
    Ipip,
    /// flannel: the gateway is the pod CIDR's network address over `flannel.1`.
    Flannel,
    /// Cilium: the node's `cilium_host` IP, else its pod CIDR's network address.
    Cilium,
}

impl Compatibility {
    /// Kilo's `enc.Gw` for one node, for traffic to `dst`: Kilo's, except that an IPv6
    /// destination goes through an IPv6 address of the node where Kilo's is IPv4 (its second
    /// internal IP, its IPv6 pod CIDR). An IPv4 destination keeps an IPv6 internal IP as its
    /// gateway (`via inet6` works, and the internal IP is the address the user chose).
    fn gateway(self, member: &Member, dst: &IpNet) -> Option<IpAddr> {
        let family = |ip: &IpAddr| ip.is_ipv4() == dst.addr().is_ipv4();
        let pod_network = || {
            member
                .pod_cidrs()
                .map(|n| n.network())
                .find(family)
                .unwrap_or(member.pod_cidr.network())
        };
        match self {
            Self::Ipip => match member.private_ip.map(|n| n.addr()) {
                Some(internal) if internal.is_ipv4() && dst.addr().is_ipv6() => Some(
                    member
                        .second_private_ip
                        .map(|n| n.addr())
                        .filter(family)
                        .unwrap_or(internal),
                ),
                internal => internal,
            },
            Self::Flannel => Some(pod_network()),
            Self::Cilium => Some(
                member
                    .cni_compatibility_ip
                    .filter(family)
                    .unwrap_or_else(pod_network),
            ),
        }
    }
}

/// A route Kilo installs (protocol `static`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Route {
    /// Routing table.
    pub table: u32,
    /// Destination prefix (canonical).
    pub dst: IpNet,
    /// Gateway, if any.
    pub gateway: Option<IpAddr>,
    /// Output interface index.
    pub link: u32,
    /// Preferred source address.
    pub src: Option<IpAddr>,
    /// The `onlink` flag (set on every route with a gateway).
    pub onlink: bool,
}

/// A policy rule kg installs: one of Kilo's (`from`, `to`, `iif` and `lookup` only), or one of
/// the tunnel guard's (`guard` set; see [`guard`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rule {
    /// `from`.
    pub src: Option<IpNet>,
    /// `to`.
    pub dst: Option<IpNet>,
    /// `iif`.
    pub iif: Option<String>,
    /// `lookup` (0 for a guard rule that answers `unreachable`).
    pub table: u32,
    /// The tunnel guard's match on WireGuard's socket mark, with the rule's priority.
    pub guard: Option<GuardMatch>,
}

/// Interface indices the plan refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Links {
    /// The WireGuard (TUN) link.
    pub kilo: u32,
    /// The link holding the private IP (0 if none).
    pub private: u32,
    /// The encapsulation link (`tunl0`, `flannel.1`…; 0 if none).
    pub tunnel: u32,
    /// The kernel's `ip6tnl` link in `ipip6` mode, which carries IPv4 to gateways with IPv6
    /// addresses (routes `via inet6` through it); 0 if none.
    pub tunnel6: u32,
}

/// What decides the plan besides the topology.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteOptions {
    /// Name of the WireGuard link (for `iif` rules).
    pub kilo_name: String,
    /// Interface indices.
    pub links: Links,
    /// `--local`: manage routes inside the location.
    pub local: bool,
    /// `--encapsulate`.
    pub encapsulate: Encapsulate,
    /// `--compatibility`.
    pub compatibility: Compatibility,
    /// Addresses this node holds inside its pod CIDRs (the CNI bridge's), at most one per
    /// family: the preferred source of routes of the family the private IP lacks (IPv4 pods over an IPv6 internal IP), so the
    /// host's own traffic leaves with an address every peer allows and the replies route back.
    ///
    /// This is how a host whose underlay is IPv6 only (or whose internal IP is IPv6) talks to
    /// IPv4 pods. Its IPv6 internal IP cannot be the source of an IPv4 packet, and its IPv4
    /// underlay address, if any, is in no peer's allowed IPs, so WireGuard would drop the packet
    /// (or the reply would never find its way back). Its pod-CIDR address is in every peer's
    /// allowed IPs for this node's segment and is routed back to this node on every node, leader
    /// or not, so it is used. The Kilo WireGuard IP is not: only a leader has one, a non-leader
    /// sends through its leader over the underlay, and on a leader the kernel already picks it
    /// for a route onto the WireGuard link when there is no pod-CIDR address. A non-leader
    /// without an address in its pod CIDR (a CNI with no bridge address) has no IPv4 source any
    /// peer allows; its pods still reach the mesh.
    pub pod_sources: Vec<IpAddr>,
    /// The tunnel link carries IPv4 packets to gateways with IPv6 addresses too (kilotun's
    /// userspace IPIP device, in an outer IPv6 header); the kernel's `tunl0` does not.
    pub ipip_over_ipv6: bool,
}

/// Routes and rules, each de-duplicated and sorted.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RoutePlan {
    /// Routes.
    pub routes: BTreeSet<Route>,
    /// Rules.
    pub rules: BTreeSet<Rule>,
    /// Where the encapsulating device sends each destination routed onto it without a kernel
    /// gateway: an IPv4 destination behind a node's IPv6 internal IP (the kernel refuses a
    /// gateway of the other family on the tunnel, whose route to it is on another device).
    /// Only the userspace IPIP device reads it; the kernel never sees it.
    pub tunnel_gateways: BTreeMap<IpNet, IpAddr>,
    /// Destinations not routed because the node they go through has no address of their
    /// family (see [`NoGateway`]).
    pub no_gateway: BTreeSet<NoGateway>,
}

/// A destination a node would route through another node of its location (its leader, or the
/// member it belongs to) over the underlay, which that node has no address of the same family
/// for: an IPv6 pod CIDR or Peer behind a leader with an IPv4 internal IP only. The kernel
/// refuses an IPv6 route through an IPv4 gateway, so the route is left out; the node's
/// `kilotun.io/second-internal-ip` (written by its kg on a dual-stack host) is the fix.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NoGateway {
    /// The destination (canonical).
    pub dst: IpNet,
    /// The node it would go through.
    pub via: String,
}

impl std::fmt::Display for NoGateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let family = if self.dst.addr().is_ipv4() {
            "IPv4"
        } else {
            "IPv6"
        };
        write!(
            f,
            "not routing {} on this node: node {} has no {family} address to route it through (its kilotun.io/second-internal-ip is empty: its host has no {family} address, or its kg is not kilotun's; with --compatibility=flannel or cilium, it has no {family} pod CIDR)",
            self.dst, self.via
        )
    }
}

impl RoutePlan {
    /// Adds `route` unless a route to the same destination in the same table is planned already
    /// (the kernel holds one; the first planned wins, deterministically).
    fn insert_route(&mut self, route: Route) {
        let floor = Route {
            table: route.table,
            dst: route.dst,
            gateway: None,
            link: 0,
            src: None,
            onlink: false,
        };
        let taken = self
            .routes
            .range(floor..)
            .next()
            .is_some_and(|r| r.table == route.table && r.dst == route.dst);
        if !taken {
            self.routes.insert(route);
        }
    }
}

/// The annotation naming a node's allowed location IPs.
pub const FIELD_ALLOWED_LOCATION_IPS: &str = "kilo.squat.ai/allowed-location-ips";
/// The Node field holding its pod CIDR.
pub const FIELD_POD_CIDR: &str = "spec.podCIDR";
/// The annotation holding a node's internal (private) IP.
pub const FIELD_INTERNAL_IP: &str = "kilo.squat.ai/internal-ip";
/// The Peer field holding its allowed IPs.
pub const FIELD_PEER_ALLOWED_IPS: &str = "spec.allowedIPs";

/// A CIDR kg does not route on this node because it contains or equals one of the node's
/// directly connected networks: the route would replace (or cover) the kernel's own route to
/// that network and cut the node off its neighbours. A more specific CIDR inside a connected
/// network (a /32 behind another node, as Kilo's `allowed-location-ips` for one host) is
/// routed as usual.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Withheld {
    /// `node <name>`, `location <key>` or `peer <name>`.
    pub owner: String,
    /// The annotation or field the CIDR comes from (one of the `FIELD_*` constants).
    pub field: &'static str,
    /// The CIDR (canonical).
    pub cidr: IpNet,
    /// The connected network it contains or equals.
    pub connected: IpNet,
}

impl std::fmt::Display for Withheld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {} contains this node's connected network {}; not routing it into the mesh on this node",
            self.owner, self.field, self.cidr, self.connected
        )
    }
}

/// A WireGuard peer's endpoint that a route into the tunnel covers, and the host route that
/// keeps the tunnel's own packets to it on the underlay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bypass {
    /// The node or Peer reached at the endpoint.
    pub owner: String,
    /// The endpoint's address.
    pub endpoint: IpAddr,
    /// The tunnel route that covers it.
    pub covered_by: IpNet,
    /// The host route added: the endpoint through the underlay route the host has for it.
    pub route: Route,
    /// A standby tunnel's endpoint (see [`crate::standby`]): expected while a cut-off leader's
    /// location checks who can replace it, so nothing to warn about.
    pub standby: bool,
}

impl std::fmt::Display for Bypass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the WireGuard endpoint {} of {} is inside {}, which is routed into the tunnel; WireGuard's packets to it keep to the underlay through a host route",
            self.endpoint, self.owner, self.covered_by
        )
    }
}

impl Topology {
    /// The endpoints this node's WireGuard peers are reached at (the discovered one for a peer
    /// behind NAT), with who is there. Only a leader has peers.
    pub fn peer_endpoints(&self) -> Vec<(String, IpAddr)> {
        if !self.leader {
            return Vec::new();
        }
        let segments = self
            .segments
            .iter()
            .filter(|s| !self.in_local_location(s) && self.relay_for(s).is_none())
            .filter_map(|s| {
                let ip = self
                    .effective_endpoint(s.endpoint.as_ref(), &s.public_key, s.persistent_keepalive)?
                    .ip()?;
                Some((format!("node {}", s.leader_member().name), ip))
            });
        let peers = self.peers.iter().filter_map(|p| {
            let key = p.public_key.as_ref()?;
            let ip = self
                .effective_endpoint(p.endpoint.as_ref(), key, p.persistent_keepalive)?
                .ip()?;
            Some((format!("peer {}", p.name), ip))
        });
        segments.chain(peers).collect()
    }

    /// Keeps WireGuard's own packets out of the tunnel: for every peer endpoint that a route of
    /// `plan` on the WireGuard link `kilo` covers (allowed IPs that include another peer's
    /// endpoint), adds a host route to the endpoint through the best of `underlay`, the host's
    /// other main-table routes (longest prefix of the same family). The longest prefix wins
    /// over the tunnel route, only for that address, and nothing else of Kilo's routing changes.
    /// A standby tunnel's endpoint gets the same host route when any of kg's routes covers it.
    /// Returns what was added.
    pub fn bypass_endpoints(
        &self,
        plan: &mut RoutePlan,
        kilo: u32,
        underlay: &[Route],
    ) -> Vec<Bypass> {
        let mut added = Vec::new();
        // Most endpoints are under no tunnel route: the indexes answer that without scanning
        // every route for every endpoint (5,000 routes and 500 endpoints at 5,000 nodes). A
        // standby endpoint is checked against any main-table route, including the host routes
        // added here.
        let main = || plan.routes.iter().filter(|r| r.table == MAIN_TABLE);
        let in_tunnel = cover::Cover::of(main().filter(|r| r.link == kilo).map(|r| &r.dst));
        let mut in_main = cover::Cover::of(main().map(|r| &r.dst));
        let peers = self
            .peer_endpoints()
            .into_iter()
            .map(|(owner, ip)| (owner, ip, false));
        // A standby tunnel proves this node's own path: none of kg's routes may carry it, not
        // even one through the (possibly broken) leader.
        let standby_endpoints = self.standby.iter().filter_map(|p| {
            let ip = p.endpoint.as_ref()?.ip()?;
            Some((format!("node {} (standby)", p.name), ip, true))
        });
        for (owner, endpoint, standby) in peers.chain(standby_endpoints) {
            let host = host_net(endpoint);
            let index = if standby { &in_main } else { &in_tunnel };
            if !index.may_cover(endpoint) {
                continue;
            }
            let Some(tunnel) = plan
                .routes
                .iter()
                .filter(|r| r.table == MAIN_TABLE && (standby || r.link == kilo))
                .find(|r| r.dst.contains(&endpoint))
                .map(|r| r.dst)
            else {
                continue;
            };
            let Some(via) = underlay
                .iter()
                .filter(|r| r.link != kilo && r.dst.contains(&endpoint))
                .max_by_key(|r| r.dst.prefix_len())
            else {
                continue;
            };
            let route = Route {
                table: MAIN_TABLE,
                dst: host,
                gateway: via.gateway,
                link: via.link,
                src: None,
                onlink: via.gateway.is_some(),
            };
            // A tunnel route to exactly the endpoint gives way to it.
            plan.routes.retain(|r| {
                !(r.table == MAIN_TABLE && r.dst == host && (standby || r.link == kilo))
            });
            in_main.insert(route.dst);
            plan.insert_route(route.clone());
            added.push(Bypass {
                owner,
                endpoint,
                covered_by: tunnel,
                route,
                standby,
            });
        }
        added
    }
}

impl Topology {
    /// The routes a Peer running `kgctl connect` needs on its WireGuard link `link`:
    /// each segment's pod CIDRs, private IPs and allowed location IPs via its WireGuard IP (with
    /// no gateway where the WireGuard IP is of the other family), the
    /// WireGuard IPs themselves, the other Peers' allowed IPs, and `extra` CIDRs via the first
    /// segment. Unlike Kilo, a private IP that is also the segment's endpoint is not routed into
    /// the tunnel, which would swallow the tunnel's own packets.
    pub fn peer_routes(&self, peer: &str, link: u32, extra: &[IpNet]) -> RoutePlan {
        let mut plan = RoutePlan::default();
        let mut route = |dst: IpNet, gateway: Option<IpAddr>| {
            // The WireGuard link needs no gateway; one of the other family (IPv6 pods through
            // an IPv4 WireGuard IP) the kernel refuses.
            let gateway = gateway.filter(|g| g.is_ipv4() == dst.addr().is_ipv4());
            plan.insert_route(Route {
                table: MAIN_TABLE,
                dst: dst.trunc(),
                gateway,
                link,
                src: None,
                onlink: gateway.is_some(),
            });
        };
        for s in &self.segments {
            let via = Some(s.wireguard_ip);
            let endpoint_ip = self
                .effective_endpoint(s.endpoint.as_ref(), &s.public_key, s.persistent_keepalive)
                .and_then(|e| e.ip());
            for pods in s.members.iter().flat_map(Member::pod_cidrs) {
                route(pods, via);
            }
            for ip in s.private_ips().filter(|ip| Some(*ip) != endpoint_ip) {
                route(host_net(ip), via);
            }
            for net in &s.allowed_location_ips {
                route(*net, via);
            }
            route(host_net(s.wireguard_ip), None);
        }
        for p in self.peers.iter().filter(|p| p.name != peer) {
            for net in &p.allowed_ips {
                route(*net, None);
            }
        }
        if let Some(first) = self.segments.first() {
            for net in extra {
                route(*net, Some(first.wireguard_ip));
            }
        }
        plan
    }
}

/// One change to the kernel's routing state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouteOp {
    /// Add or replace a route.
    ReplaceRoute(Route),
    /// Delete a route.
    DeleteRoute(Route),
    /// Add a rule.
    AddRule(Rule),
    /// Delete a rule.
    DeleteRule(Rule),
}

/// The changes that take the kernel from `observed` to `desired`.
///
/// `observed` holds the kernel's protocol-static routes in the main, Kilo and underlay tables,
/// its Kilo-table rules and the tunnel guard's; `owned` is what was applied before. A route or
/// rule is removed when it is not desired and is ours: in `owned` (applied before, by this run
/// or, as kg saved it, the last), in the Kilo or underlay table, on the WireGuard link, or a
/// guard rule.
/// A route whose destination is still desired is replaced, never deleted first, so traffic is not
/// interrupted. Applying the result and diffing again yields nothing.
pub fn diff(
    desired: &RoutePlan,
    observed: &RoutePlan,
    owned: &RoutePlan,
    kilo_link: u32,
) -> Vec<RouteOp> {
    let mut ops = Vec::new();
    let desired_dsts: BTreeSet<(u32, IpNet)> =
        desired.routes.iter().map(|r| (r.table, r.dst)).collect();
    for r in observed.routes.difference(&desired.routes) {
        let ours = owned.routes.contains(r)
            || r.table == KILO_TABLE
            || r.table == UNDERLAY_TABLE
            || r.link == kilo_link;
        if ours && !desired_dsts.contains(&(r.table, r.dst)) {
            ops.push(RouteOp::DeleteRoute(r.clone()));
        }
    }
    for r in observed.rules.difference(&desired.rules) {
        if owned.rules.contains(r) || r.table == KILO_TABLE || r.guard.is_some() {
            ops.push(RouteOp::DeleteRule(r.clone()));
        }
    }
    for r in desired.routes.difference(&observed.routes) {
        ops.push(RouteOp::ReplaceRoute(r.clone()));
    }
    for r in desired.rules.difference(&observed.rules) {
        ops.push(RouteOp::AddRule(r.clone()));
    }
    ops
}

/// `observed` after `ops` were applied, as the kernel would hold it: what [`diff`] converges to.
pub fn apply_ops(observed: &RoutePlan, ops: &[RouteOp]) -> RoutePlan {
    let mut out = observed.clone();
    for op in ops {
        match op {
            RouteOp::ReplaceRoute(r) => {
                out.routes.retain(|o| (o.table, o.dst) != (r.table, r.dst));
                out.routes.insert(r.clone());
            }
            RouteOp::DeleteRoute(r) => {
                out.routes.remove(r);
            }
            RouteOp::AddRule(r) => {
                out.rules.insert(r.clone());
            }
            RouteOp::DeleteRule(r) => {
                out.rules.remove(r);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
