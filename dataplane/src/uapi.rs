//! The cross-platform userspace API (UAPI) text protocol that `wg` speaks, without I/O.
//!
//! [`apply_set`] turns the body of a `set=1` request into the next [`DeviceConfig`], validating
//! the whole request first: an invalid request changes nothing. [`format_get`] renders the
//! answer to `get=1` with every field wireguard-go returns, in the same order. Errors carry the
//! negative errno wireguard-go answers with (`errno=-22` for invalid input).

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::UNIX_EPOCH;

use ipnet::IpNet;

use crate::config::{unique_prefixes, DeviceConfig, PeerConfig};
use crate::key::{PublicKey, SecretKey};
use crate::stats::PeerStats;

mod draft;

use draft::Draft;

/// `EINVAL`, for malformed or invalid input.
pub const EINVAL: i32 = 22;
/// `EADDRINUSE`, for a listen port another socket holds.
pub const EADDRINUSE: i32 = 98;
/// `EPROTO`, for a request that is not `get=1` or `set=1`.
pub const EPROTO: i32 = 71;
/// `EIO`, for a failure applying a valid request.
pub const EIO: i32 = 5;

/// Most bytes one request may carry: a million peers' worth of lines is far more than anyone
/// configures, and the bound keeps a client from exhausting memory.
pub const MAX_REQUEST_BYTES: usize = 64 << 20;

/// Why a request failed; answered as `errno=-N`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct UapiError {
    /// The positive errno.
    pub errno: i32,
    /// What was wrong and where (line number, key, value), never a secret.
    pub message: String,
}

impl UapiError {
    /// An `EINVAL` error with `message`.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self {
            errno: EINVAL,
            message: message.into(),
        }
    }
}

/// The next configuration after `body`, the lines of a `set=1` request (without the `set=1`
/// line and the final empty line), is applied to `current`.
///
/// # Errors
/// [`UapiError`] with `EINVAL` naming the line for any malformed line, unknown key or bad value.
pub fn apply_set(current: &DeviceConfig, body: &str) -> Result<DeviceConfig, UapiError> {
    let mut next = Draft::new(current);
    let mut own_public = next
        .interface
        .private_key
        .as_ref()
        .map(SecretKey::public_key);
    let mut peer: Option<PeerCursor> = None;

    for (number, line) in body.lines().enumerate() {
        let number = number + 2; // line 1 is `set=1`
        if line.is_empty() {
            break;
        }
        let (key, value) = line
            .split_once('=')
            .ok_or_else(|| UapiError::invalid(format!("line {number}: expected key=value")))?;
        let at = |what: &str| UapiError::invalid(format!("line {number}: {what}"));
        if key == "public_key" {
            let public_key =
                PublicKey::from_hex(value).map_err(|e| at(&format!("public_key: {e}")))?;
            peer = Some(PeerCursor::open(&mut next, public_key, own_public));
            continue;
        }
        match peer.as_mut() {
            None => {
                set_interface_key(&mut next, &mut own_public, key, value).map_err(|e| at(&e))?
            }
            Some(cursor) => cursor.set(&mut next, key, value).map_err(|e| at(&e))?,
        }
    }
    Ok(next.finish())
}

fn set_interface_key(
    next: &mut Draft,
    own_public: &mut Option<PublicKey>,
    key: &str,
    value: &str,
) -> Result<(), String> {
    match key {
        "private_key" => {
            let secret = SecretKey::from_hex(value).map_err(|e| format!("private_key: {e}"))?;
            if secret.is_zero() {
                next.interface.private_key = None;
                *own_public = None;
            } else {
                let public = secret.public_key();
                // wireguard-go drops a peer whose key is now our own.
                next.remove(&public);
                *own_public = Some(public);
                next.interface.private_key = Some(secret);
            }
        }
        "listen_port" => {
            next.interface.listen_port = value
                .parse()
                .map_err(|_| format!("listen_port: {value:?} is not a port (0-65535)"))?;
        }
        "fwmark" => {
            next.interface.fwmark = value
                .parse()
                .map_err(|_| format!("fwmark: {value:?} is not a 32-bit number"))?;
        }
        "replace_peers" => {
            expect_true(key, value)?;
            next.clear_peers();
        }
        _ => return Err(format!("unknown interface key {key:?}")),
    }
    Ok(())
}

fn expect_true(key: &str, value: &str) -> Result<(), String> {
    if value == "true" {
        Ok(())
    } else {
        Err(format!("{key}: only \"true\" is accepted, got {value:?}"))
    }
}

/// The peer that the lines after a `public_key=` line change.
struct PeerCursor {
    key: PublicKey,
    /// Where the peer is in the draft; `None` when the lines are to be ignored: the device's
    /// own key, or `update_only` for a peer that does not exist.
    at: Option<usize>,
    /// True when this request created the peer (so `update_only` removes it again).
    created: bool,
}

