//! Route plans for fixture F1 from leaders and non-leaders, with and without encapsulation, and
//! the diff's convergence.

use super::*;
use crate::fixtures::{f1_nodes, f1_params, f1_peers};
use crate::node::Granularity;

const KILO: u32 = 1;
const PRIV: u32 = 2;
const TUNL: u32 = 3;

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
        },
        local,
        encapsulate,
        compatibility: Compatibility::Ipip,
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

#[test]
fn non_leader_without_encapsulation_routes_everything_via_its_leader() {
    let plan = topology("c", Granularity::Location).route_plan(&options(true, Encapsulate::Never));
    assert_eq!(
        show(&plan),
        [
            "10.2.1.0/24 via 192.168.0.1 dev 2 src 192.168.0.2 onlink",
            "10.2.2.0/24 via 192.168.0.1 dev 2 src 192.168.0.2 onlink",
            "10.2.4.0/24 via 192.168.0.1 dev 2 src 192.168.0.2 onlink",
            "10.4.0.1/32 via 192.168.0.1 dev 2 src 192.168.0.2 onlink",
            "10.4.0.2/32 via 192.168.0.1 dev 2 src 192.168.0.2 onlink",
            "10.4.0.3/32 via 192.168.0.1 dev 2 src 192.168.0.2 onlink",
            "10.5.0.0/24 via 192.168.0.1 dev 2 src 192.168.0.2 onlink",
            "192.168.0.1/32 via 192.168.0.1 dev 2 src 192.168.0.2 onlink",
        ]
    );
    assert!(plan.rules.is_empty());
}

#[test]
fn non_leader_with_encapsulation_uses_the_tunnel_and_table_1107() {
    let plan = topology("c", Granularity::Location).route_plan(&options(true, Encapsulate::Always));
    let shown = show(&plan);
    assert!(
        shown
            .iter()
            .filter(|l| !l.contains("table"))
            .all(|l| l.contains(" dev 3 ")),
        "{shown:#?}"
    );
    assert!(shown.contains(
        &"192.168.0.1/32 via 192.168.0.1 dev 3 src 192.168.0.2 table 1107 onlink".to_string()
    ));
    assert_eq!(
        show_rules(&plan),
        ["from 10.2.3.0/24 to 192.168.0.1/32 lookup 1107"]
    );
}

#[test]
fn non_leader_with_local_off_skips_routes_to_its_own_location() {
    let plan = topology("c", Granularity::Location).route_plan(&options(false, Encapsulate::Never));
    assert!(!show(&plan).iter().any(|l| l.starts_with("10.2.2.0/24")));
    assert_eq!(plan.routes.len(), 7);
}

#[test]
fn leader_routes_other_segments_through_wireguard() {
    let plan = topology("b", Granularity::Location).route_plan(&options(true, Encapsulate::Always));
    assert_eq!(
        show(&plan),
        [
            "10.2.1.0/24 via 10.4.0.1 dev 1 src 192.168.0.1 onlink",
            "10.2.3.0/24 via 192.168.0.2 dev 3 src 192.168.0.1 onlink",
            "10.2.4.0/24 via 10.4.0.3 dev 1 src 192.168.0.1 onlink",
            "10.5.0.0/24 dev 1 src 192.168.0.1",
            "192.168.0.1/32 via 10.4.0.1 dev 1 src 192.168.0.1 onlink",
            "192.168.0.2/32 via 192.168.0.2 dev 3 src 192.168.0.1 table 1107 onlink",
        ]
    );
    assert_eq!(
        show_rules(&plan),
        [
            "iif kilo0 to 192.168.0.2/32 lookup 1107",
            "from 10.2.2.0/24 to 192.168.0.2/32 lookup 1107",
        ]
    );
}

