use super::*;
use std::collections::{BTreeMap, BTreeSet};

use control::node::annotation as a;
use k8s_openapi::api::core::v1::{Node as KubeNode, NodeSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

const NOW: i64 = 1_700_000_000;

fn kube_node(name: &str, location: &str, ip: u8, extra: &[(&str, &str)]) -> KubeNode {
    let key = control::Key::padded(name).to_base64();
    let mut annotations: BTreeMap<String, String> = [
        (a::LOCATION, location.to_string()),
        (a::ENDPOINT, format!("192.168.0.{ip}:51820")),
        (a::INTERNAL_IP, format!("192.168.0.{ip}/24")),
        (a::KEY, key),
        (a::LAST_SEEN, NOW.to_string()),
        (a::GRANULARITY, "location".to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    for (k, v) in extra {
        annotations.insert(k.to_string(), v.to_string());
    }
    KubeNode {
        metadata: ObjectMeta {
            name: Some(name.into()),
            annotations: Some(annotations),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: Some(format!("10.42.{ip}.0/24")),
            ..Default::default()
        }),
        status: None,
    }
}

fn snapshot() -> Snapshot {
    let mut s = Snapshot::default();
    for (name, loc, ip) in [("a", "east", 1), ("b", "east", 2), ("c", "west", 3)] {
        s.put_node(
            name,
            kube_node(name, loc, ip, &[(a::WIREGUARD_IP, "10.7.0.1/16")]),
        );
    }
    let mut stale = kube_node("d", "west", 4, &[]);
    stale
        .metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(a::LAST_SEEN.into(), "5".into());
    s.put_node("d", stale);
    let peer: control::PeerObject = serde_saphyr::from_str(
        "metadata: {name: laptop}\nspec: {allowedIPs: [10.5.0.1/32], publicKey: a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=, persistentKeepalive: 10}",
    )
    .unwrap();
    s.peers.insert("laptop".into(), peer);
    s
}

fn showconf_args(kind: &str, name: &str, as_peer: bool) -> ShowconfArgs {
    ShowconfArgs {
        kind: kind.into(),
        name: name.into(),
        as_peer,
        output: "wireguard".into(),
        allowed_ips: vec!["10.43.0.0/16".into()],
        live: false,
        kg_port: 1107,
    }
}

#[test]
fn the_view_uses_ready_nodes_the_published_subnet_and_auto_granularity() {
    let v = view(&snapshot(), "auto", DEFAULT_TOPOLOGY_LABEL, NOW).unwrap();
    let names: Vec<&str> = v.nodes.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names, ["a", "b", "c"], "d's check-in is stale");
    assert_eq!(v.subnet.to_string(), "10.7.0.0/16");
    assert_eq!(v.granularity, Granularity::Location);
    assert_eq!(v.peers.len(), 1);
    assert!(view(&snapshot(), "crisscross", DEFAULT_TOPOLOGY_LABEL, NOW).is_err());
    assert_eq!(
        view(&snapshot(), "cross", DEFAULT_TOPOLOGY_LABEL, NOW)
            .unwrap()
            .granularity,
        Granularity::Cross
    );
}

#[test]
fn graph_draws_every_segment_and_peer() {
    let v = view(&snapshot(), "auto", DEFAULT_TOPOLOGY_LABEL, NOW).unwrap();
    let dot = graph(&v).unwrap();
    assert!(dot.contains("label=\"10.7.0.0/16\""));
    assert!(
        dot.contains("cluster_location_location:east")
            && dot.contains("cluster_location_location:west")
    );
    assert!(dot.contains("\t\"a\" -> \"c\" [dir=both];"));
    assert!(dot.contains("\"a\" -> \"laptop\" [dir=both, style=dashed]"));
}

#[test]
fn showconf_node_prints_a_leaders_peers_or_says_it_is_not_a_leader() {
    let v = view(&snapshot(), "auto", DEFAULT_TOPOLOGY_LABEL, NOW).unwrap();
    let (out, err) = showconf(&v, &showconf_args("node", "a", false), 51820, None).unwrap();
    assert!(err.is_empty());
    assert!(out.starts_with("[Interface]\nListenPort = 51820\n\n[Peer]\nAllowedIPs = 10.42.3.0/24, 192.168.0.3/32, 10.7.0.2/32\n"), "{out}");
    assert!(out.contains("AllowedIPs = 10.5.0.1/32\n"));
    let (out, err) = showconf(&v, &showconf_args("node", "b", false), 51820, None).unwrap();
    assert!(out.is_empty());
    assert_eq!(err, "Node \"b\" is not a leader node\n");
    let (out, _) = showconf(&v, &showconf_args("node", "b", true), 51820, None).unwrap();
    assert!(out.contains("AllowedIPs = 10.42.1.0/24, 192.168.0.1/32, 10.42.2.0/24, 192.168.0.2/32, 10.7.0.1/32, 10.43.0.0/16\n"), "{out}");
    assert!(
        out.contains("Endpoint = 192.168.0.1:51820\n"),
        "the leader's endpoint: {out}"
    );
}

#[test]
fn showconf_peer_lists_every_segment_with_the_peers_keepalive() {
    let v = view(&snapshot(), "auto", DEFAULT_TOPOLOGY_LABEL, NOW).unwrap();
    let (out, _) = showconf(&v, &showconf_args("peer", "laptop", false), 51820, None).unwrap();
    assert_eq!(out.matches("[Peer]").count(), 2);
    assert_eq!(out.matches("PersistentKeepalive = 10").count(), 2);
    assert!(!out.contains("[Interface]"));
    let (out, _) = showconf(&v, &showconf_args("peer", "laptop", true), 51820, None).unwrap();
    assert!(out.contains("AllowedIPs = 10.5.0.1/32\n"));
    assert!(showconf(&v, &showconf_args("peer", "ghost", false), 51820, None).is_err());
}

#[test]
fn showconf_as_peer_prints_a_peer_object_in_json_or_yaml() {
    let v = view(&snapshot(), "auto", DEFAULT_TOPOLOGY_LABEL, NOW).unwrap();
    let mut args = showconf_args("node", "b", true);
    args.output = "yaml".into();
    let (out, _) = showconf(&v, &args, 51820, None).unwrap();
    let object: control::PeerObject = serde_saphyr::from_str(&out).unwrap();
    assert_eq!(object.api_version, "kilo.squat.ai/v1alpha1");
    assert_eq!(object.kind, "Peer");
    assert_eq!(object.metadata.name.as_deref(), Some("b"));
    assert_eq!(object.validate(), Ok(()));
    assert!(object
        .spec
        .allowed_ips
        .contains(&"10.43.0.0/16".to_string()));
    assert_eq!(
        object
            .spec
            .endpoint
            .as_ref()
            .unwrap()
            .dns_or_ip
            .ip
            .as_deref(),
        Some("192.168.0.1")
    );
    args.output = "json".into();
    let (json, _) = showconf(&v, &args, 51820, None).unwrap();
    let same: control::PeerObject = serde_json::from_str(&json).unwrap();
    assert_eq!(same, object);

    // A Peer's own spec, keepalive in seconds (Kilo printed nanoseconds).
    let mut args = showconf_args("peer", "laptop", true);
    args.output = "json".into();
    let (json, _) = showconf(&v, &args, 51820, None).unwrap();
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(value["spec"]["persistentKeepalive"], 10);
    assert_eq!(value["metadata"]["name"], "laptop");

    args.output = "toml".into();
    let error = showconf(&v, &args, 51820, None).unwrap_err().to_string();
    assert!(error.contains("\"toml\""), "{error}");
    let mut args = showconf_args("node", "a", false);
    args.output = "json".into();
    let error = showconf(&v, &args, 51820, None).unwrap_err().to_string();
    assert!(error.contains("--as-peer"), "{error}");
}

#[test]
fn showconf_and_the_graph_take_pod_ranges_from_the_ipam_source() {
    use crate::agent::args::IpamChoice;
    let mut s = snapshot();
    let mut ipam = control::ipam::IpamObjects::default();
    ipam.cilium_nodes.insert(
        "c".into(),
        control::ipam::CiliumNode {
            node: "c".into(),
            pod_cidrs: vec![
                "10.70.3.0/24".parse().unwrap(),
                "10.71.3.0/27".parse().unwrap(),
            ],
        },
    );
    for (name, cidr) in [("a", "10.70.1.0/24"), ("b", "10.70.2.0/24")] {
        ipam.cilium_nodes.insert(
            name.into(),
            control::ipam::CiliumNode {
                node: name.into(),
                pod_cidrs: vec![cidr.parse().unwrap()],
            },
        );
    }
    s.replace_ipam(ipam);
    for choice in [IpamChoice::Cilium, IpamChoice::Auto] {
        let v = view_with_ipam(&s, "auto", DEFAULT_TOPOLOGY_LABEL, NOW, choice).unwrap();
        let (conf, _) = showconf(&v, &showconf_args("node", "a", false), 51820, None).unwrap();
        assert!(
            conf.contains("10.70.3.0/24") && conf.contains("10.71.3.0/27"),
            "{conf}"
        );
        assert!(!conf.contains("10.42.3.0/24"), "the Node's own: {conf}");
        assert!(graph(&v).unwrap().contains("10.70.1.0/24"));
    }
    // By default, the Nodes' own.
    let v = view(&s, "auto", DEFAULT_TOPOLOGY_LABEL, NOW).unwrap();
    let (conf, _) = showconf(&v, &showconf_args("node", "a", false), 51820, None).unwrap();
    assert!(conf.contains("10.42.3.0/24"), "{conf}");
}

#[test]
fn the_peer_and_multi_cluster_output_carry_calicos_dual_stack_blocks() {
    use crate::agent::args::IpamChoice;
    use control::ipam::{BlockAffinity, IpamBlock};
    let mut s = snapshot();
    let mut ipam = control::ipam::IpamObjects::default();
    for (name, ip) in [("a", 1), ("b", 2), ("c", 3)] {
        for cidr in [format!("10.70.{ip}.0/26"), format!("fd00:70::{ip}:0/122")] {
            ipam.affinities.insert(
                format!("{name}-{cidr}"),
                BlockAffinity {
                    node: name.into(),
                    cidr: cidr.parse().unwrap(),
                    confirmed: true,
                },
            );
        }
    }
    // c's IPv6 block lent an address to a pod on a.
    ipam.blocks.insert(
        "c6".into(),
        IpamBlock {
            cidr: "fd00:70::3:0/122".parse().unwrap(),
            host: Some("c".into()),
            allocated: vec![(7, "a".into())],
        },
    );
    s.replace_ipam(ipam);
    let v = view_with_ipam(&s, "auto", DEFAULT_TOPOLOGY_LABEL, NOW, IpamChoice::Calico).unwrap();

    // The multi-cluster output: location east as a Peer for another cluster.
    let mut args = showconf_args("node", "a", true);
    args.output = "yaml".into();
    let (east, _) = showconf(&v, &args, 51820, None).unwrap();
    for range in [
        "10.70.1.0/26",
        "10.70.2.0/26",
        "fd00:70::1:0/122",
        "fd00:70::2:0/122",
        "fd00:70::3:7/128",
    ] {
        assert!(
            east.contains(range),
            "{range} missing from east as a Peer:\n{east}"
        );
    }
    assert!(
        !east.contains("10.70.3.0/26") && !east.contains("fd00:70::3:0/122"),
        "west's blocks:\n{east}"
    );
    assert!(!east.contains("10.42."), "the Nodes' own ranges:\n{east}");

    // An external Peer's configuration reaches every block through the leaders.
    let (laptop, _) = showconf(&v, &showconf_args("peer", "laptop", false), 51820, None).unwrap();
    for ip in 1..=3 {
        assert!(
            laptop.contains(&format!("10.70.{ip}.0/26"))
                && laptop.contains(&format!("fd00:70::{ip}:0/122")),
            "node {ip}'s blocks missing from the Peer's configuration:\n{laptop}"
        );
    }
    assert!(laptop.contains("fd00:70::3:7/128"), "{laptop}");
    assert!(!laptop.contains("10.42."), "{laptop}");
    assert!(graph(&v).unwrap().contains("fd00:70::2:0/122"));
}

/// Two leaders per location, each holding its share's lease: every node's `--as-peer` is its
/// share (its leader's key, the share's pod ranges), so registering every node, as Kilo's
/// multi-cluster recipe does, registers every share, each range once.
#[test]
fn showconf_as_peer_gives_each_node_its_share() {
    let mut s = Snapshot::default();
    let flags = [(a::LEADER_ELECTION, "lease"), (a::LEADER_SHARES, "2")];
    for (name, loc, ip) in [
        ("e1", "east", 1),
        ("e2", "east", 2),
        ("e3", "east", 3),
        ("e4", "east", 4),
        ("w1", "west", 5),
    ] {
        s.put_node(name, kube_node(name, loc, ip, &flags));
    }
    let held = |holder: &str| control::leader::LeaseState {
        holder: Some(holder.into()),
        renewed_ms: NOW * 1000,
        duration_ms: control::leader::LEASE_DURATION_MS,
        ..Default::default()
    };
    s.leases
        .insert(control::leader::lease_name("east"), held("e3"));
    s.leases.insert(
        control::leader::shares::share_lease_name("east", 1),
        held("e1"),
    );
    let v = view(&s, "auto", DEFAULT_TOPOLOGY_LABEL, NOW).unwrap();
    let mut by_key: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for node in ["e1", "e2", "e3", "e4"] {
        let mut args = showconf_args("node", node, true);
        args.allowed_ips.clear();
        let (out, _) = showconf(&v, &args, 51820, None).unwrap();
        let field = |name: &str| {
            out.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} = ")))
                .unwrap()
                .to_string()
        };
        let ranges = field("AllowedIPs");
        let ranges = ranges.split(", ").filter(|r| r.starts_with("10.42."));
        by_key
            .entry(field("PublicKey"))
            .or_default()
            .extend(ranges.map(str::to_string));
    }
    let key = |n: &str| control::Key::padded(n).to_base64();
    assert_eq!(
        by_key.keys().cloned().collect::<BTreeSet<_>>(),
        BTreeSet::from([key("e1"), key("e3")]),
        "{by_key:?}"
    );
    let all: Vec<&String> = by_key.values().flatten().collect();
    assert_eq!(all.len(), 4, "each east range in one share: {by_key:?}");
    assert!(by_key.values().all(|r| r.len() == 2), "{by_key:?}");
}

