//! End-to-end: `kgctl diagnose` in a netns mesh, breaking one thing at a time and asserting the
//! diagnosis names it: UDP dropped to a location, a Peer announcing the wrong key, IP protocol 4
//! dropped inside a location, a flushed iptables chain, a skewed `last-seen`, and a router link
//! with a smaller MTU. A healthy part is never named.

mod common;

use std::process::Output;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::cluster::{kgctl_bin, Cluster, Laptop};
use serde_json::Value;

/// `kgctl diagnose n1 ARGS…` run inside n1, asking n1's kg.
fn run_diagnose(c: &Cluster, args: &[&str]) -> Output {
    let dir = format!("--cluster-dir={}", c.dir.display());
    let mut command = vec![
        kgctl_bin(),
        "--backend=file",
        &dir,
        "diagnose",
        "n1",
        "--kg-url=http://127.0.0.1:1107",
    ];
    command.extend_from_slice(args);
    c.node("n1").ns.output(&command)
}

/// `kgctl diagnose n1 -o json` run inside n1: (exit success, report).
fn diagnose(c: &Cluster, probe: bool) -> (bool, Value) {
    let probe = format!("--probe={probe}");
    let out = run_diagnose(c, &[&probe, "-o", "json"]);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "kgctl diagnose printed no JSON ({e}): {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.success(), report)
}

/// The findings of `report` at `severity` from `check`.
fn findings<'a>(report: &'a Value, severity: &str, check: &str) -> Vec<&'a Value> {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == severity && f["check"] == check)
        .collect()
}

