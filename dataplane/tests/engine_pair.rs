//! Two engines over an in-memory wire: no sockets, no TUN, no threads.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use dataplane::testing::{ip_packet, pseudo_random_bytes, EnginePair, Side};
use dataplane::{DropReason, Outbox, PeerConfig, SecretKey};

fn payload_of(packet: &[u8]) -> &[u8] {
    &packet[20..]
}

#[test]
fn first_packet_triggers_handshake_and_is_delivered_after_it() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"hello");
    assert_eq!(
        pair.b.delivered.len(),
        1,
        "queued packet delivered once the session exists"
    );
    assert_eq!(payload_of(&pair.b.delivered[0]), b"hello");
    let a_stats = &pair.a.engine.peer_stats()[0];
    assert_eq!(a_stats.handshakes, 1);
    assert!(a_stats.last_handshake.is_some());
    assert!(a_stats.tx_bytes > 0 && a_stats.rx_bytes > 0);
}

#[test]
fn handshake_times_follow_a_wall_clock_set_after_the_engine_started() {
    // A board without a real-time clock starts in 1970; NTP sets the clock later. A handshake
    // read after that must be dated by the corrected clock, not the one the engine started with.
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"hello");
    let started_with = pair.a.engine.peer_stats()[0].last_handshake.unwrap();
    let corrected = started_with + Duration::from_secs(1_700_000_000);
    let read = pair.a.engine.peer_stats_at((now, corrected))[0]
        .last_handshake
        .unwrap();
    let off = read
        .duration_since(corrected)
        .unwrap_or_else(|e| e.duration());
    assert!(off < Duration::from_secs(1), "{read:?} vs {corrected:?}");
}

#[test]
fn data_flows_both_ways_over_one_session() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"ping");
    pair.send_b_to_a(now, b"pong");
    for i in 0..100u32 {
        pair.send_a_to_b(now, &i.to_be_bytes());
        pair.send_b_to_a(now, &i.to_le_bytes());
    }
    assert_eq!(pair.b.delivered.len(), 101);
    assert_eq!(pair.a.delivered.len(), 101);
    assert_eq!(payload_of(&pair.a.delivered[0]), b"pong");
    assert_eq!(payload_of(&pair.b.delivered[100]), &99u32.to_be_bytes());
    let handshakes: u64 =
        pair.a.engine.peer_stats()[0].handshakes + pair.b.engine.peer_stats()[0].handshakes;
    assert_eq!(handshakes, 2, "one handshake, counted once on each side");
}

#[test]
fn ipv6_inside_the_tunnel_is_routed_by_allowed_ips() {
    let mut pair = EnginePair::new();
    let a6: IpAddr = "fd00::1".parse().unwrap();
    let b6: IpAddr = "fd00::2".parse().unwrap();
    let mut a_config = pair.a.config_with_peer(&pair.b);
    a_config.peers[0].add_allowed_ip("fd00::2/128".parse().unwrap());
    pair.a.engine.apply(&a_config);
    let mut b_config = pair.b.config_with_peer(&pair.a);
    b_config.peers[0].add_allowed_ip("fd00::1/128".parse().unwrap());
    pair.b.engine.apply(&b_config);
    let now = Instant::now();
    let mut out = Outbox::default();
    let packet = ip_packet(a6, b6, b"six");
    pair.a
        .engine
        .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
    pair.run(now, out, true);
    assert_eq!(pair.b.delivered, vec![packet]);
}

#[test]
fn decrypted_packet_with_a_source_outside_allowed_ips_is_dropped() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"establish");
    // B routes by destination (A's tunnel address), so it encrypts both; A accepts from B only
    // sources in B's allowed IPs (10.0.0.2/32).
    let spoofed = ip_packet("10.9.9.9".parse().unwrap(), pair.a.tunnel_ip, b"spoof");
    let genuine = ip_packet(pair.b.tunnel_ip, pair.a.tunnel_ip, b"ok");
    let mut out = Outbox::default();
    pair.b
        .engine
        .handle_tunnel_packets(now, [spoofed.as_slice(), genuine.as_slice()], &mut out);
    assert_eq!(out.to_network.len(), 2);
    pair.run(now, out, false);
    assert_eq!(pair.a.delivered, vec![genuine]);
    assert_eq!(pair.a.engine.drops().get(DropReason::SourceNotAllowed), 1);
}

#[test]
fn reapplying_the_same_config_keeps_the_session() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"one");
    let before = pair.a.engine.peer_stats()[0].clone();
    let report = pair.a.engine.apply(&pair.a.config_with_peer(&pair.b));
    assert_eq!(report.kept, vec![pair.b.key.public_key()]);
    assert!(report.added.is_empty() && report.removed.is_empty());
    let moved = {
        let packet = ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, b"two");
        let mut out = Outbox::default();
        pair.a
            .engine
            .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
        pair.run(now, out, true)
    };
    assert_eq!(moved, 1, "one data message, no handshake");
    let after = &pair.a.engine.peer_stats()[0];
    assert_eq!(after.handshakes, before.handshakes);
    assert_eq!(after.last_handshake, before.last_handshake);
    assert!(
        after.tx_bytes > before.tx_bytes,
        "counters survive the apply"
    );
}

