//! `kgctl diagnose`'s judgement, as pure functions: what is wrong in the cluster's annotations
//! (clock skew, duplicate WireGuard IPs, overlapping CIDRs, who leads each location and why),
//! and what is wrong on one node, from the [`NodeStatus`](crate::status::NodeStatus) its kg reports (handshakes that never
//! complete and the evidence of why, NAT without keepalive, path MTU, IPIP, missing routes and
//! rules, endpoint candidates left or refused). Each finding says in plain words what is wrong and what to do.

use serde::{Deserialize, Serialize};

mod candidates;
mod cluster;
mod evidence;
mod host;
mod keys;

pub use candidates::candidate_findings;
pub use cluster::{cluster_findings, cluster_findings_with_leases};
pub use host::{node_findings, remote_findings};
pub use keys::{key_findings, FALLBACK_SHOWN_SECS};

/// A `last-seen` further than this in the future is clock skew.
pub const CLOCK_SKEW_SECS: i64 = 10;
/// A session older than this is dead (WireGuard rejects data after 180 s without a rekey).
pub const STALE_HANDSHAKE_SECS: i64 = 180;
/// Traffic that has gone this long without an answer is failing: WireGuard itself gives up on
/// a session and starts a new handshake once data has gone unanswered for keepalive (10 s) plus
/// rekey timeout (5 s). A busy link is answered far sooner, an idle one awaits nothing.
pub const UNANSWERED_SECS: i64 = 15;

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Something is broken: `kgctl diagnose` exits non-zero.
    Problem,
    /// Something is likely to break, or could not be checked.
    Warning,
    /// How things are, for the reader.
    Info,
}

/// One thing `kgctl diagnose` found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// How bad it is.
    pub severity: Severity,
    /// Which check found it (`handshake`, `nat`, `path-mtu`, `ipip`, `routes`, `leader`,
    /// `clock`, `wireguard-ip`, `cidr-overlap`, `kg`…).
    pub check: String,
    /// What it is about: a node, a location, a Peer.
    pub subject: String,
    /// What is wrong (or how things are).
    pub message: String,
    /// What to do about it (empty for information).
    pub advice: String,
}

impl Finding {
    fn new(
        severity: Severity,
        check: &str,
        subject: impl Into<String>,
        message: impl Into<String>,
        advice: impl Into<String>,
    ) -> Self {
        Self {
            severity,
            check: check.to_string(),
            subject: subject.into(),
            message: message.into(),
            advice: advice.into(),
        }
    }
}

/// True when any finding is a problem.
pub fn has_problems(findings: &[Finding]) -> bool {
    findings.iter().any(|f| f.severity == Severity::Problem)
}

#[cfg(test)]
mod tests;
