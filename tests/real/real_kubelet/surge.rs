//! A surge rollout under the real scheduler and kubelets, done by hand.
//!
//! Kubernetes 1.22 and later roll a DaemonSet with `maxSurge: 1, maxUnavailable: 0` node by
//! node: create the new pod beside the old one, wait until it is Ready, then delete the old
//! one. The cluster here is 1.20, whose DaemonSet controller cannot surge, so the test does
//! those steps itself with what 1.20 has: a second DaemonSet (`kilo-next`, the same template
//! under one more label) whose pods the scheduler places beside the running ones, and a node
//! label that the first DaemonSet's pods select, removed node by node so that its controller
//! deletes the old pod there (its DaemonSet remains: for the old kg this is a rollout, not an
//! uninstall). What is under test is what a surge controller relies on: the scheduler admits
//! the second pod (no host port in the way), the new kg stands by and turns Ready while the old
//! one runs, and the old pod's deletion hands the engine over.

use std::collections::BTreeMap;
use std::fs;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{pings_across, pod_ready, wait_for, walk, KubeletCluster};

/// The label of the nodes whose old kg pod still runs (the first DaemonSet's nodeSelector).
const OLD_GENERATION: &str = "kilotun.test/old-generation";
/// The label that sets the second DaemonSet's pods apart.
const NEXT_GENERATION: &str = "kilotun.test/generation";

/// Labels every node and makes the first DaemonSet select that label: a change of its pod
/// template, which the DaemonSet controller rolls out as it does `kubectl rollout restart`.
pub(crate) fn select_old_generation(k: &KubeletCluster) {
    for node in &k.nodes {
        k.kubectl_ok(&[
            "label",
            "node",
            &node.name,
            &format!("{OLD_GENERATION}=yes"),
        ]);
    }
    let patch = json!({"spec": {"template": {"spec": {"nodeSelector": {OLD_GENERATION: "yes"}}}}});
    k.kubectl_ok(&[
        "-n",
        "kube-system",
        "patch",
        "daemonset",
        "kilo",
        "--type=merge",
        "-p",
        &patch.to_string(),
    ]);
}

/// The scheduled pods of `selector` in kube-system not being deleted, by node name (one per
/// node).
fn pods_by_node(k: &KubeletCluster, selector: &str) -> BTreeMap<String, Value> {
    let list = k.json(&["-n", "kube-system", "get", "pods", "-l", selector]);
    let mut by_node = BTreeMap::new();
    for pod in list["items"].as_array().into_iter().flatten() {
        let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
        if pod["metadata"]["deletionTimestamp"].is_null() && !node.is_empty() {
            let previous = by_node.insert(node.to_string(), pod.clone());
            assert!(previous.is_none(), "two pods of {selector} on {node}");
        }
    }
    by_node
}

/// How many `TookOver` Events kg posted about Node `node`.
fn took_over(k: &KubeletCluster, node: &str) -> usize {
    let list: serde_json::Value = serde_json::from_str(&k.kubectl_ok(&[
        "get",
        "events.events.k8s.io",
        "-n",
        "kube-system",
        "-o",
        "json",
    ]))
    .unwrap_or_default();
    list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| {
            e["reportingController"] == "kilotun.io/kg"
                && e["reason"] == "TookOver"
                && e["regarding"]["name"] == node
        })
        .count()
}

/// The log of the kilo container of `pod` (from the node's /var/log/pods, as the kubelet
/// writes it: the API server here cannot reach the kubelets' port).
fn kg_log(k: &KubeletCluster, pod: &str) -> String {
    walk(&k.dir.join("nodes"))
        .into_iter()
        .filter(|p| {
            let p = p.display().to_string();
            p.contains(&format!("/kube-system_{pod}_")) && p.contains("/kilo/")
        })
        .map(|p| fs::read_to_string(p).unwrap_or_default())
        .collect()
}

/// The longest gaps of cross-node pings (one way, the other way) while each node's kg is
/// handed over, by node name.
pub(crate) type Gaps = BTreeMap<String, (Duration, Duration)>;

