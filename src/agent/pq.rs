//! The shells' side of post-quantum preshared keys ([`control::pq`]): the node's ML-KEM seed on
//! disk, the keys saved for a restarted kg, and the UDP socket the exchanges travel on (through
//! the tunnel, between WireGuard IPs). What the links decide is the machine's
//! ([`super::reconciler::PqState`]).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use control::clock::Now;
use control::pq::link::Installed;
use control::pq::PqIdentity;
use control::Key;
use dataplane::SecretKey;
use rand_core::RngCore;
use zeroize::Zeroizing;

use super::reconciler::{PqEffect, PqState};
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

/// A node's post-quantum shells: the wire its exchanges travel on and the file their keys
/// are saved in. The links themselves are the machine's ([`PqState`]).
pub struct PqShell {
    wire: PqWire,
    saved_at: PathBuf,
}

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

/// The operating system's random bytes, for the exchanges ([`control::pq`]).
pub fn fill(buf: &mut [u8]) {
    rand_core::OsRng.fill_bytes(buf);
}

impl PqShell {
    /// The shell for the node whose key file is `key_file` and WireGuard key `secret`, and the
    /// machine's post-quantum state: the seed loaded (or made, 0600), the keys the last run
    /// saved, the socket bound, or the datagrams put in `outbox` when there is one. Keys
    /// change every `period`; `falls_back` when the device counts failed handshakes.
    pub async fn start(
        key_file: &Path,
        secret: &SecretKey,
        period: Duration,
        falls_back: bool,
        outbox: Option<PqOutbox>,
    ) -> Result<(Self, PqState)> {
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
        let state = PqState::new(secret.clone(), identity, period, falls_back, saved, fill);
        Ok((Self { wire, saved_at }, state))
    }

    /// Makes the node a new ML-KEM key pair (stored in `<key-file>.pq`, 0600), as it does when
    /// its WireGuard key rotates.
    pub(super) fn renew(key_file: &Path) -> Result<Arc<PqIdentity>> {
        let seed = super::shells::keyfile::generate_seed(&seed_path(key_file))?;
        Ok(Arc::new(PqIdentity::from_seed(&seed)))
    }

    fn send(&self, to: std::net::IpAddr, datagram: Vec<u8>) {
        match &self.wire {
            PqWire::Udp(socket) => {
                if let Err(e) = socket.try_send_to(&datagram, SocketAddr::new(to, PQ_PORT)) {
                    tracing::debug!(peer = %to, error = %e, "post-quantum exchange: sending failed");
                }
            }
            PqWire::Memory(outbox) => outbox.lock().push((to, datagram)),
        }
    }
}

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Carries out the post-quantum links' effects ([`PqEffect`]) at `now`, handing back the
    /// answers the machine waits for.
    pub(super) fn carry_out_pq(&mut self, now: Now) {
        while let Some(effect) = self.core.poll_pq_effect() {
            let Some(shell) = &self.pq else { return };
            match effect {
                PqEffect::Send { to, datagram } => shell.send(to, datagram),
                PqEffect::ReadFailedHandshakes => {
                    let failed = self.wg.failed_handshakes();
                    self.core.pq_failed_handshakes(&failed, now);
                }
                PqEffect::Rekey(peer) => {
                    tracing::info!(%peer, "post-quantum preshared key installed; handshaking");
                    self.wg.rekey(&peer);
                }
                PqEffect::SaveKeys { local, keys } => {
                    if let Err(e) = save(&shell.saved_at, local, &keys) {
                        tracing::warn!(
                            error = format!("{e:#}"),
                            "saving the post-quantum keys failed"
                        );
                    }
                }
                PqEffect::Publish(statuses) => self.pq_publish(statuses),
                PqEffect::Refused { from, why } => {
                    self.metrics.keys.pq_refused.inc();
                    tracing::debug!(peer = %from, error = why, "post-quantum exchange: datagram refused");
                }
                PqEffect::Installed { changed, keyed } => {
                    self.metrics.keys.pq_psk_changes.inc_by(changed as u64);
                    self.metrics.keys.pq_links_keyed.set(keyed as i64);
                }
                PqEffect::FellBack => {
                    self.metrics.keys.pq_fallbacks.inc();
                }
            }
        }
    }

    /// Puts every link's state on `/status` and into the per-link series.
    fn pq_publish(&mut self, statuses: BTreeMap<Key, control::status::PqLinkStatus>) {
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

    /// The socket the exchanges arrive on, with `--post-quantum`.
    pub fn pq_socket(&self) -> Option<Arc<tokio::net::UdpSocket>> {
        match &self.pq.as_ref()?.wire {
            PqWire::Udp(socket) => Some(Arc::clone(socket)),
            PqWire::Memory(_) => None,
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
