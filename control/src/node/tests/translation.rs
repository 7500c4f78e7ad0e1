//! Kilo's `TestTranslateNode` vectors: how each annotation, the topology label and
//! `spec.podCIDR` become a Node's fields.

use super::*;

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
fn an_earlier_kilotuns_shares_count_as_one_leader_per_location() {
    let n = translate(&[(a::LEADER_SHARES, "3")]);
    assert_eq!((n.leaders_per_location, n.older_shares), (Some(3), None));
    // An earlier kilotun splits shares otherwise: one leader per location while it runs.
    let n = translate(&[(a::LEADERS_PER_LOCATION, "2")]);
    assert_eq!((n.leaders_per_location, n.older_shares), (Some(1), Some(2)));
    let n = translate(&[(a::LEADERS_PER_LOCATION, "1")]);
    assert_eq!((n.leaders_per_location, n.older_shares), (None, None));
    let (n, problems) = translate_node(
        &kube_node(&[(a::LEADER_SHARES, "many")], &[], None),
        DEFAULT_TOPOLOGY_LABEL,
    );
    assert_eq!(n.leaders_per_location, Some(1));
    assert_eq!(problems[0].annotation, a::LEADER_SHARES);
    assert_eq!(problems[0].value, "many");
}

#[test]
fn a_node_with_both_shares_annotations_counts_as_an_earlier_kilotuns() {
    let n = translate(&[(a::LEADER_SHARES, "2"), (a::LEADERS_PER_LOCATION, "2")]);
    assert_eq!((n.leaders_per_location, n.older_shares), (Some(1), Some(2)));
}
