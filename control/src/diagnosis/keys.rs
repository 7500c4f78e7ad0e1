//! The findings about a node's preshared keys, from the [`NodeStatus`] its kg reports: links
//! whose handshakes fail the way differing preshared keys make them fail, post-quantum links
//! that dropped their key, and exchanges that do not complete.

use super::host::peer_subject;
use super::{Finding, Severity};
use crate::pq::link::FailedHandshakes;
use crate::status::{NodeStatus, PeerKind, PqState};

/// How long after a post-quantum link dropped its key diagnose still says so once it holds a
/// key again.
pub const FALLBACK_SHOWN_SECS: i64 = 600;

/// The findings about `status`'s preshared keys at `now_unix`.
pub fn key_findings(status: &NodeStatus, now_unix: i64) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut keyed = Vec::new();
    let mut off = Vec::new();
    for peer in &status.peers {
        let subject = peer_subject(peer);
        let failed = FailedHandshakes {
            refused_responses: peer.refused_responses,
            unused_answers: peer.unused_answers,
        };
        if failed.keys_differ() {
            let taking_part = peer
                .post_quantum
                .as_ref()
                .filter(|pq| pq.state != PqState::Off);
            let (message, advice) = match (taking_part, peer.kind) {
                (Some(pq), _) if pq.falls_back => (
                    "kg falls back: each end drops the link's post-quantum key, and a new exchange follows",
                    "if this stays, check that kg runs with --post-quantum at both ends and compare `wg show <interface> preshared-keys` there",
                ),
                (Some(_), _) => (
                    "this link does not fall back by itself: an end's WireGuard does not count failed handshakes (the kernel's)",
                    "remove <key-file>.psk on one end and restart its kg: it makes a new ML-KEM key, and both ends drop their keys",
                ),
                (None, PeerKind::Peer) => (
                    "the Peer's presharedKey differs from the one configured at its other end",
                    "set the same preshared key at both ends",
                ),
                (None, PeerKind::Segment) => (
                    "the preshared keys of the two ends differ",
                    "compare `wg show <interface> preshared-keys` at both ends",
                ),
            };
            out.push(Finding::new(
                Severity::Problem,
                "preshared-key",
                subject.clone(),
                format!(
                    "handshakes fail the way differing preshared keys make them fail ({} responses refused, {} answers unused, in a row): {message}",
                    failed.refused_responses, failed.unused_answers
                ),
                advice,
            ));
        }
        let Some(pq) = &peer.post_quantum else {
            continue;
        };
        // Shown while the link holds no key again, and for ten minutes once it does.
        let fell_back_ago = pq
            .fell_back_unix
            .map(|t| now_unix - t)
            .filter(|ago| pq.state != PqState::Keyed || *ago <= FALLBACK_SHOWN_SECS);
        if let Some(ago) = fell_back_ago {
            let now = match (pq.state, pq.epoch) {
                (PqState::Keyed, Some(epoch)) => format!("it is keyed again (epoch {epoch})"),
                (PqState::FellBack, _) => "it has no key yet: the next exchange makes one".into(),
                _ => format!("it has no key: {}", pq.detail),
            };
            out.push(Finding::new(
                Severity::Warning,
                "post-quantum",
                subject.clone(),
                format!("the link dropped its post-quantum key {ago} s ago because handshakes failed under it (the two ends held different keys, or the answers were lost); {now}"),
                "nothing if it is keyed again; saved keys (<key-file>.psk) changed or copied from another node cause this, and so does a path that loses the handshake answers",
            ));
        }
        match pq.state {
            PqState::Keyed => keyed.push(subject),
            PqState::Off => off.push(subject),
            PqState::FellBack => {}
            PqState::Exchanging if fell_back_ago.is_some() => {}
            PqState::Exchanging => {
                let Some((reason, _)) = &pq.last_refused else {
                    out.push(Finding::new(
                        Severity::Info,
                        "post-quantum",
                        subject,
                        format!("no post-quantum key yet: {}", pq.detail),
                        "",
                    ));
                    continue;
                };
                let counts: Vec<String> = pq
                    .refused
                    .iter()
                    .map(|(r, n)| format!("{r} ×{n}"))
                    .collect();
                let advice = if reason == "unanswered" {
                    "check that the peer's kg runs with --post-quantum, and that UDP 51821 is open on the WireGuard interfaces of both nodes"
                } else {
                    "the peer's kg sends messages this kg refuses: check that both run the same kilotun version, and the peer's log"
                };
                out.push(Finding::new(
                    Severity::Warning,
                    "post-quantum",
                    subject,
                    format!(
                        "the link has no post-quantum key: {} (refused so far: {})",
                        pq.detail,
                        counts.join(", ")
                    ),
                    advice,
                ));
            }
        }
    }
    if !keyed.is_empty() || !off.is_empty() {
        let mut message = format!("{} link(s) hold a post-quantum preshared key", keyed.len());
        if !off.is_empty() {
            message.push_str(&format!(
                "; {} take no part and run without one: {}",
                off.len(),
                off.join(", ")
            ));
        }
        out.push(Finding::new(
            Severity::Info,
            "post-quantum",
            format!("node {}", status.node),
            message,
            "",
        ));
    }
    out
}
