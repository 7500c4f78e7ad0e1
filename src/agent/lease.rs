//! Leader election by lease (see `control::leader`), the agent's side: which leases it has
//! seen and when (validity is judged by this node's clock from the moment a renewal was seen,
//! never by comparing clocks across nodes), the leaders they give, and the lease step run every
//! [`LEASE_RENEW_MS`]: the elected leader renews (or takes) its location's lease, a holder that
//! is no longer elected (cordoned, or an annotated node preferred) hands it over, a holder
//! whose tunnels all went silent marks its lease cut off, and a verifier of a cut-off lease
//! whose standby tunnel completed a handshake takes it over.

use std::collections::{BTreeMap, VecDeque};

use control::leader::{
    cut_off, hears_any, kilo_rule_leaders, lease_agreement, lease_leaders, lease_name, successor,
    Agreement, Basis, Election, Expectation, LeaseState, TrafficSample, CUT_OFF_WINDOW_MS,
    LEASE_DURATION_MS, LEASE_RENEW_MS,
};
use control::Node;

use super::shells::{Engine, Firewall, Kernel};
use super::Agent;

/// A lease as last seen, and when this node saw it change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Seen {
    state: LeaseState,
    observed_ms: i64,
}

/// What the agent knows of the leases.
#[derive(Debug, Default)]
pub(super) struct Leases {
    seen: BTreeMap<String, Seen>,
    /// True when a lease changed since the leaders were last computed.
    pub(super) changed: bool,
    /// The leaders last computed, by location.
    pub(super) leaders: BTreeMap<String, Election>,
    /// Whether the ready nodes agreed to leases at the last election (logged when it changes).
    agreement: Option<Agreement>,
    /// While Kilo's rule governs: its leader of every location, who keeps the lease current.
    kilo_rule: BTreeMap<String, String>,
    /// Traffic samples of the tunnels while this node leads, oldest first.
    samples: VecDeque<TrafficSample>,
    /// This node verifies a cut-off holder and its standby handshake was already complete at
    /// the last lease step: it takes over only on a second step in a row, so a holder that
    /// hears again at the same moment clears its mark first and keeps the lead.
    standby_confirmed: bool,
    /// The last moment (Unix milliseconds) the backend was reachable.
    reachable_ms: Option<i64>,
    /// While the backend is unreachable: the moment leases are judged at (see
    /// [`Leases::observe_backend`]).
    frozen_ms: Option<i64>,
}

