//! Leaders that fail over in seconds: a lease per location, renewed by its holder while it is
//! healthy. Every node still computes every location's leader by itself, from the same Node
//! objects and the same leases, so all agree without talking to each other:
//!
//! - a node that is cordoned (`spec.unschedulable`) is no candidate while another is;
//! - a valid lease's holder leads, unless a candidate annotated `kilo.squat.ai/leader` is
//!   preferred over it (Kilo's annotation keeps its meaning);
//! - otherwise Kilo's rule picks among the candidates, leaving out the holder of an expired
//!   lease (it stopped renewing: it is dead or gave up).
//!
//! Leases are used only while every ready node of the cluster runs kilotun with lease election
//! (and says so with [`crate::node::annotation::LEADER_ELECTION`]): every agent chooses a peer
//! for every location, so a single Kilo agent anywhere, which follows Kilo's rule for all
//! locations, would otherwise disagree with the rest about some location's leader and cut the
//! traffic between them. Until then every node follows Kilo's rule ([`lease_agreement`] says
//! which node holds the cluster back). A recovered leader does not take leadership back while
//! the lease is held (hold-down), and a leaving or broken holder hands the lease to the next
//! candidate itself, so no node waits for it to expire.
//!
//! A holder whose lease expired (or that a verifier found cut off) is recorded in the lease as
//! deposed, with the `last-seen` it had then; it is no candidate until it checks in again. A
//! dead node still counts as ready for a minute by Kilo's rule, so without this record the
//! second of two leaders dying in a row would be succeeded by the first, dead, one.
//!
//! A holder whose tunnels to every other location went silent does not give the lead away
//! blindly: the whole location may be cut off, and then every candidate would be as cut off as
//! it. It marks its lease cut off instead; the next few candidates ([`Election::verifiers`]) then
//! open standby tunnels (handshakes only, no allowed IPs) to the other locations' leaders, and
//! the first whose handshake completes takes the lease over. When none does within
//! [`VERIFY_WINDOW_MS`], the holder withdraws the mark and keeps the lead.

pub mod book;
pub mod shares;

use std::collections::BTreeMap;

use crate::node::Node;
use crate::topology::find_leader;

/// How long a lease stays valid after its last renewal was seen.
pub const LEASE_DURATION_MS: i64 = 6_000;
/// How often the holder renews (and a candidate checks whether to take over).
pub const LEASE_RENEW_MS: i64 = 2_000;
/// How long a leader's tunnels must send without receiving before it gives its lease up:
/// longer than WireGuard's 10 s passive keepalive, so one-way traffic is never mistaken for it.
pub const CUT_OFF_WINDOW_MS: i64 = 12_000;
/// How long a holder's cut-off mark stands without a verifier taking over: past it, the next
/// candidates reached no other location either, so the holder is no more cut off than they are
/// (the other locations are down, or the whole location is cut off). It withdraws the mark and
/// asks again only once its tunnels hear something or another location's leader changes.
pub const VERIFY_WINDOW_MS: i64 = 20_000;
/// How many candidates check whether they reach the other locations when the holder is cut off.
pub const VERIFIERS: usize = 3;

/// A location's lease, as the backend holds it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseState {
    /// The node holding it (`None`: released).
    pub holder: Option<String>,
    /// Unix milliseconds of the last renewal.
    pub renewed_ms: i64,
    /// How long it is valid after a renewal, in milliseconds.
    pub duration_ms: i64,
    /// How many times it changed hands.
    pub transitions: i32,
    /// The holder says its tunnels to every other location went silent: other candidates check
    /// whether they reach those locations, and one that does takes the lease over.
    pub cut_off: bool,
    /// Earlier holders that stopped renewing (or were cut off), with the `last-seen` each had
    /// when it was deposed: no candidate until its `last-seen` moves on.
    pub deposed: BTreeMap<String, i64>,
    /// The holder a verifier took this lease from because it was cut off: no candidate, and
    /// its `kilo.squat.ai/leader` annotation no preference, while the lease stays in the same
    /// hands. Otherwise an annotated holder that is cut off would take the lead back at every
    /// check-in and lose it again a lease step later.
    pub cut_off_predecessor: Option<String>,
    /// The holder that handed this lease to its holder (it was cordoned, or a node annotated
    /// `kilo.squat.ai/leader` was preferred), while the lease stays in the same hands. With
    /// several leaders per location it stays in this lease's share
    /// ([`Election::predecessors`]), so that the handover moves no other node.
    pub handed_over_by: Option<String>,
}

/// What a lease write expects to find: the compare of its compare-and-swap.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Expectation {
    /// The holder read before deciding (`None`: no holder).
    pub holder: Option<String>,
    /// The write is a verifier taking over a cut-off lease: it holds only while the mark is
    /// still on (a holder that hears again clears it, and keeps its lead).
    pub cut_off: bool,
}

