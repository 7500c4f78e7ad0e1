//! IP-in-IP (protocol 4) in userspace, for hosts whose kernel has no `ipip` module.
//!
//! Packets the kernel routes to a TUN device are wrapped in an outer header addressed to the
//! gateway of their route and sent through a raw `IPPROTO_IPIP` socket; protocol-4 packets the
//! host receives come out of that socket, are unwrapped and written to the TUN device. The inner
//! packet is always IPv4. The outer header is IPv4 (the bytes of kernel IPIP, `tunl0`) when the
//! gateway is an IPv4 address, and IPv6 with next header 4 (the bytes of the kernel's `ip6tnl`
//! in `ipip6` mode) when it is an IPv6 address: a location whose nodes have IPv6 internal IPs
//! still carries IPv4 pods encapsulated. Either end may be kernel or userspace.
//!
//! A TUN device does not see a route's gateway, so the caller supplies the table that maps inner
//! destinations to gateways ([`IpipTable`]), built from the same route plan that points those
//! destinations at the device. The decisions ([`IpipTable::gateway`], [`IpipTable::unwrap`],
//! [`IpipTable::unwrap_from_v6`]) are pure; [`UserspaceIpip`] is the thin I/O shell around them.

use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use arc_swap::ArcSwap;
use ipnet::IpNet;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use crate::allowed_ips::AllowedIps;
use crate::eventfd::{poll, readable, StopSignal};
use crate::io::linux_tun::{LinuxTun, TunError};
use crate::io::TunIo;

/// IANA protocol number of IP-in-IP.
pub const IPPROTO_IPIP: u8 = 4;
/// Bytes the outer IPv4 header adds.
pub const IPIP_OVERHEAD: u32 = 20;
/// Bytes the outer IPv6 header adds (to a gateway with an IPv6 address).
pub const IPIP6_OVERHEAD: u32 = 40;

/// Why a packet was not forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IpipDrop {
    /// Not a well-formed IPv4 packet (outer, or inner for what the TUN device gave us).
    Malformed,
    /// An outer packet whose protocol is not 4.
    NotIpip,
    /// An inner packet that is not IPv4 (IPIP carries IPv4 only).
    InnerNotIpv4,
    /// An outer source that is not one of the location's nodes.
    SourceNotAllowed,
    /// No route maps the inner destination to a gateway.
    NoGateway,
}

/// Where encapsulated packets go, and whom they are accepted from.
#[derive(Debug, Default)]
pub struct IpipTable {
    gateways: AllowedIps<IpAddr>,
    sources: HashSet<IpAddr>,
}

/// Checks an IPv4 header at the start of `packet`: (header length, total length, protocol).
fn ipv4_header(packet: &[u8]) -> Option<(usize, usize, u8)> {
    let first = *packet.first()?;
    if first >> 4 != 4 {
        return None;
    }
    let header = usize::from(first & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([*packet.get(2)?, *packet.get(3)?]));
    if header < 20 || total < header || total > packet.len() {
        return None;
    }
    Some((header, total, packet[9]))
}

fn ipv4_at(packet: &[u8], offset: usize) -> Ipv4Addr {
    Ipv4Addr::new(
        packet[offset],
        packet[offset + 1],
        packet[offset + 2],
        packet[offset + 3],
    )
}

/// The IPv4 packet at the start of `inner`, cut to its total length.
fn inner_ipv4(inner: &[u8]) -> Result<&[u8], IpipDrop> {
    match ipv4_header(inner) {
        Some((_, total, _)) => Ok(&inner[..total]),
        None if inner.first().is_some_and(|b| b >> 4 != 4) => Err(IpipDrop::InnerNotIpv4),
        None => Err(IpipDrop::Malformed),
    }
}

