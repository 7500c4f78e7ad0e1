//! Which of a peer's candidates kg uses, decided by handshake: one candidate at a time, the
//! next while no handshake completes within the probe window although the device sent, and a
//! candidate that worked kept until it fails (the device sends and its last handshake is
//! older than a session lives).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use super::candidates::{EndpointFilter, UnderlayFamily};
use crate::clock::Now;
use crate::key::Key;
use crate::peer_status::PeerReading;

/// WireGuard's `Reject-After-Time`: a session older than this carries nothing, so a link
/// whose last handshake is older while the device sends has failed.
pub const SESSION_LIFETIME: Duration = Duration::from_secs(180);

/// How many departures a peer's status keeps (the latest).
const LEFT_KEPT: usize = 8;

/// How many times a candidate's window doubles for a peer none of whose candidates answered,
/// one doubling per round through them all: 2^3 windows (2 min at 15 s) at most, so a node
/// that is gone costs a handshake per candidate every two minutes, not every window.
pub const MAX_BACKOFF: u32 = 3;

/// How kg picks among candidates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeRules {
    /// How long a candidate has to complete a handshake (`--endpoint-probe-window`).
    pub window: Duration,
    /// Which of a peer's candidates may be tried (`--accept-endpoints`).
    pub accept: EndpointFilter,
    /// Which family is tried first (`--underlay-family`).
    pub family: UnderlayFamily,
    /// True when this host has an IPv4 address to send from.
    pub ipv4: bool,
    /// True when this host has an IPv6 address to send from.
    pub ipv6: bool,
}

impl ProbeRules {
    /// The candidates of `node` kg will try, in order, and those refused with why:
    /// `--accept-endpoints` refuses, a family this host has no address of is refused, and so
    /// is an address `outside_route` says the host has no route for except through the mesh
    /// (WireGuard's packets would travel inside the tunnel). The rest are ordered by
    /// `--underlay-family`, the list's order otherwise.
    pub fn usable(
        &self,
        node: &str,
        candidates: &[SocketAddr],
        outside_route: impl Fn(IpAddr) -> bool,
    ) -> (Vec<SocketAddr>, Vec<Refusal>) {
        let mut usable = Vec::new();
        let mut refused = Vec::new();
        for addr in candidates {
            let ip = addr.ip();
            let why = if !self.accept.admits(ip) {
                Some(format!("--accept-endpoints={} refuses it", self.accept))
            } else if ip.is_ipv4() && !self.ipv4 {
                Some("this host has no IPv4 address".to_string())
            } else if ip.is_ipv6() && !self.ipv6 {
                Some("this host has no IPv6 address".to_string())
            } else if !outside_route(ip) {
                Some("this host has no route to it outside the mesh: WireGuard's packets would travel inside the tunnel".to_string())
            } else {
                None
            };
            match why {
                Some(why) => refused.push(Refusal {
                    node: node.to_string(),
                    endpoint: *addr,
                    why,
                }),
                None => usable.push(*addr),
            }
        }
        match self.family {
            UnderlayFamily::Auto => {}
            UnderlayFamily::Ipv4 => usable.sort_by_key(|a| a.is_ipv6()),
            UnderlayFamily::Ipv6 => usable.sort_by_key(|a| a.is_ipv4()),
        }
        (usable, refused)
    }
}

/// A peer's candidates as the mesh names them ([`EndpointProbes::track`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrackedPeer {
    /// The node at the other end.
    pub node: String,
    /// Its public key.
    pub key: Key,
    /// The candidates it publishes, in its order.
    pub candidates: Vec<SocketAddr>,
}

/// A candidate kg will not try, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The node that published it.
    pub node: String,
    /// The candidate.
    pub endpoint: SocketAddr,
    /// Why it is not tried.
    pub why: String,
}

/// A candidate kg stopped using.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CandidateLeft {
    /// The candidate.
    pub endpoint: SocketAddr,
    /// Why it was left.
    pub why: String,
    /// When (Unix milliseconds).
    pub at_ms: i64,
}

/// kg moved a peer to another candidate ([`EndpointProbes::observe`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointMove {
    /// The node at the other end.
    pub node: String,
    /// Its public key.
    pub key: Key,
    /// The candidate left.
    pub from: SocketAddr,
    /// The candidate now in use.
    pub to: SocketAddr,
    /// Why `from` was left.
    pub why: String,
}

/// Where a peer's probing stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeState {
    /// Its only usable candidate is in use: nothing to probe.
    Only,
    /// The candidate in use has not completed a handshake yet.
    Probing,
    /// The candidate in use completed a handshake: it stays until it fails.
    Working,
}

impl ProbeState {
    /// The word `/status` shows.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Only => "only",
            Self::Probing => "probing",
            Self::Working => "working",
        }
    }
}

