//! Brings the host to the desired state: [`control::desired::plan`] computes it as one value
//! (the link's MTU, address and state, the CNI configuration, the tunnel, the routes and rules,
//! the WireGuard device, the firewall) before any shell runs; each part is then compared with
//! what kg last applied (and, for routes, with the kernel state kg last observed plus its own
//! changes) and only a part that differs is written. A full reconcile (resync, kernel
//! notification) compares against freshly listed state instead, so anything changed behind
//! kg's back comes back within one resync.

use std::time::Instant;

use anyhow::Result;
use control::desired::{
    self, CniState, DesiredHost, HostSettings, LinkState, ResolvedLinks, TunnelKind, TunnelSpec,
};
use control::iptables::RuleSet;
use control::nat::discover_nat_endpoints;
use control::node::Node;
use control::routes::{apply_ops, diff, RoutePlan, Withheld};
use control::wgconf::Conf;
use control::{Peer, Topology};
use dataplane::DeviceConfig;
use ipnet::IpNet;

use super::shells::{Engine, Firewall, Kernel};
use super::stages::Stage;
use super::{state, Agent};

/// What kg last applied to the host, part by part (`None`: unknown, apply it).
#[derive(Debug, Default)]
pub(super) struct Applied {
    device: Option<DeviceConfig>,
    /// The device as planned when it was last applied, and whether this node led then.
    conf: Option<(Conf, bool)>,
    address: Option<Option<IpNet>>,
    cni: Option<CniState>,
    /// What the tunnel was prepared for, and the links that gave.
    tunnel: Option<(TunnelSpec, ResolvedLinks)>,
    /// The kernel's routes and rules as last observed, with kg's changes since.
    kernel_routes: Option<RoutePlan>,
    rules: Option<RuleSet>,
}

impl Applied {
    /// False when some part failed last time and must be applied again.
    pub(super) fn complete(&self) -> bool {
        self.kernel_routes.is_some() && self.rules.is_some()
    }
}

