//! Unanswered traffic, which the embedded engine tracks: seen from the sending node and from
//! the other end, told apart from an idle link and from a refused key.

use super::*;
use crate::status::RejectedHandshakeStatus;

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
