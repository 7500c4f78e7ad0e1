//! The backend's in-memory twin, for tests that run many agents at once: one cluster of Nodes,
//! Peers and Leases that every agent shares, each through a connection of its own that a test
//! can cut off from the API. Writes behave as the API server's do: a patch of a Node that does
//! not exist fails, a lease is written only if it is still as the writer expected.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{bail, Result};
use control::leader::{Expectation, LeaseState};
use control::PeerObject;
use parking_lot::Mutex;
use tokio::sync::watch;

use super::{Listed, Snapshot};

/// The cluster: what an API server would hold.
pub struct MemoryCluster {
    snapshot: Mutex<Snapshot>,
    tx: watch::Sender<Arc<Snapshot>>,
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
        })
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
