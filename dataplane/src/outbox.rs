//! Where the engine puts the packets it wants sent.
//!
//! An [`Outbox`] holds two [`Batch`]es: datagrams for the network and IP packets for the TUN
//! device. Each batch is one contiguous byte buffer plus a list of entries; clearing keeps the
//! capacity, so in steady state the engine allocates nothing per packet.

use std::net::SocketAddr;
use std::ops::Range;

use crate::endpoint::Endpoint;
use crate::engine::CryptoScratch;

/// A batch of packets in one contiguous buffer. A datagram for the network has an
/// [`Endpoint`]: where it goes and, when known, the local address it leaves from.
///
/// The buffer never shrinks: bytes past the last packet are scratch left from earlier packets,
/// so reserving room for the next packet zeroes memory only the first time the batch grows
/// that far, not once per packet.
#[derive(Debug, Default)]
pub struct Batch {
    data: Vec<u8>,
    /// End of the last committed packet; `data` past it is scratch.
    end: usize,
    entries: Vec<(Option<Endpoint>, Range<usize>)>,
    reserved_at: usize,
}

impl Batch {
    /// A batch with room for `bytes` of packets before it grows.
    pub fn with_capacity(bytes: usize, packets: usize) -> Self {
        Self {
            data: Vec::with_capacity(bytes),
            end: 0,
            entries: Vec::with_capacity(packets),
            reserved_at: 0,
        }
    }

    /// Number of packets.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when there is no packet.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes used by packets.
    pub fn bytes(&self) -> usize {
        self.end
    }

    /// Forgets all packets, keeping the capacity.
    pub fn clear(&mut self) {
        self.end = 0;
        self.entries.clear();
        self.reserved_at = 0;
    }

    /// The packet at `i` with its destination (network batches only).
    pub fn get(&self, i: usize) -> Option<(Option<SocketAddr>, &[u8])> {
        let (to, range) = self.entries.get(i)?;
        Some((to.map(|e| e.peer), &self.data[range.clone()]))
    }

    /// Iterates over `(destination, packet)`.
    pub fn iter(&self) -> impl Iterator<Item = (Option<SocketAddr>, &[u8])> + '_ {
        self.entries
            .iter()
            .map(|(to, range)| (to.map(|e| e.peer), &self.data[range.clone()]))
    }

    /// Iterates over `(endpoint, packet)`: the destination with the source to send from.
    pub fn iter_endpoints(&self) -> impl Iterator<Item = (Option<Endpoint>, &[u8])> + '_ {
        self.entries
            .iter()
            .map(|(to, range)| (*to, &self.data[range.clone()]))
    }

    /// Reserves `max` bytes at the end for the next packet and returns them. They hold
    /// whatever earlier packets left there (zeroes where the batch never reached): the caller
    /// writes what it commits.
    ///
    /// Follow with [`Batch::commit`] or [`Batch::abort`]; a second `reserve` aborts the first.
    pub(crate) fn reserve(&mut self, max: usize) -> &mut [u8] {
        self.reserved_at = self.end;
        let needed = self.reserved_at + max;
        if self.data.len() < needed {
            self.data.resize(needed, 0);
        }
        &mut self.data[self.reserved_at..needed]
    }

    /// Keeps `len` bytes starting `offset` bytes into the reservation as a packet to `addr`.
    pub(crate) fn commit(&mut self, addr: Option<Endpoint>, offset: usize, len: usize) {
        let start = self.reserved_at;
        if offset != 0 {
            self.data
                .copy_within(start + offset..start + offset + len, start);
        }
        self.entries.push((addr, start..start + len));
        self.end = start + len;
        self.reserved_at = self.end;
    }

    /// Drops the reservation.
    pub(crate) fn abort(&mut self) {
        self.reserved_at = self.end;
    }

    /// Appends a packet of `len` bytes to `addr` whose bytes the caller writes later (through
    /// [`Batch::bytes_mut`], at the returned range) and before anyone reads the batch.
    pub(crate) fn push_unwritten(&mut self, addr: Option<Endpoint>, len: usize) -> Range<usize> {
        self.reserve(len);
        self.commit(addr, 0, len);
        self.end - len..self.end
    }

    /// Sets aside `len` bytes at the end, with no packet yet: [`PacketList::push_range`] makes a
    /// packet of part of them later, or nothing does (the bytes are then unused until the batch
    /// is cleared).
    pub(crate) fn set_aside(&mut self, len: usize) -> Range<usize> {
        self.reserve(len);
        self.end += len;
        self.reserved_at = self.end;
        self.end - len..self.end
    }

    /// The batch's whole buffer, packets and scratch, for writing packets in place.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.data
    }

    /// The batch's whole buffer, for writing packets in place in bytes set aside, and its list
    /// of packets apart, for making packets of them meanwhile.
    pub(crate) fn split_for_fill(&mut self) -> (&mut [u8], PacketList<'_>) {
        (
            &mut self.data,
            PacketList {
                entries: &mut self.entries,
                end: self.end,
            },
        )
    }

    /// Appends a copy of `packet` to `addr`.
    pub(crate) fn push_copy(&mut self, addr: Option<Endpoint>, packet: &[u8]) {
        let len = packet.len();
        self.reserve(len).copy_from_slice(packet);
        self.commit(addr, 0, len);
    }
}

