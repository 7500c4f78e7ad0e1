//! The reconcile pipeline, one stage after another, each output a plain value compared with
//! the last one: the backend's changed objects → the node table (translation and readiness) →
//! the local node → the topology → the desired host state ([`super::apply`]) → the annotations
//! kg publishes. A stage whose output equals the last one ends the reconcile there, so a Node
//! update that moves only a `last-seen` (the steady churn of every Kilo cluster) stops after the
//! table and touches neither the kernel nor iptables nor WireGuard. Resyncs and
//! kernel notifications list the host again and run every stage.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use control::clock::Now;
use control::coalesce::{FirewallHold, ReadinessBatch};
use control::node::{Node, WrittenAnnotations};
use control::pass::{tends_lease, Changes};
use control::table::{differs_beyond_check_in, NodeTable};
use control::{translate_peer, Peer, Topology, TopologyParams};
use k8s_openapi::api::core::v1::Node as KubeNode;

use super::apply::Applied;
use super::host::local;
use super::host::{read_host, DetectionInputs, HostView, OwnSide};
use super::shells::{Engine, Firewall, Kernel};
use super::stages::Stage;
use super::{read_clock, Agent, Trigger, CHECK_IN_PERIOD};
use crate::backend::Snapshot;

/// What the stages produced last time.
pub(super) struct Memo {
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
    pub(super) host: Option<HostView>,
    /// The local Node's object, as last ingested.
    local_object: Option<Arc<KubeNode>>,
    /// What the host was last read with from the local Node's object.
    detection: DetectionInputs,
    /// The local Node's annotations as seen when kg last patched them, and that patch.
    last_patch: Option<(BTreeMap<String, String>, local::AnnotationPatch)>,
    /// The local node the mesh was last computed with.
    local: Option<Node>,
    /// The last topology (`None` while the local node is not ready).
    pub(super) topology: Option<Topology>,
    /// True once a mesh was computed and applied without error.
    settled: bool,
    /// What was last applied to the host.
    pub(super) applied: Applied,
    /// The links the netlink shell last resolved the host state's roles to.
    pub(super) resolved: control::desired::ResolvedLinks,
    /// True once the engine was first configured (and asked to handshake with every peer).
    pub(super) engine_configured: bool,
    /// Leader-election leases and the leaders they give.
    pub(super) leases: control::leader::book::LeaseBook,
    /// Readiness flips not yet taken into the mesh ([`control::coalesce`]).
    pub(super) readiness_batch: ReadinessBatch,
    /// Firewall writes held while readiness flips alone change the rules.
    pub(super) firewall_hold: FirewallHold,
    /// True once a snapshot with everything listed was ingested (see `Snapshot::listed`).
    listed: bool,
}

impl Memo {
    /// Nothing computed yet.
    pub(super) fn new(topology_label: &str) -> Self {
        Self {
            table: NodeTable::new(topology_label),
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
            applied: Applied::default(),
            resolved: Default::default(),
            engine_configured: false,
            leases: Default::default(),
            readiness_batch: ReadinessBatch::default(),
            firewall_hold: FirewallHold::default(),
            listed: false,
        }
    }
}

impl<N: Kernel, F: Firewall, W: Engine> Agent<N, F, W> {
    /// One reconcile after `trigger`, now: [`Agent::reconcile_at`] the clock's time.
    pub async fn reconcile(&mut self, snapshot: &Snapshot, trigger: Trigger) -> Result<()> {
        self.reconcile_at(snapshot, trigger, read_clock()).await
    }

    /// One reconcile after `trigger` at `now`: [`Agent::ingest`] `snapshot`, then
    /// [`Agent::settle`].
    pub async fn reconcile_at(
        &mut self,
        snapshot: &Snapshot,
        trigger: Trigger,
        now: Now,
    ) -> Result<()> {
        self.ingest(snapshot, now);
        self.settle(trigger, now).await
    }

    /// Carries what [`Agent::ingest`] took in (and the time passed, to `now`) through as many
    /// stages as it changes, and says where the time went ([`super::stages`]).
    pub async fn settle(&mut self, trigger: Trigger, now: Now) -> Result<()> {
        let settled = self.run_stages(trigger, now).await;
        self.memo.readiness_batch.reconciled(now.instant);
        self.memo.firewall_hold.reconciled(now.instant);
        self.stages.finish(trigger, settled.is_ok(), &self.metrics);
        settled
    }

