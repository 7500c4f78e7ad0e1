//! The agent's decisions, as a state machine that does no I/O: values in, values out, `now`
//! an argument everywhere. The driver ([`super::reconcile`]) runs a pass as a protocol
//! ([`pass`]):
//!
//! 1. [`Reconciler::ingest`] takes a backend snapshot's changes into the node table;
//! 2. [`Reconciler::begin_pass`] opens a pass (none while the backend has not listed
//!    everything);
//! 3. [`Reconciler::poll_effect`] hands out what the shells must do next ([`PassEffect`]: list
//!    the host, take a key rotation's step, converge the host to a topology, read the tunnels,
//!    write the lease, patch the annotations), deciding everything between them (the local node,
//!    what changed, the leaders, the topology) itself;
//! 4. [`Reconciler::handle`] takes each answer ([`PassAnswer`]), a shell's failure among them;
//! 5. [`Reconciler::end_pass`] closes the pass with its outcome.
//!
//! While the shells converge the host they ask [`Reconciler::desired`] for the desired state
//! and [`Reconciler::firewall_step`] whether the firewall is written now. Each step's output is
//! a plain value compared with the last one, so a pass that changes nothing stops early and
//! touches no shell. [`Reconciler::poll_timeout`] names the next moment a pass or lookup is due
//! without an event ([`Timer`]). Unit tests drive it with values alone (`tests.rs`); the
//! reference model (`crate::model`) drives whole agents on the shells' twins.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;

use control::clock::Now;
use control::coalesce::{FirewallHold, ReadinessBatch};
use control::dns::DnsBook;
use control::iptables::RuleSet;
use control::journal::{Event, Journal, Reason};
use control::node::Node;
use control::pass::{Changes, Trigger};
use control::table::{differs_beyond_check_in, NodeTable};
use control::{Key, Peer, Topology};
use k8s_openapi::api::core::v1::Node as KubeNode;

use crate::agent::host::local::{self, ProblemLog};
use crate::agent::host::{DetectionInputs, HostView};

mod condition;
mod config;
mod converge;
mod endpoints;
mod events;
mod host_book;
mod host_effects;
mod ingest;
mod ipam;
mod mesh;
mod pass;
mod peer_status;
mod pq;
mod publish;
mod rotation;
mod shares;
#[cfg(test)]
mod tests;
mod timers;

pub use config::Config;
pub use host_effects::{
    DeviceOutcome, DeviceWrite, FirewallOutcome, FirewallWrite, HostAnswer, HostEffect, HostReport,
    LinkWrite, ResolvedPlan,
};
pub use mesh::{Convergence, FirewallStep};
pub use pass::{MeshReport, PassAnswer, PassEffect};
use pass::{Observed, Pass, Step};
pub use pq::{Entropy, PqEffect, PqState};
pub use timers::{Timer, Wake};

/// How often kg refreshes its own `last-seen` (Kilo's fixed check-in period).
pub const CHECK_IN_PERIOD: std::time::Duration = std::time::Duration::from_secs(30);

