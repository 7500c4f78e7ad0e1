use std::collections::BTreeMap;

use super::*;
use crate::fixtures::location_nodes;
use crate::leader::{Basis, LEASE_DURATION_MS};

const NOW: i64 = 1_700_000_000_000;

/// Five nodes of `east` (e1..e5), all with lease election.
fn east() -> Vec<Node> {
    let mut nodes = location_nodes("e", "east", 10, 5);
    for n in &mut nodes {
        n.lease_election = true;
    }
    nodes
}

fn held(holder: &str, renewed_ms: i64) -> LeaseState {
    LeaseState {
        holder: Some(holder.into()),
        renewed_ms,
        duration_ms: LEASE_DURATION_MS,
        ..LeaseState::default()
    }
}

/// A lease `holder` holds, renewed now, that `by` handed over to it.
fn handed(holder: &str, by: &str) -> LeaseState {
    LeaseState {
        handed_over_by: Some(by.into()),
        ..held(holder, NOW)
    }
}

/// East's elections among `nodes` with `count` shares.
fn elected(nodes: &[Node], leases: &BTreeMap<String, LeaseState>, count: usize) -> Vec<Election> {
    let refs: Vec<&Node> = nodes.iter().collect();
    elect_shares(&refs, "east", leases, count, NOW)
}

/// Each share's leader, in share order, as (share, leader).
fn leaders(
    nodes: &[Node],
    leases: &BTreeMap<String, LeaseState>,
    count: usize,
) -> Vec<(usize, String)> {
    elected(nodes, leases, count)
        .into_iter()
        .map(|e| (e.share, e.leader))
        .collect()
}

/// `names` leading shares 0, 1, ... in order.
fn share_leaders(names: &[&str]) -> Vec<ShareLeader> {
    names
        .iter()
        .enumerate()
        .map(|(share, name)| ShareLeader {
            share,
            name: name.to_string(),
            predecessors: Vec::new(),
        })
        .collect()
}

fn names(pairs: &[(usize, &str)]) -> Vec<(usize, String)> {
    pairs.iter().map(|(s, n)| (*s, n.to_string())).collect()
}

#[test]
fn share_leases_are_named_apart_from_every_locations_lease() {
    assert_eq!(share_lease_name("east", 0), lease_name("east"));
    assert_eq!(share_lease_name("east", 1), "kilotun-leader-east.share2");
    // A location whose name looks like another's share still has a lease of its own.
    assert_ne!(
        share_lease_name("east.share2", 0),
        share_lease_name("east", 1)
    );
    let all: std::collections::BTreeSet<String> = (0..MAX_SHARES)
        .map(|s| share_lease_name("east", s))
        .collect();
    assert_eq!(all.len(), MAX_SHARES);
}

#[test]
fn one_share_is_the_locations_election() {
    let nodes = east();
    let leases = BTreeMap::from([(lease_name("east"), held("e3", NOW))]);
    assert_eq!(leaders(&nodes, &leases, 1), names(&[(0, "e3")]));
}

#[test]
fn without_leases_each_share_takes_the_next_node_in_kilos_order() {
    let nodes = east();
    assert_eq!(
        leaders(&nodes, &BTreeMap::new(), 3),
        names(&[(0, "e1"), (1, "e2"), (2, "e3")])
    );
    // Never more shares than nodes.
    assert_eq!(leaders(&nodes, &BTreeMap::new(), 9).len(), 5);
}

#[test]
fn a_shares_holder_keeps_it_when_the_first_share_fails_over() {
    let nodes = east();
    // e1 held share 0 and stopped renewing; e4 holds share 1.
    let leases = BTreeMap::from([
        (
            share_lease_name("east", 0),
            held("e1", NOW - LEASE_DURATION_MS),
        ),
        (share_lease_name("east", 1), held("e4", NOW)),
    ]);
    let elected = leaders(&nodes, &leases, 2);
    // Kilo's rule would pick e1 (expired) then e2: share 0 goes to e2, and e4 keeps share 1
    // rather than being promoted, so its followers see no change.
    assert_eq!(elected, names(&[(0, "e2"), (1, "e4")]));
}

