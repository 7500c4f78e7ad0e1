//! Carries out the converge step's effects ([`HostEffect`]): the reconciler decides which part
//! of the host differs from the desired state and in which order the parts change
//! (`reconciler/converge.rs`); each effect here is one shell call, its answer handed back. The
//! device is the one part the driver still compares: its configuration holds the private key,
//! which stays on this side, so an identical configuration is not sent.

use std::sync::Arc;

use anyhow::Result;
use control::desired::TunnelSpec;
use control::iptables::RuleSet;
use control::routes::RoutePlan;

use super::reconciler::{
    DeviceOutcome, DeviceWrite, FirewallOutcome, HostAnswer, HostEffect, HostReport, LinkWrite,
    ResolvedPlan,
};
use super::serve::status;
use super::shells::{Device, Firewall, Kernel};
use super::stages::Stage;
use super::{state, Agent};

mod record;
pub(super) use record::HostRecord;

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Carries out `effect`: its answer, when it has one, and the stage its time counts to.
    pub(super) async fn carry_out(&mut self, effect: HostEffect) -> (Stage, Option<HostAnswer>) {
        match effect {
            HostEffect::Converging(c) => {
                if c.full {
                    // A full pass compares the device with what it is to be afresh.
                    self.record.device = None;
                }
                if c.changed {
                    *self.graph.lock() = Some(super::serve::http::GraphSource {
                        topology: Arc::clone(&c.topology),
                        withheld: Default::default(),
                    });
                }
                let t = &c.topology;
                self.metrics.set_leader(t.leader, &t.location);
                (Stage::Routes, None)
            }
            HostEffect::ReadEndpoints => {
                let read = self.wg.device_peers();
                (Stage::Routes, Some(HostAnswer::Endpoints(read)))
            }
            HostEffect::ConfigureDevice(write) => {
                let configured = self.configure_device(write);
                (Stage::Engine, Some(HostAnswer::Device(configured)))
            }
            HostEffect::SetLink(part) => {
                let set = self.set_link(part).await;
                (Stage::Routes, Some(HostAnswer::Link(set)))
            }
            HostEffect::WriteCni(cni) => {
                self.sync_cni(&cni.pod_cidrs, cni.mtu);
                (Stage::Routes, None)
            }
            HostEffect::PrepareTunnel(spec) => {
                let prepared = self.prepare_tunnel(spec).await;
                (Stage::Routes, Some(HostAnswer::Tunnel(prepared)))
            }
            HostEffect::PlanResolved(planned) => {
                self.show_plan(*planned);
                (Stage::Routes, None)
            }
            HostEffect::ObserveRoutes => {
                let observed = self.netlink.observe().await;
                (Stage::Routes, Some(HostAnswer::ObservedRoutes(observed)))
            }
            HostEffect::ChangeRoutes(ops) => {
                self.metrics.route_changes.inc();
                tracing::debug!(changes = ops.len(), "reconciling routes");
                let errors = self.netlink.apply(&ops).await;
                (Stage::Routes, Some(HostAnswer::ChangedRoutes(errors)))
            }
            HostEffect::SaveRoutes(held) => {
                self.save_routes(&held);
                (Stage::Routes, None)
            }
            HostEffect::WriteFirewall(write) => {
                let outcome = self.write_firewall(write.rules, write.previous).await;
                (Stage::Firewall, Some(HostAnswer::Firewall(outcome)))
            }
            HostEffect::Converged(report) => {
                self.report_converged(*report);
                (Stage::Firewall, None)
            }
        }
    }

    /// Starts the lost WireGuard device again ([`Device::recreate`]) on a new link, and
    /// forgets what was written to the old one; the new link's index is returned, so the pass
    /// that follows applies the link's state, the routes and the peers anew and starts
    /// handshakes with every peer at once. A device already started again (the link's lookup
    /// failed after it) is not started twice.
    pub(super) async fn recreate_engine(&mut self) -> Result<u32> {
        use anyhow::Context as _;
        if self.wg.lost().is_some() {
            self.wg.recreate()?;
            self.record.forget_written();
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
        Ok(self.kilo_index)
    }

    /// Sets one part of the WireGuard link.
    async fn set_link(&mut self, part: LinkWrite) -> Result<()> {
        let kilo = self.kilo_index;
        match part {
            LinkWrite::Mtu(mtu) => self.netlink.set_mtu(kilo, mtu).await,
            LinkWrite::Address(address) => self.netlink.set_address(kilo, address).await,
            LinkWrite::Up(up) => self.netlink.set_up(kilo, up).await,
        }
    }

    /// The tunnel prepared for `spec`, and the links it resolves to.
    async fn prepare_tunnel(
        &mut self,
        spec: TunnelSpec,
    ) -> Result<control::desired::ResolvedLinks> {
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
        Ok(control::desired::ResolvedLinks {
            kilo: self.kilo_index,
            tunnel,
            tunnel6,
        })
    }

    /// The plan's withheld CIDRs on `/graph` and in `kilotun_withheld_cidrs`, and its routes
    /// in the userspace tunnel's table.
    fn show_plan(&mut self, planned: ResolvedPlan) {
        self.metrics
            .withheld_cidrs
            .set(planned.withheld.len() as i64);
        // The graph already holds this topology (set when it changed): only its marks change.
        if let Some(graph) = self.graph.lock().as_mut() {
            graph.withheld = Arc::new(planned.withheld);
        }
        if let Some((routes, index)) = &planned.tunnel_routes {
            self.tunnel.update(routes, *index, &planned.topology);
        }
    }

    /// The device configured as `write` plans it (its post-quantum preshared keys over the
    /// Peers' own), with the private key; a configuration identical to the last one written is not sent again.
    fn configure_device(&mut self, write: DeviceWrite) -> Result<DeviceOutcome> {
        if let Some(why) = self.wg.lost() {
            anyhow::bail!("{why}: it carries no packet until kg starts it again");
        }
        let mut desired = crate::wiring::device_config(&write.conf, &self.key);
        desired.interface.fwmark = write.fwmark;
        for peer in &mut desired.peers {
            if let Some(psk) = write.psks.get(&control::Key(*peer.public_key.as_bytes())) {
                peer.preshared_key = Some(psk.clone());
            }
        }
        let mut outcome = DeviceOutcome::default();
        if self.record.device.as_ref() == Some(&desired) {
            return Ok(outcome);
        }
        // The first configuration of this process's engine handshakes at once, restored
        // peers or not (a node whose last agent was Kilo has nothing to restore).
        let changed = if write.first {
            let (changed, started) = self.wg.apply_and_handshake(&desired)?;
            outcome.handshakes_started = started;
            self.status
                .update(|p| p.engine = status::EngineReadiness::Configured);
            changed
        } else {
            self.wg.apply(&desired)?
        };
        let updates = self.wg.take_allowed_ips_updates();
        self.metrics
            .count_allowed_ips_updates(updates.edited, updates.replaced);
        outcome.edit_refused = updates.edit_refused;
        if changed {
            self.metrics.device_changes.inc();
            tracing::info!(
                leader = write.leader,
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
        self.record.device = Some(desired);
        for peer in &write.handshake {
            self.wg.rekey(peer);
        }
        Ok(outcome)
    }

    /// Saves `held` as the routes and rules kg holds, beside the key.
    fn save_routes(&self, held: &RoutePlan) {
        if let Err(e) = state::save_routes(&self.settings.args.key_file, held) {
            tracing::warn!(
                error = format!("{e:#}"),
                "saving the routes kg installed failed"
            );
        }
    }

    /// Writes the firewall's `rules`, `previous` those last written: only the difference, or
    /// (not knowing them) against the host's rules as read. A failure is counted and said.
    async fn write_firewall(
        &mut self,
        rules: RuleSet,
        previous: Option<RuleSet>,
    ) -> FirewallOutcome {
        let v6 = match self.firewall_ready.wait(&self.firewall).await {
            Ok(Some(v6)) => v6,
            Ok(None) => return FirewallOutcome::NotReady,
            Err(e) => {
                self.fatal = Some(e);
                return FirewallOutcome::NotReady;
            }
        };
        let reconciled = super::shells::firewall::off_loop(&self.firewall, move |firewall| {
            firewall.reconcile(&rules, previous.as_ref(), v6)
        })
        .await;
        match reconciled {
            Ok(changed) => {
                if changed {
                    tracing::debug!("firewall rules reconciled");
                }
                FirewallOutcome::Written
            }
            Err(e) => {
                self.metrics.error("apply");
                tracing::warn!(error = format!("{e:#}"), "applying iptables rules failed");
                FirewallOutcome::Failed(format!("{e:#}"))
            }
        }
    }

    /// What the host was converged to, on `/status`.
    fn report_converged(&mut self, report: HostReport) {
        let tunnel_name = report
            .tunnel
            .then(|| self.tunnel.name().map(str::to_string))
            .flatten();
        let withheld = report.withheld.iter().map(ToString::to_string).collect();
        self.status.update(|p| {
            p.node = self.settings.hostname.clone();
            p.interface = self.settings.args.interface.clone();
            p.granularity = self.settings.granularity.as_str().to_string();
            p.topology = Some(report.topology);
            p.encapsulate = report.encapsulate;
            p.tunnel = tunnel_name;
            p.mtu = report.mtu;
            p.kilo_index = report.kilo_index;
            p.plan = report.plan;
            p.rules = Some(report.rules);
            p.withheld = withheld;
        });
    }
}
