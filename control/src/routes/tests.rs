//! Route plans for fixture F1 from leaders and non-leaders, with and without encapsulation, and
//! the diff's convergence.

use super::*;
use crate::fixtures::{f1_nodes, f1_params, f1_peers};
use crate::node::Granularity;

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
        ..Default::default()
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

/// a1 (leader) and a2 in location x, b1 in y, with IPv6 endpoints and internal IPs and IPv4
/// pod CIDRs.
fn ipv6_internal_ip_nodes() -> Vec<crate::node::Node> {
    use crate::fixtures::node;
    let mut nodes = vec![
        node(
            "a1",
            "[fd50::1]:51820",
            Some("fd50::1/64"),
            "x",
            "10.42.1.0/24",
            "k1",
        ),
        node(
            "a2",
            "[fd50::2]:51820",
            Some("fd50::2/64"),
            "x",
            "10.42.2.0/24",
            "k2",
        ),
        node(
            "b1",
            "[fd50::33]:51820",
            Some("fd50::3/64"),
            "y",
            "10.42.3.0/24",
            "k3",
        ),
    ];
    nodes[0].leader = true;
    nodes
}

/// No route of `plan` has a source, or a gateway on the WireGuard link, of the other family
/// than its destination.
fn assert_no_mixed_family(plan: &RoutePlan) {
    for r in &plan.routes {
        if let Some(gw) = r.gateway.filter(|_| r.link == KILO) {
            assert_eq!(gw.is_ipv4(), r.dst.addr().is_ipv4(), "{r:?}");
        }
        if let Some(src) = r.src {
            assert_eq!(src.is_ipv4(), r.dst.addr().is_ipv4(), "{r:?}");
        }
    }
    for rule in &plan.rules {
        if let (Some(src), Some(dst)) = (rule.src, rule.dst) {
            assert_eq!(src.addr().is_ipv4(), dst.addr().is_ipv4(), "{rule:?}");
        }
    }
}

#[test]
fn ipv6_internal_ips_never_mix_families_in_a_route() {
    let nodes = ipv6_internal_ip_nodes();
    let mut o = options(true, Encapsulate::Never);
    o.pod_sources = vec!["10.42.1.1".parse().unwrap()];
    let leader = Topology::new(&nodes, &[], &f1_params("a1", Granularity::Location)).unwrap();
    let plan = leader.route_plan(&o);
    assert_no_mixed_family(&plan);
    let routes = show(&plan);
    // b1's IPv6 private IP: straight onto the WireGuard link, no IPv4 gateway.
    assert_has_route(&routes, "fd50::3/128 dev 1 src fd50::1");
    // b1's IPv4 pods: through its IPv4 WireGuard IP, from this node's own pod address.
    assert!(
        routes
            .iter()
            .any(|r| r.starts_with("10.42.3.0/24 via 10.4.0.")
                && r.ends_with("src 10.42.1.1 onlink")),
        "{routes:?}"
    );
    // A non-leader sends IPv4 through its leader's IPv6 private IP, from its own pod address.
    o.pod_sources = vec!["10.42.2.1".parse().unwrap()];
    let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
    let routes = show(&member.route_plan(&o));
    assert_has_route(
        &routes,
        "10.42.3.0/24 via fd50::1 dev 2 src 10.42.2.1 onlink",
    );
}

