//! Several active leaders per location (`--leaders-per-location`), file backend, network
//! namespaces: each location's nodes split into shares, each share reached through its own
//! leader, two locations of two leaders joined by four tunnels.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::cluster::Cluster;

const NODES: [(&str, &str); 8] = [
    ("e1", "east"),
    ("e2", "east"),
    ("e3", "east"),
    ("e4", "east"),
    ("w1", "west"),
    ("w2", "west"),
    ("w3", "west"),
    ("w4", "west"),
];

/// The public keys of `node`'s WireGuard peers.
fn peers(c: &Cluster, node: &str) -> BTreeSet<String> {
    c.node(node)
        .wg("peers")
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

#[test]
fn two_leaders_per_location_carry_a_share_each_over_four_tunnels() {
    if !common::can_run("two_leaders_per_location_carry_a_share_each_over_four_tunnels") {
        return;
    }
    let mut c = Cluster::with_nodes(&["east", "west"], &NODES);
    for i in 0..NODES.len() {
        c.start_kg(i, &["--encapsulate=never", "--leaders-per-location=2"]);
    }
    let meshed = c.wait_for(Duration::from_secs(60), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    // By Kilo's order of preference (all private: by name), e1 and e2 lead east, w1 and w2 west.
    let names: Vec<&str> = NODES.iter().map(|(n, _)| *n).collect();
    assert_eq!(c.leading(&names), ["e1", "e2", "w1", "w2"]);
    let key = |node: &str| c.node(node).wg("public-key").trim().to_string();
    for (leader, remote) in [
        ("e1", ["w1", "w2"]),
        ("e2", ["w1", "w2"]),
        ("w1", ["e1", "e2"]),
        ("w2", ["e1", "e2"]),
    ] {
        let want: BTreeSet<String> = remote.iter().map(|r| key(r)).collect();
        assert_eq!(
            peers(&c, leader),
            want,
            "{leader}'s peers are the other location's leaders"
        );
    }
    // Each west share's pod CIDRs are the allowed IPs of exactly one of e1's peers: every west
    // node is in one share, and the shares are two of two nodes.
    let allowed = c.node("e1").wg("allowed-ips");
    let mut shares: Vec<usize> = Vec::new();
    for line in allowed.lines() {
        shares.push(
            (1..=4)
                .filter(|n| line.contains(&format!("10.42.{}.0/24", 4 + n)))
                .count(),
        );
    }
    assert_eq!(shares, [2, 2], "{allowed}");
    for follower in ["e3", "e4", "w3", "w4"] {
        assert!(
            peers(&c, follower).is_empty(),
            "{follower} peers with no one"
        );
    }
    for node in &c.nodes {
        assert!(
            !node
                .log_text()
                .contains("--leaders-per-location=2: 1 per location"),
            "{}: {}",
            node.name,
            node.log_text()
        );
    }
    assert_eq!(c.annotations("e3")["kilotun.io/leaders-per-location"], "2");
}

/// A node run without the flag (as Kilo's kg, which publishes none) holds the cluster at one
/// leader per location, and the others say so; the mesh works throughout.
#[test]
fn a_node_without_the_flag_holds_every_location_at_one_leader() {
    if !common::can_run("a_node_without_the_flag_holds_every_location_at_one_leader") {
        return;
    }
    let mut c = Cluster::with_nodes(&["east", "west"], &NODES[..6]);
    for i in 0..6 {
        let flags: &[&str] = if i == 5 {
            &["--encapsulate=never"]
        } else {
            &["--encapsulate=never", "--leaders-per-location=2"]
        };
        c.start_kg(i, flags);
    }
    let meshed = c.wait_for(Duration::from_secs(60), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    let names: Vec<&str> = NODES[..6].iter().map(|(n, _)| *n).collect();
    assert_eq!(c.leading(&names), ["e1", "w1"]);
    let said = "--leaders-per-location=2: 1 per location until every node runs with 2";
    let log = c.node("e1").log_text();
    assert!(log.contains(said) && log.contains("w2 (1)"), "{log}");
}
