//! One link's post-quantum preshared key exchange, as a state machine that does no I/O:
//! datagrams and `now` (Unix milliseconds) in through [`PqLink::handle`] and [`PqLink::poll`],
//! datagrams out through [`PqLink::poll_transmit`], the key to install from [`PqLink::psk`].
//!
//! The end with the lower WireGuard key initiates: it fetches the responder's encapsulation key
//! (checked against the published fingerprint), sends a ciphertext for a new epoch, checks the
//! responder's key confirmation and commits; the responder installs on the commit and says
//! so, and the initiator installs on that answer. So the two ends hold different keys for one
//! round trip only. Every message is retried after 1, 2 and 4 s; an exchange left unanswered
//! is dropped and tried again 10 s later, the installed key staying as it was. The responder
//! refuses an `Init` of an epoch at or below one it accepted (a replay), answering only an
//! exact repeat of the last one, and its fresh nonce gives a replayed `Init` a key nobody
//! confirms.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use super::message::{Malformed, Message};
use super::{derive, Binding, Derived, PeerEk, PqIdentity};
use keys::SecretKey;
use zeroize::Zeroizing;

use crate::key::Key;

/// The waits before the retries of one message, in milliseconds.
pub const RETRIES_MS: [i64; 3] = [1_000, 2_000, 4_000];
/// How long after an exchange failed the next one starts.
pub const RETRY_EXCHANGE_MS: i64 = 10_000;
/// Responses refused in a row (see [`FailedHandshakes`]) at which a link drops its key: the
/// second, so a single forged response costs nothing.
pub const FALLBACK_AFTER_REFUSED: u32 = 2;
/// Answers unused in a row at which a link drops its key: the fourth, about 15 s of the
/// peer's retries, since lost answers look the same.
pub const FALLBACK_AFTER_UNUSED: u32 = 4;

/// What a device counted of the handshakes with one peer that failed the way differing
/// preshared keys make them fail, since data last came from it (`dataplane::PeerStats`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FailedHandshakes {
    /// Responses to this end's initiations whose key confirmation failed.
    pub refused_responses: u32,
    /// The peer's initiations repeated while this end's answer to the last went unused.
    pub unused_answers: u32,
}

impl FailedHandshakes {
    /// True when the counts say the two ends hold different keys.
    pub fn keys_differ(&self) -> bool {
        self.refused_responses >= FALLBACK_AFTER_REFUSED
            || self.unused_answers >= FALLBACK_AFTER_UNUSED
    }
}

/// A link that dropped its key because handshakes failed under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FellBack {
    /// The epoch of the key dropped.
    pub epoch: u64,
    /// When (Unix milliseconds).
    pub at_ms: i64,
    /// What the device had counted.
    pub failed: FailedHandshakes,
}

/// What a link is between: the two nodes' WireGuard keys and ML-KEM fingerprints, and the key
/// that tags its messages ([`super::tag_key`]).
#[derive(Clone, PartialEq, Eq)]
pub struct LinkSetup {
    /// This node's WireGuard public key.
    pub local: Key,
    /// The peer's.
    pub peer: Key,
    /// The peer's published ML-KEM fingerprint.
    pub peer_fp: [u8; 32],
    /// The key that tags every message of the link.
    pub tag_key: SecretKey,
}

/// The key a link uses and where it came from.
#[derive(Clone, PartialEq, Eq)]
pub struct Installed {
    /// The preshared key.
    pub psk: SecretKey,
    /// The exchange's epoch.
    pub epoch: u64,
    /// When it was installed (Unix milliseconds).
    pub at_ms: i64,
}

impl std::fmt::Debug for Installed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Installed {{ epoch: {}, at_ms: {} }}",
            self.epoch, self.at_ms
        )
    }
}

/// Where the initiator's exchange stands.
enum Stage {
    /// Waiting for the responder's encapsulation key.
    Key,
    /// Waiting for the confirmation of `epoch`.
    Ack {
        epoch: u64,
        nonce: [u8; 16],
        ct: Box<[u8; super::CT_LEN]>,
        shared: Zeroizing<[u8; 32]>,
    },
    /// Waiting for the responder to say it installed `epoch`'s key.
    Done { epoch: u64, derived: Derived },
}

struct Exchange {
    stage: Stage,
    /// The message to send again, when, and how many retries are left.
    resend: (Vec<u8>, i64, usize),
}

