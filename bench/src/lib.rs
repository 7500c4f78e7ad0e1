//! Shared fixtures for kilotun's criterion benches.

use std::net::IpAddr;

use dataplane::testing::ip_packet;

/// An IPv4 packet of exactly `size` bytes between the pair's tunnel addresses.
pub fn packet_of_size(size: usize) -> Vec<u8> {
    let src: IpAddr = [10, 0, 0, 1].into();
    let dst: IpAddr = [10, 0, 0, 2].into();
    ip_packet(src, dst, &vec![0xa5; size.saturating_sub(20)])
}

/// `count` distinct prefixes of mixed lengths (/8 to /32), deterministic.
pub fn prefixes(count: usize) -> Vec<ipnet::IpNet> {
    let mut state = 0x1234_5678_9abc_def0u64;
    (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = 8 + (state % 25) as u8;
            let addr = std::net::Ipv4Addr::from((state >> 16) as u32);
            ipnet::IpNet::V4(
                ipnet::Ipv4Net::new(addr, len)
                    .expect("length <= 32")
                    .trunc(),
            )
        })
        .collect()
}
