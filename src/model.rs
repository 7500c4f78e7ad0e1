//! A reference-model test of many agents: `kg` agents on the shells' in-memory twins share one
//! in-memory API server and a manual clock ([`sim`]), and a sequence of events and faults
//! decoded from bytes ([`events`]) drives them: nodes joining, leaving, dying and restarting
//! with or without their saved state, moving location, cordoned, preferred as leaders, given
//! malformed annotations and Peers, cut off from the API alone or all at once. After every step
//! the invariants that always hold are checked; then the faults stop, model time passes, and
//! every surviving node must have converged on one mesh ([`check`]).
//!
//! `cargo test` runs random sequences and replays the committed corpus in
//! `fuzz/corpus/agents/`; `cargo fuzz run agents` searches for new ones.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::Duration;

use control::node::Granularity;
use ipnet::IpNet;

pub mod check;
pub mod check_endpoints;
pub mod check_pq;
pub mod check_published;
pub mod check_shares;
pub mod events;
pub mod report;
pub mod settings;
pub mod sim;

use events::{EndpointChange, Event, PeerChange, BROKEN_ANNOTATIONS, LOCATIONS, MAX_NODES};
use sim::{Election, Family, Sim};

/// How long after the last fault every surviving node must have converged: a dead node's
/// check-in window (60 s after its last check-in, which is at most 30 s old), then a resync.
pub const CONVERGENCE_BOUND: Duration = Duration::from_secs(120);

/// How much longer a tunnel may take to find a working pair of endpoints when an uplink stays
/// black-holed or without its address: a candidate that worked is left once the device has sent for a session's
/// lifetime and a probe window with no handshake ([`control::endpoints::SESSION_LIFETIME`]),
/// and each candidate tried after it gets one window (15 s), or 8 windows (2 min) once rounds
/// through every candidate found none answering ([`control::endpoints::MAX_BACKOFF`]); two
/// candidates per node here.
pub const ENDPOINT_BOUND: Duration = Duration::from_secs(180 + 15 + 2 * 8 * 15);

/// What a sequence did, for a test to report.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Events applied.
    pub events: usize,
    /// Nodes running at the end.
    pub running: usize,
    /// Locations with a running node at the end.
    pub locations: usize,
    /// Times a lease changed hands (a leader taking over from another).
    pub lease_transitions: i64,
}

/// A violation: what went wrong, after which events.
#[derive(Debug, Clone)]
pub struct Violation {
    /// What was wrong.
    pub what: String,
    /// The events applied, the last one first to blame.
    pub history: Vec<String>,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.what)?;
        writeln!(f, "after these events:")?;
        for (i, line) in self.history.iter().enumerate() {
            writeln!(f, "  {i:2}. {line}")?;
        }
        Ok(())
    }
}

