//! One reconcile pass, carried out: the [`Reconciler`](super::reconciler::Reconciler) decides
//! each step from values (the backend's changed objects, the host as listed, the tunnels'
//! readings, the shells' results) and this driver runs the shells it names, times the stages
//! ([`super::stages`]) and feeds the results back. A pass whose inputs moved nothing but a
//! `last-seen` (the steady churn of every Kilo cluster) stops after the node table and
//! touches neither the kernel nor the firewall nor WireGuard. Resyncs and kernel notifications
//! list the host again and run every stage.

use std::time::Instant;

use anyhow::Result;
use control::clock::Now;

use super::host::{read_host, OwnSide};
use super::reconciler::Start;
use super::shells::{Engine, Firewall, Kernel};
use super::stages::Stage;
use super::{read_clock, Agent, Trigger};
use crate::backend::Snapshot;

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
        let settled = self.run_pass(trigger, now).await;
        self.core.finish(now);
        for line in self.core.take_errors() {
            self.status.error(line);
        }
        self.stages.finish(trigger, settled.is_ok(), &self.metrics);
        settled
    }

    /// [`Agent::settle`]'s pass: each step asks the reconciler, then runs the shells it names.
    async fn run_pass(&mut self, trigger: Trigger, now: Now) -> Result<()> {
        self.metrics.reconciles.inc();
        match self.core.start(trigger, self.backend.healthy(), now) {
            Start::Wait => return Ok(()),
            Start::Decide => {}
            Start::ListHost(detection) => {
                let own = OwnSide {
                    kilo_index: self.kilo_index,
                    tunnel: self.tunnel.name(),
                    hostname_ips: &self.hostname_ips,
                    subnet: self.s.subnet,
                    internal_cidrs: &self.s.internal_cidrs,
                };
                let started = Instant::now();
                let kept = self.record.kept_dump(trigger, &self.owned);
                let dumped = kept.is_none();
                let count = self.record.count_before_dump();
                let host = read_host(&self.netlink, &own, &detection, kept).await?;
                if dumped {
                    self.record
                        .dumped(count, &host.net.main_routes, &self.owned);
                }
                self.stages.lap(Stage::Host, started);
                self.core.host_listed(host, detection);
            }
        }
        let observed = self.core.observe(now)?;
        if let Some(step) = self.core.rotation_step(now) {
            self.rotate_key(step, now);
        }
        if observed.elect {
            let started = Instant::now();
            self.core.elect(now);
            self.stages.lap(Stage::Leases, started);
        }
        let started = Instant::now();
        if let Some(step) = self.core.mesh(now)? {
            self.metrics.nodes.set(step.nodes as i64);
            self.metrics.peers.set(step.peers as i64);
            if step.computed {
                self.stages.lap(Stage::Topology, started);
            }
            if let Some(c) = step.converge {
                let applied = self.apply(&c, now).await;
                let routes_known = self.record.routes_known();
                self.core.converged(c, applied.is_ok(), routes_known);
                applied?;
            }
        }
        if self.core.lease_due() {
            let readings = self.tunnel_readings();
            if let Some(write) = self.core.tend_lease(&readings, now) {
                self.write_lease(write).await;
            }
        }
        if let Some(patch) = self.core.annotation_patch(trigger == Trigger::CheckIn, now) {
            let patched = self
                .backend
                .patch_annotations(&self.s.hostname, &patch)
                .await;
            self.core.patched(patch, patched.is_ok());
            patched?;
        }
        Ok(())
    }
}
