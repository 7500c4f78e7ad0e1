//! The container image the manifests run, built by `image/build.sh` and run by a real container
//! runtime (podman over runc) the way the DaemonSet runs it: the host network of a test node's
//! namespace, `NET_ADMIN` and `NET_RAW`, `/dev/net/tun`, the DaemonSet's own command and
//! arguments, and the host directories it mounts. Needs root; CI installs the tools.
//!
//! The image is built once per test run, shared with `tests/real/real_kubelet/` (or taken from
//! `KILOTUN_IMAGE_ARCHIVE`; see `tests/common/image.rs`), and a second time by the
//! reproducibility test.

use crate::common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::Duration;

use common::cluster::{Cluster, NodeSpec};
use common::{unique, which, Impl, Link, Underlay, WgDevice};
use serde_json::Value;

const REPO: &str = env!("CARGO_MANIFEST_DIR");
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// Fails `test`, naming what is missing, unless it can build and run images here.
fn require_image_tools(test: &str) {
    common::require_root(test);
    let missing: Vec<&str> = ["podman", "runc", "skopeo"]
        .into_iter()
        .filter(|t| !which(t))
        .collect();
    assert!(
        missing.is_empty(),
        "{test}: needs {missing:?} (.ci/run installs them)"
    );
}

/// Runs `command` to its end and returns its output; a failure names `what` and shows the output.
fn succeeded(command: &mut Command, what: &str) -> Output {
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "{what}: {}",
        common::output_text(&out)
    );
    out
}

/// Builds the image into `out` with `image/build.sh` (from the binaries this test run was built
/// with) and returns the archive's path.
fn build_image(out: &Path) -> PathBuf {
    common::image::build(out).unwrap_or_else(|e| panic!("{e}"));
    out.to_path_buf()
}

/// The image archive under test, built once per test run.
fn archive() -> &'static Path {
    static ARCHIVE: OnceLock<PathBuf> = OnceLock::new();
    ARCHIVE.get_or_init(|| common::image::archive().unwrap_or_else(|e| panic!("{e}")))
}

