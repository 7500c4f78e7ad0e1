//! What the files hold, as the snapshot shows it: gathered whole after a listing of the
//! directory, or only for the names a few changed files touch (its watch's report), so a
//! change costs in proportion to what changed and not to the size of the cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use control::ipam::IpamObjects;
use control::leader::LeaseState;
use control::PeerObject;
use k8s_openapi::api::core::v1::Node as KubeNode;

use super::FileEntry;
use crate::backend::Snapshot;

/// Everything the files hold: Nodes, Peers and leases by name, each from the first file (by
/// path) that defines it.
pub(super) struct Gathered {
    pub(super) nodes: BTreeMap<String, Arc<KubeNode>>,
    pub(super) peers: BTreeMap<String, PeerObject>,
    pub(super) leases: BTreeMap<String, LeaseState>,
    pub(super) ipam: IpamObjects,
}

/// Gathers every file's objects; a Node defined twice is said once per listing.
pub(super) fn gather(files: &BTreeMap<PathBuf, FileEntry>) -> Gathered {
    let mut gathered = Gathered {
        nodes: BTreeMap::new(),
        peers: all_peers(files),
        leases: all_leases(files),
        ipam: all_ipam(files),
    };
    for (path, entry) in files {
        for node in &entry.nodes {
            let name = node.metadata.name.clone().unwrap_or_default();
            if gathered.nodes.contains_key(&name) {
                tracing::warn!(file = %path.display(), node = %name, "node defined twice; the first file (by name) wins");
                continue;
            }
            gathered.nodes.insert(name, Arc::clone(node));
        }
    }
    gathered
}

fn all_peers(files: &BTreeMap<PathBuf, FileEntry>) -> BTreeMap<String, PeerObject> {
    let mut peers = BTreeMap::new();
    for peer in files.values().flat_map(|e| &e.peers) {
        let name = peer.metadata.name.clone().unwrap_or_default();
        peers.entry(name).or_insert_with(|| peer.clone());
    }
    peers
}

fn all_leases(files: &BTreeMap<PathBuf, FileEntry>) -> BTreeMap<String, LeaseState> {
    let mut leases = BTreeMap::new();
    for (name, lease) in files.values().flat_map(|e| &e.leases) {
        leases.entry(name.clone()).or_insert_with(|| lease.clone());
    }
    leases
}

/// Every file's IPAM objects, each name from the first file (by path) that defines it.
fn all_ipam(files: &BTreeMap<PathBuf, FileEntry>) -> IpamObjects {
    fn first<T: Clone>(all: &mut BTreeMap<String, T>, more: &BTreeMap<String, T>) {
        for (name, object) in more {
            all.entry(name.clone()).or_insert_with(|| object.clone());
        }
    }
    let mut all = IpamObjects::default();
    for o in files.values().map(|e| &e.ipam) {
        first(&mut all.affinities, &o.affinities);
        first(&mut all.blocks, &o.blocks);
        first(&mut all.cilium_nodes, &o.cilium_nodes);
        first(&mut all.pods, &o.pods);
    }
    all
}

/// What some files held or hold: the Node names, and whether any Peer or lease was among them.
#[derive(Debug, Default)]
pub(super) struct Touched {
    nodes: BTreeSet<String>,
    peers: bool,
    leases: bool,
    ipam: bool,
}

impl Touched {
    /// Adds what `entry` holds (call with a file's entry before and after it changed).
    pub(super) fn add(&mut self, entry: Option<&FileEntry>) {
        let Some(entry) = entry else {
            return;
        };
        self.nodes.extend(
            entry
                .nodes
                .iter()
                .map(|n| n.metadata.name.clone().unwrap_or_default()),
        );
        self.peers |= !entry.peers.is_empty();
        self.leases |= !entry.leases.is_empty();
        self.ipam |= entry.ipam != IpamObjects::default();
    }

    /// Brings `snapshot` to what `files` hold for the names touched: each Node from the first
    /// file that defines it now, or gone; the Peers and leases again when a file touched had or
    /// has one, and the IPAM objects likewise. True when the snapshot changed.
    pub(super) fn apply(
        &self,
        files: &BTreeMap<PathBuf, FileEntry>,
        snapshot: &mut Snapshot,
    ) -> bool {
        let mut changed = false;
        for name in &self.nodes {
            changed |= match first_definition(files, name) {
                Some(node) => snapshot.put_shared_node(name, node),
                None => snapshot.remove_node(name),
            };
        }
        if self.peers {
            changed |= snapshot.replace_peers(all_peers(files));
        }
        if self.leases {
            changed |= snapshot.replace_leases(all_leases(files));
        }
        if self.ipam {
            changed |= snapshot.replace_ipam(all_ipam(files));
        }
        changed
    }
}

/// Node `name` as the first file (by path) that defines it holds it.
fn first_definition(files: &BTreeMap<PathBuf, FileEntry>, name: &str) -> Option<Arc<KubeNode>> {
    files.values().find_map(|entry| {
        entry
            .nodes
            .iter()
            .find(|n| n.metadata.name.as_deref() == Some(name))
            .cloned()
    })
}
