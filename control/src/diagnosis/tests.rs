use std::collections::BTreeMap;

use super::*;
use crate::fixtures::{f1_nodes, f1_params, node, NOW};
use crate::node::{Granularity, Node};
use crate::peer::Peer;
use crate::status::{
    IpipProbe, MtuOutcome, MtuProbe, NodeStatus, PeerKind, PeerStatus, Probes,
    RejectedHandshakeStatus,
};
use crate::topology::Topology;

fn checks(findings: &[Finding], severity: Severity) -> Vec<&str> {
    findings
        .iter()
        .filter(|f| f.severity == severity)
        .map(|f| f.check.as_str())
        .collect()
}

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

fn peer_status(name: &str, leader: &str, key: &str) -> PeerStatus {
    PeerStatus {
        kind: PeerKind::Segment,
        name: format!("location:{name}"),
        leader: leader.into(),
        public_key: key.into(),
        configured_endpoint: Some("192.168.20.3:51820".into()),
        endpoint: Some("192.168.20.3:51820".into()),
        persistent_keepalive: 0,
        last_handshake_unix: Some(NOW - 5),
        unanswered_since_unix: None,
        handshakes: 1,
        handshake_failures: 0,
        rx_bytes: 1000,
        tx_bytes: 1000,
    }
}

fn status(peers: Vec<PeerStatus>) -> NodeStatus {
    NodeStatus {
        node: "n1".into(),
        location: "location:east".into(),
        leader: true,
        mtu: 1420,
        port: 51820,
        peers,
        drift: Some(Vec::new()),
        ..Default::default()
    }
}

#[test]
fn a_healthy_node_has_no_problem() {
    let s = status(vec![peer_status("west", "n3", "K3")]);
    assert!(!has_problems(&node_findings(&s, &[], NOW)));
}

#[test]
fn silence_from_a_peer_means_udp_is_blocked() {
    let mut p = peer_status("west", "n3", "K3");
    p.last_handshake_unix = None;
    p.rx_bytes = 0;
    p.handshake_failures = 4;
    let findings = node_findings(&status(vec![p]), &[], NOW);
    let f = findings.iter().find(|f| f.check == "handshake").unwrap();
    assert_eq!(f.severity, Severity::Problem);
    assert_eq!(f.subject, "location:west (leader n3)");
    assert!(
        f.message.contains("no handshake has ever completed"),
        "{}",
        f.message
    );
    assert!(f.message.contains("nothing has arrived"), "{}", f.message);
    assert!(f.advice.contains("UDP port 51820"), "{}", f.advice);
}

#[test]
fn a_handshake_with_another_key_names_the_stale_annotation() {
    let mut p = peer_status("west", "n3", "ANNOUNCED");
    p.last_handshake_unix = Some(NOW - 400);
    let mut s = status(vec![p]);
    s.rejected_handshakes = vec![RejectedHandshakeStatus {
        reason: "unknown_peer".into(),
        from: "192.168.20.3:51820".into(),
        public_key: Some("REAL".into()),
        at_unix: NOW - 2,
    }];
    let findings = node_findings(&s, &[], NOW);
    let f = findings.iter().find(|f| f.check == "handshake").unwrap();
    assert!(f.message.contains("400 s ago"), "{}", f.message);
    assert!(
        f.message.contains("REAL") && f.message.contains("ANNOUNCED"),
        "{}",
        f.message
    );
    assert!(f.message.contains("node n3"), "{}", f.message);
    // Named once, under the peer: not again as an anonymous refusal.
    assert_eq!(
        findings.iter().filter(|f| f.check == "handshake").count(),
        1
    );
}

#[test]
fn nat_without_keepalive_is_a_warning() {
    let mut p = peer_status("west", "n3", "K3");
    p.endpoint = Some("203.0.113.9:40123".into());
    let findings = node_findings(&status(vec![p.clone()]), &[], NOW);
    let f = findings.iter().find(|f| f.check == "nat").unwrap();
    assert_eq!(f.severity, Severity::Warning);
    assert!(f.advice.contains("persistent-keepalive"));
    p.persistent_keepalive = 25;
    let findings = node_findings(&status(vec![p]), &[], NOW);
    assert_eq!(
        findings.iter().find(|f| f.check == "nat").unwrap().severity,
        Severity::Info
    );
}

