//! Kubernetes Nodes as Kilo sees them: the `kilo.squat.ai/*` annotations read into a typed
//! [`Node`], readiness, and the annotations kg writes back on its own Node.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;

use ipnet::IpNet;

use crate::ip::Endpoint;
use crate::key::Key;

pub mod annotation;
mod translate;
mod written;

pub use translate::{is_no_endpoint, translate_node};
pub use written::{decode_discovered_endpoints, encode_discovered_endpoints, WrittenAnnotations};

/// Kilo's default topology label.
pub const DEFAULT_TOPOLOGY_LABEL: &str = "topology.kubernetes.io/region";

/// Taints that mark a node about to be removed (cluster-autoscaler's scale-down, Karpenter's
/// disruption): like a cordon, they hand leadership over before the node goes.
pub const LEAVING_TAINTS: [&str; 3] = [
    "ToBeDeletedByClusterAutoscaler",
    "karpenter.sh/disrupted",
    "karpenter.sh/disruption",
];

/// A node is ready while its last check-in is younger than this many seconds.
pub const READY_WINDOW_SECS: i64 = 60;

/// How the mesh groups nodes into WireGuard segments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Granularity {
    /// One segment per location; a leader per location.
    #[default]
    Location,
    /// Every node is its own segment: a full mesh.
    Full,
    /// A WireGuard tunnel between every pair of nodes in different locations, none inside a
    /// location (routes, or the CNI, carry traffic there): no leader to lose.
    Cross,
}

impl Granularity {
    /// Parses `location`, `full` or `cross`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "location" => Some(Self::Location),
            "full" => Some(Self::Full),
            "cross" => Some(Self::Cross),
            _ => None,
        }
    }

    /// The annotation value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Location => "location",
            Self::Full => "full",
            Self::Cross => "cross",
        }
    }
}

/// A Node translated from its Kubernetes object.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Node {
    /// The Node's name.
    pub name: String,
    /// Where its WireGuard listens (force-endpoint, else endpoint).
    pub endpoint: Option<Endpoint>,
    /// Private IP with host bits and interface mask (force-internal-ip, else internal-ip).
    pub internal_ip: Option<IpNet>,
    /// True when force-internal-ip is `""` or `-`: the node has deliberately no private IP.
    pub no_internal_ip: bool,
    /// Its private IP of the other family, on a dual-stack host (`kilotun.io/second-internal-ip`):
    /// the gateway for that family inside its location.
    pub second_internal_ip: Option<IpNet>,
    /// WireGuard public key; `None` when absent or unparsable (not ready).
    pub key: Option<Key>,
    /// Unix seconds of the last check-in; 0 when absent or unparsable.
    pub last_seen: i64,
    /// True when the leader annotation is present, whatever its value.
    pub leader: bool,
    /// Logical location.
    pub location: String,
    /// The pod CIDR (`spec.podCIDR`), as its network.
    pub subnet: Option<IpNet>,
    /// The other entries of `spec.podCIDRs` (a dual-stack cluster's pod CIDR of the other
    /// family), as networks.
    pub extra_subnets: Vec<IpNet>,
    /// The WireGuard IP it published (leaders only).
    pub wireguard_ip: Option<IpNet>,
    /// Persistent keepalive in seconds; 0 is off.
    pub persistent_keepalive: u16,
    /// Endpoints this node discovered for NATed peers, by public key.
    pub discovered_endpoints: BTreeMap<Key, SocketAddr>,
    /// Extra CIDRs routed to this node's location.
    pub allowed_location_ips: Vec<IpNet>,
    /// The granularity the node's agent runs with, if it published a known one.
    pub granularity: Option<Granularity>,
    /// The CNI compatibility IP (Cilium's `cilium_host`).
    pub cni_compatibility_ip: Option<IpNet>,
    /// `spec.unschedulable`: cordoned, so no candidate for leadership while another is.
    pub cordoned: bool,
    /// Its agent takes part in lease-based leader election.
    pub lease_election: bool,
    /// Annotated `kilotun.io/relay`: its location may relay between locations behind NAT.
    pub relay: bool,
    /// The leaders per location its agent runs with (`kilotun.io/leader-shares`), when it
    /// publishes one (kg does above 1; a malformed value counts as 1); 1 for an earlier
    /// kilotun's agent (see `older_shares`).
    pub leaders_per_location: Option<u16>,
    /// The leaders per location an earlier kilotun's agent runs with
    /// (`kilotun.io/leaders-per-location`): it splits shares otherwise, so the node counts
    /// as 1 ([`annotation::LEADERS_PER_LOCATION`]).
    pub older_shares: Option<u16>,
    /// The key its agent will use next (`kilotun.io/next-key`), while it rotates its key.
    pub next_key: Option<Key>,
    /// The fingerprint of its ML-KEM key (`kilotun.io/pq`): its agent takes part in
    /// post-quantum preshared keys.
    pub pq: Option<crate::pq::PqAnnouncement>,
    /// Every address its agent says it can be reached at (`kilotun.io/endpoints`), in its
    /// order of preference; empty for Kilo's agent (see [`crate::endpoints`]).
    pub endpoint_candidates: Vec<SocketAddr>,
}

/// A bad annotation value: which node, which annotation, what value, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnotationProblem {
    /// The Node (or Peer) name.
    pub object: String,
    /// The annotation or field.
    pub annotation: String,
    /// The offending value.
    pub value: String,
    /// What was wrong and what kg does instead.
    pub reason: String,
}

impl fmt::Display for AnnotationProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A value may be anything up to the API's limit; the log line shows its start only.
        // The reason can quote the value again, so it is shortened too.
        write!(
            f,
            "{}: {}={:?}: {}",
            self.object,
            self.annotation,
            shortened(&self.value, 120),
            shortened(&self.reason, 240)
        )
    }
}

/// The first `limit` characters of `text`, with `…` when there were more.
pub(crate) fn shortened(text: &str, limit: usize) -> String {
    match text.char_indices().nth(limit) {
        None => text.to_string(),
        Some((end, _)) => format!("{}…", &text[..end]),
    }
}

impl Node {
    /// Its pod CIDRs: `spec.podCIDR`, then the other family's from `spec.podCIDRs`.
    pub fn pod_cidrs(&self) -> impl Iterator<Item = IpNet> + '_ {
        self.subnet.iter().chain(&self.extra_subnets).copied()
    }

    /// Kilo's readiness: a usable endpoint, a key, a pod CIDR and a check-in younger than
    /// 60 s at `now_unix`. The internal IP is not required. Beyond Kilo, a node with no
    /// endpoint at all is ready when it keeps its tunnels alive: it reaches the others first,
    /// and they answer at the endpoint its handshakes come from.
    pub fn is_ready(&self, now_unix: i64) -> bool {
        self.has_usable_endpoint()
            && self.key.is_some()
            && self.subnet.is_some()
            && self.check_in_age(now_unix) < READY_WINDOW_SECS
    }

    /// Seconds since its `last-seen` at `now_unix` (negative when `last-seen` is ahead of
    /// `now_unix`), saturating instead of overflowing on an absurd annotation.
    pub fn check_in_age(&self, now_unix: i64) -> i64 {
        now_unix.saturating_sub(self.last_seen)
    }

    /// An endpoint that resolves, or none at all with a keepalive (see [`Node::is_ready`]).
    pub fn has_usable_endpoint(&self) -> bool {
        match &self.endpoint {
            Some(e) => e.is_ready(),
            None => self.persistent_keepalive > 0,
        }
    }
}

#[cfg(test)]
mod tests;
