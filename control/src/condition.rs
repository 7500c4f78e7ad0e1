//! The node condition `KiloMeshReady`: whether this node's part of the mesh works, judged from
//! what kg already knows (the engine's configuration, the node's role in the topology, its
//! tunnels' byte counters), and when that judgement is worth a write to the API server.
//!
//! A tunnel is down when, over at least [`DOWN_WINDOW_MS`], its far end was sent something and
//! answered nothing: the same evidence a leader's lease uses to mark itself cut off. An idle
//! tunnel (nothing sent) is not down: WireGuard shakes hands only when there is traffic.
//!
//! Writes follow node-problem-detector's habit: on a change of status or reason (at most one
//! per [`MIN_WRITE_INTERVAL_MS`], so a flapping tunnel costs one write per interval), and as a
//! heartbeat every [`HEARTBEAT_MS`] otherwise. A message that changes alone waits for the
//! heartbeat.

use std::collections::{BTreeMap, VecDeque};

use crate::leader::{sent_unanswered, TrafficSample, CUT_OFF_WINDOW_MS};
use crate::Key;

/// The condition's `type` on the Node.
pub const CONDITION_TYPE: &str = "KiloMeshReady";
/// How long a tunnel must be sent to without an answer to count as down.
pub const DOWN_WINDOW_MS: i64 = CUT_OFF_WINDOW_MS;
/// The shortest time between two writes of a changed condition.
pub const MIN_WRITE_INTERVAL_MS: i64 = 10_000;
/// How often an unchanged condition is written again (`lastHeartbeatTime`): every 10 minutes,
/// so that at 5,000 nodes the conditions cost half the budget of one write per node per five
/// minutes, and the Events and Peer statuses fit in the rest.
pub const HEARTBEAT_MS: i64 = 10 * 60_000;

/// The condition's `status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConditionStatus {
    /// The node's part of the mesh works.
    True,
    /// It does not: the reason says why.
    False,
    /// kg cannot tell (the device's counters cannot be read).
    Unknown,
}

impl ConditionStatus {
    /// The value Kubernetes spells.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::True => "True",
            Self::False => "False",
            Self::Unknown => "Unknown",
        }
    }
}

/// Why the condition has its status: the condition's `reason`, stable for alerts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MeshReason {
    /// A leader whose tunnels to the other locations answer (or are idle).
    Meshed,
    /// A follower: its location's leader carries its traffic.
    FollowsLeader,
    /// The engine has no configuration yet (no reconcile, no restored peers).
    EngineNotConfigured,
    /// The local node is not ready, so it has no place in the topology.
    NodeNotReady,
    /// Some tunnels to other locations were sent to and answered nothing.
    PeersDown,
    /// Every tunnel to another location was sent to and answered nothing: this leader is cut off.
    NoLeaderReachable,
    /// The device's counters could not be read.
    TunnelsUnreadable,
}

impl MeshReason {
    /// The reason as the condition carries it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Meshed => "Meshed",
            Self::FollowsLeader => "FollowsLeader",
            Self::EngineNotConfigured => "EngineNotConfigured",
            Self::NodeNotReady => "NodeNotReady",
            Self::PeersDown => "PeersDown",
            Self::NoLeaderReachable => "NoLeaderReachable",
            Self::TunnelsUnreadable => "TunnelsUnreadable",
        }
    }

    /// The reason a condition names `name`, if it is one of these.
    pub fn from_name(name: &str) -> Option<Self> {
        [
            Self::Meshed,
            Self::FollowsLeader,
            Self::EngineNotConfigured,
            Self::NodeNotReady,
            Self::PeersDown,
            Self::NoLeaderReachable,
            Self::TunnelsUnreadable,
        ]
        .into_iter()
        .find(|r| r.as_str() == name)
    }

    /// The status that goes with the reason.
    pub fn status(self) -> ConditionStatus {
        match self {
            Self::Meshed | Self::FollowsLeader => ConditionStatus::True,
            Self::TunnelsUnreadable => ConditionStatus::Unknown,
            _ => ConditionStatus::False,
        }
    }
}

/// The judgement: status (from the reason), reason and a message naming what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshCondition {
    /// Why.
    pub reason: MeshReason,
    /// What, for a person.
    pub message: String,
}

impl MeshCondition {
    /// The condition's status.
    pub fn status(&self) -> ConditionStatus {
        self.reason.status()
    }
}

/// A tunnel this node must keep: another location's leader (or, in full granularity, another
/// node), by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tunnel {
    /// The far end's node name.
    pub name: String,
    /// Its public key.
    pub key: Key,
}

