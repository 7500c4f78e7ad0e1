//! The smallest change that takes a device from one configuration to another, for driving a
//! device we do not own: wireguard-go or another kilotun over its UAPI socket
//! ([`set_request`]), or the kernel's WireGuard over generic netlink (kg renders the same
//! [`DeviceChange`] as netlink attributes).
//!
//! Unlike a full `replace_peers=true` push, untouched peers are not mentioned, so wireguard-go
//! and the kernel keep their sessions too.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::net::SocketAddr;

use ipnet::IpNet;

use crate::config::{DeviceConfig, PeerConfig};
use crate::key::{PublicKey, SecretKey};

/// What must change on a device to make its configuration the desired one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceChange {
    /// The private key to set (`Some(None)`: remove it), when it differs.
    pub private_key: Option<Option<SecretKey>>,
    /// The listen port to set, when it differs (a desired 0 keeps the device's own).
    pub listen_port: Option<u16>,
    /// The fwmark to set, when it differs.
    pub fwmark: Option<u32>,
    /// Peers to remove.
    pub removed: Vec<PublicKey>,
    /// Peers to add or update, in the desired order.
    pub peers: Vec<PeerChange>,
}

impl DeviceChange {
    /// How many peers the device has already whose allowed IPs this change changes.
    pub fn peers_with_changed_allowed_ips(&self) -> usize {
        self.peers
            .iter()
            .filter(|p| {
                p.allowed_ips_edit
                    .as_ref()
                    .is_some_and(|e| !e.added.is_empty() || !e.removed.is_empty())
            })
            .count()
    }

    /// Whether, sent as edits, this change removes an allowed IP of a peer the device has:
    /// what devices from before the removal existed refuse.
    pub fn removes_allowed_ips(&self) -> bool {
        self.peers.iter().any(|p| {
            p.allowed_ips_edit
                .as_ref()
                .is_some_and(|e| !e.removed.is_empty())
        })
    }
}

/// One peer to add or update. Every field but the preshared key, the endpoint and (for a device
/// that takes removals) the allowed IPs is sent in full.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerChange {
    /// The peer's public key.
    pub public_key: PublicKey,
    /// True when the peer exists already: the device must not create it.
    pub update_only: bool,
    /// The preshared key to set (`Some(None)`: clear it), when it differs.
    pub preshared_key: Option<Option<SecretKey>>,
    /// The endpoint to set, when one is configured and differs.
    pub endpoint: Option<SocketAddr>,
    /// Seconds between keepalives; 0 disables them.
    pub persistent_keepalive: u16,
    /// The allowed IPs, replacing the device's list for this peer.
    pub allowed_ips: Vec<IpNet>,
    /// For a peer the device has, how its allowed IPs differ from the device's: a device that
    /// takes removals (`allowed_ip=-`) is sent only these ([`AllowedIpsStyle::Edit`]).
    pub allowed_ips_edit: Option<AllowedIpsEdit>,
}

/// How an existing peer's allowed IPs differ from the device's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedIpsEdit {
    /// Wanted and not on the device.
    pub added: Vec<IpNet>,
    /// On the device and no longer wanted.
    pub removed: Vec<IpNet>,
}

/// How a request changes an existing peer's allowed IPs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllowedIpsStyle {
    /// `replace_allowed_ips=true` and the whole list: every device takes it.
    Replace,
    /// Only what changed, `allowed_ip=` to add and `allowed_ip=-` to remove (kilotun,
    /// wireguard-go from 0.0.20250522, wireguard-tools' UAPI from 1.0.20250521); the other
    /// entries are never absent from the device, not even for the length of the request.
    Edit,
}

/// The change that turns `current` into `desired`, or `None` when they already agree.
pub fn change(current: &DeviceConfig, desired: &DeviceConfig) -> Option<DeviceChange> {
    let mut change = DeviceChange::default();
    // Compared by public key: devices clamp the private key they store (wireguard-go and the
    // kernel do), so the bytes read back may differ from an unclamped key that was set.
    let public = |c: &DeviceConfig| c.interface.private_key.as_ref().map(SecretKey::public_key);
    if public(current) != public(desired) {
        change.private_key = Some(desired.interface.private_key.clone());
    }
    if desired.interface.listen_port != 0
        && current.interface.listen_port != desired.interface.listen_port
    {
        change.listen_port = Some(desired.interface.listen_port);
    }
    if current.interface.fwmark != desired.interface.fwmark {
        change.fwmark = Some(desired.interface.fwmark);
    }
    let (current_peers, desired_peers) = (by_key(current), by_key(desired));
    change.removed = current
        .peers
        .iter()
        .filter(|p| !desired_peers.contains_key(&p.public_key))
        .map(|p| p.public_key)
        .collect();
    for peer in &desired.peers {
        match current_peers.get(&peer.public_key).copied() {
            Some(now) if same_peer(now, peer) => {}
            now => change.peers.push(peer_change(now, peer)),
        }
    }
    (change != DeviceChange::default()).then_some(change)
}

