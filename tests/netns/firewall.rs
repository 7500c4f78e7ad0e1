//! Kilo's NAT rules through both of kg's firewalls, with real packets: the nftables table
//! `inet kilo` (`nft`) and iptables (`iptables-restore`), each in its own network namespaces.
//!
//! A pod (10.2.1.2) behind a node sends UDP to two hosts beyond it: 192.168.50.2, which the
//! rules masquerade, and 192.168.60.2, a destination Kilo leaves alone (a known IP: its
//! `KILO-NAT` returns). The far side reports the source each datagram arrived from. Then the
//! rules change incrementally (192.168.50.0/24 becomes known, then unknown again), and a rule
//! removed by someone else comes back at the next resync. The same rules, the same packets,
//! the same answers from both back ends. Kilo's IPIP guard (protocol 4 accepted only from the
//! location's private IPs) is checked the same way, with IPIP packets from two sources.

use crate::common;

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use common::{which, Netns};
use control::iptables::{IptRule, RuleSet, KILO_NAT};
use kilotun::agent::shells::{iptables, nftables};

const POD: &str = "10.2.1.2";
const MASQUERADED: &str = "192.168.50.2";
const KNOWN: &str = "192.168.60.2";
const NODE_OUTSIDE: &str = "192.168.50.1";

/// A pod, a node and a far host: pod —veth— node —veth— far.
struct Net {
    pod: Netns,
    node: Netns,
    far: Netns,
}

fn net() -> Net {
    let (pod, node, far) = (Netns::new(), Netns::new(), Netns::new());
    let link = |a: &Netns, b: &Netns, a_ip: &str, b_ip: &str| {
        let (ia, ib) = (common::unique("fa"), common::unique("fb"));
        common::run(&[
            "ip", "link", "add", &ia, "netns", &a.name, "type", "veth", "peer", &ib, "netns",
            &b.name,
        ]);
        a.run(&["ip", "addr", "add", a_ip, "dev", &ia]);
        b.run(&["ip", "addr", "add", b_ip, "dev", &ib]);
        a.run(&["ip", "link", "set", &ia, "up"]);
        b.run(&["ip", "link", "set", &ib, "up"]);
        ib
    };
    link(&pod, &node, "10.2.1.2/24", "10.2.1.1/24");
    let far_link = link(&node, &far, "192.168.50.1/24", "192.168.50.2/24");
    far.run(&["ip", "addr", "add", "192.168.60.2/24", "dev", &far_link]);
    pod.run(&["ip", "route", "add", "default", "via", "10.2.1.1"]);
    node.run(&["ip", "route", "add", "192.168.60.0/24", "via", MASQUERADED]);
    far.run(&["ip", "route", "add", "10.2.1.0/24", "via", NODE_OUTSIDE]);
    node.run(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    Net { pod, node, far }
}

fn comment(text: &str) -> String {
    format!("-m comment --comment \"{text}\"")
}

/// Kilo's rules for a node whose pods are 10.2.1.0/24, with `known` not NATed.
fn rules(known: &[&str]) -> RuleSet {
    let mut r = RuleSet::default();
    r.v4.builtin.push(IptRule {
        table: "nat",
        chain: "POSTROUTING",
        spec: format!(
            "-s 10.2.1.0/24 {} -j {KILO_NAT}",
            comment("Kilo: jump to KILO-NAT chain")
        ),
    });
    for net in known {
        r.v4.kilo_nat.push(format!(
            "-d {net} {} -j RETURN",
            comment("Kilo: do not NAT packets destined for known IPs")
        ));
    }
    r.v4.kilo_nat.push(format!(
        "{} -j MASQUERADE",
        comment("Kilo: NAT remaining packets")
    ));
    r
}

/// The source address a datagram from the pod to `to` arrives from.
fn source_seen(n: &Net, to: &str) -> String {
    let to: SocketAddr = format!("{to}:7070").parse().unwrap();
    let server = n.far.in_ns(move || {
        let socket = UdpSocket::bind(SocketAddr::new(to.ip(), 7070)).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut buf = [0u8; 16];
        socket
            .recv_from(&mut buf)
            .map(|(_, from)| from.ip().to_string())
    });
    std::thread::sleep(Duration::from_millis(100));
    // A new socket each time: a new conntrack entry, so the NAT decision is made again.
    n.pod
        .in_ns(move || {
            let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
            socket.send_to(b"kilo", to).unwrap();
        })
        .join()
        .unwrap();
    server
        .join()
        .unwrap()
        .unwrap_or_else(|e| format!("nothing: {e}"))
}

/// Runs `f` in the node's namespace (child processes it starts live there too).
fn on_node<T: Send + 'static>(n: &Net, f: impl FnOnce() -> T + Send + 'static) -> T {
    n.node.in_ns(f).join().unwrap()
}

