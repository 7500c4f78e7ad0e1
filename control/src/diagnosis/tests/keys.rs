//! Preshared keys: a mismatch named from the device's failed handshakes, a post-quantum link
//! that fell back, an exchange that does not complete, and the summary of keyed links.

use std::collections::BTreeMap;

use super::*;
use crate::status::{PqLinkStatus, PqState};

fn pq(state: PqState) -> PqLinkStatus {
    PqLinkStatus {
        state,
        detail: String::new(),
        epoch: (state == PqState::Keyed).then_some(7),
        psk_changed_unix: Some(NOW - 40),
        fell_back_unix: None,
        falls_back: true,
        refused: BTreeMap::new(),
        last_refused: None,
    }
}

fn with_pq(name: &str, leader: &str, state: PqState) -> PeerStatus {
    PeerStatus {
        post_quantum: Some(pq(state)),
        ..peer_status(name, leader, &format!("K-{leader}"))
    }
}

fn find<'f>(findings: &'f [Finding], check: &str) -> Vec<&'f Finding> {
    findings.iter().filter(|f| f.check == check).collect()
}

#[test]
fn handshakes_failing_under_differing_keys_are_a_problem_named_by_link() {
    let mut refused = with_pq("west", "n3", PqState::Keyed);
    refused.refused_responses = 2;
    let mut once = with_pq("south", "n4", PqState::Keyed);
    once.refused_responses = 1;
    let mut lossy = with_pq("north", "n5", PqState::Keyed);
    lossy.unused_answers = 3;
    let mut unused = with_pq("east2", "n6", PqState::Keyed);
    unused.unused_answers = 4;
    unused.post_quantum.as_mut().unwrap().falls_back = false;
    let findings = key_findings(&status(vec![refused, once, lossy, unused]), NOW);
    let named = find(&findings, "preshared-key");
    assert_eq!(
        named.len(),
        2,
        "one refused response, or three unused answers (lost ones look the same), is not yet a mismatch: {findings:?}"
    );
    assert_eq!(named[0].severity, Severity::Problem);
    assert_eq!(named[0].subject, "location:west (leader n3)");
    assert!(named[0]
        .message
        .contains("(2 responses refused, 0 answers unused, in a row)"));
    assert!(named[0].message.contains("kg falls back"));
    // A link with an end that does not fall back: the way out is named.
    assert_eq!(named[1].subject, "location:east2 (leader n6)");
    assert!(named[1].message.contains("does not fall back"));
    assert!(named[1].advice.contains("<key-file>.psk"));
    // A Peer, which takes no part in post-quantum keys: its own presharedKey is named.
    let mut peer = with_pq("laptop", "", PqState::Off);
    peer.kind = PeerKind::Peer;
    peer.name = "laptop".into();
    peer.refused_responses = 3;
    let findings = key_findings(&status(vec![peer]), NOW);
    assert!(find(&findings, "preshared-key")[0]
        .message
        .contains("the Peer's presharedKey differs"));
}

#[test]
fn a_link_that_fell_back_is_shown_for_ten_minutes_with_what_it_holds_now() {
    let mut again = with_pq("west", "n3", PqState::Keyed);
    again.post_quantum.as_mut().unwrap().fell_back_unix = Some(NOW - 30);
    let mut without = with_pq("south", "n4", PqState::FellBack);
    let p = without.post_quantum.as_mut().unwrap();
    p.fell_back_unix = Some(NOW - 5);
    p.detail = "dropped the key of epoch 6".into();
    let mut long_ago = with_pq("north", "n5", PqState::Keyed);
    long_ago.post_quantum.as_mut().unwrap().fell_back_unix = Some(NOW - FALLBACK_SHOWN_SECS - 1);
    // Still without a key long after: said as long as it lasts, with why no key came.
    let mut stuck = with_pq("east2", "n6", PqState::Exchanging);
    let p = stuck.post_quantum.as_mut().unwrap();
    p.fell_back_unix = Some(NOW - 3_600);
    p.detail = "the exchange goes unanswered".into();
    let findings = key_findings(&status(vec![again, without, long_ago, stuck]), NOW);
    let shown = find(&findings, "post-quantum");
    let warnings: Vec<_> = shown
        .iter()
        .filter(|f| f.severity == Severity::Warning)
        .collect();
    assert_eq!(warnings.len(), 3, "{findings:?}");
    assert!(warnings[2].message.contains("3600 s ago"));
    assert!(warnings[2]
        .message
        .ends_with("it has no key: the exchange goes unanswered"));
    assert!(warnings[0].message.contains("30 s ago"));
    assert!(warnings[0].message.contains("keyed again (epoch 7)"));
    assert!(warnings[1]
        .message
        .ends_with("no key yet: the next exchange makes one"));
}

#[test]
fn an_exchange_that_fails_says_why_and_a_summary_lists_the_links_without() {
    let mut unanswered = with_pq("west", "n3", PqState::Exchanging);
    let p = unanswered.post_quantum.as_mut().unwrap();
    p.detail = "the exchange goes unanswered".into();
    p.refused.insert("unanswered".into(), 3);
    p.last_refused = Some(("unanswered".into(), NOW - 2));
    let starting = with_pq("south", "n4", PqState::Exchanging);
    let keyed = with_pq("north", "n5", PqState::Keyed);
    let off = with_pq("east2", "n6", PqState::Off);
    let findings = key_findings(&status(vec![unanswered, starting, keyed, off]), NOW);
    let shown = find(&findings, "post-quantum");
    let warning = shown
        .iter()
        .find(|f| f.severity == Severity::Warning)
        .expect("the failing exchange");
    assert_eq!(warning.subject, "location:west (leader n3)");
    assert!(warning.message.contains("unanswered ×3"));
    assert!(warning.advice.contains("UDP 51821"));
    let infos: Vec<&str> = shown
        .iter()
        .filter(|f| f.severity == Severity::Info)
        .map(|f| f.message.as_str())
        .collect();
    assert_eq!(infos.len(), 2, "{infos:?}");
    assert!(infos[1].starts_with("1 link(s) hold a post-quantum preshared key; 1 take no part"));
    assert!(infos[1].contains("location:east2 (leader n6)"));
    assert!(!has_problems(&findings));
}
