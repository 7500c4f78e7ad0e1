use serde_json::json;

use super::objects::{block_affinity, cilium_node, ipam_block, pod_addresses};
use super::*;

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn nets(list: &[&str]) -> Vec<IpNet> {
    list.iter().map(|s| net(s)).collect()
}

fn affinity(node: &str, cidr: &str, state: &str, deleted: &str) -> BlockAffinity {
    block_affinity(&json!({
        "apiVersion": "crd.projectcalico.org/v1",
        "kind": "BlockAffinity",
        "metadata": {"name": format!("{node}-{}", cidr.replace(['.', '/'], "-"))},
        "spec": {"node": node, "cidr": cidr, "state": state, "deleted": deleted}
    }))
    .unwrap()
}

/// An IPAMBlock affine to `host` whose addresses at `offsets` are given to pods on `nodes`.
fn block(cidr: &str, host: Option<&str>, given: &[(usize, &str)]) -> IpamBlock {
    let size = 1usize << (32 - net(cidr).prefix_len());
    let mut allocations = vec![serde_json::Value::Null; size];
    let mut attributes = Vec::new();
    for (i, (offset, node)) in given.iter().enumerate() {
        allocations[*offset] = json!(i);
        attributes.push(json!({
            "handle_id": format!("k8s-pod-network.{i}"),
            "secondary": {"namespace": "default", "node": node, "pod": format!("pod-{i}")}
        }));
    }
    ipam_block(&json!({
        "kind": "IPAMBlock",
        "metadata": {"name": cidr.replace(['.', '/'], "-")},
        "spec": {
            "cidr": cidr,
            "affinity": host.map(|h| format!("host:{h}")),
            "allocations": allocations,
            "attributes": attributes,
            "unallocated": [],
            "strictAffinity": false
        }
    }))
    .unwrap()
}

fn calico(affinities: Vec<BlockAffinity>, blocks: Vec<IpamBlock>) -> IpamObjects {
    IpamObjects {
        affinities: affinities
            .into_iter()
            .enumerate()
            .map(|(i, a)| (format!("a{i}"), a))
            .collect(),
        blocks: blocks
            .into_iter()
            .enumerate()
            .map(|(i, b)| (format!("b{i}"), b))
            .collect(),
        ..Default::default()
    }
}

#[test]
fn calico_routes_confirmed_blocks_to_their_nodes_and_borrowed_addresses_to_the_borrower() {
    let objects = calico(
        vec![
            affinity("a", "10.244.0.0/26", "confirmed", "false"),
            affinity("a", "10.244.0.64/26", "confirmed", "false"),
            affinity("b", "10.244.1.0/26", "confirmed", "false"),
            // Not yet the node's, and being released.
            affinity("b", "10.244.1.64/26", "pending", "false"),
            affinity("c", "10.244.2.0/26", "confirmed", "true"),
        ],
        // a's first block: its own pods at 0 and 1, and c's pod borrowed at 5.
        vec![block(
            "10.244.0.0/26",
            Some("a"),
            &[(0, "a"), (1, "a"), (5, "c")],
        )],
    );
    let ranges = pod_ranges(IpamSource::Calico, &objects).unwrap();
    assert!(ranges.problems.is_empty(), "{:?}", ranges.problems);
    assert_eq!(
        ranges.by_node["a"],
        nets(&["10.244.0.0/26", "10.244.0.64/26"])
    );
    assert_eq!(ranges.by_node["b"], nets(&["10.244.1.0/26"]));
    assert_eq!(ranges.by_node["c"], nets(&["10.244.0.5/32"]));
    assert_eq!(pod_ranges(IpamSource::Node, &objects), None);
}

#[test]
fn a_block_claimed_by_two_nodes_or_inside_another_nodes_is_refused_for_both() {
    let objects = calico(
        vec![
            affinity("a", "10.244.0.0/26", "confirmed", "false"),
            affinity("b", "10.244.0.0/26", "confirmed", "false"),
            affinity("c", "10.244.4.0/24", "confirmed", "false"),
            affinity("d", "10.244.4.64/26", "confirmed", "false"),
            affinity("e", "10.244.9.0/26", "confirmed", "false"),
        ],
        // The same address lent to two nodes' pods (a stale allocation).
        vec![
            block("10.244.9.0/26", Some("e"), &[(3, "f")]),
            block("10.244.9.0/26", None, &[(3, "g")]),
        ],
    );
    let ranges = pod_ranges(IpamSource::Calico, &objects).unwrap();
    for node in ["a", "b", "c", "d", "f", "g"] {
        assert!(
            !ranges.by_node.contains_key(node),
            "{node}: {:?}",
            ranges.by_node
        );
    }
    assert_eq!(
        ranges.by_node["e"],
        nets(&["10.244.9.0/26"]),
        "e keeps its block"
    );
    let all = ranges.problems.join("\n");
    assert!(
        all.contains("10.244.0.0/26 of node a") && all.contains("of node b"),
        "{all}"
    );
    assert!(
        all.contains("10.244.4.0/24 of node c (BlockAffinity) and 10.244.4.64/26 of node d"),
        "{all}"
    );
    assert!(
        all.contains("10.244.9.3/32 of node f") && all.contains("10.244.9.3/32 of node g"),
        "{all}"
    );
}

