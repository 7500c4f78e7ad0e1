//! `--ipam` against the real API server with Calico's and Cilium's own CRDs installed
//! (`tests/real/crds/`, their published schemas): the API server validates every object the
//! tests create as it would in a cluster running those CNIs, and kg reads them through the
//! `kilo` ServiceAccount with `manifests/ipam-rbac.yaml`. Addresses on the nodes' pod bridges
//! stand in for pods in the blocks; with `--ipam=pods`, Pods whose status a test writes as a
//! kubelet would.

use control::journal::Reason;
use std::path::PathBuf;
use std::time::Duration;

use super::KubeCluster;
use crate::common;
use common::calico::{self, block_affinity, lent_address};

/// Applies the CRDs in `tests/real/crds/<file>` and waits until the API server serves them.
pub(super) fn install_crds(k: &KubeCluster, file: &str, plurals: &[&str]) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/real/crds")
        .join(file);
    k.kube.kubectl(&["apply", "-f", path.to_str().unwrap()]);
    for plural in plurals {
        k.kube.kubectl(&[
            "wait",
            "--for=condition=established",
            "--timeout=30s",
            &format!("crd/{plural}"),
        ]);
    }
}

/// A ping from node `from`'s namespace, from its address `source`, to `to`.
fn answers(k: &KubeCluster, from: &str, source: &str, to: &str) -> bool {
    common::ping_from_ok(
        &k.c.node(from).ns.name,
        Some(source),
        to,
        Duration::from_secs(2),
    )
}

