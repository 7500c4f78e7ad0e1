//! Bad input never takes the daemon down: malformed UAPI requests, random datagrams at the
//! listen port, and clear one-line errors for impossible starts. Root only.

use crate::common;

use std::io::{Read, Write};
use std::net::UdpSocket;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use common::{kilotun_bin, ping_ok, Impl, Netns, WgDevice};
use dataplane::testing::pseudo_random_bytes;

fn uapi(name: &str, request: &[u8]) -> String {
    let mut s = UnixStream::connect(format!("/var/run/wireguard/{name}.sock")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(request).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut reply = String::new();
    let _ = s.read_to_string(&mut reply);
    reply
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn malformed_uapi_and_random_datagrams_leave_the_daemon_working() {
    common::require_root("malformed_uapi_and_random_datagrams_leave_the_daemon_working");
    let (link, mut a, _b) = common::peered(Impl::Kilotun, Impl::Kilotun, 72);
    let before = a.wg(&["showconf", &a.name]);

    let requests: Vec<Vec<u8>> = vec![
        b"set=1\nlisten_port=99999\n\n".to_vec(),
        b"set=1\nprivate_key=nothex\n\n".to_vec(),
        b"set=1\npublic_key=00\n\n".to_vec(),
        b"set=1\nreplace_peers=true\nallowed_ip=10.0.0.0/8\n\n".to_vec(),
        b"set=1\nfwmark\n\n".to_vec(),
        [b"set=1\n".as_slice(), &vec![b'x'; 100_000], b"\n\n"].concat(),
        vec![0xff, 0xfe, 0x00, b'\n', b'\n'],
        b"get=1\ngarbage\n".to_vec(),
    ];
    for request in &requests {
        let reply = uapi(&a.name, request);
        assert!(
            reply.starts_with("errno=-") || reply.contains("\nerrno=-"),
            "request {:?} got {reply:?}",
            String::from_utf8_lossy(&request[..request.len().min(40)])
        );
    }
    assert_eq!(
        a.wg(&["showconf", &a.name]),
        before,
        "refused requests changed nothing"
    );

    // Thousands of random datagrams at the listen port, every WireGuard type and size.
    let sender = link.right.in_ns(|| {
        let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for i in 0..20_000usize {
            let len = [0, 1, 4, 32, 64, 92, 148, 200, 1400][i % 9] + (i % 3);
            let mut bytes = pseudo_random_bytes(&mut state, len);
            if len >= 4 {
                bytes[..4].copy_from_slice(&[(i % 5) as u8, 0, 0, 0]);
            }
            let _ = socket.send_to(&bytes, "192.168.200.1:51820");
        }
    });
    sender.join().unwrap();
    assert!(a.is_running(), "daemon survived");
    assert!(
        ping_ok(&a.ns, "10.72.0.2", Duration::from_secs(10)),
        "tunnel still works"
    );
    assert_eq!(
        a.wg(&["showconf", &a.name]).lines().count(),
        before.lines().count()
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn impossible_starts_fail_with_one_clear_line() {
    common::require_root("impossible_starts_fail_with_one_clear_line");
    let ns = Netns::new();
    // A bridge (not a TUN device) already holds the name.
    let taken = common::unique("br");
    ns.run(&["ip", "link", "add", &taken, "type", "bridge"]);
    let out = ns.output(&[kilotun_bin(), &taken]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("exists and is not a TUN device"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        !std::path::Path::new(&format!("/var/run/wireguard/{taken}.sock")).exists(),
        "no socket left behind"
    );

    // A live device already serves the name (its socket is in use).
    let other = Netns::new();
    let live = WgDevice::start(&ns, Impl::Kilotun);
    let out = other.output(&[kilotun_bin(), &live.name]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another running process"), "{err}");

    let out = ns.output(&[kilotun_bin(), "--threads", "0", "kz0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--threads"));

    if common::which("setpriv") {
        let out = ns.output(&[
            "setpriv",
            "--inh-caps=-net_admin",
            "--bounding-set=-net_admin",
            kilotun_bin(),
            "kz1",
        ]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("needs CAP_NET_ADMIN"), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }

    let out = ns.output(&[kilotun_bin(), "this-name-is-far-too-long"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid interface name"));

    // The container runtime's device rules leave /dev/net/tun out (runc 1.2.0 to 1.2.3, crun
    // of 2022 to 2025): the same devices-cgroup rule, on this host's cgroup v1 controller.
    let denied = "/dev/net/tun exists but opening it is denied";
    let dir = std::env::temp_dir().join(common::unique("kg-tun-denied"));
    std::fs::create_dir_all(&dir).unwrap();
    let kg_args = [
        common::cluster::kg_bin().to_string(),
        "--backend=file".into(),
        format!("--cluster-dir={}", dir.display()),
        "--hostname=n1".into(),
        "--interface=kz2".into(),
        format!("--key-file={}", dir.join("key").display()),
        format!("--socket-dir={}", dir.display()),
    ];
    let kg_args: Vec<&str> = kg_args.iter().map(String::as_str).collect();
    match with_tun_denied(&ns, &[kilotun_bin(), "kz2"]) {
        Some(out) => {
            assert!(!out.status.success());
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(denied) && err.contains("runc 1.2.0"), "{err}");
            assert_eq!(err.trim().lines().count(), 1, "{err}");
            let out = with_tun_denied(&ns, &kg_args).unwrap();
            assert!(!out.status.success());
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(err.contains(denied), "{err}");
            assert!(!err.contains("CAP_NET_ADMIN"), "{err}");
            // Beside a kg that runs the engine (the lock it holds, held here by flock(1)), a
            // kg that could not run it after that one does not stand by (a surge rollout's new
            // pod would answer /health and get the running one stopped): it fails at once.
            let lock = dir.join("kz2.lock");
            std::fs::write(&lock, "").unwrap();
            let mut holder = std::process::Command::new("flock")
                .arg(&lock)
                .args(["sleep", "60"])
                .spawn()
                .unwrap();
            std::thread::sleep(Duration::from_millis(300));
            let mut bounded = vec!["timeout", "20"];
            bounded.extend_from_slice(&kg_args);
            let out = with_tun_denied(&ns, &bounded).unwrap();
            let _ = holder.kill();
            let _ = holder.wait();
            let err = String::from_utf8_lossy(&out.stderr);
            assert_ne!(out.status.code(), Some(124), "it stood by: {err}");
            assert!(!out.status.success(), "{err}");
            assert!(
                err.contains("not standing by") && err.contains(denied),
                "{err}"
            );
        }
        None => eprintln!(
            "impossible_starts_fail_with_one_clear_line: no cgroup v1 devices controller here; the denied /dev/net/tun case is not run"
        ),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `args` in `ns` inside a new cgroup whose device rules deny `/dev/net/tun` (character
/// device 10:200), as a container runtime's do; `None` without a cgroup v1 devices controller.
fn with_tun_denied(ns: &Netns, args: &[&str]) -> Option<std::process::Output> {
    let root = std::path::Path::new("/sys/fs/cgroup/devices");
    if !root.join("devices.deny").exists() {
        return None;
    }
    let cgroup = root.join(common::unique("kilotun-tun-denied"));
    std::fs::create_dir(&cgroup).unwrap();
    std::fs::write(cgroup.join("devices.deny"), "c 10:200 rwm").unwrap();
    let procs = cgroup.join("cgroup.procs");
    // Joined before `ip netns exec`, which mounts a sysfs of its own over /sys.
    let script = format!("echo $$ > {} && exec \"$@\"", procs.display());
    let out = std::process::Command::new("sh")
        .args(["-c", &script, "sh", "ip", "netns", "exec", &ns.name])
        .args(args)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir(&cgroup);
    Some(out)
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn detached_start_returns_once_up_and_sigterm_removes_everything() {
    common::require_root("detached_start_returns_once_up_and_sigterm_removes_everything");
    let ns = Netns::new();
    let name = common::unique("wg");
    let out = ns.output(&[kilotun_bin(), &name]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let socket = format!("/var/run/wireguard/{name}.sock");
    assert!(
        std::path::Path::new(&socket).exists(),
        "socket exists when the parent returns"
    );
    let mode = std::fs::metadata(&socket).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o600
    );
    assert!(ns.run(&["ip", "link", "show", &name]).contains(&name));
    // Root only: an unprivileged user cannot talk to the device.
    if common::which("setpriv") {
        let out = common::output(&[
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "wg",
            "show",
            &name,
        ]);
        assert!(!out.status.success(), "nobody reached the UAPI socket");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("ermission denied") || stderr.contains("Unable to access"),
            "{stderr}"
        );
    }
    let pid = common::run(&["pgrep", "-f", &format!("kilotun {name} --foreground")]);
    let pid: i32 = pid.lines().next().unwrap().trim().parse().unwrap();
    // SAFETY: signalling the daemon we started.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::path::Path::new(&socket).exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!std::path::Path::new(&socket).exists(), "socket removed");
    // The link goes when the daemon's last TUN queue closes; the kernel unregisters it in the
    // background, which a machine busy tearing down other namespaces can take a while to do.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let link_exists = || ns.output(&["ip", "link", "show", &name]).status.success();
    while link_exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!link_exists(), "interface removed");
}

/// Malformed annotations on Nodes and malformed Peers in a running cluster: each is one log
/// line naming the object, the annotation or field, and the value, logged once however many
/// reconciles see it; the mesh keeps working.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn malformed_nodes_and_peers_are_each_logged_once_and_the_mesh_keeps_working() {
    common::require_root(
        "malformed_nodes_and_peers_are_each_logged_once_and_the_mesh_keeps_working",
    );
    let c = common::cluster::Cluster::meshed_east_west(&["--encapsulate=never"]);
    let long = "7".repeat(20_000);
    let bad_annotations: Vec<(&str, String)> = vec![
        ("kilo.squat.ai/endpoint", "192.168.10.99:70000".into()),
        ("kilo.squat.ai/force-endpoint", "[::1:51820".into()),
        ("kilo.squat.ai/internal-ip", "10.0.0.300/24".into()),
        ("kilo.squat.ai/wireguard-ip", "10.4.0.9".into()),
        ("kilo.squat.ai/persistent-keepalive", "soon".into()),
        ("kilo.squat.ai/persistent-keepalive", "65536".into()),
        ("kilo.squat.ai/key", "not-a-key".into()),
        ("kilo.squat.ai/key", "ключ".into()),
        (
            "kilo.squat.ai/allowed-location-ips",
            "10.9.0.0/33,zzz".into(),
        ),
        ("kilo.squat.ai/last-seen", "yesterday".into()),
        ("kilo.squat.ai/granularity", "sometimes".into()),
        ("kilo.squat.ai/discovered-endpoints", "{nope".into()),
        ("kilo.squat.ai/persistent-keepalive", long.clone()),
    ];
    // Each bad node is otherwise complete but has never checked in, so it is not ready and
    // the mesh's shape does not change.
    for (i, (annotation, value)) in bad_annotations.iter().enumerate() {
        let yaml = format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: bad-{i}\n  annotations:\n    \
             kilo.squat.ai/location: east\n    kilo.squat.ai/endpoint: \"192.168.10.99:51820\"\n    \
             kilo.squat.ai/key: a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n    {annotation}: {value:?}\n\
             spec:\n  podCIDR: 10.42.{}.0/24\n",
            100 + i
        );
        std::fs::write(c.dir.join(format!("bad-{i}.yaml")), yaml).unwrap();
    }
    let key = "a2V5MgAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    let bad_peers: Vec<(&str, String, &str)> = vec![
        ("allowed", format!("allowedIPs: [\"10.5.0.1\"]\n  publicKey: {key}"), "allowedIPs: \"10.5.0.1\""),
        ("key", "allowedIPs: [\"10.5.0.2/32\"]\n  publicKey: garbage".into(), "publicKey: \"garbage\""),
        ("port", format!("allowedIPs: [\"10.5.0.3/32\"]\n  publicKey: {key}\n  endpoint:\n    dnsOrIP:\n      ip: 192.168.10.98\n    port: 70000"), "endpoint.port: 70000"),
        ("dns", format!("allowedIPs: [\"10.5.0.4/32\"]\n  publicKey: {key}\n  endpoint:\n    dnsOrIP:\n      dns: \"bücher_\"\n    port: 51820"), "endpoint.dnsOrIP.dns: \"bücher_\""),
        ("keepalive", format!("allowedIPs: [\"10.5.0.5/32\"]\n  publicKey: {key}\n  persistentKeepalive: -5"), "persistentKeepalive: -5"),
        ("ipv6", format!("allowedIPs: [\"fd00::6/128\", \"fd00::zz/64\"]\n  publicKey: {key}"), "allowedIPs: \"fd00::zz/64\""),
        ("prefix", format!("allowedIPs: [\"fd00::/200\"]\n  publicKey: {key}"), "allowedIPs: \"fd00::/200\""),
    ];
    for (name, spec, _) in &bad_peers {
        let yaml = format!(
            "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: bad-{name}\nspec:\n  {spec}\n"
        );
        std::fs::write(c.dir.join(format!("peer-bad-{name}.yaml")), yaml).unwrap();
    }

    let node_line = |i: usize, annotation: &str, value: &str| {
        let shown: String = format!("{value:?}").chars().take(40).collect();
        format!("bad-{i}: {annotation}={shown}")
    };
    let peer_line = |name: &str, field: &str| format!("bad Peer bad-{name}: {field}");
    let all_logged = |c: &common::cluster::Cluster| {
        let log = c.node("n1").log_text();
        bad_annotations
            .iter()
            .enumerate()
            .all(|(i, (a, v))| log.contains(&node_line(i, a, v)))
            && bad_peers
                .iter()
                .all(|(name, _, field)| log.contains(&peer_line(name, field)))
    };
    let logged = c.wait_for(Duration::from_secs(15), all_logged);
    assert!(logged, "{}", c.node("n1").log_text());
    // Several resyncs (2 s each) later, still one line each.
    std::thread::sleep(Duration::from_secs(7));
    let log = c.node("n1").log_text();
    for (i, (annotation, value)) in bad_annotations.iter().enumerate() {
        let line = node_line(i, annotation, value);
        assert_eq!(log.matches(&line).count(), 1, "{line}");
    }
    for (name, _, field) in &bad_peers {
        let line = peer_line(name, field);
        assert_eq!(log.matches(&line).count(), 1, "{line}");
    }
    for line in log.lines().filter(|l| l.contains(" bad-")) {
        eprintln!("{line}");
    }
    let longest = log.lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 2_000, "a log line of {longest} bytes");
    assert!(!log.contains(&long), "the over-long value was logged whole");

    assert_eq!(c.all_pods_reachable(), Ok(()), "{}", c.logs());
    assert_eq!(
        c.node("n1").wg("peers").lines().count(),
        1,
        "n1 peers with n3 only"
    );
}