#[test]
fn cilium_takes_cluster_pool_and_multi_pool_ranges() {
    let node = cilium_node(&json!({
        "apiVersion": "cilium.io/v2",
        "kind": "CiliumNode",
        "metadata": {"name": "a"},
        "spec": {"ipam": {
            "podCIDRs": ["10.0.1.0/24", "fd00:1::/96"],
            "pools": {"allocated": [
                {"pool": "default", "cidrs": ["10.10.0.0/27"]},
                {"pool": "jupiter", "cidrs": ["10.20.0.0/28", "10.20.0.32/28"]}
            ]}
        }}
    }))
    .unwrap();
    assert_eq!(
        node.pod_cidrs,
        nets(&[
            "10.0.1.0/24",
            "fd00:1::/96",
            "10.10.0.0/27",
            "10.20.0.0/28",
            "10.20.0.32/28"
        ])
    );
    let objects = IpamObjects {
        cilium_nodes: [("a".to_string(), node)].into(),
        ..Default::default()
    };
    let ranges = pod_ranges(IpamSource::Cilium, &objects).unwrap();
    assert_eq!(
        ranges.by_node["a"],
        nets(&[
            "10.0.1.0/24",
            "10.10.0.0/27",
            "10.20.0.0/28",
            "10.20.0.32/28",
            "fd00:1::/96"
        ])
    );
}

fn pod(name: &str, node: &str, ips: &[&str], extra: serde_json::Value) -> serde_json::Value {
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"nodeName": node},
        "status": {"phase": "Running", "podIPs": ips.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}
    });
    if let (Some(pod), Some(extra)) = (pod.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            pod[k]
                .as_object_mut()
                .unwrap()
                .extend(v.as_object().unwrap().clone());
        }
    }
    pod
}

#[test]
fn pod_addresses_are_aggregated_per_node_and_host_network_or_ended_pods_left_out() {
    let mut objects = IpamObjects::default();
    let mut add = |value: serde_json::Value| {
        if let Some(p) = pod_addresses(&value).unwrap() {
            let name = value["metadata"]["name"].as_str().unwrap().to_string();
            objects.pods.insert(name, p);
        }
    };
    for i in 0..4 {
        add(pod(
            &format!("p{i}"),
            "a",
            &[&format!("10.1.0.{i}"), &format!("fd01::{i}")],
            json!({}),
        ));
    }
    add(pod("p9", "a", &["10.1.0.9"], json!({})));
    add(pod("q", "b", &["10.1.1.7"], json!({})));
    add(pod(
        "host",
        "b",
        &["192.168.0.2"],
        json!({"spec": {"hostNetwork": true}}),
    ));
    add(pod(
        "done",
        "b",
        &["10.1.1.8"],
        json!({"status": {"phase": "Succeeded"}}),
    ));
    add(pod("stale", "c", &["10.1.1.7"], json!({})));
    let ranges = pod_ranges(IpamSource::Pods, &objects).unwrap();
    assert_eq!(
        ranges.by_node["a"],
        nets(&["10.1.0.0/30", "10.1.0.9/32", "fd01::/126"])
    );
    // 10.1.1.7 is held by pods on b and c: neither gets it.
    assert!(!ranges.by_node.contains_key("b") && !ranges.by_node.contains_key("c"));
    assert_eq!(ranges.problems.len(), 1, "{:?}", ranges.problems);
}

#[test]
fn auto_picks_calico_only_where_it_gave_out_blocks_and_cilium_only_with_pod_ranges() {
    // Canal: Calico's CRDs are there, its IPAM is not (host-local): no confirmed affinity.
    let canal = calico(
        vec![affinity("a", "10.244.0.0/26", "pending", "false")],
        vec![],
    );
    let (source, why) = detect(&canal);
    assert_eq!(source, IpamSource::Node, "{why}");
    assert!(why.contains("spec.podCIDRs"), "{why}");
    let calico_cluster = calico(
        vec![affinity("a", "10.244.0.0/26", "confirmed", "false")],
        vec![],
    );
    assert_eq!(detect(&calico_cluster).0, IpamSource::Calico);
    let mut cilium = IpamObjects::default();
    cilium.cilium_nodes.insert(
        "a".into(),
        CiliumNode {
            node: "a".into(),
            pod_cidrs: Vec::new(),
        },
    );
    assert_eq!(
        detect(&cilium).0,
        IpamSource::Node,
        "a CiliumNode without ranges"
    );
    cilium.cilium_nodes.get_mut("a").unwrap().pod_cidrs = nets(&["10.0.0.0/24"]);
    let (source, why) = detect(&cilium);
    assert_eq!(source, IpamSource::Cilium);
    assert!(why.contains("1 CiliumNode"), "{why}");
}

