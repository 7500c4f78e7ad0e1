//! What happened to each node's kilo pods during a rollout, and when: one `kubectl get
//! --watch` of them while the rollout runs, each change stamped with the moment it arrives. It
//! splits a rollout's gap between the old pod's exit, Kubernetes replacing the pod, and the
//! new kg's start.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::BufReader;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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

/// When each old kg process (`pids`, by node) exited, polled every 50 ms until `done` or all
/// have: the moment kg itself finished, which the pod's status may report much later.
pub(super) fn watch_exits(
    pids: &BTreeMap<String, i32>,
    done: &AtomicBool,
) -> BTreeMap<String, Instant> {
    let gone = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
            stat.rsplit(") ")
                .next()
                .is_some_and(|rest| rest.starts_with('Z'))
        })
    };
    let mut exited = BTreeMap::new();
    while !done.load(Ordering::Relaxed) && exited.len() < pids.len() {
        for (node, pid) in pids {
            if !exited.contains_key(node) && gone(*pid) {
                exited.insert(node.clone(), Instant::now());
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    exited
}

/// Each node's kg container log, as the kubelet writes it (`log-pods/` of the node), followed
/// by `tail -F` into a file in `dir` so that it outlives the pod.
pub(super) struct FollowedLogs(Vec<(String, Child, PathBuf)>);

impl FollowedLogs {
    pub(super) fn start(k: &KubeletCluster, pods: &BTreeMap<String, String>, dir: &Path) -> Self {
        let files = super::walk(&k.dir.join("nodes"));
        let followed = pods
            .iter()
            .filter_map(|(node, pod)| {
                let marker = format!("kube-system_{pod}_");
                let source = files
                    .iter()
                    .filter(|f| {
                        let path = f.display().to_string();
                        path.contains(&marker) && path.contains("/kilo/") && path.ends_with(".log")
                    })
                    .max()?
                    .clone();
                let path = dir.join(format!("{pod}.log"));
                let file = std::fs::File::create(&path).expect("a log file");
                let child = Command::new("tail")
                    .args(["-n", "+1", "-F"])
                    .arg(&source)
                    .stdin(Stdio::null())
                    .stdout(file)
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("running tail -F");
                Some((node.clone(), child, path))
            })
            .collect();
        Self(followed)
    }

    /// Stops following and prints each log's last `lines` lines.
    pub(super) fn print_tail(mut self, lines: usize) {
        for (node, child, path) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
            let text = std::fs::read_to_string(&*path).unwrap_or_default();
            let all: Vec<&str> = text.lines().collect();
            eprintln!("{node}: the old kg's last lines:");
            for line in &all[all.len().saturating_sub(lines)..] {
                eprintln!("  {line}");
            }
        }
    }
}

/// Where a rollout's ping gaps went, node by node, from `timeline` (Kubernetes 1.20 replaces a
/// node's pod only once the old one is gone): the old kg's exit after SIGTERM, Kubernetes
/// removing the old pod and creating the new one, the kubelet starting its container, and the
/// new kg's start until traffic flows. `windows`: each direction's longest gap; `kg_exits`:
/// when each node's old kg process exited ([`watch_exits`]). Returns kg's own parts of each
/// node's gap.
pub(super) fn split_rollout_gaps(
    k: &KubeletCluster,
    timeline: &Timeline,
    origin: Instant,
    windows: [(Instant, Instant); 2],
    kg_exits: &BTreeMap<String, Instant>,
) -> Vec<KgParts> {
    let secs = |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64();
    let mut parts = Vec::new();
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
        let reported = old.get(&Step::Exited).copied().unwrap_or(gone);
        let exited = kg_exits.get(&node.name).copied().unwrap_or(reported);
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
                "rollout gap on {} ({:.1} s): kg's exit after SIGTERM {:.1} s (the pod's status said \
                 so {:.1} s after that), the old pod's removal {:.1} s, until the new pod {:.1} s, \
                 its container started {:.1} s, kg's start until traffic {:.1} s",
                node.name,
                secs(start, end),
                secs(sigterm, exited),
                secs(exited, reported),
                secs(exited, gone),
                secs(gone, listed),
                secs(listed, running),
                secs(running, end),
            );
            parts.push(KgParts {
                node: node.name.clone(),
                exit: kg_exits
                    .get(&node.name)
                    .map(|at| at.saturating_duration_since(sigterm)),
                start_to_traffic: end.saturating_duration_since(running),
            });
        }
    }
    parts
}

/// kg's own part of one node's rollout gap.
#[derive(Debug)]
pub(super) struct KgParts {
    /// The node.
    pub(super) node: String,
    /// From the pod's deletion (when the kubelet sends SIGTERM, at the earliest) until the old
    /// kg's process was gone; `None` when its process was not found before the rollout.
    pub(super) exit: Option<Duration>,
    /// From the new kg's container start until traffic flowed again.
    pub(super) start_to_traffic: Duration,
}
