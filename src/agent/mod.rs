//! The `kg` agent: watches the backend, computes Kilo's topology, and drives the WireGuard
//! device, the link and the routes. I/O lives here and in the modules below; every decision is
//! made by the pure `control` crate.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use control::dns::{Answer, DnsBook};
use control::nat::discover_nat_endpoints;
use control::node::{annotation, Node, WrittenAnnotations};
use control::routes::{diff, Encapsulate, Links, RouteOptions, RoutePlan};
use control::{translate_node, translate_peer, Key, Peer, Topology, TopologyParams};
use dataplane::{DeviceConfig, InterfaceConfig, SecretKey};
use hickory_resolver::TokioResolver;
use tokio::sync::watch;

use crate::backend::{file::FileBackend, kube::KubeBackend, Backend, Snapshot};
use args::{BackendKind, Settings};
use local::ProblemLog;
use metrics::Metrics;
use netlink::Netlink;
use wireguard::WireGuard;

pub mod args;
mod cni;
pub mod encap;
mod host;
pub mod http;
pub mod ipdetect;
pub mod iptables;
pub mod keyfile;
pub mod local;
pub mod metrics;
pub mod netlink;
pub mod state;
pub mod wireguard;
pub mod xtables;

/// How often kg refreshes its own `last-seen` (Kilo's fixed check-in period).
pub const CHECK_IN_PERIOD: Duration = Duration::from_secs(30);
/// How long one DNS lookup may take.
pub const DNS_TIMEOUT: Duration = Duration::from_secs(3);
/// The MTU used when the default route's cannot be read.
pub const DEFAULT_MTU: u32 = 1420;
/// WireGuard's overhead, subtracted by `--mtu=auto`.
pub const WIREGUARD_OVERHEAD: u32 = 80;

/// Maps Kilo's `--log-level` to a tracing filter.
pub fn log_filter(level: &str) -> Option<&'static str> {
    Some(match level {
        "all" => "trace",
        "debug" => "debug",
        "info" => "info",
        "warn" => "warn",
        "error" => "error",
        "none" => "off",
        _ => return None,
    })
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// The running agent.
pub struct Agent {
    s: Settings,
    key: SecretKey,
    public: Key,
    backend: Backend,
    netlink: Netlink,
    wg: Arc<WireGuard>,
    kilo_index: u32,
    resolver: Option<TokioResolver>,
    dns: DnsBook,
    hostname_ips: Vec<IpAddr>,
    owned: RoutePlan,
    problems: ProblemLog,
    discovered: BTreeMap<Key, SocketAddr>,
    warned: BTreeMap<&'static str, bool>,
    /// Kilo's metrics and kilotun's own.
    pub metrics: Arc<Metrics>,
    /// The DOT graph of the last topology, for `/graph`.
    pub graph: Arc<parking_lot::Mutex<Option<String>>>,
    ip6tables: bool,
    tunnel: encap::Tunnel,
    readiness: control::readiness::ReadinessClock,
    patch_failed: bool,
}

