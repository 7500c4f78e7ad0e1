//! The converge step of a pass, as a machine of its own: the host brought to a topology part by
//! part. [`control::desired::plan`] computes the desired state as one value; each part is then
//! compared with what kg last applied (`host_book.rs`, kept with the decisions) and only a
//! part that differs becomes an effect for the shells: the link's MTU, address and state, the
//! CNI configuration, the tunnel, the routes and rules, the WireGuard device, the firewall.
//! A full pass (resync, kernel notification) forgets what was applied, so every part is
//! compared with the host as listed and anything changed behind kg's back comes back.
//!
//! The device changes before the links and routes when that is safe
//! ([`desired::engine_before_routes`]: the node keeps its role and no route to a new or moved
//! peer's endpoint changes), so the routes' cost, which grows with the cluster, never delays the
//! tunnel. Otherwise it changes after them: a node taking over a location answers its new
//! peers' first initiations at once, and the answers must leave by the new routes, not by the
//! old ones through the location's last leader. Either way it changes even when the links or
//! routes failed, so a failing host step never keeps the node's peers from it; that failure
//! ends the pass after the device, and the firewall waits for the next pass.

use std::sync::Arc;

use control::clock::Now;
use control::desired::{self, DesiredHost, ResolvedLinks, TunnelSpec};
use control::journal::Reason;
use control::routes::{diff, RouteOp, RoutePlan};

use super::host_book::Applied;
use super::host_effects::{
    DeviceWrite, FirewallOutcome, FirewallWrite, HostAnswer, HostEffect, LinkWrite, ResolvedPlan,
};
use super::mesh::{Convergence, FirewallStep};
use super::Reconciler;

/// The converge step in progress: the convergence it works towards, and where it stands.
pub(super) struct HostWork {
    pub(super) c: Convergence,
    phase: Phase,
}

/// Before the plan and after it.
enum Phase {
    /// A full pass forgets what it compares afresh (keeping the kernel's routes when the pass
    /// kept the last route dump), then reads the device's endpoints.
    Start { dump_kept: bool },
    /// Waiting for the device's endpoints.
    AwaitEndpoints,
    /// Plan the desired state and choose the order.
    Plan,
    /// The desired state is planned: its parts are converged.
    Planned(Box<Planned>),
}

/// The desired state, and how far the host has been brought to it.
struct Planned {
    want: DesiredHost,
    /// True when the device changes before the links and routes.
    engine_first: bool,
    step: Part,
    /// Why the links, the tunnel or the routes failed, if they did.
    routed: Option<anyhow::Error>,
    /// Why the device failed, if it did.
    configured: Option<anyhow::Error>,
}

/// The part being converged.
enum Part {
    /// Configure the device (before the links and routes, or after them).
    Device {
        before_routes: bool,
    },
    AwaitDevice {
        before_routes: bool,
    },
    /// Set the link's parts that differ, one by one, after the one set last (if any).
    Link(Option<LinkWrite>),
    AwaitLink(LinkWrite),
    /// Write the CNI configuration when it differs.
    Cni,
    /// Prepare the tunnel when its spec changed or its link was missing.
    Tunnel,
    AwaitTunnel(TunnelSpec),
    /// The links are resolved: plan again when they moved, and say what the plan leaves out.
    Replan(ResolvedLinks),
    /// Take the kernel's routes and rules to the plan.
    Routes,
    AwaitObservedRoutes,
    /// Change the routes observed (or known) to the plan.
    ChangeRoutes(RoutePlan),
    AwaitChangedRoutes {
        observed: RoutePlan,
        ops: Vec<RouteOp>,
    },
    /// The changes came back: record what kg holds.
    RoutesChanged {
        observed: RoutePlan,
        ops: Vec<RouteOp>,
        errors: Vec<anyhow::Error>,
    },
    /// The links and routes are done (or failed): the device, if it comes after them.
    AfterRoutes,
    /// The device and the routes are done: on to the firewall unless one failed.
    Finish,
    /// Write the firewall when the reconciler says so.
    Firewall,
    AwaitFirewall,
    /// Report what the host was converged to.
    Report,
    /// Nothing left to do.
    Done,
}

/// One turn of the converge step.
pub(super) enum HostProgress {
    /// Moved on with nothing for the shells.
    Moved,
    /// The shells must do this.
    Effect(HostEffect),
    /// Waiting for an answer.
    Waiting,
    /// Done: converged whole, or why not.
    Done(anyhow::Result<()>),
}