/// The body of a `set=1` request (without the `set=1` line and final blank line) that turns
/// `current` into `desired`, or `None` when they already agree.
pub fn set_request(
    current: &DeviceConfig,
    desired: &DeviceConfig,
    style: AllowedIpsStyle,
) -> Option<String> {
    change(current, desired).map(|change| render_set(&change, style))
}

/// `change` as the body of a UAPI `set=1` request, existing peers' allowed IPs changed as
/// `style` says.
pub fn render_set(change: &DeviceChange, style: AllowedIpsStyle) -> String {
    let mut out = String::new();
    match &change.private_key {
        Some(Some(key)) => {
            let _ = writeln!(out, "private_key={}", key.expose_hex().as_str());
        }
        Some(None) => out.push_str("private_key=\n"),
        None => {}
    }
    if let Some(port) = change.listen_port {
        let _ = writeln!(out, "listen_port={port}");
    }
    if let Some(mark) = change.fwmark {
        let _ = writeln!(out, "fwmark={mark}");
    }
    for key in &change.removed {
        let _ = writeln!(out, "public_key={}\nremove=true", key.to_hex());
    }
    for peer in &change.peers {
        let _ = writeln!(out, "public_key={}", peer.public_key.to_hex());
        if peer.update_only {
            out.push_str("update_only=true\n");
        }
        match &peer.preshared_key {
            Some(Some(psk)) => {
                let _ = writeln!(out, "preshared_key={}", psk.expose_hex().as_str());
            }
            Some(None) => {
                let _ = writeln!(out, "preshared_key={}", "0".repeat(64));
            }
            None => {}
        }
        if let Some(endpoint) = peer.endpoint {
            let _ = writeln!(out, "endpoint={endpoint}");
        }
        let _ = writeln!(
            out,
            "persistent_keepalive_interval={}",
            peer.persistent_keepalive
        );
        match (&peer.allowed_ips_edit, style) {
            (Some(edit), AllowedIpsStyle::Edit) => {
                // Additions first: an address moving to a narrower range is never unrouted.
                for ip in &edit.added {
                    let _ = writeln!(out, "allowed_ip={ip}");
                }
                for ip in &edit.removed {
                    let _ = writeln!(out, "allowed_ip=-{ip}");
                }
            }
            _ => {
                out.push_str("replace_allowed_ips=true\n");
                for ip in &peer.allowed_ips {
                    let _ = writeln!(out, "allowed_ip={ip}");
                }
            }
        }
    }
    out
}

/// Whether the body of a request removes an allowed IP (`allowed_ip=-`), which devices
/// before the removal existed refuse.
pub fn removes_allowed_ips(body: &str) -> bool {
    body.lines().any(|l| l.starts_with("allowed_ip=-"))
}

/// `config`'s peers by public key (a key listed twice: the first, as [`DeviceConfig::peer`]).
fn by_key(config: &DeviceConfig) -> HashMap<PublicKey, &PeerConfig> {
    config
        .peers
        .iter()
        .rev()
        .map(|p| (p.public_key, p))
        .collect()
}

fn same_peer(a: &PeerConfig, b: &PeerConfig) -> bool {
    let mut a_ips = a.allowed_ips.clone();
    let mut b_ips = b.allowed_ips.clone();
    a_ips.sort();
    b_ips.sort();
    a.preshared_key == b.preshared_key
        && a.persistent_keepalive == b.persistent_keepalive
        && a_ips == b_ips
        && (b.endpoint.is_none() || a.endpoint == b.endpoint)
}

fn peer_change(current: Option<&PeerConfig>, peer: &PeerConfig) -> PeerChange {
    PeerChange {
        public_key: peer.public_key,
        update_only: current.is_some(),
        preshared_key: (current.map(|c| &c.preshared_key) != Some(&peer.preshared_key))
            .then(|| peer.preshared_key.clone()),
        endpoint: peer
            .endpoint
            .filter(|e| current.and_then(|c| c.endpoint) != Some(*e)),
        persistent_keepalive: peer.persistent_keepalive,
        allowed_ips: peer.allowed_ips.clone(),
        allowed_ips_edit: current.map(|now| AllowedIpsEdit {
            added: missing(&peer.allowed_ips, &now.allowed_ips),
            removed: missing(&now.allowed_ips, &peer.allowed_ips),
        }),
    }
}

