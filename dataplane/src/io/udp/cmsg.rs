//! The control messages of the UDP sockets, read and written over plain byte buffers with
//! every length checked, so that a malformed or truncated one is skipped, never followed:
//!
//! - received: `UDP_GRO` (the size of coalesced datagrams) and `IP_PKTINFO` /
//!   `IPV6_PKTINFO` (the local address a datagram was sent to);
//! - sent: `UDP_SEGMENT` (the GSO segment size) and `IP_PKTINFO` / `IPV6_PKTINFO` (the source
//!   address to send from).

use std::mem::size_of;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::endpoint::LocalAddr;

/// `UDP_SEGMENT` (send-side GSO segment size), from linux/udp.h.
pub(super) const UDP_SEGMENT: libc::c_int = 103;
/// `UDP_GRO` (receive-side coalescing; also the control message carrying the size).
pub(super) const UDP_GRO: libc::c_int = 104;

/// Bytes of control buffer per message: room for a `UDP_GRO` or `UDP_SEGMENT` message and an
/// `IPV6_PKTINFO` one (64 bytes on 64-bit Linux), with room to spare.
pub(super) const CONTROL_BYTES: usize = 128;

/// One message's control buffer, aligned as `cmsghdr` wants.
#[derive(Clone, Copy)]
#[repr(C, align(8))]
pub(super) struct Control(pub(super) [u8; CONTROL_BYTES]);

impl Control {
    pub(super) const ZERO: Self = Self([0; CONTROL_BYTES]);
}

/// Bytes of `in_pktinfo` (`ipi_ifindex`, `ipi_spec_dst`, `ipi_addr`).
const IN_PKTINFO: usize = 12;
/// Bytes of `in6_pktinfo` (`ipi6_addr`, `ipi6_ifindex`).
const IN6_PKTINFO: usize = 20;

/// `len` rounded up as the kernel aligns control messages (`CMSG_ALIGN`: to a `long`).
const fn align(len: usize) -> usize {
    let word = size_of::<usize>();
    (len + word - 1) & !(word - 1)
}

/// Where a control message's data starts (`CMSG_LEN(0)`).
const DATA_OFFSET: usize = align(size_of::<libc::cmsghdr>());

/// Bytes a control message with `len` bytes of data takes (`CMSG_SPACE(len)`).
pub(super) const fn space(len: usize) -> usize {
    DATA_OFFSET + align(len)
}

/// What the control messages of one received message said.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Received {
    /// The `UDP_GRO` segment size, or 0 (one datagram).
    pub(super) segment: usize,
    /// The local address the datagram was sent to.
    pub(super) local: Option<LocalAddr>,
}

/// Reads the control messages in `control` (the `msg_controllen` bytes the kernel wrote).
/// Anything malformed ends the walk: what was read before it stands.
pub(super) fn parse(control: &[u8]) -> Received {
    let mut received = Received::default();
    let mut at = 0;
    while control.len() - at >= size_of::<libc::cmsghdr>() {
        // SAFETY: a whole cmsghdr lies within `control` from `at`; read_unaligned takes any
        // alignment, and every bit pattern is a valid cmsghdr (integers only).
        let header =
            unsafe { std::ptr::read_unaligned(control[at..].as_ptr().cast::<libc::cmsghdr>()) };
        // A size_t with glibc, a socklen_t with musl: a usize either way on Linux.
        #[allow(clippy::unnecessary_cast)]
        let len = header.cmsg_len as usize;
        if len < DATA_OFFSET || len > control.len() - at {
            break;
        }
        let data = &control[at + DATA_OFFSET..at + len];
        match (header.cmsg_level, header.cmsg_type) {
            (libc::SOL_UDP, UDP_GRO) => {
                if let Some(size) = data.get(..4) {
                    let size = i32::from_ne_bytes(size.try_into().expect("4 bytes"));
                    received.segment = usize::try_from(size).unwrap_or(0);
                }
            }
            (libc::IPPROTO_IP, libc::IP_PKTINFO) => {
                if let Some(info) = data.get(..IN_PKTINFO) {
                    received.local = local_v4(info);
                }
            }
            (libc::IPPROTO_IPV6, libc::IPV6_PKTINFO) => {
                if let Some(info) = data.get(..IN6_PKTINFO) {
                    received.local = local_v6(info);
                }
            }
            _ => {}
        }
        // Past the message and its padding; `len` is at least DATA_OFFSET, so this moves on.
        at = at.saturating_add(align(len)).min(control.len());
    }
    received
}

