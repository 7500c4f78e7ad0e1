//! Routes with several leaders per location: a follower reaches other locations through its
//! own share's leader and its location's other shares directly; a leader reaches the other
//! locations' shares over WireGuard, each at its own leader's WireGuard IP.

use super::*;
use crate::fixtures::location_nodes;
use crate::topology::TopologyParams;

/// e1..e4 in east (192.168.1.0/24), w1..w4 in west (192.168.2.0/24), two leaders each.
fn shared(host: &str) -> Topology {
    let mut nodes = location_nodes("e", "east", 1, 4);
    nodes.extend(location_nodes("w", "west", 2, 4));
    let params = TopologyParams {
        leaders_per_location: 2,
        ..f1_params(host, Granularity::Location)
    };
    Topology::new(&nodes, &[], &params).unwrap()
}

/// Fails unless `routes` has exactly one route to `dst`, through `gateway` on link `link`.
#[track_caller]
fn via(routes: &[String], dst: &str, gateway: &str, link: u32) {
    let to: Vec<&String> = routes
        .iter()
        .filter(|r| r.starts_with(&format!("{dst} ")))
        .collect();
    assert_eq!(to.len(), 1, "{dst}: {routes:?}");
    assert!(
        to[0].starts_with(&format!("{dst} via {gateway} dev {link} ")),
        "{}",
        to[0]
    );
}

#[test]
fn a_follower_goes_through_its_own_leader_and_straight_to_its_locations_other_shares() {
    let t = shared("e1");
    let own = t.local_segment().unwrap().clone();
    let follower = own.members.iter().find(|m| m.name != "e1").unwrap();
    let other_share = t
        .segments
        .iter()
        .find(|s| s.location == "east" && s.key != own.key)
        .unwrap()
        .clone();
    let t = shared(&follower.name);
    assert!(!t.leader);
    let routes = show(&t.route_plan(&options(true, Encapsulate::Never)));
    // Every west pod CIDR through its own leader e1 (192.168.1.1).
    for i in 1..=4 {
        via(&routes, &format!("10.2.{i}.0/24"), "192.168.1.1", PRIV);
    }
    // The other share's members straight at their private IPs.
    for m in &other_share.members {
        let ip = m.private_ip.unwrap().addr();
        via(&routes, &m.pod_cidr.to_string(), &ip.to_string(), PRIV);
    }
}

#[test]
fn a_leader_routes_each_remote_share_to_its_leaders_wireguard_ip() {
    let t = shared("e1");
    assert!(t.leader);
    let routes = show(&t.route_plan(&options(true, Encapsulate::Never)));
    for s in t.segments.iter().filter(|s| s.location == "west") {
        for m in &s.members {
            via(
                &routes,
                &m.pod_cidr.to_string(),
                &s.wireguard_ip.to_string(),
                KILO,
            );
        }
    }
}
