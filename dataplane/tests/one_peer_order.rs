//! One peer's crypto spread over helper threads keeps the peer's order: the counters on the wire
//! rise in the order packets were handed to the engine, and the far end delivers them in that
//! order, however the chunks of a batch were timed across threads. Helpers started with jitter
//! make every chunk wait a random time first, so chunks finish in a random order.
//!
//! Also: the replay window under spread opening, and packets that fail authentication in a
//! spread batch, are refused and counted exactly as on one thread.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dataplane::helpers::Helpers;
use dataplane::testing::{ip_packet, EnginePair};
use dataplane::{DropReason, Outbox};

/// A pair with a session up, each engine with `helpers` jittered helper threads.
fn spread_pair(helpers: usize) -> (EnginePair, Arc<Helpers>, Arc<Helpers>) {
    let mut pair = EnginePair::new();
    let jitter = Duration::from_micros(30);
    let (a, b) = (
        Arc::new(Helpers::start_jittered(helpers, jitter).unwrap()),
        Arc::new(Helpers::start_jittered(helpers, jitter).unwrap()),
    );
    assert!(pair.a.engine.use_helpers(Arc::clone(&a)));
    assert!(pair.b.engine.use_helpers(Arc::clone(&b)));
    pair.send_a_to_b(Instant::now(), b"handshake");
    (pair, a, b)
}

/// A packet from A to B carrying `seq`, `size` bytes long.
fn numbered(pair: &EnginePair, seq: u64, size: usize) -> Vec<u8> {
    let mut payload = vec![(seq % 251) as u8; size - 20];
    payload[..8].copy_from_slice(&seq.to_le_bytes());
    ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, &payload)
}

fn seq_of(packet: &[u8]) -> u64 {
    u64::from_le_bytes(packet[20..28].try_into().unwrap())
}

/// The counter of a data message on the wire.
fn counter_of(datagram: &[u8]) -> u64 {
    assert_eq!(datagram[0], 4, "a data message");
    u64::from_le_bytes(datagram[8..16].try_into().unwrap())
}

/// A small deterministic generator (xorshift64*), so a failure can be replayed.
struct Draws(u64);