#[test]
fn a_peers_own_endpoint_is_not_routed_into_the_tunnel() {
    // Another cluster's leader as a Peer (Kilo's multi-cluster setup): its private IP, which is
    // also its endpoint, is among its allowed IPs.
    let mut peers = f1_peers();
    peers[1].allowed_ips = vec![
        "10.6.0.0/24".parse().unwrap(),
        "192.168.9.9/32".parse().unwrap(),
    ];
    peers[1].endpoint = Some(crate::ip::Endpoint::parse("192.168.9.9:51820").unwrap());
    let t = Topology::new(&f1_nodes(), &peers, &f1_params("b", Granularity::Location)).unwrap();
    let routes = show(&t.route_plan(&options(true, Encapsulate::Always)));
    assert!(
        routes.contains(&"10.6.0.0/24 dev 1 src 192.168.0.1".to_string()),
        "{routes:?}"
    );
    assert!(
        routes.iter().all(|r| !r.starts_with("192.168.9.9/32")),
        "{routes:?}"
    );
}

#[test]
fn leader_without_encapsulation_routes_its_location_directly() {
    let plan = topology("b", Granularity::Location).route_plan(&options(true, Encapsulate::Never));
    assert!(show(&plan)
        .contains(&"10.2.3.0/24 via 192.168.0.2 dev 2 src 192.168.0.1 onlink".to_string()));
    assert!(plan.rules.is_empty());
    assert!(plan.routes.iter().all(|r| r.table == MAIN_TABLE));
}

#[test]
fn crosssubnet_encapsulates_only_outside_the_private_subnet() {
    let mut nodes = f1_nodes();
    nodes[1].internal_ip = Some("192.168.0.1/24".parse().unwrap());
    nodes[2].internal_ip = Some("192.168.1.2/24".parse().unwrap());
    let params = f1_params("b", Granularity::Location);
    let t = Topology::new(&nodes, &[], &params).unwrap();
    let plan = t.route_plan(&options(true, Encapsulate::CrossSubnet));
    assert!(show(&plan)
        .contains(&"10.2.3.0/24 via 192.168.1.2 dev 3 src 192.168.0.1 onlink".to_string()));
    nodes[2].internal_ip = Some("192.168.0.2/24".parse().unwrap());
    let t = Topology::new(&nodes, &[], &params).unwrap();
    let plan = t.route_plan(&options(true, Encapsulate::CrossSubnet));
    assert!(show(&plan)
        .contains(&"10.2.3.0/24 via 192.168.0.2 dev 2 src 192.168.0.1 onlink".to_string()));
    assert!(plan.rules.is_empty());
}

#[test]
fn leader_without_private_ip_has_no_source_and_no_local_routes() {
    let plan = topology("d", Granularity::Location).route_plan(&options(true, Encapsulate::Always));
    let shown = show(&plan);
    assert!(shown.iter().all(|l| !l.contains("src")), "{shown:#?}");
    assert!(shown.contains(&"10.2.3.0/24 via 10.4.0.2 dev 1 onlink".to_string()));
    assert!(shown.contains(&"192.168.178.3/32 via 10.4.0.2 dev 1 onlink".to_string()));
    // a and b share 192.168.0.1 in F1: one route, the first segment's.
    assert!(shown.contains(&"192.168.0.1/32 via 10.4.0.1 dev 1 onlink".to_string()));
    assert!(!shown.contains(&"192.168.0.1/32 via 10.4.0.2 dev 1 onlink".to_string()));
}

#[test]
fn full_mesh_routes_every_node_through_wireguard() {
    let plan = topology("a", Granularity::Full).route_plan(&options(true, Encapsulate::Always));
    assert!(plan.routes.iter().all(|r| r.link == KILO));
    assert!(plan.rules.is_empty());
    let shown = show(&plan);
    assert!(shown.contains(&"10.2.4.0/24 via 10.4.0.4 dev 1 src 192.168.0.1 onlink".to_string()));
}

#[test]
fn diff_adds_what_is_missing_and_converges() {
    let desired =
        topology("b", Granularity::Location).route_plan(&options(true, Encapsulate::Always));
    let empty = RoutePlan::default();
    let ops = diff(&desired, &empty, &empty, KILO);
    assert_eq!(ops.len(), desired.routes.len() + desired.rules.len());
    let after = apply_ops(&empty, &ops);
    assert_eq!(after, desired);
    assert!(diff(&desired, &after, &desired, KILO).is_empty());
}

