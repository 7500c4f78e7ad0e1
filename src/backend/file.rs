//! `--backend=file`: Nodes and Peers as Kubernetes objects in a directory (YAML, multi-document
//! YAML, `kind: List`, or JSON), the way `kubectl get -o yaml` prints them.
//!
//! The kernel's inotify says which files changed, and only those are read again; the whole
//! directory is listed every [`RESCAN_INTERVAL`] besides (every [`POLL_INTERVAL`] where it cannot
//! be watched), and only files whose size, mtime or inode changed are re-read. Readers are told of
//! other writers' changes at most once per [`pace::NOTIFY_INTERVAL`], as the Node watch does. kg
//! writes its own Node's annotations back into the file that holds the Node (or `<node>.yaml`),
//! under an exclusive `flock` on `.kilotun.lock` and by rename, so several kg processes sharing the
//! directory never lose each other's writes and readers never see a half-written file. A file that
//! does not parse is reported once and its last good content kept.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context, Result};
use control::PeerObject;
use k8s_openapi::api::core::v1::Node as KubeNode;
use parking_lot::Mutex;
use serde_json::Value;
use tokio::sync::watch;

use super::{pace, Snapshot};
use control::leader::{Expectation, LeaseState};
use k8s_openapi::api::coordination::v1::Lease;

mod dir_watch;
mod documents;
mod lease;
mod lock;
mod publish;

use dir_watch::{Changed, DirWatch};

use documents::{
    apply_changes, is_object_file, name_of, parse_documents, render, visit, visit_mut,
};
pub use lease::{
    lease_object, lease_state, CUT_OFF_ANNOTATION, CUT_OFF_PREDECESSOR_ANNOTATION,
    DEPOSED_ANNOTATION, HANDED_OVER_BY_ANNOTATION,
};
use lock::{write_atomically, DirLock};

