//! Unit tests of `diagnosis`: helpers that build a node's status and its peers'; the tests
//! live in the submodules.

use super::*;
use crate::fixtures::NOW;
use crate::status::{NodeStatus, PeerKind, PeerStatus};

mod candidates;
mod cluster;
mod host;
mod keys;
mod unanswered;

fn checks(findings: &[Finding], severity: Severity) -> Vec<&str> {
    findings
        .iter()
        .filter(|f| f.severity == severity)
        .map(|f| f.check.as_str())
        .collect()
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
        refused_responses: 0,
        unused_answers: 0,
        post_quantum: None,
        candidates: None,
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
