//! The kernel's WireGuard, driven over generic netlink: the only module that speaks WireGuard's
//! netlink family (`WG_CMD_GET_DEVICE`, `WG_CMD_SET_DEVICE`). The link itself is created by the
//! rtnetlink shell (`ip link add NAME type wireguard`).
//!
//! A change is the same [`DeviceChange`] the UAPI path renders as text, so unchanged peers are
//! not mentioned and keep their sessions, as with the embedded engine.

use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use dataplane::uapi_diff::{self, AllowedIpsStyle, DeviceChange, PeerChange};
use dataplane::{DeviceConfig, PeerConfig, PeerStats, PublicKey, SecretKey};
use ipnet::IpNet;
use netlink_packet_core::{NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_wireguard::{
    WireguardAddressFamily, WireguardAllowedIp, WireguardAllowedIpAttr, WireguardAllowedIpFlags,
    WireguardAttribute, WireguardCmd, WireguardMessage, WireguardPeer, WireguardPeerAttribute,
    WireguardPeerFlags,
};

mod genl;
use super::allowed_ips::{AllowedIpsMethod, AllowedIpsUpdates};
use genl::GenlSocket;

/// The largest `WG_CMD_SET_DEVICE` message kg sends: a change bigger than this (hundreds of
/// peers, thousands of allowed IPs) is split as `wg setconf` splits it.
const MAX_SET_MESSAGE: usize = 32 * 1024;

/// The kernel's WireGuard device `interface`.
pub struct KernelWireGuard {
    interface: String,
    netlink: parking_lot::Mutex<GenlSocket>,
    /// Whether an existing peer's allowed IPs change entry by entry
    /// ([`AllowedIpsStyle::Edit`]; off on kernels before 6.16 and after a refusal), and what
    /// was sent.
    allowed_ips: AllowedIpsMethod,
}

/// Whether a kernel of `release` (`uname -r`) takes `WGALLOWEDIP_F_REMOVE_ME`, the removal of
/// one allowed IP: Linux 6.16 and later. Older kernels are sent an existing peer's whole list.
pub fn kernel_takes_removals(release: &str) -> bool {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let major = numbers.next().unwrap_or(0);
    let minor = numbers.next().unwrap_or(0);
    (major, minor) >= (6, 16)
}

impl KernelWireGuard {
    /// Drives the kernel's WireGuard link `interface`. Fails when the kernel has no WireGuard
    /// (no `wireguard` generic netlink family) or `interface` is not a WireGuard link.
    pub fn open(interface: &str) -> Result<Self> {
        let netlink = GenlSocket::open("wireguard")
            .context("the kernel has no WireGuard (no generic netlink family \"wireguard\")")?;
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let device = Self {
            interface: interface.to_string(),
            netlink: parking_lot::Mutex::new(netlink),
            allowed_ips: AllowedIpsMethod::new(kernel_takes_removals(release.trim())),
        };
        device
            .read()
            .with_context(|| format!("{interface} is not a kernel WireGuard link"))?;
        Ok(device)
    }

    /// Whether the kernel has WireGuard: its generic netlink family resolves (the kernel loads
    /// the module on the way when it can). Creates nothing.
    pub fn available() -> Result<()> {
        GenlSocket::open("wireguard")
            .map(drop)
            .context("the kernel has no WireGuard (no generic netlink family \"wireguard\")")
    }

    /// The interface's name.
    pub fn interface(&self) -> &str {
        &self.interface
    }

    /// The device's configuration and its peers' counters and handshake times.
    pub fn read(&self) -> Result<(DeviceConfig, Vec<PeerStats>)> {
        let request = WireguardMessage {
            cmd: WireguardCmd::GetDevice,
            attributes: vec![WireguardAttribute::IfName(self.interface.clone())],
        };
        let answers = self
            .netlink
            .lock()
            .request(request, NLM_F_REQUEST | NLM_F_DUMP)
            .with_context(|| format!("reading WireGuard device {}", self.interface))?;
        Ok(device_from_messages(&answers))
    }

    /// Makes the device's configuration `desired`, changing only what differs. True when
    /// something changed. An existing peer's allowed IPs change entry by entry where the kernel
    /// takes removals; a kernel that refuses one gets whole lists from then on.
    pub fn apply(&self, desired: &DeviceConfig) -> Result<bool> {
        let (current, _) = self.read()?;
        let Some(change) = uapi_diff::change(&current, desired) else {
            return Ok(false);
        };
        let style = self.allowed_ips.style();
        let refused = match self.send(&change, style) {
            Ok(()) => {
                self.allowed_ips.sent(&change, style);
                return Ok(true);
            }
            Err(e) if style == AllowedIpsStyle::Edit && change.removes_allowed_ips() => e,
            Err(e) => return Err(e),
        };
        // The messages before the refused one were applied: read the device again and replace
        // what still differs. Only when that succeeds was the removal the trouble.
        let (current, _) = self.read()?;
        if let Some(change) = uapi_diff::change(&current, desired) {
            self.send(&change, AllowedIpsStyle::Replace)?;
            self.allowed_ips.sent(&change, AllowedIpsStyle::Replace);
        }
        self.allowed_ips.refused(format!(
            "the kernel refused the removal of one allowed IP (WGALLOWEDIP_F_REMOVE_ME): {refused:#}"
        ));
        Ok(true)
    }

    /// What changed peers' allowed IPs were sent as since the last call.
    pub fn take_allowed_ips_updates(&self) -> AllowedIpsUpdates {
        self.allowed_ips.take()
    }

    fn send(&self, change: &DeviceChange, style: AllowedIpsStyle) -> Result<()> {
        tracing::debug!(device = %self.interface, change = describe(change, style), "WireGuard netlink set");
        let mut netlink = self.netlink.lock();
        for message in set_messages(&self.interface, change, style) {
            netlink
                .request(message, NLM_F_REQUEST | NLM_F_ACK)
                .with_context(|| format!("configuring WireGuard device {}", self.interface))?;
        }
        Ok(())
    }
}

/// What `change` does to peers, for the debug log: `peer=<key> +net -net` for an edit,
/// `peer=<key> replace N` for a whole list, `remove=<key>`; never a key of the device's own.
fn describe(change: &DeviceChange, style: AllowedIpsStyle) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    for key in &change.removed {
        let _ = write!(out, "remove={key} ");
    }
    for peer in &change.peers {
        let _ = write!(out, "peer={}", peer.public_key);
        match (&peer.allowed_ips_edit, style) {
            (Some(edit), AllowedIpsStyle::Edit) => {
                for net in &edit.added {
                    let _ = write!(out, " +{net}");
                }
                for net in &edit.removed {
                    let _ = write!(out, " -{net}");
                }
            }
            _ => {
                let _ = write!(out, " replace {}", peer.allowed_ips.len());
            }
        }
        out.push(' ');
    }
    out.trim_end().to_string()
}

