//! Real UDP sockets on loopback: batches, GSO runs and their fallback, GRO splitting.

use super::*;
use crate::endpoint::LocalAddr;
use crate::outbox::Outbox;
use std::os::fd::FromRawFd;

/// Receives until `want` datagrams arrived (or 2 s passed); returns them and how many
/// receive slots they took.
fn receive(socket: &UdpSocketIo, want: usize) -> (Vec<(SocketAddr, Vec<u8>)>, usize) {
    let mut batch = RecvBatch::new(64, 65536);
    let mut got = Vec::new();
    let mut slots = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while got.len() < want && std::time::Instant::now() < deadline {
        match socket.recv_batch(&mut batch) {
            Ok(_) => {
                let used: std::collections::BTreeSet<usize> = batch
                    .datagrams
                    .iter()
                    .map(|(range, _)| range.start / batch.slot_size)
                    .collect();
                slots += used.len();
                got.extend(batch.iter().map(|(src, p)| (src, p.to_vec())));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(e) => panic!("{e}"),
        }
    }
    (got, slots)
}

/// Two loopback sockets and the second's address, or `None` (said) where the kernel has no GSO.
fn gso_pair() -> Option<(UdpSocketIo, UdpSocketIo, SocketAddr)> {
    let a = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    let b = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    if !a.uses_gso() {
        eprintln!("skipped: this kernel has no UDP GSO");
        return None;
    }
    let to_b = SocketAddr::from(([127, 0, 0, 1], b.local_port().unwrap()));
    Some((a, b, to_b))
}

/// `count` datagrams of `size` bytes to `to`, the i-th filled with byte i.
fn numbered(to: SocketAddr, count: u8, size: usize) -> Outbox {
    let mut out = Outbox::default();
    for i in 0..count {
        out.to_network.push_copy(Some(to.into()), &vec![i; size]);
    }
    out
}

#[test]
fn runs_to_one_destination_go_out_segmented_and_come_back_split() {
    let Some((a, b, to_b)) = gso_pair() else {
        return;
    };
    // 20 full-size datagrams and a short last one: one GSO message.
    let mut out = numbered(to_b, 20, 1200);
    out.to_network.push_copy(Some(to_b.into()), &[99; 300]);
    let outcome = a.send_batch(&out.to_network).unwrap();
    assert_eq!(
        outcome,
        SendOutcome {
            sent: 21,
            ..SendOutcome::default()
        }
    );
    assert!(a.uses_gso(), "loopback accepts segmented sends");
    let (got, slots) = receive(&b, 21);
    assert_eq!(
        got.len(),
        21,
        "every datagram arrives, split at its boundary"
    );
    for (i, (_, payload)) in got.iter().take(20).enumerate() {
        assert_eq!(payload, &vec![i as u8; 1200]);
    }
    assert_eq!(got[20].1, vec![99u8; 300]);
    assert!(
        slots < 21,
        "the receiver got them coalesced (GRO) in {slots} receives"
    );
}

#[test]
fn a_run_breaks_at_a_new_destination_size_or_the_segment_limit() {
    let x: SocketAddr = "10.0.0.1:1".parse().unwrap();
    let y: SocketAddr = "10.0.0.2:1".parse().unwrap();
    let big = [0u8; 1000];
    let small = [0u8; 500];
    let mut run = SendRun::new();
    for (to, packet) in [
        (x, &big[..]),
        (x, &big[..]),
        (x, &small[..]), // shorter: joins, then closes the message
        (x, &big[..]),   // new message
        (y, &big[..]),   // new destination
        (y, &small[..]),
    ] {
        run.push(to, None, packet, true);
    }
    let shape: Vec<(usize, u16)> = run.message[..run.messages]
        .iter()
        .map(|m| (m.iovecs, m.segment))
        .collect();
    assert_eq!(shape, vec![(3, 1000), (1, 1000), (2, 1000)]);

    // A new source breaks a run too: one GSO message never mixes sources.
    let source = Some(LocalAddr::new(std::net::IpAddr::from([10, 0, 0, 9])));
    let mut run = SendRun::new();
    for from in [None, None, source, source, None] {
        run.push(x, from, &big, true);
    }
    let shape: Vec<usize> = run.message[..run.messages]
        .iter()
        .map(|m| m.iovecs)
        .collect();
    assert_eq!(shape, vec![2, 2, 1]);

    let mut run = SendRun::new();
    for _ in 0..MAX_SEGMENTS + 1 {
        run.push(x, None, &small, true);
    }
    assert_eq!(
        run.messages, 2,
        "at most {MAX_SEGMENTS} segments per message"
    );
    let mut run = SendRun::new();
    for _ in 0..3 {
        run.push(x, None, &big, false);
    }
    assert_eq!(run.messages, 3, "without GSO every datagram is a message");
}

#[test]
fn without_gso_every_datagram_still_arrives() {
    let a = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    a.disable_gso();
    let b = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    let to_b = SocketAddr::from(([127, 0, 0, 1], b.local_port().unwrap()));
    let mut out = Outbox::default();
    for i in 0..30u8 {
        out.to_network.push_copy(Some(to_b.into()), &[i; 800]);
    }
    assert_eq!(a.send_batch(&out.to_network).unwrap().sent, 30);
    let (got, _) = receive(&b, 30);
    assert_eq!(got.len(), 30);
    assert!(got
        .iter()
        .enumerate()
        .all(|(i, (_, p))| p == &vec![i as u8; 800]));
}

#[test]
fn loopback_batch_round_trip() {
    let a = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    let b = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    let to_b = SocketAddr::from(([127, 0, 0, 1], b.local_port().unwrap()));
    let mut out = Outbox::default();
    for i in 0..10u8 {
        out.to_network.push_copy(Some(to_b.into()), &[i; 100]);
    }
    // A datagram of the other family is skipped, not an error.
    out.to_network.push_copy(
        Some("[::1]:9".parse::<SocketAddr>().unwrap().into()),
        b"skipped",
    );
    let outcome = a.send_batch(&out.to_network).unwrap();
    assert_eq!(
        outcome,
        SendOutcome {
            sent: 10,
            ..SendOutcome::default()
        }
    );
    let mut batch = RecvBatch::new(32, 2048);
    let mut got = Vec::new();
    for _ in 0..100 {
        match b.recv_batch(&mut batch) {
            Ok(_) => got.extend(batch.iter().map(|(src, p)| (src, p.to_vec()))),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if got.len() == 10 {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(got.len(), 10);
    assert_eq!(got[3].1, vec![3u8; 100]);
    assert_eq!(got[0].0.port(), a.local_port().unwrap());
}

#[test]
#[ignore = "needs root: a network namespace with a smaller loopback MTU"]
fn a_segment_above_the_path_mtu_goes_out_unsegmented_and_gso_stays_on() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    assert!(
        root,
        "a network namespace with a smaller loopback MTU needs root"
    );
    // A namespace of this thread's own, whose loopback's MTU (1,300) is below the segments
    // sent: the kernel refuses the segmented message with EMSGSIZE.
    std::thread::spawn(|| {
        // SAFETY: unshare on this thread only, which then exits.
        assert_eq!(unsafe { libc::unshare(libc::CLONE_NEWNET) }, 0);
        loopback_up_with_mtu(1300).expect("setting the namespace's loopback MTU and bringing it up");
        let Some((a, b, to_b)) = gso_pair() else {
            return;
        };
        let outcome = a.send_batch(&numbered(to_b, 8, 1400).to_network).unwrap();
        assert_eq!(
            outcome,
            SendOutcome {
                sent: 8,
                ..SendOutcome::default()
            },
            "each datagram went out alone (fragmented by the kernel)"
        );
        let (got, _) = receive(&b, 8);
        assert_eq!(got.len(), 8);
        assert!(got
            .iter()
            .enumerate()
            .all(|(i, (_, p))| p == &vec![i as u8; 1400]));
        // Linux answers EMSGSIZE here from 6.14 ("udp: gso: do not drop small packets when
        // PMTU reduces"); before, EINVAL, which also turns the offload off.
        if kernel_release() < (6, 14) {
            eprintln!(
                "this kernel (before 6.14) may answer EINVAL, which turns GSO off: not checking that it stays on"
            );
            return;
        }
        assert!(
            a.uses_gso(),
            "a path MTU below the segment size says nothing about the offload"
        );

        // Segments that fit still go out segmented, and arrive coalesced.
        let out = numbered(to_b, 20, 1000);
        assert_eq!(a.send_batch(&out.to_network).unwrap().sent, 20);
        let (got, slots) = receive(&b, 20);
        assert_eq!(got.len(), 20);
        assert!(slots < 20, "{slots} receives: the run was not segmented");
    })
    .join()
    .unwrap();
}

#[test]
fn only_errors_of_the_offload_itself_turn_it_off() {
    let error = |code| io::Error::from_raw_os_error(code);
    assert!(segmentation_refused(&error(libc::EMSGSIZE)));
    assert!(!gso_unsupported(&error(libc::EMSGSIZE)));
    for code in [libc::EIO, libc::EINVAL, libc::ENOPROTOOPT, libc::EOPNOTSUPP] {
        assert!(gso_unsupported(&error(code)), "{code}");
    }
    for code in [
        libc::ENETUNREACH,
        libc::EHOSTUNREACH,
        libc::ECONNREFUSED,
        libc::EAGAIN,
        libc::ENOBUFS,
        libc::EPERM,
    ] {
        assert!(!segmentation_refused(&error(code)), "{code}");
    }
}

/// The running kernel's major and minor version.
fn kernel_release() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// Sets this thread's network namespace's loopback MTU to `mtu` and brings it up, through the
/// interface ioctls (no `ip` binary needed, so the emulated ARM runs take this test too).
fn loopback_up_with_mtu(mtu: i32) -> io::Result<()> {
    // SAFETY: a plain socket call; the descriptor is owned and closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    let socket = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: an all-zero ifreq is valid; the name "lo" fits with its NUL.
    let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
    for (slot, byte) in request.ifr_name.iter_mut().zip(b"lo") {
        *slot = *byte as libc::c_char;
    }
    let call = |op, request: &mut libc::ifreq| {
        // SAFETY: `request` is a valid ifreq naming an interface; the ioctls read or write it.
        if unsafe { libc::ioctl(socket.as_raw_fd(), op, request as *mut libc::ifreq) } < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    };
    request.ifr_ifru.ifru_mtu = mtu;
    call(libc::SIOCSIFMTU, &mut request)?;
    call(libc::SIOCGIFFLAGS, &mut request)?;
    // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
    let flags = unsafe { request.ifr_ifru.ifru_flags };
    request.ifr_ifru.ifru_flags = flags | libc::IFF_UP as libc::c_short;
    call(libc::SIOCSIFFLAGS, &mut request)
}

#[test]
fn a_received_datagram_names_the_local_address_it_was_sent_to() {
    // All of 127/8 is the host's own: a datagram to 127.0.0.2 says so.
    let a = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    let b = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    let to_b = SocketAddr::from(([127, 0, 0, 2], b.local_port().unwrap()));
    let mut out = Outbox::default();
    out.to_network.push_copy(Some(to_b.into()), b"hello");
    assert_eq!(a.send_batch(&out.to_network).unwrap().sent, 1);
    let (endpoints, _) = receive_endpoints(&b, 1);
    assert_eq!(endpoints.len(), 1);
    let local = endpoints[0]
        .local
        .expect("IP_PKTINFO names the local address");
    assert_eq!(local.ip, std::net::IpAddr::from([127, 0, 0, 2]));
    assert_ne!(local.ifindex, 0, "and the interface it came in on");
}

#[test]
fn replies_leave_from_the_local_address_asked_for_even_in_one_gso_batch() {
    let a = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    let b = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    let to_b = SocketAddr::from(([127, 0, 0, 1], b.local_port().unwrap()));
    let from = |last: u8| Some(LocalAddr::new(std::net::IpAddr::from([127, 0, 0, last])));
    // Runs of one size to one destination, from three sources in turn: GSO must not
    // merge them.
    let mut out = Outbox::default();
    for (i, source) in [from(3), from(3), from(4), from(4), None, from(3)]
        .into_iter()
        .enumerate()
    {
        out.to_network
            .push_copy(Some(Endpoint::new(to_b, source)), &[i as u8; 1000]);
    }
    let outcome = a.send_batch(&out.to_network).unwrap();
    assert_eq!(outcome.sent, 6);
    assert_eq!(outcome.refused_source, None);
    let (got, _) = receive(&b, 6);
    let sources: Vec<(u8, std::net::IpAddr)> = got.iter().map(|(s, p)| (p[0], s.ip())).collect();
    let ip = |last: u8| std::net::IpAddr::from([127, 0, 0, last]);
    assert_eq!(
        sources,
        vec![
            (0, ip(3)),
            (1, ip(3)),
            (2, ip(4)),
            (3, ip(4)),
            (4, ip(1)),
            (5, ip(3))
        ]
    );
}

#[test]
fn a_source_that_is_not_the_hosts_is_dropped_and_reported() {
    let a = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    let b = UdpSocketIo::bind(false, 0, false, 0).unwrap();
    let to_b = SocketAddr::from(([127, 0, 0, 1], b.local_port().unwrap()));
    // 192.0.2.1 (TEST-NET-1) is no address of this host.
    let gone = std::net::IpAddr::from([192, 0, 2, 1]);
    let mut out = Outbox::default();
    for i in 0..4u8 {
        out.to_network.push_copy(
            Some(Endpoint::new(to_b, Some(LocalAddr::new(gone)))),
            &[i; 500],
        );
    }
    let outcome = a.send_batch(&out.to_network).unwrap();
    assert_eq!(
        outcome,
        SendOutcome {
            sent: 4,
            failed: 0,
            refused_source: Some(gone)
        }
    );
    let (got, _) = receive(&b, 4);
    assert_eq!(got.len(), 4, "all went out, from the kernel's choice");
    assert!(got
        .iter()
        .all(|(s, _)| s.ip() == std::net::IpAddr::from([127, 0, 0, 1])));
}

#[test]
fn ipv6_sources_are_learnt_and_used() {
    let Ok(a) = UdpSocketIo::bind(true, 0, false, 0) else {
        eprintln!("skipped: no IPv6");
        return;
    };
    let b = UdpSocketIo::bind(true, 0, false, 0).unwrap();
    let to_b: SocketAddr = format!("[::1]:{}", b.local_port().unwrap())
        .parse()
        .unwrap();
    let mut out = Outbox::default();
    out.to_network.push_copy(
        Some(Endpoint::new(
            to_b,
            Some(LocalAddr::new("::1".parse().unwrap())),
        )),
        b"six",
    );
    let outcome = a.send_batch(&out.to_network).unwrap();
    if outcome.sent == 0 {
        eprintln!("skipped: ::1 unreachable here");
        return;
    }
    assert_eq!(outcome.refused_source, None);
    let (endpoints, _) = receive_endpoints(&b, 1);
    assert_eq!(
        endpoints[0].local.map(|l| l.ip),
        Some("::1".parse().unwrap())
    );
    // An address not the host's: EINVAL, sent again without it.
    let gone: std::net::IpAddr = "2001:db8::1".parse().unwrap();
    let mut out = Outbox::default();
    out.to_network
        .push_copy(Some(Endpoint::new(to_b, Some(LocalAddr::new(gone)))), b"x");
    let outcome = a.send_batch(&out.to_network).unwrap();
    assert_eq!((outcome.sent, outcome.refused_source), (1, Some(gone)));
}

#[test]
fn only_a_gone_source_is_dropped_from_a_send() {
    let error = |code| io::Error::from_raw_os_error(code);
    for code in [
        libc::EINVAL,
        libc::EADDRNOTAVAIL,
        libc::ENETUNREACH,
        libc::ENODEV,
    ] {
        assert!(source_refused(&error(code)), "{code}");
    }
    for code in [
        libc::EAGAIN,
        libc::ENOBUFS,
        libc::EMSGSIZE,
        libc::EPERM,
        libc::EIO,
    ] {
        assert!(!source_refused(&error(code)), "{code}");
    }
}

/// As [`receive`], the endpoints (source and local address) of what arrived.
fn receive_endpoints(socket: &UdpSocketIo, want: usize) -> (Vec<Endpoint>, usize) {
    let mut batch = RecvBatch::new(8, 2048);
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while got.len() < want && std::time::Instant::now() < deadline {
        match socket.recv_batch(&mut batch) {
            Ok(_) => got.extend(batch.iter_endpoints().map(|(e, _)| e)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(e) => panic!("{e}"),
        }
    }
    let n = got.len();
    (got, n)
}
