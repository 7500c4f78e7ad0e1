//! The backend's in-memory twin, for tests that run many agents at once: one cluster of Nodes,
//! Peers and Leases that every agent shares, each through a connection of its own that a test
//! can cut off from the API. Writes behave as the API server's do: a patch of a Node that does
//! not exist fails, a lease is written only if it is still as the writer expected.
//!
//! What the agents publish of the mesh's state (the Nodes' `KiloMeshReady`, the Peers' `status`,
//! Kubernetes Events) is kept beside the snapshot ([`MemoryCluster::published`]), not in it: no
//! agent's decisions read another's condition or Events, so those writes wake no reader. Every
//! write an agent sends is counted by kind and writer ([`MemoryCluster::writes`]), which is how
//! the model checks the write budget.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Result};
use control::api_events::ApiWrite;
use control::condition::ConditionWrite;
use control::leader::{Expectation, LeaseState};
use control::peer_status::{PeerStatus, PeerStatusWrite};
use control::PeerObject;
use parking_lot::Mutex;
use tokio::sync::watch;

use super::{Listed, Snapshot};

/// The cluster: what an API server would hold.
pub struct MemoryCluster {
    snapshot: Mutex<Snapshot>,
    tx: watch::Sender<Arc<Snapshot>>,
    published: Mutex<Published>,
}

/// How many writes of each kind one agent sent (a lease write another writer beat is counted
/// too: the API server answered it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteCounts {
    /// Patches of the agent's Node's annotations.
    pub annotations: u64,
    /// Lease writes.
    pub leases: u64,
    /// Writes of the agent's Node's `KiloMeshReady` condition.
    pub conditions: u64,
    /// Writes of a Peer's `status`.
    pub peer_statuses: u64,
    /// Kubernetes Event writes: new Events and repeats of one.
    pub events: u64,
}

impl WriteCounts {
    /// The writes that publish the mesh's state: conditions, Peer statuses and Events.
    pub fn mesh_state(&self) -> u64 {
        self.conditions + self.peer_statuses + self.events
    }
}

/// The mesh's state as the agents published it.
#[derive(Debug, Clone, Default)]
pub struct Published {
    /// Each Node's `KiloMeshReady`, as last written.
    pub conditions: BTreeMap<String, ConditionWrite>,
    /// Each Peer's `status`, as last written, with the node that wrote it.
    pub peer_statuses: BTreeMap<String, (String, PeerStatus)>,
    /// Every Event write, with the node that sent it, in order.
    pub events: Vec<(String, ApiWrite)>,
    /// Every writer's writes so far.
    pub writes: BTreeMap<String, WriteCounts>,
}

impl MemoryCluster {
    /// An empty cluster, listed (a reader never waits for a first list).
    pub fn new() -> Arc<Self> {
        let snapshot = Snapshot {
            listed: Listed::EVERYTHING,
            ..Snapshot::default()
        };
        let (tx, _) = watch::channel(Arc::new(snapshot.clone()));
        Arc::new(Self {
            snapshot: Mutex::new(snapshot),
            tx,
            published: Mutex::new(Published::default()),
        })
    }

    /// The mesh's state as published so far.
    pub fn published(&self) -> Published {
        self.published.lock().clone()
    }

    /// Every writer's writes so far.
    pub fn writes(&self) -> BTreeMap<String, WriteCounts> {
        self.published.lock().writes.clone()
    }

    fn count(&self, writer: &str, kind: impl FnOnce(&mut WriteCounts) -> &mut u64) {
        let mut published = self.published.lock();
        *kind(published.writes.entry(writer.to_string()).or_default()) += 1;
    }

