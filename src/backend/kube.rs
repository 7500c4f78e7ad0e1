//! `--backend=kubernetes`: Nodes and Peers from the API server through watches (no polling),
//! and JSON merge patches of the local Node's annotations.
//!
//! If the Peer CRD is not installed, kg warns and runs without Peers (Kilo fails there), and
//! keeps retrying the Peer watch with backoff so installing the CRD later is picked up.
//!
//! Nodes are decoded through [`slim::SlimNode`] (only the fields kg reads), and a burst of Node
//! events is read and announced to readers once per [`pace::NOTIFY_INTERVAL`] ([`pace::Pace`]):
//! at 5,000 nodes the check-in churn alone is 167 events a second, each of which would otherwise
//! wake both the watch and the reconcile loop.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use control::PeerObject;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Node as KubeNode;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, Config};
use tokio::sync::watch;
use tokio::time::Instant;

use super::backoff::WatchBackoff;
use super::pace::{self, Pace};
use super::Snapshot;

pub mod departure;
pub mod events;
pub mod ipam;
mod lease;
pub mod slim;
#[cfg(test)]
mod tests;

pub use lease::LEASE_NAMESPACE;
use slim::SlimNode;

/// A connection to the Kubernetes API.
pub struct KubeBackend {
    client: Client,
    tx: watch::Sender<Arc<Snapshot>>,
    healthy: Arc<AtomicBool>,
    /// Full lists of Nodes after the first: the watch started again from nothing (its
    /// resourceVersion expired, `410 Gone`, or the watcher gave up resuming it).
    node_relists: prometheus_client::metrics::counter::Counter,
}

/// Builds the client configuration from `--kubeconfig` and `--master` (in-cluster or
/// `$KUBECONFIG`/`~/.kube/config` when neither is given).
pub async fn client_config(kubeconfig: &str, master: &str) -> Result<Config> {
    let mut config = if !kubeconfig.is_empty() {
        let file = Kubeconfig::read_from(kubeconfig)
            .with_context(|| format!("reading --kubeconfig {kubeconfig}"))?;
        Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
            .await
            .with_context(|| format!("using --kubeconfig {kubeconfig}"))?
    } else if !master.is_empty() {
        Config::new(
            master
                .parse()
                .with_context(|| format!("--master {master:?} is not a URL"))?,
        )
    } else {
        Config::infer()
            .await
            .context("finding the Kubernetes API (in-cluster config or kubeconfig)")?
    };
    if !master.is_empty() {
        config.cluster_url = master
            .parse()
            .with_context(|| format!("--master {master:?} is not a URL"))?;
    }
    // kube's default retry layer retries a 503 up to 15 times with backoff growing to minutes,
    // inside a single call: during an API outage a patch would hold the reconcile loop and the
    // watch would never report its failure. kg retries on its own schedule instead (the next
    // check-in for patches, the watcher's backoff for watches).
    config.default_retry = false;
    config
        .headers
        .push((http::header::USER_AGENT, user_agent().parse()?));
    Ok(config)
}

/// The `User-Agent` of kg's and kgctl's requests, in client-go's form as Kilo's are
/// (`kg/v0.8.0 (linux/amd64) kilotun`): the program's name first, so an API server's audit log
/// tells kg's writes from kgctl's and from other clients'.
pub fn user_agent() -> String {
    let program = std::env::args_os()
        .next()
        .and_then(|arg| {
            let name = std::path::Path::new(&arg)
                .file_name()?
                .to_str()?
                .to_string();
            Some(name)
        })
        .unwrap_or_else(|| "kilotun".to_string());
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    format!(
        "{program}/v{} (linux/{arch}) kilotun",
        env!("CARGO_PKG_VERSION")
    )
}

/// How long one write to the API (patch, create, delete) may take before kg gives up on it and
/// carries on with the configuration it has; the next check-in tries again.
const WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs one API write under [`WRITE_TIMEOUT`], with `what` naming it in errors.
async fn bounded<T>(
    what: impl FnOnce() -> String,
    call: impl std::future::Future<Output = kube::Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(WRITE_TIMEOUT, call).await {
        Ok(result) => result.with_context(what),
        Err(_) => Err(anyhow::anyhow!(
            "{}: no answer from the API server within {WRITE_TIMEOUT:?}",
            what()
        )),
    }
}

/// The Peer CRD as a dynamic resource.
fn peer_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk(control::peer::GROUP, control::peer::VERSION, "Peer"),
        control::peer::PLURAL,
    )
}

