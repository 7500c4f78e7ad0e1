//! The TUN device's lifecycle: attaching to an existing TUN link (and leaving it on exit),
//! tolerating others changing its MTU, addresses and up/down state, as Kilo does through
//! netlink, and exiting when the link is deleted. Root only.

use crate::common;

use std::time::Duration;

use common::{kilotun_bin, ping_ok, Impl, Link, Underlay, WgDevice};

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn attaches_to_an_existing_tun_device_and_leaves_it_on_exit() {
    common::require_root("attaches_to_an_existing_tun_device_and_leaves_it_on_exit");
    let link = Link::new(Underlay::V4);
    let name = common::unique("wg");
    link.left.run(&[
        "ip",
        "tuntap",
        "add",
        "dev",
        &name,
        "mode",
        "tun",
        "multi_queue",
    ]);
    link.left.run(&["ip", "link", "set", &name, "mtu", "1380"]);
    let mut child = link
        .left
        .spawn(&[kilotun_bin(), "-f", "--threads", "2", &name]);
    let socket = format!("/var/run/wireguard/{name}.sock");
    for _ in 0..200 {
        if std::path::Path::new(&socket).exists() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        std::path::Path::new(&socket).exists(),
        "device came up on the existing link"
    );
    let shown = link.left.run(&["ip", "link", "show", &name]);
    assert!(shown.contains("mtu 1380"), "existing MTU kept: {shown}");

    let b = WgDevice::start(&link.right, Impl::WireguardGo);
    let key = format!("/tmp/{name}.key");
    std::fs::write(&key, common::run(&["wg", "genkey"])).unwrap();
    let a_pub = common::pipe_to(&["wg", "pubkey"], std::fs::read(&key).unwrap().as_slice());
    link.left.run(&[
        "wg",
        "set",
        &name,
        "private-key",
        &key,
        "listen-port",
        "51820",
        "peer",
        &b.public_key,
        "endpoint",
        "192.168.200.2:51821",
        "allowed-ips",
        "10.74.0.2/32",
    ]);
    b.configure(51821, &["10.74.0.2/24"]);
    b.wg(&[
        "set",
        &b.name,
        "peer",
        a_pub.trim(),
        "endpoint",
        "192.168.200.1:51820",
        "allowed-ips",
        "10.74.0.1/32",
    ]);
    link.left
        .run(&["ip", "addr", "add", "10.74.0.1/24", "dev", &name]);
    link.left.run(&["ip", "link", "set", &name, "up"]);
    assert!(ping_ok(
        &link.left.name,
        "10.74.0.2",
        Duration::from_secs(10)
    ));

    // SAFETY: signalling the child we spawned.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    std::fs::remove_file(&key).unwrap();
    assert!(!std::path::Path::new(&socket).exists(), "socket removed");
    assert!(
        link.left
            .output(&["ip", "link", "show", &name])
            .status
            .success(),
        "a TUN link we did not create stays"
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn survives_mtu_address_and_link_state_changes() {
    common::require_root("survives_mtu_address_and_link_state_changes");
    let (_link, mut a, b) = common::peered(Impl::Kilotun, Impl::Kilotun, 75);
    a.add_peer(&b, "192.168.200.2:51821", "10.75.0.2/32,10.76.0.0/24");
    b.add_peer(&a, "192.168.200.1:51820", "10.75.0.1/32,10.76.0.1/32");
    assert!(ping_ok(&a.ns, "10.75.0.2", Duration::from_secs(10)));

    a.ip(&["link", "set", &a.name, "mtu", "1280"]);
    assert!(
        ping_ok(&a.ns, "10.75.0.2", Duration::from_secs(5)),
        "after MTU change"
    );
    a.ip(&["link", "set", &a.name, "down"]);
    // Packets for a down link are dropped, not fatal.
    assert!(!ping_ok(&b.ns, "10.75.0.1", Duration::from_secs(2)));
    a.ip(&["link", "set", &a.name, "up"]);
    assert!(
        ping_ok(&a.ns, "10.75.0.2", Duration::from_secs(5)),
        "after down/up"
    );
    a.ip(&["addr", "del", "10.75.0.1/24", "dev", &a.name]);
    a.ip(&["addr", "add", "10.76.0.1/24", "dev", &a.name]);
    a.ip(&["route", "add", "10.75.0.0/24", "dev", &a.name]);
    b.ip(&["route", "add", "10.76.0.0/24", "dev", &b.name]);
    assert!(
        ping_ok(&b.ns, "10.76.0.1", Duration::from_secs(5)),
        "after address change"
    );
    assert!(a.is_running());
}

/// What wg-quick's `down` and wireguard-go rely on: deleting the link ends the daemon at once,
/// with status 0, its socket removed, and the name is free for the next start. The link a
/// daemon creates starts down (the caller brings it up, as with wireguard-go).
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn deleting_the_link_ends_the_daemon_within_a_second_and_the_name_starts_again() {
    common::require_root(
        "deleting_the_link_ends_the_daemon_within_a_second_and_the_name_starts_again",
    );
    let (_link, mut a, _b) = common::peered(Impl::Kilotun, Impl::Kilotun, 77);
    assert!(ping_ok(&a.ns, "10.77.0.2", Duration::from_secs(10)));
    let socket = format!("/var/run/wireguard/{}.sock", a.name);
    let deleted = std::time::Instant::now();
    a.ip(&["link", "del", &a.name]);
    let status = loop {
        if let Some(status) = a.try_wait() {
            break status;
        }
        assert!(
            deleted.elapsed() < Duration::from_secs(5),
            "kilotun still runs 5 s after its link was deleted"
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    let took = deleted.elapsed();
    println!("kilotun exited {took:?} after `ip link del` was run, with {status}");
    assert!(status.success(), "exit status {status}");
    assert!(took < Duration::from_secs(1), "{took:?}");
    assert!(!std::path::Path::new(&socket).exists(), "socket removed");

    // The same name again, at once.
    let mut again = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &a.ns,
            kilotun_bin(),
            "-f",
            "--threads",
            "2",
            &a.name,
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut started = false;
    for _ in 0..250 {
        if std::path::Path::new(&socket).exists() {
            started = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(started, "a second kilotun {} came up", a.name);
    let shown = a.ip(&["link", "show", &a.name]);
    assert!(
        !shown.contains(",UP"),
        "a link kilotun creates starts down: {shown}"
    );
    assert!(
        a.wg(&["show", &a.name]).contains(&a.name),
        "the second device answers"
    );
    // SAFETY: signalling the child we spawned and have not reaped.
    unsafe { libc::kill(again.id() as i32, libc::SIGTERM) };
    assert!(again.wait().unwrap().success(), "SIGTERM ends it with 0");
    assert!(!std::path::Path::new(&socket).exists(), "socket removed");
}

/// Context switches (voluntary and not) of every thread of process `pid` so far: each is a
/// wake-up of one of its threads.
fn context_switches(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .map(|status| {
            status
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum()
}

/// Most Kilo nodes are not leaders and have no WireGuard peer: their device must cost nothing
/// while idle. Before, its threads woke about 16 times a second (the UAPI listener every 100
/// ms, the timers every 250 ms, each worker every second). Once a peer is added, its timers
/// run: a persistent keepalive to a peer that never answers keeps sending handshake
/// initiations.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn an_idle_device_without_peers_never_wakes_and_its_first_peer_gets_timers() {
    common::require_root("an_idle_device_without_peers_never_wakes_and_its_first_peer_gets_timers");
    let ns = common::Netns::new();
    ns.run(&["ip", "link", "set", "lo", "up"]);
    let device = WgDevice::start(&ns, Impl::Kilotun);
    // A key and a port, so the sockets are bound; the link stays down, so the kernel sends it
    // nothing of its own (IPv6 router solicitations would wake a worker, rightly).
    device.wg(&[
        "set",
        &device.name,
        "private-key",
        &device.key_file,
        "listen-port",
        "51820",
    ]);
    std::thread::sleep(Duration::from_millis(500));
    let before = context_switches(device.pid());
    std::thread::sleep(Duration::from_secs(3));
    let woke = context_switches(device.pid()) - before;
    assert!(
        woke <= 3,
        "an idle kilotun with no peer woke {woke} times in 3 s"
    );

    // A peer at a loopback port nobody answers on: the keepalive starts a handshake, and the
    // timers retry it. Only the timer thread sends these.
    let peer_key = common::run(&["wg", "genkey"]);
    let peer = common::pipe_to(&["wg", "pubkey"], peer_key.as_bytes());
    device.wg(&[
        "set",
        &device.name,
        "peer",
        peer.trim(),
        "endpoint",
        "127.0.0.1:9",
        "persistent-keepalive",
        "1",
        "allowed-ips",
        "10.78.0.2/32",
    ]);
    let sent = || -> u64 {
        let transfer = device.wg(&["show", &device.name, "transfer"]);
        transfer
            .split_whitespace()
            .nth(2)
            .and_then(|tx| tx.parse().ok())
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while sent() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no handshake initiation sent 5 s after a peer with a keepalive was added"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
