//! One agent's side of lease election, as a value: the leases it has seen and when (a lease's
//! validity is judged by this node's clock from the moment a renewal was seen, never by
//! comparing clocks across nodes), the leaders they give, and the lease step run every
//! [`LEASE_RENEW_MS`]. The step ([`LeaseBook::tend`]) takes what the agent read of its tunnels
//! as a value and returns the lease write it wants ([`LeaseWrite`]), which the agent's shell
//! sends as a compare-and-swap: the elected leader renews (or takes) its location's lease, a
//! holder that is no longer elected (cordoned, or an annotated node preferred) hands it over, a
//! holder whose tunnels all went silent marks its lease cut off, and a verifier of a cut-off
//! lease whose standby tunnel completed a handshake takes it over.

use std::collections::{BTreeMap, VecDeque};

use super::shares::{share_lease_name, MAX_SHARES};
use super::{
    kilo_rule_leaders, lease_agreement, lease_leaders, successor, Agreement, Basis, Election,
    Expectation, LeaseState, TrafficSample, CUT_OFF_WINDOW_MS, LEASE_DURATION_MS, LEASE_RENEW_MS,
    VERIFY_WINDOW_MS,
};
use crate::journal::Reason;
use crate::topology::ShareLeader;
use crate::{Key, Node};

mod cut_off;
mod write;
use cut_off::Mark;
pub use write::{LeaseWhy, LeaseWrite};

/// A lease as last seen, and when this node saw it change.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    state: LeaseState,
    observed_ms: i64,
}

impl Seen {
    /// When it runs out as this node judges it (Unix milliseconds): a lease's duration after
    /// this node saw its last renewal.
    fn expiry_ms(&self) -> i64 {
        self.observed_ms + self.state.duration_ms
    }
}

/// What one agent knows of the leases.
#[derive(Debug, Default)]
pub struct LeaseBook {
    seen: BTreeMap<String, Seen>,
    /// True when a lease changed since the leaders were last computed.
    changed: bool,
    /// The leaders last computed, by location: one election per share, the location's lease's
    /// first.
    leaders: BTreeMap<String, Vec<Election>>,
    /// Whether the ready nodes agreed to leases at the last election.
    agreement: Option<Agreement>,
    /// While Kilo's rule governs: its leader of every location, who keeps the lease current.
    kilo_rule: BTreeMap<String, String>,
    /// Traffic samples of the tunnels while this node leads, oldest first.
    samples: VecDeque<TrafficSample>,
    /// Since when (Unix milliseconds) this leader's lease has been marked cut off.
    marked_since_ms: Option<i64>,
    /// The tunnels this leader watched when its verifiers reached nothing either: it does not
    /// mark its lease again while they stay the same and silent.
    unverified: Option<Vec<Key>>,
    /// Since when (Unix milliseconds) this node, verifying a cut-off holder, has seen its
    /// standby handshake complete at every lease step: it takes over only at a step most of a
    /// lease step ([`LEASE_RENEW_MS`]) later, so a holder that hears again at the same moment clears its
    /// mark first and keeps the lead, however close together the steps run.
    standby_since_ms: Option<i64>,
    /// The last moment (Unix milliseconds) the backend was reachable.
    reachable_ms: Option<i64>,
    /// While the backend is unreachable: the moment leases are judged at (see
    /// [`LeaseBook::observe_backend`]).
    frozen_ms: Option<i64>,
}

/// What an election changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Elected {
    /// A location's leader or verifiers changed.
    pub leaders_changed: bool,
    /// Whether the ready nodes agree to leases, when that changed (to be said once).
    pub agreement: Option<Agreement>,
}

/// What the agent read of this node's tunnels for a lease step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TunnelTraffic {
    /// This node does not lead its location in the applied topology.
    NotLeading,
    /// It leads, and its device's counters could not be read.
    Unreadable,
    /// It leads: the counters now, and which peers are the other locations' leaders.
    Read {
        /// The tunnels to other locations' leaders.
        watched: Vec<Key>,
        /// Received and sent bytes by peer.
        peers: BTreeMap<Key, (u64, u64)>,
    },
}

