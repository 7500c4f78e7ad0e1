//! The checks of the model themselves: a mesh that converged passes them, and damage done to
//! it behind the agents' backs is caught by the check that names it.

use std::collections::BTreeSet;
use std::time::Duration;

use super::check;
use super::sim::{Election, Sim};

/// Nodes in l0, l1 and l0 by lease, 10 s after they joined: converged, every invariant held.
fn three_nodes_converged() -> Sim {
    let mut sim = Sim::new(Election::Lease).unwrap();
    for location in [0, 1, 0] {
        sim.join(&format!("l{location}")).unwrap();
    }
    sim.advance(Duration::from_secs(10)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
    check::always(&sim).unwrap();
    sim
}

/// The checks themselves: a mesh that converged passes, and each kind of damage done to it
/// behind the agents' backs is caught.
#[test]
fn the_checks_catch_a_second_leader_an_overlap_and_a_missing_route() {
    use dataplane::PeerConfig;
    let converged = three_nodes_converged;
    let leader_of = |sim: &Sim, location: &str| sim.lease_holder(location).unwrap();

    // A second peer claiming an address the first one carries.
    let sim = converged();
    let leader = leader_of(&sim, "l0");
    let engine = &sim.nodes[&leader].running.as_ref().unwrap().twin.engine;
    let mut config = engine.config();
    let mut extra = PeerConfig::new(dataplane::SecretKey::from_bytes([99; 32]).public_key());
    extra.add_allowed_ip(sim.nodes["n02"].pod_cidr);
    config.peers.push(extra);
    crate::agent::shells::Device::apply(engine, &config).unwrap();
    let error = check::always(&sim).unwrap_err();
    assert!(error.contains("routes 10.42.2.0/24 to peer"), "{error}");

    // A follower whose route to the other location's pods is gone.
    let sim = converged();
    let follower = ["n01", "n03"]
        .into_iter()
        .find(|n| *n != leader_of(&sim, "l0"))
        .unwrap();
    let kernel = &sim.nodes[follower].kernel;
    let mut routes = kernel.routes();
    routes.routes.retain(|r| r.dst != sim.nodes["n02"].pod_cidr);
    kernel.set_routes(routes);
    let error = check::converged(&sim, &BTreeSet::new(), &[]).unwrap_err();
    assert!(
        error.contains(&format!("follower {follower} of l0 routes n02")),
        "{error}"
    );

    // A follower that brought its WireGuard link up with an address, as a leader does.
    let sim = converged();
    let follower = ["n01", "n03"]
        .into_iter()
        .find(|n| *n != leader_of(&sim, "l0"))
        .unwrap();
    let kernel = sim.nodes[follower].kernel.clone();
    futures::executor::block_on(async {
        use crate::agent::shells::Kernel as _;
        kernel
            .set_address(3, Some("10.4.0.9/16".parse().unwrap()))
            .await
            .unwrap();
        kernel.set_up(3, true).await.unwrap();
    });
    let error = check::converged(&sim, &BTreeSet::new(), &[]).unwrap_err();
    assert!(error.contains("location l0 has 2 leaders"), "{error}");
}

/// Each invariant of [`check::always`] can fail: a converged mesh passes them all, and each
/// kind of damage done behind the agents' backs is caught by the one that names it.
#[test]
fn every_invariant_catches_its_own_damage() {
    use control::routes::{Route, MAIN_TABLE};
    use dataplane::PeerConfig;
    let converged = three_nodes_converged;
    let route = |dst: &str, link| Route {
        table: MAIN_TABLE,
        dst: dst.parse().unwrap(),
        gateway: None,
        link,
        src: None,
        onlink: false,
    };
    let leader = |sim: &Sim| sim.lease_holder("l0").unwrap();
    assert_eq!(check::checks().len(), 7);

    // Its own key as a peer.
    let sim = converged();
    let name = leader(&sim);
    let engine = &sim.nodes[&name].running.as_ref().unwrap().twin.engine;
    let mut config = engine.config();
    config
        .peers
        .push(PeerConfig::new(sim.nodes[&name].key.public_key()));
    crate::agent::shells::Device::apply(engine, &config).unwrap();
    let error = check::always(&sim).unwrap_err();
    assert!(error.contains("holds its own key"), "{error}");

    // Its own pods routed into the tunnel.
    let sim = converged();
    let node = &sim.nodes["n01"];
    let mut routes = node.kernel.routes();
    routes.routes.insert(route(&node.pod_cidr.to_string(), 3));
    node.kernel.set_routes(routes);
    let error = check::always(&sim).unwrap_err();
    assert!(error.contains("its own pod CIDR"), "{error}");

    // A peer's endpoint routed into the tunnel: harmless while the tunnel guard's rules send
    // the marked packets to the underlay table, caught once they are gone.
    let sim = converged();
    let name = leader(&sim);
    let node = &sim.nodes[&name];
    let endpoint = node.running.as_ref().unwrap().twin.engine.config().peers[0]
        .endpoint
        .unwrap();
    let mut routes = node.kernel.routes();
    let host = ipnet::IpNet::from(endpoint.ip());
    routes.routes.insert(route(&host.to_string(), 3));
    node.kernel.set_routes(routes.clone());
    let error = check::always(&sim).unwrap_err();
    assert!(
        !error.contains("into its own tunnel"),
        "the guard keeps it out: {error}"
    );
    assert!(routes.rules.iter().any(|r| r.guard.is_some()));
    routes.rules.retain(|r| r.guard.is_none());
    node.kernel.set_routes(routes);
    let error = check::always(&sim).unwrap_err();
    assert!(error.contains("into its own tunnel"), "{error}");

    // A route of kg's its record does not hold.
    let sim = converged();
    let node = &sim.nodes["n02"];
    let mut routes = node.kernel.routes();
    routes.routes.insert(route("203.0.113.0/24", 2));
    node.kernel.set_routes(routes);
    let error = check::always(&sim).unwrap_err();
    assert!(error.contains("its saved record does not"), "{error}");

    // A device written by a step that ran no pass, as the model's driver records it
    // (`Sim::wake` compares the device's writes before and after each step).
    let mut sim = converged();
    let running = sim.nodes.get_mut("n02").unwrap().running.as_mut().unwrap();
    running
        .writes_outside_pass
        .push("the PostQuantum timer".into());
    let error = check::always(&sim).unwrap_err();
    assert!(error.contains("though no pass ran"), "{error}");
}
