//! Encapsulate and decapsulate one packet through the engine (warm session) at 64, 512 and
//! 1420 bytes, next to a raw ring ChaCha20-Poly1305 seal of the same size, in place and after a
//! copy into an output buffer; a batch of 64 packets of 1420 bytes through the engine each way,
//! as a worker hands them over; 64 decrypted packets prepared for the TUN device (coalesced);
//! and encryption spread over 1 and 2 threads sharing the engine, as the device's workers share
//! it, for one peer and for two.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use std::net::IpAddr;
use std::sync::Barrier;
use std::time::{Duration, Instant, SystemTime};

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use dataplane::gro::Coalescer;
use dataplane::testing::{ip_packet, EnginePair, Side};
use dataplane::{Engine, Outbox};
use kilotun_bench::packet_of_size;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};

const SIZES: [usize; 3] = [64, 512, 1420];

fn encapsulate(c: &mut Criterion) {
    let mut group = c.benchmark_group("dataplane/encapsulate");
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"warm up");
    let mut out = Outbox::with_capacity(4, 2048);
    for size in SIZES {
        let packet = packet_of_size(size);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_with_input(BenchmarkId::new("engine", size), &packet, |b, packet| {
            b.iter(|| {
                pair.a
                    .engine
                    .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
                out.clear();
            });
        });
        let key = LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, &[7; 32]).unwrap());
        let mut buffer = packet.clone();
        let mut counter = 0u64;
        group.bench_function(BenchmarkId::new("ring_seal", size), |b| {
            b.iter(|| {
                counter += 1;
                let mut nonce = [0u8; 12];
                nonce[4..].copy_from_slice(&counter.to_le_bytes());
                let tag = key
                    .seal_in_place_separate_tag(
                        Nonce::assume_unique_for_key(nonce),
                        Aad::empty(),
                        &mut buffer,
                    )
                    .unwrap();
                let _ = std::hint::black_box(tag);
            });
        });
        // The same seal after copying the packet into a separate output buffer, as boringtun's
        // encapsulate does: the difference is what sealing in place would save.
        let mut output = vec![0u8; size + 32];
        group.bench_function(BenchmarkId::new("ring_copy_seal", size), |b| {
            b.iter(|| {
                counter += 1;
                let mut nonce = [0u8; 12];
                nonce[4..].copy_from_slice(&counter.to_le_bytes());
                output[16..16 + size].copy_from_slice(std::hint::black_box(&packet));
                let tag = key
                    .seal_in_place_separate_tag(
                        Nonce::assume_unique_for_key(nonce),
                        Aad::empty(),
                        &mut output[16..16 + size],
                    )
                    .unwrap();
                output[16 + size..].copy_from_slice(tag.as_ref());
                let _ = std::hint::black_box(&output);
            });
        });
    }
    group.finish();
}

fn decapsulate(c: &mut Criterion) {
    let mut group = c.benchmark_group("dataplane/decapsulate");
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"warm up");
    let from = pair.a.addr;
    let mut sealed = Outbox::with_capacity(4, 2048);
    let mut out = Outbox::with_capacity(4, 2048);
    for size in SIZES {
        let packet = packet_of_size(size);
        group.throughput(Throughput::Bytes(size as u64));
        group.bench_function(BenchmarkId::new("engine", size), |b| {
            b.iter_batched(
                || {
                    // A fresh ciphertext each time: the replay window refuses repeats.
                    sealed.clear();
                    pair.a
                        .engine
                        .handle_tunnel_packets(now, [packet.as_slice()], &mut sealed);
                    sealed.to_network.get(0).unwrap().1.to_vec()
                },
                |datagram| {
                    pair.b
                        .engine
                        .handle_datagram(now, from, &datagram, &mut out);
                    assert_eq!(out.to_tunnel.len(), 1);
                    out.clear();
                },
                BatchSize::SmallInput,
            );
        });
    }
    group.finish();
}

/// Packets per batch in the batch benchmarks (one `recvmmsg`'s worth at the default size).
const BATCH: usize = 64;
/// Batches sealed ahead of each timed stretch of the decapsulation benchmark.
const SEALED_CHUNK: u64 = 16;

