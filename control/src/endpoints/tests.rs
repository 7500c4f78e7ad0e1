use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use super::*;
use crate::clock::Now;
use crate::key::Key;
use crate::peer_status::PeerReading;

fn at(text: &str) -> SocketAddr {
    text.parse().unwrap()
}

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

const WINDOW: Duration = Duration::from_secs(15);

fn rules() -> ProbeRules {
    ProbeRules {
        window: WINDOW,
        accept: EndpointFilter::default(),
        family: UnderlayFamily::Auto,
        ipv4: true,
        ipv6: true,
    }
}

fn start() -> Now {
    Now {
        instant: Instant::now(),
        unix_ms: 1_800_000_000_000,
    }
}

fn reading(tx_bytes: u64, last_handshake_ms: Option<i64>) -> PeerReading {
    PeerReading {
        endpoint: None,
        last_handshake_ms,
        rx_bytes: 0,
        tx_bytes,
    }
}

#[test]
fn a_list_round_trips_and_bad_entries_are_named_and_skipped() {
    let (found, left_out) = parse_candidates(
        " 192.0.2.1:51820, [2001:db8::1]:51820,node.example:51820,10.0.0.1:0,192.0.2.1:51820,",
    );
    assert_eq!(found, [at("192.0.2.1:51820"), at("[2001:db8::1]:51820")]);
    assert_eq!(
        encode_candidates(&found),
        "192.0.2.1:51820,[2001:db8::1]:51820"
    );
    let entries: Vec<&str> = left_out.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(entries, ["node.example:51820", "10.0.0.1:0"]);
    assert!(left_out[0].1.contains("address:port"), "{left_out:?}");
    assert!(left_out[1].1.contains("port 0"), "{left_out:?}");
    assert_eq!(parse_candidates(""), (Vec::new(), Vec::new()));
}

#[test]
fn filters_take_cidrs_and_negations_and_name_a_bad_entry() {
    let filter = EndpointFilter::parse("10.0.0.0/8, !10.9.0.0/16,2001:db8::/32").unwrap();
    assert!(filter.admits(ip("10.1.2.3")));
    assert!(!filter.admits(ip("10.9.2.3")), "excluded inside included");
    assert!(!filter.admits(ip("192.0.2.1")), "not included");
    assert!(filter.admits(ip("2001:db8::5")));
    assert_eq!(filter.to_string(), "10.0.0.0/8,2001:db8::/32,!10.9.0.0/16");
    let only_negated = EndpointFilter::parse("!192.168.0.0/16").unwrap();
    assert!(only_negated.admits(ip("10.0.0.1")) && !only_negated.admits(ip("192.168.1.1")));
    assert!(EndpointFilter::parse("").unwrap().is_open());
    let bad = EndpointFilter::parse("10.0.0.0/8,!nonsense").unwrap_err();
    assert_eq!(bad.entry, "!nonsense");
    assert!(bad.to_string().contains("\"!nonsense\""));
}

#[test]
fn a_node_publishes_forced_then_detected_then_public_before_private() {
    let addresses = [
        ip("10.0.0.5"),
        ip("2001:db8::5"),
        ip("192.0.2.5"),
        ip("fd00::5"),
        ip("172.16.0.5"),
    ];
    let list = local_candidates(
        Some(at("198.51.100.1:4000")),
        Some(at("10.0.0.5:51820")),
        &addresses,
        51820,
        &EndpointFilter::default(),
    );
    assert_eq!(
        list,
        [
            at("198.51.100.1:4000"),
            at("10.0.0.5:51820"),
            at("192.0.2.5:51820"),
            at("[2001:db8::5]:51820"),
            at("172.16.0.5:51820"),
            at("[fd00::5]:51820"),
        ]
    );
    let advertise = EndpointFilter::parse("!10.0.0.0/8,!fd00::/8").unwrap();
    let filtered = local_candidates(
        Some(at("10.9.9.9:1")),
        Some(at("10.0.0.5:51820")),
        &addresses,
        51820,
        &advertise,
    );
    assert_eq!(
        filtered,
        [
            at("10.9.9.9:1"),
            at("192.0.2.5:51820"),
            at("[2001:db8::5]:51820"),
            at("172.16.0.5:51820"),
        ],
        "the forced endpoint stays; the filter drops the rest of 10/8 and fd00::/8"
    );
}