impl KernelWireGuard {
    /// Starts a handshake at once with every peer that has none, and returns how many: the
    /// other ends may still send on sessions that died with the last device (the embedded
    /// engine's, before a switch) and, on a link where only they send, would wait for their own
    /// timers (about 15 s). The kernel has no command for it; turning a peer's persistent
    /// keepalive on sends a keepalive at once (`set_peer` in drivers/net/wireguard/netlink.c),
    /// which needs a session and so starts a handshake. The interval is then put back. The
    /// link must be up.
    pub fn start_handshakes(&self) -> Result<usize> {
        let (config, stats) = self.read()?;
        let idle: Vec<&PeerConfig> = config
            .peers
            .iter()
            .filter(|p| {
                stats
                    .iter()
                    .any(|s| s.public_key == p.public_key && s.last_handshake.is_none())
            })
            .collect();
        if idle.is_empty() {
            return Ok(0);
        }
        let keepalive = |interval: &dyn Fn(&PeerConfig) -> u16| {
            set_device(vec![
                WireguardAttribute::IfName(self.interface.clone()),
                WireguardAttribute::Peers(
                    idle.iter()
                        .map(|p| {
                            WireguardPeer(vec![
                                WireguardPeerAttribute::PublicKey(*p.public_key.as_bytes()),
                                WireguardPeerAttribute::Flags(WireguardPeerFlags::UpdateOnly),
                                WireguardPeerAttribute::PersistentKeepalive(interval(p)),
                            ])
                        })
                        .collect(),
                ),
            ])
        };
        let steps = [
            // Off where it is on, so that the next step turns it on.
            keepalive(&|_| 0),
            keepalive(&|p| p.persistent_keepalive.max(1)),
            keepalive(&|p| p.persistent_keepalive),
        ];
        let mut netlink = self.netlink.lock();
        for step in steps {
            netlink
                .request(step, NLM_F_REQUEST | NLM_F_ACK)
                .with_context(|| format!("starting handshakes on {}", self.interface))?;
        }
        Ok(idle.len())
    }
}

