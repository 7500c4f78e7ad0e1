//! Counting test: kg on in-memory twins of the kernel, iptables and the WireGuard
//! device, in a cluster of 1,000 ready Nodes in 100 locations. 1,000 Node updates that move
//! only `last-seen` make no call at all to any of them (no netlink dump or write, no iptables
//! child, no device read or change); a real change writes without listing the host; a resync
//! lists the host and restores what was changed behind kg's back; nodes flapping across the
//! `last-seen` bound change the device at most once per readiness interval and the firewall
//! once per firewall interval, while a real change still reaches them at once. Needs no root. The agent runs on a manual clock.

use std::time::Duration;

use control::coalesce::{FIREWALL_INTERVAL, READINESS_INTERVAL};
use control::fixtures::synthetic_cluster;
use control::node::annotation;
use control::routes::RoutePlan;
use kilotun::agent::shells::twins::Calls;
use kilotun::agent::Trigger;

use super::twin_cluster::{unix_now, Fixture};

const NODES: usize = 1000;
const LOCATIONS: usize = 100;
const LOCAL: &str = "node-00000";

/// kg as node-00000 in the cluster of 1,000 Nodes in 100 locations.
async fn start(test: &str) -> Fixture {
    Fixture::with_nodes(test, LOCAL, synthetic_cluster(NODES, LOCATIONS)).await
}