impl Agent {
    /// Loads the key, connects the backend, creates or finds the interface.
    pub async fn start(s: Settings) -> Result<Self> {
        let key = keyfile::load_or_generate(&s.args.key_file)?;
        let public = Key(*key.public_key().as_bytes());
        let backend = match s.args.backend {
            BackendKind::File => {
                let backend = FileBackend::open(Path::new(&s.args.cluster_dir))?;
                backend.spawn_poller();
                Backend::File(backend)
            }
            BackendKind::Kubernetes => {
                let config =
                    crate::backend::kube::client_config(&s.args.kubeconfig, &s.args.master).await?;
                Backend::Kube(KubeBackend::start(config)?)
            }
        };
        let netlink = Netlink::connect()?;
        let threads = s
            .args
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let wg = if s.args.create_interface {
            WireGuard::embedded(&s.args.interface, threads, &s.args.socket_dir, true)?
        } else {
            WireGuard::uapi(&s.args.interface, &s.args.socket_dir)?
        };
        let kilo_index = netlink
            .link_by_name(&s.args.interface)
            .await?
            .with_context(|| format!("failed to get interface index of {}", s.args.interface))?
            .index;
        // Start with our key and port, so `wg show` is meaningful before the first reconcile.
        wg.apply(&DeviceConfig {
            interface: InterfaceConfig {
                private_key: Some(key.clone()),
                listen_port: s.args.port,
                fwmark: 0,
            },
            peers: Vec::new(),
        })?;
        // Restore the peers of the last run before anything else: after a crash the persistent
        // link still has its addresses and routes, so traffic flows again as soon as the peers
        // are back, without waiting for the backend.
        match state::load(&s.args.key_file, &key) {
            Ok(Some(restored)) => {
                let peers = restored.peers.len();
                wg.apply(&restored)?;
                tracing::info!(peers, "restored the WireGuard peers of the last run");
            }
            Ok(None) => {}
            Err(e) => tracing::warn!(
                error = format!("{e:#}"),
                "ignoring the saved state of the last run"
            ),
        }
        let resolver = match TokioResolver::builder_tokio() {
            Ok(mut builder) => {
                builder.options_mut().cache_size = 0;
                builder.options_mut().timeout = DNS_TIMEOUT;
                builder.options_mut().attempts = 1;
                builder.build().ok()
            }
            Err(e) => {
                tracing::warn!(error = %e, "no DNS configuration; DNS endpoints will not resolve");
                None
            }
        };
        let hostname_ips = match tokio::time::timeout(
            Duration::from_secs(1),
            tokio::net::lookup_host((s.hostname.as_str(), 0)),
        )
        .await
        {
            Ok(Ok(addrs)) => addrs.map(|a| a.ip()).collect(),
            _ => s.hostname.parse::<IpAddr>().into_iter().collect(),
        };
        xtables::select(s.args.iptables_backend)?;
        let ip6tables = iptables::v6_available();
        let tunnel = encap::Tunnel::choose(&netlink, s.encapsulate, s.compatibility).await?;
        tracing::info!(node = %s.hostname, interface = %s.args.interface, public_key = %public, "kg started");
        Ok(Self {
            dns: DnsBook::new(s.resync),
            s,
            key,
            public,
            backend,
            netlink,
            wg: Arc::new(wg),
            kilo_index,
            resolver,
            hostname_ips,
            owned: RoutePlan::default(),
            problems: ProblemLog::default(),
            discovered: BTreeMap::new(),
            warned: BTreeMap::new(),
            metrics: Arc::new(Metrics::new()),
            graph: Arc::new(parking_lot::Mutex::new(None)),
            ip6tables,
            tunnel,
            readiness: Default::default(),
            patch_failed: false,
        })
    }

