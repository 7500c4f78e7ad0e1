//! Inbound datagrams: each checked against the handshake rate limiter, matched to its peer (by
//! static key for an initiation, by session index otherwise), then answered or decrypted, with
//! the inner packet's source checked against the sender's allowed IPs.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use boringtun::noise::handshake::parse_handshake_anon;
use boringtun::noise::{errors::WireGuardError, Packet, TunnResult};

use super::peer::{self, PeerEntry, PeerShared};
use super::run::{cached_lookup, PeerRun, Run};
use super::{
    reason_for, Engine, State, COOKIE_REPLY, DATA_OVERHEAD, HANDSHAKE_INITIATION,
    HANDSHAKE_RESPONSE, MIN_OUTPUT,
};
use crate::key::PublicKey;
use crate::outbox::{offset_within, Outbox};
use crate::stats::{DropReason, RejectedHandshake};

impl Engine {
    /// Handles one datagram received from `from`: handshakes answered into `out.to_network`,
    /// decrypted packets into `out.to_tunnel`.
    pub fn handle_datagram(
        &self,
        now: Instant,
        from: SocketAddr,
        datagram: &[u8],
        out: &mut Outbox,
    ) {
        self.handle_datagrams(now, [(from, datagram)], out);
    }

    /// Handles a batch of received datagrams; see [`Engine::handle_datagram`]. Consecutive
    /// datagrams from the same peer share one update of the peer's counters, and their inner
    /// packets' sources one lookup.
    pub fn handle_datagrams<'p>(
        &self,
        now: Instant,
        datagrams: impl IntoIterator<Item = (SocketAddr, &'p [u8])>,
        out: &mut Outbox,
    ) {
        let state = self.state.load();
        let mut run = Run::default();
        for (from, datagram) in datagrams {
            if let Err(reason) = self.decapsulate_one(&state, now, from, datagram, &mut run, out) {
                self.drops.count(reason);
                if matches!(reason, DropReason::InvalidMac | DropReason::HandshakeFailed) {
                    self.rejected.record(RejectedHandshake {
                        reason,
                        from,
                        public_key: None,
                        at: SystemTime::now(),
                    });
                }
            }
        }
    }

