//! kg's Prometheus metrics: Kilo's `kilo_*` series; the WireGuard series of the
//! prometheus_wireguard_exporter Kilo's monitoring guide deploys (same names, labels and
//! meanings), read from the engine at scrape time; the engine's own `kilotun_*` series; and the
//! standard `process_*` series. Served as OpenMetrics to scrapers that ask for it and in the
//! Prometheus text format 0.0.4 otherwise.

use std::time::UNIX_EPOCH;

use dataplane::{DeviceConfig, DropReason, PeerStats};
use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::{Registry, Unit};

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

/// The `location` label of the `kilotun_location` info metric.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LocationLabel {
    /// The node's location as Kilo's topology names it (`node:<name>` when it has none).
    pub location: String,
}

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

/// The labels of `kilotun_dropped_packets_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DropLabels {
    interface: String,
    reason: String,
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
    peers: Vec<(PeerStats, String)>,
    engine: Option<Vec<(DropReason, u64)>>,
}

impl WireGuardScrape {
    /// The live state of `interface`: its peers' counters and their allowed IPs from `config`
    /// (only the allowed IPs are kept, never a key). `engine` holds the engine's drop counters
    /// when the device is kg's own engine; `None` for a device over UAPI, whose per-peer
    /// handshake, failure and roaming counts are unknown and so not exported.
    pub fn new(
        interface: &str,
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
            peers,
            engine,
        }
    }
}