#[test]
fn ipip_never_carries_traffic_to_an_ipv6_internal_ip() {
    let nodes = ipv6_internal_ip_nodes();
    for encapsulate in [Encapsulate::Always, Encapsulate::CrossSubnet] {
        let mut o = options(true, encapsulate);
        for (host, pods) in [("a1", "10.42.1.1"), ("a2", "10.42.2.1")] {
            o.pod_sources = vec![pods.parse().unwrap()];
            let t = Topology::new(&nodes, &[], &f1_params(host, Granularity::Location)).unwrap();
            let plan = t.route_plan(&o);
            assert_no_mixed_family(&plan);
            // tunl0 carries IPv4 to IPv4 addresses only: nothing goes onto it, and no
            // table-1107 detour or rule is planned for an IPv6 internal IP.
            assert!(
                plan.routes.iter().all(|r| r.link != TUNL),
                "{encapsulate:?} on {host}: {:?}",
                show(&plan)
            );
            assert!(plan.rules.is_empty(), "{:?}", show_rules(&plan));
        }
        // The location's pods are reached straight over the underlay, via the IPv6 internal IP.
        o.pod_sources = vec!["10.42.1.1".parse().unwrap()];
        let leader = Topology::new(&nodes, &[], &f1_params("a1", Granularity::Location)).unwrap();
        let routes = show(&leader.route_plan(&o));
        assert_has_route(
            &routes,
            "10.42.2.0/24 via fd50::2 dev 2 src 10.42.1.1 onlink",
        );
    }
}

#[test]
fn userspace_ipip_carries_ipv4_pods_to_an_ipv6_internal_ip() {
    let nodes = ipv6_internal_ip_nodes();
    let mut o = options(true, Encapsulate::Always);
    o.ipip_over_ipv6 = true;
    o.pod_sources = vec!["10.42.1.1".parse().unwrap()];
    let leader = Topology::new(&nodes, &[], &f1_params("a1", Granularity::Location)).unwrap();
    let plan = leader.route_plan(&o);
    assert_no_mixed_family(&plan);
    let routes = show(&plan);
    // The location's IPv4 pods go onto the tunnel with no gateway (the kernel refuses one of
    // the other family there); the device sends them to the node's IPv6 internal IP.
    assert_has_route(&routes, "10.42.2.0/24 dev 3 src 10.42.1.1");
    assert_eq!(
        plan.tunnel_gateways.get(&"10.42.2.0/24".parse().unwrap()),
        Some(&"fd50::2".parse().unwrap())
    );
    // The IPv6 internal IP itself is no IPIP traffic (IPIP carries IPv4 only): no detour, and
    // no rule mixing families.
    assert!(
        plan.routes
            .iter()
            .filter(|r| r.link == TUNL)
            .all(|r| r.dst.addr().is_ipv4()),
        "{routes:?}"
    );
    assert!(plan.rules.is_empty(), "{:?}", show_rules(&plan));
    // A node that does not lead sends the other location's pods to its leader the same way.
    let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
    o.pod_sources = vec!["10.42.2.1".parse().unwrap()];
    let plan = member.route_plan(&o);
    let remote: Vec<Option<IpAddr>> = plan
        .routes
        .iter()
        .filter(|r| r.link == TUNL && r.dst != "10.42.1.0/24".parse::<IpNet>().unwrap())
        .map(|r| plan.tunnel_gateways.get(&r.dst).copied())
        .collect();
    assert!(!remote.is_empty(), "{:?}", show(&plan));
    assert!(
        remote
            .iter()
            .all(|g| *g == Some("fd50::1".parse().unwrap())),
        "{remote:?} {:?}",
        show(&plan)
    );
}

/// a1 (leader) and a2 in location x, b1 in y: IPv4 internal IPs and endpoints, dual-stack
/// pods (`10.42.<n>.0/24` and `fd42:<n>::/64`), and each host's IPv6 address published as its
/// second internal IP.
fn dual_stack_pod_nodes() -> Vec<crate::node::Node> {
    use crate::fixtures::node;
    let mut nodes: Vec<crate::node::Node> = [("a1", "x"), ("a2", "x"), ("b1", "y")]
        .into_iter()
        .enumerate()
        .map(|(i, (name, location))| {
            let n = i + 1;
            let mut node = node(
                name,
                &format!("192.168.0.{n}:51820"),
                Some(&format!("192.168.0.{n}/24")),
                location,
                &format!("10.42.{n}.0/24"),
                &format!("k{n}"),
            );
            node.extra_subnets = vec![format!("fd42:{n}::/64").parse().unwrap()];
            node.second_internal_ip = Some(format!("fd50::{n}/64").parse().unwrap());
            node
        })
        .collect();
    nodes[0].leader = true;
    nodes
}