/// Runs the sequence `input` stands for, on three nodes in as many locations to begin with,
/// checking the invariants after each event and convergence at the end. The first byte's low
/// bit chooses the leader election (set: Kilo's rule, clear: leases), its next bit the
/// granularity (set: full, clear: location), the one after the nodes' address family
/// (set: IPv6 only, clear: IPv4; [`sim::Family`]) and the fourth `--post-quantum` on every
/// agent (set; then every tunnel must hold one post-quantum key at both ends at the end,
/// [`check_pq`]); the rest decodes to the events ([`events::decode`]).
pub fn run(input: &[u8]) -> Result<Outcome, Violation> {
    let (mode, input) = input
        .split_first()
        .map_or((0, input), |(m, rest)| (*m, rest));
    let election = if mode & 1 == 1 {
        Election::Kilo
    } else {
        Election::Lease
    };
    let granularity = if mode & 2 == 2 {
        Granularity::Full
    } else {
        Granularity::Location
    };
    let family = if mode & 4 == 4 {
        Family::V6
    } else {
        Family::V4
    };
    let post_quantum = mode & 8 == 8;
    let mut history = vec![format!(
        "leaders chosen by {election:?}, {} granularity, {family:?} addresses{}",
        granularity.as_str(),
        if post_quantum { ", --post-quantum" } else { "" }
    )];
    let fail = |what: String, history: &[String]| Violation {
        what,
        history: history.to_vec(),
    };
    let mut sim =
        Sim::meshed(election, granularity).map_err(|e| fail(format!("{e:#}"), &history))?;
    sim.family = family;
    sim.post_quantum = post_quantum;
    let mut model = Model::default();
    for location in 0..LOCATIONS {
        let event = Event::Join { location };
        history.push(event.to_string());
        model
            .apply(&mut sim, &event)
            .map_err(|e| fail(e, &history))?;
    }
    sim.advance(Duration::from_secs(5))
        .map_err(|e| fail(format!("{e:#}"), &history))?;
    check::always(&sim).map_err(|e| fail(e, &history))?;
    let events = events::decode(input);
    for event in &events {
        let mut line = event.to_string();
        if let Some(name) = model.target(&sim, event) {
            let _ = write!(line, " ({name})");
        }
        history.push(line);
        model
            .apply(&mut sim, event)
            .map_err(|e| fail(e, &history))?;
        sim.advance(Duration::from_millis(500))
            .map_err(|e| fail(format!("{e:#}"), &history))?;
        check::always(&sim).map_err(|e| fail(e, &history))?;
    }
    history
        .push("the faults stop: every outage ends, every malformed annotation is removed".into());
    model.heal(&mut sim);
    // An uplink black-holed or without its address: a tunnel on it that had worked is left
    // only once a session's lifetime has passed without a handshake.
    let uplink_down = sim
        .nodes
        .values()
        .any(|n| (0..sim::UPLINKS).any(|u| !n.uplink_live(u)));
    let bound = if uplink_down {
        history.push(format!(
            "an uplink stays black-holed or without its address: {} s more for the candidates",
            ENDPOINT_BOUND.as_secs()
        ));
        CONVERGENCE_BOUND + ENDPOINT_BOUND
    } else {
        CONVERGENCE_BOUND
    };
    sim.advance(bound)
        .map_err(|e| fail(format!("{e:#}"), &history))?;
    let peers = model.valid_peers();
    check::converged(&sim, &model.left, &peers).map_err(|e| {
        fail(
            format!(
                "not converged {} s after the last fault: {e}\nthe nodes then:\n{}",
                bound.as_secs(),
                report::describe(&sim)
            ),
            &history,
        )
    })?;
    Ok(Outcome {
        events: events.len(),
        running: sim.running(),
        locations: sim
            .nodes
            .values()
            .filter(|n| n.running.is_some())
            .map(|n| n.location.clone())
            .collect::<BTreeSet<_>>()
            .len(),
        lease_transitions: sim
            .cluster
            .snapshot()
            .leases
            .values()
            .map(|l| i64::from(l.transitions))
            .sum(),
    })
}

/// What the model keeps besides the simulation: the faults in force and what left.
#[derive(Default)]
struct Model {
    /// The pod CIDRs of nodes that left.
    left: BTreeSet<IpNet>,
    /// Nodes with a malformed annotation: the annotations to remove when the faults stop.
    broken: Vec<(String, &'static str)>,
    /// Nodes cut off from the API.
    cut_off: BTreeSet<String>,
    /// Nodes whose WireGuard port is blocked.
    blocked: BTreeSet<String>,
    /// Nodes whose kernel refuses changes.
    refusing: BTreeSet<String>,
    /// Nodes behind NAT (not a fault: they stay so).
    behind_nat: BTreeSet<String>,
    /// The Peers in the cluster, valid or not, by number.
    peers: [Option<PeerChange>; 3],
}

/// Puts `name` in `set` (`on`) or takes it out.
fn mark(set: &mut BTreeSet<String>, name: String, on: bool) {
    if on {
        set.insert(name);
    } else {
        set.remove(&name);
    }
}

fn location_name(location: usize) -> String {
    format!("l{location}")
}

fn peer_key(which: usize) -> dataplane::PublicKey {
    dataplane::SecretKey::from_bytes([200 + which as u8; 32]).public_key()
}

fn peer_cidr(which: usize) -> IpNet {
    format!("10.99.{which}.0/24").parse().expect("CIDR")
}

impl Model {
    /// The node an event is about, if any.
    fn target(&self, sim: &Sim, event: &Event) -> Option<String> {
        match event {
            Event::Kill { node }
            | Event::Restart { node, .. }
            | Event::Leave { node }
            | Event::Move { node, .. }
            | Event::Break { node, .. }
            | Event::Mend { node }
            | Event::Cordon { node, .. }
            | Event::Prefer { node, .. }
            | Event::Outage { node, .. }
            | Event::Block { node, .. }
            | Event::Refuse { node, .. }
            | Event::Nat { node, .. }
            | Event::Endpoint { node, .. } => sim.nth(*node),
            _ => None,
        }
    }

