//! Cluster-wide findings: leaders and why they lead, clock skew, stale check-ins, duplicate
//! WireGuard IPs and overlapping claims.

use std::collections::BTreeMap;

use super::*;
use crate::fixtures::{f1_nodes, f1_params, node};
use crate::node::{Granularity, Node};
use crate::peer::Peer;
use crate::topology::{ShareLeader, Topology};

#[test]
fn a_healthy_fixture_has_only_information() {
    let nodes = f1_nodes();
    let t = Topology::new(&nodes, &[], &f1_params("a", Granularity::Location)).unwrap();
    let findings = cluster_findings(&nodes, &[], Some(&t), NOW);
    assert!(!has_problems(&findings), "{findings:#?}");
    let leaders: Vec<&Finding> = findings.iter().filter(|f| f.check == "leader").collect();
    assert_eq!(leaders.len(), t.segments.len());
    assert!(leaders.iter().all(|f| f.severity == Severity::Info));
}

#[test]
fn says_why_a_node_leads() {
    let mut nodes = f1_nodes();
    let t = Topology::new(&nodes, &[], &f1_params("a", Granularity::Location)).unwrap();
    let two = t.segments.iter().find(|s| s.members.len() > 1).unwrap();
    let leader = two.leader_member().name.clone();
    let text = |nodes: &[Node]| {
        let t = Topology::new(nodes, &[], &f1_params("a", Granularity::Location)).unwrap();
        cluster_findings(nodes, &[], Some(&t), NOW)
            .into_iter()
            .find(|f| f.check == "leader" && f.subject == two.key)
            .unwrap()
            .message
    };
    assert!(text(&nodes).contains(&leader), "{}", text(&nodes));
    let other = two
        .members
        .iter()
        .find(|m| m.name != leader)
        .unwrap()
        .name
        .clone();
    nodes.iter_mut().find(|n| n.name == other).unwrap().leader = true;
    let message = text(&nodes);
    assert!(message.starts_with(&other), "{message}");
    assert!(
        message.contains("annotated kilo.squat.ai/leader"),
        "{message}"
    );
}

#[test]
fn finds_clock_skew_and_stale_check_ins() {
    let mut nodes = f1_nodes();
    nodes[0].last_seen = NOW + 3600;
    nodes[1].last_seen = NOW - 600;
    let findings = cluster_findings(&nodes, &[], None, NOW);
    let skew = findings.iter().find(|f| f.check == "clock").unwrap();
    assert_eq!(skew.severity, Severity::Problem);
    assert_eq!(skew.subject, format!("node {}", nodes[0].name));
    assert!(
        skew.message.contains("3600 s in the future"),
        "{}",
        skew.message
    );
    let stale = findings.iter().find(|f| f.check == "check-in").unwrap();
    assert_eq!(stale.subject, format!("node {}", nodes[1].name));
    // A few seconds ahead is ordinary drift.
    nodes[0].last_seen = NOW + CLOCK_SKEW_SECS;
    assert!(!cluster_findings(&nodes, &[], None, NOW)
        .iter()
        .any(|f| f.check == "clock"));
}

#[test]
fn finds_duplicate_wireguard_ips() {
    let mut nodes = f1_nodes();
    nodes[0].wireguard_ip = Some("10.4.0.1/16".parse().unwrap());
    nodes[2].wireguard_ip = Some("10.4.0.1/16".parse().unwrap());
    let findings = cluster_findings(&nodes, &[], None, NOW);
    let dup = findings.iter().find(|f| f.check == "wireguard-ip").unwrap();
    assert_eq!(dup.severity, Severity::Problem);
    assert!(dup.subject.contains(&nodes[0].name) && dup.subject.contains(&nodes[2].name));
}

