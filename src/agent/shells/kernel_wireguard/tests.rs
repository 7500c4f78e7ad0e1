//! The translation between kg's configurations and WireGuard's netlink messages, checked
//! against a twin of the kernel's side.

use super::*;
use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_generic::GenlMessage;

fn key(seed: u8) -> PublicKey {
    SecretKey::from_bytes([seed; 32]).public_key()
}

fn peer(seed: u8, ips: &[&str]) -> PeerConfig {
    let mut p = PeerConfig::new(key(seed));
    for ip in ips {
        p.add_allowed_ip(ip.parse().unwrap());
    }
    p
}

/// The kernel's side of `WG_CMD_SET_DEVICE` (drivers/net/wireguard/netlink.c), as far as
/// kg uses it: the twin the translation is checked against here; the kernel itself checks
/// it in tests/real/kernel_vm.rs.
fn kernel_set(device: &mut DeviceConfig, message: &WireguardMessage) {
    for attribute in &message.attributes {
        match attribute {
            WireguardAttribute::PrivateKey(k) => {
                device.interface.private_key = (k != &[0; 32]).then(|| SecretKey::from_bytes(*k));
            }
            WireguardAttribute::ListenPort(p) => device.interface.listen_port = *p,
            WireguardAttribute::Fwmark(m) => device.interface.fwmark = *m,
            WireguardAttribute::Peers(peers) => {
                for p in peers {
                    kernel_set_peer(device, p);
                }
            }
            _ => {}
        }
    }
}

fn kernel_set_peer(device: &mut DeviceConfig, peer: &WireguardPeer) {
    let mut key = None;
    let mut flags = WireguardPeerFlags::empty();
    for a in &peer.0 {
        match a {
            WireguardPeerAttribute::PublicKey(k) => key = Some(PublicKey::from_bytes(*k)),
            WireguardPeerAttribute::Flags(f) => flags = *f,
            _ => {}
        }
    }
    let key = key.unwrap();
    if flags.contains(WireguardPeerFlags::RemoveMe) {
        device.peers.retain(|p| p.public_key != key);
        return;
    }
    if device.peer(&key).is_none() {
        assert!(
            !flags.contains(WireguardPeerFlags::UpdateOnly),
            "update of a missing peer"
        );
        device.peers.push(PeerConfig::new(key));
    }
    let target = device.peer_mut(&key).unwrap();
    if flags.contains(WireguardPeerFlags::ReplaceAllowedIps) {
        target.allowed_ips.clear();
    }
    for a in &peer.0 {
        match a {
            WireguardPeerAttribute::PresharedKey(k) => {
                target.preshared_key = (k != &[0; 32]).then(|| SecretKey::from_bytes(*k));
            }
            WireguardPeerAttribute::Endpoint(e) => target.endpoint = Some(*e),
            WireguardPeerAttribute::PersistentKeepalive(s) => target.persistent_keepalive = *s,
            WireguardPeerAttribute::AllowedIps(ips) => {
                for ip in ips {
                    let net = allowed_ip(ip).unwrap();
                    let remove = ip.0.iter().any(|a| {
                        matches!(a, WireguardAllowedIpAttr::Flags(f) if f.contains(WireguardAllowedIpFlags::RemoveMe))
                    });
                    if remove {
                        target.allowed_ips.retain(|n| *n != net);
                    } else {
                        target.add_allowed_ip(net);
                    }
                }
            }
            _ => {}
        }
    }
}

/// Emits and parses `message` as the kernel would receive it.
fn over_the_wire(message: &WireguardMessage) -> WireguardMessage {
    let mut genl = GenlMessage::from_payload(message.clone());
    genl.set_resolved_family_id(21);
    let mut nl = NetlinkMessage::from(genl);
    nl.finalize();
    let mut buffer = vec![0; nl.buffer_len()];
    nl.serialize(&mut buffer);
    match NetlinkMessage::<GenlMessage<WireguardMessage>>::deserialize(&buffer)
        .unwrap()
        .payload
    {
        NetlinkPayload::InnerMessage(m) => m.payload,
        other => panic!("{other:?}"),
    }
}

fn apply(current: &DeviceConfig, desired: &DeviceConfig) -> (DeviceConfig, usize) {
    apply_as(current, desired, AllowedIpsStyle::Replace)
}

fn apply_as(
    current: &DeviceConfig,
    desired: &DeviceConfig,
    style: AllowedIpsStyle,
) -> (DeviceConfig, usize) {
    let mut device = current.clone();
    let change = uapi_diff::change(current, desired).unwrap();
    let messages = set_messages("kilo0", &change, style);
    for m in &messages {
        kernel_set(&mut device, &over_the_wire(m));
    }
    (device, messages.len())
}

#[test]
fn a_change_sent_to_the_kernel_makes_the_device_the_desired_one() {
    let mut current = DeviceConfig::default();
    current.interface.listen_port = 51820;
    current.peers = vec![peer(1, &["10.0.1.0/24"]), peer(2, &["10.0.2.0/24"])];
    let mut desired = current.clone();
    desired.interface.private_key = Some(SecretKey::from_bytes([9; 32]));
    desired.peers.remove(1);
    desired.peers[0]
        .allowed_ips
        .push("10.9.0.0/16".parse().unwrap());
    desired.peers[0].endpoint = Some("192.0.2.1:51820".parse().unwrap());
    let mut new = peer(3, &["10.0.3.0/24", "fd00::/64"]);
    new.persistent_keepalive = 25;
    new.preshared_key = Some(SecretKey::from_bytes([7; 32]));
    new.endpoint = Some("[2001:db8::1]:51820".parse().unwrap());
    desired.peers.push(new);
    let (device, messages) = apply(&current, &desired);
    assert_eq!(messages, 1);
    assert_eq!(device, desired);
    assert_eq!(uapi_diff::change(&device, &desired), None);
}

