//! Tests of kg's metrics: names, labels and values as Prometheus reads them.

use super::*;
use dataplane::PeerConfig;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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
        unanswered_since: at.map(|t| t + Duration::from_secs(60)),
        rx_bytes: 100,
        tx_bytes: 200,
        handshakes: 3,
        handshake_failures: 2,
        endpoint_changes: 1,
        refused_responses: 0,
        unused_answers: 0,
    };
    let drops = DropReason::ALL
        .iter()
        .enumerate()
        .map(|(i, r)| (*r, i as u64))
        .collect();
    WireGuardScrape::new("kilo0", "embedded", &config, vec![stats], Some(drops))
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
            "kilotun_wireguard_configurations_total 0".into(),
            "kilotun_route_changes_total 0".into(),
            "kilotun_withheld_cidrs 0".into(),
            format!("wireguard_sent_bytes_total{exporter} 200"),
            format!("wireguard_received_bytes_total{exporter} 100"),
            format!("wireguard_latest_handshake_seconds{exporter} 1700000000"),
            format!("kilotun_peer_handshakes_total{own} 3"),
            format!("kilotun_peer_handshake_failures_total{own} 2"),
            format!("kilotun_peer_endpoint_changes_total{own} 1"),
            format!("kilotun_peer_unanswered_since_seconds{own} 1700000060"),
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
    assert!(text.contains(&format!("kilotun_peer_unanswered_since_seconds{own} 0\n")));
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
        om.contains("# TYPE kilotun_location info\nkilotun_location_info{location=\"east\"} 1\n"),
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
    // OpenMetrics, whose counters Prometheus's own scrapes check in tests/real/prometheus.rs.
    // Present means `promtool --version` succeeds: under qemu-user (cross-built tests) a missing
    // program is not a spawn error but a child that exits 127.
    if !std::process::Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success())
    {
        eprintln!(
            "skipping the promtool check: promtool is not installed (apt-get install prometheus)"
        );
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
