use super::*;
use crate::fixtures::node;

const NOW: i64 = 1_700_000_000_000;

fn members() -> Vec<Node> {
    let mut nodes = vec![
        node(
            "n1",
            "192.168.10.1:51820",
            Some("192.168.10.1/24"),
            "east",
            "10.42.1.0/24",
            "k1",
        ),
        node(
            "n2",
            "192.168.10.2:51820",
            Some("192.168.10.2/24"),
            "east",
            "10.42.2.0/24",
            "k2",
        ),
        node(
            "n3",
            "192.168.10.3:51820",
            Some("192.168.10.3/24"),
            "east",
            "10.42.3.0/24",
            "k3",
        ),
    ];
    for n in &mut nodes {
        n.lease_election = true;
    }
    nodes
}

fn lease(holder: &str, renewed_ms: i64) -> LeaseState {
    LeaseState {
        holder: Some(holder.into()),
        renewed_ms,
        duration_ms: LEASE_DURATION_MS,
        transitions: 0,
        cut_off: false,
        deposed: BTreeMap::new(),
        cut_off_predecessor: None,
        handed_over_by: None,
    }
}

fn leader(nodes: &[Node], lease: Option<&LeaseState>) -> (String, Basis) {
    let refs: Vec<&Node> = nodes.iter().collect();
    let e = elect(&refs, lease, NOW).unwrap();
    (e.leader, e.basis)
}

#[test]
fn without_a_lease_kilos_rule_decides() {
    assert_eq!(leader(&members(), None), ("n1".into(), Basis::KiloRule));
}

#[test]
fn a_valid_lease_holder_leads_and_keeps_leading_after_the_first_recovers() {
    // n2 took over; n1 is back and first by name, but the lease holds (hold-down).
    let l = lease("n2", NOW - 1_000);
    assert_eq!(leader(&members(), Some(&l)), ("n2".into(), Basis::Lease));
}

#[test]
fn an_expired_holder_is_passed_over() {
    // n1 died holding the lease: it is still ready (last-seen is recent) but stopped renewing.
    let l = lease("n1", NOW - LEASE_DURATION_MS - 1);
    assert_eq!(leader(&members(), Some(&l)), ("n2".into(), Basis::KiloRule));
    // A lone node still leads itself with an expired lease.
    let alone = &members()[..1];
    assert_eq!(leader(alone, Some(&l)).0, "n1");
}

#[test]
fn a_cordoned_node_is_no_candidate_even_holding_the_lease() {
    let mut nodes = members();
    nodes[0].cordoned = true;
    assert_eq!(leader(&nodes, None).0, "n2");
    let l = lease("n1", NOW);
    assert_eq!(leader(&nodes, Some(&l)), ("n2".into(), Basis::KiloRule));
    // Everyone cordoned: they stay candidates rather than leave the location without one.
    for n in &mut nodes {
        n.cordoned = true;
    }
    assert_eq!(leader(&nodes, None).0, "n1");
}

#[test]
fn the_leader_annotation_still_wins_over_a_lease() {
    let mut nodes = members();
    nodes[2].leader = true;
    let l = lease("n2", NOW);
    assert_eq!(leader(&nodes, Some(&l)), ("n3".into(), Basis::KiloRule));
    // Once the annotated node holds it, the lease keeps it.
    let l = lease("n3", NOW);
    assert_eq!(leader(&nodes, Some(&l)), ("n3".into(), Basis::Lease));
}

#[test]
fn successors_follow_kilos_rule_among_the_others() {
    let nodes = members();
    let refs: Vec<&Node> = nodes.iter().collect();
    assert_eq!(successor(&refs, "n1").as_deref(), Some("n2"));
    assert_eq!(successor(&refs, "n2").as_deref(), Some("n1"));
    assert_eq!(successor(&refs[..1], "n1"), None);
}

