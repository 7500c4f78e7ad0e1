//! Test hosts in network namespaces: namespaces, veth links, devices (kilotun, wireguard-go or
//! gotatun) and sockets opened from inside a namespace. Everything is named uniquely per test and
//! removed on drop. Tests that need root skip themselves with a message when not root.

#![allow(dead_code, unreachable_pub, missing_docs)]

use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub mod calico;
pub mod cluster;
pub mod edits;
pub mod fake_kube;
pub mod image;
pub mod old_clusters;
pub mod pinger;
pub mod real_kube;
pub mod webhook;

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// Fails the test, naming what is missing, unless it may create namespaces and TUN devices (root,
/// with iproute2 and wireguard-tools). The tests that call it are `#[ignore]`d, so they run only
/// when asked for, and a run that cannot happen is a failure, never a silent pass.
pub fn require_root(test: &str) {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(
        root,
        "{test} needs root for network namespaces and TUN devices: run it as root \
         (`sudo bash .ci/run`), or leave out the ignored tests and it is reported as skipped"
    );
    let missing: Vec<&str> = ["ip", "wg"].into_iter().filter(|t| !which(t)).collect();
    assert!(
        missing.is_empty(),
        "{test} needs {missing:?} (iproute2 and wireguard-tools; .ci/run installs them)"
    );
}

/// Fails the test, naming it, unless tcpdump is here: a capture that cannot start must not read
/// as one that saw nothing (nor let the test pass without its check).
pub fn require_tcpdump(test: &str) {
    assert!(
        which("tcpdump"),
        "{test} needs tcpdump to capture on the underlay (.ci/run installs it)"
    );
}

pub fn which(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Resident memory of process `pid`, in KiB (`VmRSS` in `/proc/PID/status`).
pub fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// A short name unique to this process and call, and so among the tests that run at the same
/// time (nextest runs each test in a process of its own, side by side): `{prefix}{pid}x{n}`,
/// at most 15 bytes (an interface name's limit) for a two-letter prefix, with the pid under
/// Linux's largest `pid_max` (seven digits) and fewer than 10,000 names.
pub fn unique(prefix: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{}x{n}", std::process::id())
}

/// A loopback address of this process's own, `127.64.0.0/10` with the process id in its low 22
/// bits: nextest runs each test in a process of its own, so no two live tests share one, and a
/// server a test starts on it with a fixed port cannot find that port taken by another test.
pub fn own_loopback() -> std::net::Ipv4Addr {
    let pid = std::process::id() & 0x3f_ffff;
    std::net::Ipv4Addr::new(127, 64 | (pid >> 16) as u8, (pid >> 8) as u8, pid as u8)
}

/// A finished command's standard output, then its standard error.
pub fn output_text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs a command, panicking with its output if it fails.
pub fn run(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("running {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn output(args: &[&str]) -> Output {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("running {args:?}: {e}"))
}

/// A network namespace, deleted (with everything in it) on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new() -> Self {
        let name = unique("kt");
        run(&["ip", "netns", "add", &name]);
        run(&["ip", "-n", &name, "link", "set", "lo", "up"]);
        Self { name }
    }

    /// Runs `args` inside the namespace, panicking on failure.
    pub fn run(&self, args: &[&str]) -> String {
        let mut full = vec!["ip", "netns", "exec", &self.name];
        full.extend_from_slice(args);
        run(&full)
    }

    /// Runs `args` inside the namespace and returns its output whatever the exit status.
    pub fn output(&self, args: &[&str]) -> Output {
        let mut full = vec!["ip", "netns", "exec", &self.name];
        full.extend_from_slice(args);
        output(&full)
    }

    pub fn spawn(&self, args: &[&str]) -> Child {
        self.spawn_with_env(args, &[])
    }

    /// [`Netns::spawn`] with extra environment variables.
    pub fn spawn_with_env(&self, args: &[&str], env: &[(&str, &str)]) -> Child {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawning {args:?}: {e}"))
    }

    /// Runs `f` on a thread that has entered this namespace (sockets it opens live here).
    pub fn in_ns<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::thread::JoinHandle<T> {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let ns = File::open(&path).expect("open netns");
            // SAFETY: setns on this thread only, with a descriptor of a namespace file.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
            f()
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = output(&["ip", "netns", "del", &self.name]);
    }
}

