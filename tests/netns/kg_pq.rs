//! Post-quantum preshared keys end to end: three nodes in a full mesh with `--post-quantum`
//! (one of them without it in the mixed case), pings at 10 a second across a link while its
//! preshared key changes every 10 s. Both ends show the same key in `wg show`, it changes,
//! and no echo is lost; a link with an end that does not take part has no key and works as
//! without. A kg restarted with a saved key its peer does not hold is named by `kgctl
//! diagnose` within 30 s, and both ends fall back and key the link again; one restarted
//! without its saved keys changes its ML-KEM key, and its peers drop theirs at once. A node
//! whose announcement another writer keeps removing writes it again, and its link loses no
//! more than 2 echoes and is keyed again.

use crate::common;
use control::journal::Reason;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use base64::Engine as _;
use common::cluster::Cluster;
use common::pinger::Pinger;
use serde_json::Value;

const FULL: [&str; 2] = ["--mesh-granularity=full", "--encapsulate=never"];
const PQ: [&str; 2] = ["--post-quantum", "--psk-rotation-period=10s"];

/// `wg show <iface> preshared-keys` of `node`, by peer key.
fn psks(c: &Cluster, node: &str) -> BTreeMap<String, String> {
    c.node(node).preshared_keys()
}

fn key_of(c: &Cluster, node: &str) -> String {
    c.annotations(node)["kilo.squat.ai/key"].clone()
}

/// The preshared key `a` holds for `b`, and the one `b` holds for `a`.
fn link_psks(c: &Cluster, a: &str, b: &str) -> (Option<String>, Option<String>) {
    (
        psks(c, a).get(&key_of(c, b)).cloned(),
        psks(c, b).get(&key_of(c, a)).cloned(),
    )
}

/// True when both ends of `a`–`b` hold one preshared key.
fn keyed(c: &Cluster, a: &str, b: &str) -> bool {
    let (x, y) = link_psks(c, a, b);
    x.is_some() && x != Some("(none)".into()) && x == y
}

/// kg's flags, with post-quantum keys when `pq`.
fn flags(pq: bool) -> Vec<&'static str> {
    let mut flags = FULL.to_vec();
    if pq {
        flags.extend(PQ);
    }
    flags
}

