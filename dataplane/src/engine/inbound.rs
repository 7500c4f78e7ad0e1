//! Inbound datagrams: each checked against the handshake rate limiter, matched to its peer (by
//! static key for an initiation, by session index otherwise), then answered or decrypted, with
//! the inner packet's source checked against the sender's allowed IPs.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use boringtun::noise::handshake::parse_handshake_anon;
use boringtun::noise::session::Session;
use boringtun::noise::{errors::WireGuardError, Packet, TunnResult};
use parking_lot::MutexGuard;

use super::crypto::{run_jobs, OpenJob, Opened, DATA_HEADER};
use super::peer::{self, PeerCore, PeerEntry, PeerShared};
use super::run::{PeerRun, Run};
use super::{
    reason_for, Engine, State, COOKIE_REPLY, DATA_OVERHEAD, HANDSHAKE_INITIATION,
    HANDSHAKE_RESPONSE, MIN_OUTPUT,
};
use crate::key::PublicKey;
use crate::outbox::{offset_within, Outbox, PacketList};
use crate::stats::{DropReason, RejectedHandshake};

/// Who sent a datagram, and whether it is a data message.
enum Sender<'s> {
    Data(DataMessage<'s>),
    /// A handshake message or a cookie reply, from this peer.
    Other(&'s Arc<PeerEntry>),
}

/// A data message's peer and header.
struct DataMessage<'s> {
    entry: &'s Arc<PeerEntry>,
    receiver_idx: u32,
    counter: u64,
}

/// The first bytes of a data message: its type, 4, as a little-endian word.
const DATA_MESSAGE_TYPE: [u8; 4] = [4, 0, 0, 0];

/// The data message `datagram`, if it is one for the same session as the last job's (the
/// common case in a batch: a run of one peer's packets), without the lookups
/// [`Engine::find_sender`] makes for the first of a run.
fn continues_run<'s>(jobs: &[OpenJob<'s, '_>], datagram: &[u8]) -> Option<DataMessage<'s>> {
    let last = jobs.last()?;
    if datagram.len() < DATA_OVERHEAD || datagram[..4] != DATA_MESSAGE_TYPE {
        return None;
    }
    let receiver_idx = u32::from_le_bytes(datagram[4..8].try_into().ok()?);
    (receiver_idx == last.receiver_idx).then(|| DataMessage {
        entry: last.entry,
        receiver_idx,
        counter: data_counter(datagram),
    })
}

