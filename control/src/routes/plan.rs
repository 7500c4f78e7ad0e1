//! The route planner: walks a node's topology and lists the routes and policy rules it
//! needs, leaving out (and reporting) CIDRs that would cover one of the node's own networks.

use std::collections::BTreeSet;
use std::net::IpAddr;

use ipnet::IpNet;

use super::{
    Encapsulate, NoGateway, Route, RouteOptions, RoutePlan, Rule, Withheld,
    FIELD_ALLOWED_LOCATION_IPS, FIELD_INTERNAL_IP, FIELD_PEER_ALLOWED_IPS, FIELD_POD_CIDR,
    KILO_TABLE, MAIN_TABLE,
};
use crate::ip::host_net;
use crate::topology::{Member, Segment, Topology};

impl Topology {
    /// The routes and rules this node needs, on a node with no connected network to guard.
    pub fn route_plan(&self, options: &RouteOptions) -> RoutePlan {
        self.guarded_route_plan(options, &[]).0
    }

    /// The routes and rules this node needs, given its directly connected networks
    /// (`connected`, kg's own links left out), and the CIDRs withheld because they contain or
    /// equal one of them (sorted, de-duplicated). Other nodes, not on those networks, still
    /// route them to their location.
    pub fn guarded_route_plan(
        &self,
        options: &RouteOptions,
        connected: &[IpNet],
    ) -> (RoutePlan, Vec<Withheld>) {
        let connected: Vec<IpNet> = connected.iter().map(IpNet::trunc).collect();
        let mut p = Planner {
            t: self,
            o: options,
            connected: &connected,
            plan: RoutePlan::default(),
            withheld: BTreeSet::new(),
        };
        if self.leader {
            p.leader();
        } else {
            p.non_leader();
        }
        (p.plan, p.withheld.into_iter().collect())
    }
}

/// The owner of an allowed location IP of segment `s`: the first member annotated with it,
/// else the segment.
fn location_ip_owner(s: &Segment, net: &IpNet) -> String {
    s.members
        .iter()
        .find(|m| {
            m.allowed_location_ips
                .iter()
                .any(|n| n.trunc() == net.trunc())
        })
        .map_or_else(
            || format!("location {}", s.key),
            |m| format!("node {}", m.name),
        )
}

struct Planner<'a> {
    t: &'a Topology,
    o: &'a RouteOptions,
    /// This node's directly connected networks (canonical).
    connected: &'a [IpNet],
    plan: RoutePlan,
    withheld: BTreeSet<Withheld>,
}