#[test]
fn malformed_objects_are_refused_naming_the_object_and_the_field() {
    let cases = [
        (
            block_affinity(&json!({"metadata": {"name": "x"}, "spec": {"node": "a", "cidr": "10.0.0.0/33"}}))
                .unwrap_err(),
            "BlockAffinity \"x\": spec.cidr \"10.0.0.0/33\" is not a CIDR",
        ),
        (
            block_affinity(&json!({"metadata": {"name": "y"}, "spec": {"cidr": "10.0.0.0/26"}})).unwrap_err(),
            "BlockAffinity \"y\": spec.node is missing or not a string",
        ),
        (
            ipam_block(&json!({"metadata": {"name": "z"}, "spec": {"cidr": "10.0.0.0/30",
                "allocations": [0, null, null, null, 0], "attributes": [{"secondary": {"node": "a"}}]}}))
            .unwrap_err(),
            "IPAMBlock \"z\": spec.allocations has 5 entries, more than 10.0.0.0/30 holds",
        ),
        (
            ipam_block(&json!({"metadata": {"name": "w"}, "spec": {"cidr": "10.0.0.0/30", "allocations": ["x"]}}))
                .unwrap_err(),
            "IPAMBlock \"w\": spec.allocations[0] is \"x\", not an index",
        ),
        (
            cilium_node(&json!({"metadata": {"name": "n"}, "spec": {"ipam": {"podCIDRs": ["nope"]}}})).unwrap_err(),
            "CiliumNode \"n\": spec.ipam.podCIDRs \"nope\" is not a CIDR",
        ),
        (
            cilium_node(&json!({"metadata": {"name": "m"}, "spec": {"ipam": {"pools": {"allocated": [{"cidrs": [7]}]}}}}))
                .unwrap_err(),
            "CiliumNode \"m\": spec.ipam.pools.allocated[0]: cidrs holds 7, not a CIDR",
        ),
        (
            pod_addresses(&json!({"metadata": {"name": "p", "namespace": "ns"}, "spec": {"nodeName": "a"},
                "status": {"podIPs": [{"ip": "10.0.0.300"}]}}))
            .unwrap_err(),
            "Pod \"ns/p\": status.podIPs holds \"10.0.0.300\", not an address",
        ),
    ];
    for (error, want) in cases {
        assert_eq!(error.to_string(), want);
    }
    // An unscheduled pod holds no address of a node's yet.
    assert_eq!(
        pod_addresses(
            &json!({"metadata": {"name": "p"}, "spec": {}, "status": {"podIP": "10.0.0.1"}})
        ),
        Ok(None)
    );
}

#[test]
fn a_range_inside_its_own_nodes_refused_range_stays() {
    // a's /24 holds b's /26 (both refused) and another /26 of a's, which is a's alone.
    let objects = calico(
        vec![
            affinity("a", "10.244.0.0/24", "confirmed", "false"),
            affinity("b", "10.244.0.0/26", "confirmed", "false"),
            affinity("a", "10.244.0.128/26", "confirmed", "false"),
            // Inside a's surviving /24 elsewhere: a /26 of c's own /24 stays redundant.
            affinity("c", "10.245.0.0/24", "confirmed", "false"),
            affinity("c", "10.245.0.64/26", "confirmed", "false"),
        ],
        vec![],
    );
    let ranges = pod_ranges(IpamSource::Calico, &objects).unwrap();
    assert_eq!(ranges.by_node["a"], nets(&["10.244.0.128/26"]));
    assert!(!ranges.by_node.contains_key("b"));
    assert_eq!(ranges.by_node["c"], nets(&["10.245.0.0/24"]));
}

#[test]
fn nodes_run_by_kilos_kg_are_named_when_the_pods_come_from_elsewhere() {
    let node = |name: &str, lease: bool| crate::Node {
        name: name.to_string(),
        location: "east".to_string(),
        lease_election: lease,
        ..Default::default()
    };
    let nodes = [node("kilo1", false), node("kilotun1", true)];
    let named = kilo_agents_under(IpamSource::Calico, &nodes);
    assert_eq!(named.len(), 1, "{named:?}");
    let (node, line) = &named[0];
    assert_eq!(node, "kilo1");
    assert!(
        line.starts_with("node kilo1 (location east) runs Kilo's kg"),
        "{line}"
    );
    assert!(line.contains("not the calico pod ranges"), "{line}");
    assert!(kilo_agents_under(IpamSource::Node, &nodes).is_empty());
}