/// What this node is in the mesh now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Not in the topology: why (the readiness check's words).
    NotReady(String),
    /// It leads `location` and keeps `tunnels` to the other locations.
    Leader {
        /// The location it leads.
        location: String,
        /// The tunnels to the other locations' leaders.
        tunnels: Vec<Tunnel>,
    },
    /// It follows `leader`, its location's leader.
    Follower {
        /// The leader's node name.
        leader: String,
    },
}

/// What the judgement reads besides the role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MeshInputs {
    /// The engine carries a configuration (a reconcile's, or the last run's peers).
    pub engine_configured: bool,
    /// This node's role.
    pub role: Role,
    /// The device's bytes received and sent per peer; `None` when they could not be read.
    pub traffic: Option<BTreeMap<Key, (u64, u64)>>,
}

/// The tunnels' history the judgement needs: byte counters sampled over the last
/// [`DOWN_WINDOW_MS`] and a little more, and the tunnels judged down since when.
#[derive(Debug, Clone, Default)]
pub struct MeshWatch {
    samples: VecDeque<TrafficSample>,
    /// The tunnels judged down, by far end, and when that was first judged (Unix ms).
    down_since: BTreeMap<String, i64>,
    /// The tunnels that went down or came back since [`MeshWatch::take_link_changes`].
    link_changes: Vec<LinkChange>,
}

/// A tunnel of this leader that went down or came back, as the judgements saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkChange {
    /// The tunnel to `name` was sent to for [`DOWN_WINDOW_MS`] and answered nothing.
    Down {
        /// The far end's node name.
        name: String,
    },
    /// The tunnel to `name`, judged down, received something again.
    Up {
        /// The far end's node name.
        name: String,
        /// How long it was judged down.
        down_ms: i64,
    },
}

impl MeshWatch {
    /// Judges the node at `now_ms` from `inputs`, keeping their counters for later judgements.
    pub fn judge(&mut self, inputs: &MeshInputs, now_ms: i64) -> MeshCondition {
        if let Some(traffic) = &inputs.traffic {
            self.samples.push_back(TrafficSample {
                at_ms: now_ms,
                peers: traffic.clone(),
            });
            // Keep the newest sample at least DOWN_WINDOW_MS old as the baseline.
            while self
                .samples
                .get(1)
                .is_some_and(|s| now_ms - s.at_ms >= DOWN_WINDOW_MS)
            {
                self.samples.pop_front();
            }
        }
        if !inputs.engine_configured {
            self.down_since.clear();
            return condition(
                MeshReason::EngineNotConfigured,
                "the WireGuard engine has no configuration yet: no reconcile has configured it and no saved peers were restored".into(),
            );
        }
        let (location, tunnels) = match &inputs.role {
            Role::NotReady(why) => {
                self.down_since.clear();
                return condition(
                    MeshReason::NodeNotReady,
                    format!("the node is not part of the mesh: {why}"),
                );
            }
            Role::Follower { leader } => {
                self.samples.clear();
                self.down_since.clear();
                return condition(
                    MeshReason::FollowsLeader,
                    format!("follows its location's leader {leader}, which carries its traffic to the other locations"),
                );
            }
            Role::Leader { location, tunnels } => (location, tunnels),
        };
        if inputs.traffic.is_none() {
            return condition(
                MeshReason::TunnelsUnreadable,
                "the WireGuard device's counters cannot be read".into(),
            );
        }
        let down = self.down(tunnels, now_ms);
        self.track_links(tunnels, &down, now_ms);
        if tunnels.is_empty() {
            return condition(
                MeshReason::Meshed,
                format!("leads location {location}; no other location to reach"),
            );
        }
        if down.is_empty() {
            return condition(
                MeshReason::Meshed,
                format!(
                    "leads location {location}; its {} tunnels to other locations answer or are idle",
                    tunnels.len()
                ),
            );
        }
        let seconds = DOWN_WINDOW_MS / 1000;
        if down.len() == tunnels.len() {
            return condition(
                MeshReason::NoLeaderReachable,
                format!("leads location {location}; none of its tunnels to other locations ({}) answered in {seconds} s of sending", down.join(", ")),
            );
        }
        condition(
            MeshReason::PeersDown,
            format!(
                "leads location {location}; {} of its {} tunnels to other locations answered nothing in {seconds} s of sending: {}",
                down.len(),
                tunnels.len(),
                down.join(", ")
            ),
        )
    }

    /// The tunnels that went down or came back since the last call, oldest first.
    pub fn take_link_changes(&mut self) -> Vec<LinkChange> {
        std::mem::take(&mut self.link_changes)
    }

