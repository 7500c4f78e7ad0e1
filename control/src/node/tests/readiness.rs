//! Kilo's `TestReady` vectors, a cordon or removal taint marking a node as leaving, and a
//! `-` force-endpoint that leaves readiness to a keepalive.

use super::*;

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
