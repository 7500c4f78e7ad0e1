//! Control messages built and read back, and malformed ones read without harm.

use super::*;

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

/// A received-style control buffer: a message of `level`/`kind` with `data`, raw.
fn raw(level: libc::c_int, kind: libc::c_int, data: &[u8]) -> Vec<u8> {
    let mut buffer = vec![0u8; space(data.len())];
    put(&mut buffer, 0, level, kind, data).unwrap();
    buffer
}

fn in_pktinfo(ifindex: i32, spec_dst: [u8; 4], addr: [u8; 4]) -> Vec<u8> {
    let mut info = ifindex.to_ne_bytes().to_vec();
    info.extend_from_slice(&spec_dst);
    info.extend_from_slice(&addr);
    info
}

fn in6_pktinfo(addr: Ipv6Addr, ifindex: i32) -> Vec<u8> {
    let mut info = addr.octets().to_vec();
    info.extend_from_slice(&ifindex.to_ne_bytes());
    info
}

#[test]
fn gro_and_pktinfo_are_read_together() {
    let mut control = raw(libc::SOL_UDP, UDP_GRO, &1400i32.to_ne_bytes());
    control.extend(raw(
        libc::IPPROTO_IP,
        libc::IP_PKTINFO,
        &in_pktinfo(3, [10, 0, 0, 2], [10, 0, 0, 2]),
    ));
    assert_eq!(
        parse(&control),
        Received {
            segment: 1400,
            local: Some(LocalAddr {
                ip: v4(10, 0, 0, 2),
                ifindex: 3
            }),
        }
    );
    let ip: Ipv6Addr = "fd00::2".parse().unwrap();
    let control = raw(libc::IPPROTO_IPV6, libc::IPV6_PKTINFO, &in6_pktinfo(ip, 7));
    assert_eq!(
        parse(&control).local,
        Some(LocalAddr {
            ip: IpAddr::V6(ip),
            ifindex: 7
        })
    );
    assert_eq!(parse(&control).segment, 0);
}

#[test]
fn the_reply_address_of_ipv4_is_spec_dst() {
    // A broadcast received on an interface of 10.0.0.1: the reply goes out from 10.0.0.1.
    let control = raw(
        libc::IPPROTO_IP,
        libc::IP_PKTINFO,
        &in_pktinfo(2, [10, 0, 0, 1], [255, 255, 255, 255]),
    );
    assert_eq!(parse(&control).local.unwrap().ip, v4(10, 0, 0, 1));
    // No usable address: none learnt.
    for spec_dst in [[0, 0, 0, 0], [224, 0, 0, 1], [255, 255, 255, 255]] {
        let control = raw(
            libc::IPPROTO_IP,
            libc::IP_PKTINFO,
            &in_pktinfo(2, spec_dst, spec_dst),
        );
        assert_eq!(parse(&control).local, None, "{spec_dst:?}");
    }
    let control = raw(
        libc::IPPROTO_IPV6,
        libc::IPV6_PKTINFO,
        &in6_pktinfo("ff02::1".parse().unwrap(), 2),
    );
    assert_eq!(parse(&control).local, None);
}

#[test]
fn malformed_control_messages_are_skipped_never_followed() {
    let good = raw(
        libc::IPPROTO_IP,
        libc::IP_PKTINFO,
        &in_pktinfo(1, [192, 0, 2, 1], [192, 0, 2, 1]),
    );
    let want = Some(LocalAddr {
        ip: v4(192, 0, 2, 1),
        ifindex: 1,
    });
    assert_eq!(parse(&good).local, want);
    // Every truncation of a valid message: never a panic, and no address from a short one.
    for cut in 0..good.len() {
        let got = parse(&good[..cut]);
        assert!(
            got.local.is_none() || cut >= DATA_OFFSET + IN_PKTINFO,
            "{cut}"
        );
    }
    // A length below the header's, zero, or past the buffer: the walk ends there.
    for bad_len in [0usize, 1, DATA_OFFSET - 1, good.len() + 1, usize::MAX] {
        let mut control = good.clone();
        control[..size_of::<usize>()].copy_from_slice(&bad_len.to_ne_bytes()[..size_of::<usize>()]);
        assert_eq!(parse(&control), Received::default(), "cmsg_len {bad_len}");
    }
    // A message too short for its type is ignored; the next one is still read.
    let mut control = raw(libc::IPPROTO_IP, libc::IP_PKTINFO, &[1, 2, 3]);
    control.extend(raw(libc::SOL_UDP, UDP_GRO, &[9]));
    control.extend(good.clone());
    assert_eq!(
        parse(&control),
        Received {
            segment: 0,
            local: want
        }
    );
    // Unknown messages are passed over.
    let mut control = raw(libc::SOL_SOCKET, libc::SO_TIMESTAMP, &[0; 16]);
    control.extend(good);
    assert_eq!(parse(&control).local, want);
    // A negative GRO size counts as none.
    let control = raw(libc::SOL_UDP, UDP_GRO, &(-5i32).to_ne_bytes());
    assert_eq!(parse(&control).segment, 0);
    // Garbage of every length, and an empty buffer.
    let mut state = 0x1234_5678_u32;
    for len in 0..200 {
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                state = state.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (state >> 16) as u8
            })
            .collect();
        let _ = parse(&bytes);
    }
}

#[test]
fn segment_and_source_fit_one_control_buffer_and_read_back() {
    let mut control = Control::ZERO;
    let local = LocalAddr {
        ip: "fe80::1".parse().unwrap(),
        ifindex: 4,
    };
    let at = put_segment(&mut control.0, 0, 1200).unwrap();
    assert_eq!(at, space(2));
    let end = put_source(&mut control.0, at, &local).unwrap();
    assert_eq!(end, space(2) + space(IN6_PKTINFO));
    assert!(end <= CONTROL_BYTES);
    let got = parse(&control.0[..end]);
    assert_eq!(
        got.local,
        Some(local),
        "a link-local source names its interface"
    );
    // The segment size went out as a u16 (read back here only as the raw bytes).
    assert_eq!(
        &control.0[DATA_OFFSET..DATA_OFFSET + 2],
        &1200u16.to_ne_bytes()
    );

    // A global IPv6 source and an IPv4 one name no interface (the route picks it).
    let global = LocalAddr {
        ip: "2001:db8::2".parse().unwrap(),
        ifindex: 4,
    };
    let end = put_source(&mut control.0, 0, &global).unwrap();
    assert_eq!(
        parse(&control.0[..end]).local,
        Some(LocalAddr::new(global.ip))
    );
    let end = put_source(&mut control.0, 0, &LocalAddr::new(v4(10, 0, 0, 2))).unwrap();
    assert_eq!(end, space(IN_PKTINFO));
    assert_eq!(
        parse(&control.0[..end]).local,
        Some(LocalAddr::new(v4(10, 0, 0, 2)))
    );
}

#[test]
fn building_without_room_or_off_alignment_writes_nothing() {
    let mut small = [0u8; 8];
    assert_eq!(put_segment(&mut small, 0, 1), None);
    assert_eq!(small, [0; 8]);
    let mut control = Control::ZERO;
    assert_eq!(put_segment(&mut control.0, 3, 1), None);
    assert_eq!(put_segment(&mut control.0, CONTROL_BYTES, 1), None);
    assert_eq!(
        put_source(&mut control.0, usize::MAX, &LocalAddr::new(v4(1, 2, 3, 4))),
        None
    );
    assert!(control.0.iter().all(|&b| b == 0));
}
