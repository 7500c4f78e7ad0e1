//! Benchmark: sanstun 0.1.0 data path, 1420-byte plaintext, one peer, 1 and 2 threads.
//!
//! Env: SECS (timed seconds per case, default 3), POOL (datagrams pre-sealed per open round,
//! default 4096), CASES (comma list of seal1,seal2,open1,open2; default all).
//!
//! seal: each worker locks the sender Tunnel only for `begin_encapsulate` x BATCH, then runs
//!       `PendingEncapsulate::encrypt` for the batch outside the lock.
//! open: each worker claims BATCH datagrams from a pre-sealed pool; under the receiver lock it
//!       runs `Interface::receive` (needs &mut) + `Tunnel::begin_decapsulate` (&self) for the
//!       batch, then `PendingDecapsulate::decrypt` outside the lock, then locks again for
//!       `Tunnel::commit_decapsulate` x BATCH.

use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex, RwLock};
use std::time::{Duration, Instant};

use sanstun::{Committed, Interface, PendingDecapsulate, Received, ReceivedMessage, Tunnel, TunnelConfig};
use zeroize::Zeroizing;

const PT_LEN: usize = 1420;
/// 16-byte header + plaintext padded to 16 + 16-byte tag.
const DG_LEN: usize = 16 + PT_LEN.next_multiple_of(16) + 16;
const BATCH: usize = 64;

fn env_f64(name: &str, default: f64) -> f64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn ipv4_packet(len: usize) -> Vec<u8> {
    let mut p = vec![0u8; len];
    p[0] = 0x45;
    p[2..4].copy_from_slice(&(len as u16).to_be_bytes());
    p[8] = 64; // TTL
    p[9] = 17; // UDP
    p[12..16].copy_from_slice(&[10, 0, 0, 1]);
    p[16..20].copy_from_slice(&[10, 0, 0, 2]);
    for (i, b) in p[20..].iter_mut().enumerate() {
        *b = i as u8;
    }
    p
}

struct Pair {
    a_tunnel: Tunnel,
    b_iface: Interface,
    b_tunnel: Tunnel,
    a_addr: SocketAddr,
    now: Instant,
}

/// Two interfaces, one tunnel each, handshake done in memory (incl. the confirming keepalive).
fn established(seed: u8) -> Pair {
    // Frozen clock: sessions never expire during the run (REJECT_AFTER_TIME = 180 s).
    let now = Instant::now();
    let unix = Duration::from_secs(1_700_000_000);
    let a_addr: SocketAddr = "192.0.2.1:51820".parse().unwrap();
    let b_addr: SocketAddr = "192.0.2.2:51820".parse().unwrap();
    let mut a_iface = Interface::new(Zeroizing::new([seed; 32]), now, unix);
    let mut b_iface = Interface::new(Zeroizing::new([seed.wrapping_add(100); 32]), now, unix);
    let mut a_tunnel = a_iface
        .new_tunnel(b_iface.static_public(), TunnelConfig::default(), now)
        .unwrap();
    let mut b_tunnel = b_iface
        .new_tunnel(a_iface.static_public(), TunnelConfig::default(), now)
        .unwrap();

    let init = a_tunnel.initiate_handshake(now).unwrap();
    let Received::Message(ReceivedMessage::HandshakeInitiation(init)) =
        b_iface.receive(a_addr, &init, now).unwrap()
    else {
        panic!("expected initiation")
    };
    let resp = b_tunnel.handle_handshake_initiation(init, now).unwrap();
    let Received::Message(ReceivedMessage::HandshakeResponse(resp)) =
        a_iface.receive(b_addr, &resp, now).unwrap()
    else {
        panic!("expected response")
    };
    let keepalive = a_tunnel.handle_handshake_response(resp, now).unwrap();
    let Received::Message(ReceivedMessage::TransportData(td)) =
        b_iface.receive(a_addr, &keepalive, now).unwrap()
    else {
        panic!("expected keepalive data")
    };
    let dec = b_tunnel
        .begin_decapsulate(td, now)
        .unwrap()
        .decrypt(&keepalive, vec![0u8; 64]);
    assert!(matches!(
        b_tunnel.commit_decapsulate(dec, now).unwrap(),
        Committed::Keepalive
    ));
    while b_tunnel.poll_event().is_some() {}
    while a_tunnel.poll_event().is_some() {}

    Pair { a_tunnel, b_iface, b_tunnel, a_addr, now }
}

fn gib_s(packets: u64, elapsed: Duration) -> f64 {
    (packets as f64 * PT_LEN as f64) / elapsed.as_secs_f64() / (1u64 << 30) as f64
}

