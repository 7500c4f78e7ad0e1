//! The WireGuard engine: cryptokey routing around boringtun's noise state machines.
//!
//! Contract: the engine owns no file descriptor, spawns no thread and never reads the clock
//! itself; every call takes `now`. Input is packets (from the TUN device, from the network);
//! output goes into the caller's [`Outbox`]. All methods take `&self`: the peer table is an
//! immutable snapshot swapped atomically by [`Engine::apply`], and each peer has its own lock,
//! held only for the noise call, so any number of worker threads can share one engine.
//!
//! boringtun's `Tunn` keeps its own coarse clock, advanced by `update_timers`; the runtime must
//! call [`Engine::handle_timers`] every [`TIMER_TICK`].

mod held;
mod peer;
mod run;
mod timers;

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use boringtun::noise::handshake::parse_handshake_anon;
use boringtun::noise::rate_limiter::RateLimiter;
use boringtun::noise::{errors::WireGuardError, Packet, TunnResult};
use parking_lot::Mutex;

use crate::allowed_ips::AllowedIps;
use crate::config::{ApplyReport, DeviceConfig, InterfaceConfig, PeerConfig};
use crate::key::{PublicKey, SecretKey};
use crate::outbox::{offset_within, Outbox};
use crate::packet;
use crate::stats::{DropCounters, DropReason, PeerStats, RejectedHandshake, RejectedHandshakes};
use held::HeldInitiations;
use peer::{new_tunn, PeerEntry, PeerShared};
use run::{cached_lookup, PeerRun, Run};

/// How often [`Engine::handle_timers`] should run.
pub const TIMER_TICK: Duration = Duration::from_millis(250);
/// WireGuard's passive keepalive: data received and not followed by anything sent for this long
/// is acknowledged with a keepalive, so its sender knows the path works.
pub(crate) const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an initiation sent by [`Engine::initiate_handshakes`] waits for an answer before
/// another is sent, instead of WireGuard's 5 s REKEY_TIMEOUT. A restarted agent's first
/// initiation often reaches a peer whose own agent has not added it back yet (Kilo's agent,
/// after a node's annotations went and came back, reconfigures its WireGuard a moment later
/// and drops what came before): waiting the full 5 s cost a migrating node 6 s of traffic.
pub(crate) const EAGER_RETRY_AFTER: Duration = Duration::from_secs(1);
/// How many such early initiations follow the first, at most: by then REKEY_TIMEOUT's own
/// retries take over.
pub(crate) const EAGER_RETRIES: u8 = 4;

/// Handshake messages per second the whole device verifies before answering with cookies.
const DEVICE_HANDSHAKE_RATE_LIMIT: u64 = 100;

/// Smallest buffer boringtun accepts for any output.
const MIN_OUTPUT: usize = 148;
/// WireGuard data-message overhead: header plus tag.
const DATA_OVERHEAD: usize = 32;
/// First byte of each WireGuard message type.
const HANDSHAKE_INITIATION: u8 = 1;
const HANDSHAKE_RESPONSE: u8 = 2;
const COOKIE_REPLY: u8 = 3;

/// This device's keys and the handshake rate limiter they key.
struct Identity {
    private_key: SecretKey,
    public_key: PublicKey,
    rate_limiter: Arc<RateLimiter>,
}

/// One immutable snapshot of the device.
struct State {
    identity: Option<Identity>,
    interface: InterfaceConfig,
    /// Configured peers by public key.
    peers: BTreeMap<PublicKey, Arc<PeerEntry>>,
    /// Peers in configuration order (for `get`).
    order: Vec<PublicKey>,
    by_index: HashMap<u32, Arc<PeerEntry>>,
    routes: AllowedIps<Arc<PeerEntry>>,
}

impl State {
    fn empty() -> Self {
        Self {
            identity: None,
            interface: InterfaceConfig::default(),
            peers: BTreeMap::new(),
            order: Vec::new(),
            by_index: HashMap::new(),
            routes: AllowedIps::new(),
        }
    }
}

/// The wall-clock time of the monotonic instant `at`, given one pair `(instant, wall-clock time)`.
fn wall_time((mono, wall): (Instant, SystemTime), at: Instant) -> SystemTime {
    match at.checked_duration_since(mono) {
        Some(after) => wall + after,
        None => wall - mono.duration_since(at),
    }
}

