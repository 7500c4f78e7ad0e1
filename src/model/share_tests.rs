//! The model with two leaders per location: a share's leader killed, restarted, cut off, and
//! the location's lease holder killed; each time the other share keeps its leader and the
//! mesh converges on shares every agent agrees on.

use std::time::Duration;

use control::leader::shares::share_lease_name;

use super::check_shares::{converged_shares, shares_seen_from_afar};
use super::sim::{Election, Sim};

/// Four nodes in l0 and three in l1, two leaders a side by lease, converged.
fn two_a_side() -> Sim {
    let mut sim = Sim::new(Election::Lease).unwrap();
    sim.leaders_per_location = 2;
    for location in [0, 0, 0, 0, 1, 1, 1] {
        sim.join(&format!("l{location}")).unwrap();
    }
    sim.advance(Duration::from_secs(20)).unwrap();
    converged_shares(&sim, 2).unwrap();
    sim
}

/// The holder of l0's share `share` (counting from 0).
fn holder(sim: &Sim, share: usize) -> Option<String> {
    sim.cluster
        .snapshot()
        .leases
        .get(&share_lease_name("l0", share))?
        .holder
        .clone()
}

/// Advances a second at a time until l0's `share` is held by a running node other than `was`,
/// for at most `bound`: how long it took.
fn taken_over(sim: &mut Sim, share: usize, was: &str, bound: Duration) -> Duration {
    let mut waited = Duration::ZERO;
    loop {
        let by = holder(sim, share);
        let running = by
            .as_deref()
            .is_some_and(|h| h != was && sim.nodes[h].running.is_some());
        if running {
            return waited;
        }
        assert!(
            waited < bound,
            "l0's share {share} still with {by:?} after {waited:?}"
        );
        sim.advance(Duration::from_secs(1)).unwrap();
        waited += Duration::from_secs(1);
    }
}

#[test]
fn a_killed_second_leader_is_replaced_within_the_lease_and_keeps_out_when_back() {
    let mut sim = two_a_side();
    let (first, second) = (holder(&sim, 0).unwrap(), holder(&sim, 1).unwrap());
    sim.kill(&second);
    let waited = taken_over(&mut sim, 1, &second, Duration::from_secs(10));
    println!("l0's second leader {second} killed: its share's lease taken over after {waited:?}");
    assert_eq!(holder(&sim, 0).as_deref(), Some(first.as_str()));
    sim.advance(Duration::from_secs(10)).unwrap();
    converged_shares(&sim, 2).unwrap();
    let successor = holder(&sim, 1).unwrap();
    for with_saved_state in [true, false] {
        sim.start(&second, with_saved_state).unwrap();
        sim.advance(Duration::from_secs(30)).unwrap();
        converged_shares(&sim, 2).unwrap();
        assert_eq!(holder(&sim, 1).as_deref(), Some(successor.as_str()));
        assert_eq!(holder(&sim, 0).as_deref(), Some(first.as_str()));
    }
}

#[test]
fn a_killed_first_leader_leaves_the_second_share_alone() {
    let mut sim = two_a_side();
    let (first, second) = (holder(&sim, 0).unwrap(), holder(&sim, 1).unwrap());
    sim.kill(&first);
    taken_over(&mut sim, 0, &first, Duration::from_secs(10));
    assert_eq!(holder(&sim, 1).as_deref(), Some(second.as_str()));
    assert_ne!(holder(&sim, 0).as_deref(), Some(second.as_str()));
    sim.advance(Duration::from_secs(10)).unwrap();
    converged_shares(&sim, 2).unwrap();
}

#[test]
fn a_second_leader_cut_off_hands_its_share_to_a_verifier() {
    let mut sim = two_a_side();
    let (first, second) = (holder(&sim, 0).unwrap(), holder(&sim, 1).unwrap());
    sim.set_blocked(&second, true);
    let waited = taken_over(&mut sim, 1, &second, Duration::from_secs(40));
    println!("l0's second leader {second} cut off: its share's lease taken over after {waited:?}");
    assert_eq!(holder(&sim, 0).as_deref(), Some(first.as_str()));
    sim.set_blocked(&second, false);
    sim.advance(Duration::from_secs(20)).unwrap();
    converged_shares(&sim, 2).unwrap();
}