impl LeaseState {
    /// The compare-and-swap rule every backend applies before writing `self` over `current`
    /// (a missing lease is the default state): the holder must still be the `expected` one
    /// (or already `self`'s), and a takeover of a cut-off lease needs the mark still on.
    pub fn may_replace(&self, current: &LeaseState, expected: &Expectation) -> bool {
        let holder = current.holder == expected.holder || current.holder == self.holder;
        holder && (!expected.cut_off || current.cut_off)
    }

    /// True while the lease is held and not expired at `now_ms`.
    pub fn is_valid(&self, now_ms: i64) -> bool {
        self.holder.is_some() && now_ms < self.renewed_ms + self.duration_ms
    }

    /// True when `node` was deposed and has not checked in since, or, while this lease is
    /// valid at `now_ms`, is the cut-off holder its holder replaced (once the holder stops
    /// renewing, the lease is no longer in the same hands, and a dead holder must not leave its
    /// location with no candidate but itself).
    pub fn keeps_out(&self, node: &Node, now_ms: i64) -> bool {
        let replaced = self.cut_off_predecessor.as_deref() == Some(node.name.as_str());
        (replaced && self.is_valid(now_ms)) || self.deposes(node)
    }

    /// True when `node` was deposed (its lease expired, or a verifier found it cut off) and
    /// has not checked in since.
    pub fn deposes(&self, node: &Node) -> bool {
        self.deposed
            .get(&node.name)
            .is_some_and(|&last_seen| node.last_seen <= last_seen)
    }

    /// The deposed record `holder` writes, among the location's `members`: the entries of
    /// other nodes still kept out, plus the previous holder when `deposing` it (its lease
    /// expired, or it was cut off) with the `last-seen` it has now.
    pub fn deposed_after(
        &self,
        members: &[&Node],
        holder: &str,
        deposing: bool,
    ) -> BTreeMap<String, i64> {
        let mut deposed: BTreeMap<String, i64> = members
            .iter()
            .filter(|n| n.name != holder)
            .filter_map(|n| {
                let last_seen = *self.deposed.get(&n.name)?;
                (n.last_seen <= last_seen).then(|| (n.name.clone(), last_seen))
            })
            .collect();
        if deposing {
            let previous = self.holder.as_deref();
            let deposable = |n: &&&Node| Some(n.name.as_str()) == previous && n.name != holder;
            if let Some(n) = members.iter().find(deposable) {
                deposed.insert(n.name.clone(), n.last_seen);
            }
        }
        deposed
    }
}

/// Whether the ready nodes agree to leases: every one runs kilotun with lease election.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Agreement {
    /// Leases decide where they are held.
    Leases,
    /// Kilo's rule everywhere: the first node (by name) that does not take part, and how many
    /// do not.
    KiloRule {
        /// The first ready node without lease election.
        holdout: String,
        /// How many ready nodes lack it.
        count: usize,
    },
}

/// Whether every ready node in `nodes` takes part in lease election (see [`Agreement`]).
pub fn lease_agreement<'n>(nodes: impl IntoIterator<Item = &'n Node>) -> Agreement {
    let mut holdouts: Vec<&str> = nodes
        .into_iter()
        .filter(|n| !n.lease_election)
        .map(|n| n.name.as_str())
        .collect();
    holdouts.sort_unstable();
    match holdouts.first() {
        None => Agreement::Leases,
        Some(first) => Agreement::KiloRule {
            holdout: first.to_string(),
            count: holdouts.len(),
        },
    }
}

/// Why a node leads its location.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    /// It holds the location's valid lease.
    Lease,
    /// Kilo's rule among the candidates (no valid lease, or an annotated node is preferred).
    KiloRule,
}

/// The outcome of an election in one location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Election {
    /// The leader's name.
    pub leader: String,
    /// Why.
    pub basis: Basis,
    /// The candidates asked to check whether they reach the other locations' leaders, in the
    /// order they would lead: empty unless the holder marked its lease cut off.
    pub verifiers: Vec<String>,
    /// Members the lease keeps from leading (deposed, replaced while cut off, or the holder of
    /// an expired lease). With several leaders per location, the members gone from any share
    /// instead (deposed, or the holder of an expired share lease): they lead no share, and stay in
    /// the share they are gone from ([`Election::predecessors`]; see [`shares::elect_shares`]).
    pub kept_out: Vec<String>,
    /// Which of the location's shares it leads (0 for the location's lease, see
    /// [`shares::elect_shares`]).
    pub share: usize,
    /// With several leaders per location, the earlier holders of this share's lease that lead
    /// nothing now (its expired holder, the holders it deposed or replaced while cut off, until
    /// they check in again): they stay in this share, counted in its load, while its new leader
    /// is one of its own followers, so that a leader's loss moves no other node.
    pub predecessors: Vec<String>,
}

