//! The `kg` agent: watches the backend, computes Kilo's topology, and drives the WireGuard
//! device, the link and the routes. Every decision is made by the pure `control` crate.
//!
//! The tree reads by role:
//! - the pipeline, here: this loop, [`reconcile`] (snapshot → node table → topology → desired
//!   state, each stage a value compared with the last), [`apply`] (desired state → shells) and
//!   [`lease`] (leader election's side effects);
//! - [`shells`]: every adapter that talks to the kernel, a child process or a file, each behind
//!   a small trait, with their in-memory twins beside them;
//! - [`host`]: what kg learns from and sets up on its own node (its IP, links, MTU, tunnel);
//! - [`serve`]: what kg serves (HTTP, `/status`, metrics, path probes).
//!
//! Imports go one way: the pipeline uses the three folders, never the reverse.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use control::dns::{Answer, DnsBook};
use control::node::annotation;
use control::routes::{diff, RoutePlan};
use control::Key;
use dataplane::{DeviceConfig, InterfaceConfig, SecretKey};
use hickory_resolver::TokioResolver;
use tokio::sync::watch;

use crate::backend::{file::FileBackend, kube::KubeBackend, Backend, Snapshot};
use args::{BackendKind, Settings};
use host::{encap, local::ProblemLog};
use serve::{http, metrics::Metrics, status};
use shells::engine_lock::EngineLock;
use shells::netlink::Netlink;
use shells::wireguard::WireGuard;
use shells::{kernel_watch, keyfile, state};
use shells::{Engine, Firewall, Iptables, Kernel};

mod apply;
pub mod args;
pub mod host;
mod lease;
mod reconcile;
pub mod serve;
pub mod shells;
pub mod twin_agent;

/// How often kg refreshes its own `last-seen` (Kilo's fixed check-in period).
pub const CHECK_IN_PERIOD: Duration = Duration::from_secs(30);
/// How long one DNS lookup may take.
pub const DNS_TIMEOUT: Duration = Duration::from_secs(3);
/// Least time between two reconciles started for DNS lookups.
const DNS_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// How long kg lets a burst of kernel notifications settle before listing the host again.
pub const KERNEL_SETTLE: Duration = Duration::from_millis(200);

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

fn unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// What woke the reconcile loop. Only the resync timer and the kernel's own notifications list
/// the host again; anything else is compared against what kg last read and applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// A Node or Peer changed in the backend.
    Event,
    /// A DNS name is due for re-resolution.
    Dns,
    /// `--resync-period` elapsed: everything is listed and compared again.
    Resync,
    /// The check-in period elapsed: `last-seen` is refreshed.
    CheckIn,
    /// The kernel reported a change to addresses, protocol-static routes or rules.
    Kernel,
    /// The lease period elapsed: leaders are elected again and this node's lease tended.
    Lease,
}

impl Trigger {
    /// True when this reconcile lists the host (links, addresses, routes, rules, iptables, the
    /// device) instead of trusting what kg last read and applied.
    pub fn lists_the_host(self) -> bool {
        matches!(self, Self::Resync | Self::Kernel)
    }
}

/// The running agent, over the kernel `N`, the firewall `F` and the WireGuard device `W` (the
/// host's by default; in-memory twins in tests and benchmarks).
pub struct Agent<N = Netlink, F = Iptables, W = WireGuard> {
    s: Settings,
    key: SecretKey,
    public: Key,
    backend: Backend,
    netlink: N,
    firewall: F,
    wg: Arc<W>,
    kilo_index: u32,
    resolver: Option<TokioResolver>,
    dns: DnsBook,
    hostname_ips: Vec<IpAddr>,
    owned: RoutePlan,
    problems: ProblemLog,
    discovered: BTreeMap<Key, SocketAddr>,
    /// True once this node's own published `discovered-endpoints` were merged into
    /// `discovered` (at the first reconcile that sees its Node).
    discovery_seeded: bool,
    warned: BTreeMap<&'static str, bool>,
    /// Kilo's metrics and kilotun's own.
    pub metrics: Arc<Metrics>,
    /// The DOT graph of the last topology, for `/graph`.
    pub graph: Arc<parking_lot::Mutex<Option<String>>>,
    /// What kg last applied, for `/status`.
    pub status: Arc<status::StatusBoard>,
    ip6tables: bool,
    tunnel: encap::Tunnel,
    readiness: control::readiness::ReadinessClock,
    patch_failed: bool,
    /// The stages' last outputs, compared with the next ones.
    memo: reconcile::Memo,
}

