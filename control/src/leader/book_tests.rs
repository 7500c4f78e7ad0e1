use super::*;
use crate::fixtures::node;
use crate::leader::lease_name;

const T0: i64 = 1_700_000_000_000;

/// Three ready nodes of `east` and one of `west`, all with lease election.
fn cluster() -> Vec<Node> {
    let mut nodes = vec![
        node(
            "e1",
            "192.168.10.1:51820",
            Some("192.168.10.1/24"),
            "east",
            "10.42.1.0/24",
            "k1",
        ),
        node(
            "e2",
            "192.168.10.2:51820",
            Some("192.168.10.2/24"),
            "east",
            "10.42.2.0/24",
            "k2",
        ),
        node(
            "e3",
            "192.168.10.3:51820",
            Some("192.168.10.3/24"),
            "east",
            "10.42.3.0/24",
            "k3",
        ),
        node(
            "w1",
            "192.168.20.1:51820",
            Some("192.168.20.1/24"),
            "west",
            "10.42.4.0/24",
            "k4",
        ),
    ];
    for n in &mut nodes {
        n.lease_election = true;
    }
    nodes
}

fn quiet() -> TunnelReadings {
    TunnelReadings {
        traffic: TunnelTraffic::NotLeading,
        standby_reached: Vec::new(),
    }
}

/// `e1` leading, its tunnel to `w1` having received `rx` and sent `tx` bytes.
fn leading(rx: u64, tx: u64) -> TunnelReadings {
    let west = Key::padded("k4");
    TunnelReadings {
        traffic: TunnelTraffic::Read {
            watched: vec![west],
            peers: BTreeMap::from([(west, (rx, tx))]),
        },
        standby_reached: Vec::new(),
    }
}

/// The backend after `write` succeeded: its lease replaced.
fn written(leases: &mut BTreeMap<String, LeaseState>, write: &LeaseWrite) {
    assert!(
        write.next.may_replace(
            &leases.get(&write.name).cloned().unwrap_or_default(),
            &write.expected
        ),
        "the backend refuses {write:?}"
    );
    leases.insert(write.name.clone(), write.next.clone());
}

/// `book` of `hostname` takes in `leases`, elects and tends at `now`.
fn step(
    book: &mut LeaseBook,
    hostname: &str,
    nodes: &[Node],
    leases: &BTreeMap<String, LeaseState>,
    tunnels: &TunnelReadings,
    now: i64,
) -> Option<LeaseWrite> {
    book.ingest(leases, now);
    book.elect(nodes, 1, now);
    book.tend(hostname, nodes, tunnels, now)
}

#[test]
fn the_elected_node_takes_a_free_lease_and_then_renews_it_quietly() {
    let nodes = cluster();
    let mut leases = BTreeMap::new();
    let mut book = LeaseBook::default();
    let take = step(&mut book, "e1", &nodes, &leases, &quiet(), T0).expect("a write");
    assert_eq!(take.name, "kilotun-leader-east");
    assert_eq!(take.next.holder.as_deref(), Some("e1"));
    assert_eq!(take.next.transitions, 1);
    assert_eq!(take.expected.holder, None);
    assert_eq!(take.reason(), Some(Reason::LeaderElected));
    written(&mut leases, &take);

    let renew = step(&mut book, "e1", &nodes, &leases, &quiet(), T0 + 2_000).expect("a renewal");
    assert_eq!(renew.next.holder.as_deref(), Some("e1"));
    assert_eq!(renew.next.renewed_ms, T0 + 2_000);
    assert_eq!(renew.next.transitions, 1, "a renewal is no transition");
    assert_eq!(renew.expected.holder.as_deref(), Some("e1"));
    assert_eq!(renew.why, None, "a renewal is not worth a line");
}

#[test]
fn a_node_that_neither_leads_nor_holds_writes_nothing() {
    let nodes = cluster();
    let mut book = LeaseBook::default();
    assert_eq!(
        step(&mut book, "e2", &nodes, &BTreeMap::new(), &quiet(), T0),
        None
    );
    assert_eq!(
        book.tend("nobody", &nodes, &quiet(), T0),
        None,
        "a node missing from the ready ones has no location"
    );
}

