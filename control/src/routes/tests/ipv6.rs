//! Route plans where families meet: IPv6 internal IPs with IPv4 pods, dual-stack and
//! IPv6-only pods, IPIP to IPv6 internal IPs (userspace device and the kernel's ip6tnl), and a
//! connecting Peer's routes to IPv6 pods.

use super::*;

/// a1 (leader) and a2 in location x, b1 in y, with IPv6 endpoints and internal IPs and IPv4
/// pod CIDRs.
fn ipv6_internal_ip_nodes() -> Vec<crate::node::Node> {
    use crate::fixtures::node;
    let mut nodes = vec![
        node(
            "a1",
            "[fd50::1]:51820",
            Some("fd50::1/64"),
            "x",
            "10.42.1.0/24",
            "k1",
        ),
        node(
            "a2",
            "[fd50::2]:51820",
            Some("fd50::2/64"),
            "x",
            "10.42.2.0/24",
            "k2",
        ),
        node(
            "b1",
            "[fd50::33]:51820",
            Some("fd50::3/64"),
            "y",
            "10.42.3.0/24",
            "k3",
        ),
    ];
    nodes[0].leader = true;
    nodes
}

/// No route of `plan` has a source, or a gateway on the WireGuard link, of the other family
/// than its destination.
fn assert_no_mixed_family(plan: &RoutePlan) {
    for r in &plan.routes {
        if let Some(gw) = r.gateway.filter(|_| r.link == KILO) {
            assert_eq!(gw.is_ipv4(), r.dst.addr().is_ipv4(), "{r:?}");
        }
        if let Some(src) = r.src {
            assert_eq!(src.is_ipv4(), r.dst.addr().is_ipv4(), "{r:?}");
        }
    }
    for rule in &plan.rules {
        if let (Some(src), Some(dst)) = (rule.src, rule.dst) {
            assert_eq!(src.addr().is_ipv4(), dst.addr().is_ipv4(), "{rule:?}");
        }
    }
}

#[test]
fn ipv6_internal_ips_never_mix_families_in_a_route() {
    let nodes = ipv6_internal_ip_nodes();
    let mut o = options(true, Encapsulate::Never);
    o.pod_sources = vec!["10.42.1.1".parse().unwrap()];
    let leader = Topology::new(&nodes, &[], &f1_params("a1", Granularity::Location)).unwrap();
    let plan = leader.route_plan(&o);
    assert_no_mixed_family(&plan);
    let routes = show(&plan);
    // b1's IPv6 private IP: straight onto the WireGuard link, no IPv4 gateway.
    assert_has_route(&routes, "fd50::3/128 dev 1 src fd50::1");
    // b1's IPv4 pods: through its IPv4 WireGuard IP, from this node's own pod address.
    assert!(
        routes
            .iter()
            .any(|r| r.starts_with("10.42.3.0/24 via 10.4.0.")
                && r.ends_with("src 10.42.1.1 onlink")),
        "{routes:?}"
    );
    // A non-leader sends IPv4 through its leader's IPv6 private IP, from its own pod address.
    o.pod_sources = vec!["10.42.2.1".parse().unwrap()];
    let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
    let routes = show(&member.route_plan(&o));
    assert_has_route(
        &routes,
        "10.42.3.0/24 via fd50::1 dev 2 src 10.42.2.1 onlink",
    );
}

