//! The typed configuration of a WireGuard device.
//!
//! A [`DeviceConfig`] is the whole desired state. [`crate::Engine::apply`] compares it with the
//! running state and changes only what differs, so a peer whose public and preshared keys are
//! unchanged keeps its session (no new handshake, no lost packets) whatever else is re-sent.

use std::collections::HashMap;
use std::net::SocketAddr;

use ipnet::IpNet;

use crate::key::{PublicKey, SecretKey};

/// Interface-wide settings.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InterfaceConfig {
    /// This device's private key; without one the device answers nothing.
    pub private_key: Option<SecretKey>,
    /// UDP listen port; 0 asks for a random free port.
    pub listen_port: u16,
    /// `SO_MARK` put on the UDP sockets; 0 for none.
    pub fwmark: u32,
}

/// One peer's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerConfig {
    /// The peer's public key, its identity.
    pub public_key: PublicKey,
    /// Optional preshared key mixed into the handshake.
    pub preshared_key: Option<SecretKey>,
    /// Where to send to until the peer is heard from elsewhere.
    pub endpoint: Option<SocketAddr>,
    /// Seconds between keepalives when the tunnel is otherwise idle; 0 disables them.
    pub persistent_keepalive: u16,
    /// Prefixes routed to this peer and accepted from it, canonical, in insertion order.
    pub allowed_ips: Vec<IpNet>,
    /// The peer this one is the next key of (a node rotating its key): once anything
    /// authenticated arrives from this peer, it is accepted from and sent to in place of that
    /// peer, over that peer's allowed IPs, until the configuration moves them. Not part of
    /// WireGuard's configuration protocol: only the embedded engine honours it.
    pub replaces: Option<PublicKey>,
}

impl PeerConfig {
    /// A peer with only a public key set.
    pub fn new(public_key: PublicKey) -> Self {
        Self {
            public_key,
            preshared_key: None,
            endpoint: None,
            persistent_keepalive: 0,
            allowed_ips: Vec::new(),
            replaces: None,
        }
    }

    /// Adds `prefix` (canonicalised) unless already present. Linear in the peer's allowed IPs:
    /// many changes go through a [`PrefixList`].
    pub fn add_allowed_ip(&mut self, prefix: IpNet) {
        let prefix = prefix.trunc();
        if !self.allowed_ips.contains(&prefix) {
            self.allowed_ips.push(prefix);
        }
    }

    /// Removes `prefix` (canonicalised) if present. Linear, as [`PeerConfig::add_allowed_ip`].
    pub fn remove_allowed_ip(&mut self, prefix: IpNet) {
        let prefix = prefix.trunc();
        self.allowed_ips.retain(|p| *p != prefix);
    }
}

/// `prefixes` canonicalised, each kept once, in the order of its first appearance: linear.
pub fn unique_prefixes(prefixes: &[IpNet]) -> Vec<IpNet> {
    let mut list = PrefixList::default();
    for prefix in prefixes {
        list.insert(*prefix);
    }
    list.into_vec()
}

/// A peer's allowed IPs while a request edits them: canonical prefixes, each once, in insertion
/// order (a prefix removed and added again goes last), with every insertion and removal in
/// constant time.
#[derive(Debug, Clone, Default)]
pub struct PrefixList {
    /// In insertion order; `None` where a prefix was removed.
    slots: Vec<Option<IpNet>>,
    /// Where each present prefix is in `slots`.
    index: HashMap<IpNet, usize>,
}

impl PrefixList {
    /// The list `prefixes` make, canonicalised and without repeats.
    pub fn new(prefixes: &[IpNet]) -> Self {
        let mut list = Self {
            slots: Vec::with_capacity(prefixes.len()),
            index: HashMap::with_capacity(prefixes.len()),
        };
        for prefix in prefixes {
            list.insert(*prefix);
        }
        list
    }