impl KubeBackend {
    /// Connects and starts watching Nodes and Peers (and, with `watch_leases`, the leaders'
    /// leases).
    pub fn start(config: Config, watch_leases: bool) -> Result<Self> {
        let client = Client::try_from(config).context("building the Kubernetes client")?;
        // Without lease election there are no leases to wait for.
        let listed = super::Listed {
            leases: !watch_leases,
            ipam: true,
            ..super::Listed::default()
        };
        let (tx, _) = watch::channel(Arc::new(Snapshot {
            listed,
            ..Snapshot::default()
        }));
        let healthy = Arc::new(AtomicBool::new(true));
        let backend = Self {
            client,
            tx,
            healthy,
            node_relists: Default::default(),
        };
        backend.watch_nodes();
        backend.watch_peers();
        if watch_leases {
            backend.watch_leases();
        }
        Ok(backend)
    }

    /// Watches the IPAM objects of `kinds` too ([`ipam::watch`]); until each was listed (or
    /// failed to be), the snapshot says not everything is.
    pub fn watch_ipam(&self, kinds: &[ipam::IpamKind], quiet_when_missing: bool) {
        if kinds.is_empty() {
            return;
        }
        self.tx
            .send_modify(|s| Arc::make_mut(s).listed.ipam = false);
        ipam::watch(&self.client, &self.tx, kinds, quiet_when_missing);
    }

    /// Snapshots, updated on every event.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.tx.subscribe()
    }

    /// Waits (up to `timeout`) until the first full list of Nodes (and of the IPAM objects
    /// watched) has arrived; false on timeout.
    pub async fn wait_listed(&self, timeout: std::time::Duration) -> bool {
        let mut rx = self.tx.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|s| s.listed.nodes && s.listed.ipam))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// False while the Node watch is failing (the API server is unreachable).
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// The count of full Node lists after the first (shared: it goes on counting).
    pub fn node_relists(&self) -> prometheus_client::metrics::counter::Counter {
        self.node_relists.clone()
    }

    fn watch_nodes(&self) {
        let api: Api<SlimNode> = Api::all(self.client.clone());
        let mut nodes = NodeWatch {
            tx: self.tx.clone(),
            healthy: self.healthy.clone(),
            pending: None,
            relists: self.node_relists.clone(),
            pace: Pace::new(pace::NOTIFY_INTERVAL),
        };
        tokio::spawn(async move {
            let mut stream = watcher::watcher(api, watcher::Config::default())
                .backoff(WatchBackoff::random())
                .boxed();
            loop {
                // While a change is held back, the stream is left alone until it falls due:
                // the events of a burst pile up in the socket and are read together (one wake
                // and one read instead of one of each per event), then announced at once.
                if let Some(due) = nodes.pace.due() {
                    tokio::time::sleep_until(due).await;
                    let end = due + pace::DRAIN_LIMIT;
                    while Instant::now() < end {
                        match tokio::time::timeout(pace::DRAIN_GAP, stream.next()).await {
                            Ok(Some(event)) => nodes.handle(event),
                            Ok(None) => return,
                            Err(_) => break,
                        }
                    }
                    nodes.notify();
                    continue;
                }
                match stream.next().await {
                    Some(event) => nodes.handle(event),
                    None => return,
                }
            }
        });
    }

    fn watch_peers(&self) {
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &peer_resource());
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let mut warned = false;
            let mut pending: Option<BTreeMap<String, PeerObject>> = None;
            let mut stream = watcher::watcher(api, watcher::Config::default())
                .backoff(WatchBackoff::random())
                .boxed();
            while let Some(event) = stream.next().await {
                let to_peer = |o: DynamicObject| -> Option<(String, PeerObject)> {
                    let name = o.metadata.name.clone().unwrap_or_default();
                    let value = serde_json::to_value(&o).ok()?;
                    match serde_json::from_value::<PeerObject>(value) {
                        Ok(mut p) => {
                            // A status write moves these and nothing kg reads: the Peer
                            // stays the same, and no agent runs a pass for it.
                            p.metadata.resource_version = None;
                            p.metadata.managed_fields = None;
                            Some((name, p))
                        }
                        Err(e) => {
                            tracing::warn!(peer = %name, error = %e, "ignoring a Peer that does not parse");
                            None
                        }
                    }
                };
                match event {
                    Ok(Event::Init) => pending = Some(BTreeMap::new()),
                    Ok(Event::InitApply(o)) => {
                        if let (Some(p), Some((n, peer))) = (pending.as_mut(), to_peer(o)) {
                            p.insert(n, peer);
                        }
                    }
                    Ok(Event::InitDone) => {
                        warned = false;
                        if let Some(peers) = pending.take() {
                            tx.send_if_modified(|s| {
                                let changed =
                                    s.peers != peers && Arc::make_mut(s).replace_peers(peers);
                                mark_listed(s, |l| &mut l.peers) || changed
                            });
                        }
                    }
                    Ok(Event::Apply(o)) => {
                        if let Some((name, peer)) = to_peer(o) {
                            tx.send_if_modified(|s| {
                                s.peers.get(&name) != Some(&peer)
                                    && Arc::make_mut(s).put_peer(&name, Some(peer))
                            });
                        }
                    }
                    Ok(Event::Delete(o)) => {
                        let name = o.metadata.name.unwrap_or_default();
                        tx.send_if_modified(|s| {
                            s.peers.contains_key(&name) && Arc::make_mut(s).put_peer(&name, None)
                        });
                    }
                    Err(e) => {
                        // Without the CRD there are no Peers to wait for: kg meshes without
                        // them. (An API server that cannot be reached lists no Nodes either.)
                        tx.send_if_modified(|s| mark_listed(s, |l| &mut l.peers));
                        if !warned {
                            tracing::warn!(error = %e, "cannot watch Peers (is the peers.kilo.squat.ai CRD installed?); running without Peers and retrying");
                            warned = true;
                        }
                    }
                }
            }
        });
    }

    /// Sets or removes annotations on Node `name` with a JSON merge patch.
    pub async fn patch_annotations(
        &self,
        name: &str,
        changes: &BTreeMap<String, Option<String>>,
    ) -> Result<()> {
        let api: Api<KubeNode> = Api::all(self.client.clone());
        let body = serde_json::json!({ "metadata": { "annotations": changes } });
        bounded(
            || format!("patching the annotations of Node {name}"),
            api.patch(name, &PatchParams::default(), &Patch::Merge(&body)),
        )
        .await?;
        Ok(())
    }
}

