//! The diff from observed to desired routes and rules: it converges, replaces a changed route
//! without deleting it first, and removes stale routes only on kg's own links.

use super::*;

#[test]
fn diff_adds_what_is_missing_and_converges() {
    let desired =
        topology("b", Granularity::Location).route_plan(&options(true, Encapsulate::Always));
    let empty = RoutePlan::default();
    let ops = diff(&desired, &empty, &empty, KILO);
    assert_eq!(ops.len(), desired.routes.len() + desired.rules.len());
    let after = apply_ops(&empty, &ops);
    assert_eq!(after, desired);
    assert!(diff(&desired, &after, &desired, KILO).is_empty());
}

#[test]
fn diff_replaces_a_changed_route_without_deleting_it_first() {
    let old = topology("b", Granularity::Location).route_plan(&options(true, Encapsulate::Always));
    let mut nodes = f1_nodes();
    nodes[2].leader = true; // c now leads location 2, so b becomes a non-leader
    let params = f1_params("b", Granularity::Location);
    let t = Topology::new(&nodes, &f1_peers(), &params).unwrap();
    assert!(!t.leader);
    let new = t.route_plan(&options(true, Encapsulate::Always));
    let ops = diff(&new, &old, &old, KILO);
    let deleted: Vec<&Route> = ops
        .iter()
        .filter_map(|o| match o {
            RouteOp::DeleteRoute(r) => Some(r),
            _ => None,
        })
        .collect();
    for r in &deleted {
        assert!(
            !new.routes
                .iter()
                .any(|n| (n.table, n.dst) == (r.table, r.dst)),
            "{r:?} deleted though still routed"
        );
    }
    let after = apply_ops(&old, &ops);
    assert_eq!(after, new);
}

#[test]
fn diff_leaves_foreign_routes_alone_but_removes_stale_kilo_ones() {
    let desired = RoutePlan::default();
    let foreign = Route {
        table: MAIN_TABLE,
        dst: "10.9.0.0/16".parse().unwrap(),
        gateway: Some("192.168.0.254".parse().unwrap()),
        link: PRIV,
        src: None,
        onlink: false,
    };
    let stale_on_kilo = Route {
        link: KILO,
        dst: "10.8.0.0/16".parse().unwrap(),
        ..foreign
    };
    let stale_rule = Rule {
        src: None,
        dst: Some("192.168.0.9/32".parse().unwrap()),
        iif: None,
        table: KILO_TABLE,
        guard: None,
    };
    let observed = RoutePlan {
        routes: [foreign, stale_on_kilo.clone()].into(),
        rules: [stale_rule.clone()].into(),
        ..Default::default()
    };
    let ops = diff(&desired, &observed, &RoutePlan::default(), KILO);
    assert_eq!(
        ops,
        vec![
            RouteOp::DeleteRoute(stale_on_kilo),
            RouteOp::DeleteRule(stale_rule)
        ]
    );
}

#[test]
fn routes_the_last_run_installed_on_a_tunnel_go_and_no_one_elses() {
    // A kg restarted with other settings (another granularity, after --clean-up=false) finds
    // its last run's route over tunl0, which this run does not want; kg passes the last run's
    // saved plan as what it owns.
    let stale_on_tunnel = Route {
        table: MAIN_TABLE,
        dst: "10.2.3.0/24".parse().unwrap(),
        gateway: Some("192.168.0.3".parse().unwrap()),
        link: TUNL,
        src: None,
        onlink: true,
    };
    let observed = RoutePlan {
        routes: [stale_on_tunnel.clone()].into(),
        ..Default::default()
    };
    let none = RoutePlan::default();
    assert_eq!(
        diff(&none, &observed, &observed, KILO),
        vec![RouteOp::DeleteRoute(stale_on_tunnel)]
    );
    // The same route installed by someone else (nothing saved says it is kg's) stays: only
    // the WireGuard link's routes are kg's whoever installed them.
    assert_eq!(diff(&none, &observed, &none, KILO), vec![]);
}

#[test]
fn a_stale_guard_is_removed_and_a_host_route_in_main_is_left() {
    // What a run with another --tunnel-guard-mark left (not in the saved record): its rules
    // and its underlay copy go; the host's own default route in main stays.
    let desired = RoutePlan::default();
    let copy = Route {
        table: UNDERLAY_TABLE,
        dst: "0.0.0.0/0".parse().unwrap(),
        gateway: Some("192.168.0.254".parse().unwrap()),
        link: 2,
        src: None,
        onlink: true,
    };
    let hosts = Route {
        table: MAIN_TABLE,
        ..copy
    };
    let stale_rule = Rule::guard(1100, 0x2000, false, UNDERLAY_TABLE);
    let observed = RoutePlan {
        routes: [copy.clone(), hosts].into(),
        rules: [stale_rule.clone()].into(),
        ..Default::default()
    };
    let ops = diff(&desired, &observed, &RoutePlan::default(), KILO);
    assert_eq!(
        ops,
        vec![RouteOp::DeleteRoute(copy), RouteOp::DeleteRule(stale_rule)]
    );
}
