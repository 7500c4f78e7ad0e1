//! The cluster's Nodes as kg last translated them, kept up to date one object at a time.
//!
//! In a Kilo cluster every node patches its `last-seen` annotation every 30 s, so at 5,000 nodes
//! some 167 Node updates a second arrive that change nothing but a check-in time (the churn
//! behind Kilo issues #135 and #304). The table re-translates only the object that changed
//! (same `resourceVersion`, or the same object where there is none, is skipped), treats
//! readiness as a value derived from the translation and the readiness clock, and records a
//! change only when something the mesh depends on moved: a Node added or removed or a
//! translated field other than `last_seen` ([`TableChanges::nodes`]), or a readiness flip
//! ([`TableChanges::readiness`], which kg may batch: see `control::coalesce`). Check-ins that expire are found
//! through a deadline index, so time passing costs nothing until a deadline is reached.
//!
//! Pure: no I/O; the readiness time comes in as an argument.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node as KubeNode;

use crate::node::{translate_node, AnnotationProblem, Node, READY_WINDOW_SECS};

#[derive(Debug, Clone)]
struct Entry {
    object: Arc<KubeNode>,
    node: Node,
    ready: bool,
    /// The pod CIDRs the object itself gives (`spec.podCIDRs`), as translated; the node's
    /// own unless an IPAM source overrides them ([`NodeTable::set_pod_ranges`]).
    spec_ranges: (Option<IpNet>, Vec<IpNet>),
}

/// Puts `ranges` (an IPAM source's map of every node's pod ranges; `None`: the Node's own,
/// `spec`) into `node`: the first as its pod CIDR, the rest beside it.
fn overlay(node: &mut Node, spec: &(Option<IpNet>, Vec<IpNet>), ranges: Option<&PodRangeMap>) {
    match ranges {
        Some(ranges) => crate::ipam::set_pod_ranges(node, ranges),
        None => (node.subnet, node.extra_subnets) = spec.clone(),
    }
}

/// Every node's pod ranges, by node name, from an IPAM source ([`crate::ipam`]).
pub type PodRangeMap = BTreeMap<String, Vec<IpNet>>;

/// Every Node's translation and readiness, updated per object.
#[derive(Debug, Clone)]
pub struct NodeTable {
    topology_label: String,
    entries: BTreeMap<String, Entry>,
    /// `(last_seen + READY_WINDOW_SECS, name)` of every ready Node: it stops being ready then.
    deadlines: BTreeSet<(i64, String)>,
    now: i64,
    changes: TableChanges,
    /// The pod ranges of every node from an IPAM source, in place of the Nodes' own.
    pod_ranges: Option<PodRangeMap>,
}

/// What moved in a [`NodeTable`] since the changes were last taken.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableChanges {
    /// A Node was added or removed, or a translated field other than `last_seen` changed.
    pub nodes: bool,
    /// A Node became ready or stopped being ready (its check-in came back or expired).
    pub readiness: bool,
}

impl TableChanges {
    /// True when anything moved.
    pub fn any(self) -> bool {
        self.nodes || self.readiness
    }
}

/// True when `a` and `b` differ in more than `last_seen` (`b` is borrowed mutably only to
/// compare without a copy; it is left as it was).
pub fn differs_beyond_check_in(a: &Node, b: &mut Node) -> bool {
    let last_seen = std::mem::replace(&mut b.last_seen, a.last_seen);
    let differs = a != b;
    b.last_seen = last_seen;
    differs
}

/// True when `object` is known to be the same Node as `old` without translating it.
fn same_object(old: &Arc<KubeNode>, object: &Arc<KubeNode>) -> bool {
    if Arc::ptr_eq(old, object) {
        return true;
    }
    match (
        &old.metadata.resource_version,
        &object.metadata.resource_version,
    ) {
        (Some(a), Some(b)) => a == b,
        _ => **old == **object,
    }
}

