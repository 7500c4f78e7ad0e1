//! kilotun's DaemonSet as pods under real kubelets: `scripts/kubelet-cluster.sh` starts etcd,
//! kube-apiserver, kube-scheduler and kube-controller-manager v1.20.2 on this host and two nodes,
//! each a network and a mount namespace with its own containerd (CRI, runc or crun) and kubelet, with
//! the pause image and kilotun's image (`image/build.sh`) imported. The tests apply the
//! manifests as a user would (only the pull policy changed: nothing can be pulled here) and
//! check what a cluster operator sees: the pods Ready, the Node annotations, the mesh carrying
//! pod traffic through WireGuard, the liveness probe holding, traffic across a crash of kg and
//! across `kubectl rollout restart`, and `kubectl delete` cleaning up; on a crun node, kg given
//! the TUN by `kg device-plugin` (`device_plugin.rs`); the Peer webhook as a pod (`webhook.rs`).
//!
//! Needs root, containerd, runc and the container tools; the Kubernetes binaries are built (and
//! cached) by `scripts/kube-apiserver.sh` and `scripts/kube-node-bins.sh`. Without them the
//! tests skip themselves with a message, unless `CI` is set: then they fail. The image is built
//! once per test run from the binaries under test, or taken from `KILOTUN_IMAGE_ARCHIVE`.
//! `KILOTUN_KUBELET_KEEP` keeps a cluster's directory (logs) on drop.

mod chart;
mod device_plugin;
mod rollout;
mod surge;
mod timeline;
mod webhook;

use crate::common;

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::pinger::Pinger;
use common::{ping_ok, unique, which};
use serde_json::Value;

const REPO: &str = env!("CARGO_MANIFEST_DIR");
const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The manifests' `kilotun:<version>` as the kubelet and containerd spell it.
fn image_name() -> String {
    format!("docker.io/library/kilotun:{VERSION}")
}
const KILO_SELECTOR: &str = "app.kubernetes.io/name=kilo";

/// A cluster takes both cores of a test machine for a minute; one at a time (within this
/// process, as `cargo test` runs the tier; under nextest, the `cpu-heavy` test group of
/// `.config/nextest.toml` keeps the clusters apart).
static SERIAL: Mutex<()> = Mutex::new(());

/// Fails the test, saying why it cannot run here (it is `#[ignore]`d: it runs only when asked for).
fn unavailable(test: &str, why: &str) -> ! {
    panic!("{test}: cannot run here: {why}");
}

/// Fails the test, saying why, unless this host can run the cluster.
fn require_the_cluster_tools(test: &str) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        unavailable(test, "needs root (namespaces, cgroups, containerd)");
    }
    let mut tools = vec![
        "ip",
        "nsenter",
        "unshare",
        "containerd",
        "ctr",
        "runc",
        "iptables",
        "ping",
        "curl",
        "openssl",
    ];
    if std::env::var_os("KILOTUN_IMAGE_ARCHIVE").is_none() {
        tools.extend(["mmdebstrap", "buildah", "skopeo"]);
    }
    let missing: Vec<&str> = tools.into_iter().filter(|t| !which(t)).collect();
    if !missing.is_empty() {
        unavailable(test, &format!("needs {missing:?} (.ci/run installs them)"));
    }
}

/// The image archive under test: `KILOTUN_IMAGE_ARCHIVE`, or built once per test run by
/// `image/build.sh` from the binaries this test run was built with (`tests/common/image.rs`; the
/// image tests share it).
fn image_archive() -> Result<PathBuf, String> {
    common::image::archive()
}

/// Parses `export K=V` lines written with bash's `printf %q` (only `\ ` escapes occur here).
fn parse_env(path: &Path) -> BTreeMap<String, String> {
    fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.replace("\\ ", " ")))
        .collect()
}

struct Node {
    name: String,
    netns: String,
}