    /// Everything the cluster holds now.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        Arc::clone(&self.tx.borrow())
    }

    /// Changes the cluster with `change`, which says whether it changed anything; watchers see
    /// the result only then.
    pub fn update(&self, change: impl FnOnce(&mut Snapshot) -> bool) -> bool {
        let mut snapshot = self.snapshot.lock();
        let changed = change(&mut snapshot);
        if changed {
            self.tx.send_replace(Arc::new(snapshot.clone()));
        }
        changed
    }

    /// A connection to the cluster, reachable until [`MemoryBackend::set_reachable`] says not.
    pub fn connect(self: &Arc<Self>) -> Arc<MemoryBackend> {
        Arc::new(MemoryBackend {
            cluster: Arc::clone(self),
            reachable: AtomicBool::new(true),
        })
    }
}

/// One agent's connection to a [`MemoryCluster`].
pub struct MemoryBackend {
    cluster: Arc<MemoryCluster>,
    reachable: AtomicBool,
}

impl MemoryBackend {
    /// Cuts this connection off from the API (`false`) or restores it: while cut off, every
    /// write fails and [`MemoryBackend::healthy`] is false.
    pub fn set_reachable(&self, reachable: bool) {
        self.reachable.store(reachable, Ordering::Relaxed);
    }

    /// False while the connection is cut off.
    pub fn healthy(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    /// The cluster's snapshots as they change.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.cluster.tx.subscribe()
    }

    fn reach(&self, what: &str) -> Result<()> {
        if !self.healthy() {
            bail!("{what}: the API server is unreachable");
        }
        Ok(())
    }

    /// Sets or removes annotations on Node `name`.
    pub fn patch_annotations(
        &self,
        name: &str,
        changes: &BTreeMap<String, Option<String>>,
    ) -> Result<()> {
        self.reach(&format!("patching node {name}"))?;
        let mut found = false;
        self.cluster.update(|s| {
            let Some(node) = s.nodes.get(name) else {
                return false;
            };
            found = true;
            let mut node = (**node).clone();
            let annotations = node.metadata.annotations.get_or_insert_with(BTreeMap::new);
            for (key, value) in changes {
                match value {
                    Some(v) => annotations.insert(key.clone(), v.clone()),
                    None => annotations.remove(key),
                };
            }
            s.put_node(name, node)
        });
        if !found {
            bail!("patching node {name}: nodes \"{name}\" not found");
        }
        self.cluster.count(name, |c| &mut c.annotations);
        Ok(())
    }

    /// Writes lease `name` if it is still as `expected`; false when another writer was first.
    pub fn write_lease(
        &self,
        name: &str,
        lease: &LeaseState,
        expected: &Expectation,
    ) -> Result<bool> {
        self.reach(&format!("writing lease {name}"))?;
        if let Some(holder) = &lease.holder {
            self.cluster.count(holder, |c| &mut c.leases);
        }
        let mut written = false;
        self.cluster.update(|s| {
            let current = s.leases.get(name).cloned().unwrap_or_default();
            if !lease.may_replace(&current, expected) {
                return false;
            }
            written = true;
            s.leases.insert(name.to_string(), lease.clone());
            true
        });
        Ok(written)
    }

    /// Sets Node `name`'s `KiloMeshReady`; fails for a Node that does not exist.
    pub fn write_node_condition(&self, name: &str, write: &ConditionWrite) -> Result<()> {
        self.reach(&format!("writing the condition of node {name}"))?;
        if !self.cluster.snapshot().nodes.contains_key(name) {
            bail!("writing the condition of node {name}: nodes \"{name}\" not found");
        }
        self.cluster.count(name, |c| &mut c.conditions);
        let mut published = self.cluster.published.lock();
        published.conditions.insert(name.to_string(), write.clone());
        Ok(())
    }

    /// The `KiloMeshReady` Node `name` carries (`None`: none, or no such Node).
    pub fn node_condition(&self, name: &str) -> Result<Option<ConditionWrite>> {
        self.reach(&format!("reading node {name}"))?;
        if !self.cluster.snapshot().nodes.contains_key(name) {
            return Ok(None);
        }
        Ok(self.cluster.published.lock().conditions.get(name).cloned())
    }

