//! The model's sequences run by `cargo test`: random ones from fixed seeds, the committed corpus
//! and a few written by hand for the faults the namespace tests used to try one at a time.

use super::*;
use sim::Election;

/// A byte string from `seed` (xorshift64*), `len` long.
fn random_input(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            (state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 56) as u8
        })
        .collect()
}

fn hex(input: &[u8]) -> String {
    input.iter().map(|b| format!("{b:02x}")).collect()
}

fn must_pass(input: &[u8], what: &str) -> Outcome {
    match run(input) {
        Ok(outcome) => outcome,
        Err(violation) => panic!("{what} (input {}):\n{violation}", hex(input)),
    }
}

/// The seeds of the random sequences `cargo test` runs: 48 from 0, or
/// `KILOTUN_MODEL_SEQUENCES` from `KILOTUN_MODEL_FIRST_SEED` (CI's longer run starts where the
/// clock says, so each run tries sequences no run tried before; a failure names its seed).
fn seeds() -> std::ops::Range<u64> {
    let var = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let first = var("KILOTUN_MODEL_FIRST_SEED", 0);
    first..first.saturating_add(var("KILOTUN_MODEL_SEQUENCES", 48))
}

#[test]
fn random_sequences_of_faults_keep_the_invariants_and_converge() {
    let (mut events, mut transitions) = (0, 0);
    let seeds = seeds();
    println!("seeds {seeds:?}");
    for seed in seeds {
        let input = random_input(seed, 96);
        let outcome = must_pass(&input, &format!("seed {seed}"));
        println!("seed {seed}: {outcome:?}");
        events += outcome.events;
        transitions += outcome.lease_transitions;
    }
    println!("{events} events, {transitions} lease transitions");
    assert!(events > 0, "the sequences held events");
    assert!(
        transitions > 0,
        "no sequence moved a lease: the faults are not reaching the leaders"
    );
}

#[test]
fn the_committed_corpus_replays() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/agents");
    let mut replayed = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let input = std::fs::read(&path).unwrap();
        must_pass(&input, &path.display().to_string());
        replayed += 1;
    }
    assert!(replayed > 0, "{} holds no input", dir.display());
}

/// The bytes of `events`, as [`events::decode`] reads them back.
fn encode(events: &[Event]) -> Vec<u8> {
    let mut out = Vec::new();
    for event in events {
        match *event {
            Event::Wait { secs } => out.extend([0, (secs - 1) as u8]),
            Event::Join { location } => out.extend([4, location as u8]),
            Event::Kill { node } => out.extend([6, node as u8]),
            Event::Restart {
                node,
                with_saved_state,
            } => out.extend([7, node as u8, u8::from(with_saved_state)]),
            Event::Leave { node } => out.extend([10, node as u8]),
            Event::Move { node, location } => out.extend([11, node as u8, location as u8]),
            Event::Break { node, which } => out.extend([12, node as u8, which as u8]),
            Event::Mend { node } => out.extend([13, node as u8]),
            Event::Cordon { node, on } => out.extend([14, node as u8, u8::from(on)]),
            Event::Prefer { node, on } => out.extend([15, node as u8, u8::from(on)]),
            Event::Outage { node, on } => out.extend([16, node as u8, u8::from(on)]),
            Event::OutageAll { on } => out.extend([17, u8::from(on)]),
            Event::Block { node, on } => out.extend([18, node as u8, u8::from(on)]),
            Event::Nat { node, on } => out.extend([21, node as u8, u8::from(on)]),
            Event::Endpoint { node, change } => out.extend(match change {
                EndpointChange::BlackHole { uplink, on } => {
                    vec![19, node as u8, 0, uplink as u8, u8::from(on)]
                }
                EndpointChange::AddressRemoved => vec![19, node as u8, 1],
                EndpointChange::AddressRenewed => vec![19, node as u8, 2],
                EndpointChange::NatMoved => vec![19, node as u8, 3],
            }),
            Event::Refuse { node, on } => out.extend([20, node as u8, u8::from(on)]),
            Event::Peer { which, change } => out.extend([
                22,
                which as u8,
                match change {
                    PeerChange::Valid => 0,
                    PeerChange::Malformed => 1,
                    PeerChange::Removed => 2,
                },
            ]),
        }
    }
    out
}

