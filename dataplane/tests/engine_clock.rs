//! Engine timers under a mock clock: rekey after REKEY_AFTER_TIME and handshake retry after a
//! lost initiation. boringtun reads mock_instant's thread-local clock (feature `mock-clock`), so
//! the engines run on this test's thread and `advance` moves both clocks together.
//!
//! Run with `cargo test -p dataplane --features mock-clock --test engine_clock`.

use std::time::{Duration, Instant};

use dataplane::testing::{ip_packet, EnginePair};
use dataplane::Outbox;
use mock_instant::MockClock;

/// Moves boringtun's clock and ours forward together.
fn advance(now: &mut Instant, by: Duration) {
    MockClock::advance(by);
    *now += by;
}

#[test]
fn sessions_rekey_after_two_minutes_without_losing_packets() {
    let mut pair = EnginePair::new();
    let mut now = Instant::now();
    pair.send_a_to_b(now, b"first");
    assert_eq!(pair.a.engine.peer_stats()[0].handshakes, 1);
    for second in 0..150u32 {
        advance(&mut now, Duration::from_millis(500));
        pair.tick(now);
        advance(&mut now, Duration::from_millis(500));
        pair.send_a_to_b(now, &second.to_be_bytes());
        pair.tick(now);
    }
    let handshakes = pair.a.engine.peer_stats()[0].handshakes;
    assert!(handshakes >= 2, "a rekeyed ({handshakes} handshakes)");
    assert_eq!(
        pair.b.delivered.len(),
        151,
        "every packet arrived across the rekey"
    );
}

#[test]
fn a_lost_initiation_is_retried_after_rekey_timeout() {
    let mut pair = EnginePair::new();
    let mut now = Instant::now();
    let packet = ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, b"queued");
    let mut lost = Outbox::default();
    pair.a
        .engine
        .handle_tunnel_packets(now, [packet.as_slice()], &mut lost);
    assert_eq!(
        lost.to_network.len(),
        1,
        "an initiation, which the wire loses"
    );
    for _ in 0..16 {
        advance(&mut now, Duration::from_millis(250));
        pair.tick(now);
    }
    assert!(
        pair.b.delivered.is_empty(),
        "nothing before REKEY_TIMEOUT (5 s)"
    );
    for _ in 0..8 {
        advance(&mut now, Duration::from_millis(250));
        pair.tick(now);
    }
    assert_eq!(
        pair.b.delivered,
        vec![packet],
        "retried initiation, then the queued packet"
    );
    let stats = &pair.a.engine.peer_stats()[0];
    assert_eq!(stats.handshake_failures, 1, "the lost initiation");
    assert_eq!(stats.handshakes, 1);
    // A healthy session adds no failures.
    for _ in 0..40 {
        advance(&mut now, Duration::from_millis(250));
        pair.tick(now);
    }
    assert_eq!(pair.a.engine.peer_stats()[0].handshake_failures, 1);
}

/// A request answered once, then silence: the side that sent last (the answer) gets WireGuard's
/// passive keepalive 10 s later, so on a healthy link nothing waits for an answer for the 15 s
/// after which `kgctl diagnose` calls traffic unanswered.
#[test]
fn the_last_answer_on_a_quiet_link_is_acknowledged_within_ten_seconds() {
    let mut pair = EnginePair::new();
    let mut now = Instant::now();
    pair.send_a_to_b(now, b"request");
    advance(&mut now, Duration::from_millis(20));
    pair.send_b_to_a(now, b"response");
    assert_eq!(pair.a.engine.peer_stats()[0].unanswered_since, None);
    assert!(
        pair.b.engine.peer_stats()[0].unanswered_since.is_some(),
        "the response awaits A's keepalive"
    );
    for _ in 0..48 {
        advance(&mut now, Duration::from_millis(250));
        pair.tick(now);
    }
    assert_eq!(pair.a.engine.peer_stats()[0].unanswered_since, None);
    assert_eq!(
        pair.b.engine.peer_stats()[0].unanswered_since,
        None,
        "A's passive keepalive answered B within 12 s"
    );
}

