//! Kubernetes Events (`events.k8s.io/v1`): the writes [`control::api_events`] decides, sent
//! one after another by a task of their own, so the agent's loop never waits on the API server
//! for them.

use std::sync::Arc;

use control::api_events::{ApiEvent, ApiWrite, Regarding, REPORTING_CONTROLLER};
use control::journal::EventKind;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as KubeEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use tokio::sync::{mpsc, oneshot};

/// Where Events about cluster-scoped objects (Nodes, Peers) are kept: every API server version
/// takes an `events.k8s.io/v1` Event about a cluster-scoped object there (1.20's refuses one in
/// `default`: "involvedObject.namespace ... does not match event.namespace").
pub const EVENT_NAMESPACE: &str = "kube-system";

/// Writes queued at most: a burst beyond it (the API server slower than the agent) is dropped.
const QUEUE: usize = 64;

/// How each write ended, for `kilotun_api_events_total{result}`.
pub trait EventCounts: Send + Sync {
    /// Counts one write that ended as `result` (`posted`, `repeated`, `failed`, `dropped`).
    fn count(&self, result: &'static str);
}

enum Job {
    Write(ApiWrite),
    Flush(oneshot::Sender<()>),
}

/// The queue of Event writes and the task that sends them.
#[derive(Clone)]
pub struct EventPoster {
    jobs: mpsc::Sender<Job>,
    counts: Arc<dyn EventCounts>,
}

impl EventPoster {
    /// Starts the task that writes through `client` as kg of `node`.
    pub fn start(client: Client, node: &str, counts: Arc<dyn EventCounts>) -> Self {
        let (jobs, mut queue) = mpsc::channel(QUEUE);
        let api: Api<KubeEvent> = Api::namespaced(client, EVENT_NAMESPACE);
        let instance = format!("kg-{node}");
        let task_counts = Arc::clone(&counts);
        tokio::spawn(async move {
            // The first refusal is said (a missing RBAC rule, an API server that refuses the
            // Event); the rest are counted.
            let mut said = false;
            while let Some(job) = queue.recv().await {
                match job {
                    Job::Write(write) => match send(&api, &instance, &write).await {
                        Ok(result) => task_counts.count(result),
                        Err(e) => {
                            if !said {
                                tracing::warn!(error = %e, "the API server refused a Kubernetes Event (kg goes on meshing; is `events.k8s.io` create and patch in kg's ClusterRole?)");
                                said = true;
                            } else {
                                tracing::debug!(error = %e, "writing a Kubernetes Event");
                            }
                            task_counts.count("failed");
                        }
                    },
                    Job::Flush(done) => {
                        let _ = done.send(());
                    }
                }
            }
        });
        Self { jobs, counts }
    }

    /// Queues `write`; dropped (and counted) when the queue is full.
    pub fn post(&self, write: ApiWrite) {
        if self.jobs.try_send(Job::Write(write)).is_err() {
            self.counts.count("dropped");
        }
    }

    /// Waits until the writes queued so far were sent, or `within` passed.
    pub async fn flush(&self, within: std::time::Duration) {
        let (done, sent) = oneshot::channel();
        if self.jobs.send(Job::Flush(done)).await.is_ok() {
            let _ = tokio::time::timeout(within, sent).await;
        }
    }
}

/// Sends one write; what happened, as a count's label, or why it failed.
async fn send(
    api: &Api<KubeEvent>,
    instance: &str,
    write: &ApiWrite,
) -> Result<&'static str, String> {
    let call = async {
        match write {
            ApiWrite::Create(event) => api
                .create(&PostParams::default(), &kube_event(event, instance))
                .await
                .map(|_| "posted"),
            ApiWrite::Repeat {
                name,
                count,
                last_unix_ms,
            } => {
                let series = serde_json::json!({ "series": EventSeries {
                    count: i32::try_from(*count).unwrap_or(i32::MAX),
                    last_observed_time: micro_time(*last_unix_ms),
                } });
                api.patch(name, &PatchParams::default(), &Patch::Merge(&series))
                    .await
                    .map(|_| "repeated")
            }
        }
    };
    match tokio::time::timeout(super::WRITE_TIMEOUT, call).await {
        Ok(Ok(result)) => Ok(result),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "no answer from the API server within {:?}",
            super::WRITE_TIMEOUT
        )),
    }
}

fn micro_time(unix_ms: i64) -> MicroTime {
    MicroTime(
        k8s_openapi::jiff::Timestamp::from_millisecond(unix_ms)
            .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    )
}

/// The Event object of `event`, reported by `instance`.
fn kube_event(event: &ApiEvent, instance: &str) -> KubeEvent {
    let regarding = match &event.regarding {
        Regarding::Node(name) => ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(name.clone()),
            ..Default::default()
        },
        Regarding::Peer(name) => ObjectReference {
            api_version: Some(format!(
                "{}/{}",
                control::peer::GROUP,
                control::peer::VERSION
            )),
            kind: Some("Peer".into()),
            name: Some(name.clone()),
            ..Default::default()
        },
    };
    KubeEvent {
        metadata: ObjectMeta {
            name: Some(event.name.clone()),
            namespace: Some(EVENT_NAMESPACE.into()),
            ..Default::default()
        },
        event_time: Some(micro_time(event.at_unix_ms)),
        reporting_controller: Some(REPORTING_CONTROLLER.into()),
        reporting_instance: Some(instance.into()),
        action: Some(event.action.into()),
        reason: Some(event.reason.as_str().into()),
        type_: Some(
            match event.kind {
                EventKind::Normal => "Normal",
                EventKind::Warning => "Warning",
            }
            .into(),
        ),
        note: Some(event.note.clone()),
        regarding: Some(regarding),
        ..Default::default()
    }
}
