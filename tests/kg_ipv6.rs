//! End-to-end: the Kilo network over an IPv6 underlay (file backend, network namespaces).
//! Dual-stack hosts announce IPv6 endpoints and internal IPs (`force-endpoint`,
//! `force-internal-ip`), as Kilo's annotations allow; pods stay IPv4.

mod common;

use std::time::Duration;

use common::cluster::{Cluster, NodeSpec};

/// a1, a2 in location x and b1, b2 in y, all on one L2 segment with IPv4 and `fd50::<n>/64`,
/// each announcing `[fd50::<n>]:51820` and `fd50::<n>/64`.
fn dual_stack(extra: &[&str]) -> Cluster {
    let mut c = Cluster::new(&["seg"]);
    let nodes = [("a1", "x"), ("a2", "x"), ("b1", "y"), ("b2", "y")];
    for (i, (name, location)) in nodes.iter().enumerate() {
        let n = i + 1;
        let endpoint = format!("[fd50::{n}]:51820");
        let internal = format!("fd50::{n}/64");
        let annotations = [
            ("kilo.squat.ai/force-endpoint", endpoint.as_str()),
            ("kilo.squat.ai/force-internal-ip", internal.as_str()),
        ];
        let spec = NodeSpec {
            name,
            location,
            annotations: &annotations,
        };
        let index = c.add_node_on(&spec, "seg", n as u8);
        let ns = &c.nodes[index].ns;
        ns.run(&["ip", "-6", "addr", "add", &internal, "dev", "eth0", "nodad"]);
        ns.run(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
    }
    for i in 0..4 {
        c.start_kg(i, extra);
    }
    c
}

fn failed_route_changes(c: &Cluster) -> Vec<String> {
    c.nodes
        .iter()
        .flat_map(|n| {
            n.log_text()
                .lines()
                .filter(|l| l.contains("route change failed") || l.contains("rule change failed"))
                .map(|l| format!("{}: {l}", n.name))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn location_granularity_over_a_dual_stack_underlay_meshes_without_mixed_routes() {
    if !common::can_run(
        "location_granularity_over_a_dual_stack_underlay_meshes_without_mixed_routes",
    ) {
        return;
    }
    let c = dual_stack(&["--encapsulate=never", "--resync-period=2s"]);
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    // The endpoints in use are IPv6.
    let endpoints = c.node("a1").wg("endpoints");
    assert!(endpoints.contains("[fd50::"), "{endpoints}");
    // A few resyncs later, no route was refused.
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(
        failed_route_changes(&c),
        Vec::<String>::new(),
        "{}",
        c.logs()
    );
}

/// Pings `target` from `node`'s host addresses (no pod source).
fn host_reaches(c: &Cluster, node: &str, target: &str) -> bool {
    common::ping_ok(&c.node(node).ns.name, target, Duration::from_secs(5))
}

#[test]
fn hosts_reach_remote_pods_over_an_ipv6_internal_ip() {
    if !common::can_run("hosts_reach_remote_pods_over_an_ipv6_internal_ip") {
        return;
    }
    let c = dual_stack(&["--encapsulate=never"]);
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    // Leaders and non-leaders alike, to the other location's pods and back.
    for (from, to) in [("a1", "b1"), ("a2", "b2"), ("b2", "a2"), ("b1", "a1")] {
        let target = c.node(to).pod_ip.clone();
        assert!(
            host_reaches(&c, from, &target),
            "{from} → {target}\n{}",
            c.logs()
        );
    }
}
