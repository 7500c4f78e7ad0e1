//! Longest-prefix-match lookup in the allowed-IPs table at 10, 1,000 and 10,000 prefixes.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use std::net::{IpAddr, Ipv4Addr};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use dataplane::allowed_ips::AllowedIps;
use kilotun_bench::prefixes;

fn lookup(c: &mut Criterion) {
    let mut group = c.benchmark_group("allowed_ips/lookup");
    for count in [10usize, 1_000, 10_000] {
        let mut table = AllowedIps::new();
        for (i, prefix) in prefixes(count).into_iter().enumerate() {
            table.insert(prefix, i);
        }
        let probes: Vec<IpAddr> = (0..1024u32)
            .map(|i| IpAddr::V4(Ipv4Addr::from(i.wrapping_mul(2_654_435_761))))
            .collect();
        group.bench_with_input(BenchmarkId::from_parameter(count), &probes, |b, probes| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % probes.len();
                std::hint::black_box(table.lookup(probes[i]))
            });
        });
    }
    group.finish();
}

criterion_group!(benches, lookup);
criterion_main!(benches);
