//! The configuration a `set=1` request builds, line by line, with every line's step in constant
//! time: peers found by key through an index, removed peers left as holes until the end, and
//! the allowed IPs of each peer the request edits kept in a [`PrefixList`]. A request of 130,000
//! `allowed_ip` lines is then linear, where editing the configuration itself would compare each
//! new prefix with all before it.

use std::collections::HashMap;

use crate::config::{DeviceConfig, InterfaceConfig, PeerConfig, PrefixList};
use crate::key::PublicKey;

/// A [`DeviceConfig`] under edit.
pub(super) struct Draft {
    pub(super) interface: InterfaceConfig,
    /// In configuration order; `None` where the request removed a peer.
    peers: Vec<Option<DraftPeer>>,
    /// Where each present peer is in `peers`.
    index: HashMap<PublicKey, usize>,
}

/// One peer under edit.
pub(super) struct DraftPeer {
    pub(super) config: PeerConfig,
    /// The allowed IPs once a line of the request changed them (`config.allowed_ips` is stale
    /// from then on).
    edited: Option<PrefixList>,
}

impl DraftPeer {
    /// The allowed IPs to edit.
    pub(super) fn allowed_ips(&mut self) -> &mut PrefixList {
        let config = &self.config;
        self.edited
            .get_or_insert_with(|| PrefixList::new(&config.allowed_ips))
    }

    /// Drops every allowed IP (without first indexing the ones there were).
    pub(super) fn clear_allowed_ips(&mut self) {
        self.edited = Some(PrefixList::default());
    }
}

impl Draft {
    /// `current`, ready for edits.
    pub(super) fn new(current: &DeviceConfig) -> Self {
        let mut draft = Self {
            interface: current.interface.clone(),
            peers: Vec::with_capacity(current.peers.len()),
            index: HashMap::with_capacity(current.peers.len()),
        };
        for peer in &current.peers {
            // A key listed twice is the first one, as `DeviceConfig::peer` finds it.
            if !draft.index.contains_key(&peer.public_key) {
                draft.push(peer.clone());
            }
        }
        draft
    }

    /// Where the peer with `key` is, if present.
    pub(super) fn position(&self, key: &PublicKey) -> Option<usize> {
        self.index.get(key).copied()
    }

    /// Adds `peer` last; returns its position.
    pub(super) fn push(&mut self, peer: PeerConfig) -> usize {
        let at = self.peers.len();
        self.index.insert(peer.public_key, at);
        self.peers.push(Some(DraftPeer {
            config: peer,
            edited: None,
        }));
        at
    }

    /// The peer at `at`, unless it was removed.
    pub(super) fn peer_mut(&mut self, at: usize) -> Option<&mut DraftPeer> {
        self.peers.get_mut(at).and_then(Option::as_mut)
    }

    /// Removes the peer with `key`, if present.
    pub(super) fn remove(&mut self, key: &PublicKey) {
        if let Some(at) = self.index.remove(key) {
            self.peers[at] = None;
        }
    }

    /// Removes every peer.
    pub(super) fn clear_peers(&mut self) {
        self.peers.clear();
        self.index.clear();
    }

    /// The configuration the edits made.
    pub(super) fn finish(self) -> DeviceConfig {
        let peers = self
            .peers
            .into_iter()
            .flatten()
            .map(|peer| {
                let mut config = peer.config;
                if let Some(edited) = peer.edited {
                    config.allowed_ips = edited.into_vec();
                }
                config
            })
            .collect();
        DeviceConfig {
            interface: self.interface,
            peers,
        }
    }
}
