//! End-to-end on the Kubernetes backend against the project's in-process fake API server (real
//! HTTP list/watch/patch) in a node's namespace. The fake stays here only for what a real API
//! server cannot be made to do on cue: count every request kg sends (so the check-in load is
//! exactly one patch per node per 30 s) and answer 503 to everything during an outage while its
//! watches are cut. Everything else runs against a real kube-apiserver in `tests/real/real_kube/`
//! and `tests/real/kube_backend.rs`.

use crate::common;
use control::journal::Reason;

use std::time::Duration;

use common::cluster::{Cluster, NodeSpec};
use common::fake_kube::FakeKube;
use serde_json::json;

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kg_publishes_its_node_and_configures_peers_from_the_api() {
    common::require_root("kg_publishes_its_node_and_configures_peers_from_the_api");
    let mut c = Cluster::new(&["east"]);
    c.add_node(
        &NodeSpec {
            name: "n1",
            location: "east",
            annotations: &[],
        },
        1,
    );
    let api = c.nodes[0].ns.in_ns(FakeKube::start).join().unwrap();
    api.put_node(json!({"apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": "n1", "labels": {"topology.kubernetes.io/region": "east"}},
                        "spec": {"podCIDR": "10.42.1.0/24"}}));
    c.start_kg(
        0,
        &[
            "--backend=kubernetes",
            &format!("--master={}", api.url),
            "--encapsulate=never",
        ],
    );

    let annotated = c.wait_for(Duration::from_secs(20), |_| {
        api.node("n1").is_some_and(|n| {
            n["metadata"]["annotations"]["kilo.squat.ai/wireguard-ip"] == "10.4.0.1/16"
        })
    });
    assert!(annotated, "{:#?}\n{}", api.node("n1"), c.logs());
    let n1 = api.node("n1").unwrap();
    let a = &n1["metadata"]["annotations"];
    assert_eq!(a["kilo.squat.ai/endpoint"], "192.168.10.1:51820");
    assert_eq!(a["kilo.squat.ai/internal-ip"], "192.168.10.1/24");
    assert_eq!(a["kilo.squat.ai/granularity"], "location");
    let key = a["kilo.squat.ai/key"].as_str().unwrap().to_string();
    assert!(c.node("n1").wg("public-key").contains(&key));

    // A remote node appears through the watch: n1 (leader of east) peers with it.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let remote_key = "a2V5MgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    api.put_node(json!({"apiVersion": "v1", "kind": "Node",
                        "metadata": {"name": "remote", "annotations": {
                            "kilo.squat.ai/location": "west",
                            "kilo.squat.ai/endpoint": "192.168.10.200:51820",
                            "kilo.squat.ai/key": remote_key,
                            "kilo.squat.ai/last-seen": now.to_string()}},
                        "spec": {"podCIDR": "10.42.2.0/24"}}));
    let peered = c.wait_for(Duration::from_secs(5), |c| {
        c.node("n1").wg("allowed-ips").contains("10.42.2.0/24")
    });
    assert!(peered, "{}", c.logs());
    assert!(c
        .node("n1")
        .wg("endpoints")
        .contains(&format!("{remote_key}\t192.168.10.200:51820")));
    let show = |c: &Cluster| {
        String::from_utf8_lossy(
            &c.node("n1")
                .ns
                .output(&["ip", "route", "show", "10.42.2.0/24"])
                .stdout,
        )
        .into_owned()
    };
    let routed = c.wait_for(Duration::from_secs(5), |c| {
        let r = show(c);
        r.contains("via 10.4.0.2") && r.contains("proto static") && r.contains("onlink")
    });
    assert!(routed, "{}", show(&c));

    // Check-in: last-seen is refreshed every 30 s, as Kilo does, with nothing else changing.
    let seen = |api: &FakeKube| -> Vec<String> {
        api.patches()
            .iter()
            .filter_map(|(name, body)| {
                let v = body["metadata"]["annotations"]["kilo.squat.ai/last-seen"].as_str()?;
                (name == "n1").then(|| v.to_string())
            })
            .collect()
    };
    // Every patch kg sends for n1, whatever it changes: the API load.
    let all = |api: &FakeKube| {
        api.patches()
            .iter()
            .filter(|(name, _)| name == "n1")
            .count()
    };
    let first = seen(&api);
    let patches_before = all(&api);
    let checked_in = c.wait_for(Duration::from_secs(40), |_| {
        let now = seen(&api);
        now.len() > first.len() && now.last() != first.last()
    });
    assert!(checked_in, "last-seen patches: {:?}", seen(&api));
    // Kilo's load and no more: in a settled mesh, the check-in is the only patch in 30 s.
    assert_eq!(
        all(&api),
        patches_before + 1,
        "patches: {:?}",
        api.patches()
    );
}

