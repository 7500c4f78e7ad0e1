//! The collectors read at scrape time: the node's location, and the per-peer and drop series
//! of the WireGuard device (the exporter's names and labels, and kilotun's own).

use std::time::UNIX_EPOCH;

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Unit;

use super::{LocationLabel, WireGuardScrape};

/// The labels of the exporter-compatible per-peer series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WireGuardPeerLabels {
    interface: String,
    public_key: String,
    allowed_ips: String,
}

/// The labels of kilotun's per-peer series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabels {
    interface: String,
    public_key: String,
}

/// The labels of `kilotun_wireguard_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ImplementationLabels {
    interface: String,
    implementation: String,
}

/// The labels of `kilotun_dropped_packets_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DropLabels {
    interface: String,
    reason: String,
}

/// `kilotun_location_info{location}`: an OpenMetrics info metric (a gauge named `_info` in the
/// 0.0.4 format), once the node has a location.
#[derive(Debug, Default)]
pub(super) struct LocationCollector(pub(super) Mutex<Option<String>>);

impl Collector for LocationCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(location) = self.0.lock().clone() else {
            return Ok(());
        };
        encode_one(
            &mut encoder,
            "kilotun_location",
            "The location (topology segment) of the node, as Kilo's topology names it.",
            None,
            &Info::new(LocationLabel { location }),
        )
    }
}

/// Encodes one metric (usually a family built for this scrape) under `name`.
pub(super) fn encode_one(
    encoder: &mut DescriptorEncoder,
    name: &'static str,
    help: &str,
    unit: Option<&'static Unit>,
    metric: &impl EncodeMetric,
) -> std::fmt::Result {
    let metric_encoder = encoder.encode_descriptor(name, help, unit, metric.metric_type())?;
    metric.encode(metric_encoder)
}

/// The per-peer and drop series of the scrape being encoded.
#[derive(Debug, Default)]
pub(super) struct WireGuardCollector {
    pub(super) scrape: Mutex<Option<WireGuardScrape>>,
}

impl Collector for WireGuardCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let scrape = self.scrape.lock();
        let Some(scrape) = scrape.as_ref() else {
            return Ok(());
        };
        encode_one(
            &mut encoder,
            "kilotun_wireguard",
            "The WireGuard kg drives: embedded (the engine inside kg), kernel (the kernel's module) or uapi (another process's device).",
            None,
            &Info::new(ImplementationLabels {
                interface: scrape.interface.clone(),
                implementation: scrape.implementation.to_string(),
            }),
        )?;
        let sent = Family::<WireGuardPeerLabels, Counter>::default();
        let received = Family::<WireGuardPeerLabels, Counter>::default();
        let latest = Family::<WireGuardPeerLabels, Gauge>::default();
        let handshakes = Family::<PeerLabels, Counter>::default();
        let failures = Family::<PeerLabels, Counter>::default();
        let roams = Family::<PeerLabels, Counter>::default();
        let unanswered = Family::<PeerLabels, Gauge>::default();
        for (p, allowed_ips) in &scrape.peers {
            let public_key = p.public_key.to_base64();
            let exporter = WireGuardPeerLabels {
                interface: scrape.interface.clone(),
                public_key: public_key.clone(),
                allowed_ips: allowed_ips.clone(),
            };
            sent.get_or_create(&exporter).inc_by(p.tx_bytes);
            received.get_or_create(&exporter).inc_by(p.rx_bytes);
            let at = unix_secs(p.last_handshake);
            latest.get_or_create(&exporter).set(at);
            let own = PeerLabels {
                interface: scrape.interface.clone(),
                public_key,
            };
            handshakes.get_or_create(&own).inc_by(p.handshakes);
            failures.get_or_create(&own).inc_by(p.handshake_failures);
            roams.get_or_create(&own).inc_by(p.endpoint_changes);
            let since = unix_secs(p.unanswered_since);
            unanswered.get_or_create(&own).set(since);
        }
        if !scrape.peers.is_empty() {
            encode_one(
                &mut encoder,
                "wireguard_sent",
                "Bytes sent to the peer.",
                Some(&Unit::Bytes),
                &sent,
            )?;
            encode_one(
                &mut encoder,
                "wireguard_received",
                "Bytes received from the peer.",
                Some(&Unit::Bytes),
                &received,
            )?;
            encode_one(
                &mut encoder,
                "wireguard_latest_handshake",
                "Unix time of the latest handshake with the peer, 0 when there was none.",
                Some(&Unit::Seconds),
                &latest,
            )?;
        }
        let Some(drops) = &scrape.engine else {
            return Ok(());
        };
        if !scrape.peers.is_empty() {
            encode_one(
                &mut encoder,
                "kilotun_peer_handshakes",
                "Handshakes completed with the peer.",
                None,
                &handshakes,
            )?;
            encode_one(
                &mut encoder,
                "kilotun_peer_handshake_failures",
                "Failed handshakes with the peer: unanswered initiations and handshake messages that did not verify.",
                None,
                &failures,
            )?;
            encode_one(
                &mut encoder,
                "kilotun_peer_endpoint_changes",
                "Times the peer's endpoint moved to another address (roaming or reconfiguration).",
                None,
                &roams,
            )?;
            encode_one(
                &mut encoder,
                "kilotun_peer_unanswered_since",
                "Unix time of the oldest data packet or handshake initiation sent to the peer that nothing has answered since, 0 while nothing awaits an answer; traffic unanswered for 15 s or more is failing (a firewall or NAT dropping WireGuard's UDP, or the peer down).",
                Some(&Unit::Seconds),
                &unanswered,
            )?;
        }
        if !drops.is_empty() {
            let family = Family::<DropLabels, Counter>::default();
            for (reason, count) in drops {
                family
                    .get_or_create(&DropLabels {
                        interface: scrape.interface.clone(),
                        reason: reason.name().to_string(),
                    })
                    .inc_by(*count);
            }
            encode_one(
                &mut encoder,
                "kilotun_dropped_packets",
                "Packets the engine dropped, by reason.",
                None,
                &family,
            )?;
        }
        Ok(())
    }
}

/// `at` in whole seconds since the Unix epoch; 0 for never (or before 1970).
fn unix_secs(at: Option<std::time::SystemTime>) -> i64 {
    at.and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs() as i64)
}
