//! Kilo's `TestNewTopology` (AV-1, AV-2), `TestFindLeader` and `TestDeduplicatePeerIPs`
//! vectors, plus allowed-location-ip filtering.

use super::*;
use crate::fixtures::{f1_nodes, f1_params, f1_peers, node};

fn net(text: &str) -> IpNet {
    text.parse().unwrap()
}

fn nets(texts: &[&str]) -> Vec<IpNet> {
    texts.iter().map(|t| net(t)).collect()
}

fn params(hostname: &str, granularity: Granularity) -> TopologyParams {
    f1_params(hostname, granularity)
}

fn topology(hostname: &str, granularity: Granularity) -> Topology {
    Topology::new(&f1_nodes(), &f1_peers(), &params(hostname, granularity)).unwrap()
}

#[test]
fn location_granularity_matches_av1_from_every_view() {
    for host in ["a", "b", "c", "d"] {
        let t = topology(host, Granularity::Location);
        let keys: Vec<&str> = t.segments.iter().map(|s| s.key.as_str()).collect();
        assert_eq!(keys, ["location:1", "location:2", "node:d"], "view {host}");
        let s = &t.segments;
        assert_eq!(s[0].leader_member().name, "a");
        assert_eq!(s[0].wireguard_ip.to_string(), "10.4.0.1");
        assert_eq!(
            s[0].allowed_ips,
            nets(&["10.2.1.0/24", "192.168.0.1/32", "10.4.0.1/32"])
        );
        assert!(s[0].allowed_location_ips.is_empty());
        assert_eq!(
            s[0].endpoint.as_ref().unwrap().to_string(),
            "10.1.0.1:51820"
        );
        assert_eq!(s[0].public_key, Key::padded("key1"));

        let members: Vec<&str> = s[1].members.iter().map(|m| m.name.as_str()).collect();
        assert_eq!(members, ["b", "c"]);
        assert_eq!(s[1].leader_member().name, "b");
        assert_eq!(s[1].wireguard_ip.to_string(), "10.4.0.2");
        assert_eq!(
            s[1].allowed_ips,
            nets(&[
                "10.2.2.0/24",
                "192.168.0.1/32",
                "10.2.3.0/24",
                "192.168.0.2/32",
                "10.4.0.2/32"
            ])
        );
        assert_eq!(s[1].allowed_location_ips, nets(&["192.168.178.3/32"]));
        let private: Vec<String> = s[1].private_ips().map(|i| i.to_string()).collect();
        assert_eq!(private, ["192.168.0.1", "192.168.0.2"]);
        assert_eq!(s[1].public_key, Key::padded("key2"));

        assert_eq!(s[2].leader_member().name, "d");
        assert_eq!(s[2].wireguard_ip.to_string(), "10.4.0.3");
        assert_eq!(s[2].allowed_ips, nets(&["10.2.4.0/24", "10.4.0.3/32"]));
        assert_eq!(s[2].private_ips().count(), 0);
        assert_eq!(s[2].public_key, Key::padded("key4"));

        let peer_names: Vec<&str> = t.peers.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(peer_names, ["a", "b"]);
        assert_eq!(
            t.peers[0].allowed_ips,
            nets(&["10.5.0.1/24", "10.5.0.2/24"])
        );
    }
}

#[test]
fn location_views_match_av1() {
    let cases = [
        (
            "a",
            "location:1",
            true,
            "10.4.0.1/16",
            Some("192.168.0.1/32"),
            "10.2.1.0/24",
        ),
        (
            "b",
            "location:2",
            true,
            "10.4.0.2/16",
            Some("192.168.0.1/32"),
            "10.2.2.0/24",
        ),
        (
            "c",
            "location:2",
            false,
            "10.4.0.0/16",
            Some("192.168.0.2/32"),
            "10.2.3.0/24",
        ),
        ("d", "node:d", true, "10.4.0.3/16", None, "10.2.4.0/24"),
    ];
    for (host, location, leader, cidr, private, subnet) in cases {
        let t = topology(host, Granularity::Location);
        assert_eq!(t.location, location, "{host}");
        assert_eq!(t.leader, leader, "{host}");
        assert_eq!(t.wireguard_cidr, net(cidr), "{host}");
        assert_eq!(t.private_ip, private.map(net), "{host}");
        assert_eq!(t.subnet, net(subnet), "{host}");
    }
}

