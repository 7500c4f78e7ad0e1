//! Kubernetes Nodes as Kilo sees them: the `kilo.squat.ai/*` annotations read into a typed
//! [`Node`], readiness, and the annotations kg writes back on its own Node.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node as KubeNode;
use serde::{Deserialize, Serialize};

use crate::ip::{normalise, parse_cidr, Endpoint};
use crate::key::Key;

/// Annotation names, exactly as Kilo spells them.
pub mod annotation {
    /// User-set: overrides the endpoint (`host:port`); its port is also the listen port.
    pub const FORCE_ENDPOINT: &str = "kilo.squat.ai/force-endpoint";
    /// User-set: overrides the internal IP (CIDR), or `""`/`-` to have none.
    pub const FORCE_INTERNAL_IP: &str = "kilo.squat.ai/force-internal-ip";
    /// User-set, presence-only: prefer this node as its segment's leader.
    pub const LEADER: &str = "kilo.squat.ai/leader";
    /// User-set: the logical location (wins over the topology label).
    pub const LOCATION: &str = "kilo.squat.ai/location";
    /// User-set: keepalive seconds; non-zero on a remote node marks it as behind NAT.
    pub const PERSISTENT_KEEPALIVE: &str = "kilo.squat.ai/persistent-keepalive";
    /// User-set: comma-separated CIDRs routed to this node's location.
    pub const ALLOWED_LOCATION_IPS: &str = "kilo.squat.ai/allowed-location-ips";
    /// Written by kg: the endpoint in use.
    pub const ENDPOINT: &str = "kilo.squat.ai/endpoint";
    /// Written by kg: the private IP with its interface mask.
    pub const INTERNAL_IP: &str = "kilo.squat.ai/internal-ip";
    /// Written by kg: the WireGuard public key.
    pub const KEY: &str = "kilo.squat.ai/key";
    /// Written by kg: Unix seconds of the last check-in.
    pub const LAST_SEEN: &str = "kilo.squat.ai/last-seen";
    /// Written by kg: a leader's WireGuard IP with the Kilo subnet mask, else `""`.
    pub const WIREGUARD_IP: &str = "kilo.squat.ai/wireguard-ip";
    /// Written by kg: endpoints learned from NATed peers (JSON).
    pub const DISCOVERED_ENDPOINTS: &str = "kilo.squat.ai/discovered-endpoints";
    /// Written by kg: the mesh granularity this agent runs with.
    pub const GRANULARITY: &str = "kilo.squat.ai/granularity";
    /// Written by kg: the `cilium_host` address in Cilium compatibility mode, else `""`.
    pub const CNI_COMPATIBILITY_IP: &str = "kilo.squat.ai/cni-compatibility-ip";
    /// Written by kilotun's kg (not Kilo's): `lease` when it takes part in lease-based leader
    /// election (see `crate::leader`).
    pub const LEADER_ELECTION: &str = "kilotun.io/leader-election";
    /// User-set on any node of a location (kilotun's, not Kilo's): only locations so marked may
    /// relay between two locations behind NAT; without it, any reachable location may.
    pub const RELAY: &str = "kilotun.io/relay";
    /// Written by kilotun's kg (not Kilo's): on a host with addresses of both families, its
    /// address of the family `internal-ip` is not (with mask), else `""`. When `internal-ip` is
    /// IPv4, the other nodes of its location route IPv6 pods and Peers through it (a route
    /// cannot take a gateway of the other family).
    pub const SECOND_INTERNAL_IP: &str = "kilotun.io/second-internal-ip";

    /// Every annotation kg writes, in the order it writes them.
    pub const WRITTEN: [&str; 10] = [
        ENDPOINT,
        INTERNAL_IP,
        KEY,
        LAST_SEEN,
        WIREGUARD_IP,
        DISCOVERED_ENDPOINTS,
        GRANULARITY,
        CNI_COMPATIBILITY_IP,
        LEADER_ELECTION,
        SECOND_INTERNAL_IP,
    ];
}

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

/// Go's `net.UDPAddr` JSON shape, used by the `discovered-endpoints` annotation.
#[derive(Debug, Serialize, Deserialize)]
struct GoUdpAddr {
    #[serde(rename = "IP")]
    ip: IpAddr,
    #[serde(rename = "Port")]
    port: u16,
    #[serde(rename = "Zone", default)]
    zone: String,
}