impl Planner<'_> {
    /// True (and recorded) when `cidr` contains or equals a connected network of this node.
    fn withholds(
        &mut self,
        cidr: IpNet,
        owner: impl FnOnce() -> String,
        field: &'static str,
    ) -> bool {
        let cidr = cidr.trunc();
        let Some(connected) = self.connected.iter().find(|n| cidr.contains(*n)) else {
            return false;
        };
        self.withheld.insert(Withheld {
            owner: owner(),
            field,
            cidr,
            connected: *connected,
        });
        true
    }

    /// The route source for `dst`: the local private IP when it is of the destination's family
    /// (Kilo's), else the node's own pod-CIDR address of that family, else none.
    fn source_for(&self, dst: &IpNet) -> Option<IpAddr> {
        let same = |ip: &IpAddr| ip.is_ipv4() == dst.addr().is_ipv4();
        match self.t.private_ip.map(|n| n.addr()) {
            Some(own) if same(&own) => Some(own),
            _ => self.o.pod_sources.iter().copied().find(same),
        }
    }

    /// True when the tunnel device can carry traffic to `dst` through `gateway`. IPIP carries
    /// IPv4 packets only, so an IPv6 destination is reached unencapsulated whatever
    /// `--encapsulate` says (Kilo would install a route the kernel refuses). The kernel's
    /// `tunl0` (and flannel's and Cilium's devices) reach IPv4 gateways only, so a node with an
    /// IPv6 internal IP is reached unencapsulated through them; kilotun's userspace IPIP device
    /// reaches it in an outer IPv6 header ([`RouteOptions::ipip_over_ipv6`]), and so does the
    /// kernel's `ip6tnl` where kg made one beside `tunl0` ([`Links::tunnel6`]).
    fn tunnel_carries(&self, dst: &IpNet, gateway: Option<IpAddr>) -> bool {
        dst.addr().is_ipv4()
            && gateway
                .is_none_or(|g| g.is_ipv4() || self.o.ipip_over_ipv6 || self.o.links.tunnel6 != 0)
    }

    /// True when traffic to `dst` through `gateway` goes through the tunnel device.
    fn encapsulates_to(&self, dst: &IpNet, gateway: Option<IpAddr>) -> bool {
        if !self.tunnel_carries(dst, gateway) {
            return false;
        }
        match self.o.encapsulate {
            Encapsulate::Always => true,
            Encapsulate::CrossSubnet => match (self.t.private_ip, gateway) {
                (Some(own), Some(gw)) => !own.contains(&gw),
                _ => true,
            },
            Encapsulate::Never => false,
        }
    }

    /// Kilo's `encapsulateRoute`: a route through node `via` (its gateway for `dst`'s family) on
    /// the private link, moved to the tunnel link when encapsulating, with the local private IP
    /// as source. Left out, and recorded, when `via` has no address the route can take.
    fn private_route(&mut self, dst: IpNet, via: &Member) {
        let gateway = self.o.compatibility.gateway(via, &dst);
        if dst.addr().is_ipv6() && gateway.is_some_and(|g| g.is_ipv4()) {
            self.plan.no_gateway.insert(NoGateway {
                dst: dst.trunc(),
                via: via.name.clone(),
            });
            return;
        }
        let (link, gateway) = if self.encapsulates_to(&dst, gateway) {
            let same_family = gateway.filter(|g| g.is_ipv4() == dst.addr().is_ipv4());
            match gateway.filter(|_| same_family.is_none()) {
                // The kernel's ip6tnl sends to the route's IPv6 gateway.
                Some(other) if self.o.links.tunnel6 != 0 => (self.o.links.tunnel6, Some(other)),
                // The kernel refuses a gateway of the other family on the userspace device's
                // link (the gateway's own route is on another device): the device reads it
                // from the plan.
                Some(other) => {
                    self.plan.tunnel_gateways.insert(dst.trunc(), other);
                    (self.o.links.tunnel, same_family)
                }
                None => (self.o.links.tunnel, same_family),
            }
        } else {
            (self.o.links.private, gateway)
        };
        self.plan.insert_route(Route {
            table: MAIN_TABLE,
            dst: dst.trunc(),
            gateway,
            link,
            src: self.source_for(&dst),
            onlink: gateway.is_some(),
        });
    }

    fn kilo_route(&mut self, dst: IpNet, gateway: Option<IpAddr>) {
        // The WireGuard link needs no gateway (the engine routes by allowed IPs); one of the
        // other family (an IPv6 destination through an IPv4 WireGuard IP) is refused by the
        // kernel, so it is left out.
        let gateway = gateway.filter(|g| g.is_ipv4() == dst.addr().is_ipv4());
        self.plan.insert_route(Route {
            table: MAIN_TABLE,
            dst: dst.trunc(),
            gateway,
            link: self.o.links.kilo,
            src: self.source_for(&dst),
            onlink: gateway.is_some(),
        });
    }

    /// Routes (and table-1107 detours) to the other members of the local segment.
    fn local_members(&mut self, members: &[Member], leader: bool) {
        let own = self.t.private_ip.map(|n| n.addr());
        for m in members {
            let Some(ip) = m.private_ip.map(|n| n.addr()) else {
                continue;
            };
            if Some(ip) == own {
                continue;
            }
            for pods in m.pod_cidrs() {
                if !self.withholds(pods, || format!("node {}", m.name), FIELD_POD_CIDR) {
                    self.private_route(pods, m);
                }
            }
            let gw = self.o.compatibility.gateway(m, &host_net(ip));
            let crosses = self.tunnel_carries(&host_net(ip), gw)
                && match self.o.encapsulate {
                    Encapsulate::Always => true,
                    Encapsulate::CrossSubnet => self.t.private_ip.is_some_and(|n| !n.contains(&ip)),
                    Encapsulate::Never => false,
                };
            if crosses {
                self.plan.insert_route(Route {
                    table: KILO_TABLE,
                    dst: host_net(ip),
                    gateway: gw,
                    link: self.o.links.tunnel,
                    src: own.filter(|o| o.is_ipv4() == ip.is_ipv4()),
                    onlink: gw.is_some(),
                });
                let own_pods = self
                    .t
                    .local_pod_cidrs()
                    .find(|n| n.addr().is_ipv4() == ip.is_ipv4());
                if let Some(own_pods) = own_pods {
                    self.plan.rules.insert(Rule {
                        src: Some(own_pods),
                        dst: Some(host_net(ip)),
                        iif: None,
                        table: KILO_TABLE,
                        guard: None,
                    });
                }
                if leader {
                    self.plan.rules.insert(Rule {
                        src: None,
                        dst: Some(host_net(ip)),
                        iif: Some(self.o.kilo_name.clone()),
                        table: KILO_TABLE,
                        guard: None,
                    });
                }
            }
        }
    }

    fn non_leader(&mut self) {
        let t = self.t;
        let Some(own) = t.local_segment() else { return };
        let gw = own.leader_member();
        for s in &t.segments {
            self.private_route(host_net(s.wireguard_ip), gw);
            if t.in_local_location(s) {
                // Its own segment, or another share of its location: reached directly.
                if self.o.local {
                    self.local_members(&s.members, false);
                }
                continue;
            }
            for m in &s.members {
                for pods in m.pod_cidrs() {
                    if !self.withholds(pods, || format!("node {}", m.name), FIELD_POD_CIDR) {
                        self.private_route(pods, gw);
                    }
                }
            }
            for m in &s.members {
                let Some(ip) = m.private_ip.map(|n| host_net(n.addr())) else {
                    continue;
                };
                if !self.withholds(ip, || format!("node {}", m.name), FIELD_INTERNAL_IP) {
                    self.private_route(ip, gw);
                }
            }
            for net in &s.allowed_location_ips {
                let owner = || location_ip_owner(s, net);
                if !self.withholds(*net, owner, FIELD_ALLOWED_LOCATION_IPS) {
                    self.private_route(*net, gw);
                }
            }
        }
        for p in &t.peers {
            for net in &p.allowed_ips {
                let owner = || format!("peer {}", p.name);
                if !self.withholds(*net, owner, FIELD_PEER_ALLOWED_IPS) {
                    self.private_route(*net, gw);
                }
            }
        }
    }

    fn leader(&mut self) {
        let t = self.t;
        for s in &t.segments {
            if t.in_local_location(s) {
                // In `cross` granularity the other nodes of the location are segments of their
                // own, reached like the members of a location's segment.
                if self.o.local && t.private_ip.is_some() {
                    self.local_members(&s.members, true);
                } else if t.private_ip.is_some() && self.o.encapsulate != Encapsulate::Never {
                    self.cilium_detours(&s.members);
                }
                continue;
            }
            let endpoint_ip = t
                .effective_endpoint(s.endpoint.as_ref(), &s.public_key, s.persistent_keepalive)
                .and_then(|e| e.ip());
            for m in &s.members {
                let owner = || format!("node {}", m.name);
                for pods in m.pod_cidrs() {
                    if !self.withholds(pods, owner, FIELD_POD_CIDR) {
                        self.kilo_route(pods, Some(s.wireguard_ip));
                    }
                }
                if let Some(ip) = m.private_ip.map(|n| n.addr()) {
                    if Some(ip) != endpoint_ip
                        && !self.withholds(host_net(ip), owner, FIELD_INTERNAL_IP)
                    {
                        self.kilo_route(host_net(ip), Some(s.wireguard_ip));
                    }
                }
            }
            for net in &s.allowed_location_ips {
                let owner = || location_ip_owner(s, net);
                if !self.withholds(*net, owner, FIELD_ALLOWED_LOCATION_IPS) {
                    self.kilo_route(*net, Some(s.wireguard_ip));
                }
            }
        }
        for p in &t.peers {
            // A host route to the Peer's own endpoint would swallow the tunnel's packets to it.
            // Kilo's multi-cluster setup makes such Peers: `kgctl showconf node --as-peer`
            // lists a leader's private IP, which is usually its endpoint too.
            let endpoint_ip = p
                .public_key
                .as_ref()
                .and_then(|k| t.effective_endpoint(p.endpoint.as_ref(), k, p.persistent_keepalive))
                .and_then(|e| e.ip());
            for net in &p.allowed_ips {
                if endpoint_ip.is_some_and(|ip| net.trunc() == host_net(ip)) {
                    continue;
                }
                let owner = || format!("peer {}", p.name);
                if !self.withholds(*net, owner, FIELD_PEER_ALLOWED_IPS) {
                    self.kilo_route(*net, None);
                }
            }
        }
    }

    /// `--local=false` on a leader: members whose gateway is not their private IP (Cilium) still
    /// get a table-1107 route so WireGuard traffic returns through the tunnel.
    fn cilium_detours(&mut self, members: &[Member]) {
        let own = self.t.private_ip.map(|n| n.addr());
        for m in members {
            let Some(ip) = m.private_ip.map(|n| n.addr()) else {
                continue;
            };
            let gw = self.o.compatibility.gateway(m, &host_net(ip));
            if Some(ip) == own
                || gw.is_none()
                || gw == Some(ip)
                || !self.tunnel_carries(&host_net(ip), gw)
            {
                continue;
            }
            self.plan.insert_route(Route {
                table: KILO_TABLE,
                dst: host_net(ip),
                gateway: gw,
                link: self.o.links.tunnel,
                src: None,
                onlink: true,
            });
            self.plan.rules.insert(Rule {
                src: None,
                dst: Some(host_net(ip)),
                iif: Some(self.o.kilo_name.clone()),
                table: KILO_TABLE,
                guard: None,
            });
        }
    }
}
