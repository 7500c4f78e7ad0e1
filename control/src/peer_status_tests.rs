use super::*;
use crate::fixtures::{f1_nodes, f1_params, f1_peers};
use crate::node::Granularity;
use keys::SecretKey;

const NOW: i64 = 1_780_000_000_000;

fn topology(hostname: &str) -> Arc<Topology> {
    let mut peers = f1_peers();
    peers[1].preshared_key = Some(SecretKey::from_bytes(Key::padded("psk").0));
    let t = Topology::new(
        &f1_nodes(),
        &peers,
        &f1_params(hostname, Granularity::Location),
    );
    Arc::new(t.unwrap())
}

fn reading(handshake_ago_ms: i64) -> PeerReading {
    PeerReading {
        endpoint: Some("192.168.0.1:51820".parse().unwrap()),
        last_handshake_ms: Some(NOW - handshake_ago_ms),
        rx_bytes: 100,
        tx_bytes: 200,
    }
}

#[test]
fn only_the_first_segments_leader_writes() {
    let writers: Vec<&str> = ["a", "b", "c", "d"]
        .into_iter()
        .filter(|n| writes_peer_status(&topology(n)))
        .collect();
    assert_eq!(writers, ["a"]);
}

#[test]
fn a_status_names_every_server_and_holds_the_peers_configuration_without_keys() {
    let t = topology("a");
    let readings = BTreeMap::from([(Key::padded("key5"), reading(5_000))]);
    let all = statuses(&t, &readings, NOW);
    assert_eq!(all.keys().collect::<Vec<_>>(), ["a", "b"]);
    let b = &all["b"];
    assert_eq!(b.reporter, "a");
    // d has no private IP: a segment of its own in location 1, with its own leader.
    assert_eq!(&*b.servers, "1=a, 2=b, 1=d");
    assert!(b.connected);
    assert_eq!(b.endpoint.as_deref(), Some("192.168.0.1:51820"));
    assert_eq!((b.rx_bytes, b.tx_bytes), (100, 200));
    let at = b.last_handshake_time.as_deref().unwrap();
    assert!(at.ends_with('Z') && at.len() == 20, "{at}");
    assert!(b.config.starts_with("[Peer]\n"), "{}", b.config);
    assert_eq!(
        b.config.matches("[Peer]").count(),
        4,
        "three segments, one other Peer"
    );
    let psk = Key::padded("psk").to_base64();
    assert!(!b.config.contains(&psk) && !b.config.contains("PresharedKey"));
    // A Peer the engine has not heard from is not connected and has no reading.
    let a = &all["a"];
    assert!(!a.connected && a.endpoint.is_none() && a.last_handshake_time.is_none());
    let json = serde_json::to_value(a).unwrap();
    // None is sent as null: in a merge patch that removes what an earlier write left.
    assert!(json.get("servedBy").is_some() && json["lastHandshakeTime"].is_null());
    assert!(json.as_object().unwrap().contains_key("endpoint"));
}

#[test]
fn a_stale_handshake_is_not_connected() {
    let t = topology("a");
    let stale = BTreeMap::from([(Key::padded("key5"), reading(CONNECTED_WITHIN_MS + 1))]);
    assert!(!statuses(&t, &stale, NOW)["b"].connected);
}

#[test]
fn rfc3339_counts_days_and_leap_years() {
    assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
    assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00Z");
    assert_eq!(rfc3339(1_796_281_199_000), "2026-12-03T06:59:59Z");
}

#[test]
fn writes_are_due_on_a_change_at_most_every_interval_and_on_the_heartbeat() {
    let t = topology("a");
    let mut book = PeerStatusBook::default();
    let at = |ago| BTreeMap::from([(Key::padded("key5"), reading(ago))]);
    // First sight: both written.
    let first = book.due(&statuses(&t, &at(5_000), NOW), NOW);
    assert_eq!(first.len(), 2);
    for w in first {
        book.written(w, NOW);
    }
    // Bytes and handshake times alone move: nothing until the heartbeat.
    let later = NOW + 60_000;
    let moved = statuses(&t, &at(1_000), later);
    assert!(book.due(&moved, later).is_empty());
    // Disconnected: due, but not within the interval of the last write.
    let soon = NOW + 5_000;
    let gone = statuses(&t, &BTreeMap::new(), soon);
    assert!(book.due(&gone, soon).is_empty());
    let due = book.due(&gone, NOW + MIN_WRITE_INTERVAL_MS);
    assert_eq!(
        due.iter().map(|w| w.peer.as_str()).collect::<Vec<_>>(),
        ["b"]
    );
    // The heartbeat writes every Peer again.
    let beat = NOW + HEARTBEAT_MS;
    assert_eq!(book.due(&statuses(&t, &at(1_000), beat), beat).len(), 2);
    // A Peer that left is forgotten: back, it is written at once.
    let mut only_a = statuses(&t, &BTreeMap::new(), later);
    let b = only_a.remove("b").unwrap();
    assert!(book.due(&only_a, later).is_empty());
    only_a.insert("b".into(), b);
    assert_eq!(book.due(&only_a, later).len(), 1);
}

#[test]
fn the_configurations_are_made_again_only_when_the_topology_changes() {
    let mut shapes = PeerShapes::default();
    let readings = BTreeMap::new();
    let first = shapes.statuses(&topology("a"), &readings, NOW);
    // An equal topology in a new allocation, as every pass makes: the same configuration.
    let again = shapes.statuses(&topology("a"), &readings, NOW + 1_000);
    assert!(Arc::ptr_eq(&first["b"].config, &again["b"].config));
    assert!(Arc::ptr_eq(&first["b"].served_by, &again["b"].served_by));
    // Another topology (another reporter): made again.
    let other = shapes.statuses(&topology("d"), &readings, NOW + 2_000);
    assert!(!Arc::ptr_eq(&first["b"].served_by, &other["b"].served_by));
    assert_eq!(other["b"].reporter, "d");
    assert_eq!(
        other["b"].config, first["b"].config,
        "the same Peer's configuration, made anew"
    );
}
