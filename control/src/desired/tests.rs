use super::*;
use crate::fixtures::{f1_nodes, f1_params, f1_peers};
use crate::host::Link;
use crate::Granularity;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn settings(tunnel: bool) -> HostSettings {
    HostSettings {
        interface: "kilo0".into(),
        mtu: Mtu::Auto,
        cni: true,
        cni_conflist: true,
        local: true,
        encapsulate: Encapsulate::Always,
        compatibility: Compatibility::Ipip,
        forward_rules: false,
        service_cidrs: Vec::new(),
        tunnel: tunnel.then(|| TunnelKind {
            name: "tunl0".into(),
            ipip: true,
            ipv6_outer: false,
        }),
        tunnel_guard: TunnelGuard::Routes,
    }
}

/// Node `name` of fixture F1 on a host whose eth0 (index 2, MTU 1500) holds its internal IP
/// and the default route, kilo0 is index 3 and tunl0 index 4.
fn host_of(name: &str) -> (Topology, HostNet) {
    let nodes = f1_nodes();
    let t = Topology::new(&nodes, &f1_peers(), &f1_params(name, Granularity::Location)).unwrap();
    let me = nodes.iter().find(|n| n.name == name).unwrap();
    let mut addresses = vec![(3, net("10.4.0.1/16"))];
    addresses.extend(me.internal_ip.map(|ip| (2, ip)));
    let host = HostNet {
        default_link: Some(2),
        links: vec![
            Link {
                index: 2,
                name: "eth0".into(),
                mtu: 1500,
                up: true,
            },
            Link {
                index: 3,
                name: "kilo0".into(),
                mtu: 1420,
                up: true,
            },
            Link {
                index: 4,
                name: "tunl0".into(),
                mtu: 1480,
                up: true,
            },
        ],
        addresses,
        main_routes: Vec::new(),
    };
    (t, host)
}

fn public() -> Key {
    Key::padded("self")
}

#[test]
fn a_leader_wants_its_link_up_with_the_subnets_address_and_a_follower_wants_it_down() {
    let mut seen = (false, false);
    for name in ["a", "b", "c", "d"] {
        let (t, host) = host_of(name);
        let links = ResolvedLinks {
            kilo: 3,
            tunnel: None,
            tunnel6: None,
        };
        let want = plan(
            &t,
            &host,
            &links,
            &RoutePlan::default(),
            &public(),
            &settings(false),
        );
        assert_eq!(want.link.up, t.leader, "{name}");
        assert_eq!(want.link.mtu, 1420, "{name}: eth0's 1500 less 80");
        if t.leader {
            seen.0 = true;
            assert_eq!(want.link.address, Some(t.wireguard_cidr), "{name}");
            assert_eq!(want.device, t.conf(Some(&public())), "{name}");
            assert!(!want.device.peers.is_empty(), "{name}: a leader has peers");
        } else {
            seen.1 = true;
            assert_eq!(want.link.address, None, "{name}");
            assert_eq!(want.device, t.standby_conf(Some(&public())), "{name}");
        }
        let cni = want.cni.expect("--cni");
        assert_eq!(cni.pod_cidrs, t.local_pod_cidrs().collect::<Vec<_>>());
        assert_eq!(cni.mtu, 1420);
        assert!(want.tunnel.is_none(), "no tunnel without one configured");
        assert_eq!(want.encapsulate, Encapsulate::Never);
    }
    assert_eq!(seen, (true, true), "F1 has leaders and followers");
}