impl IpipTable {
    /// A table from `(inner destination, gateway)` routes and the accepted outer sources.
    /// IPv6 destinations are ignored: IPIP carries IPv4 packets (to a gateway of either family).
    pub fn new(
        routes: impl IntoIterator<Item = (IpNet, IpAddr)>,
        sources: impl IntoIterator<Item = IpAddr>,
    ) -> Self {
        let mut gateways = AllowedIps::default();
        for (dst, gateway) in routes {
            if let IpNet::V4(dst) = dst {
                gateways.insert(IpNet::V4(dst.trunc()), gateway);
            }
        }
        Self {
            gateways,
            sources: sources.into_iter().collect(),
        }
    }

    /// The gateway an inner packet from the TUN device is sent to.
    pub fn gateway(&self, inner: &[u8]) -> Result<IpAddr, IpipDrop> {
        match inner.first().map(|b| b >> 4) {
            Some(4) => {}
            Some(6) => return Err(IpipDrop::InnerNotIpv4),
            _ => return Err(IpipDrop::Malformed),
        }
        ipv4_header(inner).ok_or(IpipDrop::Malformed)?;
        let destination = ipv4_at(inner, 16);
        self.gateways
            .lookup(IpAddr::V4(destination))
            .copied()
            .ok_or(IpipDrop::NoGateway)
    }

    /// The inner packet of a received protocol-4 datagram (outer IPv4 header included, as a raw
    /// IPv4 socket delivers it), if it is well formed and comes from an accepted source.
    pub fn unwrap<'a>(&self, datagram: &'a [u8]) -> Result<&'a [u8], IpipDrop> {
        let (header, total, protocol) = ipv4_header(datagram).ok_or(IpipDrop::Malformed)?;
        if protocol != IPPROTO_IPIP {
            return Err(IpipDrop::NotIpip);
        }
        if !self.sources.contains(&IpAddr::V4(ipv4_at(datagram, 12))) {
            return Err(IpipDrop::SourceNotAllowed);
        }
        inner_ipv4(&datagram[header..total])
    }

    /// The inner packet of a protocol-4 payload received from `source` over IPv6 (a raw IPv6
    /// socket delivers the payload alone, the outer header stripped), if it is well formed and
    /// `source` is accepted.
    pub fn unwrap_from_v6<'a>(
        &self,
        source: Ipv6Addr,
        payload: &'a [u8],
    ) -> Result<&'a [u8], IpipDrop> {
        if !self.sources.contains(&IpAddr::V6(source)) {
            return Err(IpipDrop::SourceNotAllowed);
        }
        inner_ipv4(payload)
    }

    /// Number of gateway routes.
    pub fn len(&self) -> usize {
        self.gateways.len()
    }

    /// True with no gateway routes.
    pub fn is_empty(&self) -> bool {
        self.gateways.is_empty()
    }
}

/// What the userspace IPIP device has done, for metrics and tests.
#[derive(Debug, Default)]
pub struct IpipCounters {
    /// Packets wrapped and sent.
    pub sent: AtomicU64,
    /// Packets unwrapped and written to the TUN device.
    pub received: AtomicU64,
    /// Packets dropped (any [`IpipDrop`] or a failed send or write).
    pub dropped: AtomicU64,
}

