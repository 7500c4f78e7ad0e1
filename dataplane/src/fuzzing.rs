//! Entry points of the dataplane's fuzz targets (`fuzz/fuzz_targets/`), shared with the test that
//! replays the committed corpus (`fuzz/corpus/`) on every `cargo test`. Each takes arbitrary bytes
//! and must never panic; the engine must stay usable afterwards.

use std::cell::Cell;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use crate::helpers::Helpers;
use crate::ipip::IpipTable;
use crate::outbox::Outbox;
use crate::testing::{ip_packet, EnginePair};
use crate::uapi::{apply_set, parse_get};
use crate::{DeviceConfig, InterfaceConfig, PeerConfig, SecretKey};

fn configured_device() -> DeviceConfig {
    let mut peer = PeerConfig::new(SecretKey::from_bytes([7; 32]).public_key());
    peer.add_allowed_ip("10.0.0.2/32".parse().expect("prefix"));
    DeviceConfig {
        interface: InterfaceConfig {
            private_key: Some(SecretKey::from_bytes([9; 32])),
            listen_port: 51820,
            fwmark: 0,
        },
        peers: vec![peer],
    }
}

/// A UAPI `set` body and a `get` answer: parsed against a configured device. An accepted body
/// yields a configuration that renders and parses back.
pub fn uapi_request(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let current = configured_device();
    if let Ok(next) = apply_set(&current, text) {
        let rendered = crate::uapi::format_get(&next, next.interface.listen_port, &[]);
        let (back, _) = parse_get(&rendered).expect("our own get answer parses");
        assert_eq!(back.peers.len(), next.peers.len());
    }
    let _ = parse_get(text);
}

thread_local! {
    static PAIR: EnginePair = {
        let mut pair = EnginePair::new();
        pair.send_a_to_b(Instant::now(), b"session");
        pair
    };
}

/// Any datagram at the listen port of an engine with a live session, as every message type:
/// nothing panics, and the session still carries traffic afterwards.
pub fn datagram(data: &[u8]) {
    PAIR.with(|pair| {
        let now = Instant::now();
        let from = SocketAddr::from(([198, 51, 100, 1], 4000));
        let mut out = Outbox::default();
        pair.a.engine.handle_datagram(now, from, data, &mut out);
        if let Some(first) = data.first() {
            let mut typed = data.to_vec();
            typed[0] = 1 + first % 4;
            for b in typed.iter_mut().skip(1).take(3) {
                *b = 0;
            }
            out.clear();
            pair.a.engine.handle_datagram(now, from, &typed, &mut out);
        }
    });
}

/// Any packet read from the TUN device: header parsing, routing and encryption, and the IPIP
/// table's gateway and unwrap decisions.
pub fn tun_packet(data: &[u8]) {
    let _ = crate::packet::parse_header(data);
    let table = IpipTable::new(
        [(
            "10.0.0.0/8".parse().expect("prefix"),
            IpAddr::from([192, 168, 0, 1]),
        )],
        [IpAddr::from([192, 168, 0, 1])],
    );
    let _ = table.gateway(data);
    let _ = table.unwrap(data);
    PAIR.with(|pair| {
        let mut out = Outbox::default();
        pair.a
            .engine
            .handle_tunnel_packets(Instant::now(), [data], &mut out);
        // A well-formed packet to the peer still goes out after arbitrary ones.
        let probe = ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, b"probe");
        out.clear();
        pair.a
            .engine
            .handle_tunnel_packets(Instant::now(), [probe.as_slice()], &mut out);
        assert_eq!(out.to_network.len(), 1, "the session stopped working");
    });
}

/// A pair whose B side opens with a helper thread (its engine keeps it), the one instant every
/// batch is handled at, and the number of the next packet A sends.
struct SpreadPair {
    pair: EnginePair,
    now: Instant,
    next: Cell<u64>,
}

thread_local! {
    static SPREAD_PAIR: SpreadPair = {
        let mut pair = EnginePair::new();
        pair.b.engine.use_helpers(Arc::new(Helpers::start(1).expect("a helper thread")));
        // One instant for every batch: the session never ages, however long the fuzzer runs.
        let now = Instant::now();
        pair.send_a_to_b(now, b"session");
        SpreadPair { pair, now, next: Cell::new(0) }
    };
}

/// Packets in each batch of [`datagram_batch`]: 48 of 1400 bytes, past the size at which a
/// batch is spread over the helpers.
const BATCH_PACKETS: u64 = 48;