fn bench_seal(workers: usize, secs: f64) -> f64 {
    let pair = established(1 + workers as u8);
    let now = pair.now;
    let tunnel = Mutex::new(pair.a_tunnel);
    let plaintext = ipv4_packet(PT_LEN);
    let stop = AtomicBool::new(false);
    let barrier = Barrier::new(workers + 1);

    let (packets, elapsed) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                let (tunnel, plaintext, stop, barrier) = (&tunnel, &plaintext, &stop, &barrier);
                s.spawn(move || {
                    let mut out = vec![0u8; BATCH * DG_LEN];
                    let mut pending = Vec::with_capacity(BATCH);
                    let mut n = 0u64;
                    barrier.wait();
                    while !stop.load(Ordering::Relaxed) {
                        {
                            let mut t = tunnel.lock().unwrap();
                            for _ in 0..BATCH {
                                pending.push(t.begin_encapsulate(now).unwrap());
                            }
                        }
                        for (p, dst) in pending.drain(..).zip(out.chunks_exact_mut(DG_LEN)) {
                            let m = p.encrypt(plaintext, dst).unwrap();
                            assert_eq!(m.len(), DG_LEN);
                            black_box(&*m);
                        }
                        n += BATCH as u64;
                    }
                    n
                })
            })
            .collect();
        barrier.wait();
        let t0 = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(secs));
        stop.store(true, Ordering::Relaxed);
        let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        (total, t0.elapsed())
    });
    gib_s(packets, elapsed)
}

fn bench_open(workers: usize, secs: f64, pool_len: usize) -> f64 {
    let pool_len = pool_len.next_multiple_of(BATCH);
    let pair = established(11 + workers as u8);
    let now = pair.now;
    let a_addr = pair.a_addr;
    let mut a_tunnel = pair.a_tunnel;
    let receiver = Mutex::new((pair.b_iface, pair.b_tunnel));
    let plaintext = ipv4_packet(PT_LEN);
    let pool = RwLock::new(vec![0u8; pool_len * DG_LEN]);
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let barrier = Barrier::new(workers + 1);

    let (packets, elapsed) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                let (receiver, pool, next, stop, barrier) = (&receiver, &pool, &next, &stop, &barrier);
                s.spawn(move || {
                    let mut out = vec![0u8; BATCH * DG_LEN];
                    let mut pending: Vec<(usize, PendingDecapsulate)> = Vec::with_capacity(BATCH);
                    let mut n = 0u64;
                    loop {
                        barrier.wait(); // round start
                        if stop.load(Ordering::Relaxed) {
                            return n;
                        }
                        {
                            let pool = pool.read().unwrap();
                            loop {
                                let start = next.fetch_add(BATCH, Ordering::Relaxed);
                                if start >= pool_len {
                                    break;
                                }
                                {
                                    let mut g = receiver.lock().unwrap();
                                    let (iface, tunnel) = &mut *g;
                                    for i in start..start + BATCH {
                                        let dg = &pool[i * DG_LEN..(i + 1) * DG_LEN];
                                        let Received::Message(ReceivedMessage::TransportData(td)) =
                                            iface.receive(a_addr, dg, now).unwrap()
                                        else {
                                            panic!("expected data")
                                        };
                                        pending.push((i, tunnel.begin_decapsulate(td, now).unwrap()));
                                    }
                                }
                                let decrypted: Vec<_> = pending
                                    .drain(..)
                                    .zip(out.chunks_exact_mut(DG_LEN))
                                    .map(|((i, p), dst)| {
                                        p.decrypt(&pool[i * DG_LEN..(i + 1) * DG_LEN], dst)
                                    })
                                    .collect();
                                {
                                    let mut g = receiver.lock().unwrap();
                                    for d in decrypted {
                                        match g.1.commit_decapsulate(d, now).unwrap() {
                                            Committed::Data { buffer, len } => {
                                                assert_eq!(len, PT_LEN.next_multiple_of(16));
                                                assert_eq!(buffer[0], 0x45);
                                                black_box(buffer);
                                            }
                                            Committed::Keepalive => panic!("unexpected keepalive"),
                                        }
                                    }
                                }
                                n += BATCH as u64;
                            }
                        }
                        barrier.wait(); // round end
                    }
                })
            })
            .collect();

        let mut timed = Duration::ZERO;
        while timed.as_secs_f64() < secs {
            // Untimed: A seals a fresh pool (each datagram can be opened only once).
            {
                let mut pool = pool.write().unwrap();
                for dst in pool.chunks_exact_mut(DG_LEN) {
                    let m = a_tunnel.begin_encapsulate(now).unwrap().encrypt(&plaintext, dst).unwrap();
                    assert_eq!(m.len(), DG_LEN);
                }
            }
            next.store(0, Ordering::Relaxed);
            barrier.wait();
            let t0 = Instant::now();
            barrier.wait();
            timed += t0.elapsed();
        }
        stop.store(true, Ordering::Relaxed);
        barrier.wait();
        let total: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
        (total, timed)
    });
    gib_s(packets, elapsed)
}

fn main() {
    let secs = env_f64("SECS", 3.0);
    let pool = env_f64("POOL", 4096.0) as usize;
    let cases = std::env::var("CASES").unwrap_or_else(|_| "seal1,seal2,open1,open2".into());
    for case in cases.split(',') {
        let (dir, workers) = match case.trim() {
            "seal1" => ("seal", 1),
            "seal2" => ("seal", 2),
            "open1" => ("open", 1),
            "open2" => ("open", 2),
            other => panic!("unknown case {other}"),
        };
        let g = if dir == "seal" { bench_seal(workers, secs) } else { bench_open(workers, secs, pool) };
        println!("sanstun dir={dir} workers={workers} gib_s={g:.2}");
    }
}