/// The shells an [`Agent`] is built on.
pub struct Shells<N, F, W> {
    /// Links, addresses, routes and rules.
    pub kernel: N,
    /// iptables.
    pub firewall: F,
    /// The WireGuard device.
    pub engine: W,
}

impl Agent {
    /// Loads the key, connects the backend, creates or finds the interface.
    pub async fn start(s: Settings) -> Result<Self> {
        let key = keyfile::load_or_generate(&s.args.key_file)?;
        let backend = match s.args.backend {
            BackendKind::File => {
                let backend = FileBackend::open(Path::new(&s.args.cluster_dir))?;
                backend.spawn_poller();
                Backend::File(backend)
            }
            BackendKind::Kubernetes => {
                let config =
                    crate::backend::kube::client_config(&s.args.kubeconfig, &s.args.master).await?;
                Backend::Kube(KubeBackend::start(
                    config,
                    s.args.leader_election == args::LeaderElection::Lease,
                )?)
            }
        };
        let netlink = Netlink::connect()?;
        let threads = s
            .args
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        let wg = if s.args.create_interface {
            WireGuard::create(
                s.args.wireguard,
                &s.args.interface,
                threads,
                &s.args.socket_dir,
                &netlink,
            )
            .await?
        } else {
            WireGuard::uapi(&s.args.interface, &s.args.socket_dir)?
        };
        // Restore the peers of the last run before anything else: after a crash the persistent
        // link still has its addresses and routes, so traffic flows again as soon as the peers
        // are back, without waiting for the backend.
        let restored = match state::load(&s.args.key_file, &key) {
            Ok(restored) => restored,
            Err(e) => {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "ignoring the saved state of the last run"
                );
                None
            }
        };
        let shells = Shells {
            kernel: netlink,
            firewall: Iptables {
                mode: s.args.iptables_backend,
            },
            engine: wg,
        };
        Self::with_shells(s, key, backend, shells, restored).await
    }
}