fn delta(after: [Calls; 3], before: [Calls; 3]) -> [(u64, u64); 3] {
    [0, 1, 2].map(|i| {
        (
            after[i].reads - before[i].reads,
            after[i].writes - before[i].writes,
        )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_seen_updates_make_no_os_call_and_real_changes_write_without_listing() {
    let mut f = start("quiet").await;
    let engine = f.twin.engine.config();
    assert_eq!(
        engine.peers.len(),
        LOCATIONS - 1,
        "kg leads its location and peers with the other 99"
    );
    let routes = f.twin.kernel.routes();
    assert!(!routes.routes.is_empty());
    assert!(f.twin.firewall.rules().is_some());
    let published = std::fs::metadata(f.dir.join(format!("{LOCAL}.yaml")))
        .unwrap()
        .modified()
        .unwrap();

    let before = f.twin.calls();
    let now = unix_now();
    for i in 0..1000 {
        let name = format!("node-{:05}", 1 + i % (NODES - 1));
        f.set_annotation(
            &name,
            annotation::LAST_SEEN,
            (now + 1 + i as i64 / 100).to_string(),
        );
        f.reconcile(Trigger::Event).await;
    }
    assert_eq!(
        delta(f.twin.calls(), before),
        [(0, 0); 3],
        "kernel, firewall and device (reads, writes) after 1,000 check-ins"
    );
    assert_eq!(f.twin.engine.config(), engine);
    let still = std::fs::metadata(f.dir.join(format!("{LOCAL}.yaml")))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(still, published, "no annotation patch either");
    // The check-in timer refreshes last-seen only: it lists nothing either.
    let before = f.twin.calls();
    f.reconcile(Trigger::CheckIn).await;
    assert_eq!(delta(f.twin.calls(), before), [(0, 0); 3], "a check-in");

    // A real change: a node leaves its location for a new one, which kg now peers with (named
    // to sort last, so no segment's WireGuard IP moves and kg's own address stays).
    let before = f.twin.calls();
    f.set_annotation("node-00150", annotation::LOCATION, "zz-new".into());
    f.reconcile(Trigger::Event).await;
    let [kernel, firewall, device] = delta(f.twin.calls(), before);
    assert_eq!(
        f.twin.engine.config().peers.len(),
        LOCATIONS,
        "a new segment"
    );
    assert_eq!(device, (1, 1), "one device change");
    assert_eq!(
        kernel.0, 0,
        "routes compared with what kg applied, not listed"
    );
    assert!(kernel.1 > 0, "the new segment's routes were written");
    assert_eq!(
        firewall.0, 1,
        "the rules changed, so iptables was reconciled once"
    );

    // Someone deletes kg's routes: an event does not notice (kg trusts what it applied), the
    // next resync lists the kernel and puts them back.
    let wanted = f.twin.kernel.routes();
    f.twin.kernel.set_routes(RoutePlan::default());
    f.set_annotation("node-00001", annotation::LAST_SEEN, (now + 20).to_string());
    f.reconcile(Trigger::Event).await;
    assert!(f.twin.kernel.routes().routes.is_empty());
    let before = f.twin.calls();
    f.reconcile(Trigger::Resync).await;
    assert_eq!(f.twin.kernel.routes(), wanted, "restored within one resync");
    let [kernel, firewall, device] = delta(f.twin.calls(), before);
    assert!(kernel.0 > 0, "a resync lists the host");
    assert_eq!(firewall, (1, 0), "iptables listed, nothing to change");
    assert_eq!(device.1, 0, "the device already had this configuration");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_flips_and_removals_reach_the_device() {
    let mut f = start("flips").await;
    // A location leader's check-in goes stale: that location's other nodes take over, so the
    // device changes (its endpoint and allowed IPs).
    f.advance(READINESS_INTERVAL).await;
    let before = f.twin.engine.config();
    f.set_annotation("node-00007", annotation::LAST_SEEN, "5".into());
    f.reconcile(Trigger::Event).await;
    let after = f.twin.engine.config();
    assert_ne!(
        after, before,
        "a readiness flip a while after the last change is taken at once"
    );
    // Removing every node of location 8 removes its peer.
    let names: Vec<String> = f
        .snapshot
        .nodes
        .keys()
        .filter(|n| n.ends_with('8') && n[5..].parse::<usize>().unwrap() % LOCATIONS == 8)
        .cloned()
        .collect();
    assert_eq!(names.len(), NODES / LOCATIONS);
    for name in &names {
        f.snapshot.remove_node(name);
    }
    f.reconcile(Trigger::Event).await;
    assert_eq!(f.twin.engine.config().peers.len(), LOCATIONS - 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flapping_nodes_change_the_device_once_per_readiness_interval_and_a_real_change_at_once() {
    let mut f = start("flapping").await;
    let steady = f.twin.engine.config();
    let steady_rules = f.twin.firewall.rules();
    f.advance(Duration::from_secs(1)).await;
    let fresh = unix_now();
    // Ten location leaders flap across the last-seen bound, one flip every 10 ms for 10 s,
    // each delivered in its own event (fresh for 130 ms, then stale for 130 ms: a period
    // that no multiple of the interval lands on in phase).
    let before = f.twin.calls();
    for step in 0..1000u32 {
        let leader = format!("node-{:05}", 1 + step % 10);
        let stale = (step / 13) % 2 == 1;
        let seen = if stale {
            5
        } else {
            fresh + 1 + i64::from(step) / 100
        };
        f.set_annotation(&leader, annotation::LAST_SEEN, seen.to_string());
        f.reconcile(Trigger::Event).await;
        f.advance(Duration::from_millis(10)).await;
    }
    let [_, firewall, device] = delta(f.twin.calls(), before);
    // The firewall follows the flips at most once per FIREWALL_INTERVAL.
    let firewall_writes = 10 / FIREWALL_INTERVAL.as_secs() + 1;
    assert!(
        firewall.1 <= firewall_writes,
        "{} firewall writes in 10 s of flapping (at most one per {FIREWALL_INTERVAL:?})",
        firewall.1
    );
    let intervals = (10_000 / READINESS_INTERVAL.as_millis()) as u64;
    assert!(
        device.1 <= intervals + 1,
        "{} device changes in 10 s of flapping (at most one per {READINESS_INTERVAL:?})",
        device.1
    );
    assert!(
        device.1 >= intervals / 2,
        "the flips did reach the device: {} changes",
        device.1
    );
    // The last round left every leader fresh: once the held flips are due, the device is as
    // it was before the flapping.
    f.advance(READINESS_INTERVAL).await;
    assert_eq!(
        f.twin.engine.config(),
        steady,
        "the device settles on the last readiness"
    );
    // The firewall's rules follow once its hold ends.
    f.advance(FIREWALL_INTERVAL).await;
    assert_eq!(
        f.twin.firewall.rules(),
        steady_rules,
        "the firewall settles on the last readiness"
    );
    assert_eq!(
        f.twin.agent.readiness_deadline(),
        None,
        "nothing is held any more"
    );

    // While nodes flap, a real change reaches the device in the reconcile of its event.
    // Two flips at one moment: the second, at least, is held.
    for leader in ["node-00003", "node-00004"] {
        f.set_annotation(leader, annotation::LAST_SEEN, "5".into());
        f.reconcile(Trigger::Event).await;
    }
    assert!(
        f.twin.agent.readiness_deadline().is_some(),
        "a flip is held"
    );
    f.set_annotation("node-00150", annotation::LOCATION, "zz-new".into());
    f.reconcile(Trigger::Event).await;
    let peers = f.twin.engine.config().peers;
    assert_eq!(peers.len(), LOCATIONS, "the new location is a peer at once");
    assert_eq!(
        f.twin.agent.readiness_deadline(),
        None,
        "and the held flip went with it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_steady_leader_takes_a_new_peer_before_its_routes() {
    let mut f = start("engine-first").await;
    f.twin.engine.record_routes_of(&f.twin.kernel);
    f.set_annotation("node-00150", annotation::LOCATION, "zz-new".into());
    f.reconcile(Trigger::Event).await;
    let pods: ipnet::IpNet = "10.64.150.0/24".parse().unwrap();
    let changes = f.twin.engine.changes();
    assert_eq!(changes.len(), 1, "one device change");
    let (config, routes_then) = &changes[0];
    assert!(
        config.peers.iter().any(|p| p.allowed_ips.contains(&pods)),
        "the new location's peer carries its pods"
    );
    // The engine took it while the kernel still routed node-00150's pods as before: the
    // routes, whose cost grows with the cluster, did not delay the tunnel.
    let to_pods = |plan: &RoutePlan| {
        plan.routes
            .iter()
            .filter(|r| r.dst == pods)
            .map(|r| r.gateway)
            .collect::<Vec<_>>()
    };
    let after = f.twin.kernel.routes();
    assert_ne!(
        to_pods(routes_then),
        to_pods(&after),
        "the routes to its pods changed after the engine did"
    );
}
