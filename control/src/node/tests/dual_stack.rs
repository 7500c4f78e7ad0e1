//! Dual stack: `spec.podCIDRs` of each family and a second internal IP of the other family.

use super::*;

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
