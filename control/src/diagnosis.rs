//! `kgctl diagnose`'s judgement, as pure functions: what is wrong in the cluster's annotations
//! (clock skew, duplicate WireGuard IPs, overlapping CIDRs, who leads each location and why),
//! and what is wrong on one node, from the [`NodeStatus`] its kg reports (handshakes that never
//! complete and the evidence of why, NAT without keepalive, path MTU, IPIP, missing routes and
//! rules). Each finding says in plain words what is wrong and what to do.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::ip::is_public;
use crate::node::{Node, READY_WINDOW_SECS};
use crate::peer::Peer;
use crate::status::{MtuOutcome, NodeStatus, PeerKind, PeerStatus};
use crate::topology::Topology;

/// A `last-seen` further than this in the future is clock skew.
pub const CLOCK_SKEW_SECS: i64 = 10;
/// A session older than this is dead (WireGuard rejects data after 180 s without a rekey).
pub const STALE_HANDSHAKE_SECS: i64 = 180;
/// Traffic that has gone this long without an answer is failing: WireGuard itself gives up on
/// a session and starts a new handshake once data has gone unanswered for keepalive (10 s) plus
/// rekey timeout (5 s). A busy link is answered far sooner, an idle one awaits nothing.
pub const UNANSWERED_SECS: i64 = 15;

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Something is broken: `kgctl diagnose` exits non-zero.
    Problem,
    /// Something is likely to break, or could not be checked.
    Warning,
    /// How things are, for the reader.
    Info,
}

/// One thing `kgctl diagnose` found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Finding {
    /// How bad it is.
    pub severity: Severity,
    /// Which check found it (`handshake`, `nat`, `path-mtu`, `ipip`, `routes`, `leader`,
    /// `clock`, `wireguard-ip`, `cidr-overlap`, `kg`…).
    pub check: String,
    /// What it is about: a node, a location, a Peer.
    pub subject: String,
    /// What is wrong (or how things are).
    pub message: String,
    /// What to do about it (empty for information).
    pub advice: String,
}

impl Finding {
    fn new(
        severity: Severity,
        check: &str,
        subject: impl Into<String>,
        message: impl Into<String>,
        advice: impl Into<String>,
    ) -> Self {
        Self {
            severity,
            check: check.to_string(),
            subject: subject.into(),
            message: message.into(),
            advice: advice.into(),
        }
    }
}