/// Two namespaces joined by a veth pair with underlay addresses `left` and `right`.
pub struct Link {
    pub left: Netns,
    pub right: Netns,
    pub left_ip: IpAddr,
    pub right_ip: IpAddr,
    pub left_dev: String,
    pub right_dev: String,
}

pub enum Underlay {
    V4,
    V6,
}

impl Link {
    pub fn new(underlay: Underlay) -> Self {
        let (left, right) = (Netns::new(), Netns::new());
        let (ld, rd) = (unique("va"), unique("vb"));
        run(&[
            "ip", "link", "add", &ld, "type", "veth", "peer", "name", &rd,
        ]);
        run(&["ip", "link", "set", &ld, "netns", &left.name]);
        run(&["ip", "link", "set", &rd, "netns", &right.name]);
        let (lip, rip, len) = match underlay {
            Underlay::V4 => ("192.168.200.1", "192.168.200.2", "24"),
            Underlay::V6 => ("fd99::1", "fd99::2", "64"),
        };
        for (ns, dev, ip) in [(&left, &ld, lip), (&right, &rd, rip)] {
            let cidr = format!("{ip}/{len}");
            let mut args = vec!["ip", "-n", &ns.name, "addr", "add", &cidr, "dev", dev];
            if len == "64" {
                args.push("nodad");
            }
            run(&args);
            run(&["ip", "-n", &ns.name, "link", "set", dev, "up"]);
        }
        Self {
            left,
            right,
            left_ip: lip.parse().unwrap(),
            right_ip: rip.parse().unwrap(),
            left_dev: ld,
            right_dev: rd,
        }
    }
}

/// Which implementation runs a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Impl {
    Kilotun,
    /// kilotun with `--no-offload`: the path kernels without TUN offload take.
    KilotunWithoutOffload,
    WireguardGo,
    /// wireguard-go 0.0.20231211 (TUN TSO/GRO, UDP GSO/GRO), Debian's bookworm-backports build,
    /// from [`engine_bin`].
    WireguardGo2023,
    /// wireguard-go 0.0.20260522, the newest release (it takes `allowed_ip=-`), Debian's sid
    /// build, from [`engine_bin`].
    WireguardGo2026,
    /// Mullvad's gotatun 0.10.2 (boringtun's successor), from [`engine_bin`].
    Gotatun,
    /// kilotun cross-built for another architecture (`KILOTUN_CROSS_KILOTUN`, see
    /// [`foreign_kilotun`]), run by qemu-user through binfmt_misc.
    ForeignKilotun,
}

/// A kilotun binary of another architecture, as `scripts/cross-build.sh` builds it.
pub struct Foreign {
    pub bin: String,
    /// `aarch64` or `arm`.
    pub arch: &'static str,
    /// The directory qemu-user takes the dynamic loader and glibc from (`QEMU_LD_PREFIX`).
    pub ld_prefix: String,
}

