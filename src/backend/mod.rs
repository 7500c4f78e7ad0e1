//! Where Nodes and Peers come from and where kg writes its own Node's annotations: the
//! Kubernetes API or a directory of object files.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use anyhow::Result;
use control::ipam::IpamObjects;
use control::leader::{Expectation, LeaseState};
use control::PeerObject;
use k8s_openapi::api::core::v1::Node as KubeNode;
use tokio::sync::watch;

use self::kube::events::EventCounts;

pub mod backoff;
pub mod file;
pub mod kube;
pub mod memory;
pub mod pace;

#[cfg(test)]
mod tests;

/// Everything the backend holds, as last seen.
///
/// Nodes are shared (`Arc`): an update replaces one entry, so cloning a snapshot or keeping a
/// Node's last version costs no copy of the object, and an unchanged Node is the same pointer
/// from one snapshot to the next.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// Nodes by name.
    pub nodes: BTreeMap<String, Arc<KubeNode>>,
    /// Peers by name.
    pub peers: BTreeMap<String, PeerObject>,
    /// Leader-election leases by name (see `control::leader`).
    pub leases: BTreeMap<String, LeaseState>,
    /// Which Nodes changed, so a reader can catch up on those alone.
    pub changes: ChangeLog,
    /// What the backend has listed at least once: until every kind is, the snapshot may lack
    /// objects that exist (see [`Listed::all`]).
    pub listed: Listed,
    /// Calico's, Cilium's and the Pods' IPAM objects (`--ipam`); a reader tells whether they
    /// changed by [`ChangeLog::ipam_revision`].
    pub ipam: Arc<IpamObjects>,
}

/// The kinds of object a backend has listed at least once since it started. A reader that acts
/// on a partial picture (the Nodes without the Leases, say) would elect the wrong leader for
/// as long as the rest takes to arrive.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Listed {
    /// The Nodes.
    pub nodes: bool,
    /// The Peers (or the Peer watch failed before its first list: no CRD, no Peers).
    pub peers: bool,
    /// The leases (or leases are not watched, or their watch failed before its first list).
    pub leases: bool,
    /// The IPAM objects `--ipam` reads (or none are read, or their watches failed before
    /// their first list).
    pub ipam: bool,
}

impl Listed {
    /// Everything listed: what a backend that reads all at once (the file backend) starts with.
    pub const EVERYTHING: Self = Self {
        nodes: true,
        peers: true,
        leases: true,
        ipam: true,
    };

    /// True once every kind has been listed.
    pub fn all(self) -> bool {
        self.nodes && self.peers && self.leases && self.ipam
    }
}

impl Snapshot {
    /// Sets Node `name` to `node`; false (nothing recorded) when it is already that.
    pub fn put_node(&mut self, name: &str, node: KubeNode) -> bool {
        match self.nodes.get_mut(name) {
            Some(old) if **old == node => return false,
            // Replaced in place: the name is not allocated again.
            Some(old) => *old = Arc::new(node),
            None => {
                self.nodes.insert(name.to_string(), Arc::new(node));
            }
        }
        self.changes.node(name);
        true
    }

    /// Sets Node `name` to the shared `node`; false (nothing recorded) when it is already that.
    pub fn put_shared_node(&mut self, name: &str, node: Arc<KubeNode>) -> bool {
        match self.nodes.get_mut(name) {
            Some(old) if Arc::ptr_eq(old, &node) || **old == *node => return false,
            Some(old) => *old = node,
            None => {
                self.nodes.insert(name.to_string(), node);
            }
        }
        self.changes.node(name);
        true
    }

    /// Removes Node `name`; false when there was none.
    pub fn remove_node(&mut self, name: &str) -> bool {
        let removed = self.nodes.remove(name).is_some();
        if removed {
            self.changes.node(name);
        }
        removed
    }