/// The counter in a data message's header (the datagram is at least a header long).
fn data_counter(datagram: &[u8]) -> u64 {
    u64::from_le_bytes(datagram[8..16].try_into().expect("8 bytes"))
}

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
    /// datagrams from the same peer share one update of the peer's counters and one hold of its
    /// lock for the bookkeeping. Data messages are opened after the walk through the batch
    /// (on this thread or, for a big batch, on the device's helpers too: see
    /// `engine/crypto.rs`) and delivered in their order; a handshake message in the batch is
    /// handled after the data before it.
    pub fn handle_datagrams<'p>(
        &self,
        now: Instant,
        datagrams: impl IntoIterator<Item = (SocketAddr, &'p [u8])>,
        out: &mut Outbox,
    ) {
        let state = self.state.load();
        let mut run = Run::default();
        let mut jobs = out.crypto.take_open_jobs();
        for (from, datagram) in datagrams {
            let sender = match continues_run(&jobs, datagram) {
                Some(data) => Ok(Sender::Data(data)),
                None => self.find_sender(&state, now, from, datagram, out),
            };
            let claimed = match sender {
                Ok(Sender::Data(data)) => {
                    Self::claim_data(&state, data, from, datagram, out, &mut jobs)
                }
                Ok(Sender::Other(entry)) => {
                    self.open_and_deliver(now, &mut jobs, &mut run, out);
                    self.decapsulate_one(entry, now, from, datagram, &mut run, out)
                }
                Err(reason) => Err(reason),
            };
            if let Err(reason) = claimed {
                self.count_refused(reason, from);
            }
        }
        self.open_and_deliver(now, &mut jobs, &mut run, out);
        out.crypto.keep_open_jobs(jobs);
    }

    fn count_refused(&self, reason: DropReason, from: SocketAddr) {
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

    /// Takes the session a data message is for and sets room aside for its plaintext, leaving
    /// the opening to a job.
    fn claim_data<'s, 'p>(
        state: &'s State,
        data: DataMessage<'s>,
        from: SocketAddr,
        datagram: &'p [u8],
        out: &mut Outbox,
        jobs: &mut Vec<OpenJob<'s, 'p>>,
    ) -> Result<(), DropReason> {
        let same_session = jobs.last().filter(|last| {
            last.receiver_idx == data.receiver_idx && Arc::ptr_eq(last.entry, data.entry)
        });
        let session_index = if let Some(last) = same_session {
            last.session
        } else {
            let core = data.entry.shared.core.lock();
            let tunn = core.tunn.as_ref().ok_or(DropReason::NoPrivateKey)?;
            let session = tunn
                .receiving_session(data.receiver_idx)
                .ok_or(reason_for(WireGuardError::NoCurrentSession))?;
            out.crypto.session_index(session)
        };
        // The replay window's first check, before any decryption (a replayed flood costs no
        // AEAD); the second comes when the packet is delivered, in order.
        let counter = out.crypto.sessions[session_index]
            .check_receiving_counter(data.receiver_idx, data.counter)
            .map_err(reason_for)?;
        let sealed = &datagram[DATA_HEADER..];
        jobs.push(OpenJob {
            entry: data.entry,
            routes: &state.routes,
            from,
            datagram_len: datagram.len(),
            session: session_index,
            receiver_idx: data.receiver_idx,
            counter: Some(counter),
            opened_counter: None,
            sealed,
            plaintext: out.to_tunnel.set_aside(sealed.len()),
            opened: Opened::Pending,
        });
        Ok(())
    }

    /// Opens the data messages claimed so far and, in their order, notes each one that
    /// authenticated and delivers its inner packet: the first ones while the helpers, if any,
    /// still open the last.
    fn open_and_deliver<'s>(
        &self,
        now: Instant,
        jobs: &mut Vec<OpenJob<'s, '_>>,
        run: &mut Run<'s>,
        out: &mut Outbox,
    ) {
        if jobs.is_empty() {
            return;
        }
        let sessions = &out.crypto.sessions;
        let (buffer, mut packets) = out.to_tunnel.split_for_fill();
        let mut deliver = |opened: &mut [OpenJob<'s, '_>]| {
            self.deliver_opened(now, opened, sessions, run, &mut packets);
        };
        run_jobs(self.helpers(), jobs, sessions, buffer, Some(&mut deliver));
        jobs.clear();
        out.crypto.sessions.clear();
    }

    /// Goes through opened `jobs` in order: the replay window's second check, the peer's
    /// bookkeeping, and the inner packet into `packets`.
    fn deliver_opened<'s>(
        &self,
        now: Instant,
        jobs: &mut [OpenJob<'s, '_>],
        sessions: &[Arc<Session>],
        run: &mut Run<'s>,
        packets: &mut PacketList<'_>,
    ) {
        // One lock per run of messages from one peer: the bookkeeping under it is short.
        let mut held: Option<(&Arc<PeerShared>, MutexGuard<'_, PeerCore>)> = None;
        for job in jobs {
            if let Some(opened) = job.opened_counter.take() {
                // The replay window's second check: a packet opened twice in this batch, or
                // overtaken by too many others, is refused here.
                if let Err(error) = sessions[job.session].mark_received(opened) {
                    self.count_refused(reason_for(error), job.from);
                    continue;
                }
            }
            let peer = PeerRun::switch_to(&mut run.peer, job.entry);
            let shared = peer.shared();
            if !held.as_ref().is_some_and(|(h, _)| Arc::ptr_eq(h, shared)) {
                drop(held.take());
                held = Some((shared, shared.core.lock()));
            }
            let core = &mut *held.as_mut().expect("just locked").1;
            let delivered = Self::note_opened(now, job, shared, core).and_then(|inner| {
                peer.add_rx(job.datagram_len);
                match inner {
                    None => Ok(()),
                    Some((true, len)) => {
                        let start = job.plaintext.start;
                        packets.push_range(None, start..start + len);
                        Ok(())
                    }
                    Some((false, _)) => Err(DropReason::SourceNotAllowed),
                }
            });
            if let Err(reason) = delivered {
                self.count_refused(reason, job.from);
            }
        }
    }

    /// What [`Engine::decapsulate_one`] notes after boringtun opened a data message, for a job:
    /// the session in use, boringtun's timers, roaming, and when the peer was last heard from.
    /// Returns, if it carries an inner packet, whether its source is the sender's and its length.
    fn note_opened(
        now: Instant,
        job: &OpenJob<'_, '_>,
        shared: &PeerShared,
        core: &mut PeerCore,
    ) -> Result<Option<(bool, usize)>, DropReason> {
        let Some(tunn) = core.tunn.as_mut() else {
            return Err(DropReason::NoPrivateKey);
        };
        let inner = match job.opened {
            Opened::Inner { len, allowed, .. } => Some((allowed, len)),
            Opened::Keepalive => None,
            Opened::NotIp => {
                tunn.note_data_received(job.receiver_idx, 0);
                return Err(DropReason::InvalidInnerPacket);
            }
            Opened::Failed(reason) => return Err(reason),
            Opened::Pending => return Err(DropReason::Other),
        };
        tunn.note_data_received(job.receiver_idx, inner.map_or(0, |(_, len)| len));
        // The message authenticated (even if its inner packet is then refused): roam to its
        // source and count it.
        core.last_received = Some(now);
        core.unanswered_since = None;
        shared.set_endpoint(core, job.from);
        if inner.is_some() {
            core.unacknowledged_since.get_or_insert(now);
        }
        Ok(inner)
    }

    /// The peer a datagram comes from, after the rate limiter's checks: by static key for an
    /// initiation, by receiver index otherwise.
    fn find_sender<'s>(
        &self,
        state: &'s State,
        now: Instant,
        from: SocketAddr,
        datagram: &[u8],
        out: &mut Outbox,
    ) -> Result<Sender<'s>, DropReason> {
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
                return state.peers.get(&key).map(Sender::Other).ok_or_else(|| {
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
            Packet::PacketData(ref d) => {
                let entry = state
                    .by_index
                    .get(&(d.receiver_idx >> 8))
                    .ok_or(DropReason::UnknownIndex)?;
                // boringtun parsed it: a data message is at least header and tag long.
                let counter = data_counter(datagram);
                return Ok(Sender::Data(DataMessage {
                    entry,
                    receiver_idx: d.receiver_idx,
                    counter,
                }));
            }
        };
        state
            .by_index
            .get(&(index >> 8))
            .map(Sender::Other)
            .ok_or(DropReason::UnknownIndex)
    }

    /// Handles a handshake message (or a cookie reply) from `entry` through boringtun.
    fn decapsulate_one<'s>(
        &self,
        entry: &'s Arc<PeerEntry>,
        now: Instant,
        from: SocketAddr,
        datagram: &[u8],
        run: &mut Run<'s>,
        out: &mut Outbox,
    ) -> Result<(), DropReason> {
        let message_type = datagram[0];
        let peer = PeerRun::switch_to(&mut run.peer, entry);
        let shared = peer.shared();
        let mut guard = shared.core.lock();
        let core = &mut *guard;
        let Some(tunn) = core.tunn.as_mut() else {
            return Err(DropReason::NoPrivateKey);
        };
        // The to-tunnel batch's scratch holds boringtun's reply; nothing is delivered from it.
        let slot = out.to_tunnel.reserve(datagram.len().max(MIN_OUTPUT));
        let result = tunn.decapsulate(Some(from.ip()), datagram, slot);
        let mut replied = false;
        match result {
            TunnResult::WriteToNetwork(reply) => {
                // A handshake response, or the keepalive confirming our initiation. Both go
                // back where the message came from.
                shared.add_tx(reply.len());
                out.to_network.push_copy(Some(from), reply);
                replied = true;
            }
            TunnResult::Err(e) => {
                out.to_tunnel.abort();
                if matches!(message_type, HANDSHAKE_INITIATION | HANDSHAKE_RESPONSE) {
                    shared.handshake_failures.fetch_add(1, Ordering::Relaxed);
                }
                return Err(reason_for(e));
            }
            // A handshake message or a cookie reply carries no packet for the TUN device.
            TunnResult::Done
            | TunnResult::WriteToTunnelV4(..)
            | TunnResult::WriteToTunnelV6(..) => {}
        }
        out.to_tunnel.abort();
        // The message authenticated: roam to its source, count it, and note handshakes.
        core.last_received = Some(now);
        core.unanswered_since = None;
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
        Ok(())
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