#[test]
fn full_granularity_matches_av2() {
    for (i, host) in ["a", "b", "c", "d"].iter().enumerate() {
        let t = topology(host, Granularity::Full);
        let keys: Vec<&str> = t.segments.iter().map(|s| s.key.as_str()).collect();
        assert_eq!(keys, ["node:a", "node:b", "node:c", "node:d"]);
        assert!(t.leader);
        assert_eq!(t.wireguard_cidr, net(&format!("10.4.0.{}/16", i + 1)));
        let s = &t.segments;
        assert_eq!(
            s[0].allowed_ips,
            nets(&["10.2.1.0/24", "192.168.0.1/32", "10.4.0.1/32"])
        );
        assert_eq!(
            s[1].allowed_ips,
            nets(&["10.2.2.0/24", "192.168.0.1/32", "10.4.0.2/32"])
        );
        assert_eq!(s[1].allowed_location_ips, nets(&["192.168.178.3/32"]));
        assert_eq!(
            s[2].allowed_ips,
            nets(&["10.2.3.0/24", "192.168.0.2/32", "10.4.0.3/32"])
        );
        assert_eq!(s[3].allowed_ips, nets(&["10.2.4.0/24", "10.4.0.4/32"]));
        assert_eq!(t.private_ip.is_none(), *host == "d");
    }
}

#[test]
fn find_leader_matches_kilos_vectors() {
    let n0 = node("a", "10.0.0.1:51820", None, "", "10.2.0.0/24", "k");
    let n1 = node("b", "8.8.8.8:51820", None, "", "10.2.0.0/24", "k");
    let n2 = node("c", "8.8.8.8:51820", None, "", "10.2.0.0/24", "k");
    let mut n3 = node("d", "10.0.0.1:51820", None, "", "10.2.0.0/24", "k");
    n3.leader = true;
    let mut n4 = node("2", "8.8.8.8:51820", None, "", "10.2.0.0/24", "k");
    n4.leader = true;
    assert_eq!(find_leader(&[]), 0);
    assert_eq!(find_leader(&[&n0]), 0);
    assert_eq!(find_leader(&[&n0, &n1, &n2]), 1);
    assert_eq!(find_leader(&[&n3, &n4]), 1);
    assert_eq!(find_leader(&[&n1, &n2, &n4]), 2);
    assert_eq!(find_leader(&[&n0, &n3]), 1);
    assert_eq!(find_leader(&[&n0, &n1, &n2, &n3, &n4]), 4);
}

fn peer(name: &str, ips: &[&str]) -> Peer {
    Peer {
        name: name.into(),
        allowed_ips: nets(ips),
        public_key: Some(Key::padded(name)),
        endpoint: None,
        persistent_keepalive: 0,
        preshared_key: None,
    }
}

#[test]
fn peer_ip_dedupe_matches_kilos_vectors() {
    let p1 = peer("p1", &["10.0.0.1/24", "10.0.0.2/24"]);
    let p2 = peer("p2", &["10.0.0.1/24", "10.0.0.3/24"]);
    let p3 = peer("p3", &["10.0.0.2/24", "10.0.0.3/24", "10.0.0.1/24"]);
    let p4 = peer("p4", &["10.0.0.3/24", "10.0.0.3/24"]);
    let ips = |peers: &[Peer]| -> Vec<Vec<IpNet>> {
        deduplicate_peer_ips(peers)
            .0
            .into_iter()
            .map(|p| p.allowed_ips)
            .collect()
    };
    assert!(ips(&[]).is_empty());
    assert_eq!(
        ips(&[p1.clone(), p2.clone()]),
        vec![p1.allowed_ips.clone(), nets(&["10.0.0.3/24"])]
    );
    assert_eq!(
        ips(&[p2.clone(), p1.clone()]),
        vec![p2.allowed_ips.clone(), nets(&["10.0.0.2/24"])]
    );
    assert_eq!(
        ips(&[p3.clone(), p2, p1.clone(), p4.clone()]),
        vec![p3.allowed_ips, vec![], vec![], vec![]]
    );
    assert_eq!(
        ips(&[p4, p1.clone()]),
        vec![nets(&["10.0.0.3/24"]), p1.allowed_ips]
    );
}

