//! End-to-end: `--mesh-granularity=cross` in network namespaces (file backend): three
//! locations, a WireGuard tunnel between every pair of nodes in different locations and none
//! inside a location (routes carry it there), every pod reachable, and kgctl reading `cross`
//! from the nodes' `kilo.squat.ai/granularity`.

use crate::common;

use std::time::Duration;

use common::cluster::{kgctl_bin, Cluster};

fn peer_keys(c: &Cluster, node: &str) -> Vec<String> {
    c.node(node)
        .wg("peers")
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// The output of `args` run inside `node`.
fn text(c: &Cluster, node: &str, args: &[&str]) -> String {
    String::from_utf8_lossy(&c.node(node).ns.output(args).stdout).into_owned()
}

fn public_key(c: &Cluster, node: &str) -> String {
    c.node(node).wg("public-key").trim().to_string()
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn cross_tunnels_between_locations_only() {
    common::require_root("cross_tunnels_between_locations_only");
    let mut c = Cluster::with_nodes(
        &["east", "west", "south"],
        &[
            ("n1", "east"),
            ("n2", "east"),
            ("n3", "west"),
            ("n4", "west"),
            ("n5", "south"),
        ],
    );
    for i in 0..5 {
        c.start_kg(i, &["--mesh-granularity=cross", "--encapsulate=never"]);
    }
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());

    let location = |n: &str| match n {
        "n1" | "n2" => "east",
        "n3" | "n4" => "west",
        _ => "south",
    };
    let names = ["n1", "n2", "n3", "n4", "n5"];
    for node in names {
        let mut want: Vec<String> = names
            .iter()
            .filter(|other| location(other) != location(node))
            .map(|other| public_key(&c, other))
            .collect();
        want.sort();
        let mut have = peer_keys(&c, node);
        have.sort();
        assert_eq!(
            have,
            want,
            "{node}: one peer per node of another location\n{}",
            c.logs()
        );
        // Every node leads its own segment: its link is up with a WireGuard IP.
        let link = text(
            &c,
            node,
            &["ip", "-br", "addr", "show", &c.node(node).iface],
        );
        assert!(link.contains("10.4.0."), "{node}: {link}");
    }
    // Inside a location the pods are reached over the underlay, not WireGuard.
    let route = text(&c, "n1", &["ip", "route", "get", "10.42.2.1"]);
    assert!(route.contains("via 192.168.10.2 dev eth0"), "{route}");
    let route = text(&c, "n1", &["ip", "route", "get", "10.42.3.1"]);
    assert!(
        route.contains(&format!("dev {}", c.node("n1").iface)),
        "{route}"
    );

    // The granularity is announced as `cross`, and kgctl reads it from there.
    assert_eq!(
        c.annotations("n1")
            .get("kilo.squat.ai/granularity")
            .map(String::as_str),
        Some("cross")
    );
    let dir = format!("--cluster-dir={}", c.dir.display());
    let conf = common::run(&[
        kgctl_bin(),
        "--backend=file",
        &dir,
        "showconf",
        "node",
        "n5",
    ]);
    assert_eq!(conf.matches("[Peer]").count(), 4, "{conf}");
    let conf = common::run(&[
        kgctl_bin(),
        "--backend=file",
        &dir,
        "showconf",
        "node",
        "n1",
    ]);
    assert_eq!(conf.matches("[Peer]").count(), 3, "{conf}");
    let graph = common::run(&[kgctl_bin(), "--backend=file", &dir, "graph"]);
    assert!(graph.contains("\"n1\" -> \"n3\""), "{graph}");
    assert!(!graph.contains("\"n1\" -> \"n2\""), "{graph}");
}
