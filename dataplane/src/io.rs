//! The seams between the engine and the operating system: a TUN queue and a UDP socket.
//!
//! Both are non-blocking: `recv` answers `WouldBlock` when nothing is waiting, and each exposes a
//! file descriptor that polls readable when something is. The runtime waits on those with
//! `poll(2)`. Real implementations live in [`linux_tun`] and [`udp`]; [`mem`] has in-memory twins
//! (with readiness on an eventfd) for tests.

pub mod linux_tun;
pub mod mem;
pub mod udp;

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::RawFd;

use crate::endpoint::Endpoint;
use crate::outbox::Batch;

/// One queue of a TUN device (or its twin): IP packets in and out, no packet-info header.
pub trait TunIo: Send + Sync + 'static {
    /// Reads one packet into `buf` without blocking.
    ///
    /// # Errors
    /// `WouldBlock` when no packet is waiting; other errors are the device's.
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize>;

    /// Writes one IP packet.
    ///
    /// # Errors
    /// The device's write error (for example `EIO` while the link is down).
    fn send(&self, packet: &[u8]) -> io::Result<()>;

    /// A descriptor that polls readable when [`TunIo::recv`] may return a packet.
    fn readiness_fd(&self) -> RawFd;

    /// Whether this queue still belongs to a link: false once the link was deleted, which no
    /// retry mends. Asked only after a failed read, never on the packet path.
    ///
    /// # Errors
    /// When the device cannot tell.
    fn is_attached(&self) -> io::Result<bool> {
        Ok(true)
    }

    /// Reads waiting packets into `batch` without blocking, replacing its contents; returns
    /// how many. A device with segmentation offload splits each large TCP segment it reads
    /// into MTU-sized packets here, so the engine only ever sees ordinary IP packets.
    ///
    /// # Errors
    /// `WouldBlock` when nothing is waiting.
    fn recv_batch(&self, batch: &mut TunBatch) -> io::Result<usize> {
        recv_each(self, batch)
    }

    /// Writes every packet of `packets` (a device with offload coalesces consecutive
    /// segments of one TCP flow into one write). Returns how many writes failed.
    fn send_batch(&self, packets: &Batch) -> usize {
        send_each(self, packets)
    }
}

