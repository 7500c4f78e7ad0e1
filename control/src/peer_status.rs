//! A Peer's `status`: which leaders serve it, what this node's engine sees of it (endpoint,
//! last handshake, bytes) and the WireGuard configuration it is given, written by one node of
//! the cluster (the leader of the first segment, see [`writes_peer_status`]) and only when
//! worth a write.
//!
//! Writes follow the node condition's habit ([`crate::condition`]): a Peer whose servers,
//! endpoint, configuration or connectedness changed is written at once, then at most once per
//! [`MIN_WRITE_INTERVAL_MS`]; an unchanged one is written again every [`HEARTBEAT_MS`] (its
//! handshake time and byte counts), so `N` Peers cost at most `N` writes per heartbeat.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::topology::Topology;
use crate::Key;

/// The shortest time between two writes of one Peer's changed status.
pub const MIN_WRITE_INTERVAL_MS: i64 = 10_000;
/// How often an unchanged status is written again.
pub const HEARTBEAT_MS: i64 = 5 * 60_000;
/// A handshake younger than this makes the Peer connected: WireGuard's `REJECT_AFTER_TIME`,
/// past which a session carries nothing.
pub const CONNECTED_WITHIN_MS: i64 = 180_000;

/// A leader that has the Peer among its WireGuard peers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Server {
    /// The segment's location.
    pub location: String,
    /// The leader's node name.
    pub node: String,
}

/// What the writer's engine knows of one peer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerReading {
    /// Where its packets come from now (`None`: nothing heard, no endpoint set).
    pub endpoint: Option<std::net::SocketAddr>,
    /// The last completed handshake (Unix milliseconds).
    pub last_handshake_ms: Option<i64>,
    /// Bytes received from it.
    pub rx_bytes: u64,
    /// Bytes sent to it.
    pub tx_bytes: u64,
}

/// A Peer's `status`, as written (camelCase, as Kubernetes spells fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerStatus {
    /// The node that wrote this status: its readings are that node's.
    pub reporter: String,
    /// Every leader that serves the Peer, by segment (shared by every Peer's status).
    pub served_by: Arc<Vec<Server>>,
    /// `served_by` as one line (`east=n1, west=n3`), for `kubectl get peers`.
    pub servers: Arc<str>,
    /// True when the reporter's engine completed a handshake with the Peer within
    /// [`CONNECTED_WITHIN_MS`].
    pub connected: bool,
    /// The Peer's endpoint as the reporter's engine sees it (`null` when it has none: in the
    /// merge patch kg sends, that removes an endpoint written before).
    pub endpoint: Option<String>,
    /// The reporter's last handshake with it (RFC 3339; `null` as the endpoint).
    pub last_handshake_time: Option<String>,
    /// Bytes the reporter received from it.
    pub rx_bytes: u64,
    /// Bytes the reporter sent to it.
    pub tx_bytes: u64,
    /// The Peer's WireGuard configuration, as `kgctl showconf peer NAME` prints it, without any
    /// key: add `PrivateKey` (and the Peer's own `PresharedKey`, when it has one). A section
    /// per segment: shared with [`PeerShapes`] until the topology changes.
    pub config: Arc<str>,
}

impl PeerStatus {
    /// True when what makes a write due at once is the same in both (reporter, servers,
    /// connectedness, endpoint, configuration); the rest waits for the heartbeat. The shared
    /// parts of statuses made from one topology compare by pointer.
    fn same_salient(&self, other: &Self) -> bool {
        fn same<T: PartialEq + ?Sized>(a: &Arc<T>, b: &Arc<T>) -> bool {
            Arc::ptr_eq(a, b) || a == b
        }
        self.reporter == other.reporter
            && self.connected == other.connected
            && self.endpoint == other.endpoint
            && same(&self.served_by, &other.served_by)
            && same(&self.config, &other.config)
    }
}

/// True when the node `hostname` of `t` writes the Peers' status: the leader of the topology's
/// first segment, one node in the cluster that has every Peer in its engine.
pub fn writes_peer_status(t: &Topology) -> bool {
    t.leader
        && t.segments
            .first()
            .and_then(|s| s.members.get(s.leader))
            .is_some_and(|m| m.name == t.hostname)
}

/// The status of each Peer of `t` with a key, from the reporter's `readings` (by key) at
/// `now_ms`.
pub fn statuses(
    t: &Arc<Topology>,
    readings: &BTreeMap<Key, PeerReading>,
    now_ms: i64,
) -> BTreeMap<String, PeerStatus> {
    PeerShapes::default().statuses(t, readings, now_ms)
}