#[test]
fn refused_candidates_say_why_and_the_family_preference_orders_the_rest() {
    let mut r = rules();
    r.accept = EndpointFilter::parse("!203.0.113.0/24").unwrap();
    r.ipv6 = false;
    let list = [
        at("203.0.113.1:51820"),
        at("[2001:db8::1]:51820"),
        at("10.4.0.1:51820"),
        at("192.0.2.1:51820"),
    ];
    let (usable, refused) = r.usable("b", &list, |ip| ip != self::ip("10.4.0.1"));
    assert_eq!(usable, [at("192.0.2.1:51820")]);
    let whys: Vec<(SocketAddr, &str)> = refused
        .iter()
        .map(|x| (x.endpoint, x.why.as_str()))
        .collect();
    assert!(
        whys[0].1.contains("--accept-endpoints=!203.0.113.0/24"),
        "{whys:?}"
    );
    assert!(whys[1].1.contains("no IPv6 address"), "{whys:?}");
    assert!(whys[2].1.contains("inside the tunnel"), "{whys:?}");
    assert!(refused.iter().all(|x| x.node == "b"));

    let mut r = rules();
    r.family = UnderlayFamily::Ipv6;
    let (usable, _) = r.usable("b", &list[1..], |_| true);
    assert_eq!(
        usable,
        [
            at("[2001:db8::1]:51820"),
            at("10.4.0.1:51820"),
            at("192.0.2.1:51820")
        ]
    );
    r.family = UnderlayFamily::Ipv4;
    let (usable, _) = r.usable("b", &list[1..], |_| true);
    assert_eq!(usable[2], at("[2001:db8::1]:51820"));
}

fn three() -> TrackedPeer {
    TrackedPeer {
        node: "b".into(),
        key: Key::padded("b"),
        candidates: vec![
            at("10.1.0.1:51820"),
            at("10.2.0.1:51820"),
            at("10.3.0.1:51820"),
        ],
    }
}

