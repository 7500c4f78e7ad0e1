//! End-to-end: dual-stack and IPv6-only pod networks (Kilo #94), file backend, network
//! namespaces. Each Node lists its pod CIDRs in `spec.podCIDRs` as a dual-stack Kubernetes
//! cluster does (`10.42.<n>.0/24` and `fd42:<n>::/64`); every host has an IPv4 and an IPv6
//! address on its underlay and announces nothing by hand, so its internal IP is the detected
//! IPv4 one and its kg publishes the IPv6 one as `kilotun.io/second-internal-ip`: the gateway
//! its location's other nodes route IPv6 pods through. Leaders carry both families over one
//! WireGuard link (IPv4 endpoints) with no gateway of the other family.

use crate::common;
use control::journal::Reason;

use std::time::Duration;

use common::calico;
use common::cluster::{Cluster, Laptop, NodeSpec};

/// Which pod CIDRs the Nodes list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pods {
    /// `10.42.<n>.0/24` first, then `fd42:<n>::/64`.
    DualStack,
    /// `fd42:<n>::/64` only.
    Ipv6Only,
}

/// a1, a2 in location x and b1, b2 in y, on one L2 segment with `192.168.10.<n>/24` and
/// `fd50::<n>/64`; pod bridges with `10.42.<n>.1` and `fd42:<n>::1`; kg with `extra`.
fn pod_mesh(pods: Pods, extra: &[&str]) -> Cluster {
    pod_mesh_with(pods, extra, &[])
}