fn check_nat(n: &Net, masquerading: bool, back_end: &str) {
    let seen = source_seen(n, MASQUERADED);
    let want = if masquerading { NODE_OUTSIDE } else { POD };
    assert_eq!(seen, want, "{back_end}: a datagram to {MASQUERADED}");
    assert_eq!(
        source_seen(n, KNOWN),
        POD,
        "{back_end}: a datagram to the known {KNOWN}"
    );
}

/// The same scenario through `reconcile` (one back end) and `remove_known` (someone else
/// deleting the known destination's rule).
fn scenario(
    back_end: &'static str,
    reconcile: fn(&RuleSet, Option<&RuleSet>) -> anyhow::Result<bool>,
    remove_known: &[&str],
) {
    let n = net();
    let first = rules(&["192.168.60.0/24"]);
    let rules1 = first.clone();
    assert!(on_node(&n, move || reconcile(&rules1, None).unwrap()));
    check_nat(&n, true, back_end);
    // Nothing to do when nothing changed, at a resync too.
    let (a, b) = (first.clone(), first.clone());
    assert!(!on_node(&n, move || reconcile(&a, Some(&b)).unwrap()));
    let a = first.clone();
    assert!(!on_node(&n, move || reconcile(&a, None).unwrap()));

    // 192.168.50.0/24 becomes known: an incremental change.
    let second = rules(&["192.168.60.0/24", "192.168.50.0/24"]);
    let (a, b) = (second.clone(), first.clone());
    assert!(on_node(&n, move || reconcile(&a, Some(&b)).unwrap()));
    check_nat(&n, false, back_end);
    // And unknown again.
    let (a, b) = (first.clone(), second);
    assert!(on_node(&n, move || reconcile(&a, Some(&b)).unwrap()));
    check_nat(&n, true, back_end);

    // Someone removes the rule that keeps 192.168.60.0/24's sources: masqueraded now ...
    n.node.run(remove_known);
    assert_eq!(
        source_seen(&n, KNOWN),
        NODE_OUTSIDE,
        "{back_end}: the rule was not removed"
    );
    // ... until the next resync (no previous rules: the host's are read and compared).
    let a = first;
    assert!(on_node(&n, move || reconcile(&a, None).unwrap()));
    check_nat(&n, true, back_end);
    eprintln!("{back_end}: masquerading, known destinations, incremental changes and a resync repairing a removed rule: as Kilo's chains");
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn nftables_masquerades_what_kilos_chains_masquerade() {
    let test = "nftables_masquerades_what_kilos_chains_masquerade";
    common::require_root(test);
    assert!(
        which("nft"),
        "{test}: nft is missing (apt install nftables)"
    );
    scenario(
        "nftables",
        |r, p| nftables::reconcile(r, p, false),
        &[
            "nft",
            "delete",
            "element",
            "inet",
            "kilo",
            "no_nat4",
            "{ 192.168.60.0/24 }",
        ],
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn iptables_masquerades_what_kilos_chains_masquerade() {
    let test = "iptables_masquerades_what_kilos_chains_masquerade";
    common::require_root(test);
    let spec = format!(
        "-d 192.168.60.0/24 {} -j RETURN",
        comment("Kilo: do not NAT packets destined for known IPs")
    );
    let mut delete = vec!["iptables", "-t", "nat", "-D", KILO_NAT];
    let words = shell_words(&spec);
    delete.extend(words.iter().map(String::as_str));
    scenario("iptables", |r, p| iptables::reconcile(r, p, false), &delete);
}

/// `spec` split as a shell would (the comment's quoted text is one word).
fn shell_words(spec: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut rest = spec;
    while !rest.is_empty() {
        rest = rest.trim_start();
        if let Some(quoted) = rest.strip_prefix('"') {
            let end = quoted.find('"').unwrap();
            words.push(quoted[..end].to_string());
            rest = &quoted[end + 1..];
        } else {
            let end = rest.find(' ').unwrap_or(rest.len());
            words.push(rest[..end].to_string());
            rest = &rest[end..];
        }
    }
    words
}

/// Kilo's IPIP guard for a location whose only other member is 192.168.50.2: protocol 4
/// from it is accepted, from anywhere else dropped.
fn ipip_rules() -> RuleSet {
    let mut r = RuleSet::default();
    r.v4.input = vec![
        format!(
            "-p 4 {} -j {}",
            comment("Kilo: jump to IPIP chain"),
            control::iptables::KILO_IPIP
        ),
        format!(
            "-p 4 {} -j DROP",
            comment("Kilo: reject other IPIP traffic")
        ),
    ];
    r.v4.kilo_ipip = Some(vec![format!(
        "-s {MASQUERADED}/32 {} -j ACCEPT",
        comment("Kilo: allow IPIP traffic")
    )]);
    r
}

/// Sends one IPIP packet (an inner IPv4 header, nothing else) from each of the far host's
/// addresses to the node, and returns the sources a raw IPIP socket on the node received,
/// which, like the kernel's `tunl0` and kg's userspace IPIP device, sees a packet only after
/// the INPUT hook.
fn ipip_sources_received(n: &Net) -> Vec<String> {
    use socket2::{Domain, Protocol, Socket, Type};
    let (ready, listening) = std::sync::mpsc::channel();
    let receiver = n.node.in_ns(move || {
        let socket = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::from(4))).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(1500)))
            .unwrap();
        ready.send(()).unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 256];
        while let Ok(len) = std::io::Read::read(&mut &socket, &mut buf) {
            // The outer IPv4 header's source address.
            if len >= 20 {
                seen.push(format!("{}.{}.{}.{}", buf[12], buf[13], buf[14], buf[15]));
            }
        }
        seen
    });
    listening.recv().unwrap();
    n.far
        .in_ns(|| {
            for from in [MASQUERADED, KNOWN] {
                let socket = Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::from(4))).unwrap();
                let bind: SocketAddr = format!("{from}:0").parse().unwrap();
                socket.bind(&bind.into()).unwrap();
                // An inner IPv4 header (10.9.0.1 → 10.9.0.2, protocol 253), no payload.
                let inner: [u8; 20] = [
                    0x45, 0, 0, 20, 0, 0, 0x40, 0, 64, 253, 0, 0, 10, 9, 0, 1, 10, 9, 0, 2,
                ];
                let to: SocketAddr = format!("{NODE_OUTSIDE}:0").parse().unwrap();
                socket.send_to(&inner, &to.into()).unwrap();
            }
        })
        .join()
        .unwrap();
    let mut seen = receiver.join().unwrap();
    seen.sort();
    seen.dedup();
    seen
}

