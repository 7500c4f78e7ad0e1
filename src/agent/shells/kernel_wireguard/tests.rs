//! The translation between kg's configurations and WireGuard's netlink messages, checked
//! against a twin of the kernel's side.

use super::*;

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
                    target.add_allowed_ip(allowed_ip(ip).unwrap());
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
    let mut device = current.clone();
    let change = uapi_diff::change(current, desired).unwrap();
    let messages = set_messages("kilo0", &change);
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
