//! Reading a Kubernetes Node into a [`Node`]: each `kilo.squat.ai/*` annotation and pod CIDR
//! parsed with Kilo's rules, every bad value reported as an [`AnnotationProblem`].

use std::collections::BTreeMap;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Node as KubeNode;

use super::{
    annotation, decode_discovered_endpoints, AnnotationProblem, Granularity, Node, LEAVING_TAINTS,
};
use crate::ip::{normalise, parse_cidr, Endpoint};
use crate::key::Key;

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
    let mut count = |key: &str| match r.get(key).map(str::to_string) {
        Some(text) if !text.is_empty() => match text.parse::<u16>() {
            Ok(n) if n >= 1 => Some(n),
            _ => {
                r.problem(key, &text, "not a whole number from 1; counted as 1");
                Some(1)
            }
        },
        _ => None,
    };
    let shares = count(a::LEADER_SHARES);
    let older_shares = count(a::LEADERS_PER_LOCATION).filter(|&n| n > 1);
    // An earlier kilotun's agent splits shares otherwise: one leader per location with it.
    let leaders_per_location = if older_shares.is_some() {
        Some(1)
    } else {
        shares
    };
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

    let next_key =
        r.get(a::NEXT_KEY)
            .map(str::to_string)
            .and_then(|text| match Key::parse(&text) {
                Ok(k) => Some(k),
                Err(e) => {
                    r.problem(a::NEXT_KEY, &text, format!("{e}; ignored"));
                    None
                }
            });
    let pq = r.get(a::PQ).map(str::to_string).and_then(|text| {
        match crate::pq::PqAnnouncement::parse(&text) {
            Some(pq) => Some(pq),
            None => {
                r.problem(
                    a::PQ,
                    &text,
                    "not v1: and a base64 32-byte fingerprint (with optional flags after commas); ignored",
                );
                None
            }
        }
    });
    let endpoint_candidates = match r.get(a::ENDPOINTS).map(str::to_string) {
        Some(text) => {
            let (found, left_out) = crate::endpoints::parse_candidates(&text);
            for (entry, why) in left_out {
                r.problem(
                    a::ENDPOINTS,
                    &entry,
                    format!("{why}; this entry is skipped"),
                );
            }
            found
        }
        None => Vec::new(),
    };
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
            leaders_per_location,
            older_shares,
            next_key,
            pq,
            endpoint_candidates,
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

/// True for the `force-endpoint` values that mean "no endpoint": `-` and the empty string, as
/// for `force-internal-ip`.
pub fn is_no_endpoint(value: &str) -> bool {
    value.is_empty() || value == "-"
}
