//! Entry points of the control plane's fuzz targets (`fuzz/fuzz_targets/`), shared with the test
//! that replays the committed corpus (`fuzz/corpus/`) on every `cargo test`. Each takes arbitrary
//! bytes, must never panic, and asserts the invariants that hold for any input.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node as KubeNode, NodeSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::ip::Endpoint;
use crate::key::Key;
use crate::node::{annotation, Granularity, Node};
use crate::peer::{translate_peer, Peer, PeerObject};
use crate::topology::{Topology, TopologyParams};

/// The annotations a user sets or kg writes, indexed by a byte of fuzz input.
const KEYS: [&str; 14] = [
    annotation::FORCE_ENDPOINT,
    annotation::FORCE_INTERNAL_IP,
    annotation::LEADER,
    annotation::LOCATION,
    annotation::PERSISTENT_KEEPALIVE,
    annotation::ALLOWED_LOCATION_IPS,
    annotation::ENDPOINT,
    annotation::INTERNAL_IP,
    annotation::KEY,
    annotation::LAST_SEEN,
    annotation::WIREGUARD_IP,
    annotation::DISCOVERED_ENDPOINTS,
    annotation::GRANULARITY,
    annotation::CNI_COMPATIBILITY_IP,
];

/// Node and Peer translation: the input is lines of `<key byte><value>` (annotations, plus the
/// pod CIDR under key byte `~`), and, separately, the whole input as a Peer object in JSON.
pub fn annotations(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let mut annotations = BTreeMap::new();
    let mut pod_cidr = None;
    for line in text.split('\n') {
        let mut chars = line.chars();
        let Some(first) = chars.next() else { continue };
        let value = chars.as_str().to_string();
        if first == '~' {
            pod_cidr = Some(value);
        } else {
            let key = KEYS[(first as usize) % KEYS.len()];
            annotations.insert(key.to_string(), value);
        }
    }
    let node = KubeNode {
        metadata: ObjectMeta {
            name: Some("fuzz".into()),
            annotations: Some(annotations.clone()),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr,
            ..Default::default()
        }),
        ..Default::default()
    };
    let (translated, problems) = crate::translate_node(&node, crate::node::DEFAULT_TOPOLOGY_LABEL);
    for problem in &problems {
        // Every problem names the node and one of the annotations it was given.
        assert_eq!(problem.object, "fuzz");
        assert!(
            annotations.contains_key(&problem.annotation) || problem.annotation == "spec.podCIDR",
            "{problem:?} names an annotation the node does not have"
        );
    }
    let _ = translated.is_ready(crate::fixtures::NOW);
    if let Ok(object) = serde_json::from_slice::<PeerObject>(data) {
        let valid = object.validate().is_ok();
        let peer = translate_peer(&object);
        if valid {
            // A valid Peer keeps every allowed IP and its key through translation.
            assert_eq!(peer.allowed_ips.len(), object.spec.allowed_ips.len());
            assert!(peer.public_key.is_some() || Key::parse(&object.spec.public_key).is_ok());
        }
    }
}