#[test]
fn allowed_location_ips_that_clash_are_dropped() {
    let mut nodes = f1_nodes();
    // a (location 1) claims b's LAN IP and a peer's range; c (location 2) claims a pod CIDR.
    nodes[0].allowed_location_ips = nets(&["192.168.178.0/24", "10.5.0.0/16", "172.30.0.0/16"]);
    nodes[2].allowed_location_ips = nets(&["10.2.1.5/32", "172.31.0.0/16"]);
    let t = Topology::new(&nodes, &f1_peers(), &params("a", Granularity::Location)).unwrap();
    assert_eq!(t.segments[0].allowed_location_ips, nets(&["172.30.0.0/16"]));
    // a's /24 was dropped first, so b's /32 no longer clashes with anything (order matters).
    assert_eq!(
        t.segments[1].allowed_location_ips,
        nets(&["172.31.0.0/16", "192.168.178.3/32"])
    );
    let dropped: Vec<String> = t.dropped.iter().map(|d| d.cidr.to_string()).collect();
    assert!(
        dropped.contains(&"192.168.178.0/24".to_string()),
        "{dropped:?}"
    );
    assert!(dropped.contains(&"10.5.0.0/16".to_string()));
    assert!(dropped.contains(&"10.2.1.5/32".to_string()));
}

#[test]
fn an_allowed_location_ip_may_contain_a_private_node_ip() {
    let mut nodes = f1_nodes();
    nodes[0].allowed_location_ips = nets(&["192.168.0.0/16"]);
    nodes[1].allowed_location_ips.clear();
    let t = Topology::new(&nodes, &[], &params("a", Granularity::Location)).unwrap();
    assert_eq!(
        t.segments[0].allowed_location_ips,
        nets(&["192.168.0.0/16"])
    );
}

#[test]
fn a_public_endpoint_or_annotation_moves_leadership() {
    let mut nodes = f1_nodes();
    nodes[2].endpoint = Some(Endpoint::parse("8.8.8.8:51820").unwrap());
    let t = Topology::new(&nodes, &[], &params("c", Granularity::Location)).unwrap();
    assert!(t.leader);
    assert_eq!(t.segments[1].public_key, Key::padded("key3"));
    assert_eq!(
        t.segments[1].endpoint.as_ref().unwrap().to_string(),
        "8.8.8.8:51820"
    );
    nodes[1].leader = true;
    let t = Topology::new(&nodes, &[], &params("c", Granularity::Location)).unwrap();
    assert!(
        !t.leader,
        "an annotated private node beats an unannotated public one"
    );
}

#[test]
fn discovered_endpoints_prefer_the_local_node_then_segment_order() {
    let mut nodes = f1_nodes();
    let k = Key::padded("nat");
    nodes[1]
        .discovered_endpoints
        .insert(k, "1.1.1.1:1".parse().unwrap());
    nodes[0]
        .discovered_endpoints
        .insert(k, "2.2.2.2:2".parse().unwrap());
    let t = Topology::new(&nodes, &[], &params("c", Granularity::Location)).unwrap();
    assert_eq!(
        t.discovered_endpoints[&k],
        "2.2.2.2:2".parse().unwrap(),
        "segment location:1 first"
    );
    let t = Topology::new(&nodes, &[], &params("b", Granularity::Location)).unwrap();
    assert_eq!(
        t.discovered_endpoints[&k],
        "1.1.1.1:1".parse().unwrap(),
        "the local node first"
    );
}

#[test]
fn subnet_exhaustion_and_missing_local_node_are_errors() {
    let mut p = params("a", Granularity::Full);
    p.subnet = net("10.4.0.0/31");
    assert!(matches!(
        Topology::new(&f1_nodes(), &[], &p),
        Err(TopologyError::SubnetExhausted { .. })
    ));
    assert_eq!(
        Topology::new(&f1_nodes(), &[], &params("zz", Granularity::Full)),
        Err(TopologyError::NoLocalNode("zz".into()))
    );
}

