//! The `kg` agent: watches the backend, computes Kilo's topology, and drives the WireGuard
//! device, the link and the routes.
//!
//! The tree reads by role:
//! - [`reconciler`]: every decision, as a state machine that does no I/O (values in, the
//!   shells' work out as values, `now` an argument), built on the pure `control` crate;
//! - the driver, here: this loop, [`start`] (key, backend, engine, restored peers, tunnel),
//!   [`reconcile`] (one pass: asks the reconciler each step and runs the shells it names),
//!   [`apply`] (the desired state → the shells, part by part), [`lease`] (the tunnels' readings
//!   for the lease step, and its write) and [`shutdown`] (what SIGTERM undoes, and what it
//!   leaves to a successor); [`stages`] times them;
//! - [`shells`]: every adapter that talks to the kernel, a child process or a file, each behind
//!   a small trait, with their in-memory twins beside them;
//! - [`host`]: what kg learns from and sets up on its own node (its IP, links, MTU, tunnel);
//! - [`serve`]: what kg serves (HTTP, `/status`, metrics, path probes).
//!
//! Imports go one way: the driver uses the four folders, never the reverse, and the reconciler
//! uses no shell.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use control::clock::Now;
use control::routes::RoutePlan;
use dataplane::SecretKey;
use hickory_resolver::TokioResolver;
use tokio::sync::watch;

use crate::backend::{Backend, Snapshot};
use crate::periodic::periodic;
use args::Settings;
use host::{encap, local::ProblemLog};
use serve::{http, metrics::Metrics, status};
use shells::firewall::HostFirewall;
use shells::lookups::{LookupAnswer, Lookups};
use shells::netlink::Netlink;
use shells::wireguard::WireGuard;
use shells::{kernel_watch, state};
use shells::{Engine, Firewall, Kernel};
use start::take_engine;

mod apply;
pub mod args;
pub mod host;
mod lease;
pub mod pq;
mod reconcile;
pub mod reconciler;
mod rotate;
pub mod serve;
pub mod shells;
mod shutdown;
pub mod stages;
mod start;
pub mod twin_agent;

pub use reconciler::CHECK_IN_PERIOD;
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

/// Libraries whose own lines are not for an operator, with the level kg shows them at:
/// netlink-proto's chatter, the resolver's per-lookup lines, and boringtun's line per peer and
/// handshake retry (the engine says in one line which peers it gave up on).
pub const QUIET_LIBRARIES: [&str; 5] = [
    "netlink_proto=error",
    "hickory_net=warn",
    "hickory_resolver=warn",
    "hickory_proto=warn",
    "boringtun=off",
];

/// A tracing filter's `directives` (from `--log-level` or `KG_LOG`) with [`QUIET_LIBRARIES`]
/// added for each library the directives do not name themselves.
pub fn with_quiet_libraries(directives: &str) -> String {
    let mut all = directives.to_string();
    for quiet in QUIET_LIBRARIES {
        let library = quiet.split('=').next().unwrap_or(quiet);
        if !directives.contains(library) {
            all.push(',');
            all.push_str(quiet);
        }
    }
    all
}

/// Reads both clocks: the one place kg's event loop takes the time, which every decision
/// then receives as an argument.
pub fn read_clock() -> Now {
    Now {
        instant: Instant::now(),
        unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as i64),
    }
}

pub use control::pass::Trigger;

/// The running agent, over the kernel `N`, the firewall `F` and the WireGuard device `W` (the
/// host's by default; in-memory twins in tests and benchmarks).
pub struct Agent<N = Netlink, F = HostFirewall, W = WireGuard> {
    s: Settings,
    key: SecretKey,
    /// The next key of a rotation under way: on disk, published, not yet in use.
    next_key: Option<SecretKey>,
    /// Post-quantum preshared keys (`--post-quantum`).
    pq: Option<pq::PqShell>,
    backend: Backend,
    netlink: N,
    firewall: F,
    wg: Arc<W>,
    kilo_index: u32,
    cni_file: Box<dyn shells::cni_file::CniFile>,
    resolver: Option<TokioResolver>,
    hostname_ips: Vec<IpAddr>,
    /// The routes and rules kg installed (saved beside the key, so a restart claims them).
    owned: RoutePlan,
    /// Problems of the host state already said, so each is said once.
    problems: ProblemLog,
    warned: BTreeMap<&'static str, bool>,
    /// Kilo's metrics and kilotun's own.
    pub metrics: Arc<Metrics>,
    /// What `/graph` draws the last topology from.
    pub graph: Arc<parking_lot::Mutex<Option<http::GraphSource>>>,
    /// What kg last applied, for `/status`.
    pub status: Arc<status::StatusBoard>,
    ip6tables: bool,
    tunnel: encap::Tunnel,
    /// Where the current reconcile's time goes.
    stages: stages::StageClock,
    /// Every decision: what the agent saw, and what the host must be brought to.
    core: reconciler::Reconciler,
    /// What the shells wrote to the host.
    record: apply::HostRecord,
}

