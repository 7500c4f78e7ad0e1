//! The node table: per-object translation, readiness flips, and the `changed` flag.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::*;
use crate::fixtures::{kube_node, synthetic_cluster, NOW};
use crate::node::{annotation, DEFAULT_TOPOLOGY_LABEL};

fn table(nodes: &[Node]) -> NodeTable {
    let mut t = NodeTable::new(DEFAULT_TOPOLOGY_LABEL);
    t.advance(NOW);
    for (i, n) in nodes.iter().enumerate() {
        t.update(&n.name, Some(&Arc::new(kube_node(n, i as u64 + 1))));
    }
    t
}

fn with_last_seen(node: &Node, last_seen: i64, rv: u64) -> Arc<KubeNode> {
    let mut node = node.clone();
    node.last_seen = last_seen;
    Arc::new(kube_node(&node, rv))
}

#[test]
fn translations_match_translate_node_and_new_nodes_are_changes() {
    let nodes = synthetic_cluster(20, 4);
    let mut t = table(&nodes);
    assert!(t.take_changed(), "nodes were added");
    assert!(!t.take_changed(), "the flag is cleared once taken");
    assert_eq!(t.len(), 20);
    for (n, (translated, ready)) in nodes.iter().zip(t.iter()) {
        assert_eq!(translated, n);
        assert!(ready);
    }
}

#[test]
fn a_check_in_that_flips_no_readiness_is_no_change() {
    let nodes = synthetic_cluster(10, 2);
    let mut t = table(&nodes);
    t.take_changed();
    let problems = t.update(
        &nodes[3].name,
        Some(&with_last_seen(&nodes[3], NOW + 30, 100)),
    );
    assert_eq!(problems, None, "a check-in alone is not translated");
    assert!(!t.take_changed());
    assert_eq!(t.get(&nodes[3].name).unwrap().last_seen, NOW + 30);
    // The same resourceVersion again is not even translated.
    let again = with_last_seen(&nodes[3], NOW + 31, 100);
    assert_eq!(t.update(&nodes[3].name, Some(&again)), None);
    assert_eq!(t.get(&nodes[3].name).unwrap().last_seen, NOW + 30);
}

#[test]
fn a_check_in_alone_is_taken_without_translation_and_anything_more_is_translated() {
    let nodes = synthetic_cluster(6, 2);
    let mut t = table(&nodes);
    t.take_changed();
    // A check-in alone: what translating would give, readiness and deadline moved.
    let object = with_last_seen(&nodes[1], NOW + 45, 200);
    assert_eq!(t.update(&nodes[1].name, Some(&object)), None);
    let (translated, _) = translate_node(&object, DEFAULT_TOPOLOGY_LABEL);
    assert_eq!(t.get(&nodes[1].name), Some(&translated));
    t.advance(NOW + READY_WINDOW_SECS + 1);
    assert!(t.take_changed(), "the others expired");
    let ready: Vec<bool> = t.iter().map(|(_, r)| r).collect();
    assert_eq!(ready.iter().filter(|r| **r).count(), 1, "{ready:?}");
    // A check-in that brings a Node back is a change.
    let back = with_last_seen(&nodes[2], NOW + READY_WINDOW_SECS + 1, 201);
    assert_eq!(t.update(&nodes[2].name, Some(&back)), None);
    assert!(t.take_changed());
    // A check-in with another annotation changed is translated.
    let mut moved = nodes[3].clone();
    moved.last_seen = NOW + READY_WINDOW_SECS + 1;
    moved.location = "elsewhere".into();
    let object = Arc::new(kube_node(&moved, 202));
    assert_eq!(t.update(&moved.name, Some(&object)), Some(vec![]));
    assert_eq!(t.get(&moved.name).unwrap().location, "elsewhere");
    // A check-in that does not parse is translated, and reported.
    let mut bad = (*with_last_seen(&nodes[4], NOW, 203)).clone();
    bad.metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(annotation::LAST_SEEN.into(), "yesterday".into());
    let problems = t.update(&nodes[4].name, Some(&Arc::new(bad))).unwrap();
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].annotation, annotation::LAST_SEEN);
}