#[test]
fn ipip_never_carries_traffic_to_an_ipv6_internal_ip() {
    let nodes = ipv6_internal_ip_nodes();
    for encapsulate in [Encapsulate::Always, Encapsulate::CrossSubnet] {
        let mut o = options(true, encapsulate);
        for (host, pods) in [("a1", "10.42.1.1"), ("a2", "10.42.2.1")] {
            o.pod_sources = vec![pods.parse().unwrap()];
            let t = Topology::new(&nodes, &[], &f1_params(host, Granularity::Location)).unwrap();
            let plan = t.route_plan(&o);
            assert_no_mixed_family(&plan);
            // tunl0 carries IPv4 to IPv4 addresses only: nothing goes onto it, and no
            // table-1107 detour or rule is planned for an IPv6 internal IP.
            assert!(
                plan.routes.iter().all(|r| r.link != TUNL),
                "{encapsulate:?} on {host}: {:?}",
                show(&plan)
            );
            assert!(plan.rules.is_empty(), "{:?}", show_rules(&plan));
        }
        // The location's pods are reached straight over the underlay, via the IPv6 internal IP.
        o.pod_sources = vec!["10.42.1.1".parse().unwrap()];
        let leader = Topology::new(&nodes, &[], &f1_params("a1", Granularity::Location)).unwrap();
        let routes = show(&leader.route_plan(&o));
        assert_has_route(
            &routes,
            "10.42.2.0/24 via fd50::2 dev 2 src 10.42.1.1 onlink",
        );
    }
}

#[test]
fn userspace_ipip_carries_ipv4_pods_to_an_ipv6_internal_ip() {
    let nodes = ipv6_internal_ip_nodes();
    let mut o = options(true, Encapsulate::Always);
    o.ipip_over_ipv6 = true;
    o.pod_sources = vec!["10.42.1.1".parse().unwrap()];
    let leader = Topology::new(&nodes, &[], &f1_params("a1", Granularity::Location)).unwrap();
    let plan = leader.route_plan(&o);
    assert_no_mixed_family(&plan);
    let routes = show(&plan);
    // The location's IPv4 pods go onto the tunnel with no gateway (the kernel refuses one of
    // the other family there); the device sends them to the node's IPv6 internal IP.
    assert_has_route(&routes, "10.42.2.0/24 dev 3 src 10.42.1.1");
    assert_eq!(
        plan.tunnel_gateways.get(&"10.42.2.0/24".parse().unwrap()),
        Some(&"fd50::2".parse().unwrap())
    );
    // The IPv6 internal IP itself is no IPIP traffic (IPIP carries IPv4 only): no detour, and
    // no rule mixing families.
    assert!(
        plan.routes
            .iter()
            .filter(|r| r.link == TUNL)
            .all(|r| r.dst.addr().is_ipv4()),
        "{routes:?}"
    );
    assert!(plan.rules.is_empty(), "{:?}", show_rules(&plan));
    // A node that does not lead sends the other location's pods to its leader the same way.
    let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
    o.pod_sources = vec!["10.42.2.1".parse().unwrap()];
    let plan = member.route_plan(&o);
    let remote: Vec<Option<IpAddr>> = plan
        .routes
        .iter()
        .filter(|r| r.link == TUNL && r.dst != "10.42.1.0/24".parse::<IpNet>().unwrap())
        .map(|r| plan.tunnel_gateways.get(&r.dst).copied())
        .collect();
    assert!(!remote.is_empty(), "{:?}", show(&plan));
    assert!(
        remote
            .iter()
            .all(|g| *g == Some("fd50::1".parse().unwrap())),
        "{remote:?} {:?}",
        show(&plan)
    );
}

/// a1 (leader) and a2 in location x, b1 in y: IPv4 internal IPs and endpoints, dual-stack
/// pods (`10.42.<n>.0/24` and `fd42:<n>::/64`), and each host's IPv6 address published as its
/// second internal IP.
fn dual_stack_pod_nodes() -> Vec<crate::node::Node> {
    use crate::fixtures::node;
    let mut nodes: Vec<crate::node::Node> = [("a1", "x"), ("a2", "x"), ("b1", "y")]
        .into_iter()
        .enumerate()
        .map(|(i, (name, location))| {
            let n = i + 1;
            let mut node = node(
                name,
                &format!("192.168.0.{n}:51820"),
                Some(&format!("192.168.0.{n}/24")),
                location,
                &format!("10.42.{n}.0/24"),
                &format!("k{n}"),
            );
            node.extra_subnets = vec![format!("fd42:{n}::/64").parse().unwrap()];
            node.second_internal_ip = Some(format!("fd50::{n}/64").parse().unwrap());
            node
        })
        .collect();
    nodes[0].leader = true;
    nodes
}