/// The shells an [`Agent`] is built on.
pub struct Shells<N, F, W> {
    /// Links, addresses, routes and rules.
    pub kernel: N,
    /// iptables.
    pub firewall: F,
    /// The WireGuard device.
    pub engine: W,
    /// The CNI configuration file (`--cni`).
    pub cni: Box<dyn shells::cni_file::CniFile>,
    /// With `--post-quantum`, where the exchanges' datagrams go instead of a UDP socket (the
    /// reference model's network), if anywhere.
    pub pq_outbox: Option<pq::PqOutbox>,
}

impl<N: Kernel, F: Firewall, W: Engine> Agent<N, F, W> {
    /// Snapshots from the backend.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.backend.subscribe()
    }

    /// True when kg takes its location's lease ([`args::Settings::elects_by_lease`]).
    pub fn leases_on(&self) -> bool {
        self.s.elects_by_lease()
    }

    /// When the next DNS lookup is due: `None` with no name to resolve (or no resolver), so
    /// the loop sets no timer for it.
    pub fn dns_deadline(&self) -> Option<Instant> {
        self.resolver.as_ref()?;
        self.core.dns_deadline()
    }

    /// When the readiness flips or the firewall write held back are due: `None` when none
    /// is held.
    pub fn readiness_deadline(&self) -> Option<Instant> {
        self.core.readiness_deadline()
    }

    /// When a lease this node saw held runs out unless renewed (see
    /// [`reconciler::Reconciler::lease_deadline`]).
    pub fn lease_deadline(&self) -> Option<Instant> {
        self.core.lease_deadline()
    }

    /// When a key rotation's next step is due (see
    /// [`reconciler::Reconciler::rotation_deadline`]).
    pub fn rotation_deadline(&self) -> Option<Instant> {
        self.core.rotation_deadline()
    }

    /// The deadlines of the lease step, the held readiness flips and the key rotation, in
    /// that order: what a driver other than [`run`] (the reference model) waits for.
    pub fn timer_deadlines(&self) -> [Option<Instant>; 3] {
        [
            self.lease_deadline(),
            self.readiness_deadline(),
            self.rotation_deadline(),
        ]
    }

    fn warn_once(&mut self, what: &'static str, message: &str) {
        if !self.warned.insert(what, true).unwrap_or(false) {
            tracing::warn!("{message}");
        }
    }

    /// The DNS names whose lookup is due at `now`, marked as asked
    /// ([`control::dns::DnsBook::start`]); none without a resolver.
    pub fn start_lookups(&mut self, now: Now) -> Vec<String> {
        if self.resolver.is_none() {
            return Vec::new();
        }
        self.core.start_lookups(now)
    }

    /// Takes in lookup answers that came at `now`: a failure keeps the last good address.
    /// The next reconcile computes the mesh again when an address changed.
    pub fn take_lookups(&mut self, answers: Vec<LookupAnswer>, now: Now) {
        let failed = self.core.take_lookups(answers, now);
        self.metrics.dns_failures.inc_by(failed as u64);
    }
}
/// Runs kg until SIGINT or SIGTERM.
pub async fn run(settings: Settings) -> Result<()> {
    let resync = settings.resync;
    let listen = settings.args.listen.clone();
    // Held until the engine is stopped: the next kg of this node waits on it (see `engine_lock`).
    let engine_lock = if settings.args.create_interface {
        let a = &settings.args;
        Some(take_engine(&a.socket_dir, &a.interface, &listen, a.wireguard).await?)
    } else {
        None
    };
    let mut agent = Agent::start(settings).await?;
    let state = http::HttpState {
        metrics: Arc::clone(&agent.metrics),
        wg: Arc::clone(&agent.wg),
        graph: Arc::clone(&agent.graph),
        status: Arc::clone(&agent.status),
        kernel: agent.netlink.clone(),
        firewall: agent.firewall,
    };
    let bound = http::serve(&listen, state).await?;
    tracing::info!(address = %bound, "serving /health, /ready, /metrics, /graph and /status");
    let mut snapshots = agent.subscribe();
    let mut resync_timer = periodic(resync);
    let mut check_in_timer = periodic(CHECK_IN_PERIOD);
    let leases = agent.leases_on();
    let mut lease_timer = periodic(lease::LEASE_PERIOD);
    let (mut kernel_changes, routing) =
        kernel_watch::watch_changes(KERNEL_SETTLE, agent.netlink.port())?;
    agent.record.routing = Some(routing);
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // DNS lookups run when the book says one is due, at most once a second: a reconcile that
    // fails before it resolves leaves the deadline in the past, and must not spin.
    let mut last_dns: Option<Instant> = None;
    let mut lookups = agent
        .resolver
        .clone()
        .map(|resolver| Lookups::spawn(resolver, DNS_TIMEOUT));
    let pq_socket = agent.pq_socket();
    let mut pq_buffer = vec![0u8; 2048];
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
            () = sleep_until(dns_deadline) => {
                let now = read_clock();
                last_dns = Some(now.instant);
                if let Some(lookups) = &lookups {
                    lookups.ask(agent.start_lookups(now));
                }
                continue;
            }
            Some(answers) = next_answers(&mut lookups) => {
                agent.take_lookups(answers, read_clock());
                Trigger::Dns
            }
            () = sleep_until(agent.readiness_deadline()) => Trigger::Readiness,
            _ = lease_timer.tick(), if leases => Trigger::Lease,
            () = sleep_until(agent.lease_deadline()), if leases => Trigger::Lease,
            () = sleep_until(agent.rotation_deadline()) => Trigger::Key,
            Some((len, from)) = receive(pq_socket.as_deref(), &mut pq_buffer) => {
                agent.pq_datagram(from, &pq_buffer[..len], read_clock());
                continue;
            }
            () = sleep_until(agent.pq_deadline()) => {
                agent.pq_poll(read_clock());
                continue;
            }
        };
        // Only what changed is taken from the snapshot, under the channel's lock and before
        // any await: the backend, writing the next event, never finds it shared and copies it.
        let now = read_clock();
        agent.ingest(&snapshots.borrow_and_update(), now);
        tracing::trace!(?trigger, "reconcile");
        if let Err(e) = agent.settle(trigger, now).await {
            agent.metrics.error("apply");
            agent.status.error(format!("reconcile failed: {e:#}"));
            tracing::warn!(error = format!("{e:#}"), "reconcile failed");
        }
        agent.pq_refresh(read_clock());
    }
    tracing::info!("shutting down");
    agent.shut_down().await;
    // Only now, with the engine's sockets closed and its TUN queues released, may the next kg
    // of this node (a surge rollout's new pod, waiting on the lock) take over.
    drop(engine_lock);
    Ok(())
}

