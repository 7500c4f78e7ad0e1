//! Every post-quantum link of one node ([`PqBook`]): the links follow the WireGuard peers whose
//! nodes publish an ML-KEM fingerprint, datagrams are routed to a link by the peer's WireGuard
//! IP, and the installed keys come out by peer. Pure, like [`super::link`].

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use super::link::{FailedHandshakes, Installed, LinkSetup, PqLink};
use super::message::Malformed;
use super::PqIdentity;
use keys::SecretKey;

use crate::key::Key;
use crate::status::{PqLinkStatus, PqState};

/// A peer the node has a post-quantum link with.
#[derive(Clone, PartialEq, Eq)]
pub struct PqPeer {
    /// Its WireGuard public key.
    pub key: Key,
    /// Its published ML-KEM fingerprint.
    pub fingerprint: [u8; 32],
    /// Its WireGuard IP: where its kg's exchange listens, and where its datagrams come from.
    pub wireguard_ip: IpAddr,
    /// The key that tags the link's messages ([`super::tag_key`]).
    pub tag_key: SecretKey,
    /// It announces that it falls back ([`super::PqAnnouncement::falls_back`]).
    pub falls_back: bool,
}

impl std::fmt::Debug for PqPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PqPeer")
            .field("key", &self.key)
            .field("wireguard_ip", &self.wireguard_ip)
            .finish_non_exhaustive()
    }
}

/// Why a datagram went to no link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No link's peer has the datagram's source address.
    #[error("from no peer's WireGuard IP")]
    Stranger,
    /// The link refused it.
    #[error("{0}")]
    Malformed(#[from] Malformed),
}

/// Every post-quantum link of one node. See the module documentation.
pub struct PqBook {
    identity: Arc<PqIdentity>,
    local: Key,
    period_ms: i64,
    links: BTreeMap<Key, (IpAddr, PqLink)>,
    /// Keys saved by the last run, taken by each link when it is made.
    restored: BTreeMap<Key, Installed>,
    /// This node's device counts failed handshakes, so it falls back.
    falls_back: bool,
}

impl PqBook {
    /// No links yet, for the node whose WireGuard key is `local` and whose ML-KEM key pair is
    /// `identity`; keys change every `period_ms`. `falls_back` when its device counts failed
    /// handshakes ([`super::PqAnnouncement::falls_back`]).
    pub fn new(identity: Arc<PqIdentity>, local: Key, period_ms: i64, falls_back: bool) -> Self {
        Self {
            identity,
            local,
            period_ms,
            links: BTreeMap::new(),
            restored: BTreeMap::new(),
            falls_back,
        }
    }

    /// What this node publishes in `kilotun.io/pq`.
    pub fn announcement(&self) -> super::PqAnnouncement {
        super::PqAnnouncement {
            fingerprint: self.identity.fingerprint(),
            falls_back: self.falls_back,
        }
    }

    /// The keys the last run of this node's kg had installed (for links made under `local`):
    /// each link made from now on starts with its peer's, so the restarted device and its
    /// peers agree until the next exchange.
    pub fn restore(&mut self, local: Key, installed: BTreeMap<Key, Installed>) {
        if local == self.local {
            self.restored = installed;
        }
    }

    /// Takes `identity` as the node's ML-KEM key pair from now on: every link is made again
    /// (its peers see the new fingerprint and do the same), and no saved key is taken back.
    pub fn renew(&mut self, identity: Arc<PqIdentity>) {
        self.identity = identity;
        self.links.clear();
        self.restored.clear();
    }

    /// The WireGuard key the links were made for.
    pub fn local(&self) -> Key {
        self.local
    }

    /// This node's fingerprint.
    pub fn fingerprint(&self) -> [u8; 32] {
        self.identity.fingerprint()
    }

    /// Brings the links to `peers`: a new peer gets a link with no key yet; a peer gone, or
    /// whose fingerprint or tag key changed, loses its link and its key (so both ends go
    /// without one until a new exchange completes). `local` is this node's WireGuard key now.
    /// A saved key no link took is dropped: its peer takes no part now.
    pub fn set_peers(&mut self, local: Key, peers: &[PqPeer]) {
        if local != self.local {
            self.local = local;
            self.links.clear();
        }
        self.links.retain(|key, (_, link)| {
            peers.iter().any(|p| {
                p.key == *key
                    && p.fingerprint == link.setup().peer_fp
                    && p.tag_key == link.setup().tag_key
            })
        });
        for p in peers {
            let restored = &mut self.restored;
            let link = self.links.entry(p.key).or_insert_with(|| {
                let setup = LinkSetup {
                    local: self.local,
                    peer: p.key,
                    peer_fp: p.fingerprint,
                    tag_key: p.tag_key.clone(),
                };
                let mut link = PqLink::new(setup, Arc::clone(&self.identity), self.period_ms);
                if let Some(installed) = restored.remove(&p.key) {
                    link.restore(installed);
                }
                (p.wireguard_ip, link)
            });
            link.0 = p.wireguard_ip;
            link.1.set_falls_back(self.falls_back && p.falls_back);
        }
        self.restored.clear();
    }