/// The lease's name for `location` (a DNS-1123 name: lower-case letters, digits and `-`).
pub fn lease_name(location: &str) -> String {
    let clean: String = location
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let exact = clean == location && !location.is_empty();
    let mut name = format!("kilotun-leader-{}", clean.trim_matches('-'));
    if !exact {
        // Different locations must not share a lease after cleaning.
        let hash = location.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
        name = format!("{}-{:08x}", name.trim_end_matches('-'), hash as u32);
    }
    name.truncate(63);
    name
}

/// Elects the leader of one location among its ready `members` (any order), given its lease.
pub fn elect(members: &[&Node], lease: Option<&LeaseState>, now_ms: i64) -> Option<Election> {
    let mut sorted: Vec<&Node> = members.to_vec();
    sorted.sort_by(|a, b| a.name.cmp(&b.name));
    let mut candidates: Vec<&Node> = sorted.iter().copied().filter(|n| !n.cordoned).collect();
    if candidates.is_empty() {
        candidates = sorted;
    }
    if candidates.is_empty() {
        return None;
    }
    let valid = lease.filter(|l| l.is_valid(now_ms));
    let expired_holder = lease
        .filter(|l| !l.is_valid(now_ms))
        .and_then(|l| l.holder.as_deref());
    let kept_out_names: Vec<String> = candidates
        .iter()
        .filter(|n| {
            Some(n.name.as_str()) == expired_holder || lease.is_some_and(|l| l.keeps_out(n, now_ms))
        })
        .map(|n| n.name.clone())
        .collect();
    if let Some(holder) = valid.and_then(|l| l.holder.as_deref()) {
        if let Some(node) = candidates.iter().find(|n| n.name == holder) {
            let kept_out = |n: &Node| valid.is_some_and(|l| l.keeps_out(n, now_ms));
            let preferred = candidates.iter().any(|n| n.leader && !kept_out(n)) && !node.leader;
            if !preferred {
                let verifiers = if valid.is_some_and(|l| l.cut_off) {
                    in_order_of_succession(&candidates, holder, VERIFIERS)
                } else {
                    Vec::new()
                };
                return Some(Election {
                    leader: holder.to_string(),
                    basis: Basis::Lease,
                    verifiers,
                    kept_out: kept_out_names,
                    share: 0,
                    predecessors: Vec::new(),
                });
            }
        }
    }
    let alive: Vec<&Node> = candidates
        .iter()
        .copied()
        .filter(|n| Some(n.name.as_str()) != expired_holder)
        .filter(|n| !lease.is_some_and(|l| l.keeps_out(n, now_ms)))
        .collect();
    if !alive.is_empty() {
        candidates = alive;
    }
    let i = find_leader(&candidates);
    Some(Election {
        leader: candidates[i].name.clone(),
        basis: Basis::KiloRule,
        verifiers: Vec::new(),
        kept_out: kept_out_names,
        share: 0,
        predecessors: Vec::new(),
    })
}

/// Up to `count` candidates other than `holder`, in the order Kilo's rule would make them
/// leaders one after another.
fn in_order_of_succession(candidates: &[&Node], holder: &str, count: usize) -> Vec<String> {
    let mut others: Vec<&Node> = candidates
        .iter()
        .copied()
        .filter(|n| n.name != holder && !n.cordoned)
        .collect();
    others.sort_by(|a, b| a.name.cmp(&b.name));
    let mut order = Vec::with_capacity(count.min(others.len()));
    while order.len() < count && !others.is_empty() {
        order.push(others.remove(find_leader(&others)).name.clone());
    }
    order
}

/// The next candidate after `holder`: who a leaving or broken holder hands its lease to (Kilo's
/// rule among the other candidates), `None` when it is the only one.
pub fn successor(members: &[&Node], holder: &str) -> Option<String> {
    in_order_of_succession(members, holder, 1).pop()
}

/// Who leads `node`'s location by a valid lease at `now_ms`, when that is another node that
/// `node` cannot displace (it is not annotated `kilo.squat.ai/leader`, or the lease keeps it
/// out) and `node` leads no share of its own by lease: a restarted agent's saved peers are
/// then stale if it led before it died, and bringing them back, even until its first
/// reconcile, would make it act as a leader it no longer is. `None` when `node` holds the
/// location's lease or a share's, no valid lease names anyone, or the annotation may give
/// `node` the lead.
pub fn led_by_another<'l>(
    node: &Node,
    leases: &'l BTreeMap<String, LeaseState>,
    now_ms: i64,
) -> Option<&'l str> {
    let holds_a_share = (1..shares::MAX_SHARES).any(|s| {
        leases
            .get(&shares::share_lease_name(&node.location, s))
            .is_some_and(|l| l.is_valid(now_ms) && l.holder.as_deref() == Some(&node.name))
    });
    if holds_a_share {
        return None;
    }
    let lease = leases
        .get(&lease_name(&node.location))
        .filter(|l| l.is_valid(now_ms))?;
    if node.leader && !lease.keeps_out(node, now_ms) {
        return None;
    }
    lease
        .holder
        .as_deref()
        .filter(|holder| *holder != node.name)
}

