//! What happened to each node's kilo pods during a rollout, and when: the API server polled
//! every 200 ms while the rollout runs (so each moment is known to within about a third of a
//! second, what a `kubectl get` takes here), each step of each pod stamped with the moment it
//! was first seen. It splits a rollout's gap between the old pod's exit, Kubernetes replacing
//! the pod, and the new kg's start.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{KubeletCluster, KILO_SELECTOR};

/// A step of a kilo pod's life, as the API server shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Step {
    /// The pod is in the API.
    Listed,
    /// Its kg container runs.
    Running,
    /// It is Ready (kg answers `/health`).
    Ready,
    /// It is being deleted: the kubelet sends kg SIGTERM.
    Deleting,
    /// Its kg container has exited.
    Exited,
    /// It is gone from the API.
    Gone,
}

/// When each pod (by node, then uid) was first seen at each step.
#[derive(Default)]
pub(super) struct Timeline {
    pods: BTreeMap<(String, String), BTreeMap<Step, Instant>>,
}

impl Timeline {
    fn observe(&mut self, pods: &[Value], at: Instant) {
        let mut listed = Vec::new();
        for pod in pods {
            let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
            let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
            let key = (node.to_string(), uid.to_string());
            let state = &pod["status"]["containerStatuses"][0]["state"];
            let ready = pod["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            let steps = self.pods.entry(key.clone()).or_default();
            let mut mark = |step: Step, now: bool| {
                if now {
                    steps.entry(step).or_insert(at);
                }
            };
            mark(Step::Listed, true);
            mark(Step::Running, !state["running"].is_null());
            mark(Step::Ready, ready);
            mark(
                Step::Deleting,
                !pod["metadata"]["deletionTimestamp"].is_null(),
            );
            mark(Step::Exited, !state["terminated"].is_null());
            listed.push(key);
        }
        for (key, steps) in &mut self.pods {
            if !listed.contains(key) {
                steps.entry(Step::Gone).or_insert(at);
            }
        }
    }

    /// The steps of `node`'s pods, oldest pod first.
    pub(super) fn of(&self, node: &str) -> Vec<&BTreeMap<Step, Instant>> {
        let mut pods: Vec<&BTreeMap<Step, Instant>> = self
            .pods
            .iter()
            .filter(|((n, _), _)| n == node)
            .map(|(_, steps)| steps)
            .collect();
        pods.sort_by_key(|steps| steps.get(&Step::Listed).copied());
        pods
    }

    /// `node`'s pods, each step in seconds after `origin`.
    pub(super) fn describe(&self, node: &str, origin: Instant) -> String {
        let mut text = String::new();
        for (i, steps) in self.of(node).into_iter().enumerate() {
            let _ = write!(text, "{node} pod {i}:");
            for (step, at) in steps {
                let secs = at.saturating_duration_since(origin).as_secs_f64();
                let _ = write!(text, " {step:?} {secs:.1}");
            }
            text.push('\n');
        }
        text
    }
}

/// Polls the kilo pods every 200 ms until `done` is set.
pub(super) fn record(k: &KubeletCluster, done: &AtomicBool) -> Timeline {
    let mut timeline = Timeline::default();
    while !done.load(Ordering::Relaxed) {
        let pods = k.json(&["-n", "kube-system", "get", "pods", "-l", KILO_SELECTOR]);
        let items = pods["items"].as_array().map(Vec::as_slice).unwrap_or(&[]);
        timeline.observe(items, Instant::now());
        std::thread::sleep(Duration::from_millis(200));
    }
    timeline
}
