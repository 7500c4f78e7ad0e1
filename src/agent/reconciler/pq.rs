//! Post-quantum preshared keys ([`control::pq`]) as the machine's own state: which links get
//! keys (this node's WireGuard peers whose nodes publish an ML-KEM fingerprint), the book of
//! exchanges, the keys the device last took, and the effects they ask of the shells. The device
//! takes new keys only in a pass: a change of keys asks for one ([`Trigger::PostQuantum`]),
//! whose device write carries them ([`super::DeviceWrite::psks`]).

use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use control::clock::Now;
use control::journal::Reason;
use control::pq::book::{PqBook, PqPeer};
use control::pq::link::{FailedHandshakes, Installed};
use control::pq::{PqAnnouncement, PqIdentity};
use control::status::PqLinkStatus;
use control::Key;
use dataplane::SecretKey;

use super::{Reconciler, Trigger};

/// How often the device's failed handshakes are read while a link holds a key.
const CHECK_EVERY_MS: i64 = 2_000;

/// Fills a buffer with random bytes (the operating system's, in kg).
pub type Entropy = fn(&mut [u8]);

/// What the post-quantum links need done outside the machine ([`Reconciler::poll_pq_effect`]).
#[derive(Debug)]
pub enum PqEffect {
    /// Send `datagram` to the exchange of the peer whose WireGuard IP is `to`.
    Send {
        /// The peer's WireGuard IP.
        to: IpAddr,
        /// The datagram.
        datagram: Vec<u8>,
    },
    /// Read the device's failed handshakes per peer. Answer:
    /// [`Reconciler::pq_failed_handshakes`].
    ReadFailedHandshakes,
    /// The device took a new key for `peer`: start a handshake with it, so the key protects
    /// traffic at once (this node initiates the link's exchanges; both ends hold the key).
    Rekey(Key),
    /// Save these keys, made under the node key `local`, for a restarted kg.
    SaveKeys {
        /// The node key the links were made for.
        local: Key,
        /// Each link's key and epoch.
        keys: BTreeMap<Key, Installed>,
    },
    /// The links' states changed: put them on `/status` and into the per-link series.
    Publish(BTreeMap<Key, PqLinkStatus>),
    /// A datagram from `from` was refused (counted).
    Refused {
        /// Where it came from.
        from: IpAddr,
        /// Why.
        why: String,
    },
    /// The device took the links' keys: `changed` of them new, `keyed` links hold one.
    Installed {
        /// The keys new to the device.
        changed: usize,
        /// The links holding a key.
        keyed: usize,
    },
    /// A link dropped its key: its handshakes fail under it (counted).
    FellBack,
}

/// A node's post-quantum side: its links, the X25519 key their tags are agreed with, and what
/// the device holds.
pub struct PqState {
    book: PqBook,
    /// This node's WireGuard key, for the X25519 agreement each link's tag key is made from.
    secret: SecretKey,
    entropy: Entropy,
    /// The epoch of each key the device last took.
    on_device: BTreeMap<Key, u64>,
    /// The epochs of the device write under way.
    writing: Option<BTreeMap<Key, u64>>,
    /// True when a pass asked for by a change of keys ended without the device taking them:
    /// no other is asked for until one does (the retry timer tries again).
    stuck: bool,
    /// When the device's failed handshakes are next read (Unix milliseconds).
    next_check_ms: i64,
    /// The links' states as last published.
    published: BTreeMap<Key, PqLinkStatus>,
    effects: VecDeque<PqEffect>,
}

impl PqState {
    /// The post-quantum side of the node whose WireGuard key is `secret` and ML-KEM key pair
    /// `identity`; keys change every `period`; it falls back (`falls_back`) when its device
    /// counts failed handshakes. `restored` holds the keys the last run saved, with the node
    /// key they were made under; the device restored from the last run holds them.
    pub fn new(
        secret: SecretKey,
        identity: Arc<PqIdentity>,
        period: Duration,
        falls_back: bool,
        restored: Option<(Key, BTreeMap<Key, Installed>)>,
        entropy: Entropy,
    ) -> Self {
        let local = Key(*secret.public_key().as_bytes());
        let period_ms = i64::try_from(period.as_millis()).unwrap_or(i64::MAX);
        let mut book = PqBook::new(identity, local, period_ms, falls_back);
        if let Some((under, keys)) = restored {
            book.restore(under, keys);
        }
        let on_device = epochs(&book.device_keys());
        Self {
            book,
            secret,
            entropy,
            on_device,
            writing: None,
            stuck: false,
            next_check_ms: 0,
            published: BTreeMap::new(),
            effects: VecDeque::new(),
        }
    }

    /// What this node publishes as `kilotun.io/pq`.
    pub fn announcement(&self) -> PqAnnouncement {
        self.book.announcement()
    }

