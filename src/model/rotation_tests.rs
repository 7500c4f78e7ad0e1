//! Key rotation in the reference model: a node's kg asked for a new key (its
//! `kilotun.io/rotate-key` annotation), in location and full granularity, with leases or
//! Kilo's rule. The node ends with one new key, published and on its device, every other node's
//! device holds that key and not the old one, and the model's checks hold throughout.

use std::collections::BTreeSet;
use std::time::Duration;

use control::node::annotation;
use control::node::Granularity;

use super::check;
use super::settings::Election;
use super::sim::Sim;

fn rotate_and_follow(election: Election, granularity: Granularity) {
    let what = format!("{election:?}, {granularity:?}");
    let mut sim = Sim::meshed(election, granularity).unwrap();
    for location in [0, 0, 1, 2] {
        sim.join(&format!("l{location}")).unwrap();
    }
    sim.advance(Duration::from_secs(10)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap_or_else(|e| panic!("{what}: {e}"));
    let old = sim.nodes["n01"].public_key();
    sim.annotate("n01", annotation::ROTATE_KEY, Some("r1"));
    for _ in 0..10 {
        sim.advance(Duration::from_secs(1)).unwrap();
        check::always(&sim).unwrap_or_else(|e| panic!("{what}, rotating: {e}"));
    }
    let new = sim.nodes["n01"].public_key();
    assert_ne!(new, old, "{what}: n01 rotated its key");
    let published = sim.cluster.snapshot().nodes["n01"]
        .metadata
        .annotations
        .clone()
        .unwrap_or_default();
    assert_eq!(published[annotation::KEY], new.to_base64(), "{what}");
    assert_eq!(published[annotation::KEY_ROTATED], "r1", "{what}");
    assert!(!published.contains_key(annotation::NEXT_KEY), "{what}");
    for (name, node) in &sim.nodes {
        let peers = node.device_peers().unwrap_or_default();
        assert!(
            peers.iter().all(|(k, _)| *k != old),
            "{what}: {name} still holds n01's old key: {peers:?}"
        );
    }
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap_or_else(|e| panic!("{what}: {e}"));
    // Restarted, the node keeps its new key and does not rotate again.
    sim.start("n01", true).unwrap();
    sim.advance(Duration::from_secs(10)).unwrap();
    assert_eq!(sim.nodes["n01"].public_key(), new, "{what}");
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap_or_else(|e| panic!("{what}: {e}"));
}

#[test]
fn a_rotated_key_reaches_every_peer_and_the_mesh_stays_whole() {
    for election in [Election::Lease, Election::Kilo] {
        for granularity in [Granularity::Location, Granularity::Full] {
            rotate_and_follow(election, granularity);
        }
    }
}