impl HostWork {
    /// The converge step for `c`; `dump_kept`: the pass kept the last route dump.
    pub(super) fn new(c: Convergence, dump_kept: bool) -> Self {
        Self {
            c,
            phase: Phase::Start { dump_kept },
        }
    }
}

impl Reconciler {
    /// One turn of the converge step `work` at `now`.
    pub(super) fn converge_turn(&mut self, work: &mut HostWork, now: Now) -> HostProgress {
        match std::mem::replace(&mut work.phase, Phase::AwaitEndpoints) {
            Phase::Start { dump_kept } => {
                work.phase = Phase::Plan;
                if !work.c.full {
                    return HostProgress::Moved;
                }
                let kernel_routes = dump_kept
                    .then(|| self.host_book.applied.kernel_routes.take())
                    .flatten();
                self.host_book.applied = Applied {
                    kernel_routes,
                    ..Applied::default()
                };
                work.phase = Phase::AwaitEndpoints;
                HostProgress::Effect(HostEffect::ReadEndpoints)
            }
            Phase::AwaitEndpoints => HostProgress::Waiting,
            Phase::Plan => match self.plan(&work.c) {
                Ok(planned) => {
                    work.phase = Phase::Planned(Box::new(planned));
                    HostProgress::Effect(HostEffect::Converging(work.c.clone()))
                }
                Err(e) => HostProgress::Done(Err(e)),
            },
            Phase::Planned(mut planned) => {
                let progress = self.part_turn(&work.c, &mut planned, now);
                work.phase = Phase::Planned(planned);
                progress
            }
        }
    }

    /// Takes a shell's answer to the converge step's last effect at `now`; `meshed`: the ready
    /// nodes and Peers the mesh was computed from (for NAT discovery).
    pub(super) fn converge_answer(
        &mut self,
        work: &mut HostWork,
        meshed: Option<&(Vec<control::node::Node>, Vec<control::Peer>)>,
        answer: HostAnswer,
        now: Now,
    ) {
        let phase = std::mem::replace(&mut work.phase, Phase::AwaitEndpoints);
        work.phase = match (phase, answer) {
            (Phase::AwaitEndpoints, HostAnswer::Endpoints(read)) => {
                match (read, meshed) {
                    (Ok(device), Some((nodes, peers))) => {
                        self.learn_endpoints(&device, nodes, peers)
                    }
                    (Ok(_), None) => {}
                    (Err(e), _) => tracing::warn!(
                        error = format!("{e:#}"),
                        "reading the device's endpoints for NAT discovery failed"
                    ),
                }
                Phase::Plan
            }
            (Phase::Planned(mut planned), answer) => {
                self.part_answer(&work.c, &mut planned, answer, now);
                Phase::Planned(planned)
            }
            (phase, answer) => {
                tracing::debug!(
                    ?answer,
                    "an answer the converge step does not wait for; ignored"
                );
                phase
            }
        };
    }

    /// The desired state for `c` and the order its parts are converged in.
    fn plan(&self, c: &Convergence) -> anyhow::Result<Planned> {
        let want = self.desired(&c.topology, &self.links())?;
        let book = &self.host_book;
        // The tunnel's links stay as planned (a new tunnel would plan the routes again).
        let links_kept = match (&want.tunnel, &book.applied.tunnel) {
            (None, _) => true,
            (Some(spec), Some((applied, _))) => spec == applied,
            (Some(_), None) => false,
        };
        let engine_first = book.engine_configured
            && links_kept
            && desired::engine_before_routes(
                book.applied.conf.as_ref().map(|(c, leader)| (c, *leader)),
                &want.device,
                c.topology.leader,
                &book.owned,
                &want.routes,
            );
        let step = if engine_first {
            Part::Device {
                before_routes: true,
            }
        } else {
            Part::Link(None)
        };
        Ok(Planned {
            want,
            engine_first,
            step,
            routed: None,
            configured: None,
        })
    }