/// `kilotun_location_info{location}`: an OpenMetrics info metric (a gauge named `_info` in the
/// 0.0.4 format), once the node has a location.
#[derive(Debug, Default)]
struct LocationCollector(Mutex<Option<String>>);

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
fn encode_one(
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
struct WireGuardCollector {
    scrape: Mutex<Option<WireGuardScrape>>,
}

impl Collector for WireGuardCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let scrape = self.scrape.lock();
        let Some(scrape) = scrape.as_ref() else {
            return Ok(());
        };
        let sent = Family::<WireGuardPeerLabels, Counter>::default();
        let received = Family::<WireGuardPeerLabels, Counter>::default();
        let latest = Family::<WireGuardPeerLabels, Gauge>::default();
        let handshakes = Family::<PeerLabels, Counter>::default();
        let failures = Family::<PeerLabels, Counter>::default();
        let roams = Family::<PeerLabels, Counter>::default();
        for (p, allowed_ips) in &scrape.peers {
            let public_key = p.public_key.to_base64();
            let exporter = WireGuardPeerLabels {
                interface: scrape.interface.clone(),
                public_key: public_key.clone(),
                allowed_ips: allowed_ips.clone(),
            };
            sent.get_or_create(&exporter).inc_by(p.tx_bytes);
            received.get_or_create(&exporter).inc_by(p.rx_bytes);
            let at = p
                .last_handshake
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_secs() as i64);
            latest.get_or_create(&exporter).set(at);
            let own = PeerLabels {
                interface: scrape.interface.clone(),
                public_key,
            };
            handshakes.get_or_create(&own).inc_by(p.handshakes);
            failures.get_or_create(&own).inc_by(p.handshake_failures);
            roams.get_or_create(&own).inc_by(p.endpoint_changes);
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

/// The standard `process_*` series of this process, read from `/proc` at each scrape.
#[derive(Debug, Default)]
pub struct ProcessCollector;

/// This process's figures from `/proc`.
#[derive(Debug, Default, PartialEq)]
struct ProcessStats {
    cpu_seconds: f64,
    start_time_seconds: f64,
    virtual_memory_bytes: u64,
    resident_memory_bytes: u64,
    open_fds: u64,
    max_fds: u64,
}

/// Parses `/proc/self/stat` (fields after the parenthesised command name, which may contain
/// spaces) with the boot time from `/proc/stat`.
fn parse_stat(stat: &str, boot_time: u64, ticks: f64, page_size: u64) -> Option<ProcessStats> {
    let after_comm = &stat[stat.rfind(')')? + 1..];
    // Field 3 (state) is index 0 here: utime is field 14, stime 15, starttime 22, vsize 23,
    // rss 24 (proc(5)).
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let field = |n: usize| -> Option<u64> { fields.get(n - 3)?.parse().ok() };
    Some(ProcessStats {
        cpu_seconds: (field(14)? + field(15)?) as f64 / ticks,
        start_time_seconds: boot_time as f64 + field(22)? as f64 / ticks,
        virtual_memory_bytes: field(23)?,
        resident_memory_bytes: field(24)? * page_size,
        open_fds: 0,
        max_fds: 0,
    })
}

impl ProcessStats {
    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot_time = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
        // SAFETY: sysconf and getrlimit only read process-wide settings into local values.
        let (ticks, page_size, limit) = unsafe {
            let mut limit: libc::rlimit = std::mem::zeroed();
            let got = libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
            (
                libc::sysconf(libc::_SC_CLK_TCK),
                libc::sysconf(libc::_SC_PAGESIZE),
                (got == 0).then_some(limit.rlim_cur),
            )
        };
        if ticks <= 0 || page_size <= 0 {
            return None;
        }
        let mut stats = parse_stat(&stat, boot_time, ticks as f64, page_size as u64)?;
        stats.open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
        stats.max_fds = limit.unwrap_or(0);
        Some(stats)
    }
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(s) = ProcessStats::read() else {
            return Ok(());
        };
        encode_one(
            &mut encoder,
            "process_cpu",
            "Total user and system CPU time spent in seconds.",
            Some(&Unit::Seconds),
            &ConstCounter::new(s.cpu_seconds),
        )?;
        encode_one(
            &mut encoder,
            "process_open_fds",
            "Number of open file descriptors.",
            None,
            &ConstGauge::new(s.open_fds as i64),
        )?;
        encode_one(
            &mut encoder,
            "process_max_fds",
            "Maximum number of open file descriptors.",
            None,
            &ConstGauge::new(s.max_fds as i64),
        )?;
        encode_one(
            &mut encoder,
            "process_virtual_memory",
            "Virtual memory size in bytes.",
            Some(&Unit::Bytes),
            &ConstGauge::new(s.virtual_memory_bytes as i64),
        )?;
        encode_one(
            &mut encoder,
            "process_resident_memory",
            "Resident memory size in bytes.",
            Some(&Unit::Bytes),
            &ConstGauge::new(s.resident_memory_bytes as i64),
        )?;
        encode_one(
            &mut encoder,
            "process_start_time",
            "Start time of the process since the Unix epoch in seconds.",
            Some(&Unit::Seconds),
            &ConstGauge::new(s.start_time_seconds),
        )
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
    /// `kilotun_withheld_cidrs`: CIDRs not routed on this node because they contain or equal
    /// one of its connected networks.
    pub withheld_cidrs: Gauge,
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
            withheld_cidrs: Gauge::default(),
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
            "kilotun_withheld_cidrs",
            "CIDRs not routed into the mesh on this node because they contain or equal one of its directly connected networks",
            m.withheld_cidrs.clone(),
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
mod tests {
    use super::*;
    use dataplane::PeerConfig;
    use std::time::{Duration, SystemTime};

    const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

    /// One peer with two allowed IPs that handshook at `at`, and every drop reason.
    fn scrape(key: dataplane::PublicKey, at: Option<SystemTime>) -> WireGuardScrape {
        let mut peer = PeerConfig::new(key);
        peer.allowed_ips = vec![
            "10.4.0.2/32".parse().unwrap(),
            "10.2.1.0/24".parse().unwrap(),
        ];
        let config = DeviceConfig {
            peers: vec![peer],
            ..Default::default()
        };
        let stats = PeerStats {
            public_key: key,
            endpoint: None,
            last_handshake: at,
            rx_bytes: 100,
            tx_bytes: 200,
            handshakes: 3,
            handshake_failures: 2,
            endpoint_changes: 1,
        };
        let drops = DropReason::ALL
            .iter()
            .enumerate()
            .map(|(i, r)| (*r, i as u64))
            .collect();
        WireGuardScrape::new("kilo0", &config, vec![stats], Some(drops))
    }

    #[test]
    fn kilos_exporters_engines_and_process_series_are_exported() {
        let m = Metrics::new();
        let fresh = m.render(None, Format::Text);
        assert!(
            fresh.contains("kilo_errors_total{event=\"apply\"} 0\n"),
            "no error series before the first error:\n{fresh}"
        );
        m.error("apply");
        m.reconciles.inc();
        m.set_leader(true, "east");
        m.nodes.set(4);
        let key = dataplane::SecretKey::generate().public_key();
        let b64 = key.to_base64();
        let at = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let exporter = format!(
            "{{interface=\"kilo0\",public_key=\"{b64}\",allowed_ips=\"10.4.0.2/32,10.2.1.0/24\"}}"
        );
        let own = format!("{{interface=\"kilo0\",public_key=\"{b64}\"}}");
        for format in [Format::Text, Format::OpenMetrics] {
            let text = m.render(Some(scrape(key, Some(at))), format);
            for line in [
                "kilo_errors_total{event=\"apply\"} 1".to_string(),
                "kilo_reconciles_total 1".into(),
                "kilo_leader 1".into(),
                "kilo_nodes 4".into(),
                "kilo_peers 0".into(),
                "kilotun_location_info{location=\"east\"} 1".into(),
                "kilotun_dns_resolution_failures_total 0".into(),
                "kilotun_withheld_cidrs 0".into(),
                format!("wireguard_sent_bytes_total{exporter} 200"),
                format!("wireguard_received_bytes_total{exporter} 100"),
                format!("wireguard_latest_handshake_seconds{exporter} 1700000000"),
                format!("kilotun_peer_handshakes_total{own} 3"),
                format!("kilotun_peer_handshake_failures_total{own} 2"),
                format!("kilotun_peer_endpoint_changes_total{own} 1"),
                "kilotun_dropped_packets_total{interface=\"kilo0\",reason=\"not_ip\"} 0".into(),
                "kilotun_dropped_packets_total{interface=\"kilo0\",reason=\"no_route\"} 1".into(),
            ] {
                assert!(
                    text.contains(&line),
                    "{format:?}: {line} missing from\n{text}"
                );
            }
            for name in [
                "process_cpu_seconds_total ",
                "process_resident_memory_bytes ",
                "process_virtual_memory_bytes ",
                "process_open_fds ",
                "process_max_fds ",
                "process_start_time_seconds ",
            ] {
                assert!(
                    text.lines().any(|l| l.starts_with(name)),
                    "{format:?}: {name} missing from\n{text}"
                );
            }
        }
        // A peer that never handshook reads 0, as the exporter reports it.
        let text = m.render(Some(scrape(key, None)), Format::Text);
        assert!(text.contains(&format!("wireguard_latest_handshake_seconds{exporter} 0\n")));
        // A peer that is gone disappears from the next scrape; so does a moved location.
        m.set_leader(false, "west");
        let text = m.render(None, Format::Text);
        assert!(!text.contains(&b64), "{text}");
        assert!(!text.contains("location=\"east\""), "{text}");
        assert!(text.contains("kilotun_location_info{location=\"west\"} 1"));
        assert!(text.contains("kilo_leader 0"));
    }

    #[test]
    fn a_device_over_uapi_exports_only_what_wg_show_reports() {
        let m = Metrics::new();
        let key = dataplane::SecretKey::generate().public_key();
        let mut uapi = scrape(key, None);
        uapi.engine = None;
        let text = m.render(Some(uapi), Format::Text);
        assert!(text.contains("wireguard_sent_bytes_total{"), "{text}");
        assert!(
            text.contains("wireguard_latest_handshake_seconds{"),
            "{text}"
        );
        assert!(!text.contains("kilotun_peer_"), "{text}");
        assert!(!text.contains("kilotun_dropped_packets"), "{text}");
    }

    #[test]
    fn each_format_follows_its_own_rules() {
        let m = Metrics::new();
        m.set_leader(true, "east");
        let key = dataplane::SecretKey::generate().public_key();
        let om = m.render(
            Some(scrape(key, Some(SystemTime::now()))),
            Format::OpenMetrics,
        );
        let text = m.render(Some(scrape(key, Some(SystemTime::now()))), Format::Text);
        // OpenMetrics: counter families are named without `_total`, their samples with it; a
        // unit is declared and ends the family name; the body ends with `# EOF`.
        assert!(om.ends_with("# EOF\n"), "{om}");
        assert!(
            om.contains(
                "# TYPE kilotun_location info\nkilotun_location_info{location=\"east\"} 1\n"
            ),
            "{om}"
        );
        assert!(
            text.contains(
                "# TYPE kilotun_location_info gauge\nkilotun_location_info{location=\"east\"} 1\n"
            ),
            "{text}"
        );
        assert!(om.contains("# TYPE kilo_errors counter\n"), "{om}");
        assert!(
            om.contains("# TYPE process_cpu_seconds counter\n# UNIT process_cpu_seconds seconds\n"),
            "{om}"
        );
        assert!(om.contains("# TYPE wireguard_latest_handshake_seconds gauge\n# UNIT wireguard_latest_handshake_seconds seconds\n"), "{om}");
        // 0.0.4: the family is named as its samples; no UNIT, no EOF.
        assert!(text.contains("# HELP kilo_errors_total "), "{text}");
        assert!(
            text.contains("# TYPE kilo_errors_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE wireguard_sent_bytes_total counter\n"),
            "{text}"
        );
        assert!(
            !text.contains("# EOF") && !text.contains("# UNIT"),
            "{text}"
        );
        // In both, every sample belongs to the family declared last, by the format's naming.
        for (format, body) in [(Format::OpenMetrics, &om), (Format::Text, &text)] {
            let mut family: Option<(String, String)> = None;
            let mut samples = 0;
            for line in body.lines() {
                if let Some(rest) = line.strip_prefix("# TYPE ") {
                    let (name, kind) = rest.split_once(' ').unwrap();
                    family = Some((name.to_string(), kind.to_string()));
                    continue;
                }
                if let Some(rest) = line.strip_prefix("# HELP ") {
                    assert!(!rest.contains('\\') && !rest.contains('"'), "{line}");
                }
                if line.starts_with('#') {
                    continue;
                }
                let (family_name, kind) = family.as_ref().expect("a sample before any TYPE");
                let name = line.split(['{', ' ']).next().unwrap();
                let expected = match (format, kind.as_str()) {
                    (Format::OpenMetrics, "counter") => format!("{family_name}_total"),
                    (Format::OpenMetrics, "info") => format!("{family_name}_info"),
                    _ => family_name.clone(),
                };
                assert_eq!(name, expected, "{format:?}: {line}");
                if kind == "counter" {
                    assert!(name.ends_with("_total"), "{line}");
                }
                samples += 1;
            }
            assert!(samples > 20, "{body}");
        }
        // promtool (Debian's prometheus package) lints the 0.0.4 format; it cannot read
        // OpenMetrics, whose counters Prometheus's own scrapes check in tests/prometheus.rs.
        if std::process::Command::new("promtool")
            .arg("--version")
            .output()
            .is_err()
        {
            eprintln!("skipping the promtool check: promtool is not installed (apt-get install prometheus)");
            return;
        }
        use std::io::Write;
        let mut child = std::process::Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool check metrics: {}{}\n{text}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn the_format_follows_the_accept_header() {
        for (accept, format) in [
            (None, Format::Text),
            (Some(""), Format::Text),
            (Some(PROMETHEUS_ACCEPT), Format::OpenMetrics),
            (
                Some("application/openmetrics-text; version=1.0.0"),
                Format::OpenMetrics,
            ),
            (Some("application/openmetrics-text"), Format::OpenMetrics),
            (
                Some("application/openmetrics-text;version=0.0.1"),
                Format::Text,
            ),
            (Some("text/plain;version=0.0.4"), Format::Text),
            (Some("*/*"), Format::Text),
            (
                Some("text/plain, application/openmetrics-text;q=0.5"),
                Format::Text,
            ),
            (
                Some("text/plain;q=0.2, application/openmetrics-text;q=0.5"),
                Format::OpenMetrics,
            ),
            (Some("application/openmetrics-text;q=0"), Format::Text),
            (Some("application/json"), Format::Text),
        ] {
            assert_eq!(Format::negotiate(accept), format, "{accept:?}");
        }
        assert!(Format::OpenMetrics
            .content_type()
            .starts_with("application/openmetrics-text; version=1.0.0"));
        assert!(Format::Text
            .content_type()
            .starts_with("text/plain; version=0.0.4"));
    }

    #[test]
    fn proc_stat_is_parsed_past_a_command_with_spaces() {
        let stat = "4242 (kg (a b)) S 1 4242 4242 0 -1 4194560 1000 0 0 0 250 150 0 0 20 0 9 0 5000 123456789 300 18446744073709551615 0";
        let s = parse_stat(stat, 1_000_000, 100.0, 4096).unwrap();
        assert_eq!(s.cpu_seconds, 4.0);
        assert_eq!(s.start_time_seconds, 1_000_050.0);
        assert_eq!(s.virtual_memory_bytes, 123_456_789);
        assert_eq!(s.resident_memory_bytes, 300 * 4096);
        assert!(parse_stat("4242 (kg) S 1", 0, 100.0, 4096).is_none());
        let live = ProcessStats::read().unwrap();
        assert!(live.resident_memory_bytes > 0 && live.open_fds > 0 && live.max_fds > 0);
        assert!(live.start_time_seconds > 1_600_000_000.0, "{live:?}");
    }
}