/// A cluster from `scripts/kubelet-cluster.sh`, taken down (and its directory removed) on drop.
struct KubeletCluster {
    dir: PathBuf,
    env: BTreeMap<String, String>,
    nodes: Vec<Node>,
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl KubeletCluster {
    /// `count` nodes of `flavor` (kubeadm or k3s) with kilotun's image imported, their OCI
    /// runtimes as `runtimes` names them (`KUBE_NODE_RUNTIMES`: runc where empty), or `None`
    /// (the test skipped) when that cannot be done here.
    fn up(test: &str, count: usize, flavor: &str, runtimes: &str) -> Option<Self> {
        require_the_cluster_tools(test);
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let archive = match image_archive() {
            Ok(a) => a,
            Err(e) => unavailable(test, &e),
        };
        let dir = std::env::temp_dir().join(unique("kubelet"));
        let started = Instant::now();
        let out = Command::new("bash")
            .arg(Path::new(REPO).join("scripts/kubelet-cluster.sh"))
            .arg("up")
            .arg(&dir)
            .arg(count.to_string())
            .env(
                "KUBE_NODE_IMAGES",
                format!("{}={}", archive.display(), image_name()),
            )
            .env("KUBE_NODE_FLAVOR", flavor)
            .env("KUBE_NODE_RUNTIMES", runtimes)
            .stdin(Stdio::null())
            .output()
            .expect("running scripts/kubelet-cluster.sh");
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(40).collect();
            let _ = fs::remove_dir_all(&dir);
            unavailable(
                test,
                &format!(
                    "scripts/kubelet-cluster.sh up failed ({}):\n{}",
                    out.status,
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                ),
            );
        }
        eprintln!("{test}: cluster of {count} up in {:.0?}", started.elapsed());
        let env = parse_env(&dir.join("cluster.env"));
        let nodes = env["NODE_NAMES"]
            .split(' ')
            .zip(env["NODE_NETNS"].split(' '))
            .map(|(name, netns)| Node {
                name: name.to_string(),
                netns: netns.to_string(),
            })
            .collect();
        Some(Self {
            dir,
            env,
            nodes,
            _serial: serial,
        })
    }

    fn kubectl(&self, args: &[&str]) -> Output {
        self.kubectl_with_input(args, "")
    }

    /// kubectl with `input` on its standard input.
    fn kubectl_with_input(&self, args: &[&str], input: &str) -> Output {
        use std::io::Write as _;
        let mut child = Command::new(&self.env["KUBECTL"])
            .arg("--kubeconfig")
            .arg(&self.env["KUBECONFIG"])
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("running kubectl");
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(input.as_bytes()).unwrap();
        drop(stdin);
        child.wait_with_output().expect("running kubectl")
    }

    /// `kubectl rollout status` of `object` (`daemonset/kilo`) in `namespace`, waiting up to
    /// `timeout` (`300s`); panics if the rollout does not finish.
    fn rollout_status(&self, namespace: &str, object: &str, timeout: &str) {
        let timeout = format!("--timeout={timeout}");
        self.kubectl_ok(&["-n", namespace, "rollout", "status", object, &timeout]);
    }

