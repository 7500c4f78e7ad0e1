//! Several active leaders per location (`--leaders-per-location`): a location's nodes are split
//! into shares, one per leader, each a segment of its own that the other locations reach
//! through that leader. A location with k leaders and one with m are joined by k × m tunnels.
//!
//! Which nodes lead and which share each node joins are functions of the node set every agent
//! sees, so no two agents can disagree while they see the same nodes:
//! - the leaders are the ones elected by the shares' leases (with lease election, see
//!   [`crate::leader::shares`]), then, up to the number asked, the candidates in Kilo's order of
//!   preference ([`leader_ranking`]): the nodes annotated `kilo.squat.ai/leader` when any is,
//!   else all of them;
//! - a share's earlier leaders that lead nothing now stay in it ([`ShareLeader::predecessors`]);
//! - every other node joins the share it scores highest with ([`score`], rendezvous hashing),
//!   unless that share is full: shares differ by at most one node while no earlier leader stays
//!   in one. A leader's loss or cordon moves no other node (its successor is one of its own
//!   followers); a node's arrival or departure moves it and the few that balance needs.
//!
//! Pure: no I/O.

use std::collections::{BTreeMap, BTreeSet};

use super::{find_leader, ShareLeader, TopologyParams};
use crate::ip::{is_public, Endpoint};
use crate::node::{Granularity, Node};

/// The leaders per location every agent runs with among the ready `nodes`: the smallest number
/// any of them publishes (`kilotun.io/leader-shares`; 1 for a node that publishes none,
/// Kilo's kg among them).
pub fn agreed_leaders_per_location<'n>(nodes: impl IntoIterator<Item = &'n Node>) -> u16 {
    nodes
        .into_iter()
        .map(|n| n.leaders_per_location.unwrap_or(1))
        .min()
        .unwrap_or(1)
}

/// Kilo's order of preference among `nodes` (given in name order), as positions: nodes
/// annotated `kilo.squat.ai/leader` with a public endpoint, then the other annotated ones, then
/// those with a public endpoint, then the rest, each group in the given order. Its first entry
/// is Kilo's leader ([`super::find_leader`]).
pub fn leader_ranking(nodes: &[&Node]) -> Vec<usize> {
    let public = |n: &Node| {
        n.endpoint
            .as_ref()
            .and_then(Endpoint::ip)
            .is_some_and(is_public)
    };
    let mut ranked: Vec<usize> = (0..nodes.len()).collect();
    ranked.sort_by_key(|&i| {
        let n = nodes[i];
        match (n.leader, public(n)) {
            (true, true) => 0,
            (true, false) => 1,
            (false, true) => 2,
            (false, false) => 3,
        }
    });
    ranked
}

/// The leaders of a location of `nodes` (in name order), as positions, at most `count`:
/// the `chosen` ones first (the leases' holders, in share order) when they name some of them,
/// then the candidates by [`leader_ranking`]. The candidates are the nodes neither cordoned nor
/// `kept_out` by the leases (all of them when that leaves none), and of those the ones
/// annotated `kilo.squat.ai/leader` when any is (the operator picked them).
pub fn share_leaders(
    nodes: &[&Node],
    count: usize,
    chosen: &[&str],
    kept_out: &BTreeSet<String>,
) -> Vec<usize> {
    // Cordoned nodes and the ones the lease keeps out lead no share, unless nothing else can.
    let fit = |n: &Node| !n.cordoned && !kept_out.contains(&n.name);
    let eligible: Vec<bool> = if nodes.iter().any(|n| fit(n)) {
        nodes.iter().map(|n| fit(n)).collect()
    } else {
        vec![true; nodes.len()]
    };
    let annotated = nodes.iter().zip(&eligible).any(|(n, e)| *e && n.leader);
    let count = count.max(1);
    let mut leaders: Vec<usize> = Vec::with_capacity(count);
    for name in chosen {
        if let Some(i) = nodes.iter().position(|n| n.name == *name) {
            if leaders.len() < count && !leaders.contains(&i) {
                leaders.push(i);
            }
        }
    }
    for i in leader_ranking(nodes) {
        if leaders.len() >= count {
            break;
        }
        if eligible[i] && (nodes[i].leader || !annotated) && !leaders.contains(&i) {
            leaders.push(i);
        }
    }
    if leaders.is_empty() && !nodes.is_empty() {
        // No candidate at all (cannot happen: an annotated node is a candidate): Kilo's leader.
        leaders.push(leader_ranking(nodes)[0]);
    }
    leaders
}