impl<N: Kernel, F: Firewall, W: Engine> Agent<N, F, W> {
    /// Builds the agent on `shells`: finds the interface, sets the key and port (and the
    /// `restored` peers of the last run), picks the tunnel.
    pub async fn with_shells(
        s: Settings,
        key: SecretKey,
        backend: Backend,
        shells: Shells<N, F, W>,
        restored: Option<DeviceConfig>,
    ) -> Result<Self> {
        let Shells {
            kernel: netlink,
            firewall,
            engine: wg,
        } = shells;
        // The iptables back end is the host's, chosen once before the first rule is read; its
        // child processes run while the device is configured and the last run's peers restored.
        let preparing = {
            let firewall = firewall.clone();
            tokio::task::spawn_blocking(move || firewall.prepare())
        };
        let public = Key(*key.public_key().as_bytes());
        let kilo_index = netlink
            .link_by_name(&s.args.interface)
            .await?
            .with_context(|| format!("failed to get interface index of {}", s.args.interface))?
            .index;
        // Start with our key and port, so `wg show` is meaningful before the first reconcile.
        // The kg this one replaces may still be closing its sockets after it let go of the
        // engine lock: a port in use is tried again for a few seconds. A device that outlived
        // the last kg (the kernel's link, a userspace device over UAPI) keeps its peers here,
        // and with them their sessions: the restore and the first reconcile change only what
        // differs.
        let kept = match wg.configuration() {
            Ok(config) => config.peers,
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "reading the device's peers");
                Vec::new()
            }
        };
        let first = DeviceConfig {
            interface: InterfaceConfig {
                private_key: Some(key.clone()),
                listen_port: s.args.port,
                fwmark: 0,
            },
            peers: kept,
        };
        // (A kg of this version closes its engine before it lets go of the lock, so the port
        // is free at once; an older one, or a crashed one's lingering sockets, are waited for.)
        let asked = Instant::now();
        let deadline = asked + PORT_RELEASE_WAIT;
        let mut retries = 0u32;
        while let Err(e) = wg.apply(&first) {
            if !port_in_use(&e) || Instant::now() >= deadline {
                return Err(e.context(format!("listening on UDP port {}", s.args.port)));
            }
            retries += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if retries > 0 {
            tracing::info!(
                retries,
                waited_ms = asked.elapsed().as_millis() as u64,
                port = s.args.port,
                "waited for the UDP port to be released"
            );
        }
        // The node's own name is looked up meanwhile (it can take up to a second).
        let hostname = s.hostname.clone();
        let hostname_lookup = tokio::spawn(async move {
            match tokio::time::timeout(
                HOSTNAME_LOOKUP_TIMEOUT,
                tokio::net::lookup_host((hostname.as_str(), 0)),
            )
            .await
            {
                Ok(Ok(addrs)) => addrs.map(|a| a.ip()).collect(),
                _ => hostname.parse::<IpAddr>().into_iter().collect::<Vec<_>>(),
            }
        });
        // The endpoints the last run used, NAT-discovered ones among them: kept as discovered
        // until a handshake teaches newer ones (see `discover_nat_endpoints`), so the first
        // reconcile does not send the restored peers back to their announced addresses.
        let mut discovered = BTreeMap::new();
        if let Some(restored) = restored {
            discovered.extend(
                restored
                    .peers
                    .iter()
                    .filter_map(|p| Some((Key(*p.public_key.as_bytes()), p.endpoint?))),
            );
            let snapshot = backend.complete_within(RESTORE_WAIT).await;
            match stale_restore(&snapshot, &s) {
                Some(why) => {
                    tracing::info!("not restoring the WireGuard peers of the last run: {why}")
                }
                None => {
                    let peers = restored.peers.len();
                    wg.apply_and_handshake(&restored)?;
                    tracing::info!(peers, "restored the WireGuard peers of the last run");
                }
            }
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
        let hostname_ips = hostname_lookup
            .await
            .context("looking up the node's name")?;
        preparing.await.context("preparing the firewall")??;
        let tunnel =
            encap::Tunnel::choose(&netlink, s.encapsulate, s.compatibility, s.args.ipip).await?;
        tracing::info!(node = %s.hostname, interface = %s.args.interface, public_key = %public, version = crate::VERSION, "kg started");
        Ok(Self {
            dns: DnsBook::new(s.resync),
            memo: reconcile::Memo::new(&s.args.topology_label),
            ip6tables: firewall.v6_available(),
            s,
            key,
            public,
            backend,
            netlink,
            firewall,
            wg: Arc::new(wg),
            kilo_index,
            resolver,
            hostname_ips,
            owned: RoutePlan::default(),
            problems: ProblemLog::default(),
            discovered,
            discovery_seeded: false,
            warned: BTreeMap::new(),
            metrics: Arc::new(Metrics::new()),
            graph: Arc::new(parking_lot::Mutex::new(None)),
            status: Arc::new(status::StatusBoard::default()),
            tunnel,
            readiness: Default::default(),
            patch_failed: false,
        })
    }

    /// Snapshots from the backend.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.backend.subscribe()
    }

    /// True with `--leader-election=lease`.
    pub fn leases_on(&self) -> bool {
        self.s.args.leader_election == args::LeaderElection::Lease
    }

    /// When the next DNS lookup is due: `None` with no name to resolve (or no resolver), so
    /// the loop sets no timer for it.
    pub fn dns_deadline(&self) -> Option<Instant> {
        self.resolver.as_ref()?;
        self.dns.next_deadline()
    }

    fn warn_once(&mut self, what: &'static str, message: &str) {
        if !self.warned.insert(what, true).unwrap_or(false) {
            tracing::warn!("{message}");
        }
    }

    /// Re-resolves the DNS names that are due; a failure keeps the last good address. True
    /// when an address changed.
    async fn resolve_due(&mut self) -> bool {
        let now = Instant::now();
        let due = self.dns.due(now);
        if due.is_empty() {
            return false;
        }
        let Some(resolver) = self.resolver.clone() else {
            return false;
        };
        let mut changed = false;
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
                    changed = true;
                    tracing::info!(name = %name, ?old, %new, "DNS endpoint resolved")
                }
                Answer::Failed { kept } => {
                    self.metrics.dns_failures.inc();
                    tracing::warn!(name = %name, error = error.unwrap_or_default(), ?kept, "DNS lookup failed; keeping the last good address");
                }
                Answer::Unchanged | Answer::Untracked => {}
            }
        }
        changed
    }
}

