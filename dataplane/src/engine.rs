//! The WireGuard engine: cryptokey routing around boringtun's noise state machines.
//!
//! Contract: the engine owns no file descriptor, spawns no thread and never reads the clock
//! itself; every call takes `now`. Input is packets (from the TUN device, from the network);
//! output goes into the caller's [`Outbox`](crate::outbox::Outbox). All methods take `&self`: the peer table is an
//! immutable snapshot swapped atomically by [`Engine::apply`], and each peer has its own lock,
//! held only for the noise state's bookkeeping (never for a data packet's AEAD, which runs on
//! boringtun's session outside it: `engine/crypto.rs`), so any number of worker threads can
//! share one engine, and one peer's crypto runs on all of them.
//!
//! boringtun's `Tunn` keeps its own coarse clock, advanced by `update_timers`; the runtime must
//! call [`Engine::handle_timers`] every [`TIMER_TICK`].

mod apply;
mod crypto;
mod held;
mod inbound;
mod outbound;
mod peer;
mod run;
mod timers;

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use boringtun::noise::errors::WireGuardError;
use boringtun::noise::rate_limiter::RateLimiter;
use parking_lot::Mutex;

use crate::allowed_ips::AllowedIps;
use crate::config::{DeviceConfig, InterfaceConfig};
use crate::endpoint::LocalAddr;
use crate::helpers::Helpers;
use crate::key::{PublicKey, SecretKey};
use crate::stats::{DropCounters, DropReason, PeerStats, RejectedHandshake, RejectedHandshakes};
pub(crate) use crypto::CryptoScratch;
use held::HeldInitiations;
use peer::PeerEntry;

/// How often [`Engine::handle_timers`] should run.
pub const TIMER_TICK: Duration = Duration::from_millis(250);

/// The peers whose handshake boringtun gave up on at one timer tick ([`Engine::handle_timers`]):
/// how many, and the first of them, for one line about all of them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GaveUp {
    /// How many peers.
    pub peers: usize,
    /// The first of them, in the engine's peer order.
    pub first: Option<PublicKey>,
}

impl GaveUp {
    fn note(&mut self, peer: PublicKey) {
        self.peers += 1;
        self.first.get_or_insert(peer);
    }
}
/// WireGuard's passive keepalive: data received and not followed by anything sent for this long
/// is acknowledged with a keepalive, so its sender knows the path works.
pub(crate) const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an initiation sent by [`Engine::initiate_handshakes`] waits for an answer before
/// another is sent, instead of WireGuard's 5 s REKEY_TIMEOUT, while [`EAGER_RETRIES`] -
/// [`EAGER_SLOW_RETRIES`] retries remain. A restarted agent's first initiation often reaches a
/// peer whose own agent has not added it back yet (Kilo's agent, after a node's annotations went
/// and came back, reconfigures its WireGuard a moment later and drops what came before): waiting
/// the full 5 s cost a migrating node 6 s of traffic, and a retry a second later still cost
/// that node up to 2 s on a busy host where Kilo's agent took over a second to catch up.
pub(crate) const EAGER_RETRY_AFTER: Duration = Duration::from_millis(500);
/// The wait before each of the last [`EAGER_SLOW_RETRIES`] early initiations: a retry replaces
/// the unanswered initiation (a new index), so an answer that takes longer than the wait is
/// dropped when it comes; these leave a path with a round trip of up to a second its chance.
pub(crate) const EAGER_SLOW_RETRY_AFTER: Duration = Duration::from_secs(1);
/// How many early initiations follow the first, at most (about 0.5, 1, 1.5, 2.5, 3.5 and 4.5 s
/// after it, each wait up to a third longer: [`eager_retry_after`]): by then REKEY_TIMEOUT's
/// own retries take over.
pub(crate) const EAGER_RETRIES: u8 = 6;
/// How many of the [`EAGER_RETRIES`] wait [`EAGER_SLOW_RETRY_AFTER`].
pub(crate) const EAGER_SLOW_RETRIES: u8 = 3;

