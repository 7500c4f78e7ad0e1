//! The shells' side of post-quantum preshared keys ([`control::pq`]): the node's ML-KEM seed on
//! disk, the UDP socket the exchanges travel on (through the tunnel, between WireGuard IPs),
//! and the keys installed into the device.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use control::clock::Now;
use control::journal::Reason;
use control::pq::book::{PqBook, PqPeer};
use control::pq::link::Installed;
use control::pq::{PqAnnouncement, PqIdentity};
use control::Key;
use rand_core::RngCore;
use zeroize::Zeroizing;

use super::shells::{Device, Firewall, Kernel};
use super::Agent;

pub use control::pq::PQ_PORT;

/// The datagrams a node's exchanges send, each to a peer's WireGuard IP, for a network other
/// than the host's (the reference model's) to carry.
pub type PqOutbox = Arc<parking_lot::Mutex<Vec<(std::net::IpAddr, Vec<u8>)>>>;

/// Where the exchanges' datagrams go.
pub enum PqWire {
    /// A UDP socket on [`PQ_PORT`]: the host's network, through the tunnel.
    Udp(Arc<tokio::net::UdpSocket>),
    /// An outbox (its twin): whoever drives the agent delivers them.
    Memory(PqOutbox),
}

/// A node's post-quantum side: its links, the wire, and the epoch of the key each link last
/// put into the device.
pub struct PqShell {
    pub(super) book: PqBook,
    wire: PqWire,
    installed: BTreeMap<Key, u64>,
    saved_at: PathBuf,
    /// When the device's failed handshakes are next read (Unix milliseconds).
    next_check_ms: i64,
    /// The links' states as last put on `/status` and into the series.
    published: BTreeMap<Key, control::status::PqLinkStatus>,
}

/// How often the device's failed handshakes are read while a link holds a key.
pub const CHECK_EVERY_MS: i64 = 2_000;

/// Where the node's ML-KEM seed is kept: `<key-file>.pq`.
pub fn seed_path(key_file: &Path) -> PathBuf {
    super::shells::keyfile::beside(key_file, ".pq")
}

/// Where the installed keys are saved, for a restarted kg: `<key-file>.psk` (0600).
pub fn saved_path(key_file: &Path) -> PathBuf {
    super::shells::keyfile::beside(key_file, ".psk")
}

/// The installed keys as saved: the local key they were made under, and each peer's key and
/// epoch. The keys' text, and the file's, are wiped when dropped.
#[derive(serde::Serialize, serde::Deserialize)]
struct Saved {
    local: String,
    links: BTreeMap<String, (Zeroizing<String>, u64)>,
}

fn save(path: &Path, local: Key, installed: &BTreeMap<Key, Installed>) -> Result<()> {
    let saved = Saved {
        local: local.to_base64(),
        links: installed
            .iter()
            .map(|(k, i)| (k.to_base64(), (i.psk.expose_base64(), i.epoch)))
            .collect(),
    };
    let text = Zeroizing::new(serde_json::to_string(&saved)?);
    super::shells::keyfile::write_private(path, &text)
}

fn load(path: &Path) -> Option<(Key, BTreeMap<Key, Installed>)> {
    let text = Zeroizing::new(std::fs::read_to_string(path).ok()?);
    let saved: Saved = serde_json::from_str(&text).ok()?;
    let links = saved
        .links
        .iter()
        .filter_map(|(peer, (psk, epoch))| {
            let installed = Installed {
                psk: dataplane::SecretKey::from_base64(psk).ok()?,
                epoch: *epoch,
                at_ms: 0,
            };
            Some((Key::parse(peer).ok()?, installed))
        })
        .collect();
    Some((Key::parse(&saved.local).ok()?, links))
}

/// Puts the post-quantum keys saved in `<key-file>.psk` under `local` into `restored` (the
/// device's peers of the last run, from `<key-file>.state`), in case the two files were not
/// both written (kg died between them, or an earlier kg wrote the state only when a reconcile
/// changed the device). Keys saved under another node key (a rotation committed since) are
/// taken off their peers: the peers hold none for the new key. Returns how many peers took a
/// key.
pub fn overlay_saved_keys(
    key_file: &Path,
    local: Key,
    restored: &mut dataplane::DeviceConfig,
) -> usize {
    let Some((under, saved)) = load(&saved_path(key_file)) else {
        return 0;
    };
    let mut taken = 0;
    for peer in &mut restored.peers {
        if let Some(installed) = saved.get(&Key(*peer.public_key.as_bytes())) {
            peer.preshared_key = (under == local).then(|| installed.psk.clone());
            taken += usize::from(under == local);
        }
    }
    taken
}

