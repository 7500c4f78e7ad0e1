//! Kilo's `TestTranslateNode` and `TestReady` vectors, plus the written formats.

use super::*;
use k8s_openapi::api::core::v1::{Node as KubeNode, NodeSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

fn kube_node(
    annotations: &[(&str, &str)],
    labels: &[(&str, &str)],
    pod_cidr: Option<&str>,
) -> KubeNode {
    let map = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>()
    };
    KubeNode {
        metadata: ObjectMeta {
            name: Some("n".into()),
            annotations: Some(map(annotations)),
            labels: Some(map(labels)),
            ..Default::default()
        },
        spec: Some(NodeSpec {
            pod_cidr: pod_cidr.map(str::to_string),
            ..Default::default()
        }),
        status: None,
    }
}

fn translate(annotations: &[(&str, &str)]) -> Node {
    translate_node(&kube_node(annotations, &[], None), DEFAULT_TOPOLOGY_LABEL).0
}

fn net(text: &str) -> IpNet {
    text.parse().unwrap()
}

use annotation as a;

#[test]
fn endpoint_without_port_is_absent() {
    assert_eq!(translate(&[(a::ENDPOINT, "10.0.0.1")]).endpoint, None);
}

#[test]
fn bad_internal_ip_is_absent() {
    assert_eq!(translate(&[(a::INTERNAL_IP, "foo")]).internal_ip, None);
}

#[test]
fn ipv4_endpoint_and_internal_ip_parse() {
    let n = translate(&[
        (a::ENDPOINT, "10.0.0.1:51820"),
        (a::INTERNAL_IP, "10.0.0.2/32"),
    ]);
    assert_eq!(n.endpoint.unwrap().to_string(), "10.0.0.1:51820");
    assert_eq!(n.internal_ip, Some(net("10.0.0.2/32")));
}

#[test]
fn ipv6_endpoint_and_internal_ip_parse_keeping_host_bits() {
    let n = translate(&[
        (a::ENDPOINT, "[ff10::10]:51820"),
        (a::INTERNAL_IP, "ff60::10/64"),
    ]);
    assert_eq!(n.endpoint.unwrap().to_string(), "[ff10::10]:51820");
    assert_eq!(n.internal_ip.unwrap().to_string(), "ff60::10/64");
}