    /// kubectl, panicking with its output on failure; returns stdout.
    fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}",
            common::output_text(&out)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `kubectl apply -f -` with `yaml`.
    fn apply(&self, yaml: &str) {
        let out = self.kubectl_with_input(&["apply", "-f", "-"], yaml);
        assert!(
            out.status.success(),
            "kubectl apply: {}",
            common::output_text(&out)
        );
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut full = args.to_vec();
        full.extend(["-o", "json"]);
        serde_json::from_str(&self.kubectl_ok(&full)).expect("kubectl's JSON")
    }

    fn node_annotations(&self, node: &str) -> BTreeMap<String, String> {
        self.json(&["get", "node", node])["metadata"]["annotations"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The kilo pods, by node name.
    fn kilo_pods(&self) -> BTreeMap<String, Value> {
        self.json(&["-n", "kube-system", "get", "pods", "-l", KILO_SELECTOR])["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["metadata"]["deletionTimestamp"].is_null())
            .map(|p| {
                (
                    p["spec"]["nodeName"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    p.clone(),
                )
            })
            .collect()
    }

    /// Waits until every node runs one Ready kilo pod; returns them by node.
    fn wait_kilo_ready(&self, timeout: Duration) -> BTreeMap<String, Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let pods = self.kilo_pods();
            if self
                .nodes
                .iter()
                .all(|n| pods.get(&n.name).is_some_and(pod_ready))
            {
                return pods;
            }
            assert!(
                Instant::now() < deadline,
                "kilo pods not Ready on every node after {timeout:?}:\n{}",
                self.kubectl_ok(&["-n", "kube-system", "get", "pods", "-o", "wide"])
            );
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// Restart counts of the kilo containers, by node.
    fn restart_counts(&self) -> BTreeMap<String, u64> {
        self.kilo_pods()
            .into_iter()
            .map(|(node, p)| {
                let count = p["status"]["containerStatuses"]
                    .as_array()
                    .and_then(|s| s.iter().find(|c| c["name"] == "kilo"))
                    .and_then(|c| c["restartCount"].as_u64())
                    .unwrap_or(0);
                (node, count)
            })
            .collect()
    }

    /// A pod that only sleeps (kilotun's image: busybox), on `node`, in the pod network.
    /// Returns its IP once it runs.
    fn sleeper(&self, name: &str, node: &str) -> String {
        self.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  \
             nodeName: {node}\n  terminationGracePeriodSeconds: 0\n  containers:\n  - name: sleep\n    \
             image: kilotun:{VERSION}\n    imagePullPolicy: Never\n    \
             command: [\"/bin/busybox\", \"sleep\", \"100000\"]\n"
        ));
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let pod = self.json(&["get", "pod", name]);
            if pod["status"]["phase"] == "Running" {
                if let Some(ip) = pod["status"]["podIP"].as_str() {
                    return ip.to_string();
                }
            }
            assert!(
                Instant::now() < deadline,
                "pod {name} not running on {node} after 120 s: {}",
                self.kubectl_ok(&["describe", "pod", name])
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The pid of kg on `node` (hostNetwork: a process named kg in the node's network namespace).
    fn kg_pid(&self, node: &Node) -> Option<i32> {
        let ino = fs::metadata(format!("/run/netns/{}", node.netns))
            .ok()?
            .ino();
        let want = format!("net:[{ino}]");
        fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let net = fs::read_link(e.path().join("ns/net")).ok()?;
            let comm = fs::read_to_string(e.path().join("comm")).ok()?;
            (net.to_str() == Some(want.as_str()) && comm.trim() == "kg").then_some(pid)
        })
    }

    fn ip_in(&self, node: &Node, args: &[&str]) -> String {
        let out = Command::new("ip")
            .args(["-n", &node.netns])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// What to look at when a test failed: pods, nodes, and the logs' last lines.
    fn dump(&self) {
        for args in [
            &["get", "pods", "-A", "-o", "wide"][..],
            &["get", "nodes", "-o", "wide"][..],
            &["-n", "kube-system", "describe", "pods", "-l", KILO_SELECTOR][..],
        ] {
            eprintln!(
                "--- kubectl {}\n{}",
                args.join(" "),
                common::output_text(&self.kubectl(args))
            );
        }
        let logs = self.dir.join("logs");
        for i in 1..=self.nodes.len() {
            let file = logs.join(format!("node{i}-kubelet.log"));
            let log = fs::read_to_string(&file).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            eprintln!(
                "--- {}\n{}",
                file.display(),
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        // The kg containers' own logs (/var/log/pods of each node).
        for entry in walk(&self.dir.join("nodes")) {
            let path = entry.display().to_string();
            if path.contains("/log-pods/") && path.contains("_kilo-") && path.ends_with(".log") {
                let log = fs::read_to_string(&entry).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                eprintln!(
                    "--- {path}\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
        }
    }
}

/// True when `pod`'s Ready condition is True.
fn pod_ready(pod: &Value) -> bool {
    pod["status"]["conditions"].as_array().is_some_and(|c| {
        c.iter()
            .any(|c| c["type"] == "Ready" && c["status"] == "True")
    })
}

/// Every file below `dir`.
fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            match e.file_type() {
                Ok(t) if t.is_dir() => stack.push(e.path()),
                Ok(t) if t.is_file() => files.push(e.path()),
                _ => {}
            }
        }
    }
    files
}

impl Drop for KubeletCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump();
        }
        let out = Command::new("bash")
            .arg(Path::new(REPO).join("scripts/kubelet-cluster.sh"))
            .arg("down")
            .arg(&self.dir)
            .stdin(Stdio::null())
            .output();
        match out {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "kubelet-cluster.sh down failed: {}",
                common::output_text(&o)
            ),
            Err(e) => eprintln!("kubelet-cluster.sh down: {e}"),
        }
        if std::env::var_os("KILOTUN_KUBELET_KEEP").is_some() || std::thread::panicking() {
            // The nodes' containerd content is large; the logs (the cluster's and each pod's,
            // in nodes/N/log-pods) are what is worth keeping.
            for i in 1..=self.nodes.len() {
                let _ = fs::remove_dir_all(self.dir.join(format!("nodes/{i}/containerd")));
            }
            eprintln!("kept {} (logs/, nodes/*/log-pods/)", self.dir.display());
        } else {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// A manifest as a user without a registry applies it: the pull policy Never, so that a missing
/// image shows as such instead of a pull that cannot succeed here.
fn manifest(name: &str) -> String {
    let text = fs::read_to_string(Path::new(REPO).join("manifests").join(name)).unwrap();
    assert!(
        text.contains(&format!("image: kilotun:{VERSION}")),
        "{name} names another image"
    );
    // Kubernetes 1.20: through the line docs/rollouts.md gives for clusters before 1.22.
    common::old_clusters::before_1_22(&text)
        .replace("imagePullPolicy: IfNotPresent", "imagePullPolicy: Never")
}

/// Pingers from each of the first two nodes to the other's pod (`pod_ips`, in node order),
/// once both get replies (within 20 s, else a panic naming `what`).
fn pings_across(k: &KubeletCluster, pod_ips: &[String], what: &str) -> (Pinger, Pinger) {
    let (n1, n2) = (&k.nodes[0], &k.nodes[1]);
    let p12 = Pinger::start(&n1.netns, &pod_ips[1]);
    let p21 = Pinger::start(&n2.netns, &pod_ips[0]);
    let since = Instant::now();
    assert!(
        p12.wait_flowing(since, Duration::from_secs(20))
            && p21.wait_flowing(since, Duration::from_secs(20)),
        "no pings across {what}"
    );
    (p12, p21)
}

/// Waits until `f` is true, panicking with `what` after `timeout`.
fn wait_for(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not after {timeout:?}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The annotations kg writes and an operator reads (`kilo.squat.ai/*`), present and sensible.
fn assert_annotated(k: &KubeletCluster, node: &str) -> BTreeMap<String, String> {
    let a = k.node_annotations(node);
    for key in [
        "key",
        "endpoint",
        "internal-ip",
        "wireguard-ip",
        "last-seen",
        "granularity",
    ] {
        let key = format!("kilo.squat.ai/{key}");
        assert!(a.contains_key(&key), "{node} lacks {key}: {a:#?}");
    }
    assert_eq!(
        a["kilo.squat.ai/key"].len(),
        44,
        "{node}: a WireGuard key: {a:#?}"
    );
    assert!(
        a["kilo.squat.ai/endpoint"].ends_with(":51820"),
        "{node}: {a:#?}"
    );
    a
}

/// The WireGuard IP of `node` (its `kilo.squat.ai/wireguard-ip`, without the mask).
fn wireguard_ip(k: &KubeletCluster, node: &str) -> String {
    let a = k.node_annotations(node);
    let ip = a
        .get("kilo.squat.ai/wireguard-ip")
        .cloned()
        .unwrap_or_default();
    ip.split('/').next().unwrap_or_default().to_string()
}

/// Installs `manifest_name` with the CRDs and RBAC, waits for the pods, annotations and mesh;
/// returns the sleeper pods' IPs (one per node, in node order) and when kilo became Ready.
fn install(k: &KubeletCluster, manifest_name: &str) -> (Vec<String>, Instant) {
    install_with(k, manifest_name, |_| {})
}

/// [`install`], with `before_ready` run once the DaemonSet is applied, before waiting for its
/// pods to be Ready.
fn install_with(
    k: &KubeletCluster,
    manifest_name: &str,
    before_ready: impl FnOnce(&KubeletCluster),
) -> (Vec<String>, Instant) {
    install_by(k, manifest_name, |k| {
        k.kubectl_ok(&["apply", "-f", &format!("{REPO}/manifests/crds.yaml")]);
        k.kubectl_ok(&["apply", "-f", &format!("{REPO}/manifests/rbac.yaml")]);
        k.apply(&manifest(manifest_name));
        before_ready(k);
    })
}

/// [`install`] by `apply` (which installs kilotun as `what` names it): the nodes given a
/// location each, then the pods, annotations and mesh waited for and checked.
fn install_by(
    k: &KubeletCluster,
    what: &str,
    apply: impl FnOnce(&KubeletCluster),
) -> (Vec<String>, Instant) {
    let started = Instant::now();
    // The nodes share one subnet and no topology label: Kilo's rule would make them one
    // location, joined by IPIP without WireGuard. An operator who wants the WireGuard mesh
    // between them says where each node is.
    for (i, node) in k.nodes.iter().enumerate() {
        let location = format!("kilo.squat.ai/location=loc{}", i + 1);
        k.kubectl_ok(&["annotate", "node", &node.name, &location]);
    }
    apply(k);
    let pods = k.wait_kilo_ready(Duration::from_secs(180));
    let ready_at = Instant::now();
    eprintln!(
        "{what}: kilo pods Ready on {} nodes after {:.1?}",
        pods.len(),
        started.elapsed()
    );

    // The annotations, and the interface with the node's WireGuard IP.
    for node in &k.nodes {
        wait_for(
            &format!("kilo.squat.ai annotations on {}", node.name),
            Duration::from_secs(60),
            || {
                let a = k.node_annotations(&node.name);
                a.contains_key("kilo.squat.ai/key")
                    && a.get("kilo.squat.ai/wireguard-ip")
                        .is_some_and(|v| !v.is_empty())
            },
        );
        let a = assert_annotated(k, &node.name);
        let wg_ip = wireguard_ip(k, &node.name);
        let addresses = k.ip_in(node, &["-4", "addr", "show", "kilo0"]);
        assert!(
            addresses.contains(&wg_ip),
            "{}: kilo0 lacks {wg_ip}: {addresses}\n{a:#?}",
            node.name
        );
    }

    // The nodes turn Ready once install-cni wrote the CNI configuration; then pods in the pod
    // network start, with addresses from kg's pod CIDR.
    k.kubectl_ok(&[
        "wait",
        "node",
        "--all",
        "--for=condition=Ready",
        "--timeout=120s",
    ]);
    let ips: Vec<String> = k
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| k.sleeper(&format!("sleeper{}", i + 1), &n.name))
        .collect();

    // The mesh: each node's host namespace reaches the other's WireGuard IP, and the pod on the
    // other node (through kilo0: the route to its pod CIDR).
    for (i, from) in k.nodes.iter().enumerate() {
        for (j, to) in k.nodes.iter().enumerate() {
            if i == j {
                continue;
            }
            let wg = wireguard_ip(k, &to.name);
            assert!(
                ping_ok(&from.netns, &wg, Duration::from_secs(60)),
                "{} does not reach {}'s WireGuard IP {wg}",
                from.name,
                to.name
            );
            assert!(
                ping_ok(&from.netns, &ips[j], Duration::from_secs(60)),
                "{} does not reach the pod {} on {}",
                from.name,
                ips[j],
                to.name
            );
            let route = k.ip_in(from, &["route", "get", &ips[j]]);
            assert!(
                route.contains("dev kilo0"),
                "{} routes {} not through kilo0: {route}",
                from.name,
                ips[j]
            );
        }
    }
    eprintln!(
        "{what}: meshed, pods reachable across nodes after {:.1?}",
        started.elapsed()
    );
    (ips, ready_at)
}

/// `kubectl delete` of the DaemonSet: the pods go, and each kg, seeing its DaemonSet gone,
/// removes its annotations and routes.
fn uninstall(k: &KubeletCluster, pod_ips: &[String], daemonsets: &[&str]) {
    let started = Instant::now();
    let mut args = vec!["-n", "kube-system", "delete", "daemonset"];
    args.extend(daemonsets);
    args.extend(["--wait=true", "--timeout=120s"]);
    k.kubectl_ok(&args);
    wait_for("the kilo pods gone", Duration::from_secs(120), || {
        k.kilo_pods().is_empty()
    });
    assert_cleaned_up(k, pod_ips);
    eprintln!("uninstall: done after {:.1?}", started.elapsed());
}

/// What each kg, its DaemonSet gone, leaves on its node once its pod is gone: no `kilo.squat.ai`
/// annotations of its own, no route through kilo0 to the other nodes' pods (`pod_ips`, in node
/// order), and kilo0 gone or without carrier.
fn assert_cleaned_up(k: &KubeletCluster, pod_ips: &[String]) {
    let started = Instant::now();
    let mut links = Vec::new();
    for (i, node) in k.nodes.iter().enumerate() {
        wait_for(
            &format!("kg's annotations removed from {}", node.name),
            Duration::from_secs(60),
            || {
                let a = k.node_annotations(&node.name);
                [
                    "key",
                    "endpoint",
                    "internal-ip",
                    "wireguard-ip",
                    "last-seen",
                ]
                .iter()
                .all(|key| !a.contains_key(&format!("kilo.squat.ai/{key}")))
            },
        );
        for (j, ip) in pod_ips.iter().enumerate() {
            if i != j {
                let route = k.ip_in(node, &["route", "get", ip]);
                assert!(
                    !route.contains("kilo0"),
                    "{}: a route through kilo0 remains: {route}",
                    node.name
                );
            }
        }
        // The manifests leave --clean-up-interface at Kilo's default (false): kilo0 may stay,
        // but with no engine behind it (no carrier) once kg has exited. kg stops its engine
        // last, after the annotations above, and its pod is Terminating (not listed) meanwhile.
        wait_for(
            &format!("{}: kilo0 gone or without carrier", node.name),
            Duration::from_secs(60),
            || {
                let link = k.ip_in(node, &["link", "show", "kilo0"]);
                link.is_empty() || link.contains("NO-CARRIER")
            },
        );
        let link = k.ip_in(node, &["link", "show", "kilo0"]);
        links.push(if link.is_empty() {
            "gone"
        } else {
            "left without carrier"
        });
    }
    eprintln!(
        "cleaned up: annotations and routes gone after {:.1?}; kilo0 {links:?}",
        started.elapsed()
    );
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn kubeadm_daemonset_on_real_kubelets() {
    let test = "kubeadm_daemonset_on_real_kubelets";
    let Some(k) = KubeletCluster::up(test, 2, "kubeadm", "") else {
        return;
    };
    let (pod_ips, ready_at) = install(&k, "kilo-kubeadm.yaml");
    let (n1, n2) = (&k.nodes[0], &k.nodes[1]);

    // The liveness probe (initialDelaySeconds 10, periodSeconds 30) holds: no restart after
    // more than a probe period.
    let probe_window = Duration::from_secs(45);
    if let Some(rest) = probe_window.checked_sub(ready_at.elapsed()) {
        std::thread::sleep(rest);
    }
    let counts = k.restart_counts();
    assert!(
        counts.values().all(|c| *c == 0),
        "kg restarted under its liveness probe: {counts:?}"
    );
    assert_eq!(counts.len(), 2);
    k.wait_kilo_ready(Duration::from_secs(5));

    // (a) kg killed on the answering side (n2), pinging from n1 n2's pod and n2's WireGuard IP
    // (the latter answered by n2's host through kilo0 both ways).
    let pinger = Pinger::start(&n1.netns, &pod_ips[1]);
    let wg_pinger = Pinger::start(&n1.netns, &wireguard_ip(&k, &n2.name));
    let since = Instant::now();
    assert!(
        pinger.wait_flowing(since, Duration::from_secs(20)),
        "no replies before the kill"
    );
    assert!(
        wg_pinger.wait_flowing(since, Duration::from_secs(20)),
        "no replies before the kill"
    );
    let pid = k.kg_pid(n2).expect("kg's pid on node 2");
    let killed = Instant::now();
    // SAFETY: signalling the kg process the kubelet started for this test's node.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    wait_for("the kubelet restarting kg", Duration::from_secs(60), || {
        k.restart_counts().get(&n2.name).is_some_and(|c| *c >= 1)
    });
    assert!(
        pinger.wait_flowing(killed, Duration::from_secs(90)),
        "pings from {} to the pod on {} did not resume after kg was killed",
        n1.name,
        n2.name
    );
    assert!(
        wg_pinger.wait_flowing(killed, Duration::from_secs(60)),
        "pings from {} to {}'s WireGuard IP did not resume after kg was killed",
        n1.name,
        n2.name
    );
    std::thread::sleep(Duration::from_secs(2));
    let gap = pinger.longest_gap_after(killed);
    let wg_gap = wg_pinger.longest_gap_after(killed);
    drop((pinger, wg_pinger));
    eprintln!(
        "kill -9 of kg on the answering node: longest ping gap {gap:.2?} to its pod, {wg_gap:.2?} to its WireGuard IP"
    );
    assert!(
        gap < Duration::from_secs(30),
        "traffic stopped {gap:?} after kg was killed"
    );
    assert!(
        wg_gap < Duration::from_secs(30),
        "traffic stopped {wg_gap:?} after kg was killed"
    );
    k.wait_kilo_ready(Duration::from_secs(60));

    // (b) A rollout: every kg replaced, one node at a time, pings both ways. The pod template
    // changes as with `kubectl rollout restart` or a new image: here by a nodeSelector that every
    // node matches, which the surge (c) then uses to delete old pods node by node.
    rollout::roll_every_kg(&k, &pod_ips, "rollout", surge::select_old_generation);

    // (c) A surge rollout (what 1.22 and later do with maxSurge), done by hand: each node's
    // handover costs at most a second.
    let gaps = surge::surge_by_hand(&k, &pod_ips);
    for (node, (there, back)) in &gaps {
        assert!(
            *there <= Duration::from_secs(1) && *back <= Duration::from_secs(1),
            "the surge handover on {node} stopped pings for {there:?} and {back:?}"
        );
    }
    for n in &k.nodes {
        assert_annotated(&k, &n.name);
    }

    uninstall(&k, &pod_ips, &["kilo", "kilo-next"]);
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn k3s_daemonset_on_real_kubelets() {
    let test = "k3s_daemonset_on_real_kubelets";
    // The second node's runtime is crun 1.8, which leaves /dev/net/tun out of its default
    // devices: kg fails there with its one line until the device plugin gives it the TUN.
    let Some(k) = KubeletCluster::up(test, 2, "k3s", "runc crun") else {
        return;
    };
    let (pod_ips, _) = install_with(&k, "kilo-k3s.yaml", device_plugin::denied_then_given);
    // k3s's CNI directory holds kg's configuration with the node's pod CIDR.
    for (i, n) in k.nodes.iter().enumerate() {
        let conf = k
            .dir
            .join(format!("nodes/{}/k3s-cni-conf/10-kilo.conflist", i + 1));
        let text = fs::read_to_string(&conf).unwrap_or_else(|e| panic!("{}: {e}", conf.display()));
        let cidr = k.kubectl_ok(&["get", "node", &n.name, "-o", "jsonpath={.spec.podCIDR}"]);
        assert!(text.contains(cidr.trim()), "{}: {text}", conf.display());
    }
    webhook::the_webhook_pod_validates_peers(&k);
    uninstall(&k, &pod_ips, &["kilo"]);
}