#[test]
fn changing_the_preshared_key_keeps_the_session_and_the_next_handshake_uses_it() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"one");
    let psk = SecretKey::generate();
    // A first: data still flows on the session both ends hold.
    let with_psk = |side: &Side, other: &Side| {
        let mut config = side.config_with_peer(other);
        config.peers[0].preshared_key = Some(psk.clone());
        config
    };
    let report = pair.a.engine.apply(&with_psk(&pair.a, &pair.b));
    assert_eq!(report.preshared_key_changed, vec![pair.b.key.public_key()]);
    assert!(report.sessions_reset.is_empty());
    assert_eq!(report.kept, vec![pair.b.key.public_key()]);
    pair.send_a_to_b(now, b"two");
    pair.send_b_to_a(now, b"back");
    assert_eq!((pair.b.delivered.len(), pair.a.delivered.len()), (2, 1));
    assert_eq!(pair.a.engine.peer_stats()[0].handshakes, 1);
    // Only A has the key: a handshake now fails, and the session in use still carries data.
    let later = now + Duration::from_secs(1);
    pair.a.engine.rekey(&pair.b.key.public_key());
    pair.tick(later);
    assert_eq!(pair.a.engine.peer_stats()[0].handshakes, 1);
    pair.send_a_to_b(later, b"three");
    assert_eq!(pair.b.delivered.len(), 3);
    // Both have it: the next handshake completes under it.
    pair.b.engine.apply(&with_psk(&pair.b, &pair.a));
    let later = later + Duration::from_secs(6);
    pair.a.engine.rekey(&pair.b.key.public_key());
    pair.tick(later);
    assert_eq!(pair.a.engine.peer_stats()[0].handshakes, 2);
    pair.send_a_to_b(later, b"four");
    assert_eq!(pair.b.delivered.len(), 4);
}

#[test]
fn handshakes_under_differing_preshared_keys_are_counted_on_both_ends_until_data_flows() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    let keyed = |side: &Side, other: &Side, psk: Option<SecretKey>| {
        let mut config = side.config_with_peer(other);
        config.peers[0].preshared_key = psk;
        config
    };
    pair.a
        .engine
        .apply(&keyed(&pair.a, &pair.b, Some(SecretKey::generate())));
    pair.b
        .engine
        .apply(&keyed(&pair.b, &pair.a, Some(SecretKey::generate())));
    // (responses A refused, answers B saw unused)
    let failed = |pair: &EnginePair| {
        (
            pair.a.engine.peer_stats()[0].refused_responses,
            pair.b.engine.peer_stats()[0].unused_answers,
        )
    };
    // A's first initiation: B answers under its key, and A cannot verify the answer.
    pair.send_a_to_b(now, b"lost");
    assert!(pair.b.delivered.is_empty());
    assert_eq!(failed(&pair), (1, 0));
    // A tries again: B sees a second initiation although its first answer was never used.
    let mut at = now;
    for _ in 0..2 {
        at += Duration::from_secs(6);
        pair.a.engine.rekey(&pair.b.key.public_key());
        pair.tick(at);
    }
    assert_eq!(failed(&pair), (3, 2));
    assert!(pair.b.delivered.is_empty());
    // Neither end counts the other kind.
    assert_eq!(pair.a.engine.peer_stats()[0].unused_answers, 0);
    assert_eq!(pair.b.engine.peer_stats()[0].refused_responses, 0);
    // Both ends without a key: the next handshake completes, and data clears both counts.
    pair.a.engine.apply(&keyed(&pair.a, &pair.b, None));
    pair.b.engine.apply(&keyed(&pair.b, &pair.a, None));
    at += Duration::from_secs(6);
    pair.a.engine.rekey(&pair.b.key.public_key());
    pair.tick(at);
    pair.send_a_to_b(at, b"through");
    // The packet queued since the first attempt goes first.
    let delivered: Vec<&[u8]> = pair.b.delivered.iter().map(|p| payload_of(p)).collect();
    assert_eq!(delivered, [&b"lost"[..], &b"through"[..]]);
    assert_eq!(failed(&pair), (0, 0));
}

#[test]
fn removed_peer_is_neither_routed_nor_accepted() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"one");
    let mut config = pair.a.config_with_peer(&pair.b);
    config.peers.clear();
    let report = pair.a.engine.apply(&config);
    assert_eq!(report.removed, vec![pair.b.key.public_key()]);
    pair.send_a_to_b(now, b"two");
    assert_eq!(pair.a.engine.drops().get(DropReason::NoRoute), 1);
    pair.send_b_to_a(now, b"three");
    assert_eq!(pair.a.engine.drops().get(DropReason::UnknownIndex), 1);
    assert!(pair.a.delivered.is_empty());
}

