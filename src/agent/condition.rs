//! The node condition `KiloMeshReady`, the agent's shell around it: after each pass it reads
//! what the judgement needs (the engine's state, the node's role in the applied topology, the
//! device's counters) and sends the write the reconciler says is due (the judgement's tunnel
//! events are recorded with any backend)
//! ([`super::reconciler::Reconciler::condition_due`]).

use control::clock::Now;
use control::condition::{MeshInputs, Role, Tunnel};
use control::journal::Reason;

use super::serve::status::EngineReadiness;
use super::shells::{Device, Firewall, Kernel};
use super::Agent;

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Judges the node at `now` (its tunnels' `LinkDown` and `LinkUp` events with any backend)
    /// and, with a backend that keeps node conditions, writes the condition when due; a
    /// refusal is said once. While the API server is unreachable nothing is sent: the write
    /// stays due.
    pub(super) async fn tend_condition(&mut self, now: Now) {
        let keeps_conditions = self.backend.keeps_conditions();
        let hostname = self.settings.hostname.clone();
        if keeps_conditions && self.core.condition_wants_present() && self.backend.healthy() {
            // Read once (a failed read is tried again at the next step).
            if let Ok(present) = self.backend.node_condition(&hostname).await {
                self.core.condition_adopt(present);
            }
        }
        let inputs = self.mesh_inputs();
        let Some(write) = self.core.condition_due(&inputs, now.unix_ms) else {
            return;
        };
        if !keeps_conditions || !self.backend.healthy() {
            return;
        }
        let sent = self.backend.write_node_condition(&hostname, &write).await;
        self.core.condition_sent(write);
        if let Err(e) = sent {
            if self.problems.first_time("condition refused") {
                self.core.journal().record(
                    Reason::ConditionRefused,
                    hostname,
                    format!("the API server refused the node condition {} (kg goes on meshing; is `nodes/status` patch in kg's ClusterRole?): {e:#}", control::condition::CONDITION_TYPE),
                );
            }
        }
    }

    /// What the judgement reads now.
    fn mesh_inputs(&self) -> MeshInputs {
        let engine_configured = self.status.engine() != EngineReadiness::Unconfigured;
        let role = match self.core.topology() {
            None => Role::NotReady(
                "kg has no topology for it (the node is not ready: see /status)".into(),
            ),
            Some(t) if t.leader => Role::Leader {
                location: t.local_location.clone(),
                tunnels: t
                    .segments
                    .iter()
                    .filter(|s| !t.in_local_location(s))
                    .filter_map(|s| {
                        let name = s.members.get(s.leader)?.name.clone();
                        // A relayed location's traffic goes through the relay's tunnel, the
                        // only one that can show it answering.
                        Some(match t.relay_for(s) {
                            Some(relay) => Tunnel {
                                name: format!(
                                    "{name} (through {})",
                                    relay.members.get(relay.leader)?.name
                                ),
                                key: relay.public_key,
                            },
                            None => Tunnel {
                                name,
                                key: s.public_key,
                            },
                        })
                    })
                    .collect(),
            },
            Some(t) => Role::Follower {
                leader: t
                    .local_segment()
                    .and_then(|s| s.members.get(s.leader))
                    .map_or_else(|| "(unknown)".into(), |m| m.name.clone()),
            },
        };
        let traffic = match role {
            Role::Leader { .. } => self.wg.traffic().ok().map(|t| t.into_iter().collect()),
            _ => Some(Default::default()),
        };
        MeshInputs {
            engine_configured,
            role,
            traffic,
        }
    }
}