/// The agent's decisions and everything they remember: the node table, the Peers, the host as
/// last listed, the leases, the last topology, and the pacing of readiness flips and firewall
/// writes.
pub struct Reconciler {
    /// What it decides with.
    config: Config,
    public: Key,
    /// Every Node, translated.
    table: NodeTable,
    /// The snapshot revision the table was brought to (`None`: never).
    revision: Option<u64>,
    /// The Peer revision `peers` was translated at.
    peer_revision: Option<u64>,
    /// The valid Peers, translated.
    peers: Vec<Peer>,
    /// True when the Peers changed since the mesh was last computed.
    peers_changed: bool,
    /// The host as last listed.
    host: Option<HostView>,
    /// The local Node's object, as last ingested.
    local_object: Option<Arc<KubeNode>>,
    /// What the host was last read with from the local Node's object.
    detection: DetectionInputs,
    /// The local Node's annotations as seen when kg last patched them, and that patch.
    last_patch: Option<local::SentPatch>,
    /// The local node the mesh was last computed with.
    local: Option<Node>,
    /// The last topology applied (`None` while the local node is not ready, or until the
    /// one computed is applied).
    topology: Option<Arc<Topology>>,
    /// True once a mesh was computed and applied without error.
    settled: bool,
    /// False when some part of the host failed to converge and must be tried again.
    converged_whole: bool,
    /// The firewall rules last written (`None`: unknown, write them).
    firewall_rules: Option<RuleSet>,
    /// Leader-election leases and the leaders they give.
    leases: control::leader::book::LeaseBook,
    /// The clock at the last ingest: where the leases' wall-clock expiries fall on the
    /// monotonic clock ([`Reconciler::lease_deadline`]).
    ingested_at: Option<Now>,
    /// Readiness flips not yet taken into the mesh ([`control::coalesce`]).
    readiness_batch: ReadinessBatch,
    /// Firewall writes held while readiness flips alone change the rules.
    firewall_hold: FirewallHold,
    /// True once a snapshot with everything listed was ingested (see `Snapshot::listed`).
    listed: bool,
    /// When other nodes' check-ins are judged (frozen while the backend is unreachable).
    readiness: control::readiness::ReadinessClock,
    /// The DNS names in use and their last answers.
    dns: DnsBook,
    /// True when a DNS answer changed an address since the mesh was last computed.
    dns_changed: bool,
    /// Endpoints learnt from handshakes (NAT discovery), published by this node.
    discovered: BTreeMap<Key, SocketAddr>,
    /// True once this node's own published `discovered-endpoints` were merged in.
    discovery_seeded: bool,
    /// True when the last annotation patch failed (the backend counts as unhealthy).
    patch_failed: bool,
    /// Why the WireGuard device stopped carrying packets, when it did and is not yet started
    /// again ([`Reconciler::engine_lost`]).
    engine_lost: Option<String>,
    /// Problems already said, so each is said once.
    problems: ProblemLog,
    /// What this agent noticed and decided since the driver last took it.
    journal: Journal,
    /// Errors for `/status`, taken by [`Reconciler::take_errors`].
    errors: Vec<String>,
    /// The pass in progress ([`pass`]).
    pass: Option<Pass>,
    /// The IPAM objects the pod ranges were last taken from (`--ipam`).
    ipam: ipam::IpamState,
    /// Where this node's key rotation stands.
    rotation: control::rotation::Rotation,
    /// When the key in use was made (Unix milliseconds), for `--key-rotation-period`.
    key_made_ms: i64,
    /// The post-quantum links (`--post-quantum`).
    pq: Option<pq::PqState>,
    /// When the periodic steps are next due ([`Reconciler::poll_timeout`]).
    timers: timers::TimerTable,
    /// The tunnels' recent counters, for the node condition.
    mesh_watch: control::condition::MeshWatch,
    /// The node condition last sent.
    condition_book: control::condition::ConditionBook,
    /// The Peers' status last written, when this node writes it.
    peer_status_book: control::peer_status::PeerStatusBook,
    /// What the Peers' statuses take from the topology, made again when it changes.
    peer_shapes: control::peer_status::PeerShapes,
    /// The Kubernetes Events posted and the budget left.
    api_events: control::api_events::ApiEventBook,
    /// What kg applied to the host, the links it resolved and the routes it holds.
    host_book: host_book::HostBook,
    /// The WireGuard link's index.
    kilo_index: u32,
    /// Which of each peer's endpoint candidates is in use ([`control::endpoints`]).
    endpoint_probes: control::endpoints::EndpointProbes,
    /// True when a peer moved to another candidate since the mesh was last computed.
    endpoints_moved: bool,
}

