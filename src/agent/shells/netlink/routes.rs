//! Routes and policy rules: reading the main, Kilo and underlay tables, the Kilo-table rules
//! and the tunnel guard's rules, and
//! applying kg's route and rule changes, with the translation between netlink messages and
//! [`Route`] and [`Rule`].

use std::net::IpAddr;

use anyhow::{Context, Result};
use control::routes::guard::GUARD_PRIORITY;
use control::routes::{
    GuardMatch, Route, RouteOp, RoutePlan, Rule, KILO_TABLE, MAIN_TABLE, UNDERLAY_TABLE,
};
use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteMessage, RouteNextHopFlags, RouteProtocol,
    RouteType, RouteVia,
};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use netlink_packet_route::AddressFamily;
use rtnetlink::{IpVersion, RouteMessageBuilder};

use super::Netlink;

fn route_address(addr: &RouteAddress) -> Option<IpAddr> {
    match addr {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

impl Netlink {
    /// The main table's unicast routes, IPv4 then IPv6 (every protocol: the host's own and
    /// kg's alike).
    pub async fn main_routes(&self) -> Result<Vec<Route>> {
        let mut out = Vec::new();
        for v6 in [false, true] {
            let msg = if v6 {
                RouteMessageBuilder::<std::net::Ipv6Addr>::new().build()
            } else {
                RouteMessageBuilder::<std::net::Ipv4Addr>::new().build()
            };
            // The dump is read to the end: abandoning it mid-way leaves answers undeliverable.
            let routes: Vec<RouteMessage> = self
                .handle
                .route()
                .get(msg)
                .execute()
                .try_collect()
                .await
                .context("listing routes")?;
            out.extend(
                routes
                    .iter()
                    .filter(|r| table_of(r) == MAIN_TABLE && r.header.kind == RouteType::Unicast)
                    .filter_map(parse_default_or_route),
            );
        }
        Ok(out)
    }

    /// The kernel's protocol-static routes in the main, Kilo and underlay tables, its
    /// Kilo-table rules and the tunnel guard's.
    pub async fn observe(&self) -> Result<RoutePlan> {
        let mut plan = RoutePlan::default();
        for v6 in [false, true] {
            let msg = if v6 {
                RouteMessageBuilder::<std::net::Ipv6Addr>::new().build()
            } else {
                RouteMessageBuilder::<std::net::Ipv4Addr>::new().build()
            };
            let mut stream = self.handle.route().get(msg).execute();
            while let Some(route) = stream.try_next().await.context("listing routes")? {
                if route.header.protocol != RouteProtocol::Static {
                    continue;
                }
                let table = table_of(&route);
                if ![MAIN_TABLE, KILO_TABLE, UNDERLAY_TABLE].contains(&table) {
                    continue;
                }
                // The underlay table holds the host's default routes too.
                if let Some(r) = parse_default_or_route_in(&route, table) {
                    plan.routes.insert(r);
                }
            }
            let version = if v6 { IpVersion::V6 } else { IpVersion::V4 };
            let mut stream = self.handle.rule().get(version).execute();
            let mut broken = Vec::new();
            while let Some(rule) = stream.try_next().await.context("listing rules")? {
                if let Some(r) = parse_rule(&rule) {
                    if r.guard.is_some() || rule.header.action == RuleAction::ToTable {
                        plan.rules.insert(r);
                    } else {
                        broken.push(rule);
                    }
                }
            }
            // A table-1107 rule without the "to table" action drops what it matches: remove
            // it, and the diff adds a working one.
            for rule in broken {
                tracing::info!(?rule.header.action, "removing a table-1107 rule without a lookup action");
                self.handle
                    .rule()
                    .del(rule)
                    .execute()
                    .await
                    .context("removing a broken rule")?;
            }
        }
        Ok(plan)
    }

    /// Applies route and rule changes in order; each failure is collected, not fatal to the rest.
    pub async fn apply(&self, ops: &[RouteOp]) -> Vec<anyhow::Error> {
        let mut errors = Vec::new();
        for op in ops {
            let result = match op {
                RouteOp::ReplaceRoute(r) => self.replace_route(r).await,
                RouteOp::DeleteRoute(r) => self.delete_route(r).await,
                RouteOp::AddRule(r) => self.add_rule(r).await,
                RouteOp::DeleteRule(r) => self.delete_rule(r).await,
            };
            if let Err(e) = result {
                errors.push(e.context(format!("{op:?}")));
            }
        }
        errors
    }

    async fn replace_route(&self, r: &Route) -> Result<()> {
        let msg = build_route(r)?;
        self.handle.route().add(msg).replace().execute().await?;
        Ok(())
    }

    async fn delete_route(&self, r: &Route) -> Result<()> {
        let msg = build_route(r)?;
        match self.handle.route().del(msg).execute().await {
            Ok(()) => Ok(()),
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ESRCH => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn add_rule(&self, r: &Rule) -> Result<()> {
        if let Some(guard) = r.guard {
            return self.add_guard_rule(r, guard).await;
        }
        let v6 = r.src.or(r.dst).is_some_and(|n| n.addr().is_ipv6());
        // The action must be "to table": the kernel answers a lookup through a rule without
        // one with EINVAL, i.e. drops the packet.
        let mut req = self
            .handle
            .rule()
            .add()
            .table_id(r.table)
            .action(RuleAction::ToTable);
        if let Some(iif) = &r.iif {
            req = req.input_interface(iif.clone());
        }
        if v6 {
            let mut req = req.v6();
            if let Some(IpNet::V6(src)) = r.src {
                req = req.source_prefix(src.addr(), src.prefix_len());
            }
            if let Some(IpNet::V6(dst)) = r.dst {
                req = req.destination_prefix(dst.addr(), dst.prefix_len());
            }
            req.execute().await?;
        } else {
            let mut req = req.v4();
            if let Some(IpNet::V4(src)) = r.src {
                req = req.source_prefix(src.addr(), src.prefix_len());
            }
            if let Some(IpNet::V4(dst)) = r.dst {
                req = req.destination_prefix(dst.addr(), dst.prefix_len());
            }
            req.execute().await?;
        }
        Ok(())
    }

    /// Adds a guard rule: `fwmark M/M`, at its priority, looking its table up or answering
    /// `unreachable`.
    async fn add_guard_rule(&self, r: &Rule, guard: GuardMatch) -> Result<()> {
        let action = if r.is_unreachable() {
            RuleAction::Unreachable
        } else {
            RuleAction::ToTable
        };
        let mut req = self
            .handle
            .rule()
            .add()
            .action(action)
            .priority(guard.priority)
            .fw_mark(guard.mark);
        if r.is_unreachable() {
            // No table: `ip rule add … unreachable` leaves it unspecified.
            req.message_mut().header.table = 0;
        } else {
            req = req.table_id(r.table);
        }
        req.message_mut()
            .attributes
            .push(RuleAttribute::FwMask(guard.mark));
        if guard.ipv6 {
            req.v6().execute().await?;
        } else {
            req.v4().execute().await?;
        }
        Ok(())
    }

    async fn delete_rule(&self, r: &Rule) -> Result<()> {
        for version in [IpVersion::V4, IpVersion::V6] {
            let rules: Vec<RuleMessage> = self
                .handle
                .rule()
                .get(version)
                .execute()
                .try_collect()
                .await?;
            if let Some(msg) = rules
                .into_iter()
                .find(|m| parse_rule(m).as_ref() == Some(r))
            {
                self.handle.rule().del(msg).execute().await?;
                return Ok(());
            }
        }
        Ok(())
    }
}

fn table_of(route: &RouteMessage) -> u32 {
    route
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(route.header.table))
}

/// The output link and gateway of a multipath route's first usable next hop (not dead, its
/// link not down): what stands for the route where a [`Route`] has one path, as in the tunnel
/// guard's copy of the host's routes (WireGuard's few flows lose only the balancing).
fn first_next_hop(route: &RouteMessage) -> Option<(u32, Option<IpAddr>)> {
    let hops = route.attributes.iter().find_map(|a| match a {
        RouteAttribute::MultiPath(hops) => Some(hops),
        _ => None,
    })?;
    let unusable = RouteNextHopFlags::Dead | RouteNextHopFlags::Linkdown;
    let hop = hops
        .iter()
        .find(|h| h.interface_index != 0 && !h.flags.intersects(unusable))?;
    let gateway = hop.attributes.iter().find_map(|a| match a {
        RouteAttribute::Gateway(a) => route_address(a),
        RouteAttribute::Via(v) => via_address(v),
        _ => None,
    });
    Some((hop.interface_index, gateway))
}

/// [`parse_default_or_route_in`] for a main-table route.
fn parse_default_or_route(route: &RouteMessage) -> Option<Route> {
    parse_default_or_route_in(route, MAIN_TABLE)
}

/// [`parse_route`], and a default route too, which has no destination attribute.
fn parse_default_or_route_in(route: &RouteMessage, table: u32) -> Option<Route> {
    if route.header.destination_prefix_length == 0 {
        let mut r = Route {
            table,
            dst: match route.header.address_family {
                AddressFamily::Inet6 => "::/0".parse().ok()?,
                _ => "0.0.0.0/0".parse().ok()?,
            },
            gateway: None,
            link: 0,
            src: None,
            onlink: route.header.flags.contains(RouteFlags::Onlink),
        };
        for attr in &route.attributes {
            match attr {
                RouteAttribute::Gateway(a) => r.gateway = route_address(a),
                RouteAttribute::Via(v) => r.gateway = via_address(v),
                RouteAttribute::Oif(i) => r.link = *i,
                RouteAttribute::PrefSource(a) => r.src = route_address(a),
                _ => {}
            }
        }
        if r.link == 0 {
            if let Some((link, gateway)) = first_next_hop(route) {
                (r.link, r.gateway) = (link, gateway);
            }
        }
        return Some(r);
    }
    parse_route(route, table)
}

/// The address of an `RTA_VIA` attribute.
fn via_address(via: &RouteVia) -> Option<IpAddr> {
    match via {
        RouteVia::Inet(a) => Some(IpAddr::V4(*a)),
        RouteVia::Inet6(a) => Some(IpAddr::V6(*a)),
        _ => None,
    }
}

fn parse_route(route: &RouteMessage, table: u32) -> Option<Route> {
    let mut dst = None;
    let mut gateway = None;
    let mut link = 0;
    let mut src = None;
    for attr in &route.attributes {
        match attr {
            RouteAttribute::Destination(a) => dst = route_address(a),
            RouteAttribute::Gateway(a) => gateway = route_address(a),
            // A gateway of the other family (an IPv4 route via an IPv6 address).
            RouteAttribute::Via(v) => gateway = via_address(v),
            RouteAttribute::Oif(i) => link = *i,
            RouteAttribute::PrefSource(a) => src = route_address(a),
            _ => {}
        }
    }
    let dst = match dst {
        Some(ip) => IpNet::new(ip, route.header.destination_prefix_length).ok()?,
        None => return None,
    };
    if link == 0 {
        if let Some(hop) = first_next_hop(route) {
            (link, gateway) = hop;
        }
    }
    Some(Route {
        table,
        dst: dst.trunc(),
        gateway,
        link,
        src,
        onlink: route.header.flags.contains(RouteFlags::Onlink),
    })
}

/// One of kg's rules: a table-1107 rule (Kilo's), or a guard rule (a mark under itself as the
/// mask, at one of the guard's two priorities).
fn parse_rule(rule: &RuleMessage) -> Option<Rule> {
    let mut table = u32::from(rule.header.table);
    let mut src = None;
    let mut dst = None;
    let mut iif = None;
    let (mut priority, mut mark, mut mask) = (None, None, None);
    for attr in &rule.attributes {
        match attr {
            RuleAttribute::Table(t) => table = *t,
            RuleAttribute::Source(ip) => src = IpNet::new(*ip, rule.header.src_len).ok(),
            RuleAttribute::Destination(ip) => dst = IpNet::new(*ip, rule.header.dst_len).ok(),
            RuleAttribute::Iifname(n) => iif = Some(n.clone()),
            RuleAttribute::Priority(p) => priority = Some(*p),
            RuleAttribute::FwMark(m) => mark = Some(*m),
            RuleAttribute::FwMask(m) => mask = Some(*m),
            _ => {}
        }
    }
    if let (Some(priority), Some(mark)) = (priority, mark) {
        let ours = (priority == GUARD_PRIORITY && rule.header.action == RuleAction::ToTable)
            || (priority == GUARD_PRIORITY + 1 && rule.header.action == RuleAction::Unreachable);
        if ours && mask == Some(mark) && src.is_none() && dst.is_none() && iif.is_none() {
            let ipv6 = rule.header.family == AddressFamily::Inet6;
            let table = if rule.header.action == RuleAction::Unreachable {
                0
            } else {
                table
            };
            return Some(Rule::guard(priority, mark, ipv6, table));
        }
    }
    (table == KILO_TABLE).then_some(Rule {
        src,
        dst,
        iif,
        table,
        guard: None,
    })
}

fn build_route(r: &Route) -> Result<RouteMessage> {
    let mut b = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(r.dst.addr(), r.dst.prefix_len())?
        .table_id(r.table)
        .protocol(RouteProtocol::Static)
        .output_interface(r.link);
    if let Some(gw) = r.gateway {
        b = b.gateway(gw)?;
    }
    if let Some(src) = r.src {
        b = b.pref_source(src)?;
    }
    if r.onlink {
        b = b.onlink();
    }
    let mut msg = b.build();
    if msg.header.address_family == AddressFamily::Unspec {
        msg.header.address_family = if r.dst.addr().is_ipv6() {
            AddressFamily::Inet6
        } else {
            AddressFamily::Inet
        };
    }
    Ok(msg)
}
