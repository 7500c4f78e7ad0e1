//! End-to-end: the Kilo network over an IPv6 underlay (file backend, network namespaces).
//! Nodes announce IPv6 endpoints and internal IPs (`force-endpoint`, `force-internal-ip`), as
//! Kilo's annotations allow, on dual-stack hosts and on IPv6-only hosts (no IPv4 address on the
//! underlay). Pods, the pod CIDRs and the Kilo subnet stay IPv4: WireGuard carries IPv4 inside
//! IPv6 UDP. Every granularity is checked for the same things: no route mixes families, every
//! host and pod address reaches every other of its family, and a steady mesh logs no failed
//! route or rule change over many resyncs.

use crate::common;
use control::journal::Reason;

use std::time::{Duration, Instant};

use common::cluster::{Cluster, NodeSpec};

/// What the nodes' underlay holds besides `fd50::<n>/64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Underlay {
    /// IPv4 (`192.168.10.<n>/24`) too.
    DualStack,
    /// Nothing else: the harness's IPv4 address and default route are removed.
    Ipv6Only,
}

/// a1, a2 in location x and b1, b2 in y, all on one L2 segment with `fd50::<n>/64` (and IPv4 on
/// a dual-stack underlay), each announcing `[fd50::<n>]:51820` and `fd50::<n>/64`, running kg
/// with `extra`.
fn ipv6_mesh(underlay: Underlay, extra: &[&str]) -> Cluster {
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
        let node = &c.nodes[index];
        let ns = &node.ns;
        if underlay == Underlay::Ipv6Only {
            // Takes the default route with it.
            ns.run(&[
                "ip",
                "addr",
                "del",
                &format!("{}/24", node.ip),
                "dev",
                "eth0",
            ]);
        }
        ns.run(&["ip", "-6", "addr", "add", &internal, "dev", "eth0", "nodad"]);
        ns.run(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
    }
    for i in 0..4 {
        c.start_kg(i, extra);
    }
    c
}

/// The addresses of node `n` (1-based) on `underlay`: its IPv6 host address, its IPv4 one on a
/// dual-stack underlay, and its pod address.
fn addresses(c: &Cluster, underlay: Underlay, n: usize) -> Vec<String> {
    let node = &c.nodes[n - 1];
    let mut out = vec![format!("fd50::{n}")];
    if underlay == Underlay::DualStack {
        out.push(node.ip.clone());
    }
    out.push(node.pod_ip.clone());
    out
}

/// Every node, from its host (the source the kernel picks, as the host's own traffic has) and
/// from its pod address, against every address of every other node in the source's family,
/// one echo each (three tries): the pairs that failed.
fn unreachable_pairs(c: &Cluster, underlay: Underlay) -> Vec<String> {
    let mut failed = Vec::new();
    for a in 1..=c.nodes.len() {
        let node = &c.nodes[a - 1];
        for b in (1..=c.nodes.len()).filter(|b| *b != a) {
            for target in addresses(c, underlay, b) {
                let ipv6 = target.contains(':');
                let mut sources = vec![None];
                if !ipv6 {
                    sources.push(Some(node.pod_ip.as_str()));
                }
                for source in sources {
                    let mut args = vec!["ping", "-c", "1", "-W", "1"];
                    if let Some(source) = source {
                        args.extend(["-I", source]);
                    }
                    args.push(&target);
                    let ok = (0..3).any(|_| node.ns.output(&args).status.success());
                    if !ok {
                        let from = source.unwrap_or("host");
                        failed.push(format!("{} ({from}) → {target}", node.name));
                    }
                }
            }
        }
    }
    failed
}

/// How long a steady mesh is watched for failed route changes (resyncs every 2 s).
const STEADY: Duration = Duration::from_secs(20);

