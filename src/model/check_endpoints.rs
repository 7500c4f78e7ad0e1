//! What the converged mesh must show of the endpoint candidates: every tunnel a leader's
//! device holds to another node carries traffic when the two share an uplink that is live at
//! both ends, whichever candidates were black-holed, removed or renumbered on the way.

use super::sim::{Sim, SimNode, UPLINKS};

/// The uplink a tunnel between `a` and `b` can use: one live at both ends, unless both are
/// behind NAT (then a relay carries them, and no uplink of their own does).
pub fn carrying_uplink(a: &SimNode, b: &SimNode) -> Option<usize> {
    if a.behind_nat && b.behind_nat {
        return None;
    }
    (0..UPLINKS).find(|u| a.uplink_live(*u) && b.uplink_live(*u))
}

/// Every running leader's tunnel to another running node: up, unless no uplink is live at
/// both ends (no candidate pair can work) or both are behind NAT (a relay carries them).
pub fn tunnels_carry(sim: &Sim) -> Result<(), String> {
    for (name, node) in sim.nodes.iter().filter(|(_, n)| n.leads()) {
        for (key, _) in node.device_peers().unwrap_or_default() {
            let Some((far_name, far)) = sim
                .nodes
                .iter()
                .find(|(_, n)| n.public_key() == key && n.running.is_some())
            else {
                continue;
            };
            let Some(uplink) = carrying_uplink(node, far) else {
                continue;
            };
            if !sim.tunnel_up(name, &key) {
                let endpoint = node
                    .running
                    .as_ref()
                    .map(|r| r.twin.engine.config())
                    .and_then(|c| {
                        c.peers
                            .into_iter()
                            .find(|p| p.public_key.as_bytes() == &key.0)
                    })
                    .and_then(|p| p.endpoint);
                return Err(format!(
                    "{name}'s tunnel to {far_name} carries nothing though uplink {uplink} is live at both ends: {name} sends to {endpoint:?}, {far_name}'s uplinks are {:?} (black-holed {:?})",
                    (0..UPLINKS).map(|u| far.uplink_address(u)).collect::<Vec<_>>(),
                    far.uplinks.black_holed,
                ));
            }
        }
    }
    Ok(())
}