/// Each of `nodes`' share, as a position in `leaders`: a leader is in its own share; a node
/// `pinned` to a share (a leader gone from it, see [`ShareLeader::predecessors`]) stays in it;
/// every other node joins the share it scores highest with (by the share's entry in `labels`,
/// one per leader) that is not yet full, the nodes placed in the order of their best score,
/// highest first, so that the nodes most attached to a share keep it. Shares are full at an
/// even part of the pinned nodes and followers (the first shares one more when they do not
/// divide evenly), so they differ by at most one node while none is pinned. The other `kept_out`
/// nodes join their best share and count for no share's load.
///
/// A share labelled by its lease's number keeps its followers when another node takes its lease
/// over; one labelled by its leader's name, when the others change. Because the pinned nodes are
/// placed first and the shares' sizes do not depend on the order, a leader that dies, pinned to
/// its share, while one of that share's followers takes its lease over, moves no other node: up
/// to the successor's turn its share is one fuller than before, which turns nobody away that
/// the successor's own place did not, and from then on every share is as full as before.
pub fn assign(
    nodes: &[&Node],
    leaders: &[usize],
    labels: &[String],
    kept_out: &BTreeSet<String>,
    pinned: &BTreeMap<String, usize>,
) -> Vec<usize> {
    let mut share = vec![0; nodes.len()];
    for (s, &l) in leaders.iter().enumerate() {
        share[l] = s;
    }
    let count = leaders.len();
    if count <= 1 {
        return share;
    }
    let mut load = vec![0; count];
    let mut followers: Vec<usize> = Vec::with_capacity(nodes.len());
    let best = |f: usize| {
        (0..count)
            .max_by_key(|&s| (score(&nodes[f].name, &labels[s]), s))
            .unwrap_or(0)
    };
    for i in (0..nodes.len()).filter(|i| !leaders.contains(i)) {
        let name = &nodes[i].name;
        match pinned.get(name).filter(|&&s| s < count) {
            Some(&s) => {
                share[i] = s;
                load[s] += 1;
            }
            None if kept_out.contains(name) => share[i] = best(i),
            None => followers.push(i),
        }
    }
    let placed = load.iter().sum::<usize>() + followers.len();
    let full = |s: usize| placed / count + usize::from(s < placed % count);
    // Each follower's shares, best first.
    let mut preferences: Vec<(usize, Vec<(u64, usize)>)> = followers
        .iter()
        .map(|&f| {
            let mut scores: Vec<(u64, usize)> = (0..count)
                .map(|s| (score(&nodes[f].name, &labels[s]), s))
                .collect();
            scores.sort_by(|a, b| b.cmp(a));
            (f, scores)
        })
        .collect();
    preferences.sort_by(|a, b| b.1[0].cmp(&a.1[0]).then(a.0.cmp(&b.0)));
    for (f, scores) in preferences {
        // The pinned nodes fill no share past what the followers leave room for: a follower
        // always finds one (the best, should the pinned ones have overfilled the others).
        let s = scores
            .iter()
            .map(|&(_, s)| s)
            .find(|&s| load[s] < full(s))
            .unwrap_or(scores[0].1);
        load[s] += 1;
        share[f] = s;
    }
    share
}

/// A location split into shares: its leaders, what each share is known by, and every node's
/// share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    /// The leaders, as positions in the location's nodes, in share order.
    pub heads: Vec<usize>,
    /// Each share's label ([`share_label`]).
    pub labels: Vec<String>,
    /// Each node's share, as a position in `heads`.
    pub share_of: Vec<usize>,
}