/// [`TunIo::recv_batch`] one [`TunIo::recv`] per packet, until nothing waits or `batch` is full.
pub(crate) fn recv_each<T: TunIo + ?Sized>(tun: &T, batch: &mut TunBatch) -> io::Result<usize> {
    batch.count = 0;
    while batch.count < batch.bufs.len() {
        match tun.recv(&mut batch.bufs[batch.count]) {
            Ok(len) => {
                batch.sizes[batch.count] = len;
                batch.count += 1;
            }
            Err(e) if batch.count == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(batch.count)
}

/// [`TunIo::send_batch`] one [`TunIo::send`] per packet; returns how many failed.
pub(crate) fn send_each<T: TunIo + ?Sized>(tun: &T, packets: &Batch) -> usize {
    packets
        .iter()
        .filter(|(_, packet)| tun.send(packet).is_err())
        .count()
}

/// Packets read from a TUN queue: one buffer per packet, reused across calls.
#[derive(Debug)]
pub struct TunBatch {
    pub(crate) bufs: Vec<Vec<u8>>,
    pub(crate) sizes: Vec<usize>,
    pub(crate) count: usize,
}

impl TunBatch {
    /// Room for `slots` packets of up to `slot_size` bytes each.
    pub fn new(slots: usize, slot_size: usize) -> Self {
        Self {
            bufs: (0..slots).map(|_| vec![0; slot_size]).collect(),
            sizes: vec![0; slots],
            count: 0,
        }
    }

    /// The packets the last read returned.
    pub fn iter(&self) -> impl Iterator<Item = &[u8]> + '_ {
        (0..self.count).map(|i| &self.bufs[i][..self.sizes[i]])
    }

    /// Number of packets the last read returned.
    pub fn len(&self) -> usize {
        self.count
    }

    /// True when the last read returned nothing.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// Received datagrams. The buffer has one slot per receive; a slot may hold several
/// datagrams of one sender when the kernel coalesced them (UDP GRO), so datagrams are kept as
/// a separate list of (range in the buffer, source with the local address it was sent to).
/// Everything is reused across calls.
#[derive(Debug)]
pub struct RecvBatch {
    pub(crate) buffer: Vec<u8>,
    pub(crate) slot_size: usize,
    slots: usize,
    datagrams: Vec<(std::ops::Range<usize>, Endpoint)>,
}

impl RecvBatch {
    /// Room for `slots` receives of up to `slot_size` bytes each.
    pub fn new(slots: usize, slot_size: usize) -> Self {
        Self {
            buffer: vec![0; slots * slot_size],
            slot_size,
            slots,
            datagrams: Vec::with_capacity(slots),
        }
    }

    /// Number of slots (receives per call).
    pub fn capacity(&self) -> usize {
        self.slots
    }

    /// Datagrams received by the last call, with their sources.
    pub fn iter(&self) -> impl Iterator<Item = (SocketAddr, &[u8])> + '_ {
        self.datagrams
            .iter()
            .map(|(range, source)| (source.peer, &self.buffer[range.clone()]))
    }

    /// Datagrams received by the last call, each with its source and the local address it
    /// was sent to (when the socket could tell).
    pub fn iter_endpoints(&self) -> impl Iterator<Item = (Endpoint, &[u8])> + '_ {
        self.datagrams
            .iter()
            .map(|(range, source)| (*source, &self.buffer[range.clone()]))
    }

    /// Number of datagrams received by the last call.
    pub fn len(&self) -> usize {
        self.datagrams.len()
    }

    /// True when the last call received nothing.
    pub fn is_empty(&self) -> bool {
        self.datagrams.is_empty()
    }

    /// Slot `i` for writing, used by implementations.
    pub(crate) fn slot_mut(&mut self, i: usize) -> &mut [u8] {
        let start = i * self.slot_size;
        &mut self.buffer[start..start + self.slot_size]
    }

    /// Forgets the last call's datagrams, keeping the capacity.
    pub(crate) fn clear(&mut self) {
        self.datagrams.clear();
    }

    /// Records that slot `slot` received `len` bytes from `source`: one datagram, or with
    /// `segment` > 0 consecutive datagrams of `segment` bytes (the last may be shorter).
    pub(crate) fn push_received(
        &mut self,
        slot: usize,
        len: usize,
        segment: usize,
        source: Endpoint,
    ) {
        let start = slot * self.slot_size;
        let end = start + len.min(self.slot_size);
        let step = if segment == 0 { end - start } else { segment };
        let mut at = start;
        loop {
            let next = (at + step.max(1)).min(end);
            self.datagrams.push((at..next, source));
            at = next;
            if at >= end {
                break;
            }
        }
    }
}

/// A UDP socket (or its twin) of one address family.
pub trait UdpIo: Send + Sync + 'static {
    /// Receives as many waiting datagrams as fit in `batch`, without blocking.
    ///
    /// # Errors
    /// `WouldBlock` when none is waiting.
    fn recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize>;

    /// Sends every packet of `batch` whose destination is of this socket's family, from the
    /// local address its [`Endpoint`] names, if any.
    ///
    /// A local address the kernel refuses (it left the host, or its interface did) is left
    /// out and the datagrams go out without it, the kernel choosing their source; the
    /// result's `refused_source` names it, for the caller to forget. Datagrams the kernel refuses (no route, buffer full) are counted in the result's second
    /// field and dropped, as a lossy network would; they never stop the rest of the batch.
    ///
    /// # Errors
    /// Only for failures of the socket itself.
    fn send_batch(&self, batch: &Batch) -> io::Result<SendOutcome>;

    /// A descriptor that polls readable when [`UdpIo::recv_batch`] may return datagrams.
    fn readiness_fd(&self) -> RawFd;
}

/// What [`UdpIo::send_batch`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SendOutcome {
    /// Datagrams handed to the kernel.
    pub sent: usize,
    /// Datagrams the kernel refused.
    pub failed: usize,
    /// A local address the kernel refused as a source (the first, if several were): the
    /// datagrams that named it went out without it. The caller should forget it
    /// ([`Engine::forget_local`](crate::Engine::forget_local)).
    pub refused_source: Option<IpAddr>,
}