#[test]
fn endpoint_follows_authenticated_packets_only() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"one");
    // B's next packet arrives from a new address (NAT rebinding).
    let packet = ip_packet(pair.b.tunnel_ip, pair.a.tunnel_ip, b"roamed");
    let mut out = Outbox::default();
    pair.b
        .engine
        .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
    let roamed: SocketAddr = "198.51.100.9:40000".parse().unwrap();
    let (_, datagram) = out.to_network.get(0).unwrap();
    let datagram = datagram.to_vec();
    let mut reply = Outbox::default();
    pair.a
        .engine
        .handle_datagram(now, roamed, &datagram, &mut reply);
    assert_eq!(reply.to_tunnel.len(), 1);
    assert_eq!(pair.a.engine.peer_stats()[0].endpoint, Some(roamed));
    assert_eq!(pair.a.engine.peer_stats()[0].endpoint_changes, 1);
    // A forged datagram from elsewhere does not move the endpoint.
    let mut forged = datagram.clone();
    forged[20] ^= 0xff;
    let elsewhere: SocketAddr = "203.0.113.1:1".parse().unwrap();
    pair.a
        .engine
        .handle_datagram(now, elsewhere, &forged, &mut Outbox::default());
    assert_eq!(pair.a.engine.peer_stats()[0].endpoint, Some(roamed));
    // Re-applying the configured endpoint does not undo the roam.
    pair.a.engine.apply(&pair.a.config_with_peer(&pair.b));
    assert_eq!(pair.a.engine.peer_stats()[0].endpoint, Some(roamed));
    assert_eq!(
        pair.a.engine.peer_stats()[0].endpoint_changes,
        1,
        "neither the forgery nor the re-apply moved it"
    );
    assert_eq!(pair.a.engine.peer_stats()[0].handshake_failures, 0);
    // The replayed datagram is refused, as was the forged copy (its counter was already seen).
    pair.a
        .engine
        .handle_datagram(now, roamed, &datagram, &mut Outbox::default());
    assert_eq!(
        pair.a.engine.drops().get(DropReason::Replay),
        2,
        "{:?}",
        pair.a.engine.drops().snapshot()
    );
}

#[test]
fn handshake_from_an_unknown_key_is_refused() {
    let mut pair = EnginePair::new();
    let stranger = SecretKey::generate();
    let mut config = pair.b.config_with_peer(&pair.a);
    config.interface.private_key = Some(stranger);
    pair.b.engine.apply(&config);
    pair.send_b_to_a(Instant::now(), b"let me in");
    assert_eq!(pair.a.engine.drops().get(DropReason::UnknownPeer), 1);
    assert!(pair.a.delivered.is_empty());
}

/// A's first initiation reaches B a moment before B adds A as a peer (two nodes learning of
/// each other at once, as a new leader and the mesh do).
fn initiation_before_the_responder_knows_the_initiator(pair: &mut EnginePair, now: Instant) {
    let mut unconfigured = pair.b.config_with_peer(&pair.a);
    unconfigured.peers.clear();
    pair.b.engine.apply(&unconfigured);
    pair.send_a_to_b(now, b"early");
    assert_eq!(pair.b.engine.drops().get(DropReason::UnknownPeer), 1);
    assert!(pair.b.delivered.is_empty());
    pair.b.engine.apply(&pair.b.config_with_peer(&pair.a));
}

/// What one run of `side`'s timers at `now` sends.
fn timer_output(side: &Side, now: Instant) -> Outbox {
    let mut out = Outbox::default();
    side.engine.handle_timers(now, &mut out);
    out
}

#[test]
fn an_initiation_that_beat_its_senders_configuration_is_answered_at_the_next_tick() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    initiation_before_the_responder_knows_the_initiator(&mut pair, now);
    // B's next timer tick answers the held initiation: no wait for A's retry (5 s later), so
    // the clock does not move here.
    let out = timer_output(&pair.b, now);
    assert_eq!(out.to_network.len(), 1, "the handshake response");
    pair.run(now, out, false);
    assert_eq!(
        pair.b.delivered.len(),
        1,
        "A's queued packet, sent once the session is up"
    );
    assert_eq!(payload_of(&pair.b.delivered[0]), b"early");
    assert_eq!(pair.b.engine.peer_stats()[0].handshakes, 1);
    assert!(
        timer_output(&pair.b, now).to_network.is_empty(),
        "answered once"
    );
}

