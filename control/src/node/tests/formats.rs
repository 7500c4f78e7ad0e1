//! The written formats: discovered endpoints in Go's `UDPAddr` shape, the annotations kg
//! writes, and a Node kg wrote reading back the same.

use super::*;

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
        leaders_per_location: 1,
        next_key: None,
        key_rotated: None,
        pq: None,
        endpoints: Vec::new(),
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
    // election, the number of leaders per location only above 1.
    // Neither lease election nor shares by default; the earlier shares annotation never.
    // No rotation under way or carried out: neither next-key nor key-rotated.
    // No candidates: no kilotun.io/endpoints.
    assert_eq!(map.len(), annotation::WRITTEN.len() - 7);
    let with_lease = WrittenAnnotations {
        leader_election: true,
        leaders_per_location: 1,
        ..written.clone()
    }
    .to_map();
    assert_eq!(with_lease[a::LEADER_ELECTION], "lease");
    let with_shares = WrittenAnnotations {
        leaders_per_location: 2,
        ..written
    }
    .to_map();
    assert_eq!(with_shares[a::LEADER_SHARES], "2");
    assert!(!with_shares.contains_key(a::LEADERS_PER_LOCATION));
}

#[test]
fn a_rotating_nodes_next_key_reads_back_and_a_bad_one_is_named() {
    let next = Key::padded("next");
    let n = translate(&[(a::NEXT_KEY, next.to_base64().as_str())]);
    assert_eq!(n.next_key, Some(next));
    let (n, problems) = translate_node(
        &kube_node(&[(a::NEXT_KEY, "not-a-key")], &[], Some("10.2.1.0/24")),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(n.next_key, None);
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].annotation, a::NEXT_KEY);
    assert_eq!(problems[0].value, "not-a-key");
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
        leaders_per_location: 1,
        next_key: Some(Key::padded("next")),
        key_rotated: Some("r1".into()),
        pq: Some(crate::pq::PqAnnouncement {
            fingerprint: [5; 32],
            falls_back: true,
        }),
        endpoints: vec![
            "10.1.0.1:51820".parse().unwrap(),
            "[2001:db8::1]:51820".parse().unwrap(),
        ],
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
    assert_eq!(n.next_key, written.next_key);
    assert_eq!(n.pq, written.pq);
    assert_eq!(n.endpoint_candidates, written.endpoints);
    assert_eq!(map[a::ENDPOINTS], "10.1.0.1:51820,[2001:db8::1]:51820");
    assert!(n.is_ready(30));
}