fn batch_of_64(c: &mut Criterion) {
    let mut group = c.benchmark_group("dataplane/batch64");
    let mut pair = EnginePair::new();
    let now = Instant::now();
    pair.send_a_to_b(now, b"warm up");
    let packet = packet_of_size(1420);
    let packets: Vec<&[u8]> = vec![packet.as_slice(); BATCH];
    let mut out = Outbox::with_capacity(BATCH, 2048);
    group.throughput(Throughput::Bytes((BATCH * 1420) as u64));
    group.bench_function("encapsulate", |b| {
        b.iter(|| {
            pair.a
                .engine
                .handle_tunnel_packets(now, packets.iter().copied(), &mut out);
            assert_eq!(out.to_network.len(), BATCH);
            out.clear();
        });
    });
    let from = pair.a.addr;
    let mut sealed = Outbox::with_capacity(BATCH * SEALED_CHUNK as usize, 2048);
    // Datagrams must be fresh (the replay window refuses repeats), so each timed batch is
    // sealed beforehand, untimed, in chunks small enough to stay in cache.
    group.bench_function("decapsulate", |b| {
        b.iter_custom(|iterations| {
            let mut total = Duration::ZERO;
            let mut done = 0;
            while done < iterations {
                let chunk = (iterations - done).min(SEALED_CHUNK);
                sealed.clear();
                for _ in 0..chunk {
                    pair.a
                        .engine
                        .handle_tunnel_packets(now, packets.iter().copied(), &mut sealed);
                }
                let started = Instant::now();
                for batch in 0..chunk as usize {
                    let datagrams = (batch * BATCH..(batch + 1) * BATCH)
                        .filter_map(|i| sealed.to_network.get(i))
                        .map(|(_, d)| (from, d));
                    pair.b.engine.handle_datagrams(now, datagrams, &mut out);
                    assert_eq!(out.to_tunnel.len(), BATCH);
                    out.clear();
                }
                total += started.elapsed();
                done += chunk;
            }
            total
        });
    });
    group.finish();
}

/// A TCP segment (IPv4, 1420 bytes in all) or UDP datagram (IPv4, 1328 bytes) of one flow,
/// numbered `i`, with valid checksums.
fn flow_packet(udp: bool, i: u32) -> Vec<u8> {
    let (l4h, payload) = if udp { (8, 1300) } else { (20, 1380) };
    let total = 20 + l4h + payload;
    let mut p = vec![0u8; total];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
    p[6] = 0x40;
    p[8] = 64;
    p[9] = if udp { 17 } else { 6 };
    p[12..16].copy_from_slice(&[10, 0, 0, 1]);
    p[16..20].copy_from_slice(&[10, 0, 0, 2]);
    let ip = !fold(sum(&p[..20], 0));
    p[10..12].copy_from_slice(&ip.to_be_bytes());
    p[20..22].copy_from_slice(&5201u16.to_be_bytes());
    p[22..24].copy_from_slice(&40000u16.to_be_bytes());
    if udp {
        p[24..26].copy_from_slice(&((l4h + payload) as u16).to_be_bytes());
    } else {
        p[24..28].copy_from_slice(&(i * payload as u32).to_be_bytes());
        p[32] = 5 << 4;
        p[33] = 0x10;
    }
    for (j, b) in p[20 + l4h..].iter_mut().enumerate() {
        *b = (i as usize + j) as u8;
    }
    let pseudo = sum(&p[12..20], u64::from(p[9]) + (l4h + payload) as u64);
    let check = !fold(sum(&p[20..], pseudo));
    let at = if udp { 26 } else { 36 };
    p[at..at + 2].copy_from_slice(&check.to_be_bytes());
    p
}

fn sum(data: &[u8], initial: u64) -> u64 {
    let mut sum = initial;
    for w in data.chunks(2) {
        sum += u64::from(u16::from_be_bytes([w[0], *w.get(1).unwrap_or(&0)]));
    }
    sum
}

fn fold(mut sum: u64) -> u16 {
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    sum as u16
}

