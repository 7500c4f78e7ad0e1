use super::*;

fn key(n: u8) -> Key {
    Key([n; 32])
}

fn tunnel(name: &str, n: u8) -> Tunnel {
    Tunnel {
        name: name.into(),
        key: key(n),
    }
}

fn leader(tunnels: Vec<Tunnel>) -> Role {
    Role::Leader {
        location: "east".into(),
        tunnels,
    }
}

fn inputs(role: Role, traffic: &[(u8, u64, u64)]) -> MeshInputs {
    MeshInputs {
        engine_configured: true,
        role,
        traffic: Some(
            traffic
                .iter()
                .map(|&(n, rx, tx)| (key(n), (rx, tx)))
                .collect(),
        ),
    }
}

#[test]
fn an_unconfigured_engine_and_a_node_not_ready_are_false_with_their_reasons() {
    let mut watch = MeshWatch::default();
    let mut i = inputs(leader(vec![tunnel("w1", 1)]), &[]);
    i.engine_configured = false;
    let c = watch.judge(&i, 0);
    assert_eq!(c.reason, MeshReason::EngineNotConfigured);
    assert_eq!(c.status(), ConditionStatus::False);
    let c = watch.judge(&inputs(Role::NotReady("no pod CIDR".into()), &[]), 1_000);
    assert_eq!(c.reason, MeshReason::NodeNotReady);
    assert!(c.message.contains("no pod CIDR"), "{}", c.message);
}

#[test]
fn a_follower_is_true_and_names_its_leader() {
    let c = MeshWatch::default().judge(
        &inputs(
            Role::Follower {
                leader: "e1".into(),
            },
            &[],
        ),
        0,
    );
    assert_eq!(
        (c.reason, c.status()),
        (MeshReason::FollowsLeader, ConditionStatus::True)
    );
    assert!(c.message.contains("e1"), "{}", c.message);
}

#[test]
fn a_tunnel_sent_to_without_an_answer_for_the_window_is_down_and_idle_ones_are_not() {
    let mut watch = MeshWatch::default();
    let role = leader(vec![tunnel("w1", 1), tunnel("s1", 2), tunnel("n1", 3)]);
    // w1 answers, s1 is sent to and silent, n1 idle.
    let at = |rx1: u64, tx2: u64| inputs(role.clone(), &[(1, rx1, 10), (2, 5, tx2), (3, 7, 7)]);
    assert_eq!(watch.judge(&at(100, 100), 0).reason, MeshReason::Meshed);
    // Not yet a whole window: still meshed.
    assert_eq!(
        watch.judge(&at(200, 200), DOWN_WINDOW_MS - 1).reason,
        MeshReason::Meshed
    );
    let c = watch.judge(&at(300, 300), DOWN_WINDOW_MS);
    assert_eq!(
        (c.reason, c.status()),
        (MeshReason::PeersDown, ConditionStatus::False)
    );
    assert!(
        c.message.contains("1 of its 3") && c.message.contains("s1"),
        "{}",
        c.message
    );
    assert!(
        !c.message.contains("w1") && !c.message.contains("n1"),
        "{}",
        c.message
    );
    // s1 answers again: meshed at the next judgement a window later.
    let back = inputs(role.clone(), &[(1, 400, 10), (2, 6, 400), (3, 7, 7)]);
    assert_eq!(
        watch.judge(&back, 2 * DOWN_WINDOW_MS).reason,
        MeshReason::Meshed
    );
}

#[test]
fn every_tunnel_silent_is_no_leader_reachable_and_unreadable_counters_are_unknown() {
    let mut watch = MeshWatch::default();
    let role = leader(vec![tunnel("w1", 1), tunnel("s1", 2)]);
    watch.judge(&inputs(role.clone(), &[(1, 5, 10), (2, 5, 10)]), 0);
    let c = watch.judge(
        &inputs(role.clone(), &[(1, 5, 90), (2, 5, 90)]),
        DOWN_WINDOW_MS,
    );
    assert_eq!(c.reason, MeshReason::NoLeaderReachable);
    assert!(c.message.contains("w1, s1"), "{}", c.message);
    let mut unreadable = inputs(role, &[]);
    unreadable.traffic = None;
    let c = watch.judge(&unreadable, DOWN_WINDOW_MS + 1);
    assert_eq!(
        (c.reason, c.status()),
        (MeshReason::TunnelsUnreadable, ConditionStatus::Unknown)
    );
}

#[test]
fn a_peer_missing_from_the_device_is_down_once_a_window_passed() {
    let mut watch = MeshWatch::default();
    let role = leader(vec![tunnel("w1", 1), tunnel("s1", 2)]);
    watch.judge(&inputs(role.clone(), &[(1, 5, 10)]), 0);
    let c = watch.judge(&inputs(role, &[(1, 9, 20)]), DOWN_WINDOW_MS);
    assert_eq!(c.reason, MeshReason::PeersDown);
    assert!(c.message.contains("s1"), "{}", c.message);
}

fn meshed() -> MeshCondition {
    MeshCondition {
        reason: MeshReason::Meshed,
        message: "ok".into(),
    }
}

fn down(message: &str) -> MeshCondition {
    MeshCondition {
        reason: MeshReason::PeersDown,
        message: message.into(),
    }
}