#[test]
fn pod_cidr_is_reduced_to_its_network() {
    let (n, _) = translate_node(
        &kube_node(&[], &[], Some("10.2.0.1/24")),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(n.subnet, Some(net("10.2.0.0/24")));
    let (n, problems) = translate_node(&kube_node(&[], &[], Some("foo")), DEFAULT_TOPOLOGY_LABEL);
    assert_eq!(n.subnet, None);
    assert_eq!(problems[0].annotation, "spec.podCIDR");
}

#[test]
fn location_comes_from_annotation_then_label() {
    let label = [(DEFAULT_TOPOLOGY_LABEL, "a")];
    let (n, _) = translate_node(&kube_node(&[], &label, None), DEFAULT_TOPOLOGY_LABEL);
    assert_eq!(n.location, "a");
    let (n, _) = translate_node(
        &kube_node(&[(a::LOCATION, "b")], &label, None),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(n.location, "b");
    let (n, _) = translate_node(
        &kube_node(&[(a::LOCATION, "")], &label, None),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(n.location, "", "a present but empty annotation still wins");
    let (n, _) = translate_node(&kube_node(&[], &[("zone", "z")], None), "zone");
    assert_eq!(n.location, "z", "--topology-label names the label");
}

#[test]
fn invalid_force_endpoint_falls_back_to_endpoint_and_is_reported() {
    let (n, problems) = translate_node(
        &kube_node(
            &[
                (a::ENDPOINT, "10.0.0.1:51820"),
                (a::FORCE_ENDPOINT, "-10.0.0.2:51821"),
            ],
            &[],
            None,
        ),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(n.endpoint.unwrap().to_string(), "10.0.0.1:51820");
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].annotation, a::FORCE_ENDPOINT);
    assert_eq!(problems[0].value, "-10.0.0.2:51821");
    assert!(problems[0]
        .to_string()
        .starts_with("n: kilo.squat.ai/force-endpoint=\"-10.0.0.2:51821\""));
}

#[test]
fn valid_force_endpoint_wins() {
    let n = translate(&[
        (a::ENDPOINT, "10.0.0.1:51820"),
        (a::FORCE_ENDPOINT, "10.0.0.2:51821"),
    ]);
    assert_eq!(n.endpoint.unwrap().to_string(), "10.0.0.2:51821");
}

#[test]
fn force_endpoint_may_be_a_dns_name() {
    let n = translate(&[(a::FORCE_ENDPOINT, "node-b.mesh.test:51820")]);
    let e = n.endpoint.unwrap();
    assert_eq!(e.dns_name(), Some("node-b.mesh.test"));
    assert!(e.is_ready());
}

#[test]
fn force_internal_ip_wins_unless_invalid() {
    let n = translate(&[
        (a::INTERNAL_IP, "10.1.0.1/24"),
        (a::FORCE_INTERNAL_IP, "-10.1.0.2/24"),
    ]);
    assert_eq!(n.internal_ip, Some(net("10.1.0.1/24")));
    let n = translate(&[
        (a::INTERNAL_IP, "10.1.0.1/24"),
        (a::FORCE_INTERNAL_IP, "10.1.0.2/24"),
    ]);
    assert_eq!(n.internal_ip, Some(net("10.1.0.2/24")));
}

#[test]
fn a_written_internal_ip_of_the_other_family_than_the_forced_one_is_its_refusal() {
    // The node's kg refused an IPv6 force-internal-ip on an IPv4-only host and wrote the
    // detected IPv4 address.
    let n = translate(&[
        (a::INTERNAL_IP, "192.168.10.1/24"),
        (a::FORCE_INTERNAL_IP, "fd50::1/64"),
    ]);
    assert_eq!(n.internal_ip, Some(net("192.168.10.1/24")));
    let n = translate(&[
        (a::INTERNAL_IP, "fd50::1/64"),
        (a::FORCE_INTERNAL_IP, "192.168.10.1/24"),
    ]);
    assert_eq!(n.internal_ip, Some(net("fd50::1/64")));
    // Not written yet, or written of the same family: the forced one.
    let n = translate(&[(a::FORCE_INTERNAL_IP, "fd50::1/64")]);
    assert_eq!(n.internal_ip, Some(net("fd50::1/64")));
    let n = translate(&[
        (a::INTERNAL_IP, "fd50::9/64"),
        (a::FORCE_INTERNAL_IP, "fd50::1/64"),
    ]);
    assert_eq!(n.internal_ip, Some(net("fd50::1/64")));
}

#[test]
fn force_internal_ip_empty_or_dash_disables_the_private_ip() {
    for value in ["", "-"] {
        let n = translate(&[
            (a::INTERNAL_IP, "10.1.0.1/32"),
            (a::FORCE_INTERNAL_IP, value),
        ]);
        assert_eq!(n.internal_ip, None);
        assert!(n.no_internal_ip, "{value:?}");
    }
    let n = translate(&[(a::INTERNAL_IP, "")]);
    assert_eq!(n.internal_ip, None);
    assert!(!n.no_internal_ip);
}

#[test]
fn keepalive_last_seen_and_leader() {
    assert_eq!(
        translate(&[(a::PERSISTENT_KEEPALIVE, "25")]).persistent_keepalive,
        25
    );
    assert_eq!(
        translate(&[(a::PERSISTENT_KEEPALIVE, "soon")]).persistent_keepalive,
        0
    );
    assert_eq!(
        translate(&[(a::PERSISTENT_KEEPALIVE, "-5")]).persistent_keepalive,
        0
    );
    assert_eq!(translate(&[(a::LAST_SEEN, "foo")]).last_seen, 0);
    assert!(translate(&[(a::LEADER, "")]).leader);
    assert!(translate(&[(a::LEADER, "false")]).leader, "presence-only");
    assert!(!translate(&[]).leader);
}

#[test]
fn wireguard_ip_keeps_the_kilo_mask() {
    assert_eq!(
        translate(&[(a::WIREGUARD_IP, "10.4.0.1/16")]).wireguard_ip,
        Some(net("10.4.0.1/16"))
    );
}

#[test]
fn allowed_location_ips_are_trimmed_and_bad_items_skipped() {
    let (n, problems) = translate_node(
        &kube_node(
            &[(
                a::ALLOWED_LOCATION_IPS,
                "10.6.0.1/32, 192.168.178.0/24,nope",
            )],
            &[],
            None,
        ),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(
        n.allowed_location_ips,
        vec![net("10.6.0.1/32"), net("192.168.178.0/24")]
    );
    assert_eq!(problems.len(), 1);
    assert!(problems[0].reason.contains("\"nope\""));
}

#[test]
fn garbage_key_is_reported_and_leaves_the_node_unready() {
    let (n, problems) = translate_node(
        &kube_node(&[(a::KEY, "garbage")], &[], None),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(n.key, None);
    assert_eq!(problems[0].annotation, a::KEY);
}

#[test]
fn discovered_endpoints_use_gos_udpaddr_shape() {
    let key = Key::padded("key1");
    let map = BTreeMap::from([(key, "1.2.3.4:51820".parse().unwrap())]);
    let text = encode_discovered_endpoints(&map);
    assert_eq!(
        text,
        r#"{"a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=":{"IP":"1.2.3.4","Port":51820,"Zone":""}}"#
    );
    assert_eq!(decode_discovered_endpoints(&text).unwrap(), map);
    assert_eq!(decode_discovered_endpoints("").unwrap(), BTreeMap::new());
    assert_eq!(decode_discovered_endpoints("{}").unwrap(), BTreeMap::new());
    assert_eq!(encode_discovered_endpoints(&BTreeMap::new()), "");
    assert!(decode_discovered_endpoints("{nope").is_err());
    let n = translate(&[(a::DISCOVERED_ENDPOINTS, "{nope")]);
    assert!(n.discovered_endpoints.is_empty());
}

fn ready_node(now: i64) -> Node {
    Node {
        name: "r".into(),
        endpoint: Some(Endpoint::parse("2.2.2.2:51820").unwrap()),
        key: Some(Key::padded("k")),
        subnet: Some(net("10.2.1.0/24")),
        last_seen: now,
        ..Default::default()
    }
}

#[test]
fn readiness_follows_kilos_rules() {
    let now = 1_700_000_000;
    assert!(ready_node(now).is_ready(now));
    assert!(!Node::default().is_ready(now), "empty");
    let mut n = ready_node(now);
    n.endpoint = None;
    assert!(!n.is_ready(now), "missing endpoint");
    let mut n = ready_node(now);
    n.key = None;
    assert!(!n.is_ready(now), "empty key");
    let mut n = ready_node(now);
    n.subnet = None;
    assert!(!n.is_ready(now), "missing subnet");
    let mut n = ready_node(now);
    n.last_seen = 0;
    assert!(!n.is_ready(now), "missing last-seen");
    assert!(!ready_node(now - 60).is_ready(now), "60 s old check-in");
    assert!(ready_node(now - 59).is_ready(now));
    let mut n = ready_node(now);
    n.last_seen = i64::MIN;
    assert!(
        !n.is_ready(now),
        "a last-seen so far back that now minus it overflows"
    );
}

#[test]
fn written_annotations_use_kilos_formats() {
    let written = WrittenAnnotations {
        endpoint: Some(Endpoint::parse("[fd00::1]:51820").unwrap()),
        internal_ip: Some(net("192.168.0.10/24")),
        key: Key::padded("key1"),
        last_seen: 1_700_000_000,
        wireguard_ip: None,
        discovered_endpoints: BTreeMap::new(),
        granularity: Granularity::Full,
        cni_compatibility_ip: None,
        second_internal_ip: None,
        leader_election: false,
    };
    let map = written.to_map();
    assert_eq!(map[a::ENDPOINT], "[fd00::1]:51820");
    assert_eq!(map[a::INTERNAL_IP], "192.168.0.10/24");
    assert_eq!(map[a::KEY], "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=");
    assert_eq!(map[a::LAST_SEEN], "1700000000");
    assert_eq!(map[a::WIREGUARD_IP], "");
    assert_eq!(map[a::DISCOVERED_ENDPOINTS], "", "as Kilo writes none");
    assert_eq!(map[a::GRANULARITY], "full");
    assert_eq!(map[a::CNI_COMPATIBILITY_IP], "");
    assert_eq!(map[a::SECOND_INTERNAL_IP], "");
    // Kilo's eight and the second internal IP; the lease one only when it takes part in lease
    // election.
    assert_eq!(map.len(), annotation::WRITTEN.len() - 1);
    let with_lease = WrittenAnnotations {
        leader_election: true,
        ..written
    }
    .to_map();
    assert_eq!(with_lease[a::LEADER_ELECTION], "lease");
}

#[test]
fn a_node_written_by_kg_reads_back_the_same() {
    let written = WrittenAnnotations {
        endpoint: Some(Endpoint::parse("10.1.0.1:51820").unwrap()),
        internal_ip: Some(net("192.168.0.1/24")),
        key: Key::padded("key1"),
        last_seen: 5,
        wireguard_ip: Some(net("10.4.0.1/16")),
        discovered_endpoints: BTreeMap::from([(Key::padded("x"), "[fd00::2]:4".parse().unwrap())]),
        granularity: Granularity::Location,
        cni_compatibility_ip: None,
        second_internal_ip: Some(net("fd00::1/64")),
        leader_election: true,
    };
    let map = written.to_map();
    let pairs: Vec<(&str, &str)> = map.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let (n, problems) = translate_node(
        &kube_node(&pairs, &[], Some("10.2.1.0/24")),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(n.endpoint, written.endpoint);
    assert_eq!(n.internal_ip, written.internal_ip);
    assert_eq!(n.key, Some(written.key));
    assert_eq!(n.wireguard_ip, written.wireguard_ip);
    assert_eq!(n.discovered_endpoints, written.discovered_endpoints);
    assert_eq!(n.granularity, Some(Granularity::Location));
    assert!(n.lease_election);
    assert_eq!(n.second_internal_ip, Some(net("fd00::1/64")));
    assert!(n.is_ready(30));
}

fn with_pod_cidrs(
    pod_cidr: &str,
    pod_cidrs: &[&str],
    annotations: &[(&str, &str)],
) -> (Node, Vec<AnnotationProblem>) {
    let mut object = kube_node(annotations, &[], Some(pod_cidr));
    object.spec.as_mut().unwrap().pod_cidrs =
        Some(pod_cidrs.iter().map(|c| c.to_string()).collect());
    translate_node(&object, DEFAULT_TOPOLOGY_LABEL)
}

#[test]
fn a_dual_stack_node_has_a_pod_cidr_of_each_family() {
    let (n, problems) = with_pod_cidrs("10.42.1.0/24", &["10.42.1.0/24", "fd42:1::/64"], &[]);
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(n.subnet, Some(net("10.42.1.0/24")));
    assert_eq!(n.extra_subnets, [net("fd42:1::/64")]);
    assert_eq!(
        n.pod_cidrs().collect::<Vec<_>>(),
        [net("10.42.1.0/24"), net("fd42:1::/64")]
    );
    // IPv6 first, as a cluster whose primary family is IPv6 lists them.
    let (n, _) = with_pod_cidrs("fd42:1::/64", &["fd42:1::/64", "10.42.1.0/24"], &[]);
    assert_eq!(n.extra_subnets, [net("10.42.1.0/24")]);
}

#[test]
fn bad_pod_cidrs_entries_are_named_and_skipped() {
    let (n, problems) = with_pod_cidrs(
        "10.42.1.0/24",
        &["10.42.1.0/24", "10.43.1.0/24", "fd42::/200", "fd42:1::/64"],
        &[],
    );
    assert_eq!(n.subnet, Some(net("10.42.1.0/24")));
    assert_eq!(n.extra_subnets, [net("fd42:1::/64")]);
    let named: Vec<(String, String)> = problems
        .iter()
        .map(|p| (p.annotation.clone(), p.value.clone()))
        .collect();
    assert_eq!(
        named,
        [
            ("spec.podCIDRs".to_string(), "10.43.1.0/24".to_string()),
            ("spec.podCIDRs".to_string(), "fd42::/200".to_string()),
        ]
    );
    assert!(
        problems[0].reason.contains("same family"),
        "{}",
        problems[0]
    );
}

#[test]
fn a_second_internal_ip_of_the_internal_ips_family_is_ignored() {
    let (n, problems) = with_pod_cidrs(
        "10.42.1.0/24",
        &[],
        &[
            (a::INTERNAL_IP, "192.168.0.1/24"),
            (a::SECOND_INTERNAL_IP, "192.168.0.2/24"),
        ],
    );
    assert_eq!(n.second_internal_ip, None);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].annotation, a::SECOND_INTERNAL_IP);
    let (n, problems) = with_pod_cidrs(
        "10.42.1.0/24",
        &[],
        &[
            (a::INTERNAL_IP, "192.168.0.1/24"),
            (a::SECOND_INTERNAL_IP, "fd50::1/64"),
        ],
    );
    assert!(problems.is_empty(), "{problems:?}");
    assert_eq!(n.second_internal_ip, Some(net("fd50::1/64")));
}

/// Every malformed value of every annotation kg reads: each yields exactly one problem that
/// names the node, the annotation and the value (shortened when long), and leaves everything
/// else about the node as it was.
#[test]
fn each_malformed_annotation_is_one_problem_naming_node_annotation_and_value() {
    let long = "x".repeat(100_000);
    let long_endpoint = format!("{long}:51820");
    let long_keepalive = "9".repeat(5_000);
    let cases: &[(&str, &str)] = &[
        (a::ENDPOINT, "10.0.0.1:70000"),
        (a::ENDPOINT, "10.0.0.1:-1"),
        (a::ENDPOINT, "[::1:51820"),
        (a::ENDPOINT, &long_endpoint),
        (a::FORCE_ENDPOINT, "host name:51820"),
        (a::FORCE_ENDPOINT, "ünïcödé.example:51820"),
        (a::INTERNAL_IP, "10.0.0.300/24"),
        (a::INTERNAL_IP, "10.0.0.1/33"),
        (a::INTERNAL_IP, "🙂"),
        (a::FORCE_INTERNAL_IP, "not-an-ip"),
        (a::WIREGUARD_IP, "10.4.0.1"),
        (a::WIREGUARD_IP, "fe80::1/129"),
        (a::CNI_COMPATIBILITY_IP, "10.0.0.0/8/8"),
        (a::SECOND_INTERNAL_IP, "fd00::1/200"),
        (a::PERSISTENT_KEEPALIVE, "soon"),
        (a::PERSISTENT_KEEPALIVE, "2.5"),
        (a::PERSISTENT_KEEPALIVE, "-1"),
        (a::PERSISTENT_KEEPALIVE, "65536"),
        (a::PERSISTENT_KEEPALIVE, &long_keepalive),
        (a::KEY, "not-a-key"),
        (a::KEY, "AAAA"),
        (a::KEY, "ключключключключключключключключключключкл="),
        (a::KEY, &long),
        (a::LAST_SEEN, "yesterday"),
        (a::LAST_SEEN, "1e9"),
        (a::ALLOWED_LOCATION_IPS, "10.9.0.0/33,zzz,10.8.0.0/16"),
        (a::ALLOWED_LOCATION_IPS, "１０.０.０.０/８"),
        (a::DISCOVERED_ENDPOINTS, "{nope"),
        (
            a::DISCOVERED_ENDPOINTS,
            r#"{"not-a-key":{"IP":"1.2.3.4","Port":1,"Zone":""}}"#,
        ),
        (a::GRANULARITY, "sometimes"),
    ];
    let good_key = "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    let baseline_pairs = [
        (a::LOCATION, "east"),
        (a::KEY, good_key),
        (a::ENDPOINT, "192.168.1.1:51820"),
        (a::LAST_SEEN, "1700000000"),
    ];
    let translate_with = |bad: (&str, &str)| {
        let mut pairs: Vec<(&str, &str)> = baseline_pairs
            .iter()
            .copied()
            .filter(|(k, _)| *k != bad.0)
            .collect();
        pairs.push(bad);
        let mut object = kube_node(&pairs, &[], Some("10.42.1.0/24"));
        object.metadata.name = Some("node-7".into());
        translate_node(&object, DEFAULT_TOPOLOGY_LABEL)
    };
    for &(annotation, value) in cases {
        let (node, problems) = translate_with((annotation, value));
        assert_eq!(
            problems.len(),
            1,
            "{annotation}={value:.40}: want one problem, got {problems:?}"
        );
        let p = &problems[0];
        assert_eq!(
            (p.object.as_str(), p.annotation.as_str()),
            ("node-7", annotation)
        );
        assert_eq!(p.value, value);
        let line = p.to_string();
        let head: String = format!("{value:?}").chars().take(20).collect();
        assert!(
            line.starts_with(&format!("node-7: {annotation}=")) && line.contains(&head),
            "{line}"
        );
        assert!(
            line.len() < 1_000,
            "an over-long value is shortened: {} bytes",
            line.len()
        );
        // The rest of the node is untouched.
        assert_eq!(node.location, "east", "{annotation}");
        assert_eq!(node.subnet, Some(net("10.42.1.0/24")), "{annotation}");
        if annotation != a::KEY {
            assert_eq!(
                node.key,
                Some(Key::parse(good_key).unwrap()),
                "{annotation}"
            );
        }
        if annotation != a::ENDPOINT {
            assert_eq!(
                node.endpoint,
                Some(Endpoint::parse("192.168.1.1:51820").unwrap()),
                "{annotation}"
            );
        }
        if annotation != a::LAST_SEEN {
            assert_eq!(node.last_seen, 1_700_000_000, "{annotation}");
        }
    }
}

#[test]
fn a_cordon_or_a_removal_taint_marks_a_node_as_leaving() {
    let mut object = kube_node(&[], &[], Some("10.2.1.0/24"));
    assert!(!translate_node(&object, DEFAULT_TOPOLOGY_LABEL).0.cordoned);
    object.spec.as_mut().unwrap().unschedulable = Some(true);
    assert!(translate_node(&object, DEFAULT_TOPOLOGY_LABEL).0.cordoned);
    object.spec.as_mut().unwrap().unschedulable = None;
    let taint = |key: &str| k8s_openapi::api::core::v1::Taint {
        key: key.into(),
        effect: "NoSchedule".into(),
        ..Default::default()
    };
    object.spec.as_mut().unwrap().taints = Some(vec![taint("example.com/other")]);
    assert!(!translate_node(&object, DEFAULT_TOPOLOGY_LABEL).0.cordoned);
    for key in LEAVING_TAINTS {
        object.spec.as_mut().unwrap().taints = Some(vec![taint("example.com/other"), taint(key)]);
        assert!(
            translate_node(&object, DEFAULT_TOPOLOGY_LABEL).0.cordoned,
            "{key}"
        );
    }
}

#[test]
fn force_endpoint_dash_means_no_endpoint_and_readiness_then_needs_a_keepalive() {
    for none in ["-", ""] {
        let (n, problems) = translate_node(
            &kube_node(
                &[
                    (annotation::FORCE_ENDPOINT, none),
                    (annotation::ENDPOINT, "10.0.0.1:51820"),
                    (
                        annotation::KEY,
                        "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
                    ),
                    (annotation::LAST_SEEN, "1000"),
                ],
                &[],
                Some("10.42.1.0/24"),
            ),
            DEFAULT_TOPOLOGY_LABEL,
        );
        assert_eq!(n.endpoint, None, "a stale endpoint gives way to {none:?}");
        assert!(problems.is_empty(), "{problems:?}");
        assert!(
            !n.is_ready(1010),
            "no endpoint and no keepalive: unreachable"
        );
        let kept_alive = Node {
            persistent_keepalive: 5,
            ..n
        };
        assert!(kept_alive.is_ready(1010));
        assert!(!kept_alive.is_ready(1100), "a stale check-in still counts");
    }
}
