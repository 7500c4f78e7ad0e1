use super::*;

fn ipv4(src: [u8; 4], dst: [u8; 4], protocol: u8, payload: &[u8]) -> Vec<u8> {
    let total = 20 + payload.len();
    let mut p = vec![0u8; 20];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p[8] = 64;
    p[9] = protocol;
    p[12..16].copy_from_slice(&src);
    p[16..20].copy_from_slice(&dst);
    p.extend_from_slice(payload);
    p
}

fn table() -> IpipTable {
    IpipTable::new(
        [
            (
                "10.42.2.0/24".parse().unwrap(),
                "192.168.10.2".parse().unwrap(),
            ),
            (
                "10.42.0.0/16".parse().unwrap(),
                "192.168.10.1".parse().unwrap(),
            ),
            ("fd00::/64".parse().unwrap(), "fd00::1".parse().unwrap()),
            // A node with an IPv6 internal IP: its IPv4 pods behind an IPv6 gateway.
            ("10.42.3.0/24".parse().unwrap(), "fd50::3".parse().unwrap()),
        ],
        [
            "192.168.10.1".parse().unwrap(),
            "192.168.10.2".parse().unwrap(),
            "fd50::3".parse().unwrap(),
        ],
    )
}

#[test]
fn the_gateway_is_the_longest_matching_routes() {
    let t = table();
    assert_eq!(t.len(), 3, "the IPv6 destination is ignored");
    let to_b = ipv4([10, 42, 1, 5], [10, 42, 2, 7], 1, b"ping");
    assert_eq!(
        t.gateway(&to_b),
        Ok(IpAddr::V4(Ipv4Addr::new(192, 168, 10, 2)))
    );
    let to_other = ipv4([10, 42, 1, 5], [10, 42, 9, 1], 6, b"tcp");
    assert_eq!(
        t.gateway(&to_other),
        Ok(IpAddr::V4(Ipv4Addr::new(192, 168, 10, 1)))
    );
    let to_c = ipv4([10, 42, 1, 5], [10, 42, 3, 9], 1, b"ping");
    assert_eq!(t.gateway(&to_c), Ok("fd50::3".parse::<IpAddr>().unwrap()));
    let nowhere = ipv4([10, 42, 1, 5], [8, 8, 8, 8], 17, b"udp");
    assert_eq!(t.gateway(&nowhere), Err(IpipDrop::NoGateway));
    let mut v6 = vec![0u8; 40];
    v6[0] = 0x60;
    assert_eq!(t.gateway(&v6), Err(IpipDrop::InnerNotIpv4));
    assert_eq!(t.gateway(&[]), Err(IpipDrop::Malformed));
    assert_eq!(t.gateway(&to_b[..10]), Err(IpipDrop::Malformed));
}

#[test]
fn received_packets_are_unwrapped_only_from_the_locations_nodes() {
    let t = table();
    let inner = ipv4([10, 42, 2, 7], [10, 42, 1, 5], 1, b"pong");
    let outer = ipv4([192, 168, 10, 2], [192, 168, 10, 3], IPPROTO_IPIP, &inner);
    assert_eq!(t.unwrap(&outer), Ok(&inner[..]));
    // Trailing bytes past the outer or inner total length are not delivered.
    let mut padded = outer.clone();
    padded.extend_from_slice(&[0; 6]);
    assert_eq!(t.unwrap(&padded), Ok(&inner[..]));
    let stranger = ipv4([192, 168, 99, 9], [192, 168, 10, 3], IPPROTO_IPIP, &inner);
    assert_eq!(t.unwrap(&stranger), Err(IpipDrop::SourceNotAllowed));
    let gre = ipv4([192, 168, 10, 2], [192, 168, 10, 3], 47, &inner);
    assert_eq!(t.unwrap(&gre), Err(IpipDrop::NotIpip));
    let mut v6_inner = vec![0u8; 40];
    v6_inner[0] = 0x60;
    let six = ipv4(
        [192, 168, 10, 2],
        [192, 168, 10, 3],
        IPPROTO_IPIP,
        &v6_inner,
    );
    assert_eq!(t.unwrap(&six), Err(IpipDrop::InnerNotIpv4));
    let short = ipv4(
        [192, 168, 10, 2],
        [192, 168, 10, 3],
        IPPROTO_IPIP,
        &inner[..12],
    );
    assert_eq!(t.unwrap(&short), Err(IpipDrop::Malformed));
    // An outer length beyond the datagram.
    let mut lying = outer;
    lying[2..4].copy_from_slice(&2000u16.to_be_bytes());
    assert_eq!(t.unwrap(&lying), Err(IpipDrop::Malformed));
}

#[test]
fn payloads_over_ipv6_are_unwrapped_only_from_the_locations_nodes() {
    let t = table();
    let inner = ipv4([10, 42, 3, 9], [10, 42, 1, 5], 1, b"pong");
    let node: Ipv6Addr = "fd50::3".parse().unwrap();
    assert_eq!(t.unwrap_from_v6(node, &inner), Ok(&inner[..]));
    let mut padded = inner.clone();
    padded.extend_from_slice(&[0; 6]);
    assert_eq!(t.unwrap_from_v6(node, &padded), Ok(&inner[..]));
    let stranger: Ipv6Addr = "fd50::99".parse().unwrap();
    assert_eq!(
        t.unwrap_from_v6(stranger, &inner),
        Err(IpipDrop::SourceNotAllowed)
    );
    let mut v6_inner = vec![0u8; 40];
    v6_inner[0] = 0x60;
    assert_eq!(
        t.unwrap_from_v6(node, &v6_inner),
        Err(IpipDrop::InnerNotIpv4)
    );
    assert_eq!(
        t.unwrap_from_v6(node, &inner[..12]),
        Err(IpipDrop::Malformed)
    );
}

#[test]
fn arbitrary_bytes_never_panic() {
    let t = table();
    let mut seed = 0x1234_5678_u32;
    let mut bytes = [0u8; 64];
    for _ in 0..20_000 {
        for b in &mut bytes {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            *b = seed as u8;
        }
        bytes[0] = 0x40 | (bytes[0] & 0x0f);
        let len = usize::from(bytes[1]) % bytes.len();
        let _ = t.unwrap(&bytes[..len]);
        let _ = t.unwrap_from_v6("fd50::3".parse().unwrap(), &bytes[..len]);
        let _ = t.gateway(&bytes[..len]);
    }
}
