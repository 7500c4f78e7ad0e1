//! A rollout of kg under the real kubelets, whatever starts it (a changed pod template, `helm
//! upgrade`): every kg pod replaced, one node at a time as Kubernetes 1.20 does, while each node
//! pings the other's pod; the longest gaps printed and split by `timeline.rs`, kg's own parts
//! bounded.

use std::collections::BTreeMap;
use std::fs;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{assert_annotated, pings_across, timeline, KubeletCluster};

/// Runs `change` (which changes the DaemonSet's pod template), waits for the rollout it starts
/// and checks it: every pod replaced, pings across resumed, the old kg out within 12 s of its
/// pod's deletion and the new one carrying traffic within 15 s of its start, the annotations
/// as before. `what` names the rollout in what is printed.
pub(super) fn roll_every_kg(
    k: &KubeletCluster,
    pod_ips: &[String],
    what: &str,
    change: impl FnOnce(&KubeletCluster),
) {
    let (n1, n2) = (&k.nodes[0], &k.nodes[1]);
    let (p12, p21) = pings_across(k, pod_ips, &format!("before the {what}"));
    // Each node's old pod (its uid, to see it replaced, and its name, to follow its log), and
    // its kg process, to tell kg's own exit from the kubelet's report of it.
    let old_pods = k.kilo_pods();
    let field = |key: &str| -> BTreeMap<String, String> {
        old_pods
            .iter()
            .map(|(n, p)| {
                let value = p["metadata"][key].as_str().unwrap_or_default();
                (n.clone(), value.to_string())
            })
            .collect()
    };
    let (before, old_names) = (field("uid"), field("name"));
    let old_pids: BTreeMap<String, i32> = k
        .nodes
        .iter()
        .filter_map(|n| Some((n.name.clone(), k.kg_pid(n)?)))
        .collect();
    let logs_dir =
        std::env::temp_dir().join(format!("kilotun-rollout-logs-{}", std::process::id()));
    fs::create_dir_all(&logs_dir).unwrap();
    let old_logs = timeline::FollowedLogs::start(k, &old_names, &logs_dir);
    let restarted = Instant::now();
    let done = AtomicBool::new(false);
    let (timeline, kg_exits) = std::thread::scope(|scope| {
        let watcher = scope.spawn(|| timeline::record(k, &done));
        let exits = scope.spawn(|| timeline::watch_exits(&old_pids, &done));
        change(k);
        k.rollout_status("kube-system", "daemonset/kilo", "300s");
        done.store(true, Ordering::Relaxed);
        (watcher.join().unwrap(), exits.join().unwrap())
    });
    old_logs.print_tail(6);
    let _ = fs::remove_dir_all(&logs_dir);
    let rolled = restarted.elapsed();
    let after = k.wait_kilo_ready(Duration::from_secs(60));
    for (node, uid) in &before {
        assert_ne!(
            after[node]["metadata"]["uid"].as_str(),
            Some(uid.as_str()),
            "{node}'s kilo pod was not replaced"
        );
    }
    assert!(
        p12.wait_flowing(restarted, Duration::from_secs(60)),
        "n1 -> n2 pod did not resume"
    );
    assert!(
        p21.wait_flowing(restarted, Duration::from_secs(60)),
        "n2 -> n1 pod did not resume"
    );
    std::thread::sleep(Duration::from_secs(2));
    let (g12, g21) = (
        p12.longest_gap_after(restarted),
        p21.longest_gap_after(restarted),
    );
    let windows = [
        p12.longest_gap_window_after(restarted),
        p21.longest_gap_window_after(restarted),
    ];
    drop((p12, p21));
    eprintln!(
        "{what} ({rolled:.1?}): longest ping gap {} -> pod on {}: {g12:.2?}; {} -> pod on {}: {g21:.2?}",
        n1.name, n2.name, n2.name, n1.name
    );
    let parts = timeline::split_rollout_gaps(k, &timeline, restarted, windows, &kg_exits);
    // Most of a rollout's gap is Kubernetes 1.20's: the DaemonSet controller creates the new
    // pod only once the old one is gone from the API, and the kubelet deletes it from its status
    // manager's loop (a 10 s period) after the teardown, at times a minute later on a busy
    // machine; that part is printed, not bounded. kg's own parts are: its exit after SIGTERM
    // (at most the 10 s it gives the API server to say whether its DaemonSet still exists,
    // then the engine's stop) and the new kg's start until traffic flows.
    assert!(
        !parts.is_empty(),
        "no gap was matched to a node's replacement"
    );
    for p in &parts {
        assert!(
            p.exit.is_none_or(|exit| exit < Duration::from_secs(12)),
            "{}: the old kg took {:?} to exit after its pod's deletion",
            p.node,
            p.exit
        );
        assert!(
            p.start_to_traffic < Duration::from_secs(15),
            "{}: traffic came back {:?} after the new kg's container started",
            p.node,
            p.start_to_traffic
        );
    }
    assert_eq!(
        (old_pids.len(), kg_exits.len()),
        (k.nodes.len(), k.nodes.len()),
        "every node's old kg found, then seen exiting: {old_pids:?} {kg_exits:?}"
    );
    // After the restart, the annotations are as before and the mesh works.
    for n in &k.nodes {
        assert_annotated(k, &n.name);
    }
}