#[test]
fn only_locations_that_all_take_part_use_leases() {
    let mut nodes = members();
    let mut west = node(
        "w1",
        "192.168.20.1:51820",
        Some("192.168.20.1/24"),
        "west",
        "10.42.9.0/24",
        "k9",
    );
    west.lease_election = false; // Kilo's own agent
    nodes.push(west);
    let leases = BTreeMap::from([
        (lease_name("east"), lease("n3", NOW)),
        (lease_name("west"), lease("w1", NOW)),
    ]);
    // West's Kilo agent follows Kilo's rule for east too: east by lease would disagree with it.
    assert!(lease_leaders(&nodes, &leases, 1, NOW).is_empty());
    assert_eq!(
        lease_agreement(&nodes),
        Agreement::KiloRule {
            holdout: "w1".into(),
            count: 1
        }
    );
    // Meanwhile each location's Kilo-rule leader keeps the lease in its name.
    assert_eq!(
        kilo_rule_leaders(&nodes),
        BTreeMap::from([("east".into(), "n1".into()), ("west".into(), "w1".into())])
    );
    nodes[3].lease_election = true; // w1 migrated
    let leaders = lease_leaders(&nodes, &leases, 1, NOW);
    assert_eq!(leaders.keys().collect::<Vec<_>>(), ["east", "west"]);
    assert_eq!(leaders["east"][0].leader, "n3");
    assert_eq!(lease_agreement(&nodes), Agreement::Leases);
    // One Kilo agent anywhere takes the whole cluster back to Kilo's rule.
    nodes[1].lease_election = false;
    assert!(lease_leaders(&nodes, &leases, 1, NOW).is_empty());
}

#[test]
fn lease_names_are_dns_names_and_distinct() {
    assert_eq!(lease_name("east"), "kilotun-leader-east");
    let a = lease_name("Eu West/1");
    let b = lease_name("eu-west-1");
    assert_ne!(a, b);
    assert!(
        a.len() <= 63
            && a.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
        "{a}"
    );
    assert_ne!(lease_name(""), lease_name("-"));
}

#[test]
fn a_leader_is_cut_off_only_when_every_tunnel_sends_and_hears_nothing() {
    let (a, b) = (crate::Key::padded("a"), crate::Key::padded("b"));
    let sample = |at_ms, pa: (u64, u64), pb: (u64, u64)| TrafficSample {
        at_ms,
        peers: BTreeMap::from([(a, pa), (b, pb)]),
    };
    let start = sample(0, (100, 100), (100, 100));
    let silent = sample(CUT_OFF_WINDOW_MS, (100, 900), (100, 700));
    assert!(cut_off(&start, &silent, &[a, b]));
    // One remote location down is not this leader's fault.
    let one = sample(CUT_OFF_WINDOW_MS, (100, 900), (300, 700));
    assert!(!cut_off(&start, &one, &[a, b]));
    // Too short a window, or nothing sent (idle), or no tunnel at all: no judgement.
    assert!(!cut_off(
        &start,
        &sample(CUT_OFF_WINDOW_MS - 1, (100, 900), (100, 700)),
        &[a, b]
    ));
    assert!(!cut_off(
        &start,
        &sample(CUT_OFF_WINDOW_MS, (100, 100), (100, 100)),
        &[a, b]
    ));
    assert!(!cut_off(&start, &silent, &[]));
    // Once marked, only something received clears it: idle silence does not.
    let idle = sample(CUT_OFF_WINDOW_MS + 2_000, (100, 900), (100, 700));
    assert!(!hears_any(&silent, &idle, &[a, b]));
    let heard = sample(CUT_OFF_WINDOW_MS + 2_000, (100, 900), (148, 700));
    assert!(hears_any(&silent, &heard, &[a, b]));
    assert!(!hears_any(&silent, &heard, &[a]), "b is not watched");
}

#[test]
fn a_lease_is_replaced_only_over_the_expected_holder() {
    let mine = lease("n2", NOW);
    let held_by = |holder: Option<&str>| LeaseState {
        holder: holder.map(str::to_string),
        ..LeaseState::default()
    };
    let expecting = |holder: Option<&str>| Expectation {
        holder: holder.map(str::to_string),
        cut_off: false,
    };
    assert!(mine.may_replace(&held_by(None), &expecting(None)));
    assert!(mine.may_replace(&held_by(Some("n1")), &expecting(Some("n1"))));
    assert!(
        mine.may_replace(&held_by(Some("n2")), &expecting(Some("n1"))),
        "already ours"
    );
    assert!(
        !mine.may_replace(&held_by(Some("n3")), &expecting(Some("n1"))),
        "someone else got there first"
    );
    // A verifier's takeover holds only while the holder is still marked cut off: a holder that
    // heard again and cleared the mark keeps its lead.
    let takeover = Expectation {
        holder: Some("n1".into()),
        cut_off: true,
    };
    let marked = LeaseState {
        cut_off: true,
        ..held_by(Some("n1"))
    };
    assert!(mine.may_replace(&marked, &takeover));
    assert!(!mine.may_replace(&held_by(Some("n1")), &takeover));
}

