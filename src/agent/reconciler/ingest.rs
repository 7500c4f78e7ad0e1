//! Taking in a snapshot of the backend: the node table, the IPAM objects and the Peers.

use std::collections::BTreeMap;

use control::clock::Now;
use control::journal::Reason;
use control::{translate_peer, Peer};

use super::Reconciler;
use crate::backend::Snapshot;

impl Reconciler {
    /// Takes in what changed in `snapshot` at `now`: brings the node table to it, through the
    /// change log when it reaches back to the last revision seen (else every Node is
    /// compared), and re-translates the Peers when they changed. Costs in proportion to the
    /// changes and keeps nothing of `snapshot` but the shared objects, so the backend never
    /// has to copy a snapshot a reader still holds.
    pub fn ingest(&mut self, snapshot: &Snapshot, now: Now) {
        self.listed |= snapshot.listed.all();
        self.local_object = snapshot.nodes.get(&self.config.hostname).cloned();
        if let (Some(sent), Some(object)) = (&mut self.last_patch, &self.local_object) {
            sent.observe(
                object
                    .metadata
                    .annotations
                    .as_ref()
                    .unwrap_or(&BTreeMap::new()),
            );
        }
        self.leases.ingest(&snapshot.leases, now.unix_ms);
        self.ingested_at = Some(now);
        let table = &mut self.table;
        let mut translated = Vec::new();
        match self.revision.and_then(|r| snapshot.changes.since(r)) {
            Some(names) => {
                for name in names {
                    let object = snapshot.nodes.get(name);
                    if let Some(problems) = table.update(name, object) {
                        translated.push((name.to_string(), problems));
                    }
                }
            }
            None => translated = table.sync(&snapshot.nodes),
        }
        self.revision = Some(snapshot.changes.revision());
        let ipam_revision = snapshot.changes.ipam_revision();
        self.take_ipam(&snapshot.ipam, ipam_revision, snapshot.listed.ipam);
        for (name, problems) in translated {
            for line in self.problems.fresh(&name, &problems) {
                self.journal.record(
                    Reason::BadAnnotation,
                    &name,
                    format!("bad annotation on node {line}"),
                );
            }
        }
        let peer_revision = snapshot.changes.peer_revision();
        if self.peer_revision == Some(peer_revision) {
            return;
        }
        self.peer_revision = Some(peer_revision);
        let mut peers: Vec<Peer> = Vec::with_capacity(snapshot.peers.len());
        for (name, object) in &snapshot.peers {
            let lines = match object.validate() {
                Ok(()) => {
                    peers.push(translate_peer(object));
                    Vec::new()
                }
                Err(e) => vec![format!("{name}: {e}; ignoring this Peer")],
            };
            for line in self.problems.fresh_lines(&format!("peer/{name}"), lines) {
                self.journal
                    .record(Reason::BadPeer, name, format!("bad Peer {line}"));
            }
        }
        if peers != self.peers {
            self.peers = peers;
            self.peers_changed = true;
        }
    }
}
