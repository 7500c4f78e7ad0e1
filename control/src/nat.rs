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
pub fn discover_nat_endpoints(
    device: &[DevicePeer],
    nodes: &[Node],
    peers: &[Peer],
) -> BTreeMap<Key, SocketAddr> {
    let live: BTreeMap<Key, SocketAddr> = device
        .iter()
        .filter(|p| p.has_handshake)
        .filter_map(|p| Some((p.public_key, p.endpoint?)))
        .collect();
    let mut found = BTreeMap::new();
    let node_keys = nodes
        .iter()
        .filter(|n| n.persistent_keepalive != 0)
        .filter_map(|n| n.key);
    let peer_keys = peers.iter().filter_map(|p| p.public_key);
    for key in node_keys.chain(peer_keys) {
        if let Some(addr) = live.get(&key) {
            found.insert(key, *addr);
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{f1_nodes, f1_peers};

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
        let found = discover_nat_endpoints(&device, &nodes, &peers);
        assert_eq!(
            found,
            BTreeMap::from([
                (Key::padded("key1"), "5.5.5.5:1000".parse().unwrap()),
                (Key::padded("key5"), "7.7.7.7:1000".parse().unwrap()),
            ])
        );
    }
}
