//! Route plans for fixture F1 from leaders and non-leaders, with and without encapsulation, and
//! the diff's convergence.

use super::*;
use crate::fixtures::{f1_nodes, f1_params, f1_peers};
use crate::node::Granularity;

mod ipv6;

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
    assert_has_route(&routes, "10.6.0.0/24 dev 1 src 192.168.0.1");
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
    let ops = diff(&desired, &empty, &empty, &[KILO]);
    assert_eq!(ops.len(), desired.routes.len() + desired.rules.len());
    let after = apply_ops(&empty, &ops);
    assert_eq!(after, desired);
    assert!(diff(&desired, &after, &desired, &[KILO]).is_empty());
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
    let ops = diff(&new, &old, &old, &[KILO]);
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
        ..Default::default()
    };
    let ops = diff(&desired, &observed, &RoutePlan::default(), &[KILO]);
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

/// The guard's scenario: a1 and a2 (location x) and b1 (location y) on one L2 subnet
/// 192.168.10.0/24, b1 annotated with `allowed-location-ips` `b1_location_ips`, and a Peer
/// `p` with `peer_ips`.
fn shared_subnet(host: &str, b1_location_ips: &[&str], peer_ips: &[&str]) -> Topology {
    use crate::fixtures::node;
    let mut nodes = vec![
        node(
            "a1",
            "192.168.10.1:51820",
            Some("192.168.10.1/24"),
            "x",
            "10.42.1.0/24",
            "ka1",
        ),
        node(
            "a2",
            "192.168.10.2:51820",
            Some("192.168.10.2/24"),
            "x",
            "10.42.2.0/24",
            "ka2",
        ),
        node(
            "b1",
            "192.168.10.3:51820",
            Some("192.168.10.3/24"),
            "y",
            "10.42.3.0/24",
            "kb1",
        ),
    ];
    nodes[2].allowed_location_ips = b1_location_ips.iter().map(|n| n.parse().unwrap()).collect();
    let peers: Vec<crate::Peer> = (!peer_ips.is_empty())
        .then(|| crate::Peer {
            name: "p".into(),
            allowed_ips: peer_ips.iter().map(|n| n.parse().unwrap()).collect(),
            public_key: Some(crate::Key::padded("kp")),
            endpoint: None,
            persistent_keepalive: 0,
            preshared_key: None,
        })
        .into_iter()
        .collect();
    Topology::new(&nodes, &peers, &f1_params(host, Granularity::Location)).unwrap()
}

fn connected(nets: &[&str]) -> Vec<IpNet> {
    nets.iter().map(|n| n.parse().unwrap()).collect()
}

fn routes_to(plan: &RoutePlan, dst: &str) -> Vec<String> {
    show(plan)
        .into_iter()
        .filter(|l| l.starts_with(&format!("{dst} ")))
        .collect()
}

#[test]
fn allowed_location_ips_equal_to_a_connected_network_are_withheld_on_leader_and_member() {
    for (host, pods) in [("a1", "10.42.1.0/24"), ("a2", "10.42.2.0/24")] {
        let on_subnet = connected(&["192.168.10.0/24", pods]);
        let t = shared_subnet(host, &["192.168.10.0/24"], &[]);
        assert_eq!(t.leader, host == "a1");
        let (plan, withheld) = t.guarded_route_plan(&options(true, Encapsulate::Never), &on_subnet);
        assert!(
            routes_to(&plan, "192.168.10.0/24").is_empty(),
            "{host}: {:#?}",
            show(&plan)
        );
        assert_eq!(
            withheld,
            [Withheld {
                owner: "node b1".into(),
                field: FIELD_ALLOWED_LOCATION_IPS,
                cidr: "192.168.10.0/24".parse().unwrap(),
                connected: "192.168.10.0/24".parse().unwrap(),
            }],
            "{host}"
        );
        assert_eq!(
            withheld[0].to_string(),
            "node b1 kilo.squat.ai/allowed-location-ips 192.168.10.0/24 contains this node's connected network 192.168.10.0/24; not routing it into the mesh on this node"
        );
        // The rest of the mesh to b1 is untouched.
        assert_eq!(routes_to(&plan, "10.42.3.0/24").len(), 1, "{host}");
    }
}