#[test]
fn a_cut_off_holder_keeps_the_lead_and_names_its_verifiers_in_order_of_succession() {
    let mut nodes = members();
    let mut l = lease("n2", NOW);
    let refs: Vec<&Node> = nodes.iter().collect();
    assert!(elect(&refs, Some(&l), NOW).unwrap().verifiers.is_empty());
    l.cut_off = true;
    let e = elect(&refs, Some(&l), NOW).unwrap();
    assert_eq!((e.leader.as_str(), e.basis), ("n2", Basis::Lease));
    assert_eq!(e.verifiers, ["n1", "n3"]);
    // An annotated candidate comes first (the annotated holder keeps the lead); a cordoned
    // one verifies nothing.
    nodes[1].leader = true;
    nodes[2].leader = true;
    let refs: Vec<&Node> = nodes.iter().collect();
    assert_eq!(elect(&refs, Some(&l), NOW).unwrap().verifiers, ["n3", "n1"]);
    nodes[0].cordoned = true;
    let refs: Vec<&Node> = nodes.iter().collect();
    assert_eq!(elect(&refs, Some(&l), NOW).unwrap().verifiers, ["n3"]);
}

#[test]
fn a_deposed_leader_is_passed_over_until_it_checks_in_again() {
    let mut nodes = members();
    for n in &mut nodes {
        n.last_seen = NOW / 1000 - 5;
    }
    // n1 led and died; n2 took its expired lease and deposed it.
    let first = lease("n1", NOW - 10_000);
    let refs: Vec<&Node> = nodes.iter().collect();
    let mut second = lease("n2", NOW - 3_000);
    second.deposed = first.deposed_after(&refs, "n2", true);
    assert_eq!(
        second.deposed,
        BTreeMap::from([("n1".into(), NOW / 1000 - 5)])
    );
    assert_eq!(leader(&nodes, Some(&second)), ("n2".into(), Basis::Lease));
    // n2 dies too: its lease expires while n1 still looks ready (last-seen 5 s old).
    let expired = LeaseState {
        renewed_ms: NOW - 7_000,
        ..second
    };
    assert_eq!(
        leader(&nodes, Some(&expired)),
        ("n3".into(), Basis::KiloRule),
        "neither dead leader"
    );
    // n3 takes the lease and keeps both records.
    let mut third = lease("n3", NOW);
    third.deposed = expired.deposed_after(&refs, "n3", true);
    assert_eq!(third.deposed.keys().collect::<Vec<_>>(), ["n1", "n2"]);
    // n1 comes back (a fresh check-in): it is a candidate again, and drops off the record.
    nodes[0].last_seen = NOW / 1000;
    let refs: Vec<&Node> = nodes.iter().collect();
    assert!(!third.keeps_out(&nodes[0], NOW));
    assert_eq!(
        third
            .deposed_after(&refs, "n3", false)
            .keys()
            .collect::<Vec<_>>(),
        ["n2"]
    );
    let gone = LeaseState {
        renewed_ms: NOW - 7_000,
        ..third
    };
    assert_eq!(leader(&nodes, Some(&gone)), ("n1".into(), Basis::KiloRule));
}