impl Reconciler {
    /// Nothing decided yet at `now`, configured by `config`, for the node whose public key is `public`;
    /// `discovered` holds the endpoints the last run used.
    pub fn new(
        config: Config,
        public: Key,
        discovered: BTreeMap<Key, SocketAddr>,
        now: Now,
    ) -> Self {
        Self {
            endpoint_probes: control::endpoints::EndpointProbes::new(config.probe_rules.clone()),
            endpoints_moved: false,
            table: NodeTable::new(&config.topology_label),
            dns: DnsBook::new(config.resync),
            timers: timers::TimerTable::new(now.instant),
            config,
            public,
            revision: None,
            peer_revision: None,
            peers: Vec::new(),
            peers_changed: false,
            host: None,
            local_object: None,
            detection: DetectionInputs::default(),
            last_patch: None,
            local: None,
            topology: None,
            settled: false,
            converged_whole: false,
            firewall_rules: None,
            leases: Default::default(),
            ingested_at: None,
            readiness_batch: ReadinessBatch::default(),
            firewall_hold: FirewallHold::default(),
            listed: false,
            readiness: Default::default(),
            dns_changed: false,
            discovered,
            discovery_seeded: false,
            patch_failed: false,
            engine_lost: None,
            problems: ProblemLog::default(),
            journal: Journal::default(),
            errors: Vec::new(),
            pass: None,
            ipam: Default::default(),
            rotation: Default::default(),
            key_made_ms: 0,
            pq: None,
            mesh_watch: Default::default(),
            condition_book: Default::default(),
            peer_status_book: Default::default(),
            peer_shapes: Default::default(),
            api_events: Default::default(),
            host_book: Default::default(),
            kilo_index: 0,
        }
    }

    /// True when the host is not yet what the last topology wants: a part failed to converge
    /// and is being retried ([`Timer::Retry`]).
    pub fn host_behind(&self) -> bool {
        self.timers.retrying()
    }

    /// True when kg takes its location's lease ([`Config::elects_by_lease`]).
    pub fn leases_on(&self) -> bool {
        self.config.elects_by_lease
    }

    /// The last topology applied, if any.
    pub fn topology(&self) -> Option<&Arc<Topology>> {
        self.topology.as_ref()
    }

    /// The host as last listed, if it was.
    pub fn host(&self) -> Option<&HostView> {
        self.host.as_ref()
    }

    /// The events recorded since the last call, stamped `at_unix_ms` (the step's time).
    pub fn take_events(&mut self, at_unix_ms: i64) -> Vec<Event> {
        self.journal.take(at_unix_ms)
    }

    /// Where the driver records what its shells' results say ([`Journal::record`]).
    pub fn journal(&mut self) -> &mut Journal {
        &mut self.journal
    }

    /// Errors for `/status` said since the last call.
    pub fn take_errors(&mut self) -> Vec<String> {
        std::mem::take(&mut self.errors)
    }

    /// Takes in that the WireGuard device stopped carrying packets, and why (its TUN link was
    /// deleted under it). The next pass starts it again first
    /// ([`PassEffect::RecreateEngine`]), then lists the host and applies everything anew.
    pub fn engine_lost(&mut self, why: String) {
        self.engine_lost = Some(why);
    }

