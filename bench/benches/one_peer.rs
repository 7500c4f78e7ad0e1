//! One peer's crypto on N workers, in memory: batches of 256 packets of 1420 bytes for one peer
//! sealed (and, separately, opened) by an engine whose batches spread over N - 1 helper threads
//! plus the calling worker, as a location leader's one link does on a device. No I/O.
//!
//! Prints one line per direction and N, `one_peer_workers dir=seal workers=N gib_s=X`, from
//! all the batches criterion timed (warm-up included). N comes from `ONE_PEER_WORKERS` (a comma
//! list, default `1,2`), so a bigger host runs `ONE_PEER_WORKERS=1,2,16,64` unchanged.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dataplane::helpers::Helpers;
use dataplane::testing::{ip_packet, EnginePair};
use dataplane::Outbox;

const BATCH: usize = 256;
const PACKET: usize = 1420;
const GIB: f64 = (1u64 << 30) as f64;

fn worker_counts() -> Vec<usize> {
    std::env::var("ONE_PEER_WORKERS")
        .unwrap_or_else(|_| "1,2".into())
        .split(',')
        .map(|n| {
            n.trim()
                .parse()
                .expect("ONE_PEER_WORKERS: a comma list of counts")
        })
        .filter(|&n| n > 0)
        .collect()
}

/// A pair with a session up, whose side `sealing` (A) or opening (B) engine has `workers - 1`
/// helpers, and a batch of packets from A to B.
fn pair_with_workers(workers: usize, sealing: bool) -> (EnginePair, Vec<Vec<u8>>, Arc<Helpers>) {
    let mut pair = EnginePair::new();
    let helpers = Arc::new(Helpers::start(workers - 1).expect("helper threads"));
    let engine = if sealing {
        &pair.a.engine
    } else {
        &pair.b.engine
    };
    assert!(engine.use_helpers(Arc::clone(&helpers)));
    pair.send_a_to_b(Instant::now(), b"handshake");
    let header = ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, &[]).len();
    let payload = vec![0x5a; PACKET - header];
    let packet = ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, &payload);
    assert_eq!(packet.len(), PACKET);
    (pair, vec![packet; BATCH], helpers)
}

fn report(dir: &str, workers: usize, bytes: u64, time: Duration, helpers: &Helpers) {
    if time.is_zero() {
        return; // filtered out
    }
    println!(
        "one_peer_workers dir={dir} workers={workers} gib_s={:.2}",
        bytes as f64 / GIB / time.as_secs_f64()
    );
    let stats = helpers.stats();
    let batches = bytes / (BATCH * PACKET) as u64;
    eprintln!(
        "  {} of {batches} batches spread, helpers ran {} chunks",
        stats.spread, stats.helped_chunks
    );
}

fn seal(c: &mut Criterion) {
    let mut group = c.benchmark_group("one_peer_workers/seal");
    group.throughput(Throughput::Bytes((BATCH * PACKET) as u64));
    for workers in worker_counts() {
        let (pair, batch, helpers) = pair_with_workers(workers, true);
        // Distinct copies, more than the caches hold, taken in turn: like packets just read
        // from the TUN device, none is in a core's cache already.
        let batches: Vec<Vec<Vec<u8>>> = (0..IN_FLIGHT).map(|_| batch.clone()).collect();
        let mut out = Outbox::with_capacity(BATCH, PACKET + 64);
        let (mut bytes, mut time) = (0u64, Duration::ZERO);
        group.bench_function(BenchmarkId::from_parameter(workers), |b| {
            b.iter_custom(|iters| {
                let now = Instant::now();
                let start = Instant::now();
                for i in 0..iters as usize {
                    pair.a.engine.handle_tunnel_packets(
                        now,
                        batches[i % IN_FLIGHT].iter().map(Vec::as_slice),
                        &mut out,
                    );
                    assert_eq!(out.to_network.len(), BATCH);
                    out.clear();
                }
                let took = start.elapsed();
                bytes += iters * (BATCH * PACKET) as u64;
                time += took;
                took
            });
        });
        report("seal", workers, bytes, time, &helpers);
    }
    group.finish();
}

/// Batches in flight: sealed from distinct plaintexts (64 batches are 23 MB, more than this
/// machine's 2 MB of L2, so a helper never finds its input in its own cache, as with packets the
/// kernel just copied in for the worker); opened from datagrams sealed ahead of each timed
/// stretch (a receiver under load opens batch after batch, with no sealing in between to let its
/// helpers fall asleep).
const IN_FLIGHT: usize = 64;

fn open(c: &mut Criterion) {
    let mut group = c.benchmark_group("one_peer_workers/open");
    group.throughput(Throughput::Bytes((BATCH * PACKET) as u64));
    for workers in worker_counts() {
        let (pair, batch, helpers) = pair_with_workers(workers, false);
        let mut sealed: Vec<Outbox> = (0..IN_FLIGHT)
            .map(|_| Outbox::with_capacity(BATCH, PACKET + 64))
            .collect();
        let mut out = Outbox::with_capacity(BATCH, PACKET + 64);
        let from = pair.a.addr;
        let (mut bytes, mut time) = (0u64, Duration::ZERO);
        group.bench_function(BenchmarkId::from_parameter(workers), |b| {
            b.iter_custom(|iters| {
                let now = Instant::now();
                let mut took = Duration::ZERO;
                let mut left = iters as usize;
                while left > 0 {
                    // Fresh datagrams each time (the replay window refuses a second opening),
                    // sealed by A's engine (no helpers) on this thread, not timed: the datagrams
                    // are then in this worker's cache and not in the helpers', as after the
                    // kernel copied them in on the worker's receive call.
                    let ahead = left.min(IN_FLIGHT);
                    for outbox in &mut sealed[..ahead] {
                        outbox.clear();
                        pair.a.engine.handle_tunnel_packets(
                            now,
                            batch.iter().map(Vec::as_slice),
                            outbox,
                        );
                    }
                    let start = Instant::now();
                    for outbox in &sealed[..ahead] {
                        pair.b.engine.handle_datagrams(
                            now,
                            outbox.to_network.iter().map(|(_, d)| (from, d)),
                            &mut out,
                        );
                        assert_eq!(out.to_tunnel.len(), BATCH, "every packet opens");
                        out.clear();
                    }
                    took += start.elapsed();
                    left -= ahead;
                }
                bytes += iters * (BATCH * PACKET) as u64;
                time += took;
                took
            });
        });
        report("open", workers, bytes, time, &helpers);
    }
    group.finish();
}

criterion_group!(one_peer_workers, seal, open);
criterion_main!(one_peer_workers);
