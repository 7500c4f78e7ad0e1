//! End-to-end: pods from Calico's IPAM (`--ipam=calico`), file backend, network namespaces.
//! The Nodes' own `spec.podCIDR`s (`10.42.<n>.0/24`) are not where the pods live: Calico's
//! `BlockAffinity` documents give each node a /26 of `10.60.0.0/16`, and an address on each
//! node's pod bridge stands in for a pod in it. kg routes the blocks, follows a node taking a
//! second block and releasing it, and routes an address Calico lent out of one node's block
//! to the node whose pod holds it, each change by the allowed IPs of one peer, whose session
//! stays.

use crate::common;

use std::time::Duration;

use common::calico::{self, block_affinity, lent_address};
use common::cluster::Cluster;

/// A ping from `from`'s namespace, from `source`, to `to`: answered or not.
fn answers(c: &Cluster, from: &str, source: &str, to: &str) -> bool {
    common::ping_from_ok(
        &c.node(from).ns.name,
        Some(source),
        to,
        Duration::from_secs(2),
    )
}

/// The allowed IPs of `node`'s peer whose allowed IPs include `marker`, on `node`'s device.
fn allowed_ips_with(c: &Cluster, node: &str, marker: &str) -> String {
    calico::allowed_ips_with(c.node(node), marker)
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn pods_in_calicos_blocks_are_routed_and_each_block_change_touches_one_peer() {
    common::require_root(
        "pods_in_calicos_blocks_are_routed_and_each_block_change_touches_one_peer",
    );
    let mut c = Cluster::with_nodes(
        &["east", "west"],
        &[("n1", "east"), ("n2", "east"), ("n3", "west")],
    );
    for n in 1..=3 {
        c.nodes[n - 1].ns.run(&[
            "ip",
            "addr",
            "add",
            &format!("10.60.{n}.1/26"),
            "dev",
            "pods0",
        ]);
        let block = block_affinity(&format!("n{n}"), &format!("10.60.{n}.0/26"));
        std::fs::write(c.dir.join(format!("block-n{n}.yaml")), block).unwrap();
    }
    for i in 0..3 {
        c.start_kg(i, &["--encapsulate=never", "--ipam=calico"]);
    }
    let pods = [
        ("n1", "10.60.1.1"),
        ("n2", "10.60.2.1"),
        ("n3", "10.60.3.1"),
    ];
    let meshed = c.wait_for(Duration::from_secs(40), |c| {
        pods.iter().all(|(from, source)| {
            pods.iter()
                .filter(|(to, _)| to != from)
                .all(|(_, target)| answers(c, from, source, target))
        })
    });
    assert!(meshed, "every pod reaches every pod\n{}", c.logs());
    // The Nodes' own pod CIDRs are no pod's: kg routes none of them across locations.
    let west = allowed_ips_with(&c, "n3", "10.60.1.0/26");
    assert!(west.contains("10.60.2.0/26"), "{west}");
    assert!(!west.contains("10.42."), "{west}");
    let east_leader = if allowed_ips_with(&c, "n1", "10.60.3.0/26").is_empty() {
        "n2"
    } else {
        "n1"
    };
    let handshakes = c.node("n3").wg("latest-handshakes");

    // n3 takes a second block, with a pod in it.
    c.node("n3")
        .ns
        .run(&["ip", "addr", "add", "10.60.3.65/26", "dev", "pods0"]);
    std::fs::write(
        c.dir.join("block-n3-second.yaml"),
        block_affinity("n3", "10.60.3.64/26"),
    )
    .unwrap();
    let second = c.wait_for(Duration::from_secs(20), |c| {
        answers(c, "n1", "10.60.1.1", "10.60.3.65") && answers(c, "n2", "10.60.2.1", "10.60.3.65")
    });
    assert!(second, "the second block is routed\n{}", c.logs());
    let peer = allowed_ips_with(&c, east_leader, "10.60.3.0/26");
    assert!(peer.contains("10.60.3.64/26"), "{peer}");

    // A pod on n3 holds an address Calico lent out of n1's block: n2, in n1's location,
    // reaches it in the west.
    c.node("n3")
        .ns
        .run(&["ip", "addr", "add", "10.60.1.10/32", "dev", "pods0"]);
    std::fs::write(
        c.dir.join("ipamblock-n1.yaml"),
        lent_address("10.60.1.0/26", "n1", 10, "n3"),
    )
    .unwrap();
    let borrowed = c.wait_for(Duration::from_secs(20), |c| {
        answers(c, "n2", "10.60.2.1", "10.60.1.10")
    });
    assert!(borrowed, "the lent address is routed to n3\n{}", c.logs());
    let peer = allowed_ips_with(&c, east_leader, "10.60.3.0/26");
    assert!(peer.contains("10.60.1.10/32"), "{peer}");

    // The second block released: its range leaves the peer; the first block still answers.
    std::fs::remove_file(c.dir.join("block-n3-second.yaml")).unwrap();
    let released = c.wait_for(Duration::from_secs(20), |c| {
        !allowed_ips_with(c, east_leader, "10.60.3.0/26").contains("10.60.3.64/26")
    });
    assert!(released, "{}", c.logs());
    assert!(answers(&c, "n1", "10.60.1.1", "10.60.3.1"));

    // No change replaced the west peer on n3: its session (the handshake's time) is the one
    // it had before the first change.
    assert_eq!(c.node("n3").wg("latest-handshakes"), handshakes);
    eprintln!("blocks, a second block, a lent address and a release followed by peer {east_leader}'s allowed IPs alone");
}