/// One link's exchange, from one end. See the module documentation.
pub struct PqLink {
    setup: LinkSetup,
    identity: Arc<PqIdentity>,
    initiator: bool,
    period_ms: i64,
    installed: Option<Installed>,
    // The initiator's side.
    peer_ek: Option<PeerEk>,
    exchange: Option<Exchange>,
    next_exchange_ms: i64,
    last_epoch: u64,
    // The responder's side.
    pending: Option<(u64, Derived)>,
    highest_epoch: Option<u64>,
    last_answer: Option<(Vec<u8>, Vec<u8>)>,
    outbox: VecDeque<Vec<u8>>,
    refused: BTreeMap<&'static str, u64>,
    last_refused: Option<(&'static str, i64)>,
    fell_back: Option<FellBack>,
    /// Both ends drop a key that handshakes fail under.
    falls_back: bool,
    /// The `now_ms` of the call being handled.
    now_ms: i64,
}

impl PqLink {
    /// A link with no key yet; its key changes every `period_ms`.
    pub fn new(setup: LinkSetup, identity: Arc<PqIdentity>, period_ms: i64) -> Self {
        let initiator = setup.local.0 < setup.peer.0;
        Self {
            setup,
            identity,
            initiator,
            period_ms,
            installed: None,
            peer_ek: None,
            exchange: None,
            next_exchange_ms: i64::MIN,
            last_epoch: 0,
            pending: None,
            highest_epoch: None,
            last_answer: None,
            outbox: VecDeque::new(),
            refused: BTreeMap::new(),
            last_refused: None,
            fell_back: None,
            falls_back: false,
            now_ms: 0,
        }
    }

    /// Takes back the key this link had before kg restarted (saved beside the key file): the
    /// other end still uses it, and the tunnel the next exchange travels through needs it.
    pub fn restore(&mut self, installed: Installed) {
        if self.initiator {
            self.last_epoch = self.last_epoch.max(installed.epoch);
        } else {
            self.highest_epoch = Some(installed.epoch);
        }
        self.installed = Some(installed);
    }

    /// What the link is between.
    pub fn setup(&self) -> &LinkSetup {
        &self.setup
    }

    /// The preshared key in use, if an exchange completed.
    pub fn installed(&self) -> Option<&Installed> {
        self.installed.as_ref()
    }

    /// Messages refused, by reason.
    pub fn refused(&self) -> &BTreeMap<&'static str, u64> {
        &self.refused
    }

    /// The last refusal and when it was (Unix milliseconds).
    pub fn last_refused(&self) -> Option<(&'static str, i64)> {
        self.last_refused
    }

    /// When the link last dropped its key because handshakes failed under it.
    pub fn fell_back(&self) -> Option<FellBack> {
        self.fell_back
    }

    /// True when this end starts the exchanges.
    pub fn initiator(&self) -> bool {
        self.initiator
    }

    /// Says whether both ends drop a key that handshakes fail under: this end's device counts
    /// failed handshakes, and the peer announces that it does (`,fallback` in its
    /// `kilotun.io/pq`).
    pub fn set_falls_back(&mut self, both: bool) {
        self.falls_back = both;
    }

    /// True when both ends drop a key that handshakes fail under.
    pub fn falls_back(&self) -> bool {
        self.falls_back
    }

    /// Takes in what the device counted of the handshakes with the peer that failed the way
    /// differing preshared keys make them fail ([`FailedHandshakes`]). When they say the keys
    /// differ, and the peer falls back too, the link drops its key: the other end's
    /// handshakes fail as well, so it drops its key too, the two meet without one, and the
    /// initiator starts a new exchange at once, through the tunnel that works again. A peer
    /// that does not fall back would keep its key, so this end keeps its own. True when the
    /// key was dropped now.
    pub fn note_failed_handshakes(&mut self, failed: FailedHandshakes, now_ms: i64) -> bool {
        let Some(epoch) = self.installed.as_ref().map(|i| i.epoch) else {
            return false;
        };
        if !self.falls_back || !failed.keys_differ() {
            return false;
        }
        self.installed = None;
        self.fell_back = Some(FellBack {
            epoch,
            at_ms: now_ms,
            failed,
        });
        if self.initiator {
            self.exchange = None;
            self.next_exchange_ms = now_ms;
        }
        true
    }