#[test]
fn a_larger_cidr_containing_a_connected_network_is_withheld() {
    let on_subnet = connected(&["192.168.10.7/24"]);
    let options = options(true, Encapsulate::Never);
    let t = shared_subnet("a1", &["192.168.0.0/16"], &[]);
    let (plan, location) = t.guarded_route_plan(&options, &on_subnet);
    assert!(routes_to(&plan, "192.168.0.0/16").is_empty());
    let t = shared_subnet("a2", &[], &["192.168.10.0/23"]);
    let (plan, peer) = t.guarded_route_plan(&options, &on_subnet);
    assert!(routes_to(&plan, "192.168.10.0/23").is_empty());
    let shown: Vec<String> = location
        .iter()
        .chain(&peer)
        .map(|w| format!("{} {} {} {}", w.owner, w.field, w.cidr, w.connected))
        .collect();
    assert_eq!(
        shown,
        [
            "node b1 kilo.squat.ai/allowed-location-ips 192.168.0.0/16 192.168.10.0/24",
            "peer p spec.allowedIPs 192.168.10.0/23 192.168.10.0/24",
        ]
    );
}

/// "Contains or equals": a CIDR more specific than the connected network (a host behind
/// another node, Kilo's allowed-location-ips for one address) is still routed into the mesh;
/// it replaces nothing, only narrows the kernel's connected route for that host.
#[test]
fn a_cidr_inside_a_connected_network_is_still_routed() {
    let t = shared_subnet("a1", &["192.168.10.200/32"], &[]);
    let (plan, withheld) = t.guarded_route_plan(
        &options(true, Encapsulate::Never),
        &connected(&["192.168.10.0/24"]),
    );
    assert!(withheld.is_empty(), "{withheld:?}");
    assert_eq!(
        routes_to(&plan, "192.168.10.200/32"),
        ["192.168.10.200/32 via 10.4.0.2 dev 1 src 192.168.10.1 onlink"]
    );
}

#[test]
fn a_node_not_on_the_network_still_routes_it_to_its_location() {
    let t = shared_subnet("a1", &["192.168.10.0/24"], &[]);
    let expected = t.route_plan(&options(true, Encapsulate::Never));
    let (plan, withheld) = t.guarded_route_plan(
        &options(true, Encapsulate::Never),
        &connected(&["192.168.20.0/24", "10.42.1.0/24"]),
    );
    assert!(withheld.is_empty());
    assert_eq!(plan, expected);
    assert_eq!(
        routes_to(&plan, "192.168.10.0/24"),
        ["192.168.10.0/24 via 10.4.0.2 dev 1 src 192.168.10.1 onlink"]
    );
}

/// Issue item 4, as far as it goes today: two locations announcing the same CIDR. Kilo's
/// filter keeps it for the location whose key sorts last and drops it from the other, naming
/// both owners, and every node computes the same: the CIDR goes to the same location's
/// WireGuard IP from every other location.
#[test]
fn the_same_allowed_location_ip_on_two_locations_is_routed_alike_everywhere() {
    use crate::fixtures::node;
    let claim: IpNet = "10.9.0.0/24".parse().unwrap();
    let mut nodes = vec![
        node(
            "a1",
            "192.168.10.1:51820",
            Some("192.168.10.1/24"),
            "x",
            "10.42.1.0/24",
            "ka1",
        ),
        node(
            "b1",
            "192.168.20.1:51820",
            Some("192.168.20.1/24"),
            "y",
            "10.42.2.0/24",
            "kb1",
        ),
        node(
            "c1",
            "192.168.30.1:51820",
            Some("192.168.30.1/24"),
            "z",
            "10.42.3.0/24",
            "kc1",
        ),
    ];
    nodes[0].allowed_location_ips = vec![claim];
    nodes[1].allowed_location_ips = vec![claim];
    let mut gateways = Vec::new();
    for host in ["a1", "b1", "c1"] {
        let t = Topology::new(&nodes, &[], &f1_params(host, Granularity::Location)).unwrap();
        let dropped: Vec<String> = t
            .dropped
            .iter()
            .map(|d| format!("{} {} {}", d.owner, d.cidr, d.reason))
            .collect();
        assert_eq!(
            dropped,
            ["location:x 10.9.0.0/24 overlaps allowed-location-ip 10.9.0.0/24 of location:y"],
            "{host}"
        );
        let plan = t.route_plan(&options(true, Encapsulate::Never));
        gateways.push(routes_to(&plan, "10.9.0.0/24"));
    }
    assert_eq!(
        gateways,
        [
            vec!["10.9.0.0/24 via 10.4.0.2 dev 1 src 192.168.10.1 onlink".to_string()],
            vec![],
            vec!["10.9.0.0/24 via 10.4.0.2 dev 1 src 192.168.30.1 onlink".to_string()],
        ]
    );
}

fn underlay(lines: &[(&str, Option<&str>, u32)]) -> Vec<Route> {
    lines
        .iter()
        .map(|(dst, gw, link)| Route {
            table: MAIN_TABLE,
            dst: dst.parse().unwrap(),
            gateway: gw.map(|g| g.parse().unwrap()),
            link: *link,
            src: None,
            onlink: false,
        })
        .collect()
}