/// The digest of the archive's top manifest: the image's, or the index's (which names every
/// platform's image by digest).
fn skopeo_digest(archive: &Path) -> String {
    let out = Command::new("skopeo")
        .args(["inspect", "--raw"])
        .arg(format!("oci-archive:{}", archive.display()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::output_text(&out));
    let sum = common::pipe_to(&["sha256sum"], &out.stdout);
    format!("sha256:{}", sum.split_whitespace().next().unwrap())
}

/// One platform's image in the archive.
struct PlatformImage {
    /// `linux/amd64`, `linux/arm64/v8`, `linux/arm/v7`.
    platform: String,
    /// The image's OCI config.
    config: serde_json::Value,
    /// Its layers' blob paths, base first.
    layers: Vec<PathBuf>,
    /// Bytes of its compressed layers.
    compressed: u64,
}

/// `os/architecture[/variant]` of an image config or an index entry's platform.
fn platform_of(value: &serde_json::Value) -> String {
    let mut platform = format!(
        "{}/{}",
        value["os"].as_str().unwrap(),
        value["architecture"].as_str().unwrap()
    );
    if let Some(variant) = value["variant"].as_str() {
        platform = format!("{platform}/{variant}");
    }
    platform
}

/// The archive unpacked into a temporary directory (removed on drop).
struct Unpacked {
    dir: PathBuf,
}

impl Unpacked {
    fn new(archive: &Path) -> Self {
        let dir = std::env::temp_dir().join(unique("oci"));
        fs::create_dir_all(&dir).unwrap();
        common::run(&[
            "tar",
            "-xf",
            archive.to_str().unwrap(),
            "-C",
            dir.to_str().unwrap(),
        ]);
        Self { dir }
    }

    fn blob(&self, digest: &str) -> PathBuf {
        self.dir
            .join("blobs/sha256")
            .join(digest.trim_start_matches("sha256:"))
    }

    fn json(&self, digest: &str) -> serde_json::Value {
        serde_json::from_slice(&fs::read(self.blob(digest)).unwrap()).unwrap()
    }

    /// Every platform's image: the one image of a single-platform archive, or each image the
    /// index names.
    fn images(&self) -> Vec<PlatformImage> {
        let top: serde_json::Value =
            serde_json::from_slice(&fs::read(self.dir.join("index.json")).unwrap()).unwrap();
        let entries = top["manifests"].as_array().unwrap();
        assert_eq!(entries.len(), 1, "one name in the archive: {top}");
        let entry = &entries[0];
        let manifests: Vec<serde_json::Value> =
            if entry["mediaType"] == "application/vnd.oci.image.index.v1+json" {
                let index = self.json(entry["digest"].as_str().unwrap());
                index["manifests"].as_array().unwrap().clone()
            } else {
                vec![entry.clone()]
            };
        manifests
            .iter()
            .map(|m| {
                let manifest = self.json(m["digest"].as_str().unwrap());
                let config = self.json(manifest["config"]["digest"].as_str().unwrap());
                let platform = platform_of(&config);
                // The index's platform says the same as the image's own config.
                if let Some(claimed) = m.get("platform") {
                    assert_eq!(
                        platform_of(claimed),
                        platform,
                        "the index's platform of {m}"
                    );
                }
                let layers = manifest["layers"].as_array().unwrap();
                PlatformImage {
                    platform,
                    config,
                    layers: layers
                        .iter()
                        .map(|l| self.blob(l["digest"].as_str().unwrap()))
                        .collect(),
                    compressed: layers.iter().map(|l| l["size"].as_u64().unwrap()).sum(),
                }
            })
            .collect()
    }
}

impl Drop for Unpacked {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The platforms CI's archive holds: `KILOTUN_IMAGE_PLATFORMS` (which image/build.sh reads too)
/// names them; `all` is the three.
fn expected_platforms() -> Vec<&'static str> {
    let names = std::env::var("KILOTUN_IMAGE_PLATFORMS").unwrap_or_else(|_| "amd64".into());
    let names = if names == "all" {
        "amd64,arm64,armv7".to_string()
    } else {
        names
    };
    names
        .split(',')
        .map(|p| match p {
            "amd64" => "linux/amd64",
            "arm64" => "linux/arm64/v8",
            "armv7" => "linux/arm/v7",
            other => panic!("KILOTUN_IMAGE_PLATFORMS names {other:?}"),
        })
        .collect()
}

/// The GNU triple Debian's multiarch paths use, and the ELF machine of the platform's binaries.
fn multiarch_of(platform: &str) -> (&'static str, u16) {
    match platform {
        "linux/amd64" => ("x86_64-linux-gnu", 62),
        "linux/arm64/v8" => ("aarch64-linux-gnu", 183),
        "linux/arm/v7" => ("arm-linux-gnueabihf", 40),
        other => panic!("unexpected platform {other}"),
    }
}

/// A private podman: its own storage, run root and configuration, removed on drop, with the
/// image loaded. Configured for hosts like CI's: runc (crun fails on its cgroup layout),
/// cgroupfs, file events, and explicit nofile and nproc limits (podman's defaults raise them
/// past what the host lets runc set).
struct Podman {
    dir: PathBuf,
    image: String,
}

impl Podman {
    /// A podman holding the image of `platform` (`linux/arm64`, `linux/arm/v7`) from the archive,
    /// pulled as a runtime on that platform pulls it from the index.
    fn with_platform(platform: &str) -> Self {
        let mut podman = Self::empty();
        let out = succeeded(
            podman
                .command()
                .args(["pull", "--quiet", "--platform", platform])
                .arg(format!("oci-archive:{}", archive().display())),
            &format!("podman pull --platform {platform}"),
        );
        podman.image = String::from_utf8_lossy(&out.stdout).trim().to_string();
        podman
    }

    fn new() -> Self {
        let mut podman = Self::empty();
        let out = podman
            .command()
            .args(["load", "--quiet", "--input"])
            .arg(archive())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "podman load: {}",
            common::output_text(&out)
        );
        // "Loaded image: NAME" (or "Loaded image(s): NAME").
        podman.image = String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.split_once(": ").map(|(_, name)| name.trim().to_string()))
            .expect("podman load names the image");
        podman
    }

    /// Its own storage and configuration, no image yet.
    fn empty() -> Self {
        let dir = std::env::temp_dir().join(unique("podman"));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join("containers.conf"),
            "[containers]\ncgroups = \"no-conmon\"\n\
             default_ulimits = [\"nofile=20000:20000\", \"nproc=4096:4096\"]\n\
             [engine]\nevents_logger = \"file\"\ncgroup_manager = \"cgroupfs\"\nruntime = \"runc\"\n",
        )
        .unwrap();
        Self {
            dir,
            image: String::new(),
        }
    }

    fn command(&self) -> Command {
        let mut command = Command::new("podman");
        command
            .env("CONTAINERS_CONF", self.dir.join("containers.conf"))
            .arg("--root")
            .arg(self.dir.join("storage"))
            .arg("--runroot")
            .arg(self.dir.join("run"))
            .args(["--storage-driver", "vfs"]);
        command
    }

    /// `podman run --rm` with the DaemonSet's security context: host network of `netns`,
    /// `NET_ADMIN` and `NET_RAW` added, and a relative cgroup parent.
    fn run_in(&self, netns: &str, name: &str) -> Command {
        self.run_with_caps(netns, name, "NET_ADMIN,NET_RAW")
    }

    /// [`Podman::run_in`] with other added capabilities.
    fn run_with_caps(&self, netns: &str, name: &str, caps: &str) -> Command {
        let mut command = self.command();
        command
            .args(["run", "--rm", "--name", name])
            .arg(format!("--network=ns:/run/netns/{netns}"))
            .args(["--cap-add", caps])
            .args(["--cgroup-parent", "kilotun-test"]);
        command
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        let _ = self.command().args(["rm", "--all", "--force"]).output();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The DaemonSet and the CNI ConfigMap of `manifests/kilo-kubeadm.yaml`.
struct Manifest {
    daemonset: Value,
    cni_config: String,
}

impl Manifest {
    fn load() -> Self {
        let text = fs::read_to_string(Path::new(REPO).join("manifests/kilo-kubeadm.yaml")).unwrap();
        let mut daemonset = None;
        let mut cni_config = None;
        let documents: Vec<Value> = serde_saphyr::from_multiple(&text).unwrap();
        for value in documents {
            match value["kind"].as_str() {
                Some("DaemonSet") => daemonset = Some(value),
                Some("ConfigMap") => {
                    cni_config = value["data"]["cni-conf.json"].as_str().map(str::to_string)
                }
                _ => {}
            }
        }
        Self {
            daemonset: daemonset.expect("a DaemonSet"),
            cni_config: cni_config.expect("the CNI ConfigMap"),
        }
    }

    fn pod_spec(&self) -> &Value {
        &self.daemonset["spec"]["template"]["spec"]
    }

    fn strings(value: &Value) -> Vec<String> {
        value
            .as_array()
            .map(|s| {
                s.iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The install-cni init container's command and its environment (the ConfigMap's
    /// conflist for the variable taken from it).
    fn install_cni(&self) -> (Vec<String>, Vec<(String, String)>) {
        let init = &self.pod_spec()["initContainers"][0];
        assert_eq!(init["name"].as_str(), Some("install-cni"));
        let env = init["env"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let name = e["name"].as_str().unwrap().to_string();
                let value = match e["value"].as_str() {
                    Some(v) => v.to_string(),
                    None => self.cni_config.clone(),
                };
                (name, value)
            })
            .collect();
        (Self::strings(&init["command"]), env)
    }

    /// The kg container's command and arguments, with `$(NODE_NAME)` expanded as the kubelet
    /// does and the kubeconfig flag left out (these nodes use the file backend).
    fn kg_command(&self, node: &str) -> Vec<String> {
        let kg = &self.pod_spec()["containers"][0];
        let mut argv = Self::strings(&kg["command"]);
        argv.extend(
            Self::strings(&kg["args"])
                .into_iter()
                .filter(|a| !a.starts_with("--kubeconfig"))
                .map(|a| a.replace("$(NODE_NAME)", node)),
        );
        argv
    }

    fn image(&self) -> String {
        self.pod_spec()["containers"][0]["image"]
            .as_str()
            .unwrap()
            .to_string()
    }
}

/// Finishes `run` as the DaemonSet's kg container for `node` on the file backend: the cluster
/// directory mounted at its own path, the manifest's command and arguments, and the interface
/// `iface` (unique per test: `/var/run/wireguard` is shared).
fn daemonset_kg(
    run: &mut Command,
    podman: &Podman,
    manifest: &Manifest,
    node: &str,
    cluster_dir: &Path,
    iface: &str,
) {
    let argv = manifest.kg_command(node);
    run.arg("-v")
        .arg(format!("{0}:{0}", cluster_dir.display()))
        .arg("--entrypoint")
        .arg(&argv[0])
        .arg(&podman.image)
        .args(&argv[1..])
        .arg("--backend=file")
        .arg(format!("--cluster-dir={}", cluster_dir.display()))
        .arg(format!("--interface={iface}"));
}

/// One platform's image: its config, its two layers, every file the contract promises (under the
/// platform's own multiarch directory), nothing a package manager brings, and kilotun's
/// binaries built for that platform (their ELF machine).
fn check_platform_image(image: &PlatformImage) {
    let (gnu, machine) = multiarch_of(&image.platform);
    let config = &image.config;
    assert_eq!(config["os"], "linux");
    assert_eq!(config["config"]["Entrypoint"][0], "/usr/local/bin/kg");
    let layers = config["rootfs"]["diff_ids"].as_array().unwrap().len();
    assert_eq!(layers, 2, "a Debian layer and kilotun's: {config}");
    assert_eq!(image.layers.len(), 2);
    eprintln!(
        "{}: {} KiB compressed",
        image.platform,
        image.compressed / 1024
    );

    // The files, listed from the layers themselves.
    let mut files = String::new();
    for layer in &image.layers {
        files += &common::run(&["tar", "-tvzf", layer.to_str().unwrap()]);
    }
    let has = |path: &str| {
        let want = path.trim_start_matches('/');
        files.lines().any(|l| {
            l.split_whitespace()
                .nth(5)
                .is_some_and(|p| p.trim_start_matches("./").trim_end_matches('/') == want)
        })
    };
    let graphviz_config = format!("/usr/lib/{gnu}/graphviz/config6a");
    for path in [
        "/usr/local/bin/kg",
        "/usr/local/bin/kgctl",
        "/usr/local/bin/kilotun",
        "/bin/sh",
        "/bin/cp",
        "/opt/cni/bin/bridge",
        "/opt/cni/bin/host-local",
        "/opt/cni/bin/loopback",
        "/opt/cni/bin/portmap",
        "/usr/sbin/iptables-legacy",
        "/usr/sbin/iptables-nft",
        "/usr/sbin/iptables-legacy-restore",
        "/usr/sbin/iptables-nft-restore",
        "/usr/sbin/ip6tables-legacy",
        "/usr/sbin/ip6tables-nft-restore",
        "/usr/sbin/iptables",
        "/usr/sbin/iptables-restore",
        "/usr/sbin/ip6tables",
        "/usr/sbin/nft",
        "/usr/bin/dot",
        &graphviz_config,
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/kilotun/debian-packages.txt",
    ] {
        assert!(
            has(path),
            "{}: {path} is missing from the image:\n{files}",
            image.platform
        );
    }
    // Nothing a package manager or a compiler would bring.
    for path in [
        "/usr/bin/apt-get",
        "/usr/bin/dpkg",
        "/usr/bin/perl",
        "/bin/bash",
    ] {
        assert!(
            !has(path),
            "{}: {path} should not be in the image",
            image.platform
        );
    }
    // kilotun's binaries, in the second layer, are of this platform: the ELF header's e_machine.
    for bin in ["kg", "kgctl", "kilotun"] {
        let out = Command::new("tar")
            .arg("-xzOf")
            .arg(&image.layers[1])
            .arg("--wildcards")
            .arg(format!("*usr/local/bin/{bin}"))
            .output()
            .unwrap();
        assert!(
            out.status.success() && out.stdout.len() > 20,
            "{bin}: {}",
            common::output_text(&out)
        );
        let found = u16::from_le_bytes([out.stdout[18], out.stdout[19]]);
        assert_eq!(found, machine, "{}: {bin}'s ELF machine", image.platform);
    }
}

/// Every file the manifests and README promise is in the image, with the right entrypoint,
/// platform and layers; a second build of the same commit has the same digest.
#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn the_image_holds_the_contract_and_rebuilds_to_the_same_digest() {
    require_image_tools("the_image_holds_the_contract_and_rebuilds_to_the_same_digest");
    let archive = archive();
    let unpacked = Unpacked::new(archive);
    let images = unpacked.images();
    let platforms: Vec<&str> = images.iter().map(|i| i.platform.as_str()).collect();
    assert_eq!(platforms, expected_platforms(), "the archive's platforms");
    for image in &images {
        check_platform_image(image);
    }
    drop(unpacked);

    // The same commit built again: the same digest.
    let again = build_image(&std::env::temp_dir().join(format!("{}.oci.tar", unique("again"))));
    let (first, second) = (skopeo_digest(archive), skopeo_digest(&again));
    let _ = fs::remove_file(&again);
    assert_eq!(first, second, "two builds of the same commit differ");
}

/// Every manifest names the image the build produces (Kubernetes reads the short name
/// `kilotun:<version>` as `docker.io/library/kilotun:<version>`, the name in the archive).
#[test]
fn the_manifests_run_the_image_the_build_writes() {
    assert_eq!(Manifest::load().image(), format!("kilotun:{VERSION}"));
    let mut seen = 0;
    for entry in fs::read_dir(Path::new(REPO).join("manifests")).unwrap() {
        let path = entry.unwrap().path();
        for line in fs::read_to_string(&path).unwrap().lines() {
            let Some(image) = line.trim().strip_prefix("image: ") else {
                continue;
            };
            if image.contains("kilotun") {
                assert_eq!(image, format!("kilotun:{VERSION}"), "{}", path.display());
                seen += 1;
            }
        }
    }
    assert_eq!(
        seen, 6,
        "kubeadm and k3s (kg and install-cni each), the webhook and the TUN's device plugin"
    );
    let build = fs::read_to_string(Path::new(REPO).join("image/build.sh")).unwrap();
    assert!(build.contains("docker.io/library/kilotun:$version"));
}

/// Runs the install-cni init container's exact command against temporary host directories and
/// checks what it left there.
fn install_cni(podman: &Podman, netns: &str, host: &Path) {
    let (command, env) = Manifest::load().install_cni();
    let bin = host.join("opt/cni/bin");
    let conf = host.join("etc/cni/net.d");
    fs::create_dir_all(&bin).unwrap();
    fs::create_dir_all(&conf).unwrap();
    fs::write(conf.join("99-stale.conf"), "{}").unwrap();
    let mut run = podman.run_in(netns, &unique("cni"));
    run.arg("-v")
        .arg(format!("{}:/host/opt/cni/bin", bin.display()))
        .arg("-v")
        .arg(format!("{}:/host/etc/cni/net.d", conf.display()));
    for (name, value) in env {
        run.arg("-e").arg(format!("{name}={value}"));
    }
    let out = run
        .arg("--entrypoint")
        .arg(&command[0])
        .arg(&podman.image)
        .args(&command[1..])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "install-cni failed: {}",
        common::output_text(&out)
    );
    for plugin in ["bridge", "host-local", "loopback", "portmap"] {
        let path = bin.join(plugin);
        let mode = fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .permissions();
        assert!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o111 != 0,
            "{plugin} is not executable"
        );
    }
    let entries: Vec<_> = fs::read_dir(&conf)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(
        entries,
        vec!["10-kilo.conflist".to_string()],
        "the stale file is removed"
    );
    let conflist: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(conf.join("10-kilo.conflist")).unwrap()).unwrap();
    assert_eq!(conflist["plugins"][0]["type"], "bridge");
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn the_install_cni_init_container_installs_the_plugins_and_the_conflist() {
    require_image_tools("the_install_cni_init_container_installs_the_plugins_and_the_conflist");
    let podman = Podman::new();
    let ns = common::Netns::new();
    let host = std::env::temp_dir().join(unique("cnihost"));
    install_cni(&podman, &ns.name, &host);
    let _ = fs::remove_dir_all(&host);
}

