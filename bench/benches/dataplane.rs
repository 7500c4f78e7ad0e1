//! Encapsulate and decapsulate one packet through the engine (warm session) at 64, 512 and
//! 1420 bytes, next to a raw ring ChaCha20-Poly1305 seal of the same size; and a batch of 64
//! packets of 1420 bytes through the engine each way, as a worker hands them over.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, Throughput};
use dataplane::testing::EnginePair;
use dataplane::Outbox;
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

criterion_group!(benches, encapsulate, decapsulate, batch_of_64);
criterion_main!(benches);