fn dual_stack_sources(n: u8) -> Vec<IpAddr> {
    vec![
        format!("10.42.{n}.1").parse().unwrap(),
        format!("fd42:{n}::1").parse().unwrap(),
    ]
}

#[test]
fn dual_stack_pods_are_routed_in_both_families() {
    let nodes = dual_stack_pod_nodes();
    for encapsulate in [Encapsulate::Never, Encapsulate::Always] {
        let mut o = options(true, encapsulate);
        o.pod_sources = dual_stack_sources(1);
        let leader = Topology::new(&nodes, &[], &f1_params("a1", Granularity::Location)).unwrap();
        let plan = leader.route_plan(&o);
        assert_no_mixed_family(&plan);
        assert!(plan.no_gateway.is_empty(), "{:?}", plan.no_gateway);
        let routes = show(&plan);
        // The other location's IPv6 pods: onto the WireGuard link without a gateway (its
        // WireGuard IP is IPv4), from this node's IPv6 pod address.
        assert_has_route(&routes, "fd42:3::/64 dev 1 src fd42:1::1");
        // Its own location's IPv6 pods: straight to the member's IPv6 address, never onto
        // the IPv4-only tunnel.
        assert!(
            routes.contains(&"fd42:2::/64 via fd50::2 dev 2 src fd42:1::1 onlink".to_string()),
            "{encapsulate:?}: {routes:?}"
        );
        // The WireGuard peer allows both families of the other location's pods.
        let peer = leader
            .segments
            .iter()
            .find(|s| s.key == "location:y")
            .expect("segment y");
        for cidr in ["10.42.3.0/24", "fd42:3::/64"] {
            assert!(
                peer.allowed_ips.contains(&cidr.parse().unwrap()),
                "{:?}",
                peer.allowed_ips
            );
        }

        // A member routes the IPv6 pods of other locations through its leader's IPv6 address.
        o.pod_sources = dual_stack_sources(2);
        let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
        let plan = member.route_plan(&o);
        assert_no_mixed_family(&plan);
        let routes = show(&plan);
        assert!(
            routes.contains(&"fd42:3::/64 via fd50::1 dev 2 src fd42:2::1 onlink".to_string()),
            "{encapsulate:?}: {routes:?}"
        );
        assert!(
            plan.routes
                .iter()
                .filter(|r| r.dst.addr().is_ipv6())
                .all(|r| r.link != TUNL),
            "{routes:?}"
        );
    }
}

#[test]
fn ipv6_pods_behind_a_leader_without_an_ipv6_address_are_named_not_routed() {
    let mut nodes = dual_stack_pod_nodes();
    // The leader's host has no IPv6 address (or runs Kilo's own kg, which publishes none).
    nodes[0].second_internal_ip = None;
    let mut o = options(true, Encapsulate::Never);
    o.pod_sources = dual_stack_sources(2);
    let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
    let plan = member.route_plan(&o);
    assert_no_mixed_family(&plan);
    assert!(
        plan.routes
            .iter()
            .all(|r| r.dst != "fd42:3::/64".parse::<IpNet>().unwrap()),
        "{:?}",
        show(&plan)
    );
    let named: Vec<String> = plan.no_gateway.iter().map(ToString::to_string).collect();
    assert!(
        named.contains(
            &"not routing fd42:3::/64 on this node: node a1 has no IPv6 address to route it \
              through (its kilotun.io/second-internal-ip is empty: its host has no IPv6 \
              address, or its kg is not kilotun's; with --compatibility=flannel or cilium, it \
              has no IPv6 pod CIDR)"
                .to_string()
        ),
        "{named:?}"
    );
    // The IPv4 pods are unaffected.
    assert!(
        show(&plan)
            .iter()
            .any(|r| r.starts_with("10.42.3.0/24 via 192.168.0.1 dev 2")),
        "{:?}",
        show(&plan)
    );
}