/// The `last-seen` of `object` (Unix seconds) when it differs from `old` in nothing but that
/// annotation and its `resourceVersion`: a Kilo check-in, which needs no translation. `None`
/// when anything else differs or either check-in does not parse (then the object is
/// translated, and a bad value reported as ever).
fn check_in_only(old: &KubeNode, object: &KubeNode) -> Option<i64> {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let key = crate::node::annotation::LAST_SEEN;
    // Every field named, so a field added to ObjectMeta cannot be forgotten here.
    let ObjectMeta {
        annotations,
        creation_timestamp,
        deletion_grace_period_seconds,
        deletion_timestamp,
        finalizers,
        generate_name,
        generation,
        labels,
        managed_fields,
        name,
        namespace,
        owner_references,
        resource_version: _,
        self_link,
        uid,
    } = &object.metadata;
    let o = &old.metadata;
    let same = old.spec == object.spec
        && old.status == object.status
        && *creation_timestamp == o.creation_timestamp
        && *deletion_grace_period_seconds == o.deletion_grace_period_seconds
        && *deletion_timestamp == o.deletion_timestamp
        && *finalizers == o.finalizers
        && *generate_name == o.generate_name
        && *generation == o.generation
        && *labels == o.labels
        && *managed_fields == o.managed_fields
        && *name == o.name
        && *namespace == o.namespace
        && *owner_references == o.owner_references
        && *self_link == o.self_link
        && *uid == o.uid;
    if !same {
        return None;
    }
    let (now, then) = (annotations.as_ref()?, o.annotations.as_ref()?);
    let parse = |a: &std::collections::BTreeMap<String, String>| a.get(key)?.parse::<i64>().ok();
    let seen = parse(now)?;
    parse(then)?;
    let others_equal = now.len() == then.len()
        && now
            .iter()
            .zip(then.iter())
            .all(|((k, v), (k0, v0))| k == k0 && (v == v0 || k == key));
    others_equal.then_some(seen)
}

impl NodeTable {
    /// An empty table translating with `topology_label` (`--topology-label`).
    pub fn new(topology_label: &str) -> Self {
        Self {
            topology_label: topology_label.to_string(),
            entries: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            now: 0,
            changes: TableChanges::default(),
            pod_ranges: None,
        }
    }

    /// Takes every node's pod ranges from `ranges` (an IPAM source's; `None`: from the Nodes'
    /// `spec.podCIDRs` again). Only the nodes whose ranges change are touched, and their
    /// readiness judged again (a node with no pod range is not ready, as in Kilo).
    pub fn set_pod_ranges(&mut self, ranges: Option<PodRangeMap>) {
        if self.pod_ranges == ranges {
            return;
        }
        self.pod_ranges = ranges;
        let names: Vec<String> = self.entries.keys().cloned().collect();
        for name in names {
            let Some(mut entry) = self.entries.remove(&name) else {
                continue;
            };
            let before = (entry.node.subnet, entry.node.extra_subnets.clone());
            overlay(
                &mut entry.node,
                &entry.spec_ranges,
                self.pod_ranges.as_ref(),
            );
            if (entry.node.subnet, &entry.node.extra_subnets) != (before.0, &before.1) {
                self.changes.nodes = true;
                self.forget_deadline(&name, &entry);
                let ready = entry.node.is_ready(self.now);
                self.changes.readiness |= ready != entry.ready;
                entry.ready = ready;
                if ready {
                    self.deadlines.insert((deadline(&entry.node), name.clone()));
                }
            }
            self.entries.insert(name, entry);
        }
    }

    /// Brings Node `name` to `object` (`None`: it is gone). Returns the Node's annotation
    /// problems when it was translated again, `None` when nothing was translated.
    pub fn update(
        &mut self,
        name: &str,
        object: Option<&Arc<KubeNode>>,
    ) -> Option<Vec<AnnotationProblem>> {
        let Some(object) = object else {
            if let Some(old) = self.entries.remove(name) {
                self.forget_deadline(name, &old);
                self.changes.nodes = true;
            }
            return None;
        };
        if let Some(old) = self.entries.get(name) {
            if same_object(&old.object, object) {
                return None;
            }
        }
        if let Some(seen) = self
            .entries
            .get(name)
            .and_then(|old| check_in_only(&old.object, object))
        {
            self.check_in(name, object, seen);
            return None;
        }
        let (mut node, problems) = translate_node(object, &self.topology_label);
        let spec_ranges = (node.subnet, node.extra_subnets.clone());
        overlay(&mut node, &spec_ranges, self.pod_ranges.as_ref());
        let ready = node.is_ready(self.now);
        match self.entries.remove(name) {
            Some(old) => {
                self.forget_deadline(name, &old);
                self.changes.readiness |= old.ready != ready;
                self.changes.nodes |= differs_beyond_check_in(&old.node, &mut node);
            }
            None => self.changes.nodes = true,
        }
        if ready {
            self.deadlines.insert((deadline(&node), name.to_string()));
        }
        self.entries.insert(
            name.to_string(),
            Entry {
                object: Arc::clone(object),
                node,
                ready,
                spec_ranges,
            },
        );
        Some(problems)
    }