#[test]
fn an_annotated_holder_found_cut_off_is_not_preferred_while_its_replacement_holds() {
    let mut nodes = members();
    nodes[0].leader = true; // n1: the operator's choice, found cut off and replaced by n2
    let mut replaced = lease("n2", NOW - 1_000);
    replaced.cut_off_predecessor = Some("n1".into());
    assert!(replaced.keeps_out(&nodes[0], NOW), "checked in or not");
    assert_eq!(leader(&nodes, Some(&replaced)), ("n2".into(), Basis::Lease));
    // A restarted n1 does not bring back the peers it had as a leader.
    let leases = BTreeMap::from([(lease_name("east"), replaced.clone())]);
    assert_eq!(led_by_another(&nodes[0], &leases, NOW), Some("n2"));
    // Once the lease is in other hands (n2 expired), n1 is preferred again.
    let expired = LeaseState {
        renewed_ms: NOW - 7_000,
        ..replaced
    };
    let refs: Vec<&Node> = nodes.iter().collect();
    let mut third = lease("n3", NOW);
    third.deposed = expired.deposed_after(&refs, "n3", true);
    assert_eq!(third.cut_off_predecessor, None);
    assert_eq!(leader(&nodes, Some(&third)), ("n1".into(), Basis::KiloRule));
    // Of two nodes, n1 replaced a cut-off n2 and died: n2 is the one candidate left, not kept
    // out by a lease nobody renews (else Kilo's rule, among everyone, picks the dead n1).
    let pair: Vec<Node> = members()[..2].to_vec();
    let mut dead = lease("n1", NOW - 7_000);
    dead.cut_off_predecessor = Some("n2".into());
    assert!(!dead.keeps_out(&pair[1], NOW));
    assert_eq!(leader(&pair, Some(&dead)), ("n2".into(), Basis::KiloRule));
    // Without the record, the annotation wins over the holder as before.
    let plain = lease("n2", NOW - 1_000);
    assert_eq!(leader(&nodes, Some(&plain)), ("n1".into(), Basis::KiloRule));
}

#[test]
fn when_every_candidate_is_deposed_kilos_rule_still_picks_one() {
    let nodes = members();
    let mut l = lease("n1", NOW - 10_000);
    l.deposed = nodes
        .iter()
        .map(|n| (n.name.clone(), n.last_seen))
        .collect();
    let (chosen, basis) = leader(&nodes, Some(&l));
    assert_eq!(basis, Basis::KiloRule);
    // The one chosen never records itself as deposed when it takes the lease.
    let refs: Vec<&Node> = nodes.iter().collect();
    assert!(!l.deposed_after(&refs, &chosen, true).contains_key(&chosen));
}

#[test]
fn a_node_without_an_internal_ip_never_leads_its_location_by_kilos_rule() {
    let mut nodes = members();
    nodes[0].internal_ip = None; // n1: a segment of its own in the topology
    assert_eq!(kilo_rule_leaders(&nodes)["east"], "n2");
}

/// The leader every kind of agent among the ready `nodes` names for each location: Kilo's
/// agents by Kilo's rule, kilotun's by [`lease_leaders`] or, without agreement, by Kilo's rule.
/// Panics when two agents disagree about a location.
fn agreed_leaders(
    nodes: &[Node],
    leases: &BTreeMap<String, LeaseState>,
    now: i64,
    context: &str,
) -> BTreeMap<String, String> {
    let kilo = kilo_rule_leaders(nodes);
    let by_lease = lease_leaders(nodes, leases, 1, now);
    let kilotun: BTreeMap<String, String> = kilo
        .iter()
        .map(|(loc, leader)| {
            let chosen = by_lease.get(loc).map_or(leader, |e| &e[0].leader);
            (loc.clone(), chosen.clone())
        })
        .collect();
    let kilo_agents = nodes.iter().any(|n| !n.lease_election);
    let kilotun_agents = nodes.iter().any(|n| n.lease_election);
    if kilo_agents && kilotun_agents {
        assert_eq!(
            kilotun, kilo,
            "{context}: Kilo's and kilotun's agents disagree"
        );
    }
    if kilotun_agents {
        kilotun
    } else {
        kilo
    }
}

/// One lease step of every kilotun node, as `tend_lease` takes it: an elected node that takes
/// part in leases renews (or takes) its location's lease, or is handed it by the holder; a
/// lease whose elected node takes no part (Kilo's agent) lapses.
fn tend(
    nodes: &[Node],
    leaders: &BTreeMap<String, String>,
    leases: &mut BTreeMap<String, LeaseState>,
    now: i64,
) {
    for (loc, leader) in leaders {
        let takes_part = nodes.iter().any(|n| n.name == *leader && n.lease_election);
        if takes_part {
            leases.insert(lease_name(loc), lease(leader, now));
        }
    }
}