#[test]
fn a_cordoned_holder_hands_its_lease_to_the_next_candidate() {
    let mut nodes = cluster();
    let mut leases = BTreeMap::new();
    let mut book = LeaseBook::default();
    let take = step(&mut book, "e1", &nodes, &leases, &quiet(), T0).unwrap();
    written(&mut leases, &take);
    nodes[0].cordoned = true;
    // Its own lease still names it: by lease it stays elected unless cordoned out of the
    // candidates, which it now is.
    let hand = step(&mut book, "e1", &nodes, &leases, &quiet(), T0 + 2_000).expect("a handover");
    assert_eq!(hand.next.holder.as_deref(), Some("e2"));
    assert_eq!(hand.next.transitions, 2);
    assert_eq!(hand.expected.holder.as_deref(), Some("e1"));
    assert_eq!(hand.reason(), Some(Reason::LeaderHandedOver));
    assert!(hand.next.deposed.is_empty(), "a handover deposes nobody");
}

#[test]
fn a_leader_whose_tunnels_only_send_marks_its_lease_cut_off_and_clears_it_when_they_hear() {
    let nodes = cluster();
    let mut leases = BTreeMap::new();
    let mut book = LeaseBook::default();
    let mut now = T0;
    let first = step(&mut book, "e1", &nodes, &leases, &leading(100, 100), now).unwrap();
    written(&mut leases, &first);
    // Sending, never receiving: cut off once the window has passed, not before.
    let mut marked_at = None;
    for tx in 1..=8 {
        now += 2_000;
        let w = step(
            &mut book,
            "e1",
            &nodes,
            &leases,
            &leading(100, 100 + tx * 50),
            now,
        )
        .unwrap();
        if w.next.cut_off && marked_at.is_none() {
            marked_at = Some(now);
            assert_eq!(w.reason(), Some(Reason::LeaderCutOff));
        }
        written(&mut leases, &w);
    }
    let marked_at = marked_at.expect("marked cut off");
    assert!(
        marked_at - T0 >= CUT_OFF_WINDOW_MS,
        "marked after {} ms",
        marked_at - T0
    );
    // Still silent: the mark stays.
    now += 2_000;
    let w = step(&mut book, "e1", &nodes, &leases, &leading(100, 600), now).unwrap();
    assert!(w.next.cut_off && w.why.is_none());
    written(&mut leases, &w);
    // A byte received: cleared at once.
    now += 2_000;
    let w = step(&mut book, "e1", &nodes, &leases, &leading(101, 650), now).unwrap();
    assert!(!w.next.cut_off);
    assert_eq!(w.reason(), Some(Reason::LeaderReconnected));
}

#[test]
fn a_mark_no_verifier_acts_on_is_withdrawn_and_not_made_again_until_something_changes() {
    let nodes = cluster();
    let mut leases = BTreeMap::new();
    let mut book = LeaseBook::default();
    let mut now = T0;
    let mut tx = 100;
    let mut sending = |book: &mut LeaseBook,
                       leases: &mut BTreeMap<String, LeaseState>,
                       now: i64,
                       readings: fn(u64, u64) -> TunnelReadings| {
        tx += 50;
        let w = step(book, "e1", &nodes, leases, &readings(100, tx), now).unwrap();
        written(leases, &w);
        w
    };
    let mut marked_at = None;
    while marked_at.is_none() {
        now += 2_000;
        if sending(&mut book, &mut leases, now, leading).next.cut_off {
            marked_at = Some(now);
        }
    }
    let marked_at = marked_at.unwrap();
    // Nobody takes over: the mark stands for the verify window, then is withdrawn, once.
    let withdrawn = loop {
        now += 2_000;
        let w = sending(&mut book, &mut leases, now, leading);
        if !w.next.cut_off {
            break w;
        }
        assert!(now - marked_at <= VERIFY_WINDOW_MS + 2_000, "marked still");
    };
    assert!(
        now - marked_at >= VERIFY_WINDOW_MS,
        "withdrawn after {} ms",
        now - marked_at
    );
    assert_eq!(withdrawn.reason(), Some(Reason::LeaderCutOffUnconfirmed));
    assert_eq!(withdrawn.next.holder.as_deref(), Some("e1"));
    // Still silent on the same tunnel: no new mark, and nothing said.
    for _ in 0..20 {
        now += 2_000;
        let w = sending(&mut book, &mut leases, now, leading);
        assert!(!w.next.cut_off && w.why.is_none(), "{w:?}");
    }
    // Another location's leader (a new key to watch) makes it a new question: marked again.
    let elsewhere = |rx, tx| {
        let other = Key::padded("k9");
        TunnelReadings {
            traffic: TunnelTraffic::Read {
                watched: vec![other],
                peers: BTreeMap::from([(other, (rx, tx))]),
            },
            standby_reached: Vec::new(),
        }
    };
    let mut remarked = false;
    for _ in 0..10 {
        now += 2_000;
        remarked |= sending(&mut book, &mut leases, now, elsewhere).next.cut_off;
    }
    assert!(remarked, "a changed tunnel is asked about again");
}