/// What the Peers' statuses take from the topology: the servers and each Peer's configuration.
/// A configuration holds a section per segment (500 at 5,000 nodes in 500 locations), so they
/// are made again only when the topology changes, not at every step.
#[derive(Debug, Default)]
pub struct PeerShapes {
    topology: Option<Arc<Topology>>,
    served_by: Arc<Vec<Server>>,
    servers: Arc<str>,
    configs: BTreeMap<String, Arc<str>>,
}

impl PeerShapes {
    /// [`statuses`], with what `t` gives them made only if `t` differs from the last topology.
    pub fn statuses(
        &mut self,
        t: &Arc<Topology>,
        readings: &BTreeMap<Key, PeerReading>,
        now_ms: i64,
    ) -> BTreeMap<String, PeerStatus> {
        let same = self
            .topology
            .as_ref()
            .is_some_and(|last| Arc::ptr_eq(last, t) || **last == **t);
        if !same {
            self.shape(t);
        }
        self.topology = Some(Arc::clone(t));
        t.peers
            .iter()
            .filter_map(|p| {
                let key = p.public_key?;
                let config = Arc::clone(self.configs.get(&p.name)?);
                let reading = readings.get(&key).copied().unwrap_or_default();
                let status = PeerStatus {
                    reporter: t.hostname.clone(),
                    served_by: Arc::clone(&self.served_by),
                    servers: Arc::clone(&self.servers),
                    connected: reading
                        .last_handshake_ms
                        .is_some_and(|at| now_ms - at < CONNECTED_WITHIN_MS),
                    endpoint: reading.endpoint.map(|e| e.to_string()),
                    last_handshake_time: reading.last_handshake_ms.map(rfc3339),
                    rx_bytes: reading.rx_bytes,
                    tx_bytes: reading.tx_bytes,
                    config,
                };
                Some((p.name.clone(), status))
            })
            .collect()
    }

    /// Makes the servers and every keyed Peer's configuration of `t`.
    fn shape(&mut self, t: &Topology) {
        let served_by: Vec<Server> = t
            .segments
            .iter()
            .filter_map(|s| {
                Some(Server {
                    location: s.location.clone(),
                    node: s.members.get(s.leader)?.name.clone(),
                })
            })
            .collect();
        self.servers = served_by
            .iter()
            .map(|s| format!("{}={}", s.location, s.node))
            .collect::<Vec<_>>()
            .join(", ")
            .into();
        self.served_by = Arc::new(served_by);
        self.configs = t
            .peers
            .iter()
            .filter(|p| p.public_key.is_some())
            .map(|p| {
                let mut conf = t.peer_conf(&p.name);
                for peer in &mut conf.peers {
                    peer.preshared_key = None;
                }
                (p.name.clone(), Arc::from(conf.to_ini(None)))
            })
            .collect();
    }
}

/// Unix milliseconds as RFC 3339 seconds (`2026-12-03T06:40:00Z`).
fn rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let (days, rest) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// Howard Hinnant's days-to-civil: the proleptic Gregorian date of `days` since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// One Peer's status to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerStatusWrite {
    /// The Peer's name.
    pub peer: String,
    /// Its status.
    pub status: PeerStatus,
}

/// What was last written for each Peer, and when: decides which writes are due.
#[derive(Debug, Default)]
pub struct PeerStatusBook {
    written: BTreeMap<String, (PeerStatus, i64)>,
}

impl PeerStatusBook {
    /// The writes due at `now_ms` for `current` (see the module's doc). Peers that are gone are
    /// forgotten: one that comes back is written at once.
    pub fn due(
        &mut self,
        current: &BTreeMap<String, PeerStatus>,
        now_ms: i64,
    ) -> Vec<PeerStatusWrite> {
        self.written.retain(|name, _| current.contains_key(name));
        current
            .iter()
            .filter(|(name, status)| match self.written.get(*name) {
                None => true,
                Some((last, at)) => {
                    let since = now_ms - at;
                    let changed = !last.same_salient(status);
                    changed && since >= MIN_WRITE_INTERVAL_MS || since >= HEARTBEAT_MS
                }
            })
            .map(|(name, status)| PeerStatusWrite {
                peer: name.clone(),
                status: status.clone(),
            })
            .collect()
    }

    /// Records `write` as sent at `now_ms`. A refused write is recorded too, so it is tried
    /// again only at the next change or heartbeat.
    pub fn written(&mut self, write: PeerStatusWrite, now_ms: i64) {
        self.written.insert(write.peer, (write.status, now_ms));
    }

    /// Forgets every write: this node no longer writes the Peers' status (another leads the
    /// first segment), so if it writes again it starts afresh.
    pub fn clear(&mut self) {
        self.written.clear();
    }
}

#[cfg(test)]
#[path = "peer_status_tests.rs"]
mod tests;