    /// Notes the tunnels newly judged down (`down`), and those judged down before that
    /// received something since the previous sample: evidence, not silence, brings a tunnel
    /// back (one that went idle stays down until it hears something or leaves the topology).
    fn track_links(&mut self, tunnels: &[Tunnel], down: &[String], now_ms: i64) {
        self.down_since
            .retain(|name, _| tunnels.iter().any(|t| &t.name == name));
        for name in down {
            if !self.down_since.contains_key(name) {
                self.down_since.insert(name.clone(), now_ms);
                self.link_changes
                    .push(LinkChange::Down { name: name.clone() });
            }
        }
        let latest = self
            .samples
            .len()
            .checked_sub(2)
            .map(|i| (&self.samples[i], &self.samples[i + 1]));
        let Some((before, after)) = latest else {
            return;
        };
        let heard = |key: &Key| match (before.peers.get(key), after.peers.get(key)) {
            (Some((rx0, _)), Some((rx1, _))) => rx1 > rx0,
            _ => false,
        };
        for tunnel in tunnels {
            if down.contains(&tunnel.name) || !heard(&tunnel.key) {
                continue;
            }
            if let Some(since) = self.down_since.remove(&tunnel.name) {
                self.link_changes.push(LinkChange::Up {
                    name: tunnel.name.clone(),
                    down_ms: now_ms - since,
                });
            }
        }
    }

    /// The names of the `tunnels` that were sent to and received nothing over the window.
    fn down(&self, tunnels: &[Tunnel], now_ms: i64) -> Vec<String> {
        let (Some(oldest), Some(newest)) = (self.samples.front(), self.samples.back()) else {
            return Vec::new();
        };
        if now_ms - oldest.at_ms < DOWN_WINDOW_MS {
            return Vec::new();
        }
        tunnels
            .iter()
            .filter(
                |t| match (oldest.peers.get(&t.key), newest.peers.get(&t.key)) {
                    (Some(before), Some(after)) => sent_unanswered(*before, *after),
                    // A peer the device lacks cannot carry anything.
                    (_, None) => true,
                    // Added within the window: not judged yet.
                    (None, Some(_)) => false,
                },
            )
            .map(|t| t.name.clone())
            .collect()
    }
}

fn condition(reason: MeshReason, message: String) -> MeshCondition {
    MeshCondition { reason, message }
}

/// A condition to write: the judgement, and the times the Node's condition carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConditionWrite {
    /// The judgement.
    pub condition: MeshCondition,
    /// `lastTransitionTime`: when the status last changed (Unix milliseconds).
    pub transition_ms: i64,
    /// `lastHeartbeatTime`: now.
    pub heartbeat_ms: i64,
}

/// What was last written, and so what is due.
#[derive(Debug, Clone, Default)]
pub struct ConditionBook {
    written: Option<ConditionWrite>,
    /// True once the condition the Node carried was asked for ([`ConditionBook::adopt`]).
    adopted: bool,
}

impl ConditionBook {
    /// The write due at `now_ms` for `judged`, if any (see the module's doc).
    pub fn due(&self, judged: &MeshCondition, now_ms: i64) -> Option<ConditionWrite> {
        let Some(last) = &self.written else {
            return Some(ConditionWrite {
                condition: judged.clone(),
                transition_ms: now_ms,
                heartbeat_ms: now_ms,
            });
        };
        let since = now_ms - last.heartbeat_ms;
        let changed = last.condition.reason != judged.reason;
        if !(changed && since >= MIN_WRITE_INTERVAL_MS || since >= HEARTBEAT_MS) {
            return None;
        }
        let transition_ms = if last.condition.status() == judged.status() {
            last.transition_ms
        } else {
            now_ms
        };
        Some(ConditionWrite {
            condition: judged.clone(),
            transition_ms,
            heartbeat_ms: now_ms,
        })
    }

    /// Takes the condition the Node already carries (the last run's), so that an unchanged
    /// status keeps its `lastTransitionTime` and a fresh kg writes only what changed.
    /// `None`: the Node has none.
    pub fn adopt(&mut self, present: Option<ConditionWrite>) {
        self.adopted = true;
        if self.written.is_none() {
            self.written = present;
        }
    }

    /// True until the Node's own condition was adopted or one was written: the driver reads
    /// it once before the first write.
    pub fn wants_present(&self) -> bool {
        !self.adopted && self.written.is_none()
    }

    /// Records that `write` was sent. The driver records a refused write too, so that it is
    /// tried again only at the next change or heartbeat; one never recorded is due at once.
    pub fn written(&mut self, write: ConditionWrite) {
        self.written = Some(write);
    }
}

#[cfg(test)]
#[path = "condition_tests.rs"]
mod tests;