fn cluster(pq_on: [bool; 3]) -> Cluster {
    let mut c = Cluster::with_nodes(
        &["east", "west"],
        &[("n1", "east"), ("n2", "east"), ("n3", "west")],
    );
    for (i, on) in pq_on.iter().enumerate() {
        c.start_kg(i, &flags(*on));
    }
    let meshed = c.wait_for(Duration::from_secs(30), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    c
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_post_quantum_link_changes_its_key_every_period_without_losing_an_echo() {
    common::require_root("a_post_quantum_link_changes_its_key_every_period_without_losing_an_echo");
    let c = cluster([true, true, true]);
    assert!(
        c.wait_for(Duration::from_secs(15), |c| keyed(c, "n1", "n3")),
        "{:?} {:?}\n{}",
        psks(&c, "n1"),
        psks(&c, "n3"),
        c.logs()
    );
    let first = link_psks(&c, "n1", "n3").0;
    let mut c = c;
    let pinger = Pinger::start(&c.node("n3").ns.name, &c.node("n1").pod_ip);
    assert!(pinger.wait_flowing(
        Instant::now() - Duration::from_secs(1),
        Duration::from_secs(10)
    ));
    let since = Instant::now();
    // Two periods: the key changes twice.
    std::thread::sleep(Duration::from_secs(22));
    // Read while no switch is in flight: both ends hold one key, and not the first.
    let changed = |c: &Cluster| {
        let now = link_psks(c, "n1", "n3");
        now.0 == now.1 && now.0 != first
    };
    assert!(c.wait_for(Duration::from_secs(5), changed), "{}", c.logs());
    let now = link_psks(&c, "n1", "n3");
    let lost = pinger.lost_after(since);
    eprintln!(
        "post-quantum: {lost} echoes lost over two key changes; longest gap {:?}",
        pinger.longest_gap_after(since)
    );
    assert_eq!(lost, 0, "{}", c.logs());
    let changes = counter(&c, "n1", "kilotun_pq_psk_changes_total");
    assert!(
        changes >= 4,
        "two links, two changes each at least: {changes}\n{}",
        c.logs()
    );
    let log = c.node("n1").log_text();
    assert!(
        !log.contains(now.0.as_deref().unwrap()),
        "a preshared key was logged"
    );

    // n1's kg restarts: it takes back its saved keys, so its links come back and get keys,
    // and no handshake fails under a key the other end does not hold: neither end falls back.
    let fallbacks_at_n3 = counter(&c, "n3", "kilotun_pq_fallbacks_total");
    c.nodes[0].kill();
    let restarted = Instant::now();
    c.start_kg(0, &flags(true));
    let back = c.wait_for(Duration::from_secs(20), |c| {
        c.all_pods_reachable().is_ok() && keyed(c, "n1", "n3")
    });
    assert!(back, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    eprintln!(
        "post-quantum: n1 reached and keyed again {:?} after its kg restarted; pings n3→n1: longest gap {:?}",
        restarted.elapsed(),
        pinger.longest_gap_after(restarted - Duration::from_millis(200))
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        (
            counter(&c, "n1", "kilotun_pq_fallbacks_total"),
            counter(&c, "n3", "kilotun_pq_fallbacks_total")
        ),
        (0, fallbacks_at_n3),
        "a restart with the saved keys made an end fall back\n{}",
        c.logs()
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_link_to_a_node_without_post_quantum_has_no_preshared_key_and_works() {
    common::require_root("a_link_to_a_node_without_post_quantum_has_no_preshared_key_and_works");
    let c = cluster([true, true, false]);
    assert!(
        c.wait_for(Duration::from_secs(15), |c| keyed(c, "n1", "n2")),
        "{}",
        c.logs()
    );
    assert_eq!(link_psks(&c, "n1", "n3").0.as_deref(), Some("(none)"));
    assert_eq!(link_psks(&c, "n3", "n1").0.as_deref(), Some("(none)"));
    assert!(c.all_pods_reachable().is_ok(), "{}", c.logs());
    assert!(!c.annotations("n3").contains_key("kilotun.io/pq"));
    assert!(c.annotations("n1")["kilotun.io/pq"].starts_with("v1:"));
}

/// A counter of `node`'s `/metrics`, 0 when absent.
fn counter(c: &Cluster, node: &str, name: &str) -> u64 {
    let (_, metrics) = c.node(node).http_get("/metrics");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// `kgctl diagnose NODE -o json` run inside NODE, asking its kg.
fn diagnose(c: &Cluster, node: &str) -> Value {
    let out = crate::kg_diagnose::run_diagnose_on(c, node, &["--probe=false", "-o", "json"]);
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

/// The findings of `report` that name the key of the link to `peer`: a handshake failing under
/// differing keys, or a post-quantum key dropped.
fn named_mismatch(report: &Value, peer: &str) -> Vec<String> {
    report["findings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| {
            let subject = f["subject"].as_str().unwrap_or_default();
            let message = f["message"].as_str().unwrap_or_default();
            subject.contains(peer)
                && (f["check"] == "preshared-key"
                    || (f["check"] == "post-quantum" && message.contains("dropped")))
        })
        .map(|f| format!("{}: {}", f["check"], f["message"]))
        .collect()
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_mismatched_key_is_named_within_30_s_and_both_ends_fall_back_then_key_again() {
    common::require_root(
        "a_mismatched_key_is_named_within_30_s_and_both_ends_fall_back_then_key_again",
    );
    let mut c = cluster([true, true, true]);
    assert!(
        c.wait_for(Duration::from_secs(15), |c| keyed(c, "n1", "n3")),
        "{}",
        c.logs()
    );
    let before = link_psks(&c, "n1", "n3").0.unwrap();
    // n1's kg stops; its saved key for n3 is made one that n3 does not hold.
    c.nodes[0].kill();
    let saved_at = c.work.join("keys").join("n1.psk");
    let mut saved: Value =
        serde_json::from_str(&std::fs::read_to_string(&saved_at).unwrap()).unwrap();
    let wrong = base64::engine::general_purpose::STANDARD.encode([0x5a_u8; 32]);
    saved["links"][key_of(&c, "n3")][0] = Value::String(wrong.clone());
    std::fs::write(&saved_at, saved.to_string()).unwrap();
    let restarted = Instant::now();
    c.start_kg(0, &flags(true));
    // diagnose names the link within 30 s.
    let mut named = Vec::new();
    while restarted.elapsed() < Duration::from_secs(30) && named.is_empty() {
        named = named_mismatch(&diagnose(&c, "n1"), "n3");
        if named.is_empty() {
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    let named_after = restarted.elapsed();
    assert!(
        !named.is_empty(),
        "not named within 30 s: {}\n{}",
        diagnose(&c, "n1"),
        c.logs()
    );
    eprintln!(
        "post-quantum: the mismatch named by diagnose {named_after:?} after the restart: {named:?}"
    );
    // Both ends fall back, meet without a key, and the next exchange keys the link again.
    let again = c.wait_for(Duration::from_secs(45), |c| {
        c.all_pods_reachable().is_ok()
            && keyed(c, "n1", "n3")
            && link_psks(c, "n1", "n3")
                .0
                .as_deref()
                .is_some_and(|k| k != wrong && k != before)
    });
    assert!(
        again,
        "{:?} {:?}\n{}",
        link_psks(&c, "n1", "n3"),
        c.all_pods_reachable(),
        c.logs()
    );
    eprintln!(
        "post-quantum: every pod reached and n1–n3 keyed again {:?} after the restart",
        restarted.elapsed()
    );
    for (node, peer) in [("n1", "n3"), ("n3", "n1")] {
        assert!(
            counter(&c, node, "kilotun_pq_fallbacks_total") >= 1,
            "{node} did not fall back\n{}",
            c.logs()
        );
        // And said so, naming the peer's node.
        let said = c.node(node).events_of(Reason::PostQuantumFallback);
        assert!(said.iter().any(|e| e.subject == peer), "{node}: {said:?}");
    }
    assert!(
        keyed(&c, "n1", "n2"),
        "the link whose saved key was right keeps one"
    );
    let status: Value =
        serde_json::from_str(&c.node("n1").http_get("/status?probe=false").1).unwrap();
    let to_n3 = status["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["public_key"] == key_of(&c, "n3").as_str())
        .expect("n1's peer n3");
    assert_eq!(to_n3["post_quantum"]["state"], "keyed", "{to_n3}");
    assert!(to_n3["post_quantum"]["fell_back_unix"].is_i64(), "{to_n3}");

    // n1's kg restarts without its saved keys: it makes a new ML-KEM key, and its peers drop
    // theirs when they see the new fingerprint, so no handshake has to fail first.
    let fingerprint = c.annotations("n1")["kilotun.io/pq"].clone();
    let fallbacks = counter(&c, "n3", "kilotun_pq_fallbacks_total");
    c.nodes[0].kill();
    std::fs::remove_file(&saved_at).unwrap();
    let restarted = Instant::now();
    c.start_kg(0, &flags(true));
    let back = c.wait_for(Duration::from_secs(30), |c| {
        c.all_pods_reachable().is_ok() && keyed(c, "n1", "n3") && keyed(c, "n1", "n2")
    });
    assert!(back, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    eprintln!(
        "post-quantum: restarted without its saved keys, n1 reached and keyed again {:?} later",
        restarted.elapsed()
    );
    assert_ne!(c.annotations("n1")["kilotun.io/pq"], fingerprint);
    assert_eq!(counter(&c, "n3", "kilotun_pq_fallbacks_total"), fallbacks);
    let log = c.node("n1").log_text() + &c.node("n3").log_text();
    assert!(
        !log.contains(&before) && !log.contains(&wrong),
        "a preshared key was logged"
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_key_rotation_renews_the_ml_kem_key_and_the_links_are_keyed_again_under_load() {
    common::require_root(
        "a_key_rotation_renews_the_ml_kem_key_and_the_links_are_keyed_again_under_load",
    );
    let c = cluster([true, true, true]);
    assert!(
        c.wait_for(Duration::from_secs(15), |c| keyed(c, "n1", "n3")
            && keyed(c, "n1", "n2")),
        "{}",
        c.logs()
    );
    let (key, fingerprint) = (
        key_of(&c, "n1"),
        c.annotations("n1")["kilotun.io/pq"].clone(),
    );
    let pinger = Pinger::start(&c.node("n3").ns.name, &c.node("n1").pod_ip);
    assert!(pinger.wait_flowing(
        Instant::now() - Duration::from_secs(1),
        Duration::from_secs(10)
    ));
    let since = Instant::now();
    crate::kg_rotation::rotate_n1(&c);
    let renewed = c.wait_for(Duration::from_secs(30), |c| {
        key_of(c, "n1") != key
            && c.annotations("n1")["kilotun.io/pq"] != fingerprint
            && keyed(c, "n1", "n3")
            && keyed(c, "n1", "n2")
    });
    assert!(renewed, "{:?}\n{}", c.annotations("n1"), c.logs());
    eprintln!(
        "post-quantum: n1's keys rotated and its links keyed again {:?} after kgctl rotate-key",
        since.elapsed()
    );
    std::thread::sleep(Duration::from_secs(1));
    let lost = pinger.lost_after(since);
    eprintln!(
        "post-quantum: {lost} echoes lost n3→n1 over the rotation; longest gap {:?}",
        pinger.longest_gap_after(since)
    );
    assert!(lost <= 2, "{lost} echoes lost\n{}", c.logs());
    let seed = c.work.join("keys").join("n1.pq");
    let mode = std::fs::metadata(&seed).unwrap().permissions();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
        0o600
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn an_announcement_that_flaps_costs_the_link_no_echo_and_it_is_keyed_again() {
    common::require_root("an_announcement_that_flaps_costs_the_link_no_echo_and_it_is_keyed_again");
    let c = cluster([true, true, true]);
    assert!(
        c.wait_for(Duration::from_secs(15), |c| keyed(c, "n1", "n3")),
        "{}",
        c.logs()
    );
    let pinger = Pinger::start(&c.node("n3").ns.name, &c.node("n1").pod_ip);
    assert!(pinger.wait_flowing(
        Instant::now() - Duration::from_secs(1),
        Duration::from_secs(10)
    ));
    let since = Instant::now();
    // Another writer removes n1's kilotun.io/pq three times: n1's kg writes it again each
    // time, and n3 drops its key for n1 whenever its watch shows it gone.
    for round in 1..=3 {
        let announced = c.annotations("n1")["kilotun.io/pq"].clone();
        c.annotate("n1", &[("kilotun.io/pq", None)]);
        let again = c.wait_for(Duration::from_secs(15), |c| {
            c.annotations("n1").get("kilotun.io/pq") == Some(&announced)
        });
        assert!(
            again,
            "round {round}: n1 did not write kilotun.io/pq again\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_secs(2));
    }
    let keyed_again = c.wait_for(Duration::from_secs(30), |c| keyed(c, "n1", "n3"));
    assert!(keyed_again, "{:?}\n{}", link_psks(&c, "n1", "n3"), c.logs());
    std::thread::sleep(Duration::from_secs(1));
    let lost = pinger.lost_after(since);
    eprintln!(
        "post-quantum: n1's announcement removed three times: {lost} echoes lost n3→n1, longest gap {:?}, keyed again {:?} after the first removal",
        pinger.longest_gap_after(since),
        since.elapsed()
    );
    assert!(lost <= 2, "{lost} echoes lost\n{}", c.logs());
}