#[test]
fn events_encode_to_the_bytes_they_decode_from() {
    let events = vec![
        Event::Wait { secs: 7 },
        Event::Restart {
            node: 3,
            with_saved_state: true,
        },
        Event::Peer {
            which: 2,
            change: PeerChange::Malformed,
        },
        Event::OutageAll { on: true },
    ];
    assert_eq!(events::decode(&encode(&events)), events);
}

/// Each scenario the namespace tests tried one at a time, as a sequence with leaders chosen by
/// `election`: two more nodes in location l0 (n04, n05), then the fault.
fn scenario_by(election: Election, fault: &[Event]) -> Vec<u8> {
    let mut events = vec![
        Event::Join { location: 0 },
        Event::Join { location: 0 },
        Event::Wait { secs: 10 },
    ];
    events.extend_from_slice(fault);
    let mut input = vec![u8::from(election == Election::Kilo)];
    input.extend(encode(&events));
    input
}

/// [`scenario_by`] with leases.
fn scenario(fault: &[Event]) -> Vec<u8> {
    scenario_by(Election::Lease, fault)
}

#[test]
fn a_leader_killed_and_restarted_with_or_without_its_state() {
    for election in [Election::Lease, Election::Kilo] {
        for with_saved_state in [true, false] {
            let input = scenario_by(
                election,
                &[
                    Event::Kill { node: 0 },
                    Event::Wait { secs: 20 },
                    Event::Restart {
                        node: 0,
                        with_saved_state,
                    },
                ],
            );
            must_pass(&input, &format!("kill and restart, {election:?}"));
        }
    }
}

