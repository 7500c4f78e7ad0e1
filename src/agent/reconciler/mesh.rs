//! The mesh step of a pass: the topology from the ready nodes and Peers, compared with the
//! last one, and the [`Convergence`] the shells carry out when the host must follow it.

use std::sync::Arc;

use control::clock::Now;
use control::desired::{self, DesiredHost, HostSettings, ResolvedLinks};
use control::ipam::IpamSource;
use control::iptables::RuleSet;
use control::journal::Reason;
use control::nat::DevicePeer;
use control::nat::{discover_nat_endpoints, endpoint_switches};
use control::node::Node;
use control::{Peer, Topology, TopologyParams};

use super::pass::{MeshReport, Observed, Pass};
use super::Reconciler;

/// What the host must be brought to: the topology, and how the shells compare each part.
#[derive(Debug, Clone)]
pub struct Convergence {
    /// The topology to apply.
    pub topology: Arc<Topology>,
    /// True when it differs from the last one (what `/graph` draws changes).
    pub changed: bool,
    /// True when the host was listed this pass: every part is compared afresh, and the
    /// endpoints learnt from handshakes are read again ([`Reconciler::learn_endpoints`]).
    pub full: bool,
    /// True when readiness flips alone changed the mesh: the firewall may wait
    /// ([`Reconciler::firewall_step`]).
    pub flips_only: bool,
}

/// Whether the firewall is written now ([`Reconciler::firewall_step`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FirewallStep {
    /// The rules are those last written.
    Unchanged,
    /// Readiness flips alone changed them and the firewall was written too recently: they wait
    /// for the next change or for the hold's deadline.
    Held,
    /// Write them; `previous` are the rules last written (`None`: unknown, read the host's).
    Write {
        /// The rules last written.
        previous: Option<RuleSet>,
    },
}

impl Reconciler {
    /// Computes the topology for `pass` from what it `observed`, when something the topology is
    /// made of changed (or the last attempt did not settle): `None` when the mesh is not due
    /// this pass, else what the step found and the convergence the host must follow, if any.
    pub(super) fn mesh(
        &mut self,
        pass: &Pass,
        observed: &mut Observed,
        now: Now,
    ) -> anyhow::Result<Option<(MeshReport, Option<Convergence>)>> {
        let changes = observed.changes;
        if !changes.mesh(observed.leaders_changed, self.settled) {
            return Ok(None);
        }
        let local = observed.local.clone();
        let flips_only = changes.flips_only(observed.leaders_changed) && !pass.full;
        let (full, readiness_now) = (pass.full, pass.readiness_now);
        let ready = observed.ready.clone();
        self.readiness_batch.meshed(now.instant);
        self.local = Some(local.clone());
        self.settled = false;

        let hostname = self.config.hostname.clone();
        let mut nodes = ready.unwrap_or_else(|| self.ready_nodes(&local));
        let mut peers = self.peers.clone();
        for e in nodes
            .iter_mut()
            .filter_map(|n| n.endpoint.as_mut())
            .chain(peers.iter_mut().filter_map(|p| p.endpoint.as_mut()))
        {
            self.dns.fill(e);
        }
        nodes.retain(|n| n.name != hostname || n.is_ready(readiness_now));
        peers.retain(Peer::is_ready);
        let (node_count, peer_count) = (nodes.len(), peers.len());
        if !nodes.iter().any(|n| n.name == hostname) {
            let why = if local.endpoint.is_none() && local.persistent_keepalive == 0 {
                "kilo.squat.ai/force-endpoint says it has no endpoint, so it needs kilo.squat.ai/persistent-keepalive: nothing could reach it first"
            } else {
                "it needs spec.podCIDR"
            };
            if self.problems.first_time("local-not-ready") {
                self.journal.record(
                    Reason::NotReady,
                    &hostname,
                    format!("node {hostname} is not ready ({why}); not configuring the mesh yet"),
                );
            }
            self.topology = None;
            self.settled = true;
            let report = MeshReport {
                nodes: node_count,
                peers: peer_count,
                computed: false,
            };
            return Ok(Some((report, None)));
        }
        let params = TopologyParams {
            granularity: self.config.granularity,
            hostname: hostname.clone(),
            port: local.endpoint.as_ref().map_or(self.config.port, |e| e.port),
            subnet: self.config.subnet,
            persistent_keepalive: local.persistent_keepalive,
            leaders_per_location: self.leaders_per_location(&nodes),
            kept_out: self.leases.kept_out(),
        };
        let mut t = Topology::with_leaders(&nodes, &peers, &params, &self.leases.leader_names())?
            .with_standby(&nodes, &self.leases.verifiers());
        self.choose_endpoints(&mut t, now);
        let changed = self.topology.as_deref() != Some(&t);
        if changed {
            self.say_what_the_topology_drops(&t);
            self.say_which_agents_route_node_cidrs(&nodes);
        }
        let firewall_due = self.firewall_hold.due(now.instant);
        // An unchanged topology stays the same allocation, so what is derived from it (the
        // Peers' statuses) knows it unchanged by pointer.
        let t = match &self.topology {
            Some(last) if !changed => Arc::clone(last),
            _ => Arc::new(t),
        };
        let converge = if full || changed || !self.converged_whole || firewall_due || changes.keys {
            // Forget the topology until it is applied: a failure retries on the next pass.
            self.topology = None;
            if full {
                self.firewall_rules = None;
            }
            Some(Convergence {
                topology: t,
                changed,
                full,
                flips_only,
            })
        } else {
            self.topology = Some(t);
            self.settled = true;
            None
        };
        observed.meshed = Some((nodes, peers));
        let report = MeshReport {
            nodes: node_count,
            peers: peer_count,
            computed: true,
        };
        Ok(Some((report, converge)))
    }