impl IpipCounters {
    /// Counts one packet: into `forwarded` when it went through, else as dropped.
    fn tally(&self, forwarded: &AtomicU64, went_through: bool) {
        let counter = if went_through {
            forwarded
        } else {
            &self.dropped
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Why the userspace IPIP device could not start.
#[derive(Debug, thiserror::Error)]
pub enum IpipError {
    /// The TUN device.
    #[error(transparent)]
    Tun(#[from] TunError),
    /// The raw socket (needs CAP_NET_RAW).
    #[error("opening a raw IPIP socket (needs CAP_NET_RAW): {0}")]
    Socket(#[source] io::Error),
    /// Starting a worker thread.
    #[error("starting an IPIP worker: {0}")]
    Thread(#[source] io::Error),
}

/// A running userspace IPIP device: a TUN device, raw protocol-4 sockets (IPv4, and IPv6 where
/// the host has it) and two worker threads.
pub struct UserspaceIpip {
    name: String,
    table: Arc<ArcSwap<IpipTable>>,
    counters: Arc<IpipCounters>,
    stop: Arc<StopSignal>,
    workers: Vec<JoinHandle<()>>,
    carries_ipv6_outer: bool,
}

impl std::fmt::Debug for UserspaceIpip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserspaceIpip")
            .field("name", &self.name)
            .field("routes", &self.table.load().len())
            .field("carries_ipv6_outer", &self.carries_ipv6_outer)
            .finish_non_exhaustive()
    }
}

/// The raw protocol-4 sockets, one per outer family.
struct RawSockets {
    v4: Socket,
    /// `None` on a host without IPv6.
    v6: Option<Socket>,
}

impl RawSockets {
    fn open() -> Result<Self, IpipError> {
        let open = |domain| -> io::Result<Socket> {
            let socket = Socket::new(
                domain,
                Type::RAW,
                Some(Protocol::from(i32::from(IPPROTO_IPIP))),
            )?;
            socket.set_nonblocking(true)?;
            Ok(socket)
        };
        let v4 = open(Domain::IPV4).map_err(IpipError::Socket)?;
        let v6 = match open(Domain::IPV6) {
            Ok(socket) => Some(socket),
            Err(e) => {
                tracing::info!(error = %e, "no raw IPv6 socket for IPIP: gateways with IPv6 addresses are not reached");
                None
            }
        };
        Ok(Self { v4, v6 })
    }

    /// Sends `packet` to `gateway`, in an outer header of the gateway's family.
    fn send(&self, packet: &[u8], gateway: IpAddr) -> bool {
        match gateway {
            IpAddr::V4(v4) => {
                let to = SockAddr::from(SocketAddr::V4(SocketAddrV4::new(v4, 0)));
                self.v4.send_to(packet, &to).is_ok()
            }
            IpAddr::V6(v6) => self.v6.as_ref().is_some_and(|socket| {
                let to = SockAddr::from(SocketAddr::V6(SocketAddrV6::new(v6, 0, 0, 0)));
                socket.send_to(packet, &to).is_ok()
            }),
        }
    }
}

/// Sleeps until one of `fds` (at most two) is readable or `stop` is given; no timeout, so an
/// idle device never wakes. A descriptor in error (the TUN link deleted under us) is waited
/// on at most every 100 ms instead of in a busy loop.
fn wait_readable(fds: &[RawFd], stop: &StopSignal) {
    let mut pfds = [readable(-1); 3];
    for (pfd, fd) in pfds.iter_mut().zip(fds.iter().take(2)) {
        *pfd = readable(*fd);
    }
    pfds[2] = readable(stop.fd());
    poll(&mut pfds, None);
    let broken = pfds[..2]
        .iter()
        .any(|p| p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0);
    if broken && !stop.is_stopped() {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

impl UserspaceIpip {
    /// Creates the TUN device `name` and the raw sockets, and starts forwarding with an empty
    /// table (everything is dropped until [`UserspaceIpip::set_table`]).
    pub fn start(name: &str) -> Result<Self, IpipError> {
        let (mut queues, _) = LinuxTun::open(name, 1)?;
        let tun = Arc::new(queues.remove(0));
        let sockets = Arc::new(RawSockets::open()?);
        let carries_ipv6_outer = sockets.v6.is_some();
        let table = Arc::new(ArcSwap::from_pointee(IpipTable::default()));
        let counters = Arc::new(IpipCounters::default());
        let stop = Arc::new(StopSignal::new().map_err(IpipError::Thread)?);
        let mut workers = Vec::new();
        let outbound = {
            let (tun, sockets, table, counters, stop) = (
                tun.clone(),
                sockets.clone(),
                table.clone(),
                counters.clone(),
                stop.clone(),
            );
            std::thread::Builder::new()
                .name(format!("{name}-out"))
                .spawn(move || outbound(&*tun, &sockets, &table, &counters, &stop))
                .map_err(IpipError::Thread)?
        };
        workers.push(outbound);
        let inbound = {
            let (table, counters, stop) = (table.clone(), counters.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("{name}-in"))
                .spawn(move || inbound(&*tun, &sockets, &table, &counters, &stop))
                .map_err(IpipError::Thread)?
        };
        workers.push(inbound);
        Ok(Self {
            name: name.to_string(),
            table,
            counters,
            stop,
            workers,
            carries_ipv6_outer,
        })
    }

    /// The TUN device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// True when gateways with IPv6 addresses are reached (in an outer IPv6 header).
    pub fn carries_ipv6_outer(&self) -> bool {
        self.carries_ipv6_outer
    }

    /// Replaces the routing table; packets in flight use the old or the new one.
    pub fn set_table(&self, table: IpipTable) {
        self.table.store(Arc::new(table));
    }

    /// The device's counters.
    pub fn counters(&self) -> &IpipCounters {
        &self.counters
    }
}

impl Drop for UserspaceIpip {
    fn drop(&mut self) {
        self.stop.stop();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// TUN → raw socket: wrap each packet for its gateway.
fn outbound(
    tun: &dyn TunIo,
    sockets: &RawSockets,
    table: &ArcSwap<IpipTable>,
    counters: &IpipCounters,
    stop: &StopSignal,
) {
    let mut buf = vec![0u8; 65_535];
    while !stop.is_stopped() {
        wait_readable(&[tun.readiness_fd()], stop);
        let table = table.load();
        loop {
            let len = match tun.recv(&mut buf) {
                Ok(len) => len,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::debug!(error = %e, "reading the IPIP TUN device");
                    break;
                }
            };
            let packet = &buf[..len];
            let sent = table
                .gateway(packet)
                .ok()
                .is_some_and(|gateway| sockets.send(packet, gateway));
            counters.tally(&counters.sent, sent);
        }
    }
}

/// Raw sockets → TUN: unwrap what the location's nodes send, over either family.
fn inbound(
    tun: &dyn TunIo,
    sockets: &RawSockets,
    table: &ArcSwap<IpipTable>,
    counters: &IpipCounters,
    stop: &StopSignal,
) {
    let mut buf = vec![0u8; 65_535];
    let v4 = sockets.v4.as_raw_fd();
    let v6 = sockets.v6.as_ref().map(AsRawFd::as_raw_fd);
    let fds: Vec<RawFd> = std::iter::once(v4).chain(v6).collect();
    while !stop.is_stopped() {
        wait_readable(&fds, stop);
        let table = table.load();
        loop {
            // SAFETY: reading into an initialised byte buffer.
            let len =
                unsafe { libc::recv(v4, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
            if len < 0 {
                break;
            }
            let delivered = table
                .unwrap(&buf[..len as usize])
                .ok()
                .is_some_and(|inner| tun.send(inner).is_ok());
            counters.tally(&counters.received, delivered);
        }
        let Some(v6) = v6 else { continue };
        while let Some((len, source)) = recv_from_v6(v6, &mut buf) {
            let delivered = table
                .unwrap_from_v6(source, &buf[..len])
                .ok()
                .is_some_and(|inner| tun.send(inner).is_ok());
            counters.tally(&counters.received, delivered);
        }
    }
}

/// One datagram from the raw IPv6 socket `fd` (its payload, the outer header stripped) and its
/// source address, or `None` when nothing is waiting.
fn recv_from_v6(fd: RawFd, buf: &mut [u8]) -> Option<(usize, Ipv6Addr)> {
    // SAFETY: sockaddr_in6 is plain data; zeroed is a valid value.
    let mut from: libc::sockaddr_in6 = unsafe { std::mem::zeroed() };
    let mut from_len = std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t;
    // SAFETY: an initialised buffer and a sockaddr_in6 with its length, both valid for the call.
    let len = unsafe {
        libc::recvfrom(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
            std::ptr::addr_of_mut!(from).cast(),
            &mut from_len,
        )
    };
    (len >= 0).then(|| (len as usize, Ipv6Addr::from(from.sin6_addr.s6_addr)))
}

#[cfg(test)]
mod tests;
