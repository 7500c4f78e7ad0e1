//! Shells that fail: a kernel that refuses every change fails its agent's passes, the agent
//! retries on its own timer (not at the next check-in or resync), and once the kernel takes
//! changes again the mesh is whole within the retry's backoff.

use std::collections::BTreeSet;
use std::time::Duration;

use super::check;
use super::sim::{Election, Sim};
use crate::agent::Timer;

#[test]
fn a_kernel_that_refuses_changes_is_retried_on_a_backoff_and_caught_up_after() {
    let mut sim = Sim::new(Election::Lease).unwrap();
    for location in [0, 1, 0] {
        sim.join(&format!("l{location}")).unwrap();
    }
    sim.advance(Duration::from_secs(10)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
    let leader = sim.lease_holder("l0").unwrap();
    sim.nodes[&leader].kernel.refuse_changes(true);
    let newcomer = sim.join("l2").unwrap();
    let pods = sim.nodes[&newcomer].pod_cidr;
    let routed = |sim: &Sim| {
        sim.nodes[&leader]
            .kernel
            .routes()
            .routes
            .iter()
            .any(|r| r.dst == pods)
    };
    sim.advance(Duration::from_secs(5)).unwrap();
    check::always(&sim).unwrap();
    assert!(!routed(&sim), "the kernel refused the route");
    let agent = &sim.nodes[&leader].running.as_ref().unwrap().twin.agent;
    let retry = agent
        .timers_due()
        .into_iter()
        .find(|(_, timer)| *timer == Timer::Retry);
    assert!(retry.is_some(), "a retry is set while the kernel refuses");
    assert!(agent.host_behind());
    sim.nodes[&leader].kernel.refuse_changes(false);
    // The backoff after about five failed seconds is at most 8 s; a check-in or resync would
    // take up to 30 s.
    let mut waited = 0;
    while !routed(&sim) {
        assert!(
            waited < 9,
            "{newcomer}'s pods are not routed {waited} s later"
        );
        sim.advance(Duration::from_secs(1)).unwrap();
        waited += 1;
    }
    println!("{newcomer}'s pods routed by {leader} {waited} s after its kernel took changes");
    sim.advance(Duration::from_secs(10)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
}
