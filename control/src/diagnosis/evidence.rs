//! The evidence about one link of a node: why its handshakes never complete (keys this node
//! refused, or silence), and whether traffic sent over it goes unanswered.

use std::net::IpAddr;

use super::{Finding, Severity, STALE_HANDSHAKE_SECS, UNANSWERED_SECS};
use crate::status::{NodeStatus, PeerStatus};

pub(super) fn endpoint_ip(endpoint: Option<&String>) -> Option<IpAddr> {
    endpoint?
        .parse::<std::net::SocketAddr>()
        .ok()
        .map(|e| e.ip())
}

/// Why a peer has no handshake, from what the node saw: refused handshakes from the peer's
/// addresses, or nothing received at all.
pub(super) fn handshake_evidence(
    status: &NodeStatus,
    peer: &PeerStatus,
    addresses: &[IpAddr],
    owner: &str,
) -> (String, String) {
    refusal_evidence(status, peer, addresses, owner)
        .unwrap_or_else(|| silence_evidence(status, peer))
}

/// Handshakes this node refused that came from the peer (from its addresses, or, for a peer
/// with no known address, an unknown key from an address no other peer uses): which key
/// arrived, which was announced, and what to fix. `None` when nothing points to a key.
fn refusal_evidence(
    status: &NodeStatus,
    peer: &PeerStatus,
    addresses: &[IpAddr],
    owner: &str,
) -> Option<(String, String)> {
    let from_peer = status.rejected_handshakes.iter().find(|r| {
        r.from
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|f| addresses.contains(&f.ip()))
    });
    // A peer without a known address (a Peer with no endpoint): an unknown key from an address
    // no other peer uses may be it.
    let unclaimed = || {
        status.rejected_handshakes.iter().find(|r| {
            r.reason == "unknown_peer"
                && !status.peers.iter().any(|p| {
                    endpoint_ip(p.endpoint.as_ref())
                        .or(endpoint_ip(p.configured_endpoint.as_ref()))
                        .is_some_and(|ip| {
                            r.from
                                .parse::<std::net::SocketAddr>()
                                .is_ok_and(|f| f.ip() == ip)
                        })
                })
        })
    };
    if from_peer.is_none() && addresses.is_empty() {
        if let Some(r) = unclaimed() {
            return Some((
                format!(
                    "handshakes arrive from {} with the public key {}, which no node or Peer announces; if that is {owner}, the key it announces ({}) is wrong",
                    r.from,
                    r.public_key.as_deref().unwrap_or("?"),
                    peer.public_key
                ),
                "fix the announced key (a Peer's spec.publicKey), or the device's private key".into(),
            ));
        }
    }
    let r = from_peer?;
    Some(match r.reason.as_str() {
        "unknown_peer" => (
            format!(
                "handshakes arrive from {} with the public key {}, but {owner} announces {}",
                r.from,
                r.public_key.as_deref().unwrap_or("?"),
                peer.public_key
            ),
            "the announced key is stale or wrong: restart kg there so it announces its key again, or fix the Peer's spec.publicKey".into(),
        ),
        "invalid_mac" => (
            format!("handshakes from {} are made for another public key of this node", r.from),
            "the device there holds a wrong public key for this node: check its configuration (for a Peer, regenerate it with kgctl showconf)".into(),
        ),
        _ => (
            format!("handshakes from {} fail to verify", r.from),
            "the keys on the two sides do not match: compare kilo.squat.ai/key with `wg show` on each side".into(),
        ),
    })
}

/// Why a peer has no handshake when nothing it sent was refused: silence (UDP blocked, or kg
/// not running there), or packets that arrived without a handshake completing.
fn silence_evidence(status: &NodeStatus, peer: &PeerStatus) -> (String, String) {
    if peer.rx_bytes == 0 {
        (
            if peer.handshake_failures > 0 {
                format!(
                    "nothing has arrived from it at all ({} handshake attempts unanswered)",
                    peer.handshake_failures
                )
            } else {
                "nothing has arrived from it at all".to_string()
            },
            format!(
                "UDP port {} is blocked between the two, in one direction or both (firewall, security group), or kg does not run there: allow UDP {} to and from {}",
                status.port,
                status.port,
                endpoint_shown(peer).unwrap_or("its endpoint")
            ),
        )
    } else {
        (
            format!(
                "{} bytes arrived, yet no handshake completed ({} failures)",
                peer.rx_bytes, peer.handshake_failures
            ),
            "run kgctl diagnose on the other side: its drops tell whether it refuses this node's key".into(),
        )
    }
}