/// A userspace WireGuard device's packet logic. See the module documentation.
pub struct Engine {
    state: ArcSwap<State>,
    /// Serialises [`Engine::apply`] calls.
    apply_lock: Mutex<()>,
    next_index: AtomicU32,
    drops: DropCounters,
    rejected: RejectedHandshakes,
    /// Initiations from keys that were not peers yet, answered if they become peers soon.
    held: HeldInitiations,
    last_rate_reset: Mutex<Option<Instant>>,
    /// Pairs a monotonic instant with wall-clock time to report handshakes as wall-clock times.
    clock_anchor: (Instant, SystemTime),
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.state.load();
        f.debug_struct("Engine")
            .field("public_key", &state.identity.as_ref().map(|i| i.public_key))
            .field("peers", &state.peers.len())
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// An engine with no key and no peers. `anchor` pairs one monotonic instant with the
    /// wall-clock time at that instant; handshake times are reported relative to it.
    pub fn new(anchor: (Instant, SystemTime), first_index: u32) -> Self {
        Self {
            state: ArcSwap::from_pointee(State::empty()),
            apply_lock: Mutex::new(()),
            next_index: AtomicU32::new(first_index & 0x00ff_ffff),
            drops: DropCounters::default(),
            rejected: RejectedHandshakes::default(),
            held: HeldInitiations::default(),
            last_rate_reset: Mutex::new(None),
            clock_anchor: anchor,
        }
    }

    /// Makes `desired` the running configuration, changing only what differs.
    ///
    /// A peer whose public and preshared keys are unchanged keeps its session and counters.
    /// Its endpoint changes only when the configured endpoint changed, so re-applying the same
    /// configuration never undoes roaming. A peer whose key equals this device's own public key
    /// is ignored, as wireguard-go does. When two peers list the same prefix, the later wins.
    pub fn apply(&self, desired: &DeviceConfig) -> ApplyReport {
        let _serial = self.apply_lock.lock();
        let old = self.state.load_full();
        let mut report = ApplyReport::default();

        let identity = match (&old.identity, &desired.interface.private_key) {
            (Some(id), Some(key)) if id.private_key == *key => Some(Identity {
                private_key: key.clone(),
                public_key: id.public_key,
                rate_limiter: Arc::clone(&id.rate_limiter),
            }),
            (_, Some(key)) => {
                report.private_key_changed = true;
                let public_key = key.public_key();
                Some(Identity {
                    private_key: key.clone(),
                    public_key,
                    rate_limiter: Arc::new(RateLimiter::new(
                        &public_key.to_dalek(),
                        DEVICE_HANDSHAKE_RATE_LIMIT,
                    )),
                })
            }
            (None, None) => None,
            (Some(_), None) => {
                report.private_key_changed = true;
                None
            }
        };
        let own_public = identity.as_ref().map(|i| i.public_key);
        let private_key = identity.as_ref().map(|i| &i.private_key);

        let mut peers = BTreeMap::new();
        let mut order = Vec::new();
        for config in &desired.peers {
            if Some(config.public_key) == own_public || peers.contains_key(&config.public_key) {
                continue;
            }
            let shared = match old.peers.get(&config.public_key) {
                Some(existing) => {
                    self.update_peer(existing, config, private_key, &mut report);
                    Arc::clone(&existing.shared)
                }
                None => {
                    report.added.push(config.public_key);
                    PeerShared::new(self.allocate_index(), config, private_key)
                }
            };
            let entry = Arc::new(PeerEntry {
                config: canonical(config),
                shared,
            });
            order.push(config.public_key);
            peers.insert(config.public_key, entry);
        }
        report.removed = old
            .order
            .iter()
            .filter(|k| !peers.contains_key(*k))
            .copied()
            .collect();

        let mut routes = AllowedIps::new();
        let mut by_index = HashMap::with_capacity(peers.len());
        for key in &order {
            let entry = &peers[key];
            for prefix in &entry.config.allowed_ips {
                routes.insert(*prefix, Arc::clone(entry));
            }
            by_index.insert(entry.shared.index, Arc::clone(entry));
        }

        self.state.store(Arc::new(State {
            identity,
            interface: desired.interface.clone(),
            peers,
            order,
            by_index,
            routes,
        }));
        report
    }

    fn update_peer(
        &self,
        existing: &PeerEntry,
        config: &PeerConfig,
        private_key: Option<&SecretKey>,
        report: &mut ApplyReport,
    ) {
        let shared = &existing.shared;
        let mut core = shared.core.lock();
        let psk_changed = existing.config.preshared_key != config.preshared_key;
        match (private_key, core.tunn.as_mut()) {
            (None, _) => core.tunn = None,
            (Some(key), Some(_)) if report.private_key_changed || psk_changed => {
                core.tunn = Some(new_tunn(key, config, shared.index));
                report.sessions_reset.push(config.public_key);
            }
            (Some(key), None) => core.tunn = Some(new_tunn(key, config, shared.index)),
            (Some(_), Some(_)) => report.kept.push(config.public_key),
        }
        if let Some(to) = config
            .endpoint
            .filter(|_| existing.config.endpoint != config.endpoint)
        {
            shared.set_endpoint(&mut core, to);
        }
        if existing.config.persistent_keepalive == 0 && config.persistent_keepalive > 0 {
            core.keepalive_due = true;
        }
    }

    fn allocate_index(&self) -> u32 {
        self.next_index.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff
    }

