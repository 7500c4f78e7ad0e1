//! Leases for several leaders per location (`--leaders-per-location`): a lease per share, so
//! that every leader, not only the first, fails over within the lease's bounds.
//!
//! Share 0's lease is the location's lease ([`lease_name`]); share `s` > 0 has its own
//! ([`share_lease_name`]). Each share elects its leader as a location elects one
//! ([`elect`]), among the location's members that lead no other share: a node holding another
//! share's valid lease is never a candidate, so one share's failover never moves another's
//! leader. A node gone from any share (the holder of an expired share lease, or one a share's
//! lease records as deposed, until it checks in again) leads no share while another node can
//! lead the first, and leads no other share at all; a holder a verifier replaced while it was
//! cut off is kept out of that share only, as [`elect`] keeps it out of a location's lease. The
//! other shares' candidates are further neither cordoned nor gone, and the nodes annotated
//! `kilo.squat.ai/leader` when any such node is. A share with no such candidate has no leader,
//! and the location has fewer shares.
//!
//! A share whose holder leaves it (its lease expired, or it is cordoned) is taken over by one of
//! its own followers, and a cut-off share is verified by them first; the holders gone from a
//! share stay in it ([`Election::predecessors`]). So a leader's loss moves no other node
//! ([`crate::topology::shares::assign`]).
//!
//! Pure: no I/O.

use std::collections::{BTreeMap, BTreeSet};

use super::{elect, in_order_of_succession, lease_name, Election, LeaseState, VERIFIERS};
use crate::node::Node;
use crate::topology::shares::split;
use crate::topology::ShareLeader;

/// The most leaders a location may have.
pub const MAX_SHARES: usize = 16;

/// The lease of share `share` of `location`: the location's lease for share 0, and for the
/// others the location's lease name with `.share<n>` after it (`n` counting from 1 for share
/// 0). Lease names are DNS-1123 subdomains: the dot keeps them apart from every location's
/// lease name, which has none.
pub fn share_lease_name(location: &str, share: usize) -> String {
    let name = lease_name(location);
    if share == 0 {
        name
    } else {
        format!("{name}.share{}", share + 1)
    }
}

/// Elects up to `count` leaders of one location among its ready `members` (any order), given
/// the backend's `leases` at `now_ms`: one [`Election`] per share that has a leader, in share
/// order, each naming its share ([`Election::share`]). With `count` 1 this is [`elect`] over
/// the location's lease.
pub fn elect_shares(
    members: &[&Node],
    location: &str,
    leases: &BTreeMap<String, LeaseState>,
    count: usize,
    now_ms: i64,
) -> Vec<Election> {
    let count = count.clamp(1, MAX_SHARES);
    let slot_leases: Vec<Option<&LeaseState>> = (0..count)
        .map(|s| leases.get(&share_lease_name(location, s)))
        .collect();
    if count == 1 {
        return elect(members, slot_leases[0], now_ms).into_iter().collect();
    }
    let holder = |s: usize| {
        slot_leases[s]
            .filter(|l| l.is_valid(now_ms))
            .and_then(|l| l.holder.as_deref())
    };
    // Gone, by any share's lease: it stopped renewing, or was deposed.
    let kept_out: BTreeSet<&str> = members
        .iter()
        .filter(|n| {
            slot_leases.iter().flatten().any(|l| {
                l.deposes(n)
                    || (!l.is_valid(now_ms) && l.holder.as_deref() == Some(n.name.as_str()))
            })
        })
        .map(|n| n.name.as_str())
        .collect();
    let fit = |n: &Node| !n.cordoned && !kept_out.contains(n.name.as_str());
    let annotated = members.iter().any(|n| fit(n) && n.leader);
    let mut gone = gone_from(members, &slot_leases, now_ms);
    let own = own_followers(members, &slot_leases, &gone, &kept_out, count);
    // A holder leaving a valid lease (cordoned) stays in that share from the moment it leaves,
    // whatever older lease names it.
    for (share, lease) in slot_leases.iter().enumerate() {
        if let Some(h) = lease.and_then(|l| l.holder.as_deref()) {
            if holder(share) == Some(h) && members.iter().any(|n| n.name == h && n.cordoned) {
                gone.insert(h, share);
            }
        }
    }
    let mut elected: Vec<Election> = Vec::with_capacity(count);
    for (share, lease) in slot_leases.iter().enumerate() {
        let free = |n: &&&Node| {
            !elected.iter().any(|e| e.leader == n.name)
                && !(0..count).any(|o| o != share && holder(o) == Some(n.name.as_str()))
        };
        let mut pool: Vec<&Node> = members.iter().filter(free).copied().collect();
        if share == 0 {
            // The first share has a leader while any member is free; another share's gone
            // nodes lead it only when nothing else can (its own lease's are left to `elect`).
            if pool.iter().any(|n| !kept_out.contains(n.name.as_str())) {
                pool.retain(|n| {
                    !kept_out.contains(n.name.as_str())
                        || lease.is_some_and(|l| l.holder.as_deref() == Some(n.name.as_str()))
                });
            }
        } else {
            pool.retain(|n| fit(n) && (n.leader || !annotated));
        }
        // A share whose holder leads it no more is taken over by one of its own followers
        // (a fit one, annotated when the pool's candidates are), which keeps every other node
        // where it is; a share whose holder marked it cut off is verified by them first. The
        // pool stands when none of them can. (A holder that is no ready member any more, its
        // Node deleted before its lease ran out, has no followers to go by.)
        let lease_holder = lease.and_then(|l| l.holder.as_deref());
        let holder_leaves = lease_holder.is_some_and(|h| {
            holder(share) != Some(h)
                || kept_out.contains(h)
                || members.iter().any(|n| n.name == h && n.cordoned)
        });
        let verified = lease.is_some_and(|l| l.cut_off && l.is_valid(now_ms));
        // The pool before it is narrowed, for a cut-off share's further verifiers.
        let whole_pool = if verified { pool.clone() } else { Vec::new() };
        if let Some(own) = own.get(&share).filter(|_| holder_leaves || verified) {
            let successor =
                |n: &&Node| own.contains(&n.name.as_str()) && fit(n) && (n.leader || !annotated);
            if pool.iter().any(successor) {
                pool.retain(|n| successor(n) || lease_holder == Some(n.name.as_str()));
            }
        }
        if let Some(mut e) = elect(&pool, *lease, now_ms) {
            e.share = share;
            // Too few of its own followers to verify a cut-off share: the other candidates
            // after them (one of them taking over moves a node or two, but the share is carried).
            if verified && e.verifiers.len() < VERIFIERS {
                for v in in_order_of_succession(&whole_pool, &e.leader, VERIFIERS) {
                    if e.verifiers.len() < VERIFIERS && !e.verifiers.contains(&v) {
                        e.verifiers.push(v);
                    }
                }
            }
            // The nodes gone from any share lead none and count for no share's load, but the
            // ones gone from this share stay in it.
            e.kept_out = kept_out.iter().map(|n| n.to_string()).collect();
            e.predecessors = gone
                .iter()
                .filter(|(_, &s)| s == share)
                .map(|(n, _)| n.to_string())
                .collect();

            elected.push(e);
        }
    }
    // A predecessor that leads another share now is that share's leader, not a predecessor.
    let leaders: BTreeSet<String> = elected.iter().map(|e| e.leader.clone()).collect();
    for e in &mut elected {
        e.predecessors.retain(|p| !leaders.contains(p));
    }
    elected
}

