//! What kg reports about its own node at `/status`, as plain values: the node's place in the
//! mesh, each WireGuard peer's live state, the engine's drops and refused handshakes, what the
//! kernel and iptables lack against what kg installs, and (when asked) the result of probing
//! the paths to its peers. `kgctl diagnose` reads it and judges it (see `crate::diagnosis`).

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// How many recent events `/status` keeps.
pub const EVENTS_KEPT: usize = 64;

/// One node as its kg sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeStatus {
    /// The node's name.
    pub node: String,
    /// Its segment key (`location:<name>`; for a share of a location with several leaders
    /// `location:<name>#share:<n>`, or `location:<name>#<leader>` without leases; or
    /// `node:<name>`); empty while it is not ready.
    pub location: String,
    /// True when it leads its segment.
    pub leader: bool,
    /// `--mesh-granularity`.
    pub granularity: String,
    /// The WireGuard interface.
    pub interface: String,
    /// The WireGuard kg drives: `embedded`, `kernel` or `uapi` (empty from a kg before it).
    #[serde(default)]
    pub wireguard: String,
    /// The WireGuard interface's MTU.
    pub mtu: u32,
    /// The WireGuard listen port.
    pub port: u16,
    /// `--encapsulate` as in effect (`never` when the tunnel link is missing).
    pub encapsulate: String,
    /// The IPIP link inside the location, when there is one.
    pub tunnel: Option<String>,
    /// The WireGuard peers, in configuration order.
    pub peers: Vec<PeerStatus>,
    /// Packets the engine dropped, by reason (empty for a device driven over UAPI).
    pub drops: BTreeMap<String, u64>,
    /// True when the device reports [`PeerStatus::unanswered_since_unix`] (the embedded engine;
    /// a device driven over UAPI, or a kg from before it, does not).
    #[serde(default)]
    pub tracks_answers: bool,
    /// The last handshakes the engine refused.
    pub rejected_handshakes: Vec<RejectedHandshakeStatus>,
    /// Routes, rules and iptables rules kg installs that the host lacks (or has wrong), one line
    /// each; `None` when they could not be listed.
    pub drift: Option<Vec<String>>,
    /// Why the last check of the host failed, when it did.
    pub drift_error: Option<String>,
    /// CIDRs not routed on this node because they cover one of its connected networks.
    pub withheld: Vec<String>,
    /// Errors of recent reconciles, oldest first (a few).
    pub errors: Vec<String>,
    /// What the agent recently noticed and decided, oldest first (the last
    /// [`EVENTS_KEPT`]; empty from a kg before it).
    #[serde(default)]
    pub events: Vec<crate::journal::Event>,
    /// Path probes, when asked for (`/status?probe=true`).
    pub probes: Option<Probes>,
}

/// What the peer of a WireGuard configuration stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PeerKind {
    /// A segment of the mesh (a location, or one node in full granularity), through its leader.
    Segment,
    /// A Peer object.
    Peer,
}

/// One WireGuard peer's configuration and live state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerStatus {
    /// A segment or a Peer object.
    pub kind: PeerKind,
    /// The segment key or the Peer's name.
    pub name: String,
    /// The node that leads the segment (empty for Peers).
    pub leader: String,
    /// The peer's public key (base64).
    pub public_key: String,
    /// The endpoint kg configured (announced, or discovered behind NAT).
    pub configured_endpoint: Option<String>,
    /// The endpoint in use now: learned from the last authenticated packet.
    pub endpoint: Option<String>,
    /// The keepalive interval kg configured, in seconds (0: off).
    pub persistent_keepalive: u16,
    /// Unix time of the last completed handshake.
    pub last_handshake_unix: Option<i64>,
    /// Unix time of the oldest data packet or handshake initiation sent to it that nothing has
    /// answered yet (no authenticated message from it since); `None` while nothing awaits an
    /// answer. Keepalives do not count.
    #[serde(default)]
    pub unanswered_since_unix: Option<i64>,
    /// Handshakes completed.
    pub handshakes: u64,
    /// Handshakes that failed (unanswered or refused).
    pub handshake_failures: u64,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Responses to this node's initiations whose key confirmation failed, in a row: the peer
    /// answered under another preshared key (`dataplane::PeerStats::refused_responses`); 0 on
    /// a working link and on a device that does not count them.
    #[serde(default)]
    pub refused_responses: u32,
    /// The peer's initiations repeated while this node's answer went unused, in a row: another
    /// preshared key at the peer, or lost answers (`dataplane::PeerStats::unused_answers`).
    #[serde(default)]
    pub unused_answers: u32,
    /// The link's post-quantum preshared key, when this node runs with `--post-quantum`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub post_quantum: Option<PqLinkStatus>,
    /// The endpoint candidates of a leader that publishes them (`kilotun.io/endpoints`):
    /// which is in use and why the others are not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidates: Option<CandidatesStatus>,
}

