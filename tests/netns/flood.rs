//! A handshake flood against a running `kilotun`: thousands of valid-looking initiations per
//! second from spoofed source addresses, sent with a raw socket from another namespace. Cookie
//! replies must engage, a real peer (wireguard-go) must still complete its handshake, and the
//! daemon's memory must stay bounded.

use crate::common;

use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{rss_kib, Impl, Link, Netns, Underlay, WgDevice};
use dataplane::key::{PublicKey, SecretKey};

/// How many distinct initiations the flooder cycles through (each from a fresh stranger key).
const INITIATIONS: usize = 512;
/// Initiations per second the flooder aims for.
const RATE: u32 = 5_000;

/// Handshake initiations a stranger who knows `responder`'s public key can make: MAC1 is valid,
/// so they pass the cheap check and reach the rate limiter.
fn initiations(responder: &PublicKey) -> Vec<Vec<u8>> {
    (0..INITIATIONS)
        .map(|_| {
            let mut stranger = boringtun::noise::Tunn::new(
                SecretKey::generate().to_dalek(),
                responder.to_dalek(),
                None,
                None,
                1,
                None,
            );
            let mut buf = [0u8; 256];
            match stranger.format_handshake_initiation(&mut buf, true) {
                boringtun::noise::TunnResult::WriteToNetwork(init) => init.to_vec(),
                _ => panic!("no initiation"),
            }
        })
        .collect()
}

/// An IPv4/UDP datagram from `source:1000` to `target:port` carrying `payload`. The kernel fills
/// the IP checksum and id; the UDP checksum is left 0 (none), which IPv4 allows.
fn spoofed_datagram(source: Ipv4Addr, target: Ipv4Addr, port: u16, payload: &[u8]) -> Vec<u8> {
    let total = 20 + 8 + payload.len();
    let mut p = Vec::with_capacity(total);
    p.extend_from_slice(&[
        0x45,
        0,
        (total >> 8) as u8,
        total as u8,
        0,
        0,
        0,
        0,
        64,
        17,
        0,
        0,
    ]);
    p.extend_from_slice(&source.octets());
    p.extend_from_slice(&target.octets());
    let udp_len = (8 + payload.len()) as u16;
    p.extend_from_slice(&1000u16.to_be_bytes());
    p.extend_from_slice(&port.to_be_bytes());
    p.extend_from_slice(&udp_len.to_be_bytes());
    p.extend_from_slice(&[0, 0]);
    p.extend_from_slice(payload);
    p
}

/// Starts flooding `target:port` from `ns` at [`RATE`] until `stop` is set, each datagram from
/// another address in 10.200.0.0/16. The thread returns how many were sent.
fn start_flood(
    ns: &Netns,
    target: Ipv4Addr,
    port: u16,
    inits: Vec<Vec<u8>>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<u64> {
    ns.in_ns(move || {
        // SAFETY: plain socket(2); the descriptor is closed below.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
        assert!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
        let address = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from(target).to_be(),
            },
            sin_zero: [0; 8],
        };
        let burst = RATE / 100;
        let mut sent = 0u64;
        let start = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            for _ in 0..burst {
                let i = sent as usize;
                let source = Ipv4Addr::new(10, 200, (i >> 8) as u8, i as u8);
                let datagram = spoofed_datagram(source, target, port, &inits[i % inits.len()]);
                // SAFETY: the buffer and address outlive the call.
                let n = unsafe {
                    libc::sendto(
                        fd,
                        datagram.as_ptr().cast(),
                        datagram.len(),
                        0,
                        (&address as *const libc::sockaddr_in).cast(),
                        std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
                    )
                };
                if n > 0 {
                    sent += 1;
                }
            }
            // Pace to RATE: burst every 10 ms on average.
            let due = start + Duration::from_millis(10 * (sent / burst as u64));
            if let Some(wait) = due.checked_duration_since(Instant::now()) {
                std::thread::sleep(wait);
            }
        }
        // SAFETY: closing the descriptor opened above.
        unsafe { libc::close(fd) };
        sent
    })
}