#[test]
fn a_lost_secondary_leader_is_replaced_by_a_follower_of_its_share() {
    let nodes = location_nodes("e", "east", 10, 9)
        .into_iter()
        .map(|mut n| {
            n.lease_election = true;
            n
        })
        .collect::<Vec<_>>();
    let leases = BTreeMap::from([
        (share_lease_name("east", 0), held("e1", NOW)),
        (
            share_lease_name("east", 1),
            held("e2", NOW - LEASE_DURATION_MS),
        ),
        (share_lease_name("east", 2), held("e3", NOW)),
    ]);
    // The shares as they were while e2 led share 1.
    let group: Vec<&Node> = nodes.iter().collect();
    let chosen = share_leaders(&["e1", "e2", "e3"]);
    let before = split(&group, 3, &chosen, &Default::default());
    let share1: Vec<&str> = (0..nodes.len())
        .filter(|&i| before.share_of[i] == 1 && nodes[i].name != "e2")
        .map(|i| nodes[i].name.as_str())
        .collect();
    let elected = elected(&nodes, &leases, 3);
    let leaders: Vec<&str> = elected.iter().map(|e| e.leader.as_str()).collect();
    assert_eq!([leaders[0], leaders[2]], ["e1", "e3"]);
    assert!(
        share1.contains(&leaders[1]),
        "{} took share 1 over, not one of its followers {share1:?}",
        leaders[1]
    );
    // Kilo's order among them: the first in name order (none is annotated or public).
    assert_eq!(leaders[1], share1[0]);
    assert_eq!(elected[1].basis, Basis::KiloRule);
    assert!(elected[1].kept_out.contains(&"e2".to_string()));
    // e2 stays in share 1 and in no other.
    assert_eq!(elected[1].predecessors, ["e2"]);
    assert!(elected[0].predecessors.is_empty() && elected[2].predecessors.is_empty());
    // With no follower left in its share, the other candidates stand.
    let three = &nodes[..3];
    let alone = super::elect_shares(&three.iter().collect::<Vec<_>>(), "east", &leases, 3, NOW);
    assert_eq!(alone.len(), 2, "two nodes left lead two shares: {alone:?}");
}

#[test]
fn a_returning_leader_does_not_take_its_share_back() {
    let mut nodes = east();
    // e4 took share 1 over from e2, whose lease expired; e2 has checked in since.
    let mut share1 = held("e4", NOW);
    share1.deposed = BTreeMap::from([("e2".to_string(), nodes[1].last_seen)]);
    nodes[1].last_seen += 30;
    let leases = BTreeMap::from([
        (share_lease_name("east", 0), held("e1", NOW)),
        (share_lease_name("east", 1), share1),
    ]);
    assert_eq!(leaders(&nodes, &leases, 2), names(&[(0, "e1"), (1, "e4")]));
    // It is a candidate again: a third share would be its.
    assert_eq!(
        leaders(&nodes, &leases, 3),
        names(&[(0, "e1"), (1, "e4"), (2, "e2")])
    );
}

#[test]
fn a_cordoned_secondary_holder_gives_its_share_to_a_free_node() {
    let mut nodes = east();
    nodes[1].cordoned = true;
    let leases = BTreeMap::from([
        (share_lease_name("east", 0), held("e1", NOW)),
        (share_lease_name("east", 1), held("e2", NOW)),
    ]);
    assert_eq!(leaders(&nodes, &leases, 2), names(&[(0, "e1"), (1, "e3")]));
}

#[test]
fn a_cut_off_share_is_verified_by_nodes_that_lead_nothing() {
    let nodes = east();
    let mut share1 = held("e2", NOW);
    share1.cut_off = true;
    let leases = BTreeMap::from([
        (share_lease_name("east", 0), held("e1", NOW)),
        (share_lease_name("east", 1), share1),
        (share_lease_name("east", 2), held("e3", NOW)),
    ]);
    let elected = elected(&nodes, &leases, 3);
    assert_eq!(elected[1].leader, "e2");
    // The verifiers are the share's own followers first (e5; e4 follows another share), so that
    // the one that takes it over moves nobody else, then the other candidates.
    let group: Vec<&Node> = nodes.iter().collect();
    let chosen = share_leaders(&["e1", "e2", "e3"]);
    let split = split(&group, 3, &chosen, &Default::default());
    assert_eq!((split.share_of[3], split.share_of[4]), (0, 1));
    assert_eq!(elected[1].verifiers, ["e5", "e4"]);
    assert!(elected[0].verifiers.is_empty());
}

