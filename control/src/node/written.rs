//! The annotations kg writes on its own Node ([`WrittenAnnotations`]), and the JSON of the
//! `discovered-endpoints` annotation, which kg writes and reads back from every Node.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::{annotation, Granularity};
use crate::ip::Endpoint;
use crate::key::Key;

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
    /// `--leaders-per-location` (written only above 1).
    pub leaders_per_location: u16,
    /// The next key, while a rotation is under way.
    pub next_key: Option<Key>,
    /// The key rotation request last carried out.
    pub key_rotated: Option<String>,
    /// The ML-KEM key's fingerprint, with `--post-quantum`.
    pub pq: Option<crate::pq::PqAnnouncement>,
    /// Every `address:port` a peer could reach this node at (`kilotun.io/endpoints`, written
    /// only when there is one).
    pub endpoints: Vec<SocketAddr>,
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
        .chain(
            self.next_key
                .map(|k| (a::NEXT_KEY.to_string(), k.to_base64())),
        )
        .chain(self.pq.map(|pq| (a::PQ.to_string(), pq.format())))
        .chain((!self.endpoints.is_empty()).then(|| {
            (
                a::ENDPOINTS.to_string(),
                crate::endpoints::encode_candidates(&self.endpoints),
            )
        }))
        .chain(
            self.key_rotated
                .clone()
                .map(|id| (a::KEY_ROTATED.to_string(), id)),
        )
        .chain((self.leaders_per_location > 1).then(|| {
            (
                a::LEADER_SHARES.to_string(),
                self.leaders_per_location.to_string(),
            )
        }))
        .collect()
    }
}
