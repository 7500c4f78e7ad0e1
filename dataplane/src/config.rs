//! The typed configuration of a WireGuard device.
//!
//! A [`DeviceConfig`] is the whole desired state. [`crate::Engine::apply`] compares it with the
//! running state and changes only what differs, so a peer whose public and preshared keys are
//! unchanged keeps its session (no new handshake, no lost packets) whatever else is re-sent.

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

    /// Adds `prefix` (canonicalised) unless already present.
    pub fn add_allowed_ip(&mut self, prefix: IpNet) {
        let prefix = prefix.trunc();
        if !self.allowed_ips.contains(&prefix) {
            self.allowed_ips.push(prefix);
        }
    }

    /// Removes `prefix` (canonicalised) if present.
    pub fn remove_allowed_ip(&mut self, prefix: IpNet) {
        let prefix = prefix.trunc();
        self.allowed_ips.retain(|p| *p != prefix);
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