/// Two nodes, each kg in a container with the DaemonSet's command, arguments and mounts (file
/// backend): they mesh and their pods reach each other; `wg show` on the host reads each
/// containerized engine through the shared `/var/run/wireguard`; each container writes its
/// KILO chains into legacy iptables where its host's rules are there, and its nftables table
/// where they are in nf_tables; the CNI plugins and conflist come from the init container and kg keeps the conflist
/// on the node's pod CIDR; `/graph?format=svg` renders inside the container.
#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn two_containerized_nodes_mesh_as_the_daemonset_runs_them() {
    require_image_tools("two_containerized_nodes_mesh_as_the_daemonset_runs_them");
    let podman = Podman::new();
    let manifest = Manifest::load();
    let mut cluster = Cluster::new(&["east", "west"]);
    let backends = ["legacy", "nft"];
    // The DaemonSet's hostPath volume is FileOrCreate.
    fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open("/run/xtables.lock")
        .unwrap();
    let mut names = Vec::new();
    for (i, (node, location)) in [("c1", "east"), ("c2", "west")].into_iter().enumerate() {
        let index = cluster.add_node(
            &NodeSpec {
                name: node,
                location,
                annotations: &[],
            },
            i as u8 + 1,
        );
        let ns = cluster.nodes[index].ns.name.clone();
        // The host's existing rules: one, in the back end this node's host uses.
        cluster.nodes[index].ns.run(&[
            &format!("iptables-{}", backends[i]),
            "-A",
            "INPUT",
            "-s",
            &format!("192.0.2.{}/32", i + 1),
            "-j",
            "ACCEPT",
        ]);
        let host = cluster.work.join(format!("{node}-host"));
        install_cni(&podman, &ns, &host);
        let kilo_dir = host.join("var/lib/kilo");
        fs::create_dir_all(&kilo_dir).unwrap();
        let container = unique("kg");
        let mut run = podman.run_in(&ns, &container);
        run.arg("-e")
            .arg(format!("NODE_NAME={node}"))
            .arg("-v")
            .arg("/dev/net/tun:/dev/net/tun")
            .arg("-v")
            .arg(format!(
                "{}:/etc/cni/net.d",
                host.join("etc/cni/net.d").display()
            ))
            .arg("-v")
            .arg(format!("{}:/var/lib/kilo", kilo_dir.display()))
            .arg("-v")
            .arg("/var/run/wireguard:/var/run/wireguard")
            .arg("-v")
            .arg("/run/xtables.lock:/run/xtables.lock");
        daemonset_kg(
            &mut run,
            &podman,
            &manifest,
            node,
            &cluster.dir,
            &cluster.nodes[index].iface,
        );
        cluster.start_kg_command(index, run);
        names.push(container);
    }
    let meshed = cluster.wait_for(Duration::from_secs(60), |c| c.all_pods_reachable().is_ok());
    assert!(
        meshed,
        "{:?}\n{}",
        cluster.all_pods_reachable(),
        cluster.logs()
    );

    for (i, node) in cluster.nodes.iter().enumerate() {
        // `wg show` on the host, through the socket the container created.
        let peers = node.wg("peers");
        assert_eq!(
            peers.lines().count(),
            1,
            "{}: {peers}\n{}",
            node.name,
            node.log_text()
        );
        // The key file kg wrote through the mount is private.
        let key = cluster
            .work
            .join(format!("{}-host/var/lib/kilo/key", node.name));
        let mode = fs::metadata(&key).unwrap().permissions();
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode) & 0o777,
            0o600
        );
        // Where the host's rules are in legacy iptables, KILO-NAT is there and only there;
        // where they are in nf_tables, kg writes its nftables table (the image's nft) and no
        // iptables chain in either back end.
        let listed = |backend: &str| {
            node.ns
                .output(&[
                    &format!("iptables-{backend}"),
                    "-t",
                    "nat",
                    "-S",
                    "KILO-NAT",
                ])
                .status
                .success()
        };
        if i == 0 {
            assert!(
                listed("legacy"),
                "{}: KILO-NAT not in legacy\n{}",
                node.name,
                node.log_text()
            );
            assert!(!listed("nft"), "{}: KILO-NAT also in nft", node.name);
            // The image's plain `iptables` reads the same back end.
            let exec = podman
                .command()
                .args(["exec", &names[i], "iptables", "-t", "nat", "-S", "KILO-NAT"])
                .output()
                .unwrap();
            assert!(
                exec.status.success(),
                "{}: {}",
                node.name,
                common::output_text(&exec)
            );
        } else {
            assert!(
                !listed("legacy") && !listed("nft"),
                "{}: KILO-NAT in iptables",
                node.name
            );
            let exec = podman
                .command()
                .args(["exec", &names[i], "nft", "list", "table", "inet", "kilo"])
                .output()
                .unwrap();
            assert!(
                exec.status.success() && common::output_text(&exec).contains("masquerade"),
                "{}: no nftables table: {}\n{}",
                node.name,
                common::output_text(&exec),
                node.log_text()
            );
        }
        // kg keeps the installed conflist on this node's pod CIDR.
        let conflist = cluster
            .work
            .join(format!("{}-host/etc/cni/net.d/10-kilo.conflist", node.name));
        let pod_cidr = format!("10.42.{}.0/24", i + 1);
        let kept = cluster.wait_for(Duration::from_secs(10), |_| {
            fs::read_to_string(&conflist).is_ok_and(|t| t.contains(&pod_cidr))
        });
        assert!(kept, "{}: {:?}", node.name, fs::read_to_string(&conflist));
        // Graphviz inside the container.
        let (status, svg) = node.http_get("/graph?format=svg");
        assert_eq!(status, 200, "{svg}");
        assert!(
            svg.contains("<svg") && svg.contains("c1") && svg.contains("c2"),
            "{svg}"
        );
    }
}