/// The finding about one peer of a device that reports unanswered traffic (the embedded
/// engine): a problem once what this node sends has gone [`UNANSWERED_SECS`] without an answer,
/// naming a refused key when the peer's handshakes were refused here, else the UDP path; an
/// idle link with an old handshake is no problem (WireGuard makes no handshake on a link that
/// carries nothing), only said.
pub(super) fn answer_finding(
    status: &NodeStatus,
    peer: &PeerStatus,
    subject: &str,
    addresses: &[IpAddr],
    owner: &str,
    now_unix: i64,
) -> Option<Finding> {
    let refused = refusal_evidence(status, peer, addresses, owner);
    let age = peer.last_handshake_unix.map(|t| now_unix - t);
    let fresh = age.is_some_and(|age| age <= STALE_HANDSHAKE_SECS);
    let unanswered = peer
        .unanswered_since_unix
        .map(|t| now_unix - t)
        .filter(|secs| *secs >= UNANSWERED_SECS);
    let endpoint = endpoint_shown(peer).unwrap_or("its endpoint");
    match (unanswered, refused) {
        (Some(secs), refused) => {
            let tries = match peer.handshake_failures {
                0 => String::new(),
                n => format!("; {n} handshake attempts in all went unanswered"),
            };
            let (evidence, advice) = if let Some(refused) = refused {
                refused
            } else {
                (
                    format!(
                        "nothing has come back from {endpoint} since: a firewall, security group or NAT between the two is likely dropping WireGuard's UDP (port {} there, {} here), in one direction or both",
                        endpoint_port(endpoint).map_or_else(|| "?".to_string(), |p| p.to_string()),
                        status.port
                    ),
                    format!(
                        "allow UDP to {endpoint} and from it to port {} of this node; kgctl diagnose {} tells whether this node's packets arrive there",
                        status.port,
                        if peer.leader.is_empty() { owner.to_string() } else { peer.leader.clone() }
                    ),
                )
            };
            Some(Finding::new(
                Severity::Problem,
                "unanswered",
                subject,
                format!("traffic sent to {owner} for {secs} s has had no answer ({}{tries}): {evidence}", match age {
                    None => "no handshake has ever completed".to_string(),
                    Some(age) => format!("last handshake {age} s ago"),
                }),
                advice,
            ))
        }
        (None, _) if fresh => None,
        (None, Some((evidence, advice))) => Some(Finding::new(
            Severity::Problem,
            "handshake",
            subject,
            format!("{}: {evidence}", last_handshake(age)),
            advice,
        )),
        (None, None) => Some(Finding::new(
            Severity::Info,
            "handshake",
            subject,
            format!(
                "idle: {}, and nothing sent to it awaits an answer (WireGuard makes no handshake on a link that carries no traffic)",
                match age {
                    None => "no handshake yet".to_string(),
                    Some(age) => format!("the last handshake was {age} s ago"),
                }
            ),
            "",
        )),
    }
}

/// When the last handshake was, for a finding, from its age in seconds.
pub(super) fn last_handshake(age: Option<i64>) -> String {
    match age {
        None => "no handshake has ever completed".to_string(),
        Some(age) => format!("the last handshake was {age} s ago"),
    }
}

/// The endpoint a peer's packets go to: the one in use, else the one kg configured.
pub(super) fn endpoint_shown(peer: &PeerStatus) -> Option<&str> {
    peer.endpoint
        .as_deref()
        .or(peer.configured_endpoint.as_deref())
}

/// The port of `host:port` (`[v6]:port` too).
fn endpoint_port(endpoint: &str) -> Option<u16> {
    endpoint.rsplit_once(':')?.1.parse().ok()
}
