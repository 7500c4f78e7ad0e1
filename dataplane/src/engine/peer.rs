//! A peer's live state: its noise tunnel, current endpoint, timers and counters.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use boringtun::noise::Tunn;
use parking_lot::Mutex;

use super::HANDSHAKE_INITIATION;
use crate::config::PeerConfig;
use crate::endpoint::{Endpoint, LocalAddr};
use crate::key::SecretKey;

/// State that survives configuration changes as long as the peer's keys do.
pub(crate) struct PeerShared {
    /// The 24-bit index boringtun puts (shifted left by 8) into every session index.
    pub(crate) index: u32,
    pub(crate) core: Mutex<PeerCore>,
    pub(crate) rx_bytes: AtomicU64,
    pub(crate) tx_bytes: AtomicU64,
    pub(crate) handshakes: AtomicU64,
    /// Handshakes that failed: our initiations that went unanswered until the next attempt,
    /// and handshake messages from this peer that did not verify.
    pub(crate) handshake_failures: AtomicU64,
    /// Times the endpoint in use moved from one address to another (roaming or reconfiguration).
    pub(crate) endpoint_changes: AtomicU64,
    /// True once anything authenticated came from the peer under these keys: a peer that
    /// replaces another ([`PeerConfig::replaces`]) takes over from then on.
    pub(crate) heard_from: AtomicBool,
}

/// Everything touched under the peer's lock. The lock is never held across a syscall.
pub(crate) struct PeerCore {
    /// `None` until the device has a private key.
    pub(crate) tunn: Option<Tunn>,
    pub(crate) endpoint: Option<SocketAddr>,
    /// The local address the peer last reached us at: the source of what we send it (`None`:
    /// the kernel picks the source).
    pub(crate) local: Option<LocalAddr>,
    pub(crate) last_sent: Option<Instant>,
    pub(crate) last_received: Option<Instant>,
    /// When the last handshake completed (see `PeerStats::last_handshake`).
    pub(crate) last_handshake: Option<Instant>,
    /// Set when persistent keepalive was just enabled: send one at the next timer tick.
    pub(crate) keepalive_due: bool,
    /// Set by [`Engine::initiate_handshakes`](super::Engine::initiate_handshakes): send a
    /// handshake initiation at the next timer tick unless a session is up by then.
    pub(crate) handshake_due: bool,
    /// Set by [`Engine::rekey`](super::Engine::rekey): send a handshake initiation at the next
    /// timer tick, session or not.
    pub(crate) rekey_due: bool,
    /// After that initiation: when to send another if no handshake has completed by then, and
    /// how many more may follow (see [`EAGER_RETRY_AFTER`](super::EAGER_RETRY_AFTER)).
    pub(crate) eager_retry: Option<(Instant, u8)>,
    /// We sent a handshake initiation and no handshake has completed since.
    pub(crate) initiation_pending: bool,
    /// When the oldest data packet or handshake initiation sent since the last authenticated
    /// message from the peer went out: `None` while nothing awaits an answer. Keepalives do
    /// not count (nothing answers one), as in WireGuard's own timers, which start a new
    /// handshake once data has gone unanswered for keepalive + rekey timeout (15 s).
    pub(crate) unanswered_since: Option<Instant>,
    /// When the oldest data packet received from the peer that nothing we sent has followed
    /// arrived: the passive keepalive is due [`KEEPALIVE_TIMEOUT`](super::KEEPALIVE_TIMEOUT)
    /// after it (see `Engine::passive_keepalive`).
    pub(crate) unacknowledged_since: Option<Instant>,
    /// boringtun gave up on the handshake (no answer for REKEY_ATTEMPT_TIME, 90 s, or no new
    /// session for REJECT_AFTER_TIME × 3) and none has completed since: reported once
    /// ([`GaveUp`](super::GaveUp)), not at every tick that finds it so.
    pub(crate) gave_up: bool,
    /// We answered an initiation from the peer and no data has come from it since: our
    /// index of the session that answer made, where data confirms it (data on an older
    /// session does not).
    pub(crate) answer_unused: Option<u32>,
    /// Responses to our initiations whose key confirmation failed, since data last came from
    /// the peer or a response verified: what a preshared key that differs between the two
    /// ends makes the initiating end see (loss cannot cause it).
    pub(crate) refused_responses: u32,
    /// Initiations from the peer that came again while our answer to the last one was unused
    /// by any data, since data last came from it: what the answering end sees when the keys
    /// differ, and also when its answers are lost.
    pub(crate) unused_answers: u32,
}