/// How often the directory is re-scanned.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// How often the whole directory is listed even though its watch reported nothing (a change the
/// kernel does not report, on a network file system, is seen within this).
pub const RESCAN_INTERVAL: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, PartialEq, Eq)]
struct Signature {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

#[derive(Debug, Clone)]
struct FileEntry {
    signature: Signature,
    nodes: Vec<Arc<KubeNode>>,
    peers: Vec<PeerObject>,
    leases: Vec<(String, LeaseState)>,
    /// Calico's, Cilium's and Pods' objects, for `--ipam`.
    ipam: control::ipam::IpamObjects,
}

/// A cluster held in a directory.
pub struct FileBackend {
    dir: PathBuf,
    tx: watch::Sender<Arc<Snapshot>>,
    files: Mutex<BTreeMap<PathBuf, FileEntry>>,
    readable: AtomicBool,
    /// The kernel refused to watch the directory last time (said once).
    unwatched: AtomicBool,
}

fn read_entry(path: &Path, signature: Signature) -> Result<FileEntry> {
    let text = fs::read_to_string(path)?;
    let docs = parse_documents(path, &text)?;
    let mut entry = FileEntry {
        signature,
        nodes: Vec::new(),
        peers: Vec::new(),
        leases: Vec::new(),
        ipam: Default::default(),
    };
    let mut objects = Vec::new();
    for doc in &docs {
        visit(doc, &mut objects);
    }
    for object in objects {
        match object.get("kind").and_then(Value::as_str) {
            Some("Node") => entry.nodes.push(Arc::new(
                serde_json::from_value(object.clone())
                    .with_context(|| format!("Node {:?}", name_of(object).unwrap_or("?")))?,
            )),
            Some("Peer") => entry.peers.push(
                serde_json::from_value(object.clone())
                    .with_context(|| format!("Peer {:?}", name_of(object).unwrap_or("?")))?,
            ),
            Some("Lease") => {
                let lease: Lease = serde_json::from_value(object.clone())
                    .with_context(|| format!("Lease {:?}", name_of(object).unwrap_or("?")))?;
                let name = lease.metadata.name.clone().unwrap_or_default();
                entry.leases.push((name, lease_state(&lease)));
            }
            Some(kind) => {
                if let Err(e) = take_ipam_object(&mut entry.ipam, kind, object) {
                    tracing::warn!(file = %path.display(), "{e}; ignoring it");
                }
            }
            None => {}
        }
    }
    Ok(entry)
}

/// Takes `object` of `kind` into `ipam` if it is an IPAM object (`BlockAffinity`, `IPAMBlock`,
/// `CiliumNode`, `Pod`); one that does not parse is refused alone.
fn take_ipam_object(
    ipam: &mut control::ipam::IpamObjects,
    kind: &str,
    object: &Value,
) -> Result<(), control::ipam::ObjectError> {
    use control::ipam::objects;
    let meta = object.get("metadata");
    let name = name_of(object).unwrap_or_default().to_string();
    match kind {
        "BlockAffinity" => {
            ipam.affinities
                .insert(name, objects::block_affinity(object)?);
        }
        "IPAMBlock" => {
            ipam.blocks.insert(name, objects::ipam_block(object)?);
        }
        "CiliumNode" => {
            ipam.cilium_nodes
                .insert(name, objects::cilium_node(object)?);
        }
        "Pod" => {
            let namespace = meta
                .and_then(|m| m.get("namespace"))
                .and_then(Value::as_str)
                .unwrap_or("default");
            if let Some(pod) = objects::pod_addresses(object)? {
                ipam.pods.insert(format!("{namespace}/{name}"), pod);
            }
        }
        _ => {}
    }
    Ok(())
}

/// Takes file `path` (whose metadata is `meta`) into `files` when it changed since it was
/// last read; true when its content did. A file that does not parse keeps its last good
/// content, and is said once per change.
fn take_file(files: &mut BTreeMap<PathBuf, FileEntry>, path: PathBuf, meta: &fs::Metadata) -> bool {
    let signature = Signature {
        modified: meta.modified().ok(),
        len: meta.len(),
        inode: meta.ino(),
    };
    if files.get(&path).is_some_and(|f| f.signature == signature) {
        return false;
    }
    match read_entry(&path, signature.clone()) {
        Ok(entry) => {
            files.insert(path, entry);
            true
        }
        Err(e) => {
            tracing::warn!(file = %path.display(), error = format!("{e:#}"), "cannot parse cluster file; keeping its last good content");
            match files.get_mut(&path) {
                Some(old) => old.signature = signature,
                None => {
                    files.insert(
                        path,
                        FileEntry {
                            signature,
                            nodes: Vec::new(),
                            peers: Vec::new(),
                            leases: Vec::new(),
                            ipam: Default::default(),
                        },
                    );
                }
            }
            false
        }
    }
}

/// Watches `dir` (`None` where the kernel cannot, or the directory is not there), then lists
/// it through `backend`, so nothing changed before the watch began is missed.
/// Where the kernel refuses the watch (inotify instances or watches used up, most often), says
/// so once, and again once it watches.
fn arm(dir: &Path, backend: &Weak<FileBackend>) -> Option<DirWatch> {
    let dir_watch = DirWatch::new(dir);
    if let Some(backend) = backend.upgrade() {
        match &dir_watch {
            Ok(_) => {
                if backend.unwatched.swap(false, Ordering::Relaxed) {
                    tracing::info!(dir = %dir.display(), "watching the cluster directory again");
                }
            }
            // A directory that is gone is said by the listing.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                if !backend.unwatched.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        dir = %dir.display(),
                        error = %e,
                        "cannot watch the cluster directory (with too many inotify instances or watches in use, raise fs.inotify.max_user_instances or max_user_watches); listing it every {POLL_INTERVAL:?} instead"
                    );
                }
            }
        }
        backend.scan();
    }
    dir_watch.ok()
}

impl FileBackend {
    /// Opens `dir` (which must exist) and reads it once.
    pub fn open(dir: &Path) -> Result<Arc<Self>> {
        if !dir.is_dir() {
            bail!("--cluster-dir {} is not a directory", dir.display());
        }
        // Read whole and at once below: the first snapshot a reader sees is complete.
        let (tx, _) = watch::channel(Arc::new(Snapshot {
            listed: super::Listed::EVERYTHING,
            ..Snapshot::default()
        }));
        let backend = Arc::new(Self {
            dir: dir.to_path_buf(),
            tx,
            files: Mutex::new(BTreeMap::new()),
            readable: AtomicBool::new(true),
            unwatched: AtomicBool::new(false),
        });
        backend.scan();
        Ok(backend)
    }

    /// False while the directory cannot be read.
    pub fn healthy(&self) -> bool {
        self.readable.load(Ordering::Relaxed)
    }