/// A batch's list of packets, apart from its buffer (see [`Batch::split_for_fill`]).
pub(crate) struct PacketList<'b> {
    entries: &'b mut Vec<(Option<Endpoint>, Range<usize>)>,
    end: usize,
}

impl PacketList<'_> {
    /// Appends the packet at `range`, bytes set aside earlier by [`Batch::set_aside`].
    pub(crate) fn push_range(&mut self, addr: Option<Endpoint>, range: Range<usize>) {
        debug_assert!(range.end <= self.end);
        self.entries.push((addr, range));
    }
}

/// The engine's output for one batch of input.
#[derive(Debug, Default)]
pub struct Outbox {
    /// WireGuard datagrams to send, each with its destination.
    pub to_network: Batch,
    /// Decrypted IP packets to write to the TUN device.
    pub to_tunnel: Batch,
    /// The engine's scratch for one batch's crypto, kept here so that its capacity is reused.
    pub(crate) crypto: CryptoScratch,
}

impl Outbox {
    /// An outbox sized for `packets` packets of up to `packet_size` bytes in each direction.
    pub fn with_capacity(packets: usize, packet_size: usize) -> Self {
        Self {
            to_network: Batch::with_capacity(packets * packet_size, packets),
            to_tunnel: Batch::with_capacity(packets * packet_size, packets),
            crypto: CryptoScratch::default(),
        }
    }

    /// Forgets all packets in both directions, keeping the capacity.
    pub fn clear(&mut self) {
        self.to_network.clear();
        self.to_tunnel.clear();
    }

    /// True when nothing waits to be sent in either direction.
    pub fn is_empty(&self) -> bool {
        self.to_network.is_empty() && self.to_tunnel.is_empty()
    }
}

/// The byte offset of `inner` within `outer`; `inner` must be a sub-slice of `outer`.
pub(crate) fn offset_within(outer: *const u8, inner: &[u8]) -> usize {
    (inner.as_ptr() as usize).saturating_sub(outer as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_commit_keeps_only_the_used_bytes() {
        let mut b = Batch::with_capacity(64, 4);
        let addr: SocketAddr = "127.0.0.1:1".parse().unwrap();
        b.reserve(100)[..3].copy_from_slice(b"abc");
        b.commit(Some(addr.into()), 0, 3);
        let slot = b.reserve(100);
        slot[5..7].copy_from_slice(b"xy");
        b.commit(None, 5, 2);
        b.reserve(50);
        b.abort();
        b.push_copy(None, b"zz");
        let got: Vec<_> = b.iter().map(|(a, p)| (a, p.to_vec())).collect();
        assert_eq!(
            got,
            vec![
                (Some(addr), b"abc".to_vec()),
                (None, b"xy".to_vec()),
                (None, b"zz".to_vec())
            ]
        );
        assert_eq!(b.bytes(), 7);
        b.clear();
        assert!(b.is_empty());
        assert_eq!(b.bytes(), 0);
        assert_eq!(b.iter().count(), 0);
    }

    #[test]
    fn reserving_again_after_clear_zeroes_nothing() {
        let mut b = Batch::with_capacity(4096, 8);
        b.reserve(1500).fill(0xaa);
        b.commit(None, 0, 1500);
        b.clear();
        // The scratch left by the first packet is handed out again as is (not zeroed), and
        // only what is committed counts.
        let slot = b.reserve(1500);
        assert!(slot.iter().all(|&x| x == 0xaa));
        slot[..2].copy_from_slice(b"ok");
        b.commit(None, 0, 2);
        assert_eq!(b.get(0).unwrap().1, b"ok");
        assert_eq!(b.bytes(), 2);
    }

    #[test]
    fn capacity_is_reused_after_clear() {
        let mut b = Batch::with_capacity(4096, 8);
        for _ in 0..3 {
            for _ in 0..2 {
                b.reserve(1500);
                b.commit(None, 0, 1400);
            }
            b.clear();
        }
        assert!(b.data.capacity() >= 4096);
        assert_eq!(b.data.capacity(), 4096);
    }
}