    /// Snapshots from the backend.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.backend.subscribe()
    }

    /// True when DNS lookups are due.
    pub fn dns_due(&self) -> bool {
        !self.dns.due(Instant::now()).is_empty()
    }

    fn warn_once(&mut self, what: &'static str, message: &str) {
        if !self.warned.insert(what, true).unwrap_or(false) {
            tracing::warn!("{message}");
        }
    }

    /// Re-resolves the DNS names that are due; a failure keeps the last good address.
    async fn resolve_due(&mut self) {
        let now = Instant::now();
        let due = self.dns.due(now);
        let Some(resolver) = self.resolver.clone() else {
            return;
        };
        let lookups =
            due.into_iter().map(|name| {
                let resolver = resolver.clone();
                async move {
                    let result =
                        match tokio::time::timeout(DNS_TIMEOUT, resolver.lookup_ip(name.as_str()))
                            .await
                        {
                            Ok(Ok(ips)) => {
                                let mut ips: Vec<IpAddr> = ips.iter().collect();
                                ips.sort_by_key(|ip| ip.is_ipv6());
                                ips.first().copied().ok_or_else(|| "no address".to_string())
                            }
                            Ok(Err(e)) => Err(e.to_string()),
                            Err(_) => Err("timed out".to_string()),
                        };
                    (name, result)
                }
            });
        for (name, result) in futures::future::join_all(lookups).await {
            let error = result.as_ref().err().cloned();
            match self.dns.record(&name, result, Instant::now()) {
                Answer::Changed { old, new } => {
                    tracing::info!(name = %name, ?old, %new, "DNS endpoint resolved")
                }
                Answer::Failed { kept } => {
                    self.metrics.dns_failures.inc();
                    tracing::warn!(name = %name, error = error.unwrap_or_default(), ?kept, "DNS lookup failed; keeping the last good address");
                }
                Answer::Unchanged | Answer::Untracked => {}
            }
        }
    }

    /// One full reconcile: translate, resolve, compute, apply, publish.
    pub async fn reconcile(&mut self, snapshot: &Snapshot, check_in: bool) -> Result<()> {
        self.metrics.reconciles.inc();
        let now_unix = unix_now();
        let hostname = self.s.hostname.clone();

        let mut nodes: Vec<Node> = Vec::with_capacity(snapshot.nodes.len());
        for (name, object) in &snapshot.nodes {
            let (node, problems) = translate_node(object, &self.s.args.topology_label);
            for line in self.problems.fresh(name, &problems) {
                tracing::warn!("bad annotation on node {line}");
            }
            nodes.push(node);
        }
        let mut peers: Vec<Peer> = Vec::with_capacity(snapshot.peers.len());
        for (name, object) in &snapshot.peers {
            let lines = match object.validate() {
                Ok(()) => {
                    peers.push(translate_peer(object));
                    Vec::new()
                }
                Err(e) => vec![format!("{name}: {e}; ignoring this Peer")],
            };
            for line in self.problems.fresh_lines(&format!("peer/{name}"), lines) {
                tracing::warn!("bad Peer {line}");
            }
        }

        let local_object = snapshot.nodes.get(&hostname);
        let (detected, default_link) = self.detect(local_object).await?;
        let empty = BTreeMap::new();
        let local_annotations = local_object
            .and_then(|o| o.metadata.annotations.as_ref())
            .unwrap_or(&empty);
        let index = match nodes.iter().position(|n| n.name == hostname) {
            Some(i) => i,
            None => {
                nodes.push(Node {
                    name: hostname.clone(),
                    ..Default::default()
                });
                nodes.len() - 1
            }
        };
        {
            let local = &mut nodes[index];
            local::fill_local(
                local,
                local_annotations,
                &detected,
                self.s.args.prioritise_private_addresses,
                self.s.args.port,
            );
            local.key = Some(self.public);
            local.last_seen = now_unix;
            local.granularity = Some(self.s.granularity);
            local.discovered_endpoints = self.discovered.clone();
        }
        let local = nodes[index].clone();

        // DNS endpoints: track every name in use, resolve what is due, fill in addresses.
        let names: Vec<String> = nodes
            .iter()
            .filter_map(|n| n.endpoint.as_ref()?.dns_name().map(str::to_string))
            .chain(
                peers
                    .iter()
                    .filter_map(|p| p.endpoint.as_ref()?.dns_name().map(str::to_string)),
            )
            .collect();
        self.dns
            .track(names.iter().map(String::as_str), Instant::now());
        self.resolve_due().await;
        for e in nodes
            .iter_mut()
            .filter_map(|n| n.endpoint.as_mut())
            .chain(peers.iter_mut().filter_map(|p| p.endpoint.as_mut()))
        {
            self.dns.fill(e);
        }

        let healthy = self.backend.healthy() && !self.patch_failed;
        let was_frozen = self.readiness.is_frozen();
        let grace = (CHECK_IN_PERIOD + self.s.resync).as_secs() as i64;
        self.readiness.observe(now_unix, healthy, grace);
        if self.readiness.is_frozen() != was_frozen {
            if was_frozen {
                tracing::info!("the backend is reachable again; judging check-ins by the clock");
            } else {
                tracing::warn!("the backend is unreachable; keeping the last good mesh (other nodes' check-ins are judged as of the last contact)");
            }
        }
        let readiness_now = self.readiness.now(now_unix);
        let ready_nodes: Vec<Node> = nodes
            .into_iter()
            .filter(|n| n.is_ready(readiness_now))
            .collect();
        let ready_peers: Vec<Peer> = peers.into_iter().filter(Peer::is_ready).collect();
        self.metrics.nodes.set(ready_nodes.len() as i64);
        self.metrics.peers.set(ready_peers.len() as i64);

        let topology = if ready_nodes.iter().any(|n| n.name == hostname) {
            let params = TopologyParams {
                granularity: self.s.granularity,
                hostname: hostname.clone(),
                port: local.endpoint.as_ref().map_or(self.s.args.port, |e| e.port),
                subnet: self.s.subnet,
                persistent_keepalive: local.persistent_keepalive,
            };
            Some(Topology::new(&ready_nodes, &ready_peers, &params)?)
        } else {
            self.warn_once("local-not-ready", &format!("node {hostname} is not ready (it needs spec.podCIDR); not configuring the mesh yet"));
            None
        };

        if let Some(t) = &topology {
            *self.graph.lock() = Some(t.dot());
            for d in &t.dropped {
                for line in self.problems.fresh_lines(
                    &format!("dropped/{}/{}", d.owner, d.cidr),
                    vec![format!("{}: {} dropped: {}", d.owner, d.cidr, d.reason)],
                ) {
                    tracing::warn!("{line}");
                }
            }
            self.apply(t, &ready_nodes, &ready_peers, default_link)
                .await?;
        }

        let current_last_seen = local_annotations
            .get(annotation::LAST_SEEN)
            .and_then(|v| v.parse::<i64>().ok());
        let last_seen = match current_last_seen {
            Some(v) if !check_in && now_unix - v < CHECK_IN_PERIOD.as_secs() as i64 => v,
            _ => now_unix,
        };
        let written = WrittenAnnotations {
            endpoint: local.endpoint.clone(),
            internal_ip: local.internal_ip,
            key: self.public,
            last_seen,
            wireguard_ip: topology
                .as_ref()
                .filter(|t| t.leader)
                .map(|t| t.wireguard_cidr),
            discovered_endpoints: self.discovered.clone(),
            granularity: self.s.granularity,
            cni_compatibility_ip: self.cni_compatibility_ip().await?,
        };
        let changes = local::annotation_changes(local_annotations, &written);
        if !changes.is_empty() {
            let patched = self.backend.patch_annotations(&hostname, &changes).await;
            self.patch_failed = patched.is_err();
            patched?;
        }
        Ok(())
    }

    async fn apply(
        &mut self,
        t: &Topology,
        nodes: &[Node],
        peers: &[Peer],
        default_link: Option<u32>,
    ) -> Result<()> {
        let kilo = self.kilo_index;
        let mtu = self.mtu(default_link).await?;
        let link = self
            .netlink
            .links()
            .await?
            .into_iter()
            .find(|l| l.index == kilo);
        if link.as_ref().is_some_and(|l| l.mtu != mtu) {
            self.netlink.set_mtu(kilo, mtu).await?;
        }
        if self.s.args.cni {
            self.sync_cni(t.subnet, mtu);
        }
        self.metrics.leader.set(i64::from(t.leader));
        let desired = if t.leader {
            crate::wiring::device_config(&t.conf(Some(&self.public)), &self.key)
        } else {
            DeviceConfig {
                interface: InterfaceConfig {
                    private_key: Some(self.key.clone()),
                    listen_port: t.port,
                    fwmark: 0,
                },
                peers: Vec::new(),
            }
        };
        if self.wg.apply(&desired)? {
            tracing::info!(
                leader = t.leader,
                peers = desired.peers.len(),
                "WireGuard configuration applied"
            );
            if let Err(e) = state::save(&self.s.args.key_file, &desired) {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "saving the WireGuard state failed"
                );
            }
        }
        if t.leader {
            self.netlink
                .set_address(kilo, Some(t.wireguard_cidr))
                .await?;
        } else {
            self.netlink.set_address(kilo, None).await?;
        }
        if link.as_ref().is_none_or(|l| l.up != t.leader) {
            self.netlink.set_up(kilo, t.leader).await?;
        }

        self.discovered = discover_nat_endpoints(&self.wg.device_peers()?, nodes, peers);

        let private = self.private_link(t.private_ip).await?;
        let private_mtu = self
            .netlink
            .links()
            .await?
            .iter()
            .find(|l| l.index == private && private != 0)
            .map(|l| l.mtu);
        let tunnel = self
            .tunnel
            .prepare(&self.netlink, t.subnet, private_mtu)
            .await?;
        let encapsulate = match (self.tunnel.name(), tunnel) {
            (Some(_), Some(_)) => self.s.encapsulate,
            (Some(name), None) => {
                let message = format!("the tunnel link {name} does not exist (yet); routing inside the location without encapsulation");
                self.warn_once("tunnel-missing", &message);
                Encapsulate::Never
            }
            (None, _) => Encapsulate::Never,
        };
        let options = RouteOptions {
            kilo_name: self.s.args.interface.clone(),
            links: Links {
                kilo,
                private,
                tunnel: tunnel.unwrap_or(0),
            },
            local: self.s.args.local,
            encapsulate,
            compatibility: self.s.compatibility,
        };
        let plan = t.route_plan(&options);
        if let Some(index) = tunnel {
            self.tunnel.update(&plan, index, t);
        }
        let observed = self.netlink.observe().await?;
        let ops = diff(&plan, &observed, &self.owned, kilo);
        if !ops.is_empty() {
            tracing::debug!(changes = ops.len(), "reconciling routes");
        }
        let errors = self.netlink.apply(&ops).await;
        for e in &errors {
            tracing::warn!(error = format!("{e:#}"), "route change failed");
        }
        self.owned = plan;
        let rules = t.iptables_rules(&control::iptables::IptablesOptions {
            cni: self.s.args.cni,
            forward_rules: self.s.args.iptables_forward_rules,
            service_cidrs: self.s.service_cidrs.clone(),
            ipip: self.tunnel.is_ipip() && self.s.args.local && encapsulate != Encapsulate::Never,
        });
        let v6 = self.ip6tables;
        match tokio::task::spawn_blocking(move || iptables::reconcile(&rules, v6)).await? {
            Ok(true) => tracing::debug!("iptables rules reconciled"),
            Ok(false) => {}
            Err(e) => {
                self.metrics.error("apply");
                tracing::warn!(error = format!("{e:#}"), "applying iptables rules failed");
            }
        }
        Ok(())
    }

    /// Undoes what kg set up: routes and rules, the annotations it wrote (with `--clean-up`),
    /// and the engine.
    pub async fn shut_down(self) {
        if self.s.args.clean_up {
            let v6 = self.ip6tables;
            match tokio::task::spawn_blocking(move || iptables::clean_up(v6)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = format!("{e:#}"), "removing iptables rules failed")
                }
                Err(e) => tracing::warn!(error = %e, "removing iptables rules failed"),
            }
            if let Ok(observed) = self.netlink.observe().await {
                let ops = diff(
                    &RoutePlan::default(),
                    &observed,
                    &self.owned,
                    self.kilo_index,
                );
                for e in self.netlink.apply(&ops).await {
                    tracing::warn!(error = format!("{e:#}"), "removing a route failed");
                }
            }
            let removal: BTreeMap<String, Option<String>> = annotation::WRITTEN
                .iter()
                .filter(|a| **a != annotation::CNI_COMPATIBILITY_IP)
                .map(|a| (a.to_string(), None))
                .collect();
            if let Err(e) = self
                .backend
                .patch_annotations(&self.s.hostname, &removal)
                .await
            {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "removing the node's annotations failed"
                );
            }
        }
        let index = self.kilo_index;
        let wg = match Arc::try_unwrap(self.wg) {
            Ok(wg) => wg,
            Err(_) => return, // the HTTP server still holds it; the process is exiting anyway
        };
        if wg.shutdown(self.s.args.clean_up_interface) {
            if let Err(e) = self.netlink.delete_link(index).await {
                tracing::warn!(error = format!("{e:#}"), "deleting the interface failed");
            }
        }
    }
}