/// The foreign kilotun named by `KILOTUN_CROSS_KILOTUN` (for example
/// `target/aarch64-unknown-linux-gnu/release/kilotun`): `Ok(None)` when the variable is unset,
/// `Err(why)` when it is set but the binary cannot run here. Its glibc is the bookworm sysroot
/// the script links against, `${KILOTUN_CACHE:-/var/cache/kilotun}/cross/sysroot-{arm64,armhf}`
/// (`KILOTUN_CROSS_LD_PREFIX` overrides it); it runs through the machine's binfmt_misc entry
/// (qemu-user-static registers `qemu-aarch64` and `qemu-arm`).
pub fn foreign_kilotun() -> Result<Option<Foreign>, String> {
    use std::os::unix::fs::PermissionsExt;
    let Some(bin) = std::env::var_os("KILOTUN_CROSS_KILOTUN") else {
        return Ok(None);
    };
    let bin = std::path::absolute(&bin)
        .map_err(|e| format!("KILOTUN_CROSS_KILOTUN={bin:?}: {e}"))?
        .to_string_lossy()
        .into_owned();
    let meta = std::fs::metadata(&bin).map_err(|e| format!("KILOTUN_CROSS_KILOTUN={bin}: {e}"))?;
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Err(format!(
            "KILOTUN_CROSS_KILOTUN={bin} is not an executable file"
        ));
    }
    let mut header = [0u8; 20];
    File::open(&bin)
        .and_then(|mut f| f.read_exact(&mut header))
        .map_err(|e| format!("reading {bin}: {e}"))?;
    if &header[..4] != b"\x7fELF" {
        return Err(format!("{bin} is not an ELF file"));
    }
    let (arch, debian) = match u16::from_le_bytes([header[18], header[19]]) {
        183 => ("aarch64", "arm64"),
        40 => ("arm", "armhf"),
        machine => {
            return Err(format!(
                "{bin}: ELF machine {machine} is neither aarch64 nor arm"
            ))
        }
    };
    let binfmt = format!("/proc/sys/fs/binfmt_misc/qemu-{arch}");
    match std::fs::read_to_string(&binfmt) {
        Ok(entry) if entry.starts_with("enabled") => {}
        _ => {
            return Err(format!(
                "{binfmt} is missing or disabled: install qemu-user-static (it registers the \
                 entry; mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc if need be)"
            ))
        }
    }
    let ld_prefix = std::env::var("KILOTUN_CROSS_LD_PREFIX").unwrap_or_else(|_| {
        let cache = std::env::var("KILOTUN_CACHE").unwrap_or_else(|_| "/var/cache/kilotun".into());
        format!("{cache}/cross/sysroot-{debian}")
    });
    if !std::path::Path::new(&ld_prefix).join("lib").is_dir() {
        return Err(format!(
            "no {debian} sysroot at {ld_prefix} (scripts/cross-build.sh creates it; \
             KILOTUN_CROSS_LD_PREFIX overrides the path)"
        ));
    }
    Ok(Some(Foreign {
        bin,
        arch,
        ld_prefix,
    }))
}

/// Where an engine that `scripts/engines.sh` fetches is looked for: (its name, the environment
/// variable naming its binary (the script prints `VARIABLE=PATH`), that path, else the script's
/// cache path under `${KILOTUN_CACHE:-/var/cache/kilotun}`). `None` for the other engines.
fn engine_location(engine: Impl) -> Option<(&'static str, &'static str, String)> {
    let (name, variable, cached) = match engine {
        Impl::WireguardGo2023 => (
            "wireguard-go 0.0.20231211",
            "KILOTUN_WIREGUARD_GO_2023",
            "wireguard-go-0.0.20231211/usr/bin/wireguard-go",
        ),
        Impl::WireguardGo2026 => (
            "wireguard-go 0.0.20260522",
            "KILOTUN_WIREGUARD_GO_2026",
            "wireguard-go-0.0.20260522/usr/bin/wireguard-go",
        ),
        Impl::Gotatun => (
            "gotatun 0.10.2",
            "KILOTUN_GOTATUN",
            "gotatun-0.10.2/bin/gotatun",
        ),
        Impl::Kilotun | Impl::KilotunWithoutOffload | Impl::WireguardGo | Impl::ForeignKilotun => {
            return None
        }
    };
    let path = std::env::var(variable).unwrap_or_else(|_| {
        let cache = std::env::var("KILOTUN_CACHE").unwrap_or_else(|_| "/var/cache/kilotun".into());
        format!("{cache}/{cached}")
    });
    Some((name, variable, path))
}

/// The binary of an engine that `scripts/engines.sh` fetches, when it is an executable file.
pub fn engine_bin(engine: Impl) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let (_, _, path) = engine_location(engine)?;
    let executable =
        std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0);
    executable.then_some(path)
}

