//! Route plans for fixture F1 from leaders and non-leaders, with and without encapsulation,
//! in a full mesh, and for a connecting Peer.

use super::*;

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