    /// Takes in `datagram` from `from` at `now_ms`.
    pub fn handle(
        &mut self,
        from: IpAddr,
        datagram: &[u8],
        now_ms: i64,
        entropy: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), Refusal> {
        let (_, link) = self
            .links
            .values_mut()
            .find(|(ip, _)| *ip == from)
            .ok_or(Refusal::Stranger)?;
        link.handle(datagram, now_ms, entropy)?;
        Ok(())
    }

    /// Runs every link's timers at `now_ms`.
    pub fn poll(&mut self, now_ms: i64, entropy: &mut dyn FnMut(&mut [u8])) {
        for (_, link) in self.links.values_mut() {
            link.poll(now_ms, entropy);
        }
    }

    /// The datagrams to send, with the address of the peer each goes to.
    pub fn transmits(&mut self) -> Vec<(IpAddr, Vec<u8>)> {
        let mut out = Vec::new();
        for (ip, link) in self.links.values_mut() {
            while let Some(d) = link.poll_transmit() {
                out.push((*ip, d));
            }
        }
        out
    }

    /// When [`PqBook::poll`] is next due.
    pub fn next_timeout(&self) -> Option<i64> {
        self.links
            .values()
            .filter_map(|(_, l)| l.poll_timeout())
            .min()
    }

    /// The keys the device holds: each link's installed key and, until the links are first
    /// made ([`PqBook::set_peers`]), the keys saved by the last run, so a restarted kg's first
    /// configuration keeps the keys its peers hold.
    pub fn device_keys(&self) -> BTreeMap<Key, Installed> {
        let mut keys = self.restored.clone();
        keys.extend(self.installed());
        keys
    }

    /// The installed key of each link that has one, by peer.
    pub fn installed(&self) -> BTreeMap<Key, Installed> {
        self.links
            .iter()
            .filter_map(|(k, (_, l))| Some((*k, l.installed()?.clone())))
            .collect()
    }

    /// Every link's peer, whether it has a key, and what it refused, for `/status`.
    pub fn links(&self) -> impl Iterator<Item = (&Key, &PqLink)> {
        self.links.iter().map(|(k, (_, l))| (k, l))
    }

    /// Takes in, per peer, what the device counted of the handshakes that failed the way
    /// differing preshared keys make them fail (see [`PqLink::note_failed_handshakes`]).
    /// Returns the peers whose links dropped their key now.
    pub fn note_failed_handshakes(
        &mut self,
        failed: &BTreeMap<Key, FailedHandshakes>,
        now_ms: i64,
    ) -> Vec<Key> {
        let mut dropped = Vec::new();
        for (key, (_, link)) in &mut self.links {
            if failed
                .get(key)
                .is_some_and(|n| link.note_failed_handshakes(*n, now_ms))
            {
                dropped.push(*key);
            }
        }
        dropped
    }

    /// Each link's state for `/status`, by peer.
    pub fn statuses(&self) -> BTreeMap<Key, PqLinkStatus> {
        self.links
            .iter()
            .map(|(key, (ip, link))| (*key, link_status(link, *ip)))
            .collect()
    }

    /// True when this node starts the exchanges with `peer` (its key is the lower).
    pub fn initiates(&self, peer: &Key) -> bool {
        self.local.0 < peer.0
    }
}

fn link_status(link: &PqLink, ip: IpAddr) -> PqLinkStatus {
    let installed = link.installed();
    let fell_back = link.fell_back();
    // A refusal since the fallback says why no new key came.
    let last_refused = link.last_refused();
    let refused_since = last_refused.filter(|(_, at)| fell_back.is_none_or(|f| *at >= f.at_ms));
    let (state, detail) = match (installed, fell_back, refused_since) {
        (Some(_), _, _) => (PqState::Keyed, String::new()),
        (None, _, Some(("unanswered", _))) if link.initiator() => (
            PqState::Exchanging,
            format!(
                "the exchange goes unanswered: the peer's kg does not answer on UDP {ip}:{} through the tunnel",
                crate::pq::PQ_PORT
            ),
        ),
        (None, _, Some((reason, _))) => {
            (PqState::Exchanging, format!("the exchange fails: {reason}"))
        }
        (None, Some(f), None) => (
            PqState::FellBack,
            format!(
                "dropped the key of epoch {} when handshakes failed under it ({} responses refused, {} answers unused in a row); none until the next exchange",
                f.epoch, f.failed.refused_responses, f.failed.unused_answers
            ),
        ),
        (None, None, None) if link.initiator() => {
            (PqState::Exchanging, "the exchange is under way".to_string())
        }
        (None, None, None) => (
            PqState::Exchanging,
            "waiting for the peer to start the exchange".to_string(),
        ),
    };
    let changed = [installed.map(|i| i.at_ms), fell_back.map(|f| f.at_ms)]
        .into_iter()
        .flatten()
        .max();
    PqLinkStatus {
        state,
        detail,
        epoch: installed.map(|i| i.epoch),
        psk_changed_unix: changed.filter(|ms| *ms > 0).map(|ms| ms / 1000),
        fell_back_unix: fell_back.map(|f| f.at_ms / 1000),
        falls_back: link.falls_back(),
        refused: link
            .refused()
            .iter()
            .map(|(r, n)| (r.to_string(), *n))
            .collect(),
        last_refused: last_refused.map(|(r, ms)| (r.to_string(), ms / 1000)),
    }
}