/// Fails `test`, saying how to get it, unless `engine` can be started here. The tests that use
/// another engine are `#[ignore]`d (root only), so they run only when asked for.
pub fn require_engine(engine: Impl, test: &str) {
    match engine {
        Impl::Kilotun | Impl::KilotunWithoutOffload => {}
        Impl::ForeignKilotun => match foreign_kilotun() {
            Ok(Some(_)) => {}
            Ok(None) => panic!(
                "{test}: set KILOTUN_CROSS_KILOTUN to a kilotun built by scripts/cross-build.sh \
                 (target/aarch64-unknown-linux-gnu/release/kilotun; .ci/run builds it)"
            ),
            Err(why) => panic!("{test}: {why}"),
        },
        Impl::WireguardGo => assert!(
            which("wireguard-go"),
            "{test}: needs wireguard-go (Debian package wireguard-go; .ci/run installs it)"
        ),
        Impl::WireguardGo2023 | Impl::WireguardGo2026 | Impl::Gotatun => {
            if engine_bin(engine).is_none() {
                let (name, variable, path) = engine_location(engine).expect("a fetched engine");
                panic!(
                    "{test}: {name} is not at {path} (run scripts/engines.sh, or set {variable} \
                     to its binary)"
                );
            }
        }
    }
}

/// A userspace WireGuard device in a namespace, stopped on drop.
pub struct WgDevice {
    pub ns: String,
    pub name: String,
    pub key_file: String,
    pub public_key: String,
    child: Child,
}

pub fn kilotun_bin() -> &'static str {
    env!("CARGO_BIN_EXE_kilotun")
}

impl WgDevice {
    /// Starts `which` as interface `name` in `ns` (in the foreground) and waits for its socket.
    pub fn start(ns: &Netns, which: Impl) -> Self {
        let name = unique("wg");
        let child = match which {
            Impl::Kilotun => ns.spawn(&[kilotun_bin(), "-f", "--threads", "2", &name]),
            Impl::KilotunWithoutOffload => {
                ns.spawn(&[kilotun_bin(), "-f", "--threads", "2", "--no-offload", &name])
            }
            Impl::WireguardGo => ns.spawn(&["wireguard-go", "-f", &name]),
            // binfmt_misc runs it under qemu-user, which takes the dynamic loader and glibc
            // from QEMU_LD_PREFIX.
            Impl::ForeignKilotun => {
                let foreign = foreign_kilotun()
                    .expect("foreign kilotun")
                    .expect("KILOTUN_CROSS_KILOTUN (engine_available)");
                ns.spawn_with_env(
                    &[&foreign.bin, "-f", "--threads", "2", &name],
                    &[("QEMU_LD_PREFIX", &foreign.ld_prefix)],
                )
            }
            Impl::WireguardGo2023 | Impl::WireguardGo2026 => {
                let bin = engine_bin(which).expect("wireguard-go (engine_available)");
                ns.spawn(&[&bin, "-f", &name])
            }
            // gotatun drops privileges to the login user unless told not to, and getlogin()
            // fails without a terminal.
            Impl::Gotatun => {
                let bin = engine_bin(which).expect("gotatun (engine_available)");
                ns.spawn(&[&bin, "-f", "--disable-drop-privileges", &name])
            }
        };
        Self::started(ns, name, child, Duration::from_secs(10))
    }

    /// A device `name` in `ns` that `child` runs (started by the caller, e.g. in a container):
    /// waits up to `timeout` for its UAPI socket in `/var/run/wireguard` and makes it a key.
    pub fn started(ns: &Netns, name: String, child: Child, timeout: Duration) -> Self {
        let socket = format!("/var/run/wireguard/{name}.sock");
        let deadline = Instant::now() + timeout;
        while !std::path::Path::new(&socket).exists() {
            assert!(Instant::now() < deadline, "{name}: no {socket}");
            std::thread::sleep(Duration::from_millis(20));
        }
        let key_file = format!("/tmp/{name}.key");
        let key = run(&["wg", "genkey"]);
        std::fs::write(&key_file, &key).unwrap();
        let public_key = pipe_to(&["wg", "pubkey"], key.as_bytes())
            .trim()
            .to_string();
        Self {
            ns: ns.name.clone(),
            name,
            key_file,
            public_key,
            child,
        }
    }

    /// `wg ARGS…` against this device, inside its namespace.
    pub fn wg(&self, args: &[&str]) -> String {
        let mut full = vec!["ip", "netns", "exec", &self.ns, "wg"];
        full.extend_from_slice(args);
        run(&full)
    }

