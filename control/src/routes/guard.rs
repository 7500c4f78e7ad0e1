//! The tunnel guard: WireGuard's own packets are never routed into the mesh, whatever kg's
//! routes cover. The engine's UDP sockets (or the kernel WireGuard's) carry a mark (`SO_MARK`,
//! the device's `fwmark`). Two policy rules per address family, ahead of the main table, send
//! a marked packet to a table of the host's own routes (copies of the main table's routes that
//! do not go through kg's links) and, when that table has no route for it, answer
//! `unreachable`. A marked packet never meets one of kg's routes into the WireGuard link, so
//! no host route per endpoint is needed, and no later route change can pull WireGuard's
//! packets into the tunnel.
//!
//! With `--tunnel-guard=routes` kg marks nothing and pins a host route per covered endpoint
//! instead ([`super::Topology::bypass_endpoints`]).

use super::{Route, RoutePlan, Rule};

/// The table of the host's own routes that marked packets look up.
pub const UNDERLAY_TABLE: u32 = 1108;
/// The priority of the lookup rule; the `unreachable` rule comes one after it. The local
/// table (0) is consulted before both and the main table (32766) after. Kilo's rules, added
/// without a priority, are numbered by the kernel one below the second rule in the list, so
/// they may come before the guard's: they match pod sources and traffic from the WireGuard
/// link, never the socket's own packets.
pub const GUARD_PRIORITY: u32 = 1100;
/// The mark kg puts on WireGuard's socket by default. kube-proxy marks with 0x4000 and
/// 0x8000, Calico within 0xffff0000, Cilium within 0x0f00; this bit is none of those. The
/// rules match it under itself as the mask, so other bits set by other agents do not matter.
pub const DEFAULT_GUARD_MARK: u32 = 0x1000;

/// How kg keeps WireGuard's packets out of the tunnel (`--tunnel-guard`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TunnelGuard {
    /// Mark the socket and route marked packets by the host's own routes (`mark`, with
    /// `--tunnel-guard-mark`).
    Mark(u32),
    /// A host route per endpoint that one of kg's routes covers (`routes`).
    Routes,
}

impl Default for TunnelGuard {
    fn default() -> Self {
        Self::Mark(DEFAULT_GUARD_MARK)
    }
}

impl TunnelGuard {
    /// The `--tunnel-guard` value and the mark: `mark` (with a non-zero `mark`) or `routes`.
    pub fn parse(text: &str, mark: u32) -> Result<Self, String> {
        match text {
            "mark" if mark == 0 => {
                Err("--tunnel-guard=mark needs a non-zero --tunnel-guard-mark".to_string())
            }
            "mark" => Ok(Self::Mark(mark)),
            "routes" => Ok(Self::Routes),
            other => Err(format!(
                "--tunnel-guard: {other:?} is neither \"mark\" nor \"routes\""
            )),
        }
    }

    /// The mark WireGuard's socket carries (0: none).
    pub fn mark(self) -> u32 {
        match self {
            Self::Mark(mark) => mark,
            Self::Routes => 0,
        }
    }
}

/// A guard rule's match: `fwmark <mark>/<mark>`, its priority and its family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GuardMatch {
    /// `pref`.
    pub priority: u32,
    /// The mark, matched under itself as the mask.
    pub mark: u32,
    /// An IPv6 rule (`ip -6 rule`).
    pub ipv6: bool,
}

impl Rule {
    /// The guard's rule of `priority` for `mark` in one family: a lookup in `table`, or
    /// `unreachable` for table 0.
    pub fn guard(priority: u32, mark: u32, ipv6: bool, table: u32) -> Self {
        Self {
            src: None,
            dst: None,
            iif: None,
            table,
            guard: Some(GuardMatch {
                priority,
                mark,
                ipv6,
            }),
        }
    }

    /// True for a guard rule that answers `unreachable`.
    pub fn is_unreachable(&self) -> bool {
        self.guard.is_some() && self.table == 0
    }
}

impl RoutePlan {
    /// Adds the guard for packets marked `mark`: `underlay` (the host's own main-table routes,
    /// none through kg's links) copied into [`UNDERLAY_TABLE`], and for each family that has
    /// one of them, a rule looking that table up and one answering `unreachable` after it.
    /// Link-local (and loopback) destinations are left out: no endpoint is one
    /// ([`crate::ip::is_unusable`]), and every link has its own `fe80::/64`. So is a route
    /// without an output link (the host's listing gives a multipath route its first usable
    /// next hop; one with none is left out): a family none of whose routes is copied gets no
    /// rules, rather than rules that would make every endpoint of it unreachable.
    pub fn guard_socket(&mut self, mark: u32, underlay: &[Route]) {
        let mut families = [false; 2];
        for r in underlay.iter().filter(|r| r.link != 0) {
            if crate::ip::is_unusable(r.dst.addr()) && r.dst.prefix_len() > 0 {
                continue;
            }
            families[usize::from(r.dst.addr().is_ipv6())] = true;
            self.insert_route(Route {
                table: UNDERLAY_TABLE,
                dst: r.dst,
                gateway: r.gateway,
                link: r.link,
                src: r.src,
                onlink: r.gateway.is_some(),
            });
        }
        for (ipv6, present) in [(false, families[0]), (true, families[1])] {
            if present {
                self.rules
                    .insert(Rule::guard(GUARD_PRIORITY, mark, ipv6, UNDERLAY_TABLE));
                self.rules
                    .insert(Rule::guard(GUARD_PRIORITY + 1, mark, ipv6, 0));
            }
        }
    }
}
