//! End-to-end: encapsulation inside a location. This kernel has no IPIP, so kg must pick its
//! userspace IPIP device by itself; non-leaders then reach the other location through IPIP to
//! their leader, and only the location's nodes may send protocol 4 (KILO-IPIP).

use crate::common;
use control::journal::Reason;

use std::time::Duration;

use common::cluster::{Cluster, KgNode, NodeSpec};

const DEVICE: &str = "kilo-ipip";

fn node(name: &'static str, location: &'static str) -> NodeSpec<'static> {
    NodeSpec {
        name,
        location,
        annotations: &[],
    }
}

fn text(node: &KgNode, args: &[&str]) -> String {
    String::from_utf8_lossy(&node.ns.output(args).stdout).into_owned()
}

/// Packets the kernel sent into (TX) and received from (RX) the node's IPIP device.
fn device_packets(node: &KgNode) -> (u64, u64) {
    let stats = text(
        node,
        &[
            "cat",
            &format!("/sys/class/net/{DEVICE}/statistics/tx_packets"),
            &format!("/sys/class/net/{DEVICE}/statistics/rx_packets"),
        ],
    );
    let mut numbers = stats.lines().map(|l| l.trim().parse::<u64>().unwrap_or(0));
    (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0))
}

/// The route `ip route get` picks for `dst` from `node`.
fn route_to(node: &KgNode, dst: &str) -> String {
    text(node, &["ip", "route", "get", dst])
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn always_carries_location_traffic_over_userspace_ipip() {
    common::require_root("always_carries_location_traffic_over_userspace_ipip");
    let mut c = Cluster::new(&["east", "west"]);
    c.add_node(&node("n1", "east"), 1);
    c.add_node(&node("n2", "east"), 2);
    c.add_node(&node("n3", "west"), 3);
    c.add_node(&node("n4", "west"), 4);
    for i in 0..4 {
        // Kilo's own chains (KILO-IPIP), which the test reads with iptables.
        c.start_kg(i, &["--encapsulate=always", "--firewall=iptables"]);
    }
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    for n in &c.nodes {
        let tunnel = n.status().and_then(|s| s.tunnel);
        assert_eq!(
            tunnel.as_deref(),
            Some("kilo-ipip"),
            "{} does not encapsulate over the userspace IPIP link:\n{}",
            n.name,
            n.log_text()
        );
    }

    // n2 (not a leader) reaches the west through n1's private IP, over IPIP.
    let n2 = c.node("n2");
    let route = route_to(n2, "10.42.3.1");
    assert!(
        route.contains("via 192.168.10.1") && route.contains(&format!("dev {DEVICE}")),
        "{route}\n{}",
        c.logs()
    );
    // Inside the location too: n2 → n1's pods over IPIP, with the location's MTU less 20.
    assert!(route_to(n2, "10.42.1.1").contains(&format!("dev {DEVICE}")));
    let link = text(n2, &["ip", "link", "show", DEVICE]);
    assert!(link.contains("mtu 1480"), "{link}");
    let (tx, rx) = device_packets(n2);
    assert!(tx > 0 && rx > 0, "no IPIP traffic on n2: tx {tx} rx {rx}");

    // From n2's own address (not a pod's): the reply reaches n1 over WireGuard and only the
    // table-1107 rule `iif <kilo> to 192.168.10.2` sends it back through IPIP.
    assert!(
        common::ping_ok(&c.node("n2").ns.name, "10.42.4.1", Duration::from_secs(10)),
        "{}\n{}",
        text(c.node("n1"), &["ip", "rule"]),
        c.logs()
    );
    let rules = text(c.node("n1"), &["ip", "rule"]);
    assert!(rules.contains("to 192.168.10.2 iif"), "{rules}");
    assert!(
        rules
            .lines()
            .filter(|l| l.contains("1107"))
            .all(|l| !l.trim_end().ends_with("none")),
        "table-1107 rules must look the table up: {rules}"
    );

    // The leader carries the west's replies back to n2 through IPIP as well.
    let (tx, rx) = device_packets(c.node("n1"));
    assert!(tx > 0 && rx > 0, "no IPIP traffic on n1: tx {tx} rx {rx}");

    // KILO-IPIP accepts the location's private IPs only; other IPIP is dropped.
    let chain = text(n2, &["iptables", "-S", "KILO-IPIP"]);
    for ip in ["192.168.10.1/32", "192.168.10.2/32"] {
        assert!(
            chain.contains(&format!(
                "-A KILO-IPIP -s {ip} -m comment --comment \"Kilo: allow IPIP traffic\" -j ACCEPT"
            )),
            "{chain}"
        );
    }
    assert!(!chain.contains("192.168.20."), "{chain}");
    let input = text(n2, &["iptables", "-S", "INPUT"]);
    let jump = input.find("Kilo: jump to IPIP chain").expect(&input);
    let drop = input.find("Kilo: reject other IPIP traffic").expect(&input);
    assert!(jump < drop, "{input}");

    // A deleted INPUT rule comes back in order within a resync.
    let n2 = c.node("n2");
    n2.ns.run(&[
        "iptables",
        "-D",
        "INPUT",
        "-p",
        "4",
        "-m",
        "comment",
        "--comment",
        "Kilo: jump to IPIP chain",
        "-j",
        "KILO-IPIP",
    ]);
    let restored = c.wait_for(Duration::from_secs(10), |c| {
        let input = text(c.node("n2"), &["iptables", "-S", "INPUT"]);
        matches!(
            (input.find("Kilo: jump to IPIP chain"), input.find("Kilo: reject other IPIP traffic")),
            (Some(j), Some(d)) if j < d
        )
    });
    assert!(
        restored,
        "{}",
        text(c.node("n2"), &["iptables", "-S", "INPUT"])
    );
    assert!(c.all_pods_reachable().is_ok(), "{}", c.logs());

    // Clean-up removes the chain and the INPUT rules.
    c.nodes[1].stop();
    let input = text(&c.nodes[1], &["iptables", "-S"]);
    assert!(!input.contains("Kilo:"), "{input}");
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn crosssubnet_encapsulates_only_to_other_subnets() {
    common::require_root("crosssubnet_encapsulates_only_to_other_subnets");
    let mut c = Cluster::new(&["east", "west"]);
    // east: n1 and n4 share 192.168.10.0/24, n2 sits on 192.168.11.0/24 of the same bridge.
    c.add_node(&node("n1", "east"), 1);
    c.add_node_in_subnet(&node("n2", "east"), 2, 11);
    c.add_node(&node("n3", "west"), 3);
    c.add_node(&node("n4", "east"), 4);
    for i in 0..4 {
        c.start_kg(i, &["--encapsulate=crosssubnet", "--firewall=iptables"]);
    }
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());

    // n4 is on the leader's subnet: plain routes. n2 is not: IPIP.
    let n4 = c.node("n4");
    let plain = route_to(n4, "10.42.3.1");
    assert!(
        plain.contains("via 192.168.10.1") && plain.contains("dev eth0"),
        "{plain}\n{}",
        c.logs()
    );
    let n2 = c.node("n2");
    let wrapped = route_to(n2, "10.42.3.1");
    assert!(
        wrapped.contains("via 192.168.10.1") && wrapped.contains(&format!("dev {DEVICE}")),
        "{wrapped}\n{}",
        c.logs()
    );
    // n1 → n2's pods over IPIP, n1 → n4's pods plain; the table-1107 rule sends pod traffic
    // for n2's private IP through the tunnel too.
    let n1 = c.node("n1");
    assert!(route_to(n1, "10.42.2.1").contains(&format!("dev {DEVICE}")));
    assert!(route_to(n1, "10.42.4.1").contains("dev eth0"));
    let rules = text(n1, &["ip", "rule"]);
    assert!(rules.contains("to 192.168.11.2 lookup 1107"), "{rules}");
    let (tx, rx) = device_packets(n2);
    assert!(tx > 0 && rx > 0, "no IPIP traffic on n2: tx {tx} rx {rx}");
}

/// `--compatibility=flannel` routes inside the location over `flannel.1` (which flannel may
/// create after kg starts), to the pod CIDR's network address; `--compatibility=cilium` reuses
/// `cilium_tunl` and publishes `cilium_host`'s address as `cni-compatibility-ip`. The links are
/// stand-ins (bridges) with the right names: kg only routes over them.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn compatibility_modes_route_over_the_cnis_links() {
    common::require_root("compatibility_modes_route_over_the_cnis_links");
    let mut c = Cluster::new(&["east"]);
    c.add_node(&node("n1", "east"), 1);
    c.add_node(&node("n2", "east"), 2);
    c.start_kg(0, &["--compatibility=flannel"]);
    c.start_kg(1, &["--compatibility=flannel"]);
    let warned = c.wait_for(Duration::from_secs(20), |c| {
        c.node("n2")
            .events_of(Reason::TunnelMissing)
            .iter()
            .any(|e| e.subject == "flannel.1")
    });
    assert!(warned, "{}", c.logs());
    let n2 = c.node("n2");
    n2.ns
        .run(&["ip", "link", "add", "flannel.1", "type", "bridge"]);
    n2.ns.run(&["ip", "link", "set", "flannel.1", "up"]);
    let routed = c.wait_for(Duration::from_secs(10), |c| {
        route_to(c.node("n2"), "10.42.1.1").contains("via 10.42.1.0 dev flannel.1")
    });
    assert!(
        routed,
        "{}\n{}",
        route_to(c.node("n2"), "10.42.1.1"),
        c.logs()
    );
    drop(c);

    let mut c = Cluster::new(&["east"]);
    c.add_node(&node("n1", "east"), 1);
    c.add_node(&node("n2", "east"), 2);
    for (i, host_ip) in [(0, "10.0.1.5/32"), (1, "10.0.2.5/32")] {
        let ns = &c.nodes[i].ns;
        ns.run(&["ip", "link", "add", "cilium_tunl", "type", "bridge"]);
        ns.run(&["ip", "link", "add", "cilium_host", "type", "bridge"]);
        ns.run(&["ip", "addr", "add", host_ip, "dev", "cilium_host"]);
        ns.run(&["ip", "link", "set", "cilium_host", "up"]);
        c.start_kg(i, &["--compatibility=cilium"]);
    }
    let published = c.wait_for(Duration::from_secs(20), |c| {
        c.annotations("n1")
            .get("kilo.squat.ai/cni-compatibility-ip")
            .is_some_and(|v| v == "10.0.1.5/32")
    });
    assert!(published, "{:?}\n{}", c.annotations("n1"), c.logs());
    let routed = c.wait_for(Duration::from_secs(10), |c| {
        route_to(c.node("n2"), "10.42.1.1").contains("via 10.0.1.5 dev cilium_tunl")
    });
    assert!(
        routed,
        "{}\n{}",
        route_to(c.node("n2"), "10.42.1.1"),
        c.logs()
    );
    assert_eq!(
        c.node("n2").status().and_then(|s| s.tunnel).as_deref(),
        Some("cilium_tunl"),
        "{}",
        c.logs()
    );
}