    /// Writes a Peer's `status` as the agent of `node`; fails for a Peer that does not exist.
    pub fn write_peer_status(&self, node: &str, write: &PeerStatusWrite) -> Result<()> {
        let peer = &write.peer;
        self.reach(&format!("writing the status of Peer {peer}"))?;
        if !self.cluster.snapshot().peers.contains_key(peer) {
            bail!("writing the status of Peer {peer}: peers \"{peer}\" not found");
        }
        self.cluster.count(node, |c| &mut c.peer_statuses);
        let mut published = self.cluster.published.lock();
        let status = (node.to_string(), write.status.clone());
        published.peer_statuses.insert(peer.clone(), status);
        Ok(())
    }

    /// Takes a Kubernetes Event write of the agent of `node` (`posted` or `repeated`, as the
    /// API server's answer would be counted), or fails while cut off.
    pub fn post_event(&self, node: &str, write: ApiWrite) -> Result<&'static str> {
        self.reach("writing an Event")?;
        self.cluster.count(node, |c| &mut c.events);
        let result = match write {
            ApiWrite::Create(_) => "posted",
            ApiWrite::Repeat { .. } => "repeated",
        };
        self.cluster
            .published
            .lock()
            .events
            .push((node.to_string(), write));
        Ok(result)
    }

    /// Creates or replaces a Peer.
    pub fn create_peer(&self, peer: &PeerObject) -> Result<()> {
        self.reach("creating a Peer")?;
        let name = peer.metadata.name.clone().unwrap_or_default();
        self.cluster
            .update(|s| s.put_peer(&name, Some(peer.clone())));
        Ok(())
    }

    /// Deletes Peer `name`.
    pub fn delete_peer(&self, name: &str) -> Result<()> {
        self.reach(&format!("deleting Peer {name}"))?;
        if !self.cluster.update(|s| s.put_peer(name, None)) {
            bail!("deleting Peer {name}: peers \"{name}\" not found");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Node as KubeNode;

    fn node(name: &str) -> KubeNode {
        let mut node = KubeNode::default();
        node.metadata.name = Some(name.to_string());
        node
    }

    #[test]
    fn a_patch_reaches_every_watcher_and_fails_while_cut_off_or_for_a_missing_node() {
        let cluster = MemoryCluster::new();
        cluster.update(|s| s.put_node("a", node("a")));
        let (one, two) = (cluster.connect(), cluster.connect());
        let mut watching = two.subscribe();
        let set = BTreeMap::from([("k".to_string(), Some("v".to_string()))]);
        one.patch_annotations("a", &set).unwrap();
        assert!(watching.has_changed().unwrap());
        let seen = watching.borrow_and_update().nodes["a"]
            .metadata
            .annotations
            .clone();
        assert_eq!(seen.unwrap()["k"], "v");

        let error = one.patch_annotations("b", &set).unwrap_err().to_string();
        assert!(error.contains("\"b\" not found"), "{error}");
        one.set_reachable(false);
        assert!(!one.healthy() && two.healthy());
        let error = one.patch_annotations("a", &set).unwrap_err().to_string();
        assert!(error.contains("unreachable"), "{error}");
    }

    #[test]
    fn a_lease_is_written_only_as_its_writer_expected() {
        let cluster = MemoryCluster::new();
        let backend = cluster.connect();
        let held_by = |holder: &str| LeaseState {
            holder: Some(holder.to_string()),
            ..LeaseState::default()
        };
        let free = Expectation::default();
        assert!(backend.write_lease("l", &held_by("a"), &free).unwrap());
        // b expected a free lease, but a holds it now.
        assert!(!backend.write_lease("l", &held_by("b"), &free).unwrap());
        let from_a = Expectation {
            holder: Some("a".to_string()),
            cut_off: false,
        };
        assert!(backend.write_lease("l", &held_by("b"), &from_a).unwrap());
        assert_eq!(cluster.snapshot().leases["l"].holder.as_deref(), Some("b"));
    }
}