#[test]
fn a_silent_candidate_is_left_after_the_window_and_a_working_one_kept() {
    let key = Key::padded("b");
    let mut probes = EndpointProbes::new(rules());
    let t0 = start();
    assert!(probes.track(&[three()], |_| true, t0).is_empty());
    assert_eq!(probes.choices()[&key], at("10.1.0.1:51820"));
    assert_eq!(probes.next_check(), Some(t0.instant + WINDOW));

    let read = |tx, hs| BTreeMap::from([(key, reading(tx, hs))]);
    assert!(probes
        .observe(&read(100, None), t0.after(Duration::from_secs(1)))
        .is_empty());
    assert!(
        probes
            .observe(&read(100, None), t0.after(WINDOW))
            .is_empty(),
        "nothing sent: an idle link is no failed one"
    );
    let moves = probes.observe(&read(400, None), t0.after(WINDOW + Duration::from_secs(1)));
    assert_eq!(moves.len(), 1);
    assert_eq!(
        (moves[0].from, moves[0].to),
        (at("10.1.0.1:51820"), at("10.2.0.1:51820"))
    );
    assert!(
        moves[0].why.contains("no handshake within 15 s"),
        "{moves:?}"
    );
    assert_eq!(probes.choices()[&key], at("10.2.0.1:51820"));

    // The second is silent too; the third answers within its window.
    let t1 = t0.after(WINDOW + Duration::from_secs(1));
    let moves = probes.observe(&read(900, None), t1.after(WINDOW));
    assert_eq!(moves[0].to, at("10.3.0.1:51820"));
    let t2 = t1.after(WINDOW);
    let shaken = t2.after(Duration::from_secs(2)).unix_ms;
    assert!(probes
        .observe(&read(1_500, Some(shaken)), t2.after(Duration::from_secs(3)))
        .is_empty());
    let status = &probes.statuses()[0];
    assert_eq!(status.state, ProbeState::Working);
    assert_eq!(status.in_use, Some(at("10.3.0.1:51820")));
    assert_eq!(status.left.len(), 2);

    // Sticky: much later, with traffic and recent handshakes, it stays; the list's first
    // coming back changes nothing.
    let later = t2.after(Duration::from_secs(100));
    assert!(probes
        .observe(&read(90_000, Some(later.unix_ms)), later)
        .is_empty());
    assert!(probes.track(&[three()], |_| true, later).is_empty());
    assert_eq!(probes.choices()[&key], at("10.3.0.1:51820"));

    // It fails: sending, and no handshake for longer than a session lives.
    let quiet = later.after(SESSION_LIFETIME + WINDOW + Duration::from_secs(1));
    assert!(
        probes
            .observe(&read(90_000, Some(later.unix_ms)), quiet)
            .is_empty(),
        "an old handshake on a link that sends nothing is no failure"
    );
    let moves = probes.observe(
        &read(99_000, Some(later.unix_ms)),
        quiet.after(Duration::from_secs(5)),
    );
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!(
        moves[0].to,
        at("10.1.0.1:51820"),
        "round to the first again"
    );
    assert!(
        moves[0].why.contains("it worked, but no handshake"),
        "{moves:?}"
    );
}

#[test]
fn a_changed_list_keeps_the_candidate_in_use_and_a_gone_peer_is_forgotten() {
    let key = Key::padded("b");
    let mut probes = EndpointProbes::new(rules());
    let t0 = start();
    probes.track(&[three()], |_| true, t0);
    let read = |tx| BTreeMap::from([(key, reading(tx, None))]);
    probes.observe(&read(1), t0);
    probes.observe(&read(2), t0.after(WINDOW));
    assert_eq!(probes.choices()[&key], at("10.2.0.1:51820"));

    let mut changed = three();
    changed.candidates.insert(0, at("10.0.0.1:51820"));
    probes.track(&[changed.clone()], |_| true, t0.after(WINDOW));
    assert_eq!(
        probes.choices()[&key],
        at("10.2.0.1:51820"),
        "still in the list"
    );
    changed.candidates.retain(|a| *a != at("10.2.0.1:51820"));
    probes.track(&[changed], |_| true, t0.after(WINDOW));
    assert_eq!(
        probes.choices()[&key],
        at("10.0.0.1:51820"),
        "gone: the first"
    );

    probes.track(&[], |_| true, t0.after(WINDOW));
    assert!(probes.choices().is_empty() && probes.next_check().is_none());
}

#[test]
fn refusals_are_returned_once_and_a_peer_with_one_candidate_is_not_probed() {
    let key = Key::padded("b");
    let mut probes = EndpointProbes::new(rules());
    let t0 = start();
    let tunnel_only = |ip: IpAddr| ip != self::ip("10.1.0.1");
    let peer = TrackedPeer {
        node: "b".into(),
        key,
        candidates: vec![at("10.1.0.1:51820"), at("10.2.0.1:51820")],
    };
    let refused = probes.track(std::slice::from_ref(&peer), tunnel_only, t0);
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0].endpoint, at("10.1.0.1:51820"));
    assert!(
        probes
            .track(std::slice::from_ref(&peer), tunnel_only, t0)
            .is_empty(),
        "said once"
    );
    assert_eq!(probes.choices()[&key], at("10.2.0.1:51820"));
    assert_eq!(probes.statuses()[0].state, ProbeState::Only);
    assert!(probes.next_check().is_none());
    let moves = probes.observe(
        &BTreeMap::from([(key, reading(10_000, None))]),
        t0.after(WINDOW * 4),
    );
    assert!(moves.is_empty(), "nothing to move to");

    let nothing = probes.track(&[peer], |_| false, t0);
    assert_eq!(nothing.len(), 1, "the second refused now");
    assert!(
        probes.choices().is_empty(),
        "every one refused: Kilo's endpoint"
    );
    assert_eq!(probes.statuses()[0].in_use, None);
}