    /// Replaces every Node (a re-list), keeping the shared object of each Node that is
    /// unchanged so readers see only the real changes. False when nothing changed.
    pub fn replace_nodes(&mut self, nodes: BTreeMap<String, Arc<KubeNode>>) -> bool {
        let mut changed = false;
        let old = std::mem::take(&mut self.nodes);
        for name in old.keys().filter(|n| !nodes.contains_key(*n)) {
            self.changes.node(name);
            changed = true;
        }
        for (name, node) in nodes {
            match old.get(&name) {
                Some(kept) if Arc::ptr_eq(kept, &node) || **kept == *node => {
                    self.nodes.insert(name, Arc::clone(kept));
                }
                _ => {
                    self.changes.node(&name);
                    self.nodes.insert(name, node);
                    changed = true;
                }
            }
        }
        changed
    }

    /// Replaces every Peer; false when they are the same.
    pub fn replace_peers(&mut self, peers: BTreeMap<String, PeerObject>) -> bool {
        if self.peers == peers {
            return false;
        }
        self.peers = peers;
        self.changes.peer();
        true
    }

    /// Replaces the IPAM objects; false when they are the same.
    pub fn replace_ipam(&mut self, ipam: IpamObjects) -> bool {
        if *self.ipam == ipam {
            return false;
        }
        self.ipam = Arc::new(ipam);
        self.changes.ipam();
        true
    }

    /// Changes the IPAM objects in place with `edit`, which says whether it changed them
    /// (copied first only if a reader still holds them).
    pub fn edit_ipam(&mut self, edit: impl FnOnce(&mut IpamObjects) -> bool) -> bool {
        let changed = edit(Arc::make_mut(&mut self.ipam));
        if changed {
            self.changes.ipam();
        }
        changed
    }

    /// Replaces every lease; false when they are the same.
    pub fn replace_leases(&mut self, leases: BTreeMap<String, LeaseState>) -> bool {
        if self.leases == leases {
            return false;
        }
        self.leases = leases;
        true
    }

    /// Sets (`Some`) or removes (`None`) Peer `name`; false when nothing changed.
    pub fn put_peer(&mut self, name: &str, peer: Option<PeerObject>) -> bool {
        let changed = match peer {
            Some(p) if self.peers.get(name) != Some(&p) => {
                self.peers.insert(name.to_string(), p);
                true
            }
            Some(_) => false,
            None => self.peers.remove(name).is_some(),
        };
        if changed {
            self.changes.peer();
        }
        changed
    }
}

/// How many Node changes a [`ChangeLog`] remembers; a reader further behind walks every Node.
pub const CHANGE_LOG_LENGTH: usize = 1024;

/// The names of the Nodes changed (added, updated or removed), each with the revision it was
/// recorded at, so a reader that processed revision `r` catches up on the names after `r`
/// instead of comparing every Node. Replacing every Node at once (a re-list) is a reset: readers
/// behind it walk everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChangeLog {
    revision: u64,
    reset_at: u64,
    forgotten: u64,
    peers: u64,
    ipam: u64,
    entries: VecDeque<(u64, String)>,
}

impl ChangeLog {
    /// The revision of the last change.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The revision of the last Peer change (Peers are few: readers compare them all).
    pub fn peer_revision(&self) -> u64 {
        self.peers
    }

    /// The revision of the last change to the IPAM objects.
    pub fn ipam_revision(&self) -> u64 {
        self.ipam
    }

    /// Records that the IPAM objects changed.
    pub fn ipam(&mut self) {
        self.ipam += 1;
    }

    /// Records that Node `name` changed.
    pub fn node(&mut self, name: &str) {
        self.revision += 1;
        if self.entries.len() == CHANGE_LOG_LENGTH {
            if let Some((r, _)) = self.entries.pop_front() {
                self.forgotten = r;
            }
        }
        self.entries.push_back((self.revision, name.to_string()));
    }

    /// Records that every Node may have changed.
    pub fn reset(&mut self) {
        self.revision += 1;
        self.reset_at = self.revision;
        self.entries.clear();
    }

    /// Records that the Peers changed.
    pub fn peer(&mut self) {
        self.revision += 1;
        self.peers = self.revision;
    }