#[test]
fn a_held_initiation_expires_after_the_initiators_retry_time() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    initiation_before_the_responder_knows_the_initiator(&mut pair, now);
    assert!(
        timer_output(&pair.b, now + Duration::from_secs(5))
            .to_network
            .is_empty(),
        "by now A has sent a fresh initiation"
    );
    assert!(pair.b.delivered.is_empty());
}

#[test]
fn random_datagrams_are_counted_and_never_panic() {
    let pair = EnginePair::new();
    let now = Instant::now();
    let from: SocketAddr = "203.0.113.7:9".parse().unwrap();
    let mut out = Outbox::default();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for len in 0..600usize {
        let bytes = pseudo_random_bytes(&mut state, len);
        pair.a.engine.handle_datagram(now, from, &bytes, &mut out);
        // Messages with valid types and sizes but random contents.
        for kind in [1u8, 2, 3, 4] {
            let mut typed = bytes.clone();
            if typed.len() >= 4 {
                typed[..4].copy_from_slice(&[kind, 0, 0, 0]);
                pair.a.engine.handle_datagram(now, from, &typed, &mut out);
            }
        }
        for size in [148usize, 92, 64, 32] {
            let mut sized = vec![0u8; size];
            sized[0] = match size {
                148 => 1,
                92 => 2,
                64 => 3,
                _ => 4,
            };
            pair.a.engine.handle_datagram(now, from, &sized, &mut out);
        }
    }
    assert!(out.to_tunnel.is_empty());
    assert!(pair.a.engine.drops().get(DropReason::Malformed) > 0);
    assert!(pair.a.engine.drops().get(DropReason::InvalidMac) > 0);
    assert!(pair.a.engine.drops().get(DropReason::UnknownIndex) > 0);
}

#[test]
fn persistent_keepalive_is_sent_on_an_idle_tunnel_at_its_interval() {
    let mut pair = EnginePair::new();
    let mut config = pair.a.config_with_peer(&pair.b);
    config.peers[0].persistent_keepalive = 5;
    pair.a.engine.apply(&config);
    let start = Instant::now();
    // Enabling it sends one at once (here: a handshake first, then the keepalive).
    pair.tick(start);
    assert_eq!(pair.b.engine.peer_stats()[0].handshakes, 1);
    let rx_after_handshake = pair.b.engine.peer_stats()[0].rx_bytes;
    let mut sent_at = Vec::new();
    let mut last_rx = rx_after_handshake;
    for step in 1..=80u64 {
        let now = start + Duration::from_millis(250 * step);
        pair.tick(now);
        let rx = pair.b.engine.peer_stats()[0].rx_bytes;
        if rx > last_rx {
            sent_at.push(now.duration_since(start));
            last_rx = rx;
        }
    }
    // 20 s idle with a 5 s interval: keepalives at 5, 10, 15, 20 s.
    assert_eq!(
        sent_at,
        (1..=4)
            .map(|i| Duration::from_secs(5 * i))
            .collect::<Vec<_>>()
    );
}

#[test]
fn packets_without_endpoint_or_route_are_dropped_by_reason() {
    let pair = EnginePair::new();
    let mut config = pair.a.config_with_peer(&pair.b);
    config.peers[0].endpoint = None;
    config.peers.push({
        let mut p = PeerConfig::new(SecretKey::generate().public_key());
        p.add_allowed_ip("10.7.0.0/16".parse().unwrap());
        p
    });
    let fresh = dataplane::Engine::new((Instant::now(), std::time::SystemTime::now()), 1);
    fresh.apply(&config);
    let now = Instant::now();
    let mut out = Outbox::default();
    let to_peer = ip_packet(pair.a.tunnel_ip, "10.7.1.1".parse().unwrap(), b"x");
    let nowhere = ip_packet(pair.a.tunnel_ip, "172.16.0.1".parse().unwrap(), b"x");
    fresh.handle_tunnel_packets(
        now,
        [to_peer.as_slice(), nowhere.as_slice(), &[0x45, 0]],
        &mut out,
    );
    assert!(out.to_network.is_empty());
    assert_eq!(fresh.drops().get(DropReason::NoEndpoint), 1);
    assert_eq!(fresh.drops().get(DropReason::NoRoute), 1);
    assert_eq!(fresh.drops().get(DropReason::NotIp), 1);
}

