//! Watches of the IPAM objects `--ipam` reads: Calico's `blockaffinities` and `ipamblocks`,
//! Cilium's `ciliumnodes`, or every Pod. Each kind is watched on its own and kept in the
//! snapshot's [`IpamObjects`]; one that cannot be watched (its CRD missing, or no RBAC rule
//! for it) is said once, naming the resource and the rule to add, and its last good objects
//! stay.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use control::ipam::{objects, IpamObjects, ObjectError};
use futures::StreamExt;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use serde_json::Value;
use tokio::sync::watch;
use tokio::time::Instant;

use super::mark_listed;
use crate::backend::backoff::WatchBackoff;
use crate::backend::pace::{self, Pace};
use crate::backend::Snapshot;

/// An IPAM kind kg can watch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpamKind {
    /// `blockaffinities.crd.projectcalico.org`.
    BlockAffinities,
    /// `ipamblocks.crd.projectcalico.org`.
    IpamBlocks,
    /// `ciliumnodes.cilium.io`.
    CiliumNodes,
    /// `pods`.
    Pods,
}

impl IpamKind {
    fn resource(self) -> ApiResource {
        let (group, version, kind, plural) = self.names();
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
    }

    /// API group, version, kind and plural.
    fn names(self) -> (&'static str, &'static str, &'static str, &'static str) {
        match self {
            Self::BlockAffinities => (
                "crd.projectcalico.org",
                "v1",
                "BlockAffinity",
                "blockaffinities",
            ),
            Self::IpamBlocks => ("crd.projectcalico.org", "v1", "IPAMBlock", "ipamblocks"),
            Self::CiliumNodes => ("cilium.io", "v2", "CiliumNode", "ciliumnodes"),
            Self::Pods => ("", "v1", "Pod", "pods"),
        }
    }

    /// The resource as `kubectl` names it, and the ClusterRole rule kg needs for it.
    pub fn rule(self) -> String {
        let (group, _, _, plural) = self.names();
        let resource = if group.is_empty() {
            plural.to_string()
        } else {
            format!("{plural}.{group}")
        };
        format!(
            "{resource} (ClusterRole rule: apiGroups [\"{group}\"], resources [\"{plural}\"], verbs [\"list\", \"watch\"])"
        )
    }

    /// Takes `object` into `ipam`; true when that changed it (a Pod that left the pod network,
    /// on the host's network or ended, is removed).
    fn take(
        self,
        ipam: &mut IpamObjects,
        key: String,
        object: &Value,
    ) -> Result<bool, ObjectError> {
        fn put<T: PartialEq + Clone>(map: &mut BTreeMap<String, T>, key: String, v: T) -> bool {
            map.insert(key, v.clone()).as_ref() != Some(&v)
        }
        Ok(match self {
            Self::BlockAffinities => {
                put(&mut ipam.affinities, key, objects::block_affinity(object)?)
            }
            Self::IpamBlocks => put(&mut ipam.blocks, key, objects::ipam_block(object)?),
            Self::CiliumNodes => put(&mut ipam.cilium_nodes, key, objects::cilium_node(object)?),
            Self::Pods => match objects::pod_addresses(object)? {
                Some(pod) => put(&mut ipam.pods, key, pod),
                None => ipam.pods.remove(&key).is_some(),
            },
        })
    }

    /// Removes the object `key` from `ipam`; true when it was there.
    fn remove(self, ipam: &mut IpamObjects, key: &str) -> bool {
        match self {
            Self::BlockAffinities => ipam.affinities.remove(key).is_some(),
            Self::IpamBlocks => ipam.blocks.remove(key).is_some(),
            Self::CiliumNodes => ipam.cilium_nodes.remove(key).is_some(),
            Self::Pods => ipam.pods.remove(key).is_some(),
        }
    }

    /// Replaces every object of this kind in `ipam` with those of `listed`.
    fn replace_all(self, ipam: &mut IpamObjects, listed: IpamObjects) {
        match self {
            Self::BlockAffinities => ipam.affinities = listed.affinities,
            Self::IpamBlocks => ipam.blocks = listed.blocks,
            Self::CiliumNodes => ipam.cilium_nodes = listed.cilium_nodes,
            Self::Pods => ipam.pods = listed.pods,
        }
    }
}