    /// Opens a pass woken by `trigger` at `now`, with the backend reachable or not
    /// (`backend_healthy`): judges readiness by the clock or freezes it. Returns false, and
    /// opens none, while the backend has not listed everything.
    pub fn begin_pass(&mut self, trigger: Trigger, backend_healthy: bool, now: Now) -> bool {
        self.pass = None;
        if !self.listed {
            // Nodes without their leases would elect by Kilo's rule, a leader the leases may
            // not name: nothing is decided from a partial picture.
            tracing::debug!("waiting for the backend's first list of Nodes, Peers and Leases");
            return false;
        }
        let detection = DetectionInputs::of(self.local_object.as_deref());
        let full = Changes::host_listing(trigger, self.host.is_some(), self.detection != detection)
            || self.engine_lost.is_some();
        let healthy = backend_healthy && !self.patch_failed;
        self.leases.observe_backend(healthy, now.unix_ms);
        let was_frozen = self.readiness.is_frozen();
        let grace = (CHECK_IN_PERIOD + self.config.resync).as_secs() as i64;
        self.readiness.observe(now.unix_secs(), healthy, grace);
        if self.readiness.is_frozen() != was_frozen {
            let backend = "backend";
            if was_frozen {
                self.journal.record(
                    Reason::BackendReachable,
                    backend,
                    "the backend is reachable again; judging check-ins by the clock",
                );
            } else {
                self.journal.record(Reason::BackendUnreachable, backend, "the backend is unreachable; keeping the last good mesh (other nodes' check-ins are judged as of the last contact)");
            }
        }
        let readiness_now = self.readiness.now(now.unix_secs());
        self.table.advance(readiness_now);
        self.pass = Some(Pass {
            trigger,
            full,
            dump_kept: false,
            local_object: self.local_object.clone(),
            readiness_now,
            step: match (&self.engine_lost, full) {
                (Some(why), _) => Step::Recreate(why.clone(), detection),
                (None, true) => Step::ListHost(detection),
                (None, false) => Step::Observe,
            },
            failure: None,
            converged: None,
        });
        true
    }