/// The line of `node`'s `wg show allowed-ips` whose peer holds `marker`.
fn allowed_ips_with(k: &KubeCluster, node: &str, marker: &str) -> String {
    calico::allowed_ips_with(k.c.node(node), marker)
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn calicos_blocks_and_lent_addresses_route_pods_through_the_api_server() {
    let test = "calicos_blocks_and_lent_addresses_route_pods_through_the_api_server";
    let nodes = [("n1", "east"), ("n2", "east"), ("n3", "west")];
    let Some(mut k) = KubeCluster::new(test, "", &["east", "west"], &nodes) else {
        return;
    };
    install_crds(
        &k,
        "calico-ipam.yaml",
        &[
            "blockaffinities.crd.projectcalico.org",
            "ipamblocks.crd.projectcalico.org",
        ],
    );
    for n in 1..=3 {
        k.c.nodes[n - 1].ns.run(&[
            "ip",
            "addr",
            "add",
            &format!("10.60.{n}.1/26"),
            "dev",
            "pods0",
        ]);
        k.kube.apply(&block_affinity(
            &format!("n{n}"),
            &format!("10.60.{n}.0/26"),
        ));
    }
    // Without the IPAM rule, kg says which resource and which rule it lacks.
    k.start(2, &["--ipam=calico"]);
    let named = k.c.wait_for(Duration::from_secs(20), |c| {
        c.node("n3").log_text().contains(
            "blockaffinities.crd.projectcalico.org (ClusterRole rule: apiGroups [\"crd.projectcalico.org\"]",
        )
    });
    assert!(named, "{}", k.c.node("n3").log_text());
    k.kube.apply_manifest("ipam-rbac.yaml");
    for i in 0..2 {
        k.start(i, &["--ipam=calico"]);
    }
    let pods = [
        ("n1", "10.60.1.1"),
        ("n2", "10.60.2.1"),
        ("n3", "10.60.3.1"),
    ];
    let meshed = k.c.wait_for(Duration::from_secs(60), |c| {
        pods.iter().all(|(from, source)| {
            pods.iter().filter(|(to, _)| to != from).all(|(_, target)| {
                common::ping_from_ok(
                    &c.node(from).ns.name,
                    Some(source),
                    target,
                    Duration::from_secs(2),
                )
            })
        })
    });
    assert!(meshed, "every pod reaches every pod\n{}", k.c.logs());
    let west = allowed_ips_with(&k, "n3", "10.60.1.0/26");
    assert!(
        west.contains("10.60.2.0/26") && !west.contains("10.42."),
        "{west}"
    );
    let east_leader = if allowed_ips_with(&k, "n1", "10.60.3.0/26").is_empty() {
        "n2"
    } else {
        "n1"
    };
    let handshakes = k.c.node("n3").wg("latest-handshakes");

    // n3 takes a second block, then a pod on n3 holds an address lent out of n1's block.
    k.c.node("n3")
        .ns
        .run(&["ip", "addr", "add", "10.60.3.65/26", "dev", "pods0"]);
    k.kube.apply(&block_affinity("n3", "10.60.3.64/26"));
    k.c.node("n3")
        .ns
        .run(&["ip", "addr", "add", "10.60.1.10/32", "dev", "pods0"]);
    // kubectl 1.20's own validation does not take the schema's nullable integers (Calico's
    // free slots); the API server validates the object against the CRD's schema itself.
    let block = lent_address("10.60.1.0/26", "n1", 10, "n3");
    k.kube
        .kubectl_stdin(&["apply", "--validate=false", "-f", "-"], Some(&block));
    let followed = k.c.wait_for(Duration::from_secs(20), |_| {
        answers(&k, "n1", "10.60.1.1", "10.60.3.65") && answers(&k, "n2", "10.60.2.1", "10.60.1.10")
    });
    assert!(
        followed,
        "the second block and the lent address\n{}",
        k.c.logs()
    );
    let peer = allowed_ips_with(&k, east_leader, "10.60.3.0/26");
    assert!(
        peer.contains("10.60.3.64/26") && peer.contains("10.60.1.10/32"),
        "{peer}"
    );

    // The block released, then n2 leaving the cluster: each range leaves the mesh.
    k.kube
        .kubectl(&["delete", "blockaffinity", "n3-10-60-3-64-26"]);
    let released = k.c.wait_for(Duration::from_secs(20), |_| {
        !allowed_ips_with(&k, east_leader, "10.60.3.0/26").contains("10.60.3.64/26")
    });
    assert!(released, "{}", k.c.logs());
    assert_eq!(
        k.c.node("n3").wg("latest-handshakes"),
        handshakes,
        "no change replaced n3's peer"
    );
    if east_leader == "n1" {
        k.kube.kubectl(&["delete", "node", "n2"]);
        let gone = k.c.wait_for(Duration::from_secs(20), |_| {
            !allowed_ips_with(&k, "n3", "10.60.1.0/26").contains("10.60.2.0/26")
        });
        assert!(gone, "{}", k.c.logs());
    }
    eprintln!("Calico's blocks through the API server: a second block, a lent address, a release, {east_leader} leading east");
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn cilium_node_ranges_of_both_ipam_modes_route_pods_and_auto_finds_them() {
    let test = "cilium_node_ranges_of_both_ipam_modes_route_pods_and_auto_finds_them";
    let nodes = [("n1", "east"), ("n2", "west")];
    let Some(mut k) = KubeCluster::new(test, "", &["east", "west"], &nodes) else {
        return;
    };
    install_crds(&k, "cilium-nodes.yaml", &["ciliumnodes.cilium.io"]);
    k.kube.apply_manifest("ipam-rbac.yaml");
    // n1 in cluster-pool mode, n2 in multi-pool mode.
    k.kube.apply(
        "apiVersion: cilium.io/v2\nkind: CiliumNode\nmetadata:\n  name: n1\nspec:\n  ipam:\n    podCIDRs: [10.70.1.0/24]\n",
    );
    k.kube.apply(
        "apiVersion: cilium.io/v2\nkind: CiliumNode\nmetadata:\n  name: n2\nspec:\n  ipam:\n    pools:\n      allocated:\n      - pool: default\n        cidrs: [10.70.2.0/27]\n",
    );
    k.c.nodes[0]
        .ns
        .run(&["ip", "addr", "add", "10.70.1.1/24", "dev", "pods0"]);
    k.c.nodes[1]
        .ns
        .run(&["ip", "addr", "add", "10.70.2.1/27", "dev", "pods0"]);
    for i in 0..2 {
        k.start(i, &["--ipam=auto"]);
    }
    let meshed = k.c.wait_for(Duration::from_secs(60), |_| {
        answers(&k, "n1", "10.70.1.1", "10.70.2.1") && answers(&k, "n2", "10.70.2.1", "10.70.1.1")
    });
    assert!(meshed, "{}", k.c.logs());
    let said = k.c.node("n1").events_of(Reason::IpamSource);
    assert_eq!(
        said.last().map(|e| e.subject.as_str()),
        Some("cilium"),
        "{said:?}"
    );
    let peer = allowed_ips_with(&k, "n1", "10.70.2.0/27");
    assert!(!peer.contains("10.42."), "the Node's own pod CIDR: {peer}");
}

/// Pod `name` in kube-system on `node`, running with `ips` (the API server clears a new Pod's
/// status, so the status is written through its subresource, as a kubelet writes it).
fn run_pod(k: &KubeCluster, name: &str, node: &str, host_network: bool, ips: &[&str]) {
    k.kube.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: kube-system\nspec:\n  nodeName: {node}\n  hostNetwork: {host_network}\n  serviceAccountName: kilo\n  automountServiceAccountToken: false\n  containers:\n  - name: c\n    image: pause\n"
    ));
    set_pod_status(k, name, "Running", ips);
}