/// Runs the surge node by node, pinging each node's pod from the other, and returns the gaps.
pub(crate) fn surge_by_hand(k: &KubeletCluster, pod_ips: &[String]) -> Gaps {
    let old_selector = format!("app.kubernetes.io/name=kilo,!{NEXT_GENERATION}");
    let next_selector = format!("app.kubernetes.io/name=kilo,{NEXT_GENERATION}=next");
    let old = pods_by_node(k, &old_selector);
    assert_eq!(old.len(), k.nodes.len(), "an old kg on every node");

    // The second DaemonSet: the first one's spec, one more label, no nodeSelector.
    let ds = k.json(&["-n", "kube-system", "get", "daemonset", "kilo"]);
    let mut spec = ds["spec"].clone();
    spec["selector"]["matchLabels"][NEXT_GENERATION] = json!("next");
    spec["template"]["metadata"]["labels"][NEXT_GENERATION] = json!("next");
    if let Some(pod) = spec["template"]["spec"].as_object_mut() {
        pod.remove("nodeSelector");
    }
    let next = json!({
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "kilo-next", "namespace": "kube-system"},
        "spec": spec,
    });
    let started = Instant::now();
    k.apply(&next.to_string());

    // The scheduler places a second kg pod on every node, and each turns Ready while the old
    // one runs: it answers /health on the shared port and stands by.
    let deadline = Instant::now() + Duration::from_secs(180);
    let next_pods = loop {
        let pods = pods_by_node(k, &next_selector);
        if k.nodes
            .iter()
            .all(|n| pods.get(&n.name).is_some_and(pod_ready))
        {
            break pods;
        }
        assert!(
            Instant::now() < deadline,
            "the surge pods are not Ready beside the old ones (a host port in the pod spec \
             keeps the scheduler from placing them):\n{}\n{}",
            k.kubectl_ok(&["-n", "kube-system", "get", "pods", "-o", "wide"]),
            k.kubectl_ok(&["-n", "kube-system", "get", "events"])
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    eprintln!(
        "surge: a second kg Ready on every node after {:.1?}",
        started.elapsed()
    );
    // Ready beside the old kg, and none took over: each stands by.
    for (node, pod) in &next_pods {
        let name = pod["metadata"]["name"].as_str().unwrap_or_default();
        assert_eq!(
            took_over(k, node),
            0,
            "{node}: {name} took over while the old kg ran:\n{}",
            kg_log(k, name)
        );
    }

    let (n1, n2) = (&k.nodes[0], &k.nodes[1]);
    let (p12, p21) = pings_across(k, pod_ips, "before the surge's handovers");
    let mut gaps = Gaps::new();
    for node in &k.nodes {
        let old_pod = old[&node.name]["metadata"]["name"].as_str().unwrap();
        let next_pod = next_pods[&node.name]["metadata"]["name"].as_str().unwrap();
        let handover = Instant::now();
        // What the surge controller does once the new pod is available: delete the old one.
        k.kubectl_ok(&["label", "node", &node.name, &format!("{OLD_GENERATION}-")]);
        wait_for(
            &format!("{old_pod} gone from {}", node.name),
            Duration::from_secs(90),
            || !pods_by_node(k, &old_selector).contains_key(&node.name),
        );
        wait_for(
            &format!("{next_pod} taking over on {}", node.name),
            Duration::from_secs(30),
            || took_over(k, &node.name) == 1,
        );
        assert!(
            p12.wait_flowing(handover, Duration::from_secs(30))
                && p21.wait_flowing(handover, Duration::from_secs(30)),
            "pings across did not resume after {old_pod} handed over to {next_pod}"
        );
        std::thread::sleep(Duration::from_secs(2));
        let gap = (
            p12.longest_gap_after(handover),
            p21.longest_gap_after(handover),
        );
        eprintln!(
            "surge handover on {} ({old_pod} -> {next_pod}, old pod gone after {:.1?}): longest \
             ping gap {} -> {}: {:.2?}, {} -> {}: {:.2?}",
            node.name,
            handover.elapsed(),
            n1.name,
            n2.name,
            gap.0,
            n2.name,
            n1.name,
            gap.1
        );
        gaps.insert(node.name.clone(), gap);
    }
    gaps
}