/// The configuration and peer state in a `WG_CMD_GET_DEVICE` dump. The kernel splits a large
/// device over several messages; a peer whose allowed IPs did not fit continues at the start of
/// the next message under the same public key.
pub fn device_from_messages(messages: &[WireguardMessage]) -> (DeviceConfig, Vec<PeerStats>) {
    let mut config = DeviceConfig::default();
    let mut stats: Vec<PeerStats> = Vec::new();
    for message in messages {
        for attribute in &message.attributes {
            match attribute {
                WireguardAttribute::PrivateKey(key) if key != &[0; 32] => {
                    config.interface.private_key = Some(SecretKey::from_bytes(*key));
                }
                WireguardAttribute::ListenPort(port) => config.interface.listen_port = *port,
                WireguardAttribute::Fwmark(mark) => config.interface.fwmark = *mark,
                WireguardAttribute::Peers(peers) => {
                    for peer in peers {
                        read_peer(peer, &mut config, &mut stats);
                    }
                }
                _ => {}
            }
        }
    }
    for peer in &mut config.peers {
        peer.allowed_ips = dataplane::config::unique_prefixes(&peer.allowed_ips);
    }
    (config, stats)
}

fn read_peer(peer: &WireguardPeer, config: &mut DeviceConfig, stats: &mut Vec<PeerStats>) {
    let Some(key) = peer.0.iter().find_map(|a| match a {
        WireguardPeerAttribute::PublicKey(k) => Some(PublicKey::from_bytes(*k)),
        _ => None,
    }) else {
        return;
    };
    if config.peers.last().map(|p| p.public_key) != Some(key) {
        config.peers.push(PeerConfig::new(key));
        stats.push(PeerStats::new(key));
    }
    let (Some(out), Some(counters)) = (config.peers.last_mut(), stats.last_mut()) else {
        return;
    };
    for attribute in &peer.0 {
        match attribute {
            WireguardPeerAttribute::PresharedKey(psk) if psk != &[0; 32] => {
                out.preshared_key = Some(SecretKey::from_bytes(*psk));
            }
            WireguardPeerAttribute::Endpoint(endpoint) => {
                out.endpoint = Some(*endpoint);
                counters.endpoint = Some(*endpoint);
            }
            WireguardPeerAttribute::PersistentKeepalive(seconds) => {
                out.persistent_keepalive = *seconds;
            }
            WireguardPeerAttribute::LastHandshake(time) if time.seconds > 0 => {
                counters.last_handshake = Some(
                    SystemTime::UNIX_EPOCH
                        + Duration::new(
                            time.seconds as u64,
                            time.nano_seconds.clamp(0, 999_999_999) as u32,
                        ),
                );
            }
            WireguardPeerAttribute::RxBytes(bytes) => counters.rx_bytes = *bytes,
            WireguardPeerAttribute::TxBytes(bytes) => counters.tx_bytes = *bytes,
            WireguardPeerAttribute::AllowedIps(ips) => {
                for ip in ips {
                    // Made unique once the whole dump is read (linear, for a long list).
                    if let Some(net) = allowed_ip(ip) {
                        out.allowed_ips.push(net.trunc());
                    }
                }
            }
            _ => {}
        }
    }
}

fn allowed_ip(ip: &WireguardAllowedIp) -> Option<IpNet> {
    let mut address = None;
    let mut prefix = None;
    for attribute in &ip.0 {
        match attribute {
            WireguardAllowedIpAttr::IpAddr(a) => address = Some(*a),
            WireguardAllowedIpAttr::Cidr(c) => prefix = Some(*c),
            _ => {}
        }
    }
    IpNet::new(address?, prefix?).ok()
}

/// `change` as `WG_CMD_SET_DEVICE` messages for `interface`, existing peers' allowed IPs
/// changed as `style` says: one message unless it exceeds [`MAX_SET_MESSAGE`], in which case
/// later messages carry the remaining peers and a peer's remaining allowed IPs (added to the
/// ones the earlier message replaced), as `wg setconf` does.
pub fn set_messages(
    interface: &str,
    change: &DeviceChange,
    style: AllowedIpsStyle,
) -> Vec<WireguardMessage> {
    let mut first = vec![WireguardAttribute::IfName(interface.to_string())];
    if let Some(key) = &change.private_key {
        first.push(WireguardAttribute::PrivateKey(
            key.as_ref().map_or([0; 32], |k| *k.as_bytes()),
        ));
    }
    if let Some(port) = change.listen_port {
        first.push(WireguardAttribute::ListenPort(port));
    }
    if let Some(mark) = change.fwmark {
        first.push(WireguardAttribute::Fwmark(mark));
    }
    let mut peers: Vec<WireguardPeer> = change
        .removed
        .iter()
        .map(|key| {
            WireguardPeer(vec![
                WireguardPeerAttribute::PublicKey(*key.as_bytes()),
                WireguardPeerAttribute::Flags(WireguardPeerFlags::RemoveMe),
            ])
        })
        .collect();
    for peer in &change.peers {
        peers.extend(peer_parts(peer, style));
    }
    let mut messages = Vec::new();
    let mut attributes = first;
    let mut batch: Vec<WireguardPeer> = Vec::new();
    let mut size = 0;
    for peer in peers {
        let len = peer_len(&peer);
        if !batch.is_empty() && size + len > MAX_SET_MESSAGE {
            attributes.push(WireguardAttribute::Peers(std::mem::take(&mut batch)));
            messages.push(set_device(attributes));
            attributes = vec![WireguardAttribute::IfName(interface.to_string())];
            size = 0;
        }
        size += len;
        batch.push(peer);
    }
    if !batch.is_empty() {
        attributes.push(WireguardAttribute::Peers(batch));
    }
    messages.push(set_device(attributes));
    messages
}

