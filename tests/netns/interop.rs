//! kilotun against itself, against Debian bookworm's wireguard-go (0.0.20220316), and against the
//! engines users pick today: wireguard-go 0.0.20231211 (bookworm-backports), wireguard-go
//! 0.0.20260522 (sid, the newest release) and gotatun 0.10.2, fetched by `scripts/engines.sh`. Each end in its own network namespace over veth: pings and a
//! checked 100 MB TCP transfer each way, IPv4 and IPv6 inside the tunnel, over an IPv4 or an IPv6
//! underlay. Root only (skipped otherwise); an engine that is not installed skips its tests, or
//! fails them when `CI` is set.

use crate::common;

use std::time::Duration;

use common::{ping_ok, require_engine, tcp_transfer, Impl, Link, Underlay, WgDevice};

const TRANSFER: u64 = 100 * 1024 * 1024;

fn interop(left: Impl, right: Impl, underlay: Underlay, test: &str) {
    common::require_root(test);
    require_engine(left, test);
    require_engine(right, test);
    let link = Link::new(underlay);
    let a = WgDevice::start(&link.left, left);
    let b = WgDevice::start(&link.right, right);
    a.configure(51820, &["10.70.0.1/24", "fd70::1/64"]);
    b.configure(51821, &["10.70.0.2/24", "fd70::2/64"]);
    let endpoint =
        |ip: std::net::IpAddr, port: u16| std::net::SocketAddr::new(ip, port).to_string();
    a.add_peer(
        &b,
        &endpoint(link.right_ip, 51821),
        "10.70.0.2/32,fd70::2/128",
    );
    b.add_peer(
        &a,
        &endpoint(link.left_ip, 51820),
        "10.70.0.1/32,fd70::1/128",
    );

    assert!(
        ping_ok(&a.ns, "10.70.0.2", Duration::from_secs(10)),
        "IPv4 ping a -> b"
    );
    assert!(
        ping_ok(&b.ns, "10.70.0.1", Duration::from_secs(5)),
        "IPv4 ping b -> a"
    );
    assert!(
        ping_ok(&a.ns, "fd70::2", Duration::from_secs(5)),
        "IPv6 ping a -> b"
    );
    assert!(
        ping_ok(&b.ns, "fd70::1", Duration::from_secs(5)),
        "IPv6 ping b -> a"
    );

    // kilotun opens its TUN with the virtio-net header (segmentation offload) on this kernel,
    // so the transfers below go through its split and coalesce paths; and with a 5,000-packet
    // transmit queue.
    // `--no-offload` (the path of kernels without offload) opens it without the header.
    for (side, which, device) in [("left", left, &a), ("right", right, &b)] {
        let header = match which {
            Impl::Kilotun => "vnet_hdr on",
            Impl::KilotunWithoutOffload => "vnet_hdr off",
            Impl::WireguardGo
            | Impl::WireguardGo2023
            | Impl::WireguardGo2026
            | Impl::Gotatun
            | Impl::ForeignKilotun => continue,
        };
        let details = device.ip(&["-d", "link", "show", &device.name]);
        assert!(details.contains(header), "{side}: {details}");
        assert!(details.contains("qlen 5000"), "{side}: {details}");
    }
    let took = tcp_transfer(
        &link.left,
        &link.right,
        "10.70.0.2".parse().unwrap(),
        TRANSFER,
    );
    eprintln!("{test}: 100 MB a -> b over IPv4 in {took:?}");
    let took = tcp_transfer(
        &link.right,
        &link.left,
        "fd70::1".parse().unwrap(),
        TRANSFER,
    );
    eprintln!("{test}: 100 MB b -> a over IPv6 in {took:?}");
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kilotun_with_kilotun_over_ipv4() {
    interop(
        Impl::Kilotun,
        Impl::Kilotun,
        Underlay::V4,
        "kilotun_with_kilotun_over_ipv4",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kilotun_with_kilotun_over_ipv6() {
    interop(
        Impl::Kilotun,
        Impl::Kilotun,
        Underlay::V6,
        "kilotun_with_kilotun_over_ipv6",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kilotun_without_offload_with_kilotun_with_offload() {
    interop(
        Impl::KilotunWithoutOffload,
        Impl::Kilotun,
        Underlay::V4,
        "kilotun_without_offload_with_kilotun_with_offload",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kilotun_with_wireguard_go_over_ipv4() {
    interop(
        Impl::Kilotun,
        Impl::WireguardGo,
        Underlay::V4,
        "kilotun_with_wireguard_go_over_ipv4",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kilotun_with_wireguard_go_over_ipv6() {
    interop(
        Impl::Kilotun,
        Impl::WireguardGo,
        Underlay::V6,
        "kilotun_with_wireguard_go_over_ipv6",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kilotun_with_wireguard_go_2023_over_ipv4() {
    interop(
        Impl::Kilotun,
        Impl::WireguardGo2023,
        Underlay::V4,
        "kilotun_with_wireguard_go_2023_over_ipv4",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kilotun_with_wireguard_go_2023_over_ipv6() {
    interop(
        Impl::Kilotun,
        Impl::WireguardGo2023,
        Underlay::V6,
        "kilotun_with_wireguard_go_2023_over_ipv6",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kilotun_with_wireguard_go_2026_over_ipv4() {
    interop(
        Impl::Kilotun,
        Impl::WireguardGo2026,
        Underlay::V4,
        "kilotun_with_wireguard_go_2026_over_ipv4",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kilotun_with_gotatun_over_ipv4() {
    interop(
        Impl::Kilotun,
        Impl::Gotatun,
        Underlay::V4,
        "kilotun_with_gotatun_over_ipv4",
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn kilotun_with_gotatun_over_ipv6() {
    interop(
        Impl::Kilotun,
        Impl::Gotatun,
        Underlay::V6,
        "kilotun_with_gotatun_over_ipv6",
    );
}
