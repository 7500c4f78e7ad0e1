//! Leader election by lease, the agent's shell around the lease step: it reads the tunnels the
//! step needs ([`TunnelReadings`]) and sends the lease write the reconciler returns
//! ([`super::reconciler::PassEffect::WriteLease`]) as a compare-and-swap.

use control::leader::book::{LeaseWrite, TunnelReadings, TunnelTraffic};
use control::Key;

use super::shells::{Device, Firewall, Kernel};
use super::Agent;

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Sends `write`, and records why when it was worth saying and it held.
    pub(super) async fn write_lease(&mut self, write: LeaseWrite) {
        let LeaseWrite {
            name,
            next,
            expected,
            why,
        } = write;
        match self.backend.write_lease(&name, &next, &expected).await {
            Ok(true) => {
                if let Some(why) = why {
                    self.core.journal().record(why.reason, name, why.message);
                }
            }
            Ok(false) => tracing::debug!(lease = %name, "another node wrote the lease first"),
            Err(e) => {
                tracing::warn!(lease = %name, error = format!("{e:#}"), "writing the lease failed")
            }
        }
    }

    /// What the lease step needs of the device: the tunnels' counters while this node leads,
    /// and which other locations' leaders its standby tunnels completed a handshake with.
    pub(super) fn tunnel_readings(&self) -> TunnelReadings {
        let Some(t) = self.core.topology() else {
            return TunnelReadings {
                traffic: TunnelTraffic::NotLeading,
                standby_reached: Vec::new(),
            };
        };
        let remote: Vec<&control::topology::Segment> = t
            .segments
            .iter()
            .filter(|s| !t.in_local_location(s))
            .collect();
        let traffic = if !t.leader {
            TunnelTraffic::NotLeading
        } else {
            match self.wg.traffic() {
                Ok(peers) => TunnelTraffic::Read {
                    watched: remote.iter().map(|s| s.public_key).collect(),
                    peers: peers.into_iter().collect(),
                },
                Err(_) => TunnelTraffic::Unreadable,
            }
        };
        let standby_reached = if t.standby.is_empty() {
            Vec::new()
        } else {
            match self.wg.device_peers() {
                Ok(device) => {
                    let shaken = |key: &Key| {
                        device
                            .iter()
                            .any(|d| d.public_key == *key && d.has_handshake)
                    };
                    remote
                        .iter()
                        .filter(|s| t.standby.iter().any(|p| p.public_key == s.public_key))
                        .filter(|s| shaken(&s.public_key))
                        .map(|s| s.location.clone())
                        .collect()
                }
                Err(_) => Vec::new(),
            }
        };
        TunnelReadings {
            traffic,
            standby_reached,
        }
    }
}