fn rotate(node: &str, force: bool) -> rotate::RotateKeyArgs {
    rotate::RotateKeyArgs {
        node: node.into(),
        force,
    }
}

#[test]
fn rotate_key_names_an_unknown_node_a_keyless_one_one_rotating_and_peers_that_would_not_follow() {
    let mut s = snapshot();
    let err = |s: &Snapshot, args| format!("{:#}", rotate::request(s, &args, "1").unwrap_err());
    assert!(err(&s, rotate("nope", true)).contains("no node called \"nope\""));
    let e = err(&s, rotate("a", false));
    assert!(e.contains("laptop") && e.contains("--force"), "{e}");
    let asked = rotate::request(&s, &rotate("a", true), "17").unwrap();
    assert_eq!(asked.id, "17");
    assert!(
        asked.message.contains("kilotun.io/key-rotated: 17"),
        "{}",
        asked.message
    );
    s.peers.clear();
    assert!(rotate::request(&s, &rotate("a", false), "18").is_ok());
    s.put_node("e", kube_node("e", "west", 5, &[(a::NEXT_KEY, "x")]));
    let e = err(&s, rotate("e", false));
    assert!(e.contains("rotating its key already"), "{e}");
    let mut keyless = kube_node("f", "west", 6, &[]);
    keyless
        .metadata
        .annotations
        .as_mut()
        .unwrap()
        .remove(a::KEY);
    s.put_node("f", keyless);
    let e = err(&s, rotate("f", false));
    assert!(e.contains("has no kilo.squat.ai/key"), "{e}");
}

