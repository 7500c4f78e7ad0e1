//! Calico's IPAM objects as Calico writes them (valid against its published CRDs in
//! `tests/real/crds/`), for the `--ipam=calico` tests on the file backend and the API server.

use super::cluster::KgNode;

/// A confirmed BlockAffinity giving `node` the block `cidr`.
pub fn block_affinity(node: &str, cidr: &str) -> String {
    format!(
        "apiVersion: crd.projectcalico.org/v1\nkind: BlockAffinity\nmetadata:\n  name: {node}-{}\nspec:\n  node: {node}\n  cidr: {cidr}\n  state: confirmed\n  deleted: \"false\"\n",
        cidr.replace(['.', ':', '/'], "-")
    )
}

/// An IPAMBlock `cidr` (a /26, or an IPv6 /122) affine to `host`, whose address at `offset` a pod on `node`
/// holds.
pub fn lent_address(cidr: &str, host: &str, offset: usize, node: &str) -> String {
    let mut allocations = vec!["null"; 64];
    allocations[offset] = "0";
    let unallocated: Vec<String> = (0..64)
        .filter(|i| *i != offset)
        .map(|i| i.to_string())
        .collect();
    format!(
        "apiVersion: crd.projectcalico.org/v1\nkind: IPAMBlock\nmetadata:\n  name: {}\nspec:\n  cidr: {cidr}\n  affinity: host:{host}\n  allocations: [{}]\n  unallocated: [{}]\n  attributes:\n  - handle_id: k8s-pod-network.lent\n    secondary:\n      namespace: default\n      node: {node}\n      pod: lent\n  strictAffinity: false\n",
        cidr.replace(['.', ':', '/'], "-"),
        allocations.join(", "),
        unallocated.join(", ")
    )
}

/// The line of `node`'s `wg show allowed-ips` whose peer holds `marker` (empty if none).
pub fn allowed_ips_with(node: &KgNode, marker: &str) -> String {
    node.wg("allowed-ips")
        .lines()
        .find(|l| l.contains(marker))
        .unwrap_or_default()
        .to_string()
}
