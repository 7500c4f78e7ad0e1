//! Brings the host to the desired state: [`control::desired::plan`] computes it as one value
//! (the link's MTU, address and state, the CNI configuration, the tunnel, the routes and rules,
//! the WireGuard device, the firewall) before any shell runs; each part is then compared with
//! what kg last applied (and, for routes, with the kernel state kg last observed plus its own
//! changes) and only a part that differs is written. A full reconcile (resync, kernel
//! notification) compares against freshly listed state instead, so anything changed behind
//! kg's back comes back within one resync.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use control::clock::Now;
use control::desired::{self, DesiredHost, LinkState, ResolvedLinks, TunnelKind, TunnelSpec};
use control::iptables::RuleSet;
use control::journal::Reason;
use control::routes::{apply_ops, diff, RoutePlan, Withheld};
use control::Topology;

use super::reconciler::{Convergence, FirewallStep};
use super::serve::status;
use super::shells::{Device, Firewall, Kernel};
use super::stages::Stage;
use super::{state, Agent};

mod record;
use record::Applied;
pub(super) use record::HostRecord;

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Brings the host to `c`'s topology at `now`: [`control::desired::plan`] computes the
    /// desired state as one value before any shell runs, then each part is converged.
    ///
    /// The engine changes before the links and routes when that is safe
    /// ([`desired::engine_before_routes`]: the node keeps its role and no route to a new or
    /// moved peer's endpoint changes), so the routes' cost, which grows with the cluster, never
    /// delays the tunnel. Otherwise it changes after them: a node taking over a location
    /// answers its new peers' first initiations (held by the engine for this moment) at once,
    /// and the answers must leave by the new routes, not by the old ones through the
    /// location's last leader, which sent them to a dead node and cost a 5 s handshake retry.
    /// Either way it changes even when the links or routes failed, so a failing host step
    /// never keeps the node's peers from it; the failure is returned after. The firewall is
    /// written when the reconciler says so ([`super::reconciler::Reconciler::firewall_step`]).
    pub(super) async fn apply(&mut self, c: &Convergence, now: Now) -> Result<()> {
        let t: &Topology = &c.topology;
        if c.full {
            // A resync that kept the last route dump keeps what it knows of kg's routes.
            let kernel_routes = self
                .record
                .dump_kept
                .then(|| self.record.applied.kernel_routes.take())
                .flatten();
            self.record.applied = Applied {
                kernel_routes,
                ..Applied::default()
            };
            match self.wg.device_peers() {
                Ok(device) => self.core.learn_endpoints(&device),
                Err(e) => tracing::warn!(
                    error = format!("{e:#}"),
                    "reading the device's endpoints for NAT discovery failed"
                ),
            }
        }
        if c.changed {
            *self.graph.lock() = Some(super::serve::http::GraphSource {
                topology: Arc::clone(&c.topology),
                withheld: Default::default(),
            });
        }
        let started = Instant::now();
        let tunnel = self.tunnel_kind();
        let links = ResolvedLinks {
            kilo: self.kilo_index,
            ..self.record.resolved
        };
        let mut want = self.core.desired(t, &links, &self.owned, tunnel.clone())?;
        // The tunnel's links stay as planned (a new tunnel would plan the routes again).
        let links_kept = match (&want.tunnel, &self.record.applied.tunnel) {
            (None, _) => true,
            (Some(spec), Some((applied, _))) => spec == applied,
            (Some(_), None) => false,
        };
        let engine_first = self.record.engine_configured
            && links_kept
            && desired::engine_before_routes(
                self.record
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
                .converge_links_and_routes(t, &mut want, links, &tunnel)
                .await;
            self.stages.lap(Stage::Routes, started);
            configured?;
            routed?;
        } else {
            let routed = self
                .converge_links_and_routes(t, &mut want, links, &tunnel)
                .await;
            self.stages.lap(Stage::Routes, started);
            let started = Instant::now();
            self.converge_device(t.leader, &want)?;
            self.stages.lap(Stage::Engine, started);
            routed?;
        }
        let started = Instant::now();
        self.converge_firewall(&want.firewall, c.flips_only, now)
            .await;
        self.stages.lap(Stage::Firewall, started);
        let kilo = self.kilo_index;
        let listed_mtu = self
            .core
            .host()
            .and_then(|h| h.net.link(kilo))
            .map_or(0, |l| l.mtu);
        let mtu = self.record.applied.link_mtu.unwrap_or(listed_mtu);
        let owned = self.owned.clone();
        let tunnel_name = self
            .record
            .resolved
            .tunnel
            .and(self.tunnel.name().map(str::to_string));
        let withheld = want.withheld.iter().map(ToString::to_string).collect();
        self.status.update(|p| {
            p.node = self.settings.hostname.clone();
            p.interface = self.settings.args.interface.clone();
            p.granularity = self.settings.granularity.as_str().to_string();
            p.topology = Some(Arc::clone(&c.topology));
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

    /// Starts the lost WireGuard device again ([`Device::recreate`]) on a new link, and
    /// forgets what kg applied to the old one, so the pass that follows applies the link's
    /// state, the routes and the peers anew and starts handshakes with every peer at once. A
    /// device already started again (the link's lookup failed after it) is not started twice.
    pub(super) async fn recreate_engine(&mut self) -> Result<()> {
        use anyhow::Context as _;
        if self.wg.lost().is_some() {
            self.wg.recreate()?;
            self.record.forget_applied();
            self.status
                .update(|p| p.engine = status::EngineReadiness::Unconfigured);
        }
        let name = &self.settings.args.interface;
        self.kilo_index = self
            .netlink
            .link_by_name(name)
            .await?
            .with_context(|| format!("{name} is missing after the engine started again"))?
            .index;
        tracing::info!(interface = %name, index = self.kilo_index, "the embedded engine runs again on a new TUN link");
        Ok(())
    }

    /// The encapsulation link kg uses, if any, as the desired state names it.
    fn tunnel_kind(&self) -> Option<TunnelKind> {
        self.tunnel.name().map(|name| TunnelKind {
            name: name.to_string(),
            ipip: self.tunnel.is_ipip(),
            ipv6_outer: self.tunnel.carries_ipv6_outer(),
        })
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
        tunnel: &Option<TunnelKind>,
    ) -> Result<()> {
        self.converge_link(&want.link).await?;
        if let Some(cni) = &want.cni {
            if self.record.applied.cni.as_ref() != Some(cni) {
                self.sync_cni(&cni.pod_cidrs, cni.mtu);
                self.record.applied.cni = Some(cni.clone());
            }
        }
        self.metrics.set_leader(t.leader, &t.location);
        let links = self.converge_tunnel(want.tunnel).await?;
        self.record.resolved = links;
        if links != planned {
            *want = self.core.desired(t, &links, &self.owned, tunnel.clone())?;
        }
        if let (true, Some(name)) = (want.tunnel_missing(&links), self.tunnel.name()) {
            let message = format!("the tunnel link {name} does not exist (yet); routing inside the location without encapsulation");
            if self.problems.first_time("tunnel-missing") {
                self.core
                    .journal()
                    .record(Reason::TunnelMissing, name, message);
            }
        }
        self.report_withheld(&want.withheld);
        let bypasses = want
            .bypasses
            .iter()
            .filter(|b| !b.standby)
            .map(|b| (b.endpoint.to_string(), b.to_string()))
            .collect();
        self.record_fresh("endpoint bypasses", Reason::EndpointBypassed, bypasses);
        let unrouted = want
            .routes
            .no_gateway
            .iter()
            .map(|r| (r.dst.to_string(), r.to_string()))
            .collect();
        self.record_fresh(
            "routes without a gateway",
            Reason::RouteWithoutGateway,
            unrouted,
        );
        if let Some(index) = links.tunnel {
            self.tunnel.update(&want.routes, index, t);
        }
        self.converge_routes(want.routes.clone()).await
    }

    /// The WireGuard link's MTU, address and state, brought to `want` (the MTU and state
    /// compared with the host as listed, the address with what kg last set).
    async fn converge_link(&mut self, want: &LinkState) -> Result<()> {
        let kilo = self.kilo_index;
        let listed = self
            .core
            .host()
            .ok_or_else(|| anyhow::anyhow!("the host has not been listed"))?
            .net
            .link(kilo)
            .map(|l| (l.mtu, l.up));
        let applied = &self.record.applied;
        let mtu = applied.link_mtu.or(listed.map(|(mtu, _)| mtu));
        if mtu.is_some_and(|mtu| mtu != want.mtu) {
            self.netlink.set_mtu(kilo, want.mtu).await?;
            self.record.applied.link_mtu = Some(want.mtu);
        }
        if self.record.applied.address != Some(want.address) {
            self.netlink.set_address(kilo, want.address).await?;
            self.record.applied.address = Some(want.address);
        }
        let up = self.record.applied.link_up.or(listed.map(|(_, up)| up));
        if up != Some(want.up) {
            self.netlink.set_up(kilo, want.up).await?;
            if listed.is_some() {
                self.record.applied.link_up = Some(want.up);
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
        if let Some((applied, links)) = self.record.applied.tunnel {
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
        self.record.applied.tunnel = Some((spec, links));
        Ok(links)
    }

    /// The WireGuard device, brought to `want`'s configuration.
    fn converge_device(&mut self, leader: bool, want: &DesiredHost) -> Result<()> {
        if let Some(why) = self.wg.lost() {
            anyhow::bail!("{why}: it carries no packet until kg starts it again");
        }
        let mut desired = crate::wiring::device_config(&want.device, &self.key);
        self.pq_keys_into(&mut desired);
        if self.record.applied.device.as_ref() == Some(&desired) {
            return Ok(());
        }
        // The first configuration of this process's engine handshakes at once, restored
        // peers or not (a node whose last agent was Kilo has nothing to restore).
        let changed = if self.record.engine_configured {
            self.wg.apply(&desired)?
        } else {
            let (changed, started) = self.wg.apply_and_handshake(&desired)?;
            if let Some(started) = started {
                let interface = self.settings.args.interface.clone();
                self.core
                    .journal()
                    .record(Reason::HandshakesStarted, interface, started);
            }
            self.record.engine_configured = true;
            self.status
                .update(|p| p.engine = status::EngineReadiness::Configured);
            changed
        };
        let updates = self.wg.take_allowed_ips_updates();
        self.metrics
            .count_allowed_ips_updates(updates.edited, updates.replaced);
        if let Some(answer) = updates.edit_refused {
            let interface = self.settings.args.interface.clone();
            self.core.journal().record(
                Reason::AllowedIpEditRefused,
                interface,
                format!("{answer}: replacing changed peers' allowed IPs whole from now on"),
            );
        }
        if changed {
            self.metrics.device_changes.inc();
            tracing::info!(
                leader,
                peers = desired.peers.len(),
                "WireGuard configuration applied"
            );
            if let Err(e) = state::save(&self.settings.args.key_file, &desired) {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "saving the WireGuard state failed"
                );
            }
        }
        self.record.applied.device = Some(desired);
        self.record.applied.conf = Some((want.device.clone(), leader));
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
        let withheld = withheld
            .iter()
            .map(|w| (w.cidr.to_string(), w.to_string()))
            .collect();
        self.record_fresh("withheld routes", Reason::RouteWithheld, withheld);
    }

    /// Records, for `reason`, each (subject, message) of `items` not recorded the last time
    /// `object` was reported.
    fn record_fresh(&mut self, object: &str, reason: Reason, items: Vec<(String, String)>) {
        let lines = items.iter().map(|(_, line)| line.clone()).collect();
        for line in self.problems.fresh_lines(object, lines) {
            let subject = items
                .iter()
                .find(|(_, l)| *l == line)
                .map(|(subject, _)| subject.clone())
                .unwrap_or_default();
            self.core.journal().record(reason, subject, line);
        }
    }

    /// Takes the kernel's routes and rules to `plan`, listing them only when kg does not know
    /// them (after a full reconcile's reset, or a failed change).
    async fn converge_routes(&mut self, plan: RoutePlan) -> Result<()> {
        if self.record.applied.kernel_routes.is_some() && plan == self.owned {
            return Ok(());
        }
        let observed = match self.record.applied.kernel_routes.take() {
            Some(known) => known,
            None => self.netlink.observe().await?,
        };
        let ops = diff(&plan, &observed, &self.owned, self.kilo_index);
        if !ops.is_empty() {
            self.metrics.route_changes.inc();
            tracing::debug!(changes = ops.len(), "reconciling routes");
        }
        let errors = self.netlink.apply(&ops).await;
        for e in &errors {
            self.status.error(format!("route change failed: {e:#}"));
            tracing::warn!(error = format!("{e:#}"), "route change failed");
        }
        // What kg may hold now: the plan, and after a failed change also every route and rule
        // it held before (one it could not remove stays its own, for the next pass or the next
        // kg to remove).
        let mut held = plan;
        if errors.is_empty() {
            self.record.applied.kernel_routes = Some(apply_ops(&observed, &ops));
        } else {
            held.routes.extend(self.owned.routes.iter().cloned());
            held.rules.extend(self.owned.rules.iter().cloned());
        }
        if held != self.owned {
            if let Err(e) = state::save_routes(&self.settings.args.key_file, &held) {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "saving the routes kg installed failed"
                );
            }
        }
        self.owned = held;
        Ok(())
    }

    /// Takes the firewall to `rules` when the reconciler says they are written now. A failure
    /// is counted and shown on `/status`; the next pass reads the host's rules and tries again.
    async fn converge_firewall(&mut self, rules: &RuleSet, flips_only: bool, now: Now) {
        let previous = match self.core.firewall_step(rules, flips_only, now) {
            FirewallStep::Unchanged | FirewallStep::Held => return,
            FirewallStep::Write { previous } => previous,
        };
        let v6 = match self.firewall_ready.wait(&self.firewall).await {
            Ok(Some(v6)) => v6,
            Ok(None) => return,
            Err(e) => {
                self.fatal = Some(e);
                return;
            }
        };
        let wanted = rules.clone();
        // What was written last: the firewall writes only the difference (none after a full
        // pass, which forgot it: then the host's rules are read and compared).
        let reconciled = super::shells::firewall::off_loop(&self.firewall, move |firewall| {
            firewall.reconcile(&wanted, previous.as_ref(), v6)
        })
        .await;
        match reconciled {
            Ok(changed) => {
                if changed {
                    tracing::debug!("firewall rules reconciled");
                }
                self.core.firewall_written(Some(rules.clone()), now);
            }
            Err(e) => {
                self.core.firewall_written(None, now);
                self.metrics.error("apply");
                self.status
                    .error(format!("applying iptables rules failed: {e:#}"));
                tracing::warn!(error = format!("{e:#}"), "applying iptables rules failed");
            }
        }
    }
}