/// The leaders chosen by lease, by location name, when every one of the ready `nodes` takes
/// part in lease election (see [`lease_agreement`]); otherwise none: Kilo's rule everywhere.
/// Each location has one [`Election`] per share with a leader, up to `shares` of them (see
/// [`shares::elect_shares`]), the location's lease's first.
pub fn lease_leaders<'n>(
    nodes: impl IntoIterator<Item = &'n Node> + Clone,
    leases: &BTreeMap<String, LeaseState>,
    shares: usize,
    now_ms: i64,
) -> BTreeMap<String, Vec<Election>> {
    if lease_agreement(nodes.clone()) != Agreement::Leases {
        return BTreeMap::new();
    }
    let mut by_location: BTreeMap<&str, Vec<&Node>> = BTreeMap::new();
    for n in nodes.into_iter().filter(|n| n.internal_ip.is_some()) {
        by_location.entry(n.location.as_str()).or_default().push(n);
    }
    by_location
        .into_iter()
        .map(|(location, members)| {
            let elected = shares::elect_shares(&members, location, leases, shares, now_ms);
            (location.to_string(), elected)
        })
        .filter(|(_, elected)| !elected.is_empty())
        .collect()
}

/// Kilo's rule's leader of every location of the ready `nodes`, by location name, as the
/// topology picks it when no lease decides. While Kilo's rule governs, each location's leader
/// keeps the lease in its own name anyway, so the lease is current (and names the same leader)
/// the moment every node agrees to leases.
pub fn kilo_rule_leaders<'n>(
    nodes: impl IntoIterator<Item = &'n Node>,
) -> BTreeMap<String, String> {
    // A node without an internal IP is a segment of its own in the topology, never its
    // location's leader.
    let mut by_location: BTreeMap<&str, Vec<&Node>> = BTreeMap::new();
    for n in nodes.into_iter().filter(|n| n.internal_ip.is_some()) {
        by_location.entry(n.location.as_str()).or_default().push(n);
    }
    by_location
        .into_iter()
        .map(|(location, mut members)| {
            members.sort_by(|a, b| a.name.cmp(&b.name));
            let leader = members[find_leader(&members)].name.clone();
            (location.to_string(), leader)
        })
        .collect()
}

/// Bytes received and sent per WireGuard peer at one moment.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TrafficSample {
    /// When (Unix milliseconds).
    pub at_ms: i64,
    /// Received and sent bytes by peer public key.
    pub peers: BTreeMap<crate::Key, (u64, u64)>,
}

/// True when the leader looks cut off between `oldest` and `newest` (at least
/// [`CUT_OFF_WINDOW_MS`] apart): it has tunnels to other locations (`watched`, not empty), and
/// on every one it sent and received nothing. A remote location that is down makes only its
/// own tunnel silent; a blocked port or a broken leader silences them all.
pub fn cut_off(oldest: &TrafficSample, newest: &TrafficSample, watched: &[crate::Key]) -> bool {
    if watched.is_empty() || newest.at_ms - oldest.at_ms < CUT_OFF_WINDOW_MS {
        return false;
    }
    watched
        .iter()
        .all(|k| match (oldest.peers.get(k), newest.peers.get(k)) {
            (Some(before), Some(after)) => sent_unanswered(*before, *after),
            _ => false,
        })
}

/// True when a tunnel whose (received, sent) bytes went from `before` to `after` sent something
/// and received nothing: the evidence that its far end does not answer.
pub fn sent_unanswered(before: (u64, u64), after: (u64, u64)) -> bool {
    let ((rx0, tx0), (rx1, tx1)) = (before, after);
    tx1 > tx0 && rx1 == rx0
}

/// True when any of the `watched` tunnels received something between `older` and `newer`. A
/// leader that marked its lease cut off clears the mark only on this evidence, never on silence
/// alone: a cut-off leader soon stops sending too, which [`cut_off`] would read as no longer cut
/// off.
pub fn hears_any(older: &TrafficSample, newer: &TrafficSample, watched: &[crate::Key]) -> bool {
    watched
        .iter()
        .any(|k| match (older.peers.get(k), newer.peers.get(k)) {
            (Some((rx0, _)), Some((rx1, _))) => rx1 > rx0,
            (None, Some((rx1, _))) => *rx1 > 0,
            _ => false,
        })
}

#[cfg(test)]
#[path = "leader/tests.rs"]
mod tests;
