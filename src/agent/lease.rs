//! Leader election by lease, the agent's shell around `control::leader::book`: it reads the
//! tunnels the lease step needs ([`TunnelReadings`]), lets the book decide, and sends the lease
//! write it returns as a compare-and-swap.

use control::leader::book::{LeaseWrite, TunnelReadings, TunnelTraffic};
use control::leader::LEASE_RENEW_MS;
use control::{Key, Node};

use super::shells::{Engine, Firewall, Kernel};
use super::Agent;

impl<N: Kernel, F: Firewall, W: Engine> Agent<N, F, W> {
    /// The lease step at `now` (Unix milliseconds): renew, take, or hand over this node's
    /// location's lease.
    pub(super) async fn tend_lease(&mut self, nodes: &[Node], now: i64) {
        let readings = self.tunnel_readings();
        let hostname = self.s.hostname.clone();
        let Some(write) = self.memo.leases.tend(&hostname, nodes, &readings, now) else {
            return;
        };
        self.write_lease(write).await;
    }

    /// Sends `write`, and says why when it was worth saying and it held.
    async fn write_lease(&self, write: LeaseWrite) {
        let LeaseWrite {
            name,
            next,
            expected,
            why,
        } = write;
        match self.backend.write_lease(&name, &next, &expected).await {
            Ok(true) => {
                if let Some(why) = why {
                    tracing::info!(lease = %name, "{why}");
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
    fn tunnel_readings(&self) -> TunnelReadings {
        let Some(t) = self.memo.topology.as_ref() else {
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

/// How often the lease step runs.
pub(super) const LEASE_PERIOD: std::time::Duration =
    std::time::Duration::from_millis(LEASE_RENEW_MS as u64);