/// Encodes discovered endpoints as Kilo's annotation value (`""` when there are none).
pub fn encode_discovered_endpoints(map: &BTreeMap<Key, SocketAddr>) -> String {
    if map.is_empty() {
        return String::new();
    }
    let shaped: BTreeMap<String, GoUdpAddr> = map
        .iter()
        .map(|(k, a)| {
            (
                k.to_base64(),
                GoUdpAddr {
                    ip: a.ip(),
                    port: a.port(),
                    zone: String::new(),
                },
            )
        })
        .collect();
    serde_json::to_string(&shaped).expect("plain map serialises")
}

/// Decodes Kilo's `discovered-endpoints` value; `""` is an empty map.
pub fn decode_discovered_endpoints(text: &str) -> Result<BTreeMap<Key, SocketAddr>, String> {
    if text.is_empty() || text == "null" {
        return Ok(BTreeMap::new());
    }
    let shaped: BTreeMap<String, GoUdpAddr> =
        serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    shaped
        .into_iter()
        .map(|(k, a)| {
            let key = Key::parse(&k).map_err(|e| format!("key {k:?}: {e}"))?;
            Ok((key, SocketAddr::new(a.ip, a.port)))
        })
        .collect()
}

struct Reader<'a> {
    name: &'a str,
    annotations: &'a BTreeMap<String, String>,
    problems: Vec<AnnotationProblem>,
}

impl Reader<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.annotations.get(key).map(String::as_str)
    }

    fn problem(&mut self, annotation: &str, value: &str, reason: impl Into<String>) {
        self.problems.push(AnnotationProblem {
            object: self.name.to_string(),
            annotation: annotation.to_string(),
            value: value.to_string(),
            reason: reason.into(),
        });
    }

    /// A CIDR annotation; empty is absent, a bad value is reported and absent.
    fn cidr(&mut self, key: &str) -> Option<IpNet> {
        let value = self.get(key)?.to_string();
        if value.is_empty() {
            return None;
        }
        match parse_cidr(&value) {
            Some(net) => Some(normalise(net)),
            None => {
                self.problem(key, &value, "not a CIDR (want e.g. 10.1.0.2/24); ignored");
                None
            }
        }
    }

    fn endpoint(&mut self, key: &str) -> Option<Endpoint> {
        let value = self.get(key)?.to_string();
        if value.is_empty() {
            return None;
        }
        match Endpoint::parse(&value) {
            Ok(e) => Some(e),
            Err(e) => {
                self.problem(key, &value, format!("{e}; ignored"));
                None
            }
        }
    }
}