    fn apply(&mut self, sim: &mut Sim, event: &Event) -> Result<(), String> {
        let target = self.target(sim, event);
        let error = |e: anyhow::Error| format!("{e:#}");
        match (event, target) {
            (Event::Wait { secs }, _) => sim
                .advance(Duration::from_secs(u64::from(*secs)))
                .map_err(error)?,
            (Event::Join { location }, _) if sim.nodes.len() < MAX_NODES => {
                sim.join(&location_name(*location)).map_err(error)?;
            }
            // Two agents keep running: a cluster of dead nodes converges on nothing.
            (Event::Kill { .. }, Some(name)) if sim.running() > 2 => sim.kill(&name),
            (
                Event::Restart {
                    with_saved_state, ..
                },
                Some(name),
            ) => {
                sim.start(&name, *with_saved_state).map_err(error)?;
                if self.cut_off.contains(&name) {
                    sim.set_outage(&name, true);
                }
            }
            // The last node stays: a cluster of none checks nothing.
            (Event::Leave { .. }, Some(name)) if sim.nodes.len() > 1 => {
                self.left.insert(sim.nodes[&name].pod_cidr);
                self.cut_off.remove(&name);
                self.blocked.remove(&name);
                self.refusing.remove(&name);
                self.broken.retain(|(n, _)| *n != name);
                sim.leave(&name);
            }
            (Event::Move { location, .. }, Some(name)) => {
                let location = location_name(*location);
                sim.nodes.get_mut(&name).expect("listed").location = location.clone();
                sim.edit_node(&name, |node| {
                    node.metadata
                        .labels
                        .get_or_insert_with(Default::default)
                        .insert(control::node::DEFAULT_TOPOLOGY_LABEL.to_string(), location);
                });
            }
            (Event::Break { which, .. }, Some(name)) => {
                let (key, value) = BROKEN_ANNOTATIONS[*which];
                sim.annotate(&name, key, Some(value));
                self.broken.push((name, key));
            }
            (Event::Mend { .. }, Some(name)) => {
                let broken: Vec<&str> = self
                    .broken
                    .iter()
                    .filter(|(n, _)| *n == name)
                    .map(|(_, key)| *key)
                    .collect();
                for key in broken {
                    self.mend(sim, &name, key);
                }
                self.broken.retain(|(n, _)| *n != name);
            }
            (Event::Nat { on, .. }, Some(name)) => {
                // The NAT's annotation replaces a malformed one of the same key.
                let keepalive = control::node::annotation::PERSISTENT_KEEPALIVE;
                self.broken
                    .retain(|(n, k)| !(*n == name && *k == keepalive));
                sim.set_nat(&name, *on);
                mark(&mut self.behind_nat, name, *on);
            }
            (Event::Endpoint { change, .. }, Some(name)) => match *change {
                EndpointChange::BlackHole { uplink, on } => sim.set_black_holed(&name, uplink, on),
                EndpointChange::AddressRemoved => sim.readdress(&name, true),
                EndpointChange::AddressRenewed => sim.readdress(&name, false),
                EndpointChange::NatMoved => sim.move_nat_mapping(&name),
            },
            (Event::Cordon { on, .. }, Some(name)) => {
                let on = *on;
                sim.edit_node(&name, |node| {
                    node.spec.get_or_insert_with(Default::default).unschedulable =
                        on.then_some(true);
                });
            }
            (Event::Prefer { on, .. }, Some(name)) => {
                sim.annotate(
                    &name,
                    control::node::annotation::LEADER,
                    on.then_some("true"),
                );
            }
            (Event::Outage { on, .. }, Some(name)) => self.cut_off_from_the_api(sim, name, *on),
            (Event::Block { on, .. }, Some(name)) => {
                sim.set_blocked(&name, *on);
                mark(&mut self.blocked, name, *on);
            }
            (Event::Refuse { on, .. }, Some(name)) => {
                sim.nodes[&name].kernel.refuse_changes(*on);
                mark(&mut self.refusing, name, *on);
            }
            (Event::OutageAll { on }, _) => {
                let names: Vec<String> = sim.nodes.keys().cloned().collect();
                for name in names {
                    self.cut_off_from_the_api(sim, name, *on);
                }
            }
            (Event::Peer { which, change }, _) => {
                let which = *which;
                let name = format!("p{which}");
                let object = match change {
                    PeerChange::Removed => None,
                    PeerChange::Valid | PeerChange::Malformed => {
                        let mut object = control::PeerObject::default();
                        object.metadata.name = Some(name.clone());
                        object.spec.public_key = base64_key(&peer_key(which));
                        object.spec.allowed_ips = vec![if *change == PeerChange::Valid {
                            peer_cidr(which).to_string()
                        } else {
                            "10.99.0.0/99".to_string()
                        }];
                        object.spec.persistent_keepalive = Some(10);
                        Some(object)
                    }
                };
                self.peers[which] = (*change != PeerChange::Removed).then_some(*change);
                sim.cluster.update(|s| s.put_peer(&name, object));
            }
            // An event about a node when there is none, or a join past the limit: nothing.
            _ => {}
        }
        Ok(())
    }

