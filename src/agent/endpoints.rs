//! Endpoint candidates, the agent's shell around them: when the machine asks
//! ([`super::reconciler::Wake::ReadPeers`]) it reads the device's peers and hands them over,
//! and it puts each peer's probing on `/status`.

use std::collections::BTreeMap;

use control::clock::Now;
use control::status::CandidatesStatus;

use super::shells::{Device, Firewall, Kernel};
use super::Agent;

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Reads the device's peers at `now` for the endpoint probing: returns how many peers
    /// moved to another candidate (a pass then gives the device their endpoints). A read that
    /// fails hands over no reading: the machine asks again later.
    pub(super) fn read_for_endpoints(&mut self, now: Now) -> usize {
        let readings = self.wg.peer_readings().unwrap_or_else(|e| {
            tracing::debug!(
                error = format!("{e:#}"),
                "reading the device for the endpoint candidates"
            );
            BTreeMap::new()
        });
        let moved = self.core.endpoint_readings(&readings, now);
        self.metrics.endpoint_changes.inc_by(moved as u64);
        self.publish_candidates();
        moved
    }

    /// Every peer's endpoint probing, as `/status` shows it.
    pub fn endpoint_statuses(&self) -> Vec<control::endpoints::ProbeStatus> {
        self.core.endpoint_statuses()
    }

    /// Puts every peer's endpoint probing on `/status`, when it changed since last put there
    /// (a step's pass rarely changes it; formatting every peer's candidates is not free).
    pub(super) fn publish_candidates(&mut self) {
        let revision = self.core.endpoint_statuses_revision();
        if self.candidates_published == Some(revision) {
            return;
        }
        self.candidates_published = Some(revision);
        let candidates: BTreeMap<String, CandidatesStatus> = self
            .core
            .endpoint_statuses()
            .iter()
            .map(|p| (p.key.to_string(), CandidatesStatus::from(p)))
            .collect();
        self.status.update(|s| s.candidates = candidates);
    }
}