/// One peer's probing, as `/status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeStatus {
    /// The node at the other end.
    pub node: String,
    /// Its public key.
    pub key: Key,
    /// The candidate in use (`None`: every one refused, Kilo's endpoint is used).
    pub in_use: Option<SocketAddr>,
    /// Where probing stands.
    pub state: ProbeState,
    /// The candidates kg tries, in order.
    pub usable: Vec<SocketAddr>,
    /// The candidates kg refused, with why.
    pub refused: Vec<Refusal>,
    /// The latest candidates left, with why, oldest first.
    pub left: Vec<CandidateLeft>,
}

/// One peer's probing.
#[derive(Debug, Clone)]
struct PeerProbe {
    node: String,
    usable: Vec<SocketAddr>,
    refused: Vec<Refusal>,
    /// The index in `usable` of the candidate in use.
    at: usize,
    /// When it was put in use.
    since: Instant,
    since_ms: i64,
    /// The bytes sent to the peer when the candidate was put in use (first read after).
    tx_at_start: Option<u64>,
    /// The bytes sent at the last reading.
    tx_last: Option<u64>,
    worked: bool,
    /// Rounds through every candidate with no handshake since one last worked (or the list
    /// changed): each doubles the window, up to [`MAX_BACKOFF`] times.
    rounds: u32,
    left: Vec<CandidateLeft>,
    /// When the readings are next wanted.
    due: Instant,
}

impl PeerProbe {
    fn status(&self, key: Key) -> ProbeStatus {
        let state = if self.usable.len() < 2 {
            ProbeState::Only
        } else if self.worked {
            ProbeState::Working
        } else {
            ProbeState::Probing
        };
        ProbeStatus {
            node: self.node.clone(),
            key,
            in_use: self.usable.get(self.at).copied(),
            state,
            usable: self.usable.clone(),
            refused: self.refused.clone(),
            left: self.left.clone(),
        }
    }

    /// The window the candidate in use has: the probe window, doubled for each round through
    /// every candidate that found none answering.
    fn window(&self, window: Duration) -> Duration {
        window * (1 << self.rounds.min(MAX_BACKOFF))
    }

    fn start(&mut self, at: usize, now: Now, window: Duration) {
        self.at = at;
        self.since = now.instant;
        self.since_ms = now.unix_ms;
        self.tx_at_start = None;
        self.worked = false;
        self.due = now.instant + self.window(window);
    }
}

/// Every peer's probing: the candidate in use per peer, chosen by handshake.
#[derive(Debug, Clone)]
pub struct EndpointProbes {
    rules: ProbeRules,
    peers: BTreeMap<Key, PeerProbe>,
    /// Peers moved to another candidate whose device has not been told to handshake yet.
    moved: Vec<Key>,
    /// Counts the changes of what [`EndpointProbes::statuses`] shows.
    revision: u64,
}

impl EndpointProbes {
    /// No peer tracked yet, probing by `rules`.
    pub fn new(rules: ProbeRules) -> Self {
        Self {
            rules,
            peers: BTreeMap::new(),
            moved: Vec::new(),
            revision: 0,
        }
    }

    /// A number that changes whenever what [`EndpointProbes::statuses`] shows does: a reader
    /// that saw it before need not ask again.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The rules in force.
    pub fn rules(&self) -> &ProbeRules {
        &self.rules
    }

    /// Sets the host's address families (they come with each listing of the host).
    pub fn set_families(&mut self, ipv4: bool, ipv6: bool) {
        self.rules.ipv4 = ipv4;
        self.rules.ipv6 = ipv6;
    }

    /// Takes the peers the mesh has now at `now` (see [`ProbeRules::usable`] for
    /// `outside_route`). A peer whose usable list is unchanged keeps its state; one whose
    /// list changed keeps its candidate in use when the new list still has it, and starts at
    /// the first otherwise; a peer no longer named is forgotten. Returns the refusals not
    /// returned before, to be said once.
    pub fn track(
        &mut self,
        peers: &[TrackedPeer],
        outside_route: impl Fn(IpAddr) -> bool,
        now: Now,
    ) -> Vec<Refusal> {
        let mut fresh = Vec::new();
        let mut kept = BTreeMap::new();
        let mut changed = false;
        for peer in peers {
            let (usable, refused) = self
                .rules
                .usable(&peer.node, &peer.candidates, &outside_route);
            let old = self.peers.remove(&peer.key);
            changed |= old
                .as_ref()
                .is_none_or(|o| o.usable != usable || o.refused != refused || o.node != peer.node);
            let said: &[Refusal] = old.as_ref().map_or(&[], |o| &o.refused);
            fresh.extend(refused.iter().filter(|r| !said.contains(r)).cloned());
            let probe = match old {
                Some(mut probe) if probe.usable == usable => {
                    probe.refused = refused;
                    probe.node.clone_from(&peer.node);
                    probe
                }
                Some(mut probe) => {
                    let in_use = probe.usable.get(probe.at).copied();
                    let kept_at = in_use.and_then(|a| usable.iter().position(|u| *u == a));
                    probe.usable = usable;
                    probe.refused = refused;
                    probe.node.clone_from(&peer.node);
                    probe.rounds = 0;
                    match kept_at {
                        Some(at) => probe.at = at,
                        None => probe.start(0, now, self.rules.window),
                    }
                    probe
                }
                None => {
                    let mut probe = PeerProbe {
                        node: peer.node.clone(),
                        usable,
                        refused,
                        at: 0,
                        since: now.instant,
                        since_ms: now.unix_ms,
                        tx_at_start: None,
                        tx_last: None,
                        worked: false,
                        rounds: 0,
                        left: Vec::new(),
                        due: now.instant,
                    };
                    probe.start(0, now, self.rules.window);
                    probe
                }
            };
            kept.insert(peer.key, probe);
        }
        // A peer forgotten changes what the statuses show too.
        if !self.peers.is_empty() {
            changed = true;
        }
        if changed {
            self.revision += 1;
        }
        self.peers = kept;
        fresh
    }