    /// Closes the pass at `now` and returns how it went; a failed one, or one that left a part
    /// of the host unconverged, is tried again after a backoff ([`Timer::Retry`]). Held flips or firewall writes whose deadline passed (the
    /// pass failed before it could take them) wait another interval, so the loop never spins.
    pub fn end_pass(&mut self, now: Now) -> anyhow::Result<()> {
        self.readiness_batch.reconciled(now.instant);
        self.firewall_hold.reconciled(now.instant);
        let (trigger, failure, converged) = match self.pass.take() {
            Some(pass) => (Some(pass.trigger), pass.failure, pass.converged),
            None => (None, None, None),
        };
        let outcome = match (&failure, converged) {
            (Some(_), _) | (None, Some(false)) => timers::PassOutcome::Failed,
            (None, Some(true)) => timers::PassOutcome::Whole,
            (None, None) => timers::PassOutcome::Untried,
        };
        self.timers
            .pass_ended(outcome, now.instant, self.config.resync);
        self.pq_pass_ended(trigger, outcome == timers::PassOutcome::Failed, now);
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Works out the local node (its translation filled in from the host and kg's own state)
    /// and what changed since the last pass. Fails when the host was never listed.
    fn observe(&mut self, pass: &Pass, now: Now) -> anyhow::Result<Observed> {
        if !self.discovery_seeded {
            if let Some(own) = self.table.get(&self.config.hostname) {
                // What the last run published, where the restored device knows nothing newer.
                for (key, addr) in &own.discovered_endpoints {
                    self.discovered.entry(*key).or_insert(*addr);
                }
                self.discovery_seeded = true;
            }
        }
        let empty = BTreeMap::new();
        let annotations = pass
            .local_object
            .as_ref()
            .and_then(|o| o.metadata.annotations.as_ref())
            .unwrap_or(&empty);
        let (mut local, refused) = self.local_node(annotations, now.unix_secs())?;
        let refusals = refused.iter().map(ToString::to_string).collect();
        for line in self
            .problems
            .fresh_lines("local force-internal-ip", refusals)
        {
            self.journal
                .record(Reason::BadAnnotation, &self.config.hostname, &line);
            self.errors.push(line);
        }
        let local_changed = match &self.local {
            Some(last) => differs_beyond_check_in(last, &mut local),
            None => true,
        };
        // A Node's content changing counts at once; readiness flips alone, at most once per
        // READINESS_INTERVAL (held flips wake the loop at `readiness_deadline`).
        let table_changes = self.table.take_changes();
        let readiness_due = self
            .readiness_batch
            .due(table_changes.readiness, now.instant);
        let changes = Changes {
            host: pass.full,
            nodes: table_changes.nodes,
            readiness: readiness_due,
            firewall: self.firewall_hold.due(now.instant),
            peers: std::mem::take(&mut self.peers_changed),
            local: local_changed,
            dns: std::mem::take(&mut self.dns_changed),
            leases: self.leases.changed(),
            keys: self.pq_keys_due(),
            endpoints: std::mem::take(&mut self.endpoints_moved),
        };
        if changes.names_may_change() {
            self.track_dns_names(&local, now);
        }
        let elect = changes.elect(self.leases_on(), pass.trigger);
        Ok(Observed {
            local,
            changes,
            elect,
            ready: None,
            elected: false,
            leaders_changed: false,
            meshed: None,
        })
    }

    /// Elects leaders from the leases and the ready nodes, readiness judged at
    /// `readiness_now`.
    fn elect(&mut self, observed: &mut Observed, readiness_now: i64, now: Now) {
        let local = &observed.local;
        let nodes = self.ready_nodes(local);
        let local_name = local.name.clone();
        let shares = self.leaders_per_location(&nodes);
        let electors = nodes
            .iter()
            .filter(|n| n.name != local_name || n.is_ready(readiness_now));
        let judged_at = self.leases.judged_at(now.unix_ms);
        let elected = self.leases.elect(electors, shares, judged_at);
        match elected.agreement {
            Some(control::leader::Agreement::Leases) => self.journal.record(
                Reason::LeadersByLease,
                &local_name,
                "every ready node runs kilotun with --leader-election=lease: leaders are chosen by lease",
            ),
            Some(control::leader::Agreement::KiloRule { holdout, count }) => self.journal.record(
                Reason::LeadersByKiloRule,
                &holdout,
                format!("leaders are chosen by Kilo's rule: {count} ready node(s), {holdout} first, do not take part in lease election (Kilo's agent, or kg with --leader-election=kilo) and pick every location's leader by Kilo's rule"),
            ),
            None => {}
        }
        observed.leaders_changed = elected.leaders_changed;
        observed.elected = true;
        observed.ready = Some(nodes);
    }

    /// The local node: its translation, filled in from the host and kg's own state, and the
    /// `force-internal-ip` refused, if any.
    fn local_node(
        &self,
        annotations: &BTreeMap<String, String>,
        now_unix: i64,
    ) -> anyhow::Result<(Node, Option<local::RefusedInternalIp>)> {
        let host = self
            .host
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the host has not been listed"))?;
        let mut local = self
            .table
            .get(&self.config.hostname)
            .cloned()
            .unwrap_or(Node {
                name: self.config.hostname.clone(),
                ..Default::default()
            });
        let refused = local::fill_local(
            &mut local,
            annotations,
            &host.detected,
            self.config.prioritise_private_addresses,
            self.config.port,
        );
        let published = local.second_internal_ip;
        local.second_internal_ip = local
            .internal_ip
            .and_then(|internal| host.second_internal_ip(internal, published));
        local.key = Some(self.public);
        local.last_seen = now_unix;
        local.granularity = Some(self.config.granularity);
        // What this kg does, not what its Node said before its annotations were written.
        local.lease_election = self.leases_on();
        local.discovered_endpoints = self.discovered.clone();
        Ok((local, refused))
    }

    /// The ready Nodes, and the local one (`local`, ready or not).
    fn ready_nodes(&self, local: &Node) -> Vec<Node> {
        let hostname = &self.config.hostname;
        let mut nodes: Vec<Node> = Vec::new();
        let mut local_listed = false;
        for (node, ready) in self.table.iter() {
            if node.name == *hostname {
                local_listed = true;
                nodes.push(local.clone());
            } else if ready {
                nodes.push(node.clone());
            }
        }
        if !local_listed {
            nodes.push(local.clone());
        }
        nodes
    }
}