#[test]
fn probes_name_a_small_path_mtu_and_blocked_ipip() {
    let mut s = status(vec![peer_status("west", "n3", "K3")]);
    s.tunnel = Some("kilo-ipip".into());
    s.probes = Some(Probes {
        path_mtu: vec![
            MtuProbe {
                peer: "location:west".into(),
                endpoint: "192.168.20.3".parse().unwrap(),
                needed: 1480,
                outcome: MtuOutcome::Smaller { path_mtu: 1400 },
            },
            MtuProbe {
                peer: "location:south".into(),
                endpoint: "192.168.30.3".parse().unwrap(),
                needed: 1480,
                outcome: MtuOutcome::Fits,
            },
        ],
        ipip: vec![
            IpipProbe {
                node: "n2".into(),
                private_ip: "192.168.10.2".parse().unwrap(),
                target: "10.42.2.1".parse().unwrap(),
                plain: true,
                encapsulated: false,
            },
            IpipProbe {
                node: "n4".into(),
                private_ip: "192.168.10.4".parse().unwrap(),
                target: "10.42.4.1".parse().unwrap(),
                plain: true,
                encapsulated: true,
            },
        ],
    });
    let findings = node_findings(&s, &[], NOW);
    let mtu: Vec<&Finding> = findings.iter().filter(|f| f.check == "path-mtu").collect();
    assert_eq!(mtu.len(), 1);
    assert!(
        mtu[0].message.contains("at most 1400 bytes"),
        "{}",
        mtu[0].message
    );
    assert!(mtu[0].advice.contains("--mtu=1340"), "{}", mtu[0].advice);
    let ipip: Vec<&Finding> = findings.iter().filter(|f| f.check == "ipip").collect();
    assert_eq!(ipip.len(), 1);
    assert_eq!(ipip[0].subject, "node n2");
    assert!(ipip[0].message.contains("protocol 4 is blocked"));
}

#[test]
fn drift_and_errors_are_problems() {
    let mut s = status(Vec::new());
    s.drift = Some(vec!["iptables -t nat -I POSTROUTING 1 -j KILO-NAT".into()]);
    s.errors = vec!["route change failed: invalid argument".into()];
    let findings = node_findings(&s, &[], NOW);
    assert_eq!(checks(&findings, Severity::Problem), ["routes", "kg"]);
    assert!(findings[0].message.contains("KILO-NAT"));
}

#[test]
fn an_unknown_key_from_anywhere_is_named_for_a_peer_without_an_address() {
    let mut p = peer_status("laptop", "", "ANNOUNCED");
    p.kind = PeerKind::Peer;
    p.name = "laptop".into();
    p.configured_endpoint = None;
    p.endpoint = None;
    p.last_handshake_unix = None;
    p.rx_bytes = 0;
    let mut s = status(vec![p]);
    s.rejected_handshakes = vec![RejectedHandshakeStatus {
        reason: "unknown_peer".into(),
        from: "192.168.10.50:39000".into(),
        public_key: Some("REAL".into()),
        at_unix: NOW - 1,
    }];
    let findings = node_findings(&s, &[], NOW);
    let f = findings.iter().find(|f| f.check == "handshake").unwrap();
    assert_eq!(f.subject, "Peer laptop");
    assert!(
        f.message.contains("REAL") && f.message.contains("ANNOUNCED"),
        "{}",
        f.message
    );
    assert_eq!(
        findings.iter().filter(|f| f.check == "handshake").count(),
        1
    );
}

#[test]
fn a_refused_handshake_beside_a_live_session_is_still_reported() {
    let mut s = status(vec![peer_status("west", "n3", "K3")]);
    s.rejected_handshakes = vec![RejectedHandshakeStatus {
        reason: "invalid_mac".into(),
        from: "192.168.20.3:51820".into(),
        public_key: None,
        at_unix: NOW - 1,
    }];
    let findings = node_findings(&s, &[], NOW);
    let f = findings.iter().find(|f| f.check == "handshake").unwrap();
    assert_eq!(f.severity, Severity::Warning);
    assert!(f.message.contains("192.168.20.3:51820"));
}

