//! A real Prometheus (Debian's `prometheus` package) scrapes every kg of a mesh in network
//! namespaces, and every PromQL expression of `dashboards/kilotun.json` returns data through
//! Prometheus's HTTP API once traffic has flowed. Prometheus runs in the cluster's router
//! namespace, which routes to every node's underlay address, with static targets labelled
//! `pod=kilo-<node>` as the kube-prometheus PodMonitor of Kilo's manifests labels them.

use crate::common;

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::Netns;
use serde_json::Value;

/// Where Prometheus listens inside the router namespace.
const PROMETHEUS: &str = "127.0.0.1:9090";
/// The Accept header Prometheus 2.42 scrapes with.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0";

/// A Prometheus server, killed on drop.
struct Prometheus {
    child: Child,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Percent-encodes a query parameter value.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `GET /api/v1/<path>` on Prometheus: the `data` of a successful answer, or why not.
fn api(router: &Netns, path: &str) -> Result<Value, String> {
    let (status, _, body) =
        common::http_get_accepting(router, PROMETHEUS, &format!("/api/v1/{path}"), None);
    let answer: Value =
        serde_json::from_str(&body).map_err(|e| format!("HTTP {status} {e}: {body}"))?;
    if answer["status"] != "success" {
        return Err(format!("HTTP {status}: {body}"));
    }
    Ok(answer["data"].clone())
}

/// Every PromQL expression of the dashboard, with its panel's title.
fn dashboard_queries() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("dashboards/kilotun.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push((
                panel["title"].as_str().unwrap().to_string(),
                target["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    queries
}

/// Runs `promtool check metrics` on `body`: its complaints, if any.
fn promtool_check(body: &str) -> Result<(), String> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn prometheus_scrapes_every_kg_and_every_dashboard_query_returns_data() {
    let test = "prometheus_scrapes_every_kg_and_every_dashboard_query_returns_data";
    common::require_root(test);
    assert!(
        common::which("prometheus") && common::which("promtool"),
        "{test}: needs Prometheus (apt-get install prometheus; .ci/run installs it)"
    );
    let c = Cluster::meshed_east_west(&[]);

    // kg's own answer in each format: 0.0.4 by default, which promtool lints clean; OpenMetrics
    // when asked (promtool cannot read it; Prometheus's scrapes below parse it).
    let n1 = c.node("n1");
    let (status, headers, text) =
        common::http_get_accepting(&n1.ns, "127.0.0.1:1107", "/metrics", None);
    assert_eq!(status, 200, "{text}");
    assert!(
        headers.contains("content-type: text/plain; version=0.0.4"),
        "{headers}"
    );
    assert!(
        text.contains("# TYPE kilo_errors_total counter\n"),
        "{text}"
    );
    assert!(
        text.contains("kilo_errors_total{event=\"apply\"} 0\n"),
        "{text}"
    );
    if let Err(problems) = promtool_check(&text) {
        panic!("promtool check metrics on the 0.0.4 format:\n{problems}\n{text}");
    }
    let (status, headers, om) =
        common::http_get_accepting(&n1.ns, "127.0.0.1:1107", "/metrics", Some(OPENMETRICS));
    assert_eq!(status, 200, "{om}");
    assert!(
        headers.contains("content-type: application/openmetrics-text; version=1.0.0"),
        "{headers}"
    );
    assert!(om.contains("# TYPE kilo_errors counter\n"), "{om}");
    assert!(om.ends_with("# EOF\n"), "{om}");

    // Prometheus in the router namespace, scraping each node's kg every second.
    let dir = c.work.join("prometheus");
    std::fs::create_dir_all(dir.join("data")).unwrap();
    let mut config = String::from(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: kilo\n    static_configs:\n",
    );
    for node in &c.nodes {
        config.push_str(&format!(
            "      - targets: ['{}:1107']\n        labels:\n          pod: kilo-{}\n",
            node.ip, node.name
        ));
    }
    std::fs::write(dir.join("prometheus.yml"), &config).unwrap();
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let _prometheus = Prometheus {
        child: Command::new("ip")
            .args(["netns", "exec", &c.router.name, "prometheus"])
            .arg(format!(
                "--config.file={}",
                dir.join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("data").display()
            ))
            .arg(format!("--web.listen-address={PROMETHEUS}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawning prometheus"),
    };
    let prometheus_log = || std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default();

    // Every target up, with no scrape error: Prometheus negotiated OpenMetrics and its parser
    // accepted kg's exposition.
    let deadline = Instant::now() + Duration::from_secs(60);
    let targets = loop {
        let targets = api(&c.router, "targets").ok();
        let active = targets
            .as_ref()
            .and_then(|t| t["activeTargets"].as_array().cloned())
            .unwrap_or_default();
        if active.len() == c.nodes.len() && active.iter().all(|t| t["health"] == "up") {
            break active;
        }
        assert!(
            Instant::now() < deadline,
            "targets not all up: {targets:#?}\n{}",
            prometheus_log()
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    for target in &targets {
        assert_eq!(target["lastError"], "", "{target:#}");
    }
    // The metadata Prometheus keeps says how it parsed: OpenMetrics names a counter family
    // without `_total` and carries units.
    let metadata = api(
        &c.router,
        "targets/metadata?match_target=%7Bjob%3D%22kilo%22%7D",
    )
    .unwrap();
    let entry = |metric: &str| {
        metadata
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["metric"] == metric)
            .cloned()
            .unwrap_or_else(|| panic!("no metadata for {metric}: {metadata:#}"))
    };
    assert_eq!(entry("kilo_errors")["type"], "counter");
    assert_eq!(entry("wireguard_sent_bytes")["type"], "counter");
    assert_eq!(entry("wireguard_sent_bytes")["unit"], "bytes");
    assert_eq!(entry("process_cpu_seconds")["unit"], "seconds");
    assert_eq!(entry("wireguard_latest_handshake_seconds")["type"], "gauge");
    assert_eq!(entry("kilotun_location")["type"], "info");

    // Traffic through both tunnels: n2 (through its leader n1) and n1 to n3's pods, and back.
    for (from, to) in [("n2", "n3"), ("n1", "n3"), ("n3", "n2")] {
        let (a, b) = (c.node(from), c.node(to));
        let (received, out) = common::ping_series_received(&a.ns.name, &a.pod_ip, &b.pod_ip, 20);
        assert!(received >= 15, "{from} → {to}: {out}\n{}", c.logs());
    }

    // Every dashboard query returns data.
    let queries = dashboard_queries();
    assert!(queries.len() >= 16, "{queries:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut empty: Vec<String>;
    loop {
        empty = Vec::new();
        for (title, expr) in &queries {
            match api(&c.router, &format!("query?query={}", encode(expr))) {
                Ok(data) if data["result"].as_array().is_some_and(|r| !r.is_empty()) => {}
                Ok(data) => empty.push(format!("{title}: {expr} → {data}")),
                Err(e) => empty.push(format!("{title}: {expr} → {e}")),
            }
        }
        if empty.is_empty() || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    assert!(
        empty.is_empty(),
        "dashboard queries without data:\n{}\n{}",
        empty.join("\n"),
        prometheus_log()
    );

    // What the data say: the exporter's series for the peers with traffic, the leader of each
    // location, and kg's process.
    let value = |expr: &str| -> Vec<Value> {
        api(&c.router, &format!("query?query={}", encode(expr))).unwrap()["result"]
            .as_array()
            .unwrap()
            .clone()
    };
    let leaders = value(
        "max by (location, pod) (kilotun_location_info and on (instance) (kilo_leader == 1))",
    );
    let mut pairs: Vec<(String, String)> = leaders
        .iter()
        .map(|r| {
            (
                r["metric"]["location"].as_str().unwrap().to_string(),
                r["metric"]["pod"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    pairs.sort();
    assert_eq!(
        pairs,
        [
            ("location:east".to_string(), "kilo-n1".to_string()),
            ("location:west".to_string(), "kilo-n3".to_string())
        ]
    );
    let sent = value("wireguard_sent_bytes_total{pod=\"kilo-n1\"} > 0");
    assert_eq!(sent.len(), 1, "n1 has one peer (n3's location): {sent:#?}");
    let labels = &sent[0]["metric"];
    assert_eq!(labels["interface"], n1.iface.as_str());
    let n3_key = c.node("n3").wg("public-key");
    assert_eq!(labels["public_key"], n3_key.trim());
    // n3's pod CIDR (10.42.3.0/24) is among the allowed IPs of n1's peer for the west location.
    assert!(
        labels["allowed_ips"]
            .as_str()
            .unwrap()
            .split(',')
            .any(|ip| ip == "10.42.3.0/24"),
        "{labels:#}"
    );
    let age = value("time() - wireguard_latest_handshake_seconds{pod=\"kilo-n1\"}");
    let age: f64 = age[0]["value"][1].as_str().unwrap().parse().unwrap();
    assert!((0.0..300.0).contains(&age), "handshake age {age}");
    for pod in ["kilo-n1", "kilo-n2", "kilo-n3"] {
        let rss = value(&format!("process_resident_memory_bytes{{pod=\"{pod}\"}}"));
        let rss: f64 = rss[0]["value"][1].as_str().unwrap().parse().unwrap();
        assert!(rss > 1e6, "{pod}: {rss}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