/// Every order in which a cluster of Kilo agents can move to kilotun with leases, one node at a
/// time, checked against a model of both agents, with the leader of the migrating node's
/// location restarting after each step (its kg's clean-up makes it unready for a moment, as
/// Kilo's does): at every moment every agent names the same leader for every location, and
/// while a Kilo agent remains the leaders are Kilo's rule's.
#[test]
fn every_migration_order_keeps_every_agent_agreeing_through_leader_restarts() {
    let location = |i: usize| ["east", "west", "south"][i / 2];
    // n1 (east) has a public endpoint: Kilo's rule prefers it over n0, the first by name.
    let nodes: Vec<Node> = (0..6)
        .map(|i| {
            let ep = if i == 1 {
                "8.8.8.8:51820".to_string()
            } else {
                format!("192.168.{}.{i}:51820", 10 + i / 2)
            };
            node(
                &format!("n{i}"),
                &ep,
                Some(&format!("192.168.{}.{i}/24", 10 + i / 2)),
                location(i),
                &format!("10.42.{i}.0/24"),
                &format!("k{i}"),
            )
        })
        .collect();
    let expected = kilo_rule_leaders(&nodes);
    assert_eq!(expected["east"], "n1", "the public node");

    fn permutations(prefix: &mut Vec<usize>, n: usize, out: &mut Vec<Vec<usize>>) {
        if prefix.len() == n {
            out.push(prefix.clone());
            return;
        }
        for i in 0..n {
            if !prefix.contains(&i) {
                prefix.push(i);
                permutations(prefix, n, out);
                prefix.pop();
            }
        }
    }
    let mut orders = Vec::new();
    permutations(&mut Vec::new(), 6, &mut orders);
    assert_eq!(orders.len(), 720);

    for order in orders {
        let mut cluster = nodes.clone();
        let mut leases: BTreeMap<String, LeaseState> = BTreeMap::new();
        let mut now = NOW;
        for (step, &migrating) in order.iter().enumerate() {
            let context = format!("order {order:?}, step {step}");
            cluster[migrating].lease_election = true;
            now += LEASE_RENEW_MS;
            let leaders = agreed_leaders(&cluster, &leases, now, &context);
            tend(&cluster, &leaders, &mut leases, now);
            // The leader of the migrating node's location restarts: gone for a lease step,
            // then back.
            let restarting = leaders[location(migrating)].clone();
            let rest: Vec<Node> = cluster
                .iter()
                .filter(|n| n.name != restarting)
                .cloned()
                .collect();
            now += LEASE_RENEW_MS;
            let during = agreed_leaders(&rest, &leases, now, &format!("{context}, restart"));
            tend(&rest, &during, &mut leases, now);
            now += LEASE_RENEW_MS;
            let after = agreed_leaders(&cluster, &leases, now, &format!("{context}, return"));
            tend(&cluster, &after, &mut leases, now);
            if cluster.iter().any(|n| !n.lease_election) {
                assert_eq!(after, expected, "{context}: not Kilo's rule's leaders");
            }
        }
        assert_eq!(lease_agreement(&cluster), Agreement::Leases);
    }
}

#[test]
fn a_returning_node_knows_another_leads_its_location_only_by_a_valid_foreign_lease() {
    let nodes = members();
    let n1 = &nodes[0];
    let leases = |l: LeaseState| BTreeMap::from([(lease_name("east"), l)]);
    // n3 took the lease while n1 was away: n1's saved leader peers are stale.
    assert_eq!(
        led_by_another(n1, &leases(lease("n3", NOW - 1_000)), NOW),
        Some("n3")
    );
    // Its own lease, an expired one, none at all, or another location's: nothing says so.
    assert_eq!(
        led_by_another(n1, &leases(lease("n1", NOW - 1_000)), NOW),
        None
    );
    assert_eq!(
        led_by_another(n1, &leases(lease("n3", NOW - LEASE_DURATION_MS)), NOW),
        None
    );
    assert_eq!(led_by_another(n1, &BTreeMap::new(), NOW), None);
    let west = BTreeMap::from([(lease_name("west"), lease("n3", NOW))]);
    assert_eq!(led_by_another(n1, &west, NOW), None);
    // Annotated to lead, n1 may take the lead back at once.
    let mut annotated = n1.clone();
    annotated.leader = true;
    assert_eq!(
        led_by_another(&annotated, &leases(lease("n3", NOW - 1_000)), NOW),
        None
    );
}
