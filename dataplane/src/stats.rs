//! Counters: packets dropped by reason, and per-peer statistics.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use crate::key::PublicKey;

/// Why a packet was dropped. Counted, never logged per packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum DropReason {
    /// A packet from the TUN device was not IPv4 or IPv6, or too short for its header.
    NotIp,
    /// No peer's allowed IPs contain the packet's destination.
    NoRoute,
    /// The destination peer has no endpoint to send to.
    NoEndpoint,
    /// The device has no private key yet.
    NoPrivateKey,
    /// A datagram that is not a WireGuard message of a known type and size.
    Malformed,
    /// A handshake initiation or response with a bad MAC1 (or MAC2 while under load).
    InvalidMac,
    /// A handshake initiation from a public key that is not a configured peer.
    UnknownPeer,
    /// A message whose receiver index matches no peer.
    UnknownIndex,
    /// A handshake that failed to decrypt or verify.
    HandshakeFailed,
    /// A data packet that failed to decrypt (bad tag, no session, expired session).
    DecryptFailed,
    /// A replayed or too-old data packet.
    Replay,
    /// A decrypted packet whose source address is not in the sending peer's allowed IPs.
    SourceNotAllowed,
    /// A decrypted packet that is not a well-formed IP packet.
    InvalidInnerPacket,
    /// A handshake answered with a cookie reply instead, because the device is under load.
    CookieReplySent,
    /// Another error reported by the noise layer.
    Other,
}

impl DropReason {
    /// Every reason, in counter order.
    pub const ALL: [Self; 15] = [
        Self::NotIp,
        Self::NoRoute,
        Self::NoEndpoint,
        Self::NoPrivateKey,
        Self::Malformed,
        Self::InvalidMac,
        Self::UnknownPeer,
        Self::UnknownIndex,
        Self::HandshakeFailed,
        Self::DecryptFailed,
        Self::Replay,
        Self::SourceNotAllowed,
        Self::InvalidInnerPacket,
        Self::CookieReplySent,
        Self::Other,
    ];

    /// A stable snake_case name, for logs and metrics labels.
    pub const fn name(self) -> &'static str {
        match self {
            Self::NotIp => "not_ip",
            Self::NoRoute => "no_route",
            Self::NoEndpoint => "no_endpoint",
            Self::NoPrivateKey => "no_private_key",
            Self::Malformed => "malformed",
            Self::InvalidMac => "invalid_mac",
            Self::UnknownPeer => "unknown_peer",
            Self::UnknownIndex => "unknown_index",
            Self::HandshakeFailed => "handshake_failed",
            Self::DecryptFailed => "decrypt_failed",
            Self::Replay => "replay",
            Self::SourceNotAllowed => "source_not_allowed",
            Self::InvalidInnerPacket => "invalid_inner_packet",
            Self::CookieReplySent => "cookie_reply_sent",
            Self::Other => "other",
        }
    }

    const fn slot(self) -> usize {
        self as usize
    }
}

/// Lock-free counters of dropped packets, one per [`DropReason`].
#[derive(Debug, Default)]
pub struct DropCounters {
    counts: [AtomicU64; DropReason::ALL.len()],
}

impl DropCounters {
    /// Counts one drop.
    #[inline]
    pub fn count(&self, reason: DropReason) {
        self.counts[reason.slot()].fetch_add(1, Ordering::Relaxed);
    }

    /// The count for `reason`.
    pub fn get(&self, reason: DropReason) -> u64 {
        self.counts[reason.slot()].load(Ordering::Relaxed)
    }

    /// Every reason with its count, in [`DropReason::ALL`] order.
    pub fn snapshot(&self) -> Vec<(DropReason, u64)> {
        DropReason::ALL.iter().map(|r| (*r, self.get(*r))).collect()
    }
}

/// A peer's live state, as `wg show` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerStats {
    /// The peer's public key.
    pub public_key: PublicKey,
    /// The endpoint in use now: configured, or learned from the last authenticated packet.
    pub endpoint: Option<SocketAddr>,
    /// Wall-clock time of the last completed handshake.
    pub last_handshake: Option<SystemTime>,
    /// Bytes received from this peer (whole WireGuard messages, as the kernel counts).
    pub rx_bytes: u64,
    /// Bytes sent to this peer (whole WireGuard messages).
    pub tx_bytes: u64,
    /// Handshakes completed with this peer.
    pub handshakes: u64,
    /// Handshakes that failed: initiations that went unanswered until the next attempt, and
    /// handshake messages from this peer that did not verify.
    pub handshake_failures: u64,
    /// Times the endpoint in use moved from one address to another.
    pub endpoint_changes: u64,
}
