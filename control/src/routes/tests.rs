//! Unit tests of `routes`: fixture F1, the route options, and helpers that print plans the
//! way `ip route` and `ip rule` would; the tests live in the submodules.

use super::*;
use crate::fixtures::{f1_nodes, f1_params, f1_peers};
use crate::node::Granularity;

mod bypass;
mod diffing;
mod guard;
mod ipv6;
mod plans;
mod shares;

const KILO: u32 = 1;
const PRIV: u32 = 2;
const TUNL: u32 = 3;
const TUNL6: u32 = 4;

fn topology(host: &str, granularity: Granularity) -> Topology {
    Topology::new(&f1_nodes(), &f1_peers(), &f1_params(host, granularity)).unwrap()
}

fn options(local: bool, encapsulate: Encapsulate) -> RouteOptions {
    RouteOptions {
        kilo_name: "kilo0".into(),
        links: Links {
            kilo: KILO,
            private: PRIV,
            tunnel: TUNL,
            tunnel6: 0,
        },
        local,
        encapsulate,
        compatibility: Compatibility::Ipip,
        pod_sources: Vec::new(),
        ipip_over_ipv6: false,
    }
}

/// Routes as `ip route` would print them, sorted.
fn show(plan: &RoutePlan) -> Vec<String> {
    let mut lines: Vec<String> = plan
        .routes
        .iter()
        .map(|r| {
            let mut s = r.dst.to_string();
            if let Some(gw) = r.gateway {
                s += &format!(" via {gw}");
            }
            s += &format!(" dev {}", r.link);
            if let Some(src) = r.src {
                s += &format!(" src {src}");
            }
            if r.table != MAIN_TABLE {
                s += &format!(" table {}", r.table);
            }
            if r.onlink {
                s += " onlink";
            }
            s
        })
        .collect();
    lines.sort();
    lines
}

/// Fails, listing `routes`, unless `line` is one of them.
#[track_caller]
fn assert_has_route(routes: &[String], line: &str) {
    assert!(routes.iter().any(|r| r == line), "{line} not in {routes:?}");
}

fn show_rules(plan: &RoutePlan) -> Vec<String> {
    plan.rules
        .iter()
        .map(|r| {
            let mut s = String::new();
            if let Some(src) = r.src {
                s += &format!("from {src} ");
            }
            if let Some(iif) = &r.iif {
                s += &format!("iif {iif} ");
            }
            if let Some(dst) = r.dst {
                s += &format!("to {dst} ");
            }
            s + &format!("lookup {}", r.table)
        })
        .collect()
}