#[test]
fn a_leader_by_lease_is_said_to_hold_it() {
    let nodes = f1_nodes();
    let t = Topology::new(&nodes, &[], &f1_params("a", Granularity::Location)).unwrap();
    let two = t.segments.iter().find(|s| s.members.len() > 1).unwrap();
    let leader = two.leader_member().name.clone();
    let leases = BTreeMap::from([(two.location.clone(), leader)]);
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

/// A node of the embedded engine, which reports unanswered traffic.
fn tracked(peers: Vec<PeerStatus>) -> NodeStatus {
    NodeStatus {
        tracks_answers: true,
        ..status(peers)
    }
}

#[test]
fn traffic_unanswered_for_fifteen_seconds_names_the_udp_path_long_before_the_session_expires() {
    // The last handshake is 60 s old, well inside its 180 s life: the old check saw nothing.
    let mut p = peer_status("west", "n3", "K3");
    p.last_handshake_unix = Some(NOW - 60);
    p.handshake_failures = 2;
    p.rx_bytes = 440; // something arrived once: not evidence of a refused key
    p.unanswered_since_unix = Some(NOW - 16);
    let findings = node_findings(&tracked(vec![p.clone()]), &[], NOW);
    let f = findings
        .iter()
        .find(|f| f.check == "unanswered")
        .expect("a finding");
    assert_eq!(f.severity, Severity::Problem);
    assert_eq!(f.subject, "location:west (leader n3)");
    assert!(
        f.message.contains("for 16 s has had no answer"),
        "{}",
        f.message
    );
    assert!(f.message.contains("192.168.20.3:51820"), "{}", f.message);
    assert!(
        f.message
            .contains("dropping WireGuard's UDP (port 51820 there, 51820 here)"),
        "{}",
        f.message
    );
    assert!(
        !f.message.contains("key"),
        "nothing refused a key: {}",
        f.message
    );
    assert!(f.advice.contains("kgctl diagnose n3"), "{}", f.advice);

    // Under 15 s it is a link waiting for its answer, as every busy link is for a moment.
    p.unanswered_since_unix = Some(NOW - 10);
    assert!(!has_problems(&node_findings(&tracked(vec![p]), &[], NOW)));
}

#[test]
fn an_idle_link_with_an_old_handshake_is_no_problem() {
    // The false alarm the session-age rule raised: a link that carries nothing makes no
    // handshake, so its last one grows old.
    let mut p = peer_status("south", "n5", "K5");
    p.last_handshake_unix = Some(NOW - 230);
    let findings = node_findings(&tracked(vec![p.clone()]), &[], NOW);
    assert!(!has_problems(&findings), "{findings:#?}");
    let f = findings.iter().find(|f| f.check == "handshake").unwrap();
    assert_eq!(f.severity, Severity::Info);
    assert!(f.message.contains("idle"), "{}", f.message);
    // Never used at all: also no problem.
    p.last_handshake_unix = None;
    assert!(!has_problems(&node_findings(&tracked(vec![p]), &[], NOW)));
}

#[test]
fn unanswered_traffic_with_refused_handshakes_names_the_key() {
    let mut p = peer_status("west", "n3", "ANNOUNCED");
    p.last_handshake_unix = None;
    p.unanswered_since_unix = Some(NOW - 20);
    let mut s = tracked(vec![p]);
    s.rejected_handshakes = vec![RejectedHandshakeStatus {
        reason: "unknown_peer".into(),
        from: "192.168.20.3:51820".into(),
        public_key: Some("REAL".into()),
        at_unix: NOW - 2,
    }];
    let findings = node_findings(&s, &[], NOW);
    let f = findings.iter().find(|f| f.check == "unanswered").unwrap();
    assert!(
        f.message.contains("REAL") && f.message.contains("ANNOUNCED"),
        "{}",
        f.message
    );
}

#[test]
fn the_other_end_names_a_node_whose_incoming_udp_is_dropped() {
    // n3 only answers (it sends nothing of its own), so its own status shows nothing wrong;
    // n1, the leader at the other end, has sent to it for 25 s without an answer.
    let n3 = NodeStatus {
        node: "n3".into(),
        location: "location:west".into(),
        leader: true,
        port: 51820,
        tracks_answers: true,
        peers: vec![peer_status("east", "n1", "K1")],
        ..Default::default()
    };
    assert!(!has_problems(&node_findings(&n3, &[], NOW)));
    let mut towards_n3 = peer_status("west", "n3", "K3");
    towards_n3.unanswered_since_unix = Some(NOW - 25);
    let n1 = NodeStatus {
        node: "n1".into(),
        tracks_answers: true,
        peers: vec![towards_n3.clone()],
        ..tracked(vec![])
    };
    let found = remote_findings(&n3, &n1, NOW);
    assert_eq!(found.len(), 1, "{found:#?}");
    assert_eq!(found[0].severity, Severity::Problem);
    assert_eq!(found[0].subject, "node n1 → node n3");
    assert!(
        found[0].message.contains("for 25 s without an answer"),
        "{}",
        found[0].message
    );
    assert!(
        found[0].advice.contains("UDP port 51820"),
        "{}",
        found[0].advice
    );
    // Answered again: nothing to say. A device that does not track answers: nothing either.
    towards_n3.unanswered_since_unix = None;
    let healed = NodeStatus {
        peers: vec![towards_n3],
        ..n1.clone()
    };
    assert!(remote_findings(&n3, &healed, NOW).is_empty());
    let untracked = NodeStatus {
        tracks_answers: false,
        ..n1
    };
    assert!(remote_findings(&n3, &untracked, NOW).is_empty());
}

#[test]
fn a_peer_without_an_address_whose_real_key_knocks_is_named_even_when_idle() {
    // A laptop Peer (no endpoint) announcing a key other than its device's: its handshakes
    // arrive with the real key from an address no other peer uses, and are refused.
    let mut p = peer_status("laptop", "", "ANNOUNCED");
    p.kind = PeerKind::Peer;
    p.name = "laptop".into();
    p.endpoint = None;
    p.configured_endpoint = None;
    p.last_handshake_unix = None;
    p.rx_bytes = 0;
    let mut s = tracked(vec![p]);
    s.rejected_handshakes = vec![RejectedHandshakeStatus {
        reason: "unknown_peer".into(),
        from: "192.168.10.50:47339".into(),
        public_key: Some("REAL".into()),
        at_unix: NOW - 5,
    }];
    let findings = node_findings(&s, &[], NOW);
    let f = findings
        .iter()
        .find(|f| f.subject == "Peer laptop" && f.severity == Severity::Problem)
        .unwrap_or_else(|| panic!("{findings:#?}"));
    assert_eq!(f.check, "handshake");
    assert!(
        f.message.contains("REAL") && f.message.contains("ANNOUNCED"),
        "{}",
        f.message
    );
}