    /// A check-in of Node `name` (its entry exists): the new object and `last_seen`, its
    /// readiness and deadline moved, a change recorded only if its readiness flipped.
    fn check_in(&mut self, name: &str, object: &Arc<KubeNode>, last_seen: i64) {
        let Some(mut entry) = self.entries.remove(name) else {
            return;
        };
        self.forget_deadline(name, &entry);
        entry.object = Arc::clone(object);
        entry.node.last_seen = last_seen;
        let ready = entry.node.is_ready(self.now);
        self.changes.readiness |= ready != entry.ready;
        entry.ready = ready;
        if ready {
            self.deadlines
                .insert((deadline(&entry.node), name.to_string()));
        }
        self.entries.insert(name.to_string(), entry);
    }

    /// Brings the whole table to `objects` (after a re-list, or when a reader fell behind):
    /// every name is visited, but only changed objects are translated again. Returns the
    /// problems of each Node translated again.
    pub fn sync(
        &mut self,
        objects: &BTreeMap<String, Arc<KubeNode>>,
    ) -> Vec<(String, Vec<AnnotationProblem>)> {
        let gone: Vec<String> = self
            .entries
            .keys()
            .filter(|n| !objects.contains_key(*n))
            .cloned()
            .collect();
        for name in gone {
            self.update(&name, None);
        }
        objects
            .iter()
            .filter_map(|(name, object)| Some((name.clone(), self.update(name, Some(object))?)))
            .collect()
    }

    /// Moves the readiness time to `now`: Nodes whose check-in is now too old stop being ready.
    /// Costs nothing until the earliest deadline is reached; a clock that went backwards makes
    /// every Node judged again.
    pub fn advance(&mut self, now: i64) {
        if now < self.now {
            self.rejudge(now);
            return;
        }
        self.now = now;
        while let Some((deadline, _)) = self.deadlines.first() {
            if *deadline > now {
                break;
            }
            let Some((_, name)) = self.deadlines.pop_first() else {
                break;
            };
            if let Some(entry) = self.entries.get_mut(&name) {
                entry.ready = false;
                self.changes.readiness = true;
            }
        }
    }

    /// Judges every Node's readiness again at `now`.
    pub fn rejudge(&mut self, now: i64) {
        self.now = now;
        self.deadlines.clear();
        for (name, entry) in &mut self.entries {
            let ready = entry.node.is_ready(now);
            if ready != entry.ready {
                entry.ready = ready;
                self.changes.readiness = true;
            }
            if ready {
                self.deadlines.insert((deadline(&entry.node), name.clone()));
            }
        }
    }

    /// True when something the mesh depends on changed since the last call; clears the
    /// changes.
    pub fn take_changed(&mut self) -> bool {
        self.take_changes().any()
    }

    /// What changed since the changes were last taken; clears them.
    pub fn take_changes(&mut self) -> TableChanges {
        std::mem::take(&mut self.changes)
    }

    /// Node `name`'s translation.
    pub fn get(&self, name: &str) -> Option<&Node> {
        self.entries.get(name).map(|e| &e.node)
    }

    /// Every Node by name, with its readiness at the current readiness time.
    pub fn iter(&self) -> impl Iterator<Item = (&Node, bool)> {
        self.entries.values().map(|e| (&e.node, e.ready))
    }

    /// How many Nodes the table holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the table holds no Node.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn forget_deadline(&mut self, name: &str, old: &Entry) {
        if old.ready {
            self.deadlines
                .remove(&(deadline(&old.node), name.to_string()));
        }
    }
}

fn deadline(node: &Node) -> i64 {
    node.last_seen.saturating_add(READY_WINDOW_SECS)
}

#[cfg(test)]
mod tests;