    /// The Nodes changed after revision `seen`, or `None` when the log does not reach back that
    /// far (or a reset came after it): the reader must compare every Node.
    pub fn since(&self, seen: u64) -> Option<impl Iterator<Item = &str>> {
        if seen < self.reset_at || seen < self.forgotten || seen > self.revision {
            return None;
        }
        let first = self.entries.partition_point(|(r, _)| *r <= seen);
        Some(self.entries.range(first..).map(|(_, name)| name.as_str()))
    }
}

/// A running backend.
pub enum Backend {
    /// `--backend=file`.
    File(Arc<file::FileBackend>),
    /// `--backend=kubernetes`.
    Kube(kube::KubeBackend),
    /// The in-memory twin, for tests that run many agents at once.
    Memory(Arc<memory::MemoryBackend>),
}

/// Where an agent's Kubernetes Events go.
#[derive(Clone)]
pub enum EventSink {
    /// The API server's `events.k8s.io/v1`, through a task of its own.
    Kube(kube::events::EventPoster),
    /// The in-memory cluster, at once.
    Memory {
        /// The agent's connection.
        backend: Arc<memory::MemoryBackend>,
        /// The agent's node.
        node: String,
        /// Where each write's result is counted.
        counts: Arc<dyn EventCounts>,
    },
}

impl EventSink {
    /// Sends `write` (the Kubernetes sink queues it; a full queue drops and counts it).
    pub fn post(&self, write: control::api_events::ApiWrite) {
        match self {
            Self::Kube(poster) => poster.post(write),
            Self::Memory {
                backend,
                node,
                counts,
            } => counts.count(backend.post_event(node, write).unwrap_or("failed")),
        }
    }

    /// Waits until the writes sent so far reached the API server, or `within` passed.
    pub async fn flush(&self, within: std::time::Duration) {
        if let Self::Kube(poster) = self {
            poster.flush(within).await;
        }
    }
}

/// Why kg is stopping, as far as the backend can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Departure {
    /// Another kg takes over this node (its DaemonSet still exists): a rollout, a restart.
    Replaced {
        /// What replaces it.
        by: String,
    },
    /// Nothing is known to take over: kilotun is being removed from this node.
    Removed {
        /// Why kg thinks so.
        why: String,
    },
}

impl Backend {
    /// Why kg is stopping. The file backend has no orchestrator that restarts kg.
    pub async fn departure(&self) -> Departure {
        match self {
            Self::File(_) => Departure::Removed {
                why: "the file backend has nothing that restarts kg".to_string(),
            },
            Self::Memory(_) => Departure::Removed {
                why: "the in-memory backend has nothing that restarts kg".to_string(),
            },
            Self::Kube(k) => k.departure().await,
        }
    }

