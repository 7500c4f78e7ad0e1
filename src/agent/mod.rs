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

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use control::clock::Now;
use control::journal::{EventKind, Reason};
use dataplane::SecretKey;
use hickory_resolver::TokioResolver;
use tokio::sync::watch;

use crate::backend::{Backend, Snapshot};
use args::Settings;
use host::{encap, local::ProblemLog};
use serve::{http, metrics::Metrics, status};
use shells::firewall::HostFirewall;
use shells::lookups::{LookupAnswer, Lookups};
use shells::netlink::Netlink;
use shells::wireguard::WireGuard;
use shells::{kernel_watch, state};
use shells::{Device, Firewall, Kernel};
use start::take_engine;

mod apply;
pub mod args;
mod cni;
mod condition;
mod endpoints;
mod firewall_ready;
pub mod host;
mod lease;
mod peer_status;
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

pub use reconciler::{Timer, Wake, CHECK_IN_PERIOD};
/// How long one DNS lookup may take.
pub const DNS_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a stopping kg waits for its last Kubernetes Events to be written.
const EVENT_FLUSH_WAIT: Duration = Duration::from_secs(2);
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
    /// The agent's configuration.
    settings: Settings,
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
    /// Problems of the host state already said, so each is said once.
    problems: ProblemLog,
    /// The revision of the endpoint probing last put on `/status`.
    candidates_published: Option<u64>,
    /// Kilo's metrics and kilotun's own.
    pub metrics: Arc<Metrics>,
    /// What `/graph` draws the last topology from.
    pub graph: Arc<parking_lot::Mutex<Option<http::GraphSource>>>,
    /// What kg last applied, for `/status`.
    pub status: Arc<status::StatusBoard>,
    /// The firewall's back end, chosen while the first pass brings the engine and routes up.
    firewall_ready: firewall_ready::FirewallReady,
    /// An error that stops kg, kept for the driver ([`Agent::take_fatal`]).
    fatal: Option<anyhow::Error>,
    tunnel: encap::Tunnel,
    /// Where the current reconcile's time goes.
    stages: stages::StageClock,
    /// Every decision: what the agent saw, and what the host must be brought to.
    core: reconciler::Reconciler,
    /// The device as last configured and the last route dump.
    record: apply::HostRecord,
    /// DNS names due for a lookup, for the driver's resolver ([`Agent::take_due_lookups`]).
    due_lookups: Vec<String>,
    /// Where the Kubernetes Events go (the Kubernetes backend and its in-memory twin).
    event_sink: Option<crate::backend::EventSink>,
}

/// What wakes the agent ([`Agent::step`]).
#[derive(Debug)]
pub enum Input<'a> {
    /// The backend's snapshot changed.
    Snapshot,
    /// The kernel's links, addresses or routes changed (a settled burst of notifications).
    Kernel,
    /// A timer of [`Agent::poll_timeout`] fell due.
    Timeout(Timer),
    /// Answers to the lookups asked.
    Lookups(Vec<LookupAnswer>),
    /// A post-quantum exchange's datagram from `from`.
    PqDatagram {
        /// Where it came from.
        from: std::net::SocketAddr,
        /// Its bytes.
        datagram: &'a [u8],
    },
}

/// Where the agent reads the backend's latest snapshot from: kg's watch, or a value.
pub trait SnapshotSource {
    /// Calls `read` with the latest snapshot (marking it seen), with nothing awaited between.
    fn read_latest<R>(&mut self, read: impl FnOnce(&Snapshot) -> R) -> R;
}

impl SnapshotSource for watch::Receiver<Arc<Snapshot>> {
    fn read_latest<R>(&mut self, read: impl FnOnce(&Snapshot) -> R) -> R {
        read(&self.borrow_and_update())
    }
}

impl SnapshotSource for Arc<Snapshot> {
    fn read_latest<R>(&mut self, read: impl FnOnce(&Snapshot) -> R) -> R {
        read(self)
    }
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

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Snapshots from the backend.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Snapshot>> {
        self.backend.subscribe()
    }

