//! Leader-election leases on the Kubernetes backend: `coordination.k8s.io/v1` Leases named
//! `kilotun-leader-<location>` in [`LEASE_NAMESPACE`], watched like Nodes, and written with the
//! API server's own compare-and-swap (a replace carrying the `resourceVersion` read).

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context, Result};
use control::leader::{Expectation, LeaseState};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::PostParams;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::Api;

use super::super::backoff::WatchBackoff;
use super::super::file::{lease_object, lease_state};
use super::KubeBackend;

/// The namespace holding the leases (Kilo's DaemonSet's).
pub const LEASE_NAMESPACE: &str = "kube-system";
/// The prefix of every lease name (see `control::leader::lease_name`).
const PREFIX: &str = "kilotun-leader-";

impl KubeBackend {
    fn leases_api(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), LEASE_NAMESPACE)
    }

    /// Watches the leases into the snapshots.
    pub(super) fn watch_leases(&self) {
        let api = self.leases_api();
        let tx = self.tx.clone();
        tokio::spawn(async move {
            let mut warned = false;
            let mut pending: Option<BTreeMap<String, LeaseState>> = None;
            let mut stream = watcher::watcher(api, watcher::Config::default())
                .backoff(WatchBackoff::random())
                .boxed();
            let ours = |l: &Lease| -> Option<(String, LeaseState)> {
                let name = l.metadata.name.clone()?;
                name.starts_with(PREFIX).then(|| (name, lease_state(l)))
            };
            while let Some(event) = stream.next().await {
                match event {
                    Ok(Event::Init) => pending = Some(BTreeMap::new()),
                    Ok(Event::InitApply(l)) => {
                        if let (Some(p), Some((n, s))) = (pending.as_mut(), ours(&l)) {
                            p.insert(n, s);
                        }
                    }
                    Ok(Event::InitDone) => {
                        warned = false;
                        if let Some(leases) = pending.take() {
                            tx.send_if_modified(|s| {
                                let changed =
                                    s.leases != leases && Arc::make_mut(s).replace_leases(leases);
                                super::mark_listed(s, |l| &mut l.leases) || changed
                            });
                        }
                    }
                    Ok(Event::Apply(l)) => {
                        if let Some((name, state)) = ours(&l) {
                            tx.send_if_modified(|s| {
                                if s.leases.get(&name) == Some(&state) {
                                    return false;
                                }
                                let mut leases = s.leases.clone();
                                leases.insert(name, state);
                                Arc::make_mut(s).replace_leases(leases)
                            });
                        }
                    }
                    Ok(Event::Delete(l)) => {
                        if let Some((name, _)) = ours(&l) {
                            tx.send_if_modified(|s| {
                                if !s.leases.contains_key(&name) {
                                    return false;
                                }
                                let mut leases = s.leases.clone();
                                leases.remove(&name);
                                Arc::make_mut(s).replace_leases(leases)
                            });
                        }
                    }
                    Err(e) => {
                        // Leases that cannot be read elect nobody: Kilo's rule decides until
                        // they can, so they are not waited for.
                        tx.send_if_modified(|s| super::mark_listed(s, |l| &mut l.leases));
                        if !warned {
                            tracing::warn!(error = %e, namespace = LEASE_NAMESPACE, "cannot watch Leases (does the kilo ServiceAccount have the kilo-leases Role?); retrying");
                            warned = true;
                        }
                    }
                }
            }
        });
    }

    /// Writes lease `name` as `lease` if it is still as `expected` (see
    /// `LeaseState::may_replace`): the replace carries the `resourceVersion` read, so a
    /// concurrent writer makes it fail with 409. Then the lease is read and judged again, up to
    /// [`WRITE_ATTEMPTS`] times: every kg steps its leases every 2 s, and kg processes started
    /// together step in phase, so a node taking over a cut-off lease would otherwise lose to
    /// the holder's renewal of the same moment, step after step (a failover of 28 to 31 s
    /// instead of 17 to 19 s in about one run of three). False when the lease is no longer as
    /// expected, or still contended after the last attempt.
    pub async fn write_lease(
        &self,
        name: &str,
        lease: &LeaseState,
        expected: &Expectation,
    ) -> Result<bool> {
        for _ in 0..WRITE_ATTEMPTS {
            match self.write_lease_once(name, lease, expected).await? {
                Written::Yes => return Ok(true),
                Written::NotAsExpected => return Ok(false),
                Written::Conflict => {}
            }
        }
        Ok(false)
    }

    /// One read, judgement and conditional write of lease `name`.
    async fn write_lease_once(
        &self,
        name: &str,
        lease: &LeaseState,
        expected: &Expectation,
    ) -> Result<Written> {
        let api = self.leases_api();
        let current = api
            .get_opt(name)
            .await
            .with_context(|| format!("reading Lease {LEASE_NAMESPACE}/{name}"))?;
        let mut object = lease_object(name, lease);
        object.metadata.namespace = Some(LEASE_NAMESPACE.to_string());
        let written = match current {
            None if !lease.may_replace(&LeaseState::default(), expected) => {
                return Ok(Written::NotAsExpected)
            }
            None => api.create(&PostParams::default(), &object).await,
            Some(now) => {
                if !lease.may_replace(&lease_state(&now), expected) {
                    return Ok(Written::NotAsExpected);
                }
                object.metadata.resource_version = now.metadata.resource_version;
                object
                    .spec
                    .as_mut()
                    .expect("lease_object sets a spec")
                    .acquire_time = now.spec.and_then(|s| s.acquire_time);
                api.replace(name, &PostParams::default(), &object).await
            }
        };
        match written {
            Ok(_) => Ok(Written::Yes),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(Written::Conflict),
            Err(e) => Err(e).with_context(|| format!("writing Lease {LEASE_NAMESPACE}/{name}")),
        }
    }
}

/// How many times [`KubeBackend::write_lease`] reads and writes a lease that another writer
/// changed in between.
const WRITE_ATTEMPTS: usize = 3;

/// What one conditional write of a lease did.
enum Written {
    /// It was written.
    Yes,
    /// The lease is not as expected any more: not written.
    NotAsExpected,
    /// Another writer changed it between the read and the write.
    Conflict,
}