impl Draws {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

#[test]
fn counters_on_the_wire_and_delivery_keep_the_order_packets_came_in() {
    let (pair, a_helpers, b_helpers) = spread_pair(3);
    let now = Instant::now();
    let from: SocketAddr = pair.a.addr;
    let mut draws = Draws(0x5eed_1234_abcd_ef01);
    let (mut sealed, mut opened) = (Outbox::default(), Outbox::default());
    let (mut next_seq, mut expected_seq) = (0u64, 0u64);
    let mut last_counter = None;
    for _ in 0..150 {
        // Batches from 1 to 300 packets of 60 to 1420 bytes: small ones stay on the worker,
        // big ones spread.
        let count = 1 + draws.below(300);
        let batch: Vec<Vec<u8>> = (0..count)
            .map(|_| {
                let size = 60 + draws.below(1361) as usize;
                next_seq += 1;
                numbered(&pair, next_seq - 1, size)
            })
            .collect();
        sealed.clear();
        pair.a
            .engine
            .handle_tunnel_packets(now, batch.iter().map(Vec::as_slice), &mut sealed);
        assert_eq!(sealed.to_network.len(), batch.len());
        for (_, datagram) in sealed.to_network.iter() {
            let counter = counter_of(datagram);
            assert!(
                last_counter.is_none_or(|last| counter == last + 1),
                "counter {counter} after {last_counter:?}: the wire is out of order"
            );
            last_counter = Some(counter);
        }
        opened.clear();
        pair.b.engine.handle_datagrams(
            now,
            sealed.to_network.iter().map(|(_, d)| (from, d)),
            &mut opened,
        );
        assert_eq!(opened.to_tunnel.len(), batch.len(), "every packet opens");
        for ((_, delivered), sent) in opened.to_tunnel.iter().zip(&batch) {
            assert_eq!(seq_of(delivered), expected_seq, "delivered out of order");
            assert_eq!(delivered, sent.as_slice(), "delivered as sent");
            expected_seq += 1;
        }
    }
    assert_eq!(expected_seq, next_seq);
    // The helpers took part on both sides (else this tested one thread).
    for (side, helpers) in [("sealing", &a_helpers), ("opening", &b_helpers)] {
        let stats = helpers.stats();
        assert!(
            stats.spread > 10 && stats.helped_chunks > 50,
            "{side}: {stats:?}"
        );
    }
    let drops: u64 = pair
        .b
        .engine
        .drops()
        .snapshot()
        .iter()
        .map(|(_, n)| n)
        .sum();
    assert_eq!(drops, 0);
}

#[test]
fn two_workers_sealing_for_one_peer_each_keep_their_own_order() {
    // Two workers (two TUN queues, two flows) sealing for the same peer at once, sharing the
    // helpers: each worker's datagrams carry rising counters, no counter is used twice, and B
    // opens all of them.
    let (pair, _, _) = spread_pair(2);
    let pair = Arc::new(pair);
    let now = Instant::now();
    let workers: Vec<_> = (0..2u64)
        .map(|flow| {
            let pair = Arc::clone(&pair);
            std::thread::spawn(move || {
                let mut out = Outbox::default();
                let mut sent = Vec::new();
                for round in 0..40 {
                    let batch: Vec<Vec<u8>> = (0..64)
                        .map(|i| numbered(&pair, flow << 32 | (round * 64 + i), 1420))
                        .collect();
                    out.clear();
                    pair.a.engine.handle_tunnel_packets(
                        now,
                        batch.iter().map(Vec::as_slice),
                        &mut out,
                    );
                    sent.push(out.to_network.iter().map(|(_, d)| d.to_vec()).collect());
                }
                sent
            })
        })
        .collect();
    let per_worker: Vec<Vec<Vec<Vec<u8>>>> =
        workers.into_iter().map(|w| w.join().unwrap()).collect();
    let mut all_counters = Vec::new();
    for batches in &per_worker {
        let counters: Vec<u64> = batches.iter().flatten().map(|d| counter_of(d)).collect();
        assert!(
            counters.windows(2).all(|w| w[0] < w[1]),
            "one worker's counters go back"
        );
        all_counters.extend(counters);
    }
    all_counters.sort_unstable();
    all_counters.dedup();
    assert_eq!(all_counters.len(), 2 * 40 * 64, "a counter was used twice");
    // B opens the batches in the order they were sealed (as the wire carries them; opening one
    // worker's far behind the other's would fall out of the replay window, as with any
    // WireGuard), and each flow arrives in order.
    let mut batches: Vec<(u64, usize, &Vec<Vec<u8>>)> = per_worker
        .iter()
        .enumerate()
        .flat_map(|(flow, batches)| batches.iter().map(move |b| (counter_of(&b[0]), flow, b)))
        .collect();
    batches.sort_unstable_by_key(|(first, _, _)| *first);
    let mut out = Outbox::default();
    let mut expected = [0u64; 2];
    for (_, flow, batch) in batches {
        out.clear();
        pair.b.engine.handle_datagrams(
            now,
            batch.iter().map(|d| (pair.a.addr, d.as_slice())),
            &mut out,
        );
        assert_eq!(out.to_tunnel.len(), 64);
        for (_, packet) in out.to_tunnel.iter() {
            assert_eq!(seq_of(packet), (flow as u64) << 32 | expected[flow]);
            expected[flow] += 1;
        }
    }
    assert_eq!(expected, [40 * 64, 40 * 64]);
}

#[test]
fn replays_and_forgeries_in_a_spread_batch_are_refused_and_counted_as_on_one_thread() {
    let (pair, _, b_helpers) = spread_pair(2);
    let now = Instant::now();
    let batch: Vec<Vec<u8>> = (0..200).map(|i| numbered(&pair, i, 1420)).collect();
    let mut sealed = Outbox::default();
    pair.a
        .engine
        .handle_tunnel_packets(now, batch.iter().map(Vec::as_slice), &mut sealed);
    let mut wire: Vec<Vec<u8>> = sealed.to_network.iter().map(|(_, d)| d.to_vec()).collect();
    // Every tenth datagram forged (a flipped ciphertext byte), and every seventh sent twice
    // within the batch.
    let mut forged = 0;
    for (i, datagram) in wire.iter_mut().enumerate() {
        if i % 10 == 3 {
            datagram[40] ^= 0x01;
            forged += 1;
        }
    }
    let mut with_repeats = Vec::new();
    let mut repeated = 0;
    for (i, datagram) in wire.iter().enumerate() {
        with_repeats.push(datagram.clone());
        if i % 7 == 0 && i % 10 != 3 {
            with_repeats.push(datagram.clone());
            repeated += 1;
        }
    }
    let before = b_helpers.stats();
    let mut out = Outbox::default();
    pair.b.engine.handle_datagrams(
        now,
        with_repeats.iter().map(|d| (pair.a.addr, d.as_slice())),
        &mut out,
    );
    assert!(b_helpers.stats().spread > before.spread, "the batch spread");
    let delivered: Vec<u64> = out.to_tunnel.iter().map(|(_, p)| seq_of(p)).collect();
    let expected: Vec<u64> = (0..200).filter(|i| i % 10 != 3).collect();
    assert_eq!(delivered, expected, "each genuine packet once, in order");
    let drops = pair.b.engine.drops();
    assert_eq!(drops.get(DropReason::DecryptFailed), forged);
    assert_eq!(drops.get(DropReason::Replay), repeated);
    // The whole batch again, later: every genuine packet is a replay now, refused before
    // decryption; the forgeries fail again.
    out.clear();
    pair.b.engine.handle_datagrams(
        now,
        wire.iter().map(|d| (pair.a.addr, d.as_slice())),
        &mut out,
    );
    assert!(out.to_tunnel.is_empty());
    assert_eq!(drops.get(DropReason::Replay), repeated + 200 - forged);
    assert_eq!(drops.get(DropReason::DecryptFailed), 2 * forged);
    // Forged copies of the genuine packets: their counters were seen, so the replay window's
    // first check refuses them before any decryption, as replays, not as failed decryptions,
    // and a batch with nothing left to open wakes no helper.
    let copies: Vec<Vec<u8>> = (0..200)
        .filter(|i| i % 10 != 3)
        .map(|i| {
            let mut copy = wire[i].clone();
            copy[40] ^= 0x01;
            copy
        })
        .collect();
    out.clear();
    let before = b_helpers.stats();
    pair.b.engine.handle_datagrams(
        now,
        copies.iter().map(|d| (pair.a.addr, d.as_slice())),
        &mut out,
    );
    assert_eq!(b_helpers.stats(), before, "nothing to open, nothing spread");
    assert!(out.to_tunnel.is_empty());
    assert_eq!(drops.get(DropReason::Replay), repeated + 2 * (200 - forged));
    assert_eq!(drops.get(DropReason::DecryptFailed), 2 * forged);
}