fn dual_stack_sources(n: u8) -> Vec<IpAddr> {
    vec![
        format!("10.42.{n}.1").parse().unwrap(),
        format!("fd42:{n}::1").parse().unwrap(),
    ]
}

#[test]
fn dual_stack_pods_are_routed_in_both_families() {
    let nodes = dual_stack_pod_nodes();
    for encapsulate in [Encapsulate::Never, Encapsulate::Always] {
        let mut o = options(true, encapsulate);
        o.pod_sources = dual_stack_sources(1);
        let leader = Topology::new(&nodes, &[], &f1_params("a1", Granularity::Location)).unwrap();
        let plan = leader.route_plan(&o);
        assert_no_mixed_family(&plan);
        assert!(plan.no_gateway.is_empty(), "{:?}", plan.no_gateway);
        let routes = show(&plan);
        // The other location's IPv6 pods: onto the WireGuard link without a gateway (its
        // WireGuard IP is IPv4), from this node's IPv6 pod address.
        assert_has_route(&routes, "fd42:3::/64 dev 1 src fd42:1::1");
        // Its own location's IPv6 pods: straight to the member's IPv6 address, never onto
        // the IPv4-only tunnel.
        assert!(
            routes.contains(&"fd42:2::/64 via fd50::2 dev 2 src fd42:1::1 onlink".to_string()),
            "{encapsulate:?}: {routes:?}"
        );
        // The WireGuard peer allows both families of the other location's pods.
        let peer = leader
            .segments
            .iter()
            .find(|s| s.key == "location:y")
            .expect("segment y");
        for cidr in ["10.42.3.0/24", "fd42:3::/64"] {
            assert!(
                peer.allowed_ips.contains(&cidr.parse().unwrap()),
                "{:?}",
                peer.allowed_ips
            );
        }

        // A member routes the IPv6 pods of other locations through its leader's IPv6 address.
        o.pod_sources = dual_stack_sources(2);
        let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
        let plan = member.route_plan(&o);
        assert_no_mixed_family(&plan);
        let routes = show(&plan);
        assert!(
            routes.contains(&"fd42:3::/64 via fd50::1 dev 2 src fd42:2::1 onlink".to_string()),
            "{encapsulate:?}: {routes:?}"
        );
        assert!(
            plan.routes
                .iter()
                .filter(|r| r.dst.addr().is_ipv6())
                .all(|r| r.link != TUNL),
            "{routes:?}"
        );
    }
}

#[test]
fn ipv6_pods_behind_a_leader_without_an_ipv6_address_are_named_not_routed() {
    let mut nodes = dual_stack_pod_nodes();
    // The leader's host has no IPv6 address (or runs Kilo's own kg, which publishes none).
    nodes[0].second_internal_ip = None;
    let mut o = options(true, Encapsulate::Never);
    o.pod_sources = dual_stack_sources(2);
    let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
    let plan = member.route_plan(&o);
    assert_no_mixed_family(&plan);
    assert!(
        plan.routes
            .iter()
            .all(|r| r.dst != "fd42:3::/64".parse::<IpNet>().unwrap()),
        "{:?}",
        show(&plan)
    );
    let named: Vec<String> = plan.no_gateway.iter().map(ToString::to_string).collect();
    assert!(
        named.contains(
            &"not routing fd42:3::/64 on this node: node a1 has no IPv6 address to route it \
              through (its kilotun.io/second-internal-ip is empty: its host has no IPv6 \
              address, or its kg is not kilotun's; with --compatibility=flannel or cilium, it \
              has no IPv6 pod CIDR)"
                .to_string()
        ),
        "{named:?}"
    );
    // The IPv4 pods are unaffected.
    assert!(
        show(&plan)
            .iter()
            .any(|r| r.starts_with("10.42.3.0/24 via 192.168.0.1 dev 2")),
        "{:?}",
        show(&plan)
    );
}