    /// The candidate in use per peer with a usable one: the endpoint kg configures for it,
    /// unless NAT discovery knows better.
    pub fn choices(&self) -> BTreeMap<Key, SocketAddr> {
        self.peers
            .iter()
            .filter_map(|(key, p)| Some((*key, *p.usable.get(p.at)?)))
            .collect()
    }

    /// Takes the device's `readings` at `now` and moves every peer whose candidate failed to
    /// the next one: one not yet working when the window passed with bytes sent and no
    /// handshake since it was put in use; one working when the device sends and its last
    /// handshake is older than [`SESSION_LIFETIME`] and a window. Returns the moves (the
    /// device's endpoints then change).
    pub fn observe(
        &mut self,
        readings: &BTreeMap<Key, PeerReading>,
        now: Now,
    ) -> Vec<EndpointMove> {
        let window = self.rules.window;
        let mut moves = Vec::new();
        for (key, probe) in self.peers.iter_mut() {
            if probe.usable.len() < 2 {
                continue;
            }
            let Some(reading) = readings.get(key) else {
                // The device does not have it (yet): ask again later, not at once.
                probe.due = now.instant + window / 3;
                continue;
            };
            let tx_start = *probe.tx_at_start.get_or_insert(reading.tx_bytes);
            let sending = probe.tx_last.is_some_and(|last| reading.tx_bytes > last);
            probe.tx_last = Some(reading.tx_bytes);
            let handshake = reading.last_handshake_ms;
            if !probe.worked && handshake.is_some_and(|at| at >= probe.since_ms) {
                probe.worked = true;
                probe.rounds = 0;
                self.revision += 1;
            }
            let window_now = probe.window(window);
            let why = if probe.worked {
                let stale_ms = (SESSION_LIFETIME + window).as_millis() as i64;
                let age = handshake.map(|at| now.unix_ms - at);
                (sending && age.is_some_and(|age| age > stale_ms)).then(|| {
                    format!(
                        "it worked, but no handshake for {} s while kg sends",
                        age.unwrap_or_default() / 1000
                    )
                })
            } else {
                let waited = now.instant.saturating_duration_since(probe.since);
                (waited >= window_now && reading.tx_bytes > tx_start).then(|| {
                    format!(
                        "no handshake within {} s of trying it",
                        window_now.as_secs_f64()
                    )
                })
            };
            match why {
                Some(why) => {
                    let from = probe.usable[probe.at];
                    let next = (probe.at + 1) % probe.usable.len();
                    if next == 0 && !probe.worked {
                        // A round through every candidate found none answering: wait longer
                        // on each in the next (a node that is gone, a peer still booting).
                        probe.rounds += 1;
                    }
                    probe.left.push(CandidateLeft {
                        endpoint: from,
                        why: why.clone(),
                        at_ms: now.unix_ms,
                    });
                    if probe.left.len() > LEFT_KEPT {
                        probe.left.remove(0);
                    }
                    probe.start(next, now, window);
                    probe.tx_at_start = Some(reading.tx_bytes);
                    self.revision += 1;
                    if !self.moved.contains(key) {
                        self.moved.push(*key);
                    }
                    moves.push(EndpointMove {
                        node: probe.node.clone(),
                        key: *key,
                        from,
                        to: probe.usable[next],
                        why,
                    });
                }
                None if !probe.worked && probe.since + window_now > now.instant => {
                    probe.due = probe.since + window_now;
                }
                None => probe.due = now.instant + window / 3,
            }
        }
        moves
    }

    /// The peers moved since the last call, which the device should start a handshake with
    /// as soon as it has their new endpoint (so each candidate is tried at once).
    pub fn take_moved(&mut self) -> Vec<Key> {
        std::mem::take(&mut self.moved)
    }

    /// When the device's readings are next wanted: the soonest a peer with two candidates or
    /// more may need to move (`None`: no peer has a choice).
    pub fn next_check(&self) -> Option<Instant> {
        self.peers
            .values()
            .filter(|p| p.usable.len() >= 2)
            .map(|p| p.due)
            .min()
    }

    /// Every tracked peer's probing, by node name.
    pub fn statuses(&self) -> Vec<ProbeStatus> {
        let mut all: Vec<ProbeStatus> = self.peers.iter().map(|(k, p)| p.status(*k)).collect();
        all.sort_by(|a, b| a.node.cmp(&b.node));
        all
    }
}