    /// The keys the device is to hold: none while the links were made for a key this node no
    /// longer uses (it just rotated): its peers' entries for the new key have none yet.
    fn device_keys(&self, public: Key) -> BTreeMap<Key, Installed> {
        if self.book.local() == public {
            self.book.device_keys()
        } else {
            BTreeMap::new()
        }
    }

    /// Queues the datagrams the links want sent, and their states when they changed.
    fn collect(&mut self) {
        for (to, datagram) in self.book.transmits() {
            self.effects.push_back(PqEffect::Send { to, datagram });
        }
        let statuses = self.book.statuses();
        if statuses != self.published || statuses.is_empty() {
            self.published.clone_from(&statuses);
            self.effects.push_back(PqEffect::Publish(statuses));
        }
    }
}

fn epochs(keys: &BTreeMap<Key, Installed>) -> BTreeMap<Key, u64> {
    keys.iter().map(|(k, i)| (*k, i.epoch)).collect()
}

impl Reconciler {
    /// Takes part in post-quantum exchanges (`--post-quantum`) from now on, as `state` says.
    pub fn enable_post_quantum(&mut self, state: PqState) {
        self.pq = Some(state);
    }

    /// What this node publishes as `kilotun.io/pq`, with `--post-quantum`.
    pub fn pq_announcement(&self) -> Option<PqAnnouncement> {
        self.pq.as_ref().map(PqState::announcement)
    }

    /// The next thing the post-quantum links need done outside the machine.
    pub fn poll_pq_effect(&mut self) -> Option<PqEffect> {
        self.pq.as_mut()?.effects.pop_front()
    }

    /// The node's key is now `secret` (a rotation committed), and its ML-KEM key pair
    /// `identity` when a new one was made: no exchange made under the old keys carries over.
    pub fn pq_key_committed(&mut self, secret: SecretKey, identity: Option<Arc<PqIdentity>>) {
        let Some(pq) = &mut self.pq else { return };
        pq.secret = secret;
        if let Some(identity) = identity {
            pq.book.renew(identity);
        }
    }

    /// The peers of the topology last applied that take part: each one's WireGuard key,
    /// announcement and WireGuard IP. None before a topology was applied; empty while this
    /// node leads nothing; none for a segment reached through a relay (no link of its own).
    pub fn pq_peers(&self) -> Option<Vec<(Key, PqAnnouncement, IpAddr)>> {
        let t = self.topology.as_deref()?;
        if !t.leader {
            return Some(Vec::new());
        }
        let peers = t
            .segments
            .iter()
            .filter(|s| !t.in_local_location(s) && t.relay_for(s).is_none())
            .filter_map(|s| {
                let node = self.table.get(&s.leader_member().name)?;
                Some((s.public_key, node.pq?, s.wireguard_ip))
            })
            .collect();
        Some(peers)
    }

    /// Brings the links to the peers of the topology last applied, at the end of a pass. The
    /// saved keys stay until a topology was applied.
    pub(super) fn pq_refresh(&mut self, now: Now) {
        let Some(taking_part) = self.pq_peers() else {
            return;
        };
        let public = self.public;
        let Some(pq) = &mut self.pq else { return };
        let secret = pq.secret.to_dalek();
        let peers: Vec<PqPeer> = taking_part
            .into_iter()
            .map(|(key, announced, wireguard_ip)| {
                let agreement = secret.diffie_hellman(&x25519_dalek::PublicKey::from(key.0));
                PqPeer {
                    key,
                    fingerprint: announced.fingerprint,
                    wireguard_ip,
                    tag_key: control::pq::tag_key(agreement.as_bytes()),
                    falls_back: announced.falls_back,
                }
            })
            .collect();
        pq.book.set_peers(public, &peers);
        self.pq_poll(now);
    }

    /// Takes in a datagram from `from` at `now`.
    pub fn pq_datagram(&mut self, from: IpAddr, datagram: &[u8], now: Now) {
        let Some(pq) = &mut self.pq else { return };
        let from = from.to_canonical();
        if let Err(e) = pq.book.handle(from, datagram, now.unix_ms, &mut pq.entropy) {
            let why = e.to_string();
            pq.effects.push_back(PqEffect::Refused { from, why });
        }
        pq.collect();
    }

    /// Runs the links' timers at `now`, and asks for the device's failed handshakes when they
    /// are due while a link holds a key.
    fn pq_poll(&mut self, now: Now) {
        let Some(pq) = &mut self.pq else { return };
        pq.book.poll(now.unix_ms, &mut pq.entropy);
        if now.unix_ms >= pq.next_check_ms && !pq.on_device.is_empty() {
            pq.next_check_ms = now.unix_ms + CHECK_EVERY_MS;
            pq.effects.push_back(PqEffect::ReadFailedHandshakes);
        }
        pq.collect();
    }