    /// Snapshots, updated whenever a Node or Peer changes.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        match self {
            Self::File(f) => f.subscribe(),
            Self::Kube(k) => k.subscribe(),
            Self::Memory(m) => m.subscribe(),
        }
    }

    /// The snapshot once everything is listed (see [`Listed`]), or as it is after `timeout`.
    pub async fn complete_within(&self, timeout: std::time::Duration) -> Arc<Snapshot> {
        let mut rx = self.subscribe();
        if rx.borrow().listed.all() {
            // Listed already: no timer (the reference model runs without a runtime).
            return Arc::clone(&rx.borrow());
        }
        let _ = tokio::time::timeout(timeout, rx.wait_for(|s| s.listed.all())).await;
        let snapshot = Arc::clone(&rx.borrow());
        snapshot
    }

    /// The count of full Node lists after the first, for the Kubernetes backend (whose watch
    /// lists again when its resourceVersion expired); `None` for the others, which re-read
    /// whole on every change.
    pub fn node_relists(&self) -> Option<prometheus_client::metrics::counter::Counter> {
        match self {
            Self::Kube(k) => Some(k.node_relists()),
            Self::File(_) | Self::Memory(_) => None,
        }
    }

    /// False while the backend cannot be read (API server or cluster directory unreachable).
    pub fn healthy(&self) -> bool {
        match self {
            Self::File(f) => f.healthy(),
            Self::Kube(k) => k.healthy(),
            Self::Memory(m) => m.healthy(),
        }
    }

    /// Sets (`Some`) or removes (`None`) annotations on the Node called `name`.
    pub async fn patch_annotations(
        &self,
        name: &str,
        changes: &BTreeMap<String, Option<String>>,
    ) -> Result<()> {
        match self {
            Self::File(f) => {
                let f = Arc::clone(f);
                let name = name.to_string();
                let changes = changes.clone();
                tokio::task::spawn_blocking(move || f.patch_annotations(&name, &changes)).await?
            }
            Self::Kube(k) => k.patch_annotations(name, changes).await,
            Self::Memory(m) => m.patch_annotations(name, changes),
        }
    }

    /// Writes lease `name` as `lease` if it is still as `expected` (compare and swap); false
    /// when another writer got there first.
    pub async fn write_lease(
        &self,
        name: &str,
        lease: &LeaseState,
        expected: &Expectation,
    ) -> Result<bool> {
        match self {
            Self::File(f) => {
                let f = Arc::clone(f);
                let (name, lease) = (name.to_string(), lease.clone());
                let expected = expected.clone();
                tokio::task::spawn_blocking(move || f.write_lease(&name, &lease, &expected)).await?
            }
            Self::Kube(k) => k.write_lease(name, lease, expected).await,
            Self::Memory(m) => m.write_lease(name, lease, expected),
        }
    }

    /// True when the backend keeps node conditions and Peer statuses (the Kubernetes API and
    /// its in-memory twin; the file backend has no status).
    pub fn keeps_conditions(&self) -> bool {
        matches!(self, Self::Kube(_) | Self::Memory(_))
    }

    /// Sets the node condition `KiloMeshReady` on Node `name` (a no-op where
    /// [`Backend::keeps_conditions`] is false).
    pub async fn write_node_condition(
        &self,
        name: &str,
        write: &control::condition::ConditionWrite,
    ) -> Result<()> {
        match self {
            Self::Kube(k) => k.write_node_condition(name, write).await,
            Self::Memory(m) => m.write_node_condition(name, write),
            Self::File(_) => Ok(()),
        }
    }

    /// Writes a Peer's `status`, as kg of `node` (a no-op where [`Backend::keeps_conditions`]
    /// is false).
    pub async fn write_peer_status(
        &self,
        node: &str,
        write: &control::peer_status::PeerStatusWrite,
    ) -> Result<()> {
        match self {
            Self::Kube(k) => k.write_peer_status(node, write).await,
            Self::Memory(m) => m.write_peer_status(node, write),
            Self::File(_) => Ok(()),
        }
    }

    /// Where this agent's Kubernetes Events go, as kg of `node`: `None` where the backend keeps
    /// none (the file backend).
    pub fn event_sink(&self, node: &str, counts: Arc<dyn EventCounts>) -> Option<EventSink> {
        match self {
            Self::Kube(k) => Some(EventSink::Kube(k.event_poster(node, counts))),
            Self::Memory(m) => Some(EventSink::Memory {
                backend: Arc::clone(m),
                node: node.to_string(),
                counts,
            }),
            Self::File(_) => None,
        }
    }

    /// The `KiloMeshReady` condition Node `name` carries now (`None`: none, or a backend
    /// without conditions).
    pub async fn node_condition(
        &self,
        name: &str,
    ) -> Result<Option<control::condition::ConditionWrite>> {
        match self {
            Self::Kube(k) => k.node_condition(name).await,
            Self::Memory(m) => m.node_condition(name),
            Self::File(_) => Ok(None),
        }
    }

    /// Creates a Peer (for `kgctl connect`).
    pub async fn create_peer(&self, peer: &PeerObject) -> Result<()> {
        match self {
            Self::File(f) => f.create_peer(peer),
            Self::Kube(k) => k.create_peer(peer).await,
            Self::Memory(m) => m.create_peer(peer),
        }
    }

    /// Deletes the Peer called `name`.
    pub async fn delete_peer(&self, name: &str) -> Result<()> {
        match self {
            Self::File(f) => f.delete_peer(name),
            Self::Kube(k) => k.delete_peer(name).await,
            Self::Memory(m) => m.delete_peer(name),
        }
    }
}
