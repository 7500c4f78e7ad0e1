//! The Peers' `status` ([`control::peer_status`]): the reconciler says whether this node writes
//! it and which writes are due, from the engine's readings the driver hands it; the driver
//! sends them.

use std::collections::BTreeMap;

use control::peer_status::{self, PeerReading, PeerStatusWrite};
use control::Key;

use super::Reconciler;

impl Reconciler {
    /// True when this node writes the Peers' status: the leader of the topology's first
    /// segment ([`peer_status::writes_peer_status`]).
    pub fn writes_peer_status(&self) -> bool {
        self.topology()
            .is_some_and(|t| !t.peers.is_empty() && peer_status::writes_peer_status(t))
    }

    /// The Peers' status writes due at `now_ms`, with the engine's `readings` by key; none when
    /// this node does not write them (and what it wrote is forgotten, so a node that comes to
    /// write them again writes every Peer at once).
    pub fn peer_status_due(
        &mut self,
        readings: &BTreeMap<Key, PeerReading>,
        now_ms: i64,
    ) -> Vec<PeerStatusWrite> {
        if !self.writes_peer_status() {
            self.peer_status_book.clear();
            return Vec::new();
        }
        let Some(t) = self.topology().cloned() else {
            return Vec::new();
        };
        let current = self.peer_shapes.statuses(&t, readings, now_ms);
        self.peer_status_book.due(&current, now_ms)
    }

    /// Forgets what this node wrote: it does not write the Peers' status now (see
    /// [`Reconciler::peer_status_due`]).
    pub fn peer_status_forget(&mut self) {
        self.peer_status_book.clear();
    }

    /// Records that `write` was sent at `now_ms` (refused or not: see
    /// [`control::peer_status::PeerStatusBook::written`]).
    pub fn peer_status_sent(&mut self, write: PeerStatusWrite, now_ms: i64) {
        self.peer_status_book.written(write, now_ms);
    }
}
