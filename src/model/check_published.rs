//! What the converged mesh must show where Kubernetes users look: every running leader whose
//! tunnels can all carry traffic (each far end shares a live uplink with it, and they are not
//! both behind NAT) says `KiloMeshReady` `True` on its Node, and so does every running follower.

use control::condition::ConditionStatus;

use super::check_endpoints::carrying_uplink;
use super::sim::Sim;

/// Checks the conditions the running agents last wrote (see the module documentation).
pub fn conditions_ready(sim: &Sim) -> Result<(), String> {
    let published = sim.cluster.published();
    for (name, node) in sim.nodes.iter().filter(|(_, n)| n.running.is_some()) {
        if node.leads() {
            let unreachable = node
                .device_peers()
                .unwrap_or_default()
                .iter()
                .any(|(key, _)| {
                    sim.nodes
                        .values()
                        .find(|n| n.public_key() == *key && n.running.is_some())
                        .is_some_and(|far| carrying_uplink(node, far).is_none())
                });
            if unreachable {
                continue;
            }
        }
        let Some(written) = published.conditions.get(name) else {
            return Err(format!("{name} runs but wrote no KiloMeshReady condition"));
        };
        let condition = &written.condition;
        if condition.status() != ConditionStatus::True {
            let role = if node.leads() { "leader" } else { "follower" };
            return Err(format!(
                "{name} ({role}) says KiloMeshReady {:?} ({:?}: {}) in a converged mesh",
                condition.status(),
                condition.reason,
                condition.message
            ));
        }
    }
    Ok(())
}