#[test]
fn finds_overlapping_claims_naming_both_owners() {
    let mut nodes = vec![
        node(
            "a1",
            "10.1.0.1:51820",
            Some("192.168.0.1/24"),
            "x",
            "10.2.1.0/24",
            "k1",
        ),
        node(
            "a2",
            "10.1.0.2:51820",
            Some("192.168.0.2/24"),
            "x",
            "10.2.2.0/24",
            "k2",
        ),
        node(
            "b1",
            "10.1.0.3:51820",
            Some("192.168.1.1/24"),
            "y",
            "10.2.8.0/24",
            "k3",
        ),
    ];
    // A location may announce a range that holds its own pod CIDRs.
    nodes[0].allowed_location_ips = vec!["10.2.0.0/22".parse().unwrap()];
    assert!(
        !checks(&cluster_findings(&nodes, &[], None, NOW), Severity::Problem)
            .contains(&"cidr-overlap")
    );
    // Another location's pod CIDR inside it is a conflict.
    nodes[1].subnet = Some("10.2.8.0/24".parse().unwrap());
    let peer = Peer {
        name: "laptop".into(),
        allowed_ips: vec!["10.2.8.7/32".parse().unwrap()],
        public_key: None,
        endpoint: None,
        persistent_keepalive: 0,
        preshared_key: None,
    };
    let findings = cluster_findings(&nodes, &[peer], None, NOW);
    let overlaps: Vec<&Finding> = findings
        .iter()
        .filter(|f| f.check == "cidr-overlap")
        .collect();
    // a2 (x) and b1 (y) share a pod CIDR; the Peer claims an address in it.
    assert_eq!(overlaps.len(), 3, "{overlaps:#?}");
    assert!(overlaps
        .iter()
        .any(|f| f.subject.contains("node a2 (spec.podCIDR)")
            && f.subject.contains("node b1 (spec.podCIDR)")));
    assert!(overlaps
        .iter()
        .any(|f| f.subject.contains("Peer laptop") && f.message.contains("10.2.8.7/32")));
    // Another location's pod CIDR inside a location's allowed-location-ips is a conflict.
    nodes[1].subnet = Some("10.2.2.0/24".parse().unwrap());
    nodes[2].subnet = Some("10.2.3.0/24".parse().unwrap());
    let findings = cluster_findings(&nodes, &[], None, NOW);
    let overlaps: Vec<&Finding> = findings
        .iter()
        .filter(|f| f.check == "cidr-overlap")
        .collect();
    assert_eq!(overlaps.len(), 1, "{overlaps:#?}");
    assert!(overlaps[0]
        .subject
        .contains("location \"x\" (kilo.squat.ai/allowed-location-ips on node a1)"));
    assert!(overlaps[0].subject.contains("node b1 (spec.podCIDR)"));
}

#[test]
fn a_leader_by_lease_is_said_to_hold_it() {
    let nodes = f1_nodes();
    let t = Topology::new(&nodes, &[], &f1_params("a", Granularity::Location)).unwrap();
    let two = t.segments.iter().find(|s| s.members.len() > 1).unwrap();
    let leader = two.leader_member().name.clone();
    let leases = BTreeMap::from([(two.location.clone(), ShareLeader::only(leader))]);
    let findings = cluster_findings_with_leases(&nodes, &[], Some(&t), &leases, NOW);
    let f = findings
        .iter()
        .find(|f| f.check == "leader" && f.subject == two.key)
        .unwrap();
    assert!(
        f.message.contains("holds the location's lease"),
        "{}",
        f.message
    );
}

#[test]
fn a_shares_leader_by_lease_is_said_to_hold_its_shares_lease() {
    let mut nodes = crate::fixtures::location_nodes("e", "east", 10, 4);
    nodes.extend(crate::fixtures::location_nodes("w", "west", 20, 1));
    let chosen = vec![
        ShareLeader {
            share: 0,
            name: "e3".into(),
            predecessors: Vec::new(),
        },
        ShareLeader {
            share: 1,
            name: "e1".into(),
            predecessors: Vec::new(),
        },
    ];
    let leases = BTreeMap::from([("east".to_string(), chosen.clone())]);
    let mut params = f1_params("w1", Granularity::Location);
    params.leaders_per_location = 2;
    let t = Topology::with_leaders(&nodes, &[], &params, &leases).unwrap();
    let findings = cluster_findings_with_leases(&nodes, &[], Some(&t), &leases, NOW);
    let message = |key: &str| {
        findings
            .iter()
            .find(|f| f.check == "leader" && f.subject == key)
            .map(|f| f.message.clone())
            .unwrap_or_else(|| panic!("no leader finding for {key}: {findings:#?}"))
    };
    assert!(message("location:east#share:1").starts_with("e3 leads"));
    assert!(message("location:east#share:2")
        .contains("e1 leads (1 of 2 ready nodes): it holds the lease of share 2 of its location"));
    // Without leases the shares are their leaders' own, by Kilo's order of preference.
    let t = Topology::new(&nodes, &[], &params).unwrap();
    let findings = cluster_findings_with_leases(&nodes, &[], Some(&t), &BTreeMap::new(), NOW);
    assert!(findings.iter().any(|f| f.subject == "location:east#e1"
        && f.message
            .contains("one of its location's leaders (--leaders-per-location)")));
    // Down to one share, led by the second share's lease: named as that lease.
    params.leaders_per_location = 1;
    let second = BTreeMap::from([("east".to_string(), vec![chosen[1].clone()])]);
    let t = Topology::with_leaders(&nodes, &[], &params, &second).unwrap();
    let findings = cluster_findings_with_leases(&nodes, &[], Some(&t), &second, NOW);
    assert!(findings.iter().any(|f| f.subject == "location:east"
        && f.message
            .contains("e1 leads (1 of 4 ready nodes): it holds the lease of share 2")));
}