fn fill(buf: &mut [u8]) {
    rand_core::OsRng.fill_bytes(buf);
}

impl PqShell {
    /// The shell for the node whose key file is `key_file` and public key `local`: the seed
    /// loaded (or made, 0600), the socket bound, or the datagrams put in `outbox` when there
    /// is one.
    pub async fn start(
        key_file: &Path,
        local: Key,
        period: Duration,
        falls_back: bool,
        outbox: Option<PqOutbox>,
    ) -> Result<Self> {
        let saved_at = saved_path(key_file);
        let saved = load(&saved_at);
        if saved.is_none() && seed_path(key_file).exists() {
            // The keys the peers hold for this node are lost: a new ML-KEM key changes the
            // published fingerprint, and each peer drops its key for this node as soon as it
            // sees it, instead of failing handshakes until it falls back.
            tracing::info!(
                "no saved post-quantum keys: making a new ML-KEM key so the peers drop theirs"
            );
            std::fs::remove_file(seed_path(key_file))
                .with_context(|| format!("removing {}", seed_path(key_file).display()))?;
        }
        let seed = super::shells::keyfile::load_or_generate_seed(&seed_path(key_file))?;
        let identity = Arc::new(PqIdentity::from_seed(&seed));
        let wire = match outbox {
            Some(outbox) => PqWire::Memory(outbox),
            None => PqWire::Udp(Arc::new(
                match tokio::net::UdpSocket::bind(("::", PQ_PORT)).await {
                    Ok(s) => s,
                    Err(_) => tokio::net::UdpSocket::bind(("0.0.0.0", PQ_PORT))
                        .await
                        .with_context(|| {
                            format!("binding UDP port {PQ_PORT} for post-quantum keys")
                        })?,
                },
            )),
        };
        let period_ms = i64::try_from(period.as_millis()).unwrap_or(i64::MAX);
        let mut book = PqBook::new(identity, local, period_ms, falls_back);
        if let Some((under, keys)) = saved {
            book.restore(under, keys);
        }
        Ok(Self {
            book,
            wire,
            installed: BTreeMap::new(),
            saved_at,
            next_check_ms: 0,
            published: BTreeMap::new(),
        })
    }

    /// Makes the node a new ML-KEM key (stored in `<key-file>.pq`, 0600), as it does when its
    /// WireGuard key rotates; returns its fingerprint.
    pub(super) fn renew(&mut self, key_file: &Path) -> Result<PqAnnouncement> {
        let seed = super::shells::keyfile::generate_seed(&seed_path(key_file))?;
        self.book.renew(Arc::new(PqIdentity::from_seed(&seed)));
        Ok(self.book.announcement())
    }

    /// What this node publishes as `kilotun.io/pq`.
    pub fn announcement(&self) -> PqAnnouncement {
        self.book.announcement()
    }

