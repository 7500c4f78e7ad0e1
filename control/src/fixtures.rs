//! Cluster fixtures shared by tests and benchmarks: Kilo's fixture F1 and a generator of
//! large synthetic clusters.

use ipnet::IpNet;

use crate::ip::Endpoint;
use crate::key::Key;
use crate::node::{Granularity, Node};
use crate::peer::Peer;
use crate::topology::TopologyParams;

fn net(text: &str) -> IpNet {
    text.parse().expect("fixture CIDR")
}

/// The Unix time fixtures check in at.
pub const NOW: i64 = 1_700_000_000;

/// A ready node.
pub fn node(
    name: &str,
    endpoint: &str,
    internal_ip: Option<&str>,
    location: &str,
    pod_cidr: &str,
    key: &str,
) -> Node {
    Node {
        name: name.to_string(),
        endpoint: Some(Endpoint::parse(endpoint).expect("fixture endpoint")),
        internal_ip: internal_ip.map(net),
        key: Some(Key::padded(key)),
        last_seen: NOW,
        location: location.to_string(),
        subnet: Some(net(pod_cidr)),
        ..Default::default()
    }
}

/// Nodes `<prefix>1..=count` of `location`, all private: node `i` at `192.168.<subnet>.<i>`
/// (its endpoint on port 51820 and its internal IP, /24) with pods in `10.<subnet>.<i>.0/24`
/// and the key `k<prefix><i>`.
pub fn location_nodes(prefix: &str, location: &str, subnet: u8, count: u8) -> Vec<Node> {
    (1..=count)
        .map(|i| {
            node(
                &format!("{prefix}{i}"),
                &format!("192.168.{subnet}.{i}:51820"),
                Some(&format!("192.168.{subnet}.{i}/24")),
                location,
                &format!("10.{subnet}.{i}.0/24"),
                &format!("k{prefix}{i}"),
            )
        })
        .collect()
}

/// Fixture F1's parameters (Kilo subnet 10.4.0.0/16, port 51820, no keepalive) seen from
/// `hostname`.
pub fn f1_params(hostname: &str, granularity: Granularity) -> TopologyParams {
    TopologyParams {
        granularity,
        hostname: hostname.to_string(),
        port: 51820,
        subnet: net("10.4.0.0/16"),
        persistent_keepalive: 0,
        leaders_per_location: 1,
        kept_out: Default::default(),
    }
}

/// Kilo's fixture F1 nodes a, b, c, d.
pub fn f1_nodes() -> Vec<Node> {
    let mut a = node(
        "a",
        "10.1.0.1:51820",
        Some("192.168.0.1/32"),
        "1",
        "10.2.1.0/24",
        "key1",
    );
    a.persistent_keepalive = 25;
    let mut b = node(
        "b",
        "10.1.0.2:51820",
        Some("192.168.0.1/32"),
        "2",
        "10.2.2.0/24",
        "key2",
    );
    b.allowed_location_ips = vec![net("192.168.178.3/32")];
    let c = node(
        "c",
        "10.1.0.3:51820",
        Some("192.168.0.2/32"),
        "2",
        "10.2.3.0/24",
        "key3",
    );
    let d = node("d", "10.1.0.4:51820", None, "1", "10.2.4.0/24", "key4");
    vec![a, b, c, d]
}

/// Kilo's fixture F1 peers a and b.
pub fn f1_peers() -> Vec<Peer> {
    vec![
        Peer {
            name: "a".into(),
            allowed_ips: vec![net("10.5.0.1/24"), net("10.5.0.2/24")],
            public_key: Some(Key::padded("key4")),
            endpoint: None,
            persistent_keepalive: 0,
            preshared_key: None,
        },
        Peer {
            name: "b".into(),
            allowed_ips: vec![net("10.5.0.3/24")],
            public_key: Some(Key::padded("key5")),
            endpoint: Some(Endpoint::parse("192.168.0.1:51820").expect("fixture endpoint")),
            persistent_keepalive: 0,
            preshared_key: None,
        },
    ]
}

/// `count` ready nodes spread over `locations` locations, each with a distinct /24 pod CIDR,
/// private IP and key; the first node of every location has a public endpoint.
pub fn synthetic_cluster(count: usize, locations: usize) -> Vec<Node> {
    (0..count)
        .map(|i| {
            let loc = i % locations.max(1);
            let hi = (i >> 8) as u8;
            let lo = (i & 0xff) as u8;
            let endpoint = if i < locations {
                format!("203.0.{hi}.{lo}:51820")
            } else {
                format!("10.1.{hi}.{lo}:51820")
            };
            let mut key = [0u8; 32];
            key[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
            Node {
                name: format!("node-{i:05}"),
                endpoint: Some(Endpoint::parse(&endpoint).expect("synthetic endpoint")),
                internal_ip: Some(net(&format!("172.16.{hi}.{lo}/16"))),
                key: Some(Key(key)),
                last_seen: NOW,
                location: format!("loc-{loc:03}"),
                subnet: Some(net(&format!("10.{}.{}.0/24", 64 + (i >> 8), lo))),
                ..Default::default()
            }
        })
        .collect()
}

/// `node` as the Kubernetes object kg reads (Kilo's annotations, `spec.podCIDR` and, for a
/// dual-stack node, `spec.podCIDRs`), at
/// `resourceVersion` `resource_version`; translating it gives `node` back.
pub fn kube_node(node: &Node, resource_version: u64) -> k8s_openapi::api::core::v1::Node {
    use crate::node::annotation as a;
    use k8s_openapi::api::core::v1::{Node as KubeNode, NodeSpec};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    let mut annotations = std::collections::BTreeMap::new();
    let mut put = |k: &str, v: String| {
        annotations.insert(k.to_string(), v);
    };
    if let Some(e) = &node.endpoint {
        put(a::ENDPOINT, e.to_string());
    }
    if let Some(ip) = node.internal_ip {
        put(a::INTERNAL_IP, ip.to_string());
    }
    if let Some(ip) = node.second_internal_ip {
        put(a::SECOND_INTERNAL_IP, ip.to_string());
    }
    if let Some(k) = node.key {
        put(a::KEY, k.to_string());
    }
    put(a::LAST_SEEN, node.last_seen.to_string());
    put(a::LOCATION, node.location.clone());
    if node.persistent_keepalive != 0 {
        put(
            a::PERSISTENT_KEEPALIVE,
            node.persistent_keepalive.to_string(),
        );
    }
    if node.leader {
        put(a::LEADER, String::new());
    }
    KubeNode {
        metadata: ObjectMeta {
            name: Some(node.name.clone()),
            resource_version: Some(resource_version.to_string()),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: node.subnet.map(|s| s.to_string()),
            pod_cidrs: (!node.extra_subnets.is_empty())
                .then(|| node.pod_cidrs().map(|s| s.to_string()).collect()),
            ..Default::default()
        }),
        status: None,
    }
}