impl KubeBackend {
    /// Sets the node condition `KiloMeshReady` on Node `name` through the status subresource:
    /// a strategic merge patch, which Node conditions merge by `type`, so the kubelet's and
    /// other writers' conditions stay as they are.
    pub async fn write_node_condition(
        &self,
        name: &str,
        write: &control::condition::ConditionWrite,
    ) -> Result<()> {
        let api: Api<KubeNode> = Api::all(self.client.clone());
        let time = |ms: i64| {
            k8s_openapi::jiff::Timestamp::from_second(ms.div_euclid(1000))
                .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)
                .to_string()
        };
        let c = &write.condition;
        let body = serde_json::json!({ "status": { "conditions": [{
            "type": control::condition::CONDITION_TYPE,
            "status": c.status().as_str(),
            "reason": c.reason.as_str(),
            "message": c.message,
            "lastHeartbeatTime": time(write.heartbeat_ms),
            "lastTransitionTime": time(write.transition_ms),
        }] } });
        bounded(
            || {
                format!(
                    "writing the {} condition of Node {name}",
                    control::condition::CONDITION_TYPE
                )
            },
            api.patch_status(name, &PatchParams::default(), &Patch::Strategic(&body)),
        )
        .await?;
        Ok(())
    }

    /// Writes a Peer's `status` through its status subresource (a merge patch, field manager
    /// `kg-NODE`), within the write timeout.
    pub async fn write_peer_status(
        &self,
        node: &str,
        write: &control::peer_status::PeerStatusWrite,
    ) -> Result<()> {
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &peer_resource());
        let body = serde_json::json!({ "status": write.status });
        let params = PatchParams {
            field_manager: Some(format!("kg-{node}")),
            ..PatchParams::default()
        };
        let name = &write.peer;
        bounded(
            || format!("writing the status of Peer {name}"),
            api.patch_status(name, &params, &Patch::Merge(&body)),
        )
        .await?;
        Ok(())
    }

    /// The `KiloMeshReady` condition Node `name` carries, within the write timeout.
    pub async fn node_condition(
        &self,
        name: &str,
    ) -> Result<Option<control::condition::ConditionWrite>> {
        let api: Api<KubeNode> = Api::all(self.client.clone());
        let node = bounded(|| format!("reading Node {name}"), api.get(name)).await?;
        let ms = |t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time| t.0.as_millisecond();
        Ok(node
            .status
            .and_then(|s| s.conditions)
            .into_iter()
            .flatten()
            .find(|c| c.type_ == control::condition::CONDITION_TYPE)
            .and_then(|c| {
                Some(control::condition::ConditionWrite {
                    condition: control::condition::MeshCondition {
                        reason: control::condition::MeshReason::from_name(c.reason.as_deref()?)?,
                        message: c.message.unwrap_or_default(),
                    },
                    transition_ms: c.last_transition_time.as_ref().map(ms)?,
                    heartbeat_ms: c.last_heartbeat_time.as_ref().map(ms)?,
                })
            }))
    }

    /// The queue that writes this agent's Kubernetes Events, as kg of `node`.
    pub fn event_poster(
        &self,
        node: &str,
        counts: Arc<dyn events::EventCounts>,
    ) -> events::EventPoster {
        events::EventPoster::start(self.client.clone(), node, counts)
    }

    /// Why kg is stopping (see [`departure`]), within the write timeout.
    pub async fn departure(&self) -> super::Departure {
        match tokio::time::timeout(WRITE_TIMEOUT, departure::departure(&self.client)).await {
            Ok(d) => d,
            Err(_) => super::Departure::Removed {
                why: format!(
                    "the API server did not say within {WRITE_TIMEOUT:?} whether kg's DaemonSet still exists"
                ),
            },
        }
    }

    fn peers_api(&self) -> Api<DynamicObject> {
        Api::all_with(self.client.clone(), &peer_resource())
    }

    /// Creates a Peer.
    pub async fn create_peer(&self, peer: &PeerObject) -> Result<()> {
        let name = peer.metadata.name.clone().unwrap_or_default();
        let object: DynamicObject = serde_json::from_value(serde_json::to_value(peer)?)?;
        bounded(
            || format!("creating Peer {name}"),
            self.peers_api().create(&PostParams::default(), &object),
        )
        .await?;
        Ok(())
    }

    /// Deletes the Peer called `name`.
    pub async fn delete_peer(&self, name: &str) -> Result<()> {
        bounded(
            || format!("deleting Peer {name}"),
            self.peers_api().delete(name, &DeleteParams::default()),
        )
        .await?;
        Ok(())
    }
}