#[test]
fn a_large_change_is_split_and_still_exact() {
    let current = DeviceConfig::default();
    let mut desired = DeviceConfig::default();
    for seed in 1..=200u8 {
        let ips: Vec<String> = (0..20).map(|i| format!("10.{seed}.{i}.0/24")).collect();
        let ips: Vec<&str> = ips.iter().map(String::as_str).collect();
        desired.peers.push(peer(seed, &ips));
    }
    let many: Vec<String> = (0..1500u32)
        .map(|i| format!("172.{}.{}.0/24", 16 + i / 256, i % 256))
        .collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    desired.peers.push(peer(201, &many));
    let (device, messages) = apply(&current, &desired);
    assert!(messages > 1, "{messages} message(s)");
    assert_eq!(device, desired);
}

#[test]
fn a_dump_split_over_messages_reads_as_one_device() {
    let mut desired = DeviceConfig::default();
    desired.interface.listen_port = 51821;
    desired.peers = vec![
        peer(1, &["10.0.1.0/24"]),
        peer(2, &["10.0.2.0/24", "10.0.3.0/24"]),
    ];
    let whole = set_messages(
        "kilo0",
        &uapi_diff::change(&DeviceConfig::default(), &desired).unwrap(),
        AllowedIpsStyle::Edit,
    );
    // The kernel continues peer 2's allowed IPs in a second message under its key.
    let mut first = whole[0].clone();
    let Some(WireguardAttribute::Peers(peers)) = first.attributes.last_mut() else {
        panic!("no peers");
    };
    let mut continued = peers[1].clone();
    if let Some(WireguardPeerAttribute::AllowedIps(ips)) = peers[1].0.last_mut() {
        ips.truncate(1);
    }
    if let Some(WireguardPeerAttribute::AllowedIps(ips)) = continued.0.last_mut() {
        ips.remove(0);
    }
    continued.0.retain(|a| {
        matches!(
            a,
            WireguardPeerAttribute::PublicKey(_) | WireguardPeerAttribute::AllowedIps(_)
        )
    });
    let second = WireguardMessage {
        cmd: WireguardCmd::GetDevice,
        attributes: vec![WireguardAttribute::Peers(vec![continued])],
    };
    let (config, stats) = device_from_messages(&[first, second]);
    assert_eq!(config, desired);
    assert_eq!(stats.len(), 2);
    assert!(stats.iter().all(|s| s.last_handshake.is_none()));
}

/// The allowed-IP entries a set of messages carries, and how many of them are removals.
fn entries(
    current: &DeviceConfig,
    desired: &DeviceConfig,
    style: AllowedIpsStyle,
) -> (usize, usize) {
    let change = uapi_diff::change(current, desired).unwrap();
    let mut sent = (0, 0);
    for message in set_messages("kilo0", &change, style) {
        for attribute in &message.attributes {
            let WireguardAttribute::Peers(peers) = attribute else {
                continue;
            };
            for ips in peers.iter().flat_map(|p| &p.0) {
                let WireguardPeerAttribute::AllowedIps(ips) = ips else {
                    continue;
                };
                sent.0 += ips.len();
                sent.1 += ips
                    .iter()
                    .filter(|ip| {
                        ip.0.iter()
                            .any(|a| matches!(a, WireguardAllowedIpAttr::Flags(_)))
                    })
                    .count();
            }
        }
    }
    sent
}

#[test]
fn an_edit_names_only_the_changed_ranges_and_still_makes_the_device_exact() {
    let many: Vec<String> = (0..700u32)
        .map(|i| format!("10.{}.{}.0/26", 16 + i / 256, i % 256))
        .collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let current = DeviceConfig {
        peers: vec![peer(1, &many), peer(2, &["10.0.2.0/24"])],
        ..DeviceConfig::default()
    };
    let mut desired = current.clone();
    desired.peers[0]
        .allowed_ips
        .retain(|n| n.to_string() != "10.16.7.0/26");
    desired.peers[0].add_allowed_ip("10.200.0.5/32".parse().unwrap());
    desired.peers[1].add_allowed_ip("fd00:2::/64".parse().unwrap());

    assert_eq!(entries(&current, &desired, AllowedIpsStyle::Edit), (3, 1));
    let (device, _) = apply_as(&current, &desired, AllowedIpsStyle::Edit);
    assert_eq!(uapi_diff::change(&device, &desired), None);

    // Whole lists: 700 for the first peer (in two parts), two for the second.
    assert_eq!(
        entries(&current, &desired, AllowedIpsStyle::Replace),
        (702, 0)
    );
    let (device, _) = apply_as(&current, &desired, AllowedIpsStyle::Replace);
    assert_eq!(uapi_diff::change(&device, &desired), None);
}

#[test]
fn removals_go_to_kernels_from_6_16_only() {
    for release in ["6.16.0-1-amd64", "6.17.3", "7.2.13+deb14-amd64", "10.0"] {
        assert!(kernel_takes_removals(release), "{release}");
    }
    for release in ["6.15.9-arch1", "6.1.0-50-amd64", "5.10.0-32-amd64", "6", ""] {
        assert!(!kernel_takes_removals(release), "{release}");
    }
}