/// The DaemonSet without `/dev/net/tun`, or without `NET_ADMIN`: kg says what is missing in
/// one line and exits non-zero, with no stack trace.
#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn without_tun_or_net_admin_kg_exits_with_one_line() {
    require_image_tools("without_tun_or_net_admin_kg_exits_with_one_line");
    let podman = Podman::new();
    let manifest = Manifest::load();
    let cluster = Cluster::new(&["east"]);
    let ns = common::Netns::new();
    fs::write(
        cluster.dir.join("n1.yaml"),
        "apiVersion: v1\nkind: Node\nmetadata:\n  name: n1\nspec:\n  podCIDR: 10.42.1.0/24\n",
    )
    .unwrap();
    for (case, caps, with_tun) in [
        ("no-tun", "NET_ADMIN,NET_RAW", false),
        ("no-net-admin", "NET_RAW", true),
    ] {
        let keys = cluster.work.join(case);
        fs::create_dir_all(&keys).unwrap();
        let mut run = podman.run_with_caps(&ns.name, &unique("bad"), caps);
        if with_tun {
            run.args(["-v", "/dev/net/tun:/dev/net/tun"]);
        }
        run.arg("-v")
            .arg(format!("{}:/var/lib/kilo", keys.display()));
        daemonset_kg(
            &mut run,
            &podman,
            &manifest,
            "n1",
            &cluster.dir,
            &unique("kg"),
        );
        run.arg("--cni=false").arg("--log-level=warn");
        let out = run.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{case}: kg exited 0:\n{stderr}");
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{case}: one line expected:\n{stderr}");
        assert!(lines[0].starts_with("kg: "), "{case}: {stderr}");
        assert!(
            !stderr.contains("panicked") && !stderr.contains("backtrace"),
            "{case}: {stderr}"
        );
        let expected = if with_tun {
            "NET_ADMIN"
        } else {
            "/dev/net/tun"
        };
        assert!(
            lines[0].contains(expected),
            "{case}: should name {expected}: {stderr}"
        );
    }
}