    fn flush(&mut self) {
        for (ip, datagram) in self.book.transmits() {
            match &self.wire {
                PqWire::Udp(socket) => {
                    if let Err(e) = socket.try_send_to(&datagram, SocketAddr::new(ip, PQ_PORT)) {
                        tracing::debug!(peer = %ip, error = %e, "post-quantum exchange: sending failed");
                    }
                }
                PqWire::Memory(outbox) => outbox.lock().push((ip, datagram)),
            }
        }
    }
}

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Brings the post-quantum links to the peers of the topology last applied (after each
    /// reconcile).
    pub fn pq_refresh(&mut self, now: Now) {
        // Before a topology was applied the links are not made, and the saved keys stay.
        let Some(taking_part) = self.core.pq_peers() else {
            return;
        };
        let Some(pq) = &mut self.pq else { return };
        let secret = self.key.to_dalek();
        let peers: Vec<PqPeer> = taking_part
            .into_iter()
            .map(|(key, announced, wireguard_ip)| {
                let public = x25519_dalek::PublicKey::from(key.0);
                let agreement = secret.diffie_hellman(&public);
                PqPeer {
                    key,
                    fingerprint: announced.fingerprint,
                    wireguard_ip,
                    tag_key: control::pq::tag_key(agreement.as_bytes()),
                    falls_back: announced.falls_back,
                }
            })
            .collect();
        pq.book.set_peers(self.core.public_key(), &peers);
        pq.book.poll(now.unix_ms, &mut fill);
        pq.flush();
        self.pq_install();
        self.pq_publish();
    }

    /// Takes in a datagram from `from`.
    pub fn pq_datagram(&mut self, from: SocketAddr, datagram: &[u8], now: Now) {
        let Some(pq) = &mut self.pq else { return };
        let from = from.ip().to_canonical();
        if let Err(e) = pq.book.handle(from, datagram, now.unix_ms, &mut fill) {
            self.metrics.keys.pq_refused.inc();
            tracing::debug!(peer = %from, error = %e, "post-quantum exchange: datagram refused");
        }
        pq.flush();
        self.pq_install();
        self.pq_publish();
    }

    /// Runs the links' timers, and drops the key of a link whose handshakes fail under it
    /// (see [`control::pq::link::PqLink::note_failed_handshakes`]).
    pub fn pq_poll(&mut self, now: Now) {
        let Some(pq) = &mut self.pq else { return };
        pq.book.poll(now.unix_ms, &mut fill);
        if now.unix_ms >= pq.next_check_ms && !pq.installed.is_empty() {
            pq.next_check_ms = now.unix_ms + CHECK_EVERY_MS;
            let failed = self.wg.failed_handshakes();
            for key in pq.book.note_failed_handshakes(&failed, now.unix_ms) {
                self.metrics.keys.pq_fallbacks.inc();
                let counted = failed[&key];
                // The peer by its node's name where the topology knows it, else by its key.
                let peer = self
                    .core
                    .topology()
                    .and_then(|t| t.segments.iter().find(|s| s.public_key == key))
                    .map_or_else(|| key.to_string(), |s| s.leader_member().name.clone());
                self.core.journal().record(
                    Reason::PostQuantumFallback,
                    peer,
                    format!("post-quantum preshared key of the link to {key} dropped: {} handshake responses refused and {} answers unused under it (the two ends hold different keys); running without one until the next exchange", counted.refused_responses, counted.unused_answers),
                );
            }
        }
        pq.flush();
        self.pq_install();
        self.pq_publish();
    }

    /// Puts every link's state on `/status` and into the per-link series, when it changed.
    fn pq_publish(&mut self) {
        let Some(pq) = &mut self.pq else { return };
        let statuses = pq.book.statuses();
        if statuses == pq.published && !statuses.is_empty() {
            return;
        }
        pq.published.clone_from(&statuses);
        let keys = &self.metrics.keys;
        keys.pq_link_keyed.clear();
        keys.pq_psk_changed.clear();
        for (key, status) in &statuses {
            let label = super::serve::metrics::PqLinkLabel {
                public_key: key.to_base64(),
            };
            keys.pq_link_keyed
                .get_or_create(&label)
                .set(i64::from(status.state == control::status::PqState::Keyed));
            if let Some(at) = status.psk_changed_unix {
                keys.pq_psk_changed.get_or_create(&label).set(at);
            }
        }
        let by_key = statuses
            .into_iter()
            .map(|(k, s)| (k.to_string(), s))
            .collect();
        self.status.update(|p| p.post_quantum = Some(by_key));
    }

    /// When (Unix milliseconds) the links' timers, or the next read of the device's failed
    /// handshakes, are due: [`Agent::pq_poll`] then.
    pub fn pq_due_ms(&self) -> Option<i64> {
        let pq = self.pq.as_ref()?;
        let check = (!pq.installed.is_empty()).then_some(pq.next_check_ms);
        [pq.book.next_timeout(), check].into_iter().flatten().min()
    }

    /// The socket the exchanges arrive on, with `--post-quantum`.
    pub fn pq_socket(&self) -> Option<Arc<tokio::net::UdpSocket>> {
        match &self.pq.as_ref()?.wire {
            PqWire::Udp(socket) => Some(Arc::clone(socket)),
            PqWire::Memory(_) => None,
        }
    }

    /// Gives each link's installed key to the device when it changed; the link's initiator
    /// then starts a handshake so the key protects traffic at once (both ends hold it by then).
    fn pq_install(&mut self) {
        let Some(pq) = &mut self.pq else { return };
        let installed = pq.book.installed();
        let epochs: BTreeMap<Key, u64> = installed.iter().map(|(k, i)| (*k, i.epoch)).collect();
        if epochs == pq.installed {
            return;
        }
        let Some(mut device) = self.record.device.clone() else {
            return;
        };
        // The keys new to the device: a saved key a restarted kg's device already holds is
        // not, and needs no handshake.
        let changed: Vec<Key> = epochs
            .iter()
            .filter(|(k, e)| pq.installed.get(*k) != Some(*e))
            .map(|(k, _)| *k)
            .filter(|k| {
                let held = device
                    .peers
                    .iter()
                    .find(|p| p.public_key.as_bytes() == &k.0)
                    .and_then(|p| p.preshared_key.as_ref());
                held != Some(&installed[k].psk)
            })
            .collect();
        // A link that lost its key (its peer's fingerprint changed, or it left) goes without.
        for peer in &mut device.peers {
            let key = Key(*peer.public_key.as_bytes());
            if pq.installed.contains_key(&key) && !installed.contains_key(&key) {
                peer.preshared_key = None;
            }
        }
        pq_overlay(&mut device, &installed);
        if let Err(e) = self.wg.apply(&device) {
            tracing::warn!(
                error = format!("{e:#}"),
                "installing post-quantum preshared keys failed"
            );
            return;
        }
        self.metrics
            .keys
            .pq_psk_changes
            .inc_by(changed.len() as u64);
        self.metrics.keys.pq_links_keyed.set(epochs.len() as i64);
        for key in &changed {
            tracing::info!(peer = %key, epoch = epochs[key], "post-quantum preshared key installed");
            if pq.book.initiates(key) {
                self.wg.rekey(key);
            }
        }
        pq.installed = epochs;
        if let Err(e) = save(&pq.saved_at, pq.book.local(), &installed) {
            tracing::warn!(
                error = format!("{e:#}"),
                "saving the post-quantum keys failed"
            );
        }
        // The device's saved state too: a restarted kg restores its peers from it.
        if let Err(e) = super::shells::state::save(&self.settings.args.key_file, &device) {
            tracing::warn!(
                error = format!("{e:#}"),
                "saving the WireGuard state failed"
            );
        }
        self.record.device = Some(device);
    }

    /// `desired` with the post-quantum keys of its peers that have one (a Peer's own
    /// preshared key stays). None while the links were made for a key this node no longer
    /// uses (it just rotated its key): its peers' entries for the new key have none yet.
    pub(super) fn pq_keys_into(&self, desired: &mut dataplane::DeviceConfig) {
        if let Some(pq) = self
            .pq
            .as_ref()
            .filter(|pq| pq.book.local() == self.core.public_key())
        {
            pq_overlay(desired, &pq.book.device_keys());
        }
    }
}

