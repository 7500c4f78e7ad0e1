//! The findings about a node's preshared keys, from the [`NodeStatus`] its kg reports: links
//! whose handshakes fail the way differing preshared keys make them fail, post-quantum links
//! that dropped their key, and exchanges that do not complete.

use super::{Finding, Severity};
use crate::status::{NodeStatus, PeerKind, PeerStatus, PqState};

/// Handshakes in a row failed under differing preshared keys from which a link is named.
pub const MISMATCH_AFTER_FAILED: u32 = 2;
/// How long after a post-quantum link dropped its key diagnose still says so.
pub const FALLBACK_SHOWN_SECS: i64 = 600;

fn subject(peer: &PeerStatus) -> String {
    match peer.kind {
        PeerKind::Segment => format!("{} (leader {})", peer.name, peer.leader),
        PeerKind::Peer => format!("Peer {}", peer.name),
    }
}

/// The findings about `status`'s preshared keys at `now_unix`.
pub fn key_findings(status: &NodeStatus, now_unix: i64) -> Vec<Finding> {
    let mut out = Vec::new();
    let mut keyed = Vec::new();
    let mut off = Vec::new();
    for peer in &status.peers {
        let subject = subject(peer);
        if peer.failed_in_a_row >= MISMATCH_AFTER_FAILED {
            let (message, advice) = match (&peer.post_quantum, peer.kind) {
                (Some(_), _) => (
                    "kg falls back: each end drops the link's post-quantum key within two failed handshakes, and a new exchange follows",
                    "if this stays, check that kg runs with --post-quantum at both ends and compare `wg show <interface> preshared-keys` there",
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
                    "{} handshakes in a row failed the way differing preshared keys make them fail (an answer that does not verify, or an answer never used): {message}",
                    peer.failed_in_a_row
                ),
                advice,
            ));
        }
        let Some(pq) = &peer.post_quantum else {
            continue;
        };
        let fell_back_ago = pq
            .fell_back_unix
            .map(|t| now_unix - t)
            .filter(|ago| *ago <= FALLBACK_SHOWN_SECS);
        if let Some(ago) = fell_back_ago {
            let now = match (pq.state, pq.epoch) {
                (PqState::Keyed, Some(epoch)) => format!("it is keyed again (epoch {epoch})"),
                (PqState::FellBack, _) => "it has no key yet: the next exchange makes one".into(),
                _ => format!("it has no key yet: {}", pq.detail),
            };
            out.push(Finding::new(
                Severity::Warning,
                "post-quantum",
                subject.clone(),
                format!("the link dropped its post-quantum key {ago} s ago because handshakes failed under it (the two ends held different keys); {now}"),
                "nothing if it is keyed again; a kg whose saved keys (<key-file>.psk) were changed or copied from another node causes this",
            ));
        }
        match pq.state {
            PqState::Keyed => keyed.push(subject),
            PqState::Off => off.push(subject),
            PqState::FellBack => {}
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
