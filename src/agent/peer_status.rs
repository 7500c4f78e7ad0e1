//! The Peers' `status`, the agent's shell around it: after each step, on the node that writes
//! it ([`super::reconciler::Reconciler::writes_peer_status`]), it reads the engine's peers and
//! sends the writes the reconciler says are due.

use control::clock::Now;
use control::journal::Reason;

use super::shells::{Device, Firewall, Kernel};
use super::Agent;

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Writes the Peers' status that is due at `now`; a refusal (a CRD without the status
    /// subresource, a ClusterRole without `peers/status`) is said once and kg goes on. While
    /// the API server is unreachable nothing is sent: the writes stay due. A failed write ends
    /// the step's writes (one bounded wait per step at most): that Peer is tried again at its
    /// next change or heartbeat, the rest at the next step.
    pub(super) async fn tend_peer_status(&mut self, now: Now) {
        if !self.backend.keeps_conditions() {
            return;
        }
        if !self.core.writes_peer_status() {
            self.core.peer_status_forget();
            return;
        }
        if !self.backend.healthy() {
            return;
        }
        let readings = match self.wg.peer_readings() {
            Ok(readings) => readings,
            Err(e) => {
                tracing::debug!(
                    error = format!("{e:#}"),
                    "reading the device for the Peers' status"
                );
                return;
            }
        };
        let hostname = self.settings.hostname.clone();
        for write in self.core.peer_status_due(&readings, now.unix_ms) {
            let sent = self.backend.write_peer_status(&hostname, &write).await;
            let peer = write.peer.clone();
            self.core.peer_status_sent(write, now.unix_ms);
            match sent {
                Ok(()) => {
                    self.metrics.peer_status_writes.inc();
                }
                Err(e) => {
                    if self.problems.first_time("peer status refused") {
                        let message = format!("the API server refused the status of Peer {peer} (kg goes on meshing; does the Peer CRD have the status subresource, and kg's ClusterRole `patch` on `peers/status`?): {e:#}");
                        self.core
                            .journal()
                            .record(Reason::PeerStatusRefused, peer, message);
                    }
                    break;
                }
            }
        }
    }
}
