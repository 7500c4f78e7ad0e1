//! Outbound packets: IP packets read from the TUN device, routed to their peer by destination
//! and encrypted into datagrams for the network (the crypto itself in `crypto.rs`).

use std::time::Instant;

use boringtun::noise::TunnResult;

use super::crypto::{run_jobs, SealJob};
use super::peer::{PeerCore, PeerShared};
use super::run::{cached_lookup, PeerRun, Run};
use super::{reason_for, Engine, State, DATA_OVERHEAD, MIN_OUTPUT};
use crate::outbox::{offset_within, Outbox};
use crate::packet;
use crate::stats::DropReason;

impl Engine {
    /// Encrypts IP packets read from the TUN device into datagrams in `out.to_network`, in
    /// their order.
    ///
    /// Consecutive packets for the same peer (the pieces of one offloaded segment, typically)
    /// share one route lookup and one update of the peer's counters. Each packet for a peer with
    /// a session takes its counter in order under the peer's lock, and is sealed afterwards, on
    /// this thread or, for a big batch, on the device's helpers too (see `engine/crypto.rs`).
    pub fn handle_tunnel_packets<'p>(
        &self,
        now: Instant,
        packets: impl IntoIterator<Item = &'p [u8]>,
        out: &mut Outbox,
    ) {
        let state = self.state.load();
        let mut run = Run::default();
        let mut jobs = out.crypto.take_seal_jobs();
        for packet in packets {
            if let Err(reason) = self.claim_one(&state, now, packet, &mut run, out, &mut jobs) {
                self.drops.count(reason);
            }
        }
        drop(run);
        run_jobs(
            self.helpers(),
            &mut jobs,
            &out.crypto.sessions,
            out.to_network.bytes_mut(),
            // The datagrams are in the outbox already, in their order: nothing to go through.
            None,
        );
        out.crypto.keep_seal_jobs(jobs);
    }

    /// Takes the next counter of `packet`'s peer and the room for its datagram, leaving the
    /// sealing to a job; or, with no session yet, hands the packet to boringtun, which queues
    /// it and starts a handshake.
    fn claim_one<'s, 'p>(
        &self,
        state: &'s State,
        now: Instant,
        packet: &'p [u8],
        run: &mut Run<'s>,
        out: &mut Outbox,
        jobs: &mut Vec<SealJob<'p>>,
    ) -> Result<(), DropReason> {
        let destination = packet::destination(packet).ok_or(DropReason::NotIp)?;
        let entry =
            cached_lookup(&mut run.route, &state.routes, destination).ok_or(DropReason::NoRoute)?;
        let entry = state.route_to(entry);
        let peer = PeerRun::switch_to(&mut run.peer, entry);
        let shared = peer.shared();
        let mut guard = shared.core.lock();
        let core = &mut *guard;
        let endpoint = core.destination().ok_or(DropReason::NoEndpoint)?;
        let tunn = core.tunn.as_mut().ok_or(DropReason::NoPrivateKey)?;
        let Some(session) = tunn.sending_session() else {
            return Self::encapsulate_without_session(core, shared, now, packet, out);
        };
        let session = out.crypto.session_index(session);
        let counter = out.crypto.sessions[session]
            .reserve_sending_counters(1)
            .next();
        tunn.note_data_sent(packet.len());
        let len = packet.len() + DATA_OVERHEAD;
        let datagram = out.to_network.push_unwritten(Some(endpoint), len);
        jobs.push(SealJob {
            session,
            counter,
            plaintext: packet,
            datagram,
        });
        // A packet from the TUN is data (an empty one would be a keepalive).
        core.unanswered_since.get_or_insert(now);
        core.sent_at(now);
        peer.add_tx(len);
        Ok(())
    }

    /// boringtun's own path for a peer with no session: the packet waits in the tunnel's queue
    /// while a handshake initiation (if none is in flight) goes out.
    fn encapsulate_without_session(
        core: &mut PeerCore,
        shared: &PeerShared,
        now: Instant,
        packet: &[u8],
        out: &mut Outbox,
    ) -> Result<(), DropReason> {
        let endpoint = core.destination();
        let Some(tunn) = core.tunn.as_mut() else {
            return Err(DropReason::NoPrivateKey);
        };
        let slot = out
            .to_network
            .reserve((packet.len() + DATA_OVERHEAD).max(MIN_OUTPUT));
        let base = slot.as_ptr();
        match tunn.encapsulate(packet, slot) {
            TunnResult::WriteToNetwork(sent) => {
                let (offset, len) = (offset_within(base, sent), sent.len());
                shared.note_sent(core, sent, !packet.is_empty(), now);
                out.to_network.commit(endpoint, offset, len);
                core.sent_at(now);
                shared.add_tx(len);
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