/// Splits the location of `group` (its nodes, in name order) into up to `count` shares led by
/// the `chosen` leaders (the shares' lease holders) and then by Kilo's order of preference
/// ([`share_leaders`]), each node in the share [`assign`] gives it; the `chosen` leaders'
/// predecessors stay in their shares. Every agent, kgctl and the lease election split alike.
pub fn split(
    group: &[&Node],
    count: usize,
    chosen: &[ShareLeader],
    kept_out: &BTreeSet<String>,
) -> Split {
    let names: Vec<&str> = chosen.iter().map(|c| c.name.as_str()).collect();
    let heads = share_leaders(group, count, &names, kept_out);
    let labels: Vec<String> = heads
        .iter()
        .map(|&h| {
            let name = &group[h].name;
            let share = chosen.iter().find(|c| c.name == *name).map(|c| c.share);
            share_label(share, name)
        })
        .collect();
    let mut pinned: BTreeMap<String, usize> = BTreeMap::new();
    for (position, &h) in heads.iter().enumerate() {
        let Some(leader) = chosen.iter().find(|c| c.name == group[h].name) else {
            continue;
        };
        for p in &leader.predecessors {
            pinned.entry(p.clone()).or_insert(position);
        }
    }
    let share_of = assign(group, &heads, &labels, kept_out, &pinned);
    Split {
        heads,
        labels,
        share_of,
    }
}

/// How much `follower` prefers the share labelled `label`: a 64-bit hash of both (FNV-1a,
/// then SplitMix64's finaliser), the same on every agent, architecture and version.
pub fn score(follower: &str, label: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in follower
        .bytes()
        .chain(std::iter::once(0))
        .chain(label.bytes())
    {
        h ^= u64::from(byte);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// The key of a share of the location whose segment key is `location_key`:
/// `location:<name>#share:<n>` for share `n` (counting from 1) when its leader is elected by
/// that share's lease (every node takes part in lease election), so that the share keeps its
/// key, and with it its place in the WireGuard IP order and its followers, when another node
/// takes its lease over; `location:<name>#<leader>` otherwise. `label` is the part after `#`
/// ([`share_label`]).
pub fn share_key(location_key: &str, label: &str) -> String {
    format!("{location_key}#{label}")
}

/// What a share is known by in its key and in the followers' scores: `share:<n>` for a share
/// whose leader its lease elects (`share` counting from 0), else its leader's name (a node
/// name has no `:`).
pub fn share_label(share: Option<usize>, leader: &str) -> String {
    share.map_or_else(|| leader.to_string(), |s| format!("share:{}", s + 1))
}

/// A segment to be: its key, its nodes in name order and its leader's position among them.
pub(super) struct SegmentPlan<'a> {
    /// The segment's key (a share's: see [`share_key`]).
    pub key: String,
    /// Its nodes, in name order.
    pub group: Vec<&'a Node>,
    /// Its leader's position in `group`.
    pub leader: usize,
    /// One of several shares of its location.
    pub shared: bool,
}

/// The segments `groups` (nodes by segment key) make: a segment per group with its leader
/// (`leaders`' choice for its location, else Kilo's), or in location granularity with several
/// leaders per location, a segment per share.
pub(super) fn plan_segments<'a>(
    groups: BTreeMap<String, Vec<&'a Node>>,
    params: &TopologyParams,
    leaders: &BTreeMap<String, Vec<ShareLeader>>,
) -> Vec<SegmentPlan<'a>> {
    let mut plans: Vec<SegmentPlan> = Vec::with_capacity(groups.len());
    let none = Vec::new();
    for (key, mut group) in groups {
        group.sort_by(|a, b| a.name.cmp(&b.name));
        let location_wide =
            params.granularity == Granularity::Location && key.starts_with("location:");
        let chosen = if location_wide {
            leaders.get(&group[0].location).unwrap_or(&none)
        } else {
            &none
        };
        let leader = if location_wide && params.leaders_per_location > 1 {
            let split = split(
                &group,
                params.leaders_per_location,
                chosen,
                &params.kept_out,
            );
            if split.heads.len() > 1 {
                for (s, &head) in split.heads.iter().enumerate() {
                    let members: Vec<&Node> = group
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| split.share_of[*i] == s)
                        .map(|(_, n)| *n)
                        .collect();
                    let leader = members
                        .iter()
                        .position(|n| n.name == group[head].name)
                        .expect("a leader is in its own share");
                    plans.push(SegmentPlan {
                        key: share_key(&key, &split.labels[s]),
                        group: members,
                        leader,
                        shared: true,
                    });
                }
                continue;
            }
            split.heads[0]
        } else {
            chosen
                .first()
                .and_then(|c| group.iter().position(|n| n.name == c.name))
                .unwrap_or_else(|| find_leader(&group))
        };
        plans.push(SegmentPlan {
            key,
            group,
            leader,
            shared: false,
        });
    }
    plans
}

#[cfg(test)]
mod tests;
