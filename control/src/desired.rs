//! The host state a node's agent wants, as one value: the WireGuard link's MTU, address and
//! state, the CNI configuration's ranges, the encapsulation tunnel, the routes and rules, the
//! WireGuard device's configuration and the firewall's rules.
//!
//! [`plan`] computes it from the topology, the host as listed ([`HostNet`]) and the agent's
//! settings, before any shell runs; the agent then compares each part with what it last applied
//! and converges only the parts that differ. Links are named by role ([`ResolvedLinks`]): the
//! WireGuard link's index is known from the start, but the tunnel's exists only once the
//! netlink shell has created it. The agent plans with the resolution it last had, converges the
//! links, and plans again (a pure call) when the shell resolved them differently, so the routes
//! always name the links that exist.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::host::{HostNet, Mtu};
use crate::iptables::{IptablesOptions, RuleSet};
use crate::routes::{
    Bypass, Compatibility, Encapsulate, Links, Route, RouteOptions, RoutePlan, TunnelGuard,
    Withheld, MAIN_TABLE,
};
use crate::wgconf::Conf;
use crate::{Key, Topology};

/// The encapsulation link kg uses inside a location, as chosen at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelKind {
    /// The link's name (`tunl0`, kilotun's userspace IPIP device, `flannel.1`, ...).
    pub name: String,
    /// It is an IPIP link (the firewall then admits protocol 4 from the location only).
    pub ipip: bool,
    /// It carries IPv4 to gateways with IPv6 addresses (kilotun's userspace IPIP device).
    pub ipv6_outer: bool,
}

/// What decides the host state besides the topology and the host: kg's flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSettings {
    /// The WireGuard link's name (`--interface`).
    pub interface: String,
    /// `--mtu`.
    pub mtu: Mtu,
    /// `--cni`: kg manages the CNI (Kilo's rules for the pods; the configuration where
    /// `cni_conflist` says so).
    pub cni: bool,
    /// kg keeps the CNI configuration's pod ranges and MTU (`--cni`, and the pods' ranges are
    /// the Nodes' own: a CNI with its own IPAM keeps its configuration).
    pub cni_conflist: bool,
    /// `--local`: kg routes inside the location.
    pub local: bool,
    /// `--encapsulate`.
    pub encapsulate: Encapsulate,
    /// `--compatibility`.
    pub compatibility: Compatibility,
    /// `--iptables-forward-rules`.
    pub forward_rules: bool,
    /// `--service-cidr`s.
    pub service_cidrs: Vec<IpNet>,
    /// The encapsulation link, if kg uses one.
    pub tunnel: Option<TunnelKind>,
    /// `--tunnel-guard`: how WireGuard's packets are kept out of the tunnel.
    pub tunnel_guard: TunnelGuard,
}

/// The links the plan names by role, as the netlink shell resolved them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ResolvedLinks {
    /// The WireGuard link.
    pub kilo: u32,
    /// The encapsulation link, once it exists.
    pub tunnel: Option<u32>,
    /// The kernel's IPv6-outer link beside it, when one is needed and exists.
    pub tunnel6: Option<u32>,
}

/// The WireGuard link's wanted state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkState {
    /// Its MTU.
    pub mtu: u32,
    /// Its address: the Kilo subnet's address on a leader, none on a follower.
    pub address: Option<IpNet>,
    /// Up on a leader, down on a follower.
    pub up: bool,
}

/// The CNI configuration's wanted IPAM ranges and MTU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniState {
    /// The node's pod CIDRs.
    pub pod_cidrs: Vec<IpNet>,
    /// The WireGuard link's MTU.
    pub mtu: u32,
}

/// What the encapsulation tunnel is prepared for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TunnelSpec {
    /// The IPv4 pod CIDR the tunnel's address comes from (IPIP carries IPv4 only).
    pub ipv4_pods: IpNet,
    /// The link holding the private IP (0 if none).
    pub private_link: u32,
    /// That link's MTU, when known.
    pub private_mtu: Option<u32>,
    /// The private IP is IPv6 (a larger outer header).
    pub private_ipv6: bool,
    /// A node of the location has an IPv6 internal IP: IPv4 to it goes in IPv6 (the kernel's
    /// IPv6-outer link is needed).
    pub ipv6_members: bool,
}