    /// The next datagram to send to the peer, if any.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        self.outbox.pop_front()
    }

    /// When [`PqLink::poll`] is next due.
    pub fn poll_timeout(&self) -> Option<i64> {
        if !self.initiator {
            return None;
        }
        Some(match &self.exchange {
            Some(e) => e.resend.1,
            None => self.next_exchange_ms,
        })
    }

    fn send(&mut self, message: &Message) -> Vec<u8> {
        let bytes = message.encode(&self.setup.tag_key);
        self.outbox.push_back(bytes.clone());
        bytes
    }

    fn refuse(&mut self, why: &'static str) {
        *self.refused.entry(why).or_default() += 1;
        self.last_refused = Some((why, self.now_ms));
    }

    fn start(&mut self, stage: Stage, message: &Message, now_ms: i64) {
        let bytes = self.send(message);
        self.exchange = Some(Exchange {
            stage,
            resend: (bytes, now_ms + RETRIES_MS[0], RETRIES_MS.len()),
        });
    }

    /// The initiator's timers at `now_ms`: starts an exchange when one is due, sends again
    /// what went unanswered, gives up on an exchange after its last retry. `entropy` fills
    /// buffers with random bytes.
    pub fn poll(&mut self, now_ms: i64, entropy: &mut dyn FnMut(&mut [u8])) {
        self.now_ms = now_ms;
        if !self.initiator {
            return;
        }
        if let Some(exchange) = &mut self.exchange {
            let (bytes, due, left) = &mut exchange.resend;
            if now_ms < *due {
                return;
            }
            if *left == 0 {
                self.exchange = None;
                self.next_exchange_ms = now_ms + RETRY_EXCHANGE_MS;
                self.refuse("unanswered");
                return;
            }
            let wait = RETRIES_MS[RETRIES_MS.len() - *left];
            *left -= 1;
            *due = now_ms + wait;
            let bytes = bytes.clone();
            self.outbox.push_back(bytes);
            return;
        }
        if now_ms < self.next_exchange_ms {
            return;
        }
        if self.peer_ek.is_some() {
            self.send_init(now_ms, entropy);
        } else {
            self.start(Stage::Key, &Message::KeyRequest, now_ms);
        }
    }

    fn send_init(&mut self, now_ms: i64, entropy: &mut dyn FnMut(&mut [u8])) {
        let Some(ek) = &self.peer_ek else { return };
        let mut nonce = [0u8; 16];
        let mut randomness = [0u8; 32];
        entropy(&mut nonce);
        entropy(&mut randomness);
        let (ct, shared) = ek.encapsulate(&randomness);
        let epoch = (self.last_epoch + 1).max(u64::try_from(now_ms).unwrap_or(0));
        self.last_epoch = epoch;
        let ct = Box::new(ct);
        let message = Message::Init {
            epoch,
            nonce,
            ct: ct.clone(),
        };
        let stage = Stage::Ack {
            epoch,
            nonce,
            ct,
            shared,
        };
        self.start(stage, &message, now_ms);
    }

    fn binding(&self, epoch: u64, initiator_nonce: [u8; 16], responder_nonce: [u8; 16]) -> Binding {
        let (own, peer) = (self.identity.fingerprint(), self.setup.peer_fp);
        let ((initiator, initiator_fp), (responder, responder_fp)) = if self.initiator {
            ((self.setup.local, own), (self.setup.peer, peer))
        } else {
            ((self.setup.peer, peer), (self.setup.local, own))
        };
        Binding {
            initiator,
            responder,
            initiator_fp,
            responder_fp,
            epoch,
            initiator_nonce,
            responder_nonce,
        }
    }

    fn install(&mut self, psk: SecretKey, epoch: u64, now_ms: i64) {
        self.installed = Some(Installed {
            psk,
            epoch,
            at_ms: now_ms,
        });
    }

    /// Takes in a datagram from the peer at `now_ms`. A malformed one is refused (and
    /// returned as the reason); one that does not fit the exchange is counted and dropped.
    pub fn handle(
        &mut self,
        datagram: &[u8],
        now_ms: i64,
        entropy: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), Malformed> {
        self.now_ms = now_ms;
        let message = match Message::decode(datagram, &self.setup.tag_key) {
            Ok(m) => m,
            Err(e) => {
                self.refuse(e.label());
                return Err(e);
            }
        };
        match (self.initiator, message) {
            (false, Message::KeyRequest) => {
                let ek = Box::new(
                    self.identity
                        .encapsulation_key()
                        .try_into()
                        .expect("an ML-KEM-768 key is 1184 bytes"),
                );
                self.send(&Message::Key { ek });
            }
            (false, Message::Init { epoch, nonce, ct }) => {
                self.on_init(datagram, epoch, nonce, &ct, entropy)
            }
            (false, Message::Commit { epoch }) => self.on_commit(epoch, now_ms),
            (true, Message::Key { ek }) => self.on_key(&ek[..], now_ms, entropy),
            (
                true,
                Message::Ack {
                    epoch,
                    nonce,
                    confirmation,
                },
            ) => self.on_ack(epoch, nonce, confirmation, now_ms),
            (true, Message::Done { epoch }) => self.on_done(epoch, now_ms),
            _ => self.refuse("unexpected"),
        }
        Ok(())
    }

    fn on_init(
        &mut self,
        datagram: &[u8],
        epoch: u64,
        initiator_nonce: [u8; 16],
        ct: &[u8; super::CT_LEN],
        entropy: &mut dyn FnMut(&mut [u8]),
    ) {
        if let Some((init, ack)) = &self.last_answer {
            if init[..] == *datagram {
                let ack = ack.clone();
                self.outbox.push_back(ack);
                return;
            }
        }
        if self.highest_epoch.is_some_and(|h| epoch <= h) {
            self.refuse("replay");
            return;
        }
        let shared = self.identity.decapsulate(ct);
        let mut nonce = [0u8; 16];
        entropy(&mut nonce);
        let derived = derive(&shared, ct, &self.binding(epoch, initiator_nonce, nonce));
        let ack = self.send(&Message::Ack {
            epoch,
            nonce,
            confirmation: derived.confirmation,
        });
        self.highest_epoch = Some(epoch);
        self.pending = Some((epoch, derived));
        self.last_answer = Some((datagram.to_vec(), ack));
    }

    fn on_commit(&mut self, epoch: u64, now_ms: i64) {
        if self.installed.as_ref().is_some_and(|i| i.epoch == epoch) {
            self.send(&Message::Done { epoch });
            return;
        }
        match self.pending.take() {
            Some((pending, derived)) if pending == epoch => {
                self.install(derived.psk, epoch, now_ms);
                self.send(&Message::Done { epoch });
            }
            other => {
                self.pending = other;
                self.refuse("unknown epoch");
            }
        }
    }

    fn on_key(&mut self, ek: &[u8], now_ms: i64, entropy: &mut dyn FnMut(&mut [u8])) {
        if !matches!(self.exchange.as_ref().map(|e| &e.stage), Some(Stage::Key)) {
            self.refuse("unexpected");
            return;
        }
        match PeerEk::check(ek, &self.setup.peer_fp) {
            Ok(ek) => {
                self.peer_ek = Some(ek);
                self.send_init(now_ms, entropy);
            }
            Err(e) => {
                self.refuse(match e {
                    super::EkRefused::Length => "key length",
                    super::EkRefused::Fingerprint => "key fingerprint",
                    super::EkRefused::Invalid => "key invalid",
                });
                self.exchange = None;
                self.next_exchange_ms = now_ms + RETRY_EXCHANGE_MS;
            }
        }
    }

    fn on_ack(&mut self, epoch: u64, nonce: [u8; 16], confirmation: [u8; 16], now_ms: i64) {
        let Some(Exchange {
            stage:
                Stage::Ack {
                    epoch: sent,
                    nonce: ours,
                    ct,
                    shared,
                },
            ..
        }) = &self.exchange
        else {
            self.refuse("unexpected");
            return;
        };
        if *sent != epoch {
            self.refuse("unknown epoch");
            return;
        }
        let derived = derive(shared, &ct[..], &self.binding(epoch, *ours, nonce));
        if derived.confirmation != confirmation {
            // A tampered ciphertext or a key other than the published one: the key stays.
            self.refuse("confirmation");
            self.exchange = None;
            self.next_exchange_ms = now_ms + RETRY_EXCHANGE_MS;
            return;
        }
        self.start(
            Stage::Done { epoch, derived },
            &Message::Commit { epoch },
            now_ms,
        );
    }

    fn on_done(&mut self, epoch: u64, now_ms: i64) {
        match self.exchange.take() {
            Some(Exchange {
                stage:
                    Stage::Done {
                        epoch: sent,
                        derived,
                    },
                ..
            }) if sent == epoch => {
                self.install(derived.psk, epoch, now_ms);
                self.next_exchange_ms = now_ms + self.period_ms;
            }
            other => {
                self.exchange = other;
                if self.installed.as_ref().is_none_or(|i| i.epoch != epoch) {
                    self.refuse("unknown epoch");
                }
            }
        }
    }
}