/// The local address of an `in_pktinfo`: `ipi_spec_dst`, the address a reply goes out from
/// (the destination itself for a unicast datagram).
fn local_v4(info: &[u8]) -> Option<LocalAddr> {
    let ifindex = i32::from_ne_bytes(info[0..4].try_into().expect("4 bytes"));
    let octets: [u8; 4] = info[4..8].try_into().expect("4 bytes");
    let ip = Ipv4Addr::from(octets);
    if ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() {
        return None;
    }
    Some(LocalAddr {
        ip: IpAddr::V4(ip),
        ifindex: u32::try_from(ifindex).unwrap_or(0),
    })
}

/// The local address of an `in6_pktinfo`: the datagram's destination, unless multicast.
fn local_v6(info: &[u8]) -> Option<LocalAddr> {
    let octets: [u8; 16] = info[0..16].try_into().expect("16 bytes");
    let ifindex = i32::from_ne_bytes(info[16..20].try_into().expect("4 bytes"));
    let ip = Ipv6Addr::from(octets);
    if ip.is_unspecified() || ip.is_multicast() || ip.to_ipv4_mapped().is_some() {
        return None;
    }
    Some(LocalAddr {
        ip: IpAddr::V6(ip),
        ifindex: u32::try_from(ifindex).unwrap_or(0),
    })
}

/// Writes a control message of `level` and `kind` carrying `data` at byte `at` of `buffer`
/// (a multiple of the alignment); returns where the next one goes, or `None` without room.
fn put(
    buffer: &mut [u8],
    at: usize,
    level: libc::c_int,
    kind: libc::c_int,
    data: &[u8],
) -> Option<usize> {
    let next = at.checked_add(space(data.len()))?;
    if !at.is_multiple_of(align(1)) || next > buffer.len() {
        return None;
    }
    // SAFETY: an all-zero cmsghdr is valid (integers, and padding fields on some libcs).
    let mut header: libc::cmsghdr = unsafe { std::mem::zeroed() };
    header.cmsg_len = (DATA_OFFSET + data.len()) as _;
    header.cmsg_level = level;
    header.cmsg_type = kind;
    let message = &mut buffer[at..next];
    message.fill(0);
    // SAFETY: `message` holds at least DATA_OFFSET >= size_of::<cmsghdr>() bytes;
    // write_unaligned takes any alignment.
    unsafe { std::ptr::write_unaligned(message.as_mut_ptr().cast::<libc::cmsghdr>(), header) };
    message[DATA_OFFSET..DATA_OFFSET + data.len()].copy_from_slice(data);
    Some(next)
}

/// Writes a `UDP_SEGMENT` message giving the GSO segment size at byte `at` of `buffer`.
pub(super) fn put_segment(buffer: &mut [u8], at: usize, segment: u16) -> Option<usize> {
    put(
        buffer,
        at,
        libc::SOL_UDP,
        UDP_SEGMENT,
        &segment.to_ne_bytes(),
    )
}

/// Writes an `IP_PKTINFO` (`ipi_spec_dst`) or `IPV6_PKTINFO` (`ipi6_addr`) message asking for
/// `local` as the source, at byte `at` of `buffer`. No interface is named (the route picks
/// it), but for an IPv6 link-local address, which needs one.
pub(super) fn put_source(buffer: &mut [u8], at: usize, local: &LocalAddr) -> Option<usize> {
    match local.ip {
        IpAddr::V4(ip) => {
            let mut info = [0u8; IN_PKTINFO];
            info[4..8].copy_from_slice(&ip.octets());
            put(buffer, at, libc::IPPROTO_IP, libc::IP_PKTINFO, &info)
        }
        IpAddr::V6(ip) => {
            let mut info = [0u8; IN6_PKTINFO];
            info[..16].copy_from_slice(&ip.octets());
            if ip.is_unicast_link_local() {
                let ifindex = i32::try_from(local.ifindex).unwrap_or(0);
                info[16..].copy_from_slice(&ifindex.to_ne_bytes());
            }
            put(buffer, at, libc::IPPROTO_IPV6, libc::IPV6_PKTINFO, &info)
        }
    }
}

#[cfg(test)]
mod tests;