/// Meshes the cluster in `granularity` with `--encapsulate=<encapsulate>` on `underlay` and
/// checks it: every address reaches every other of its family, no route mixes families, the
/// endpoints in use are IPv6, and over [`STEADY`] of 2-second resyncs no route or rule change
/// fails and everything stays reachable.
fn steady_mesh(underlay: Underlay, granularity: &str, encapsulate: &str) -> Cluster {
    let granularity_flag = format!("--mesh-granularity={granularity}");
    let encapsulate_flag = format!("--encapsulate={encapsulate}");
    let started = Instant::now();
    let c = ipv6_mesh(
        underlay,
        &[&encapsulate_flag, "--resync-period=2s", &granularity_flag],
    );
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    let meshed_after = started.elapsed();
    assert_eq!(
        unreachable_pairs(&c, underlay),
        Vec::<String>::new(),
        "{}",
        c.logs()
    );
    assert_eq!(c.mixed_routes(), Vec::<String>::new(), "{}", c.logs());
    let endpoints = c.node("a1").wg("endpoints");
    assert!(endpoints.contains("[fd50::"), "{endpoints}");
    assert!(!endpoints.contains("192.168."), "{endpoints}");
    std::thread::sleep(STEADY);
    assert_eq!(
        c.failed_route_changes(),
        Vec::<String>::new(),
        "{}",
        c.logs()
    );
    assert_eq!(
        unreachable_pairs(&c, underlay),
        Vec::<String>::new(),
        "{}",
        c.logs()
    );
    assert_eq!(c.mixed_routes(), Vec::<String>::new(), "{}", c.logs());
    eprintln!(
        "{granularity}, encapsulate {encapsulate}, on {underlay:?}: meshed after {meshed_after:?}, steady for {STEADY:?}, {:?} in all",
        started.elapsed()
    );
    c
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn location_granularity_over_a_dual_stack_underlay() {
    common::require_root("location_granularity_over_a_dual_stack_underlay");
    drop(steady_mesh(Underlay::DualStack, "location", "never"));
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn location_granularity_over_an_ipv6_only_underlay() {
    common::require_root("location_granularity_over_an_ipv6_only_underlay");
    drop(steady_mesh(Underlay::Ipv6Only, "location", "never"));
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn full_granularity_over_a_dual_stack_underlay() {
    common::require_root("full_granularity_over_a_dual_stack_underlay");
    drop(steady_mesh(Underlay::DualStack, "full", "never"));
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn full_granularity_over_an_ipv6_only_underlay() {
    common::require_root("full_granularity_over_an_ipv6_only_underlay");
    drop(steady_mesh(Underlay::Ipv6Only, "full", "never"));
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn cross_granularity_over_a_dual_stack_underlay() {
    common::require_root("cross_granularity_over_a_dual_stack_underlay");
    drop(steady_mesh(Underlay::DualStack, "cross", "never"));
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn cross_granularity_over_an_ipv6_only_underlay() {
    common::require_root("cross_granularity_over_an_ipv6_only_underlay");
    drop(steady_mesh(Underlay::Ipv6Only, "cross", "never"));
}

/// IPIP (Kilo's default `--encapsulate=always`) over IPv6 internal IPs: this kernel has no
/// IPIP module, so kilotun's userspace IPIP device carries the location's IPv4 pod traffic in
/// an outer IPv6 header (next header 4, the bytes of the kernel's `ip6tnl` in `ipip6` mode),
/// addressed to the internal IP of the node whose pod CIDR the route covers.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn location_granularity_with_ipip_encapsulation_over_an_ipv6_only_underlay() {
    common::require_root("location_granularity_with_ipip_encapsulation_over_an_ipv6_only_underlay");
    common::require_tcpdump(
        "location_granularity_with_ipip_encapsulation_over_an_ipv6_only_underlay",
    );
    let c = steady_mesh(Underlay::Ipv6Only, "location", "always");
    let route = c
        .node("a1")
        .ns
        .output(&["ip", "route", "show", "10.42.2.0/24"]);
    let route = String::from_utf8_lossy(&route.stdout).to_string();
    assert!(
        route.contains("dev kilo-ipip") && !route.contains("via"),
        "{route}"
    );
    // a1's pod pings a2's pod while a2 captures on its underlay: IPv6 carrying protocol 4.
    let a2 = c.node("a2");
    let capture = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &a2.ns.name,
            "timeout",
            "10",
            "tcpdump",
            "-i",
            "eth0",
            "-c",
            "3",
            "-nn",
            "ip6 proto 4",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(1));
    let ping = c.node("a1").ns.output(&[
        "ping",
        "-c",
        "5",
        "-i",
        "0.2",
        "-W",
        "1",
        "-I",
        "10.42.1.1",
        "10.42.2.1",
    ]);
    assert!(ping.status.success(), "{}", c.logs());
    let captured = capture.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&captured.stdout);
    assert!(
        text.lines()
            .filter(|l| l.contains("fd50::1 > fd50::2") || l.contains("fd50::2 > fd50::1"))
            .count()
            >= 3,
        "no IPv4-in-IPv6 on a2's underlay: {text}\n(tcpdump: {}, {})\n{}",
        captured.status,
        String::from_utf8_lossy(&captured.stderr).trim(),
        c.logs()
    );
}

/// IPIP on dual-stack hosts whose internal IPs are IPv6: the location's IPv4 pods still go to
/// the internal IP the user chose, in an outer IPv6 header, although each kg also publishes its
/// IPv4 address (`kilotun.io/second-internal-ip`, the gateway for IPv6 destinations only).
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn location_granularity_with_ipip_encapsulation_over_a_dual_stack_underlay() {
    common::require_root("location_granularity_with_ipip_encapsulation_over_a_dual_stack_underlay");
    let c = steady_mesh(Underlay::DualStack, "location", "always");
    let route = c
        .node("a1")
        .ns
        .run(&["ip", "route", "show", "10.42.2.0/24"]);
    assert!(
        route.contains("dev kilo-ipip") && !route.contains("via"),
        "{route}\n{}",
        c.logs()
    );
    assert_eq!(
        c.annotations("a2")
            .get("kilotun.io/second-internal-ip")
            .map(String::as_str),
        Some("192.168.10.2/24")
    );
}

/// Full granularity has no encapsulation inside a location (every node is a segment of its
/// own), so `--encapsulate=always` must change nothing on an IPv6-only underlay.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn full_granularity_with_ipip_encapsulation_over_an_ipv6_only_underlay() {
    common::require_root("full_granularity_with_ipip_encapsulation_over_an_ipv6_only_underlay");
    drop(steady_mesh(Underlay::Ipv6Only, "full", "always"));
}

/// Pings `target` from `node`'s host addresses (no pod source).
fn host_reaches(c: &Cluster, node: &str, target: &str) -> bool {
    common::ping_ok(&c.node(node).ns.name, target, Duration::from_secs(5))
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn hosts_reach_remote_pods_over_an_ipv6_internal_ip() {
    common::require_root("hosts_reach_remote_pods_over_an_ipv6_internal_ip");
    let c = ipv6_mesh(Underlay::DualStack, &["--encapsulate=never"]);
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    // Leaders and non-leaders alike, to the other location's pods and back, with the source
    // the kernel picks.
    for (from, to) in [("a1", "b1"), ("a2", "b2"), ("b2", "a2"), ("b1", "a1")] {
        let target = c.node(to).pod_ip.clone();
        assert!(
            host_reaches(&c, from, &target),
            "{from} → {target}\n{}",
            c.logs()
        );
    }
}

/// An IPv6 `force-internal-ip` on a node whose host has no IPv6 address: kg refuses it with one
/// error naming the node, the annotation and the value, announces the detected IPv4 internal IP
/// instead, and the node stays on the mesh.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_forced_internal_ip_of_a_family_the_host_lacks_falls_back_to_detection() {
    common::require_root("a_forced_internal_ip_of_a_family_the_host_lacks_falls_back_to_detection");
    let mut c = Cluster::new(&["east", "west"]);
    let forced = [("kilo.squat.ai/force-internal-ip", "fd50::1/64")];
    for (i, (name, location)) in [("n1", "east"), ("n2", "east"), ("n3", "west")]
        .into_iter()
        .enumerate()
    {
        let spec = NodeSpec {
            name,
            location,
            annotations: if name == "n1" { &forced } else { &[] },
        };
        c.add_node(&spec, i as u8 + 1);
    }
    for i in 0..3 {
        c.start_kg(i, &["--encapsulate=never"]);
    }
    let meshed = c.wait_for(Duration::from_secs(30), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    let refusals = |c: &common::cluster::Cluster| {
        c.node("n1")
            .events_of(Reason::BadAnnotation)
            .iter()
            .filter(|e| e.subject == "n1" && e.message.contains("force-internal-ip"))
            .count()
    };
    let logged = c.wait_for(Duration::from_secs(10), |c| refusals(c) > 0);
    assert!(logged, "{:?}", c.node("n1").events());
    assert_eq!(
        c.annotations("n1")
            .get("kilo.squat.ai/internal-ip")
            .map(String::as_str),
        Some("192.168.10.1/24")
    );
    // Resyncs later: said once, and the mesh still whole.
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(refusals(&c), 1);
    assert_eq!(c.all_pods_reachable(), Ok(()), "{}", c.logs());
}

/// A Peer outside the cluster, set up from `kgctl showconf peer` as Kilo's docs have users do,
/// reaches every pod over an IPv6-only underlay: the leaders' endpoints it is given are IPv6, and
/// the leaders answer at the IPv6 endpoint its keepalives come from.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_peer_from_kgctl_showconf_reaches_every_pod_over_an_ipv6_only_underlay() {
    common::require_root("a_peer_from_kgctl_showconf_reaches_every_pod_over_an_ipv6_only_underlay");
    let c = ipv6_mesh(Underlay::Ipv6Only, &["--encapsulate=never"]);
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    let laptop = common::cluster::Laptop::join(&c, "laptop", "seg", 50, 10);
    let conf = laptop.conf();
    assert_eq!(conf.matches("Endpoint = [fd50::").count(), 2, "{conf}");
    // The laptop's underlay is IPv6 only too.
    laptop.ns.run(&["ip", "-4", "addr", "flush", "dev", "eth0"]);
    laptop.ns.run(&[
        "ip",
        "-6",
        "addr",
        "add",
        "fd50::50/64",
        "dev",
        "eth0",
        "nodad",
    ]);
    for n in &c.nodes {
        let pod = n.pod_ip.clone();
        let reached = c.wait_for(Duration::from_secs(30), |_| {
            laptop
                .ns
                .output(&["ping", "-c", "1", "-W", "1", "-I", &laptop.ip, &pod])
                .status
                .success()
        });
        assert!(
            reached,
            "the laptop cannot reach {pod}\n{conf}\n{}",
            c.logs()
        );
    }
    // Each leader reaches the laptop at its IPv6 address.
    for leader in ["a1", "b1"] {
        let endpoints = c.node(leader).wg("endpoints");
        let laptop_line = endpoints
            .lines()
            .find(|l| l.starts_with(&laptop.device.public_key))
            .unwrap_or_default()
            .to_string();
        assert!(laptop_line.contains("[fd50::50]:"), "{leader}: {endpoints}");
    }
}

/// An IPv6 `--subnet`: the leaders' WireGuard IPs come from it, and the IPv4 pods still reach
/// each other (the WireGuard link needs no gateway of their family).
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn an_ipv6_kilo_subnet_gives_the_leaders_ipv6_wireguard_ips() {
    common::require_root("an_ipv6_kilo_subnet_gives_the_leaders_ipv6_wireguard_ips");
    let c = ipv6_mesh(
        Underlay::DualStack,
        &[
            "--encapsulate=never",
            "--subnet=fd4b::/112",
            "--resync-period=2s",
        ],
    );
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    for leader in ["a1", "b1"] {
        let node = c.node(leader);
        let out = node
            .ns
            .output(&["ip", "-6", "addr", "show", "dev", &node.iface]);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        assert!(text.contains("inet6 fd4b::"), "{leader}: {text}");
    }
    // Every node reaches both leaders' WireGuard IPs (where kg serves /metrics and /graph).
    for n in &c.nodes {
        for wireguard_ip in ["fd4b::1", "fd4b::2"] {
            let reached = c.wait_for(Duration::from_secs(10), |_| {
                n.ns.output(&["ping", "-c", "1", "-W", "1", wireguard_ip])
                    .status
                    .success()
            });
            assert!(
                reached,
                "{} cannot reach {wireguard_ip}\n{}",
                n.name,
                c.logs()
            );
        }
    }
    std::thread::sleep(Duration::from_secs(10));
    assert_eq!(
        c.failed_route_changes(),
        Vec::<String>::new(),
        "{}",
        c.logs()
    );
    assert_eq!(c.mixed_routes(), Vec::<String>::new(), "{}", c.logs());
    assert_eq!(
        unreachable_pairs(&c, Underlay::DualStack),
        Vec::<String>::new(),
        "{}",
        c.logs()
    );
}

/// Two leaders per location over an IPv6-only underlay: each node of a location leads a share
/// of its own, each has the other location's two nodes as its peers over IPv6 endpoints, and
/// every address reaches every other of its family.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn two_leaders_per_location_over_an_ipv6_only_underlay() {
    common::require_root("two_leaders_per_location_over_an_ipv6_only_underlay");
    let underlay = Underlay::Ipv6Only;
    let c = ipv6_mesh(
        underlay,
        &["--encapsulate=never", "--leaders-per-location=2"],
    );
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    assert_eq!(
        c.leading(&["a1", "a2", "b1", "b2"]),
        ["a1", "a2", "b1", "b2"],
        "{}",
        c.logs()
    );
    for (node, others) in [
        ("a1", ["fd50::3", "fd50::4"]),
        ("b2", ["fd50::1", "fd50::2"]),
    ] {
        let endpoints = c.node(node).wg("endpoints");
        for other in others {
            assert!(
                endpoints.contains(&format!("[{other}]:51820")),
                "{endpoints}"
            );
        }
        assert_eq!(endpoints.lines().count(), 2, "{endpoints}");
    }
    assert_eq!(
        unreachable_pairs(&c, underlay),
        Vec::<String>::new(),
        "{}",
        c.logs()
    );
    assert_eq!(c.mixed_routes(), Vec::<String>::new(), "{}", c.logs());
}