/// The lease step's inputs besides the ready nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelReadings {
    /// The tunnels' traffic.
    pub traffic: TunnelTraffic,
    /// The locations whose leader one of this node's standby tunnels completed a handshake
    /// with (empty when it keeps no standby tunnel).
    pub standby_reached: Vec<String>,
}

impl LeaseBook {
    /// Takes in the backend's leases at `now_ms`.
    pub fn ingest(&mut self, leases: &BTreeMap<String, LeaseState>, now_ms: i64) {
        let before = self.seen.len();
        self.seen.retain(|name, _| leases.contains_key(name));
        self.changed |= self.seen.len() != before;
        for (name, state) in leases {
            if self.seen.get(name).is_some_and(|s| s.state == *state) {
                continue;
            }
            self.seen.insert(
                name.clone(),
                Seen {
                    state: state.clone(),
                    observed_ms: now_ms,
                },
            );
            self.changed = true;
        }
    }

    /// True when a lease changed since the leaders were last computed.
    pub fn changed(&self) -> bool {
        self.changed
    }

    /// Notes whether the backend is reachable at `now_ms`. While it is not, no lease can be
    /// renewed or seen renewed, so judged by the clock every holder would look dead and every
    /// location would change leaders at once, for nothing: leases are judged as of the last
    /// moment the backend was reached ([`LeaseBook::judged_at`]), as other nodes' check-ins
    /// are. When it is back, every lease seen before counts as renewed then, so a holder that
    /// died meanwhile is replaced one lease duration later and a live one renews first.
    pub fn observe_backend(&mut self, reachable: bool, now_ms: i64) {
        if reachable {
            if self.frozen_ms.take().is_some() {
                for seen in self.seen.values_mut() {
                    seen.observed_ms = seen.observed_ms.max(now_ms);
                }
                self.changed = true;
            }
            self.reachable_ms = Some(now_ms);
        } else if self.frozen_ms.is_none() {
            self.frozen_ms = Some(self.reachable_ms.unwrap_or(now_ms));
        }
    }

    /// When (Unix milliseconds, after `now_ms`) the next held lease expires as this node
    /// judges it, unless renewed before: the moment a leader may change with time alone, when
    /// the lease step should run rather than up to a step later. `None` while the backend is
    /// unreachable (leases are then judged as of the last moment it was reached) or no lease
    /// is held.
    pub fn next_expiry_ms(&self, now_ms: i64) -> Option<i64> {
        if self.frozen_ms.is_some() {
            return None;
        }
        self.seen
            .values()
            .filter(|s| s.state.holder.is_some())
            .map(Seen::expiry_ms)
            .filter(|&expiry| expiry > now_ms)
            .min()
    }

    /// The moment leases are judged at, `now_ms` or, while the backend is unreachable, the
    /// last moment it was reached.
    pub fn judged_at(&self, now_ms: i64) -> i64 {
        self.frozen_ms.map_or(now_ms, |frozen| frozen.min(now_ms))
    }

    /// The leases as this node judges them: renewed when it saw them change.
    fn observed(&self) -> BTreeMap<String, LeaseState> {
        self.seen
            .iter()
            .map(|(name, s)| {
                let mut state = s.state.clone();
                state.renewed_ms = s.observed_ms;
                (name.clone(), state)
            })
            .collect()
    }

