//! A configuration's size against the time to take it: one peer with 1,000, 8,000, 32,000 and
//! 130,560 allowed IPs, as `wg setconf` sends it (`replace_peers=true`, the peer's whole list
//! behind `replace_allowed_ips=true`). `parse` is the UAPI request turned into the next
//! configuration; `engine` is that configuration made the engine's (its allowed-IP table
//! built); `setconf` is both through a running device over the in-memory twins, onto a device
//! that already has the list, as a second `wg setconf` finds it. Each step is linear in the
//! number of allowed IPs: ten times the list, about ten times the time.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use std::fmt::Write as _;
use std::time::{Instant, SystemTime};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dataplane::device::Device;
use dataplane::io::mem::{MemBinder, MemNet, MemTun};
use dataplane::{uapi, DeviceConfig, Engine, SecretKey};

const SIZES: [usize; 4] = [1_000, 8_000, 32_000, 130_560];

/// The body of the `set=1` request `wg setconf` sends for one peer with `count` allowed IPs
/// (distinct /32s from 10.0.0.0 up, then /128s), without the `set=1` line.
fn setconf_body(count: usize) -> String {
    let own = SecretKey::from_bytes([1; 32]);
    let peer = SecretKey::from_bytes([2; 32]).public_key();
    let mut body = format!(
        "private_key={}\nlisten_port=0\nreplace_peers=true\npublic_key={}\n\
         endpoint=192.0.2.2:51820\nreplace_allowed_ips=true\n",
        own.expose_hex().as_str(),
        peer.to_hex()
    );
    for i in 0..count as u32 {
        let _ = match i.checked_sub(1 << 24) {
            None => writeln!(
                body,
                "allowed_ip={}/32",
                std::net::Ipv4Addr::from(0x0a00_0000 + i)
            ),
            Some(j) => writeln!(body, "allowed_ip=fd00::{j:x}/128"),
        };
    }
    body
}

fn config_size(c: &mut Criterion) {
    let mut group = c.benchmark_group("config_size");
    group.sample_size(10);
    let net = MemNet::new();
    let device = Device::start(
        vec![MemTun::new()],
        MemBinder::new(&net, [192, 0, 2, 1].into()),
    )
    .expect("device");
    for count in SIZES {
        let body = setconf_body(count);
        let config = uapi::apply_set(&DeviceConfig::default(), &body).expect("valid request");
        assert_eq!(config.peers[0].allowed_ips.len(), count);
        group.throughput(Throughput::Elements(count as u64));
        group.bench_with_input(BenchmarkId::new("parse", count), &body, |b, body| {
            b.iter(|| uapi::apply_set(&DeviceConfig::default(), body).expect("valid"));
        });
        let engine = Engine::new((Instant::now(), SystemTime::now()), 1);
        group.bench_with_input(BenchmarkId::new("engine", count), &config, |b, config| {
            b.iter(|| engine.apply(config));
        });
        device.uapi_set(&body).expect("first setconf");
        group.bench_with_input(BenchmarkId::new("setconf", count), &body, |b, body| {
            b.iter(|| device.uapi_set(body).expect("setconf"));
        });
    }
    group.finish();
    device.shutdown();
}

criterion_group!(benches, config_size);
criterion_main!(benches);