impl Leases {
    /// Takes in the backend's leases at `now_ms`.
    pub(super) fn ingest(&mut self, leases: &BTreeMap<String, LeaseState>, now_ms: i64) {
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

    /// Notes whether the backend is reachable at `now_ms`. While it is not, no lease can be
    /// renewed or seen renewed, so judged by the clock every holder would look dead and every
    /// location would change leaders at once, for nothing: leases are judged as of the last
    /// moment the backend was reached ([`Leases::judged_at`]), as other nodes' check-ins are.
    /// When it is back, every lease seen before counts as renewed then, so a holder that died
    /// meanwhile is replaced one lease duration later and a live one renews first.
    pub(super) fn observe_backend(&mut self, reachable: bool, now_ms: i64) {
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

    /// The moment leases are judged at, `now_ms` or, while the backend is unreachable, the
    /// last moment it was reached.
    pub(super) fn judged_at(&self, now_ms: i64) -> i64 {
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

    /// Elects every lease-capable location's leader among the ready `nodes`; true when a
    /// leader or a verifier changed.
    pub(super) fn elect<'n>(
        &mut self,
        nodes: impl IntoIterator<Item = &'n Node> + Clone,
        now_ms: i64,
    ) -> bool {
        self.changed = false;
        let agreement = lease_agreement(nodes.clone());
        self.kilo_rule = match &agreement {
            Agreement::Leases => BTreeMap::new(),
            Agreement::KiloRule { .. } => kilo_rule_leaders(nodes.clone()),
        };
        if self.agreement.as_ref() != Some(&agreement) {
            match &agreement {
                Agreement::Leases => tracing::info!(
                    "every ready node runs kilotun with --leader-election=lease: leaders are chosen by lease"
                ),
                Agreement::KiloRule { holdout, count } => tracing::info!(
                    node = %holdout,
                    without_leases = count,
                    "leaders are chosen by Kilo's rule: {count} ready node(s), {holdout} first, do not take part in lease election (Kilo's agent, or kg with --leader-election=kilo) and pick every location's leader by Kilo's rule"
                ),
            }
            self.agreement = Some(agreement);
        }
        let leaders = lease_leaders(nodes, &self.observed(), now_ms);
        let names = |m: &BTreeMap<String, Election>| -> Vec<(String, String, Vec<String>)> {
            m.iter()
                .map(|(l, e)| (l.clone(), e.leader.clone(), e.verifiers.clone()))
                .collect()
        };
        let changed = names(&leaders) != names(&self.leaders);
        self.leaders = leaders;
        changed
    }

    /// The chosen leaders by location name, for the topology.
    pub(super) fn leader_names(&self) -> BTreeMap<String, String> {
        self.leaders
            .iter()
            .map(|(l, e)| (l.clone(), e.leader.clone()))
            .collect()
    }

    /// The verifiers of every location whose holder is cut off, by location name, for the
    /// topology's standby tunnels.
    pub(super) fn verifiers(&self) -> BTreeMap<String, Vec<String>> {
        self.leaders
            .iter()
            .filter(|(_, e)| !e.verifiers.is_empty())
            .map(|(l, e)| (l.clone(), e.verifiers.clone()))
            .collect()
    }
}

impl<N: Kernel, F: Firewall, W: Engine> Agent<N, F, W> {
    /// The lease step at `now` (Unix milliseconds): renew, take, or hand over this node's
    /// location's lease.
    pub(super) async fn tend_lease(&mut self, nodes: &[Node], now: i64) {
        let hostname = self.s.hostname.clone();
        let Some(local) = nodes.iter().find(|n| n.name == hostname) else {
            return;
        };
        let location = local.location.clone();
        // While Kilo's rule governs, its leader holds the lease (never cut off, no verifiers),
        // so the lease names the same leader once every node agrees to leases.
        let mirroring = !self.memo.leases.leaders.contains_key(&location);
        if mirroring {
            self.memo.leases.samples.clear();
        }
        let election = match self.memo.leases.leaders.get(&location) {
            Some(e) => e.clone(),
            None => match self.memo.leases.kilo_rule.get(&location) {
                Some(leader) => Election {
                    leader: leader.clone(),
                    basis: Basis::KiloRule,
                    verifiers: Vec::new(),
                },
                None => return,
            },
        };
        let name = lease_name(&location);
        let current = self
            .memo
            .leases
            .seen
            .get(&name)
            .map(|s| s.state.clone())
            .unwrap_or_default();
        let members: Vec<&Node> = nodes.iter().filter(|n| n.location == location).collect();
        let expired = self
            .memo
            .leases
            .seen
            .get(&name)
            .is_some_and(|s| now >= s.observed_ms + s.state.duration_ms);
        let handing = |to: String, deposing: bool| LeaseState {
            deposed: current.deposed_after(&members, &to, deposing),
            holder: Some(to),
            renewed_ms: now,
            duration_ms: LEASE_DURATION_MS,
            transitions: current.transitions + 1,
            cut_off: false,
        };
        let (next, why, takeover) = if election.leader == hostname {
            // A sole candidate has nobody to ask: it keeps leading, unmarked.
            let cut_off = !mirroring
                && self.cut_off_now(now, current.cut_off)
                && successor(&members, &hostname).is_some();
            let taking = current.holder.as_deref() != Some(hostname.as_str());
            let state = LeaseState {
                holder: Some(hostname.clone()),
                renewed_ms: now,
                duration_ms: LEASE_DURATION_MS,
                transitions: current.transitions + i32::from(taking),
                cut_off,
                deposed: current.deposed_after(&members, &hostname, taking && expired),
            };
            let why = if taking {
                Some(format!("taking the lead of {location}"))
            } else if cut_off && !current.cut_off {
                Some(format!("no tunnel of this leader has received anything for {} s while sending; asking the next candidates of {location} whether they reach the other locations", CUT_OFF_WINDOW_MS / 1000))
            } else if !cut_off && current.cut_off {
                Some("the tunnels of this leader hear the other locations again".to_string())
            } else {
                None
            };
            (state, why, false)
        } else if current.holder.as_deref() == Some(hostname.as_str()) {
            // While mirroring Kilo's rule, a leader that takes no part in leases (Kilo's agent)
            // would never renew what it was handed: the lease lapses instead, naming this node,
            // so it cannot later count against that leader as an expired holder.
            let takes_part = members
                .iter()
                .any(|n| n.name == election.leader && n.lease_election);
            if mirroring && !takes_part {
                return;
            }
            let why = format!(
                "handing the lead of {location} to {} (this node is cordoned, or a node annotated kilo.squat.ai/leader is preferred)",
                election.leader
            );
            (handing(election.leader.clone(), false), Some(why), false)
        } else if current.cut_off && election.verifiers.contains(&hostname) {
            let reached = self.standby_handshakes();
            let confirmed =
                std::mem::replace(&mut self.memo.leases.standby_confirmed, !reached.is_empty());
            if reached.is_empty() || !confirmed {
                return;
            }
            let why = format!(
                "{} is cut off and this node has a handshake with the leader of {}; taking the lead of {location}",
                election.leader,
                reached.join(", ")
            );
            (handing(hostname.clone(), true), Some(why), true)
        } else {
            self.memo.leases.samples.clear();
            self.memo.leases.standby_confirmed = false;
            return;
        };
        self.memo.leases.standby_confirmed = false;
        if next.holder.as_deref() != Some(hostname.as_str()) {
            self.memo.leases.samples.clear();
        }
        let expected = Expectation {
            holder: current.holder.clone(),
            cut_off: takeover,
        };
        match self.backend.write_lease(&name, &next, &expected).await {
            Ok(true) => {
                if let Some(why) = why {
                    tracing::info!(lease = %name, "{why}");
                }
            }
            Ok(false) => tracing::debug!(lease = %name, "another node wrote the lease first"),
            Err(e) => {
                tracing::warn!(lease = %name, error = format!("{e:#}"), "writing the lease failed")
            }
        }
    }

    /// The locations whose leader this node's standby tunnels completed a handshake with.
    fn standby_handshakes(&self) -> Vec<String> {
        let Some(t) = self.memo.topology.as_ref() else {
            return Vec::new();
        };
        let Ok(device) = self.wg.device_peers() else {
            return Vec::new();
        };
        let shaken = |key: &control::Key| {
            device
                .iter()
                .any(|d| d.public_key == *key && d.has_handshake)
        };
        t.segments
            .iter()
            .filter(|s| !t.in_local_location(s))
            .filter(|s| t.standby.iter().any(|p| p.public_key == s.public_key))
            .filter(|s| shaken(&s.public_key))
            .map(|s| s.location.clone())
            .collect()
    }

    /// Samples the tunnels' traffic and says whether this leader is cut off (see
    /// `control::leader::cut_off`); once `marked`, until a tunnel hears something again.
    fn cut_off_now(&mut self, now_ms: i64, marked: bool) -> bool {
        let Some(t) = self.memo.topology.as_ref().filter(|t| t.leader) else {
            self.memo.leases.samples.clear();
            return false;
        };
        let watched: Vec<control::Key> = t
            .segments
            .iter()
            .filter(|s| !t.in_local_location(s))
            .map(|s| s.public_key)
            .collect();
        let Ok(traffic) = self.wg.traffic() else {
            return false;
        };
        let samples = &mut self.memo.leases.samples;
        samples.push_back(TrafficSample {
            at_ms: now_ms,
            peers: traffic.into_iter().collect(),
        });
        while samples.len() > 2
            && samples
                .get(1)
                .is_some_and(|s| now_ms - s.at_ms >= CUT_OFF_WINDOW_MS)
        {
            samples.pop_front();
        }
        let (Some(oldest), Some(newest)) = (samples.front(), samples.back()) else {
            return false;
        };
        if marked {
            let previous = samples.len().checked_sub(2).and_then(|i| samples.get(i));
            return previous.is_none_or(|p| !hears_any(p, newest, &watched));
        }
        cut_off(oldest, newest, &watched)
    }
}

/// How often the lease step runs.
pub(super) const LEASE_PERIOD: std::time::Duration =
    std::time::Duration::from_millis(LEASE_RENEW_MS as u64);