impl PeerCursor {
    fn open(next: &mut Draft, key: PublicKey, own_public: Option<PublicKey>) -> Self {
        if Some(key) == own_public {
            return Self {
                key,
                at: None,
                created: false,
            };
        }
        let (at, created) = match next.position(&key) {
            Some(at) => (at, false),
            None => (next.push(PeerConfig::new(key)), true),
        };
        Self {
            key,
            at: Some(at),
            created,
        }
    }

    fn set(&mut self, next: &mut Draft, key: &str, value: &str) -> Result<(), String> {
        // Validate every line, even ignored ones, so a bad request is refused whole.
        let change = PeerChange::parse(key, value)?;
        let Some(at) = self.at else {
            return Ok(());
        };
        match change {
            PeerChange::UpdateOnly => {
                if self.created {
                    next.remove(&self.key);
                    self.at = None;
                }
                return Ok(());
            }
            PeerChange::Remove => {
                next.remove(&self.key);
                self.at = None;
                return Ok(());
            }
            _ => {}
        }
        let Some(peer) = next.peer_mut(at) else {
            return Ok(());
        };
        match change {
            PeerChange::PresharedKey(psk) => peer.config.preshared_key = psk,
            PeerChange::Endpoint(addr) => peer.config.endpoint = Some(addr),
            PeerChange::Keepalive(seconds) => peer.config.persistent_keepalive = seconds,
            PeerChange::ReplaceAllowedIps => peer.clear_allowed_ips(),
            PeerChange::AddAllowedIp(net) => {
                peer.allowed_ips().insert(net);
            }
            PeerChange::RemoveAllowedIp(net) => {
                peer.allowed_ips().remove(net);
            }
            PeerChange::ProtocolVersion | PeerChange::UpdateOnly | PeerChange::Remove => {}
        }
        Ok(())
    }
}

/// One parsed peer line.
enum PeerChange {
    UpdateOnly,
    Remove,
    PresharedKey(Option<SecretKey>),
    Endpoint(SocketAddr),
    Keepalive(u16),
    ReplaceAllowedIps,
    AddAllowedIp(IpNet),
    RemoveAllowedIp(IpNet),
    ProtocolVersion,
}

impl PeerChange {
    fn parse(key: &str, value: &str) -> Result<Self, String> {
        Ok(match key {
            "update_only" => {
                expect_true(key, value)?;
                Self::UpdateOnly
            }
            "remove" => {
                expect_true(key, value)?;
                Self::Remove
            }
            "preshared_key" => {
                let psk = SecretKey::from_hex(value).map_err(|e| format!("preshared_key: {e}"))?;
                Self::PresharedKey((!psk.is_zero()).then_some(psk))
            }
            "endpoint" => Self::Endpoint(value.parse().map_err(|_| {
                format!("endpoint: {value:?} is not an IP:port ([IPv6]:port for IPv6)")
            })?),
            "persistent_keepalive_interval" => Self::Keepalive(value.parse().map_err(|_| {
                format!("persistent_keepalive_interval: {value:?} is not 0-65535 seconds")
            })?),
            "replace_allowed_ips" => {
                expect_true(key, value)?;
                Self::ReplaceAllowedIps
            }
            "allowed_ip" => match value.strip_prefix('-') {
                Some(removed) => Self::RemoveAllowedIp(parse_prefix(removed)?),
                None => Self::AddAllowedIp(parse_prefix(value)?),
            },
            "protocol_version" => {
                if value != "1" {
                    return Err(format!(
                        "protocol_version: only 1 is supported, got {value:?}"
                    ));
                }
                Self::ProtocolVersion
            }
            _ => return Err(format!("unknown peer key {key:?}")),
        })
    }
}

fn parse_prefix(value: &str) -> Result<IpNet, String> {
    value
        .parse::<IpNet>()
        .map_err(|_| format!("allowed_ip: {value:?} is not an IP prefix such as 10.0.0.0/24"))
}