    /// Snapshots, updated on every change.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.tx.subscribe()
    }

    /// Lists the directory, re-reads the files that changed and publishes a new snapshot if
    /// anything did.
    pub fn scan(&self) -> bool {
        let mut files = self.files.lock();
        let entries = match fs::read_dir(&self.dir) {
            Ok(e) => {
                if !self.readable.swap(true, Ordering::Relaxed) {
                    tracing::info!(dir = %self.dir.display(), "the cluster directory is back");
                }
                e
            }
            Err(e) => {
                if self.readable.swap(false, Ordering::Relaxed) {
                    tracing::warn!(dir = %self.dir.display(), error = %e, "cannot read the cluster directory; keeping the last good state");
                }
                return false;
            }
        };
        let mut changed = false;
        let mut seen = BTreeSet::new();
        for entry in entries.flatten() {
            let path = entry.path();
            if !is_object_file(&path) {
                continue;
            }
            let Ok(meta) = fs::metadata(&path) else {
                continue;
            };
            seen.insert(path.clone());
            changed |= take_file(&mut files, path, &meta);
        }
        let before = files.len();
        files.retain(|p, _| seen.contains(p));
        changed |= files.len() != before;
        changed && self.publish(files)
    }

    /// Re-reads the entries `names` of the directory (as its watch reported them: written,
    /// renamed or removed) and publishes a new snapshot if anything changed.
    fn scan_names(&self, names: &[std::ffi::OsString]) -> bool {
        let mut files = self.files.lock();
        let mut touched = publish::Touched::default();
        for name in names {
            let path = self.dir.join(name);
            if !is_object_file(&path) {
                continue;
            }
            touched.add(files.get(&path));
            match fs::metadata(&path) {
                Ok(meta) => {
                    if take_file(&mut files, path.clone(), &meta) {
                        touched.add(files.get(&path));
                    }
                }
                Err(_) => {
                    files.remove(&path);
                }
            }
        }
        // Only the names those files held or hold change: the snapshot is changed in place
        // (readers borrow it, so it is not copied).
        let changed = self
            .tx
            .send_if_modified(|snapshot| touched.apply(&files, Arc::make_mut(snapshot)));
        drop(files);
        changed
    }

    /// Re-reads the file at `path` (one kg itself wrote or removed), so its own writes are in
    /// the next snapshot at once.
    fn scan_path(&self, path: &Path) {
        if let Some(name) = path.file_name() {
            self.scan_names(&[name.to_os_string()]);
        }
    }

    /// Publishes the snapshot `files` hold, if it differs from the last one. Called under the
    /// files lock (`files`), so two scans never publish from the same base and the change
    /// log's revisions stay in order.
    fn publish(&self, files: parking_lot::MutexGuard<'_, BTreeMap<PathBuf, FileEntry>>) -> bool {
        let gathered = publish::gather(&files);
        let differs = self.tx.send_if_modified(|snapshot| {
            let snapshot = Arc::make_mut(snapshot);
            let nodes_changed = snapshot.replace_nodes(gathered.nodes);
            let leases_changed = snapshot.replace_leases(gathered.leases);
            let ipam_changed = snapshot.replace_ipam(gathered.ipam);
            snapshot.replace_peers(gathered.peers)
                || nodes_changed
                || leases_changed
                || ipam_changed
        });
        drop(files);
        differs
    }

    /// The file that held Node `name` when last read, if any.
    fn file_of_node(&self, name: &str) -> Option<PathBuf> {
        let files = self.files.lock();
        files
            .iter()
            .find(|(_, e)| {
                e.nodes
                    .iter()
                    .any(|n| n.metadata.name.as_deref() == Some(name))
            })
            .map(|(path, _)| path.clone())
    }

    /// Follows the directory on a thread until the backend is dropped: the files its watch
    /// ([`dir_watch::DirWatch`]) names are read as they change, and the whole directory is listed
    /// every [`RESCAN_INTERVAL`] besides. Readers are told at most once per
    /// [`pace::NOTIFY_INTERVAL`] (what changes meanwhile is read together after it). Where the
    /// kernel cannot watch it (or the directory was replaced, until it is back), the whole
    /// directory is listed every [`POLL_INTERVAL`].
    pub fn spawn_poller(self: &Arc<Self>) {
        let weak: Weak<Self> = Arc::downgrade(self);
        let dir = self.dir.clone();
        std::thread::Builder::new()
            .name("cluster-dir".into())
            .spawn(move || {
                let mut dir_watch = arm(&dir, &weak);
                let mut told: Option<std::time::Instant> = None;
                loop {
                    // Changes soon after the last told wait in the watch's queue and are read
                    // together, so readers wake at most once per interval.
                    let hold = pace::hold(told, std::time::Instant::now());
                    if !hold.is_zero() {
                        std::thread::sleep(hold);
                    }
                    let changed = match &dir_watch {
                        Some(w) => w.wait(RESCAN_INTERVAL).unwrap_or(Changed::Everything),
                        None => {
                            std::thread::sleep(POLL_INTERVAL);
                            Changed::Everything
                        }
                    };
                    let Some(backend) = weak.upgrade() else {
                        return;
                    };
                    let published = match &changed {
                        Changed::Names(names) => backend.scan_names(names),
                        Changed::Nothing => backend.scan(),
                        Changed::Everything => {
                            drop(backend);
                            // The directory itself changed (or the watch failed): watch
                            // whatever directory the path names now, then list it.
                            dir_watch = arm(&dir, &weak);
                            continue;
                        }
                    };
                    if published {
                        told = Some(std::time::Instant::now());
                    }
                }
            })
            .expect("spawning the cluster-dir poller");
    }

    /// Writes lease `name` (file `lease-<name>.yaml`) as `lease` when the lease in the
    /// directory is still as `expected` (see `LeaseState::may_replace`), under the directory
    /// lock; false when another writer changed it first.
    pub fn write_lease(
        &self,
        name: &str,
        lease: &LeaseState,
        expected: &Expectation,
    ) -> Result<bool> {
        let _lock = DirLock::acquire(&self.dir)?;
        let path = self.dir.join(format!("lease-{name}.yaml"));
        let current = match fs::read_to_string(&path) {
            Ok(text) => {
                serde_saphyr::from_str_with_options::<Lease>(&text, documents::yaml_options())
                    .map(|l| lease_state(&l))
                    .unwrap_or_default()
            }
            Err(_) => LeaseState::default(),
        };
        if !lease.may_replace(&current, expected) {
            return Ok(false);
        }
        let mut object = serde_json::to_value(lease_object(name, lease))?;
        object["apiVersion"] = Value::from("coordination.k8s.io/v1");
        object["kind"] = Value::from("Lease");
        write_atomically(&path, &serde_saphyr::to_string(&object)?)?;
        Ok(true)
    }

    /// Sets or removes annotations on Node `name`, in the file that holds it (or a new
    /// `<name>.yaml`), atomically and under the directory lock.
    pub fn patch_annotations(
        &self,
        name: &str,
        changes: &BTreeMap<String, Option<String>>,
    ) -> Result<()> {
        let _lock = DirLock::acquire(&self.dir)?;
        // The file that held the Node when last read first, then every other.
        let known = self.file_of_node(name);
        let mut paths: Vec<PathBuf> = fs::read_dir(&self.dir)?
            .flatten()
            .map(|e| e.path())
            .filter(|p| is_object_file(p) && Some(p) != known.as_ref())
            .collect();
        paths.sort();
        for path in known.into_iter().chain(paths) {
            let Ok(text) = fs::read_to_string(&path) else {
                continue;
            };
            let Ok(mut docs) = parse_documents(&path, &text) else {
                continue;
            };
            let mut found = false;
            for doc in docs.iter_mut() {
                let mut objects = Vec::new();
                visit_mut(doc, &mut objects);
                for object in objects {
                    let is_node = object.get("kind").and_then(Value::as_str) == Some("Node");
                    if is_node && name_of(object) == Some(name) {
                        apply_changes(object, changes);
                        found = true;
                    }
                }
                if found {
                    break;
                }
            }
            if found {
                write_atomically(&path, &render(&path, &docs)?)?;
                self.scan_path(&path);
                return Ok(());
            }
        }
        let mut node =
            serde_json::json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
        apply_changes(&mut node, changes);
        let path = self.dir.join(format!("{name}.yaml"));
        write_atomically(&path, &render(&path, &[node])?)?;
        self.scan_path(&path);
        Ok(())
    }
}

impl FileBackend {
    fn peer_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("peer-{name}.yaml"))
    }

    /// Writes `peer` as `peer-<name>.yaml`, under the directory lock.
    pub fn create_peer(&self, peer: &PeerObject) -> Result<()> {
        let name = peer.metadata.name.clone().unwrap_or_default();
        if name.is_empty() || name.contains('/') {
            bail!("a Peer needs a name without '/', not {name:?}");
        }
        let _lock = DirLock::acquire(&self.dir)?;
        let path = self.peer_path(&name);
        let object = serde_json::to_value(peer)?;
        write_atomically(&path, &render(&path, &[object])?)?;
        self.scan_path(&path);
        Ok(())
    }

    /// Removes the file [`FileBackend::create_peer`] wrote for `name`.
    pub fn delete_peer(&self, name: &str) -> Result<()> {
        let _lock = DirLock::acquire(&self.dir)?;
        let path = self.peer_path(name);
        fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        self.scan_path(&path);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