#[test]
fn a_changed_location_or_a_removed_node_is_a_change() {
    let nodes = synthetic_cluster(10, 2);
    let mut t = table(&nodes);
    t.take_changed();
    let mut moved = nodes[4].clone();
    moved.location = "elsewhere".into();
    t.update(&moved.name, Some(&Arc::new(kube_node(&moved, 200))));
    assert!(t.take_changed());
    assert_eq!(t.get(&moved.name).unwrap().location, "elsewhere");
    t.update(&moved.name, None);
    assert!(t.take_changed());
    assert!(t.get(&moved.name).is_none());
    t.update(&moved.name, None);
    assert!(!t.take_changed(), "removing an absent node changes nothing");
}

#[test]
fn check_ins_expire_at_their_deadline_and_come_back_with_a_new_one() {
    let nodes = synthetic_cluster(3, 1);
    let mut t = table(&nodes);
    t.update(
        &nodes[1].name,
        Some(&with_last_seen(&nodes[1], NOW + 20, 50)),
    );
    t.take_changed();
    t.advance(NOW + READY_WINDOW_SECS - 1);
    assert!(!t.take_changed(), "every check-in is still young enough");
    t.advance(NOW + READY_WINDOW_SECS);
    assert!(t.take_changed(), "nodes 0 and 2 expired");
    let ready: Vec<bool> = t.iter().map(|(_, r)| r).collect();
    assert_eq!(ready, [false, true, false]);
    t.advance(NOW + READY_WINDOW_SECS + 20);
    assert!(t.take_changed(), "node 1 expired");
    t.update(
        &nodes[0].name,
        Some(&with_last_seen(&nodes[0], NOW + 100, 51)),
    );
    assert!(t.take_changed(), "node 0 checked in again: ready");
    assert!(t.iter().next().unwrap().1);
}

#[test]
fn a_clock_that_goes_back_judges_every_node_again() {
    let nodes = synthetic_cluster(2, 1);
    let mut t = table(&nodes);
    t.advance(NOW + 100);
    assert!(t.take_changed());
    assert!(t.iter().all(|(_, r)| !r));
    t.advance(NOW);
    assert!(t.take_changed());
    assert!(t.iter().all(|(_, r)| r));
}

#[test]
fn objects_without_resource_version_are_compared_whole() {
    let nodes = synthetic_cluster(2, 1);
    let mut t = NodeTable::new(DEFAULT_TOPOLOGY_LABEL);
    t.advance(NOW);
    let mut object = kube_node(&nodes[0], 1);
    object.metadata.resource_version = None;
    t.update(&nodes[0].name, Some(&Arc::new(object.clone())));
    assert_eq!(
        t.update(&nodes[0].name, Some(&Arc::new(object.clone()))),
        None
    );
    object
        .metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(annotation::LOCATION.into(), "moved".into());
    assert!(t.update(&nodes[0].name, Some(&Arc::new(object))).is_some());
    assert_eq!(t.get(&nodes[0].name).unwrap().location, "moved");
}

#[test]
fn sync_removes_what_is_gone_and_translates_only_what_changed() {
    let nodes = synthetic_cluster(5, 1);
    let mut t = table(&nodes);
    t.take_changed();
    let mut objects: BTreeMap<String, Arc<KubeNode>> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.clone(), Arc::new(kube_node(n, i as u64 + 1))))
        .collect();
    objects.remove(&nodes[0].name);
    let mut moved = nodes[1].clone();
    moved.location = "elsewhere".into();
    objects.insert(nodes[1].name.clone(), Arc::new(kube_node(&moved, 99)));
    // A check-in: a new object, taken without translation.
    objects.insert(
        nodes[2].name.clone(),
        with_last_seen(&nodes[2], NOW + 5, 98),
    );
    let translated = t.sync(&objects);
    assert_eq!(translated.len(), 1, "only node 1 changed beyond a check-in");
    assert_eq!(t.get(&nodes[2].name).unwrap().last_seen, NOW + 5);
    assert_eq!(translated[0].0, nodes[1].name);
    assert!(t.take_changed(), "node 0 is gone");
    assert_eq!(t.len(), 4);
}