/// [`pod_mesh`], where the hosts named in `ipv4_only_hosts` have no IPv6 underlay address.
fn pod_mesh_with(pods: Pods, extra: &[&str], ipv4_only_hosts: &[&str]) -> Cluster {
    let mut c = Cluster::new(&["seg"]);
    for (i, (name, location)) in [("a1", "x"), ("a2", "x"), ("b1", "y"), ("b2", "y")]
        .into_iter()
        .enumerate()
    {
        let n = i + 1;
        let spec = NodeSpec {
            name,
            location,
            annotations: &[],
        };
        let index = c.add_node_on(&spec, "seg", n as u8);
        let ns = &c.nodes[index].ns;
        let mut addresses = vec![(format!("fd42:{n}::1/64"), "pods0")];
        if !ipv4_only_hosts.contains(&name) {
            addresses.push((format!("fd50::{n}/64"), "eth0"));
        }
        for (address, dev) in addresses {
            ns.run(&["ip", "-6", "addr", "add", &address, "dev", dev, "nodad"]);
        }
        ns.run(&["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
        let ipv4 = format!("10.42.{n}.0/24");
        let ipv6 = format!("fd42:{n}::/64");
        match pods {
            Pods::DualStack => c.set_pod_cidrs(name, &[&ipv4, &ipv6]),
            Pods::Ipv6Only => c.set_pod_cidrs(name, &[&ipv6]),
        }
    }
    for i in 0..4 {
        // Kilo's shipped conflist, at the path the harness gives each kg.
        let conflist = c.work.join(format!("{}.conflist", c.nodes[i].name));
        std::fs::write(&conflist, KILO_CONFLIST).unwrap();
        c.start_kg(i, extra);
    }
    c
}

/// Kilo's shipped CNI conflist (one IPv4-less `host-local` IPAM for kg to fill).
const KILO_CONFLIST: &str = r#"{"cniVersion":"0.4.0","name":"kilo","plugins":[{"name":"kubernetes","type":"bridge","bridge":"kube-bridge","isDefaultGateway":true,"forceAddress":true,"mtu":1420,"ipam":{"type":"host-local"}},{"type":"portmap","snat":true,"capabilities":{"portMappings":true}}]}"#;

/// The IPv6 pod address of node `n` (1-based).
fn ipv6_pod(n: usize) -> String {
    format!("fd42:{n}::1")
}

/// Every node against every other node's IPv6 pod address, from its own IPv6 pod address (as
/// a pod's traffic is) and from its host (the source the kernel picks), one echo each (three
/// tries): the pairs that failed.
fn unreachable_ipv6_pods(c: &Cluster) -> Vec<String> {
    let mut failed = Vec::new();
    for a in 1..=c.nodes.len() {
        let node = &c.nodes[a - 1];
        for b in (1..=c.nodes.len()).filter(|b| *b != a) {
            let target = ipv6_pod(b);
            let own = ipv6_pod(a);
            for source in [Some(own.as_str()), None] {
                let mut args = vec!["ping", "-c", "1", "-W", "1"];
                if let Some(source) = source {
                    args.extend(["-I", source]);
                }
                args.push(&target);
                if !(0..3).any(|_| node.ns.output(&args).status.success()) {
                    let from = source.unwrap_or("host");
                    failed.push(format!("{} ({from}) → {target}", node.name));
                }
            }
        }
    }
    failed
}

/// Meshes the cluster and checks, at once and again after `steady` of 2-second resyncs:
/// every IPv6 pod address reaches every other from pods and hosts (and every IPv4 pod address
/// with dual-stack pods), no route mixes families, and no route or rule change failed.
fn steady_pod_mesh(pods: Pods, granularity: &str, encapsulate: &str, steady: Duration) -> Cluster {
    let granularity_flag = format!("--mesh-granularity={granularity}");
    let encapsulate_flag = format!("--encapsulate={encapsulate}");
    let c = pod_mesh(
        pods,
        &[&encapsulate_flag, "--resync-period=2s", &granularity_flag],
    );
    let meshed = c.wait_for(Duration::from_secs(40), |c| {
        unreachable_ipv6_pods(c).is_empty()
            && (pods == Pods::Ipv6Only || c.all_pods_reachable().is_ok())
    });
    assert!(meshed, "{:?}\n{}", unreachable_ipv6_pods(&c), c.logs());
    for round in ["meshed", "steady"] {
        if round == "steady" {
            std::thread::sleep(steady);
        }
        assert_eq!(
            unreachable_ipv6_pods(&c),
            Vec::<String>::new(),
            "{round}\n{}",
            c.logs()
        );
        if pods == Pods::DualStack {
            assert_eq!(c.all_pods_reachable(), Ok(()), "{round}\n{}", c.logs());
        }
        assert_eq!(
            c.mixed_routes(),
            Vec::<String>::new(),
            "{round}\n{}",
            c.logs()
        );
        assert_eq!(
            c.failed_route_changes(),
            Vec::<String>::new(),
            "{round}\n{}",
            c.logs()
        );
    }
    c
}

/// How long a steady mesh is watched (resyncs every 2 s).
const STEADY: Duration = Duration::from_secs(12);
/// How long the first test watches its steady mesh: a minute of resyncs.
const A_MINUTE: Duration = Duration::from_secs(60);

/// The leaders' WireGuard peers allow the other location's pod CIDRs of both families, each
/// node's CNI conflist gets a range set per family, and each node masquerades its IPv6 pods'
/// traffic leaving the cluster through `KILO-NAT`; a minute of resyncs changes nothing.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn dual_stack_pods_across_two_locations() {
    common::require_root("dual_stack_pods_across_two_locations");
    let c = steady_pod_mesh(Pods::DualStack, "location", "always", A_MINUTE);
    let allowed = c.node("a1").wg("allowed-ips");
    for cidr in ["10.42.3.0/24", "fd42:3::/64", "10.42.4.0/24", "fd42:4::/64"] {
        assert!(
            allowed.contains(cidr),
            "a1 does not allow {cidr}: {allowed}"
        );
    }
    // Inside location x the IPv4 pods go through IPIP, the IPv6 pods straight to a2's IPv6
    // address (the IPIP device carries IPv4 only).
    let a1 = &c.node("a1").ns;
    let ipv4_route = a1.run(&["ip", "route", "show", "10.42.2.0/24"]);
    assert!(ipv4_route.contains("dev kilo-ipip"), "{ipv4_route}");
    let ipv6_route = a1.run(&["ip", "-6", "route", "show", "fd42:2::/64"]);
    assert!(ipv6_route.contains("via fd50::2 dev eth0"), "{ipv6_route}");
    assert_eq!(
        c.annotations("a2")
            .get("kilotun.io/second-internal-ip")
            .map(String::as_str),
        Some("fd50::2/64")
    );
    // Each node's CNI conflist holds one range set per family.
    for n in 1..=4 {
        let path = c.work.join(format!("{}.conflist", c.nodes[n - 1].name));
        let conflist = std::fs::read_to_string(&path).unwrap();
        let ranges =
            format!(r#""ranges":[[{{"subnet":"10.42.{n}.0/24"}}],[{{"subnet":"fd42:{n}::/64"}}]]"#);
        assert!(conflist.contains(&ranges), "node {n}: {conflist}");
    }
    // Each node's IPv6 pods enter the NAT chain: a set element of the nftables table, which
    // --firewall=auto picks where nft works, or Kilo's ip6tables jump.
    for n in 1..=4 {
        let ns = &c.nodes[n - 1].ns;
        if common::which("nft") {
            let set = ns.run(&["nft", "list", "set", "inet", "kilo", "nat_from6"]);
            assert!(set.contains(&format!("fd42:{n}::/64")), "node {n}: {set}");
        } else {
            let rules = ns.run(&["ip6tables", "-t", "nat", "-S", "POSTROUTING"]);
            let jump = format!("-A POSTROUTING -s fd42:{n}::/64");
            assert!(
                rules
                    .lines()
                    .any(|l| l.starts_with(&jump) && l.ends_with("-j KILO-NAT")),
                "node {n}: {rules}"
            );
        }
    }
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn dual_stack_pods_in_full_granularity() {
    common::require_root("dual_stack_pods_in_full_granularity");
    drop(steady_pod_mesh(Pods::DualStack, "full", "never", STEADY));
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn ipv6_only_pods_across_two_locations() {
    common::require_root("ipv6_only_pods_across_two_locations");
    drop(steady_pod_mesh(Pods::Ipv6Only, "location", "never", STEADY));
}

/// kgctl reads both families from the Nodes: the graph labels each node with its two pod
/// CIDRs, `showconf peer` gives a Peer both, and a Peer with an IPv6 allowed IP, set up from
/// that configuration, reaches IPv6 pods in both locations.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kgctl_and_a_peer_see_both_families() {
    common::require_root("kgctl_and_a_peer_see_both_families");
    let c = steady_pod_mesh(Pods::DualStack, "location", "never", STEADY);
    let dir = format!("--cluster-dir={}", c.dir.display());
    let graph = common::run(&[
        common::cluster::kgctl_bin(),
        "--backend=file",
        &dir,
        "graph",
    ]);
    for n in 1..=4 {
        for cidr in [format!("10.42.{n}.0/24"), format!("fd42:{n}::/64")] {
            assert!(graph.contains(&cidr), "{cidr} not in the graph: {graph}");
        }
    }
    let laptop = Laptop::join_dual_stack(&c, "laptop", "seg", 50, 10);
    let conf = laptop.conf();
    for cidr in ["fd42:1::/64", "fd42:4::/64", "10.42.2.0/24"] {
        assert!(conf.contains(cidr), "{cidr} not in showconf: {conf}");
    }
    let laptop_ipv6 = laptop.ipv6.clone().expect("dual-stack laptop");
    for n in 1..=4 {
        let target = ipv6_pod(n);
        let reached = c.wait_for(Duration::from_secs(30), |_| {
            laptop
                .ns
                .output(&["ping", "-c", "1", "-W", "1", "-I", &laptop_ipv6, &target])
                .status
                .success()
        });
        assert!(
            reached,
            "the laptop cannot reach {target}\n{conf}\n{}",
            c.logs()
        );
    }
}

/// A leader whose host has no IPv6 underlay address publishes no second internal IP: the other
/// node of its location cannot route IPv6 pods through it and says so once, naming the CIDR
/// and the leader, with no route through a gateway of the other family and no failed route
/// change; the IPv4 pods and the other location's IPv6 pods keep working.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_leader_without_an_ipv6_address_is_named_and_the_rest_of_the_mesh_works() {
    common::require_root(
        "a_leader_without_an_ipv6_address_is_named_and_the_rest_of_the_mesh_works",
    );
    let c = pod_mesh_with(Pods::DualStack, &["--encapsulate=never"], &["a1"]);
    let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    assert_eq!(
        c.annotations("a1")
            .get("kilotun.io/second-internal-ip")
            .map(String::as_str),
        Some("")
    );
    let named = |c: &common::cluster::Cluster| {
        c.node("a2")
            .events_of(Reason::RouteWithoutGateway)
            .iter()
            .filter(|e| e.subject == "fd42:3::/64")
            .count()
    };
    let said = c.wait_for(Duration::from_secs(10), |c| named(c) > 0);
    assert!(said, "{:?}", c.node("a2").events());
    // Resyncs later: said once, nothing failed, nothing mixed.
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(named(&c), 1);
    assert_eq!(
        c.failed_route_changes(),
        Vec::<String>::new(),
        "{}",
        c.logs()
    );
    assert_eq!(c.mixed_routes(), Vec::<String>::new(), "{}", c.logs());
    let a2_routes = c
        .node("a2")
        .ns
        .run(&["ip", "-6", "route", "show", "fd42:3::/64"]);
    assert_eq!(a2_routes.trim(), "", "{a2_routes}");
    assert_eq!(c.all_pods_reachable(), Ok(()), "{}", c.logs());
    // The leader's own IPv6 pods and location y's still reach each other over WireGuard.
    for (from, to) in [(1, 3), (3, 1), (3, 4), (4, 1)] {
        let node = &c.nodes[from - 1];
        let reached = common::ping_from_ok(
            &node.ns.name,
            Some(&ipv6_pod(from)),
            &ipv6_pod(to),
            Duration::from_secs(5),
        );
        assert!(reached, "{} → {}\n{}", node.name, ipv6_pod(to), c.logs());
    }
}

/// Calico's IPAM on a dual-stack cluster (`--ipam=calico`): each node's pods live in an IPv4
/// /26 of `10.60.0.0/16` and an IPv6 /122 of `fd60::/48`, not in the Nodes' `spec.podCIDRs`.
/// Every pod reaches every pod in both families, the leaders' peers carry both blocks and none
/// of the Nodes' ranges, and an IPv6 address Calico lent out of a1's block to a pod on b1 is
/// routed to b1.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn dual_stack_pods_in_calicos_blocks() {
    common::require_root("dual_stack_pods_in_calicos_blocks");
    let c = pod_mesh(Pods::DualStack, &["--encapsulate=never", "--ipam=calico"]);
    let pod = |n: usize| (format!("10.60.{n}.1"), format!("fd60:{n}::1"));
    for n in 1..=4 {
        let node = &c.nodes[n - 1];
        let (ipv4, ipv6) = pod(n);
        node.ns
            .run(&["ip", "addr", "add", &format!("{ipv4}/26"), "dev", "pods0"]);
        node.ns.run(&[
            "ip",
            "-6",
            "addr",
            "add",
            &format!("{ipv6}/122"),
            "dev",
            "pods0",
            "nodad",
        ]);
        for block in [format!("10.60.{n}.0/26"), format!("fd60:{n}::/122")] {
            let file = c.dir.join(format!(
                "block-{}-{}.yaml",
                node.name,
                block.replace(['.', ':', '/'], "-")
            ));
            std::fs::write(file, calico::block_affinity(&node.name, &block)).unwrap();
        }
    }
    let answers = |c: &Cluster, from: usize, source: &str, to: &str| {
        common::ping_from_ok(
            &c.nodes[from - 1].ns.name,
            Some(source),
            to,
            Duration::from_secs(2),
        )
    };
    let unreachable = |c: &Cluster| {
        let mut failed = Vec::new();
        for a in 1..=4 {
            for b in (1..=4).filter(|b| *b != a) {
                for (source, target) in [(pod(a).0, pod(b).0), (pod(a).1, pod(b).1)] {
                    if !answers(c, a, &source, &target) {
                        failed.push(format!("{source} → {target}"));
                    }
                }
            }
        }
        failed
    };
    let meshed = c.wait_for(Duration::from_secs(60), |c| unreachable(c).is_empty());
    assert!(meshed, "{:?}\n{}", unreachable(&c), c.logs());
    // The leaders' peers carry the other location's blocks of both families, no Node range.
    let leader = if calico::allowed_ips_with(c.node("a1"), "fd60:3::/122").is_empty() {
        "a2"
    } else {
        "a1"
    };
    let peer = calico::allowed_ips_with(c.node(leader), "fd60:3::/122");
    for block in ["10.60.3.0/26", "10.60.4.0/26", "fd60:4::/122"] {
        assert!(peer.contains(block), "{leader}: {peer}");
    }
    assert!(
        !peer.contains("10.42.") && !peer.contains("fd42:"),
        "{leader}: {peer}"
    );
    let handshakes = c.node(leader).wg("latest-handshakes");

    // A pod on b1 holds fd60:1::a, lent out of a1's block: a2 (in a1's location) reaches it.
    c.node("b1").ns.run(&[
        "ip",
        "-6",
        "addr",
        "add",
        "fd60:1::a/128",
        "dev",
        "pods0",
        "nodad",
    ]);
    std::fs::write(
        c.dir.join("ipamblock-a1-v6.yaml"),
        calico::lent_address("fd60:1::/122", "a1", 10, "b1"),
    )
    .unwrap();
    let lent = c.wait_for(Duration::from_secs(30), |c| {
        answers(c, 2, "fd60:2::1", "fd60:1::a")
    });
    assert!(lent, "the lent IPv6 address is routed to b1\n{}", c.logs());
    let peer = calico::allowed_ips_with(c.node(leader), "fd60:3::/122");
    assert!(peer.contains("fd60:1::a/128"), "{leader}: {peer}");
    assert_eq!(
        c.node(leader).wg("latest-handshakes"),
        handshakes,
        "the lent address changed the peer's allowed IPs, not its session"
    );
}