#[test]
fn an_unresolved_tunnel_routes_without_encapsulation_until_the_shell_resolves_it() {
    // c follows b in location 2; both have internal IPs, so inside the location IPIP is used.
    let (t, host) = host_of("c");
    assert!(!t.leader);
    let s = settings(true);
    let unresolved = ResolvedLinks {
        kilo: 3,
        tunnel: None,
        tunnel6: None,
    };
    let before = plan(&t, &host, &unresolved, &RoutePlan::default(), &public(), &s);
    assert!(before.tunnel_missing(&unresolved));
    assert_eq!(before.encapsulate, Encapsulate::Never);
    assert!(before.routes.routes.iter().all(|r| r.link != 4));
    let spec = before.tunnel.expect("a tunnel is configured");
    assert_eq!(spec.ipv4_pods, net("10.2.3.0/24"));
    assert_eq!(
        (spec.private_link, spec.private_mtu, spec.private_ipv6),
        (2, Some(1500), false)
    );

    let resolved = ResolvedLinks {
        kilo: 3,
        tunnel: Some(4),
        tunnel6: None,
    };
    let after = plan(&t, &host, &resolved, &RoutePlan::default(), &public(), &s);
    assert!(!after.tunnel_missing(&resolved));
    assert_eq!(after.encapsulate, Encapsulate::Always);
    assert!(
        after.routes.routes.iter().any(|r| r.link == 4),
        "the leader is reached through the tunnel: {:?}",
        after.routes.routes
    );
    assert_ne!(
        after.firewall, before.firewall,
        "IPIP from the location is admitted"
    );
    // The tunnel's preparation does not depend on its resolution.
    assert_eq!(after.tunnel, before.tunnel);
}

#[test]
fn the_plan_is_a_function_of_its_inputs() {
    let (t, host) = host_of("b");
    let links = ResolvedLinks {
        kilo: 3,
        tunnel: Some(4),
        tunnel6: None,
    };
    let s = settings(true);
    let first = plan(&t, &host, &links, &RoutePlan::default(), &public(), &s);
    let again = plan(&t, &host, &links, &RoutePlan::default(), &public(), &s);
    assert_eq!(first, again);
    let fixed = HostSettings {
        mtu: Mtu::Fixed(1300),
        cni: false,
        ..s
    };
    let other = plan(&t, &host, &links, &RoutePlan::default(), &public(), &fixed);
    assert_eq!(other.link.mtu, 1300);
    assert_eq!(other.cni, None);
    // A CNI with its own IPAM keeps its configuration; Kilo's rules for the pods stay.
    let own_ipam = HostSettings {
        cni_conflist: false,
        ..settings(true)
    };
    let left = plan(
        &t,
        &host,
        &links,
        &RoutePlan::default(),
        &public(),
        &own_ipam,
    );
    assert_eq!(left.cni, None);
    assert_eq!(left.firewall, first.firewall);
    assert_eq!(
        other.routes, first.routes,
        "the MTU and CNI do not move routes"
    );
}

#[test]
fn endpoint_bypasses_go_through_the_hosts_own_route_not_kgs() {
    // Peer b's endpoint 192.168.0.1 lies inside location 1's allowed IPs (node a's internal
    // IP), which b, leading location 2, routes onto kilo0: its bypass takes the host's own
    // route to 192.168.0.0/24 on eth0, never kg's route of the same destination (`owned`).
    let (t, mut host) = host_of("b");
    assert!(t.leader);
    let route = |link| Route {
        table: crate::routes::MAIN_TABLE,
        dst: net("192.168.0.0/24"),
        gateway: None,
        link,
        src: None,
        onlink: false,
    };
    host.main_routes = vec![route(9), route(2)];
    let owned = RoutePlan {
        routes: [route(9)].into_iter().collect(),
        ..Default::default()
    };
    let links = ResolvedLinks {
        kilo: 3,
        tunnel: None,
        tunnel6: None,
    };
    let want = plan(&t, &host, &links, &owned, &public(), &settings(false));
    assert!(!want.bypasses.is_empty(), "{:?}", want.routes.routes);
    for bypass in &want.bypasses {
        assert_eq!(bypass.route.link, 2, "{bypass:?}");
        assert!(want.routes.routes.contains(&bypass.route));
    }
}

