//! End-to-end: a node with several addresses publishes them as endpoint candidates, and its
//! peer walks them until one completes a handshake (`kg` in namespaces, file backend).

use crate::common;
use control::journal::Reason;
use control::status::CandidatesStatus;

use std::time::Duration;

use common::cluster::{Cluster, NodeSpec};

/// The candidates `on` reports at `/status` for the segment `leader` leads.
fn candidates_of(c: &Cluster, on: &str, leader: &str) -> Option<CandidatesStatus> {
    c.node(on)
        .status()?
        .peers
        .into_iter()
        .find(|p| p.leader == leader)?
        .candidates
}

/// Node a (east, 192.168.10.1) and node b (west, 192.168.20.2, annotated `b_annotations`).
fn a_and_b(b_annotations: &[(&str, &str)]) -> Cluster {
    let mut c = Cluster::new(&["east", "west"]);
    for (name, location, annotations, index) in
        [("a", "east", &[][..], 1), ("b", "west", b_annotations, 2)]
    {
        c.add_node(
            &NodeSpec {
                name,
                location,
                annotations,
            },
            index,
        );
    }
    c
}

const B_ADDRESSES: [&str; 3] = ["192.168.20.2", "192.168.20.12", "192.168.20.22"];

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn unreachable_candidates_are_left_for_the_one_that_handshakes() {
    common::require_root("unreachable_candidates_are_left_for_the_one_that_handshakes");
    if !common::which("iptables") {
        eprintln!("skipped: needs iptables too");
        return;
    }
    let mut c = a_and_b(&[]);
    // b has two more addresses on its underlay; WireGuard reaches it on the last one only.
    let b = c.node("b");
    for extra in &B_ADDRESSES[1..] {
        b.ns.run(&["ip", "addr", "add", &format!("{extra}/24"), "dev", "eth0"]);
    }
    for blocked in &B_ADDRESSES[..2] {
        b.ns.run(&[
            "iptables", "-A", "INPUT", "-p", "udp", "--dport", "51820", "-d", blocked, "-j", "DROP",
        ]);
    }
    for i in 0..2 {
        c.start_kg(i, &["--encapsulate=never", "--endpoint-probe-window=3s"]);
    }

    let published = c.wait_for(Duration::from_secs(15), |c| {
        c.annotations("b").contains_key("kilotun.io/endpoints")
    });
    assert!(published, "{:?}\n{}", c.annotations("b"), c.logs());
    let expected: Vec<String> = B_ADDRESSES.iter().map(|a| format!("{a}:51820")).collect();
    assert_eq!(
        c.annotations("b")["kilotun.io/endpoints"],
        expected.join(","),
        "Kilo's endpoint first, then the host's other addresses, lowest first"
    );
    assert_eq!(
        c.annotations("b")["kilo.squat.ai/endpoint"],
        expected[0],
        "Kilo's own annotation keeps the detected endpoint"
    );

    let up = c.wait_for(Duration::from_secs(40), |c| {
        c.pod_pings("a", "b") && c.pod_pings("b", "a")
    });
    assert!(up, "{:?}\n{}", candidates_of(&c, "a", "b"), c.logs());
    assert_eq!(c.peer_endpoint("a", "b"), expected[2]);
    let seen = candidates_of(&c, "a", "b").expect("a reports b's candidates");
    assert_eq!(
        seen.in_use.as_deref(),
        Some(expected[2].as_str()),
        "{seen:?}"
    );
    assert_eq!(seen.usable, expected, "{seen:?}");
    let left: Vec<&str> = seen.left.iter().map(|n| n.endpoint.as_str()).collect();
    assert_eq!(
        left,
        [expected[0].as_str(), expected[1].as_str()],
        "{seen:?}"
    );
    // Each candidate was given one probe window (3 s; /status counts whole seconds, and the
    // device is read every second or two).
    let (first, second) = (seen.left[0].at_unix, seen.left[1].at_unix);
    let gap = second.zip(first).map(|(s, f)| s - f);
    assert!(gap.is_some_and(|g| (2..=6).contains(&g)), "{seen:?}");
    let moves = c.node("a").events_of(Reason::EndpointCandidateLeft);
    assert_eq!(moves.len(), 2, "{moves:?}");
    assert!(moves.iter().all(|e| e.subject == "b"), "{moves:?}");
    assert!(
        moves[0].message.contains(&expected[0]) && moves[0].message.contains(&expected[1]),
        "{}",
        moves[0].message
    );

    // kgctl shows a's configuration as it is: with b at the candidate a chose, where the
    // topology alone names Kilo's endpoint.
    let dir = format!("--cluster-dir={}", c.dir.display());
    let showconf = |live: bool| {
        let mut args = vec![
            common::cluster::kgctl_bin(),
            "--backend=file",
            &dir,
            "showconf",
            "node",
            "a",
        ];
        if live {
            args.push("--live");
        }
        let out = c.node("a").ns.output(&args);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let from_topology = showconf(false);
    assert!(
        from_topology.contains(&format!("Endpoint = {}\n", expected[0])),
        "{from_topology}"
    );
    let live = showconf(true);
    assert!(
        live.contains(&format!("Endpoint = {}\n", expected[2])),
        "{live}"
    );

    // The blocked addresses open again: a working candidate is kept, not traded back for the
    // first one, over several probe windows.
    for blocked in &B_ADDRESSES[..2] {
        c.node("b").ns.run(&[
            "iptables", "-D", "INPUT", "-p", "udp", "--dport", "51820", "-d", blocked, "-j", "DROP",
        ]);
    }
    std::thread::sleep(Duration::from_secs(10));
    assert!(c.pod_pings("a", "b"), "{}", c.logs());
    assert_eq!(c.peer_endpoint("a", "b"), expected[2]);
    let kept = candidates_of(&c, "a", "b").expect("a reports b's candidates");
    assert_eq!(
        kept.in_use.as_deref(),
        Some(expected[2].as_str()),
        "{kept:?}"
    );
    assert_eq!(kept.state, "working", "{kept:?}");
    assert_eq!(
        c.node("a").events_of(Reason::EndpointCandidateLeft).len(),
        2,
        "no move after the link works"
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_candidate_routed_only_into_the_mesh_is_refused_and_never_tried() {
    common::require_root("a_candidate_routed_only_into_the_mesh_is_refused_and_never_tried");
    if !common::which("iptables") {
        eprintln!("skipped: needs iptables too");
        return;
    }
    // b routes 192.168.20.100/32 for its location, and holds that address itself: from a,
    // that candidate is reachable only through the tunnel to b.
    let mut c = a_and_b(&[("kilo.squat.ai/allowed-location-ips", "192.168.20.100/32")]);
    // a has no default route: its underlay reaches b's .2 and .222 only.
    let a = c.node("a");
    a.ns.run(&["ip", "route", "del", "default"]);
    for reached in ["192.168.20.2", "192.168.20.222"] {
        a.ns.run(&["ip", "route", "add", reached, "via", "192.168.10.254"]);
    }
    let b = c.node("b");
    for extra in ["192.168.20.100/32", "192.168.20.222/24"] {
        b.ns.run(&["ip", "addr", "add", extra, "dev", "eth0"]);
    }
    b.ns.run(&[
        "iptables",
        "-A",
        "INPUT",
        "-p",
        "udp",
        "--dport",
        "51820",
        "-d",
        "192.168.20.2",
        "-j",
        "DROP",
    ]);
    for i in 0..2 {
        c.start_kg(i, &["--encapsulate=never", "--endpoint-probe-window=3s"]);
    }
    let expected = [
        "192.168.20.2:51820",
        "192.168.20.100:51820",
        "192.168.20.222:51820",
    ];
    let published = c.wait_for(Duration::from_secs(15), |c| {
        c.annotations("b")
            .get("kilotun.io/endpoints")
            .map(String::as_str)
            == Some(expected.join(",").as_str())
    });
    assert!(published, "{:?}\n{}", c.annotations("b"), c.logs());

    let up = c.wait_for(Duration::from_secs(40), |c| {
        c.pod_pings("a", "b") && c.pod_pings("b", "a")
    });
    assert!(up, "{:?}\n{}", candidates_of(&c, "a", "b"), c.logs());
    assert_eq!(c.peer_endpoint("a", "b"), expected[2]);
    let seen = candidates_of(&c, "a", "b").expect("a reports b's candidates");
    assert_eq!(seen.in_use.as_deref(), Some(expected[2]), "{seen:?}");
    assert_eq!(seen.usable, [expected[0], expected[2]], "{seen:?}");
    let refused: Vec<&str> = seen.refused.iter().map(|n| n.endpoint.as_str()).collect();
    assert_eq!(refused, [expected[1]], "{seen:?}");
    let left: Vec<&str> = seen.left.iter().map(|n| n.endpoint.as_str()).collect();
    assert_eq!(
        left,
        [expected[0]],
        "the refused candidate is never tried: {seen:?}"
    );
    let said = c.node("a").events_of(Reason::EndpointRefused);
    assert_eq!(said.len(), 1, "{said:?}");
    assert_eq!(said[0].subject, "b");
    assert!(said[0].message.contains(expected[1]), "{}", said[0].message);
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_dual_stack_pair_prefers_ipv6_with_underlay_family_ipv6() {
    common::require_root("a_dual_stack_pair_prefers_ipv6_with_underlay_family_ipv6");
    let mut c = a_and_b(&[]);
    // The router routes IPv6 too: east is fd60:10::/64 on br0, west fd60:20::/64 on br1.
    c.router
        .run(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
    for (bridge, gateway) in [("br0", "fd60:10::254/64"), ("br1", "fd60:20::254/64")] {
        c.router
            .run(&["ip", "-6", "addr", "add", gateway, "dev", bridge, "nodad"]);
    }
    for (node, address, gateway) in [
        ("a", "fd60:10::1/64", "fd60:10::254"),
        ("b", "fd60:20::2/64", "fd60:20::254"),
    ] {
        let ns = &c.node(node).ns;
        ns.run(&["ip", "-6", "addr", "add", address, "dev", "eth0", "nodad"]);
        ns.run(&["ip", "-6", "route", "add", "default", "via", gateway]);
    }
    for i in 0..2 {
        c.start_kg(i, &["--encapsulate=never", "--underlay-family=ipv6"]);
    }
    let (v4, v6) = ("192.168.20.2:51820", "[fd60:20::2]:51820");
    let published = c.wait_for(Duration::from_secs(15), |c| {
        c.annotations("b")
            .get("kilotun.io/endpoints")
            .is_some_and(|e| *e == format!("{v4},{v6}"))
    });
    assert!(published, "{:?}\n{}", c.annotations("b"), c.logs());
    assert_eq!(c.annotations("b")["kilo.squat.ai/endpoint"], v4);

    let up = c.wait_for(Duration::from_secs(30), |c| {
        c.pod_pings("a", "b") && c.pod_pings("b", "a")
    });
    assert!(up, "{:?}\n{}", candidates_of(&c, "a", "b"), c.logs());
    let seen = candidates_of(&c, "a", "b").expect("a reports b's candidates");
    assert_eq!(seen.usable, [v6, v4], "IPv6 is tried first: {seen:?}");
    assert_eq!(seen.in_use.as_deref(), Some(v6), "{seen:?}");
    assert_eq!(c.peer_endpoint("a", "b"), v6);
    assert_eq!(c.peer_endpoint("b", "a"), "[fd60:10::1]:51820");
    assert!(
        c.node("a")
            .events_of(Reason::EndpointCandidateLeft)
            .is_empty(),
        "the preferred family worked at once"
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_nated_pair_behind_a_public_node_meshes_and_recovers_when_a_mapping_moves() {
    common::require_root(
        "a_nated_pair_behind_a_public_node_meshes_and_recovers_when_a_mapping_moves",
    );
    if !common::which("iptables") {
        eprintln!("skipped: needs iptables too");
        return;
    }
    // a is public in east; b (west) and c (north) sit behind NATs and reach each other only
    // through a. WireGuard reaches a on its second address only, so the NATed nodes must
    // find it among a's candidates (where Talos's KubeSpan was seen to rotate to a wrong
    // endpoint and stay there).
    let mut c = Cluster::new(&["east", "west", "north"]);
    let spec = |name, location| NodeSpec {
        name,
        location,
        annotations: &[("kilo.squat.ai/persistent-keepalive", "2")],
    };
    c.add_node(
        &NodeSpec {
            name: "a",
            location: "east",
            annotations: &[],
        },
        1,
    );
    let (_, nat_b) = c.add_nated_node(&spec("b", "west"), 2);
    let (_, nat_c) = c.add_nated_node(&spec("c", "north"), 3);
    let a = c.node("a");
    a.ns.run(&["ip", "addr", "add", "192.168.10.11/24", "dev", "eth0"]);
    a.ns.run(&[
        "iptables",
        "-A",
        "INPUT",
        "-p",
        "udp",
        "--dport",
        "51820",
        "-d",
        "192.168.10.1",
        "-j",
        "DROP",
    ]);
    let flags = ["--encapsulate=never", "--endpoint-probe-window=3s"];
    for i in 0..3 {
        c.start_kg(i, &flags);
    }
    let pairs = [
        ("a", "b"),
        ("b", "a"),
        ("a", "c"),
        ("c", "a"),
        ("b", "c"),
        ("c", "b"),
    ];
    let meshed = |c: &Cluster| pairs.iter().all(|(x, y)| c.pod_pings(x, y));
    let up = c.wait_for(Duration::from_secs(60), meshed);
    assert!(up, "{:?}\n{}", candidates_of(&c, "b", "a"), c.logs());
    let working = "192.168.10.11:51820";
    for nated in ["b", "c"] {
        let seen = candidates_of(&c, nated, "a").expect("the NATed node probes a");
        assert_eq!(seen.in_use.as_deref(), Some(working), "{nated}: {seen:?}");
    }
    for (nated, nat) in [("b", &nat_b), ("c", &nat_c)] {
        let endpoint = c.peer_endpoint("a", nated);
        assert!(
            endpoint.starts_with(&format!("{nat}:")),
            "{nated}: {endpoint}"
        );
    }

    // c's mapping moves: its kg comes back on another port, so its NAT maps it anew. a follows
    // c's handshakes to the new mapping, c finds a's working address again, and traffic
    // between the two NATed nodes flows through a again.
    let before = c.peer_endpoint("a", "c");
    c.nodes[2].kill();
    c.start_kg(2, &[&flags[..], &["--port=51821"]].concat());
    let recovered = c.wait_for(Duration::from_secs(60), |c| {
        c.peer_endpoint("a", "c") != before && meshed(c)
    });
    assert!(
        recovered,
        "a sends to c at {} (was {before})\n{}",
        c.peer_endpoint("a", "c"),
        c.logs()
    );
    let found = c.wait_for(Duration::from_secs(10), |c| {
        candidates_of(c, "c", "a").is_some_and(|s| s.in_use.as_deref() == Some(working))
    });
    assert!(found, "{:?}\n{:?}", c.node("c").status(), c.logs());
    std::thread::sleep(Duration::from_secs(8));
    assert!(meshed(&c), "the NATed pair stays meshed\n{}", c.logs());
    let seen = candidates_of(&c, "b", "a").expect("b probes a");
    assert_eq!(seen.in_use.as_deref(), Some(working), "b stays: {seen:?}");
}