/// A `/status` peer as kg writes it: `key`, configured to send to `endpoint`.
fn live_peer(key: &str, endpoint: Option<&str>) -> control::status::PeerStatus {
    control::status::PeerStatus {
        kind: control::status::PeerKind::Segment,
        name: String::new(),
        leader: String::new(),
        public_key: key.to_string(),
        configured_endpoint: endpoint.map(str::to_string),
        endpoint: None,
        persistent_keepalive: 0,
        last_handshake_unix: None,
        unanswered_since_unix: None,
        handshakes: 0,
        handshake_failures: 0,
        rx_bytes: 0,
        tx_bytes: 0,
        refused_responses: 0,
        unused_answers: 0,
        post_quantum: None,
        candidates: None,
    }
}

#[test]
fn showconf_live_prints_the_endpoints_the_nodes_kg_configured() {
    let v = view(&snapshot(), "auto", DEFAULT_TOPOLOGY_LABEL, NOW).unwrap();
    let (plain, _) = showconf(&v, &showconf_args("node", "a", false), 51820, None).unwrap();
    let key_of = |name: &str| {
        v.nodes
            .iter()
            .find(|n| n.name == name)
            .and_then(|n| n.key)
            .unwrap()
            .to_string()
    };
    let c = key_of("c");
    assert!(plain.contains(&format!("PublicKey = {c}")), "{plain}");
    // a's kg chose c's second candidate; it names no other peer.
    let live = control::status::NodeStatus {
        node: "a".into(),
        peers: vec![live_peer(&c, Some("[fd00::3]:51820"))],
        ..Default::default()
    };
    let mut args = showconf_args("node", "a", false);
    args.live = true;
    let (out, err) = showconf(&v, &args, 51820, Some(&live)).unwrap();
    assert!(out.contains("Endpoint = [fd00::3]:51820\n"), "{out}");
    assert_eq!(
        out.replace("Endpoint = [fd00::3]:51820", "Endpoint = 192.168.0.3:51820"),
        plain,
        "only the chosen endpoint differs"
    );
    assert!(
        err.contains("configures no endpoint") && err.contains("node a"),
        "the Peer it does not name: {err}"
    );
    // --live goes with a node's own configuration only.
    let mut as_peer = showconf_args("node", "a", true);
    as_peer.live = true;
    let refused = showconf(&v, &as_peer, 51820, Some(&live)).unwrap_err();
    assert!(refused.to_string().contains("--live"), "{refused}");
}

#[test]
fn uninstall_finds_the_daemonsets_pods_by_its_match_labels_or_says_why_not() {
    let labels = std::collections::BTreeMap::from([
        ("app.kubernetes.io/name".to_string(), "kilo".to_string()),
        (
            "app.kubernetes.io/part-of".to_string(),
            "kilotun".to_string(),
        ),
    ]);
    assert_eq!(
        uninstall::selector(Some(&labels)).unwrap(),
        "app.kubernetes.io/name=kilo,app.kubernetes.io/part-of=kilotun"
    );
    for none in [None, Some(&std::collections::BTreeMap::new())] {
        let why = uninstall::selector(none).unwrap_err().to_string();
        assert!(why.contains("matchLabels"), "{why}");
    }
}