#[test]
fn the_result_does_not_depend_on_input_order() {
    let mut nodes = f1_nodes();
    let forward = Topology::new(&nodes, &f1_peers(), &params("c", Granularity::Location)).unwrap();
    nodes.reverse();
    let mut peers = f1_peers();
    peers.reverse();
    let backward = Topology::new(&nodes, &peers, &params("c", Granularity::Location)).unwrap();
    assert_eq!(forward, backward);
}

/// Fixture F1 with every node given a private IP, so the nodes of a location can reach each
/// other directly (what `cross` needs).
fn cross_nodes() -> Vec<Node> {
    let mut nodes = crate::fixtures::f1_nodes();
    for (i, n) in nodes.iter_mut().enumerate() {
        n.internal_ip = Some(net(&format!("192.168.{}.{}/24", n.location, i + 1)));
        n.persistent_keepalive = 0;
    }
    nodes
}

#[test]
fn cross_peers_only_with_other_locations() {
    // F1: location 1 holds a and d, location 2 holds b and c.
    let nodes = cross_nodes();
    for (host, expected) in [
        ("a", ["b", "c"]),
        ("d", ["b", "c"]),
        ("b", ["a", "d"]),
        ("c", ["a", "d"]),
    ] {
        let t = Topology::new(&nodes, &[], &params(host, Granularity::Cross)).unwrap();
        assert!(t.leader, "{host} leads its own segment");
        assert_eq!(t.segments.len(), 4, "one segment per node");
        let keys: Vec<Key> = t.conf(None).peers.iter().map(|p| p.public_key).collect();
        let names: Vec<&str> = t
            .segments
            .iter()
            .filter(|s| keys.contains(&s.public_key))
            .map(|s| s.leader_member().name.as_str())
            .collect();
        assert_eq!(names, expected, "{host}");
    }
    // Kilo's e2e count: two nodes in one location and one in the other give 1, 1 and 2 peers.
    let three: Vec<Node> = nodes.iter().filter(|n| n.name != "d").cloned().collect();
    let counts: Vec<usize> = ["a", "b", "c"]
        .iter()
        .map(|h| {
            Topology::new(&three, &[], &params(h, Granularity::Cross))
                .unwrap()
                .conf(None)
                .peers
                .len()
        })
        .collect();
    assert_eq!(counts, [2, 1, 1]);
}

#[test]
fn cross_routes_its_own_location_directly_and_others_through_wireguard() {
    use crate::routes::{Compatibility, Encapsulate, Links, RouteOptions};
    let nodes = cross_nodes();
    let t = Topology::new(&nodes, &[], &params("a", Granularity::Cross)).unwrap();
    let plan = t.route_plan(&RouteOptions {
        kilo_name: "kilo0".into(),
        links: Links {
            kilo: 1,
            private: 2,
            tunnel: 3,
            tunnel6: 0,
        },
        local: true,
        encapsulate: Encapsulate::Never,
        compatibility: Compatibility::Ipip,
        pod_sources: Vec::new(),
        ipip_over_ipv6: false,
    });
    let via = |dst: &str| -> Vec<(Option<IpAddr>, u32)> {
        plan.routes
            .iter()
            .filter(|r| r.dst == net(dst))
            .map(|r| (r.gateway, r.link))
            .collect()
    };
    // d (same location): its pods through its private IP on the private link.
    assert_eq!(
        via("10.2.4.0/24"),
        [(Some("192.168.1.4".parse().unwrap()), 2)]
    );
    // b and c (the other location): through each one's own WireGuard IP.
    let b = t.segments.iter().find(|s| s.key == "node:b").unwrap();
    assert_eq!(via("10.2.2.0/24"), [(Some(b.wireguard_ip), 1)]);
    assert_eq!(via("10.2.3.0/24").len(), 1);
    assert_eq!(via("10.2.3.0/24")[0].1, 1);
    // No route to d's WireGuard IP: there is no tunnel to it.
    let d = t.segments.iter().find(|s| s.key == "node:d").unwrap();
    assert!(via(&format!("{}/32", d.wireguard_ip)).is_empty());
    // The graph has no edge between a and d.
    let dot = t.dot();
    assert!(
        !dot.contains("\"a\" -> \"d\"") && dot.contains("\"a\" -> \"b\""),
        "{dot}"
    );
}