#[test]
fn unreadable_counters_never_mark_a_leader_cut_off() {
    let nodes = cluster();
    let mut leases = BTreeMap::new();
    let mut book = LeaseBook::default();
    let unreadable = TunnelReadings {
        traffic: TunnelTraffic::Unreadable,
        standby_reached: Vec::new(),
    };
    for i in 0..10 {
        let w = step(
            &mut book,
            "e1",
            &nodes,
            &leases,
            &unreadable,
            T0 + i * 2_000,
        )
        .unwrap();
        assert!(!w.next.cut_off);
        written(&mut leases, &w);
    }
}

#[test]
fn a_sole_candidate_keeps_leading_unmarked_however_silent() {
    let nodes: Vec<Node> = cluster()
        .into_iter()
        .filter(|n| n.name != "e2" && n.name != "e3")
        .collect();
    let mut leases = BTreeMap::new();
    let mut book = LeaseBook::default();
    for i in 0..10 {
        let w = step(
            &mut book,
            "e1",
            &nodes,
            &leases,
            &leading(0, 100 * i as u64),
            T0 + i * 2_000,
        )
        .unwrap();
        assert!(!w.next.cut_off, "nobody to ask at step {i}");
        written(&mut leases, &w);
    }
}

#[test]
fn a_verifier_with_a_standby_handshake_takes_a_cut_off_lease_on_the_second_step_in_a_row() {
    let nodes = cluster();
    let mut leases = BTreeMap::new();
    let mut cut = LeaseState {
        holder: Some("e1".into()),
        renewed_ms: T0,
        duration_ms: LEASE_DURATION_MS,
        transitions: 3,
        cut_off: true,
        deposed: BTreeMap::new(),
        cut_off_predecessor: None,
        handed_over_by: None,
    };
    leases.insert(lease_name("east"), cut.clone());
    let mut book = LeaseBook::default();
    book.ingest(&leases, T0);
    let elected = book.elect(&nodes, 1, T0);
    assert!(elected.leaders_changed);
    assert_eq!(
        book.verifiers()["east"],
        vec!["e2".to_string(), "e3".to_string()]
    );
    let reached = TunnelReadings {
        traffic: TunnelTraffic::NotLeading,
        standby_reached: vec!["west".into()],
    };
    // Not yet: the holder may hear again at this very moment.
    assert_eq!(book.tend("e2", &nodes, &reached, T0), None);
    // A step without the handshake resets the confirmation.
    assert_eq!(book.tend("e2", &nodes, &quiet(), T0 + 2_000), None);
    assert_eq!(book.tend("e2", &nodes, &reached, T0 + 4_000), None);
    // A step that comes right after another (a lease ran out) is not a second step.
    assert_eq!(book.tend("e2", &nodes, &reached, T0 + 4_010), None);
    // The holder renews, still cut off: the verifier's second step in a row takes over.
    cut.renewed_ms = T0 + 5_000;
    leases.insert(lease_name("east"), cut.clone());
    let take = step(&mut book, "e2", &nodes, &leases, &reached, T0 + 6_000).expect("a takeover");
    assert_eq!(take.next.holder.as_deref(), Some("e2"));
    assert!(!take.next.cut_off);
    assert_eq!(take.next.transitions, 4);
    assert_eq!(
        take.expected,
        Expectation {
            holder: Some("e1".into()),
            cut_off: true
        },
        "the takeover holds only while the mark is on"
    );
    assert_eq!(
        take.next.deposed.get("e1"),
        Some(&nodes[0].last_seen),
        "the cut-off holder is deposed"
    );
    assert_eq!(
        take.next.cut_off_predecessor.as_deref(),
        Some("e1"),
        "and kept out while e2 holds the lease"
    );
    assert_eq!(take.reason(), Some(Reason::LeaderReplacedCutOff));
    // Had the holder cleared its mark first, the backend refuses the takeover.
    let cleared = LeaseState {
        cut_off: false,
        ..cut
    };
    assert!(!take.next.may_replace(&cleared, &take.expected));
}