#[test]
fn ipv6_only_pods_are_routed_over_an_ipv4_underlay() {
    let mut nodes = dual_stack_pod_nodes();
    for n in &mut nodes {
        n.subnet = n.extra_subnets.pop();
    }
    let mut o = options(true, Encapsulate::Always);
    o.pod_sources = vec!["fd42:2::1".parse().unwrap()];
    let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
    let plan = member.route_plan(&o);
    assert_no_mixed_family(&plan);
    let routes = show(&plan);
    assert_has_route(
        &routes,
        "fd42:3::/64 via fd50::1 dev 2 src fd42:2::1 onlink",
    );
    assert_has_route(
        &routes,
        "fd42:1::/64 via fd50::1 dev 2 src fd42:2::1 onlink",
    );
    // No table-1107 rule pairs the IPv6 pods with an IPv4 internal IP.
    assert!(
        plan.rules.iter().all(|r| r
            .src
            .zip(r.dst)
            .is_none_or(|(s, d)| s.addr().is_ipv4() == d.addr().is_ipv4())),
        "{:?}",
        show_rules(&plan)
    );
}

#[test]
fn the_kernels_ip6tnl_carries_ipv4_pods_to_an_ipv6_internal_ip() {
    let nodes = ipv6_internal_ip_nodes();
    let mut o = options(true, Encapsulate::Always);
    o.links.tunnel6 = TUNL6;
    o.pod_sources = vec!["10.42.1.1".parse().unwrap()];
    let leader = Topology::new(&nodes, &[], &f1_params("a1", Granularity::Location)).unwrap();
    let plan = leader.route_plan(&o);
    assert_no_mixed_family(&plan);
    let routes = show(&plan);
    // An IPv4 route via an IPv6 gateway on the ip6tnl link: the kernel sends the packet in an
    // IPv6 header to that gateway. Nothing for the userspace device, nothing on tunl0.
    assert_has_route(
        &routes,
        "10.42.2.0/24 via fd50::2 dev 4 src 10.42.1.1 onlink",
    );
    assert!(
        plan.tunnel_gateways.is_empty(),
        "{:?}",
        plan.tunnel_gateways
    );
    assert!(plan.routes.iter().all(|r| r.link != TUNL), "{routes:?}");
    // A member sends the other location's pods to its leader the same way.
    o.pod_sources = vec!["10.42.2.1".parse().unwrap()];
    let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
    let routes = show(&member.route_plan(&o));
    assert_has_route(
        &routes,
        "10.42.3.0/24 via fd50::1 dev 4 src 10.42.2.1 onlink",
    );
    // crosssubnet: a member of the same IPv6 subnet is reached unencapsulated.
    let mut o = options(true, Encapsulate::CrossSubnet);
    o.links.tunnel6 = TUNL6;
    o.pod_sources = vec!["10.42.1.1".parse().unwrap()];
    let routes = show(&leader.route_plan(&o));
    assert_has_route(
        &routes,
        "10.42.2.0/24 via fd50::2 dev 2 src 10.42.1.1 onlink",
    );
}

#[test]
fn a_connecting_peer_routes_ipv6_pods_without_an_ipv4_gateway() {
    let nodes = dual_stack_pod_nodes();
    let peers = vec![crate::peer::Peer {
        name: "laptop".into(),
        allowed_ips: vec![
            "10.5.0.1/32".parse().unwrap(),
            "fd05::1/128".parse().unwrap(),
        ],
        public_key: Some(crate::key::Key::padded("laptop")),
        endpoint: None,
        persistent_keepalive: 0,
        preshared_key: None,
    }];
    let t = Topology::new(&nodes, &peers, &f1_params("a1", Granularity::Location)).unwrap();
    let plan = t.peer_routes("laptop", 9, &[]);
    let routes = show(&plan);
    assert_has_route(&routes, "fd42:3::/64 dev 9");
    assert_has_route(&routes, "fd42:2::/64 dev 9");
    assert!(
        routes
            .iter()
            .any(|r| r.starts_with("10.42.3.0/24 via 10.4.0.")),
        "{routes:?}"
    );
    for r in &plan.routes {
        if let Some(gw) = r.gateway {
            assert_eq!(gw.is_ipv4(), r.dst.addr().is_ipv4(), "{r:?}");
        }
    }
}