/// Allowed IPs per peer part: a peer with more is sent as several parts, the first replacing
/// the device's list (or editing it) and the rest adding to it.
const ALLOWED_IPS_PER_PART: usize = 512;

fn peer_parts(peer: &PeerChange, style: AllowedIpsStyle) -> Vec<WireguardPeer> {
    let key = WireguardPeerAttribute::PublicKey(*peer.public_key.as_bytes());
    let mut head = vec![key.clone()];
    let (mut flags, entries) = match (&peer.allowed_ips_edit, style) {
        // Additions first: an address moving to a narrower range is never unrouted.
        (Some(edit), AllowedIpsStyle::Edit) => (
            WireguardPeerFlags::empty(),
            edit.added
                .iter()
                .map(|net| allowed_ip_entry(net, false))
                .chain(edit.removed.iter().map(|net| allowed_ip_entry(net, true)))
                .collect::<Vec<_>>(),
        ),
        _ => (
            WireguardPeerFlags::ReplaceAllowedIps,
            peer.allowed_ips
                .iter()
                .map(|net| allowed_ip_entry(net, false))
                .collect(),
        ),
    };
    if peer.update_only {
        flags |= WireguardPeerFlags::UpdateOnly;
    }
    head.push(WireguardPeerAttribute::Flags(flags));
    if let Some(psk) = &peer.preshared_key {
        head.push(WireguardPeerAttribute::PresharedKey(
            psk.as_ref().map_or([0; 32], |k| *k.as_bytes()),
        ));
    }
    if let Some(endpoint) = peer.endpoint {
        head.push(WireguardPeerAttribute::Endpoint(endpoint));
    }
    head.push(WireguardPeerAttribute::PersistentKeepalive(
        peer.persistent_keepalive,
    ));
    let mut chunks = entries.chunks(ALLOWED_IPS_PER_PART);
    head.push(WireguardPeerAttribute::AllowedIps(
        chunks.next().map(<[_]>::to_vec).unwrap_or_default(),
    ));
    let mut parts = vec![WireguardPeer(head)];
    for chunk in chunks {
        parts.push(WireguardPeer(vec![
            key.clone(),
            WireguardPeerAttribute::Flags(WireguardPeerFlags::UpdateOnly),
            WireguardPeerAttribute::AllowedIps(chunk.to_vec()),
        ]));
    }
    parts
}

/// One allowed IP, to add or (`remove`, Linux 6.16 on) to remove.
fn allowed_ip_entry(net: &IpNet, remove: bool) -> WireguardAllowedIp {
    let family = match net.addr() {
        IpAddr::V4(_) => WireguardAddressFamily::Ipv4,
        IpAddr::V6(_) => WireguardAddressFamily::Ipv6,
    };
    let mut attributes = vec![
        WireguardAllowedIpAttr::Family(family),
        WireguardAllowedIpAttr::IpAddr(net.addr()),
        WireguardAllowedIpAttr::Cidr(net.prefix_len()),
    ];
    if remove {
        attributes.push(WireguardAllowedIpAttr::Flags(
            WireguardAllowedIpFlags::RemoveMe,
        ));
    }
    WireguardAllowedIp(attributes)
}

fn peer_len(peer: &WireguardPeer) -> usize {
    use netlink_packet_core::Emitable;
    WireguardAttribute::Peers(vec![peer.clone()]).buffer_len()
}

fn set_device(attributes: Vec<WireguardAttribute>) -> WireguardMessage {
    WireguardMessage {
        cmd: WireguardCmd::SetDevice,
        attributes,
    }
}

#[cfg(test)]
mod tests;