/// The members that earlier held a share's lease and stay in that share (see
/// [`Election::predecessors`]), each with its share: the one whose lease has it as expired
/// holder, deposed it or replaced it while it was cut off (the first such share), else, while it
/// is cordoned, the one whose lease it handed over. A handover is remembered for as long as the
/// lease stays in the same hands, so it yields to the others: they are the node's latest
/// departure.
fn gone_from<'n>(
    members: &[&'n Node],
    slot_leases: &[Option<&LeaseState>],
    now_ms: i64,
) -> BTreeMap<&'n str, usize> {
    let share_where =
        |names: &dyn Fn(&LeaseState) -> bool| slot_leases.iter().position(|l| l.is_some_and(names));
    members
        .iter()
        .filter_map(|n| {
            let name = Some(n.name.as_str());
            let left = |l: &LeaseState| {
                l.keeps_out(n, now_ms) || (!l.is_valid(now_ms) && l.holder.as_deref() == name)
            };
            // A handover pins its cordoned holder only: a live one handed over (an annotated node
            // was preferred, or it took the lease in the start-up race) is a follower like any.
            let handed = |l: &LeaseState| {
                n.cordoned && l.is_valid(now_ms) && l.handed_over_by.as_deref() == name
            };
            let share = share_where(&left).or_else(|| share_where(&handed))?;
            Some((n.name.as_str(), share))
        })
        .collect()
}

/// Each share's followers while its lease's holders (expired ones included) led the shares:
/// the split the topology made before any of them was found gone, so that a successor chosen
/// among its share's own followers moves nobody else
/// ([`crate::topology::shares::assign`]).
fn own_followers<'n>(
    members: &[&'n Node],
    slot_leases: &[Option<&LeaseState>],
    gone: &BTreeMap<&str, usize>,
    kept_out: &BTreeSet<&str>,
    count: usize,
) -> BTreeMap<usize, Vec<&'n str>> {
    let mut group: Vec<&Node> = members.to_vec();
    group.sort_by(|a, b| a.name.cmp(&b.name));
    let holders: Vec<(usize, &str)> = slot_leases
        .iter()
        .enumerate()
        .filter_map(|(s, l)| Some((s, l.and_then(|l| l.holder.as_deref())?)))
        .filter(|(_, h)| group.iter().any(|n| n.name == *h))
        .collect();
    let is_holder = |n: &str| holders.iter().any(|(_, h)| *h == n);
    let chosen: Vec<ShareLeader> = holders
        .iter()
        .map(|&(share, name)| ShareLeader {
            share,
            name: name.to_string(),
            predecessors: gone
                .iter()
                .filter(|(n, &s)| s == share && !is_holder(n))
                .map(|(n, _)| n.to_string())
                .collect(),
        })
        .collect();
    let kept_out: BTreeSet<String> = kept_out
        .iter()
        .filter(|n| !is_holder(n))
        .map(|n| n.to_string())
        .collect();
    let split = split(&group, count, &chosen, &kept_out);
    let mut own: BTreeMap<usize, Vec<&str>> = BTreeMap::new();
    for (position, &head) in split.heads.iter().enumerate() {
        let Some(leader) = chosen.iter().find(|c| c.name == group[head].name) else {
            continue;
        };
        let followers = group
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != head && split.share_of[i] == position)
            .map(|(_, n)| n.name.as_str())
            .collect();
        own.insert(leader.share, followers);
    }
    own
}

#[cfg(test)]
#[path = "shares_tests.rs"]
mod tests;