    /// True when kg takes its location's lease ([`args::Settings::elects_by_lease`]).
    pub fn leases_on(&self) -> bool {
        self.settings.elects_by_lease()
    }

    /// When the readiness flips or the firewall write held back are due: `None` when none
    /// is held.
    pub fn readiness_deadline(&self) -> Option<Instant> {
        self.core.readiness_deadline()
    }

    /// The next moment the agent must wake without an event, and why: one table for every
    /// timer ([`reconciler::Reconciler::poll_timeout`]).
    pub fn poll_timeout(&self) -> Option<(Instant, Timer)> {
        self.core.poll_timeout()
    }

    /// True when the host is not yet what the last topology wants and the agent is retrying
    /// ([`reconciler::Reconciler::host_behind`]).
    pub fn host_behind(&self) -> bool {
        self.core.host_behind()
    }

    /// Every timer set, with its moment.
    pub fn timers_due(&self) -> Vec<(Instant, Timer)> {
        self.core.timers_due()
    }

    /// The error that must stop kg, if a step met one (the firewall's back end could not be
    /// chosen: `--firewall=nftables` where nftables does not work).
    pub fn take_fatal(&mut self) -> Option<anyhow::Error> {
        self.fatal.take()
    }

    /// The DNS names due for a lookup since the last call, for the driver's resolver.
    pub fn take_due_lookups(&mut self) -> Vec<String> {
        std::mem::take(&mut self.due_lookups)
    }

    /// Everything the agent does when woken by `input` at `now`, the one loop body of kg and of
    /// the reference model: a pass (reading the latest snapshot from `snapshots`) when the
    /// input asks for one (a change of the post-quantum keys does), lookups or the
    /// post-quantum links' effects otherwise. Returns the
    /// pass's outcome (`None`: no pass ran); a failed pass was counted, put on `/status` and
    /// logged.
    pub async fn step(
        &mut self,
        input: Input<'_>,
        snapshots: &mut impl SnapshotSource,
        now: Now,
    ) -> Option<Result<()>> {
        let trigger = match input {
            Input::Snapshot => Some(Trigger::Event),
            Input::Kernel => Some(Trigger::Kernel),
            Input::Lookups(answers) => {
                self.take_lookups(answers, now);
                Some(Trigger::Dns)
            }
            Input::PqDatagram { from, datagram } => {
                self.core.pq_datagram(from.ip(), datagram, now);
                None
            }
            Input::Timeout(timer) => match self.core.on_timeout(timer, now) {
                Wake::Pass(trigger) => Some(trigger),
                Wake::Lookups(names) => {
                    self.due_lookups.extend(names);
                    return None;
                }
                Wake::PostQuantum => None,
                Wake::ReadPeers => {
                    if self.read_for_endpoints(now) == 0 {
                        self.publish_events(now);
                        return None;
                    }
                    Some(Trigger::Endpoints)
                }
            },
        };
        // The post-quantum links' effects, outside a pass; a change of their keys asks for
        // one, whose device write gives the device the keys.
        let trigger = match trigger {
            Some(trigger) => trigger,
            None => {
                self.carry_out_pq(now);
                if !self.core.pq_keys_due() {
                    self.core.pq_reschedule(now);
                    self.publish_events(now);
                    return None;
                }
                Trigger::PostQuantum
            }
        };
        // Only what changed is taken from the snapshot, before any await: the backend, writing
        // the next event, never finds it shared and copies it.
        snapshots.read_latest(|snapshot| self.ingest(snapshot, now));
        tracing::trace!(?trigger, "reconcile");
        let settled = self.settle(trigger, now).await;
        if let Err(e) = &settled {
            self.metrics.error("apply");
            self.status.error(format!("reconcile failed: {e:#}"));
            let hostname = self.settings.hostname.clone();
            self.core.journal().record(
                Reason::ReconcileFailed,
                hostname,
                format!("reconcile failed: {e:#}"),
            );
        }
        self.tend_condition(now).await;
        self.tend_peer_status(now).await;
        self.publish_candidates();
        self.carry_out_pq(now);
        self.publish_events(now);
        Some(settled)
    }