impl Agent {
    /// Undoes what kg set up: routes and rules, the annotations it wrote (with `--clean-up`),
    /// and the engine. When another kg replaces this one (`--keep-on-replace` and a backend
    /// that says so), only the engine stops: the node keeps everything else for its successor.
    pub async fn shut_down(self) {
        let cleaning = self.s.args.clean_up || self.s.args.clean_up_interface;
        if cleaning && self.s.args.keep_on_replace {
            match self.backend.departure().await {
                crate::backend::Departure::Replaced { by } => {
                    tracing::info!(
                        "{by} replaces this kg: keeping the node's annotations, routes, rules and link for the next one"
                    );
                    return self.stop_engine(false).await;
                }
                crate::backend::Departure::Removed { why } => {
                    tracing::info!("cleaning up: {why}")
                }
            }
        }
        if self.s.args.clean_up {
            let v6 = self.ip6tables;
            let firewall = self.firewall;
            match tokio::task::spawn_blocking(move || firewall.clean_up(v6)).await {
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
                    &self.own_links(),
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
        if let Some(name) = self
            .tunnel
            .ipv6_outer()
            .filter(|_| self.s.args.clean_up_interface)
        {
            if let Ok(Some(link)) = self.netlink.link_by_name(name).await {
                if let Err(e) = self.netlink.delete_link(link.index).await {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        link = name,
                        "deleting the link failed"
                    );
                }
            }
        }
        let delete_link = self.s.args.clean_up_interface;
        self.stop_engine(delete_link).await;
    }

    /// Stops the engine, and deletes its link with `delete_link` when the link is its own.
    async fn stop_engine(self, delete_link: bool) {
        let index = self.kilo_index;
        // The HTTP handlers hold the engine too: it stops all the same (see `WireGuard::shutdown`).
        if self.wg.shutdown(delete_link) {
            if let Err(e) = self.netlink.delete_link(index).await {
                tracing::warn!(error = format!("{e:#}"), "deleting the interface failed");
            }
        }
    }
}

/// How long kg waits for the backend to list everything before it restores the last run's
/// peers: long enough for a healthy API server's lists, so the first reconcile decides from
/// the cluster as it is; short, since until then a restarted leader forwards nothing.
const RESTORE_WAIT: Duration = Duration::from_millis(300);

/// How long the lookup of the node's own name may take.
const HOSTNAME_LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);

/// Why the last run's peers must not come back, judged from `snapshot` (complete or not):
/// another node holds this node's location's lease, so this node does not lead. Had it led
/// when it died (a leader returning after its successor took over), its saved peers would make
/// it act as a leader until its first reconcile; a follower's are not needed before then
/// either. `None`: restore them.
fn stale_restore(snapshot: &Snapshot, s: &Settings) -> Option<String> {
    let own = snapshot.nodes.get(&s.hostname)?;
    let (node, _) = control::node::translate_node(own, &s.args.topology_label);
    let holder = control::leader::led_by_another(&node, &snapshot.leases, unix_ms())?;
    Some(format!(
        "{holder} holds the lease of location {} now",
        node.location
    ))
}

