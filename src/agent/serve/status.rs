//! `/status`: this node as kg sees it, for `kgctl diagnose`. The reconcile loop publishes what
//! it applied (a plain value, replaced after each apply); a request reads the engine's live
//! state, lists the kernel and iptables once to compare them with what kg installs, and, with
//! `probe=true`, probes the paths to the peers. Nothing here runs unless asked.

use std::collections::{BTreeMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use control::iptables::RuleSet;
use control::journal::Event;
use control::routes::{diff, Encapsulate, RoutePlan};
use control::status::{
    NodeStatus, PeerKind, PeerStatus, PqLinkStatus, PqState, Probes, RejectedHandshakeStatus,
    EVENTS_KEPT,
};
use control::Topology;
use parking_lot::Mutex;

use super::probe;
use super::route_lines::describe;
use crate::agent::shells::wireguard::WireGuard;
use crate::agent::shells::{Firewall, Kernel};

/// How many reconcile errors `/status` keeps.
pub const ERRORS_KEPT: usize = 8;
/// At most this many peers are probed in one request.
pub const PROBED_PEERS: usize = 64;

/// What the reconcile loop last applied, as `/status` reports it.
#[derive(Debug, Clone, Default)]
pub struct Published {
    /// The node's name.
    pub node: String,
    /// The WireGuard interface.
    pub interface: String,
    /// `--mesh-granularity`.
    pub granularity: String,
    /// The last topology applied (`None` while the node is not ready).
    pub topology: Option<Arc<Topology>>,
    /// `--encapsulate` in effect.
    pub encapsulate: Encapsulate,
    /// The tunnel link's name, when there is one.
    pub tunnel: Option<String>,
    /// The WireGuard interface's MTU.
    pub mtu: u32,
    /// The WireGuard interface's index.
    pub kilo_index: u32,
    /// The routes and rules kg installs.
    pub plan: RoutePlan,
    /// The iptables rules kg installs (`None` before the first apply).
    pub rules: Option<RuleSet>,
    /// The CIDRs withheld from routing, described.
    pub withheld: Vec<String>,
    /// Recent reconcile errors, oldest first.
    pub errors: VecDeque<String>,
    /// The agent's recent events, oldest first (the last [`EVENTS_KEPT`]).
    pub events: VecDeque<Event>,
    /// How far the engine is from carrying traffic (`/ready`).
    pub engine: EngineReadiness,
    /// With `--post-quantum`: the state of each link that takes part, by the peer's public key
    /// (base64).
    pub post_quantum: Option<BTreeMap<String, PqLinkStatus>>,
    /// The endpoint candidates of each leader that publishes them, by its public key
    /// (base64).
    pub candidates: BTreeMap<String, control::status::CandidatesStatus>,
}

/// How far this kg's engine is from carrying traffic, as `/ready` answers it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EngineReadiness {
    /// The engine runs with no peers yet: neither the last run's nor a reconcile's.
    #[default]
    Unconfigured,
    /// The last run's peers are back; no reconcile has configured the engine yet.
    Restored {
        /// How many peers were restored.
        peers: usize,
    },
    /// A reconcile configured the engine.
    Configured,
}

impl EngineReadiness {
    /// Whether the node is ready to carry traffic, and a line saying why or why not.
    pub fn answer(self) -> (bool, String) {
        match self {
            Self::Unconfigured => (
                false,
                "the engine runs but has no configuration yet: no saved peers were restored and no reconcile has configured it (see /status for its errors)".to_string(),
            ),
            Self::Restored { peers } => (
                true,
                format!("the engine carries the {peers} peers of the last run; no reconcile has configured it yet"),
            ),
            Self::Configured => (true, "the engine carries the configuration of the last reconcile".to_string()),
        }
    }
}

/// The published value, shared by the reconcile loop (writer) and the HTTP server (reader).
#[derive(Debug, Default)]
pub struct StatusBoard(Mutex<Published>);

impl StatusBoard {
    /// Changes the published value in place.
    pub fn update(&self, change: impl FnOnce(&mut Published)) {
        change(&mut self.0.lock());
    }