/// Replaces `path` with `text` (mode `mode`) through a temporary file and a rename.
fn write_file(path: &Path, text: &str, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.kg.tmp"));
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode))?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    Ok(())
}

/// Runs kg until SIGINT or SIGTERM.
pub async fn run(settings: Settings) -> Result<()> {
    let resync = settings.resync;
    let listen = settings.args.listen.clone();
    let mut agent = Agent::start(settings).await?;
    let state = http::HttpState {
        metrics: Arc::clone(&agent.metrics),
        wg: Arc::clone(&agent.wg),
        graph: Arc::clone(&agent.graph),
    };
    let bound = http::serve(&listen, state).await?;
    tracing::info!(address = %bound, "serving /health, /metrics and /graph");
    let mut snapshots = agent.subscribe();
    let mut resync_timer = tokio::time::interval(resync);
    let mut check_in_timer = tokio::time::interval(CHECK_IN_PERIOD);
    let mut dns_timer = tokio::time::interval(Duration::from_secs(1));
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let mut check_in = false;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
            changed = snapshots.changed() => if changed.is_err() { break },
            _ = resync_timer.tick() => {}
            _ = check_in_timer.tick() => check_in = true,
            _ = dns_timer.tick() => if !agent.dns_due() { continue },
        }
        let snapshot = snapshots.borrow_and_update().clone();
        tracing::trace!(check_in, "reconcile");
        if let Err(e) = agent.reconcile(&snapshot, check_in).await {
            agent.metrics.error("apply");
            tracing::warn!(error = format!("{e:#}"), "reconcile failed");
        }
    }
    tracing::info!("shutting down");
    agent.shut_down().await;
    Ok(())
}