#[test]
fn while_the_backend_is_unreachable_leases_are_judged_as_of_the_last_contact() {
    let nodes = cluster();
    let mut leases = BTreeMap::new();
    leases.insert(
        lease_name("east"),
        LeaseState {
            holder: Some("e2".into()),
            renewed_ms: T0,
            duration_ms: LEASE_DURATION_MS,
            transitions: 1,
            ..Default::default()
        },
    );
    let mut book = LeaseBook::default();
    book.observe_backend(true, T0);
    book.ingest(&leases, T0);
    book.observe_backend(false, T0 + 1_000);
    let late = T0 + 60_000;
    assert_eq!(book.judged_at(late), T0, "frozen at the last contact");
    book.elect(&nodes, 1, book.judged_at(late));
    assert_eq!(
        book.leader_names()["east"][0].name,
        "e2",
        "no renewal could be seen: the holder keeps it"
    );
    // Back: every lease counts as renewed now, so the holder has one lease duration to renew.
    book.observe_backend(true, late);
    assert!(book.changed());
    assert_eq!(book.judged_at(late), late);
    book.elect(&nodes, 1, late + LEASE_DURATION_MS - 1);
    assert_eq!(book.leader_names()["east"][0].name, "e2");
    book.elect(&nodes, 1, late + LEASE_DURATION_MS);
    assert_eq!(
        book.leader_names()["east"][0].name,
        "e1",
        "expired: Kilo's rule among the others"
    );
}

#[test]
fn a_node_without_lease_election_puts_everyone_on_kilos_rule_said_once() {
    let mut nodes = cluster();
    nodes[3].lease_election = false;
    let mut book = LeaseBook::default();
    let first = book.elect(&nodes, 1, T0);
    assert_eq!(
        first.agreement,
        Some(Agreement::KiloRule {
            holdout: "w1".into(),
            count: 1
        })
    );
    assert!(book.leader_names().is_empty(), "no leader by lease");
    assert_eq!(book.elect(&nodes, 1, T0 + 1).agreement, None, "said once");
    // Kilo's rule's leader still keeps its location's lease current.
    let mirror = book
        .tend("e1", &nodes, &leading(0, 1_000), T0)
        .expect("a write");
    assert_eq!(mirror.next.holder.as_deref(), Some("e1"));
    assert!(!mirror.next.cut_off, "never cut off while mirroring");
    // A holder whose location Kilo's agent leads lets the lease lapse rather than name it.
    let mut leases = BTreeMap::new();
    leases.insert(
        lease_name("west"),
        LeaseState {
            holder: Some("w0".into()),
            renewed_ms: T0,
            duration_ms: LEASE_DURATION_MS,
            ..Default::default()
        },
    );
    let mut west = nodes.clone();
    let mut w0 = west[3].clone();
    w0.name = "w0".into();
    w0.lease_election = true;
    w0.key = Some(Key::padded("k5"));
    west[3].name = "w".into();
    west.push(w0);
    let mut book = LeaseBook::default();
    book.ingest(&leases, T0);
    book.elect(&west, 1, T0);
    assert_eq!(book.kilo_rule.get("west").map(String::as_str), Some("w"));
    assert_eq!(book.tend("w0", &west, &quiet(), T0), None);
}

#[test]
fn the_next_expiry_is_the_earliest_held_lease_running_out_as_this_node_saw_it() {
    let mut book = LeaseBook::default();
    assert_eq!(book.next_expiry_ms(T0), None, "no lease seen");
    let held = |holder: Option<&str>, renewed_ms: i64| LeaseState {
        holder: holder.map(str::to_string),
        renewed_ms,
        duration_ms: LEASE_DURATION_MS,
        ..LeaseState::default()
    };
    // Judged from when this node saw each renewal, not from the renewal time written.
    let leases = BTreeMap::from([
        (lease_name("east"), held(Some("e1"), T0 - 60_000)),
        (lease_name("west"), held(Some("w1"), T0)),
        (lease_name("north"), held(None, T0)),
    ]);
    book.ingest(&leases, T0 + 500);
    assert_eq!(
        book.next_expiry_ms(T0 + 500),
        Some(T0 + 500 + LEASE_DURATION_MS)
    );
    // Once run out, it is no deadline any more: the pass at that moment does not repeat.
    assert_eq!(book.next_expiry_ms(T0 + 500 + LEASE_DURATION_MS), None);
    // While the backend is unreachable leases are judged as of the last contact: no deadline.
    book.observe_backend(false, T0 + 1_000);
    assert_eq!(book.next_expiry_ms(T0 + 1_000), None);
}
