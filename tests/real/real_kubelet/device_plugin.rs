//! kg on a node whose container runtime leaves `/dev/net/tun` out of its default devices
//! (Debian's crun 1.8, as crun was from 2022 to 2025 and runc 1.2.0 to 1.2.3), before and after
//! `manifests/tun-device-plugin.yaml`: first kg exits there with its one line naming the
//! runtime's device rules while the runc node's kg runs; then the device plugin registers
//! `squat.ai/tun` with both kubelets, the patch the manifest's header gives is applied, and the
//! rollout brings kg up on both nodes, unprivileged, with the TUN from the plugin.

use std::fs;
use std::time::Duration;

use super::{manifest, pod_ready, wait_for, walk, KubeletCluster};

/// The resource the plugin offers and kg's patched container asks for.
const RESOURCE: &str = "squat.ai/tun";
/// What kg says when the runtime's device rules deny the TUN.
const DENIED: &str = "the container runtime's device rules leave it out";

/// What kg's container in `pod` logged, every run of it: read from the node's `/var/log/pods`
/// (`kubectl logs` would need the API server to reach the kubelet, which the nodes' network
/// namespaces keep from it).
fn kg_logs(k: &KubeletCluster, pod: &str) -> String {
    let marker = format!("/kube-system_{pod}_");
    walk(&k.dir.join("nodes"))
        .into_iter()
        .filter(|p| {
            let path = p.display().to_string();
            path.contains(&marker) && path.contains("/kilo/") && path.ends_with(".log")
        })
        .map(|p| fs::read_to_string(p).unwrap_or_default())
        .collect()
}

/// The `kubectl patch` body in the manifest's header.
fn documented_patch(text: &str) -> String {
    text.lines()
        .filter_map(|l| l.strip_prefix('#'))
        .find_map(|l| {
            l.trim()
                .strip_prefix('\'')
                .and_then(|p| p.strip_suffix('\''))
        })
        .expect("tun-device-plugin.yaml: no '…' patch in the header")
        .to_string()
}

/// Runs between applying kilo's DaemonSet and waiting for it (see the module's comment).
pub(crate) fn denied_then_given(k: &KubeletCluster) {
    let (runc_node, crun_node) = (&k.nodes[0], &k.nodes[1]);
    wait_for(
        &format!(
            "kg on {} (crun) to name the runtime's rules",
            crun_node.name
        ),
        Duration::from_secs(120),
        || {
            k.kilo_pods()
                .get(&crun_node.name)
                .and_then(|p| p["metadata"]["name"].as_str().map(str::to_string))
                .is_some_and(|pod| kg_logs(k, &pod).contains(DENIED))
        },
    );
    let pods = k.kilo_pods();
    let failing = &pods[&crun_node.name];
    assert!(!pod_ready(failing), "kg Ready on crun without the TUN");
    let logs = kg_logs(k, failing["metadata"]["name"].as_str().unwrap());
    let line = logs.lines().find(|l| l.contains(DENIED)).unwrap();
    eprintln!("{}: kg without the device plugin: {line}", crun_node.name);
    assert!(
        line.contains("/dev/net/tun") && line.contains("device plugin"),
        "{line}"
    );
    wait_for(
        &format!("kg Ready on {} (runc)", runc_node.name),
        Duration::from_secs(120),
        || k.kilo_pods().get(&runc_node.name).is_some_and(pod_ready),
    );

    // The plugin: one pod per node, registered with each kubelet.
    let plugin = manifest("tun-device-plugin.yaml");
    k.apply(&plugin);
    for node in &k.nodes {
        wait_for(
            &format!("{} to offer {RESOURCE}", node.name),
            Duration::from_secs(120),
            || {
                let n = k.json(&["get", "node", &node.name]);
                n["status"]["allocatable"][RESOURCE] == "64"
            },
        );
    }

    // The patch the manifest documents, then the rollout it starts.
    let patch = documented_patch(&plugin);
    k.kubectl_ok(&[
        "-n",
        "kube-system",
        "patch",
        "daemonset",
        "kilo",
        "-p",
        &patch,
    ]);
    k.rollout_status("kube-system", "daemonset/kilo", "240s");
    let pods = k.wait_kilo_ready(Duration::from_secs(120));
    for node in &k.nodes {
        let container = &pods[&node.name]["spec"]["containers"][0];
        assert_eq!(
            container["resources"]["limits"][RESOURCE], "1",
            "{}: kg's pod does not ask for {RESOURCE}: {container}",
            node.name
        );
        assert_ne!(container["securityContext"]["privileged"], true);
    }
    eprintln!(
        "{}: kg Ready with {RESOURCE} from the device plugin",
        crun_node.name
    );
}
