//! What the agent noticed and decided, as typed records rather than log prose.
//!
//! The agent's core records an [`Event`] where it used to write a log line: a bad annotation, a
//! range the topology dropped, a change of leader, the backend lost and found again. The driver
//! takes the records after each step ([`Journal::take`]) and does three things with each: logs
//! its message, keeps the last few for `/status` (`events`), and counts it. Tests and
//! `kgctl diagnose` read the [`Reason`], which is stable; the message is for people and may be
//! reworded. The reasons are named as Kubernetes Event reasons are (`PascalCase`), so the same
//! record can become one.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Why an event was recorded. Stable: tests, `/status` readers and Kubernetes Events name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Reason {
    /// A node's `kilo.squat.ai/*` annotation cannot be used (subject: the node).
    BadAnnotation,
    /// A Peer cannot be used (subject: the Peer).
    BadPeer,
    /// The topology left out an allowed IP (subject: the CIDR).
    RangeDropped,
    /// A remote node announces no endpoint and is reached where its handshakes come from.
    NoEndpoint,
    /// `--leaders-per-location` cannot take full effect yet (subject: this node).
    LeaderSharesLimited,
    /// This node is not ready to mesh (subject: this node).
    NotReady,
    /// The backend stopped answering; the last good mesh is kept.
    BackendUnreachable,
    /// The backend answers again.
    BackendReachable,
    /// A pass failed; it is retried with backoff.
    ReconcileFailed,
    /// `--ipam=auto` chose where pod ranges come from.
    IpamSource,
    /// A pod-range source gave something unusable (subject: `ipam`), or a node run by Kilo's
    /// kg routes other pod ranges than this kg (subject: that node).
    IpamProblem,
    /// A DNS endpoint resolved to a new address (subject: the name).
    EndpointResolved,
    /// A DNS lookup failed; the last good address is kept (subject: the name).
    EndpointLookupFailed,
    /// Every ready node takes part in leases: leaders are chosen by lease.
    LeadersByLease,
    /// A ready node takes no part in leases: leaders are chosen by Kilo's rule (subject: the
    /// first such node).
    LeadersByKiloRule,
    /// This node took the lead of a location or share (subject: the lease).
    LeaderElected,
    /// This node took the lead from a leader that others found cut off (subject: the lease).
    LeaderReplacedCutOff,
    /// This node handed its lead to another node (subject: the lease).
    LeaderHandedOver,
    /// This node released a share its location no longer has (subject: the lease).
    LeaderReleased,
    /// This leader's tunnels hear nothing; it asks its location's candidates (subject: the lease).
    LeaderCutOff,
    /// No candidate reached another location either; this leader keeps the lead.
    LeaderCutOffUnconfirmed,
    /// This leader's tunnels hear the other locations again (subject: the lease).
    LeaderReconnected,
    /// A CIDR is not routed into the mesh here: it contains one of this node's connected
    /// networks (subject: the CIDR).
    RouteWithheld,
    /// A peer's endpoint lies inside a range routed into the tunnel; a host route keeps
    /// WireGuard's packets to it on the underlay (subject: the endpoint's address).
    EndpointBypassed,
    /// A route has no gateway on this node and is not installed (subject: its destination).
    RouteWithoutGateway,
    /// The tunnel link a `--compatibility` mode routes over does not exist (yet): traffic inside
    /// the location is not encapsulated (subject: the link's name).
    TunnelMissing,
    /// A key rotation made, published or started using a key (subject: this node).
    KeyRotation,
    /// The API server refused the node condition `KiloMeshReady` (subject: this node): kg
    /// goes on meshing and tries again at the next change or heartbeat.
    ConditionRefused,
    /// kg put back the WireGuard peers its last run saved, before its first pass (subject:
    /// the interface).
    PeersRestored,
    /// kg left the WireGuard peers its last run saved unrestored, and says why (another node
    /// holds the location's lease now, the saved state is too old; subject: the interface).
    PeersNotRestored,
    /// kg started handshakes with its peers itself instead of waiting for their timers
    /// (subject: the interface).
    HandshakesStarted,
    /// Another kg ran this node's engine when kg started; kg stood by until it exited, then
    /// took the engine over (subject: the interface).
    TookOver,
    /// kg stops and another kg replaces it: the node keeps its mesh for the next one (subject:
    /// this node).
    Replaced,
    /// kg stops and nothing replaces it: it removes what it set up (subject: this node).
    Removed,
    /// The API server refused a Peer's `status` (subject: the Peer): an older CRD without the
    /// status subresource, or a ClusterRole without `peers/status`. Said once; kg goes on.
    PeerStatusRefused,
    /// The embedded engine's TUN link was lost (deleted under kg) and kg started the engine
    /// again on a new link, applying the mesh anew (subject: the interface).
    EngineRecreated,
    /// The WireGuard device refused the removal of one allowed IP (wireguard-go before
    /// 0.0.20250522, a kernel without `WGALLOWEDIP_F_REMOVE_ME`): kg replaces changed peers'
    /// allowed IPs whole from then on (subject: the interface). Said once per device.
    AllowedIpEditRefused,
    /// A tunnel of this leader to another location was sent to and answered nothing for
    /// [`crate::condition::DOWN_WINDOW_MS`] (subject: the far end's node).
    LinkDown,
    /// A tunnel judged down received something again; the message says after how long
    /// (subject: the far end's node).
    LinkUp,
    /// A link's post-quantum preshared key was dropped: handshakes failed under it, so the two
    /// ends held different keys (subject: the peer's node). The link runs without one until
    /// its next exchange.
    PostQuantumFallback,
    /// A node or Peer kg discovers behind NAT (a keepalive, or a Peer) now sends its
    /// handshakes from another address, and kg sends there (subject: the node or Peer).
    EndpointSwitched,
    /// A candidate a node publishes in `kilotun.io/endpoints` is not tried (the accept
    /// filter, a family this host lacks, no route outside the mesh), said once per candidate
    /// and reason (subject: the node).
    EndpointRefused,
    /// kg left a peer's candidate for its next one (no handshake within the probe window, or
    /// one that worked failed), subject: the node.
    EndpointCandidateLeft,
}

