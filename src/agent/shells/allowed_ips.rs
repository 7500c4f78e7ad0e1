//! How changed peers' allowed IPs reach a device kg configures from outside (over UAPI or
//! netlink): entry by entry where the device takes removals, whole lists where it does not, and
//! what was sent each way, for the metrics and the journal.

use std::sync::atomic::{AtomicBool, Ordering};

use dataplane::uapi_diff::{AllowedIpsStyle, DeviceChange};

/// What a device was sent for peers whose allowed IPs changed, since it was last asked
/// ([`crate::agent::shells::Device::take_allowed_ips_updates`]).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct AllowedIpsUpdates {
    /// Peers whose allowed IPs changed entry by entry (`allowed_ip=-`,
    /// `WGALLOWEDIP_F_REMOVE_ME`): the other entries stayed on the device throughout.
    pub edited: u64,
    /// Peers whose allowed IPs were replaced whole (`replace_allowed_ips=true`).
    pub replaced: u64,
    /// Set the one time the device refused a removal of one allowed IP: what it answered.
    /// Whole lists are sent from then on.
    pub edit_refused: Option<String>,
}

/// The style a device is sent and the tally of what it was sent.
#[derive(Debug)]
pub struct AllowedIpsMethod {
    /// False on a device that does not take removals (known up front, or once it refused one).
    edits: AtomicBool,
    tally: parking_lot::Mutex<AllowedIpsUpdates>,
}

impl AllowedIpsMethod {
    /// Starts with edits (`edits`) or whole lists.
    pub fn new(edits: bool) -> Self {
        Self {
            edits: AtomicBool::new(edits),
            tally: parking_lot::Mutex::default(),
        }
    }

    /// How the next change is to be sent.
    pub fn style(&self) -> AllowedIpsStyle {
        if self.edits.load(Ordering::Relaxed) {
            AllowedIpsStyle::Edit
        } else {
            AllowedIpsStyle::Replace
        }
    }

    /// Counts `change`, which the device took in `style`.
    pub fn sent(&self, change: &DeviceChange, style: AllowedIpsStyle) {
        let peers = change.peers_with_changed_allowed_ips() as u64;
        let mut tally = self.tally.lock();
        match style {
            AllowedIpsStyle::Edit => tally.edited += peers,
            AllowedIpsStyle::Replace => tally.replaced += peers,
        }
    }

    /// The device refused a removal (it answered `answer`): whole lists from now on.
    pub fn refused(&self, answer: String) {
        self.edits.store(false, Ordering::Relaxed);
        self.tally.lock().edit_refused = Some(answer);
    }

    /// What was sent since the last call.
    pub fn take(&self) -> AllowedIpsUpdates {
        std::mem::take(&mut *self.tally.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataplane::uapi_diff::change;
    use dataplane::{DeviceConfig, PeerConfig, SecretKey};

    fn device(ips: &[&str]) -> DeviceConfig {
        let mut config = DeviceConfig::default();
        let key = SecretKey::from_hex(&"07".repeat(32)).unwrap().public_key();
        let mut peer = PeerConfig::new(key);
        peer.allowed_ips = ips.iter().map(|ip| ip.parse().unwrap()).collect();
        config.peers.push(peer);
        config
    }

    #[test]
    fn counts_changed_peers_by_style_and_switches_to_whole_lists_once_refused() {
        let method = AllowedIpsMethod::new(true);
        assert_eq!(method.style(), AllowedIpsStyle::Edit);
        let moved = change(&device(&["10.1.0.0/24"]), &device(&["10.2.0.0/24"])).unwrap();
        method.sent(&moved, method.style());
        // A new peer is no change of an existing peer's allowed IPs.
        let added = change(&DeviceConfig::default(), &device(&["10.1.0.0/24"])).unwrap();
        method.sent(&added, method.style());
        method.refused("errno=22".into());
        assert_eq!(method.style(), AllowedIpsStyle::Replace);
        method.sent(&moved, method.style());
        let expected = AllowedIpsUpdates {
            edited: 1,
            replaced: 1,
            edit_refused: Some("errno=22".into()),
        };
        assert_eq!(method.take(), expected);
        assert_eq!(method.take(), AllowedIpsUpdates::default(), "taken once");
    }
}
