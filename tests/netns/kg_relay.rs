//! End-to-end: two locations behind NAT (masquerading routers, keepalive set) that cannot reach
//! each other first, and one reachable location; the NATed locations' pods reach each other
//! through the reachable one, and their leaders have no peer for each other.

use crate::common;
use control::journal::Reason;

use std::time::{Duration, Instant};

use common::cluster::{kgctl_bin, Cluster, NodeSpec};
use common::pinger::Pinger;

const KEEPALIVE: (&str, &str) = ("kilo.squat.ai/persistent-keepalive", "5");

fn public_key(c: &Cluster, node: &str) -> String {
    c.node(node).wg("public-key").trim().to_string()
}

/// Cloud node c1 and homes h1 and h2, each behind its own masquerading router with the
/// annotation `keepalive`, every kg running, returned once every pod reaches every other (the
/// test fails if that takes over 60 s), with the routers' outside addresses.
fn cloud_and_two_nated_homes(keepalive: (&str, &str)) -> (Cluster, Vec<String>) {
    let mut c = Cluster::new(&["cloud", "home1", "home2"]);
    c.add_node(
        &NodeSpec {
            name: "c1",
            location: "cloud",
            annotations: &[],
        },
        1,
    );
    let mut outside = Vec::new();
    for (i, (name, location)) in [("h1", "home1"), ("h2", "home2")].into_iter().enumerate() {
        let (_, nat) = c.add_nated_node(
            &NodeSpec {
                name,
                location,
                annotations: &[keepalive],
            },
            i as u8 + 2,
        );
        outside.push(nat);
    }
    for i in 0..3 {
        c.start_kg(i, &["--encapsulate=never"]);
    }
    let meshed = c.wait_for(Duration::from_secs(60), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    (c, outside)
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn locations_behind_nat_reach_each_other_through_a_relay() {
    common::require_root("locations_behind_nat_reach_each_other_through_a_relay");
    let (c, _) = cloud_and_two_nated_homes(KEEPALIVE);

    // The homes peer only with the cloud; the cloud with both.
    let peers = |node: &str| -> Vec<String> {
        let mut keys: Vec<String> = c
            .node(node)
            .wg("peers")
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect();
        keys.sort();
        keys
    };
    assert_eq!(peers("h1"), [public_key(&c, "c1")], "{}", c.logs());
    assert_eq!(peers("h2"), [public_key(&c, "c1")], "{}", c.logs());
    let mut both = vec![public_key(&c, "h1"), public_key(&c, "h2")];
    both.sort();
    assert_eq!(peers("c1"), both);
    // h1's pods reach h2's through c1: the cloud's peer on h1 carries h2's pod CIDR.
    let allowed = c.node("h1").wg("allowed-ips");
    assert!(allowed.contains("10.42.3.0/24"), "{allowed}");
    // kgctl draws the relayed link.
    let dir = format!("--cluster-dir={}", c.dir.display());
    let graph = common::run(&[kgctl_bin(), "--backend=file", &dir, "graph"]);
    assert!(graph.contains("label=\"via c1\""), "{graph}");
}

/// `force-endpoint: "-"`: no endpoint at all.
const NO_ENDPOINT: (&str, &str) = ("kilo.squat.ai/force-endpoint", "-");

/// Cloud node c1 and home node h1 behind a masquerading router, h1 annotated `home`, both
/// running kg with `--resync-period=<resync>`. Returns the cluster and the router's outside
/// address.
fn cloud_and_endpointless_home(home: &[(&str, &str)], resync: &str) -> (Cluster, String) {
    let mut c = Cluster::new(&["cloud", "home"]);
    c.add_node(
        &NodeSpec {
            name: "c1",
            location: "cloud",
            annotations: &[],
        },
        1,
    );
    let (_, outside) = c.add_nated_node(
        &NodeSpec {
            name: "h1",
            location: "home",
            annotations: home,
        },
        2,
    );
    let resync = format!("--resync-period={resync}");
    for i in 0..2 {
        c.start_kg(i, &["--encapsulate=never", &resync]);
    }
    (c, outside)
}

/// A home node that announces no endpoint at all (`force-endpoint: "-"`) but keeps alive: the
/// cloud has no endpoint for it until its first handshake, then answers where it came from.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_node_with_no_endpoint_is_reached_where_its_handshakes_come_from() {
    common::require_root("a_node_with_no_endpoint_is_reached_where_its_handshakes_come_from");
    let (c, outside) = cloud_and_endpointless_home(&[KEEPALIVE, NO_ENDPOINT], "2s");
    let meshed = c.wait_for(Duration::from_secs(60), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());

    // h1 announces nothing; the cloud uses the NAT router's address its handshakes came from.
    let h1 = std::fs::read_to_string(c.dir.join("h1.yaml")).unwrap();
    let value: serde_json::Value = serde_saphyr::from_str(&h1).unwrap();
    let announced = value["metadata"]["annotations"]["kilo.squat.ai/endpoint"]
        .as_str()
        .unwrap_or("");
    assert_eq!(announced, "", "{h1}");
    let endpoints = c.node("c1").wg("endpoints");
    let line = endpoints
        .lines()
        .find(|l| l.starts_with(&public_key(&c, "h1")))
        .unwrap_or_default()
        .to_string();
    assert!(
        line.contains(&format!("{outside}:")),
        "{endpoints} (router {outside})"
    );

    // Said once, as information, over several resyncs; nothing about it is a warning.
    std::thread::sleep(Duration::from_secs(6));
    let said: Vec<_> = c
        .node("c1")
        .events_of(Reason::NoEndpoint)
        .into_iter()
        .filter(|e| e.message.contains("node h1 "))
        .collect();
    assert_eq!(said.len(), 1, "{said:?}");
    assert_eq!(
        said[0].kind,
        control::journal::EventKind::Normal,
        "{said:?}"
    );
    for node in ["c1", "h1"] {
        let log = c.node(node).log_text();
        let bad: Vec<&str> = log
            .lines()
            .filter(|l| (l.contains("WARN") || l.contains("ERROR")) && l.contains("endpoint"))
            .collect();
        assert!(bad.is_empty(), "{node}: {bad:?}");
    }
}

/// Without a keepalive, a node with no endpoint could never be reached first: it stays out of
/// the mesh and says why.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_node_with_no_endpoint_and_no_keepalive_says_why_it_stays_out() {
    common::require_root("a_node_with_no_endpoint_and_no_keepalive_says_why_it_stays_out");
    let (c, _) = cloud_and_endpointless_home(&[NO_ENDPOINT], "30s");
    let said = c.wait_for(Duration::from_secs(20), |c| {
        c.node("h1")
            .events_of(Reason::NotReady)
            .iter()
            .any(|e| e.subject == "h1" && e.message.contains("kilo.squat.ai/persistent-keepalive"))
    });
    assert!(said, "{}", c.logs());
    assert!(c.node("c1").wg("peers").trim().is_empty(), "{}", c.logs());
}

