//! The model's tunnels: when a device hears a peer, what its engine counts when handshakes
//! fail under differing preshared keys, and the post-quantum exchanges' datagrams, carried
//! through the tunnel to the peer whose allowed IPs hold their destination, from the sender's
//! address on its WireGuard link.
//!
//! A tunnel between two running devices that hold each other as peers is *reachable* when
//! neither WireGuard port is blocked and one end can start a handshake the other answers
//! ([`super::paths`]): the endpoint it holds for the other is the other's address on one of
//! its uplinks, that uplink's address is live at both ends, and the other is not behind NAT. A
//! handshake then completes when both ends hold the same preshared key (or none): the session
//! made then is renewed at every step the keys agree, and outlives a change of key for
//! WireGuard's reject-after time (180 s), as a real session does. While keys differ and no
//! session is left, the handshakes fail: each end counts one refused response a second, as the
//! embedded engine would.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use control::pq::link::FailedHandshakes;
use control::Key;
use dataplane::SecretKey;

use super::{Sim, MAX_ROUNDS};

/// How long a session outlives the last handshake its keys allowed (WireGuard's
/// REJECT_AFTER_TIME).
const SESSION_LIFETIME: Duration = Duration::from_secs(180);

/// What a tunnel between two devices does now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TunnelState {
    /// Nothing gets through: an end is down, does not know the other, or the path is shut.
    Unreachable,
    /// Packets arrive, but the handshakes fail under differing keys and no session is left.
    Refused,
    /// Traffic flows.
    Up,
}

/// What the tunnels need of one device's peer: its preshared key and the endpoint the
/// device sends to.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PeerSide {
    pub(super) preshared_key: Option<SecretKey>,
    pub(super) endpoint: Option<SocketAddr>,
}

/// Each running node's device peers.
pub(super) type DeviceKeys = BTreeMap<String, BTreeMap<Key, PeerSide>>;

impl Sim {
    /// Brings every device's traffic up to now: each running device sends on every tunnel it
    /// has (the pods keep talking), and hears a tunnel's far end while the tunnel is up
    /// ([`TunnelState::Up`]); a handshake completes on the same condition, and each second a
    /// tunnel refuses its handshakes counts at both ends.
    pub(super) fn flow(&mut self) {
        let secs = self
            .now
            .instant
            .saturating_duration_since(self.flowed)
            .as_secs();
        if secs == 0 {
            return;
        }
        self.flowed += Duration::from_secs(secs);
        let devices = self.device_keys();
        let now = self.now.instant;
        let secs_counted = u32::try_from(secs).unwrap_or(u32::MAX);
        let names: Vec<String> = devices.keys().cloned().collect();
        for name in names {
            let mut handshakes = std::collections::BTreeSet::new();
            let mut counters = BTreeMap::new();
            let mut last_handshakes = BTreeMap::new();
            for peer in devices[&name].keys() {
                let state = self.tunnel(&devices, &name, peer, now);
                self.count_refused(&name, *peer, state, secs_counted);
                let counter = self.traffic.entry((name.clone(), *peer)).or_default();
                counter.1 += 100 * secs;
                if state == TunnelState::Up {
                    counter.0 += 100 * secs;
                    handshakes.insert(*peer);
                    self.handshaked
                        .insert((name.clone(), *peer), self.now.unix_ms);
                }
                counters.insert(*peer, *counter);
                if let Some(at) = self.handshaked.get(&(name.clone(), *peer)) {
                    last_handshakes.insert(*peer, *at);
                }
            }
            let failed = self.failed_handshakes(&name);
            if let Some(running) = self.nodes.get(&name).and_then(|n| n.running.as_ref()) {
                running.twin.engine.set_traffic(counters, handshakes);
                running.twin.engine.set_last_handshakes(last_handshakes);
                running.twin.engine.set_failed_handshakes(failed);
            }
        }
    }

    /// Each running node's device peers, with their preshared keys.
    pub(super) fn device_keys(&self) -> DeviceKeys {
        self.nodes
            .iter()
            .filter_map(|(name, n)| {
                let config = n.running.as_ref()?.twin.engine.config();
                let peers = config
                    .peers
                    .into_iter()
                    .map(|p| {
                        let side = PeerSide {
                            preshared_key: p.preshared_key,
                            endpoint: p.endpoint,
                        };
                        (Key(*p.public_key.as_bytes()), side)
                    })
                    .collect();
                Some((name.clone(), peers))
            })
            .collect()
    }

    /// The tunnel from `name`'s device to its peer `peer` at `now`, given every device's
    /// peers; a handshake that the keys allow renews the session.
    pub(super) fn tunnel(
        &mut self,
        devices: &DeviceKeys,
        name: &str,
        peer: &Key,
        now: Instant,
    ) -> TunnelState {
        let (state, renewed) = self.tunnel_state(devices, name, peer, now);
        if let Some(pair) = renewed {
            self.sessions.insert(pair, now);
        }
        state
    }

