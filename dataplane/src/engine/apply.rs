//! Configuration: [`Engine::apply`] turns a [`DeviceConfig`] into the next immutable snapshot of
//! the device, keeping the sessions and counters of peers whose keys are unchanged.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use boringtun::noise::rate_limiter::RateLimiter;

use super::peer::{new_tunn, PeerEntry, PeerShared};
use super::{Engine, Identity, State, DEVICE_HANDSHAKE_RATE_LIMIT};
use crate::allowed_ips::AllowedIps;
use crate::config::{unique_prefixes, ApplyReport, DeviceConfig, PeerConfig};
use crate::key::SecretKey;

impl Engine {
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
        let mut successors = HashMap::new();
        for key in &order {
            let entry = &peers[key];
            if let Some(old) = entry.config.replaces.filter(|k| peers.contains_key(k)) {
                successors.insert(old, Arc::clone(entry));
            }
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
            successors,
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
            (Some(key), Some(_)) if report.private_key_changed => {
                core.tunn = Some(new_tunn(key, config, shared.index));
                report.sessions_reset.push(config.public_key);
                // The other end still sends on the old session, which no longer opens here:
                // a new handshake goes out at the next tick instead of after its 15 s timers
                // (no handshake under these keys has happened yet).
                core.last_handshake = None;
                core.handshake_due = core.endpoint.is_some();
                core.eager_retry = None;
                core.initiation_pending = false;
            }
            (Some(key), None) => core.tunn = Some(new_tunn(key, config, shared.index)),
            (Some(_), Some(tunn)) => {
                // As Linux's WireGuard: the session in use stays, the next handshake (a
                // rekey, or a failed session's) uses the new key.
                if psk_changed {
                    tunn.set_preshared_key(config.preshared_key.as_ref().map(|k| *k.as_bytes()));
                    report.preshared_key_changed.push(config.public_key);
                    // What failed under the old key says nothing about the new one.
                    core.refused_responses = 0;
                    core.unused_answers = 0;
                    core.answer_unused = None;
                }
                report.kept.push(config.public_key);
            }
        }
        if let Some(to) = config
            .endpoint
            .filter(|_| existing.config.endpoint != config.endpoint)
            // The address the peer is heard from already (kg configuring what the device
            // learned, as for a peer behind NAT): the local address it reached stays, so what
            // goes to it keeps leaving from there.
            .filter(|to| core.endpoint != Some(*to))
        {
            // A configured endpoint comes with no local address: the kernel picks the source
            // until the peer is heard from there.
            shared.set_endpoint(&mut core, to.into());
        }
        if existing.config.persistent_keepalive == 0 && config.persistent_keepalive > 0 {
            core.keepalive_due = true;
        }
    }

    fn allocate_index(&self) -> u32 {
        self.next_index.fetch_add(1, Ordering::Relaxed) & 0x00ff_ffff
    }
}

/// `config` with canonical allowed IPs and no duplicates (linear in their number).
fn canonical(config: &PeerConfig) -> PeerConfig {
    PeerConfig {
        allowed_ips: unique_prefixes(&config.allowed_ips),
        ..config.clone()
    }
}