#[test]
fn a_handshake_flood_engages_cookie_replies_and_a_real_peer_still_connects() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    // A stranger who knows A's public key can make initiations with a valid MAC1.
    let mut stranger = boringtun::noise::Tunn::new(
        SecretKey::generate().to_dalek(),
        pair.a.key.public_key().to_dalek(),
        None,
        None,
        1,
        None,
    );
    let mut out = Outbox::default();
    let mut buf = [0u8; 256];
    for i in 0..300u32 {
        let boringtun::noise::TunnResult::WriteToNetwork(init) =
            stranger.format_handshake_initiation(&mut buf, true)
        else {
            panic!("no initiation");
        };
        let spoofed = SocketAddr::from(([198, 18, (i >> 8) as u8, i as u8], 1000));
        pair.a.engine.handle_datagram(now, spoofed, init, &mut out);
    }
    let cookies = pair.a.engine.drops().get(DropReason::CookieReplySent);
    assert!(
        cookies >= 150,
        "cookie replies engaged after the limit: {cookies}"
    );
    assert!(out
        .to_network
        .iter()
        .all(|(_, p)| p.len() == 64 && p[0] == 3));
    // The limiter resets each second (boringtun's limiter reads its own clock, so real time
    // must pass): a real peer completes its handshake afterwards.
    std::thread::sleep(Duration::from_millis(1100));
    let later = now + Duration::from_secs(2);
    pair.a.engine.handle_timers(later, &mut Outbox::default());
    pair.send_b_to_a(later, b"still here");
    assert_eq!(pair.a.delivered.len(), 1);
}

/// Delivers `out`, produced by `sides[from]`, to the sides its datagrams are addressed to, and
/// their answers back, until nothing more is sent. Each side's decrypted packets go to its
/// `delivered`.
fn run_wire(now: Instant, sides: &mut [&mut Side], from: usize, out: Outbox) {
    let mut pending = std::collections::VecDeque::from([(from, out)]);
    while let Some((sender, out)) = pending.pop_front() {
        sides[sender]
            .delivered
            .extend(out.to_tunnel.iter().map(|(_, p)| p.to_vec()));
        let source = sides[sender].addr;
        for (to, datagram) in out.to_network.iter() {
            let receiver = sides
                .iter()
                .position(|s| Some(s.addr) == to)
                .expect("datagram to a known side");
            let mut reply = Outbox::default();
            sides[receiver]
                .engine
                .handle_datagram(now, source, datagram, &mut reply);
            pending.push_back((receiver, reply));
        }
    }
}

#[test]
fn a_batch_that_alternates_between_peers_counts_and_routes_each_packet_to_its_own_peer() {
    let anchor = (Instant::now(), std::time::SystemTime::now());
    let side = |n: u8| Side {
        engine: dataplane::Engine::new(anchor, u32::from(n) << 12),
        key: SecretKey::generate(),
        addr: SocketAddr::from(([192, 0, 2, n], 51820)),
        tunnel_ip: IpAddr::from([10, 0, 0, n]),
        delivered: Vec::new(),
    };
    let (mut hub, mut b, mut c) = (side(1), side(2), side(3));
    let mut hub_config = hub.config_with_peer(&b);
    hub_config.peers.extend(hub.config_with_peer(&c).peers);
    hub.engine.apply(&hub_config);
    b.engine.apply(&b.config_with_peer(&hub));
    c.engine.apply(&c.config_with_peer(&hub));
    let now = Instant::now();
    let to = |side: &Side, text: &str| ip_packet(hub.tunnel_ip, side.tunnel_ip, text.as_bytes());
    let (b1, c1, b2, b3, c2) = (
        to(&b, "b1"),
        to(&c, "c1"),
        to(&b, "b2"),
        to(&b, "b3"),
        to(&c, "c2"),
    );
    let nowhere = ip_packet(hub.tunnel_ip, "10.9.9.9".parse().unwrap(), b"lost");

    // Bring both sessions up, then send one batch that switches peers at every other packet.
    for first in [&b1, &c1] {
        let mut out = Outbox::default();
        hub.engine
            .handle_tunnel_packets(now, [first.as_slice()], &mut out);
        run_wire(now, &mut [&mut hub, &mut b, &mut c], 0, out);
    }
    let before: Vec<_> = hub.engine.peer_stats();
    let batch = [&b2, &c2, &nowhere, &b3, &b3, &c2];
    let mut out = Outbox::default();
    hub.engine
        .handle_tunnel_packets(now, batch.iter().map(|p| p.as_slice()), &mut out);
    assert_eq!(out.to_network.len(), 5, "the unroutable packet is dropped");
    let sent_to = |side: &Side| -> u64 {
        out.to_network
            .iter()
            .filter(|(to, _)| *to == Some(side.addr))
            .map(|(_, d)| d.len() as u64)
            .sum()
    };
    let after = hub.engine.peer_stats();
    assert_eq!(after[0].tx_bytes - before[0].tx_bytes, sent_to(&b));
    assert_eq!(after[1].tx_bytes - before[1].tx_bytes, sent_to(&c));
    assert_eq!(hub.engine.drops().get(DropReason::NoRoute), 1);
    run_wire(now, &mut [&mut hub, &mut b, &mut c], 0, out);
    assert_eq!(b.delivered, vec![b1, b2, b3.clone(), b3]);
    assert_eq!(c.delivered, vec![c1, c2.clone(), c2]);

    // The other way: one batch of datagrams from B and C interleaved, one of C's carrying B's
    // address as its source (a reverse-path violation the per-batch lookup cache must not hide).
    let from = |side: &Side, source: IpAddr, text: &str| {
        let mut out = Outbox::default();
        let packet = ip_packet(source, hub.tunnel_ip, text.as_bytes());
        side.engine
            .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
        let (_, datagram) = out.to_network.iter().next().expect("sealed");
        (side.addr, datagram.to_vec(), packet)
    };
    let incoming = [
        from(&b, b.tunnel_ip, "from b"),
        from(&c, b.tunnel_ip, "c posing as b"),
        from(&c, c.tunnel_ip, "from c"),
        from(&b, b.tunnel_ip, "from b again"),
    ];
    let before = hub.engine.peer_stats();
    let mut out = Outbox::default();
    hub.engine.handle_datagrams(
        now,
        incoming.iter().map(|(addr, d, _)| (*addr, d.as_slice())),
        &mut out,
    );
    let delivered: Vec<_> = out.to_tunnel.iter().map(|(_, p)| p.to_vec()).collect();
    let expected: Vec<_> = [0, 2, 3].iter().map(|&i| incoming[i].2.clone()).collect();
    assert_eq!(delivered, expected);
    assert_eq!(hub.engine.drops().get(DropReason::SourceNotAllowed), 1);
    let received_from = |side: &Side| -> u64 {
        incoming
            .iter()
            .filter(|(addr, _, _)| *addr == side.addr)
            .map(|(_, d, _)| d.len() as u64)
            .sum()
    };
    let after = hub.engine.peer_stats();
    assert_eq!(after[0].rx_bytes - before[0].rx_bytes, received_from(&b));
    assert_eq!(
        after[1].rx_bytes - before[1].rx_bytes,
        received_from(&c),
        "an authenticated packet refused for its source still counts as received"
    );
}