/// The answer to `get=1` (without the final `errno=0` and empty line).
pub fn format_get(config: &DeviceConfig, listen_port: u16, stats: &[PeerStats]) -> String {
    let mut out = String::with_capacity(256 + stats.len() * 256);
    let live_by_key: std::collections::HashMap<PublicKey, &PeerStats> =
        stats.iter().rev().map(|s| (s.public_key, s)).collect();
    if let Some(key) = &config.interface.private_key {
        let _ = writeln!(out, "private_key={}", key.expose_hex().as_str());
    }
    if listen_port != 0 {
        let _ = writeln!(out, "listen_port={listen_port}");
    }
    if config.interface.fwmark != 0 {
        let _ = writeln!(out, "fwmark={}", config.interface.fwmark);
    }
    for peer in &config.peers {
        let live = live_by_key.get(&peer.public_key).copied();
        let _ = writeln!(out, "public_key={}", peer.public_key.to_hex());
        match &peer.preshared_key {
            Some(psk) => {
                let _ = writeln!(out, "preshared_key={}", psk.expose_hex().as_str());
            }
            None => {
                let _ = writeln!(out, "preshared_key={}", "0".repeat(64));
            }
        }
        out.push_str("protocol_version=1\n");
        if let Some(endpoint) = live.and_then(|s| s.endpoint).or(peer.endpoint) {
            let _ = writeln!(out, "endpoint={endpoint}");
        }
        let since_epoch = live
            .and_then(|s| s.last_handshake)
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .unwrap_or_default();
        let _ = writeln!(out, "last_handshake_time_sec={}", since_epoch.as_secs());
        let _ = writeln!(
            out,
            "last_handshake_time_nsec={}",
            since_epoch.subsec_nanos()
        );
        let _ = writeln!(out, "tx_bytes={}", live.map_or(0, |s| s.tx_bytes));
        let _ = writeln!(out, "rx_bytes={}", live.map_or(0, |s| s.rx_bytes));
        let _ = writeln!(
            out,
            "persistent_keepalive_interval={}",
            peer.persistent_keepalive
        );
        for prefix in &peer.allowed_ips {
            let _ = writeln!(out, "allowed_ip={prefix}");
        }
    }
    out
}

/// Reads a `get=1` answer back into the configuration and per-peer state it describes, as a
/// client of another device's socket would (wireguard-go or kilotun).
///
/// # Errors
/// [`UapiError`] for a malformed answer or a non-zero `errno`.
pub fn parse_get(answer: &str) -> Result<(DeviceConfig, Vec<PeerStats>), UapiError> {
    let mut config = DeviceConfig::default();
    let mut stats: Vec<PeerStats> = Vec::new();
    for (number, line) in answer.lines().enumerate() {
        if line.is_empty() {
            break;
        }
        let (key, value) = line.split_once('=').ok_or_else(|| {
            UapiError::invalid(format!("line {}: expected key=value", number + 1))
        })?;
        let bad = || UapiError::invalid(format!("line {}: bad value for {key}", number + 1));
        match (key, config.peers.last_mut(), stats.last_mut()) {
            ("errno", _, _) => {
                let errno: i32 = value.parse().map_err(|_| bad())?;
                if errno != 0 {
                    return Err(UapiError {
                        errno: errno.abs(),
                        message: format!("device answered errno={errno}"),
                    });
                }
            }
            ("private_key", _, _) => {
                config.interface.private_key = Some(SecretKey::from_hex(value).map_err(|_| bad())?);
            }
            ("listen_port", _, _) => {
                config.interface.listen_port = value.parse().map_err(|_| bad())?
            }
            ("fwmark", _, _) => config.interface.fwmark = value.parse().map_err(|_| bad())?,
            ("public_key", _, _) => {
                let key = PublicKey::from_hex(value).map_err(|_| bad())?;
                config.peers.push(PeerConfig::new(key));
                stats.push(PeerStats::new(key));
            }
            (_, Some(peer), Some(live)) => match key {
                "preshared_key" => {
                    let psk = SecretKey::from_hex(value).map_err(|_| bad())?;
                    peer.preshared_key = (!psk.is_zero()).then_some(psk);
                }
                "protocol_version" => {}
                "endpoint" => {
                    let addr: SocketAddr = value.parse().map_err(|_| bad())?;
                    peer.endpoint = Some(addr);
                    live.endpoint = Some(addr);
                }
                "last_handshake_time_sec" => {
                    let secs: u64 = value.parse().map_err(|_| bad())?;
                    live.last_handshake = match secs {
                        0 => None,
                        _ => Some(
                            UNIX_EPOCH
                                .checked_add(std::time::Duration::from_secs(secs))
                                .ok_or_else(bad)?,
                        ),
                    };
                }
                "last_handshake_time_nsec" => {
                    let nanos: u64 = value.parse().map_err(|_| bad())?;
                    if let Some(t) = live.last_handshake.as_mut() {
                        *t = t
                            .checked_add(std::time::Duration::from_nanos(nanos))
                            .ok_or_else(bad)?;
                    }
                }
                "tx_bytes" => live.tx_bytes = value.parse().map_err(|_| bad())?,
                "rx_bytes" => live.rx_bytes = value.parse().map_err(|_| bad())?,
                "persistent_keepalive_interval" => {
                    peer.persistent_keepalive = value.parse().map_err(|_| bad())?;
                }
                // Made unique once the whole answer is read.
                "allowed_ip" => peer
                    .allowed_ips
                    .push(value.parse::<IpNet>().map_err(|_| bad())?.trunc()),
                _ => return Err(UapiError::invalid(format!("unknown key {key:?}"))),
            },
            _ => return Err(UapiError::invalid(format!("unknown key {key:?}"))),
        }
    }
    for peer in &mut config.peers {
        peer.allowed_ips = unique_prefixes(&peer.allowed_ips);
    }
    Ok((config, stats))
}

#[cfg(test)]
mod tests;
