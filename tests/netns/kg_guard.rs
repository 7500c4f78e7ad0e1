//! End-to-end: kg never routes a node's own connected network into the mesh. Three nodes on
//! one L2 subnet (network namespaces, file backend, `--encapsulate=never`), a1 and a2 in
//! location x, b1 in location y, b1 annotated with the shared subnet as its
//! `allowed-location-ips` (the mistake Kilo's users make).

use crate::common;
use control::journal::Reason;

use std::time::Duration;

use common::cluster::{Cluster, NodeSpec};

const ALLOWED_LOCATION_IPS: &str = "kilo.squat.ai/allowed-location-ips";
const SHARED: &str = "192.168.10.0/24";

/// The messages of `node`'s events about withholding `cidr`.
fn withheld_lines(c: &Cluster, node: &str, cidr: &str) -> Vec<String> {
    c.node(node)
        .events_of(Reason::RouteWithheld)
        .into_iter()
        .filter(|e| e.subject == cidr)
        .map(|e| e.message)
        .collect()
}

fn routes(c: &Cluster, node: &str) -> String {
    String::from_utf8_lossy(&c.node(node).ns.output(&["ip", "route"]).stdout).into_owned()
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn allowed_location_ips_on_the_wrong_location_never_take_down_the_shared_subnet() {
    common::require_root(
        "allowed_location_ips_on_the_wrong_location_never_take_down_the_shared_subnet",
    );
    let mut c = Cluster::new(&["x"]);
    for (i, name) in ["a1", "a2"].into_iter().enumerate() {
        let spec = NodeSpec {
            name,
            location: "x",
            annotations: &[],
        };
        c.add_node(&spec, i as u8 + 1);
    }
    let b1 = NodeSpec {
        name: "b1",
        location: "y",
        annotations: &[(ALLOWED_LOCATION_IPS, SHARED)],
    };
    c.add_node_on(&b1, "x", 3);
    for i in 0..3 {
        c.start_kg(i, &["--encapsulate=never", "--resync-period=1s"]);
    }

    // The mesh between the locations is up: every pod reaches every other.
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    // a1 and a2 reach each other's underlay address directly.
    for (from, to) in [("a1", "a2"), ("a2", "a1")] {
        let ns = &c.node(from).ns.name;
        let ip = &c.node(to).ip;
        assert!(
            common::ping_ok(ns, ip, Duration::from_secs(5)),
            "{from} -> {to}\n{}",
            c.logs()
        );
    }
    // The kernel's connected route stays; kg adds none over it.
    for node in ["a1", "a2"] {
        let shown = routes(&c, node);
        let shared: Vec<&str> = shown
            .lines()
            .filter(|l| l.starts_with(&format!("{SHARED} ")))
            .collect();
        assert_eq!(shared.len(), 1, "{node}:\n{shown}");
        assert!(
            shared[0].contains("dev eth0") && shared[0].contains("proto kernel"),
            "{node}:\n{shown}"
        );
    }

    // a1 (the leader of x) and a2 say so, naming b1, the annotation, the CIDR and the
    // connected network; once, though resyncs run every second.
    let expected = format!(
        "node b1 {ALLOWED_LOCATION_IPS} {SHARED} contains this node's connected network {SHARED}"
    );
    for node in ["a1", "a2"] {
        let found = c.wait_for(Duration::from_secs(10), |c| {
            !withheld_lines(c, node, SHARED).is_empty()
        });
        assert!(found, "{node}:\n{}", c.logs());
    }
    std::thread::sleep(Duration::from_secs(3));
    for node in ["a1", "a2"] {
        let lines = withheld_lines(&c, node, SHARED);
        assert_eq!(lines.len(), 1, "{node}: {lines:#?}");
        assert!(lines[0].contains(&expected), "{node}: {}", lines[0]);
    }
    let (status, metrics) = c.node("a1").http_get("/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains("\nkilotun_withheld_cidrs 1\n"),
        "{metrics}"
    );
    let (status, dot) = c.node("a1").http_get("/graph?format=dot");
    assert_eq!(status, 200);
    let mark = format!("\t\"b1\" -> \"withheld node b1 {SHARED}\" [style=dotted, color=red");
    assert!(dot.contains(&mark), "{dot}");
    assert!(
        withheld_lines(&c, "b1", SHARED).is_empty(),
        "b1 routes nothing to its own location"
    );

    // On the right location (a network only b1 is connected to), the route is installed on
    // the other location and an address behind b1 answers; removing the annotation withdraws it.
    let b1ns = &c.node("b1").ns;
    b1ns.run(&["ip", "link", "add", "behind0", "type", "bridge"]);
    b1ns.run(&["ip", "addr", "add", "172.31.0.1/24", "dev", "behind0"]);
    b1ns.run(&["ip", "link", "set", "behind0", "up"]);
    c.annotate("b1", &[(ALLOWED_LOCATION_IPS, Some("172.31.0.0/24"))]);
    for node in ["a1", "a2"] {
        let ns = c.node(node).ns.name.clone();
        let pod_ip = c.node(node).pod_ip.clone();
        let reached = c.wait_for(Duration::from_secs(20), |_| {
            common::ping_from_ok(&ns, Some(&pod_ip), "172.31.0.1", Duration::from_secs(2))
        });
        assert!(reached, "{node} -> 172.31.0.1\n{}", c.logs());
    }
    let withdrawn_metric = c.wait_for(Duration::from_secs(10), |c| {
        c.node("a1")
            .http_get("/metrics")
            .1
            .contains("\nkilotun_withheld_cidrs 0\n")
    });
    assert!(withdrawn_metric);
    assert!(c.all_pods_reachable().is_ok(), "{}", c.logs());
    c.annotate("b1", &[(ALLOWED_LOCATION_IPS, None)]);
    for node in ["a1", "a2"] {
        let gone = c.wait_for(Duration::from_secs(20), |c| {
            !routes(c, node).contains("172.31.0.0/24")
        });
        assert!(gone, "{node}:\n{}", routes(&c, node));
    }
}

/// The Peer `gateway`, claiming `allowed` (no endpoint, a key nobody holds), in the cluster
/// directory.
fn write_peer(c: &Cluster, name: &str, allowed: &[&str]) {
    let key = common::run(&["sh", "-c", "wg genkey | wg pubkey"]);
    let ips: String = allowed.iter().map(|a| format!("  - {a}\n")).collect();
    std::fs::write(
        c.dir.join(format!("peer-{name}.yaml")),
        format!(
            "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: {name}\nspec:\n  allowedIPs:\n{ips}  publicKey: {}\n",
            key.trim()
        ),
    )
    .unwrap();
}

/// n1 (east) and n3 (west), with a Peer claiming west's whole underlay subnet, n3's endpoint
/// among it, before kg starts with `extra`; returned once every pod is reachable.
fn endpoint_under_a_peer(extra: &[&str]) -> Cluster {
    let mut c = Cluster::with_nodes(&["east", "west"], &[("n1", "east"), ("n3", "west")]);
    write_peer(&c, "gateway", &["192.168.20.0/24"]);
    for i in 0..2 {
        let mut flags = vec!["--encapsulate=never"];
        flags.extend_from_slice(extra);
        c.start_kg(i, &flags);
    }
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    let table = routes(&c, "n1");
    assert!(
        table.lines().any(|l| l.starts_with("192.168.20.0/24 dev ")),
        "the Peer's CIDR is routed into the tunnel: {table}"
    );
    // The handshake completes: n1 has a recent one with n3.
    let handshakes = c.node("n1").wg("latest-handshakes");
    assert!(
        handshakes.lines().any(|l| !l.trim_end().ends_with("\t0")),
        "{handshakes}"
    );
    c
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn an_endpoint_inside_a_peers_allowed_ips_keeps_to_the_underlay_by_its_mark() {
    common::require_root(
        "an_endpoint_inside_a_peers_allowed_ips_keeps_to_the_underlay_by_its_mark",
    );
    let c = endpoint_under_a_peer(&[]);
    let endpoint = c.node("n3").ip.clone();
    let n1 = c.node("n1");
    // No host route per endpoint: the engine's socket carries the mark, and the guard's rules
    // route marked packets by the host's own routes.
    let table = routes(&c, "n1");
    assert!(
        !table
            .lines()
            .any(|l| l.starts_with(&format!("{endpoint} "))),
        "{table}"
    );
    assert!(n1.events_of(Reason::EndpointBypassed).is_empty());
    assert_eq!(n1.wg("fwmark").trim(), "0x1000");
    let rules = String::from_utf8_lossy(&n1.ns.output(&["ip", "rule"]).stdout).into_owned();
    assert!(
        rules.contains("1100:\tfrom all fwmark 0x1000/0x1000 lookup 1108"),
        "{rules}"
    );
    assert!(
        rules.contains("1101:\tfrom all fwmark 0x1000/0x1000 unreachable"),
        "{rules}"
    );
    let marked = n1
        .ns
        .run(&["ip", "route", "get", &endpoint, "mark", "0x1000"]);
    assert!(marked.contains("via 192.168.10.254 dev eth0"), "{marked}");
    let unmarked = n1.ns.run(&["ip", "route", "get", &endpoint]);
    assert!(
        unmarked.contains(&format!("dev {} ", n1.iface)),
        "{unmarked}"
    );
    // A route change that pulls the endpoint itself into the tunnel (a /32 onto kilo0) does
    // not reach WireGuard's packets: the mesh keeps working.
    n1.ns.run(&[
        "ip",
        "route",
        "add",
        &format!("{endpoint}/32"),
        "dev",
        &n1.iface,
    ]);
    std::thread::sleep(Duration::from_secs(2));
    let still = c.wait_for(Duration::from_secs(10), |c| c.all_pods_reachable().is_ok());
    assert!(still, "{:?}\n{}", c.all_pods_reachable(), c.logs());
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn an_endpoint_inside_a_peers_allowed_ips_gets_a_host_route_with_the_routes_guard() {
    common::require_root(
        "an_endpoint_inside_a_peers_allowed_ips_gets_a_host_route_with_the_routes_guard",
    );
    let c = endpoint_under_a_peer(&["--tunnel-guard=routes"]);
    let endpoint = c.node("n3").ip.clone();
    let table = routes(&c, "n1");
    assert!(
        table
            .lines()
            .any(|l| l.starts_with(&format!("{endpoint} via 192.168.10.254 dev eth0"))),
        "n3's endpoint keeps to the underlay: {table}"
    );
    assert_eq!(c.node("n1").wg("fwmark").trim(), "off");
    let warned = |c: &Cluster| {
        c.node("n1")
            .events_of(Reason::EndpointBypassed)
            .iter()
            .filter(|e| e.subject == endpoint)
            .count()
    };
    // The log is written a moment after the route.
    assert!(
        c.wait_for(Duration::from_secs(10), |c| warned(c) > 0),
        "{}",
        c.node("n1").log_text()
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(warned(&c), 1, "said once: {}", c.node("n1").log_text());
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn overlapping_allowed_location_ips_route_alike_on_every_node() {
    common::require_root("overlapping_allowed_location_ips_route_alike_on_every_node");
    let c = Cluster::claiming_location_ips(
        &["x", "y", "z"],
        &[
            ("n1", "x", "10.9.0.0/24"),
            ("n2", "y", "10.9.0.0/16"),
            ("n3", "z", ""),
        ],
    );
    // Kilo's rule, the same on every node: location x's /24 gives way to y's /16, which every
    // node but y's routes to y.
    let claim_routes = |node: &str| -> Vec<String> {
        routes(&c, node)
            .lines()
            .filter(|l| l.starts_with("10.9."))
            .map(|l| l.split(" proto").next().unwrap_or(l).to_string())
            .collect()
    };
    let via_y = |node: &str| -> Vec<String> {
        let dev = &c.node(node).iface;
        vec![format!("10.9.0.0/16 via 10.4.0.2 dev {dev}")]
    };
    for _ in 0..3 {
        assert_eq!(claim_routes("n1"), via_y("n1"), "{}", c.logs());
        assert_eq!(claim_routes("n3"), via_y("n3"), "{}", c.logs());
        assert!(claim_routes("n2").is_empty(), "{}", c.logs());
        std::thread::sleep(Duration::from_secs(1));
    }
    for node in ["n1", "n2", "n3"] {
        let named = c
            .node(node)
            .events_of(Reason::RangeDropped)
            .iter()
            .filter(|e| e.subject == "10.9.0.0/24")
            .count();
        assert_eq!(named, 1, "{node}: {}", c.node(node).log_text());
    }
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_multipath_default_route_is_copied_with_its_first_next_hop() {
    common::require_root("a_multipath_default_route_is_copied_with_its_first_next_hop");
    let mut c = Cluster::with_nodes(&["east", "west"], &[("a", "east"), ("b", "west")]);
    // a's default route balances over two gateways of east's router.
    c.router
        .run(&["ip", "addr", "add", "192.168.10.253/24", "dev", "br0"]);
    let a = c.node("a");
    a.ns.run(&[
        "ip",
        "route",
        "replace",
        "default",
        "nexthop",
        "via",
        "192.168.10.254",
        "dev",
        "eth0",
        "nexthop",
        "via",
        "192.168.10.253",
        "dev",
        "eth0",
    ]);
    for i in 0..2 {
        c.start_kg(i, &["--encapsulate=never"]);
    }
    let meshed = c.wait_for(Duration::from_secs(30), |c| {
        c.pod_pings("a", "b") && c.pod_pings("b", "a")
    });
    assert!(meshed, "{}", c.logs());
    let a = c.node("a");
    let copied = a.ns.run(&["ip", "route", "show", "table", "1108"]);
    assert!(
        copied
            .lines()
            .any(|l| l.starts_with("default via 192.168.10.254 dev eth0")),
        "the guard's table:\n{copied}"
    );
    let rules = a.ns.run(&["ip", "rule"]);
    assert!(
        rules.contains("1100:\tfrom all fwmark 0x1000/0x1000 lookup 1108"),
        "{rules}"
    );
    let marked =
        a.ns.run(&["ip", "route", "get", &c.node("b").ip, "mark", "0x1000"]);
    assert!(marked.contains("via 192.168.10.254 dev eth0"), "{marked}");
}