/// The wait before the next early initiation from `local` to `peer` when `left` of them
/// remain: [`EAGER_RETRY_AFTER`] or [`EAGER_SLOW_RETRY_AFTER`], plus up to a third of it. The
/// extra is the same for one pair of keys and retry (so a test can predict it) and differs from
/// pair to pair, so that agents restarted at once do not send their retries to a leader in
/// step (WireGuard adds up to a third of a second to its own REKEY_TIMEOUT for the same reason).
pub(crate) fn eager_retry_after(local: &[u8; 32], peer: &[u8; 32], left: u8) -> Duration {
    let wait = if left > EAGER_SLOW_RETRIES {
        EAGER_RETRY_AFTER
    } else {
        EAGER_SLOW_RETRY_AFTER
    };
    // FNV-1a over both keys and the retry's number: cheap, and spread enough for timing.
    let hash = local
        .iter()
        .chain(peer)
        .chain(std::iter::once(&left))
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
        });
    let third = wait.as_millis() as u64 / 3;
    wait + Duration::from_millis(hash % (third + 1))
}

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
    /// Peers that replace another ([`crate::PeerConfig::replaces`]), by the key they replace.
    successors: HashMap<PublicKey, Arc<PeerEntry>>,
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
            successors: HashMap::new(),
        }
    }

    /// The peer that carries a packet routed to `entry`: its successor once that was heard
    /// from (a key rotation in progress), else `entry` itself.
    #[inline]
    fn route_to<'s>(&'s self, entry: &'s Arc<PeerEntry>) -> &'s Arc<PeerEntry> {
        if self.successors.is_empty() {
            return entry;
        }
        match self.successors.get(&entry.config.public_key) {
            Some(next) if next.shared.heard_from.load(Ordering::Acquire) => next,
            _ => entry,
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
    /// Threads that may take part in a big batch's crypto (see [`Engine::use_helpers`]).
    helpers: OnceLock<Arc<Helpers>>,
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
            helpers: OnceLock::new(),
        }
    }

    /// Lets big batches spread their crypto over `helpers` (the engine spawns no thread of its
    /// own). Only the first call counts; returns whether it was this one.
    pub fn use_helpers(&self, helpers: Arc<Helpers>) -> bool {
        self.helpers.set(helpers).is_ok()
    }

    /// The helpers big batches may spread over, once set.
    fn helpers(&self) -> Option<&Helpers> {
        self.helpers.get().map(|h| &**h)
    }

    /// Marks every peer with an endpoint and no handshake in this engine's life for a handshake
    /// initiation at the next timer tick. A restarted device calls it after restoring the peers
    /// of its last run: the other side still sends on a session that died with the old process,
    /// and would wait for its own timers (up to about 15 s) before it starts a new one. (A peer
    /// with a persistent keepalive starts one at its first tick anyway; this is for the rest.)
    /// An initiation left unanswered is sent again after [`EAGER_RETRY_AFTER`] (later ones after
    /// [`EAGER_SLOW_RETRY_AFTER`]), up to [`EAGER_RETRIES`] times, until a handshake completes.
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

    /// Marks `peer` for a handshake initiation at the next timer tick, even with a session up:
    /// a new preshared key takes effect at once instead of at the next rekey (120 s). The
    /// session in use carries data until the new one is made. False when `peer` is unknown.
    pub fn rekey(&self, peer: &PublicKey) -> bool {
        let state = self.state.load();
        let Some(entry) = state.peers.get(peer) else {
            return false;
        };
        entry.shared.core.lock().rekey_due = true;
        true
    }

    /// Forgets `local` as the source address of every peer that was reached at it: what goes to
    /// them leaves from the address the kernel picks, until a datagram from the peer names
    /// another. For an address that left the host (the sockets report it:
    /// [`SendOutcome::refused_source`](crate::io::SendOutcome::refused_source)). Returns how
    /// many peers had it.
    pub fn forget_local(&self, local: IpAddr) -> usize {
        let state = self.state.load();
        let mut forgotten = 0;
        for entry in state.peers.values() {
            let mut core = entry.shared.core.lock();
            if core.local.is_some_and(|l| l.ip == local) {
                core.local = None;
                forgotten += 1;
            }
        }
        forgotten
    }

    /// The local address what goes to `peer` leaves from, once learnt from what it sent (see
    /// [`crate::endpoint`]). `None` for an unknown peer too.
    pub fn local_addr(&self, peer: &PublicKey) -> Option<LocalAddr> {
        let state = self.state.load();
        let local = state.peers.get(peer)?.shared.core.lock().local;
        local
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
                    refused_responses: core.refused_responses,
                    unused_answers: core.unused_answers,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_retries_wait_up_to_a_third_longer_and_differ_from_pair_to_pair() {
        let peer = [7; 32];
        let mut first_waits = std::collections::BTreeSet::new();
        for n in 0..200u16 {
            let mut local = [0; 32];
            local[..2].copy_from_slice(&n.to_le_bytes());
            for left in 1..=EAGER_RETRIES {
                let wait = eager_retry_after(&local, &peer, left);
                let base = if left > EAGER_SLOW_RETRIES {
                    EAGER_RETRY_AFTER
                } else {
                    EAGER_SLOW_RETRY_AFTER
                };
                assert!(
                    wait >= base && wait <= base + base / 3,
                    "{wait:?} for {base:?}"
                );
                assert_eq!(
                    wait,
                    eager_retry_after(&local, &peer, left),
                    "the same each time"
                );
            }
            first_waits.insert(eager_retry_after(&local, &peer, EAGER_RETRIES));
        }
        // 200 agents retrying towards one leader spread over the 167 ms the jitter allows.
        assert!(
            first_waits.len() > 100,
            "{} distinct waits",
            first_waits.len()
        );
    }
}