/// True when `error` says the resource does not exist (its CRD is not installed).
fn not_found(error: &watcher::Error) -> bool {
    let api = match error {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => e,
        watcher::Error::WatchError(status) => return status.code == 404,
        watcher::Error::NoResourceVersion => return false,
    };
    matches!(api, kube::Error::Api(status) if status.code == 404)
}

/// The object's key: its name, `namespace/name` where it has a namespace.
fn key_of(object: &DynamicObject) -> String {
    let name = object.metadata.name.clone().unwrap_or_default();
    match &object.metadata.namespace {
        Some(ns) => format!("{ns}/{name}"),
        None => name,
    }
}

/// Watches each of `kinds`; once every one has been listed (or, under `auto`, found missing),
/// the snapshot says the IPAM objects are listed. `quiet_when_missing` (`--ipam=auto`, which looks for kinds a
/// cluster may not have) says a watch that fails at debug level, not warn.
pub fn watch(
    client: &Client,
    tx: &watch::Sender<Arc<Snapshot>>,
    kinds: &[IpamKind],
    quiet_when_missing: bool,
) {
    let pending = Arc::new(AtomicU8::new((1u8 << kinds.len()) - 1));
    for (bit, kind) in kinds.iter().copied().enumerate() {
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &kind.resource());
        let tx = tx.clone();
        let pending = Arc::clone(&pending);
        let listed = move |tx: &watch::Sender<Arc<Snapshot>>| {
            let left = pending.fetch_and(!(1u8 << bit), Ordering::AcqRel) & !(1u8 << bit);
            if left == 0 {
                tx.send_if_modified(|s| mark_listed(s, |l| &mut l.ipam));
            }
        };
        tokio::spawn(async move {
            let mut failing = false;
            let mut relist: Option<IpamObjects> = None;
            let mut stream = watcher::watcher(api, watcher::Config::default())
                .backoff(WatchBackoff::random())
                .boxed();
            // An object that does not parse is dropped (its last good form no longer holds)
            // and said once until it parses again.
            let mut refused = std::collections::BTreeSet::new();
            let mut take = |ipam: &mut IpamObjects, o: DynamicObject| {
                let key = key_of(&o);
                let value = serde_json::to_value(&o).unwrap_or(Value::Null);
                match kind.take(ipam, key.clone(), &value) {
                    Ok(changed) => {
                        refused.remove(&key);
                        changed
                    }
                    Err(e) => {
                        if refused.insert(key.clone()) {
                            tracing::warn!("{e}; ignoring it");
                        }
                        kind.remove(ipam, &key)
                    }
                }
            };
            // Readers are told of changes at most once per interval, as of the Nodes' (with
            // 100 pods a node, the pods' own churn is tens of events a second).
            let mut pace = Pace::new(pace::NOTIFY_INTERVAL);
            loop {
                let event = match pace.due() {
                    Some(due) => tokio::select! {
                        () = tokio::time::sleep_until(due) => {
                            pace.notified(Instant::now());
                            tx.send_modify(|_| {});
                            continue;
                        }
                        event = stream.next() => event,
                    },
                    None => stream.next().await,
                };
                let Some(event) = event else {
                    if pace.due().is_some() {
                        tx.send_modify(|_| {});
                    }
                    return;
                };
                match event {
                    Ok(Event::Init) => relist = Some(IpamObjects::default()),
                    Ok(Event::InitApply(o)) => {
                        if let Some(r) = relist.as_mut() {
                            take(r, o);
                        }
                    }
                    Ok(Event::InitDone) => {
                        if failing {
                            tracing::info!("watching {} again", kind.rule());
                            failing = false;
                        }
                        if let Some(r) = relist.take() {
                            // A re-list is told at once, with whatever was held back.
                            let held = pace.due().is_some();
                            let changed = tx.send_if_modified(|s| {
                                let mut ipam = (*s.ipam).clone();
                                kind.replace_all(&mut ipam, r);
                                (*s.ipam != ipam && Arc::make_mut(s).replace_ipam(ipam)) || held
                            });
                            if changed {
                                pace.notified(Instant::now());
                            }
                        }
                        listed(&tx);
                    }
                    Ok(Event::Apply(o)) => {
                        tx.send_if_modified(|s| {
                            Arc::make_mut(s).edit_ipam(|ipam| take(ipam, o))
                                && pace.changed(Instant::now())
                        });
                    }
                    Ok(Event::Delete(o)) => {
                        let key = key_of(&o);
                        tx.send_if_modified(|s| {
                            Arc::make_mut(s).edit_ipam(|ipam| kind.remove(ipam, &key))
                                && pace.changed(Instant::now())
                        });
                    }
                    Err(e) => {
                        // A kind `auto` looks for that the cluster does not have (no CRD) is
                        // nothing to wait for. Any other failure before the first list keeps
                        // kg waiting (on the peers it restored), not meshing on no pod
                        // ranges; after it, kg goes on with the last good objects.
                        if quiet_when_missing && not_found(&e) {
                            listed(&tx);
                        }
                        if !failing {
                            failing = true;
                            if quiet_when_missing {
                                tracing::debug!(error = %e, "cannot watch {}", kind.rule());
                            } else {
                                tracing::warn!(error = %e, "cannot watch {}; keeping the last pod ranges read and retrying", kind.rule());
                            }
                        }
                    }
                }
            }
        });
    }
}

