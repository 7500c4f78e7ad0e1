//! Where Nodes and Peers come from and where kg writes its own Node's annotations: the
//! Kubernetes API or a directory of object files.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::Result;
use control::PeerObject;
use k8s_openapi::api::core::v1::Node as KubeNode;
use tokio::sync::watch;

pub mod backoff;
pub mod file;
pub mod kube;

/// Everything the backend holds, as last seen.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Snapshot {
    /// Nodes by name.
    pub nodes: BTreeMap<String, KubeNode>,
    /// Peers by name.
    pub peers: BTreeMap<String, PeerObject>,
}

/// A running backend.
pub enum Backend {
    /// `--backend=file`.
    File(Arc<file::FileBackend>),
    /// `--backend=kubernetes`.
    Kube(kube::KubeBackend),
}

impl Backend {
    /// Snapshots, updated whenever a Node or Peer changes.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        match self {
            Self::File(f) => f.subscribe(),
            Self::Kube(k) => k.subscribe(),
        }
    }

    /// False while the backend cannot be read (API server or cluster directory unreachable).
    pub fn healthy(&self) -> bool {
        match self {
            Self::File(f) => f.healthy(),
            Self::Kube(k) => k.healthy(),
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
        }
    }

    /// Creates a Peer (for `kgctl connect`).
    pub async fn create_peer(&self, peer: &PeerObject) -> Result<()> {
        match self {
            Self::File(f) => f.create_peer(peer),
            Self::Kube(k) => k.create_peer(peer).await,
        }
    }

    /// Deletes the Peer called `name`.
    pub async fn delete_peer(&self, name: &str) -> Result<()> {
        match self {
            Self::File(f) => f.delete_peer(name),
            Self::Kube(k) => k.delete_peer(name).await,
        }
    }
}