/// Records in `snapshot` that the kind `which` picks has been listed; true when that is news.
pub(super) fn mark_listed(
    snapshot: &mut Arc<Snapshot>,
    which: impl Fn(&mut super::Listed) -> &mut bool,
) -> bool {
    let mut listed = snapshot.listed;
    if *which(&mut listed) {
        return false;
    }
    *which(&mut listed) = true;
    Arc::make_mut(snapshot).listed = listed;
    true
}

/// The Node watch's side of the snapshot: the events taken in, readers told per [`Pace`].
struct NodeWatch {
    tx: watch::Sender<Arc<Snapshot>>,
    healthy: Arc<AtomicBool>,
    /// The Nodes of a re-list in progress.
    pending: Option<BTreeMap<String, Arc<KubeNode>>>,
    /// The lists that begin after the first one ended (the snapshot says the Nodes are listed).
    relists: prometheus_client::metrics::counter::Counter,
    pace: Pace,
}

impl NodeWatch {
    /// Takes in one event of the watch. A change is made to the snapshot at once but announced
    /// only when the pace allows (a re-list at once).
    fn handle(&mut self, event: kube::runtime::watcher::Result<Event<SlimNode>>) {
        let was_healthy = self.healthy.swap(event.is_ok(), Ordering::Relaxed);
        let pace = &mut self.pace;
        match event {
            Ok(Event::Init) => {
                if self.tx.borrow().listed.nodes {
                    self.relists.inc();
                }
                self.pending = Some(BTreeMap::new());
            }
            Ok(Event::InitApply(node)) => {
                if let Some(p) = self.pending.as_mut() {
                    let name = node.metadata.name.clone().unwrap_or_default();
                    p.insert(name, Arc::new(node.into_node()));
                }
            }
            Ok(Event::InitDone) => {
                if let Some(nodes) = self.pending.take() {
                    // A re-list is announced at once (with whatever else was held back).
                    if self.tx.send_if_modified(|s| {
                        let changed = Arc::make_mut(s).replace_nodes(nodes);
                        mark_listed(s, |l| &mut l.nodes) || changed
                    }) {
                        pace.notified(Instant::now());
                    }
                }
            }
            // Compared before anything is cloned: an identical object (a re-sent event) wakes
            // nobody.
            Ok(Event::Apply(node)) => {
                let name = node.metadata.name.clone().unwrap_or_default();
                let node = node.into_node();
                self.tx.send_if_modified(|s| {
                    if s.nodes.get(&name).is_some_and(|old| **old == node) {
                        return false;
                    }
                    Arc::make_mut(s).put_node(&name, node) && pace.changed(Instant::now())
                });
            }
            Ok(Event::Delete(node)) => {
                let name = node.metadata.name.unwrap_or_default();
                self.tx.send_if_modified(|s| {
                    s.nodes.contains_key(&name)
                        && Arc::make_mut(s).remove_node(&name)
                        && pace.changed(Instant::now())
                });
            }
            // Once per outage at warn; the watcher's backoff retries are debug.
            Err(e) if was_healthy => {
                tracing::warn!(error = %e, "watching Nodes failed; retrying with backoff")
            }
            Err(e) => tracing::debug!(error = %e, "watching Nodes still fails"),
        }
    }

    /// Tells readers of the changes held back.
    fn notify(&mut self) {
        self.pace.notified(Instant::now());
        self.tx.send_modify(|_| {});
    }
}