impl<N: Kernel, F: Firewall, W: Engine> Agent<N, F, W> {
    /// Brings the host to `t`. `nodes` and `peers` are the ready ones (for NAT discovery).
    ///
    /// The engine changes before the links and routes when that is safe
    /// ([`desired::engine_before_routes`]: the node keeps its role and no route to a new or
    /// moved peer's endpoint changes), so the routes' cost, which grows with the cluster, never
    /// delays the tunnel. Otherwise it changes after them: a node taking over a location
    /// answers its new peers' first initiations (held by the engine for this moment) at once,
    /// and the answers must leave by the new routes, not by the old ones through the
    /// location's last leader, which sent them to a dead node and cost a 5 s handshake retry.
    /// Either way it changes even when the links or routes failed, so a failing host step
    /// never keeps the node's peers from it; the failure is returned after. When readiness
    /// flips alone changed the mesh (`flips_only`), the firewall may wait
    /// ([`control::coalesce::FirewallHold`]).
    pub(super) async fn apply(
        &mut self,
        t: &Topology,
        nodes: &[Node],
        peers: &[Peer],
        full: bool,
        flips_only: bool,
        now: Instant,
    ) -> Result<()> {
        if full {
            self.memo.applied = Applied::default();
            self.discover_endpoints(nodes, peers);
        }
        let started = Instant::now();
        let settings = self.host_settings();
        let host = self
            .memo
            .host
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("the host has not been listed"))?;
        let links = ResolvedLinks {
            kilo: self.kilo_index,
            ..self.memo.resolved
        };
        let mut want = desired::plan(t, &host.net, &links, &self.owned, &self.public, &settings);
        // The tunnel's links stay as planned (a new tunnel would plan the routes again).
        let links_kept = match (&want.tunnel, &self.memo.applied.tunnel) {
            (None, _) => true,
            (Some(spec), Some((applied, _))) => spec == applied,
            (Some(_), None) => false,
        };
        let engine_first = self.memo.engine_configured
            && links_kept
            && desired::engine_before_routes(
                self.memo
                    .applied
                    .conf
                    .as_ref()
                    .map(|(c, leader)| (c, *leader)),
                &want.device,
                t.leader,
                &self.owned,
                &want.routes,
            );
        if engine_first {
            self.stages.lap(Stage::Routes, started);
            let started = Instant::now();
            let configured = self.converge_device(t.leader, &want);
            self.stages.lap(Stage::Engine, started);
            let started = Instant::now();
            let routed = self
                .converge_links_and_routes(t, &mut want, links, &settings)
                .await;
            self.stages.lap(Stage::Routes, started);
            configured?;
            routed?;
        } else {
            let routed = self
                .converge_links_and_routes(t, &mut want, links, &settings)
                .await;
            self.stages.lap(Stage::Routes, started);
            let started = Instant::now();
            self.converge_device(t.leader, &want)?;
            self.stages.lap(Stage::Engine, started);
            routed?;
        }
        let started = Instant::now();
        self.converge_firewall(&want.firewall, flips_only, now)
            .await?;
        self.stages.lap(Stage::Firewall, started);
        let kilo = self.kilo_index;
        let mtu = self
            .memo
            .host
            .as_ref()
            .and_then(|h| h.net.link(kilo))
            .map_or(0, |l| l.mtu);
        let owned = self.owned.clone();
        let tunnel_name = self
            .memo
            .resolved
            .tunnel
            .and(self.tunnel.name().map(str::to_string));
        let withheld = want.withheld.iter().map(ToString::to_string).collect();
        self.status.update(|p| {
            p.node = self.s.hostname.clone();
            p.interface = self.s.args.interface.clone();
            p.granularity = self.s.granularity.as_str().to_string();
            p.topology = Some(std::sync::Arc::new(t.clone()));
            p.encapsulate = want.encapsulate;
            p.tunnel = tunnel_name;
            p.mtu = mtu;
            p.kilo_index = kilo;
            p.plan = owned;
            p.rules = Some(want.firewall);
            p.withheld = withheld;
        });
        Ok(())
    }

    /// What decides the host state besides the topology: kg's flags and its tunnel.
    fn host_settings(&self) -> HostSettings {
        let a = &self.s.args;
        HostSettings {
            interface: a.interface.clone(),
            mtu: self.s.mtu,
            cni: a.cni,
            local: a.local,
            encapsulate: self.s.encapsulate,
            compatibility: self.s.compatibility,
            forward_rules: a.iptables_forward_rules,
            service_cidrs: self.s.service_cidrs.clone(),
            tunnel: self.tunnel.name().map(|name| TunnelKind {
                name: name.to_string(),
                ipip: self.tunnel.is_ipip(),
                ipv6_outer: self.tunnel.carries_ipv6_outer(),
            }),
        }
    }

    /// Endpoints learnt from handshakes: a device that cannot be read leaves the last.
    fn discover_endpoints(&mut self, nodes: &[Node], peers: &[Peer]) {
        match self.wg.device_peers() {
            Ok(device) => {
                self.discovered = discover_nat_endpoints(&device, nodes, peers, &self.discovered)
            }
            Err(e) => tracing::warn!(
                error = format!("{e:#}"),
                "reading the device's endpoints for NAT discovery failed"
            ),
        }
    }

    /// The link, the CNI configuration, the tunnel, then the routes and rules, brought to
    /// `want`. When the tunnel's links resolve differently from `planned`, the links `want`
    /// was planned with (it was just created, or recreated), `want` is planned again with them
    /// first.
    async fn converge_links_and_routes(
        &mut self,
        t: &Topology,
        want: &mut DesiredHost,
        planned: ResolvedLinks,
        settings: &HostSettings,
    ) -> Result<()> {
        self.converge_link(&want.link).await?;
        if let Some(cni) = &want.cni {
            if self.memo.applied.cni.as_ref() != Some(cni) {
                self.sync_cni(&cni.pod_cidrs, cni.mtu);
                self.memo.applied.cni = Some(cni.clone());
            }
        }
        self.metrics.set_leader(t.leader, &t.location);
        let links = self.converge_tunnel(want.tunnel).await?;
        self.memo.resolved = links;
        if links != planned {
            let host = self.memo.host.as_ref().expect("planned from it");
            *want = desired::plan(t, &host.net, &links, &self.owned, &self.public, settings);
        }
        if let (true, Some(name)) = (want.tunnel_missing(&links), self.tunnel.name()) {
            let message = format!("the tunnel link {name} does not exist (yet); routing inside the location without encapsulation");
            self.warn_once("tunnel-missing", &message);
        }
        self.report_withheld(&want.withheld);
        let lines = want
            .bypasses
            .iter()
            .filter(|b| !b.standby)
            .map(ToString::to_string)
            .collect();
        for line in self.problems.fresh_lines("endpoint bypasses", lines) {
            tracing::warn!("{line}");
        }
        let lines = want
            .routes
            .no_gateway
            .iter()
            .map(ToString::to_string)
            .collect();
        for line in self.problems.fresh_lines("routes without a gateway", lines) {
            tracing::warn!("{line}");
        }
        if let Some(index) = links.tunnel {
            self.tunnel.update(&want.routes, index, t);
        }
        self.converge_routes(want.routes.clone()).await
    }

    /// The WireGuard link's MTU, address and state, brought to `want` (the MTU and state
    /// compared with the host as listed, the address with what kg last set).
    async fn converge_link(&mut self, want: &LinkState) -> Result<()> {
        let kilo = self.kilo_index;
        let host = self
            .memo
            .host
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("the host has not been listed"))?;
        let link = host.net.links.iter_mut().find(|l| l.index == kilo);
        if let Some(link) = link.filter(|l| l.mtu != want.mtu) {
            self.netlink.set_mtu(kilo, want.mtu).await?;
            link.mtu = want.mtu;
        }
        if self.memo.applied.address != Some(want.address) {
            self.netlink.set_address(kilo, want.address).await?;
            self.memo.applied.address = Some(want.address);
        }
        let host = self.memo.host.as_mut().expect("listed above");
        match host.net.links.iter_mut().find(|l| l.index == kilo) {
            Some(link) if link.up == want.up => {}
            link => {
                self.netlink.set_up(kilo, want.up).await?;
                if let Some(link) = link {
                    link.up = want.up;
                }
            }
        }
        Ok(())
    }

    /// The tunnel prepared for `spec` (again only when `spec` changed or its link was
    /// missing), and the links it resolves to.
    async fn converge_tunnel(&mut self, spec: Option<TunnelSpec>) -> Result<ResolvedLinks> {
        let kilo = self.kilo_index;
        let Some(spec) = spec else {
            return Ok(ResolvedLinks {
                kilo,
                ..Default::default()
            });
        };
        if let Some((applied, links)) = self.memo.applied.tunnel {
            if applied == spec && links.tunnel.is_some() {
                return Ok(links);
            }
        }
        let tunnel = self
            .tunnel
            .prepare(
                &self.netlink,
                spec.ipv4_pods,
                spec.private_mtu,
                spec.private_ipv6,
            )
            .await?;
        let tunnel6 = match tunnel {
            Some(_) => {
                self.tunnel
                    .prepare_ipv6_outer(
                        &self.netlink,
                        spec.ipv6_members,
                        spec.private_link,
                        spec.private_mtu,
                    )
                    .await?
            }
            None => None,
        };
        let links = ResolvedLinks {
            kilo,
            tunnel,
            tunnel6,
        };
        self.memo.applied.tunnel = Some((spec, links));
        Ok(links)
    }

    /// The WireGuard device, brought to `want`'s configuration.
    fn converge_device(&mut self, leader: bool, want: &DesiredHost) -> Result<()> {
        let desired = crate::wiring::device_config(&want.device, &self.key);
        if self.memo.applied.device.as_ref() == Some(&desired) {
            return Ok(());
        }
        // The first configuration of this process's engine handshakes at once, restored
        // peers or not (a node whose last agent was Kilo has nothing to restore).
        let changed = if self.memo.engine_configured {
            self.wg.apply(&desired)?
        } else {
            let changed = self.wg.apply_and_handshake(&desired)?;
            self.memo.engine_configured = true;
            changed
        };
        if changed {
            self.metrics.device_changes.inc();
            tracing::info!(
                leader,
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
        self.memo.applied.device = Some(desired);
        self.memo.applied.conf = Some((want.device.clone(), leader));
        Ok(())
    }

    /// Says once, at warning level, which CIDRs are not routed on this node because they
    /// contain or equal one of its connected networks, and counts them in
    /// `kilotun_withheld_cidrs`; `/graph` marks them.
    fn report_withheld(&mut self, withheld: &[Withheld]) {
        self.metrics.withheld_cidrs.set(withheld.len() as i64);
        // The graph already holds this topology (set when it changed): only its marks change.
        if let Some(graph) = self.graph.lock().as_mut() {
            graph.withheld = std::sync::Arc::new(withheld.to_vec());
        }
        let lines = withheld.iter().map(ToString::to_string).collect();
        for line in self.problems.fresh_lines("withheld routes", lines) {
            tracing::warn!("{line}");
        }
    }

    /// Takes the kernel's routes and rules to `plan`, listing them only when kg does not know
    /// them (after a full reconcile's reset, or a failed change).
    async fn converge_routes(&mut self, plan: RoutePlan) -> Result<()> {
        if self.memo.applied.kernel_routes.is_some() && plan == self.owned {
            return Ok(());
        }
        let observed = match self.memo.applied.kernel_routes.take() {
            Some(known) => known,
            None => self.netlink.observe().await?,
        };
        let ops = diff(&plan, &observed, &self.owned, self.kilo_index);
        if !ops.is_empty() {
            tracing::debug!(changes = ops.len(), "reconciling routes");
        }
        let errors = self.netlink.apply(&ops).await;
        for e in &errors {
            self.status.error(format!("route change failed: {e:#}"));
            tracing::warn!(error = format!("{e:#}"), "route change failed");
        }
        if errors.is_empty() {
            self.memo.applied.kernel_routes = Some(apply_ops(&observed, &ops));
        }
        if plan != self.owned {
            if let Err(e) = state::save_routes(&self.s.args.key_file, &plan) {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "saving the routes kg installed failed"
                );
            }
        }
        self.owned = plan;
        Ok(())
    }

    /// Takes the firewall to `rules` unless they are the rules last applied, or readiness
    /// flips alone changed them (`flips_only`) and the firewall was written too recently.
    async fn converge_firewall(
        &mut self,
        rules: &RuleSet,
        flips_only: bool,
        now: Instant,
    ) -> Result<()> {
        if self.memo.applied.rules.as_ref() == Some(rules) {
            self.memo.firewall_hold.unneeded();
            return Ok(());
        }
        if !self.memo.firewall_hold.write_now(flips_only, now) {
            tracing::debug!("readiness flips alone changed the firewall's rules; writing them with the next change, or when the hold ends");
            return Ok(());
        }
        let v6 = self.ip6tables;
        let firewall = self.firewall.clone();
        let wanted = rules.clone();
        // What was applied last: the firewall writes only the difference (none on a resync,
        // which cleared it: then the host's rules are read and compared).
        let previous = self.memo.applied.rules.take();
        let reconciled =
            tokio::task::spawn_blocking(move || firewall.reconcile(&wanted, previous.as_ref(), v6));
        match reconciled.await? {
            Ok(changed) => {
                if changed {
                    tracing::debug!("firewall rules reconciled");
                }
                self.memo.applied.rules = Some(rules.clone());
                self.memo.firewall_hold.written(now);
            }
            Err(e) => {
                self.metrics.error("apply");
                self.status
                    .error(format!("applying iptables rules failed: {e:#}"));
                tracing::warn!(error = format!("{e:#}"), "applying iptables rules failed");
            }
        }
        Ok(())
    }
}