    /// `ip ARGS…` inside this device's namespace.
    pub fn ip(&self, args: &[&str]) -> String {
        let mut full = vec!["ip", "-n", &self.ns];
        full.extend_from_slice(args);
        run(&full)
    }

    /// Sets the private key and port, then brings the link up with `addresses`.
    pub fn configure(&self, port: u16, addresses: &[&str]) {
        self.wg(&[
            "set",
            &self.name,
            "private-key",
            &self.key_file,
            "listen-port",
            &port.to_string(),
        ]);
        for a in addresses {
            self.ip(&["addr", "add", a, "dev", &self.name]);
        }
        self.ip(&["link", "set", &self.name, "up"]);
    }

    pub fn add_peer(&self, peer: &WgDevice, endpoint: &str, allowed: &str) {
        self.wg(&[
            "set",
            &self.name,
            "peer",
            &peer.public_key,
            "endpoint",
            endpoint,
            "allowed-ips",
            allowed,
        ]);
    }

    pub fn is_running(&mut self) -> bool {
        self.try_wait().is_none()
    }

    /// The daemon's exit status, once it has exited.
    pub fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The daemon's process id (`ip netns exec` execs it in place).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stderr(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let mut s = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut s);
        }
        s
    }
}

impl Drop for WgDevice {
    fn drop(&mut self) {
        // SIGTERM first so the device removes its socket and interface (unless it has exited
        // and been reaped: its pid may be another process's by now).
        if self.is_running() {
            // SAFETY: kill with a pid we spawned and have not reaped.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.key_file);
        let _ = std::fs::remove_file(format!("/var/run/wireguard/{}.sock", self.name));
    }
}

/// Two devices in a fresh pair of namespaces over an IPv4 underlay, each the other's peer:
/// `left` at 10.SUBNET.0.1 on port 51820, `right` at 10.SUBNET.0.2 on port 51821, each
/// allowing the other's /32. Both links are up; no packet has crossed yet.
pub fn peered(left: Impl, right: Impl, subnet: u8) -> (Link, WgDevice, WgDevice) {
    let link = Link::new(Underlay::V4);
    let a = WgDevice::start(&link.left, left);
    let b = WgDevice::start(&link.right, right);
    a.configure(51820, &[&format!("10.{subnet}.0.1/24")]);
    b.configure(51821, &[&format!("10.{subnet}.0.2/24")]);
    a.add_peer(&b, "192.168.200.2:51821", &format!("10.{subnet}.0.2/32"));
    b.add_peer(&a, "192.168.200.1:51820", &format!("10.{subnet}.0.1/32"));
    (link, a, b)
}

pub fn pipe_to(args: &[&str], input: &[u8]) -> String {
    let mut child = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Pings `target` from `ns` until one answer arrives (up to `timeout`).
pub fn ping_ok(ns: &str, target: &str, timeout: Duration) -> bool {
    ping_from_ok(ns, None, target, timeout)
}

/// [`ping_ok`] from the local address `source` (`None`: the kernel's choice).
pub fn ping_from_ok(ns: &str, source: Option<&str>, target: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let mut args = vec!["ip", "netns", "exec", ns, "ping", "-c", "1", "-W", "1"];
        if let Some(source) = source {
            args.extend(["-I", source]);
        }
        args.push(target);
        let out = output(&args);
        if out.status.success() {
            return true;
        }
    }
    false
}

/// The deterministic byte stream the transfer tests send: byte `i` of the stream.
fn stream_byte(seed: u64, i: u64) -> u8 {
    let mut x = seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (x >> 32) as u8
}

/// Sends `bytes` of a deterministic stream over TCP from `from` to `to:port` (inside `to_ns`)
/// and checks every byte arrived intact. Returns the elapsed time.
pub fn tcp_transfer(from: &Netns, to: &Netns, to_ip: IpAddr, bytes: u64) -> Duration {
    let port = 5201 + (COUNTER.fetch_add(1, Ordering::Relaxed) % 1000) as u16;
    let addr = SocketAddr::new(to_ip, port);
    let seed = u64::from(port) * 7919;
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let server = to.in_ns(move || {
        let listener = TcpListener::bind(addr).expect("bind transfer listener");
        ready_tx.send(()).unwrap();
        let (mut stream, _) = listener.accept().unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let mut buf = vec![0u8; 1 << 16];
        let (mut received, mut mismatches) = (0u64, 0u64);
        loop {
            let n = stream.read(&mut buf).expect("read transfer");
            if n == 0 {
                break;
            }
            for (k, b) in buf[..n].iter().enumerate() {
                if *b != stream_byte(seed, received + k as u64) {
                    mismatches += 1;
                }
            }
            received += n as u64;
        }
        (received, mismatches)
    });
    ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let start = Instant::now();
    let client = from.in_ns(move || {
        let mut stream =
            TcpStream::connect_timeout(&addr, Duration::from_secs(10)).expect("connect transfer");
        let mut buf = vec![0u8; 1 << 16];
        let mut sent = 0u64;
        while sent < bytes {
            let n = (bytes - sent).min(buf.len() as u64) as usize;
            for (k, b) in buf[..n].iter_mut().enumerate() {
                *b = stream_byte(seed, sent + k as u64);
            }
            stream.write_all(&buf[..n]).expect("write transfer");
            sent += n as u64;
        }
    });
    client.join().unwrap();
    let (received, mismatches) = server.join().unwrap();
    assert_eq!(received, bytes, "every byte arrives");
    assert_eq!(mismatches, 0, "no byte differs");
    start.elapsed()
}

/// `ping` from `source` in namespace `ns` to `target`, `count` times every 100 ms (1 s timeout
/// each), output piped: collect it with `wait_with_output` and read it with [`ping_received`].
pub fn ping_series(ns: &str, source: &str, target: &str, count: u32) -> Child {
    Command::new("ip")
        .args(["netns", "exec", ns, "ping", "-n", "-i", "0.1", "-W", "1"])
        .args(["-c", &count.to_string(), "-I", source, target])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ping")
}

/// Runs [`ping_series`] to the end: how many of `count` echoes were answered, and ping's output.
pub fn ping_series_received(ns: &str, source: &str, target: &str, count: u32) -> (u32, String) {
    let out = ping_series(ns, source, target, count)
        .wait_with_output()
        .expect("ping");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    (ping_received(&text), text)
}

/// The `N received` of ping's summary (0 when there is none).
pub fn ping_received(output: &str) -> u32 {
    output
        .split(',')
        .find_map(|part| part.trim().strip_suffix(" received"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// The value of the unlabelled series `name` in a Prometheus text exposition, if present.
#[allow(dead_code)]
pub fn metric_value(exposition: &str, name: &str) -> Option<f64> {
    exposition.lines().find_map(|line| {
        let (series, value) = line.split_once(' ')?;
        (series == name).then(|| value.trim().parse().ok())?
    })
}

/// `GET path` against `addr` from inside `ns`: (status, body).
pub fn http_get(ns: &Netns, addr: &str, path: &str) -> (u16, String) {
    let (status, _, body) = http_get_accepting(ns, addr, path, None);
    (status, body)
}

/// `GET path` against `addr` from inside `ns`, with an `Accept` header when given:
/// (status, headers in lower case, body).
pub fn http_get_accepting(
    ns: &Netns,
    addr: &str,
    path: &str,
    accept: Option<&str>,
) -> (u16, String, String) {
    let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
    let request = format!("GET {path} HTTP/1.0\r\nHost: kg\r\n{accept}\r\n");
    let addr = addr.to_string();
    let answer = ns
        .in_ns(move || {
            let addr: SocketAddr = addr.parse().unwrap();
            let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
            stream.set_read_timeout(Some(Duration::from_secs(10)))?;
            stream.write_all(request.as_bytes())?;
            let mut bytes = Vec::new();
            stream.read_to_end(&mut bytes)?;
            Ok::<_, std::io::Error>(bytes)
        })
        .join()
        .unwrap()
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (headers, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (status, headers.to_ascii_lowercase(), body.to_string())
}
