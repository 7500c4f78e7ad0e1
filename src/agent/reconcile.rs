//! One reconcile pass, carried out: the [`Reconciler`](super::reconciler::Reconciler) decides
//! each step from values (the backend's changed objects, the host as listed, the tunnels'
//! readings, the shells' results) and hands out the effects; this driver carries each out,
//! times the stages ([`super::stages`]) and hands the answer back. A pass whose inputs moved nothing but a
//! `last-seen` (the steady churn of every Kilo cluster) stops after the node table and
//! touches neither the kernel nor the firewall nor WireGuard. Resyncs and kernel notifications
//! list the host again and run every stage.

use std::time::Instant;

use anyhow::Result;
use control::clock::Now;

use super::host::{read_host, DetectionInputs, HostView, OwnSide};
use super::reconciler::{PassAnswer, PassEffect};
use super::shells::{Device, Firewall, Kernel};
use super::stages::Stage;
use super::{read_clock, Agent, Trigger};
use crate::backend::Snapshot;

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
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

    /// Takes in what changed in `snapshot` ([`super::reconciler::Reconciler::ingest`]).
    pub fn ingest(&mut self, snapshot: &Snapshot, now: Now) {
        self.stages.begin();
        let started = Instant::now();
        self.core.ingest(snapshot, now);
        self.stages.lap(Stage::Translate, started);
    }

    /// Carries what [`Agent::ingest`] took in (and the time passed, to `now`) through as many
    /// stages as it changes, and says where the time went ([`super::stages`]).
    pub async fn settle(&mut self, trigger: Trigger, now: Now) -> Result<()> {
        self.metrics.reconciles.inc();
        if let Some(why) = self.wg.lost() {
            self.core.engine_lost(why);
        }
        if self.core.begin_pass(trigger, self.backend.healthy(), now) {
            self.run_pass(trigger, now).await;
        }
        let settled = self.core.end_pass(now);
        for line in self.core.take_errors() {
            self.status.error(line);
        }
        self.stages.finish(trigger, settled.is_ok(), &self.metrics);
        settled
    }

    /// [`Agent::settle`]'s pass: carries out each effect the reconciler asks for and hands it
    /// the answer, until it asks for nothing more. A shell's failure is an answer too: the
    /// reconciler ends the pass with it.
    async fn run_pass(&mut self, trigger: Trigger, now: Now) {
        loop {
            let started = Instant::now();
            let Some(effect) = self.core.poll_effect(now) else {
                return;
            };
            match effect {
                PassEffect::RecreateEngine(why) => {
                    tracing::debug!("{why}: starting the engine again");
                    let started = self.recreate_engine().await;
                    self.core.handle(PassAnswer::EngineRecreated(started), now);
                }
                PassEffect::ListHost(detection) => {
                    let started = Instant::now();
                    let (listed, dump_kept) = self.list_host(trigger, &detection).await;
                    self.stages.lap(Stage::Host, started);
                    self.core
                        .handle(PassAnswer::HostListed { listed, dump_kept }, now);
                }
                PassEffect::RotateKey(step) => self.rotate_key(step, now),
                PassEffect::Elected => self.stages.lap(Stage::Leases, started),
                PassEffect::Meshed(report) => {
                    self.metrics.nodes.set(report.nodes as i64);
                    self.metrics.peers.set(report.peers as i64);
                    if report.computed {
                        self.stages.lap(Stage::Topology, started);
                    }
                }
                PassEffect::Host(effect) => {
                    let (stage, answer) = self.carry_out(effect).await;
                    self.stages.lap(stage, started);
                    if let Some(answer) = answer {
                        self.core.handle(PassAnswer::Host(answer), now);
                    }
                }
                PassEffect::ReadTunnels => {
                    let readings = self.tunnel_readings();
                    self.core.handle(PassAnswer::TunnelsRead(readings), now);
                }
                PassEffect::WriteLease(write) => self.write_lease(*write).await,
                PassEffect::PatchAnnotations(patch) => {
                    let hostname = &self.settings.hostname;
                    let patched = self.backend.patch_annotations(hostname, &patch).await;
                    self.core.handle(PassAnswer::Patched(patched), now);
                }
            }
        }
    }

    /// The host listed for a pass after `trigger`, its addresses read as `detection` says, and
    /// whether the last route dump was kept (nothing changed the routes since).
    async fn list_host(
        &mut self,
        trigger: Trigger,
        detection: &DetectionInputs,
    ) -> (Result<HostView>, bool) {
        let own = OwnSide {
            kilo_index: self.kilo_index,
            tunnel: self.tunnel.name(),
            hostname_ips: &self.hostname_ips,
            subnet: self.settings.subnet,
            internal_cidrs: &self.settings.internal_cidrs,
        };
        let owned = self.core.owned_routes();
        let kept = self
            .record
            .kept_dump(trigger, owned, self.core.routes_known());
        let dump_kept = kept.is_some();
        let count = self.record.count_before_dump();
        let host = match read_host(&self.netlink, &own, detection, kept).await {
            Ok(host) => host,
            Err(e) => return (Err(e), dump_kept),
        };
        if !dump_kept {
            let owned = self.core.owned_routes();
            self.record.dumped(count, &host.net.main_routes, owned);
        }
        (Ok(host), dump_kept)
    }
}