impl PeerCore {
    /// Where datagrams for the peer go, and the local address they leave from.
    #[inline]
    pub(crate) fn destination(&self) -> Option<Endpoint> {
        self.endpoint.map(|peer| Endpoint::new(peer, self.local))
    }

    /// Notes that something went to the peer at `now`: it acknowledges what came from it.
    #[inline]
    pub(crate) fn sent_at(&mut self, now: Instant) {
        self.last_sent = Some(now);
        self.unacknowledged_since = None;
    }
}

impl PeerShared {
    pub(crate) fn new(
        index: u32,
        config: &PeerConfig,
        private_key: Option<&SecretKey>,
    ) -> Arc<Self> {
        let tunn = private_key.map(|key| new_tunn(key, config, index));
        Arc::new(Self {
            index,
            core: Mutex::new(PeerCore {
                tunn,
                endpoint: config.endpoint,
                local: None,
                last_sent: None,
                last_received: None,
                last_handshake: None,
                keepalive_due: config.persistent_keepalive > 0,
                handshake_due: false,
                rekey_due: false,
                eager_retry: None,
                initiation_pending: false,
                unanswered_since: None,
                unacknowledged_since: None,
                gave_up: false,
                answer_unused: None,
                refused_responses: 0,
                unused_answers: 0,
            }),
            rx_bytes: AtomicU64::new(0),
            tx_bytes: AtomicU64::new(0),
            handshakes: AtomicU64::new(0),
            handshake_failures: AtomicU64::new(0),
            endpoint_changes: AtomicU64::new(0),
            heard_from: AtomicBool::new(false),
        })
    }

    /// Notes a message we send: a handshake initiation sent while an earlier one is still
    /// unanswered means that one failed. An initiation, like data (`carries_data`), expects an
    /// answer (see [`PeerCore::unanswered_since`]).
    #[inline]
    pub(crate) fn note_sent(
        &self,
        core: &mut PeerCore,
        message: &[u8],
        carries_data: bool,
        now: Instant,
    ) {
        let initiation = message.first() == Some(&HANDSHAKE_INITIATION);
        if initiation {
            if core.initiation_pending {
                self.handshake_failures.fetch_add(1, Ordering::Relaxed);
            }
            core.initiation_pending = true;
        }
        if initiation || carries_data {
            core.unanswered_since.get_or_insert(now);
        }
    }

    /// Switches the endpoint in use to `to`, and the local address to the one `to` names,
    /// counting a move from one peer address to another.
    #[inline]
    pub(crate) fn set_endpoint(&self, core: &mut PeerCore, to: Endpoint) {
        if core.endpoint.is_some_and(|from| from != to.peer) {
            self.endpoint_changes.fetch_add(1, Ordering::Relaxed);
        }
        core.endpoint = Some(to.peer);
        core.local = to.local;
    }

    /// Notes that something authenticated came from the peer (read without a lock by
    /// [`State::route_to`](super::State::route_to), so it is written once, not per packet).
    #[inline]
    pub(crate) fn note_heard(&self) {
        if !self.heard_from.load(Ordering::Relaxed) {
            self.heard_from.store(true, Ordering::Release);
        }
    }

    pub(crate) fn add_rx(&self, bytes: usize) {
        self.rx_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn add_tx(&self, bytes: usize) {
        self.tx_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// A fresh noise tunnel for `config` under `private_key`. Keepalives are ours, not boringtun's,
/// so the interval can change without losing the session.
pub(crate) fn new_tunn(private_key: &SecretKey, config: &PeerConfig, index: u32) -> Tunn {
    Tunn::new(
        private_key.to_dalek(),
        config.public_key.to_dalek(),
        config.preshared_key.as_ref().map(|k| *k.as_bytes()),
        None,
        index,
        None,
    )
}

/// A configured peer in one snapshot of the device: its declared settings plus the live state
/// shared with the snapshots before and after it.
pub(crate) struct PeerEntry {
    pub(crate) config: PeerConfig,
    pub(crate) shared: Arc<PeerShared>,
}