/// Translates a Kubernetes Node with Kilo's rules. Bad values never fail the node: each is
/// reported as an [`AnnotationProblem`] and treated as Kilo treats it (mostly: as absent).
pub fn translate_node(node: &KubeNode, topology_label: &str) -> (Node, Vec<AnnotationProblem>) {
    let empty = BTreeMap::new();
    let name = node.metadata.name.clone().unwrap_or_default();
    let annotations = node.metadata.annotations.as_ref().unwrap_or(&empty);
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let mut r = Reader {
        name: &name,
        annotations,
        problems: Vec::new(),
    };
    use annotation as a;

    // `force-endpoint: "-"` (or empty): the node announces no endpoint at all and is reached
    // where its handshakes come from.
    let endpoint = match r.get(a::FORCE_ENDPOINT) {
        Some(v) if is_no_endpoint(v) => None,
        _ => match r.endpoint(a::FORCE_ENDPOINT) {
            Some(e) => Some(e),
            None => r.endpoint(a::ENDPOINT),
        },
    };

    let mut no_internal_ip = false;
    let internal_ip = match r.get(a::FORCE_INTERNAL_IP) {
        Some("") | Some("-") => {
            no_internal_ip = true;
            None
        }
        Some(_) => match r.cidr(a::FORCE_INTERNAL_IP) {
            // The node's own kg refuses a forced internal IP of a family its host has no
            // address of, and announces the detected one in `internal-ip`: a written internal
            // IP of the other family is that refusal, and wins, so every node routes to an
            // address the node holds. Of the same family, the forced one wins, as in Kilo.
            Some(forced) => match r.get(a::INTERNAL_IP).and_then(parse_cidr) {
                Some(written) if written.addr().is_ipv4() != forced.addr().is_ipv4() => {
                    Some(normalise(written))
                }
                _ => Some(forced),
            },
            None => r.cidr(a::INTERNAL_IP),
        },
        None => r.cidr(a::INTERNAL_IP),
    };
    let second_internal_ip = r.cidr(a::SECOND_INTERNAL_IP).filter(|second| {
        let same_family =
            internal_ip.is_some_and(|i| i.addr().is_ipv4() == second.addr().is_ipv4());
        if same_family {
            let value = second.to_string();
            r.problem(
                a::SECOND_INTERNAL_IP,
                &value,
                "of the same family as the internal IP; ignored",
            );
        }
        !same_family
    });

    let key = match r.get(a::KEY).map(str::to_string) {
        Some(text) if !text.is_empty() => match Key::parse(&text) {
            Ok(k) if !k.is_zero() => Some(k),
            Ok(_) => None,
            Err(e) => {
                r.problem(a::KEY, &text, format!("{e}; node not ready"));
                None
            }
        },
        _ => None,
    };

    let last_seen = match r.get(a::LAST_SEEN).map(str::to_string) {
        Some(text) if !text.is_empty() => text.parse::<i64>().unwrap_or_else(|_| {
            r.problem(a::LAST_SEEN, &text, "not Unix seconds; treated as 0");
            0
        }),
        _ => 0,
    };

    let location = match r.get(a::LOCATION) {
        Some(loc) => loc.to_string(),
        None => labels.get(topology_label).cloned().unwrap_or_default(),
    };

    let persistent_keepalive = match r.get(a::PERSISTENT_KEEPALIVE).map(str::to_string) {
        Some(text) if !text.is_empty() => match text.trim().parse::<i64>() {
            Ok(n) if (0..=i64::from(u16::MAX)).contains(&n) => n as u16,
            Ok(_) => {
                r.problem(
                    a::PERSISTENT_KEEPALIVE,
                    &text,
                    "out of range 0-65535 seconds; treated as 0",
                );
                0
            }
            Err(_) => {
                r.problem(
                    a::PERSISTENT_KEEPALIVE,
                    &text,
                    "not a whole number of seconds; treated as 0",
                );
                0
            }
        },
        _ => 0,
    };

    let mut allowed_location_ips = Vec::new();
    if let Some(list) = r.get(a::ALLOWED_LOCATION_IPS).map(str::to_string) {
        let mut bad = Vec::new();
        for item in list.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match parse_cidr(item) {
                Some(net) => allowed_location_ips.push(normalise(net)),
                None => bad.push(format!("{item:?}")),
            }
        }
        if !bad.is_empty() {
            // One line for the annotation, however many of its items are bad.
            let shown: Vec<&str> = bad.iter().take(5).map(String::as_str).collect();
            let more = bad.len().saturating_sub(shown.len());
            let more = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            r.problem(
                a::ALLOWED_LOCATION_IPS,
                &list,
                format!("not CIDRs, skipped: {}{more}", shown.join(", ")),
            );
        }
    }

    let discovered_endpoints = match r.get(a::DISCOVERED_ENDPOINTS).map(str::to_string) {
        Some(text) => decode_discovered_endpoints(&text).unwrap_or_else(|e| {
            r.problem(a::DISCOVERED_ENDPOINTS, &text, format!("{e}; ignored"));
            BTreeMap::new()
        }),
        None => BTreeMap::new(),
    };

    let granularity = match r.get(a::GRANULARITY).map(str::to_string) {
        Some(text) if !text.is_empty() => {
            let parsed = Granularity::parse(&text);
            if parsed.is_none() {
                r.problem(
                    a::GRANULARITY,
                    &text,
                    "not \"location\", \"full\" or \"cross\"; ignored",
                );
            }
            parsed
        }
        _ => None,
    };
    let wireguard_ip = r.cidr(a::WIREGUARD_IP);
    let cni_compatibility_ip = r.cidr(a::CNI_COMPATIBILITY_IP);
    let leader = r.get(a::LEADER).is_some();
    let lease_election = r.get(a::LEADER_ELECTION) == Some("lease");
    let relay = r.get(a::RELAY).is_some_and(|v| v != "false");
    let cordoned = node.spec.as_ref().is_some_and(|s| {
        s.unschedulable.unwrap_or(false)
            || s.taints
                .iter()
                .flatten()
                .any(|t| LEAVING_TAINTS.contains(&t.key.as_str()))
    });

    let subnet = node
        .spec
        .as_ref()
        .and_then(|s| s.pod_cidr.as_deref())
        .and_then(|text| match parse_cidr(text) {
            Some(net) => Some(normalise(net).trunc()),
            None => {
                r.problem("spec.podCIDR", text, "not a CIDR; node not ready");
                None
            }
        });
    let extra_subnets = extra_pod_cidrs(
        &mut r,
        subnet,
        node.spec.as_ref().and_then(|s| s.pod_cidrs.as_deref()),
    );

    let problems = r.problems;
    (
        Node {
            name,
            endpoint,
            internal_ip,
            no_internal_ip,
            second_internal_ip,
            key,
            last_seen,
            leader,
            location,
            subnet,
            extra_subnets,
            wireguard_ip,
            persistent_keepalive,
            discovered_endpoints,
            allowed_location_ips,
            granularity,
            cni_compatibility_ip,
            cordoned,
            lease_election,
            relay,
        },
        problems,
    )
}

