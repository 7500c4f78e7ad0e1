//! Endpoint candidates in the model: every node has two uplinks and publishes both addresses;
//! a black-holed candidate is left for the next within the bound, a working one is kept when
//! the first comes back, a removed address is dropped at once, and a moved NAT mapping heals by
//! itself.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::time::Duration;

use super::check;
use super::check_endpoints::tunnels_carry;
use super::sim::{Election, Sim};
use super::ENDPOINT_BOUND;

/// Three nodes, one per location, converged.
fn three_locations() -> Sim {
    let mut sim = Sim::new(Election::Lease).unwrap();
    for location in 0..3 {
        sim.join(&format!("l{location}")).unwrap();
    }
    sim.advance(Duration::from_secs(10)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
    sim
}

/// The endpoint `from`'s device sends to for `to`.
fn endpoint_of(sim: &Sim, from: &str, to: &str) -> Option<SocketAddr> {
    let key = sim.nodes[to].public_key();
    let config = sim.nodes[from].running.as_ref()?.twin.engine.config();
    config
        .peers
        .into_iter()
        .find(|p| p.public_key.as_bytes() == &key.0)?
        .endpoint
}

/// `to`'s address on uplink `uplink`.
fn uplink_ip(sim: &Sim, to: &str, uplink: usize) -> std::net::IpAddr {
    sim.nodes[to].uplink_address(uplink).unwrap().addr()
}

#[test]
fn a_black_holed_candidate_is_left_for_the_next_and_the_next_is_kept() {
    let mut sim = three_locations();
    let names: Vec<String> = sim.nodes.keys().cloned().collect();
    let target = names[2].clone();
    for other in &names[..2] {
        let endpoint = endpoint_of(&sim, other, &target).unwrap();
        assert_eq!(
            endpoint.ip(),
            uplink_ip(&sim, &target, 0),
            "{other} starts on eth0"
        );
    }
    sim.set_black_holed(&target, 0, true);
    sim.advance(Duration::from_secs(1)).unwrap();
    let down = tunnels_carry(&sim);
    assert!(down.is_err(), "a black-holed eth0 is seen as down at once");
    println!("{}", down.unwrap_err());
    sim.advance(ENDPOINT_BOUND).unwrap();
    tunnels_carry(&sim).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
    for other in &names[..2] {
        let endpoint = endpoint_of(&sim, other, &target).unwrap();
        assert_eq!(
            endpoint.ip(),
            uplink_ip(&sim, &target, 1),
            "{other} moved to eth1"
        );
    }
    // eth0 comes back: the candidate that works is kept.
    sim.set_black_holed(&target, 0, false);
    sim.advance(ENDPOINT_BOUND).unwrap();
    for other in &names[..2] {
        let endpoint = endpoint_of(&sim, other, &target).unwrap();
        assert_eq!(
            endpoint.ip(),
            uplink_ip(&sim, &target, 1),
            "{other} stays on eth1"
        );
    }
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
}

#[test]
fn a_removed_address_is_dropped_at_once_and_a_renewed_one_is_published() {
    let mut sim = three_locations();
    let names: Vec<String> = sim.nodes.keys().cloned().collect();
    let target = names[2].clone();
    sim.set_black_holed(&target, 0, true);
    sim.advance(ENDPOINT_BOUND).unwrap();
    let on_eth1 = endpoint_of(&sim, &names[0], &target).unwrap();
    assert_eq!(on_eth1.ip(), uplink_ip(&sim, &target, 1));
    // eth1 loses its address and eth0 comes back: its peers go back to eth0 with the next
    // publication, not after a window.
    sim.set_black_holed(&target, 0, false);
    sim.readdress(&target, true);
    sim.advance(Duration::from_secs(2)).unwrap();
    let back = endpoint_of(&sim, &names[0], &target).unwrap();
    assert_eq!(back.ip(), uplink_ip(&sim, &target, 0));
    tunnels_carry(&sim).unwrap();
    // A new address on eth1 is published, and carries the tunnel when eth0 fails again:
    // its peers move to it, or it starts the handshakes there itself (they roam to it).
    sim.readdress(&target, false);
    sim.advance(Duration::from_secs(2)).unwrap();
    let renewed = SocketAddr::new(uplink_ip(&sim, &target, 1), on_eth1.port());
    let agent = &sim.nodes[&names[0]].running.as_ref().unwrap().twin.agent;
    let statuses = agent.endpoint_statuses();
    let probing = statuses.iter().find(|s| s.node == target).unwrap();
    assert!(
        probing.usable.contains(&renewed),
        "{renewed} is published and tried: {probing:?}"
    );
    sim.set_black_holed(&target, 0, true);
    sim.advance(ENDPOINT_BOUND).unwrap();
    tunnels_carry(&sim).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
}

#[test]
fn a_moved_nat_mapping_heals_within_its_keepalive() {
    let mut sim = three_locations();
    let target = sim.nth(1).unwrap();
    sim.set_nat(&target, true);
    sim.advance(Duration::from_secs(60)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
    sim.move_nat_mapping(&target);
    sim.advance(Duration::from_secs(1)).unwrap();
    assert!(
        tunnels_carry(&sim).is_err(),
        "its peers' packets go to the old mapping"
    );
    sim.advance(Duration::from_secs(10)).unwrap();
    tunnels_carry(&sim).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
}