#[test]
fn readiness_flips_and_node_changes_are_told_apart() {
    let nodes = synthetic_cluster(6, 2);
    let mut t = table(&nodes);
    assert_eq!(
        t.take_changes(),
        TableChanges {
            nodes: true,
            readiness: false
        },
        "nodes added"
    );
    // Every check-in expires but node 1's: readiness only.
    let object = with_last_seen(&nodes[1], NOW + 45, 300);
    t.update(&nodes[1].name, Some(&object));
    t.advance(NOW + READY_WINDOW_SECS + 1);
    assert_eq!(
        t.take_changes(),
        TableChanges {
            nodes: false,
            readiness: true
        }
    );
    // Node 2 checks in again: readiness only.
    let back = with_last_seen(&nodes[2], NOW + READY_WINDOW_SECS + 1, 301);
    t.update(&nodes[2].name, Some(&back));
    assert_eq!(
        t.take_changes(),
        TableChanges {
            nodes: false,
            readiness: true
        }
    );
    // Node 3 moves location as it checks in again: both.
    let mut moved = nodes[3].clone();
    moved.last_seen = NOW + READY_WINDOW_SECS + 1;
    moved.location = "elsewhere".into();
    t.update(&moved.name, Some(&Arc::new(kube_node(&moved, 302))));
    assert_eq!(
        t.take_changes(),
        TableChanges {
            nodes: true,
            readiness: true
        }
    );
    // Node 4 is deleted: a node change.
    t.update(&nodes[4].name, None);
    assert_eq!(
        t.take_changes(),
        TableChanges {
            nodes: true,
            readiness: false
        }
    );
    assert!(!t.take_changes().any());
}

#[test]
fn pod_ranges_from_an_ipam_source_replace_the_nodes_own_and_touch_only_what_moved() {
    let nodes = synthetic_cluster(3, 1);
    let mut t = table(&nodes);
    t.take_changes();
    let net = |s: &str| s.parse::<IpNet>().unwrap();
    let mut ranges: PodRangeMap = BTreeMap::new();
    ranges.insert(
        nodes[0].name.clone(),
        vec![net("10.244.0.0/26"), net("10.244.0.64/26")],
    );
    ranges.insert(nodes[1].name.clone(), vec![net("10.244.1.0/26")]);
    t.set_pod_ranges(Some(ranges.clone()));
    let changes = t.take_changes();
    assert!(changes.nodes, "every node's ranges moved");
    let first = t.get(&nodes[0].name).unwrap();
    assert_eq!(first.subnet, Some(net("10.244.0.0/26")));
    assert_eq!(first.extra_subnets, vec![net("10.244.0.64/26")]);
    // The third node holds no range: not ready, as a Node without a pod CIDR in Kilo.
    assert_eq!(t.get(&nodes[2].name).unwrap().subnet, None);
    assert!(changes.readiness);
    assert_eq!(t.iter().filter(|(_, ready)| *ready).count(), 2);
    // The same ranges again: nothing moves.
    t.set_pod_ranges(Some(ranges.clone()));
    assert!(!t.take_changes().any());
    // A node re-translated (its object changed) keeps the source's ranges.
    let mut moved = nodes[1].clone();
    moved.location = "elsewhere".into();
    t.update(&moved.name, Some(&Arc::new(kube_node(&moved, 99))));
    assert_eq!(
        t.get(&moved.name).unwrap().subnet,
        Some(net("10.244.1.0/26"))
    );
    t.take_changes();
    // Back to the Nodes' own spec.podCIDRs.
    t.set_pod_ranges(None);
    assert!(t.take_changes().nodes);
    assert_eq!(t.get(&nodes[0].name).unwrap().subnet, nodes[0].subnet);
    assert_eq!(t.get(&nodes[2].name).unwrap().subnet, nodes[2].subnet);
    assert_eq!(t.iter().filter(|(_, ready)| *ready).count(), 3);
}
