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