#[test]
fn diff_replaces_a_changed_route_without_deleting_it_first() {
    let old = topology("b", Granularity::Location).route_plan(&options(true, Encapsulate::Always));
    let mut nodes = f1_nodes();
    nodes[2].leader = true; // c now leads location 2, so b becomes a non-leader
    let params = f1_params("b", Granularity::Location);
    let t = Topology::new(&nodes, &f1_peers(), &params).unwrap();
    assert!(!t.leader);
    let new = t.route_plan(&options(true, Encapsulate::Always));
    let ops = diff(&new, &old, &old, KILO);
    let deleted: Vec<&Route> = ops
        .iter()
        .filter_map(|o| match o {
            RouteOp::DeleteRoute(r) => Some(r),
            _ => None,
        })
        .collect();
    for r in &deleted {
        assert!(
            !new.routes
                .iter()
                .any(|n| (n.table, n.dst) == (r.table, r.dst)),
            "{r:?} deleted though still routed"
        );
    }
    let after = apply_ops(&old, &ops);
    assert_eq!(after, new);
}

#[test]
fn diff_leaves_foreign_routes_alone_but_removes_stale_kilo_ones() {
    let desired = RoutePlan::default();
    let foreign = Route {
        table: MAIN_TABLE,
        dst: "10.9.0.0/16".parse().unwrap(),
        gateway: Some("192.168.0.254".parse().unwrap()),
        link: PRIV,
        src: None,
        onlink: false,
    };
    let stale_on_kilo = Route {
        link: KILO,
        dst: "10.8.0.0/16".parse().unwrap(),
        ..foreign
    };
    let stale_rule = Rule {
        src: None,
        dst: Some("192.168.0.9/32".parse().unwrap()),
        iif: None,
        table: KILO_TABLE,
    };
    let observed = RoutePlan {
        routes: [foreign, stale_on_kilo.clone()].into(),
        rules: [stale_rule.clone()].into(),
    };
    let ops = diff(&desired, &observed, &RoutePlan::default(), KILO);
    assert_eq!(
        ops,
        vec![
            RouteOp::DeleteRoute(stale_on_kilo),
            RouteOp::DeleteRule(stale_rule)
        ]
    );
}

#[test]
fn a_connecting_peer_routes_every_segment_through_its_wireguard_ip() {
    let t = topology("a", Granularity::Location);
    let plan = t.peer_routes("a", 9, &["10.43.0.0/16".parse().unwrap()]);
    assert_eq!(
        show(&plan),
        [
            "10.2.1.0/24 via 10.4.0.1 dev 9 onlink",
            "10.2.2.0/24 via 10.4.0.2 dev 9 onlink",
            "10.2.3.0/24 via 10.4.0.2 dev 9 onlink",
            "10.2.4.0/24 via 10.4.0.3 dev 9 onlink",
            "10.4.0.1/32 dev 9",
            "10.4.0.2/32 dev 9",
            "10.4.0.3/32 dev 9",
            "10.43.0.0/16 via 10.4.0.1 dev 9 onlink",
            "10.5.0.0/24 dev 9",
            "192.168.0.1/32 via 10.4.0.1 dev 9 onlink",
            "192.168.0.2/32 via 10.4.0.2 dev 9 onlink",
            "192.168.178.3/32 via 10.4.0.2 dev 9 onlink",
        ]
    );
    assert!(plan.rules.is_empty());
    // A private IP that is also the leader's endpoint stays outside the tunnel.
    let mut nodes = f1_nodes();
    nodes[0].endpoint = Some(crate::ip::Endpoint::parse("192.168.0.1:51820").unwrap());
    let same = Topology::new(&nodes, &f1_peers(), &f1_params("a", Granularity::Location)).unwrap();
    let routes = show(&same.peer_routes("a", 9, &[]));
    assert!(
        routes
            .iter()
            .all(|r| !r.starts_with("192.168.0.1/32 via 10.4.0.1")),
        "{routes:?}"
    );
    // A Peer's own range is not routed into its tunnel.
    let only_a = Topology::new(
        &f1_nodes(),
        &f1_peers()[..1],
        &f1_params("a", Granularity::Location),
    )
    .unwrap();
    let own = only_a.peer_routes("a", 9, &[]);
    assert!(
        show(&own).iter().all(|r| !r.starts_with("10.5.")),
        "{own:?}"
    );
}
