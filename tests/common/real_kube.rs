//! A real Kubernetes control plane for tests: etcd and kube-apiserver v1.20.2 on loopback,
//! started by `scripts/kube-up.sh` from the binaries `scripts/kube-apiserver.sh` builds (and
//! caches) once, stopped by `scripts/kube-down.sh` on drop.
//!
//! kg runs in network namespaces, which cannot reach the host's loopback: [`Relay`] listens on a
//! namespace's `127.0.0.1:<API port>` and forwards each connection to the host's, so a node uses
//! the same URL as the host and the serving certificate (SAN 127.0.0.1) verifies there too.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::{unique, Netns};

/// The repository root (scripts live there).
fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs a script, returning its last stdout line, or its stderr tail as the error.
fn script(name: &str, args: &[&str], env: &[(&str, String)]) -> Result<String, String> {
    let out = Command::new("bash")
        .arg(repo().join("scripts").join(name))
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running {name}: {e}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
        return Err(format!(
            "{name} failed ({}):\n{}",
            out.status,
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string())
}

/// Parses the `export K=V` lines of kube-up.sh's env file (values are `%q`-quoted by bash; the
/// ones it writes are paths, URLs, numbers and hex, which need no unquoting).
fn parse_env(path: &Path) -> BTreeMap<String, String> {
    fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
        .lines()
        .filter_map(|l| l.strip_prefix("export "))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// One control plane (etcd + kube-apiserver) in a temporary directory.
pub struct RealKube {
    /// kube-up.sh's directory (certificates, etcd data, logs, env).
    pub dir: PathBuf,
    /// `https://127.0.0.1:<port>`.
    pub url: String,
    pub port: u16,
    /// The admin kubeconfig (system:masters).
    pub kubeconfig: PathBuf,
    pub ca_file: PathBuf,
    pub etcd_url: String,
    pub kubectl: PathBuf,
    bin_dir: String,
    etcd_peer_port: String,
    extra_flags: String,
}

impl RealKube {
    /// Starts a control plane. When it cannot be built or started, the test is skipped (a
    /// message says why, and `None` is returned), unless `CI` is set: then it fails.
    pub fn start(test: &str) -> Option<Self> {
        Self::start_with(test, "")
    }

    /// [`RealKube::start`] with more kube-apiserver flags (`KUBE_APISERVER_EXTRA_FLAGS`).
    pub fn start_with(test: &str, extra_flags: &str) -> Option<Self> {
        let unavailable = |why: String| -> Option<Self> {
            panic!("{test}: no real API server ({why}); run scripts/kube-apiserver.sh");
        };
        let cache = match script("kube-apiserver.sh", &[], &[]) {
            Ok(c) => c,
            Err(e) => return unavailable(e),
        };
        let bin_dir = format!("{cache}/bin");
        let dir = std::env::temp_dir().join(unique("realkube"));
        let dir_s = dir.display().to_string();
        let env_file = match script(
            "kube-up.sh",
            &[&dir_s],
            &[
                ("KUBE_BIN_DIR", bin_dir.clone()),
                ("KUBE_APISERVER_EXTRA_FLAGS", extra_flags.to_string()),
            ],
        ) {
            Ok(e) => e,
            Err(e) => {
                let _ = script("kube-down.sh", &[&dir_s], &[]);
                let _ = fs::remove_dir_all(&dir);
                return unavailable(e);
            }
        };
        let env = parse_env(Path::new(&env_file));
        let etcd_pid = &env["ETCD_PID"];
        // The etcd peer port is not in the env file; a restart needs it to reuse the data dir
        // with the same member URLs.
        let cmdline = fs::read(format!("/proc/{etcd_pid}/cmdline")).unwrap_or_default();
        let etcd_peer_port = String::from_utf8_lossy(&cmdline)
            .split('\0')
            .find_map(|a| a.strip_prefix("--listen-peer-urls=http://127.0.0.1:"))
            .unwrap_or_default()
            .to_string();
        Some(Self {
            url: env["APISERVER_URL"].clone(),
            port: env["APISERVER_PORT"].parse().unwrap(),
            kubeconfig: env["KUBECONFIG"].clone().into(),
            ca_file: env["KUBE_CA_FILE"].clone().into(),
            etcd_url: env["ETCD_URL"].clone(),
            kubectl: env["KUBECTL"].clone().into(),
            dir,
            bin_dir,
            etcd_peer_port,
            extra_flags: extra_flags.to_string(),
        })
    }

    fn env(&self) -> BTreeMap<String, String> {
        parse_env(&self.dir.join("env"))
    }

    /// SIGKILLs kube-apiserver (etcd keeps running), as a crashed control-plane node would.
    pub fn kill_apiserver(&self) {
        let pid: i32 = self.env()["APISERVER_PID"].parse().unwrap();
        // SAFETY: signalling the kube-apiserver this fixture started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        for _ in 0..100 {
            let state = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            if state.is_empty() || state.contains(") Z") {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("kube-apiserver {pid} survived SIGKILL");
    }

    /// Stops what still runs and starts etcd and kube-apiserver again on the same ports with the
    /// same certificates and data (kube-up.sh keeps both in its directory).
    pub fn restart(&self) {
        let dir = self.dir.display().to_string();
        script("kube-down.sh", &[&dir], &[]).unwrap();
        let env = self.env();
        script(
            "kube-up.sh",
            &[&dir],
            &[
                ("KUBE_BIN_DIR", self.bin_dir.clone()),
                ("KUBE_APISERVER_EXTRA_FLAGS", self.extra_flags.clone()),
                ("APISERVER_PORT", self.port.to_string()),
                ("ETCD_PORT", env["ETCD_PORT"].clone()),
                ("ETCD_PEER_PORT", self.etcd_peer_port.clone()),
            ],
        )
        .unwrap();
    }

    /// Runs kubectl as the admin; returns its output whatever the exit status.
    pub fn kubectl_output(&self, args: &[&str], stdin: Option<&str>) -> Output {
        let mut child = Command::new(&self.kubectl)
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning kubectl");
        let mut input = child.stdin.take().unwrap();
        if let Some(text) = stdin {
            input.write_all(text.as_bytes()).unwrap();
        }
        drop(input);
        child.wait_with_output().unwrap()
    }

    /// Runs kubectl as the admin, panicking with its output if it fails; returns stdout.
    pub fn kubectl(&self, args: &[&str]) -> String {
        self.kubectl_stdin(args, None)
    }

    /// [`RealKube::kubectl`] with `stdin` on standard input (for `-f -`).
    pub fn kubectl_stdin(&self, args: &[&str], stdin: Option<&str>) -> String {
        let out = self.kubectl_output(args, stdin);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `kubectl apply -f -` of `yaml`.
    pub fn apply(&self, yaml: &str) -> String {
        self.kubectl_stdin(&["apply", "-f", "-"], Some(yaml))
    }

    /// `kubectl apply -f manifests/<name>`.
    pub fn apply_manifest(&self, name: &str) -> String {
        let path = repo().join("manifests").join(name);
        self.kubectl(&["apply", "-f", path.to_str().unwrap()])
    }

    /// `kubectl get -o json` of one object, parsed.
    pub fn get(&self, args: &[&str]) -> serde_json::Value {
        let mut full = vec!["get", "-o", "json"];
        full.extend_from_slice(args);
        serde_json::from_str(&self.kubectl(&full)).unwrap()
    }

    /// A token of ServiceAccount `namespace/name` from the TokenRequest API (one hour).
    pub fn service_account_token(&self, namespace: &str, name: &str) -> String {
        let request = r#"{"apiVersion":"authentication.k8s.io/v1","kind":"TokenRequest","spec":{"audiences":["https://kubernetes.default.svc"],"expirationSeconds":3600}}"#;
        let path = format!("/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token");
        let answer = self.kubectl_stdin(&["create", "--raw", &path, "-f", "-"], Some(request));
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
        v["status"]["token"]
            .as_str()
            .unwrap_or_else(|| panic!("no token in {answer}"))
            .to_string()
    }

    /// Writes a kubeconfig at `path` that authenticates with `token` against this server.
    pub fn write_kubeconfig(&self, path: &Path, token: &str) {
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {}\n    certificate-authority: {}\nusers:\n- name: sa\n  user:\n    token: {token}\ncontexts:\n- name: test\n  context:\n    cluster: test\n    user: sa\ncurrent-context: test\n",
            self.url,
            self.ca_file.display()
        );
        fs::write(path, text).unwrap();
    }

    /// A directory laid out like a Pod's `/var/run/secrets/kubernetes.io/serviceaccount`:
    /// `token`, `ca.crt` and `namespace` of ServiceAccount `namespace/name`.
    pub fn service_account_dir(&self, at: &Path, namespace: &str, name: &str) {
        fs::create_dir_all(at).unwrap();
        fs::write(
            at.join("token"),
            self.service_account_token(namespace, name),
        )
        .unwrap();
        fs::copy(&self.ca_file, at.join("ca.crt")).unwrap();
        fs::write(at.join("namespace"), namespace).unwrap();
    }

    /// The etcd revision now.
    pub fn etcd_revision(&self) -> u64 {
        // etcd's v3 JSON gateway; the key is base64 ("/" = "Lw==").
        let answer = self.etcd_post("/v3/kv/range", r#"{"key":"Lw==","limit":1}"#);
        let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
        v["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("no revision in {answer}"))
    }

    /// Compacts etcd's history up to `revision`: watches from before it get "compacted".
    pub fn etcd_compact(&self, revision: u64) {
        self.etcd_post(
            "/v3/kv/compaction",
            &format!(r#"{{"revision":"{revision}","physical":true}}"#),
        );
    }

    fn etcd_post(&self, path: &str, body: &str) -> String {
        let out = Command::new("curl")
            .args(["-sSf", "--max-time", "10", "-X", "POST", "-d", body])
            .arg(format!("{}{path}", self.etcd_url))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "etcd {path}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The last lines of kube-apiserver's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text = fs::read_to_string(self.dir.join("logs/kube-apiserver.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// Starts relaying `ns`'s `127.0.0.1:<API port>` to the API server.
    pub fn relay_into(&self, ns: &Netns) -> Relay {
        Relay::start(ns, self.port)
    }
}

impl Drop for RealKube {
    fn drop(&mut self) {
        let dir = self.dir.display().to_string();
        if let Err(e) = script("kube-down.sh", &[&dir], &[]) {
            eprintln!("{e}");
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// A TCP relay from a namespace's `127.0.0.1:port` to the host's `127.0.0.1:port`. The listening
/// socket is made on a thread inside the namespace; accepting and connecting run on threads of
/// the host's namespace (a socket keeps the namespace it was made in). Stops on drop.
pub struct Relay {
    listener: TcpListener,
    stop: Arc<AtomicBool>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Relay {
    fn start(ns: &Netns, port: u16) -> Self {
        let listener = ns
            .in_ns(move || TcpListener::bind(("127.0.0.1", port)))
            .join()
            .unwrap()
            .expect("binding the relay in the namespace");
        let stop = Arc::new(AtomicBool::new(false));
        let open: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let accept = listener.try_clone().unwrap();
        let (stop2, open2) = (stop.clone(), open.clone());
        std::thread::spawn(move || {
            for conn in accept.incoming() {
                if stop2.load(Ordering::Relaxed) {
                    break;
                }
                let Ok(down) = conn else { continue };
                let Ok(up) = TcpStream::connect(("127.0.0.1", port)) else {
                    // The API server is down: the client sees the connection close.
                    continue;
                };
                {
                    let mut open = open2.lock().unwrap();
                    open.retain(|s| s.peer_addr().is_ok());
                    open.push(down.try_clone().unwrap());
                    open.push(up.try_clone().unwrap());
                }
                pipe(down.try_clone().unwrap(), up.try_clone().unwrap());
                pipe(up, down);
            }
        });
        Self {
            listener,
            stop,
            open,
        }
    }

    /// Closes every relayed connection (clients see their watches end and reconnect).
    pub fn reset(&self) {
        for s in self.open.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Copies `from` to `to` on a thread until either side closes.
fn pipe(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16384];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Write);
        let _ = from.shutdown(Shutdown::Read);
    });
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.reset();
        // Wakes the accept loop, which then sees `stop` (the socket, and with it the namespace,
        // is released when the thread ends).
        // SAFETY: shutting down a socket this relay owns.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
    }
}

/// Makes `/var/run/secrets/kubernetes.io/serviceaccount` exist as a mount point (the test binds
/// a ServiceAccount directory over it in a private mount namespace); removes on drop the
/// directories it had to create, if they are still empty. Removing a directory detaches the
/// mounts other mount namespaces have on it, so at most one test at a time may rely on it (one
/// test in `tests/real/real_kube/` does).
pub struct SecretsMountPoint {
    created: Vec<PathBuf>,
}

/// Where Pods find their ServiceAccount credentials (client-go's and kube-rs's in-cluster path).
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

impl SecretsMountPoint {
    pub fn ensure() -> Self {
        let mut created = Vec::new();
        let mut path = PathBuf::new();
        for part in Path::new(SERVICE_ACCOUNT_DIR).components() {
            path.push(part);
            if !path.exists() {
                fs::create_dir(&path).unwrap();
                created.push(path.clone());
            }
        }
        Self { created }
    }
}

impl Drop for SecretsMountPoint {
    fn drop(&mut self) {
        for dir in self.created.iter().rev() {
            let _ = fs::remove_dir(dir);
        }
    }
}