    /// One turn of the planned parts at `now`.
    fn part_turn(&mut self, c: &Convergence, p: &mut Planned, now: Now) -> HostProgress {
        let (next, progress) = match std::mem::replace(&mut p.step, Part::Done) {
            Part::Device { before_routes } => {
                let write = DeviceWrite {
                    conf: p.want.device.clone(),
                    leader: c.topology.leader,
                    first: !self.host_book.engine_configured,
                    psks: self.pq_device_write(),
                    handshake: self.endpoint_probes.take_moved(),
                    fwmark: self.config.tunnel_guard.mark(),
                };
                let effect = HostEffect::ConfigureDevice(write);
                (
                    Part::AwaitDevice { before_routes },
                    HostProgress::Effect(effect),
                )
            }
            Part::Link(after) => match self.link_write(&p.want, after) {
                Some(part) => (
                    Part::AwaitLink(part),
                    HostProgress::Effect(HostEffect::SetLink(part)),
                ),
                None => (Part::Cni, HostProgress::Moved),
            },
            Part::Cni => match &p.want.cni {
                Some(cni) if self.host_book.applied.cni.as_ref() != Some(cni) => {
                    self.host_book.applied.cni = Some(cni.clone());
                    let effect = HostEffect::WriteCni(cni.clone());
                    (Part::Tunnel, HostProgress::Effect(effect))
                }
                _ => (Part::Tunnel, HostProgress::Moved),
            },
            Part::Tunnel => match p.want.tunnel {
                None => {
                    let links = ResolvedLinks {
                        kilo: self.kilo_index,
                        ..Default::default()
                    };
                    (Part::Replan(links), HostProgress::Moved)
                }
                Some(spec) => match self.host_book.applied.tunnel {
                    Some((applied, links)) if applied == spec && links.tunnel.is_some() => {
                        (Part::Replan(links), HostProgress::Moved)
                    }
                    _ => (
                        Part::AwaitTunnel(spec),
                        HostProgress::Effect(HostEffect::PrepareTunnel(spec)),
                    ),
                },
            },
            Part::Replan(links) => self.replan(c, p, links),
            Part::Routes => {
                let book = &mut self.host_book;
                if book.applied.kernel_routes.is_some() && p.want.routes == book.owned {
                    (Part::AfterRoutes, HostProgress::Moved)
                } else {
                    match book.applied.kernel_routes.take() {
                        Some(known) => (Part::ChangeRoutes(known), HostProgress::Moved),
                        None => (
                            Part::AwaitObservedRoutes,
                            HostProgress::Effect(HostEffect::ObserveRoutes),
                        ),
                    }
                }
            }
            Part::ChangeRoutes(observed) => {
                let ops = diff(
                    &p.want.routes,
                    &observed,
                    &self.host_book.owned,
                    self.kilo_index,
                );
                if ops.is_empty() {
                    let errors = Vec::new();
                    let next = Part::RoutesChanged {
                        observed,
                        ops,
                        errors,
                    };
                    (next, HostProgress::Moved)
                } else {
                    let effect = HostEffect::ChangeRoutes(ops.clone());
                    (
                        Part::AwaitChangedRoutes { observed, ops },
                        HostProgress::Effect(effect),
                    )
                }
            }
            Part::RoutesChanged {
                observed,
                ops,
                errors,
            } => (
                Part::AfterRoutes,
                self.routes_changed(&p.want, &observed, &ops, &errors),
            ),
            Part::AfterRoutes if p.engine_first || p.configured.is_some() => {
                (Part::Finish, HostProgress::Moved)
            }
            Part::AfterRoutes => (
                Part::Device {
                    before_routes: false,
                },
                HostProgress::Moved,
            ),
            Part::Finish => match (p.configured.take(), p.routed.take()) {
                (Some(e), _) | (None, Some(e)) => (Part::Done, HostProgress::Done(Err(e))),
                (None, None) => (Part::Firewall, HostProgress::Moved),
            },
            Part::Firewall => match self.firewall_step(&p.want.firewall, c.flips_only, now) {
                FirewallStep::Unchanged | FirewallStep::Held => (Part::Report, HostProgress::Moved),
                FirewallStep::Write { previous } => {
                    let effect = HostEffect::WriteFirewall(Box::new(FirewallWrite {
                        rules: p.want.firewall.clone(),
                        previous,
                    }));
                    (Part::AwaitFirewall, HostProgress::Effect(effect))
                }
            },
            Part::Report => {
                let report = self.host_report(c, &p.want);
                let effect = HostEffect::Converged(Box::new(report));
                (Part::Done, HostProgress::Effect(effect))
            }
            Part::Done => (Part::Done, HostProgress::Done(Ok(()))),
            waiting @ (Part::AwaitDevice { .. }
            | Part::AwaitLink(_)
            | Part::AwaitTunnel(_)
            | Part::AwaitObservedRoutes
            | Part::AwaitChangedRoutes { .. }
            | Part::AwaitFirewall) => (waiting, HostProgress::Waiting),
        };
        p.step = next;
        progress
    }

