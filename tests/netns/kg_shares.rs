//! Several active leaders per location (`--leaders-per-location`), file backend, network
//! namespaces: each location's nodes split into shares, each share reached through its own
//! leader, two locations of two leaders joined by four tunnels.

use crate::common;
use control::journal::Reason;

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
#[ignore = "needs root: network namespaces and TUN devices"]
fn two_leaders_per_location_carry_a_share_each_over_four_tunnels() {
    common::require_root("two_leaders_per_location_carry_a_share_each_over_four_tunnels");
    two_by_two(&["--encapsulate=never"]);
}

/// The same with IPIP inside each location (`--encapsulate=always`, Kilo's default; the
/// userspace IPIP device where the kernel has no ipip module): a follower reaches its
/// location's other share straight over IPIP, and that share's nodes take it.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn two_leaders_per_location_over_ipip_inside_each_location() {
    common::require_root("two_leaders_per_location_over_ipip_inside_each_location");
    two_by_two(&["--encapsulate=always"]);
}

/// The same with lease election: each location's lease holder is one of its leaders, the
/// next candidate by Kilo's preference the other.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn two_leaders_per_location_with_lease_election() {
    common::require_root("two_leaders_per_location_with_lease_election");
    let c = two_by_two(&["--encapsulate=never", "--leader-election=lease"]);
    for location in ["east", "west"] {
        let holder = c.lease_holder(location).expect("a lease holder");
        assert!(
            c.leading(&[&holder]).len() == 1,
            "{location}'s lease holder {holder} leads"
        );
    }
}

/// Eight nodes in two locations with `--leaders-per-location=2` and `extra`: meshed (every pod
/// reaches every pod, those of its location's other share too), two leaders a side, each with
/// the other side's two leaders as its peers, shares of two nodes.
fn two_by_two(extra: &[&str]) -> Cluster {
    let mut c = Cluster::with_nodes(&["east", "west"], &NODES);
    let mut flags = vec!["--leaders-per-location=2"];
    flags.extend(extra);
    for i in 0..NODES.len() {
        c.start_kg(i, &flags);
    }
    let meshed = c.wait_for(Duration::from_secs(60), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    let names: Vec<&str> = NODES.iter().map(|(n, _)| *n).collect();
    let leading = c.leading(&names);
    assert_eq!(leading.len(), 4, "{leading:?}");
    let key = |node: &str| c.node(node).wg("public-key").trim().to_string();
    for leader in &leading {
        let remote: Vec<&String> = leading.iter().filter(|l| l[..1] != leader[..1]).collect();
        let want: BTreeSet<String> = remote.iter().map(|r| key(r)).collect();
        assert_eq!(
            peers(&c, leader),
            want,
            "{leader}'s peers are the other location's leaders"
        );
    }
    // Each west share's pod CIDRs are the allowed IPs of exactly one of an east leader's peers:
    // every west node is in one share, and the shares are two of two nodes.
    let allowed = c.node(&leading[0]).wg("allowed-ips");
    let mut shares: Vec<usize> = Vec::new();
    for line in allowed.lines() {
        shares.push(
            (1..=4)
                .filter(|n| line.contains(&format!("10.42.{}.0/24", 4 + n)))
                .count(),
        );
    }
    assert_eq!(shares, [2, 2], "{allowed}");
    for follower in names.iter().filter(|n| !leading.iter().any(|l| l == *n)) {
        assert!(
            peers(&c, follower).is_empty(),
            "{follower} peers with no one"
        );
    }
    for node in &c.nodes {
        assert!(
            node.events_of(Reason::LeaderSharesLimited).is_empty(),
            "{}: {:?}",
            node.name,
            node.events()
        );
    }
    assert_eq!(c.annotations("e3")["kilotun.io/leader-shares"], "2");
    c
}

/// A node run without the flag (as Kilo's kg, which publishes none) holds the cluster at one
/// leader per location, and the others say so; the mesh works throughout.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_node_without_the_flag_holds_every_location_at_one_leader() {
    common::require_root("a_node_without_the_flag_holds_every_location_at_one_leader");
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
    // Said, naming the node that holds the cluster back and the number it runs with.
    let said = c.node("e1").events_of(Reason::LeaderSharesLimited);
    assert!(
        said.iter().any(|e| e.message.contains("w2 (1)")),
        "{said:?}"
    );
}
