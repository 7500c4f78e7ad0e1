//! The findings about one node, from the [`NodeStatus`] its kg reports (its links, NAT, drift
//! of routes and rules, path MTU, IPIP), and from what the kg at the other end of its links
//! reports about it.

use std::net::IpAddr;

use super::evidence::{
    answer_finding, endpoint_ip, endpoint_shown, handshake_evidence, last_handshake,
};
use super::{Finding, Severity, STALE_HANDSHAKE_SECS, UNANSWERED_SECS};
use crate::node::Node;
use crate::status::{MtuOutcome, NodeStatus, PeerKind, PeerStatus};

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

/// How the findings name a WireGuard peer: a segment by its key and leader, or a Peer.
pub(super) fn peer_subject(peer: &PeerStatus) -> String {
    match peer.kind {
        PeerKind::Segment => format!("{} (leader {})", peer.name, peer.leader),
        PeerKind::Peer => format!("Peer {}", peer.name),
    }
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
        let subject = peer_subject(peer);
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
    out.extend(super::keys::key_findings(status, now_unix));
    out.extend(super::candidates::candidate_findings(status));
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