/// A peer's endpoint candidates, as kg reports them at `/status` (see `crate::endpoints`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct CandidatesStatus {
    /// The candidate in use (`None`: every one refused, Kilo's endpoint is used).
    pub in_use: Option<String>,
    /// `only` (one usable candidate), `probing` (no handshake on it yet) or `working`.
    pub state: String,
    /// The candidates kg tries, in order.
    pub usable: Vec<String>,
    /// The candidates kg does not try, with why.
    pub refused: Vec<CandidateNote>,
    /// The latest candidates kg left, with why and when, oldest first.
    pub left: Vec<CandidateNote>,
}

/// One candidate and what kg says of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CandidateNote {
    /// The candidate.
    pub endpoint: String,
    /// Why it is refused, or was left.
    pub why: String,
    /// When it was left (Unix time; `None` for a refusal).
    #[serde(default)]
    pub at_unix: Option<i64>,
}

impl From<&crate::endpoints::ProbeStatus> for CandidatesStatus {
    fn from(p: &crate::endpoints::ProbeStatus) -> Self {
        Self {
            in_use: p.in_use.map(|a| a.to_string()),
            state: p.state.as_str().to_string(),
            usable: p.usable.iter().map(ToString::to_string).collect(),
            refused: p
                .refused
                .iter()
                .map(|r| CandidateNote {
                    endpoint: r.endpoint.to_string(),
                    why: r.why.clone(),
                    at_unix: None,
                })
                .collect(),
            left: p
                .left
                .iter()
                .map(|l| CandidateNote {
                    endpoint: l.endpoint.to_string(),
                    why: l.why.clone(),
                    at_unix: Some(l.at_ms.div_euclid(1000)),
                })
                .collect(),
        }
    }
}

/// Where a link's post-quantum preshared key stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PqState {
    /// This end holds a key from an exchange (or saved from one).
    Keyed,
    /// No key: the exchange has not completed (`detail` says why).
    Exchanging,
    /// The link dropped its key because handshakes failed under it, and no exchange has
    /// failed since.
    FellBack,
    /// The other end takes no part: the link runs without a preshared key from kg.
    Off,
}

/// One link's post-quantum preshared key, as kg reports it at `/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PqLinkStatus {
    /// Where it stands.
    pub state: PqState,
    /// Why it stands so, in words (empty when keyed).
    #[serde(default)]
    pub detail: String,
    /// The epoch of the key in use.
    #[serde(default)]
    pub epoch: Option<u64>,
    /// When the link's preshared key last changed (installed or dropped), Unix time.
    #[serde(default)]
    pub psk_changed_unix: Option<i64>,
    /// When the link last dropped its key because handshakes failed under it, Unix time.
    #[serde(default)]
    pub fell_back_unix: Option<i64>,
    /// True when both ends drop a key that handshakes fail under (the peer announces it, and
    /// this node's device counts failed handshakes).
    #[serde(default)]
    pub falls_back: bool,
    /// Exchange messages refused, by reason.
    #[serde(default)]
    pub refused: BTreeMap<String, u64>,
    /// The last refusal's reason and Unix time.
    #[serde(default)]
    pub last_refused: Option<(String, i64)>,
}

/// A refused handshake (see `dataplane::RejectedHandshake`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RejectedHandshakeStatus {
    /// `invalid_mac`, `unknown_peer` or `handshake_failed`.
    pub reason: String,
    /// The source address of the last one.
    pub from: String,
    /// The public key the sender claimed, for `unknown_peer`.
    pub public_key: Option<String>,
    /// Unix time of the last one.
    pub at_unix: i64,
}

/// The results of probing the paths to this node's peers.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Probes {
    /// One per WireGuard peer with an endpoint.
    pub path_mtu: Vec<MtuProbe>,
    /// One per other node of the location reached through IPIP.
    pub ipip: Vec<IpipProbe>,
}

/// Whether packets of the size WireGuard sends reach a peer's endpoint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MtuProbe {
    /// The peer's name (as in [`PeerStatus::name`]).
    pub peer: String,
    /// The endpoint's address.
    pub endpoint: IpAddr,
    /// The largest datagram WireGuard sends to it: the interface's MTU plus WireGuard's,
    /// UDP's and IP's headers.
    pub needed: u32,
    /// What the probe found.
    pub outcome: MtuOutcome,
}

/// The outcome of an [`MtuProbe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum MtuOutcome {
    /// A packet of the needed size, not to be fragmented, was answered.
    Fits,
    /// The path (a local link, or a router that said so) carries at most `path_mtu` bytes.
    Smaller {
        /// The path MTU the kernel learnt.
        path_mtu: u32,
    },
    /// Small packets are answered and packets of the needed size vanish without an ICMP
    /// "fragmentation needed": a path-MTU black hole.
    BlackHole,
    /// The endpoint does not answer ICMP echo at all: nothing can be said.
    NoAnswer,
}

/// Whether IP protocol 4 passes between this node and another of its location.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpipProbe {
    /// The other node.
    pub node: String,
    /// Its private IP (the outer destination).
    pub private_ip: IpAddr,
    /// The address probed through the tunnel (its pod CIDR's gateway).
    pub target: IpAddr,
    /// True when its private IP answered a plain ICMP echo.
    pub plain: bool,
    /// True when `target` answered through the IPIP link.
    pub encapsulated: bool,
}