/// B's process restarts: a fresh engine with B's key and its last configuration, and A still
/// holding the session that died with the old one.
fn restart_b(pair: &mut EnginePair) {
    let anchor = (Instant::now(), std::time::SystemTime::now());
    let mut fresh = dataplane::testing::Side::numbered(anchor, 2);
    fresh.key = pair.b.key.clone();
    fresh.engine.apply(&fresh.config_with_peer(&pair.a));
    pair.b = fresh;
}

#[test]
fn a_restarted_engine_that_initiates_handshakes_is_reached_again_at_its_first_tick() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"before");
    assert_eq!(pair.b.delivered.len(), 1);

    // Without the call, A's data on the dead session is refused and nothing is sent back.
    restart_b(&mut pair);
    pair.send_a_to_b(now, b"lost");
    assert!(pair.b.delivered.is_empty(), "the old session died with B");
    assert!(
        timer_output(&pair.b, now).to_network.is_empty(),
        "a restored peer alone starts no handshake"
    );

    restart_b(&mut pair);
    assert_eq!(pair.b.engine.initiate_handshakes(), 1);
    let out = timer_output(&pair.b, now);
    assert_eq!(out.to_network.len(), 1, "B's handshake initiation");
    pair.run(now, out, false);
    assert_eq!(pair.b.engine.peer_stats()[0].handshakes, 1);
    pair.send_a_to_b(now, b"after");
    assert_eq!(
        pair.b.delivered.len(),
        1,
        "A's data reaches B on the new session"
    );
    assert_eq!(payload_of(&pair.b.delivered[0]), b"after");
    assert_eq!(
        pair.b.engine.initiate_handshakes(),
        0,
        "a peer with a session is not asked again"
    );
}

/// What `kgctl diagnose` and the metrics use to name a link whose traffic fails: since when
/// data (or a handshake initiation) has gone out with nothing authenticated coming back.
#[test]
fn unanswered_traffic_is_dated_from_its_first_packet_and_cleared_by_any_answer() {
    let mut pair = EnginePair::new();
    let start = Instant::now();
    pair.send_a_to_b(start, b"ping");
    pair.send_b_to_a(start, b"pong");
    let unanswered = |pair: &EnginePair| pair.a.engine.peer_stats()[0].unanswered_since;
    assert_eq!(unanswered(&pair), None, "the pong answered the ping");

    // The wire is cut: A sends for a while and nothing comes back.
    let cut_at = start + Duration::from_secs(1);
    for step in 0..40u64 {
        let now = cut_at + Duration::from_millis(500 * step);
        let packet = ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, b"lost");
        let mut lost = Outbox::default();
        pair.a
            .engine
            .handle_tunnel_packets(now, [packet.as_slice()], &mut lost);
        assert!(!lost.to_network.is_empty(), "A sent something");
        let mut lost = Outbox::default();
        pair.a.engine.handle_timers(now, &mut lost); // retries go nowhere either
    }
    let since = unanswered(&pair).expect("A's data awaits an answer");
    let first_loss = pair.a.engine.peer_stats()[0].last_handshake.unwrap() + Duration::from_secs(1);
    let off = since
        .duration_since(first_loss)
        .unwrap_or_else(|e| e.duration());
    assert!(
        off < Duration::from_millis(5),
        "dated from the first unanswered packet, not the last: {since:?} vs {first_loss:?}"
    );

    // The wire is back: B's next packet is an answer, and clears it.
    let healed = cut_at + Duration::from_secs(25);
    pair.send_b_to_a(healed, b"back");
    assert_eq!(unanswered(&pair), None, "an answer clears it");
}