    /// The post-quantum timer fired at `now`: a pass when the links' keys changed, the links'
    /// effects otherwise.
    pub(super) fn pq_timeout(&mut self, now: Now) -> super::Wake {
        self.pq_poll(now);
        if self.pq_keys_due() {
            super::Wake::Pass(Trigger::PostQuantum)
        } else {
            super::Wake::PostQuantum
        }
    }

    /// Takes in the device's failed handshakes per peer (read at `now`): a link whose
    /// handshakes fail under its key drops it
    /// ([`control::pq::link::PqLink::note_failed_handshakes`]).
    pub fn pq_failed_handshakes(&mut self, failed: &BTreeMap<Key, FailedHandshakes>, now: Now) {
        let Some(pq) = &mut self.pq else { return };
        let dropped = pq.book.note_failed_handshakes(failed, now.unix_ms);
        for key in dropped {
            pq.effects.push_back(PqEffect::FellBack);
            let counted = failed[&key];
            // The peer by its node's name where the topology knows it, else by its key.
            let peer = self
                .topology
                .as_deref()
                .and_then(|t| t.segments.iter().find(|s| s.public_key == key))
                .map_or_else(|| key.to_string(), |s| s.leader_member().name.clone());
            self.journal.record(
                Reason::PostQuantumFallback,
                peer,
                format!("post-quantum preshared key of the link to {key} dropped: {} handshake responses refused and {} answers unused under it (the two ends hold different keys); running without one until the next exchange", counted.refused_responses, counted.unused_answers),
            );
        }
        if let Some(pq) = &mut self.pq {
            pq.collect();
        }
    }

    /// True when the links' keys differ from the device's and a pass is to give them to it.
    pub fn pq_keys_due(&self) -> bool {
        let Some(pq) = &self.pq else { return false };
        self.topology.is_some() && !pq.stuck && epochs(&pq.device_keys(self.public)) != pq.on_device
    }

    /// The post-quantum keys for a device write, by peer, noted as the write under way.
    pub(super) fn pq_device_write(&mut self) -> BTreeMap<Key, SecretKey> {
        let public = self.public;
        let Some(pq) = &mut self.pq else {
            return BTreeMap::new();
        };
        let keys = pq.device_keys(public);
        pq.writing = Some(epochs(&keys));
        keys.into_iter().map(|(k, i)| (k, i.psk)).collect()
    }

    /// The device write under way succeeded (`ok`) or failed: the keys new to it are handshaken
    /// with (by this link's initiator) and saved.
    pub(super) fn pq_device_written(&mut self, ok: bool) {
        let Some(pq) = &mut self.pq else { return };
        let Some(written) = pq.writing.take() else {
            return;
        };
        if !ok {
            return;
        }
        pq.stuck = false;
        if written == pq.on_device {
            return;
        }
        let changed: Vec<Key> = written
            .iter()
            .filter(|(k, e)| pq.on_device.get(*k) != Some(*e))
            .map(|(k, _)| *k)
            .collect();
        for key in &changed {
            if pq.book.initiates(key) {
                pq.effects.push_back(PqEffect::Rekey(*key));
            }
        }
        pq.effects.push_back(PqEffect::Installed {
            changed: changed.len(),
            keyed: written.len(),
        });
        let keys = pq.device_keys(self.public);
        pq.on_device = written;
        pq.effects.push_back(PqEffect::SaveKeys {
            local: pq.book.local(),
            keys,
        });
    }

    /// At the end of a pass woken by `trigger`: the links brought to the topology, and the
    /// next post-quantum moment set (at once when their keys changed and the pass did not
    /// fail, `failed`).
    pub(super) fn pq_pass_ended(&mut self, trigger: Option<Trigger>, failed: bool, now: Now) {
        if self.pq.is_none() {
            return;
        }
        self.pq_refresh(now);
        let due = self.pq_keys_due();
        if let Some(pq) = &mut self.pq {
            pq.writing = None;
            pq.stuck = due && trigger == Some(Trigger::PostQuantum);
        }
        let soon = (self.pq_keys_due() && !failed).then_some(now.unix_ms);
        self.schedule_pq(soon, now);
    }

    /// Puts the links' next moment, judged at `now`, into the timer table: after the driver
    /// carried out their effects outside a pass.
    pub fn pq_reschedule(&mut self, now: Now) {
        self.schedule_pq(None, now);
    }

    /// Puts the links' next moment (or `soon`, Unix milliseconds, when earlier), judged at
    /// `now`, into the timer table.
    fn schedule_pq(&mut self, soon: Option<i64>, now: Now) {
        let Some(pq) = &self.pq else { return };
        let check = (!pq.on_device.is_empty()).then_some(pq.next_check_ms);
        let due = [pq.book.next_timeout(), check, soon]
            .into_iter()
            .flatten()
            .min();
        let at = due.map(|due| {
            let after = u64::try_from(due.saturating_sub(now.unix_ms)).unwrap_or(0);
            now.instant + Duration::from_millis(after)
        });
        self.timers.post_quantum = at;
    }
}
