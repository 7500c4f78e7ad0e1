//! kilotun cross-built for another architecture (`scripts/cross-build.sh`: aarch64 or armv7),
//! run by qemu-user through binfmt_misc in one network namespace, against this machine's own
//! kilotun and against Debian's wireguard-go in another, configured with `wg`: handshake, pings
//! both ways over IPv4 and IPv6, a checked TCP transfer each way, the byte counters `wg show`
//! reads from the foreign engine, then `wg set` reconfiguring it (listen port, peer removed and
//! added back, allowed IPs narrowed and widened).
//!
//! The foreign binary is named by `KILOTUN_CROSS_KILOTUN` (for example
//! `target/aarch64-unknown-linux-gnu/release/kilotun`; `.ci/run` builds the arm64 one and sets
//! it); without it the tests are skipped with a message, except under CI, where they fail. Set
//! but unusable (missing, not ARM, no binfmt_misc entry, no sysroot) the tests fail. Root only,
//! like the other netns tests.

use crate::common;

use std::time::Duration;

use common::{foreign_kilotun, ping_ok, tcp_transfer, Impl, Link, Underlay, WgDevice};

/// Bytes each way: qemu-user emulates the foreign engine's crypto at a few tens of MB/s.
const TRANSFER: u64 = 16 * 1024 * 1024;

/// `wg show NAME transfer` of the one peer: (received, sent) bytes.
fn transfer(device: &WgDevice) -> (u64, u64) {
    let out = device.wg(&["show", &device.name, "transfer"]);
    let fields: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(fields.len(), 3, "one peer: {out}");
    (fields[1].parse().unwrap(), fields[2].parse().unwrap())
}

/// `wg show NAME latest-handshakes` of the one peer, in seconds since the epoch.
fn latest_handshake(device: &WgDevice) -> u64 {
    let out = device.wg(&["show", &device.name, "latest-handshakes"]);
    out.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn cross(right: Impl, test: &str) {
    common::require_root(test);
    common::require_engine(Impl::ForeignKilotun, test);
    common::require_engine(right, test);
    let foreign = foreign_kilotun().unwrap().unwrap();
    let link = Link::new(Underlay::V4);
    let a = WgDevice::start(&link.left, Impl::ForeignKilotun);
    // `ip netns exec` execs the binary in place; binfmt_misc makes qemu-user its executable.
    let exe = std::fs::read_link(format!("/proc/{}/exe", a.pid())).unwrap();
    eprintln!(
        "{test}: {} ({}) runs as {} with QEMU_LD_PREFIX={}",
        foreign.bin,
        foreign.arch,
        exe.display(),
        foreign.ld_prefix
    );
    assert!(
        exe.to_string_lossy().contains("qemu"),
        "the foreign kilotun is not run by qemu-user: {}",
        exe.display()
    );
    let b = WgDevice::start(&link.right, right);
    a.configure(51820, &["10.71.0.1/24", "fd71::1/64"]);
    b.configure(51821, &["10.71.0.2/24", "fd71::2/64"]);
    // Whether the foreign engine got TUN offload (vnet_hdr) through qemu-user, for the log.
    let details = a.ip(&["-d", "link", "show", &a.name]);
    eprintln!(
        "{test}: foreign TUN with vnet_hdr {}",
        if details.contains("vnet_hdr on") {
            "on"
        } else {
            "off"
        }
    );
    a.add_peer(&b, "192.168.200.2:51821", "10.71.0.2/32,fd71::2/128");
    b.add_peer(&a, "192.168.200.1:51820", "10.71.0.1/32,fd71::1/128");

    for (from, to, timeout) in [
        (&a, "10.71.0.2", 20),
        (&b, "10.71.0.1", 5),
        (&a, "fd71::2", 5),
        (&b, "fd71::1", 5),
    ] {
        assert!(
            ping_ok(&from.ns, to, Duration::from_secs(timeout)),
            "ping {} -> {to}",
            from.name
        );
    }
    assert!(latest_handshake(&a) > 0, "the foreign side saw a handshake");
    assert!(latest_handshake(&b) > 0, "this side saw a handshake");

    let (rx0, tx0) = transfer(&a);
    let took = tcp_transfer(
        &link.left,
        &link.right,
        "10.71.0.2".parse().unwrap(),
        TRANSFER,
    );
    eprintln!("{test}: {TRANSFER} bytes foreign -> {right:?} over IPv4 in {took:?}");
    let took = tcp_transfer(
        &link.right,
        &link.left,
        "fd71::1".parse().unwrap(),
        TRANSFER,
    );
    eprintln!("{test}: {TRANSFER} bytes {right:?} -> foreign over IPv6 in {took:?}");
    // The foreign engine's counters (u64 on every architecture) saw both transfers.
    let (rx, tx) = transfer(&a);
    assert!(
        rx - rx0 >= TRANSFER && tx - tx0 >= TRANSFER,
        "foreign counters: received {rx0} -> {rx}, sent {tx0} -> {tx}"
    );
    let (b_rx, b_tx) = transfer(&b);
    assert!(b_rx >= TRANSFER && b_tx >= TRANSFER, "{b_rx} {b_tx}");

    // Reconfigured with `wg set`: a new listen port, the peer following it.
    a.wg(&["set", &a.name, "listen-port", "51830"]);
    assert_eq!(a.wg(&["show", &a.name, "listen-port"]).trim(), "51830");
    b.wg(&[
        "set",
        &b.name,
        "peer",
        &a.public_key,
        "endpoint",
        "192.168.200.1:51830",
    ]);
    assert!(
        ping_ok(&b.ns, "10.71.0.1", Duration::from_secs(10)),
        "ping to the foreign side at its new port"
    );
    assert!(
        ping_ok(&a.ns, "10.71.0.2", Duration::from_secs(5)),
        "ping from the foreign side after the port change"
    );
    // The peer removed: nothing gets through; added back: traffic again.
    a.wg(&["set", &a.name, "peer", &b.public_key, "remove"]);
    assert_eq!(a.wg(&["show", &a.name, "peers"]).trim(), "");
    assert!(
        !ping_ok(&a.ns, "10.71.0.2", Duration::from_secs(2)),
        "no peer, no traffic"
    );
    a.add_peer(&b, "192.168.200.2:51821", "10.71.0.2/32");
    assert!(
        ping_ok(&a.ns, "10.71.0.2", Duration::from_secs(10)),
        "ping after the peer came back"
    );
    // Allowed IPs narrowed to IPv4 (IPv6 dropped), then widened again.
    assert!(
        !ping_ok(&a.ns, "fd71::2", Duration::from_secs(2)),
        "fd71::2/128 is no longer an allowed IP"
    );
    a.wg(&[
        "set",
        &a.name,
        "peer",
        &b.public_key,
        "allowed-ips",
        "10.71.0.2/32,fd71::2/128",
    ]);
    assert!(
        ping_ok(&a.ns, "fd71::2", Duration::from_secs(5)),
        "IPv6 ping once allowed again"
    );
    assert!(
        ping_ok(&b.ns, "fd71::1", Duration::from_secs(5)),
        "IPv6 ping back"
    );
    let dump = a.wg(&["show", &a.name, "dump"]);
    assert!(dump.contains("10.71.0.2/32,fd71::2/128"), "{dump}");
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn foreign_kilotun_with_this_machines_kilotun() {
    cross(Impl::Kilotun, "foreign_kilotun_with_this_machines_kilotun");
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn foreign_kilotun_with_wireguard_go() {
    cross(Impl::WireguardGo, "foreign_kilotun_with_wireguard_go");
}