    /// [`Agent::settle`]'s stages.
    async fn run_stages(&mut self, trigger: Trigger, now: Now) -> Result<()> {
        self.metrics.reconciles.inc();
        if !self.memo.listed {
            // Nodes without their leases would elect by Kilo's rule, a leader the leases may
            // not name: nothing is decided from a partial picture.
            tracing::debug!("waiting for the backend's first list of Nodes, Peers and Leases");
            return Ok(());
        }
        let now_unix = now.unix_secs();
        let detection = DetectionInputs::of(self.memo.local_object.as_deref());
        let full = Changes::host_listing(
            trigger,
            self.memo.host.is_some(),
            self.memo.detection != detection,
        );
        let healthy = self.backend.healthy() && !self.patch_failed;
        self.memo.leases.observe_backend(healthy, now.unix_ms);
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
        self.memo.table.advance(readiness_now);
        if full {
            let own = OwnSide {
                kilo_index: self.kilo_index,
                tunnel: self.tunnel.name(),
                hostname_ips: &self.hostname_ips,
                subnet: self.s.subnet,
                internal_cidrs: &self.s.internal_cidrs,
            };
            let started = Instant::now();
            self.memo.host = Some(read_host(&self.netlink, &own, &detection).await?);
            self.stages.lap(Stage::Host, started);
            self.memo.detection = detection;
        }

        let empty = BTreeMap::new();
        let local_object = self.memo.local_object.clone();
        let local_annotations = local_object
            .as_ref()
            .and_then(|o| o.metadata.annotations.as_ref())
            .unwrap_or(&empty);
        if !self.discovery_seeded {
            if let Some(own) = self.memo.table.get(&self.s.hostname) {
                // What the last run published, where the restored device knows nothing newer.
                for (key, addr) in &own.discovered_endpoints {
                    self.discovered.entry(*key).or_insert(*addr);
                }
                self.discovery_seeded = true;
            }
        }
        let (mut local, refused) = self.local_node(local_annotations, now_unix)?;
        let refusals = refused.iter().map(ToString::to_string).collect();
        for line in self
            .problems
            .fresh_lines("local force-internal-ip", refusals)
        {
            tracing::error!("{line}");
            self.status.error(line);
        }
        let local_changed = match &self.memo.local {
            Some(last) => differs_beyond_check_in(last, &mut local),
            None => true,
        };
        // A Node's content changing counts at once; readiness flips alone, at most once per
        // READINESS_INTERVAL (held flips wake the loop at `readiness_deadline`).
        let changes = self.memo.table.take_changes();
        let readiness_due = self
            .memo
            .readiness_batch
            .due(changes.readiness, now.instant);
        let changed = Changes {
            host: full,
            nodes: changes.nodes,
            readiness: readiness_due,
            firewall: self.memo.firewall_hold.due(now.instant),
            peers: std::mem::take(&mut self.memo.peers_changed),
            local: local_changed,
            dns: std::mem::take(&mut self.dns_changed),
            leases: self.memo.leases.changed(),
        };
        if changed.names_may_change() {
            self.track_dns_names(&local, now);
        }

        let mut ready = None;
        let mut leaders_changed = false;
        let elect = changed.elect(self.leases_on(), trigger);
        if elect {
            let started = Instant::now();
            let nodes = self.ready_nodes(&local);
            let electors = nodes
                .iter()
                .filter(|n| n.name != local.name || n.is_ready(readiness_now));
            let judged_at = self.memo.leases.judged_at(now.unix_ms);
            let elected = self.memo.leases.elect(electors, judged_at);
            leaders_changed = elected.leaders_changed;
            match elected.agreement {
                Some(control::leader::Agreement::Leases) => tracing::info!(
                    "every ready node runs kilotun with --leader-election=lease: leaders are chosen by lease"
                ),
                Some(control::leader::Agreement::KiloRule { holdout, count }) => tracing::info!(
                    node = %holdout,
                    without_leases = count,
                    "leaders are chosen by Kilo's rule: {count} ready node(s), {holdout} first, do not take part in lease election (Kilo's agent, or kg with --leader-election=kilo) and pick every location's leader by Kilo's rule"
                ),
                None => {}
            }
            ready = Some(nodes);
            self.stages.lap(Stage::Leases, started);
        }

        if changed.mesh(leaders_changed, self.memo.settled) {
            self.memo.readiness_batch.meshed(now.instant);
            self.memo.local = Some(local.clone());
            self.memo.settled = false;
            let flips_only = changed.flips_only(leaders_changed);
            self.mesh(&local, readiness_now, full, flips_only, ready.clone(), now)
                .await?;
            self.memo.settled = true;
        }
        if tends_lease(trigger, elect) {
            if let Some(nodes) = &ready {
                self.tend_lease(nodes, now.unix_ms).await;
            }
        }
        self.publish(
            local_annotations,
            &local,
            now_unix,
            trigger == Trigger::CheckIn,
        )
        .await
    }