/// The endpoint `on`'s WireGuard device uses for `peer`'s key.
fn endpoint_for(c: &Cluster, on: &str, peer: &str) -> String {
    let key = public_key(c, peer);
    c.node(on)
        .wg("endpoints")
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}\t")).map(str::to_string))
        .unwrap_or_default()
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_restarted_hub_keeps_the_endpoints_it_learned_from_its_nated_homes() {
    common::require_root("a_restarted_hub_keeps_the_endpoints_it_learned_from_its_nated_homes");
    // Two homes behind their own NAT routers reach each other only through the cloud's hub,
    // which knows them only by the NAT addresses their packets came from. A keepalive of 15 s
    // means a hub that forgot them would wait up to 15 s for a home to teach it again.
    let (mut c, outside) = cloud_and_two_nated_homes(("kilo.squat.ai/persistent-keepalive", "15"));
    let learned = |c: &Cluster| {
        endpoint_for(c, "c1", "h1").starts_with(&format!("{}:", outside[0]))
            && endpoint_for(c, "c1", "h2").starts_with(&format!("{}:", outside[1]))
    };
    let published = |c: &Cluster| {
        let value = c
            .annotations("c1")
            .get("kilo.squat.ai/discovered-endpoints")
            .cloned()
            .unwrap_or_default();
        outside
            .iter()
            .all(|ip| value.contains(&format!("\"IP\":\"{ip}\"")))
    };
    let ready = c.wait_for(Duration::from_secs(20), |c| learned(c) && published(c));
    assert!(ready, "{:?}\n{}", c.annotations("c1"), c.logs());

    // h1 pings h2's pod through the hub while the hub's kg is killed and started again.
    let pinger = Pinger::start(&c.node("h1").ns.name, &c.node("h2").pod_ip);
    assert!(
        pinger.wait_flowing(Instant::now(), Duration::from_secs(10)),
        "{}",
        c.logs()
    );
    std::thread::sleep(Duration::from_secs(1));
    let killed = Instant::now();
    c.nodes[0].kill();
    c.start_kg(0, &["--encapsulate=never"]);
    let back = pinger.wait_flowing(killed, Duration::from_secs(30));
    // The restarted hub still sends to the homes' NAT addresses and publishes them, at once
    // and after its first resyncs (which read the device again).
    let kept = c.wait_for(Duration::from_secs(3), |c| c.node("c1").status().is_some());
    assert!(kept, "{}", c.logs());
    for _ in 0..3 {
        assert!(
            learned(&c),
            "{} {}\n{}",
            endpoint_for(&c, "c1", "h1"),
            endpoint_for(&c, "c1", "h2"),
            c.logs()
        );
        assert!(published(&c), "{:?}\n{}", c.annotations("c1"), c.logs());
        std::thread::sleep(Duration::from_secs(1));
    }
    assert_restart_gap(
        &c,
        &pinger,
        killed,
        back,
        "restart of the hub: relayed traffic",
    );

    // Then the answering home behind its NAT: its next kg restores the hub as its peer and
    // handshakes at once, through the same NAT mapping.
    let h2 = c.nodes.iter().position(|n| n.name == "h2").unwrap();
    let killed = Instant::now();
    c.nodes[h2].kill();
    c.start_kg(h2, &["--encapsulate=never"]);
    let back = pinger.wait_flowing(killed, Duration::from_secs(30));
    assert_restart_gap(
        &c,
        &pinger,
        killed,
        back,
        "restart of the answering home behind NAT: traffic",
    );
}