#[test]
fn writes_come_on_a_change_at_most_every_interval_and_as_a_heartbeat() {
    let mut book = ConditionBook::default();
    let first = book
        .due(&meshed(), 1_000)
        .expect("the first judgement is written");
    assert_eq!((first.transition_ms, first.heartbeat_ms), (1_000, 1_000));
    book.written(first);
    // Unchanged: nothing until the heartbeat.
    assert_eq!(book.due(&meshed(), 1_000 + HEARTBEAT_MS - 1), None);
    // A change within the interval waits; after it, it is written with a new transition.
    assert_eq!(
        book.due(&down("s1"), 1_000 + MIN_WRITE_INTERVAL_MS - 1),
        None
    );
    let change = book
        .due(&down("s1"), 1_000 + MIN_WRITE_INTERVAL_MS)
        .unwrap();
    assert_eq!(change.transition_ms, 1_000 + MIN_WRITE_INTERVAL_MS);
    book.written(change);
    // Only the message changes: it waits for the heartbeat, which keeps the transition time.
    let t = 1_000 + MIN_WRITE_INTERVAL_MS;
    assert_eq!(book.due(&down("s1, n1"), t + MIN_WRITE_INTERVAL_MS), None);
    let beat = book.due(&down("s1, n1"), t + HEARTBEAT_MS).unwrap();
    assert_eq!(
        (beat.transition_ms, beat.heartbeat_ms),
        (t, t + HEARTBEAT_MS)
    );
    assert_eq!(beat.condition.message, "s1, n1");
}

#[test]
fn a_failed_write_is_due_again_and_an_adopted_condition_keeps_its_transition() {
    let mut book = ConditionBook::default();
    assert!(book.wants_present());
    assert!(book.due(&meshed(), 0).is_some());
    // Not recorded as written: due again.
    assert!(book.due(&meshed(), 1).is_some());
    book.adopt(Some(ConditionWrite {
        condition: meshed(),
        transition_ms: -50_000,
        heartbeat_ms: -1_000,
    }));
    assert!(!book.wants_present());
    assert_eq!(book.due(&meshed(), 0), None);
    let change = book.due(&down("s1"), MIN_WRITE_INTERVAL_MS).unwrap();
    assert_eq!(change.transition_ms, MIN_WRITE_INTERVAL_MS);
    // A reason change within one status keeps the transition time.
    let mut book = ConditionBook::default();
    book.adopt(Some(ConditionWrite {
        condition: MeshCondition {
            reason: MeshReason::FollowsLeader,
            message: "follows".into(),
        },
        transition_ms: 7,
        heartbeat_ms: 7,
    }));
    assert_eq!(
        book.due(&meshed(), MIN_WRITE_INTERVAL_MS + 7)
            .unwrap()
            .transition_ms,
        7
    );
}

#[test]
fn a_node_without_the_condition_is_asked_once_and_written_at_once() {
    let mut book = ConditionBook::default();
    book.adopt(None);
    assert!(!book.wants_present());
    assert_eq!(book.due(&meshed(), 5).map(|w| w.transition_ms), Some(5));
    for reason in ["Meshed", "NoLeaderReachable", "TunnelsUnreadable"] {
        assert_eq!(
            MeshReason::from_name(reason).map(MeshReason::as_str),
            Some(reason)
        );
    }
    assert_eq!(MeshReason::from_name("Ready"), None);
}

#[test]
fn a_tunnel_that_goes_down_and_comes_back_is_told_once_each_with_how_long() {
    let mut watch = MeshWatch::default();
    let role = || leader(vec![tunnel("w1", 1), tunnel("w2", 2)]);
    // Both answer for a window; then w1 is sent to and answers nothing.
    watch.judge(&inputs(role(), &[(1, 10, 10), (2, 10, 10)]), 0);
    watch.judge(&inputs(role(), &[(1, 20, 20), (2, 20, 20)]), DOWN_WINDOW_MS);
    assert_eq!(watch.take_link_changes(), []);
    let mut at = DOWN_WINDOW_MS;
    let mut w1 = (20, 20);
    let mut w2 = 20;
    let mut down_at = None;
    while down_at.is_none() {
        at += 2_000;
        w1.1 += 5;
        w2 += 5;
        watch.judge(&inputs(role(), &[(1, w1.0, w1.1), (2, w2, w2)]), at);
        let changes = watch.take_link_changes();
        if !changes.is_empty() {
            assert_eq!(changes, [LinkChange::Down { name: "w1".into() }]);
            down_at = Some(at);
        }
        assert!(at < 4 * DOWN_WINDOW_MS, "w1 never judged down");
    }
    // Still down, and idle after that (nothing sent, nothing heard): no more news.
    for _ in 0..3 {
        at += 2_000;
        watch.judge(&inputs(role(), &[(1, w1.0, w1.1), (2, w2, w2)]), at);
    }
    assert_eq!(watch.take_link_changes(), []);
    // It hears something: back, with how long it was judged down.
    at += 2_000;
    watch.judge(&inputs(role(), &[(1, w1.0 + 1, w1.1 + 1), (2, w2, w2)]), at);
    let back = watch.take_link_changes();
    assert_eq!(
        back,
        [LinkChange::Up {
            name: "w1".into(),
            down_ms: at - down_at.unwrap(),
        }]
    );
    // A tunnel that leaves the topology while down is forgotten, not told as back.
    let mut watch2 = watch.clone();
    watch2.down_since.insert("w2".into(), at);
    at += 2_000;
    watch2.judge(
        &inputs(leader(vec![tunnel("w1", 1)]), &[(1, w1.0 + 2, w1.1 + 2)]),
        at,
    );
    assert_eq!(watch2.take_link_changes(), []);
    assert!(watch2.down_since.is_empty());
}
