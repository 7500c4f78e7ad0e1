//! Standby tunnels: WireGuard peers that carry no traffic, only handshakes, to prove that a path
//! works before anything is routed over it.
//!
//! When a location's lease holder says it is cut off (see [`crate::leader`]), each of its
//! verifiers gets one standby peer per other location's leader, and every other location's
//! leader gets one per verifier. Each side learns this from the same Nodes and leases, so no
//! message is needed. A verifier whose handshake completes has shown that it reaches that
//! location, over the port and keys a leader would use, and may take the lead. Once it leads,
//! the standby peers become its ordinary peers (same keys), and the session is kept.

use std::collections::{BTreeMap, BTreeSet};

use crate::key::Key;
use crate::node::{Granularity, Node};
pub use crate::topology::StandbyPeer;
use crate::topology::Topology;
use crate::wgconf::{Conf, WgPeer};

/// The keepalive of a verifier's standby peers, in seconds: the first keepalive starts the
/// handshake, so this is how soon a verifier knows.
pub const STANDBY_KEEPALIVE_S: u16 = 1;

impl Topology {
    /// Adds the local node's standby peers, given the verifiers of every location whose lease
    /// holder is cut off (by location name). Only location granularity has leaders to replace.
    pub fn with_standby(
        mut self,
        nodes: &[Node],
        verifiers: &BTreeMap<String, Vec<String>>,
    ) -> Self {
        if self.granularity != Granularity::Location {
            return self;
        }
        let mut standby = Vec::new();
        let verifying = verifiers
            .get(&self.local_location)
            .is_some_and(|names| names.contains(&self.hostname));
        if verifying {
            for s in self.segments.iter().filter(|s| !self.in_local_location(s)) {
                standby.push(StandbyPeer {
                    name: s.leader_member().name.clone(),
                    public_key: s.public_key,
                    endpoint: self.effective_endpoint(
                        s.endpoint.as_ref(),
                        &s.public_key,
                        s.persistent_keepalive,
                    ),
                    persistent_keepalive: STANDBY_KEEPALIVE_S,
                });
            }
        }
        if self.leader {
            let others = verifiers
                .iter()
                .filter(|(location, _)| **location != self.local_location)
                .flat_map(|(_, names)| names);
            for name in others {
                let Some(node) = nodes.iter().find(|n| n.name == *name) else {
                    continue;
                };
                let Some(key) = node.key else { continue };
                standby.push(StandbyPeer {
                    name: node.name.clone(),
                    public_key: key,
                    endpoint: self.effective_endpoint(
                        node.endpoint.as_ref(),
                        &key,
                        node.persistent_keepalive,
                    ),
                    persistent_keepalive: 0,
                });
            }
        }
        standby.sort_by(|a, b| a.name.cmp(&b.name));
        let mut keys = BTreeSet::new();
        standby.retain(|p| keys.insert(p.public_key));
        self.standby = standby;
        self
    }

    /// The standby peers as WireGuard peers, leaving out `taken` keys (the device's own, and
    /// peers already configured for traffic).
    pub(crate) fn standby_peers(&self, taken: &mut BTreeSet<Key>) -> Vec<WgPeer> {
        self.standby
            .iter()
            .filter(|p| taken.insert(p.public_key))
            .map(|p| WgPeer {
                public_key: p.public_key,
                allowed_ips: Vec::new(),
                endpoint: p.endpoint.clone(),
                persistent_keepalive: p.persistent_keepalive,
                preshared_key: None,
                replaces: None,
            })
            .collect()
    }

    /// What a node that does not lead applies: its listen port and its standby peers (none
    /// unless it verifies a cut-off leader's location).
    pub fn standby_conf(&self, local_key: Option<&Key>) -> Conf {
        let mut taken: BTreeSet<Key> = local_key.copied().into_iter().collect();
        let mut peers = self.standby_peers(&mut taken);
        self.add_successors(&mut peers);
        Conf {
            listen_port: Some(self.port),
            peers,
        }
    }
}

#[cfg(test)]
#[path = "standby/tests.rs"]
mod tests;