/// One batch of data messages from one peer, big enough to be opened by the worker and a
/// helper together, changed as `data` says (three bytes an edit: altered, truncated, repeated,
/// moved, dropped, or raw bytes put in): nothing panics, and B delivers exactly the genuine,
/// unchanged messages, each once (the first copy), in the order they came, each packet as sent.
pub fn datagram_batch(data: &[u8]) {
    SPREAD_PAIR.with(|spread| {
        let (pair, now) = (&spread.pair, spread.now);
        let first = spread.next.get();
        spread.next.set(first + BATCH_PACKETS);
        let packets: Vec<Vec<u8>> = (first..first + BATCH_PACKETS)
            .map(|seq| {
                let mut payload = vec![(seq % 251) as u8; 1380];
                payload[..8].copy_from_slice(&seq.to_le_bytes());
                ip_packet(pair.a.tunnel_ip, pair.b.tunnel_ip, &payload)
            })
            .collect();
        let mut sealed = Outbox::default();
        pair.a
            .engine
            .handle_tunnel_packets(now, packets.iter().map(Vec::as_slice), &mut sealed);
        let genuine: Vec<Vec<u8>> = sealed.to_network.iter().map(|(_, d)| d.to_vec()).collect();
        assert_eq!(genuine.len() as u64, BATCH_PACKETS, "A sealed every packet");
        let mut batch = genuine.clone();
        apply_edits(&mut batch, data);
        // What B must deliver: the datagrams still equal to one A sealed (edits can undo each
        // other), the first copy of each, in the order they came.
        let mut expected = Vec::new();
        for datagram in &batch {
            if let Some(seq) = genuine
                .iter()
                .position(|g| g == datagram)
                .map(|i| first + i as u64)
            {
                if !expected.contains(&seq) {
                    expected.push(seq);
                }
            }
        }
        let mut out = Outbox::default();
        pair.b.engine.handle_datagrams(
            now,
            batch
                .iter()
                .map(|datagram| (pair.a.addr, datagram.as_slice())),
            &mut out,
        );
        let delivered: Vec<u64> = out
            .to_tunnel
            .iter()
            .map(|(_, packet)| {
                let seq = u64::from_le_bytes(packet[20..28].try_into().expect("8 bytes"));
                let sent = &packets[usize::try_from(seq - first).expect("this batch's")];
                assert_eq!(packet, sent.as_slice(), "packet {seq} delivered as sent");
                seq
            })
            .collect();
        assert_eq!(
            delivered, expected,
            "the genuine messages, each once, in order"
        );
    });
}

/// Edits `batch` as `edits` says, three bytes an edit (what, which datagram, an argument): a bit
/// flipped, a datagram truncated, repeated, moved or dropped, or the next bytes of `edits` put in
/// as a datagram of their own. Stops at 256 datagrams or none.
fn apply_edits(batch: &mut Vec<Vec<u8>>, mut edits: &[u8]) {
    while let [op, at, arg, rest @ ..] = edits {
        edits = rest;
        if batch.is_empty() || batch.len() >= 256 {
            break;
        }
        let (i, arg) = (usize::from(*at) % batch.len(), usize::from(*arg));
        match op % 6 {
            0 => {
                let datagram = &mut batch[i];
                if !datagram.is_empty() {
                    let at = arg * 7 % datagram.len();
                    datagram[at] ^= 1 << (arg % 8);
                }
            }
            1 => {
                let len = batch[i].len();
                batch[i].truncate(arg * 8 % len.max(1));
            }
            2 => {
                let copy = batch[i].clone();
                batch.insert(arg % (batch.len() + 1), copy);
            }
            3 => {
                let moved = batch.remove(i);
                batch.insert(arg % (batch.len() + 1), moved);
            }
            4 => {
                batch.remove(i);
            }
            _ => {
                let (raw, rest) = edits.split_at(arg.min(edits.len()));
                edits = rest;
                batch.insert(i, raw.to_vec());
            }
        }
    }
}

/// Runs `target` on every file of the committed corpus `fuzz/corpus/<name>`: returns how many
/// inputs ran.
pub fn replay(name: &str, target: fn(&[u8])) -> usize {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(name);
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let data = std::fs::read(entry.expect("corpus entry").path()).expect("corpus file");
        target(&data);
        count += 1;
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_uapi_corpus_replays_without_a_panic() {
        assert!(replay("uapi_request", uapi_request) > 0);
    }

    #[test]
    fn the_datagram_corpus_replays_without_a_panic() {
        assert!(replay("datagram", datagram) > 0);
    }

    #[test]
    fn the_datagram_batch_corpus_replays_with_exact_delivery() {
        assert!(replay("datagram_batch", datagram_batch) > 0);
    }

    #[test]
    fn the_tun_packet_corpus_replays_and_the_session_survives() {
        assert!(replay("tun_packet", tun_packet) > 0);
    }
}
