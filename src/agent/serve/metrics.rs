//! kg's Prometheus metrics: Kilo's `kilo_*` series; the WireGuard series of the
//! prometheus_wireguard_exporter Kilo's monitoring guide deploys (same names, labels and
//! meanings), read from the engine at scrape time; the engine's own `kilotun_*` series; and the
//! standard `process_*` series. Served as OpenMetrics to scrapers that ask for it and in the
//! Prometheus text format 0.0.4 otherwise.

use dataplane::{DeviceConfig, DropReason, PeerStats};
use parking_lot::Mutex;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::{Registry, Unit};

mod keys;
pub use keys::PqLinkLabel;
mod collectors;
mod process;
use collectors::{encode_one, LocationCollector, WireGuardCollector};
pub use process::ProcessCollector;

/// The `event` values of `kilo_errors_total` kg counts, each exported from the start (at 0) so
/// that rates and alerts over it have a series before the first error. kg counts a failed
/// reconcile (WireGuard, the link, its own Node's annotations) and a failed iptables update as
/// `apply`.
pub const ERROR_EVENTS: [&str; 1] = ["apply"];

/// The `event` label of `kilo_errors_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EventLabel {
    /// `apply`, `checkin`, `local`, `run` or `cleanUp`, as in Kilo.
    pub event: String,
}

/// The `result` label of `kilotun_api_events_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `posted`, `repeated`, `failed` or `dropped`.
    pub result: &'static str,
}

/// The `method` label of `kilotun_wireguard_allowed_ips_updates_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabel {
    /// `edit` (entry by entry) or `replace` (the whole list).
    pub method: &'static str,
}

/// The `stage` label of `kilotun_reconcile_stage_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabel {
    /// One of `translate`, `host`, `leases`, `topology`, `routes`, `engine`, `firewall`.
    pub stage: &'static str,
}

/// A family of histograms whose buckets span 0.1 ms to 3.3 s, doubling.
type StageHistograms = Family<StageLabel, Histogram, fn() -> Histogram>;

fn stage_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0001, 2.0, 16))
}

/// The `location` label of the `kilotun_location` info metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LocationLabel {
    /// The node's segment as the topology names it (`node:<name>` when it has no location,
    /// `location:<name>#share:<n>` or `location:<name>#<leader>` for a share of a location with
    /// several leaders).
    pub location: String,
}

/// An exposition format, chosen from the scraper's `Accept` header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0.0: counter families named without `_total`, `# UNIT`, `# EOF`.
    OpenMetrics,
    /// The Prometheus text format 0.0.4: counter families named with `_total`.
    Text,
}

impl Format {
    /// OpenMetrics 1.0.0 when `accept` prefers it to plain text (as Prometheus does), else the
    /// 0.0.4 text format, which is also the answer to no `Accept` at all.
    pub fn negotiate(accept: Option<&str>) -> Self {
        let (mut openmetrics, mut text) = (0.0f32, 0.0f32);
        for range in accept.unwrap_or("").split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let (mut q, mut version) = (1.0f32, None);
            for param in parts {
                if let Some((key, value)) = param.split_once('=') {
                    let value = value.trim().trim_matches('"');
                    match key.trim().to_ascii_lowercase().as_str() {
                        "q" => q = value.parse().unwrap_or(0.0),
                        "version" => version = Some(value.to_string()),
                        _ => {}
                    }
                }
            }
            match media.as_str() {
                "application/openmetrics-text"
                    if version.as_deref().is_none_or(|v| v == "1.0.0") =>
                {
                    openmetrics = openmetrics.max(q)
                }
                "text/plain" if version.as_deref().is_none_or(|v| v == "0.0.4") => {
                    text = text.max(q)
                }
                "text/*" | "*/*" => text = text.max(q),
                _ => {}
            }
        }
        if openmetrics > 0.0 && openmetrics >= text {
            Self::OpenMetrics
        } else {
            Self::Text
        }
    }

    /// The `Content-Type` of a body in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Self::Text => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// Encodes `registry` in `format`.
pub fn encode_registry(registry: &Registry, format: Format) -> String {
    let mut out = String::new();
    encode(&mut out, registry).expect("writing to a String");
    match format {
        Format::OpenMetrics => out,
        Format::Text => openmetrics_to_text(&out),
    }
}