/// 64 decrypted packets of one flow prepared for the TUN device: TCP segments coalesced (as
/// the offloaded device writes them), UDP datagrams with and without UDP segmentation.
fn tun_write(c: &mut Criterion) {
    let mut group = c.benchmark_group("dataplane/tun_write64");
    let cases = [
        ("tcp", false, false),
        ("udp_alone", true, false),
        ("udp_uso", true, true),
    ];
    for (name, udp, uso) in cases {
        let packets: Vec<Vec<u8>> = (0..BATCH as u32).map(|i| flow_packet(udp, i)).collect();
        let bytes: usize = packets.iter().map(Vec::len).sum();
        group.throughput(Throughput::Bytes(bytes as u64));
        let mut coalescer = Coalescer::with_udp(uso);
        group.bench_function(name, |b| {
            b.iter(|| {
                coalescer.clear();
                for p in &packets {
                    assert!(coalescer.push(p));
                }
                let written: usize = coalescer.finish().map(<[u8]>::len).sum();
                std::hint::black_box(written);
            });
        });
    }
    group.finish();
}

/// Engine A with peers B (10.0.0.2) and C (10.0.0.3), sessions up with both.
fn engine_with_two_peers(now: Instant) -> (Engine, [IpAddr; 2]) {
    let anchor = (Instant::now(), SystemTime::now());
    let side = |n| Side::numbered(anchor, n);
    let (a, b, c) = (side(1), side(2), side(3));
    let mut config = a.config_with_peer(&b);
    config.peers.extend(a.config_with_peer(&c).peers);
    a.engine.apply(&config);
    for peer in [&b, &c] {
        peer.engine.apply(&peer.config_with_peer(&a));
        // Initiation, response, then what A queued meanwhile: until the wire is quiet.
        let mut out = Outbox::default();
        let probe = ip_packet(a.tunnel_ip, peer.tunnel_ip, b"hello");
        a.engine
            .handle_tunnel_packets(now, [probe.as_slice()], &mut out);
        let mut from_a = true;
        while !out.to_network.is_empty() {
            let mut reply = Outbox::default();
            let (to, from) = if from_a { (peer, &a) } else { (&a, peer) };
            for (_, datagram) in out.to_network.iter() {
                to.engine
                    .handle_datagram(now, from.addr, datagram, &mut reply);
            }
            out = reply;
            from_a = !from_a;
        }
    }
    (a.engine, [b.tunnel_ip, c.tunnel_ip])
}

/// Batches of 64 packets of 1420 bytes encrypted by 1 or 2 threads at once through one engine
/// (each thread with its own outbox, as each worker has): all to one peer, or each thread to
/// its own peer. Each iteration is one batch per thread, so the throughput is the threads' sum.
fn peers_and_threads(c: &mut Criterion) {
    let mut group = c.benchmark_group("dataplane/threads_encapsulate");
    let now = Instant::now();
    let (engine, peers) = engine_with_two_peers(now);
    let source: IpAddr = [10, 0, 0, 1].into();
    let payload = vec![0xa5; 1400];
    let batches: Vec<Vec<u8>> = peers
        .iter()
        .map(|peer| ip_packet(source, *peer, &payload))
        .collect();
    let cases = [
        ("one_peer", 1usize, 1usize),
        ("one_peer", 2, 1),
        ("two_peers", 2, 2),
    ];
    for (name, threads, peers) in cases {
        group.throughput(Throughput::Bytes((threads * BATCH * 1420) as u64));
        group.bench_function(BenchmarkId::new(name, threads), |b| {
            b.iter_custom(|iterations| {
                let start = Barrier::new(threads + 1);
                std::thread::scope(|scope| {
                    for thread in 0..threads {
                        let packet = batches[thread % peers].as_slice();
                        let (engine, start) = (&engine, &start);
                        scope.spawn(move || {
                            let packets = vec![packet; BATCH];
                            let mut out = Outbox::with_capacity(BATCH, 2048);
                            start.wait();
                            for _ in 0..iterations {
                                engine.handle_tunnel_packets(
                                    now,
                                    packets.iter().copied(),
                                    &mut out,
                                );
                                assert_eq!(out.to_network.len(), BATCH);
                                out.clear();
                            }
                        });
                    }
                    start.wait();
                    // The scope joins every thread before it returns.
                    Instant::now()
                })
                .elapsed()
            });
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    encapsulate,
    decapsulate,
    batch_of_64,
    tun_write,
    peers_and_threads
);
criterion_main!(benches);
