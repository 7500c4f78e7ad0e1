//! Post-quantum preshared keys in the reference model: every agent runs `--post-quantum`
//! with a 30 s `--psk-rotation-period`, its exchanges carried through the model's tunnels
//! ([`super::sim`]), its engine counting the handshakes refused under differing keys. After
//! each fault, every tunnel holds one key at both ends again ([`super::check_pq`]) and the
//! rest of the model's checks hold.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use control::node::annotation;
use control::node::Granularity;

use super::check;
use super::settings::Election;
use super::sim::Sim;

/// Every preshared key on every running device, by node and peer.
fn keys(sim: &Sim) -> BTreeMap<(String, control::Key), Option<dataplane::SecretKey>> {
    sim.nodes
        .iter()
        .filter_map(|(name, node)| Some((name, node.running.as_ref()?.twin.engine.config())))
        .flat_map(|(name, config)| {
            config.peers.into_iter().map(move |p| {
                (
                    (name.clone(), control::Key(*p.public_key.as_bytes())),
                    p.preshared_key,
                )
            })
        })
        .collect()
}

/// Advances `secs` and checks that the mesh converged with every tunnel keyed.
fn settle(sim: &mut Sim, secs: u64, after: &str) {
    sim.advance(Duration::from_secs(secs)).unwrap();
    check::converged(sim, &BTreeSet::new(), &[])
        .unwrap_or_else(|e| panic!("{:?}, after {after}: {e}", sim.granularity));
}

fn faults_heal(election: Election, granularity: Granularity) {
    let mut sim = Sim::meshed(election, granularity).unwrap();
    sim.post_quantum = true;
    for location in [0, 0, 1, 2] {
        sim.join(&format!("l{location}")).unwrap();
    }
    settle(&mut sim, 20, "joining");
    let first = keys(&sim);
    assert!(first.values().all(Option::is_some), "{granularity:?}");
    // A period later every key has changed, and the links stayed keyed.
    settle(&mut sim, 40, "a period");
    let second = keys(&sim);
    assert!(
        first
            .iter()
            .all(|(link, key)| second.get(link) != Some(key)),
        "{granularity:?}: a key did not change in a period"
    );
    // Restarts: with the saved state, without the device's saved peers, without the saved
    // keys (a new ML-KEM key), and with a saved key its peers do not hold.
    sim.start("n01", true).unwrap();
    settle(&mut sim, 20, "n01 restarted with its saved state");
    sim.start("n01", false).unwrap();
    settle(&mut sim, 20, "n01 restarted without its saved peers");
    let psk_file = crate::agent::pq::saved_path(&sim.nodes["n03"].key_file());
    std::fs::remove_file(&psk_file).unwrap();
    sim.start("n03", true).unwrap();
    settle(&mut sim, 20, "n03 restarted without its saved keys");
    sim.kill("n03");
    let saved = std::fs::read_to_string(&psk_file).unwrap();
    let altered = alter_every_key(&saved);
    std::fs::write(&psk_file, altered).unwrap();
    sim.start("n03", true).unwrap();
    settle(&mut sim, 30, "n03 restarted with altered saved keys");
    // An API outage longer than a period, and a blocked port.
    sim.set_outage("n04", true);
    sim.advance(Duration::from_secs(45)).unwrap();
    check::always(&sim).unwrap();
    sim.set_outage("n04", false);
    settle(&mut sim, 20, "n04's API outage");
    sim.set_blocked("n03", true);
    sim.advance(Duration::from_secs(20)).unwrap();
    sim.set_blocked("n03", false);
    settle(&mut sim, 130, "n03's port blocked for 20 s");
    // A node's key rotated: its links are keyed under the new key.
    sim.annotate("n03", annotation::ROTATE_KEY, Some("r1"));
    settle(&mut sim, 20, "n03's key rotated");
}

/// `saved` (a `<key-file>.psk`) with every key replaced by another.
fn alter_every_key(saved: &str) -> String {
    let mut value: serde_json::Value = serde_json::from_str(saved).unwrap();
    let other = control::Key([0x5a; 32]).to_base64();
    for (_, link) in value["links"].as_object_mut().unwrap() {
        link[0] = serde_json::Value::String(other.clone());
    }
    value.to_string()
}

#[test]
fn post_quantum_links_stay_keyed_through_restarts_outages_a_blocked_port_and_a_rotation() {
    for election in [Election::Lease, Election::Kilo] {
        for granularity in [Granularity::Location, Granularity::Full] {
            faults_heal(election, granularity);
        }
    }
}