    /// Takes in what changed in `snapshot`: brings the node table to it, through the change
    /// log when it reaches back to the last revision seen (else every Node is compared), and
    /// re-translates the Peers when they changed. Costs in proportion to the changes and keeps
    /// nothing of `snapshot` but the shared objects, so the backend never has to copy a
    /// snapshot a reader still holds.
    pub fn ingest(&mut self, snapshot: &Snapshot, now: Now) {
        self.stages.begin();
        let started = Instant::now();
        self.take_in(snapshot, now);
        self.stages.lap(Stage::Translate, started);
    }

    /// [`Agent::ingest`]'s work.
    fn take_in(&mut self, snapshot: &Snapshot, now: Now) {
        self.memo.listed |= snapshot.listed.all();
        self.memo.local_object = snapshot.nodes.get(&self.s.hostname).cloned();
        self.memo.leases.ingest(&snapshot.leases, now.unix_ms);
        let table = &mut self.memo.table;
        let mut translated = Vec::new();
        match self.memo.revision.and_then(|r| snapshot.changes.since(r)) {
            Some(names) => {
                for name in names {
                    let object = snapshot.nodes.get(name);
                    if let Some(problems) = table.update(name, object) {
                        translated.push((name.to_string(), problems));
                    }
                }
            }
            None => translated = table.sync(&snapshot.nodes),
        }
        self.memo.revision = Some(snapshot.changes.revision());
        for (name, problems) in translated {
            for line in self.problems.fresh(&name, &problems) {
                tracing::warn!("bad annotation on node {line}");
            }
        }
        let peer_revision = snapshot.changes.peer_revision();
        if self.memo.peer_revision == Some(peer_revision) {
            return;
        }
        self.memo.peer_revision = Some(peer_revision);
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
        if peers != self.memo.peers {
            self.memo.peers = peers;
            self.memo.peers_changed = true;
        }
    }

    /// The local node: its translation, filled in from the host and kg's own state, and the
    /// `force-internal-ip` refused, if any.
    fn local_node(
        &self,
        annotations: &BTreeMap<String, String>,
        now_unix: i64,
    ) -> Result<(Node, Option<local::RefusedInternalIp>)> {
        let host = self
            .memo
            .host
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the host has not been listed"))?;
        let mut local = self
            .memo
            .table
            .get(&self.s.hostname)
            .cloned()
            .unwrap_or(Node {
                name: self.s.hostname.clone(),
                ..Default::default()
            });
        let refused = local::fill_local(
            &mut local,
            annotations,
            &host.detected,
            self.s.args.prioritise_private_addresses,
            self.s.args.port,
        );
        let published = local.second_internal_ip;
        local.second_internal_ip = local
            .internal_ip
            .and_then(|internal| host.second_internal_ip(internal, published));
        local.key = Some(self.public);
        local.last_seen = now_unix;
        local.granularity = Some(self.s.granularity);
        // What this kg does, not what its Node said before its annotations were written.
        local.lease_election = self.leases_on();
        local.discovered_endpoints = self.discovered.clone();
        Ok((local, refused))
    }

    /// Tracks every DNS name in use (Nodes, ready or not, and Peers) for re-resolution.
    fn track_dns_names(&mut self, local: &Node, now: Now) {
        let hostname = &self.s.hostname;
        let names: Vec<String> = self
            .memo
            .table
            .iter()
            .map(|(n, _)| n)
            .filter(|n| n.name != *hostname)
            .chain(std::iter::once(local))
            .filter_map(|n| n.endpoint.as_ref()?.dns_name().map(str::to_string))
            .chain(
                self.memo
                    .peers
                    .iter()
                    .filter_map(|p| p.endpoint.as_ref()?.dns_name().map(str::to_string)),
            )
            .collect();
        self.dns
            .track(names.iter().map(String::as_str), now.instant);
    }