/// The IPIP guard through `reconcile` (one back end): first no rules (both sources reach the
/// socket, so the check can fail), then Kilo's guard (only the member's).
fn ipip_scenario(
    back_end: &'static str,
    reconcile: fn(&RuleSet, Option<&RuleSet>) -> anyhow::Result<bool>,
) {
    let n = net();
    assert_eq!(
        ipip_sources_received(&n),
        vec![MASQUERADED.to_string(), KNOWN.to_string()],
        "{back_end}: without the guard, IPIP from anywhere arrives"
    );
    assert!(on_node(&n, move || reconcile(&ipip_rules(), None).unwrap()));
    assert_eq!(
        ipip_sources_received(&n),
        vec![MASQUERADED.to_string()],
        "{back_end}: the guard lets in IPIP from the location's member only"
    );
    eprintln!("{back_end}: IPIP accepted from the location's member, dropped from anyone else");
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn the_ipip_guard_drops_ipip_from_outside_the_location_in_both_back_ends() {
    let test = "the_ipip_guard_drops_ipip_from_outside_the_location_in_both_back_ends";
    common::require_root(test);
    ipip_scenario("iptables", |r, p| iptables::reconcile(r, p, false));
    assert!(
        which("nft"),
        "{test}: nft is missing (apt install nftables)"
    );
    ipip_scenario("nftables", |r, p| nftables::reconcile(r, p, false));
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn nftables_takes_every_rule_kilo_writes_for_both_families() {
    let test = "nftables_takes_every_rule_kilo_writes_for_both_families";
    common::require_root(test);
    if !which("nft") {
        assert!(
            std::env::var_os("CI").is_none() || which("nft"),
            "{test}: nft is missing"
        );
        return;
    }
    use control::fixtures::{f1_nodes, f1_params, f1_peers};
    use control::iptables::IptablesOptions;
    use control::node::Granularity;
    use control::topology::Topology;
    let node = Netns::new();
    // The kernel takes every construct (the probe leaves nothing behind).
    on_ns(&node, || nftables::probe().unwrap());
    assert_eq!(node.run(&["nft", "list", "tables"]).trim(), "");
    // F1's leader of location 2 with every option: pods, forwarding, services, IPIP.
    let options = IptablesOptions {
        cni: true,
        forward_rules: true,
        service_cidrs: vec![
            "10.96.0.0/12".parse().unwrap(),
            "fd00:96::/108".parse().unwrap(),
        ],
        ipip: true,
    };
    let topology = Topology::new(
        &f1_nodes(),
        &f1_peers(),
        &f1_params("b", Granularity::Location),
    )
    .unwrap();
    let rules = topology.iptables_rules(&options);
    // Every `nft` kg runs, counted by a wrapper.
    let dir = std::env::temp_dir().join(format!("kilotun-nft-count-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (wrapper, calls) = (dir.join("nft"), dir.join("calls"));
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\necho \"$*\" >> {}\nexec nft \"$@\"\n",
            calls.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    std::env::set_var("KILOTUN_NFT", &wrapper);
    let nft_runs = || {
        std::fs::read_to_string(&calls)
            .unwrap_or_default()
            .lines()
            .count()
    };
    let (a, b) = (rules.clone(), rules.clone());
    assert!(on_ns(&node, move || nftables::reconcile(&a, None, true).unwrap()));
    // Read back, the table is what was wanted: a resync changes nothing, and drift is empty.
    assert!(!on_ns(&node, move || nftables::reconcile(&b, None, true).unwrap()));
    // Found as wanted, it is not listed again while nothing is committed (the ruleset
    // generation stays), and listed once after anyone's commit, even to another table.
    let resync = |expected_runs: usize| {
        let r = rules.clone();
        assert!(!on_ns(&node, move || nftables::reconcile(&r, None, true).unwrap()));
        assert_eq!(
            nft_runs(),
            expected_runs,
            "{:?}",
            std::fs::read_to_string(&calls)
        );
    };
    let runs = nft_runs();
    resync(runs);
    resync(runs);
    node.run(&["nft", "add", "table", "inet", "kilotun_other"]);
    resync(runs + 1);
    resync(runs + 1);
    node.run(&["nft", "delete", "table", "inet", "kilotun_other"]);
    std::env::remove_var("KILOTUN_NFT");
    std::fs::remove_dir_all(&dir).unwrap();
    let c = rules;
    assert_eq!(
        on_ns(&node, move || nftables::drift(&c, true).unwrap()),
        Vec::<String>::new()
    );
    let listing = node.run(&["nft", "list", "table", "inet", "kilo"]);
    for needle in [
        "masquerade",
        "meta l4proto ipencap drop",
        "hook postrouting",
        "10.96.0.0/12",
        "fd00:96::/108",
    ] {
        assert!(listing.contains(needle), "{needle} missing:\n{listing}");
    }
    on_ns(&node, || nftables::clean_up().unwrap());
    assert_eq!(node.run(&["nft", "list", "tables"]).trim(), "");
}

fn on_ns<T: Send + 'static>(ns: &Netns, f: impl FnOnce() -> T + Send + 'static) -> T {
    ns.in_ns(f).join().unwrap()
}

/// A thousand known networks, then ten (a mass expiry of Nodes): the incremental change
/// flushes the set and adds what stays (`control::nftables::FLUSH_OVER`), and the kernel's
/// table is then exactly what the rules want; the masquerading still holds.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_thousand_networks_leaving_at_once_leave_the_table_as_wanted() {
    let test = "a_thousand_networks_leaving_at_once_leave_the_table_as_wanted";
    common::require_root(test);
    if !which("nft") {
        assert!(
            std::env::var_os("CI").is_none() || which("nft"),
            "{test}: nft is missing"
        );
        return;
    }
    let n = net();
    let many: Vec<String> = (0..1000)
        .map(|i| format!("10.{}.{}.0/24", 100 + i / 256, i % 256))
        .collect();
    let all: Vec<&str> = many.iter().map(String::as_str).collect();
    let before = rules(&all);
    let mut staying = all[..10].to_vec();
    staying.push("192.168.60.0/24");
    let after = rules(&staying);
    let (b, a) = (before, after);
    let drift = on_node(&n, move || {
        assert!(nftables::reconcile(&b, None, false).unwrap());
        assert!(nftables::reconcile(&a, Some(&b), false).unwrap());
        nftables::drift(&a, false).unwrap()
    });
    assert!(drift.is_empty(), "after the change: {drift:?}");
    check_nat(&n, true, "nftables");
}

/// What one change costs each back end with the rules of a node of 5,000 (500 locations of
/// 10, the local location's leader, every option): the whole rule set written at start, then a
/// node joining the local location (a handful of networks), each timed once. Prints the
/// figures; run by hand:
/// `cargo test --profile ci --test netns firewall:: -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, printed, not a check"]
fn one_change_at_5000_nodes_costs_each_back_end() {
    common::require_root("one_change_at_5000_nodes_costs_each_back_end");
    if !which("nft") {
        return;
    }
    use control::fixtures::{f1_params, synthetic_cluster};
    use control::iptables::IptablesOptions;
    use control::node::Granularity;
    use control::topology::{Topology, TopologyParams};
    use std::time::Instant;
    let options = IptablesOptions {
        cni: true,
        forward_rules: true,
        service_cidrs: vec!["10.96.0.0/12".parse().unwrap()],
        ipip: true,
    };
    let rules_of = |nodes: &[control::node::Node]| {
        let params = TopologyParams {
            hostname: "node-00000".into(),
            ..f1_params("node-00000", Granularity::Location)
        };
        Topology::new(nodes, &[], &params)
            .unwrap()
            .iptables_rules(&options)
    };
    let nodes = synthetic_cluster(5000, 500);
    let mut grown = nodes.clone();
    grown.extend(synthetic_cluster(5001, 500).pop());
    let (before, after) = (rules_of(&nodes), rules_of(&grown));
    eprintln!("KILO-NAT holds {} rules", before.v4.kilo_nat.len());
    type Reconcile = fn(&RuleSet, Option<&RuleSet>) -> anyhow::Result<bool>;
    let back_ends: [(&str, Reconcile); 2] = [
        ("nftables", |r, p| nftables::reconcile(r, p, false)),
        ("iptables", |r, p| iptables::reconcile(r, p, false)),
    ];
    for (name, reconcile) in back_ends {
        let node = Netns::new();
        let (b, a) = (before.clone(), after.clone());
        let (first, change, resync) = on_ns(&node, move || {
            let t = Instant::now();
            assert!(reconcile(&b, None).unwrap());
            let first = t.elapsed();
            let t = Instant::now();
            assert!(reconcile(&a, Some(&b)).unwrap());
            let change = t.elapsed();
            let t = Instant::now();
            assert!(!reconcile(&a, None).unwrap());
            (first, change, t.elapsed())
        });
        eprintln!(
            "{name}: whole rule set {first:.1?}, one node joining {change:.1?}, a resync finding nothing to do {resync:.1?}"
        );
    }
}