    /// Marks every peer with an endpoint and no handshake in this engine's life for a handshake
    /// initiation at the next timer tick. A restarted device calls it after restoring the peers
    /// of its last run: the other side still sends on a session that died with the old process,
    /// and would wait for its own timers (up to about 15 s) before it starts a new one. (A peer
    /// with a persistent keepalive starts one at its first tick anyway; this is for the rest.)
    /// An initiation left unanswered is sent again every [`EAGER_RETRY_AFTER`], up to
    /// [`EAGER_RETRIES`] times, until a handshake completes.
    pub fn initiate_handshakes(&self) -> usize {
        let state = self.state.load();
        let mut marked = 0;
        for entry in state.peers.values() {
            let mut core = entry.shared.core.lock();
            if core.endpoint.is_some() && core.last_handshake.is_none() {
                core.handshake_due = true;
                marked += 1;
            }
        }
        marked
    }

    /// Whether any peer is configured. Without one the timers have nothing to do, so a device
    /// stops ticking until a peer is added.
    pub fn has_peers(&self) -> bool {
        !self.state.load().peers.is_empty()
    }

    /// The running configuration, with endpoints as configured (not as roamed).
    pub fn config(&self) -> DeviceConfig {
        let state = self.state.load();
        DeviceConfig {
            interface: state.interface.clone(),
            peers: state
                .order
                .iter()
                .map(|k| state.peers[k].config.clone())
                .collect(),
        }
    }

    /// This device's public key, once it has a private key.
    pub fn public_key(&self) -> Option<PublicKey> {
        self.state.load().identity.as_ref().map(|i| i.public_key)
    }

    /// Live statistics of every peer, in configuration order, with wall-clock times relative to
    /// the anchor the engine was made with. See [`Engine::peer_stats_at`].
    pub fn peer_stats(&self) -> Vec<PeerStats> {
        self.peer_stats_at(self.clock_anchor)
    }

    /// Live statistics of every peer, in configuration order, with wall-clock times relative to
    /// `now` (a monotonic instant and the wall-clock time at it). A device passes the clocks of
    /// the moment it reads: the wall clock may have been set since the engine started (a board
    /// without a real-time clock boots in 1970 until NTP corrects it), and handshake times must
    /// follow it.
    pub fn peer_stats_at(&self, now: (Instant, SystemTime)) -> Vec<PeerStats> {
        let state = self.state.load();
        state
            .order
            .iter()
            .map(|k| {
                let shared = &state.peers[k].shared;
                let core = shared.core.lock();
                PeerStats {
                    public_key: *k,
                    endpoint: core.endpoint,
                    last_handshake: core.last_handshake.map(|at| wall_time(now, at)),
                    unanswered_since: core.unanswered_since.map(|at| wall_time(now, at)),
                    rx_bytes: shared.rx_bytes.load(Ordering::Relaxed),
                    tx_bytes: shared.tx_bytes.load(Ordering::Relaxed),
                    handshakes: shared.handshakes.load(Ordering::Relaxed),
                    handshake_failures: shared.handshake_failures.load(Ordering::Relaxed),
                    endpoint_changes: shared.endpoint_changes.load(Ordering::Relaxed),
                }
            })
            .collect()
    }

    /// Packets dropped, by reason.
    pub fn drops(&self) -> &DropCounters {
        &self.drops
    }

    /// The last handshakes refused, per reason and source address.
    pub fn rejected_handshakes(&self) -> Vec<RejectedHandshake> {
        self.rejected.snapshot()
    }

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

/// `config` with canonical allowed IPs and no duplicates.
fn canonical(config: &PeerConfig) -> PeerConfig {
    let mut out = PeerConfig {
        allowed_ips: Vec::with_capacity(config.allowed_ips.len()),
        ..config.clone()
    };
    for prefix in &config.allowed_ips {
        out.add_allowed_ip(*prefix);
    }
    out
}

fn reason_for(error: WireGuardError) -> DropReason {
    match error {
        WireGuardError::InvalidMac => DropReason::InvalidMac,
        WireGuardError::InvalidAeadTag
        | WireGuardError::NoCurrentSession
        | WireGuardError::ConnectionExpired => DropReason::DecryptFailed,
        WireGuardError::InvalidCounter | WireGuardError::DuplicateCounter => DropReason::Replay,
        WireGuardError::WrongKey
        | WireGuardError::WrongIndex
        | WireGuardError::WrongTai64nTimestamp
        | WireGuardError::InvalidTai64nTimestamp
        | WireGuardError::UnexpectedPacket
        | WireGuardError::UnderLoad => DropReason::HandshakeFailed,
        WireGuardError::InvalidPacket | WireGuardError::IncorrectPacketLength => {
            DropReason::InvalidInnerPacket
        }
        WireGuardError::WrongPacketType => DropReason::Malformed,
        WireGuardError::DestinationBufferTooSmall | WireGuardError::LockFailed => DropReason::Other,
    }
}