    /// The tunnel from `name`'s device to its peer `peer` at `now`, given every device's
    /// peers, without renewing anything: the state, and the session's pair of keys when a
    /// handshake completes (the keys agree) and renews it.
    fn tunnel_state(
        &self,
        devices: &DeviceKeys,
        name: &str,
        peer: &Key,
        now: Instant,
    ) -> (TunnelState, Option<(Key, Key)>) {
        let unreachable = (TunnelState::Unreachable, None);
        let Some(node) = self.nodes.get(name) else {
            return unreachable;
        };
        let own = node.public_key();
        let Some(far_name) = self
            .nodes
            .iter()
            .find(|(_, n)| n.public_key() == *peer)
            .map(|(far, _)| far.clone())
        else {
            return unreachable;
        };
        let far = &self.nodes[&far_name];
        let (Some(mine), Some(theirs)) = (devices.get(name), devices.get(&far_name)) else {
            return unreachable;
        };
        let (Some(my_side), Some(their_side)) = (mine.get(peer), theirs.get(&own)) else {
            return unreachable;
        };
        if node.blocked || far.blocked {
            return unreachable;
        }
        let path = self.starts_handshake(node, far, my_side.endpoint, now)
            || self.starts_handshake(far, node, their_side.endpoint, now);
        if !path {
            return unreachable;
        }
        let pair = if own < *peer {
            (own, *peer)
        } else {
            (*peer, own)
        };
        if my_side.preshared_key == their_side.preshared_key {
            return (TunnelState::Up, Some(pair));
        }
        let session_left = self
            .sessions
            .get(&pair)
            .is_some_and(|renewed| now.saturating_duration_since(*renewed) < SESSION_LIFETIME);
        let state = if session_left {
            TunnelState::Up
        } else {
            TunnelState::Refused
        };
        (state, None)
    }

    /// True when the tunnel from `name`'s device to its peer `peer` carries traffic now.
    pub fn tunnel_up(&self, name: &str, peer: &Key) -> bool {
        let devices = self.device_keys();
        let (state, _) = self.tunnel_state(&devices, name, peer, self.now.instant);
        state == TunnelState::Up
    }

    /// Forgets the sessions of `name`'s device (its engine died with its agent).
    pub(super) fn drop_sessions(&mut self, name: &str) {
        if let Some(node) = self.nodes.get(name) {
            let key = node.public_key();
            self.sessions.retain(|(a, b), _| *a != key && *b != key);
        }
        self.handshaked.retain(|(n, _), _| n != name);
    }

    /// Counts, for `name`'s peer `peer`, one more second of handshakes refused under
    /// differing keys (`refused`), or clears the count when data flows.
    pub(super) fn count_refused(&mut self, name: &str, peer: Key, state: TunnelState, secs: u32) {
        let entry = (name.to_string(), peer);
        match state {
            TunnelState::Refused => *self.refused.entry(entry).or_default() += secs,
            TunnelState::Up => {
                self.refused.remove(&entry);
            }
            TunnelState::Unreachable => {}
        }
    }

    /// What `name`'s engine counted of failed handshakes, per peer.
    pub(super) fn failed_handshakes(&self, name: &str) -> BTreeMap<Key, FailedHandshakes> {
        self.refused
            .iter()
            .filter(|((n, _), _)| n == name)
            .map(|((_, peer), count)| {
                let counted = FailedHandshakes {
                    refused_responses: *count,
                    unused_answers: 0,
                };
                (*peer, counted)
            })
            .collect()
    }

    /// Where a datagram `from` sends to `to` goes: the node whose key is the peer of `from`'s
    /// device that allows `to`, and the address it comes from, `from`'s address on its
    /// WireGuard link.
    fn route(&self, from: &str, to: IpAddr) -> Option<(String, Key, IpAddr)> {
        let sender = self.nodes.get(from)?;
        let config = sender.running.as_ref()?.twin.engine.config();
        let peer = config
            .peers
            .iter()
            .find(|p| p.allowed_ips.iter().any(|net| net.contains(&to)))?;
        let peer_key = Key(*peer.public_key.as_bytes());
        let (name, _) = self
            .nodes
            .iter()
            .find(|(_, n)| n.public_key() == peer_key)?;
        let source = sender
            .kernel
            .addresses_on(control::DEFAULT_INTERFACE)
            .into_iter()
            .map(|net| net.addr())
            .find(|ip| ip.is_ipv4() == to.is_ipv4())?;
        Some((name.clone(), peer_key, source))
    }

    /// Carries the post-quantum exchanges' datagrams, round after round until none is left:
    /// each from its sender's WireGuard IP to the peer its device routes the destination to,
    /// while the tunnel between the two is up; the rest are lost, as a UDP datagram would be.
    pub(super) fn carry_pq(&mut self) -> anyhow::Result<()> {
        for _ in 0..MAX_ROUNDS {
            let mut sent = Vec::new();
            for (name, node) in &self.nodes {
                if let Some(running) = &node.running {
                    let mut outbox = running.twin.pq_outbox.lock();
                    sent.extend(outbox.drain(..).map(|(to, d)| (name.clone(), to, d)));
                }
            }
            if sent.is_empty() {
                return Ok(());
            }
            let devices = self.device_keys();
            let now = self.now;
            for (from, to_ip, datagram) in sent {
                let Some((to, to_key, source)) = self.route(&from, to_ip) else {
                    continue;
                };
                if self.tunnel(&devices, &from, &to_key, now.instant) != TunnelState::Up {
                    continue;
                }
                let from = SocketAddr::new(source, control::pq::PQ_PORT);
                let datagram = crate::agent::Input::PqDatagram {
                    from,
                    datagram: &datagram,
                };
                self.wake(&to, datagram);
            }
        }
        anyhow::bail!("the post-quantum exchanges still answered each other after {MAX_ROUNDS} rounds at one moment")
    }
}