#[test]
fn cross_is_written_and_read_as_cross() {
    assert_eq!(Granularity::parse("cross"), Some(Granularity::Cross));
    assert_eq!(Granularity::Cross.as_str(), "cross");
}

/// Two homes behind NAT (keepalive set) and one reachable cloud location, one node each.
fn homes_and_cloud() -> Vec<Node> {
    let mut h1 = node(
        "h1",
        "10.99.1.2:51820",
        Some("10.99.1.2/24"),
        "home1",
        "10.42.1.0/24",
        "kh1",
    );
    let mut h2 = node(
        "h2",
        "10.99.2.2:51820",
        Some("10.99.2.2/24"),
        "home2",
        "10.42.2.0/24",
        "kh2",
    );
    let c1 = node(
        "c1",
        "192.168.30.1:51820",
        Some("192.168.30.1/24"),
        "cloud",
        "10.42.3.0/24",
        "kc1",
    );
    h1.persistent_keepalive = 5;
    h2.persistent_keepalive = 5;
    vec![h1, h2, c1]
}

fn peer_ips(t: &Topology, key: &str) -> Option<Vec<String>> {
    t.conf(None)
        .peers
        .iter()
        .find(|p| p.public_key == Key::padded(key))
        .map(|p| p.allowed_ips.iter().map(ToString::to_string).collect())
}

#[test]
fn two_locations_behind_nat_talk_through_a_reachable_one() {
    let nodes = homes_and_cloud();
    let mut p = params("h1", Granularity::Location);
    p.persistent_keepalive = 5;
    let h1 = Topology::new(&nodes, &[], &p).unwrap();
    // No peer for the other home: its addresses ride on the cloud's peer.
    assert_eq!(peer_ips(&h1, "kh2"), None);
    let cloud = peer_ips(&h1, "kc1").unwrap();
    assert!(cloud.contains(&"10.42.2.0/24".to_string()), "{cloud:?}");
    assert!(cloud.contains(&"10.42.3.0/24".to_string()), "{cloud:?}");
    // The cloud (reachable) peers with both homes directly and forwards between them.
    let c1 = Topology::new(&nodes, &[], &params("c1", Granularity::Location)).unwrap();
    assert_eq!(
        peer_ips(&c1, "kh1").unwrap(),
        ["10.42.1.0/24", "10.99.1.2/32", "10.4.0.2/32"]
    );
    assert!(peer_ips(&c1, "kh2").is_some());
    // The graph shows the relayed link.
    assert!(
        h1.dot()
            .contains("\"h1\" -> \"h2\" [dir=both, style=dotted, label=\"via c1\"]"),
        "{}",
        h1.dot()
    );
}

#[test]
fn a_relay_annotation_pins_which_locations_may_relay() {
    let mut nodes = homes_and_cloud();
    let mut c2 = node(
        "c2",
        "192.168.40.1:51820",
        Some("192.168.40.1/24"),
        "cloud2",
        "10.42.4.0/24",
        "kc2",
    );
    c2.relay = true;
    nodes.push(c2);
    let mut p = params("h1", Granularity::Location);
    p.persistent_keepalive = 5;
    let h1 = Topology::new(&nodes, &[], &p).unwrap();
    // cloud sorts first, but only cloud2 is marked.
    assert!(peer_ips(&h1, "kc2")
        .unwrap()
        .contains(&"10.42.2.0/24".to_string()));
    assert!(!peer_ips(&h1, "kc1")
        .unwrap()
        .contains(&"10.42.2.0/24".to_string()));
    // Without any reachable location, the homes stay direct peers, as in Kilo.
    let only_homes: Vec<Node> = homes_and_cloud().into_iter().take(2).collect();
    let h1 = Topology::new(&only_homes, &[], &p).unwrap();
    assert!(peer_ips(&h1, "kh2").is_some());
}