/// The CNI configuration kg keeps in step with the node (Kilo's `--cni`).
impl<N: Kernel, F: Firewall, W: Engine> Agent<N, F, W> {
    /// Keeps the CNI conflist's IPAM ranges on the pod CIDRs (one set per family) and its MTU
    /// on the link's. A missing or unreadable file is a warning, never a failure.
    pub(super) fn sync_cni(&mut self, pod_cidrs: &[IpNet], mtu: u32) {
        let path = self.cni_file.path().display().to_string();
        let text = match self.cni_file.read() {
            Ok(t) => t,
            Err(e) => {
                self.warn_once(
                    "cni",
                    &format!("cannot read the CNI configuration {path}: {e}; not managing it"),
                );
                return;
            }
        };
        match control::cni::update_conflist(&text, pod_cidrs, Some(mtu)) {
            Ok(None) => {}
            Ok(Some(updated)) => match self.cni_file.write(&updated) {
                Ok(()) => {
                    tracing::info!(path, pod_cidrs = ?pod_cidrs, mtu, "CNI configuration updated")
                }
                Err(e) => {
                    tracing::warn!(
                        path,
                        error = format!("{e:#}"),
                        "writing the CNI configuration failed"
                    )
                }
            },
            Err(e) => self.warn_once(
                "cni",
                &format!("CNI configuration {path}: {e}; not managing it"),
            ),
        }
    }
}