impl Reason {
    /// Every reason.
    pub const ALL: [Reason; 43] = [
        Self::BadAnnotation,
        Self::BadPeer,
        Self::RangeDropped,
        Self::NoEndpoint,
        Self::LeaderSharesLimited,
        Self::NotReady,
        Self::BackendUnreachable,
        Self::BackendReachable,
        Self::ReconcileFailed,
        Self::IpamSource,
        Self::IpamProblem,
        Self::EndpointResolved,
        Self::EndpointLookupFailed,
        Self::LeadersByLease,
        Self::LeadersByKiloRule,
        Self::LeaderElected,
        Self::LeaderReplacedCutOff,
        Self::LeaderHandedOver,
        Self::LeaderReleased,
        Self::LeaderCutOff,
        Self::LeaderCutOffUnconfirmed,
        Self::LeaderReconnected,
        Self::RouteWithheld,
        Self::EndpointBypassed,
        Self::RouteWithoutGateway,
        Self::TunnelMissing,
        Self::KeyRotation,
        Self::ConditionRefused,
        Self::PeersRestored,
        Self::PeersNotRestored,
        Self::HandshakesStarted,
        Self::TookOver,
        Self::Replaced,
        Self::Removed,
        Self::EngineRecreated,
        Self::PeerStatusRefused,
        Self::AllowedIpEditRefused,
        Self::LinkDown,
        Self::LinkUp,
        Self::PostQuantumFallback,
        Self::EndpointSwitched,
        Self::EndpointRefused,
        Self::EndpointCandidateLeft,
    ];

    /// Its name, as in `/status` and in a Kubernetes Event's `reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::BadAnnotation => "BadAnnotation",
            Self::BadPeer => "BadPeer",
            Self::RangeDropped => "RangeDropped",
            Self::NoEndpoint => "NoEndpoint",
            Self::LeaderSharesLimited => "LeaderSharesLimited",
            Self::NotReady => "NotReady",
            Self::BackendUnreachable => "BackendUnreachable",
            Self::BackendReachable => "BackendReachable",
            Self::ReconcileFailed => "ReconcileFailed",
            Self::IpamSource => "IpamSource",
            Self::IpamProblem => "IpamProblem",
            Self::EndpointResolved => "EndpointResolved",
            Self::EndpointLookupFailed => "EndpointLookupFailed",
            Self::LeadersByLease => "LeadersByLease",
            Self::LeadersByKiloRule => "LeadersByKiloRule",
            Self::LeaderElected => "LeaderElected",
            Self::LeaderReplacedCutOff => "LeaderReplacedCutOff",
            Self::LeaderHandedOver => "LeaderHandedOver",
            Self::LeaderReleased => "LeaderReleased",
            Self::LeaderCutOff => "LeaderCutOff",
            Self::LeaderCutOffUnconfirmed => "LeaderCutOffUnconfirmed",
            Self::LeaderReconnected => "LeaderReconnected",
            Self::RouteWithheld => "RouteWithheld",
            Self::EndpointBypassed => "EndpointBypassed",
            Self::RouteWithoutGateway => "RouteWithoutGateway",
            Self::TunnelMissing => "TunnelMissing",
            Self::KeyRotation => "KeyRotation",
            Self::ConditionRefused => "ConditionRefused",
            Self::PeersRestored => "PeersRestored",
            Self::PeersNotRestored => "PeersNotRestored",
            Self::HandshakesStarted => "HandshakesStarted",
            Self::TookOver => "TookOver",
            Self::Replaced => "Replaced",
            Self::Removed => "Removed",
            Self::EngineRecreated => "EngineRecreated",
            Self::PeerStatusRefused => "PeerStatusRefused",
            Self::AllowedIpEditRefused => "AllowedIpEditRefused",
            Self::LinkDown => "LinkDown",
            Self::LinkUp => "LinkUp",
            Self::PostQuantumFallback => "PostQuantumFallback",
            Self::EndpointSwitched => "EndpointSwitched",
            Self::EndpointRefused => "EndpointRefused",
            Self::EndpointCandidateLeft => "EndpointCandidateLeft",
        }
    }

    /// Whether an event of this reason asks for attention (`Warning`) or records a normal
    /// change (`Normal`), as Kubernetes Events' `type`.
    pub fn kind(self) -> EventKind {
        match self {
            Self::BadAnnotation
            | Self::BadPeer
            | Self::RangeDropped
            | Self::LeaderSharesLimited
            | Self::BackendUnreachable
            | Self::ReconcileFailed
            | Self::IpamProblem
            | Self::EndpointLookupFailed
            | Self::LeaderCutOff
            | Self::LeaderCutOffUnconfirmed
            | Self::RouteWithheld
            | Self::EndpointBypassed
            | Self::RouteWithoutGateway
            | Self::TunnelMissing
            | Self::ConditionRefused
            | Self::EngineRecreated
            | Self::PeerStatusRefused
            | Self::AllowedIpEditRefused
            | Self::LinkDown
            | Self::PostQuantumFallback
            | Self::EndpointRefused => EventKind::Warning,
            Self::NoEndpoint
            | Self::NotReady
            | Self::BackendReachable
            | Self::IpamSource
            | Self::EndpointResolved
            | Self::LeadersByLease
            | Self::LeadersByKiloRule
            | Self::LeaderElected
            | Self::LeaderReplacedCutOff
            | Self::LeaderHandedOver
            | Self::LeaderReleased
            | Self::LeaderReconnected
            | Self::KeyRotation
            | Self::PeersRestored
            | Self::PeersNotRestored
            | Self::HandshakesStarted
            | Self::TookOver
            | Self::Replaced
            | Self::Removed
            | Self::LinkUp
            | Self::EndpointSwitched
            | Self::EndpointCandidateLeft => EventKind::Normal,
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A Kubernetes Event's `type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EventKind {
    /// A change worth knowing of.
    Normal,
    /// Something wrong or degraded.
    Warning,
}

/// One thing the agent noticed or decided.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Counts the agent's events from 1, in the order recorded.
    pub sequence: u64,
    /// When the step that recorded it ran, in Unix milliseconds.
    pub at_unix_ms: i64,
    /// Why.
    pub reason: Reason,
    /// `Normal` or `Warning` (from the reason).
    pub kind: EventKind,
    /// What it is about: a node, a Peer, a lease, a DNS name.
    pub subject: String,
    /// A sentence for people.
    pub message: String,
}