    /// The ready Nodes, and the local one (`local`, ready or not).
    fn ready_nodes(&self, local: &Node) -> Vec<Node> {
        let hostname = &self.s.hostname;
        let mut nodes: Vec<Node> = Vec::new();
        let mut local_listed = false;
        for (node, ready) in self.memo.table.iter() {
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

    /// Computes the topology from the ready Nodes (`ready`, when already listed) and Peers
    /// and, when it differs from the last one (or on a full reconcile), applies it to the host.
    async fn mesh(
        &mut self,
        local: &Node,
        readiness_now: i64,
        full: bool,
        flips_only: bool,
        ready: Option<Vec<Node>>,
        now: Now,
    ) -> Result<()> {
        let started = Instant::now();
        let hostname = self.s.hostname.clone();
        let mut nodes = match ready {
            Some(nodes) => nodes,
            None => self.ready_nodes(local),
        };
        let mut peers = self.memo.peers.clone();
        for e in nodes
            .iter_mut()
            .filter_map(|n| n.endpoint.as_mut())
            .chain(peers.iter_mut().filter_map(|p| p.endpoint.as_mut()))
        {
            self.dns.fill(e);
        }
        nodes.retain(|n| n.name != hostname || n.is_ready(readiness_now));
        peers.retain(Peer::is_ready);
        self.metrics.nodes.set(nodes.len() as i64);
        self.metrics.peers.set(peers.len() as i64);

        let local_ready = nodes.iter().any(|n| n.name == hostname);
        if !local_ready {
            let why = if local.endpoint.is_none() && local.persistent_keepalive == 0 {
                "kilo.squat.ai/force-endpoint says it has no endpoint, so it needs kilo.squat.ai/persistent-keepalive: nothing could reach it first"
            } else {
                "it needs spec.podCIDR"
            };
            self.warn_once(
                "local-not-ready",
                &format!("node {hostname} is not ready ({why}); not configuring the mesh yet"),
            );
            self.memo.topology = None;
            return Ok(());
        }
        let params = TopologyParams {
            granularity: self.s.granularity,
            hostname: hostname.clone(),
            port: local.endpoint.as_ref().map_or(self.s.args.port, |e| e.port),
            subnet: self.s.subnet,
            persistent_keepalive: local.persistent_keepalive,
        };
        let t = Topology::with_leaders(&nodes, &peers, &params, &self.memo.leases.leader_names())?
            .with_standby(&nodes, &self.memo.leases.verifiers());
        let same = self.memo.topology.as_ref() == Some(&t);
        if !same {
            *self.graph.lock() = Some(super::serve::http::GraphSource {
                topology: Arc::new(t.clone()),
                withheld: Default::default(),
            });
            // Said once per node, as information: announcing no endpoint is a choice.
            let endpointless = t
                .segments
                .iter()
                .filter(|s| s.endpoint.is_none() && !t.in_local_location(s))
                .map(|s| format!("node {} announces no endpoint: it is reached at the endpoint its handshakes come from (it keeps its tunnels alive every {} s)", s.leader_member().name, s.persistent_keepalive))
                .collect();
            for line in self.problems.fresh_lines("endpointless", endpointless) {
                tracing::info!("{line}");
            }
            for d in &t.dropped {
                for line in self.problems.fresh_lines(
                    &format!("dropped/{}/{}", d.owner, d.cidr),
                    vec![format!("{}: {} dropped: {}", d.owner, d.cidr, d.reason)],
                ) {
                    tracing::warn!("{line}");
                }
            }
        }
        self.stages.lap(Stage::Topology, started);
        let firewall_due = self.memo.firewall_hold.due(now.instant);
        if full || !same || !self.memo.applied.complete() || firewall_due {
            // Forget the topology until it is applied: a failure retries on the next event.
            self.memo.topology = None;
            let flips_only = flips_only && !full;
            self.apply(&t, &nodes, &peers, full, flips_only, now.instant)
                .await?;
        }
        self.memo.topology = Some(t);
        Ok(())
    }

    /// Publishes the local node's annotations where they differ from the backend's.
    async fn publish(
        &mut self,
        local_annotations: &BTreeMap<String, String>,
        local: &Node,
        now_unix: i64,
        check_in: bool,
    ) -> Result<()> {
        let current_last_seen = local_annotations
            .get(control::node::annotation::LAST_SEEN)
            .and_then(|v| v.parse::<i64>().ok());
        let last_seen = local::last_seen_to_publish(
            current_last_seen,
            now_unix,
            check_in,
            CHECK_IN_PERIOD.as_secs() as i64,
        );
        let cni_compatibility_ip = match self.s.compatibility {
            control::routes::Compatibility::Cilium => {
                self.memo.host.as_ref().and_then(HostView::cilium_host_ip)
            }
            _ => None,
        };
        let written = WrittenAnnotations {
            endpoint: local.endpoint.clone(),
            internal_ip: local.internal_ip,
            key: self.public,
            last_seen,
            wireguard_ip: self
                .memo
                .topology
                .as_ref()
                .filter(|t| t.leader)
                .map(|t| t.wireguard_cidr),
            discovered_endpoints: self.discovered.clone(),
            granularity: self.s.granularity,
            cni_compatibility_ip,
            second_internal_ip: local.second_internal_ip,
            leader_election: self.leases_on(),
        };
        if let Some(changes) =
            local::patch_due(local_annotations, &written, self.memo.last_patch.as_ref())
        {
            let patched = self
                .backend
                .patch_annotations(&self.s.hostname, &changes)
                .await;
            self.patch_failed = patched.is_err();
            patched?;
            self.memo.last_patch = Some((local_annotations.clone(), changes));
        }
        Ok(())
    }
}
