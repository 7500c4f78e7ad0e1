//! The Node watch's handling of events, without an API server.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use kube::runtime::watcher::Event;
use tokio::sync::watch;

use super::slim::{SlimNode, SlimSpec};
use super::{NodeWatch, Snapshot};
use crate::backend::pace::{Pace, NOTIFY_INTERVAL};

fn node(name: &str, resource_version: &str, last_seen: &str) -> SlimNode {
    let mut n = SlimNode::default();
    n.metadata.name = Some(name.to_string());
    n.metadata.resource_version = Some(resource_version.to_string());
    n.metadata.annotations = Some(BTreeMap::from([(
        "kilo.squat.ai/last-seen".to_string(),
        last_seen.to_string(),
    )]));
    n.spec = Some(SlimSpec {
        pod_cidr: Some("10.42.1.0/24".to_string()),
        ..SlimSpec::default()
    });
    n
}

fn watch() -> (NodeWatch, watch::Receiver<Arc<Snapshot>>) {
    let (tx, rx) = watch::channel(Arc::new(Snapshot::default()));
    let nodes = NodeWatch {
        tx,
        healthy: Arc::new(AtomicBool::new(true)),
        pending: None,
        relists: Default::default(),
        pace: Pace::new(NOTIFY_INTERVAL),
    };
    (nodes, rx)
}

fn last_seen(snapshot: &Snapshot, name: &str) -> String {
    snapshot.nodes[name].metadata.annotations.as_ref().unwrap()["kilo.squat.ai/last-seen"].clone()
}

#[test]
fn a_burst_is_applied_at_once_and_announced_once() {
    let (mut nodes, mut rx) = watch();
    nodes.handle(Ok(Event::Init));
    nodes.handle(Ok(Event::InitApply(node("a", "1", "100"))));
    nodes.handle(Ok(Event::InitDone));
    assert!(rx.has_changed().unwrap(), "the list is announced at once");
    assert_eq!(rx.borrow_and_update().nodes.len(), 1);

    // The first change after the list falls within the interval: held back, but in place.
    nodes.handle(Ok(Event::Apply(node("a", "2", "130"))));
    nodes.handle(Ok(Event::Apply(node("b", "3", "131"))));
    assert!(!rx.has_changed().unwrap());
    assert!(nodes.pace.due().is_some());
    assert_eq!(last_seen(&rx.borrow(), "a"), "130");
    assert_eq!(rx.borrow().changes.since(1).unwrap().count(), 2);

    nodes.notify();
    assert!(rx.has_changed().unwrap());
    assert!(nodes.pace.due().is_none());
    rx.borrow_and_update();

    // A re-sent identical object changes nothing and holds nothing back.
    nodes.handle(Ok(Event::Apply(node("a", "2", "130"))));
    assert!(nodes.pace.due().is_none());
    assert!(!rx.has_changed().unwrap());

    // A deletion is a change like any other.
    nodes.handle(Ok(Event::Delete(node("b", "4", "131"))));
    assert!(nodes.pace.due().is_some());
    assert!(!rx.borrow().nodes.contains_key("b"));
}

#[test]
fn the_first_node_list_is_news_even_when_empty_and_a_same_relist_is_not() {
    let (mut nodes, mut rx) = watch();
    assert!(!rx.borrow().listed.nodes);
    nodes.handle(Ok(Event::Init));
    nodes.handle(Ok(Event::InitDone));
    assert!(rx.has_changed().unwrap(), "an empty cluster is listed too");
    let listed = rx.borrow_and_update().listed;
    assert!(listed.nodes && !listed.peers && !listed.leases);
    assert_eq!(nodes.relists.get(), 0, "the first list is no re-list");
    nodes.handle(Ok(Event::Init));
    nodes.handle(Ok(Event::InitDone));
    assert!(
        !rx.has_changed().unwrap(),
        "the same empty list again is no news"
    );
    assert_eq!(nodes.relists.get(), 1, "but it is counted");
}

#[test]
fn slim_nodes_reach_the_snapshot_as_kubernetes_nodes() {
    let (mut nodes, rx) = watch();
    nodes.handle(Ok(Event::Apply(node("a", "1", "100"))));
    let snapshot = rx.borrow();
    let a = &snapshot.nodes["a"];
    assert_eq!(
        a.spec.as_ref().unwrap().pod_cidr.as_deref(),
        Some("10.42.1.0/24")
    );
    assert_eq!(a.metadata.resource_version.as_deref(), Some("1"));
}
