//! Node key rotation: a node makes a new WireGuard key, publishes it beside the current one
//! (`kilotun.io/next-key`), waits until its peers have had time to add it, then uses it and
//! publishes it as `kilo.squat.ai/key`.
//!
//! On the peers' side ([`successors`], [`Topology::add_successors`]): a link to a node with a
//! next key gets a second WireGuard peer for that key, with the link's endpoint and no allowed
//! IPs, marked as replacing the current key. kg's embedded engine sends to and accepts from the
//! successor in place of the current key as soon as the successor is heard from
//! (`dataplane::PeerConfig::replaces`), so the link is lost only for the handshake the rotating
//! node starts when it switches; a device that does not honour the mark (the kernel's, Kilo's)
//! moves the link when the new `kilo.squat.ai/key` arrives.
//!
//! On the rotating node ([`Rotation`]): each step is idempotent and survives a restart, since
//! the next key is on disk (`key.next`, with the request it answers) before it is published:
//!
//! 1. a request is seen (`kilotun.io/rotate-key` holds an id that `kilotun.io/key-rotated` does
//!    not) or the key is older than `--key-rotation-period`: [`RotationStep::MakeNextKey`];
//! 2. the next key is published as `kilotun.io/next-key`, with the request's id in
//!    `kilotun.io/key-rotated`;
//! 3. [`ROTATION_GRACE`] after the node's own watch shows it published:
//!    [`RotationStep::Commit`]: `key.next` replaces the key on disk and the device takes it;
//! 4. `kilo.squat.ai/key` says the new key and `next-key` goes.

use std::collections::BTreeMap;

use crate::key::Key;
use crate::node::Node;
use crate::topology::Topology;
use crate::wgconf::WgPeer;

/// How long a published next key stands before the node uses it: every kg's watch delivers the
/// Node and reconfigures its device well within it.
pub const ROTATION_GRACE_MS: i64 = 3_000;

/// The next key of every node rotating its key, by its current key.
pub fn successors(nodes: &[Node]) -> BTreeMap<Key, Key> {
    nodes
        .iter()
        .filter_map(|n| Some((n.key?, n.next_key?)))
        .filter(|(current, next)| current != next)
        .collect()
}

impl Topology {
    /// Adds, for each of `peers` whose node is rotating its key, a peer for the next key: the
    /// same endpoint and preshared key, no allowed IPs and no keepalive (the rotating node
    /// starts the handshake when it switches), replacing the current key.
    pub(crate) fn add_successors(&self, peers: &mut Vec<WgPeer>) {
        if self.successors.is_empty() {
            return;
        }
        let added: Vec<WgPeer> = peers
            .iter()
            .filter_map(|p| {
                let next = *self.successors.get(&p.public_key)?;
                Some(WgPeer {
                    public_key: next,
                    allowed_ips: Vec::new(),
                    endpoint: p.endpoint.clone(),
                    persistent_keepalive: 0,
                    preshared_key: p.preshared_key.clone(),
                    replaces: Some(p.public_key),
                })
            })
            .filter(|s| !peers.iter().any(|p| p.public_key == s.public_key))
            .collect();
        peers.extend(added);
    }
}

/// What the rotating node reads from its own Node, and how old its key is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RotationInputs<'a> {
    /// `kilotun.io/rotate-key`: the id of the rotation asked for, if any.
    pub requested: Option<&'a str>,
    /// `kilotun.io/key-rotated`: the id of the last request carried out, if any.
    pub rotated: Option<&'a str>,
    /// `kilotun.io/next-key` as the node's own watch shows it.
    pub published_next: Option<Key>,
    /// When the key in use was made (Unix milliseconds).
    pub key_made_ms: i64,
    /// `--key-rotation-period` in milliseconds; `None`: only on request.
    pub period_ms: Option<i64>,
}

/// A step of the rotation the shells carry out ([`Rotation::step`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RotationStep {
    /// Make a next key and write it to disk with `request` (the id it answers, none for a
    /// period), then report it with [`Rotation::prepared`].
    MakeNextKey {
        /// The request it answers.
        request: Option<String>,
    },
    /// Put the next key on disk in the key's place, give it to the device, and report with
    /// [`Rotation::committed`].
    Commit,
}

/// The next key, made and on disk, not yet in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NextKey {
    /// Its public key.
    pub key: Key,
    /// The request it answers (`None`: the period).
    pub request: Option<String>,
    /// When the node's own watch first showed it published (Unix milliseconds).
    pub seen_published_ms: Option<i64>,
}

/// Where this node's key rotation stands.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rotation {
    /// The next key, while a rotation is under way.
    pub next: Option<NextKey>,
    /// The request carried out last by this process, published as `kilotun.io/key-rotated`.
    pub rotated: Option<String>,
}

impl Rotation {
    /// A rotation resumed from the next key found on disk at start, if any.
    pub fn resumed(next: Option<(Key, Option<String>)>) -> Self {
        Self {
            next: next.map(|(key, request)| NextKey {
                key,
                request,
                seen_published_ms: None,
            }),
            rotated: None,
        }
    }

    /// The step due at `now_ms`, given what the node's own Node says.
    pub fn step(&mut self, inputs: &RotationInputs<'_>, now_ms: i64) -> Option<RotationStep> {
        match &mut self.next {
            None => {
                let rotated = self.rotated.as_deref().or(inputs.rotated);
                if let Some(id) = inputs.requested.filter(|id| Some(*id) != rotated) {
                    return Some(RotationStep::MakeNextKey {
                        request: Some(id.to_string()),
                    });
                }
                let due = inputs
                    .period_ms
                    .is_some_and(|p| now_ms.saturating_sub(inputs.key_made_ms) >= p);
                due.then_some(RotationStep::MakeNextKey { request: None })
            }
            Some(next) => {
                if inputs.published_next != Some(next.key) {
                    next.seen_published_ms = None;
                    return None;
                }
                let seen = *next.seen_published_ms.get_or_insert(now_ms);
                (now_ms - seen >= ROTATION_GRACE_MS).then_some(RotationStep::Commit)
            }
        }
    }

    /// The next key `key`, answering `request`, is on disk.
    pub fn prepared(&mut self, key: Key, request: Option<String>) {
        self.next = Some(NextKey {
            key,
            request,
            seen_published_ms: None,
        });
    }

    /// The next key is in use: returns it.
    pub fn committed(&mut self) -> Option<Key> {
        let next = self.next.take()?;
        if next.request.is_some() {
            self.rotated = next.request;
        }
        Some(next.key)
    }

    /// The request to publish as carried out: the one under way (published with the next
    /// key, so a restart after the switch does not rotate again), else the last one done.
    pub fn rotated_to_publish<'a>(&'a self, published: Option<&'a str>) -> Option<&'a str> {
        self.next
            .as_ref()
            .and_then(|n| n.request.as_deref())
            .or(self.rotated.as_deref())
            .or(published)
    }

    /// When the commit is due (Unix milliseconds), while the next key stands published.
    pub fn deadline_ms(&self) -> Option<i64> {
        let seen = self.next.as_ref()?.seen_published_ms?;
        Some(seen + ROTATION_GRACE_MS)
    }
}

#[cfg(test)]
#[path = "rotation/tests.rs"]
mod tests;