#[test]
fn a_peer_none_of_whose_candidates_answers_is_tried_less_often_each_round() {
    let key = Key::padded("b");
    let mut probes = EndpointProbes::new(rules());
    let mut now = start();
    assert!(probes.track(&[three()], |_| true, now).is_empty());
    let mut tx = 0;
    let mut read = |_at: Now, answered: Option<i64>| {
        tx += 148;
        BTreeMap::from([(key, reading(tx, answered))])
    };
    probes.observe(&read(now, None), now);
    // Round after round, each candidate is given its window, doubled each round (15, 30, 60,
    // then 120 s), and moved from the moment it passes, not before.
    let mut waits = Vec::new();
    for round in 0..7u32 {
        for _ in 0..3 {
            let wait = WINDOW * (1 << round.min(MAX_BACKOFF));
            let just_before = now.after(wait - Duration::from_secs(1));
            assert!(
                probes
                    .observe(&read(just_before, None), just_before)
                    .is_empty(),
                "round {round}: moved before {wait:?}"
            );
            assert!(probes
                .next_check()
                .is_some_and(|due| due <= now.after(wait).instant));
            now = now.after(wait);
            let moves = probes.observe(&read(now, None), now);
            assert_eq!(moves.len(), 1, "round {round}: {moves:?}");
            waits.push(wait.as_secs());
        }
    }
    assert_eq!(
        waits,
        [
            15, 15, 15, 30, 30, 30, 60, 60, 60, 120, 120, 120, 120, 120, 120, 120, 120, 120, 120,
            120, 120
        ]
    );
    // A handshake at last: the next failure is judged on the plain window again.
    let shaken = now.after(Duration::from_secs(2));
    assert!(probes
        .observe(&read(shaken, Some(shaken.unix_ms)), shaken)
        .is_empty());
    assert_eq!(probes.statuses()[0].state, ProbeState::Working);
    let quiet = shaken.after(SESSION_LIFETIME + WINDOW + Duration::from_secs(1));
    let moves = probes.observe(&read(quiet, Some(shaken.unix_ms)), quiet);
    assert_eq!(moves.len(), 1, "{moves:?}");
    let next = quiet.after(WINDOW);
    assert_eq!(
        probes.observe(&read(next, None), next).len(),
        1,
        "15 s again"
    );
}

#[test]
fn the_revision_changes_with_what_the_statuses_show_only() {
    let key = Key::padded("b");
    let mut probes = EndpointProbes::new(rules());
    let t0 = start();
    let first = probes.revision();
    probes.track(&[three()], |_| true, t0);
    let tracked = probes.revision();
    assert_ne!(tracked, first, "a new peer");
    probes.track(&[three()], |_| true, t0.after(Duration::from_secs(1)));
    assert_eq!(probes.revision(), tracked, "the same list again");
    let read = |tx| BTreeMap::from([(key, reading(tx, None))]);
    probes.observe(&read(100), t0.after(Duration::from_secs(1)));
    assert_eq!(probes.revision(), tracked, "a reading that moves nothing");
    probes.observe(&read(400), t0.after(WINDOW + Duration::from_secs(1)));
    let moved = probes.revision();
    assert_ne!(moved, tracked, "a move");
    probes.track(&[], |_| true, t0.after(WINDOW * 2));
    assert_ne!(probes.revision(), moved, "a peer forgotten");
}