/// A Node object for the fake API server: `name` in `region`, pod CIDR `10.42.<index>.0/24`.
fn kube_node(name: &str, region: &str, index: u8) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": name, "labels": {"topology.kubernetes.io/region": region}},
           "spec": {"podCIDR": format!("10.42.{index}.0/24")}})
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn an_api_outage_keeps_traffic_on_the_last_good_mesh() {
    common::require_root("an_api_outage_keeps_traffic_on_the_last_good_mesh");
    let mut c = Cluster::with_nodes(&["east", "west"], &[("n1", "east"), ("n2", "west")]);
    // The API server lives in n1's namespace on its underlay address, so both nodes reach it.
    let api = c.nodes[0]
        .ns
        .in_ns(|| FakeKube::start_on("192.168.10.1"))
        .join()
        .unwrap();
    api.put_node(kube_node("n1", "east", 1));
    api.put_node(kube_node("n2", "west", 2));
    let master = format!("--master={}", api.url);
    for i in 0..2 {
        c.start_kg(i, &["--backend=kubernetes", &master, "--encapsulate=never"]);
    }
    let meshed = c.wait_for(Duration::from_secs(30), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());

    // The API answers nothing but 503 for 80 s: longer than a node's check-in window (60 s),
    // so judged by the wall clock each node would have dropped the other.
    api.set_available(false);
    let n1 = c.node("n1");
    let (got, text) =
        common::ping_series_received(&n1.ns.name, &n1.pod_ip, &c.node("n2").pod_ip, 800);
    assert!(
        got >= 798,
        "{} of 800 pings lost during the outage:\n{text}\n{}",
        800 - got,
        c.logs()
    );
    for node in ["n1", "n2"] {
        assert!(
            !c.node(node)
                .events_of(Reason::BackendUnreachable)
                .is_empty(),
            "{node} did not notice the outage:\n{}",
            c.logs()
        );
    }

    // The API comes back: kg resumes watching by itself, and a change made now is applied.
    api.set_available(true);
    let mut n2 = api.node("n2").unwrap();
    n2["metadata"]["annotations"]["kilo.squat.ai/allowed-location-ips"] = json!("10.77.0.0/24");
    api.put_node(n2);
    // kg retries a failed watch at most every 10 s (see `backend::backoff`), so the change
    // arrives within about that; kube-runtime's default backoff could take a minute.
    let back = std::time::Instant::now();
    let applied = c.wait_for(Duration::from_secs(30), |c| {
        c.node("n1").wg("allowed-ips").contains("10.77.0.0/24")
    });
    assert!(applied, "{}\n{}", c.node("n1").wg("allowed-ips"), c.logs());
    eprintln!(
        "after the outage, a change was applied in {:?}",
        back.elapsed()
    );
    assert!(c.all_pods_reachable().is_ok(), "{}", c.logs());
    // And it checks in again: n2's last-seen is fresh.
    let last_seen_age = || {
        let seen: u64 = api.node("n2").unwrap()["metadata"]["annotations"]
            ["kilo.squat.ai/last-seen"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        unix_now().saturating_sub(seen)
    };
    let checked_in = c.wait_for(Duration::from_secs(40), |_| last_seen_age() < 35);
    assert!(
        checked_in,
        "n2 did not check in again: {:?}",
        api.node("n2")
    );
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}
