//! What publishing the mesh's state costs the API server: the node condition, the Peers'
//! status and the Kubernetes Events, counted per writer by the in-memory cluster. In steady
//! state every node's condition says `True`, one node writes every Peer's status, and the
//! writes stay within the budget of one per node per five minutes on average; a location's
//! leader cut off and back costs a bounded number of writes, told once each.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use control::api_events::ApiWrite;
use control::condition::ConditionStatus;
use control::node::Granularity;

use crate::backend::memory::WriteCounts;

use super::settings::Election;
use super::sim::Sim;
use super::{base64_key, check, peer_cidr, peer_key};

/// The budget: one write of the mesh's state per node per this long, on average.
const BUDGET_PERIOD: Duration = Duration::from_secs(5 * 60);

/// The two Peers of [`settled_mesh`], as `check::converged` expects them.
fn peers() -> Vec<(control::Key, ipnet::IpNet)> {
    (0..2)
        .map(|i| (control::Key(*peer_key(i).as_bytes()), peer_cidr(i)))
        .collect()
}

/// Six nodes in three locations and two Peers, converged and settled.
fn settled_mesh() -> Sim {
    let mut sim = Sim::meshed(Election::Lease, Granularity::Location).unwrap();
    for location in [0, 0, 1, 1, 2, 2] {
        sim.join(&format!("l{location}")).unwrap();
    }
    for which in 0..2 {
        let name = format!("p{which}");
        let mut object = control::PeerObject::default();
        object.metadata.name = Some(name.clone());
        object.spec.public_key = base64_key(&peer_key(which));
        object.spec.allowed_ips = vec![peer_cidr(which).to_string()];
        sim.cluster.update(|s| s.put_peer(&name, Some(object)));
    }
    sim.advance(Duration::from_secs(10 * 60)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &peers()).unwrap();
    sim
}

/// Each writer's writes since `before`.
fn since(sim: &Sim, before: &BTreeMap<String, WriteCounts>) -> BTreeMap<String, WriteCounts> {
    sim.cluster
        .writes()
        .into_iter()
        .map(|(writer, now)| {
            let was = before.get(&writer).copied().unwrap_or_default();
            let delta = WriteCounts {
                annotations: now.annotations - was.annotations,
                leases: now.leases - was.leases,
                conditions: now.conditions - was.conditions,
                peer_statuses: now.peer_statuses - was.peer_statuses,
                events: now.events - was.events,
            };
            (writer, delta)
        })
        .collect()
}

/// Every node's condition as last written, by name: its status and reason.
fn conditions(sim: &Sim) -> BTreeMap<String, (ConditionStatus, String)> {
    sim.cluster
        .published()
        .conditions
        .into_iter()
        .map(|(node, write)| {
            let reason = format!("{:?}", write.condition.reason);
            (node, (write.condition.status(), reason))
        })
        .collect()
}

#[test]
fn a_steady_mesh_says_ready_and_stays_within_the_write_budget() {
    let mut sim = settled_mesh();
    let all_true = conditions(&sim);
    assert_eq!(all_true.len(), 6, "a condition per node: {all_true:?}");
    assert!(
        all_true.values().all(|(s, _)| *s == ConditionStatus::True),
        "every node ready once settled: {all_true:?}"
    );
    let before = sim.cluster.writes();
    let hour = Duration::from_secs(60 * 60);
    sim.advance(hour).unwrap();
    let writes = since(&sim, &before);
    let mesh_state: u64 = writes.values().map(WriteCounts::mesh_state).sum();
    let periods = (hour.as_secs() / BUDGET_PERIOD.as_secs()) * sim.nodes.len() as u64;
    println!("steady hour: {mesh_state} writes of the mesh's state, budget {periods}: {writes:?}");
    assert!(
        mesh_state <= periods,
        "{mesh_state} writes of the mesh's state in an hour, over the budget of {periods}: {writes:?}"
    );
    assert_eq!(conditions(&sim), all_true, "nothing moved in a steady hour");

    let published = sim.cluster.published();
    let writers: BTreeSet<&String> = published.peer_statuses.values().map(|(w, _)| w).collect();
    assert_eq!(published.peer_statuses.len(), 2, "both Peers have a status");
    assert_eq!(
        writers.len(),
        1,
        "one node writes the Peers' status: {writers:?}"
    );
    let writer = *writers.iter().next().unwrap();
    assert!(
        sim.nodes[writer].leads(),
        "{writer} writes the Peers' status and leads"
    );
    let others: u64 = writes
        .iter()
        .filter(|(w, _)| *w != writer)
        .map(|(_, c)| c.peer_statuses)
        .sum();
    assert_eq!(others, 0, "only {writer} wrote a Peer's status: {writes:?}");
}

#[test]
fn a_leader_cut_off_and_back_is_told_once_at_a_bounded_cost() {
    let mut sim = settled_mesh();
    let leader = sim.lease_holder("l0").expect("l0 has a leader");
    let before = sim.cluster.writes();
    let events_before = sim.cluster.published().events.len();
    sim.set_blocked(&leader, true);
    // Every node whose condition said False at some point of the outage.
    let mut told = BTreeSet::new();
    for _ in 0..24 {
        sim.advance(Duration::from_secs(5)).unwrap();
        for (node, (status, _)) in conditions(&sim) {
            if status == ConditionStatus::False {
                told.insert(node);
            }
        }
    }
    assert!(
        !told.is_empty(),
        "a node says it lost {leader}: {:?}",
        conditions(&sim)
    );
    sim.set_blocked(&leader, false);
    let window = Duration::from_secs(10 * 60);
    sim.advance(window).unwrap();
    check::converged(&sim, &BTreeSet::new(), &peers()).unwrap();
    let back = conditions(&sim);
    assert!(
        back.values().all(|(s, _)| *s == ConditionStatus::True),
        "every node ready again: {back:?}"
    );

    let writes = since(&sim, &before);
    let mesh_state: u64 = writes.values().map(WriteCounts::mesh_state).sum();
    let nodes = sim.nodes.len() as u64;
    let minutes = 12;
    // Each node's heartbeats over the 12 minutes, and per node told: False, then True, a
    // LinkDown and a LinkUp Event for each tunnel it lost (two other locations at most).
    let bound = nodes * (minutes / 5 + 1) + told.len() as u64 * (2 + 2 * 2);
    println!("{leader} cut off for 2 min: {mesh_state} writes, bound {bound}: {writes:?}");
    assert!(
        mesh_state <= bound,
        "{mesh_state} writes of the mesh's state, over {bound}: {writes:?}"
    );
    let events = &sim.cluster.published().events[events_before..];
    let mut created: BTreeMap<(String, String), usize> = BTreeMap::new();
    for (writer, write) in events {
        if let ApiWrite::Create(event) = write {
            let what = format!(
                "{} {:?}: {}",
                event.reason.as_str(),
                event.regarding,
                event.note
            );
            *created.entry((writer.clone(), what)).or_default() += 1;
        }
    }
    assert!(
        created.keys().any(|(_, what)| what.starts_with("LinkDown")),
        "a LinkDown Event for {leader}: {created:?}"
    );
    assert!(
        created.values().all(|count| *count == 1),
        "each Event created once: {created:?}"
    );
}