    /// Takes the events the step recorded: logs each, keeps them for `/status`, and posts the
    /// Kubernetes Events the reconciler says are due.
    fn publish_events(&mut self, now: Now) {
        let events = self.core.take_events(now.unix_ms);
        if let Some(sink) = &self.event_sink {
            let (writes, dropped) = self.core.api_writes(&events, now.unix_ms);
            for write in writes {
                sink.post(write);
            }
            self.metrics.count_api_events("dropped", dropped);
        }
        if events.is_empty() {
            return;
        }
        for e in &events {
            let (reason, subject) = (e.reason.as_str(), e.subject.as_str());
            match e.kind {
                EventKind::Warning => tracing::warn!(reason, subject, "{}", e.message),
                EventKind::Normal => tracing::info!(reason, subject, "{}", e.message),
            }
        }
        self.status.events(events);
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
    let listen = settings.args.listen.clone();
    // Held until the engine is stopped: the next kg of this node waits on it (see `engine_lock`).
    let (engine_lock, took_over) = if settings.args.create_interface {
        let a = &settings.args;
        let (lock, took_over) =
            take_engine(&a.socket_dir, &a.interface, &listen, a.wireguard).await?;
        (Some(lock), took_over)
    } else {
        (None, None)
    };
    let interface = settings.args.interface.clone();
    let mut agent = Agent::start(settings).await?;
    if let Some(took_over) = took_over {
        agent
            .core
            .journal()
            .record(Reason::TookOver, interface, took_over);
    }
    let event_sink = agent.event_sink.clone();
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
    let (mut kernel_changes, routing) =
        kernel_watch::watch_changes(KERNEL_SETTLE, agent.netlink.port())?;
    agent.record.routing = Some(routing);
    let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut lookups = agent
        .resolver
        .clone()
        .map(|resolver| Lookups::spawn(resolver, DNS_TIMEOUT));
    let pq_socket = agent.pq_socket();
    let mut pq_buffer = vec![0u8; 2048];
    loop {
        let timeout = agent.poll_timeout();
        let input = tokio::select! {
            _ = tokio::signal::ctrl_c() => break,
            _ = sigterm.recv() => break,
            changed = snapshots.changed() => if changed.is_err() { break } else { Input::Snapshot },
            Some(()) = kernel_changes.recv() => Input::Kernel,
            Some(answers) = next_answers(&mut lookups) => Input::Lookups(answers),
            Some((len, from)) = receive(pq_socket.as_deref(), &mut pq_buffer) => {
                Input::PqDatagram { from, datagram: &pq_buffer[..len] }
            }
            Some(timer) = fire(timeout) => Input::Timeout(timer),
        };
        // A failed pass was said where it failed; the next input tries again.
        let _ = agent.step(input, &mut snapshots, read_clock()).await;
        if let Some(e) = agent.take_fatal() {
            agent.shut_down().await;
            drop(engine_lock);
            return Err(e);
        }
        if let Some(lookups) = &lookups {
            lookups.ask(agent.take_due_lookups());
        }
    }
    tracing::info!("shutting down");
    agent.shut_down().await;
    // Only now, with the engine's sockets closed and its TUN queues released, may the next kg
    // of this node (a surge rollout's new pod, waiting on the lock) take over.
    drop(engine_lock);
    // The Events the shutdown recorded, sent after the handover so they never delay it.
    if let Some(sink) = event_sink {
        sink.flush(EVENT_FLUSH_WAIT).await;
    }
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

/// Sleeps until `timeout`'s moment and returns its timer; with none, never returns (a
/// `select!` branch that never fires).
async fn fire(timeout: Option<(Instant, Timer)>) -> Option<Timer> {
    match timeout {
        Some((at, timer)) => {
            tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
            Some(timer)
        }
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