/// The entries of `spec.podCIDRs` beyond `spec.podCIDR` (Kubernetes lists `spec.podCIDR` first,
/// then at most one pod CIDR of the other family): each a network of a family no earlier pod
/// CIDR has. An entry that is not a CIDR, or repeats a family, is named as a problem and skipped.
fn extra_pod_cidrs(
    r: &mut Reader<'_>,
    primary: Option<IpNet>,
    listed: Option<&[String]>,
) -> Vec<IpNet> {
    let Some(primary) = primary else {
        return Vec::new();
    };
    let mut out: Vec<IpNet> = Vec::new();
    for text in listed.unwrap_or_default() {
        let Some(net) = parse_cidr(text).map(|n| normalise(n).trunc()) else {
            r.problem("spec.podCIDRs", text, "not a CIDR; skipped");
            continue;
        };
        if net == primary {
            continue;
        }
        let family_taken = std::iter::once(&primary)
            .chain(&out)
            .any(|n| n.addr().is_ipv4() == net.addr().is_ipv4());
        if family_taken {
            r.problem(
                "spec.podCIDRs",
                text,
                "a second pod CIDR of the same family; skipped (one per family)",
            );
            continue;
        }
        out.push(net);
    }
    out
}

impl Node {
    /// Its pod CIDRs: `spec.podCIDR`, then the other family's from `spec.podCIDRs`.
    pub fn pod_cidrs(&self) -> impl Iterator<Item = IpNet> + '_ {
        self.subnet.iter().chain(&self.extra_subnets).copied()
    }
}

/// True for the `force-endpoint` values that mean "no endpoint": `-` and the empty string, as
/// for `force-internal-ip`.
pub fn is_no_endpoint(value: &str) -> bool {
    value.is_empty() || value == "-"
}

impl Node {
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

/// The values of every annotation kg writes, computed from the local node's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenAnnotations {
    /// The endpoint, DNS name first.
    pub endpoint: Option<Endpoint>,
    /// The private IP with mask.
    pub internal_ip: Option<IpNet>,
    /// The public key.
    pub key: Key,
    /// Unix seconds of this check-in.
    pub last_seen: i64,
    /// The WireGuard IP with the Kilo mask (leaders), else `None`.
    pub wireguard_ip: Option<IpNet>,
    /// NAT endpoints this node discovered.
    pub discovered_endpoints: BTreeMap<Key, SocketAddr>,
    /// The granularity this agent runs with.
    pub granularity: Granularity,
    /// Cilium's `cilium_host` CIDR in compatibility mode.
    pub cni_compatibility_ip: Option<IpNet>,
    /// The host's address of the other family than the internal IP's, if it has one.
    pub second_internal_ip: Option<IpNet>,
    /// True when this agent takes part in lease-based leader election (written only then).
    pub leader_election: bool,
}

impl WrittenAnnotations {
    /// The annotation map, in Kilo's exact formats.
    pub fn to_map(&self) -> BTreeMap<String, String> {
        let opt = |v: Option<String>| v.unwrap_or_default();
        use annotation as a;
        BTreeMap::from([
            (
                a::ENDPOINT.to_string(),
                opt(self.endpoint.as_ref().map(ToString::to_string)),
            ),
            (
                a::INTERNAL_IP.to_string(),
                opt(self.internal_ip.map(|n| n.to_string())),
            ),
            (a::KEY.to_string(), self.key.to_base64()),
            (a::LAST_SEEN.to_string(), self.last_seen.to_string()),
            (
                a::WIREGUARD_IP.to_string(),
                opt(self.wireguard_ip.map(|n| n.to_string())),
            ),
            (
                a::DISCOVERED_ENDPOINTS.to_string(),
                encode_discovered_endpoints(&self.discovered_endpoints),
            ),
            (
                a::GRANULARITY.to_string(),
                self.granularity.as_str().to_string(),
            ),
            (
                a::CNI_COMPATIBILITY_IP.to_string(),
                opt(self.cni_compatibility_ip.map(|n| n.to_string())),
            ),
            (
                a::SECOND_INTERNAL_IP.to_string(),
                opt(self.second_internal_ip.map(|n| n.to_string())),
            ),
        ])
        .into_iter()
        .chain(
            self.leader_election
                .then(|| (a::LEADER_ELECTION.to_string(), "lease".to_string())),
        )
        .collect()
    }
}

#[cfg(test)]
mod tests;
