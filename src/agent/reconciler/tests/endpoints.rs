//! Endpoint candidates in the machine: the mesh step configures a peer's first usable
//! candidate, the device's readings move it to the next, and the next pass writes it and
//! starts a handshake there.

use std::collections::BTreeMap;

use super::*;
use control::journal::Reason;
use control::peer_status::PeerReading;

fn reading(tx_bytes: u64, last_handshake_ms: Option<i64>) -> BTreeMap<Key, PeerReading> {
    BTreeMap::from([(
        Key::padded("c"),
        PeerReading {
            endpoint: None,
            last_handshake_ms,
            rx_bytes: 0,
            tx_bytes,
        },
    )])
}

fn endpoint_for_c(log: &PassLog) -> Option<String> {
    let (peers, _) = log.device.as_ref()?;
    peers
        .iter()
        .find(|(key, _)| *key == Key::padded("c"))
        .and_then(|(_, e)| e.clone())
}

#[test]
fn a_peers_candidates_are_tried_in_turn_and_a_working_one_kept() {
    let mut bench = Bench::settled(&["--endpoint-probe-window=3s"]);
    bench.core.take_events(0);
    // c (l2's leader, a's only WireGuard peer) publishes three candidates; this host has no
    // IPv6 address.
    bench.annotate(
        "c",
        annotation::ENDPOINTS,
        "198.51.100.3:51820,[2001:db8::3]:51820,203.0.113.3:51820,nonsense",
    );
    let pass = bench.pass(Trigger::Event);
    assert_eq!(
        endpoint_for_c(&pass).as_deref(),
        Some("198.51.100.3:51820"),
        "{pass:?}"
    );
    let events = bench.core.take_events(0);
    let refused: Vec<_> = events
        .iter()
        .filter(|e| e.reason == Reason::EndpointRefused)
        .collect();
    assert_eq!(refused.len(), 1, "{events:?}");
    assert!(
        refused[0].message.contains("[2001:db8::3]:51820")
            && refused[0].message.contains("no IPv6 address"),
        "{}",
        refused[0].message
    );
    assert!(
        events.iter().any(|e| e.reason == Reason::BadAnnotation
            && e.message.contains("kilotun.io/endpoints")
            && e.message.contains("nonsense")),
        "{events:?}"
    );
    let due = bench.core.timers_due();
    assert!(
        due.contains(&(bench.now.instant + Duration::from_secs(3), Timer::Endpoints)),
        "{due:?}"
    );

    // The device sends and hears nothing for a window: c moves to its next usable candidate.
    assert_eq!(
        bench.core.endpoint_readings(&reading(100, None), bench.now),
        0
    );
    bench.advance(Duration::from_secs(3));
    assert_eq!(
        bench.core.on_timeout(Timer::Endpoints, bench.now),
        Wake::ReadPeers
    );
    assert_eq!(
        bench.core.endpoint_readings(&reading(400, None), bench.now),
        1
    );
    let left: Vec<_> = bench
        .core
        .take_events(0)
        .into_iter()
        .filter(|e| e.reason == Reason::EndpointCandidateLeft)
        .collect();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].subject, "c");
    let pass = bench.pass(Trigger::Endpoints);
    assert_eq!(
        endpoint_for_c(&pass).as_deref(),
        Some("203.0.113.3:51820"),
        "{pass:?}"
    );
    assert_eq!(
        pass.device.as_ref().map(|(_, h)| h.clone()),
        Some(vec![Key::padded("c")]),
        "a handshake at once on the new candidate"
    );

    // A handshake there: it is kept, through resyncs and windows.
    bench.advance(Duration::from_secs(1));
    let shaken = Some(bench.now.unix_ms);
    assert_eq!(
        bench
            .core
            .endpoint_readings(&reading(900, shaken), bench.now),
        0
    );
    for _ in 0..5 {
        bench.advance(Duration::from_secs(10));
        assert_eq!(
            bench
                .core
                .endpoint_readings(&reading(900, shaken), bench.now),
            0
        );
    }
    let pass = bench.pass(Trigger::Resync);
    assert_eq!(endpoint_for_c(&pass).as_deref(), Some("203.0.113.3:51820"));
    let status = &bench.core.endpoint_statuses()[0];
    assert_eq!(status.state, control::endpoints::ProbeState::Working);
    assert_eq!(status.left.len(), 1);
}

#[test]
fn a_node_publishes_its_addresses_as_candidates_and_none_without_an_endpoint() {
    let mut bench = Bench::new(&["--advertise-endpoints=!10.0.0.0/8"]);
    bench.listing.addresses.extend([
        (2, "198.51.100.10/24".parse().unwrap()),
        (2, "10.1.1.1/24".parse().unwrap()),
    ]);
    let pass = bench.pass(Trigger::Event);
    let patch = pass.patch.expect("the first pass publishes");
    assert_eq!(
        patch
            .get(annotation::ENDPOINTS)
            .cloned()
            .flatten()
            .as_deref(),
        Some("198.51.100.10:51820,192.168.0.10:51820"),
        "{patch:?}"
    );
    let mut bench = Bench::new(&[]);
    bench.annotate("a", annotation::FORCE_ENDPOINT, "-");
    let patch = bench.pass(Trigger::Event).patch.expect("published");
    assert!(
        patch
            .get(annotation::ENDPOINTS)
            .cloned()
            .flatten()
            .is_none(),
        "{patch:?}"
    );
}

#[test]
fn a_peer_found_behind_nat_is_sent_to_its_discovered_endpoint_and_not_probed() {
    let mut bench = Bench::settled(&["--endpoint-probe-window=3s"]);
    bench.annotate(
        "c",
        annotation::ENDPOINTS,
        "198.51.100.3:51820,203.0.113.3:51820",
    );
    bench.annotate("c", annotation::PERSISTENT_KEEPALIVE, "10");
    let key = Key::padded("c");
    bench.annotate(
        "b",
        annotation::DISCOVERED_ENDPOINTS,
        &format!(r#"{{"{key}":{{"IP":"192.0.2.9","Port":40000,"Zone":""}}}}"#),
    );
    let pass = bench.pass(Trigger::Event);
    assert_eq!(
        endpoint_for_c(&pass).as_deref(),
        Some("192.0.2.9:40000"),
        "{pass:?}"
    );
    assert!(
        bench.core.endpoint_statuses().is_empty(),
        "{:?}",
        bench.core.endpoint_statuses()
    );
    // A window of traffic with no handshake moves nothing: the discovered endpoint stays.
    assert_eq!(
        bench.core.endpoint_readings(&reading(100, None), bench.now),
        0
    );
    bench.advance(Duration::from_secs(4));
    bench.core.endpoint_readings(&reading(200, None), bench.now);
    let again = bench.pass(Trigger::Endpoints);
    if let Some(endpoint) = endpoint_for_c(&again) {
        assert_eq!(endpoint, "192.0.2.9:40000");
    }
    assert!(bench
        .core
        .take_events(0)
        .iter()
        .all(|e| e.reason != Reason::EndpointCandidateLeft));
}
