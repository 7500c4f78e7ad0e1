//! What a failure report shows of the simulated cluster at the moment a check failed.

use std::fmt::Write as _;

use super::sim::Sim;

/// Every node as a failure report shows it: location, whether it runs and leads, its
/// Node's kilo annotations, its agent's last error and its device's peers by node name.
pub fn describe(sim: &Sim) -> String {
    let snapshot = sim.cluster.snapshot();
    let owner = |key: &control::Key| key_holder(sim, key).unwrap_or_else(|| key.to_string());
    let mut out = String::new();
    for (name, node) in &sim.nodes {
        let annotations: Vec<String> = snapshot
            .nodes
            .get(name)
            .and_then(|o| o.metadata.annotations.as_ref())
            .into_iter()
            .flatten()
            .filter(|(k, _)| !k.ends_with("/key") && !k.ends_with("/last-seen"))
            .map(|(k, v)| format!("{}={v}", k.rsplit('/').next().unwrap_or(k)))
            .collect();
        let _ = write!(
            out,
            "  {name} in {}: {}{}, nat {}, blocked {}, annotations {annotations:?}",
            node.location,
            if node.running.is_some() {
                "runs"
            } else {
                "stopped"
            },
            if node.leads() { ", leads" } else { "" },
            node.behind_nat,
            node.blocked,
        );
        if let Some(error) = node.running.as_ref().and_then(|r| r.last_error.as_ref()) {
            let _ = write!(out, ", last error: {error}");
        }
        for (key, ips) in node.device_peers().unwrap_or_default() {
            let _ = write!(out, "\n    peer {}: {ips:?}", owner(&key));
        }
        out.push('\n');
    }
    for (name, lease) in &snapshot.leases {
        let _ = writeln!(
            out,
            "  lease {name}: held by {:?}, cut off {}, {} transitions",
            lease.holder, lease.cut_off, lease.transitions
        );
    }
    out
}

/// The node whose WireGuard key `key` is, by name.
pub fn key_holder(sim: &Sim, key: &control::Key) -> Option<String> {
    sim.nodes
        .iter()
        .find(|(_, n)| n.public_key() == *key)
        .map(|(name, _)| name.clone())
}