/// Rewrites an OpenMetrics body as the 0.0.4 text format: counter families take their samples'
/// `_total` name, `unknown` becomes `untyped`, `info` a gauge named `_info`, and the `# UNIT` and
/// `# EOF` lines (which 0.0.4 does not have) go.
fn openmetrics_to_text(openmetrics: &str) -> String {
    let types: Vec<(&str, &str)> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE ")?.split_once(' '))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let metadata = ["# HELP ", "# TYPE "].into_iter().find_map(|prefix| {
            let (name, rest) = line.strip_prefix(prefix)?.split_once(' ')?;
            let rest = match (prefix, rest) {
                ("# TYPE ", "unknown") => "untyped",
                ("# TYPE ", "info") => "gauge",
                _ => rest,
            };
            let suffix = match types.iter().find(|(n, _)| *n == name) {
                Some((_, "counter")) => "_total",
                Some((_, "info")) => "_info",
                _ => "",
            };
            Some(format!("{prefix}{name}{suffix} {rest}"))
        });
        match metadata {
            Some(line) => out.push_str(&line),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// What the WireGuard device reported for one scrape.
#[derive(Clone, Debug, Default)]
pub struct WireGuardScrape {
    interface: String,
    implementation: &'static str,
    peers: Vec<(PeerStats, String)>,
    engine: Option<Vec<(DropReason, u64)>>,
}

impl WireGuardScrape {
    /// The live state of `interface`: its peers' counters and their allowed IPs from `config`
    /// (only the allowed IPs are kept, never a key). `engine` holds the engine's drop counters
    /// when the device is kg's own engine; `None` for a device over UAPI, whose per-peer
    /// handshake, failure and roaming counts are unknown and so not exported. `implementation`
    /// names the WireGuard (`embedded`, `kernel`, `uapi`).
    pub fn new(
        interface: &str,
        implementation: &'static str,
        config: &DeviceConfig,
        peers: Vec<PeerStats>,
        engine: Option<Vec<(DropReason, u64)>>,
    ) -> Self {
        let peers = peers
            .into_iter()
            .map(|p| {
                let allowed_ips = config
                    .peer(&p.public_key)
                    .map(|c| {
                        c.allowed_ips
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join(",")
                    })
                    .unwrap_or_default();
                (p, allowed_ips)
            })
            .collect();
        Self {
            interface: interface.to_string(),
            implementation,
            peers,
            engine,
        }
    }
}

/// Every metric kg exports.
pub struct Metrics {
    registry: Registry,
    wireguard: std::sync::Arc<WireGuardCollector>,
    /// One scrape at a time: the WireGuard collector holds the scrape being encoded.
    rendering: Mutex<()>,
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
    /// `kilotun_endpoint_changes_total`: peers kg moved to another of their endpoint
    /// candidates.
    pub endpoint_changes: Counter,
    /// `kilotun_wireguard_configurations_total`: configurations applied that changed the
    /// WireGuard device.
    pub device_changes: Counter,
    /// `kilotun_wireguard_allowed_ips_updates_total{method}`: peers whose allowed IPs kg
    /// changed on a device it configures over UAPI or netlink, entry by entry (`edit`) or whole
    /// (`replace`).
    pub allowed_ips_updates: Family<MethodLabel, Counter>,
    /// `kilotun_api_peer_status_writes_total`: Peer statuses this node wrote to the API server.
    pub peer_status_writes: Counter,
    /// `kilotun_route_changes_total`: batches of route and rule changes kg applied to the
    /// kernel (a pass that finds the kernel as planned adds nothing).
    pub route_changes: Counter,
    /// `kilotun_api_events_total{result}`: Kubernetes Events kg wrote (`posted`, `repeated`:
    /// a series' count), could not write (`failed`) or left out (`dropped`: beyond its budget or
    /// queue).
    pub api_events: Family<ResultLabel, Counter>,
    /// The keys' series: rotations and post-quantum preshared keys.
    pub keys: keys::KeyMetrics,
    /// `kilotun_withheld_cidrs`: CIDRs not routed on this node because they contain or equal
    /// one of its connected networks.
    pub withheld_cidrs: Gauge,
    /// `kilotun_reconcile_stage_seconds{stage}`: each stage's time in the reconciles that
    /// computed a topology.
    pub stages: StageHistograms,
    /// The node's location, for the `kilotun_location` info metric.
    location: std::sync::Arc<LocationCollector>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every series registered, and `kilo_errors_total` at 0 for each of
    /// [`ERROR_EVENTS`].
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let errors = Family::<EventLabel, Counter>::default();
        for event in ERROR_EVENTS {
            errors
                .get_or_create(&EventLabel {
                    event: event.to_string(),
                })
                .inc_by(0);
        }
        let m = Self {
            errors,
            leader: Gauge::default(),
            nodes: Gauge::default(),
            peers: Gauge::default(),
            reconciles: Counter::default(),
            dns_failures: Counter::default(),
            endpoint_changes: Counter::default(),
            device_changes: Counter::default(),
            allowed_ips_updates: Family::default(),
            peer_status_writes: Counter::default(),
            route_changes: Counter::default(),
            api_events: Family::default(),
            keys: Default::default(),
            withheld_cidrs: Gauge::default(),
            stages: StageHistograms::new_with_constructor(stage_histogram),
            location: Default::default(),
            wireguard: Default::default(),
            rendering: Mutex::new(()),
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
            "kilotun_endpoint_changes",
            "Peers moved to another of their endpoint candidates",
            m.endpoint_changes.clone(),
        );
        registry.register(
            "kilotun_wireguard_configurations",
            "WireGuard device configurations kg applied that changed the device",
            m.device_changes.clone(),
        );
        registry.register(
            "kilotun_wireguard_allowed_ips_updates",
            "Peers whose allowed IPs kg changed on a WireGuard device it configures over UAPI or netlink, by method: edit (entry by entry) or replace (the whole list)",
            m.allowed_ips_updates.clone(),
        );
        registry.register(
            "kilotun_api_peer_status_writes",
            "Peer statuses this node wrote to the API server (the first segment's leader only)",
            m.peer_status_writes.clone(),
        );
        registry.register(
            "kilotun_route_changes",
            "Batches of route and rule changes kg applied to the kernel",
            m.route_changes.clone(),
        );
        registry.register(
            "kilotun_api_events",
            "Kubernetes Events kg wrote, could not write or left out, by result",
            m.api_events.clone(),
        );
        m.keys.register(&mut registry);
        registry.register(
            "kilotun_withheld_cidrs",
            "CIDRs not routed into the mesh on this node because they contain or equal one of its directly connected networks",
            m.withheld_cidrs.clone(),
        );
        registry.register_with_unit(
            "kilotun_reconcile_stage",
            "Time spent in each stage of the reconciles that computed a topology (translate, host, leases, topology, routes, engine, firewall), counted where the stage ran",
            Unit::Seconds,
            m.stages.clone(),
        );
        registry.register_collector(Box::new(std::sync::Arc::clone(&m.location)));
        registry.register_collector(Box::new(std::sync::Arc::clone(&m.wireguard)));
        registry.register_collector(Box::new(ProcessCollector));
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

    /// Counts `n` Kubernetes Event writes that ended as `result`.
    pub fn count_api_events(&self, result: &'static str, n: u64) {
        self.api_events
            .get_or_create(&ResultLabel { result })
            .inc_by(n);
    }

    /// Counts what a device was sent for peers whose allowed IPs changed.
    pub fn count_allowed_ips_updates(&self, edited: u64, replaced: u64) {
        for (method, n) in [("edit", edited), ("replace", replaced)] {
            if n > 0 {
                self.allowed_ips_updates
                    .get_or_create(&MethodLabel { method })
                    .inc_by(n);
            }
        }
    }

    /// Exports `relists`, the backend's count of full Node lists after the first, as
    /// `kilotun_api_node_relists_total`.
    pub fn register_node_relists(&mut self, relists: Counter) {
        self.registry.register(
            "kilotun_api_node_relists",
            "Full lists of Nodes after the first: the Node watch started again from nothing (its resourceVersion expired)",
            relists,
        );
    }

    /// Records `seconds` spent in reconcile stage `stage`.
    pub fn observe_stage(&self, stage: &'static str, seconds: f64) {
        self.stages
            .get_or_create(&StageLabel { stage })
            .observe(seconds);
    }

    /// Sets `kilo_leader` and the node's location.
    pub fn set_leader(&self, leader: bool, location: &str) {
        self.leader.set(i64::from(leader));
        *self.location.0.lock() = Some(location.to_string());
    }

    /// The exposition in `format`, with the WireGuard series taken from `wireguard` (none when
    /// the device could not be read).
    pub fn render(&self, wireguard: Option<WireGuardScrape>, format: Format) -> String {
        let _one_at_a_time = self.rendering.lock();
        *self.wireguard.scrape.lock() = wireguard;
        let out = encode_registry(&self.registry, format);
        *self.wireguard.scrape.lock() = None;
        out
    }
}

#[cfg(test)]
mod tests;

impl crate::backend::kube::events::EventCounts for Metrics {
    fn count(&self, result: &'static str) {
        self.count_api_events(result, 1);
    }
}
