//! Helpers for tests and benches: two engines wired to each other in memory, and IP packets.
//!
//! [`EnginePair`] passes each engine's network output straight to the other engine, like a
//! perfect wire, and collects what each would write to its TUN device. Time is whatever `now`
//! the caller gives.

use std::net::{IpAddr, SocketAddr};
use std::time::{Instant, SystemTime};

use crate::config::{DeviceConfig, InterfaceConfig, PeerConfig};
use crate::engine::Engine;
use crate::key::SecretKey;
use crate::outbox::Outbox;

/// An IPv4 or IPv6 packet from `source` to `destination` carrying `payload` (protocol 253,
/// reserved for experiments, so no stack ever answers it).
pub fn ip_packet(source: IpAddr, destination: IpAddr, payload: &[u8]) -> Vec<u8> {
    match (source, destination) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            let total = 20 + payload.len();
            let mut p = vec![0u8; total];
            p[0] = 0x45;
            p[2..4].copy_from_slice(&(total as u16).to_be_bytes());
            p[8] = 64;
            p[9] = 253;
            p[12..16].copy_from_slice(&s.octets());
            p[16..20].copy_from_slice(&d.octets());
            p[20..].copy_from_slice(payload);
            p
        }
        (IpAddr::V6(s), IpAddr::V6(d)) => {
            let mut p = vec![0u8; 40 + payload.len()];
            p[0] = 0x60;
            p[4..6].copy_from_slice(&(payload.len() as u16).to_be_bytes());
            p[6] = 253;
            p[7] = 64;
            p[8..24].copy_from_slice(&s.octets());
            p[24..40].copy_from_slice(&d.octets());
            p[40..].copy_from_slice(payload);
            p
        }
        _ => panic!("source and destination must be of one family"),
    }
}

/// One side of an [`EnginePair`].
#[derive(Debug)]
pub struct Side {
    /// The engine.
    pub engine: Engine,
    /// Its private key.
    pub key: SecretKey,
    /// The address its datagrams come from.
    pub addr: SocketAddr,
    /// Its tunnel address (the other side's allowed IP for it).
    pub tunnel_ip: IpAddr,
    /// Packets it wrote to its TUN device, oldest first.
    pub delivered: Vec<Vec<u8>>,
}

impl Side {
    /// Side number `n`: tunnel IP `10.0.0.<n>`, endpoint `192.0.2.<n>:51820`, a fresh key, and
    /// an engine on the shared clock `anchor`.
    pub fn numbered(anchor: (Instant, SystemTime), n: u8) -> Self {
        Self {
            engine: Engine::new(anchor, u32::from(n) << 12),
            key: SecretKey::generate(),
            addr: SocketAddr::from(([192, 0, 2, n], 51820)),
            tunnel_ip: IpAddr::from([10, 0, 0, n]),
            delivered: Vec::new(),
        }
    }

    /// The configuration that makes `peer` this side's only peer.
    pub fn config_with_peer(&self, peer: &Side) -> DeviceConfig {
        let mut p = PeerConfig::new(peer.key.public_key());
        p.endpoint = Some(peer.addr);
        p.add_allowed_ip(ipnet::IpNet::from(peer.tunnel_ip));
        DeviceConfig {
            interface: InterfaceConfig {
                private_key: Some(self.key.clone()),
                listen_port: self.addr.port(),
                fwmark: 0,
            },
            peers: vec![p],
        }
    }
}

/// Two engines configured as each other's peer, joined by a perfect in-memory wire.
#[derive(Debug)]
pub struct EnginePair {
    /// Side A (10.0.0.1, 192.0.2.1:51820).
    pub a: Side,
    /// Side B (10.0.0.2, 192.0.2.2:51820).
    pub b: Side,
}

impl EnginePair {
    /// Two configured engines that have not talked yet.
    pub fn new() -> Self {
        let anchor = (Instant::now(), SystemTime::now());
        let (a, b) = (Side::numbered(anchor, 1), Side::numbered(anchor, 2));
        a.engine.apply(&a.config_with_peer(&b));
        b.engine.apply(&b.config_with_peer(&a));
        Self { a, b }
    }

    /// Sends `payload` from A's tunnel address to B's through A's engine, then runs the wire
    /// until quiet.
    pub fn send_a_to_b(&mut self, now: Instant, payload: &[u8]) {
        let packet = ip_packet(self.a.tunnel_ip, self.b.tunnel_ip, payload);
        let mut out = Outbox::default();
        self.a
            .engine
            .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
        self.run(now, out, true);
    }

    /// Sends `payload` from B's tunnel address to A's, then runs the wire until quiet.
    pub fn send_b_to_a(&mut self, now: Instant, payload: &[u8]) {
        let packet = ip_packet(self.b.tunnel_ip, self.a.tunnel_ip, payload);
        let mut out = Outbox::default();
        self.b
            .engine
            .handle_tunnel_packets(now, [packet.as_slice()], &mut out);
        self.run(now, out, false);
    }

    /// Runs both engines' timers, then the wire until quiet.
    pub fn tick(&mut self, now: Instant) {
        let mut out = Outbox::default();
        self.a.engine.handle_timers(now, &mut out);
        self.run(now, out, true);
        let mut out = Outbox::default();
        self.b.engine.handle_timers(now, &mut out);
        self.run(now, out, false);
    }

    /// Delivers `out` (produced by A if `from_a`) to the other side, and the answers back,
    /// until nothing more is sent. Returns the number of datagrams moved.
    pub fn run(&mut self, now: Instant, mut out: Outbox, mut from_a: bool) -> usize {
        let mut moved = 0;
        for _ in 0..64 {
            let (sender, receiver) = if from_a {
                (&mut self.a, &mut self.b)
            } else {
                (&mut self.b, &mut self.a)
            };
            sender
                .delivered
                .extend(out.to_tunnel.iter().map(|(_, p)| p.to_vec()));
            if out.to_network.is_empty() {
                break;
            }
            let mut reply = Outbox::default();
            for (_, datagram) in out.to_network.iter() {
                moved += 1;
                receiver
                    .engine
                    .handle_datagram(now, sender.addr, datagram, &mut reply);
            }
            out = reply;
            from_a = !from_a;
        }
        moved
    }
}

impl Default for EnginePair {
    fn default() -> Self {
        Self::new()
    }
}

/// `len` deterministic pseudo-random bytes (xorshift64), advancing `state`: the garbage that
/// fuzz-style tests throw at a parser.
pub fn pseudo_random_bytes(state: &mut u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|_| {
            *state ^= *state << 13;
            *state ^= *state >> 7;
            *state ^= *state << 17;
            *state as u8
        })
        .collect()
}