#[test]
fn the_mark_guard_adds_no_bypass_and_routes_marked_packets_by_the_hosts_routes_alone() {
    // The same endpoint as above, with --tunnel-guard=mark: no host route per endpoint; the
    // host's own routes (not kg's, not kilo0's) are copied into the underlay table, and each
    // family the host routes gets a lookup rule and an unreachable rule for the mark.
    use crate::routes::guard::GUARD_PRIORITY;
    use crate::routes::{Rule, MAIN_TABLE, UNDERLAY_TABLE};
    let (t, mut host) = host_of("b");
    let route = |dst: &str, gateway: Option<&str>, link| Route {
        table: MAIN_TABLE,
        dst: net(dst),
        gateway: gateway.map(|g| g.parse().unwrap()),
        link,
        src: None,
        onlink: false,
    };
    let own = route("192.168.0.0/24", None, 9);
    host.main_routes = vec![
        route("0.0.0.0/0", Some("192.168.0.254"), 2),
        route("192.168.0.0/24", None, 2),
        route("10.42.7.0/24", None, 3),
        route("fe80::/64", None, 2),
        own.clone(),
    ];
    let owned = RoutePlan {
        routes: [own].into_iter().collect(),
        ..Default::default()
    };
    let links = ResolvedLinks {
        kilo: 3,
        tunnel: None,
        tunnel6: None,
    };
    let s = HostSettings {
        tunnel_guard: TunnelGuard::Mark(0x1000),
        ..settings(false)
    };
    let want = plan(&t, &host, &links, &owned, &public(), &s);
    assert!(want.bypasses.is_empty(), "{:?}", want.bypasses);
    let underlay: Vec<(IpNet, u32)> = want
        .routes
        .routes
        .iter()
        .filter(|r| r.table == UNDERLAY_TABLE)
        .map(|r| (r.dst, r.link))
        .collect();
    assert_eq!(
        underlay,
        [(net("0.0.0.0/0"), 2), (net("192.168.0.0/24"), 2)],
        "{:?}",
        want.routes.routes
    );
    // The peer's endpoint 192.168.0.1 stays under kg's route into kilo0 (node a's internal
    // IP): no host route through eth0 pins it.
    let pinned: Vec<&Route> = want
        .routes
        .routes
        .iter()
        .filter(|r| r.table == MAIN_TABLE && r.dst.prefix_len() == 32 && r.link != 3)
        .collect();
    assert!(pinned.is_empty(), "{pinned:?}");
    let mut guard: Vec<&Rule> = want
        .routes
        .rules
        .iter()
        .filter(|r| r.guard.is_some())
        .collect();
    guard.sort_by_key(|r| r.guard.map(|g| g.priority));
    assert_eq!(
        guard,
        [
            &Rule::guard(GUARD_PRIORITY, 0x1000, false, UNDERLAY_TABLE),
            &Rule::guard(GUARD_PRIORITY + 1, 0x1000, false, 0),
        ],
        "IPv4 only: the host routes no IPv6 but link-local"
    );
    assert!(guard[1].is_unreachable());
    // The routes guard of the same host pins the endpoint instead, and marks nothing.
    let pinned = plan(&t, &host, &links, &owned, &public(), &settings(false));
    assert!(!pinned.bypasses.is_empty());
    assert!(pinned.routes.rules.iter().all(|r| r.guard.is_none()));
    assert_eq!(TunnelGuard::Routes.mark(), 0);
}

#[test]
fn tunnel_guard_flags_parse_and_bad_ones_are_named() {
    assert_eq!(
        TunnelGuard::parse("mark", 0x1000),
        Ok(TunnelGuard::Mark(0x1000))
    );
    assert_eq!(
        TunnelGuard::parse("routes", 0x1000),
        Ok(TunnelGuard::Routes)
    );
    let zero = TunnelGuard::parse("mark", 0).unwrap_err();
    assert!(zero.contains("--tunnel-guard-mark"), "{zero}");
    let other = TunnelGuard::parse("rules", 1).unwrap_err();
    assert!(other.contains("\"rules\""), "{other}");
}

mod engine_first {
    use super::*;
    use crate::ip::Endpoint;
    use crate::wgconf::WgPeer;