#[test]
fn with_annotated_nodes_only_they_lead_the_other_shares() {
    let mut nodes = east();
    nodes[2].leader = true;
    nodes[4].leader = true;
    assert_eq!(
        leaders(&nodes, &BTreeMap::new(), 4),
        names(&[(0, "e3"), (1, "e5")])
    );
}

#[test]
fn a_restarted_node_holding_a_shares_lease_is_led_by_nobody_else() {
    let nodes = east();
    let leases = BTreeMap::from([
        (share_lease_name("east", 0), held("e1", NOW - 1_000)),
        (share_lease_name("east", 1), held("e2", NOW - 1_000)),
    ]);
    // e2 leads the second share: its saved peers are a leader's, and still its own.
    assert_eq!(crate::leader::led_by_another(&nodes[1], &leases, NOW), None);
    // e3 leads nothing: the location's holder leads it.
    assert_eq!(
        crate::leader::led_by_another(&nodes[2], &leases, NOW),
        Some("e1")
    );
    // Once the second share's lease expired, e2 is led by another too.
    let later = NOW + LEASE_DURATION_MS;
    let renewed = BTreeMap::from([
        (share_lease_name("east", 0), held("e1", later - 1_000)),
        (share_lease_name("east", 1), held("e2", NOW - 1_000)),
    ]);
    assert_eq!(
        crate::leader::led_by_another(&nodes[1], &renewed, later),
        Some("e1")
    );
}

#[test]
fn a_holder_replaced_while_cut_off_is_kept_out_of_that_share_only() {
    let nodes = east();
    // e4 took share 1 over from e2, found cut off; share 2 has no holder yet.
    let mut share1 = held("e4", NOW);
    share1.cut_off_predecessor = Some("e2".into());
    let leases = BTreeMap::from([
        (share_lease_name("east", 0), held("e1", NOW)),
        (share_lease_name("east", 1), share1),
    ]);
    let elected = elected(&nodes, &leases, 3);
    assert_eq!(
        leaders(&nodes, &leases, 3),
        names(&[(0, "e1"), (1, "e4"), (2, "e2")])
    );
    // Nor does it sit outside the shares' balance.
    assert!(elected.iter().all(|e| e.kept_out.is_empty()), "{elected:?}");
}

/// e2 once handed the first share over (and that lease stays in e1's hands), then led the
/// second share and died: it stays in the second share, the one it left last.
#[test]
fn a_predecessor_named_by_two_leases_stays_in_the_share_it_left_last() {
    let nodes = east();
    let leases = BTreeMap::from([
        (share_lease_name("east", 0), handed("e1", "e2")),
        (
            share_lease_name("east", 1),
            held("e2", NOW - LEASE_DURATION_MS),
        ),
    ]);
    let died = elected(&nodes, &leases, 2);
    assert!(died[0].predecessors.is_empty(), "{died:?}");
    assert_eq!(died[1].predecessors, ["e2"]);
    // Cordoned while it holds the second share, likewise.
    let mut nodes = east();
    nodes[1].cordoned = true;
    let leases = BTreeMap::from([
        (share_lease_name("east", 0), handed("e1", "e2")),
        (share_lease_name("east", 1), held("e2", NOW)),
    ]);
    let cordoned = elected(&nodes, &leases, 2);
    assert_ne!(cordoned[1].leader, "e2");
    assert!(cordoned[0].predecessors.is_empty(), "{cordoned:?}");
    assert_eq!(cordoned[1].predecessors, ["e2"]);
}

/// A live node that handed a lease over (it took it in the start-up race, or an annotated node
/// was preferred) is a follower like any other; cordoned, it stays in that share.
#[test]
fn only_a_cordoned_node_stays_in_the_share_it_handed_over() {
    let mut nodes = east();
    let leases = BTreeMap::from([
        (share_lease_name("east", 0), held("e1", NOW)),
        (share_lease_name("east", 1), handed("e2", "e4")),
    ]);
    let live = elected(&nodes, &leases, 2);
    assert!(live.iter().all(|e| e.predecessors.is_empty()), "{live:?}");
    nodes[3].cordoned = true;
    let cordoned = elected(&nodes, &leases, 2);
    assert_eq!(cordoned[1].predecessors, ["e4"]);
}
