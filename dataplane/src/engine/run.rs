//! Bookkeeping carried through one batch of packets: runs of consecutive packets for the same
//! peer share a route lookup and one update of the peer's byte counters.

use std::net::IpAddr;
use std::sync::Arc;

use super::peer::{PeerEntry, PeerShared};
use crate::allowed_ips::AllowedIps;

/// What one batch carries from packet to packet: the last routes looked up and the peer of the
/// current run, so a run of packets for one peer costs one route lookup and one update of the
/// peer's byte counters.
#[derive(Default)]
pub(super) struct Run<'s> {
    /// The last destination looked up for encryption, and its peer.
    pub(super) route: Option<(IpAddr, &'s Arc<PeerEntry>)>,
    /// The peer of the current run of packets.
    pub(super) peer: Option<PeerRun<'s>>,
}

/// Looks `address` up in `routes`, answering from `cache` when it holds the same address.
/// A miss is not cached (it is rare, and the lookup answers it quickly).
pub(super) fn cached_lookup<'s>(
    cache: &mut Option<(IpAddr, &'s Arc<PeerEntry>)>,
    routes: &'s AllowedIps<Arc<PeerEntry>>,
    address: IpAddr,
) -> Option<&'s Arc<PeerEntry>> {
    if let Some((cached, entry)) = *cache {
        if cached == address {
            return Some(entry);
        }
    }
    let entry = routes.lookup(address)?;
    *cache = Some((address, entry));
    Some(entry)
}

/// The peer of a run of consecutive packets of one batch: the shared byte counters are updated
/// once per run instead of once per packet. Dropping it (or switching to another peer) adds the
/// run's bytes.
///
/// It deliberately does not hold the peer's lock across the run: the lock covers the noise
/// call (boringtun's `Tunn` needs `&mut` to encrypt), so a run-long hold would stall the peer's
/// other direction (the acknowledgements another worker decrypts) for a whole batch. Measured
/// end to end, that cost about 5% of one TCP stream's throughput.
pub(crate) struct PeerRun<'s> {
    entry: &'s Arc<PeerEntry>,
    tx_bytes: usize,
    rx_bytes: usize,
}

impl<'s> PeerRun<'s> {
    /// The run of `entry` in `slot`: the one already there if it is the same peer, else a
    /// new one (the previous run's bytes are added first).
    pub(crate) fn switch_to<'a>(
        slot: &'a mut Option<PeerRun<'s>>,
        entry: &'s Arc<PeerEntry>,
    ) -> &'a mut PeerRun<'s> {
        if slot
            .as_ref()
            .is_some_and(|run| !Arc::ptr_eq(&run.entry.shared, &entry.shared))
        {
            *slot = None;
        }
        slot.get_or_insert_with(|| PeerRun {
            entry,
            tx_bytes: 0,
            rx_bytes: 0,
        })
    }

    /// The peer's shared state.
    pub(crate) fn shared(&self) -> &'s Arc<PeerShared> {
        &self.entry.shared
    }

    /// Counts bytes sent to this peer (added to its statistics when the run ends).
    pub(crate) fn add_tx(&mut self, bytes: usize) {
        self.tx_bytes += bytes;
    }

    /// Counts bytes received from this peer (added to its statistics when the run ends).
    pub(crate) fn add_rx(&mut self, bytes: usize) {
        self.rx_bytes += bytes;
    }
}

impl Drop for PeerRun<'_> {
    fn drop(&mut self) {
        let shared = &self.entry.shared;
        if self.tx_bytes > 0 {
            shared.add_tx(self.tx_bytes);
        }
        if self.rx_bytes > 0 {
            shared.add_rx(self.rx_bytes);
        }
    }
}