/// The iptables rules go through whichever `iptables` is first on `PATH`: here the legacy
/// (x_tables) back end, while the other tests use the system's default (nft).
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn iptables_rules_work_on_the_legacy_backend() {
    common::require_root("iptables_rules_work_on_the_legacy_backend");
    assert!(
        common::which("iptables-legacy"),
        "iptables_rules_work_on_the_legacy_backend: no iptables-legacy (Debian's iptables has it)"
    );
    let mut c = Cluster::new(&["east"]);
    c.add_node(&node("n1", "east"), 1);
    c.add_node(&node("n2", "east"), 2);
    // Fresh namespaces hold no rules, so kg would pick nft by itself: the flag forces legacy.
    for i in 0..2 {
        c.start_kg(i, &["--iptables-backend=legacy"]);
    }
    let ruled = c.wait_for(Duration::from_secs(20), |c| {
        let chain = text(c.node("n2"), &["iptables-legacy", "-S", "KILO-IPIP"]);
        let nat = text(
            c.node("n2"),
            &["iptables-legacy", "-t", "nat", "-S", "KILO-NAT"],
        );
        chain.contains("-s 192.168.10.1/32") && nat.contains("MASQUERADE")
    });
    assert!(ruled, "{}", c.logs());
    let input = text(c.node("n2"), &["iptables-legacy", "-S", "INPUT"]);
    assert!(input.contains("Kilo: reject other IPIP traffic"), "{input}");
    let nft = text(c.node("n2"), &["iptables-nft", "-S"]);
    assert!(!nft.contains("Kilo:"), "nothing on the nft side: {nft}");
    assert!(c.all_pods_reachable().is_ok(), "{}", c.logs());
    // A deleted rule comes back, through the legacy back end.
    c.node("n2")
        .ns
        .run(&["iptables-legacy", "-t", "nat", "-F", "KILO-NAT"]);
    let restored = c.wait_for(Duration::from_secs(10), |c| {
        text(
            c.node("n2"),
            &["iptables-legacy", "-t", "nat", "-S", "KILO-NAT"],
        )
        .contains("MASQUERADE")
    });
    assert!(restored, "{}", c.logs());
    c.nodes[1].stop();
    let left = text(&c.nodes[1], &["iptables-legacy", "-S"]);
    assert!(!left.contains("Kilo:"), "{left}");
}