/// The next DNS answers; with no lookup task, never returns.
async fn next_answers(lookups: &mut Option<Lookups>) -> Option<Vec<LookupAnswer>> {
    match lookups {
        Some(lookups) => lookups.answers().await,
        None => std::future::pending().await,
    }
}

/// The next datagram on `socket`, if there is one; without a socket, never returns.
async fn receive(
    socket: Option<&tokio::net::UdpSocket>,
    buffer: &mut [u8],
) -> Option<(usize, std::net::SocketAddr)> {
    match socket {
        Some(socket) => socket.recv_from(buffer).await.ok(),
        None => std::future::pending().await,
    }
}

/// Sleeps until `deadline`; with none, never returns (a `select!` branch that never fires).
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod log_tests {
    use super::*;

    #[test]
    fn the_libraries_stay_quiet_unless_the_filter_names_them() {
        assert_eq!(
            with_quiet_libraries("info"),
            "info,netlink_proto=error,hickory_net=warn,hickory_resolver=warn,hickory_proto=warn,boringtun=off"
        );
        let named = with_quiet_libraries("debug,boringtun=warn,hickory_resolver=debug");
        assert!(named.contains("boringtun=warn") && !named.contains("boringtun=off"));
        assert!(!named.contains("hickory_resolver=warn"), "{named}");
        assert!(named.contains("netlink_proto=error"), "{named}");
        // Every result is a filter tracing takes.
        for directives in ["info", "warn,kilotun::stages=debug", "trace"] {
            tracing_subscriber::EnvFilter::try_new(with_quiet_libraries(directives)).unwrap();
        }
    }
}