/// A restarted device's first initiation is lost (the peer's agent had not added it back yet):
/// the next goes out half a second later, not after WireGuard's 5 s REKEY_TIMEOUT, and the
/// retries stop once a handshake completes.
#[test]
fn a_lost_first_initiation_after_a_restart_is_retried_within_half_a_second() {
    let mut pair = EnginePair::new();
    let mut now = Instant::now();
    assert_eq!(pair.a.engine.initiate_handshakes(), 1);
    let mut lost = Outbox::default();
    pair.a.engine.handle_timers(now, &mut lost);
    assert_eq!(
        lost.to_network.len(),
        1,
        "the first initiation, which is lost"
    );
    let started = now;
    while pair.a.engine.peer_stats()[0].handshakes == 0 {
        advance(&mut now, Duration::from_millis(250));
        pair.tick(now);
        assert!(
            now - started <= Duration::from_secs(1),
            "no handshake within 1 s of the lost initiation"
        );
    }
    let waited = now - started;
    assert!(
        waited >= Duration::from_millis(500),
        "retried after {waited:?}, before the first could be answered"
    );
    // Once the session is up, nothing more is sent early: a quiet link stays quiet.
    let mut quiet = Outbox::default();
    for _ in 0..16 {
        advance(&mut now, Duration::from_millis(250));
        pair.a.engine.handle_timers(now, &mut quiet);
    }
    assert_eq!(
        quiet.to_network.len(),
        0,
        "no initiation once the handshake completed"
    );
    assert_eq!(pair.a.engine.peer_stats()[0].handshakes, 1);
}

/// A restarted device whose peer never answers: six early initiations follow the first, the
/// first three about half a second apart and the last three about a second apart (so that a path
/// whose answer takes up to a second is not cut short each time), each wait up to a third longer
/// as the two keys say; then only WireGuard's own retry after REKEY_TIMEOUT.
#[test]
fn unanswered_early_initiations_slow_down_then_leave_it_to_rekey_timeout() {
    let pair = EnginePair::new();
    let mut now = Instant::now();
    let started = now;
    assert_eq!(pair.a.engine.initiate_handshakes(), 1);
    let mut sent_at = Vec::new();
    while now - started <= Duration::from_secs(14) {
        // Nothing is delivered to B: every initiation is lost.
        let mut lost = Outbox::default();
        pair.a.engine.handle_timers(now, &mut lost);
        for _ in 0..lost.to_network.len() {
            sent_at.push((now - started).as_millis());
        }
        advance(&mut now, Duration::from_millis(250));
    }
    assert!(sent_at.len() > 7, "every initiation sent: {sent_at:?}");
    let gaps: Vec<u128> = sent_at.windows(2).map(|w| w[1] - w[0]).collect();
    // The wait, a third more at most, and the tick (250 ms) that notices it is over.
    for (i, gap) in gaps[..6].iter().enumerate() {
        let wait = if i < 3 { 500 } else { 1000 };
        assert!(
            (wait..=wait + wait / 3 + 250).contains(gap),
            "early initiation {} after {gap} ms: {sent_at:?}",
            i + 1
        );
    }
    assert!(
        gaps[6] >= 5000,
        "after the early ones, the next waits REKEY_TIMEOUT (5 s): {sent_at:?}"
    );
}

/// A peer that never answers: boringtun gives up after REKEY_ATTEMPT_TIME (90 s), and the
/// engine reports it once, not at every tick after, and sends nothing more until asked.
#[test]
fn a_peer_that_never_answers_is_given_up_on_once_and_costs_nothing_after() {
    let pair = EnginePair::new();
    let mut now = Instant::now();
    let started = now;
    assert_eq!(pair.a.engine.initiate_handshakes(), 1);
    let mut reports = Vec::new();
    let mut sent_after_giving_up = 0;
    while now - started <= Duration::from_secs(200) {
        let mut lost = Outbox::default();
        let gave_up = pair.a.engine.handle_timers(now, &mut lost);
        if gave_up.peers > 0 {
            reports.push(((now - started).as_secs(), gave_up));
        } else if !reports.is_empty() {
            sent_after_giving_up += lost.to_network.len();
        }
        advance(&mut now, Duration::from_millis(250));
    }
    let b = pair.b.engine.public_key();
    assert_eq!(reports.len(), 1, "reported once: {reports:?}");
    let (at, gave_up) = reports[0];
    assert!((90..=96).contains(&at), "after REKEY_ATTEMPT_TIME: {at} s");
    assert_eq!((gave_up.peers, gave_up.first), (1, b));
    assert_eq!(sent_after_giving_up, 0, "nothing sent once given up");
}