/// Replaces Pod `name`'s status with `phase` and `ips`.
fn set_pod_status(k: &KubeCluster, name: &str, phase: &str, ips: &[&str]) {
    let mut pod = k.kube.get(&["pod", "-n", "kube-system", name]);
    pod["status"] = serde_json::json!({
        "phase": phase,
        "podIP": ips.first(),
        "podIPs": ips.iter().map(|ip| serde_json::json!({"ip": ip})).collect::<Vec<_>>(),
    });
    k.kube.kubectl_stdin(
        &[
            "replace",
            "--raw",
            &format!("/api/v1/namespaces/kube-system/pods/{name}/status"),
            "-f",
            "-",
        ],
        Some(&pod.to_string()),
    );
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn the_pods_own_addresses_route_them_through_the_api_server() {
    let test = "the_pods_own_addresses_route_them_through_the_api_server";
    let nodes = [("n1", "east"), ("n2", "west")];
    let Some(mut k) = KubeCluster::new(test, "", &["east", "west"], &nodes) else {
        return;
    };
    k.kube.apply_manifest("ipam-rbac.yaml");
    // Two pods on n1 side by side (one range, 10.80.1.2/31), one on n2; a host-network pod on
    // n2, whose address is the node's and never a pod range.
    run_pod(&k, "a1", "n1", false, &["10.80.1.2"]);
    run_pod(&k, "a2", "n1", false, &["10.80.1.3"]);
    run_pod(&k, "b1", "n2", false, &["10.80.2.2"]);
    run_pod(&k, "h2", "n2", true, &["10.80.9.9"]);
    for (i, ip) in [
        (0, "10.80.1.2/32"),
        (0, "10.80.1.3/32"),
        (1, "10.80.2.2/32"),
    ] {
        k.c.nodes[i]
            .ns
            .run(&["ip", "addr", "add", ip, "dev", "pods0"]);
    }
    for i in 0..2 {
        k.start(i, &["--ipam=pods"]);
    }
    let meshed = k.c.wait_for(Duration::from_secs(60), |_| {
        answers(&k, "n1", "10.80.1.3", "10.80.2.2") && answers(&k, "n2", "10.80.2.2", "10.80.1.2")
    });
    assert!(meshed, "{}", k.c.logs());
    let east = allowed_ips_with(&k, "n2", "10.80.1.2/31");
    assert!(
        !east.is_empty() && !east.contains("10.42."),
        "n1's two pods as one range, not the Node's own pod CIDR: {}",
        k.c.node("n2").wg("allowed-ips")
    );
    let west = allowed_ips_with(&k, "n1", "10.80.2.2/32");
    assert!(
        !west.is_empty() && !west.contains("10.80.9.9"),
        "n2's pod, not its host-network one: {}",
        k.c.node("n1").wg("allowed-ips")
    );
    let handshakes = k.c.node("n2").wg("latest-handshakes");

    // a2 ends: only a1's address stays east's; a pod scheduled later on n2 joins west's.
    set_pod_status(&k, "a2", "Succeeded", &["10.80.1.3"]);
    run_pod(&k, "b2", "n2", false, &["10.80.2.7"]);
    k.c.nodes[1]
        .ns
        .run(&["ip", "addr", "add", "10.80.2.7/32", "dev", "pods0"]);
    let followed = k.c.wait_for(Duration::from_secs(20), |_| {
        let east = allowed_ips_with(&k, "n2", "10.80.1.2/32");
        let west = allowed_ips_with(&k, "n1", "10.80.2.2/32");
        !east.is_empty()
            && !east.contains("10.80.1.3")
            && !east.contains("/31")
            && west.contains("10.80.2.7/32")
    });
    assert!(
        followed,
        "n1: {}\nn2: {}\n{}",
        k.c.node("n1").wg("allowed-ips"),
        k.c.node("n2").wg("allowed-ips"),
        k.c.logs()
    );
    // b1 deleted (at once: no kubelet here confirms a graceful deletion): its address leaves
    // the mesh.
    k.kube.kubectl(&[
        "delete",
        "pod",
        "-n",
        "kube-system",
        "b1",
        "--force",
        "--grace-period=0",
    ]);
    let gone = k.c.wait_for(Duration::from_secs(20), |_| {
        !k.c.node("n1").wg("allowed-ips").contains("10.80.2.2/32")
    });
    assert!(gone, "{}", k.c.logs());
    assert_eq!(
        k.c.node("n2").wg("latest-handshakes"),
        handshakes,
        "no pod change replaced a peer"
    );
    assert!(answers(&k, "n2", "10.80.2.7", "10.80.1.2"));
}