    /// Elects every lease-capable location's leaders, up to `shares` each, among the ready
    /// `nodes` at `now_ms`.
    pub fn elect<'n>(
        &mut self,
        nodes: impl IntoIterator<Item = &'n Node> + Clone,
        shares: usize,
        now_ms: i64,
    ) -> Elected {
        self.changed = false;
        let agreement = lease_agreement(nodes.clone());
        self.kilo_rule = match &agreement {
            Agreement::Leases => BTreeMap::new(),
            Agreement::KiloRule { .. } => kilo_rule_leaders(nodes.clone()),
        };
        let agreement_changed = self.agreement.as_ref() != Some(&agreement);
        self.agreement = Some(agreement.clone());
        let leaders = lease_leaders(nodes, &self.observed(), shares, now_ms);
        let names = |m: &BTreeMap<String, Vec<Election>>| {
            m.iter()
                .flat_map(|(l, shares)| {
                    shares.iter().map(move |e| {
                        let who = (
                            e.leader.clone(),
                            e.verifiers.clone(),
                            e.kept_out.clone(),
                            e.predecessors.clone(),
                        );
                        (l.clone(), e.share, who)
                    })
                })
                .collect::<Vec<_>>()
        };
        let leaders_changed = names(&leaders) != names(&self.leaders);
        self.leaders = leaders;
        Elected {
            leaders_changed,
            agreement: agreement_changed.then_some(agreement),
        }
    }

    /// The chosen leaders by location name, for the topology: each share's leader, the
    /// location's lease's first.
    pub fn leader_names(&self) -> BTreeMap<String, Vec<ShareLeader>> {
        self.leaders
            .iter()
            .map(|(l, shares)| {
                let leaders = shares
                    .iter()
                    .map(|e| ShareLeader {
                        share: e.share,
                        name: e.leader.clone(),
                        predecessors: e.predecessors.clone(),
                    })
                    .collect();
                (l.clone(), leaders)
            })
            .collect()
    }

    /// The nodes no share may be led by (see [`Election::kept_out`]), for the topology.
    pub fn kept_out(&self) -> std::collections::BTreeSet<String> {
        self.leaders
            .values()
            .flatten()
            .flat_map(|e| e.kept_out.iter().cloned())
            .collect()
    }

    /// The verifiers of every location with a cut-off holder, by location name, for the
    /// topology's standby tunnels.
    pub fn verifiers(&self) -> BTreeMap<String, Vec<String>> {
        self.leaders
            .iter()
            .filter_map(|(l, shares)| {
                let mut verifiers: Vec<String> = Vec::new();
                for v in shares.iter().flat_map(|e| &e.verifiers) {
                    if !verifiers.contains(v) {
                        verifiers.push(v.clone());
                    }
                }
                (!verifiers.is_empty()).then(|| (l.clone(), verifiers))
            })
            .collect()
    }

    /// The lease step of node `hostname` among the ready `nodes` at `now_ms` (Unix
    /// milliseconds), given what it read of its tunnels: the write to send, if any.
    pub fn tend(
        &mut self,
        hostname: &str,
        nodes: &[Node],
        tunnels: &TunnelReadings,
        now_ms: i64,
    ) -> Option<LeaseWrite> {
        let local = nodes.iter().find(|n| n.name == hostname)?;
        let location = local.location.clone();
        // While Kilo's rule governs, its leader holds the lease (never cut off, no verifiers),
        // so the lease names the same leader once every node agrees to leases.
        let mirroring = !self.leaders.contains_key(&location);
        if mirroring {
            self.samples.clear();
        }
        let elections: Vec<Election> = match self.leaders.get(&location) {
            Some(e) => e.clone(),
            None => vec![Election {
                leader: self.kilo_rule.get(&location)?.clone(),
                basis: Basis::KiloRule,
                verifiers: Vec::new(),
                kept_out: Vec::new(),
                share: 0,
                predecessors: Vec::new(),
            }],
        };
        let holds = |share: usize| {
            self.seen
                .get(&share_lease_name(&location, share))
                .is_some_and(|s| s.state.holder.as_deref() == Some(hostname))
        };
        // A share lease that elects nobody any more (the location has fewer shares, or none of
        // its nodes may lead that share): released first, so that it never counts against this
        // node as an expired holder.
        if let Some(share) =
            (1..MAX_SHARES).find(|&s| holds(s) && !elections.iter().any(|e| e.share == s))
        {
            self.samples.clear();
            return Some(self.release(&location, share, now_ms));
        }
        // This node's share: the one it leads, else one whose lease it still holds, else a
        // cut-off one it verifies.
        let role = elections
            .iter()
            .find(|e| e.leader == hostname)
            .or_else(|| elections.iter().find(|e| holds(e.share)))
            .or_else(|| {
                elections
                    .iter()
                    .find(|e| e.verifiers.iter().any(|v| v == hostname))
            });
        let Some(election) = role.cloned() else {
            self.samples.clear();
            self.standby_since_ms = None;
            return None;
        };
        let name = share_lease_name(&location, election.share);
        let seen = self.seen.get(&name);
        let current = seen.map(|s| s.state.clone()).unwrap_or_default();
        let expired = seen.is_some_and(|s| now_ms >= s.expiry_ms());
        let members: Vec<&Node> = nodes.iter().filter(|n| n.location == location).collect();
        // The node that handed this lease over leads another share now: it is no longer this
        // share's predecessor (it took this lease in the start-up race, say, then another).
        let handed_over_by = current.handed_over_by.clone().filter(|h| {
            !(0..MAX_SHARES).filter(|&s| s != election.share).any(|s| {
                self.seen
                    .get(&share_lease_name(&location, s))
                    .is_some_and(|l| {
                        l.state.holder.as_deref() == Some(h.as_str()) && now_ms < l.expiry_ms()
                    })
            })
        });
        let location = share_label(&location, election.share);
        // Handing over deposes nobody; a verifier's takeover deposes the cut-off holder and
        // keeps it out while the verifier holds the lease.
        let handing = |to: &str, cut_off_takeover: bool| LeaseState {
            deposed: current.deposed_after(&members, to, cut_off_takeover),
            holder: Some(to.to_string()),
            renewed_ms: now_ms,
            duration_ms: LEASE_DURATION_MS,
            transitions: current.transitions + 1,
            cut_off: false,
            cut_off_predecessor: if cut_off_takeover {
                current.holder.clone()
            } else {
                None
            },
            handed_over_by: if cut_off_takeover {
                None
            } else {
                current.holder.clone()
            },
        };
        let (next, why, takeover) = if election.leader == hostname {
            // A sole candidate has nobody to ask: it keeps leading, unmarked.
            let mark = if mirroring {
                Mark::Clear
            } else {
                self.cut_off_now(&tunnels.traffic, now_ms, current.cut_off)
            };
            // The share's candidates: the members that lead no other share.
            let candidates: Vec<&Node> = members
                .iter()
                .copied()
                .filter(|n| {
                    !elections
                        .iter()
                        .any(|e| e.leader == n.name && e.share != election.share)
                })
                .collect();
            let cut_off = mark == Mark::CutOff && successor(&candidates, hostname).is_some();
            let taking = current.holder.as_deref() != Some(hostname);
            let state = LeaseState {
                holder: Some(hostname.to_string()),
                renewed_ms: now_ms,
                duration_ms: LEASE_DURATION_MS,
                transitions: current.transitions + i32::from(taking),
                cut_off,
                deposed: current.deposed_after(&members, hostname, taking && expired),
                cut_off_predecessor: if taking {
                    None
                } else {
                    current.cut_off_predecessor.clone()
                },
                // Taken from a live holder (cordoned, or a node annotated kilo.squat.ai/leader
                // is preferred) before it handed the lease over: it stays in this share as if
                // it had.
                handed_over_by: if taking {
                    current.holder.clone().filter(|_| !expired)
                } else {
                    handed_over_by
                },
            };
            let why = if taking {
                Some(LeaseWhy::new(
                    Reason::LeaderElected,
                    format!("taking the lead of {location}"),
                ))
            } else if cut_off && !current.cut_off {
                Some(LeaseWhy::new(Reason::LeaderCutOff, format!("no tunnel of this leader has received anything for {} s while sending; asking the next candidates of {location} whether they reach the other locations", CUT_OFF_WINDOW_MS / 1000)))
            } else if mark == Mark::Unverified && current.cut_off {
                Some(LeaseWhy::new(Reason::LeaderCutOffUnconfirmed, format!("no candidate of {location} reached another location within {} s either; keeping the lead until this leader's tunnels hear something or another location's leader changes", VERIFY_WINDOW_MS / 1000)))
            } else if !cut_off && current.cut_off {
                Some(LeaseWhy::new(
                    Reason::LeaderReconnected,
                    "the tunnels of this leader hear the other locations again".to_string(),
                ))
            } else {
                None
            };
            (state, why, false)
        } else if current.holder.as_deref() == Some(hostname) {
            // While mirroring Kilo's rule, a leader that takes no part in leases (Kilo's agent)
            // would never renew what it was handed: the lease lapses instead, naming this node,
            // so it cannot later count against that leader as an expired holder.
            let takes_part = members
                .iter()
                .any(|n| n.name == election.leader && n.lease_election);
            if mirroring && !takes_part {
                return None;
            }
            let why = format!(
                "handing the lead of {location} to {} (this node is cordoned, or a node annotated kilo.squat.ai/leader is preferred)",
                election.leader
            );
            let why = LeaseWhy::new(Reason::LeaderHandedOver, why);
            (handing(&election.leader, false), Some(why), false)
        } else if current.cut_off && election.verifiers.iter().any(|v| v == hostname) {
            // (Verifiers are named only while the share's holder marks its lease cut off.)
            let reached = &tunnels.standby_reached;
            if reached.is_empty() {
                self.standby_since_ms = None;
                return None;
            }
            let since = *self.standby_since_ms.get_or_insert(now_ms);
            // Most of a step: timed steps come a step apart give or take the timer's jitter,
            // while one a lease's expiry brings may come right after another.
            if now_ms - since < LEASE_RENEW_MS * 3 / 4 {
                return None;
            }
            let why = format!(
                "{} is cut off and this node has a handshake with the leader of {}; taking the lead of {location}",
                election.leader,
                reached.join(", ")
            );
            let why = LeaseWhy::new(Reason::LeaderReplacedCutOff, why);
            (handing(hostname, true), Some(why), true)
        } else {
            self.samples.clear();
            self.standby_since_ms = None;
            return None;
        };
        self.standby_since_ms = None;
        if next.holder.as_deref() != Some(hostname) {
            self.samples.clear();
        }
        Some(LeaseWrite {
            expected: Expectation {
                holder: current.holder.clone(),
                cut_off: takeover,
            },
            name,
            next,
            why,
        })
    }

    /// The write that releases this node's lease of `share` of `location`, as last seen.
    fn release(&self, location: &str, share: usize, now_ms: i64) -> LeaseWrite {
        let name = share_lease_name(location, share);
        let current = self
            .seen
            .get(&name)
            .map(|s| s.state.clone())
            .unwrap_or_default();
        LeaseWrite {
            expected: Expectation {
                holder: current.holder.clone(),
                cut_off: false,
            },
            next: LeaseState {
                holder: None,
                renewed_ms: now_ms,
                duration_ms: LEASE_DURATION_MS,
                transitions: current.transitions + 1,
                ..LeaseState::default()
            },
            why: Some(LeaseWhy::new(
                Reason::LeaderReleased,
                format!(
                    "releasing the lead of {}: the location has fewer leaders now",
                    share_label(location, share)
                ),
            )),
            name,
        }
    }
}

/// How the logs name share `share` of `location`: the location alone for its first share.
fn share_label(location: &str, share: usize) -> String {
    if share == 0 {
        location.to_string()
    } else {
        format!("{location} (share {})", share + 1)
    }
}

#[cfg(test)]
#[path = "book_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "book_shares_tests.rs"]
mod share_tests;