/// With Kilo's rule, a leader that dies (and stays dead) is replaced once its check-in expires:
/// its location's next node by name leads within a check-in window (60 s after its last
/// check-in, at most 30 s old) and a lease step, and the mesh forms around it.
#[test]
fn a_lost_leader_is_replaced_after_its_check_in_expires() {
    let mut sim = Sim::new(Election::Kilo).unwrap();
    for location in [0, 1, 0] {
        sim.join(&format!("l{location}")).unwrap();
    }
    sim.advance(Duration::from_secs(10)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
    assert!(
        sim.nodes["n01"].leads(),
        "Kilo's rule picks n01 in l0 first"
    );
    sim.kill("n01");
    let mut waited = 0;
    while !sim.nodes["n03"].leads() {
        assert!(
            waited < 95,
            "n03 does not lead l0 {waited} s after n01 died"
        );
        sim.advance(Duration::from_secs(1)).unwrap();
        waited += 1;
    }
    assert!(
        waited >= 30,
        "n03 took over after {waited} s, before n01's check-in could expire"
    );
    println!("l0's leader n01 lost: n03 leads after {waited} s");
    sim.advance(Duration::from_secs(5)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
}

/// The API server gone for longer than the check-in window: the agents keep the mesh they had,
/// nothing changes on any host (no peer, route or link address), and a change made once it is
/// back reaches them all.
#[test]
fn an_api_outage_longer_than_the_check_in_window_changes_nothing_on_the_hosts() {
    let mut sim = Sim::new(Election::Lease).unwrap();
    for location in [0, 1, 0, 1] {
        sim.join(&format!("l{location}")).unwrap();
    }
    sim.advance(Duration::from_secs(10)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
    let hosts = |sim: &Sim| -> Vec<String> {
        sim.nodes
            .values()
            .map(|n| {
                let engine = n.running.as_ref().unwrap().twin.engine.config();
                format!(
                    "{:?} {:?} {:?}",
                    engine.peers,
                    n.kernel.routes(),
                    n.kernel.addresses_on("kilo0")
                )
            })
            .collect()
    };
    let before = hosts(&sim);
    let names: Vec<String> = sim.nodes.keys().cloned().collect();
    for name in &names {
        sim.set_outage(name, true);
    }
    sim.advance(Duration::from_secs(80)).unwrap();
    let after = hosts(&sim);
    for (was, is) in before.iter().zip(&after) {
        assert_eq!(was, is, "a host changed during the outage");
    }
    for name in &names {
        sim.set_outage(name, false);
    }
    sim.join("l1").unwrap();
    sim.advance(Duration::from_secs(10)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
    assert_ne!(
        hosts(&sim),
        before,
        "the node that joined after the outage reached the mesh"
    );
}

#[test]
fn a_leader_dies_while_another_restarts_during_an_api_outage() {
    let input = scenario(&[
        Event::OutageAll { on: true },
        Event::Kill { node: 0 },
        Event::Restart {
            node: 1,
            with_saved_state: true,
        },
        Event::Wait { secs: 30 },
        Event::OutageAll { on: false },
        Event::Wait { secs: 5 },
    ]);
    must_pass(&input, "compound fault");
}

#[test]
fn cordoned_preferred_moved_and_malformed_nodes_and_peers() {
    let input = scenario(&[
        Event::Cordon { node: 0, on: true },
        Event::Prefer { node: 4, on: true },
        Event::Wait { secs: 8 },
        Event::Break { node: 2, which: 1 },
        Event::Peer {
            which: 0,
            change: PeerChange::Valid,
        },
        Event::Peer {
            which: 1,
            change: PeerChange::Malformed,
        },
        Event::Move {
            node: 3,
            location: 2,
        },
        Event::Wait { secs: 30 },
        Event::Leave { node: 1 },
    ]);
    must_pass(&input, "operator changes");
}

/// An IPv6-only cluster (addresses, endpoints and pods; the WireGuard subnet IPv4) through a
/// leader killed, a move, a cordon and a blocked port, by lease and by Kilo's rule, in location
/// and full granularity.
#[test]
fn an_ipv6_only_cluster_heals_as_an_ipv4_one_does() {
    for mode in [4u8, 5, 6, 7] {
        let mut input = vec![mode];
        input.extend(encode(&[
            Event::Join { location: 0 },
            Event::Join { location: 1 },
            Event::Wait { secs: 10 },
            Event::Kill { node: 0 },
            Event::Wait { secs: 20 },
            Event::Move {
                node: 3,
                location: 2,
            },
            Event::Cordon { node: 1, on: true },
            Event::Block { node: 2, on: true },
            Event::Wait { secs: 30 },
            Event::Block { node: 2, on: false },
            Event::Restart {
                node: 0,
                with_saved_state: true,
            },
        ]));
        let outcome = must_pass(&input, &format!("IPv6 cluster, mode {mode}"));
        assert_eq!(outcome.running, 5, "mode {mode}: {outcome:?}");
    }
}

/// A leader whose WireGuard port is blocked while its API connection stays up: its tunnels fall
/// silent, it marks its lease cut off, and a verifier whose standby tunnel completes a handshake
/// takes the lead; the mesh converges around the new leader, also once the port opens again.
#[test]
fn a_leader_whose_port_is_blocked_hands_over_to_a_verifier() {
    let mut sim = Sim::new(Election::Lease).unwrap();
    for location in [0, 1, 0, 0] {
        sim.join(&format!("l{location}")).unwrap();
    }
    sim.advance(Duration::from_secs(10)).unwrap();
    let holder = |sim: &Sim| sim.lease_holder("l0").unwrap();
    let blocked = holder(&sim);
    sim.set_blocked(&blocked, true);
    let mut waited = 0;
    while holder(&sim) == blocked {
        assert!(
            waited < 60,
            "{blocked} still leads l0 {waited} s after its port was blocked"
        );
        sim.advance(Duration::from_secs(1)).unwrap();
        waited += 1;
    }
    println!(
        "{blocked}'s port blocked: {} took over after {waited} s",
        holder(&sim)
    );
    sim.advance(Duration::from_secs(30)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
    assert_ne!(holder(&sim), blocked);
    sim.set_blocked(&blocked, false);
    sim.advance(CONVERGENCE_BOUND).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
}

/// In full granularity every node is its own segment, with no lease to take: five nodes in
/// three locations, one leaves for good, one restarts without its saved peers, one is cut off
/// from the API for half a minute and another's WireGuard port is blocked for as long; every
/// survivor ends up a peer of every other, each one's pods routed to it alone, and nothing
/// routes to the node that left. With both elections, which full granularity must not use.
#[test]
fn a_full_mesh_heals_after_a_departure_a_restart_an_outage_and_a_blocked_port() {
    for election in [Election::Lease, Election::Kilo] {
        let mut input = vec![2 | u8::from(election == Election::Kilo)];
        input.extend(encode(&[
            Event::Join { location: 0 },
            Event::Join { location: 1 },
            Event::Wait { secs: 10 },
            Event::Leave { node: 1 },
            Event::Restart {
                node: 2,
                with_saved_state: false,
            },
            Event::Outage { node: 3, on: true },
            Event::Block { node: 0, on: true },
            Event::Wait { secs: 30 },
            Event::Outage { node: 3, on: false },
            Event::Block { node: 0, on: false },
        ]));
        let outcome = must_pass(&input, &format!("full mesh, {election:?}"));
        assert_eq!(outcome.running, 4, "{outcome:?}");
        assert_eq!(outcome.lease_transitions, 0, "{outcome:?}");
    }
}

/// Two locations whose leaders are behind NAT reach each other through the third, whose
/// leader is not: each routes the other's pods to the relay, through a leader killed and
/// restarted, a blocked port and a move; once one comes out from behind NAT they peer again.
#[test]
fn locations_behind_nat_are_relayed_and_peer_directly_once_one_is_not() {
    for election in [Election::Lease, Election::Kilo] {
        let relayed = [
            Event::Nat { node: 1, on: true },
            Event::Nat { node: 2, on: true },
            Event::Wait { secs: 10 },
        ];
        let input = scenario_by(election, &relayed);
        must_pass(&input, &format!("relayed, {election:?}"));
        let mut faults = relayed.to_vec();
        faults.extend([
            Event::Kill { node: 0 },
            Event::Wait { secs: 20 },
            Event::Restart {
                node: 0,
                with_saved_state: true,
            },
            Event::Block { node: 1, on: true },
            Event::Wait { secs: 15 },
            Event::Block { node: 1, on: false },
            Event::Move {
                node: 4,
                location: 1,
            },
            Event::Wait { secs: 10 },
        ]);
        let input = scenario_by(election, &faults);
        must_pass(&input, &format!("relayed through faults, {election:?}"));
        let mut out = relayed.to_vec();
        out.push(Event::Nat { node: 2, on: false });
        let input = scenario_by(election, &out);
        must_pass(&input, &format!("out from behind NAT, {election:?}"));
    }
    // Seen on the devices: n02 (l1) reaches n03's pods (l2) through n01 (l0), and not directly.
    let mut sim = Sim::new(Election::Lease).unwrap();
    for location in 0..3 {
        sim.join(&format!("l{location}")).unwrap();
    }
    sim.set_nat("n02", true);
    sim.set_nat("n03", true);
    sim.advance(Duration::from_secs(10)).unwrap();
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
    let device = sim.nodes["n02"].device_peers().unwrap();
    let (n01, n03) = (sim.nodes["n01"].public_key(), sim.nodes["n03"].public_key());
    let n03_pods = sim.nodes["n03"].pod_cidr;
    assert!(device.iter().all(|(k, _)| *k != n03), "{device:?}");
    assert!(
        device
            .iter()
            .any(|(k, ips)| *k == n01 && ips.iter().any(|ip| ip.contains(&n03_pods))),
        "n02 routes n03's pods to the relay n01: {device:?}"
    );
}

/// Two locations whose leaders are both behind NAT, with no third to relay: their tunnel stays
/// silent for good. The holder that has a follower marks its lease cut off; the follower, behind
/// NAT too, reaches nobody either, so the holder withdraws the mark once the verify window has
/// passed and does not mark it again: no standby peer stays, and the lease keeps its holder.
#[test]
fn a_cut_off_mark_no_verifier_can_act_on_is_withdrawn_for_good() {
    let mut sim = Sim::new(Election::Lease).unwrap();
    for location in [0, 1, 1] {
        sim.join(&format!("l{location}")).unwrap();
    }
    for name in ["n01", "n02", "n03"] {
        sim.set_nat(name, true);
    }
    let lease =
        |sim: &Sim| sim.cluster.snapshot().leases[&control::leader::lease_name("l1")].clone();
    let (mut marked_for, mut withdrawn) = (0, false);
    for _ in 0..90 {
        sim.advance(Duration::from_secs(1)).unwrap();
        let cut_off = lease(&sim).cut_off;
        marked_for += u32::from(cut_off);
        withdrawn |= marked_for > 0 && !cut_off;
    }
    assert!(marked_for > 0, "l1's holder never marked its silent lease");
    assert!(withdrawn, "the mark stood {marked_for} s");
    let before = lease(&sim);
    sim.advance(Duration::from_secs(300)).unwrap();
    let after = lease(&sim);
    assert!(!after.cut_off, "marked again with nothing changed");
    assert_eq!(
        (after.holder, after.transitions),
        (before.holder, before.transitions)
    );
    check::converged(&sim, &BTreeSet::new(), &[]).unwrap();
}