    /// Adds `prefix` (canonicalised) at the end unless present; true when it was added.
    pub fn insert(&mut self, prefix: IpNet) -> bool {
        let prefix = prefix.trunc();
        if self.index.contains_key(&prefix) {
            return false;
        }
        self.index.insert(prefix, self.slots.len());
        self.slots.push(Some(prefix));
        true
    }

    /// Removes `prefix` (canonicalised); true when it was present.
    pub fn remove(&mut self, prefix: IpNet) -> bool {
        match self.index.remove(&prefix.trunc()) {
            Some(at) => {
                self.slots[at] = None;
                true
            }
            None => false,
        }
    }

    /// Removes every prefix.
    pub fn clear(&mut self) {
        self.slots.clear();
        self.index.clear();
    }

    /// Number of prefixes present.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when no prefix is present.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// The prefixes, in insertion order.
    pub fn into_vec(self) -> Vec<IpNet> {
        let mut out = Vec::with_capacity(self.index.len());
        out.extend(self.slots.into_iter().flatten());
        out
    }
}

/// The whole desired state of a device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Interface-wide settings.
    pub interface: InterfaceConfig,
    /// Peers in the order they were configured.
    pub peers: Vec<PeerConfig>,
}

impl DeviceConfig {
    /// The peer with `key`, if configured.
    pub fn peer(&self, key: &PublicKey) -> Option<&PeerConfig> {
        self.peers.iter().find(|p| p.public_key == *key)
    }

    /// The peer with `key`, if configured, mutably.
    pub fn peer_mut(&mut self, key: &PublicKey) -> Option<&mut PeerConfig> {
        self.peers.iter_mut().find(|p| p.public_key == *key)
    }
}

/// What [`crate::Engine::apply`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// Peers that did not exist before.
    pub added: Vec<PublicKey>,
    /// Peers that no longer exist.
    pub removed: Vec<PublicKey>,
    /// Existing peers whose session was reset (the private key changed).
    pub sessions_reset: Vec<PublicKey>,
    /// Existing peers whose preshared key changed: their session stays, and the next
    /// handshake uses the new key.
    pub preshared_key_changed: Vec<PublicKey>,
    /// Existing peers that kept their session, whether or not other settings changed.
    pub kept: Vec<PublicKey>,
    /// True when the private key changed (every session restarts).
    pub private_key_changed: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn a_prefix_list_keeps_insertion_order_canonical_and_unique() {
        let mut list = PrefixList::new(&nets(&["10.0.0.1/24", "10.0.0.0/24", "fd00::1/64"]));
        assert_eq!(list.len(), 2);
        assert!(list.insert("10.1.0.0/16".parse().unwrap()));
        assert!(!list.insert("10.1.2.3/16".parse().unwrap()));
        assert!(list.remove("10.0.0.9/24".parse().unwrap()));
        assert!(!list.remove("10.0.0.0/24".parse().unwrap()));
        // Removed, then added again: it goes last, as in a list edited line by line.
        assert!(list.insert("10.0.0.0/24".parse().unwrap()));
        assert_eq!(
            list.clone().into_vec(),
            nets(&["fd00::/64", "10.1.0.0/16", "10.0.0.0/24"])
        );
        list.clear();
        assert!(list.is_empty());
        assert_eq!(
            unique_prefixes(&nets(&["10.0.0.1/8", "10.9.9.9/8", "::1/128"])),
            nets(&["10.0.0.0/8", "::1/128"])
        );
    }

    #[test]
    fn a_prefix_list_takes_a_hundred_thousand_prefixes_in_linear_time() {
        let prefixes: Vec<IpNet> = (0..100_000u32)
            .map(|i| {
                IpNet::from(std::net::IpAddr::V4(std::net::Ipv4Addr::from(
                    0x0a00_0000 + i,
                )))
            })
            .collect();
        let started = std::time::Instant::now();
        let mut list = PrefixList::new(&prefixes);
        for prefix in &prefixes {
            assert!(!list.insert(*prefix));
        }
        assert_eq!(list.into_vec(), prefixes);
        // Quadratic, this is 5 billion comparisons (seconds); linear, milliseconds.
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }
}