/// What `kind load image-archive` and `k3s ctr images import` run: containerd's import of the
/// archive, with kind's flags, names the image as the manifests ask for it.
#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn containerd_imports_the_archive_under_the_manifests_name() {
    require_image_tools("containerd_imports_the_archive_under_the_manifests_name");
    assert!(
        which("containerd") && which("ctr"),
        "containerd_imports_the_archive_under_the_manifests_name: needs containerd (.ci/run installs it)"
    );
    let dir = std::env::temp_dir().join(unique("containerd"));
    fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.toml");
    // Only what an import needs: no CRI plugin (nothing here runs a kubelet).
    fs::write(
        &config,
        "version = 2\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n",
    )
    .unwrap();
    let socket = dir.join("containerd.sock");
    let mut daemon = Command::new("containerd")
        .arg("--config")
        .arg(&config)
        .arg("--root")
        .arg(dir.join("root"))
        .arg("--state")
        .arg(dir.join("state"))
        .arg("--address")
        .arg(&socket)
        .stdout(std::process::Stdio::null())
        .stderr(fs::File::create(dir.join("containerd.log")).unwrap())
        .spawn()
        .unwrap();
    let ctr = |args: &[&str]| {
        Command::new("ctr")
            .arg("--address")
            .arg(&socket)
            .args(["--namespace", "k8s.io"])
            .args(args)
            .output()
            .unwrap()
    };
    let mut up = false;
    for _ in 0..100 {
        if ctr(&["version"]).status.success() {
            up = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let imported = up.then(|| {
        ctr(&[
            "images",
            "import",
            "--all-platforms",
            "--digests",
            "--snapshotter",
            "native",
            archive().to_str().unwrap(),
        ])
    });
    let listed = ctr(&["images", "list", "--quiet"]);
    let _ = daemon.kill();
    let _ = daemon.wait();
    let log = fs::read_to_string(dir.join("containerd.log")).unwrap_or_default();
    let _ = fs::remove_dir_all(&dir);
    assert!(up, "containerd did not start:\n{log}");
    let imported = imported.unwrap();
    assert!(
        imported.status.success(),
        "ctr import: {}",
        common::output_text(&imported)
    );
    let names = String::from_utf8_lossy(&listed.stdout);
    assert!(
        names
            .lines()
            .any(|l| l == format!("docker.io/library/kilotun:{VERSION}")),
        "containerd names: {names}"
    );
}

/// The arm64 and armv7 images of the index, run as a container runtime on such a host runs them
/// (here by qemu-user through binfmt_misc): kg names its target, the platform's own iptables and
/// Graphviz load their libraries; then the arm64 engine, in its container with the DaemonSet's
/// capabilities and `/dev/net/tun`, meshes with this machine's kilotun: a handshake, pings both
/// ways and a transfer checked byte for byte.
#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn the_arm_images_run_under_emulation_and_the_arm64_engine_meshes() {
    let test = "the_arm_images_run_under_emulation_and_the_arm64_engine_meshes";
    require_image_tools(test);
    assert!(
        expected_platforms().contains(&"linux/arm64/v8"),
        "{test}: the image is amd64 only: KILOTUN_IMAGE_PLATFORMS=all builds all three (.ci/run sets it)"
    );
    for (platform, triple) in [
        ("linux/arm64", "aarch64-unknown-linux-gnu"),
        ("linux/arm/v7", "armv7-unknown-linux-gnueabihf"),
    ] {
        let podman = Podman::with_platform(platform);
        let run = |entrypoint: &str, args: &[&str]| {
            common::output_text(&succeeded(
                podman
                    .command()
                    .args(["run", "--rm", "--network=none", "--entrypoint", entrypoint])
                    .arg(&podman.image)
                    .args(args),
                &format!("{platform}: {entrypoint} {args:?}"),
            ))
        };
        let version = run("/usr/local/bin/kg", &["--version"]);
        assert!(
            version.contains(&format!("kg {VERSION} ({triple})")),
            "{platform}: {version}"
        );
        assert!(run("/usr/local/bin/kilotun", &["--version"]).contains(triple));
        assert!(run("/usr/local/bin/kgctl", &["--version"]).contains(triple));
        // (iptables-nft needs NETLINK_NETFILTER, which qemu-user does not translate.)
        assert!(run("/usr/sbin/iptables-legacy", &["--version"]).contains("legacy"));
        assert!(run("/usr/bin/dot", &["-V"]).contains("graphviz version"));
        eprintln!("{test}: {platform}: {}", version.trim());
    }

    let podman = Podman::with_platform("linux/arm64");
    let link = Link::new(Underlay::V4);
    let name = unique("wg");
    let container = unique("arm64-engine");
    let child = podman
        .run_in(&link.left.name, &container)
        .args(["--device", "/dev/net/tun"])
        .args(["-v", "/var/run/wireguard:/var/run/wireguard"])
        .args(["--entrypoint", "/usr/local/bin/kilotun"])
        .arg(&podman.image)
        .args(["-f", "--threads", "2", &name])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let a = WgDevice::started(&link.left, name, child, Duration::from_secs(60));
    let b = WgDevice::start(&link.right, Impl::Kilotun);
    a.configure(51820, &["10.72.0.1/24"]);
    b.configure(51821, &["10.72.0.2/24"]);
    a.add_peer(&b, "192.168.200.2:51821", "10.72.0.2/32");
    b.add_peer(&a, "192.168.200.1:51820", "10.72.0.1/32");
    assert!(
        common::ping_ok(&a.ns, "10.72.0.2", Duration::from_secs(20)),
        "ping from the arm64 container"
    );
    assert!(
        common::ping_ok(&b.ns, "10.72.0.1", Duration::from_secs(5)),
        "ping to the arm64 container"
    );
    let bytes = 4 * 1024 * 1024;
    let took = common::tcp_transfer(&link.right, &link.left, "10.72.0.1".parse().unwrap(), bytes);
    eprintln!("{test}: {bytes} bytes to the arm64 container's engine in {took:?}");
    let transfer = a.wg(&["show", &a.name, "transfer"]);
    let received: u64 = transfer.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(received >= bytes, "the arm64 engine counted {transfer}");
}