/// A keepalive expects no answer: a link that carries only keepalives (a node behind NAT
/// keeping its mapping open) never counts as unanswered.
#[test]
fn keepalives_alone_never_count_as_unanswered() {
    let mut pair = EnginePair::new();
    let mut config = pair.a.config_with_peer(&pair.b);
    config.peers[0].persistent_keepalive = 5;
    pair.a.engine.apply(&config);
    let start = Instant::now();
    pair.tick(start);
    for step in 1..=120u64 {
        pair.tick(start + Duration::from_millis(250 * step));
    }
    assert!(pair.b.engine.peer_stats()[0].rx_bytes > 0);
    assert_eq!(pair.a.engine.peer_stats()[0].unanswered_since, None);
    assert_eq!(pair.b.engine.peer_stats()[0].unanswered_since, None);
}

#[test]
fn what_goes_to_a_peer_leaves_from_the_local_address_it_reached_until_that_is_forgotten() {
    use dataplane::{Endpoint, LocalAddr};
    let pair = EnginePair::new();
    let now = Instant::now();
    let a_key = pair.a.key.public_key();
    // B has a second address, 192.0.2.22, and A reaches it there.
    let reached = LocalAddr::new(IpAddr::from([192, 0, 2, 22]));
    let at_reached = Endpoint::new(pair.a.addr, Some(reached));
    let packet = ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, b"hi");
    let mut out = Outbox::default();
    pair.a
        .engine
        .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
    let (_, initiation) = out.to_network.iter().next().expect("an initiation");
    let mut response = Outbox::default();
    pair.b
        .engine
        .handle_datagram(now, at_reached, initiation, &mut response);
    let answers: Vec<_> = response
        .to_network
        .iter_endpoints()
        .map(|(to, _)| to)
        .collect();
    assert_eq!(
        answers,
        vec![Some(at_reached)],
        "the response leaves from it"
    );
    assert_eq!(pair.b.engine.local_addr(&a_key), Some(reached));

    // A completes the handshake; its queued packet reaches B, at the same address.
    let mut data = Outbox::default();
    for (_, datagram) in response.to_network.iter() {
        pair.a
            .engine
            .handle_datagram(now, pair.b.addr, datagram, &mut data);
    }
    let mut delivered = Outbox::default();
    for (_, datagram) in data.to_network.iter() {
        pair.b
            .engine
            .handle_datagram(now, at_reached, datagram, &mut delivered);
    }
    assert_eq!(delivered.to_tunnel.len(), 1);

    // B's own data, and its keepalives, leave from it too.
    let send_b = || {
        let packet = ip_packet(pair.b.tunnel_ip, pair.a.tunnel_ip, b"pong");
        let mut out = Outbox::default();
        pair.b
            .engine
            .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
        out.to_network
            .iter_endpoints()
            .map(|(to, _)| to)
            .collect::<Vec<_>>()
    };
    assert_eq!(send_b(), vec![Some(at_reached)]);

    // The address left B's host: forgotten, the kernel picks the source.
    assert_eq!(pair.b.engine.forget_local(IpAddr::from([192, 0, 2, 99])), 0);
    assert_eq!(pair.b.engine.forget_local(reached.ip), 1);
    assert_eq!(send_b(), vec![Some(Endpoint::from(pair.a.addr))]);

    // The next datagram from A teaches it again, wherever A now reaches B.
    let other = LocalAddr::new(IpAddr::from([192, 0, 2, 2]));
    let packet = ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, b"again");
    let mut out = Outbox::default();
    pair.a
        .engine
        .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
    let mut delivered = Outbox::default();
    for (_, datagram) in out.to_network.iter() {
        pair.b.engine.handle_datagram(
            now,
            Endpoint::new(pair.a.addr, Some(other)),
            datagram,
            &mut delivered,
        );
    }
    assert_eq!(delivered.to_tunnel.len(), 1);
    assert_eq!(pair.b.engine.local_addr(&a_key), Some(other));
    assert_eq!(
        send_b(),
        vec![Some(Endpoint::new(pair.a.addr, Some(other)))]
    );
}