#[test]
fn an_endpoint_inside_a_peers_allowed_ips_keeps_to_the_underlay() {
    // Peer a claims 10.1.0.0/16, which holds every other location's endpoint (10.1.0.x).
    let mut peers = f1_peers();
    peers[0].allowed_ips.push("10.1.0.0/16".parse().unwrap());
    let t = Topology::new(&f1_nodes(), &peers, &f1_params("b", Granularity::Location)).unwrap();
    assert!(t.leader);
    let mut plan = t.route_plan(&options(true, Encapsulate::Never));
    assert!(show(&plan).contains(&"10.1.0.0/16 dev 1 src 192.168.0.1".to_string()));
    let host = underlay(&[
        ("0.0.0.0/0", Some("192.168.0.254"), PRIV),
        ("10.1.0.0/24", Some("192.168.0.253"), PRIV),
        ("192.168.0.0/24", None, PRIV),
        // A route on the WireGuard link itself never carries WireGuard's packets.
        ("10.1.0.3/32", None, KILO),
    ]);
    let bypasses = t.bypass_endpoints(&mut plan, KILO, &host);
    let mut got: Vec<String> = bypasses
        .iter()
        .map(|b| format!("{} {} {}", b.owner, b.endpoint, b.covered_by))
        .collect();
    got.sort();
    // F1's Peer b has node a's private IP as its endpoint, which b routes into the tunnel
    // towards a's location: kept on the underlay too.
    assert_eq!(
        got,
        [
            "node a 10.1.0.1 10.1.0.0/16",
            "node d 10.1.0.4 10.1.0.0/16",
            "peer b 192.168.0.1 192.168.0.1/32"
        ]
    );
    let routes = show(&plan);
    // The longest underlay prefix wins; the tunnel route itself stays.
    assert_has_route(&routes, "10.1.0.1/32 via 192.168.0.253 dev 2 onlink");
    assert_has_route(&routes, "192.168.0.1/32 dev 2");
    assert!(
        !routes.iter().any(|r| r.starts_with("192.168.0.1/32 via")),
        "{routes:?}"
    );
    assert_has_route(&routes, "10.1.0.4/32 via 192.168.0.253 dev 2 onlink");
    assert!(routes.contains(&"10.1.0.0/16 dev 1 src 192.168.0.1".to_string()));
    assert!(bypasses[0].to_string().contains("inside 10.1.0.0/16"));
}

#[test]
fn no_bypass_without_a_covering_tunnel_route_or_on_a_non_leader() {
    let mut quiet = f1_peers();
    quiet[1].endpoint = None;
    let t = Topology::new(&f1_nodes(), &quiet, &f1_params("b", Granularity::Location)).unwrap();
    let mut plan = t.route_plan(&options(true, Encapsulate::Never));
    let before = plan.clone();
    let host = underlay(&[("0.0.0.0/0", Some("192.168.0.254"), PRIV)]);
    assert!(t.bypass_endpoints(&mut plan, KILO, &host).is_empty());
    assert_eq!(plan, before);
    let mut peers = f1_peers();
    peers[0].allowed_ips.push("10.1.0.0/16".parse().unwrap());
    let member =
        Topology::new(&f1_nodes(), &peers, &f1_params("c", Granularity::Location)).unwrap();
    assert!(!member.leader);
    let mut plan = member.route_plan(&options(true, Encapsulate::Never));
    assert!(member.bypass_endpoints(&mut plan, KILO, &host).is_empty());
}

#[test]
fn routes_an_earlier_kg_left_on_its_tunnel_go_but_only_on_kgs_own_links() {
    // A kg restarted with other settings (another granularity, --clean-up=false before) finds
    // the last run's route over tunl0, which this run never applied.
    let stale_on_tunnel = Route {
        table: MAIN_TABLE,
        dst: "10.2.3.0/24".parse().unwrap(),
        gateway: Some("192.168.0.3".parse().unwrap()),
        link: TUNL,
        src: None,
        onlink: true,
    };
    let observed = RoutePlan {
        routes: [stale_on_tunnel.clone()].into(),
        ..Default::default()
    };
    let none = RoutePlan::default();
    assert_eq!(
        diff(&none, &observed, &none, &[KILO, TUNL]),
        vec![RouteOp::DeleteRoute(stale_on_tunnel)]
    );
    // A tunnel kg did not make (Cilium's, flannel's) is not among its own links.
    assert_eq!(diff(&none, &observed, &none, &[KILO]), vec![]);
}