/// After a restart at `killed` (traffic `back` or not): lets late disturbances show for 3 s,
/// prints the longest gap as `what` … back after a gap of …, and bounds it at 1.5 s.
fn assert_restart_gap(c: &Cluster, pinger: &Pinger, killed: Instant, back: bool, what: &str) {
    std::thread::sleep(Duration::from_secs(3));
    let gap = pinger.longest_gap_after(killed);
    eprintln!("{what} back after a gap of {:.1} s", gap.as_secs_f64());
    assert!(back, "traffic never came back\n{}", c.logs());
    assert!(
        gap <= Duration::from_millis(1500),
        "gap {gap:?}\n{}",
        c.logs()
    );
}

/// Two leaders per location, the cloud with two nodes and each home one node behind its own
/// NAT: the cloud's two shares both peer with each home, the homes reach each other through
/// one cloud leader (the relay), and every pod reaches every other.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn homes_behind_nat_are_relayed_by_one_of_the_clouds_two_leaders() {
    common::require_root("homes_behind_nat_are_relayed_by_one_of_the_clouds_two_leaders");
    let mut c = Cluster::new(&["cloud", "home1", "home2"]);
    for (name, index) in [("c1", 1), ("c2", 4)] {
        c.add_node(
            &NodeSpec {
                name,
                location: "cloud",
                annotations: &[],
            },
            index,
        );
    }
    for (i, (name, location)) in [("h1", "home1"), ("h2", "home2")].into_iter().enumerate() {
        c.add_nated_node(
            &NodeSpec {
                name,
                location,
                annotations: &[KEEPALIVE],
            },
            i as u8 + 2,
        );
    }
    for i in 0..4 {
        c.start_kg(i, &["--encapsulate=never", "--leaders-per-location=2"]);
    }
    let meshed = c.wait_for(Duration::from_secs(60), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    assert_eq!(
        c.leading(&["c1", "c2", "h1", "h2"]),
        ["c1", "c2", "h1", "h2"]
    );
    let mut cloud = vec![public_key(&c, "c1"), public_key(&c, "c2")];
    cloud.sort();
    for home in ["h1", "h2"] {
        let mut peers: Vec<String> = c
            .node(home)
            .wg("peers")
            .lines()
            .map(str::to_string)
            .collect();
        peers.sort();
        assert_eq!(
            peers,
            cloud,
            "{home} peers with both cloud leaders\n{}",
            c.logs()
        );
    }
    // h2's pods (10.42.3.0/24) are on exactly one of h1's cloud peers: its relay.
    let allowed = c.node("h1").wg("allowed-ips");
    let relays: Vec<&str> = allowed
        .lines()
        .filter(|l| l.contains("10.42.3.0/24"))
        .collect();
    assert_eq!(relays.len(), 1, "{allowed}");
    assert!(
        cloud.iter().any(|k| relays[0].starts_with(k.as_str())),
        "{allowed}"
    );
}