fn pq_overlay(device: &mut dataplane::DeviceConfig, installed: &BTreeMap<Key, Installed>) {
    for peer in &mut device.peers {
        if let Some(i) = installed.get(&Key(*peer.public_key.as_bytes())) {
            peer.preshared_key = Some(i.psk.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataplane::{DeviceConfig, PeerConfig, SecretKey};

    #[test]
    fn restored_peers_take_the_saved_post_quantum_keys_made_under_this_key() {
        let dir = std::env::temp_dir().join(format!("kilotun-pq-overlay-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key_file = dir.join("key");
        let local = Key([1; 32]);
        let (keyed, other) = (
            SecretKey::from_bytes([2; 32]),
            SecretKey::from_bytes([3; 32]),
        );
        let stale = SecretKey::from_bytes([9; 32]);
        let restored = DeviceConfig {
            peers: [&keyed, &other]
                .into_iter()
                .map(|k| {
                    let mut peer = PeerConfig::new(k.public_key());
                    peer.preshared_key = Some(stale.clone());
                    peer
                })
                .collect(),
            ..DeviceConfig::default()
        };
        let saved = BTreeMap::from([(
            Key(*keyed.public_key().as_bytes()),
            Installed {
                psk: SecretKey::from_bytes([7; 32]),
                epoch: 5,
                at_ms: 0,
            },
        )]);
        save(&saved_path(&key_file), local, &saved).unwrap();
        let mut device = restored.clone();
        assert_eq!(overlay_saved_keys(&key_file, local, &mut device), 1);
        assert_eq!(
            device.peers[0].preshared_key,
            Some(SecretKey::from_bytes([7; 32]))
        );
        // A peer with no saved key keeps what the device held (a Peer's own key, say).
        assert_eq!(device.peers[1].preshared_key, Some(stale));
        // Keys saved under another node key (before a rotation) are taken off their peers.
        let mut device = restored.clone();
        assert_eq!(overlay_saved_keys(&key_file, Key([4; 32]), &mut device), 0);
        assert_eq!(device.peers[0].preshared_key, None);
        assert_eq!(
            device.peers[1].preshared_key,
            restored.peers[1].preshared_key
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
