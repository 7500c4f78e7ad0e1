//! The only module that talks rtnetlink: links, addresses, routes and policy rules. No `ip`
//! command is ever run.

use std::net::IpAddr;

use anyhow::{Context, Result};
use control::routes::{Route, RouteOp, RoutePlan, Rule, KILO_TABLE, MAIN_TABLE};
use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{InfoKind, LinkInfo};
use netlink_packet_route::link::{Ip6TunnelFlags, LinkAttribute, LinkFlags, LinkMessage};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteMessage, RouteProtocol, RouteType, RouteVia,
};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use netlink_packet_route::AddressFamily;
use rtnetlink::{
    Handle, IpVersion, LinkIp6Tnl, LinkIpIp, LinkUnspec, LinkWireguard, RouteMessageBuilder,
};

/// A network interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Interface index.
    pub index: u32,
    /// Name.
    pub name: String,
    /// MTU.
    pub mtu: u32,
    /// Administratively up.
    pub up: bool,
}

/// A connection to the kernel's routing netlink.
#[derive(Clone)]
pub struct Netlink {
    handle: Handle,
}

fn kind_name(kind: &InfoKind) -> String {
    match kind {
        InfoKind::Tun => "tun".to_string(),
        InfoKind::Wireguard => "wireguard".to_string(),
        other => format!("{other:?}").to_lowercase(),
    }
}