    /// Takes a shell's answer for the planned parts at `now`.
    fn part_answer(&mut self, c: &Convergence, p: &mut Planned, answer: HostAnswer, now: Now) {
        let step = std::mem::replace(&mut p.step, Part::Done);
        p.step = match (step, answer) {
            (Part::AwaitDevice { before_routes }, HostAnswer::Device(configured)) => {
                self.pq_device_written(configured.is_ok());
                match configured {
                    Ok(outcome) => {
                        self.device_configured(outcome);
                        self.host_book.applied.conf =
                            Some((p.want.device.clone(), c.topology.leader));
                    }
                    Err(e) => p.configured = Some(e),
                }
                if before_routes {
                    Part::Link(None)
                } else {
                    Part::Finish
                }
            }
            (Part::AwaitLink(part), HostAnswer::Link(set)) => match set {
                Ok(()) => {
                    self.link_written(part);
                    Part::Link(Some(part))
                }
                Err(e) => {
                    p.routed = Some(e);
                    Part::AfterRoutes
                }
            },
            (Part::AwaitTunnel(spec), HostAnswer::Tunnel(prepared)) => match prepared {
                Ok(links) => {
                    self.host_book.applied.tunnel = Some((spec, links));
                    Part::Replan(links)
                }
                Err(e) => {
                    p.routed = Some(e);
                    Part::AfterRoutes
                }
            },
            (Part::AwaitObservedRoutes, HostAnswer::ObservedRoutes(observed)) => match observed {
                Ok(observed) => Part::ChangeRoutes(observed),
                Err(e) => {
                    p.routed = Some(e);
                    Part::AfterRoutes
                }
            },
            (Part::AwaitChangedRoutes { observed, ops }, HostAnswer::ChangedRoutes(errors)) => {
                Part::RoutesChanged {
                    observed,
                    ops,
                    errors,
                }
            }
            (Part::AwaitFirewall, HostAnswer::Firewall(outcome)) => {
                match outcome {
                    FirewallOutcome::Written => {
                        self.firewall_written(Some(p.want.firewall.clone()), now)
                    }
                    FirewallOutcome::Failed(why) => {
                        self.firewall_written(None, now);
                        self.errors
                            .push(format!("applying iptables rules failed: {why}"));
                    }
                    FirewallOutcome::NotReady => {}
                }
                Part::Report
            }
            (step, answer) => {
                tracing::debug!(
                    ?answer,
                    "an answer the converge step does not wait for; ignored"
                );
                step
            }
        };
    }

    /// The links resolved to `links`: plans again when they differ from those `p` was
    /// planned with, says what the plan leaves out, and hands the plan to the driver's views.
    fn replan(
        &mut self,
        c: &Convergence,
        p: &mut Planned,
        links: ResolvedLinks,
    ) -> (Part, HostProgress) {
        let planned = self.links();
        self.host_book.resolved = links;
        if links != planned {
            match self.desired(&c.topology, &links) {
                Ok(want) => p.want = want,
                Err(e) => {
                    p.routed = Some(e);
                    return (Part::AfterRoutes, HostProgress::Moved);
                }
            }
        }
        let want = &p.want;
        if let (true, Some(kind)) = (
            want.tunnel_missing(&links),
            self.host_book.tunnel_kind.as_ref(),
        ) {
            let name = kind.name.clone();
            if self.problems.first_time("tunnel-missing") {
                let message = format!("the tunnel link {name} does not exist (yet); routing inside the location without encapsulation");
                self.journal.record(Reason::TunnelMissing, name, message);
            }
        }
        let withheld = want
            .withheld
            .iter()
            .map(|w| (w.cidr.to_string(), w.to_string()))
            .collect();
        let bypasses = want
            .bypasses
            .iter()
            .filter(|b| !b.standby)
            .map(|b| (b.endpoint.to_string(), b.to_string()))
            .collect();
        let unrouted = want
            .routes
            .no_gateway
            .iter()
            .map(|r| (r.dst.to_string(), r.to_string()))
            .collect();
        let planned = ResolvedPlan {
            topology: Arc::clone(&c.topology),
            withheld: want.withheld.clone(),
            tunnel_routes: links.tunnel.map(|index| (want.routes.clone(), index)),
        };
        self.record_fresh("withheld routes", Reason::RouteWithheld, withheld);
        self.record_fresh("endpoint bypasses", Reason::EndpointBypassed, bypasses);
        self.record_fresh(
            "routes without a gateway",
            Reason::RouteWithoutGateway,
            unrouted,
        );
        let effect = HostEffect::PlanResolved(Box::new(planned));
        (Part::Routes, HostProgress::Effect(effect))
    }
}
