//! Outbound packets: IP packets read from the TUN device, routed to their peer by destination
//! and encrypted into datagrams for the network.

use std::time::Instant;

use boringtun::noise::TunnResult;

use super::run::{cached_lookup, PeerRun, Run};
use super::{reason_for, Engine, State, DATA_OVERHEAD, MIN_OUTPUT};
use crate::outbox::{offset_within, Outbox};
use crate::packet;
use crate::stats::DropReason;

impl Engine {
    /// Encrypts IP packets read from the TUN device into datagrams in `out.to_network`.
    ///
    /// Consecutive packets for the same peer (the pieces of one offloaded segment, typically)
    /// share one route lookup and one update of the peer's counters.
    pub fn handle_tunnel_packets<'p>(
        &self,
        now: Instant,
        packets: impl IntoIterator<Item = &'p [u8]>,
        out: &mut Outbox,
    ) {
        let state = self.state.load();
        let mut run = Run::default();
        for packet in packets {
            if let Err(reason) = self.encapsulate_one(&state, now, packet, &mut run, out) {
                self.drops.count(reason);
            }
        }
    }

    fn encapsulate_one<'s>(
        &self,
        state: &'s State,
        now: Instant,
        packet: &[u8],
        run: &mut Run<'s>,
        out: &mut Outbox,
    ) -> Result<(), DropReason> {
        let destination = packet::destination(packet).ok_or(DropReason::NotIp)?;
        let entry =
            cached_lookup(&mut run.route, &state.routes, destination).ok_or(DropReason::NoRoute)?;
        let peer = PeerRun::switch_to(&mut run.peer, entry);
        let shared = peer.shared();
        let mut guard = shared.core.lock();
        let core = &mut *guard;
        let endpoint = core.endpoint.ok_or(DropReason::NoEndpoint)?;
        let tunn = core.tunn.as_mut().ok_or(DropReason::NoPrivateKey)?;
        let slot = out
            .to_network
            .reserve((packet.len() + DATA_OVERHEAD).max(MIN_OUTPUT));
        let base = slot.as_ptr();
        match tunn.encapsulate(packet, slot) {
            TunnResult::WriteToNetwork(sent) => {
                let (offset, len) = (offset_within(base, sent), sent.len());
                // A packet from the TUN is data (an empty one would be a keepalive).
                shared.note_sent(core, sent, !packet.is_empty(), now);
                out.to_network.commit(Some(endpoint), offset, len);
                core.sent_at(now);
                peer.add_tx(len);
                Ok(())
            }
            TunnResult::Err(e) => {
                out.to_network.abort();
                Err(reason_for(e))
            }
            // Queued inside the tunnel until the handshake in progress completes.
            _ => {
                out.to_network.abort();
                Ok(())
            }
        }
    }
}
