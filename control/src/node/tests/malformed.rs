//! Malformed annotation values: each is one problem naming the node, the annotation and the
//! value, and leaves the rest of the node as it was.

use super::*;

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