    /// The shells brought the host to `c` (`ok`), or failed part way (the pass then ends and
    /// the next one tries again). `routes_known`: the kernel's routes and rules are known
    /// after it (false when a change failed and they must be listed again).
    pub fn converged(&mut self, c: Convergence, ok: bool, routes_known: bool) {
        self.converged_whole = ok && routes_known && self.firewall_rules.is_some();
        if ok {
            self.topology = Some(c.topology);
            self.settled = true;
        }
    }

    /// Whether the firewall is written now with `rules` (at `now`): not when they are the
    /// rules last written, nor while readiness flips alone (`flips_only`) changed them and the
    /// firewall was written less than [`control::coalesce::FIREWALL_INTERVAL`] ago.
    pub fn firewall_step(&mut self, rules: &RuleSet, flips_only: bool, now: Now) -> FirewallStep {
        if self.firewall_rules.as_ref() == Some(rules) {
            self.firewall_hold.unneeded();
            return FirewallStep::Unchanged;
        }
        if !self.firewall_hold.write_now(flips_only, now.instant) {
            tracing::debug!("readiness flips alone changed the firewall's rules; writing them with the next change, or when the hold ends");
            return FirewallStep::Held;
        }
        FirewallStep::Write {
            previous: self.firewall_rules.take(),
        }
    }

    /// The firewall was written with `rules` at `now` (`None`: the write failed, and the
    /// next one reads the host's rules first).
    pub fn firewall_written(&mut self, rules: Option<RuleSet>, now: Now) {
        if rules.is_some() {
            self.firewall_hold.written(now.instant);
        }
        self.firewall_rules = rules;
    }

    /// Takes in the endpoints the device's handshakes came from (`device`, read on a full
    /// pass, while the host converges), for `nodes` and `peers`, those the mesh was just
    /// computed from: NAT discovery.
    pub(super) fn learn_endpoints(
        &mut self,
        device: &[DevicePeer],
        nodes: &[Node],
        peers: &[Peer],
    ) {
        let found = discover_nat_endpoints(device, nodes, peers, &self.discovered);
        for (key, from, to) in endpoint_switches(&self.discovered, &found) {
            let name = nodes
                .iter()
                .find(|n| n.key == Some(key))
                .map(|n| n.name.clone())
                .or_else(|| {
                    peers
                        .iter()
                        .find(|p| p.public_key == Some(key))
                        .map(|p| p.name.clone())
                })
                .unwrap_or_else(|| key.to_string());
            self.journal.record(
                Reason::EndpointSwitched,
                name.clone(),
                format!("{name}'s handshakes come from {to} now, no longer from {from}: kg sends to it there (NAT discovery)"),
            );
        }
        self.discovered = found;
    }

    /// The desired host state for topology `t` ([`control::desired::plan`]): the links named
    /// by role and resolved as `links` says, with the routes kg holds and the encapsulation
    /// link it uses. Fails when the host was never listed.
    pub fn desired(&self, t: &Topology, links: &ResolvedLinks) -> anyhow::Result<DesiredHost> {
        let host = self
            .host
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the host has not been listed"))?;
        let a = &self.config;
        let settings = HostSettings {
            interface: a.interface.clone(),
            mtu: self.config.mtu,
            cni: a.cni,
            cni_conflist: self.ipam_source().is_none_or(|s| s == IpamSource::Node),
            local: a.local,
            encapsulate: self.config.encapsulate,
            compatibility: self.config.compatibility,
            forward_rules: a.forward_rules,
            service_cidrs: self.config.service_cidrs.clone(),
            tunnel: self.host_book.tunnel_kind.clone(),
            tunnel_guard: self.config.tunnel_guard,
        };
        Ok(desired::plan(
            t,
            &host.net,
            links,
            &self.host_book.owned,
            &self.public,
            &settings,
        ))
    }

    /// Says once per node what `t` reaches only by its handshakes, and what it dropped.
    fn say_what_the_topology_drops(&mut self, t: &Topology) {
        // Said once per node, as information: announcing no endpoint is a choice.
        let endpointless = t
            .segments
            .iter()
            .filter(|s| s.endpoint.is_none() && !t.in_local_location(s))
            .map(|s| format!("node {} announces no endpoint: it is reached at the endpoint its handshakes come from (it keeps its tunnels alive every {} s)", s.leader_member().name, s.persistent_keepalive))
            .collect();
        for line in self.problems.fresh_lines("endpointless", endpointless) {
            self.journal.record(Reason::NoEndpoint, "", line);
        }
        for d in &t.dropped {
            for line in self.problems.fresh_lines(
                &format!("dropped/{}/{}", d.owner, d.cidr),
                vec![format!("{}: {} dropped: {}", d.owner, d.cidr, d.reason)],
            ) {
                self.journal
                    .record(Reason::RangeDropped, d.cidr.to_string(), line);
            }
        }
    }
}
