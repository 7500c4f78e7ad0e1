//! The endpoint candidates' findings.

use super::*;
use crate::status::{CandidateNote, CandidatesStatus};

fn note(endpoint: &str, why: &str) -> CandidateNote {
    CandidateNote {
        endpoint: endpoint.into(),
        why: why.into(),
        at_unix: None,
    }
}

fn with_candidates(c: CandidatesStatus) -> NodeStatus {
    let mut peer = peer_status("west", "n3", "k3");
    peer.candidates = Some(c);
    status(vec![peer])
}

#[test]
fn none_usable_is_a_warning_naming_each_refusal() {
    let s = with_candidates(CandidatesStatus {
        in_use: None,
        state: "only".into(),
        usable: Vec::new(),
        refused: vec![note("[2001:db8::3]:51820", "this host has no IPv6 address")],
        left: Vec::new(),
    });
    let found = candidate_findings(&s);
    assert_eq!(checks(&found, Severity::Warning), ["endpoints"]);
    assert!(found[0].message.contains("node n3"), "{}", found[0].message);
    assert!(
        found[0]
            .message
            .contains("[2001:db8::3]:51820 (this host has no IPv6 address)"),
        "{}",
        found[0].message
    );
    assert!(node_findings(&s, &[], NOW)
        .iter()
        .any(|f| f.check == "endpoints"));
}

#[test]
fn probing_after_leaving_some_is_a_warning_and_a_working_one_is_said() {
    let mut c = CandidatesStatus {
        in_use: Some("10.0.0.4:51820".into()),
        state: "probing".into(),
        usable: vec!["10.0.0.3:51820".into(), "10.0.0.4:51820".into()],
        refused: Vec::new(),
        left: vec![note(
            "10.0.0.3:51820",
            "no handshake within 15 s of trying it",
        )],
    };
    let found = candidate_findings(&with_candidates(c.clone()));
    assert_eq!(checks(&found, Severity::Warning), ["endpoints"]);
    assert!(
        found[0].message.contains("tries 10.0.0.4:51820 now"),
        "{}",
        found[0].message
    );
    assert!(found[0].advice.contains("--advertise-endpoints on node n3"));
    c.state = "working".into();
    let found = candidate_findings(&with_candidates(c.clone()));
    assert_eq!(checks(&found, Severity::Info), ["endpoints"]);
    assert!(
        found[0]
            .message
            .contains("reached at 10.0.0.4:51820; kg left 10.0.0.3:51820"),
        "{}",
        found[0].message
    );
    // The first candidate working, nothing left or refused: nothing to say.
    c.left.clear();
    assert!(candidate_findings(&with_candidates(c)).is_empty());
}