/// The events recorded since the driver last took them.
#[derive(Debug, Default)]
pub struct Journal {
    recorded: u64,
    pending: Vec<(Reason, String, String)>,
}

impl Journal {
    /// Records `message` about `subject` for `reason`.
    pub fn record(
        &mut self,
        reason: Reason,
        subject: impl Into<String>,
        message: impl Into<String>,
    ) {
        self.pending.push((reason, subject.into(), message.into()));
    }

    /// Whether anything was recorded since the last [`Journal::take`].
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// The events recorded since the last call, stamped with the step's time `at_unix_ms` and
    /// numbered on from the last.
    pub fn take(&mut self, at_unix_ms: i64) -> Vec<Event> {
        let pending = std::mem::take(&mut self.pending);
        pending
            .into_iter()
            .map(|(reason, subject, message)| {
                self.recorded += 1;
                Event {
                    sequence: self.recorded,
                    at_unix_ms,
                    reason,
                    kind: reason.kind(),
                    subject,
                    message,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taken_events_are_numbered_on_and_stamped_with_the_step() {
        let mut journal = Journal::default();
        journal.record(Reason::BadAnnotation, "n1", "kilo.squat.ai/location: empty");
        journal.record(
            Reason::LeaderElected,
            "kilo-leader-east",
            "taking the lead of east",
        );
        let first = journal.take(1_000);
        assert!(journal.is_empty());
        journal.record(
            Reason::BackendUnreachable,
            "file",
            "keeping the last good mesh",
        );
        let second = journal.take(2_000);
        assert_eq!(
            first
                .iter()
                .map(|e| (e.sequence, e.reason, e.kind))
                .collect::<Vec<_>>(),
            [
                (1, Reason::BadAnnotation, EventKind::Warning),
                (2, Reason::LeaderElected, EventKind::Normal)
            ]
        );
        assert_eq!((second[0].sequence, second[0].at_unix_ms), (3, 2_000));
        assert_eq!(second[0].subject, "file");
    }

    #[test]
    fn every_reason_is_written_as_its_name() {
        for reason in Reason::ALL {
            let json = serde_json::to_string(&reason).unwrap();
            assert_eq!(json, format!("\"{}\"", reason.as_str()));
            assert_eq!(serde_json::from_str::<Reason>(&json).unwrap(), reason);
        }
    }

    #[test]
    fn a_reason_is_written_as_its_name() {
        let json = serde_json::to_string(&Reason::LeaderReplacedCutOff).unwrap();
        assert_eq!(json, "\"LeaderReplacedCutOff\"");
        assert_eq!(
            Reason::LeaderReplacedCutOff.to_string(),
            "LeaderReplacedCutOff"
        );
    }
}
