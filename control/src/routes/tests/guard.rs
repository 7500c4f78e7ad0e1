//! The connected-network guard: an allowed-location-ips or Peer CIDR that contains or equals a
//! network the node is on is withheld, not routed into the mesh; and a CIDR two locations
//! claim is routed alike from everywhere.

use super::*;

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
