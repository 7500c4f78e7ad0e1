//! What post-quantum preshared keys cost the control plane, per link: the CPU of an exchange
//! (both ends, every message built, checked and answered, the key derived) for a new link
//! (the responder's ML-KEM key fetched and checked against its fingerprint first) and for a
//! renewal a period later, and of making a node's ML-KEM key from its seed. The bytes each
//! exchange puts on the wire are printed once.
//!
//! `cargo bench -p kilotun-bench --bench pq`

#![allow(missing_docs)]

use std::sync::Arc;

use control::pq::link::{LinkSetup, PqLink};
use control::pq::{tag_key, PqIdentity, SEED_LEN};
use control::Key;
use criterion::{criterion_group, criterion_main, BatchSize, Criterion};

const PERIOD_MS: i64 = 120_000;

/// Deterministic bytes (xorshift64): the benchmark measures the exchange, not the OS's RNG.
fn entropy(state: &mut u64) -> impl FnMut(&mut [u8]) + '_ {
    move |buf: &mut [u8]| {
        for b in buf {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            *b = *state as u8;
        }
    }
}

/// Both ends of one link; the first initiates.
fn pair(initiator: &Arc<PqIdentity>, responder: &Arc<PqIdentity>) -> (PqLink, PqLink) {
    let tag = tag_key(&[7; 32]);
    let (low, high) = (Key([1; 32]), Key([2; 32]));
    let i = PqLink::new(
        LinkSetup {
            local: low,
            peer: high,
            peer_fp: responder.fingerprint(),
            tag_key: tag.clone(),
        },
        Arc::clone(initiator),
        PERIOD_MS,
    );
    let r = PqLink::new(
        LinkSetup {
            local: high,
            peer: low,
            peer_fp: initiator.fingerprint(),
            tag_key: tag,
        },
        Arc::clone(responder),
        PERIOD_MS,
    );
    (i, r)
}

/// Runs the initiator's timers at `now` and the wire until quiet; returns the bytes sent.
fn exchange(i: &mut PqLink, r: &mut PqLink, now: i64, rng: &mut u64) -> usize {
    let mut bytes = 0;
    let before = i.installed().map(|k| k.epoch);
    i.poll(now, &mut entropy(rng));
    loop {
        let mut moved = false;
        while let Some(d) = i.poll_transmit() {
            moved = true;
            bytes += d.len();
            r.handle(&d, now, &mut entropy(rng))
                .expect("responder took it");
        }
        while let Some(d) = r.poll_transmit() {
            moved = true;
            bytes += d.len();
            i.handle(&d, now, &mut entropy(rng))
                .expect("initiator took it");
        }
        if !moved {
            break;
        }
    }
    assert!(
        bytes > 0 && i.installed().map(|k| k.epoch) > before && i.installed() == r.installed(),
        "the exchange did not key both ends anew"
    );
    bytes
}

fn pq(c: &mut Criterion) {
    let (a, b) = (
        Arc::new(PqIdentity::from_seed(&[1; SEED_LEN])),
        Arc::new(PqIdentity::from_seed(&[2; SEED_LEN])),
    );
    let start = 1_700_000_000_000_i64;
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
    {
        let (mut i, mut r) = pair(&a, &b);
        let first = exchange(&mut i, &mut r, start, &mut rng);
        let renewal = exchange(&mut i, &mut r, start + PERIOD_MS, &mut rng);
        eprintln!("pq: bytes on the wire per exchange: new link {first}, renewal {renewal}");
    }
    let mut group = c.benchmark_group("pq");
    group.bench_function("identity_from_seed", |bench| {
        bench.iter(|| PqIdentity::from_seed(std::hint::black_box(&[3; SEED_LEN])))
    });
    group.bench_function("exchange_new_link", |bench| {
        bench.iter_batched(
            || pair(&a, &b),
            |(mut i, mut r)| exchange(&mut i, &mut r, start, &mut rng),
            BatchSize::SmallInput,
        )
    });
    group.bench_function("exchange_renewal", |bench| {
        bench.iter_batched(
            || {
                let (mut i, mut r) = pair(&a, &b);
                exchange(&mut i, &mut r, start, &mut 0x2545_f491_4f6c_dd1d);
                (i, r)
            },
            |(mut i, mut r)| exchange(&mut i, &mut r, start + PERIOD_MS, &mut rng),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

criterion_group!(benches, pq);
criterion_main!(benches);
