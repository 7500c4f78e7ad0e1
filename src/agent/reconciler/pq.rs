//! Which links get post-quantum preshared keys: this node's WireGuard peers whose nodes
//! publish an ML-KEM fingerprint (`kilotun.io/pq`), with the WireGuard IP their exchange
//! listens on.

use std::net::IpAddr;

use control::Key;

use super::Reconciler;

impl Reconciler {
    /// The peers of the topology last applied that take part: each one's WireGuard key,
    /// announcement and WireGuard IP. None before a topology was applied; empty while this
    /// node leads nothing; none for a segment reached through a relay (no link of its own).
    pub fn pq_peers(&self) -> Option<Vec<(Key, control::pq::PqAnnouncement, IpAddr)>> {
        let t = self.topology.as_deref()?;
        if !t.leader {
            return Some(Vec::new());
        }
        let peers = t
            .segments
            .iter()
            .filter(|s| !t.in_local_location(s) && t.relay_for(s).is_none())
            .filter_map(|s| {
                let node = self.table.get(&s.leader_member().name)?;
                Some((s.public_key, node.pq?, s.wireguard_ip))
            })
            .collect();
        Some(peers)
    }
}
