//! Counters: packets dropped by reason, and per-peer statistics.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use parking_lot::Mutex;

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
    /// Wall-clock time of the last completed handshake: a response received to this end's
    /// initiation, or the first data after this end answered one (as the kernel counts).
    pub last_handshake: Option<SystemTime>,
    /// Since when data or handshake initiations sent to this peer have had no answer: the
    /// oldest one sent after the last authenticated message from it. `None` while nothing
    /// awaits one (an idle link, or one whose packets come back). Keepalives do not count.
    pub unanswered_since: Option<SystemTime>,
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
    /// Responses from this peer to our initiations whose key confirmation failed, in a row
    /// (reset by data from it or a response that verifies): the peer answered under another
    /// preshared key. Loss cannot cause it; a forged response can.
    pub refused_responses: u32,
    /// Initiations from this peer that came again while our answer to the last one had not
    /// been followed by any data, in a row (reset by data from it or a response that
    /// verifies): what differing preshared keys look like from the answering end, and also
    /// what lost answers look like.
    pub unused_answers: u32,
}

impl PeerStats {
    /// A peer that nothing has been heard from or sent to yet: no endpoint, no handshake, every
    /// counter at 0.
    pub fn new(public_key: PublicKey) -> Self {
        Self {
            public_key,
            endpoint: None,
            last_handshake: None,
            unanswered_since: None,
            rx_bytes: 0,
            tx_bytes: 0,
            handshakes: 0,
            handshake_failures: 0,
            endpoint_changes: 0,
            refused_responses: 0,
            unused_answers: 0,
        }
    }
}

/// A handshake message this device refused: why, where it came from and, when the sender was
/// not a configured peer, the public key it claimed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RejectedHandshake {
    /// [`DropReason::InvalidMac`], [`DropReason::UnknownPeer`] or [`DropReason::HandshakeFailed`].
    pub reason: DropReason,
    /// The datagram's source.
    pub from: SocketAddr,
    /// The sender's static public key, when it could be decrypted (unknown peers).
    pub public_key: Option<PublicKey>,
    /// When the last such message arrived.
    pub at: SystemTime,
}

/// How many distinct (reason, source address) pairs [`RejectedHandshakes`] remembers.
pub const REJECTED_HANDSHAKES_KEPT: usize = 16;

/// The last refused handshake per reason and source address, a few of them: enough to name
/// which endpoint holds a wrong key, without a per-packet log. Recording never waits: a
/// contended lock skips the record (the counters still count every drop).
#[derive(Debug, Default)]
pub struct RejectedHandshakes {
    last: Mutex<Vec<RejectedHandshake>>,
}

impl RejectedHandshakes {
    /// Remembers `rejected`, replacing the entry of the same reason and source address; the
    /// oldest entry goes when [`REJECTED_HANDSHAKES_KEPT`] are held.
    pub fn record(&self, rejected: RejectedHandshake) {
        let Some(mut last) = self.last.try_lock() else {
            return;
        };
        let same = |r: &RejectedHandshake| -> (DropReason, IpAddr) { (r.reason, r.from.ip()) };
        if let Some(slot) = last.iter_mut().find(|r| same(r) == same(&rejected)) {
            *slot = rejected;
            return;
        }
        if last.len() == REJECTED_HANDSHAKES_KEPT {
            if let Some(oldest) = last
                .iter()
                .enumerate()
                .min_by_key(|(_, r)| r.at)
                .map(|(i, _)| i)
            {
                last.remove(oldest);
            }
        }
        last.push(rejected);
    }

    /// What is remembered, oldest first.
    pub fn snapshot(&self) -> Vec<RejectedHandshake> {
        let mut out = self.last.lock().clone();
        out.sort_by_key(|r| r.at);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn rejected(reason: DropReason, from: &str, secs: u64) -> RejectedHandshake {
        RejectedHandshake {
            reason,
            from: from.parse().unwrap(),
            public_key: None,
            at: SystemTime::UNIX_EPOCH + Duration::from_secs(secs),
        }
    }

    #[test]
    fn one_entry_per_reason_and_source_address() {
        let log = RejectedHandshakes::default();
        log.record(rejected(DropReason::InvalidMac, "192.0.2.1:51820", 1));
        log.record(rejected(DropReason::InvalidMac, "192.0.2.1:40000", 2));
        log.record(rejected(DropReason::UnknownPeer, "192.0.2.1:51820", 3));
        let got = log.snapshot();
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[0].from,
            "192.0.2.1:40000".parse().unwrap(),
            "replaced, not added"
        );
        assert_eq!(got[1].reason, DropReason::UnknownPeer);
    }

    #[test]
    fn the_oldest_goes_when_full() {
        let log = RejectedHandshakes::default();
        for i in 0..=REJECTED_HANDSHAKES_KEPT as u64 {
            log.record(rejected(
                DropReason::InvalidMac,
                &format!("192.0.2.{}:1", i + 1),
                100 + i,
            ));
        }
        let got = log.snapshot();
        assert_eq!(got.len(), REJECTED_HANDSHAKES_KEPT);
        assert!(got.iter().all(|r| r.from.ip().to_string() != "192.0.2.1"));
    }
}