    /// Records a reconcile error, keeping the last [`ERRORS_KEPT`].
    pub fn error(&self, message: String) {
        let mut published = self.0.lock();
        if published.errors.len() == ERRORS_KEPT {
            published.errors.pop_front();
        }
        published.errors.push_back(message);
    }

    /// Keeps `events`, dropping the oldest beyond [`EVENTS_KEPT`].
    pub fn events(&self, events: Vec<Event>) {
        let mut published = self.0.lock();
        published.events.extend(events);
        let excess = published.events.len().saturating_sub(EVENTS_KEPT);
        published.events.drain(..excess);
    }

    /// How far the engine is from carrying traffic.
    pub fn engine(&self) -> EngineReadiness {
        self.0.lock().engine
    }

    /// A copy of the published value.
    pub fn snapshot(&self) -> Published {
        self.0.lock().clone()
    }
}

/// Unix seconds of `at`.
fn unix(at: std::time::SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// Names each WireGuard peer of `t` by its public key: (kind, name, leader).
fn peer_names(t: &Topology) -> BTreeMap<String, (PeerKind, String, String)> {
    let mut names = BTreeMap::new();
    for s in t.segments.iter().filter(|s| !t.in_local_location(s)) {
        names.insert(
            s.public_key.to_string(),
            (
                PeerKind::Segment,
                s.key.clone(),
                s.leader_member().name.clone(),
            ),
        );
    }
    for p in &t.peers {
        if let Some(key) = p.public_key {
            names.insert(
                key.to_string(),
                (PeerKind::Peer, p.name.clone(), String::new()),
            );
        }
    }
    names
}

/// Lists the kernel's routes and rules (through `kernel`) and the firewall's rules (through
/// `firewall`), and says what differs from `published`.
async fn drift(
    published: &Published,
    kernel: &impl Kernel,
    firewall: &impl Firewall,
) -> anyhow::Result<Vec<String>> {
    let observed = kernel.observe().await?;
    let names: BTreeMap<u32, String> = kernel
        .links()
        .await?
        .into_iter()
        .map(|l| (l.index, l.name))
        .collect();
    let ops = diff(
        &published.plan,
        &observed,
        &published.plan,
        published.kilo_index,
    );
    let mut lines: Vec<String> = ops.iter().map(|op| describe(op, &names)).collect();
    if let Some(rules) = published.rules.clone() {
        let firewall = firewall.clone();
        let drifted =
            tokio::task::spawn_blocking(move || firewall.drift(&rules, firewall.v6_available()))
                .await??;
        lines.extend(drifted);
    }
    Ok(lines)
}

/// The probes of `/status?probe=true`: the path MTU to every peer's endpoint and IPIP to every
/// other node of the location that is reached through the tunnel. Runs the probes in parallel.
fn run_probes(published: &Published, peers: &[PeerStatus]) -> Probes {
    let mut mtu_targets: Vec<(String, IpAddr)> = peers
        .iter()
        .filter_map(|p| {
            let endpoint = p.endpoint.as_ref().or(p.configured_endpoint.as_ref())?;
            let ip = endpoint.parse::<std::net::SocketAddr>().ok()?.ip();
            Some((p.name.clone(), ip))
        })
        .collect();
    mtu_targets.truncate(PROBED_PEERS);
    let mut ipip_targets = Vec::new();
    if let (Some(t), Some(_), true) = (
        published.topology.as_deref(),
        &published.tunnel,
        published.encapsulate != Encapsulate::Never,
    ) {
        let local_private = t.private_ip;
        for own in t.segments.iter().filter(|s| t.in_local_location(s)) {
            for m in own.members.iter().filter(|m| m.name != t.hostname) {
                let Some(private) = m.private_ip else {
                    continue;
                };
                let same_subnet = local_private.is_some_and(|l| l.contains(&private.addr()));
                if published.encapsulate == Encapsulate::CrossSubnet && same_subnet {
                    continue;
                }
                // IPIP carries IPv4 only: the member's IPv4 pod CIDR.
                let ipv4_pods = m.pod_cidrs().find(|n| n.addr().is_ipv4());
                let Some(target) = ipv4_pods.and_then(|n| n.hosts().next()) else {
                    continue;
                };
                ipip_targets.push((m.name.clone(), private.addr(), target));
            }
        }
    }
    ipip_targets.truncate(PROBED_PEERS);
    let mtu = published.mtu;
    std::thread::scope(|scope| {
        let mtu_runs: Vec<_> = mtu_targets
            .iter()
            .enumerate()
            .map(|(i, (name, ip))| {
                let needed = mtu + probe::WIREGUARD_DATA_OVERHEAD + probe::ip_header(*ip);
                scope.spawn(move || probe::path_mtu(name, *ip, needed, (i as u16) * 8))
            })
            .collect();
        let ipip_runs: Vec<_> = ipip_targets
            .iter()
            .enumerate()
            .map(|(i, (name, private, target))| {
                scope.spawn(move || probe::ipip(name, *private, *target, 1024 + (i as u16) * 8))
            })
            .collect();
        Probes {
            path_mtu: mtu_runs.into_iter().filter_map(|h| h.join().ok()).collect(),
            ipip: ipip_runs
                .into_iter()
                .filter_map(|h| h.join().ok())
                .collect(),
        }
    })
}

/// A link that takes no part in post-quantum keys, on a node that does.
fn off(kind: PeerKind) -> PqLinkStatus {
    PqLinkStatus {
        state: PqState::Off,
        detail: match kind {
            PeerKind::Segment => "the other end publishes no kilotun.io/pq (Kilo's kg, or kg without --post-quantum): the link runs without a post-quantum key",
            PeerKind::Peer => "a Peer takes no part: the link runs with the Peer's own presharedKey, if any",
        }
        .to_string(),
        epoch: None,
        psk_changed_unix: None,
        fell_back_unix: None,
        falls_back: false,
        refused: BTreeMap::new(),
        last_refused: None,
    }
}

/// This node's status: the published value, the engine's live state, the drift of the host
/// (read through `kernel` and `firewall`, the agent's own shells) and, with `probe`, the path
/// probes.
pub async fn collect(
    board: &StatusBoard,
    wg: &Arc<WireGuard>,
    kernel: &impl Kernel,
    firewall: &impl Firewall,
    probe: bool,
) -> NodeStatus {
    let published = board.snapshot();
    let names = published
        .topology
        .as_deref()
        .map(peer_names)
        .unwrap_or_default();
    let engine = Arc::clone(wg);
    let tracks_answers = wg.is_embedded();
    let read = tokio::task::spawn_blocking(move || {
        (engine.read(), engine.drops(), engine.rejected_handshakes())
    })
    .await;
    let mut status = NodeStatus {
        node: published.node.clone(),
        location: published
            .topology
            .as_ref()
            .map(|t| t.location.clone())
            .unwrap_or_default(),
        leader: published.topology.as_ref().is_some_and(|t| t.leader),
        granularity: published.granularity.clone(),
        interface: published.interface.clone(),
        wireguard: wg.implementation().to_string(),
        mtu: published.mtu,
        port: published.topology.as_ref().map_or(0, |t| t.port),
        encapsulate: match published.encapsulate {
            Encapsulate::Never => "never",
            Encapsulate::CrossSubnet => "crosssubnet",
            Encapsulate::Always => "always",
        }
        .to_string(),
        tunnel: published.tunnel.clone(),
        withheld: published.withheld.clone(),
        errors: published.errors.iter().cloned().collect(),
        events: published.events.iter().cloned().collect(),
        tracks_answers,
        ..Default::default()
    };
    match read {
        Ok((Ok((config, stats)), drops, rejected)) => {
            for s in stats {
                let key = control::Key(*s.public_key.as_bytes()).to_string();
                let configured = config.peers.iter().find(|p| p.public_key == s.public_key);
                let (kind, name, leader) = names.get(&key).cloned().unwrap_or((
                    PeerKind::Peer,
                    String::new(),
                    String::new(),
                ));
                let candidates = published.candidates.get(&key).cloned();
                let post_quantum = published
                    .post_quantum
                    .as_ref()
                    .map(|links| links.get(&key).cloned().unwrap_or_else(|| off(kind)));
                status.peers.push(PeerStatus {
                    kind,
                    name,
                    leader,
                    public_key: key,
                    configured_endpoint: configured.and_then(|p| p.endpoint).map(|e| e.to_string()),
                    endpoint: s.endpoint.map(|e| e.to_string()),
                    persistent_keepalive: configured.map_or(0, |p| p.persistent_keepalive),
                    last_handshake_unix: s.last_handshake.map(unix),
                    unanswered_since_unix: s.unanswered_since.map(unix),
                    handshakes: s.handshakes,
                    handshake_failures: s.handshake_failures,
                    rx_bytes: s.rx_bytes,
                    tx_bytes: s.tx_bytes,
                    refused_responses: s.refused_responses,
                    unused_answers: s.unused_answers,
                    post_quantum,
                    candidates,
                });
            }
            status.drops = drops
                .into_iter()
                .filter(|(_, n)| *n > 0)
                .map(|(r, n)| (r.name().to_string(), n))
                .collect();
            status.rejected_handshakes = rejected
                .into_iter()
                .map(|r| RejectedHandshakeStatus {
                    reason: r.reason.name().to_string(),
                    from: r.from.to_string(),
                    public_key: r
                        .public_key
                        .map(|k| control::Key(*k.as_bytes()).to_string()),
                    at_unix: unix(r.at),
                })
                .collect();
        }
        Ok((Err(e), _, _)) => status
            .errors
            .push(format!("reading the WireGuard device: {e:#}")),
        Err(e) => status
            .errors
            .push(format!("reading the WireGuard device: {e}")),
    }
    match drift(&published, kernel, firewall).await {
        Ok(lines) => status.drift = Some(lines),
        Err(e) => status.drift_error = Some(format!("{e:#}")),
    }
    if probe {
        let peers = status.peers.clone();
        let publishedc = published.clone();
        status.probes = tokio::task::spawn_blocking(move || run_probes(&publishedc, &peers))
            .await
            .ok();
    }
    status
}

#[cfg(test)]
mod tests {
    use super::*;
    use control::routes::Route;

    #[tokio::test]
    async fn drift_is_read_through_the_agents_shells() {
        use crate::agent::shells::twins::{MemFirewall, MemKernel};
        let kernel = MemKernel::host("kilo0");
        let kilo = kernel
            .links()
            .await
            .unwrap()
            .into_iter()
            .find(|l| l.name == "kilo0")
            .unwrap()
            .index;
        let route = Route {
            table: 254,
            dst: "10.42.3.0/24".parse().unwrap(),
            gateway: None,
            link: kilo,
            src: None,
            onlink: false,
        };
        let firewall = MemFirewall::default();
        let mut published = Published {
            kilo_index: kilo,
            plan: RoutePlan {
                routes: [route].into_iter().collect(),
                ..Default::default()
            },
            rules: Some(RuleSet::default()),
            ..Default::default()
        };
        let lines = drift(&published, &kernel, &firewall).await.unwrap();
        assert_eq!(
            lines,
            [
                "missing or different: ip route replace 10.42.3.0/24 dev kilo0".to_string(),
                "the firewall holds none of kg's rules".to_string(),
            ]
        );
        // Once the host holds both, nothing drifted.
        kernel.set_routes(published.plan.clone());
        firewall.reconcile(&RuleSet::default(), None, true).unwrap();
        assert!(drift(&published, &kernel, &firewall)
            .await
            .unwrap()
            .is_empty());
        published.rules = None;
        assert!(drift(&published, &kernel, &firewall)
            .await
            .unwrap()
            .is_empty());
    }

    #[test]
    fn errors_keep_the_last_few() {
        let board = StatusBoard::default();
        for i in 0..ERRORS_KEPT + 3 {
            board.error(format!("e{i}"));
        }
        let errors = board.snapshot().errors;
        assert_eq!(errors.len(), ERRORS_KEPT);
        assert_eq!(errors.front().unwrap(), "e3");
    }
}
