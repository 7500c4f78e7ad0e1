//! kg's Prometheus metrics: Kilo's `kilo_*` series, and per-peer dataplane series read from the
//! engine at scrape time.

use std::sync::atomic::AtomicU64;
use std::time::SystemTime;

use dataplane::{DropReason, PeerStats};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The `event` label of `kilo_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    /// `apply`, `checkin`, `local`, `run` or `cleanUp`, as in Kilo.
    pub event: String,
}

/// A peer, by public key (public keys are not secrets).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PeerLabel {
    /// Base64 public key.
    pub public_key: String,
}

/// Why the engine dropped packets.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DropLabel {
    /// The drop reason.
    pub reason: String,
}

/// Every metric kg exports.
pub struct Metrics {
    registry: Registry,
    /// `kilo_errors_total{event}`.
    pub errors: Family<EventLabel, Counter>,
    /// `kilo_leader`.
    pub leader: Gauge,
    /// `kilo_nodes` (ready nodes).
    pub nodes: Gauge,
    /// `kilo_peers` (ready Peers).
    pub peers: Gauge,
    /// `kilo_reconciles_total`.
    pub reconciles: Counter,
    /// `kilotun_dns_resolution_failures_total`.
    pub dns_failures: Counter,
    peer_rx: Family<PeerLabel, Gauge>,
    peer_tx: Family<PeerLabel, Gauge>,
    peer_handshakes: Family<PeerLabel, Gauge>,
    peer_handshake_failures: Family<PeerLabel, Gauge>,
    peer_endpoint_changes: Family<PeerLabel, Gauge>,
    peer_handshake_age: Family<PeerLabel, Gauge<f64, AtomicU64>>,
    drops: Family<DropLabel, Gauge>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every series registered.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let m = Self {
            errors: Family::default(),
            leader: Gauge::default(),
            nodes: Gauge::default(),
            peers: Gauge::default(),
            reconciles: Counter::default(),
            dns_failures: Counter::default(),
            peer_rx: Family::default(),
            peer_tx: Family::default(),
            peer_handshakes: Family::default(),
            peer_handshake_failures: Family::default(),
            peer_endpoint_changes: Family::default(),
            peer_handshake_age: Family::default(),
            drops: Family::default(),
            registry: Registry::default(),
        };
        registry.register(
            "kilo_errors",
            "Number of errors that occurred while administering the mesh",
            m.errors.clone(),
        );
        registry.register(
            "kilo_leader",
            "Leadership status of the node",
            m.leader.clone(),
        );
        registry.register("kilo_nodes", "Number of nodes in the mesh", m.nodes.clone());
        registry.register("kilo_peers", "Number of peers in the mesh", m.peers.clone());
        registry.register(
            "kilo_reconciles",
            "Number of reconciliation attempts",
            m.reconciles.clone(),
        );
        registry.register(
            "kilotun_dns_resolution_failures",
            "DNS endpoint lookups that failed",
            m.dns_failures.clone(),
        );
        registry.register(
            "kilotun_peer_receive_bytes",
            "Bytes received from the peer",
            m.peer_rx.clone(),
        );
        registry.register(
            "kilotun_peer_transmit_bytes",
            "Bytes sent to the peer",
            m.peer_tx.clone(),
        );
        registry.register(
            "kilotun_peer_handshakes",
            "Handshakes completed with the peer",
            m.peer_handshakes.clone(),
        );
        registry.register(
            "kilotun_peer_handshake_failures",
            "Failed handshakes with the peer: unanswered initiations and handshake messages that did not verify",
            m.peer_handshake_failures.clone(),
        );
        registry.register(
            "kilotun_peer_endpoint_changes",
            "Times the peer's endpoint moved to another address (roaming or reconfiguration)",
            m.peer_endpoint_changes.clone(),
        );
        registry.register(
            "kilotun_peer_last_handshake_age_seconds",
            "Seconds since the last completed handshake with the peer",
            m.peer_handshake_age.clone(),
        );
        registry.register(
            "kilotun_dropped_packets",
            "Packets the engine dropped, by reason",
            m.drops.clone(),
        );
        Self { registry, ..m }
    }

    /// Counts an error of `event`.
    pub fn error(&self, event: &str) {
        self.errors
            .get_or_create(&EventLabel {
                event: event.to_string(),
            })
            .inc();
    }

    /// The Prometheus text exposition, with dataplane series taken from `peers` and `drops`.
    pub fn render(
        &self,
        peers: &[PeerStats],
        drops: &[(DropReason, u64)],
        now: SystemTime,
    ) -> String {
        let counts = [
            &self.peer_rx,
            &self.peer_tx,
            &self.peer_handshakes,
            &self.peer_handshake_failures,
            &self.peer_endpoint_changes,
        ];
        for family in counts {
            family.clear();
        }
        self.peer_handshake_age.clear();
        for p in peers {
            let label = PeerLabel {
                public_key: p.public_key.to_base64(),
            };
            let values = [
                p.rx_bytes,
                p.tx_bytes,
                p.handshakes,
                p.handshake_failures,
                p.endpoint_changes,
            ];
            for (family, value) in counts.iter().zip(values) {
                family.get_or_create(&label).set(value as i64);
            }
            if let Some(at) = p.last_handshake {
                let age = now.duration_since(at).map_or(0.0, |d| d.as_secs_f64());
                self.peer_handshake_age.get_or_create(&label).set(age);
            }
        }
        for (reason, count) in drops {
            self.drops
                .get_or_create(&DropLabel {
                    reason: format!("{reason:?}"),
                })
                .set(*count as i64);
        }
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn kilos_series_and_peer_series_are_exported() {
        let m = Metrics::new();
        m.error("apply");
        m.reconciles.inc();
        m.leader.set(1);
        m.nodes.set(4);
        let key = dataplane::SecretKey::generate().public_key();
        let now = SystemTime::now();
        let stats = vec![PeerStats {
            public_key: key,
            endpoint: None,
            last_handshake: Some(now - Duration::from_secs(7)),
            rx_bytes: 100,
            tx_bytes: 200,
            handshakes: 3,
            handshake_failures: 2,
            endpoint_changes: 1,
        }];
        let text = m.render(&stats, &[(DropReason::ALL[0], 5)], now);
        for line in [
            "kilo_errors_total{event=\"apply\"} 1",
            "kilo_reconciles_total 1",
            "kilo_leader 1",
            "kilo_nodes 4",
            "kilo_peers 0",
            &format!(
                "kilotun_peer_transmit_bytes{{public_key=\"{}\"}} 200",
                key.to_base64()
            ),
            &format!(
                "kilotun_peer_last_handshake_age_seconds{{public_key=\"{}\"}} 7.0",
                key.to_base64()
            ),
            &format!(
                "kilotun_peer_handshake_failures{{public_key=\"{}\"}} 2",
                key.to_base64()
            ),
            &format!(
                "kilotun_peer_endpoint_changes{{public_key=\"{}\"}} 1",
                key.to_base64()
            ),
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        assert!(text.contains("kilotun_dropped_packets{reason="));
        // A peer that is gone disappears from the next scrape.
        let text = m.render(&[], &[], now);
        assert!(!text.contains(&key.to_base64()));
    }
}
