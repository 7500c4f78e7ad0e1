//! How kg starts: the key, the backend, the engine (taking it over from the kg it replaces),
//! the last run's peers and the tunnel, up to a ready [`Agent`].

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use control::journal::Reason;
use control::routes::RoutePlan;
use control::Key;
use dataplane::{DeviceConfig, InterfaceConfig, SecretKey};
use hickory_resolver::TokioResolver;

use super::args::{BackendKind, Settings};
use super::host::{encap, local::ProblemLog};
use super::reconciler::Reconciler;
use super::serve::{http, metrics::Metrics, status};
use super::shells::engine_lock::EngineLock;
use super::shells::firewall::HostFirewall;
use super::shells::netlink::Netlink;
use super::shells::wireguard::{WireGuard, WireGuardChoice};
use super::shells::{keyfile, state};
use super::shells::{Device, Firewall, Kernel};
use super::{read_clock, Agent, Shells, DNS_TIMEOUT};
use crate::backend::{file::FileBackend, kube::KubeBackend, Backend, Snapshot};
use control::clock::Now;

impl Agent {
    /// Loads the key, connects the backend, creates or finds the interface.
    pub async fn start(s: Settings) -> Result<Self> {
        let key = keyfile::load_or_generate(&s.args.key_file)?;
        keyfile::make_secrets_private(&s.args.key_file)?;
        let backend = match s.args.backend {
            BackendKind::File => {
                let backend = FileBackend::open(Path::new(&s.args.cluster_dir))?;
                backend.spawn_poller();
                Backend::File(backend)
            }
            BackendKind::Kubernetes => {
                let config =
                    crate::backend::kube::client_config(&s.args.kubeconfig, &s.args.master).await?;
                let backend = KubeBackend::start(config, s.elects_by_lease())?;
                let kinds = crate::backend::kube::ipam::kinds(s.args.ipam.source());
                backend.watch_ipam(&kinds, s.args.ipam == super::args::IpamChoice::Auto);
                Backend::Kube(backend)
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
        let restored = match state::load(&s.args.key_file, &key, s.args.port) {
            Ok(Some(mut restored)) if s.args.post_quantum => {
                let local = control::Key(*key.public_key().as_bytes());
                let taken = super::pq::overlay_saved_keys(&s.args.key_file, local, &mut restored);
                tracing::debug!(
                    peers = taken,
                    "restored peers given their saved post-quantum keys"
                );
                Some(restored)
            }
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
            firewall: HostFirewall {
                choice: s.args.firewall,
                iptables_mode: s.args.iptables_backend,
                forward_rules: s.args.iptables_forward_rules,
            },
            engine: wg,
            cni: Box::new(super::shells::cni_file::HostCniFile::new(
                s.args.cni_path.clone(),
            )),
            pq_outbox: None,
        };
        // The node's own name is looked up meanwhile (it can take up to a second).
        let hostname = s.hostname.clone();
        let hostname_ips = tokio::spawn(async move {
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
        let hostname_ips = async move { hostname_ips.await.unwrap_or_default() };
        Self::with_shells(
            s,
            key,
            backend,
            shells,
            restored,
            hostname_ips,
            read_clock(),
        )
        .await
    }
}

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Builds the agent on `shells` at `now`: finds the interface, sets the key and port (and
    /// the `restored` peers of the last run), picks the tunnel. `hostname_ips` gives the
    /// addresses the node's own name resolves to (awaited after the engine is configured).
    pub async fn with_shells(
        s: Settings,
        key: SecretKey,
        backend: Backend,
        shells: Shells<N, F, W>,
        restored: Option<DeviceConfig>,
        hostname_ips: impl std::future::Future<Output = Vec<IpAddr>>,
        now: Now,
    ) -> Result<Self> {
        let Shells {
            kernel: netlink,
            firewall,
            engine: wg,
            cni: cni_file,
            pq_outbox,
        } = shells;
        // The iptables back end is the host's, chosen once before the first rule is read; its
        // child processes run while the device is configured and the last run's peers restored.
        let firewall_ready = super::firewall_ready::FirewallReady::start(&firewall);
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
                fwmark: s.tunnel_guard.mark(),
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
        // The endpoints the last run used, NAT-discovered ones among them: kept as discovered
        // until a handshake teaches newer ones (see `discover_nat_endpoints`), so the first
        // reconcile does not send the restored peers back to their announced addresses.
        let mut discovered = BTreeMap::new();
        // What the start did, for the journal once the reconciler exists.
        let mut started = Vec::new();
        let board = Arc::new(status::StatusBoard::default());
        if let Some(restored) = restored {
            discovered.extend(
                restored
                    .peers
                    .iter()
                    .filter_map(|p| Some((Key(*p.public_key.as_bytes()), p.endpoint?))),
            );
            let snapshot = backend.complete_within(RESTORE_WAIT).await;
            match stale_restore(&snapshot, &s, now.unix_ms) {
                Some(why) => started.push((
                    Reason::PeersNotRestored,
                    format!("not restoring the WireGuard peers of the last run: {why}"),
                )),
                None => {
                    let peers = restored.peers.len();
                    let (_, handshakes) = wg.apply_and_handshake(&restored)?;
                    board.update(|p| p.engine = status::EngineReadiness::Restored { peers });
                    started.push((
                        Reason::PeersRestored,
                        format!("restored the {peers} WireGuard peers of the last run"),
                    ));
                    started.extend(handshakes.map(|h| (Reason::HandshakesStarted, h)));
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
        let hostname_ips = hostname_ips.await;
        let tunnel =
            encap::Tunnel::choose(&netlink, s.encapsulate, s.compatibility, s.args.ipip).await?;
        tracing::info!(node = %s.hostname, interface = %s.args.interface, public_key = %public, version = crate::VERSION, "kg started");
        // What the last run installed is kg's, whatever the settings were then.
        let last_routes = state::load_routes(&s.args.key_file).unwrap_or_else(|e| {
            tracing::warn!(
                error = format!("{e:#}"),
                "the last run's routes cannot be read; kg claims only the routes on its own link"
            );
            RoutePlan::default()
        });
        let next_key = keyfile::load_next(&s.args.key_file, &key).unwrap_or_else(|e| {
            tracing::warn!(
                error = format!("{e:#}"),
                "the next key of a rotation cannot be read; the key in use stays"
            );
            None
        });
        let mut core = Reconciler::new(s.reconciler_config(), public, discovered, now);
        core.start_host(last_routes, tunnel.kind(), kilo_index);
        for (reason, message) in started {
            core.journal()
                .record(reason, s.args.interface.clone(), message);
        }
        if resolver.is_some() {
            core.enable_lookups();
        }
        let pq = if s.args.post_quantum {
            let (shell, state) = super::pq::PqShell::start(
                &s.args.key_file,
                &key,
                s.psk_rotation,
                wg.counts_failed_handshakes(),
                pq_outbox,
            )
            .await?;
            core.enable_post_quantum(state);
            Some(shell)
        } else {
            None
        };
        core.resume_rotation(
            next_key
                .as_ref()
                .map(|(k, request)| (Key(*k.public_key().as_bytes()), request.clone())),
            keyfile::made_ms(&s.args.key_file).unwrap_or(now.unix_ms),
        );
        let mut metrics = Metrics::new();
        if let Some(relists) = backend.node_relists() {
            metrics.register_node_relists(relists);
        }
        let metrics = Arc::new(metrics);
        let event_sink = backend.event_sink(
            &s.hostname,
            Arc::clone(&metrics) as Arc<dyn crate::backend::kube::events::EventCounts>,
        );
        Ok(Self {
            core,
            event_sink,
            next_key: next_key.map(|(k, _)| k),
            pq,
            record: Default::default(),
            firewall_ready,
            fatal: None,
            settings: s,
            key,
            backend,
            netlink,
            firewall,
            wg: Arc::new(wg),
            kilo_index,
            cni_file,
            resolver,
            hostname_ips,
            problems: ProblemLog::default(),
            candidates_published: None,
            metrics,
            graph: Arc::new(parking_lot::Mutex::new(None)),
            status: board,
            tunnel,
            stages: Default::default(),
            due_lookups: Vec::new(),
        })
    }
}

/// How long kg waits for the backend to list everything before it restores the last run's
/// peers: long enough for a healthy API server's lists, so the first reconcile decides from
/// the cluster as it is; short, since until then a restarted leader forwards nothing.
const RESTORE_WAIT: Duration = Duration::from_millis(300);

/// How long the lookup of the node's own name may take.
const HOSTNAME_LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);

/// Why the last run's peers must not come back, judged from `snapshot` (complete or not) at
/// `now_ms`:
/// another node holds this node's location's lease, so this node does not lead. Had it led
/// when it died (a leader returning after its successor took over), its saved peers would make
/// it act as a leader until its first reconcile; a follower's are not needed before then
/// either. `None`: restore them.
fn stale_restore(snapshot: &Snapshot, s: &Settings, now_ms: i64) -> Option<String> {
    if s.granularity != control::node::Granularity::Location {
        // Every node leads its own segment: whoever holds a lease, the peers are this node's.
        return None;
    }
    let own = snapshot.nodes.get(&s.hostname)?;
    let (node, _) = control::node::translate_node(own, &s.args.topology_label);
    let holder = control::leader::led_by_another(&node, &snapshot.leases, now_ms)?;
    Some(format!(
        "{holder} holds the lease of location {} now",
        node.location
    ))
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
/// a surge rollout), stands by, answering `/health` on `listen`, until that kg exits. Returns
/// the lock and, when it stood by, a sentence saying so for the journal.
///
/// It stands by only if it could run the engine after that kg (`choice`,
/// [`WireGuard::can_run`]); if not it fails at once, so a rollout's new pod that could not take
/// over never becomes ready and the running kg keeps the engine.
pub(super) async fn take_engine(
    socket_dir: &Path,
    interface: &str,
    listen: &str,
    choice: WireGuardChoice,
) -> Result<(EngineLock, Option<String>)> {
    let mut lock = EngineLock::open(socket_dir, interface)?;
    if lock.try_lock()? {
        return Ok((lock, None));
    }
    let holder = lock
        .holder()
        .map_or_else(|| "another kg".to_string(), |pid| format!("kg (pid {pid})"));
    if let Err(e) = WireGuard::can_run(choice) {
        anyhow::bail!(
            "{holder} runs the engine of {interface} on this node, and this kg could not run it after that one: {e:#}; not standing by (the running kg keeps the engine)"
        );
    }
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
    let took_over = format!(
        "{holder} ran the engine of {interface}: stood by {} ms until it exited, then took over",
        waited.elapsed().as_millis()
    );
    tracing::info!("the engine of {interface} is free: taking over");
    Ok((lock, Some(took_over)))
}