#[test]
fn ipv6_only_pods_are_routed_over_an_ipv4_underlay() {
    let mut nodes = dual_stack_pod_nodes();
    for n in &mut nodes {
        n.subnet = n.extra_subnets.pop();
    }
    let mut o = options(true, Encapsulate::Always);
    o.pod_sources = vec!["fd42:2::1".parse().unwrap()];
    let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
    let plan = member.route_plan(&o);
    assert_no_mixed_family(&plan);
    let routes = show(&plan);
    assert_has_route(
        &routes,
        "fd42:3::/64 via fd50::1 dev 2 src fd42:2::1 onlink",
    );
    assert_has_route(
        &routes,
        "fd42:1::/64 via fd50::1 dev 2 src fd42:2::1 onlink",
    );
    // No table-1107 rule pairs the IPv6 pods with an IPv4 internal IP.
    assert!(
        plan.rules.iter().all(|r| r
            .src
            .zip(r.dst)
            .is_none_or(|(s, d)| s.addr().is_ipv4() == d.addr().is_ipv4())),
        "{:?}",
        show_rules(&plan)
    );
}

#[test]
fn the_kernels_ip6tnl_carries_ipv4_pods_to_an_ipv6_internal_ip() {
    let nodes = ipv6_internal_ip_nodes();
    let mut o = options(true, Encapsulate::Always);
    o.links.tunnel6 = TUNL6;
    o.pod_sources = vec!["10.42.1.1".parse().unwrap()];
    let leader = Topology::new(&nodes, &[], &f1_params("a1", Granularity::Location)).unwrap();
    let plan = leader.route_plan(&o);
    assert_no_mixed_family(&plan);
    let routes = show(&plan);
    // An IPv4 route via an IPv6 gateway on the ip6tnl link: the kernel sends the packet in an
    // IPv6 header to that gateway. Nothing for the userspace device, nothing on tunl0.
    assert_has_route(
        &routes,
        "10.42.2.0/24 via fd50::2 dev 4 src 10.42.1.1 onlink",
    );
    assert!(
        plan.tunnel_gateways.is_empty(),
        "{:?}",
        plan.tunnel_gateways
    );
    assert!(plan.routes.iter().all(|r| r.link != TUNL), "{routes:?}");
    // A member sends the other location's pods to its leader the same way.
    o.pod_sources = vec!["10.42.2.1".parse().unwrap()];
    let member = Topology::new(&nodes, &[], &f1_params("a2", Granularity::Location)).unwrap();
    let routes = show(&member.route_plan(&o));
    assert_has_route(
        &routes,
        "10.42.3.0/24 via fd50::1 dev 4 src 10.42.2.1 onlink",
    );
    // crosssubnet: a member of the same IPv6 subnet is reached unencapsulated.
    let mut o = options(true, Encapsulate::CrossSubnet);
    o.links.tunnel6 = TUNL6;
    o.pod_sources = vec!["10.42.1.1".parse().unwrap()];
    let routes = show(&leader.route_plan(&o));
    assert_has_route(
        &routes,
        "10.42.2.0/24 via fd50::2 dev 2 src 10.42.1.1 onlink",
    );
}

#[test]
fn a_connecting_peer_routes_ipv6_pods_without_an_ipv4_gateway() {
    let nodes = dual_stack_pod_nodes();
    let peers = vec![crate::peer::Peer {
        name: "laptop".into(),
        allowed_ips: vec![
            "10.5.0.1/32".parse().unwrap(),
            "fd05::1/128".parse().unwrap(),
        ],
        public_key: Some(crate::key::Key::padded("laptop")),
        endpoint: None,
        persistent_keepalive: 0,
        preshared_key: None,
    }];
    let t = Topology::new(&nodes, &peers, &f1_params("a1", Granularity::Location)).unwrap();
    let plan = t.peer_routes("laptop", 9, &[]);
    let routes = show(&plan);
    assert_has_route(&routes, "fd42:3::/64 dev 9");
    assert_has_route(&routes, "fd42:2::/64 dev 9");
    assert!(
        routes
            .iter()
            .any(|r| r.starts_with("10.42.3.0/24 via 10.4.0.")),
        "{routes:?}"
    );
    for r in &plan.routes {
        if let Some(gw) = r.gateway {
            assert_eq!(gw.is_ipv4(), r.dst.addr().is_ipv4(), "{r:?}");
        }
    }
}
