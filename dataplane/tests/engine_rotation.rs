//! A node that changes its private key, followed by a peer that holds its next key as a
//! successor entry ([`PeerConfig::replaces`]): over an in-memory wire, no packet is lost on
//! either side once the rotating side has handshaken under its new key.

use std::time::{Duration, Instant};

use dataplane::testing::{EnginePair, Side};
use dataplane::{DeviceConfig, DropReason, PeerConfig, SecretKey};

/// A's configuration with B's next key beside its current one: the successor has B's endpoint,
/// no allowed IPs of its own and replaces B's current key.
fn with_successor(a: &Side, b: &Side, next: &SecretKey) -> DeviceConfig {
    let mut config = a.config_with_peer(b);
    let mut successor = PeerConfig::new(next.public_key());
    successor.endpoint = Some(b.addr);
    successor.replaces = Some(b.key.public_key());
    config.peers.push(successor);
    config
}

#[test]
fn a_peer_that_rotates_its_key_is_followed_with_no_packet_lost() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"before");
    pair.send_b_to_a(now, b"before");

    // A learns B's next key; until B uses it, A still sends to B's current key.
    let next = SecretKey::generate();
    let report = pair
        .a
        .engine
        .apply(&with_successor(&pair.a, &pair.b, &next));
    assert_eq!(report.added, vec![next.public_key()]);
    pair.send_a_to_b(now, b"still old");
    assert_eq!(pair.b.delivered.len(), 2);

    // B switches: every session restarts and B initiates at its next tick.
    let old_b = std::mem::replace(&mut pair.b.key, next.clone());
    let report = pair.b.engine.apply(&pair.b.config_with_peer(&pair.a));
    assert!(report.private_key_changed);
    let later = now + Duration::from_millis(300);
    pair.tick(later);

    // A now sends to B's new key and takes B's packets from it, on B's allowed IPs.
    pair.send_a_to_b(later, b"after");
    pair.send_b_to_a(later, b"after");
    assert_eq!(pair.b.delivered.len(), 3, "A's packet reached B's new key");
    assert_eq!(
        pair.a.delivered.len(),
        2,
        "B's packet from its new key reached A"
    );
    assert_eq!(pair.a.engine.drops().get(DropReason::SourceNotAllowed), 0);
    let stats = pair.a.engine.peer_stats();
    let successor = stats
        .iter()
        .find(|s| s.public_key == next.public_key())
        .unwrap();
    assert_eq!(successor.handshakes, 1);
    assert!(successor.rx_bytes > 0 && successor.tx_bytes > 0);

    // The configuration then moves B's allowed IPs to the new key and drops the old one: the
    // session is kept.
    let mut settled = pair.a.config_with_peer(&pair.b);
    settled.peers[0].endpoint = Some(pair.b.addr);
    let report = pair.a.engine.apply(&settled);
    assert_eq!(report.removed, vec![old_b.public_key()]);
    assert_eq!(report.kept, vec![next.public_key()]);
    pair.send_a_to_b(later, b"settled");
    assert_eq!(pair.b.delivered.len(), 4);
}

#[test]
fn a_successor_not_heard_from_takes_nothing_over() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"one");
    let next = SecretKey::generate();
    pair.a
        .engine
        .apply(&with_successor(&pair.a, &pair.b, &next));
    pair.tick(now + Duration::from_millis(300));
    pair.send_a_to_b(now, b"two");
    pair.send_b_to_a(now, b"three");
    assert_eq!(pair.b.delivered.len(), 2);
    assert_eq!(pair.a.delivered.len(), 1);
    let stats = pair.a.engine.peer_stats();
    let successor = stats
        .iter()
        .find(|s| s.public_key == next.public_key())
        .unwrap();
    assert_eq!(
        successor.tx_bytes, 0,
        "a successor B never used carries nothing"
    );
}

#[test]
fn a_successor_does_not_widen_what_its_peer_may_send() {
    // The successor speaks for the peer it replaces, and for no other peer's addresses.
    let anchor = (Instant::now(), std::time::SystemTime::now());
    let (a, b, c) = (
        Side::numbered(anchor, 1),
        Side::numbered(anchor, 2),
        Side::numbered(anchor, 3),
    );
    let mut config = a.config_with_peer(&b);
    let mut third = PeerConfig::new(c.key.public_key());
    third.add_allowed_ip(ipnet::IpNet::from(c.tunnel_ip));
    config.peers.push(third);
    let next = SecretKey::generate();
    let mut successor = PeerConfig::new(next.public_key());
    successor.replaces = Some(b.key.public_key());
    config.peers.push(successor);
    a.engine.apply(&config);
    let b_next = Side { key: next, ..b };
    b_next.engine.apply(&b_next.config_with_peer(&a));
    let mut pair = EnginePair { a, b: b_next };
    let now = Instant::now();
    // B (under its next key) claims C's address: refused.
    let spoofed = dataplane::testing::ip_packet(c.tunnel_ip, pair.a.tunnel_ip, b"spoof");
    let mut out = dataplane::Outbox::default();
    pair.b
        .engine
        .handle_tunnel_packets(now, [spoofed.as_slice()], &mut out);
    pair.run(now, out, false);
    assert!(pair.a.delivered.is_empty());
    assert_eq!(pair.a.engine.drops().get(DropReason::SourceNotAllowed), 1);
}