/// The ranges of `from` that `of` lacks, in `from`'s order.
fn missing(from: &[IpNet], of: &[IpNet]) -> Vec<IpNet> {
    let of: std::collections::BTreeSet<&IpNet> = of.iter().collect();
    from.iter().filter(|ip| !of.contains(ip)).copied().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::uapi::apply_set;

    fn peer(seed: u8, ips: &[&str], endpoint: Option<&str>) -> PeerConfig {
        let mut p = PeerConfig::new(
            SecretKey::from_hex(&format!("{seed:02x}").repeat(32))
                .unwrap()
                .public_key(),
        );
        for ip in ips {
            p.add_allowed_ip(ip.parse().unwrap());
        }
        p.endpoint = endpoint.map(|e| e.parse().unwrap());
        p
    }

    #[test]
    fn the_request_takes_current_to_desired_and_then_nothing_is_left() {
        let mut current = DeviceConfig::default();
        current.interface.listen_port = 51820;
        current.peers = vec![
            peer(1, &["10.0.1.0/24"], Some("1.1.1.1:1")),
            peer(2, &["10.0.2.0/24"], None),
        ];
        let mut desired = current.clone();
        desired.interface.private_key = Some(SecretKey::from_hex(&"09".repeat(32)).unwrap());
        desired.peers.remove(1);
        desired.peers[0]
            .allowed_ips
            .push("10.9.0.0/16".parse().unwrap());
        desired
            .peers
            .push(peer(3, &["10.0.3.0/24"], Some("3.3.3.3:3")));
        desired.peers[1].persistent_keepalive = 25;
        for style in [AllowedIpsStyle::Replace, AllowedIpsStyle::Edit] {
            let body = set_request(&current, &desired, style).unwrap();
            assert!(body.contains("remove=true"));
            let applied = apply_set(&current, &body).unwrap();
            assert_eq!(applied, desired, "{style:?}");
            assert_eq!(set_request(&applied, &desired, style), None);
        }
    }

    #[test]
    fn an_edit_names_only_the_ranges_that_changed() {
        let current = DeviceConfig {
            peers: vec![peer(
                1,
                &["10.0.1.0/24", "10.0.2.0/24", "10.0.3.0/24"],
                None,
            )],
            ..Default::default()
        };
        let mut desired = current.clone();
        desired.peers[0].allowed_ips = vec![
            "10.0.1.0/24".parse().unwrap(),
            "10.0.3.0/24".parse().unwrap(),
            "fd00::/64".parse().unwrap(),
        ];
        let body = set_request(&current, &desired, AllowedIpsStyle::Edit).unwrap();
        let lines: Vec<&str> = body
            .lines()
            .filter(|l| l.starts_with("allowed_ip"))
            .collect();
        assert_eq!(
            lines,
            ["allowed_ip=fd00::/64", "allowed_ip=-10.0.2.0/24"],
            "{body}"
        );
        assert!(!body.contains("replace_allowed_ips"), "{body}");
        assert!(removes_allowed_ips(&body));
        let edit = change(&current, &desired).unwrap();
        assert!(edit.removes_allowed_ips());
        assert_eq!(edit.peers_with_changed_allowed_ips(), 1);
        assert_eq!(apply_set(&current, &body).unwrap(), desired);
        // A new peer has nothing to edit: its list is sent whole, either way.
        let mut grown = desired.clone();
        grown.peers.push(peer(2, &["10.0.9.0/24"], None));
        let body = set_request(&desired, &grown, AllowedIpsStyle::Edit).unwrap();
        assert!(
            body.contains("replace_allowed_ips=true\nallowed_ip=10.0.9.0/24"),
            "{body}"
        );
        assert!(!removes_allowed_ips(&body));
        let grow = change(&desired, &grown).unwrap();
        assert!(!grow.removes_allowed_ips());
        assert_eq!(grow.peers_with_changed_allowed_ips(), 0, "a new peer");
        // Only additions: nothing for an older device to refuse.
        let mut wider = current.clone();
        wider.peers[0]
            .allowed_ips
            .push("10.0.4.0/24".parse().unwrap());
        let body = set_request(&current, &wider, AllowedIpsStyle::Edit).unwrap();
        assert!(!removes_allowed_ips(&body), "{body}");
    }

    #[test]
    fn an_unchanged_peer_is_not_mentioned() {
        let current = DeviceConfig {
            peers: vec![
                peer(1, &["10.0.1.0/24"], Some("1.1.1.1:1")),
                peer(2, &["10.0.2.0/24"], None),
            ],
            ..Default::default()
        };
        let mut desired = current.clone();
        desired.peers[1]
            .allowed_ips
            .push("10.8.0.0/16".parse().unwrap());
        let body = set_request(&current, &desired, AllowedIpsStyle::Replace).unwrap();
        assert!(
            !body.contains(&current.peers[0].public_key.to_hex()),
            "{body}"
        );
        assert!(body.contains("update_only=true"));
    }

    #[test]
    fn a_private_key_read_back_clamped_is_the_same_key() {
        let raw = [0xffu8; 32];
        let mut clamped = raw;
        clamped[0] &= 248;
        clamped[31] &= 127;
        clamped[31] |= 64;
        let mut current = DeviceConfig::default();
        current.interface.private_key = Some(SecretKey::from_bytes(clamped));
        let mut desired = current.clone();
        desired.interface.private_key = Some(SecretKey::from_bytes(raw));
        assert_eq!(
            set_request(&current, &desired, AllowedIpsStyle::Replace),
            None
        );
    }

    #[test]
    fn a_roamed_endpoint_is_not_a_difference_when_none_is_configured() {
        let current = DeviceConfig {
            peers: vec![peer(1, &["10.0.1.0/24"], Some("5.5.5.5:5"))],
            ..Default::default()
        };
        let mut desired = current.clone();
        desired.peers[0].endpoint = None;
        assert_eq!(
            set_request(&current, &desired, AllowedIpsStyle::Replace),
            None
        );
    }
}
