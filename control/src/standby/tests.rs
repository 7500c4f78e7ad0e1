use std::collections::BTreeMap;

use super::*;
use crate::fixtures::{f1_params, node};
use crate::ip::Endpoint;
use crate::leader::{lease_leaders, lease_name, LeaseState, LEASE_DURATION_MS};
use crate::topology::ShareLeader;

const NOW: i64 = 1_700_000_000_000;

/// n1, n2, n3 in east (n1 holds the lease), w1 in west; all elect by lease.
fn cluster() -> Vec<Node> {
    let mut nodes = vec![
        node(
            "n1",
            "192.168.1.1:51820",
            Some("192.168.1.1/24"),
            "east",
            "10.42.1.0/24",
            "k1",
        ),
        node(
            "n2",
            "192.168.1.2:51820",
            Some("192.168.1.2/24"),
            "east",
            "10.42.2.0/24",
            "k2",
        ),
        node(
            "n3",
            "192.168.1.3:51820",
            Some("192.168.1.3/24"),
            "east",
            "10.42.3.0/24",
            "k3",
        ),
        node(
            "w1",
            "192.168.2.1:51820",
            Some("192.168.2.1/24"),
            "west",
            "10.42.4.0/24",
            "k4",
        ),
    ];
    for n in &mut nodes {
        n.lease_election = true;
    }
    nodes
}

/// The topology of `host` when east's lease is held by n1, cut off or not.
fn topology(host: &str, cut_off: bool) -> Topology {
    let nodes = cluster();
    let leases = BTreeMap::from([(
        lease_name("east"),
        LeaseState {
            holder: Some("n1".into()),
            renewed_ms: NOW,
            duration_ms: LEASE_DURATION_MS,
            transitions: 0,
            cut_off,
            deposed: BTreeMap::new(),
            cut_off_predecessor: None,
            handed_over_by: None,
        },
    )]);
    let elections = lease_leaders(&nodes, &leases, 1, NOW);
    let leaders = elections
        .iter()
        .map(|(l, e)| (l.clone(), ShareLeader::only(&e[0].leader)))
        .collect();
    let verifiers = elections
        .iter()
        .map(|(l, e)| (l.clone(), e[0].verifiers.clone()))
        .collect();
    let params = f1_params(host, Granularity::Location);
    Topology::with_leaders(&nodes, &[], &params, &leaders)
        .unwrap()
        .with_standby(&nodes, &verifiers)
}

fn names(t: &Topology) -> Vec<(&str, u16)> {
    t.standby
        .iter()
        .map(|p| (p.name.as_str(), p.persistent_keepalive))
        .collect()
}

#[test]
fn a_healthy_lease_opens_no_standby_tunnel() {
    for host in ["n1", "n2", "n3", "w1"] {
        assert!(topology(host, false).standby.is_empty(), "{host}");
    }
    assert!(topology("n2", false).standby_conf(None).peers.is_empty());
}

#[test]
fn the_verifiers_of_a_cut_off_location_handshake_with_the_other_leaders() {
    for verifier in ["n2", "n3"] {
        let t = topology(verifier, true);
        assert!(!t.leader);
        assert_eq!(names(&t), [("w1", STANDBY_KEEPALIVE_S)]);
        let conf = t.standby_conf(Some(&Key::padded(verifier)));
        assert_eq!(conf.peers.len(), 1);
        assert_eq!(conf.peers[0].public_key, Key::padded("k4"));
        assert!(conf.peers[0].allowed_ips.is_empty());
        assert_eq!(
            conf.peers[0].endpoint.as_ref().and_then(Endpoint::addr),
            Some("192.168.2.1:51820".parse().unwrap())
        );
    }
    // The cut-off holder keeps its ordinary peers and opens nothing else.
    let holder = topology("n1", true);
    assert!(holder.leader && holder.standby.is_empty());
}

#[test]
fn the_other_leaders_accept_the_verifiers_without_routing_to_them() {
    let t = topology("w1", true);
    assert!(t.leader);
    assert_eq!(names(&t), [("n2", 0), ("n3", 0)]);
    let conf = t.conf(Some(&Key::padded("k4")));
    let keys: Vec<Key> = conf.peers.iter().map(|p| p.public_key).collect();
    assert_eq!(
        keys,
        [Key::padded("k1"), Key::padded("k2"), Key::padded("k3")]
    );
    assert!(!conf.peers[0].allowed_ips.is_empty());
    assert!(conf.peers[1..].iter().all(|p| p.allowed_ips.is_empty()));
}

#[test]
fn full_granularity_has_no_leader_to_verify() {
    let nodes = cluster();
    let verifiers = BTreeMap::from([("east".to_string(), vec!["n2".to_string()])]);
    let t = Topology::with_leaders(
        &nodes,
        &[],
        &f1_params("n2", Granularity::Full),
        &BTreeMap::new(),
    )
    .unwrap()
    .with_standby(&nodes, &verifiers);
    assert!(t.standby.is_empty());
}
