//! The model's check of post-quantum keys (`--post-quantum` on every agent): once converged,
//! every tunnel whose two running ends hold each other as peers, and which a path can carry
//! (not both ends behind NAT, an uplink live at both),
//! has one post-quantum preshared key at both ends, and it is a key the two agents' exchange
//! made (both ends' keys are the same).

use super::sim::{Sim, UPLINKS};

/// Every tunnel between two running nodes that a path can carry holds the same preshared key
/// at both ends, and one.
pub fn keyed(sim: &Sim) -> Result<(), String> {
    let devices: Vec<(&String, _, _)> = sim
        .nodes
        .iter()
        .filter_map(|(name, node)| {
            let config = node.running.as_ref()?.twin.engine.config();
            Some((name, node, config))
        })
        .collect();
    for (name, node, config) in &devices {
        for peer in &config.peers {
            let peer_key = control::Key(*peer.public_key.as_bytes());
            let Some((far_name, far, far_config)) =
                devices.iter().find(|(_, n, _)| n.public_key() == peer_key)
            else {
                continue;
            };
            // No path: both behind NAT, or no uplink live at both ends.
            let shared_uplink = (0..UPLINKS).any(|u| node.uplink_live(u) && far.uplink_live(u));
            if (node.behind_nat && far.behind_nat) || !shared_uplink {
                continue;
            }
            let Some(back) = far_config
                .peers
                .iter()
                .find(|p| control::Key(*p.public_key.as_bytes()) == node.public_key())
            else {
                continue;
            };
            if peer.preshared_key.is_none() {
                return Err(format!(
                    "{name}'s link to {far_name} holds no post-quantum preshared key"
                ));
            }
            if peer.preshared_key != back.preshared_key {
                return Err(format!(
                    "{name} and {far_name} hold different preshared keys for their link"
                ));
            }
        }
    }
    Ok(())
}