fn route_address(addr: &RouteAddress) -> Option<IpAddr> {
    match addr {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

impl Netlink {
    /// Opens a netlink socket and spawns its connection task on the current tokio runtime.
    pub fn connect() -> Result<Self> {
        let (connection, handle, _) = rtnetlink::new_connection().context("opening rtnetlink")?;
        tokio::spawn(connection);
        Ok(Self { handle })
    }

    /// Every link.
    pub async fn links(&self) -> Result<Vec<Link>> {
        let mut out = Vec::new();
        let mut stream = self.handle.link().get().execute();
        while let Some(msg) = stream.try_next().await.context("listing links")? {
            let mut link = Link {
                index: msg.header.index,
                name: String::new(),
                mtu: 0,
                up: msg.header.flags.contains(LinkFlags::Up),
            };
            for attr in msg.attributes {
                match attr {
                    LinkAttribute::IfName(n) => link.name = n,
                    LinkAttribute::Mtu(m) => link.mtu = m,
                    _ => {}
                }
            }
            out.push(link);
        }
        Ok(out)
    }

    /// The link called `name`.
    pub async fn link_by_name(&self, name: &str) -> Result<Option<Link>> {
        Ok(self.links().await?.into_iter().find(|l| l.name == name))
    }

    /// The kind of the link called `name` as `ip -d link` names it (`tun`, `wireguard`, …;
    /// empty when the kernel names none), or `None` when there is no such link.
    pub async fn link_kind(&self, name: &str) -> Result<Option<String>> {
        let mut stream = self
            .handle
            .link()
            .get()
            .match_name(name.to_string())
            .execute();
        let message = match stream.try_next().await {
            Ok(message) => message,
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => None,
            Err(e) => return Err(anyhow::Error::new(e).context(format!("reading link {name}"))),
        };
        Ok(message.map(|m| {
            m.attributes
                .iter()
                .find_map(|a| match a {
                    LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
                        LinkInfo::Kind(kind) => Some(kind_name(kind)),
                        _ => None,
                    }),
                    _ => None,
                })
                .unwrap_or_default()
        }))
    }

    /// Makes sure the kernel's WireGuard link `name` exists (`ip link add NAME type
    /// wireguard`). Fails where the kernel has no WireGuard.
    pub async fn add_wireguard(&self, name: &str) -> Result<()> {
        self.add_link_once(LinkWireguard::new(name).build(), name, "wireguard")
            .await
    }

    /// Every address, with its link index and prefix length.
    pub async fn addresses(&self) -> Result<Vec<(u32, IpNet)>> {
        let mut out = Vec::new();
        let mut stream = self.handle.address().get().execute();
        while let Some(msg) = stream.try_next().await.context("listing addresses")? {
            let mut local = None;
            let mut address = None;
            for attr in &msg.attributes {
                match attr {
                    AddressAttribute::Local(ip) => local = Some(*ip),
                    AddressAttribute::Address(ip) => address = Some(*ip),
                    _ => {}
                }
            }
            if let Some(ip) = local.or(address) {
                if let Ok(net) = IpNet::new(ip, msg.header.prefix_len) {
                    out.push((msg.header.index, net));
                }
            }
        }
        Ok(out)
    }

    /// Makes sure the kernel IPIP link `name` exists (`ip tunnel add NAME mode ipip`): created,
    /// or already there. Fails where the kernel has no IPIP.
    pub async fn add_ipip(&self, name: &str) -> Result<()> {
        self.add_link_once(LinkIpIp::new(name).build(), name, "IPIP")
            .await
    }

    /// Adds the link `message` describes, called `name`: created, or already there (the
    /// kernel's error is returned only when no link of that name exists afterwards).
    async fn add_link_once(&self, message: LinkMessage, name: &str, kind: &str) -> Result<()> {
        match self.handle.link().add(message).execute().await {
            Ok(()) => Ok(()),
            Err(e) => match self.link_by_name(name).await? {
                Some(_) => Ok(()),
                None => Err(anyhow::Error::new(e).context(format!("creating {kind} link {name}"))),
            },
        }
    }

    /// Makes sure the kernel's `ip6tnl` link `name` exists in `ipip6` mode over link `over`
    /// with no fixed endpoints (`ip link add NAME type ip6tnl mode ipip6 dev OVER encaplimit
    /// none`): IPv4 inside an IPv6 header whose next header is 4, sent to the IPv6 gateway of
    /// each route through it, the bytes kilotun's userspace device sends. Binding it to `over`
    /// keeps it apart from the module's own `ip6tnl0`, which has no endpoints either. The kernel
    /// takes the outer destination from an IPv4 route's IPv6 gateway since Linux 5.18 (before,
    /// such packets are dropped), so an older kernel is refused here. Fails where the kernel has
    /// no `ip6_tunnel`.
    pub async fn add_ip6tnl(&self, name: &str, over: u32) -> Result<()> {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        if !routes_ipv4_to_ipv6_gateways(&release) {
            anyhow::bail!(
                "kernel {} is older than 5.18, whose ip6tnl cannot send IPv4 to a route's IPv6 gateway",
                release.trim()
            );
        }
        let link = LinkIp6Tnl::new(name)
            .mode(netlink_packet_route::IpProtocol::Ipip)
            .dev(over)
            .set_flag(Ip6TunnelFlags::IgnEncapLimit, true)
            .build();
        self.add_link_once(link, name, "ip6tnl").await
    }

    /// True when the kernel has IPIP, loaded or loadable: its fallback device `tunl0` exists,
    /// the `ipip` module is loaded, or the running kernel's module list has it. Creates nothing.
    pub async fn has_ipip(&self) -> Result<bool> {
        if self.link_by_name("tunl0").await?.is_some()
            || std::path::Path::new("/sys/module/ipip").exists()
        {
            return Ok(true);
        }
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let modules = format!("/lib/modules/{}/modules", release.trim());
        let listed = |file: &str| {
            std::fs::read_to_string(format!("{modules}.{file}"))
                .is_ok_and(|list| list.lines().any(|l| l.contains("/ipip.ko")))
        };
        Ok(listed("dep") || listed("builtin"))
    }

    /// Deletes a link.
    pub async fn delete_link(&self, index: u32) -> Result<()> {
        self.handle
            .link()
            .del(index)
            .execute()
            .await
            .with_context(|| format!("deleting link {index}"))
    }

    /// Sets a link's MTU.
    pub async fn set_mtu(&self, index: u32, mtu: u32) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).mtu(mtu).build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .with_context(|| format!("setting MTU {mtu} on link {index}"))
    }

    /// Brings a link up or down.
    pub async fn set_up(&self, index: u32, up: bool) -> Result<()> {
        let builder = LinkUnspec::new_with_index(index);
        let msg = if up { builder.up() } else { builder.down() }.build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .with_context(|| format!("setting link {index} {}", if up { "up" } else { "down" }))
    }

    /// Makes `want` the only addresses of the link (`None`: remove all).
    pub async fn set_address(&self, index: u32, want: Option<IpNet>) -> Result<()> {
        let mut has_wanted = false;
        let mut stream = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute();
        let mut stale = Vec::new();
        while let Some(msg) = stream.try_next().await.context("listing addresses")? {
            let ip = msg.attributes.iter().find_map(|a| match a {
                AddressAttribute::Local(ip) | AddressAttribute::Address(ip) => Some(*ip),
                _ => None,
            });
            let Some(ip) = ip else { continue };
            if ip.is_ipv6() && ip.to_string().starts_with("fe80") {
                continue;
            }
            match IpNet::new(ip, msg.header.prefix_len) {
                Ok(net) if Some(net) == want => has_wanted = true,
                _ => stale.push(msg),
            }
        }
        for msg in stale {
            self.handle
                .address()
                .del(msg)
                .execute()
                .await
                .context("removing a stale address")?;
        }
        if let (Some(net), false) = (want, has_wanted) {
            self.handle
                .address()
                .add(index, net.addr(), net.prefix_len())
                .replace()
                .execute()
                .await
                .with_context(|| format!("adding {net} to link {index}"))?;
        }
        Ok(())
    }

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

    /// The kernel's protocol-static routes in the main and Kilo tables, and its Kilo-table rules.
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
                if table != MAIN_TABLE && table != KILO_TABLE {
                    continue;
                }
                if let Some(r) = parse_route(&route, table) {
                    plan.routes.insert(r);
                }
            }
            let version = if v6 { IpVersion::V6 } else { IpVersion::V4 };
            let mut stream = self.handle.rule().get(version).execute();
            let mut broken = Vec::new();
            while let Some(rule) = stream.try_next().await.context("listing rules")? {
                if let Some(r) = parse_rule(&rule) {
                    if rule.header.action == RuleAction::ToTable {
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

/// [`parse_route`] for a main-table route, where a default route has no destination attribute.
fn parse_default_or_route(route: &RouteMessage) -> Option<Route> {
    if route.header.destination_prefix_length == 0 {
        let mut r = Route {
            table: MAIN_TABLE,
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
                _ => {}
            }
        }
        return Some(r);
    }
    parse_route(route, MAIN_TABLE)
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
    Some(Route {
        table,
        dst: dst.trunc(),
        gateway,
        link,
        src,
        onlink: route.header.flags.contains(RouteFlags::Onlink),
    })
}

fn parse_rule(rule: &RuleMessage) -> Option<Rule> {
    let mut table = u32::from(rule.header.table);
    let mut src = None;
    let mut dst = None;
    let mut iif = None;
    for attr in &rule.attributes {
        match attr {
            RuleAttribute::Table(t) => table = *t,
            RuleAttribute::Source(ip) => src = IpNet::new(*ip, rule.header.src_len).ok(),
            RuleAttribute::Destination(ip) => dst = IpNet::new(*ip, rule.header.dst_len).ok(),
            RuleAttribute::Iifname(n) => iif = Some(n.clone()),
            _ => {}
        }
    }
    (table == KILO_TABLE).then_some(Rule {
        src,
        dst,
        iif,
        table,
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

/// True when kernel release `release` (`/proc/sys/kernel/osrelease`) is 5.18 or later: its
/// `ip6tnl` in NBMA mode sends IPv4 to the IPv6 gateway of the route that chose it.
pub fn routes_ipv4_to_ipv6_gateways(release: &str) -> bool {
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= (5, 18),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::routes_ipv4_to_ipv6_gateways;

    #[test]
    fn ip6tnl_routes_ipv4_to_ipv6_gateways_from_linux_5_18() {
        for (release, yes) in [
            ("6.18.0-1-cloud-amd64\n", true),
            ("5.18.0", true),
            ("5.17.15-200.fc35.x86_64", false),
            ("5.4.0-150-generic", false),
            ("4.18.0-553.el8_10.x86_64", false),
            ("10.0", true),
            ("", false),
            ("garbage", false),
        ] {
            assert_eq!(routes_ipv4_to_ipv6_gateways(release), yes, "{release:?}");
        }
    }
}