/// Reads fuzz bytes as a cluster of up to 8 nodes and 4 Peers: each node takes 6 bytes (location, private-IP octet or none,
/// public endpoint or none, keepalive, flags, key), each Peer 3 (allowed IP octet, prefix, key).
fn cluster(data: &[u8]) -> (Vec<Node>, Vec<Peer>, Granularity) {
    let granularity = if data.first().is_some_and(|b| b & 1 == 1) {
        Granularity::Full
    } else {
        Granularity::Location
    };
    let body = data.get(1..).unwrap_or(&[]);
    let (node_bytes, peer_bytes) = body.split_at((body.len() / 2 / 6 * 6).min(body.len()));
    let mut nodes = Vec::new();
    for (i, b) in node_bytes.chunks_exact(6).take(8).enumerate() {
        let private = (b[1] != 0).then(|| {
            IpNet::new(IpAddr::V4(Ipv4Addr::new(192, 168, b[1] % 4, b[1])), 24).expect("prefix")
        });
        let endpoint = (b[2] != 0).then(|| Endpoint {
            host: crate::ip::Host::Ip(IpAddr::V4(Ipv4Addr::new(203, 0, 113, b[2]))),
            port: 51820,
        });
        nodes.push(Node {
            name: format!("n{i:02}"),
            endpoint,
            internal_ip: private,
            key: Some(Key([b[5] | 1; 32])),
            last_seen: crate::fixtures::NOW,
            leader: b[4] & 1 == 1,
            location: format!("loc{}", b[0] % 4),
            subnet: Some(
                IpNet::new(IpAddr::V4(Ipv4Addr::new(10, 42, i as u8, 0)), 24).expect("prefix"),
            ),
            persistent_keepalive: u16::from(b[3] % 3) * 10,
            allowed_location_ips: if b[4] & 2 == 2 {
                vec![IpNet::new(IpAddr::V4(Ipv4Addr::new(172, 16, b[1], 0)), 24).expect("prefix")]
            } else {
                Vec::new()
            },
            ..Default::default()
        });
    }
    let peers = peer_bytes
        .chunks_exact(3)
        .take(4)
        .enumerate()
        .map(|(i, b)| Peer {
            name: format!("p{i}"),
            allowed_ips: vec![IpNet::new(
                IpAddr::V4(Ipv4Addr::new(10, 5, b[0], b[0])),
                16 + b[1] % 17,
            )
            .expect("prefix")
            .trunc()],
            public_key: Some(Key([b[2] | 0x80; 32])),
            endpoint: None,
            persistent_keepalive: 0,
            preshared_key: None,
        })
        .collect();
    (nodes, peers, granularity)
}

/// Topology on an arbitrary cluster, from every node's point of view: exactly one node leads
/// each segment, WireGuard IPs are unique, and no allowed IP is given to two WireGuard peers.
pub fn topology(data: &[u8]) {
    let (nodes, peers, granularity) = cluster(data);
    let mut leaders: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for node in &nodes {
        let params = TopologyParams {
            granularity,
            hostname: node.name.clone(),
            port: 51820,
            subnet: "10.4.0.0/16".parse().expect("subnet"),
            persistent_keepalive: 0,
            leaders_per_location: 1,
            kept_out: Default::default(),
        };
        let Ok(t) = Topology::new(&nodes, &peers, &params) else {
            continue;
        };
        let segment = t.local_segment().expect("every node is in a segment");
        let leader = &segment.members[segment.leader].name;
        leaders
            .entry(segment.key.clone())
            .or_default()
            .insert(leader.clone());
        assert_eq!(t.leader, *leader == node.name);
        let ips: BTreeSet<IpAddr> = t.segments.iter().map(|s| s.wireguard_ip).collect();
        assert_eq!(ips.len(), t.segments.len(), "duplicate WireGuard IP");
        let conf = t.conf(node.key.as_ref());
        let mut seen = BTreeSet::new();
        for peer in &conf.peers {
            for ip in &peer.allowed_ips {
                assert!(seen.insert(*ip), "{ip} is in two WireGuard peers");
            }
        }
        let _ = t.dot();
    }
    for (segment, names) in leaders {
        assert_eq!(names.len(), 1, "{segment} has leaders {names:?}");
    }
}

/// Runs `target` on every file of the committed corpus `fuzz/corpus/<name>`, and on nothing
/// else: returns how many inputs ran.
pub fn replay(name: &str, target: fn(&[u8])) -> usize {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fuzz/corpus")
        .join(name);
    let mut count = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("corpus entry").path();
        let data = std::fs::read(&path).expect("corpus file");
        target(&data);
        count += 1;
    }
    count
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_annotation_corpus_replays_without_a_panic() {
        assert!(replay("annotations", annotations) > 0);
    }

    #[test]
    fn the_topology_corpus_replays_with_every_invariant() {
        assert!(replay("topology", topology) > 0);
    }

    #[test]
    fn a_dense_cluster_keeps_the_invariants() {
        let data: Vec<u8> = (0..=255u8).cycle().take(400).collect();
        topology(&data);
        let mut full = data;
        full[0] = 1;
        topology(&full);
    }
}
