//! The keys' series: node key rotations and post-quantum preshared keys (see docs/keys.md).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
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
    /// `kilotun_pq_fallbacks_total`: links that dropped their key because handshakes failed
    /// under it.
    pub pq_fallbacks: Counter,
    /// `kilotun_pq_link_keyed{public_key}`: 1 when the link to the peer holds a post-quantum
    /// preshared key, 0 when it takes part and holds none.
    pub pq_link_keyed: Family<PqLinkLabel, Gauge>,
    /// `kilotun_pq_psk_changed_timestamp_seconds{public_key}`: when the link's preshared key
    /// last changed (installed or dropped).
    pub pq_psk_changed: Family<PqLinkLabel, Gauge>,
}

/// A post-quantum link's series: the peer's WireGuard public key.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PqLinkLabel {
    /// Base64.
    pub public_key: String,
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
        registry.register(
            "kilotun_pq_fallbacks",
            "Post-quantum links that dropped their key because handshakes failed under it (the ends held different keys)",
            self.pq_fallbacks.clone(),
        );
        registry.register(
            "kilotun_pq_link_keyed",
            "1 when the link to the peer holds a post-quantum preshared key, 0 when it takes part and holds none",
            self.pq_link_keyed.clone(),
        );
        registry.register(
            "kilotun_pq_psk_changed_timestamp_seconds",
            "Unix time the link's post-quantum preshared key last changed (installed or dropped)",
            self.pq_psk_changed.clone(),
        );
    }
}
