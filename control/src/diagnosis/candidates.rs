//! What `kgctl diagnose` says of a peer's endpoint candidates (`kilotun.io/endpoints`), from
//! the `candidates` object kg reports at `/status`: none usable, still probing after leaving
//! some, or reached on one that is not the first.

use super::host::peer_subject;
use super::{Finding, Severity};
use crate::status::{CandidateNote, NodeStatus};

/// Candidates and why, as one clause: `10.0.0.2:51820 (why), 10.0.0.3:51820 (why)`.
fn notes(list: &[CandidateNote]) -> String {
    list.iter()
        .map(|n| format!("{} ({})", n.endpoint, n.why))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The findings about the candidates of each peer of `status` that publishes them.
pub fn candidate_findings(status: &NodeStatus) -> Vec<Finding> {
    let mut out = Vec::new();
    for peer in &status.peers {
        let Some(c) = &peer.candidates else { continue };
        let subject = peer_subject(peer);
        let node = &peer.leader;
        match c.in_use.as_deref() {
            None => out.push(Finding::new(
                Severity::Warning,
                "endpoints",
                subject,
                format!(
                    "none of node {node}'s endpoint candidates is usable from here: {}; kg sends to its kilo.squat.ai/endpoint",
                    notes(&c.refused)
                ),
                "check --accept-endpoints and --underlay-family on this node, and that the host has a route of its own (not through the mesh) to one of the candidates",
            )),
            Some(in_use) if c.state == "probing" && !c.left.is_empty() => out.push(Finding::new(
                Severity::Warning,
                "endpoints",
                subject,
                format!(
                    "kg is still looking for a candidate of node {node} that completes a handshake: it left {}, and tries {in_use} now",
                    notes(&c.left)
                ),
                format!(
                    "allow UDP to one of node {node}'s candidates ({}), or leave the unreachable ones out with --advertise-endpoints on node {node}",
                    c.usable.join(", ")
                ),
            )),
            Some(in_use) if !c.left.is_empty() || !c.refused.is_empty() => {
                let mut message = if c.state == "working" {
                    format!("node {node} is reached at {in_use}")
                } else {
                    format!("kg sends to node {node} at {in_use}, with no handshake on it yet")
                };
                if !c.left.is_empty() {
                    message += &format!("; kg left {}", notes(&c.left));
                }
                if !c.refused.is_empty() {
                    message += &format!("; it does not try {}", notes(&c.refused));
                }
                out.push(Finding::new(Severity::Info, "endpoints", subject, message, ""));
            }
            Some(_) => {}
        }
    }
    out
}
