//! Sticky source addresses: a kilotun host with two underlay addresses, reached by its peer at
//! the second (not the one the kernel would pick), answers from that address, as Linux's
//! WireGuard and wireguard-go do; once the address leaves the host, the link carries on from
//! the other one. Over IPv4 and IPv6, with kilotun and wireguard-go as the peer; and with two
//! addresses on each side, two kilotun hosts each answering from the address the other reached.
//! Root only; wireguard-go missing fails its tests (see `common::require_engine`).

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{ping_ok, require_engine, Impl, Link, Underlay, WgDevice};

/// kilotun's listen port (on the left) and its peer's (on the right).
const KILOTUN_PORT: u16 = 51820;
const PEER_PORT: u16 = 51821;

/// The left side's addresses: `Link`'s own (the kernel's choice of source towards the right)
/// and the second one the peer reaches, with its prefix.
fn addresses(underlay: &Underlay) -> (&'static str, &'static str, &'static str) {
    match underlay {
        // A second address in the same subnet is secondary: never the kernel's choice.
        Underlay::V4 => ("192.168.200.1", "192.168.200.11", "24"),
        // Of two addresses in one /64 the kernel prefers the newer; one in another /64 (the
        // peer routes it over the link) matches fewer leading bits of the peer's fd99::2.
        Underlay::V6 => ("fd99::1", "fd99:0:0:1::11", "64"),
    }
}

fn socket(ip: &str, port: u16) -> String {
    std::net::SocketAddr::new(ip.parse().unwrap(), port).to_string()
}

/// tcpdump on the right side's end of the link, printing kilotun's datagrams (from its port).
fn capture(link: &Link) -> Child {
    capture_on(&link.right.name, &link.right_dev, KILOTUN_PORT)
}

/// tcpdump on `dev` in namespace `ns`, printing the datagrams from UDP port `port`.
fn capture_on(ns: &str, dev: &str, port: u16) -> Child {
    Command::new("ip")
        .args(["netns", "exec", ns, "tcpdump", "-i"])
        .args([dev, "-n", "-l", "-p", &format!("udp and src port {port}")])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("tcpdump")
}

/// Stops `capture` and returns what it printed.
fn captured(mut capture: Child) -> String {
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: kill with the pid of a child we spawned and have not reaped.
    unsafe { libc::kill(capture.id() as i32, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(3);
    while capture.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = capture.kill();
    let out = capture.wait_with_output().expect("tcpdump output");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until tcpdump is capturing (it prints nothing on its own: give it a moment).
fn settle() {
    std::thread::sleep(Duration::from_millis(700));
}

/// The peer's endpoint for kilotun, as `wg show ENDPOINTS` on the right says.
fn endpoint_seen(peer: &WgDevice) -> String {
    peer.wg(&["show", &peer.name, "endpoints"])
}

/// Lines of `text` (tcpdump's) whose source is `ip` port `KILOTUN_PORT`.
fn from_address<'t>(text: &'t str, ip: &str) -> Vec<&'t str> {
    from_socket(text, ip, KILOTUN_PORT)
}

/// Lines of `text` (tcpdump's) whose source is `ip` port `port`.
fn from_socket<'t>(text: &'t str, ip: &str, port: u16) -> Vec<&'t str> {
    // tcpdump writes the port after a dot for either family: `fd99::11.51820 >`.
    let needle = format!(" {ip}.{port} >");
    text.lines().filter(|l| l.contains(&needle)).collect()
}

/// The right side's second address, with its prefix: as the left's, never the kernel's choice
/// of source towards the left.
fn right_second(underlay: &Underlay) -> (&'static str, &'static str) {
    match underlay {
        Underlay::V4 => ("192.168.200.12", "24"),
        Underlay::V6 => ("fd99:0:0:2::12", "64"),
    }
}

/// Adds `cidr` to `dev` in `ns` (without duplicate address detection for IPv6).
fn add_address(ns: &str, dev: &str, cidr: &str) {
    let mut add = vec!["ip", "-n", ns, "addr", "add", cidr, "dev", dev];
    if cidr.contains(':') {
        add.push("nodad");
    }
    common::run(&add);
}