/// Runs kg until SIGINT or SIGTERM.
pub async fn run(settings: Settings) -> Result<()> {
    let resync = settings.resync;
    let listen = settings.args.listen.clone();
    // Held until the engine is stopped: the next kg of this node waits on it (see `engine_lock`).
    let engine_lock = if settings.args.create_interface {
        Some(take_engine(&settings.args.socket_dir, &settings.args.interface, &listen).await?)
    } else {
        None
    };
    let mut agent = Agent::start(settings).await?;
    let state = http::HttpState {
        metrics: Arc::clone(&agent.metrics),
        wg: Arc::clone(&agent.wg),
        graph: Arc::clone(&agent.graph),
        status: Arc::clone(&agent.status),
    };
    let bound = http::serve(&listen, state).await?;
    tracing::info!(address = %bound, "serving /health, /metrics, /graph and /status");
    let mut snapshots = agent.subscribe();
    let mut resync_timer = tokio::time::interval(resync);
    let mut check_in_timer = tokio::time::interval(CHECK_IN_PERIOD);
    let leases = agent.leases_on();
    let mut lease_timer = tokio::time::interval(lease::LEASE_PERIOD);
    let mut kernel_changes = kernel_watch::watch_changes(KERNEL_SETTLE)?;
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // DNS lookups run when the book says one is due, at most once a second: a reconcile that
    // fails before it resolves leaves the deadline in the past, and must not spin.
    let mut last_dns: Option<Instant> = None;
    loop {
        let dns_deadline = agent
            .dns_deadline()
            .map(|due| last_dns.map_or(due, |last| due.max(last + DNS_MIN_INTERVAL)));
        let trigger = tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
            changed = snapshots.changed() => if changed.is_err() { break } else { Trigger::Event },
            _ = resync_timer.tick() => Trigger::Resync,
            _ = check_in_timer.tick() => Trigger::CheckIn,
            Some(()) = kernel_changes.recv() => Trigger::Kernel,
            () = sleep_until(dns_deadline) => Trigger::Dns,
            _ = lease_timer.tick(), if leases => Trigger::Lease,
        };
        // Only what changed is taken from the snapshot, under the channel's lock and before
        // any await: the backend, writing the next event, never finds it shared and copies it.
        agent.ingest(&snapshots.borrow_and_update());
        if trigger == Trigger::Dns {
            last_dns = Some(Instant::now());
        }
        tracing::trace!(?trigger, "reconcile");
        if let Err(e) = agent.settle(trigger).await {
            agent.metrics.error("apply");
            agent.status.error(format!("reconcile failed: {e:#}"));
            tracing::warn!(error = format!("{e:#}"), "reconcile failed");
        }
    }
    tracing::info!("shutting down");
    agent.shut_down().await;
    // Only now, with the engine's sockets closed and its TUN queues released, may the next kg
    // of this node (a surge rollout's new pod, waiting on the lock) take over.
    drop(engine_lock);
    Ok(())
}

/// How long kg waits for its UDP port to be released by the kg it replaces.
const PORT_RELEASE_WAIT: Duration = Duration::from_secs(5);

/// True when `e` says a socket already holds the port.
fn port_in_use(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::AddrInUse)
    })
}

/// Takes the engine lock of `interface`; while another kg of this node holds it (the old pod of
/// a surge rollout), stands by, answering `/health` on `listen`, until that kg exits.
async fn take_engine(socket_dir: &Path, interface: &str, listen: &str) -> Result<EngineLock> {
    let mut lock = EngineLock::open(socket_dir, interface)?;
    if lock.try_lock()? {
        return Ok(lock);
    }
    let holder = lock
        .holder()
        .map_or_else(|| "another kg".to_string(), |pid| format!("kg (pid {pid})"));
    let why = format!(
        "{holder} runs the engine of {interface} on this node ({} is locked); standing by until it exits",
        lock.path().display()
    );
    tracing::info!("{why}");
    let standby = http::serve_standby(listen, why)?;
    let waited = Instant::now();
    let taken = tokio::task::spawn_blocking(move || lock.lock()).await;
    standby.abort();
    let lock = taken.context("waiting for the engine lock")??;
    tracing::info!(
        waited_ms = waited.elapsed().as_millis() as u64,
        "the engine of {interface} is free: taking over"
    );
    Ok(lock)
}

/// Sleeps until `deadline`; with none, never returns (a `select!` branch that never fires).
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}
