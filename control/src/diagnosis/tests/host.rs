//! A node's own findings: handshakes that never complete or use another key, NAT without a
//! keepalive, probes, drift and errors.

use super::*;
use crate::status::{IpipProbe, MtuOutcome, MtuProbe, Probes, RejectedHandshakeStatus};

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
