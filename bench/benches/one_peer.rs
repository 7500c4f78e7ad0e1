//! One peer's crypto on N workers, in memory: batches of 256 packets of 1420 bytes for one peer
//! sealed (and, separately, opened) by an engine whose batches spread over N - 1 helper threads
//! plus the calling worker, as a location leader's one link does on a device. No I/O: the
//! packets are copied, outside the timed stretch, into buffers the worker reuses from batch to
//! batch, as the kernel copies them in on a device's read or receive call (see [`Received`]).
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

/// Packets as a device's worker holds them: in buffers it reuses from batch to batch (so their
/// pages stay in its TLB), each just written on the worker's own core, as the kernel's copy
/// into them on the worker's read or receive call leaves them (in the worker's cache, not in
/// the helpers'). Filled from `stock` outside the timed stretch: that copy is the kernel's work,
/// not the engine's.
struct Received {
    buffers: Vec<Vec<u8>>,
}

impl Received {
    fn new() -> Self {
        Self {
            buffers: (0..BATCH)
                .map(|_| Vec::with_capacity(PACKET + 64))
                .collect(),
        }
    }

    /// Copies `packets` in, on this thread.
    fn fill<'a>(&mut self, packets: impl Iterator<Item = &'a [u8]>) {
        let mut filled = 0;
        for (buffer, packet) in self.buffers.iter_mut().zip(packets) {
            buffer.clear();
            buffer.extend_from_slice(packet);
            filled += 1;
        }
        assert_eq!(filled, BATCH, "a whole batch");
    }

    fn packets(&self) -> impl Iterator<Item = &[u8]> {
        self.buffers.iter().map(Vec::as_slice)
    }
}

fn seal(c: &mut Criterion) {
    let mut group = c.benchmark_group("one_peer_workers/seal");
    group.throughput(Throughput::Bytes((BATCH * PACKET) as u64));
    for workers in worker_counts() {
        let (pair, batch, helpers) = pair_with_workers(workers, true);
        let mut received = Received::new();
        let mut out = Outbox::with_capacity(BATCH, PACKET + 64);
        let (mut bytes, mut time) = (0u64, Duration::ZERO);
        group.bench_function(BenchmarkId::from_parameter(workers), |b| {
            b.iter_custom(|iters| {
                let now = Instant::now();
                let mut took = Duration::ZERO;
                for _ in 0..iters {
                    received.fill(batch.iter().map(Vec::as_slice));
                    let start = Instant::now();
                    pair.a
                        .engine
                        .handle_tunnel_packets(now, received.packets(), &mut out);
                    took += start.elapsed();
                    assert_eq!(out.to_network.len(), BATCH);
                    out.clear();
                }
                bytes += iters * (BATCH * PACKET) as u64;
                time += took;
                took
            });
        });
        report("seal", workers, bytes, time, &helpers);
    }
    group.finish();
}

/// Batches of datagrams sealed ahead of each timed stretch (the replay window refuses a second
/// opening, so every batch is fresh), kept in one stock of 190 MB: a receiver under load opens
/// batch after batch, and the helpers fall asleep only while the stock is sealed again, once
/// every this many batches.
const SEALED_AHEAD: usize = 512;
/// The room one datagram takes in the stock.
const DATAGRAM_ROOM: usize = PACKET + 32;

/// Datagrams sealed ahead, each at a multiple of [`DATAGRAM_ROOM`] with its length.
#[derive(Default)]
struct SealedStock {
    bytes: Vec<u8>,
    lengths: Vec<usize>,
}

impl SealedStock {
    /// Seals `batches` batches of `batch` with A's engine (no helpers).
    fn seal(&mut self, pair: &EnginePair, now: Instant, batch: &[Vec<u8>], batches: usize) {
        self.bytes.resize(batches * BATCH * DATAGRAM_ROOM, 0);
        self.lengths.clear();
        let mut sealed = Outbox::with_capacity(BATCH, PACKET + 64);
        for b in 0..batches {
            sealed.clear();
            pair.a
                .engine
                .handle_tunnel_packets(now, batch.iter().map(Vec::as_slice), &mut sealed);
            for (i, (_, datagram)) in sealed.to_network.iter().enumerate() {
                let at = (b * BATCH + i) * DATAGRAM_ROOM;
                self.bytes[at..at + datagram.len()].copy_from_slice(datagram);
                self.lengths.push(datagram.len());
            }
        }
    }

    /// The datagrams of batch `b`.
    fn batch(&self, b: usize) -> impl Iterator<Item = &[u8]> {
        (b * BATCH..(b + 1) * BATCH).map(|i| {
            let at = i * DATAGRAM_ROOM;
            &self.bytes[at..at + self.lengths[i]]
        })
    }
}

fn open(c: &mut Criterion) {
    let mut group = c.benchmark_group("one_peer_workers/open");
    group.throughput(Throughput::Bytes((BATCH * PACKET) as u64));
    for workers in worker_counts() {
        let (pair, batch, helpers) = pair_with_workers(workers, false);
        let mut stock = SealedStock::default();
        let mut received = Received::new();
        let mut out = Outbox::with_capacity(BATCH, PACKET + 64);
        let from = pair.a.addr;
        let (mut bytes, mut time) = (0u64, Duration::ZERO);
        group.bench_function(BenchmarkId::from_parameter(workers), |b| {
            b.iter_custom(|iters| {
                let now = Instant::now();
                let mut took = Duration::ZERO;
                let mut left = iters as usize;
                while left > 0 {
                    let ahead = left.min(SEALED_AHEAD);
                    stock.seal(&pair, now, &batch, ahead);
                    for b in 0..ahead {
                        received.fill(stock.batch(b));
                        let start = Instant::now();
                        pair.b.engine.handle_datagrams(
                            now,
                            received.packets().map(|d| (from, d)),
                            &mut out,
                        );
                        took += start.elapsed();
                        assert_eq!(out.to_tunnel.len(), BATCH, "every packet opens");
                        out.clear();
                    }
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