#[test]
fn a_held_initiation_is_answered_from_the_local_address_it_reached() {
    use dataplane::{Endpoint, LocalAddr};
    let pair = EnginePair::new();
    let now = Instant::now();
    let mut unconfigured = pair.b.config_with_peer(&pair.a);
    unconfigured.peers.clear();
    pair.b.engine.apply(&unconfigured);
    let reached = Endpoint::new(
        pair.a.addr,
        Some(LocalAddr::new(IpAddr::from([192, 0, 2, 22]))),
    );
    let packet = ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, b"early");
    let mut out = Outbox::default();
    pair.a
        .engine
        .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
    let mut ignored = Outbox::default();
    for (_, datagram) in out.to_network.iter() {
        pair.b
            .engine
            .handle_datagram(now, reached, datagram, &mut ignored);
    }
    assert_eq!(pair.b.engine.drops().get(DropReason::UnknownPeer), 1);
    pair.b.engine.apply(&pair.b.config_with_peer(&pair.a));
    let out = timer_output(&pair.b, now);
    let answers: Vec<_> = out.to_network.iter_endpoints().map(|(to, _)| to).collect();
    assert_eq!(answers, vec![Some(reached)]);
}

#[test]
fn data_on_an_older_session_does_not_complete_the_handshake_this_end_answered() {
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"hello");
    let handshakes = |side: &Side| side.engine.peer_stats()[0].handshakes;
    assert_eq!(handshakes(&pair.a), 1, "A initiated and got the response");
    // B starts a new handshake; A answers, and the answer is lost on its way back.
    assert!(pair.b.engine.rekey(&pair.a.key.public_key()));
    let mut initiation = Outbox::default();
    pair.b.engine.handle_timers(now, &mut initiation);
    let initiations: Vec<Vec<u8>> = initiation
        .to_network
        .iter()
        .map(|(_, d)| d.to_vec())
        .collect();
    assert_eq!(initiations.len(), 1, "B sends one initiation");
    let mut answer = Outbox::default();
    pair.a
        .engine
        .handle_datagram(now, pair.b.addr, &initiations[0], &mut answer);
    let lost: Vec<Vec<u8>> = answer.to_network.iter().map(|(_, d)| d.to_vec()).collect();
    assert_eq!(lost.len(), 1, "A answers");
    // Data still comes from B on the old session: it confirms nothing of A's answer.
    pair.send_b_to_a(now, b"old session");
    assert_eq!(payload_of(pair.a.delivered.last().unwrap()), b"old session");
    assert_eq!(
        handshakes(&pair.a),
        1,
        "data on the old session completed the handshake A answered"
    );
    // The answer arrives after all: B confirms it on the new session, and A counts it.
    let mut confirmation = Outbox::default();
    pair.b
        .engine
        .handle_datagram(now, pair.a.addr, &lost[0], &mut confirmation);
    pair.run(now, confirmation, false);
    pair.send_b_to_a(now, b"new session");
    assert_eq!(
        handshakes(&pair.a),
        2,
        "the data on the new session completes it"
    );
}

#[test]
fn configuring_the_endpoint_a_peer_is_heard_at_keeps_the_local_address_it_reached() {
    use dataplane::{Endpoint, LocalAddr};
    let pair = EnginePair::new();
    let now = Instant::now();
    let a_key = pair.a.key.public_key();
    // B first knows A at an address A is not at (a candidate that does not work).
    let mut elsewhere = pair.b.config_with_peer(&pair.a);
    elsewhere.peers[0].endpoint = Some(SocketAddr::from(([192, 0, 2, 77], 51820)));
    pair.b.engine.apply(&elsewhere);
    // A reaches B at B's second address, 192.0.2.22 (the only one B's firewall lets in).
    let reached = LocalAddr::new(IpAddr::from([192, 0, 2, 22]));
    let packet = ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, b"hi");
    let mut out = Outbox::default();
    pair.a
        .engine
        .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
    let (_, initiation) = out.to_network.iter().next().expect("an initiation");
    let mut response = Outbox::default();
    pair.b.engine.handle_datagram(
        now,
        Endpoint::new(pair.a.addr, Some(reached)),
        initiation,
        &mut response,
    );
    assert_eq!(pair.b.engine.local_addr(&a_key), Some(reached));
    // kg then configures the address A is heard from (as it does with a discovered
    // endpoint): B keeps sending from the address A reached.
    pair.b.engine.apply(&pair.b.config_with_peer(&pair.a));
    assert_eq!(pair.b.engine.config().peers[0].endpoint, Some(pair.a.addr));
    assert_eq!(
        pair.b.engine.local_addr(&a_key),
        Some(reached),
        "configuring where A already is forgot where A reached B"
    );
    // Another endpoint configured: the kernel picks the source again.
    pair.b.engine.apply(&elsewhere);
    assert_eq!(pair.b.engine.local_addr(&a_key), None);
}