/// The kinds `--ipam` reads: `None` for the Nodes' own ranges (nothing to watch).
pub fn kinds(source: Option<control::ipam::IpamSource>) -> Vec<IpamKind> {
    use control::ipam::IpamSource;
    match source {
        Some(IpamSource::Node) => Vec::new(),
        Some(IpamSource::Calico) => vec![IpamKind::BlockAffinities, IpamKind::IpamBlocks],
        Some(IpamSource::Cilium) => vec![IpamKind::CiliumNodes],
        Some(IpamSource::Pods) => vec![IpamKind::Pods],
        // auto: whatever of Calico's and Cilium's the cluster holds.
        None => vec![
            IpamKind::BlockAffinities,
            IpamKind::IpamBlocks,
            IpamKind::CiliumNodes,
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_names_its_resource_and_the_rule_to_add() {
        assert_eq!(
            IpamKind::BlockAffinities.rule(),
            "blockaffinities.crd.projectcalico.org (ClusterRole rule: apiGroups [\"crd.projectcalico.org\"], resources [\"blockaffinities\"], verbs [\"list\", \"watch\"])"
        );
        assert!(IpamKind::Pods
            .rule()
            .starts_with("pods (ClusterRole rule: apiGroups [\"\"]"));
        assert_eq!(IpamKind::CiliumNodes.resource().plural, "ciliumnodes");
        assert_eq!(kinds(Some(control::ipam::IpamSource::Node)), Vec::new());
        assert_eq!(kinds(None).len(), 3);
    }

    #[test]
    fn a_pod_that_leaves_the_pod_network_is_dropped_and_a_deleted_object_removed() {
        let mut ipam = IpamObjects::default();
        let running = serde_json::json!({"metadata": {"name": "p", "namespace": "ns"},
            "spec": {"nodeName": "a"}, "status": {"podIPs": [{"ip": "10.1.0.1"}]}});
        assert!(IpamKind::Pods
            .take(&mut ipam, "ns/p".into(), &running)
            .unwrap());
        assert!(
            !IpamKind::Pods
                .take(&mut ipam, "ns/p".into(), &running)
                .unwrap(),
            "the same"
        );
        assert_eq!(ipam.pods.len(), 1);
        let done = serde_json::json!({"metadata": {"name": "p", "namespace": "ns"},
            "spec": {"nodeName": "a"}, "status": {"phase": "Succeeded", "podIPs": [{"ip": "10.1.0.1"}]}});
        assert!(IpamKind::Pods
            .take(&mut ipam, "ns/p".into(), &done)
            .unwrap());
        assert!(ipam.pods.is_empty());
        IpamKind::Pods
            .take(&mut ipam, "ns/p".into(), &running)
            .unwrap();
        assert!(IpamKind::Pods.remove(&mut ipam, "ns/p"));
        assert!(!IpamKind::Pods.remove(&mut ipam, "ns/p"));
    }
}
