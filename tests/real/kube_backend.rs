//! The Kubernetes backend against a real kube-apiserver (see `tests/common/real_kube.rs`),
//! authenticated as the `kilo` ServiceAccount of `manifests/rbac.yaml`: the initial list, watch
//! events, merge patches of kg's own annotations, and a Peer CRD that is missing at first.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::real_kube::RealKube;
use kilotun::backend::kube::{client_config, KubeBackend};
use kilotun::backend::Snapshot;
use tokio::sync::watch;

fn node(name: &str, pod_cidr: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\n  annotations:\n    kilo.squat.ai/location: east\nspec:\n  podCIDR: {pod_cidr}\n"
    )
}

async fn wait_for(
    rx: &mut watch::Receiver<Arc<Snapshot>>,
    what: &str,
    check: impl Fn(&Snapshot) -> bool,
) -> Arc<Snapshot> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let snapshot = rx.borrow_and_update().clone();
        if check(&snapshot) {
            return snapshot;
        }
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            _ => panic!("timed out waiting for {what}; last snapshot: {snapshot:#?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the real kube-apiserver .ci/run builds"]
async fn nodes_and_peers_are_watched_and_annotations_patched() {
    let test = "nodes_and_peers_are_watched_and_annotations_patched";
    let Some(kube) = RealKube::start(test) else {
        return;
    };
    // The manifests' ServiceAccount and ClusterRole, but no Peer CRD yet.
    kube.apply_manifest("rbac.yaml");
    kube.apply(&node("n1", "10.42.1.0/24"));
    kube.apply(&node("n2", "10.42.2.0/24"));
    let kubeconfig = kube.dir.join("kilo.kubeconfig");
    kube.write_kubeconfig(
        &kubeconfig,
        &kube.service_account_token("kube-system", "kilo"),
    );
    let config = client_config(kubeconfig.to_str().unwrap(), "")
        .await
        .unwrap();
    let backend = KubeBackend::start(config, false).unwrap();
    let mut rx = backend.subscribe();

    // The initial list, without Peers: the CRD is not installed, and kg keeps running.
    let snap = wait_for(&mut rx, "the initial node list", |s| s.nodes.len() == 2).await;
    assert!(snap.peers.is_empty());
    assert_eq!(
        snap.nodes["n2"].spec.as_ref().unwrap().pod_cidr.as_deref(),
        Some("10.42.2.0/24")
    );
    // Decoded through the slim Node: what kg reads, not the API server's bookkeeping.
    let n2 = &snap.nodes["n2"].metadata;
    assert!(n2.resource_version.is_some() && n2.uid.is_some());
    assert_eq!(n2.managed_fields, None);
    assert_eq!(n2.creation_timestamp, None);

    // Watch events: a new node, a deleted node.
    kube.apply(&node("n3", "10.42.3.0/24"));
    wait_for(&mut rx, "n3 to be added", |s| s.nodes.contains_key("n3")).await;
    kube.kubectl(&["delete", "node", "n2"]);
    wait_for(&mut rx, "n2 to be deleted", |s| !s.nodes.contains_key("n2")).await;

    // Patching our own annotations: set and remove, stored and seen back through the watch.
    let changes = BTreeMap::from([
        (
            "kilo.squat.ai/key".to_string(),
            Some("a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=".to_string()),
        ),
        ("kilo.squat.ai/location".to_string(), None),
    ]);
    backend.patch_annotations("n1", &changes).await.unwrap();
    let stored = kube.get(&["node", "n1"]);
    assert_eq!(
        stored["metadata"]["annotations"]["kilo.squat.ai/key"],
        "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
    );
    assert!(stored["metadata"]["annotations"]
        .get("kilo.squat.ai/location")
        .is_none());
    wait_for(&mut rx, "the patch to come back through the watch", |s| {
        s.nodes["n1"]
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| {
                a.contains_key("kilo.squat.ai/key") && !a.contains_key("kilo.squat.ai/location")
            })
    })
    .await;

    // The CRD gets installed later: Peers appear without a restart.
    kube.apply_manifest("crds.yaml");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let peer = "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: laptop\nspec:\n  allowedIPs:\n  - 10.5.0.1/32\n  publicKey: a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n  persistentKeepalive: 10\n";
    // The CRD is served a moment after it is created.
    while !kube
        .kubectl_output(&["apply", "-f", "-"], Some(peer))
        .status
        .success()
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the Peer CRD is not served"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let snap = wait_for(&mut rx, "the Peer after the CRD appeared", |s| {
        s.peers.contains_key("laptop")
    })
    .await;
    assert_eq!(snap.peers["laptop"].spec.persistent_keepalive, Some(10));
    assert_eq!(snap.peers["laptop"].validate(), Ok(()));

    // Patching a node that does not exist is an error naming it.
    let err = backend
        .patch_annotations("ghost", &changes)
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("ghost"), "{err:#}");
}