/// The whole host state kg wants, computed before any shell runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredHost {
    /// The WireGuard link.
    pub link: LinkState,
    /// The CNI configuration (`None` without `--cni`).
    pub cni: Option<CniState>,
    /// The tunnel (`None` when kg uses none).
    pub tunnel: Option<TunnelSpec>,
    /// How traffic inside the location is encapsulated: `--encapsulate`, or never while the
    /// tunnel's link does not exist.
    pub encapsulate: Encapsulate,
    /// The routes and rules, endpoint bypasses among them.
    pub routes: RoutePlan,
    /// The CIDRs not routed because they cover a connected network.
    pub withheld: Vec<Withheld>,
    /// The host routes that keep peers' endpoints out of the tunnel.
    pub bypasses: Vec<Bypass>,
    /// The WireGuard device: the leader's configuration, or a follower's standby one.
    pub device: Conf,
    /// The firewall's rules.
    pub firewall: RuleSet,
}

impl DesiredHost {
    /// True when kg uses a tunnel whose link does not exist (yet).
    pub fn tunnel_missing(&self, links: &ResolvedLinks) -> bool {
        self.tunnel.is_some() && links.tunnel.is_none()
    }
}

/// The host's own routes among the main table's `main_routes`: those kg did not install
/// (`owned`, matched by table, destination and link).
pub fn host_routes<'a>(
    main_routes: &'a [Route],
    owned: &RoutePlan,
) -> impl Iterator<Item = &'a Route> {
    let kgs: std::collections::BTreeSet<(u32, IpNet, u32)> = owned
        .routes
        .iter()
        .map(|o| (o.table, o.dst, o.link))
        .collect();
    main_routes
        .iter()
        .filter(move |r| !kgs.contains(&(r.table, r.dst, r.link)))
}

/// The host state that brings `host` to `t`, for the node whose public key is `public`, with
/// the links resolved as `links` and `owned` the routes kg installed last (the host's own
/// routes are the rest, which endpoint bypasses go through).
pub fn plan(
    t: &Topology,
    host: &HostNet,
    links: &ResolvedLinks,
    owned: &RoutePlan,
    public: &Key,
    s: &HostSettings,
) -> DesiredHost {
    let mtu = host.mtu(s.mtu);
    let link = LinkState {
        mtu,
        address: t.leader.then_some(t.wireguard_cidr),
        up: t.leader,
    };
    let pod_cidrs: Vec<IpNet> = t.local_pod_cidrs().collect();
    let cni = (s.cni && s.cni_conflist).then(|| CniState {
        pod_cidrs: pod_cidrs.clone(),
        mtu,
    });
    let tunnel = s.tunnel.as_ref().map(|_| tunnel_spec(t, host));
    let encapsulate = match (&s.tunnel, links.tunnel) {
        (Some(_), Some(_)) => s.encapsulate,
        _ => Encapsulate::Never,
    };
    let tunnel_index = links.tunnel.filter(|_| s.tunnel.is_some());
    let tunnel6 = links.tunnel6.filter(|_| tunnel_index.is_some());
    // An address the host holds in each of its own pod CIDRs (the CNI bridge's, or the
    // tunnel's).
    let pod_sources: Vec<IpAddr> = pod_cidrs
        .iter()
        .filter_map(|pods| host.address_in(*pods, links.kilo))
        .collect();
    let options = RouteOptions {
        kilo_name: s.interface.clone(),
        links: Links {
            kilo: links.kilo,
            private: host.private_link(t.private_ip),
            tunnel: tunnel_index.unwrap_or(0),
            tunnel6: tunnel6.unwrap_or(0),
        },
        local: s.local,
        encapsulate,
        compatibility: s.compatibility,
        pod_sources,
        ipip_over_ipv6: tunnel_index.is_some() && s.tunnel.as_ref().is_some_and(|k| k.ipv6_outer),
    };
    let own: Vec<u32> = [Some(links.kilo), tunnel_index, tunnel6]
        .into_iter()
        .flatten()
        .collect();
    let (mut routes, withheld) = t.guarded_route_plan(&options, &host.connected_networks(&own));
    let underlay: Vec<Route> = host_routes(&host.main_routes, owned)
        .filter(|r| !own.contains(&r.link))
        .cloned()
        .collect();
    let bypasses = match s.tunnel_guard {
        TunnelGuard::Mark(mark) => {
            routes.guard_socket(mark, &underlay);
            Vec::new()
        }
        TunnelGuard::Routes => t.bypass_endpoints(&mut routes, links.kilo, &underlay),
    };
    let device = if t.leader {
        t.conf(Some(public))
    } else {
        t.standby_conf(Some(public))
    };
    let firewall = t.iptables_rules(&IptablesOptions {
        cni: s.cni,
        forward_rules: s.forward_rules,
        service_cidrs: s.service_cidrs.clone(),
        ipip: s.tunnel.as_ref().is_some_and(|k| k.ipip)
            && s.local
            && encapsulate != Encapsulate::Never,
    });
    DesiredHost {
        link,
        cni,
        tunnel,
        encapsulate,
        routes,
        withheld,
        bypasses,
        device,
        firewall,
    }
}

