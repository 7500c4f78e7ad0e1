//! Seal and open of one WireGuard data packet's payload at 64, 512, 1,420 and 8,192 bytes
//! through ring, aws-lc-rs and OpenSSL's EVP interface (see Cargo.toml).

#![allow(missing_docs)]

use aead_bench::{AwsLc, OpenSsl, PacketAead, Ring};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

const SIZES: [usize; 4] = [64, 512, 1420, 8192];

fn implementations() -> Vec<(&'static str, Box<dyn PacketAead>)> {
    let key = [0x42u8; 32];
    vec![
        ("ring", Box::new(Ring::new(&key))),
        ("aws-lc-rs", Box::new(AwsLc::new(&key))),
        ("openssl", Box::new(OpenSsl::new(&key))),
    ]
}

fn seal(c: &mut Criterion) {
    let mut group = c.benchmark_group("aead/seal");
    for size in SIZES {
        group.throughput(Throughput::Bytes(size as u64));
        for (name, mut aead) in implementations() {
            let mut data = vec![0x5au8; size];
            let mut counter = 0u64;
            group.bench_function(BenchmarkId::new(name, size), |b| {
                b.iter(|| {
                    counter += 1;
                    aead.seal(counter, &mut data)
                })
            });
        }
    }
    group.finish();
}

fn open(c: &mut Criterion) {
    let mut group = c.benchmark_group("aead/open");
    for size in SIZES {
        group.throughput(Throughput::Bytes(size as u64));
        for (name, mut aead) in implementations() {
            let mut sealed = vec![0x5au8; size];
            let tag = aead.seal(7, &mut sealed);
            sealed.extend_from_slice(&tag);
            let mut scratch = sealed.clone();
            group.bench_function(BenchmarkId::new(name, size), |b| {
                b.iter(|| {
                    // Opening decrypts in place: start each time from the sealed packet.
                    scratch.copy_from_slice(&sealed);
                    assert!(aead.open(7, &mut scratch));
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, seal, open);
criterion_main!(benches);
