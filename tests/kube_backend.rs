//! The Kubernetes backend against an in-process fake API server over real HTTP: list, watch,
//! merge patch, and a Peer CRD that is missing at first. No root needed.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::fake_kube::FakeKube;
use kilotun::backend::kube::{client_config, KubeBackend};
use kilotun::backend::Snapshot;
use serde_json::json;
use tokio::sync::watch;

fn node(name: &str, pod_cidr: &str) -> serde_json::Value {
    json!({"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": name, "annotations": {"kilo.squat.ai/location": "east"}},
           "spec": {"podCIDR": pod_cidr}})
}

async fn wait_for(
    rx: &mut watch::Receiver<Arc<Snapshot>>,
    what: &str,
    check: impl Fn(&Snapshot) -> bool,
) -> Arc<Snapshot> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
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
async fn nodes_and_peers_are_watched_and_annotations_patched() {
    let api = FakeKube::start();
    api.put_node(node("n1", "10.42.1.0/24"));
    api.put_node(node("n2", "10.42.2.0/24"));
    let config = client_config("", &api.url).await.unwrap();
    let backend = KubeBackend::start(config).unwrap();
    let mut rx = backend.subscribe();

    // The initial list, without Peers: the CRD is not installed, and kg keeps running.
    let snap = wait_for(&mut rx, "the initial node list", |s| s.nodes.len() == 2).await;
    assert!(snap.peers.is_empty());
    assert_eq!(
        snap.nodes["n2"].spec.as_ref().unwrap().pod_cidr.as_deref(),
        Some("10.42.2.0/24")
    );

    // Watch events: a new node, a changed node, a deleted node.
    api.put_node(node("n3", "10.42.3.0/24"));
    wait_for(&mut rx, "n3 to be added", |s| s.nodes.contains_key("n3")).await;
    api.delete_node("n2");
    wait_for(&mut rx, "n2 to be deleted", |s| !s.nodes.contains_key("n2")).await;

    // Patching our own annotations: set and remove, seen back through the watch.
    let changes = BTreeMap::from([
        (
            "kilo.squat.ai/key".to_string(),
            Some("a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=".to_string()),
        ),
        ("kilo.squat.ai/location".to_string(), None),
    ]);
    backend.patch_annotations("n1", &changes).await.unwrap();
    let stored = api.node("n1").unwrap();
    assert_eq!(
        stored["metadata"]["annotations"]["kilo.squat.ai/key"],
        "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="
    );
    assert!(stored["metadata"]["annotations"]
        .get("kilo.squat.ai/location")
        .is_none());
    assert_eq!(api.patches().len(), 1);
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
    api.install_peer_crd();
    api.put_peer(json!({"apiVersion": "kilo.squat.ai/v1alpha1", "kind": "Peer", "metadata": {"name": "laptop"},
                        "spec": {"allowedIPs": ["10.5.0.1/32"], "publicKey": "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
                                 "persistentKeepalive": 10}}));
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
