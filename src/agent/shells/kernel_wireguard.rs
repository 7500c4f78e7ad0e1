//! The kernel's WireGuard, driven over generic netlink: the only module that speaks WireGuard's
//! netlink family (`WG_CMD_GET_DEVICE`, `WG_CMD_SET_DEVICE`). The link itself is created by the
//! rtnetlink shell (`ip link add NAME type wireguard`).
//!
//! A change is the same [`DeviceChange`] the UAPI path renders as text, so unchanged peers are
//! not mentioned and keep their sessions, as with the embedded engine.

use std::net::IpAddr;
use std::time::{Duration, SystemTime};

use anyhow::{bail, Context, Result};
use dataplane::uapi_diff::{self, DeviceChange, PeerChange};
use dataplane::{DeviceConfig, PeerConfig, PeerStats, PublicKey, SecretKey};
use ipnet::IpNet;
use netlink_packet_core::{NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_generic::ctrl::nlas::GenlCtrlAttrs;
use netlink_packet_generic::ctrl::{GenlCtrl, GenlCtrlCmd};
use netlink_packet_generic::GenlMessage;
use netlink_packet_wireguard::{
    WireguardAddressFamily, WireguardAllowedIp, WireguardAllowedIpAttr, WireguardAttribute,
    WireguardCmd, WireguardMessage, WireguardPeer, WireguardPeerAttribute, WireguardPeerFlags,
};
use netlink_sys::{protocols::NETLINK_GENERIC, Socket, SocketAddr};

/// The largest `WG_CMD_SET_DEVICE` message kg sends: a change bigger than this (hundreds of
/// peers, thousands of allowed IPs) is split as `wg setconf` splits it.
const MAX_SET_MESSAGE: usize = 32 * 1024;

/// The kernel's WireGuard device `interface`.
pub struct KernelWireGuard {
    interface: String,
    netlink: parking_lot::Mutex<GenlSocket>,
}

impl KernelWireGuard {
    /// Drives the kernel's WireGuard link `interface`. Fails when the kernel has no WireGuard
    /// (no `wireguard` generic netlink family) or `interface` is not a WireGuard link.
    pub fn open(interface: &str) -> Result<Self> {
        let netlink = GenlSocket::open("wireguard")
            .context("the kernel has no WireGuard (no generic netlink family \"wireguard\")")?;
        let device = Self {
            interface: interface.to_string(),
            netlink: parking_lot::Mutex::new(netlink),
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
    /// something changed.
    pub fn apply(&self, desired: &DeviceConfig) -> Result<bool> {
        let (current, _) = self.read()?;
        let Some(change) = uapi_diff::change(&current, desired) else {
            return Ok(false);
        };
        let mut netlink = self.netlink.lock();
        for message in set_messages(&self.interface, &change) {
            netlink
                .request(message, NLM_F_REQUEST | NLM_F_ACK)
                .with_context(|| format!("configuring WireGuard device {}", self.interface))?;
        }
        Ok(true)
    }
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
                    if let Some(net) = allowed_ip(ip) {
                        out.add_allowed_ip(net);
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

/// `change` as `WG_CMD_SET_DEVICE` messages for `interface`: one unless it exceeds
/// [`MAX_SET_MESSAGE`], in which case later messages carry the remaining peers and a peer's
/// remaining allowed IPs (added to the ones the earlier message replaced), as `wg setconf`
/// does.
pub fn set_messages(interface: &str, change: &DeviceChange) -> Vec<WireguardMessage> {
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
        peers.extend(peer_parts(peer));
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
/// the device's list and the rest adding to it.
const ALLOWED_IPS_PER_PART: usize = 512;

fn peer_parts(peer: &PeerChange) -> Vec<WireguardPeer> {
    let key = WireguardPeerAttribute::PublicKey(*peer.public_key.as_bytes());
    let mut head = vec![key.clone()];
    let mut flags = WireguardPeerFlags::ReplaceAllowedIps;
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
    let mut chunks = peer.allowed_ips.chunks(ALLOWED_IPS_PER_PART);
    head.push(WireguardPeerAttribute::AllowedIps(
        chunks.next().map(allowed_ips).unwrap_or_default(),
    ));
    let mut parts = vec![WireguardPeer(head)];
    for chunk in chunks {
        parts.push(WireguardPeer(vec![
            key.clone(),
            WireguardPeerAttribute::Flags(WireguardPeerFlags::UpdateOnly),
            WireguardPeerAttribute::AllowedIps(allowed_ips(chunk)),
        ]));
    }
    parts
}

fn allowed_ips(nets: &[IpNet]) -> Vec<WireguardAllowedIp> {
    nets.iter()
        .map(|net| {
            let family = match net.addr() {
                IpAddr::V4(_) => WireguardAddressFamily::Ipv4,
                IpAddr::V6(_) => WireguardAddressFamily::Ipv6,
            };
            WireguardAllowedIp(vec![
                WireguardAllowedIpAttr::Family(family),
                WireguardAllowedIpAttr::IpAddr(net.addr()),
                WireguardAllowedIpAttr::Cidr(net.prefix_len()),
            ])
        })
        .collect()
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

/// A generic netlink socket bound to one family.
struct GenlSocket {
    socket: Socket,
    family: u16,
    sequence: u32,
}

impl GenlSocket {
    /// Opens a socket and resolves `family`'s id.
    fn open(family: &str) -> Result<Self> {
        let mut socket =
            Socket::new(NETLINK_GENERIC).context("opening a generic netlink socket")?;
        socket
            .bind_auto()
            .context("binding a generic netlink socket")?;
        socket
            .connect(&SocketAddr::new(0, 0))
            .context("connecting a generic netlink socket")?;
        let mut this = Self {
            socket,
            family: 0,
            sequence: 0,
        };
        let request = GenlMessage::from_payload(GenlCtrl {
            cmd: GenlCtrlCmd::GetFamily,
            nlas: vec![GenlCtrlAttrs::FamilyName(family.to_string())],
        });
        let answers = this.exchange(request, NLM_F_REQUEST | NLM_F_ACK)?;
        this.family = answers
            .iter()
            .flat_map(|a| &a.payload.nlas)
            .find_map(|nla| match nla {
                GenlCtrlAttrs::FamilyId(id) => Some(*id),
                _ => None,
            })
            .with_context(|| format!("no id for generic netlink family {family}"))?;
        Ok(this)
    }

    /// Sends a WireGuard request and collects the answers.
    fn request(&mut self, message: WireguardMessage, flags: u16) -> Result<Vec<WireguardMessage>> {
        let mut message = GenlMessage::from_payload(message);
        message.set_resolved_family_id(self.family);
        Ok(self
            .exchange(message, flags)?
            .into_iter()
            .map(|m| m.payload)
            .collect())
    }

    /// Sends `message` and reads answers until the kernel's acknowledgement or the end of a
    /// dump. A negative acknowledgement is the kernel's errno.
    fn exchange<F>(&mut self, message: GenlMessage<F>, flags: u16) -> Result<Vec<GenlMessage<F>>>
    where
        F: netlink_packet_generic::GenlFamily
            + netlink_packet_core::Emitable
            + netlink_packet_core::ParseableParametrized<[u8], netlink_packet_generic::GenlHeader>
            + std::fmt::Debug,
    {
        self.sequence = self.sequence.wrapping_add(1);
        let mut message = NetlinkMessage::from(message);
        message.header.flags = flags;
        message.header.sequence_number = self.sequence;
        message.finalize();
        let mut buffer = vec![0; message.buffer_len()];
        message.serialize(&mut buffer);
        self.socket
            .send(&buffer, 0)
            .context("sending a generic netlink request")?;
        let mut answers = Vec::new();
        loop {
            let (bytes, _) = self
                .socket
                .recv_from_full()
                .context("reading a generic netlink answer")?;
            let mut offset = 0;
            while offset < bytes.len() {
                let answer = NetlinkMessage::<GenlMessage<F>>::deserialize(&bytes[offset..])
                    .context("parsing a generic netlink answer")?;
                let length = answer.header.length as usize;
                if length == 0 {
                    bail!("a generic netlink answer of length 0");
                }
                offset += (length + 3) & !3;
                if answer.header.sequence_number != self.sequence {
                    continue;
                }
                match answer.payload {
                    NetlinkPayload::InnerMessage(inner) => answers.push(inner),
                    NetlinkPayload::Done(_) => return Ok(answers),
                    NetlinkPayload::Error(e) => match e.code {
                        None => return Ok(answers),
                        Some(_) => return Err(e.to_io().into()),
                    },
                    _ => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