    fn find_sender<'s>(
        &self,
        state: &'s State,
        now: Instant,
        from: SocketAddr,
        datagram: &[u8],
        out: &mut Outbox,
    ) -> Result<&'s Arc<PeerEntry>, DropReason> {
        let identity = state.identity.as_ref().ok_or(DropReason::NoPrivateKey)?;
        let mut cookie = [0u8; 64];
        let parsed =
            match identity
                .rate_limiter
                .verify_packet(Some(from.ip()), datagram, &mut cookie)
            {
                Ok(parsed) => parsed,
                Err(TunnResult::WriteToNetwork(reply)) => {
                    out.to_network.push_copy(Some(from), reply);
                    return Err(DropReason::CookieReplySent);
                }
                Err(TunnResult::Err(WireGuardError::InvalidMac)) => {
                    return Err(DropReason::InvalidMac)
                }
                Err(_) => return Err(DropReason::Malformed),
            };
        let index = match parsed {
            Packet::HandshakeInit(ref init) => {
                let half = parse_handshake_anon(
                    &identity.private_key.to_dalek(),
                    &identity.public_key.to_dalek(),
                    init,
                )
                .map_err(|_| DropReason::HandshakeFailed)?;
                let key = PublicKey::from_bytes(half.peer_static_public);
                return state.peers.get(&key).ok_or_else(|| {
                    self.held.hold(now, from, key, datagram);
                    self.rejected.record(RejectedHandshake {
                        reason: DropReason::UnknownPeer,
                        from,
                        public_key: Some(key),
                        at: SystemTime::now(),
                    });
                    DropReason::UnknownPeer
                });
            }
            Packet::HandshakeResponse(ref r) => r.receiver_idx,
            Packet::PacketCookieReply(ref c) => c.receiver_idx,
            Packet::PacketData(ref d) => d.receiver_idx,
        };
        state
            .by_index
            .get(&(index >> 8))
            .ok_or(DropReason::UnknownIndex)
    }

    fn decapsulate_one<'s>(
        &self,
        state: &'s State,
        now: Instant,
        from: SocketAddr,
        datagram: &[u8],
        run: &mut Run<'s>,
        out: &mut Outbox,
    ) -> Result<(), DropReason> {
        let entry = self.find_sender(state, now, from, datagram, out)?;
        let message_type = datagram[0];
        let peer = PeerRun::switch_to(&mut run.peer, entry);
        let shared = peer.shared();
        let mut guard = shared.core.lock();
        let core = &mut *guard;
        let Some(tunn) = core.tunn.as_mut() else {
            return Err(DropReason::NoPrivateKey);
        };
        let slot = out.to_tunnel.reserve(datagram.len().max(MIN_OUTPUT));
        let base = slot.as_ptr();
        let result = tunn.decapsulate(Some(from.ip()), datagram, slot);
        let carried_data = matches!(
            result,
            TunnResult::WriteToTunnelV4(..) | TunnResult::WriteToTunnelV6(..)
        );
        let mut replied = false;
        let outcome = match result {
            TunnResult::WriteToTunnelV4(inner, source) => {
                let (offset, len) = (offset_within(base, inner), inner.len());
                let owner = cached_lookup(&mut run.source, &state.routes, source.into());
                Self::deliver_inner(owner, shared, offset, len, out)
            }
            TunnResult::WriteToTunnelV6(inner, source) => {
                let (offset, len) = (offset_within(base, inner), inner.len());
                let owner = cached_lookup(&mut run.source, &state.routes, source.into());
                Self::deliver_inner(owner, shared, offset, len, out)
            }
            TunnResult::WriteToNetwork(reply) => {
                // A handshake response, or the keepalive confirming our initiation. Both go
                // back where the message came from.
                shared.add_tx(reply.len());
                out.to_network.push_copy(Some(from), reply);
                out.to_tunnel.abort();
                replied = true;
                Ok(())
            }
            TunnResult::Done => {
                out.to_tunnel.abort();
                Ok(())
            }
            TunnResult::Err(e) => {
                out.to_tunnel.abort();
                if matches!(message_type, HANDSHAKE_INITIATION | HANDSHAKE_RESPONSE) {
                    shared.handshake_failures.fetch_add(1, Ordering::Relaxed);
                }
                return Err(reason_for(e));
            }
        };
        // The message authenticated (even if its inner packet was then refused): roam to its
        // source, count it, and note handshakes.
        core.last_received = Some(now);
        core.unanswered_since = None;
        if carried_data {
            core.unacknowledged_since.get_or_insert(now);
        }
        if message_type != COOKIE_REPLY {
            shared.set_endpoint(core, from);
        }
        if matches!(message_type, HANDSHAKE_INITIATION | HANDSHAKE_RESPONSE) {
            core.initiation_pending = false;
            core.eager_retry = None;
            core.last_handshake = Some(now);
            shared.handshakes.fetch_add(1, Ordering::Relaxed);
        }
        if replied {
            // A session just came up: send what the tunnel queued while it had none.
            core.sent_at(now);
            Self::flush_queued(core, shared, out);
        }
        peer.add_rx(datagram.len());
        outcome
    }

    /// Keeps the decrypted packet reserved in `out.to_tunnel` if the peer whose allowed IPs
    /// hold its source (`owner`) is the one that sent it (cryptokey routing's reverse-path
    /// check), else drops it.
    fn deliver_inner(
        owner: Option<&Arc<PeerEntry>>,
        sender: &Arc<PeerShared>,
        offset: usize,
        len: usize,
        out: &mut Outbox,
    ) -> Result<(), DropReason> {
        if owner.is_some_and(|owner| Arc::ptr_eq(&owner.shared, sender)) {
            out.to_tunnel.commit(None, offset, len);
            Ok(())
        } else {
            out.to_tunnel.abort();
            Err(DropReason::SourceNotAllowed)
        }
    }

    /// Sends the packets the tunnel queued while it had no session.
    fn flush_queued(core: &mut peer::PeerCore, shared: &PeerShared, out: &mut Outbox) {
        let endpoint = core.endpoint;
        let Some(tunn) = core.tunn.as_mut() else {
            return;
        };
        loop {
            let slot = out.to_network.reserve(u16::MAX as usize + DATA_OVERHEAD);
            let base = slot.as_ptr();
            match tunn.decapsulate(None, &[], slot) {
                TunnResult::WriteToNetwork(sent) => {
                    let (offset, len) = (offset_within(base, sent), sent.len());
                    out.to_network.commit(endpoint, offset, len);
                    shared.add_tx(len);
                }
                _ => {
                    out.to_network.abort();
                    break;
                }
            }
        }
    }
}
