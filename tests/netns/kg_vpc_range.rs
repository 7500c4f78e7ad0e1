//! End-to-end: a location that announces its whole private network (Cozystack's use of
//! `kilo.squat.ai/allowed-location-ips`: a VPC range, which contains the location's own internal
//! IPs and its leader's endpoint). kilotun takes such a range as Kilo does, since the more
//! specific routes still win: the other locations route it into the tunnel to the location's
//! leader, the leader's encrypted packets to its endpoint inside it stay on the underlay, and
//! the location's own nodes keep their connected network. A range inside a node's allowed IPs
//! (a part of its pod CIDR) is still refused, naming it. Nodes in network namespaces, the file
//! backend, `--encapsulate=never`.

use crate::common;
use control::journal::Reason;

use std::time::Duration;

use common::cluster::Cluster;

/// Location y's network (`Cluster::new`: the second location's bridge).
const VPC: &str = "192.168.20.0/24";
/// An address on y's network that is no node's: a VM of the VPC, say.
const VPC_HOST: &str = "192.168.20.77";
/// Inside b2's pod CIDR (10.42.3.0/24): overlaps an allowed IP, refused.
const INSIDE_A_POD_CIDR: &str = "10.42.3.0/26";

fn routes(c: &Cluster, node: &str) -> String {
    String::from_utf8_lossy(&c.node(node).ns.output(&["ip", "route"]).stdout).into_owned()
}

/// The routes of `node` for exactly `cidr`, without their protocol and metric.
fn routes_of(c: &Cluster, node: &str, cidr: &str) -> Vec<String> {
    routes(c, node)
        .lines()
        .filter(|l| l.starts_with(&format!("{cidr} ")))
        .map(|l| l.split(" proto").next().unwrap_or(l).to_string())
        .collect()
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_location_announcing_its_whole_network_is_routed_there_from_the_others() {
    common::require_root("a_location_announcing_its_whole_network_is_routed_there_from_the_others");
    let claim = format!("{VPC},{INSIDE_A_POD_CIDR}");
    let c = Cluster::claiming_location_ips(
        &["x", "y"],
        &[
            ("a1", "x", ""),
            ("b1", "y", VPC),
            ("b2", "y", claim.as_str()),
        ],
    );

    let leaders = c.leading(&["b1", "b2"]);
    let [leader] = &leaders[..] else {
        panic!("one leader in y: {leaders:?}\n{}", c.logs());
    };
    let follower = if leader == "b1" { "b2" } else { "b1" };
    // a1 routes the whole range into the tunnel (to y's leader), beside the more specific
    // routes of y's nodes.
    let iface = c.node("a1").iface.clone();
    let routed = c.wait_for(Duration::from_secs(20), |c| {
        routes_of(c, "a1", VPC)
            .iter()
            .any(|r| r.contains(&format!("dev {iface}")))
    });
    assert!(routed, "a1:\n{}\n{}", routes(&c, "a1"), c.logs());
    let allowed = c.node("a1").wg("allowed-ips");
    let leader_key = c.node(leader).wg("public-key").trim().to_string();
    let line = allowed
        .lines()
        .find(|l| l.starts_with(&leader_key))
        .unwrap_or_default();
    assert!(
        line.contains(VPC),
        "y's leader's peer on a1 carries {VPC}: {allowed}"
    );
    // Its endpoint is inside the range, and the handshake still goes over the underlay.
    let endpoint = c.node(leader).ip.clone();
    let handshakes = c.node("a1").wg("latest-handshakes");
    assert!(
        handshakes
            .lines()
            .any(|l| l.starts_with(&leader_key) && !l.trim_end().ends_with("\t0")),
        "a1 shook hands with {leader} at {endpoint}: {handshakes}"
    );

    // A host of y's network that is no node answers a1's pod through the tunnel: y's leader
    // forwards into its network.
    c.node(follower).ns.run(&[
        "ip",
        "addr",
        "add",
        &format!("{VPC_HOST}/32"),
        "dev",
        "eth0",
    ]);
    let a1 = c.node("a1");
    let via = a1
        .ns
        .run(&["ip", "route", "get", VPC_HOST, "from", &a1.pod_ip]);
    assert!(
        via.contains(&format!("dev {iface}")),
        "a1 -> {VPC_HOST}: {via}"
    );
    assert!(
        common::ping_from_ok(
            &a1.ns.name,
            Some(&a1.pod_ip),
            VPC_HOST,
            Duration::from_secs(20)
        ),
        "a1 -> {VPC_HOST} on {follower}\n{}",
        c.logs()
    );

    // y's nodes route nothing of their own network: the kernel's connected route alone, and
    // each reaches the other directly.
    for node in ["b1", "b2"] {
        let own = routes_of(&c, node, VPC);
        assert_eq!(own.len(), 1, "{node}:\n{}", routes(&c, node));
        assert!(own[0].contains("dev eth0"), "{node}: {own:?}");
        assert!(
            c.node(node).events_of(Reason::RouteWithheld).is_empty(),
            "{node} withholds nothing of its own location"
        );
    }
    let b2_ip = c.node("b2").ip.clone();
    assert!(common::ping_ok(
        &c.node("b1").ns.name,
        &b2_ip,
        Duration::from_secs(5)
    ));

    // The range inside b2's pod CIDR is refused on every node, once, naming it; nothing routes
    // it apart from the pod CIDR.
    std::thread::sleep(Duration::from_secs(3));
    for node in ["a1", "b1", "b2"] {
        let dropped: Vec<String> = c
            .node(node)
            .events_of(Reason::RangeDropped)
            .into_iter()
            .filter(|e| e.subject == INSIDE_A_POD_CIDR)
            .map(|e| e.message)
            .collect();
        assert_eq!(dropped.len(), 1, "{node}: {dropped:#?}");
        assert!(
            dropped[0].contains("10.42.3.0/24"),
            "{node}: names the allowed IP it overlaps: {}",
            dropped[0]
        );
        assert!(
            routes_of(&c, node, INSIDE_A_POD_CIDR).is_empty(),
            "{node}:\n{}",
            routes(&c, node)
        );
    }
    let accepted = c
        .node("a1")
        .events_of(Reason::RangeDropped)
        .into_iter()
        .filter(|e| e.subject == VPC)
        .count();
    assert_eq!(accepted, 0, "{VPC} is not refused");
}