/// Runs diagnose until `found` holds of its report (or `timeout`); returns the last report.
fn diagnose_until(
    c: &Cluster,
    probe: bool,
    timeout: Duration,
    found: impl Fn(&Value) -> bool,
) -> (bool, Value) {
    let deadline = Instant::now() + timeout;
    loop {
        let (ok, report) = diagnose(c, probe);
        if found(&report) || Instant::now() > deadline {
            return (ok, report);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Checks that find nothing while only south's UDP and the laptop's key are broken.
const HEALTHY_CHECKS: [&str; 5] = ["ipip", "path-mtu", "routes", "clock", "cidr-overlap"];

fn text(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap()
}

#[test]
fn diagnose_names_each_broken_thing() {
    if !common::can_run("diagnose_names_each_broken_thing") {
        return;
    }
    let mut c = Cluster::with_nodes(
        &["east", "west", "south"],
        &[
            ("n1", "east"),
            ("n2", "east"),
            ("n3", "west"),
            ("n4", "south"),
        ],
    );
    // south's only node drops WireGuard's UDP both ways, from the start.
    for chain in [["INPUT", "--dport"], ["OUTPUT", "--dport"]] {
        c.node("n4").ns.run(&[
            "iptables", "-A", chain[0], "-p", "udp", chain[1], "51820", "-j", "DROP",
        ]);
    }
    // n1 resyncs rarely, so what is removed behind its back stays removed for a while.
    c.start_kg(0, &["--encapsulate=always", "--resync-period=5m"]);
    for i in 1..4 {
        c.start_kg(i, &["--encapsulate=always"]);
    }
    let n1 = c.node("n1").ns.name.clone();
    let meshed = c.wait_for(Duration::from_secs(40), |_| {
        common::ping_ok(&n1, "10.42.3.1", Duration::from_secs(1))
            && common::ping_ok(&n1, "10.42.2.1", Duration::from_secs(1))
    });
    assert!(meshed, "{}", c.logs());

    // A Peer whose announced key is not its device's.
    let wrong = common::run(&["sh", "-c", "wg genkey | wg pubkey"]);
    let wrong = wrong.trim();
    let laptop = Laptop::join_announcing(&c, "laptop", "east", 50, 5, Some(wrong));
    let real = laptop.device.public_key.clone();

    // Waits for the laptop's refused handshakes to show and for the rest of the mesh to settle
    // (a probe may lose its echoes while the Peer's configuration is being applied).
    let (ok, report) = diagnose_until(&c, true, Duration::from_secs(30), |r| {
        findings(r, "problem", "handshake")
            .iter()
            .any(|f| f["subject"] == "Peer laptop" && text(f).contains(&real))
            && HEALTHY_CHECKS
                .iter()
                .all(|check| findings(r, "problem", check).is_empty())
    });
    assert!(!ok, "problems must exit non-zero: {}", text(&report));
    let handshakes = findings(&report, "problem", "handshake");
    let south = handshakes
        .iter()
        .find(|f| f["subject"] == "location:south (leader n4)")
        .unwrap_or_else(|| panic!("south not named: {}", text(&report)));
    assert!(
        text(south).contains("nothing has arrived") && text(south).contains("UDP port 51820"),
        "{}",
        text(south)
    );
    let peer = handshakes
        .iter()
        .find(|f| f["subject"] == "Peer laptop")
        .unwrap_or_else(|| panic!("the laptop's key not named: {}", text(&report)));
    assert!(
        text(peer).contains(&real) && text(peer).contains(wrong),
        "{}",
        text(peer)
    );
    // The healthy parts are not named: west's link, IPIP to n2, the path MTU, the host.
    assert!(
        !handshakes.iter().any(|f| text(f).contains("west")),
        "{}",
        text(&report)
    );
    for check in HEALTHY_CHECKS {
        assert!(
            findings(&report, "problem", check).is_empty(),
            "{check}: {}",
            text(&report)
        );
    }
    // The same, as text for people.
    let out = run_diagnose(&c, &[]);
    let printed = String::from_utf8_lossy(&out.stdout);
    eprintln!("{printed}");
    assert!(!out.status.success());
    assert!(
        printed.contains("PROBLEM  handshake: location:south (leader n4)\n")
            && printed.contains("what to do: UDP port 51820 is blocked"),
        "{printed}"
    );
    let probes = &report["status"]["probes"];
    assert_eq!(probes["ipip"][0]["node"], "n2", "{}", text(probes));
    assert_eq!(probes["ipip"][0]["encapsulated"], true, "{}", text(probes));
    let leaders = findings(&report, "info", "leader");
    assert!(
        leaders
            .iter()
            .any(|f| f["subject"] == "location:east" && text(f).contains("n1 leads")),
        "{}",
        text(&report)
    );

    // IP protocol 4 dropped on n2: IPIP inside east is named, n2 still answers plain pings.
    let n2 = &c.node("n2").ns;
    n2.run(&["iptables", "-I", "INPUT", "1", "-p", "4", "-j", "DROP"]);
    let (_, report) = diagnose(&c, true);
    let ipip = findings(&report, "problem", "ipip");
    assert_eq!(ipip.len(), 1, "{}", text(&report));
    assert_eq!(ipip[0]["subject"], "node n2");
    assert!(
        text(ipip[0]).contains("protocol 4 is blocked"),
        "{}",
        text(ipip[0])
    );
    n2.run(&["iptables", "-D", "INPUT", "-p", "4", "-j", "DROP"]);

    // kg's NAT chain flushed behind its back: the missing rules are listed.
    let (_, report) = diagnose_until(&c, false, Duration::from_secs(20), |r| {
        c.node("n1")
            .ns
            .run(&["iptables", "-t", "nat", "-F", "KILO-NAT"]);
        !findings(r, "problem", "routes").is_empty()
    });
    let routes = findings(&report, "problem", "routes");
    assert!(
        routes.iter().any(|f| text(f).contains("KILO-NAT")),
        "{}",
        text(&report)
    );

    // n2's last-seen an hour in the future (until its next check-in rewrites it).
    let (_, report) = diagnose_until(&c, false, Duration::from_secs(20), |r| {
        let future = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
            + 3600;
        c.annotate(
            "n2",
            &[("kilo.squat.ai/last-seen", Some(&future.to_string()))],
        );
        findings(r, "problem", "clock")
            .iter()
            .any(|f| f["subject"] == "node n2")
    });
    let clock = findings(&report, "problem", "clock");
    assert!(
        clock
            .iter()
            .any(|f| f["subject"] == "node n2" && text(f).contains("in the future")),
        "{}",
        text(&report)
    );

    // The router's link to west carries 1400 bytes: WireGuard's 1480-byte datagrams do not fit.
    // Asked again while the probe's echoes go unanswered (a loaded machine can delay them past
    // their timeout, which diagnose reports as "not measured").
    c.router.run(&["ip", "link", "set", "br1", "mtu", "1400"]);
    let too_small = |report: &Value| {
        findings(report, "problem", "path-mtu")
            .iter()
            .any(|f| f["subject"] == "location:west" && text(f).contains("at most 1400 bytes"))
    };
    let (_, report) = diagnose_until(&c, true, Duration::from_secs(30), too_small);
    assert!(too_small(&report), "{}", text(&report));
    c.router.run(&["ip", "link", "set", "br1", "mtu", "1500"]);
    drop(laptop);
}