    /// Cuts `name` off from the API server (`on`) or reconnects it, and remembers which.
    fn cut_off_from_the_api(&mut self, sim: &mut Sim, name: String, on: bool) {
        sim.set_outage(&name, on);
        mark(&mut self.cut_off, name, on);
    }

    /// Ends every fault: outages, malformed annotations, blocked ports and refusing kernels.
    /// Black-holed uplinks and removed addresses stay, as conditions the mesh must route
    /// around, except that every node keeps one live uplink (`eth0` is let through when
    /// none is).
    fn heal(&mut self, sim: &mut Sim) {
        let dead: Vec<String> = sim
            .nodes
            .iter()
            .filter(|(_, n)| !(0..sim::UPLINKS).any(|u| n.uplink_live(u)))
            .map(|(name, _)| name.clone())
            .collect();
        for name in dead {
            sim.set_black_holed(&name, 0, false);
        }
        for name in std::mem::take(&mut self.cut_off) {
            sim.set_outage(&name, false);
        }
        for (name, key) in std::mem::take(&mut self.broken) {
            self.mend(sim, &name, key);
        }
        for name in std::mem::take(&mut self.blocked) {
            sim.set_blocked(&name, false);
        }
        for name in std::mem::take(&mut self.refusing) {
            sim.nodes[&name].kernel.refuse_changes(false);
        }
    }

    /// Removes the malformed annotation `key` from `name`: the node's own value comes back
    /// (its NAT's keepalive), or none.
    fn mend(&self, sim: &mut Sim, name: &str, key: &str) {
        let nat = key == control::node::annotation::PERSISTENT_KEEPALIVE
            && self.behind_nat.contains(name);
        sim.annotate(name, key, nat.then_some(sim::NAT_KEEPALIVE));
    }

    /// The valid Peers: their keys and allowed IPs.
    fn valid_peers(&self) -> Vec<(control::Key, IpNet)> {
        self.peers
            .iter()
            .enumerate()
            .filter(|(_, p)| **p == Some(PeerChange::Valid))
            .map(|(i, _)| (control::Key(*peer_key(i).as_bytes()), peer_cidr(i)))
            .collect()
    }
}

fn base64_key(key: &dataplane::PublicKey) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(key.as_bytes())
}

#[cfg(test)]
mod check_tests;
#[cfg(test)]
mod endpoint_tests;
#[cfg(test)]
mod pq_tests;
#[cfg(test)]
mod publish_tests;
#[cfg(test)]
mod retry_tests;
#[cfg(test)]
mod rotation_tests;
#[cfg(test)]
mod share_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod write_tests;