/// True when any finding is a problem.
pub fn has_problems(findings: &[Finding]) -> bool {
    findings.iter().any(|f| f.severity == Severity::Problem)
}

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
    lease_leaders: &BTreeMap<String, String>,
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
            let by_lease = lease_leaders.get(&s.location) == Some(&leader.name)
                && s.key.starts_with("location:");
            let reason = if by_lease && s.members.len() > 1 {
                "it holds the location's lease (--leader-election=lease)".to_string()
            } else {
                leader_reason(node, s.members.len())
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

fn endpoint_ip(endpoint: Option<&String>) -> Option<IpAddr> {
    endpoint?
        .parse::<std::net::SocketAddr>()
        .ok()
        .map(|e| e.ip())
}

/// Why a peer has no handshake, from what the node saw: refused handshakes from the peer's
/// addresses, or nothing received at all.
fn handshake_evidence(
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
fn answer_finding(
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
fn last_handshake(age: Option<i64>) -> String {
    match age {
        None => "no handshake has ever completed".to_string(),
        Some(age) => format!("the last handshake was {age} s ago"),
    }
}

/// The endpoint a peer's packets go to: the one in use, else the one kg configured.
fn endpoint_shown(peer: &PeerStatus) -> Option<&str> {
    peer.endpoint
        .as_deref()
        .or(peer.configured_endpoint.as_deref())
}

/// The port of `host:port` (`[v6]:port` too).
fn endpoint_port(endpoint: &str) -> Option<u16> {
    endpoint.rsplit_once(':')?.1.parse().ok()
}

/// What `remote`, the kg of a leader at the other end of one of this node's links, says about
/// this node: traffic it sent here that has gone unanswered for [`UNANSWERED_SECS`]. This node
/// may send nothing itself (a node that only answers), so only the other side can tell that
/// its packets no longer arrive.
pub fn remote_findings(status: &NodeStatus, remote: &NodeStatus, now_unix: i64) -> Vec<Finding> {
    if !remote.tracks_answers {
        return Vec::new();
    }
    remote
        .peers
        .iter()
        .filter(|p| p.leader == status.node)
        .filter_map(|p| {
            let secs = now_unix - p.unanswered_since_unix?;
            (secs >= UNANSWERED_SECS).then_some((p, secs))
        })
        .map(|(p, secs)| {
            let endpoint = endpoint_shown(p).unwrap_or("this node's endpoint");
            let both = status.peers.iter().any(|mine| {
                mine.leader == remote.node
                    && mine
                        .unanswered_since_unix
                        .is_some_and(|t| now_unix - t >= UNANSWERED_SECS)
            });
            Finding::new(
                Severity::Problem,
                "unanswered",
                format!("node {} → node {}", remote.node, status.node),
                format!(
                    "node {} has sent to this node at {endpoint} for {secs} s without an answer{}: its packets do not arrive here, or this node's answers do not arrive there",
                    remote.node,
                    if both { ", and this node's own traffic to it is unanswered too" } else { "" }
                ),
                format!(
                    "a firewall on this node or in front of it is likely dropping UDP port {}: check `iptables -S INPUT` / `nft list ruleset` here and any security group; allow UDP {} from {}",
                    status.port, status.port, remote.node
                ),
            )
        })
        .collect()
}

/// The findings about one node, from its kg's `status`. `nodes` are every Node, translated (to
/// name a segment's leader and its announced endpoint).
pub fn node_findings(status: &NodeStatus, nodes: &[Node], now_unix: i64) -> Vec<Finding> {
    let mut out = Vec::new();
    let me = format!("node {}", status.node);
    if status.location.is_empty() {
        out.push(Finding::new(
            Severity::Problem,
            "kg",
            me.clone(),
            "kg has no mesh for this node: the node is not ready",
            "a node needs spec.podCIDR, an endpoint and a key; check kg's log for the reason",
        ));
    } else if !status.leader {
        out.push(Finding::new(
            Severity::Info,
            "leader",
            me.clone(),
            format!(
                "it does not lead {}: its traffic to other locations goes through the leader",
                status.location
            ),
            "run kgctl diagnose on the leader to check the WireGuard links",
        ));
    }
    for peer in &status.peers {
        let subject = match peer.kind {
            PeerKind::Segment => format!("{} (leader {})", peer.name, peer.leader),
            PeerKind::Peer => format!("Peer {}", peer.name),
        };
        let mut addresses: Vec<IpAddr> = [
            endpoint_ip(peer.endpoint.as_ref()),
            endpoint_ip(peer.configured_endpoint.as_ref()),
        ]
        .into_iter()
        .flatten()
        .collect();
        if let Some(leader) = nodes.iter().find(|n| n.name == peer.leader) {
            addresses.extend(leader.endpoint.as_ref().and_then(|e| e.ip()));
            addresses.extend(leader.internal_ip.map(|i| i.addr()));
        }
        let owner = match peer.kind {
            PeerKind::Segment => format!("node {}", peer.leader),
            PeerKind::Peer => format!("Peer {}", peer.name),
        };
        let age = peer.last_handshake_unix.map(|t| now_unix - t);
        if status.tracks_answers {
            out.extend(answer_finding(
                status, peer, &subject, &addresses, &owner, now_unix,
            ));
        } else {
            match age {
                Some(age) if age <= STALE_HANDSHAKE_SECS => {}
                _ => {
                    let (evidence, advice) = handshake_evidence(status, peer, &addresses, &owner);
                    out.push(Finding::new(
                        Severity::Problem,
                        "handshake",
                        subject.clone(),
                        format!("{}: {evidence}", last_handshake(age)),
                        advice,
                    ));
                }
            }
        }
        if let (Some(used), Some(configured)) = (&peer.endpoint, &peer.configured_endpoint) {
            if used != configured {
                let (severity, advice) = if peer.persistent_keepalive == 0 {
                    (Severity::Warning, "set kilo.squat.ai/persistent-keepalive (e.g. 25) on the node behind NAT, or the NAT forgets the mapping when the link is idle")
                } else {
                    (Severity::Info, "")
                };
                out.push(Finding::new(
                    severity,
                    "nat",
                    subject.clone(),
                    format!("a NAT is in the path: packets come from {used}, the announced endpoint is {configured}{}", if peer.persistent_keepalive == 0 { ", and no keepalive is set" } else { "" }),
                    advice,
                ));
            }
        }
    }
    let known: Vec<&str> = status.peers.iter().map(|p| p.public_key.as_str()).collect();
    for r in status
        .rejected_handshakes
        .iter()
        .filter(|r| r.public_key.as_deref().is_none_or(|k| !known.contains(&k)))
        .filter(|r| now_unix - r.at_unix <= STALE_HANDSHAKE_SECS)
    {
        if out
            .iter()
            .any(|f| f.check == "handshake" && f.message.contains(&r.from))
        {
            continue; // named in that peer's handshake finding
        }
        out.push(Finding::new(
            Severity::Warning,
            "handshake",
            format!("{} ({})", r.from, r.reason),
            format!(
                "this node refused handshakes from {} ({}) {} s ago",
                r.from,
                r.reason,
                now_unix - r.at_unix
            ),
            "a device there uses a key this node does not know, or the wrong key for this node",
        ));
    }
    match (&status.drift, &status.drift_error) {
        (Some(lines), _) if !lines.is_empty() => out.push(Finding::new(
            Severity::Problem,
            "routes",
            me.clone(),
            format!("the host lacks what kg installs:\n{}", lines.join("\n")),
            "kg restores these at its next resync (--resync-period); if they keep disappearing, another program on the host removes them",
        )),
        (None, Some(e)) => out.push(Finding::new(
            Severity::Warning,
            "routes",
            me.clone(),
            format!("the routes, rules and iptables rules could not be listed: {e}"),
            "",
        )),
        _ => {}
    }
    for e in &status.errors {
        out.push(Finding::new(
            Severity::Problem,
            "kg",
            me.clone(),
            format!("a recent reconcile failed: {e}"),
            "see kg's log around this error",
        ));
    }
    for w in &status.withheld {
        out.push(Finding::new(
            Severity::Warning,
            "routes",
            me.clone(),
            w.clone(),
            "the CIDR covers a network this node is connected to: fix the annotation that announces it",
        ));
    }
    if let Some(probes) = &status.probes {
        for p in &probes.path_mtu {
            let overhead = p.needed.saturating_sub(status.mtu);
            let message = match p.outcome {
                MtuOutcome::Fits => continue,
                MtuOutcome::Smaller { path_mtu } if path_mtu >= p.needed => continue,
                MtuOutcome::Smaller { path_mtu } => format!(
                    "the path to {} carries at most {path_mtu} bytes, but WireGuard sends up to {} (MTU {} plus {overhead} of headers): large packets are fragmented or lost",
                    p.endpoint, p.needed, status.mtu
                ),
                MtuOutcome::BlackHole => format!(
                    "small packets reach {} but packets of {} bytes (MTU {} plus {overhead} of headers) vanish, and no router says why: a path-MTU black hole",
                    p.endpoint, p.needed, status.mtu
                ),
                MtuOutcome::NoAnswer => {
                    out.push(Finding::new(
                        Severity::Info,
                        "path-mtu",
                        p.peer.clone(),
                        format!("{} does not answer ICMP echo: its path MTU was not measured", p.endpoint),
                        "",
                    ));
                    continue;
                }
            };
            let fix = match p.outcome {
                MtuOutcome::Smaller { path_mtu } => format!(
                    "run kg with --mtu={} (or lower), or raise the MTU of the links on the path",
                    path_mtu.saturating_sub(overhead)
                ),
                _ => "lower kg's --mtu until large packets pass, or let ICMP \"fragmentation needed\" through".into(),
            };
            out.push(Finding::new(
                Severity::Problem,
                "path-mtu",
                p.peer.clone(),
                message,
                fix,
            ));
        }
        for p in &probes.ipip {
            let subject = format!("node {}", p.node);
            if !p.plain {
                out.push(Finding::new(
                    Severity::Warning,
                    "ipip",
                    subject,
                    format!(
                        "{} does not answer ICMP echo: IPIP to it was not checked",
                        p.private_ip
                    ),
                    "",
                ));
            } else if !p.encapsulated {
                out.push(Finding::new(
                    Severity::Problem,
                    "ipip",
                    subject,
                    format!(
                        "{} answers, but {} behind it does not through the IPIP tunnel ({}): IP protocol 4 is blocked between the two",
                        p.private_ip,
                        p.target,
                        status.tunnel.as_deref().unwrap_or("tunnel")
                    ),
                    "allow IP protocol 4 (IPIP) between the nodes of the location (firewall, security group), or run kg with --encapsulate=never (or crosssubnet)",
                ));
            }
        }
    }
    out
}

#[cfg(test)]
#[path = "diagnosis/tests.rs"]
mod tests;
