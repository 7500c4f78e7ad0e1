//! Where the engine puts the packets it wants sent.
//!
//! An [`Outbox`] holds two [`Batch`]es: datagrams for the network and IP packets for the TUN
//! device. Each batch is one contiguous byte buffer plus a list of entries; clearing keeps the
//! capacity, so in steady state the engine allocates nothing per packet.

use std::net::SocketAddr;
use std::ops::Range;

/// A batch of packets in one contiguous buffer.
#[derive(Debug, Default)]
pub struct Batch {
    data: Vec<u8>,
    entries: Vec<(Option<SocketAddr>, Range<usize>)>,
    reserved_at: usize,
}

impl Batch {
    /// A batch with room for `bytes` of packets before it grows.
    pub fn with_capacity(bytes: usize, packets: usize) -> Self {
        Self {
            data: Vec::with_capacity(bytes),
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
        self.data.len()
    }

    /// Forgets all packets, keeping the capacity.
    pub fn clear(&mut self) {
        self.data.clear();
        self.entries.clear();
        self.reserved_at = 0;
    }

    /// The packet at `i` with its destination (network batches only).
    pub fn get(&self, i: usize) -> Option<(Option<SocketAddr>, &[u8])> {
        let (addr, range) = self.entries.get(i)?;
        Some((*addr, &self.data[range.clone()]))
    }

    /// Iterates over `(destination, packet)`.
    pub fn iter(&self) -> impl Iterator<Item = (Option<SocketAddr>, &[u8])> + '_ {
        self.entries
            .iter()
            .map(|(addr, range)| (*addr, &self.data[range.clone()]))
    }

    /// Reserves `max` zeroed bytes at the end for the next packet and returns them.
    ///
    /// Follow with [`Batch::commit`] or [`Batch::abort`]; a second `reserve` aborts the first.
    pub(crate) fn reserve(&mut self, max: usize) -> &mut [u8] {
        self.data.truncate(self.committed_end());
        self.reserved_at = self.data.len();
        self.data.resize(self.reserved_at + max, 0);
        &mut self.data[self.reserved_at..]
    }

    /// Keeps `len` bytes starting `offset` bytes into the reservation as a packet to `addr`.
    pub(crate) fn commit(&mut self, addr: Option<SocketAddr>, offset: usize, len: usize) {
        let start = self.reserved_at;
        if offset != 0 {
            self.data
                .copy_within(start + offset..start + offset + len, start);
        }
        self.data.truncate(start + len);
        self.entries.push((addr, start..start + len));
        self.reserved_at = self.data.len();
    }

    /// Drops the reservation.
    pub(crate) fn abort(&mut self) {
        self.data.truncate(self.committed_end());
        self.reserved_at = self.data.len();
    }

    /// Appends a copy of `packet` to `addr`.
    pub(crate) fn push_copy(&mut self, addr: Option<SocketAddr>, packet: &[u8]) {
        self.abort();
        let start = self.data.len();
        self.data.extend_from_slice(packet);
        self.entries.push((addr, start..start + packet.len()));
        self.reserved_at = self.data.len();
    }

    fn committed_end(&self) -> usize {
        self.entries.last().map_or(0, |(_, r)| r.end)
    }
}

/// The engine's output for one batch of input.
#[derive(Debug, Default)]
pub struct Outbox {
    /// WireGuard datagrams to send, each with its destination.
    pub to_network: Batch,
    /// Decrypted IP packets to write to the TUN device.
    pub to_tunnel: Batch,
}

impl Outbox {
    /// An outbox sized for `packets` packets of up to `packet_size` bytes in each direction.
    pub fn with_capacity(packets: usize, packet_size: usize) -> Self {
        Self {
            to_network: Batch::with_capacity(packets * packet_size, packets),
            to_tunnel: Batch::with_capacity(packets * packet_size, packets),
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
        b.commit(Some(addr), 0, 3);
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