/// At most this many peers new or moved at once for the engine to go before the routes: each
/// one's carrying routes are compared, and a change this large is a topology's first
/// configuration or a re-election, where the routes go first anyway.
const ENGINE_FIRST_MAX_MOVED: usize = 32;

/// True when the engine may take `next` before the routes change from `owned` to `routes`, so
/// that the routes' cost does not delay the tunnel: the node keeps its role (`last` is the
/// device applied before, as a leader when its flag says so; `leader` is the role now) and,
/// for every peer that is new or whose endpoint moved, the main-table routes that would carry
/// a handshake to its endpoint are the same before and after. Otherwise a handshake the
/// engine starts (or answers) at once could leave by a route about to change (through the
/// location's old leader, or into the WireGuard link) and be lost until WireGuard's 5 s retry,
/// so the routes go first.
pub fn engine_before_routes(
    last: Option<(&Conf, bool)>,
    next: &Conf,
    leader: bool,
    owned: &RoutePlan,
    routes: &RoutePlan,
) -> bool {
    let Some((last, was_leader)) = last else {
        return false;
    };
    if was_leader != leader {
        return false;
    }
    let before: std::collections::BTreeMap<&Key, Option<IpAddr>> = last
        .peers
        .iter()
        .map(|p| (&p.public_key, p.endpoint.as_ref().and_then(|e| e.ip())))
        .collect();
    let moved: Vec<IpAddr> = next
        .peers
        .iter()
        .filter_map(|p| {
            let ip = p.endpoint.as_ref().and_then(|e| e.ip())?;
            (before.get(&p.public_key) != Some(&Some(ip))).then_some(ip)
        })
        .collect();
    if moved.len() > ENGINE_FIRST_MAX_MOVED {
        return false;
    }
    let carriers = |plan: &RoutePlan, ip: IpAddr| -> Vec<Route> {
        plan.routes
            .iter()
            .filter(|r| r.table == MAIN_TABLE && r.dst.contains(&ip))
            .cloned()
            .collect()
    };
    moved
        .into_iter()
        .all(|ip| carriers(owned, ip) == carriers(routes, ip))
}

/// What the tunnel must be prepared for on `host` under `t`.
fn tunnel_spec(t: &Topology, host: &HostNet) -> TunnelSpec {
    let private_link = host.private_link(t.private_ip);
    TunnelSpec {
        ipv4_pods: t
            .local_pod_cidrs()
            .find(|n| n.addr().is_ipv4())
            .unwrap_or(t.subnet),
        private_link,
        private_mtu: host
            .link(private_link)
            .filter(|_| private_link != 0)
            .map(|l| l.mtu),
        private_ipv6: t.private_ip.is_some_and(|n| n.addr().is_ipv6()),
        ipv6_members: t.local_location_private_ips().iter().any(|ip| ip.is_ipv6()),
    }
}

#[cfg(test)]
#[path = "desired/tests.rs"]
mod tests;
