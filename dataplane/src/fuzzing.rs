//! Entry points of the dataplane's fuzz targets (`fuzz/fuzz_targets/`), shared with the test that
//! replays the committed corpus (`fuzz/corpus/`) on every `cargo test`. Each takes arbitrary bytes
//! and must never panic; the engine must stay usable afterwards.

use std::net::{IpAddr, SocketAddr};
use std::time::Instant;

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
    fn the_tun_packet_corpus_replays_and_the_session_survives() {
        assert!(replay("tun_packet", tun_packet) > 0);
    }
}
