//! Peeks into IP headers: version, source, destination, total length.
//!
//! Contract: every function takes any byte slice and never panics; a slice too short for the
//! header it claims to be returns `None`. Nothing here allocates.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

const IPV4_HEADER_MIN: usize = 20;
const IPV6_HEADER_LEN: usize = 40;

/// The addresses and length an IP header declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpHeader {
    /// Source address.
    pub source: IpAddr,
    /// Destination address.
    pub destination: IpAddr,
    /// Total packet length the header declares (IPv6: payload length plus the fixed header).
    pub total_len: usize,
}

/// Parses the IPv4 or IPv6 header at the start of `packet`.
pub fn parse_header(packet: &[u8]) -> Option<IpHeader> {
    match packet.first()? >> 4 {
        4 if packet.len() >= IPV4_HEADER_MIN => {
            let source = Ipv4Addr::new(packet[12], packet[13], packet[14], packet[15]);
            let destination = Ipv4Addr::new(packet[16], packet[17], packet[18], packet[19]);
            Some(IpHeader {
                source: source.into(),
                destination: destination.into(),
                total_len: usize::from(u16::from_be_bytes([packet[2], packet[3]])),
            })
        }
        6 if packet.len() >= IPV6_HEADER_LEN => {
            let source = ipv6_at(packet, 8)?;
            let destination = ipv6_at(packet, 24)?;
            Some(IpHeader {
                source: source.into(),
                destination: destination.into(),
                total_len: usize::from(u16::from_be_bytes([packet[4], packet[5]]))
                    + IPV6_HEADER_LEN,
            })
        }
        _ => None,
    }
}

/// The destination address of the IP packet, if it has a complete header.
pub fn destination(packet: &[u8]) -> Option<IpAddr> {
    parse_header(packet).map(|h| h.destination)
}

fn ipv6_at(packet: &[u8], offset: usize) -> Option<Ipv6Addr> {
    let bytes: [u8; 16] = packet.get(offset..offset + 16)?.try_into().ok()?;
    Some(Ipv6Addr::from(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ipv4(src: [u8; 4], dst: [u8; 4], len: u16) -> Vec<u8> {
        let mut p = vec![0u8; usize::from(len)];
        p[0] = 0x45;
        p[2..4].copy_from_slice(&len.to_be_bytes());
        p[12..16].copy_from_slice(&src);
        p[16..20].copy_from_slice(&dst);
        p
    }

    #[test]
    fn reads_ipv4_addresses_and_length() {
        let p = ipv4([10, 0, 0, 1], [10, 0, 0, 2], 60);
        let h = parse_header(&p).unwrap();
        assert_eq!(h.source, IpAddr::from([10, 0, 0, 1]));
        assert_eq!(h.destination, IpAddr::from([10, 0, 0, 2]));
        assert_eq!(h.total_len, 60);
    }

    #[test]
    fn reads_ipv6_addresses_and_length() {
        let mut p = vec![0u8; 48];
        p[0] = 0x60;
        p[4..6].copy_from_slice(&8u16.to_be_bytes());
        p[8..24].copy_from_slice(&Ipv6Addr::LOCALHOST.octets());
        p[24..40].copy_from_slice(&"fd00::2".parse::<Ipv6Addr>().unwrap().octets());
        let h = parse_header(&p).unwrap();
        assert_eq!(h.source, IpAddr::V6(Ipv6Addr::LOCALHOST));
        assert_eq!(h.destination, "fd00::2".parse::<IpAddr>().unwrap());
        assert_eq!(h.total_len, 48);
    }

    #[test]
    fn short_or_unknown_input_is_none_not_a_panic() {
        assert_eq!(parse_header(&[]), None);
        assert_eq!(parse_header(&[0x45; 19]), None);
        assert_eq!(parse_header(&[0x60; 39]), None);
        assert_eq!(parse_header(&[0x00; 64]), None);
        for len in 0..64 {
            let junk: Vec<u8> = (0..len).map(|i| (i * 37) as u8).collect();
            let _ = parse_header(&junk);
        }
    }
}