#[test]
fn the_share_check_catches_a_location_with_too_few_leaders() {
    let sim = two_a_side();
    let error = converged_shares(&sim, 3).unwrap_err();
    assert!(error.contains("has 2 leaders"), "{error}");
}

/// `size` nodes in l0 and two in l1, two leaders a side by lease, converged.
fn sized(size: usize) -> Sim {
    let mut sim = Sim::new(Election::Lease).unwrap();
    sim.leaders_per_location = 2;
    for location in std::iter::repeat_n(0, size).chain([1, 1]) {
        sim.join(&format!("l{location}")).unwrap();
    }
    sim.advance(Duration::from_secs(20)).unwrap();
    converged_shares(&sim, 2).unwrap();
    sim
}

/// l0's second leader killed, or cordoned, with 4 to 9 nodes in l0: one of its own followers
/// takes its share over, and every other node of l0 stays in the share it was in.
#[test]
fn a_second_leader_lost_or_cordoned_moves_no_other_node() {
    for (size, cordon) in (4..=9).flat_map(|size| [(size, false), (size, true)]) {
        let mut sim = sized(size);
        let before = shares_seen_from_afar(&sim, "l0").unwrap();
        let second = holder(&sim, 1).unwrap();
        if cordon {
            sim.edit_node(&second, |node| {
                node.spec.get_or_insert_with(Default::default).unschedulable = Some(true);
            });
        } else {
            sim.kill(&second);
        }
        let bound = Duration::from_secs(10);
        taken_over(&mut sim, 1, &second, bound);
        sim.advance(Duration::from_secs(10)).unwrap();
        converged_shares(&sim, 2).unwrap();
        let successor = holder(&sim, 1).unwrap();
        assert_eq!(before[&successor], 1, "{successor} was in the second share");
        let mut after = shares_seen_from_afar(&sim, "l0").unwrap();
        if !cordon {
            after.insert(second.clone(), before[&second]);
        }
        assert_eq!(after, before, "{size} nodes in l0, cordoned: {cordon}");
        if !cordon {
            // A minute after its last check-in the dead node is no longer ready: it leaves its
            // share, and balance may move one node into it.
            sim.advance(Duration::from_secs(90)).unwrap();
            converged_shares(&sim, 2).unwrap();
            let later = shares_seen_from_afar(&sim, "l0").unwrap();
            let moved = later.iter().filter(|(n, s)| before[*n] != **s).count();
            assert!(
                moved <= 1,
                "{size} nodes in l0: {moved} moved once the dead one left"
            );
        }
    }
}

/// A node that still publishes an earlier kilotun's `kilotun.io/leaders-per-location` (its
/// agent splits shares otherwise) holds every location at one leader, the holder of the
/// location's lease, while it counts as ready; once it is gone the shares come back.
#[test]
fn an_earlier_kilotuns_node_holds_every_location_at_its_lease_holder() {
    let mut sim = sized(6);
    let first = holder(&sim, 0).unwrap();
    let second = holder(&sim, 1).unwrap();
    let older = sim
        .nodes
        .iter()
        .find(|(name, n)| n.location == "l0" && **name != first && **name != second)
        .map(|(name, _)| name.clone())
        .unwrap();
    // Its agent stopped (a running one of this version would remove the annotation), it
    // publishes what an earlier kilotun did, and still counts as ready for a while.
    sim.kill(&older);
    sim.annotate(
        &older,
        control::node::annotation::LEADERS_PER_LOCATION,
        Some("2"),
    );
    sim.advance(Duration::from_secs(10)).unwrap();
    converged_shares(&sim, 1).unwrap();
    assert!(
        sim.nodes[&first].leads(),
        "{first} holds l0's lease and leads it"
    );
    assert!(
        !sim.nodes[&second].leads(),
        "{second} leads no share any more"
    );
    assert_eq!(holder(&sim, 0).as_deref(), Some(first.as_str()));
    // Its check-in window passed: it is no longer ready, and l0 has two leaders again.
    sim.advance(Duration::from_secs(90)).unwrap();
    converged_shares(&sim, 2).unwrap();
    assert_eq!(holder(&sim, 0).as_deref(), Some(first.as_str()));
}
