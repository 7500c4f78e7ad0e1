//! End-to-end: two locations behind NAT (masquerading routers, keepalive set) that cannot reach
//! each other first, and one reachable location; the NATed locations' pods reach each other
//! through the reachable one, and their leaders have no peer for each other.

mod common;

use std::time::Duration;

use common::cluster::{kgctl_bin, Cluster, NodeSpec};

const KEEPALIVE: (&str, &str) = ("kilo.squat.ai/persistent-keepalive", "5");

fn public_key(c: &Cluster, node: &str) -> String {
    c.node(node).wg("public-key").trim().to_string()
}

#[test]
fn locations_behind_nat_reach_each_other_through_a_relay() {
    if !common::can_run("locations_behind_nat_reach_each_other_through_a_relay") {
        return;
    }
    let mut c = Cluster::new(&["cloud", "home1", "home2"]);
    c.add_node(
        &NodeSpec {
            name: "c1",
            location: "cloud",
            annotations: &[],
        },
        1,
    );
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
    for i in 0..3 {
        c.start_kg(i, &["--encapsulate=never"]);
    }
    let meshed = c.wait_for(Duration::from_secs(60), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());

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
fn a_node_with_no_endpoint_is_reached_where_its_handshakes_come_from() {
    if !common::can_run("a_node_with_no_endpoint_is_reached_where_its_handshakes_come_from") {
        return;
    }
    let (c, outside) = cloud_and_endpointless_home(&[KEEPALIVE, NO_ENDPOINT], "2s");
    let meshed = c.wait_for(Duration::from_secs(60), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());

    // h1 announces nothing; the cloud uses the NAT router's address its handshakes came from.
    let h1 = std::fs::read_to_string(c.dir.join("h1.yaml")).unwrap();
    let value: serde_yaml::Value = serde_yaml::from_str(&h1).unwrap();
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
    let log = c.node("c1").log_text();
    let said: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("node h1 announces no endpoint"))
        .collect();
    assert_eq!(said.len(), 1, "{log}");
    assert!(said[0].contains("INFO"), "{}", said[0]);
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
fn a_node_with_no_endpoint_and_no_keepalive_says_why_it_stays_out() {
    if !common::can_run("a_node_with_no_endpoint_and_no_keepalive_says_why_it_stays_out") {
        return;
    }
    let (c, _) = cloud_and_endpointless_home(&[NO_ENDPOINT], "30s");
    let said = c.wait_for(Duration::from_secs(20), |c| {
        c.node("h1")
            .log_text()
            .contains("needs kilo.squat.ai/persistent-keepalive")
    });
    assert!(said, "{}", c.logs());
    assert!(c.node("c1").wg("peers").trim().is_empty(), "{}", c.logs());
}
