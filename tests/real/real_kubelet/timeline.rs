//! What happened to each node's kilo pods during a rollout, and when: one `kubectl get
//! --watch` of them while the rollout runs, each change stamped with the moment it arrives. It
//! splits a rollout's gap between the old pod's exit, Kubernetes replacing the pod, and the
//! new kg's start.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::BufReader;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
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
    /// It is Ready (kg answers `/ready`: its engine carries traffic, or it stands by).
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
    /// Takes in one watch event (`ADDED`, `MODIFIED` or `DELETED`, with the pod) seen `at`.
    fn observe(&mut self, event: &Value, at: Instant) {
        let pod = &event["object"];
        let node = pod["spec"]["nodeName"].as_str().unwrap_or_default();
        let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
        let state = &pod["status"]["containerStatuses"][0]["state"];
        let ready = pod["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        let steps = self
            .pods
            .entry((node.to_string(), uid.to_string()))
            .or_default();
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
        mark(Step::Gone, event["type"] == "DELETED");
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

/// Watches the kilo pods until `done` is set.
pub(super) fn record(k: &KubeletCluster, done: &AtomicBool) -> Timeline {
    let mut watch = Command::new(&k.env["KUBECTL"])
        .arg("--kubeconfig")
        .arg(&k.env["KUBECONFIG"])
        .args(["-n", "kube-system", "get", "pods", "-l", KILO_SELECTOR])
        .args(["--watch", "--output-watch-events", "-o", "json"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("running kubectl get --watch");
    let stdout = watch.stdout.take().unwrap();
    let (events, arrivals) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let stream = serde_json::Deserializer::from_reader(BufReader::new(stdout));
        for event in stream.into_iter::<Value>().map_while(Result::ok) {
            if events.send((Instant::now(), event)).is_err() {
                break;
            }
        }
    });
    let mut timeline = Timeline::default();
    while !done.load(Ordering::Relaxed) {
        match arrivals.recv_timeout(Duration::from_millis(100)) {
            Ok((at, event)) => timeline.observe(&event, at),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = watch.kill();
    let _ = watch.wait();
    let _ = reader.join();
    for (at, event) in arrivals.try_iter() {
        timeline.observe(&event, at);
    }
    timeline
}

/// Where a rollout's ping gaps went, node by node, from `timeline` (Kubernetes 1.20 replaces a
/// node's pod only once the old one is gone): the old kg's exit after SIGTERM, Kubernetes
/// removing the old pod and creating the new one, the kubelet starting its container, and the
/// new kg's start until traffic flows. `windows`: each direction's longest gap.
pub(super) fn split_rollout_gaps(
    k: &KubeletCluster,
    timeline: &Timeline,
    origin: Instant,
    windows: [(Instant, Instant); 2],
) {
    let secs = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64();
    for node in &k.nodes {
        eprint!("{}", timeline.describe(&node.name, origin));
        let pods = timeline.of(&node.name);
        let [old, new] = pods[..] else {
            panic!(
                "{}: {} kilo pods during the rollout, not the old and the new one:\n{}",
                node.name,
                pods.len(),
                timeline.describe(&node.name, origin)
            );
        };
        let step = |pod: &BTreeMap<Step, Instant>, step: Step| {
            *pod.get(&step).unwrap_or_else(|| {
                panic!(
                    "{}: a pod never seen {step:?}:\n{}",
                    node.name,
                    timeline.describe(&node.name, origin)
                )
            })
        };
        let (sigterm, gone) = (step(old, Step::Deleting), step(old, Step::Gone));
        // Between two polls a container may exit and its pod go at once.
        let exited = old.get(&Step::Exited).copied().unwrap_or(gone);
        let (listed, running) = (step(new, Step::Listed), step(new, Step::Running));
        assert!(
            listed >= sigterm,
            "{}: the new pod came before the old one was deleted",
            node.name
        );
        // The gap this node's replacement caused: the one that began while its old pod went.
        for (start, end) in windows {
            if start + Duration::from_secs(1) < sigterm || start > running {
                continue;
            }
            eprintln!(
                "rollout gap on {} ({:.1} s): kg's exit after SIGTERM {:.1} s, the old pod's removal \
                 {:.1} s, until the new pod {:.1} s, its container started {:.1} s, kg's start until \
                 traffic {:.1} s",
                node.name,
                secs(start, end),
                secs(sigterm, exited),
                secs(exited, gone),
                secs(gone, listed),
                secs(listed, running),
                secs(running, end),
            );
        }
    }
}
