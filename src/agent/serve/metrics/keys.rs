//! The keys' series: node key rotations and post-quantum preshared keys (see docs/keys.md).

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Key rotations and post-quantum preshared keys.
#[derive(Debug, Default)]
pub struct KeyMetrics {
    /// `kilotun_key_rotations_total`: times this kg switched to a new WireGuard key.
    pub key_rotations: Counter,
    /// `kilotun_pq_psk_changes_total`: post-quantum preshared keys put into the device.
    pub pq_psk_changes: Counter,
    /// `kilotun_pq_refused_total`: exchange datagrams refused (malformed, tag, stranger).
    pub pq_refused: Counter,
    /// `kilotun_pq_links_keyed`: links that hold a post-quantum preshared key.
    pub pq_links_keyed: Gauge,
}

impl KeyMetrics {
    /// Registers every series in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "kilotun_key_rotations",
            "Times this kg switched to a new WireGuard key (kgctl rotate-key, --key-rotation-period)",
            self.key_rotations.clone(),
        );
        registry.register(
            "kilotun_pq_psk_changes",
            "Post-quantum preshared keys this kg put into the WireGuard device (--post-quantum)",
            self.pq_psk_changes.clone(),
        );
        registry.register(
            "kilotun_pq_refused",
            "Post-quantum exchange datagrams refused: malformed, badly tagged, or from no peer",
            self.pq_refused.clone(),
        );
        registry.register(
            "kilotun_pq_links_keyed",
            "WireGuard links that hold a post-quantum preshared key",
            self.pq_links_keyed.clone(),
        );
    }
}