/// Packets the raw-table counter rule `comment` has seen in `ns`.
fn counted(ns: &Netns, comment: &str) -> u64 {
    let listing = ns.run(&[
        "iptables",
        "-t",
        "raw",
        "-L",
        "PREROUTING",
        "-v",
        "-x",
        "-n",
    ]);
    listing
        .lines()
        .find(|l| l.contains(comment))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_spoofed_handshake_flood_engages_cookies_and_a_real_peer_still_connects() {
    common::require_root(
        "a_spoofed_handshake_flood_engages_cookies_and_a_real_peer_still_connects",
    );
    let link = Link::new(Underlay::V4);
    let victim = WgDevice::start(&link.left, Impl::Kilotun);
    let real_peer = WgDevice::start(&link.right, Impl::WireguardGo);
    victim.configure(51820, &["10.31.0.1/24"]);
    real_peer.configure(51821, &["10.31.0.2/24"]);
    victim.add_peer(&real_peer, "192.168.200.2:51821", "10.31.0.2/32");
    real_peer.add_peer(&victim, "192.168.200.1:51820", "10.31.0.1/32");
    // Replies to the spoofed sources go back over the link, where the flooder's side counts
    // the cookie replies (64-byte messages: 92-byte IP packets) and drops them.
    link.left.run(&[
        "ip",
        "route",
        "add",
        "10.200.0.0/16",
        "via",
        "192.168.200.2",
    ]);
    link.right.run(&[
        "iptables",
        "-t",
        "raw",
        "-A",
        "PREROUTING",
        "-s",
        "192.168.200.1",
        "-d",
        "10.200.0.0/16",
        "-p",
        "udp",
        "--sport",
        "51820",
        "-m",
        "length",
        "--length",
        "92",
        "-m",
        "comment",
        "--comment",
        "cookie-replies",
    ]);

    let victim_key = PublicKey::parse(&victim.public_key).unwrap();
    let inits = initiations(&victim_key);
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", victim.pid())).unwrap();
    assert_eq!(comm.trim(), "kilotun", "measuring the wrong process");
    let rss_before = rss_kib(victim.pid());
    let stop = Arc::new(AtomicBool::new(false));
    let target = Ipv4Addr::new(192, 168, 200, 1);
    let flooder = start_flood(&link.right, target, 51820, inits, Arc::clone(&stop));
    std::thread::sleep(Duration::from_secs(2));

    // Mid-flood, the real peer's first initiation is answered with a cookie; it retries with
    // MAC2 after its rekey timeout (5 s) and gets through.
    let started = Instant::now();
    let connected = common::ping_ok(&link.right.name, "10.31.0.1", Duration::from_secs(20));
    let took = started.elapsed();
    std::thread::sleep(Duration::from_secs(1));
    stop.store(true, Ordering::Relaxed);
    let sent = flooder.join().unwrap();
    let cookies = counted(&link.right, "cookie-replies");
    let rss_after = rss_kib(victim.pid());
    let seconds = (took + Duration::from_secs(3)).as_secs_f64();
    eprintln!(
        "flood: {sent} initiations in about {seconds:.0} s ({:.0}/s), {cookies} cookie replies; \
         the real peer connected after {took:?}; RSS {rss_before} KiB -> {rss_after} KiB",
        sent as f64 / seconds
    );

    assert!(connected, "the real peer never got through the flood");
    assert!(
        sent as f64 / seconds > 2_000.0,
        "the flood was too thin to mean anything: {sent} in {seconds:.0} s"
    );
    assert!(
        cookies > sent / 2,
        "cookie replies did not engage: {cookies} for {sent} initiations"
    );
    assert!(
        rss_after < rss_before + 16 * 1024,
        "memory grew from {rss_before} KiB to {rss_after} KiB under the flood"
    );
    // The daemon is still fine afterwards.
    let mut victim = victim;
    assert!(victim.is_running(), "kilotun died under the flood");
    assert!(common::ping_ok(
        &link.right.name,
        "10.31.0.1",
        Duration::from_secs(5)
    ));
}
