//! End-to-end: DNS endpoints that move (DDNS) and a node behind NAT, with `kg` in network
//! namespaces on the file backend.

use crate::common;
use control::journal::Reason;

use std::time::Duration;

use common::cluster::{Cluster, Dns, NodeSpec};

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_moved_dns_endpoint_is_followed_within_one_resync() {
    common::require_root("a_moved_dns_endpoint_is_followed_within_one_resync");
    if !common::which("dnsmasq") {
        eprintln!("(needs dnsmasq too)");
        return;
    }
    let mut c = Cluster::new(&["east", "west", "dns"]);
    let dns = Dns::start(&mut c, "dns");
    dns.set("node-b.mesh.test", "192.168.20.2");
    c.add_node(
        &NodeSpec {
            name: "a",
            location: "east",
            annotations: &[],
        },
        1,
    );
    c.add_node(
        &NodeSpec {
            name: "b",
            location: "west",
            annotations: &[("kilo.squat.ai/force-endpoint", "node-b.mesh.test:51820")],
        },
        2,
    );
    for i in 0..2 {
        c.nodes[i].use_nameserver(&dns.ip);
        c.start_kg(i, &["--encapsulate=never"]);
    }
    let up = c.wait_for(Duration::from_secs(30), |c| {
        c.pod_pings("a", "b") && c.pod_pings("b", "a")
    });
    assert!(up, "{}", c.logs());
    assert_eq!(c.peer_endpoint("a", "b"), "192.168.20.2:51820");
    assert_eq!(
        c.annotations("b")["kilo.squat.ai/endpoint"],
        "node-b.mesh.test:51820",
        "the DNS name is published, not the address"
    );

    // b moves to a new address; the record follows. a must re-resolve on its own: b sends
    // nothing that would let a learn the new address by roaming.
    let b = c.node("b");
    b.ns.run(&["ip", "addr", "del", "192.168.20.2/24", "dev", "eth0"]);
    b.ns.run(&["ip", "addr", "add", "192.168.20.12/24", "dev", "eth0"]);
    b.ns.run(&["ip", "route", "replace", "default", "via", "192.168.20.254"]);
    dns.set("node-b.mesh.test", "192.168.20.12");
    let followed = c.wait_for(Duration::from_secs(6), |c| {
        c.peer_endpoint("a", "b") == "192.168.20.12:51820"
    });
    assert!(
        followed,
        "a still sends to {:?}\n{}",
        c.peer_endpoint("a", "b"),
        c.logs()
    );
    let resumed = c.wait_for(Duration::from_secs(20), |c| {
        c.pod_pings("a", "b") && c.pod_pings("b", "a")
    });
    assert!(resumed, "{}", c.logs());

    // The DNS server goes away: the last good address stays in use and traffic keeps flowing.
    drop(dns);
    let failed = c.wait_for(Duration::from_secs(12), |c| {
        !c.node("a")
            .events_of(Reason::EndpointLookupFailed)
            .is_empty()
    });
    assert!(failed, "{}", c.node("a").log_text());
    assert_eq!(c.peer_endpoint("a", "b"), "192.168.20.12:51820");
    assert!(c.pod_pings("a", "b"), "{}", c.logs());
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_nated_node_with_keepalive_is_reached_through_its_discovered_endpoint() {
    common::require_root("a_nated_node_with_keepalive_is_reached_through_its_discovered_endpoint");
    if !common::which("iptables") {
        eprintln!("(needs iptables too)");
        return;
    }
    let mut c = Cluster::new(&["east", "west"]);
    c.add_node(
        &NodeSpec {
            name: "a",
            location: "east",
            annotations: &[],
        },
        1,
    );
    let (_, nat_ip) = c.add_nated_node(
        &NodeSpec {
            name: "b",
            location: "west",
            annotations: &[("kilo.squat.ai/persistent-keepalive", "2")],
        },
        2,
    );
    for i in 0..2 {
        c.start_kg(i, &["--encapsulate=never"]);
    }
    // b publishes its private 10.99.2.2 (unreachable from a); a learns the NAT's address.
    let up = c.wait_for(Duration::from_secs(30), |c| {
        c.pod_pings("a", "b") && c.pod_pings("b", "a")
    });
    assert!(up, "{}", c.logs());
    assert_eq!(
        c.annotations("b")["kilo.squat.ai/endpoint"],
        "10.99.2.2:51820"
    );
    assert!(
        c.peer_endpoint("a", "b").starts_with(&format!("{nat_ip}:")),
        "{}",
        c.peer_endpoint("a", "b")
    );
    let published = c.wait_for(Duration::from_secs(10), |c| {
        c.annotations("a")
            .get("kilo.squat.ai/discovered-endpoints")
            .is_some_and(|v| v.contains(&format!("\"IP\":\"{nat_ip}\"")))
    });
    assert!(published, "{:?}\n{}", c.annotations("a"), c.logs());
    // Several resyncs later the session still holds (no reconfiguration back to 10.99.2.2).
    std::thread::sleep(Duration::from_secs(5));
    assert!(c.peer_endpoint("a", "b").starts_with(&format!("{nat_ip}:")));
    assert!(
        c.pod_pings("a", "b") && c.pod_pings("b", "a"),
        "{}",
        c.logs()
    );
    assert!(c.node("a").events_of(Reason::EndpointSwitched).is_empty());

    // b's kg, killed (so b stays in the mesh: nothing is removed), comes back on another port:
    // its handshakes reach a through another NAT mapping, and a follows them and says so,
    // once, naming b and both addresses.
    let before = c.peer_endpoint("a", "b");
    c.nodes[1].kill();
    c.start_kg(1, &["--encapsulate=never", "--port=51821"]);
    let moved = c.wait_for(Duration::from_secs(30), |c| {
        let now = c.peer_endpoint("a", "b");
        now != before && now.starts_with(&format!("{nat_ip}:")) && c.pod_pings("a", "b")
    });
    assert!(
        moved,
        "{} (was {before})\n{}",
        c.peer_endpoint("a", "b"),
        c.logs()
    );
    let after = c.peer_endpoint("a", "b");
    let said = c.wait_for(Duration::from_secs(10), |c| {
        !c.node("a").events_of(Reason::EndpointSwitched).is_empty()
    });
    let switched = c.node("a").events_of(Reason::EndpointSwitched);
    assert!(said, "{:?}\n{}", c.node("a").events(), c.logs());
    assert_eq!(switched.len(), 1, "{switched:?}");
    assert_eq!(switched[0].subject, "b");
    assert!(
        switched[0].message.contains(&before) && switched[0].message.contains(&after),
        "{}",
        switched[0].message
    );
}