    fn peer(key: &str, endpoint: &str) -> WgPeer {
        WgPeer {
            public_key: Key::padded(key),
            allowed_ips: Vec::new(),
            endpoint: Some(Endpoint::parse(endpoint).unwrap()),
            persistent_keepalive: 0,
            preshared_key: None,
            replaces: None,
        }
    }

    fn conf(peers: Vec<WgPeer>) -> Conf {
        Conf {
            listen_port: Some(51820),
            peers,
        }
    }

    fn route(dst: &str, link: u32) -> Route {
        Route {
            table: MAIN_TABLE,
            dst: net(dst),
            gateway: None,
            link,
            src: None,
            onlink: false,
        }
    }

    /// [`engine_before_routes`] for a node that led before and still leads.
    fn steady_leader(last: &Conf, next: &Conf, owned: &RoutePlan, routes: &RoutePlan) -> bool {
        engine_before_routes(Some((last, true)), next, true, owned, routes)
    }

    fn plan_of(routes: &[Route]) -> RoutePlan {
        let mut plan = RoutePlan::default();
        plan.routes.extend(routes.iter().cloned());
        plan
    }

    #[test]
    fn a_steady_leader_takes_a_new_peer_first_when_no_route_to_its_endpoint_changes() {
        let last = conf(vec![peer("a", "203.0.113.1:51820")]);
        let next = conf(vec![
            peer("a", "203.0.113.1:51820"),
            peer("b", "203.0.113.2:51820"),
        ]);
        let old = plan_of(&[route("10.2.1.0/24", 3)]);
        let new = plan_of(&[route("10.2.1.0/24", 3), route("10.2.2.0/24", 3)]);
        assert!(steady_leader(&last, &next, &old, &new));
    }

    #[test]
    fn nothing_applied_yet_or_a_role_change_puts_the_routes_first() {
        let next = conf(vec![peer("a", "203.0.113.1:51820")]);
        let plan = RoutePlan::default();
        assert!(!engine_before_routes(None, &next, true, &plan, &plan));
        assert!(!engine_before_routes(
            Some((&next, false)),
            &next,
            true,
            &plan,
            &plan
        ));
        assert!(!engine_before_routes(
            Some((&next, true)),
            &next,
            false,
            &plan,
            &plan
        ));
    }

    #[test]
    fn a_moved_endpoint_whose_route_changes_puts_the_routes_first() {
        // A location's new leader is 172.16.0.9, a private IP this node routed into the
        // WireGuard link while it was a member; the new routes leave it to the underlay.
        let last = conf(vec![peer("loc", "172.16.0.8:51820")]);
        let next = conf(vec![peer("loc", "172.16.0.9:51820")]);
        let old = plan_of(&[route("172.16.0.9/32", 3)]);
        let new = plan_of(&[route("172.16.0.8/32", 3)]);
        assert!(!steady_leader(&last, &next, &old, &new));
        // The same move with a route to the endpoint that stays (an endpoint bypass over the
        // underlay, link 2) is safe.
        let kept = route("172.16.0.9/32", 2);
        assert!(steady_leader(
            &last,
            &next,
            &plan_of(std::slice::from_ref(&kept)),
            &plan_of(&[kept, route("172.16.0.8/32", 3)])
        ));
    }

    #[test]
    fn only_new_or_moved_peers_are_checked_and_a_large_move_puts_the_routes_first() {
        // Peer a's endpoint is under a route that changes, but a did not move.
        let last = conf(vec![peer("a", "172.16.0.1:51820")]);
        let next = conf(vec![
            peer("a", "172.16.0.1:51820"),
            peer("b", "203.0.113.2:51820"),
        ]);
        let old = plan_of(&[route("172.16.0.0/24", 3)]);
        let new = RoutePlan::default();
        assert!(steady_leader(&last, &next, &old, &new));
        let many = conf(
            (0..=ENGINE_FIRST_MAX_MOVED)
                .map(|i| peer(&format!("p{i}"), &format!("203.0.113.{}:51820", i + 1)))
                .collect(),
        );
        let empty = RoutePlan::default();
        assert!(!steady_leader(&conf(Vec::new()), &many, &empty, &empty));
    }
}