/// Two kilotun hosts with two addresses each. The right reaches the left at its second address
/// and hears back from there only; then the left reaches the right at the right's second
/// address, and the right answers from there only, though the kernel of each would choose the
/// first towards the other.
fn sticky_source_on_both_sides(underlay: Underlay, test: &str) {
    common::require_root(test);
    common::require_tcpdump(test);
    let (left_primary, left_second, len) = addresses(&underlay);
    let (right_second, right_len) = right_second(&underlay);
    let v6 = matches!(underlay, Underlay::V6);
    let link = Link::new(underlay);
    let right_primary = link.right_ip.to_string();
    add_address(
        &link.left.name,
        &link.left_dev,
        &format!("{left_second}/{len}"),
    );
    add_address(
        &link.right.name,
        &link.right_dev,
        &format!("{right_second}/{right_len}"),
    );
    if v6 {
        let (l, r) = (&link.left_dev, &link.right_dev);
        link.right
            .run(&["ip", "route", "add", "fd99:0:0:1::/64", "dev", r]);
        link.left
            .run(&["ip", "route", "add", "fd99:0:0:2::/64", "dev", l]);
    }
    let left_route = link.left.run(&["ip", "route", "get", &right_primary]);
    assert!(
        left_route.contains(&format!("src {left_primary} ")),
        "{left_route}"
    );
    let right_route = link.right.run(&["ip", "route", "get", left_primary]);
    assert!(
        right_route.contains(&format!("src {right_primary} ")),
        "{right_route}"
    );

    let left = WgDevice::start(&link.left, Impl::Kilotun);
    let right = WgDevice::start(&link.right, Impl::Kilotun);
    left.configure(KILOTUN_PORT, &["10.72.0.1/24"]);
    right.configure(PEER_PORT, &["10.72.0.2/24"]);
    left.wg(&[
        "set",
        &left.name,
        "peer",
        &right.public_key,
        "allowed-ips",
        "10.72.0.2/32",
    ]);
    right.add_peer(&left, &socket(left_second, KILOTUN_PORT), "10.72.0.1/32");

    // The right reaches the left at its second address: the left answers from it.
    let tcpdump = capture_on(&link.right.name, &link.right_dev, KILOTUN_PORT);
    settle();
    assert!(
        ping_ok(&right.ns, "10.72.0.1", Duration::from_secs(10)),
        "{test}: right -> left"
    );
    let text = captured(tcpdump);
    assert!(
        !from_socket(&text, left_second, KILOTUN_PORT).is_empty(),
        "{test}: {text}"
    );
    let stray = from_socket(&text, left_primary, KILOTUN_PORT);
    assert!(
        stray.is_empty(),
        "{test}: the left answered from {left_primary}: {stray:?}"
    );

    // The left reaches the right at the right's second address: the right answers from it.
    let endpoint = socket(right_second, PEER_PORT);
    left.wg(&[
        "set",
        &left.name,
        "peer",
        &right.public_key,
        "endpoint",
        &endpoint,
    ]);
    let tcpdump = capture_on(&link.left.name, &link.left_dev, PEER_PORT);
    settle();
    assert!(
        ping_ok(&left.ns, "10.72.0.2", Duration::from_secs(10)),
        "{test}: left -> right"
    );
    let text = captured(tcpdump);
    assert!(
        !from_socket(&text, right_second, PEER_PORT).is_empty(),
        "{test}: {text}"
    );
    let stray = from_socket(&text, &right_primary, PEER_PORT);
    assert!(
        stray.is_empty(),
        "{test}: the right answered from {right_primary}: {stray:?}"
    );
    let seen = left.wg(&["show", &left.name, "endpoints"]);
    assert!(
        seen.contains(&endpoint),
        "{test}: the left still reaches {endpoint}: {seen}"
    );
}

