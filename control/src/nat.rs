//! NAT endpoint discovery: what the live WireGuard device learned about roaming peers.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use crate::key::Key;
use crate::node::Node;
use crate::peer::Peer;

/// A peer as the running device reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePeer {
    /// The peer's public key.
    pub public_key: Key,
    /// The endpoint in use now (configured or roamed to).
    pub endpoint: Option<SocketAddr>,
    /// True once a handshake has completed.
    pub has_handshake: bool,
}

/// Kilo's `discoverNATEndpoints`: for every ready node with a non-zero keepalive, and every
/// ready Peer, that the device has completed a handshake with, the endpoint the device uses now.
///
/// Unlike Kilo, what was learned before (`previous`: the last discovery, or after a restart
/// what this node published and what the restored device held) is kept for a peer the device
/// still has but has not completed a handshake with since: the device has learned nothing
/// newer, and forgetting the endpoint would send the next configuration to the peer's
/// announced, often unreachable, address until the peer's next packet taught it again.
pub fn discover_nat_endpoints(
    device: &[DevicePeer],
    nodes: &[Node],
    peers: &[Peer],
    previous: &BTreeMap<Key, SocketAddr>,
) -> BTreeMap<Key, SocketAddr> {
    let live: BTreeMap<Key, &DevicePeer> = device.iter().map(|p| (p.public_key, p)).collect();
    let mut found = BTreeMap::new();
    let node_keys = nodes
        .iter()
        .filter(|n| n.persistent_keepalive != 0)
        .filter_map(|n| n.key);
    let peer_keys = peers.iter().filter_map(|p| p.public_key);
    for key in node_keys.chain(peer_keys) {
        let learned = match live.get(&key) {
            Some(p) if p.has_handshake => p.endpoint,
            Some(_) => previous.get(&key).copied(),
            None => None,
        };
        if let Some(addr) = learned {
            found.insert(key, addr);
        }
    }
    found
}

/// The peers whose endpoint in use moved between two discoveries: (key, from, to). A peer
/// discovered for the first time, or no longer discovered, moved nowhere.
pub fn endpoint_switches(
    previous: &BTreeMap<Key, SocketAddr>,
    found: &BTreeMap<Key, SocketAddr>,
) -> Vec<(Key, SocketAddr, SocketAddr)> {
    found
        .iter()
        .filter_map(|(key, to)| {
            let from = previous.get(key)?;
            (from != to).then_some((*key, *from, *to))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{f1_nodes, f1_peers};

    #[test]
    fn only_an_endpoint_that_moved_is_a_switch() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        let (a, b, c) = (Key::padded("a"), Key::padded("b"), Key::padded("c"));
        let previous = BTreeMap::from([(a, at("1.1.1.1:1")), (b, at("2.2.2.2:2"))]);
        let found = BTreeMap::from([
            (a, at("1.1.1.1:1")),
            (b, at("2.2.2.2:9")),
            (c, at("3.3.3.3:3")),
        ]);
        assert_eq!(
            endpoint_switches(&previous, &found),
            [(b, at("2.2.2.2:2"), at("2.2.2.2:9"))]
        );
        assert!(endpoint_switches(&found, &BTreeMap::new()).is_empty());
    }

    #[test]
    fn only_nated_nodes_and_peers_with_a_handshake_are_discovered() {
        let nodes = f1_nodes(); // a has keepalive 25, the others 0
        let peers = f1_peers(); // keys key4 and key5
        let device = vec![
            DevicePeer {
                public_key: Key::padded("key1"),
                endpoint: Some("5.5.5.5:1000".parse().unwrap()),
                has_handshake: true,
            },
            DevicePeer {
                public_key: Key::padded("key2"),
                endpoint: Some("6.6.6.6:1000".parse().unwrap()),
                has_handshake: true,
            },
            DevicePeer {
                public_key: Key::padded("key5"),
                endpoint: Some("7.7.7.7:1000".parse().unwrap()),
                has_handshake: true,
            },
            DevicePeer {
                public_key: Key::padded("key4"),
                endpoint: Some("8.8.8.8:1000".parse().unwrap()),
                has_handshake: false,
            },
        ];
        let found = discover_nat_endpoints(&device, &nodes, &peers, &BTreeMap::new());
        assert_eq!(
            found,
            BTreeMap::from([
                (Key::padded("key1"), "5.5.5.5:1000".parse().unwrap()),
                (Key::padded("key5"), "7.7.7.7:1000".parse().unwrap()),
            ])
        );
    }

    #[test]
    fn an_endpoint_learned_before_is_kept_until_a_new_handshake_teaches_another() {
        let nodes = f1_nodes(); // a (key1) has keepalive 25
        let learned: SocketAddr = "5.5.5.5:1000".parse().unwrap();
        let previous = BTreeMap::from([
            (Key::padded("key1"), learned),
            (Key::padded("key2"), "6.6.6.6:1".parse().unwrap()),
        ]);
        let restarted = |endpoint: &str, has_handshake| {
            vec![
                DevicePeer {
                    public_key: Key::padded("key1"),
                    endpoint: Some(endpoint.parse().unwrap()),
                    has_handshake,
                },
                DevicePeer {
                    public_key: Key::padded("key2"),
                    endpoint: Some("6.6.6.6:1".parse().unwrap()),
                    has_handshake: false,
                },
            ]
        };
        // Just restarted: no handshake yet, whatever endpoint the device holds.
        let found =
            discover_nat_endpoints(&restarted("10.0.0.1:51820", false), &nodes, &[], &previous);
        assert_eq!(
            found,
            BTreeMap::from([(Key::padded("key1"), learned)]),
            "kept for the NATed node; key2 (keepalive 0) is never discovered"
        );
        // A handshake from a new address wins.
        let found =
            discover_nat_endpoints(&restarted("7.7.7.7:2000", true), &nodes, &[], &previous);
        assert_eq!(found[&Key::padded("key1")], "7.7.7.7:2000".parse().unwrap());
        // A peer the device no longer has is forgotten.
        let found = discover_nat_endpoints(&[], &nodes, &[], &previous);
        assert!(found.is_empty());
    }
}
