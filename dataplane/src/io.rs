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
use std::net::SocketAddr;
use std::os::fd::RawFd;

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
}

/// Received datagrams: one buffer slot per datagram, reused across calls.
#[derive(Debug)]
pub struct RecvBatch {
    pub(crate) buffer: Vec<u8>,
    pub(crate) slot_size: usize,
    pub(crate) lens: Vec<usize>,
    pub(crate) sources: Vec<SocketAddr>,
    pub(crate) count: usize,
}

impl RecvBatch {
    /// Room for `slots` datagrams of up to `slot_size` bytes each.
    pub fn new(slots: usize, slot_size: usize) -> Self {
        Self {
            buffer: vec![0; slots * slot_size],
            slot_size,
            lens: vec![0; slots],
            sources: vec![SocketAddr::from(([0, 0, 0, 0], 0)); slots],
            count: 0,
        }
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.lens.len()
    }

    /// Datagrams received by the last call, with their sources.
    pub fn iter(&self) -> impl Iterator<Item = (SocketAddr, &[u8])> + '_ {
        (0..self.count).map(|i| {
            let start = i * self.slot_size;
            (self.sources[i], &self.buffer[start..start + self.lens[i]])
        })
    }

    /// Number of datagrams received by the last call.
    pub fn len(&self) -> usize {
        self.count
    }

    /// True when the last call received nothing.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Slot `i` for writing, used by implementations.
    pub(crate) fn slot_mut(&mut self, i: usize) -> &mut [u8] {
        let start = i * self.slot_size;
        &mut self.buffer[start..start + self.slot_size]
    }
}

/// A UDP socket (or its twin) of one address family.
pub trait UdpIo: Send + Sync + 'static {
    /// Receives as many waiting datagrams as fit in `batch`, without blocking.
    ///
    /// # Errors
    /// `WouldBlock` when none is waiting.
    fn recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize>;

    /// Sends every packet of `batch` whose destination is of this socket's family.
    ///
    /// Datagrams the kernel refuses (no route, buffer full) are counted in the result's second
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
}