fn sticky_source(peer_impl: Impl, underlay: Underlay, test: &str) {
    common::require_root(test);
    common::require_tcpdump(test);
    require_engine(peer_impl, test);
    let (primary, second, len) = addresses(&underlay);
    let link = Link::new(underlay);
    let second_cidr = format!("{second}/{len}");
    let mut add = vec![
        "ip",
        "-n",
        &link.left.name,
        "addr",
        "add",
        &second_cidr,
        "dev",
        &link.left_dev,
    ];
    if second.contains(':') {
        add.push("nodad");
    }
    common::run(&add);
    if second.contains(':') {
        link.right.run(&[
            "ip",
            "route",
            "add",
            "fd99:0:0:1::/64",
            "dev",
            &link.right_dev,
        ]);
    }
    // The kernel's own choice towards the peer is the first address: what a reply would come
    // from without sticky sources.
    let peer_ip = link.right_ip.to_string();
    let route = link.left.run(&["ip", "route", "get", &peer_ip]);
    assert!(
        route.contains(&format!("src {primary} ")),
        "the kernel's source towards {peer_ip} should be {primary}: {route}"
    );

    let kilotun = WgDevice::start(&link.left, Impl::Kilotun);
    let peer = WgDevice::start(&link.right, peer_impl);
    kilotun.configure(KILOTUN_PORT, &["10.72.0.1/24"]);
    peer.configure(PEER_PORT, &["10.72.0.2/24"]);
    // kilotun has no endpoint for its peer: it learns it (and its own address) from the
    // peer, which reaches it at the second address.
    kilotun.wg(&[
        "set",
        &kilotun.name,
        "peer",
        &peer.public_key,
        "allowed-ips",
        "10.72.0.2/32",
    ]);
    peer.add_peer(&kilotun, &socket(second, KILOTUN_PORT), "10.72.0.1/32");

    let tcpdump = capture(&link);
    settle();
    assert!(
        ping_ok(&peer.ns, "10.72.0.1", Duration::from_secs(10)),
        "{test}: ping peer -> kilotun"
    );
    assert!(
        ping_ok(&kilotun.ns, "10.72.0.2", Duration::from_secs(5)),
        "{test}: ping kilotun -> peer"
    );
    let text = captured(tcpdump);
    let seen = endpoint_seen(&peer);
    assert!(
        seen.contains(&socket(second, KILOTUN_PORT)),
        "{test}: the peer should still reach kilotun at {second}, having heard only from \
         there: {seen}\n{text}"
    );
    assert!(
        !from_address(&text, second).is_empty(),
        "{test}: nothing from {second} captured:\n{text}"
    );
    let stray = from_address(&text, primary);
    assert!(
        stray.is_empty(),
        "{test}: kilotun answered from {primary}, not {second}: {stray:?}"
    );

    // The second address leaves kilotun's host: the next send from it fails, kilotun forgets
    // it and sends from the kernel's choice; the peer roams there and the link carries on.
    common::run(&[
        "ip",
        "-n",
        &link.left.name,
        "addr",
        "del",
        &second_cidr,
        "dev",
        &link.left_dev,
    ]);
    let tcpdump = capture(&link);
    settle();
    assert!(
        ping_ok(&kilotun.ns, "10.72.0.2", Duration::from_secs(10)),
        "{test}: ping kilotun -> peer after {second} left"
    );
    assert!(
        ping_ok(&peer.ns, "10.72.0.1", Duration::from_secs(5)),
        "{test}: ping peer -> kilotun after {second} left"
    );
    let text = captured(tcpdump);
    let seen = endpoint_seen(&peer);
    assert!(
        seen.contains(&socket(primary, KILOTUN_PORT)),
        "{test}: the peer should have roamed to {primary}: {seen}\n{text}"
    );
    assert!(
        !from_address(&text, primary).is_empty(),
        "{test}: nothing from {primary} captured:\n{text}"
    );
    // kilotun is still up (a refused source is no fault).
    let mut kilotun = kilotun;
    assert!(kilotun.is_running(), "{test}: kilotun exited");
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn sticky_source_kilotun_peer_over_ipv4() {
    sticky_source(
        Impl::Kilotun,
        Underlay::V4,
        "sticky_source_kilotun_peer_over_ipv4",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn sticky_source_kilotun_peer_over_ipv6() {
    sticky_source(
        Impl::Kilotun,
        Underlay::V6,
        "sticky_source_kilotun_peer_over_ipv6",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn sticky_source_wireguard_go_peer_over_ipv4() {
    sticky_source(
        Impl::WireguardGo,
        Underlay::V4,
        "sticky_source_wireguard_go_peer_over_ipv4",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn sticky_source_wireguard_go_peer_over_ipv6() {
    sticky_source(
        Impl::WireguardGo,
        Underlay::V6,
        "sticky_source_wireguard_go_peer_over_ipv6",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn sticky_source_two_addresses_on_each_side_over_ipv4() {
    sticky_source_on_both_sides(
        Underlay::V4,
        "sticky_source_two_addresses_on_each_side_over_ipv4",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn sticky_source_two_addresses_on_each_side_over_ipv6() {
    sticky_source_on_both_sides(
        Underlay::V6,
        "sticky_source_two_addresses_on_each_side_over_ipv6",
    );
}
