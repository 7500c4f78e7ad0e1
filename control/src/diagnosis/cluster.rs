//! The cluster-wide findings, from every Node's and Peer's annotations: clock skew, nodes that
//! stopped checking in, duplicate WireGuard IPs, overlapping CIDRs, and who leads each location
//! and why.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;

use super::{Finding, Severity, CLOCK_SKEW_SECS};
use crate::ip::is_public;
use crate::node::{Node, READY_WINDOW_SECS};
use crate::peer::Peer;
use crate::topology::Topology;

/// Why `leader` leads its location, by Kilo's rule.
fn leader_reason(leader: &Node, members: usize) -> String {
    let public = leader
        .endpoint
        .as_ref()
        .and_then(|e| e.ip())
        .is_some_and(is_public);
    match (leader.leader, public) {
        _ if members == 1 => "it is the location's only ready node".into(),
        (true, true) => "it is annotated kilo.squat.ai/leader and has a public endpoint".into(),
        (true, false) => "it is annotated kilo.squat.ai/leader (no annotated node has a public endpoint)".into(),
        (false, true) => "no node is annotated kilo.squat.ai/leader, and it is the first by name with a public endpoint".into(),
        (false, false) => "no node is annotated kilo.squat.ai/leader or has a public endpoint, so the first by name leads".into(),
    }
}

/// One claim on address space, for the overlap check.
struct Claim {
    cidr: IpNet,
    owner: String,
    /// The location of an `allowed-location-ips` claim or a pod CIDR; none for Peers and the
    /// Kilo subnet. Claims of the same location may overlap (the location announces them once).
    location: Option<String>,
    location_wide: bool,
}

fn overlap(a: &IpNet, b: &IpNet) -> bool {
    a.contains(&b.addr()) || b.contains(&a.addr())
}

/// The cluster-wide findings: `nodes` are every Node (ready or not), translated; `topology` is
/// the mesh as seen from any node (for the leaders), `None` when no node is ready.
pub fn cluster_findings(
    nodes: &[Node],
    peers: &[Peer],
    topology: Option<&Topology>,
    now_unix: i64,
) -> Vec<Finding> {
    cluster_findings_with_leases(nodes, peers, topology, &BTreeMap::new(), now_unix)
}

/// [`cluster_findings`], with the leaders chosen by lease (`--leader-election=lease`), by
/// location name.
pub fn cluster_findings_with_leases(
    nodes: &[Node],
    peers: &[Peer],
    topology: Option<&Topology>,
    lease_leaders: &BTreeMap<String, Vec<crate::topology::ShareLeader>>,
    now_unix: i64,
) -> Vec<Finding> {
    let mut out = Vec::new();
    for n in nodes.iter().filter(|n| n.last_seen > 0) {
        let age = n.check_in_age(now_unix);
        let ahead = age.saturating_neg();
        if ahead > CLOCK_SKEW_SECS {
            out.push(Finding::new(
                Severity::Problem,
                "clock",
                format!("node {}", n.name),
                format!("its kilo.squat.ai/last-seen is {ahead} s in the future: its clock, or this machine's, is off"),
                "run NTP (chrony, systemd-timesyncd) on every node: readiness is judged by last-seen, so a skewed node stays in the mesh after it dies, or drops out while alive",
            ));
        } else if age >= READY_WINDOW_SECS {
            out.push(Finding::new(
                Severity::Warning,
                "check-in",
                format!("node {}", n.name),
                format!("it has not checked in for {age} s, so it is out of the mesh"),
                "check that kg runs on it (kubectl -n kube-system get pods -o wide) and can reach the API server",
            ));
        }
    }

    let mut by_ip: BTreeMap<IpAddr, Vec<&str>> = BTreeMap::new();
    for n in nodes {
        if let Some(ip) = n.wireguard_ip {
            by_ip.entry(ip.addr()).or_default().push(&n.name);
        }
    }
    for (ip, owners) in by_ip.iter().filter(|(_, o)| o.len() > 1) {
        out.push(Finding::new(
            Severity::Problem,
            "wireguard-ip",
            format!("nodes {}", owners.join(", ")),
            format!("they all announce the WireGuard IP {ip} (kilo.squat.ai/wireguard-ip)"),
            "every leader needs its own WireGuard IP: run one --subnet and one granularity on every kg; the annotations are rewritten at the next check-in",
        ));
    }

    let mut claims = Vec::new();
    for n in nodes {
        for (i, cidr) in n.pod_cidrs().enumerate() {
            let field = if i == 0 {
                "spec.podCIDR"
            } else {
                "spec.podCIDRs"
            };
            claims.push(Claim {
                cidr,
                owner: format!("node {} ({field})", n.name),
                location: Some(n.location.clone()),
                location_wide: false,
            });
        }
        for cidr in &n.allowed_location_ips {
            claims.push(Claim {
                cidr: *cidr,
                owner: format!(
                    "location {:?} (kilo.squat.ai/allowed-location-ips on node {})",
                    n.location, n.name
                ),
                location: Some(n.location.clone()),
                location_wide: true,
            });
        }
    }
    for p in peers {
        for cidr in &p.allowed_ips {
            claims.push(Claim {
                cidr: *cidr,
                owner: format!("Peer {} (spec.allowedIPs)", p.name),
                location: None,
                location_wide: false,
            });
        }
    }
    if let Some(subnet) = topology.map(|t| t.kilo_subnet) {
        claims.push(Claim {
            cidr: subnet,
            owner: "the Kilo subnet (--subnet)".into(),
            location: None,
            location_wide: false,
        });
    }
    for (i, a) in claims.iter().enumerate() {
        for b in &claims[i + 1..] {
            if a.owner == b.owner || !overlap(&a.cidr, &b.cidr) {
                continue;
            }
            let same_location = a.location.is_some() && a.location == b.location;
            if same_location && (a.location_wide || b.location_wide) {
                continue;
            }
            out.push(Finding::new(
                Severity::Problem,
                "cidr-overlap",
                format!("{} and {}", a.owner, b.owner),
                format!("{} and {} overlap: traffic for the overlap goes to one of them only, and which one depends on the route the kernel prefers", a.cidr, b.cidr),
                "give each location, node and Peer its own address space; remove the wrong kilo.squat.ai/allowed-location-ips or Peer allowed IPs",
            ));
        }
    }

    if let Some(t) = topology {
        for s in &t.segments {
            let leader = s.leader_member();
            let Some(node) = nodes.iter().find(|n| n.name == leader.name) else {
                continue;
            };
            let by_lease = lease_leaders
                .get(&s.location)
                .and_then(|shares| shares.iter().find(|c| c.name == leader.name))
                .filter(|_| s.key.starts_with("location:"));
            let reason = match by_lease {
                Some(c) if s.shared || c.share > 0 => format!(
                    "it holds the lease of share {} of its location (--leaders-per-location, --leader-election=lease)",
                    c.share + 1
                ),
                Some(_) if s.members.len() > 1 => {
                    "it holds the location's lease (--leader-election=lease)".to_string()
                }
                _ if s.shared => "one of its location's leaders (--leaders-per-location), in Kilo's order of preference".to_string(),
                _ => leader_reason(node, s.members.len()),
            };
            out.push(Finding::new(
                Severity::Info,
                "leader",
                s.key.clone(),
                format!(
                    "{} leads ({} of {} ready nodes): {}",
                    leader.name,
                    s.leader + 1,
                    s.members.len(),
                    reason
                ),
                "",
            ));
        }
    }
    out
}
