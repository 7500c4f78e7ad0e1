//! Inbound datagrams: each checked against the handshake rate limiter, matched to its peer (by
//! static key for an initiation, by session index otherwise), then answered or decrypted, with
//! the inner packet's source checked against the sender's allowed IPs.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use boringtun::noise::handshake::parse_handshake_anon;
use boringtun::noise::session::{ReceivingWindow, Session};
use boringtun::noise::{errors::WireGuardError, Packet, TunnResult};
use parking_lot::MutexGuard;

use super::crypto::{
    check_counters, locked_window, run_jobs, JobCounter, OpenBatch, OpenJob, OpenNote, Opened,
    DATA_HEADER,
};
use super::peer::{self, PeerCore, PeerEntry, PeerShared};
use super::run::{PeerRun, Run};
use super::{
    reason_for, wall_time, Engine, State, COOKIE_REPLY, DATA_OVERHEAD, HANDSHAKE_INITIATION,
    HANDSHAKE_RESPONSE, MIN_OUTPUT,
};
use crate::endpoint::Endpoint;
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
fn continues_run<'s>(batch: &OpenBatch<'s, '_>, datagram: &[u8]) -> Option<DataMessage<'s>> {
    let (last, note) = (batch.jobs.last()?, batch.notes.last()?);
    if datagram.len() < DATA_OVERHEAD || datagram[..4] != DATA_MESSAGE_TYPE {
        return None;
    }
    let receiver_idx = u32::from_le_bytes(datagram[4..8].try_into().ok()?);
    (receiver_idx == note.receiver_idx).then(|| DataMessage {
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
    /// Handles one datagram received from `from` (a peer's address, or an [`Endpoint`] that
    /// also names the local address it was sent to): handshakes answered into
    /// `out.to_network`, decrypted packets into `out.to_tunnel`. A datagram that authenticates
    /// makes `from` the peer's endpoint: what goes to the peer then leaves from that local
    /// address.
    pub fn handle_datagram(
        &self,
        now: Instant,
        from: impl Into<Endpoint>,
        datagram: &[u8],
        out: &mut Outbox,
    ) {
        self.handle_datagrams(now, [(from.into(), datagram)], out);
    }

    /// Handles a batch of received datagrams; see [`Engine::handle_datagram`]. Consecutive
    /// datagrams from the same peer share one update of the peer's counters and one hold of its
    /// lock for the bookkeeping. Data messages are opened after the walk through the batch
    /// (on this thread or, for a big batch, on the device's helpers too: see
    /// `engine/crypto.rs`) and delivered in their order; a handshake message in the batch is
    /// handled after the data before it.
    pub fn handle_datagrams<'p, F: Into<Endpoint>>(
        &self,
        now: Instant,
        datagrams: impl IntoIterator<Item = (F, &'p [u8])>,
        out: &mut Outbox,
    ) {
        let state = self.state.load();
        let mut run = Run::default();
        let mut batch = out.crypto.take_open_batch();
        for (from, datagram) in datagrams {
            let from: Endpoint = from.into();
            let sender = match continues_run(&batch, datagram) {
                Some(data) => Ok(Sender::Data(data)),
                None => self.find_sender(&state, now, from, datagram, out),
            };
            let claimed = match sender {
                Ok(Sender::Data(data)) => {
                    Self::claim_data(&state, data, from, datagram, out, &mut batch)
                }
                Ok(Sender::Other(entry)) => {
                    self.open_and_deliver(now, &mut batch, &mut run, out);
                    self.decapsulate_one(entry, now, from, datagram, &mut run, out)
                }
                Err(reason) => Err(reason),
            };
            if let Err(reason) = claimed {
                self.count_refused(now, reason, from.peer);
            }
        }
        self.open_and_deliver(now, &mut batch, &mut run, out);
        out.crypto.keep_open_batch(batch);
    }

    fn count_refused(&self, now: Instant, reason: DropReason, from: SocketAddr) {
        self.drops.count(reason);
        if matches!(reason, DropReason::InvalidMac | DropReason::HandshakeFailed) {
            self.rejected.record(RejectedHandshake {
                reason,
                from,
                public_key: None,
                at: wall_time(self.clock_anchor, now),
            });
        }
    }

    /// Takes the session a data message is for and sets room aside for its plaintext, leaving
    /// the opening to a job.
    fn claim_data<'s, 'p>(
        state: &'s State,
        data: DataMessage<'s>,
        from: Endpoint,
        datagram: &'p [u8],
        out: &mut Outbox,
        batch: &mut OpenBatch<'s, 'p>,
    ) -> Result<(), DropReason> {
        let same_session = batch.jobs.last().filter(|last| {
            batch.notes.last().map(|note| note.receiver_idx) == Some(data.receiver_idx)
                && Arc::ptr_eq(last.entry, data.entry)
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
        // The replay window's first check comes before any decryption, for the whole batch
        // (`check_counters`); the second when the packet is delivered, in order.
        let sealed = &datagram[DATA_HEADER..];
        batch.push(
            OpenJob {
                entry: data.entry,
                routes: &state.routes,
                session: session_index,
                counter: JobCounter::Unchecked(data.counter),
                sealed,
                plaintext_at: out.to_tunnel.set_aside(sealed.len()).start,
                opened: Opened::Pending,
            },
            OpenNote {
                from: from.peer,
                local: from.local,
                receiver_idx: data.receiver_idx,
            },
        );
        Ok(())
    }

    /// Opens the data messages claimed so far and, in their order, notes each one that
    /// authenticated and delivers its inner packet: the first ones while the helpers, if any,
    /// still open the last.
    fn open_and_deliver<'s>(
        &self,
        now: Instant,
        batch: &mut OpenBatch<'s, '_>,
        run: &mut Run<'s>,
        out: &mut Outbox,
    ) {
        if batch.jobs.is_empty() {
            return;
        }
        let sessions = &out.crypto.sessions;
        check_counters(&mut batch.jobs, &batch.notes, sessions);
        let (buffer, mut packets) = out.to_tunnel.split_for_fill();
        let notes = &batch.notes;
        let mut deliver = |range: Range<usize>, jobs: &mut [OpenJob<'s, '_>]| {
            self.deliver_opened(now, jobs, &notes[range], sessions, run, &mut packets);
        };
        run_jobs(
            self.helpers(),
            &mut batch.jobs,
            sessions,
            buffer,
            Some(&mut deliver),
        );
        batch.clear();
        out.crypto.sessions.clear();
    }

    /// Goes through opened jobs in order, with their notes: the replay window's
    /// second check, the peer's bookkeeping, and the inner packet into `packets`.
    fn deliver_opened<'s>(
        &self,
        now: Instant,
        jobs: &mut [OpenJob<'s, '_>],
        notes: &[OpenNote],
        sessions: &[Arc<Session>],
        run: &mut Run<'s>,
        packets: &mut PacketList<'_>,
    ) {
        // One lock per run of messages from one peer (the bookkeeping under it is short), and
        // within it one lock of the session's replay window; a window is only locked under its
        // peer's lock, and let go of before another is locked.
        let mut held: Option<(&Arc<PeerShared>, MutexGuard<'_, PeerCore>)> = None;
        let mut window: Option<(usize, ReceivingWindow<'_>)> = None;
        for (job, note) in jobs.iter_mut().zip(notes) {
            let peer = PeerRun::switch_to(&mut run.peer, job.entry);
            let shared = peer.shared();
            if !held.as_ref().is_some_and(|(h, _)| Arc::ptr_eq(h, shared)) {
                window = None;
                drop(held.take());
                held = Some((shared, shared.core.lock()));
            }
            if let JobCounter::Opened(opened) =
                std::mem::replace(&mut job.counter, JobCounter::Done)
            {
                // The replay window's second check: a packet opened twice in this batch, or
                // overtaken by too many others, is refused here.
                if let Err(error) = locked_window(&mut window, sessions, job.session).mark(opened) {
                    self.count_refused(now, reason_for(error), note.from);
                    continue;
                }
            }
            let core = &mut *held.as_mut().expect("just locked").1;
            let delivered = Self::note_opened(now, job.opened, note, shared, core);
            let delivered = delivered.and_then(|inner| {
                peer.add_rx(DATA_HEADER + job.sealed.len());
                match inner {
                    None => Ok(()),
                    Some((true, len)) => {
                        let start = job.plaintext_at;
                        packets.push_range(None, start..start + len);
                        Ok(())
                    }
                    Some((false, _)) => Err(DropReason::SourceNotAllowed),
                }
            });
            if let Err(reason) = delivered {
                self.count_refused(now, reason, note.from);
            }
        }
    }

    /// What [`Engine::decapsulate_one`] notes after boringtun opened a data message (`opened`,
    /// noted as `note`): the session in use, boringtun's timers, roaming, and when the peer was
    /// last heard from. Returns, if it carries an inner packet, whether its source is the
    /// sender's and its length.
    fn note_opened(
        now: Instant,
        opened: Opened,
        note: &OpenNote,
        shared: &PeerShared,
        core: &mut PeerCore,
    ) -> Result<Option<(bool, usize)>, DropReason> {
        let Some(tunn) = core.tunn.as_mut() else {
            return Err(DropReason::NoPrivateKey);
        };
        let inner = match opened {
            Opened::Inner { len, allowed } => Some((allowed, len)),
            Opened::Keepalive => None,
            Opened::NotIp => {
                tunn.note_data_received(note.receiver_idx, 0);
                return Err(DropReason::InvalidInnerPacket);
            }
            Opened::Failed(reason) => return Err(reason),
            Opened::Pending => return Err(DropReason::Other),
        };
        tunn.note_data_received(note.receiver_idx, inner.map_or(0, |(_, len)| len));
        // The message authenticated (even if its inner packet is then refused): roam to its
        // source and count it.
        core.last_received = Some(now);
        core.unanswered_since = None;
        if core.answer_unused == Some(note.receiver_idx) {
            // Data on the session our answer to an initiation made: the responder's
            // handshake completed. Data on an older session confirms nothing of it.
            core.answer_unused = None;
            Self::note_handshake(now, shared, core);
        }
        core.refused_responses = 0;
        core.unused_answers = 0;
        shared.note_heard();
        shared.set_endpoint(core, Endpoint::new(note.from, note.local));
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
        endpoint: Endpoint,
        datagram: &[u8],
        out: &mut Outbox,
    ) -> Result<Sender<'s>, DropReason> {
        let from = endpoint.peer;
        let identity = state.identity.as_ref().ok_or(DropReason::NoPrivateKey)?;
        let mut cookie = [0u8; 64];
        let parsed =
            match identity
                .rate_limiter
                .verify_packet(Some(from.ip()), datagram, &mut cookie)
            {
                Ok(parsed) => parsed,
                Err(TunnResult::WriteToNetwork(reply)) => {
                    out.to_network.push_copy(Some(endpoint), reply);
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
                    self.held.hold(now, endpoint, key, datagram);
                    self.rejected.record(RejectedHandshake {
                        reason: DropReason::UnknownPeer,
                        from,
                        public_key: Some(key),
                        at: wall_time(self.clock_anchor, now),
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
        from: Endpoint,
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
        let result = tunn.decapsulate(Some(from.peer.ip()), datagram, slot);
        let mut replied = false;
        // Our index of the session an answer to an initiation makes (the response's sender).
        let mut answered = None;
        match result {
            TunnResult::WriteToNetwork(reply) => {
                // A handshake response, or the keepalive confirming our initiation. Both go
                // back where the message came from.
                if message_type == HANDSHAKE_INITIATION
                    && reply.first() == Some(&HANDSHAKE_RESPONSE)
                {
                    answered = reply
                        .get(4..8)
                        .and_then(|b| b.try_into().ok())
                        .map(u32::from_le_bytes);
                }
                shared.add_tx(reply.len());
                out.to_network.push_copy(Some(from), reply);
                replied = true;
            }
            TunnResult::Err(e) => {
                out.to_tunnel.abort();
                if matches!(message_type, HANDSHAKE_INITIATION | HANDSHAKE_RESPONSE) {
                    shared.handshake_failures.fetch_add(1, Ordering::Relaxed);
                }
                if message_type == HANDSHAKE_RESPONSE && matches!(e, WireGuardError::InvalidAeadTag)
                {
                    // The response came for our initiation but its key confirmation failed:
                    // the responder mixed in another preshared key.
                    core.refused_responses = core.refused_responses.saturating_add(1);
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
        if message_type == HANDSHAKE_INITIATION {
            if core.answer_unused.is_some() {
                core.unused_answers = core.unused_answers.saturating_add(1);
            }
            core.answer_unused = answered;
        } else if message_type == HANDSHAKE_RESPONSE {
            // Our initiation was answered under the same preshared key.
            core.refused_responses = 0;
            core.unused_answers = 0;
        }
        if matches!(message_type, HANDSHAKE_INITIATION | HANDSHAKE_RESPONSE) {
            core.initiation_pending = false;
            core.eager_retry = None;
        }
        if message_type == HANDSHAKE_RESPONSE {
            // The initiator's handshake is complete. The responder's completes when data
            // comes on the session (`note_opened`), as in the kernel's WireGuard: an answer
            // lost on its way back must not read as a handshake.
            Self::note_handshake(now, shared, core);
        }
        if replied {
            // A session just came up: send what the tunnel queued while it had none.
            core.sent_at(now);
            Self::flush_queued(core, shared, out);
        }
        peer.add_rx(datagram.len());
        Ok(())
    }

    /// Notes a completed handshake: its time (`wg show latest-handshakes`) and count.
    fn note_handshake(now: Instant, shared: &PeerShared, core: &mut PeerCore) {
        core.last_handshake = Some(now);
        core.gave_up = false;
        shared.handshakes.fetch_add(1, Ordering::Relaxed);
    }

    /// Sends the packets the tunnel queued while it had no session.
    fn flush_queued(core: &mut peer::PeerCore, shared: &PeerShared, out: &mut Outbox) {
        let endpoint = core.destination();
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
