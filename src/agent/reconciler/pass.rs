//! A pass as a protocol: [`Reconciler::begin_pass`] opens it, [`Reconciler::poll_effect`] hands
//! out the next thing the shells must do, [`Reconciler::handle`] takes each answer back, and
//! [`Reconciler::end_pass`] closes it with its outcome. Where the pass stands is a [`Step`]
//! that carries what the steps before it found, so a step can only run once its inputs exist:
//! the order lives in the state, not in the caller.

use std::sync::Arc;

use control::clock::Now;
use control::journal::Reason;
use control::leader::book::{LeaseWrite, TunnelReadings};
use control::node::Node;
use control::pass::{tends_lease, Changes, Trigger};
use control::rotation::RotationStep;
use control::Peer;
use k8s_openapi::api::core::v1::Node as KubeNode;

use super::converge::{HostProgress, HostWork};
use super::host_effects::{HostAnswer, HostEffect};
use super::Reconciler;
use crate::agent::host::local::AnnotationPatch;
use crate::agent::host::{DetectionInputs, HostView};

/// The next thing a pass needs done outside the reconciler ([`Reconciler::poll_effect`]).
/// Those marked "answer" wait for [`Reconciler::handle`] before the pass goes on.
#[derive(Debug)]
pub enum PassEffect {
    /// Start the lost WireGuard device again (why it was lost said). Answer:
    /// [`PassAnswer::EngineRecreated`].
    RecreateEngine(String),
    /// List the host's links, addresses and routes, reading the addresses as `DetectionInputs`
    /// says. Answer: [`PassAnswer::HostListed`].
    ListHost(DetectionInputs),
    /// Carry out a key rotation's step (the driver reports back through
    /// [`Reconciler::key_prepared`] and [`Reconciler::key_committed`]).
    RotateKey(RotationStep),
    /// Leaders were elected (for the driver's stage timing).
    Elected,
    /// The mesh step ran: the counts for the metrics.
    Meshed(MeshReport),
    /// One step of bringing the host to the topology just computed ([`HostEffect`]); those
    /// that wait for an answer take it as [`PassAnswer::Host`].
    Host(HostEffect),
    /// Read the tunnels for the lease step. Answer: [`PassAnswer::TunnelsRead`].
    ReadTunnels,
    /// Send this compare-and-swap of the location's lease.
    WriteLease(Box<LeaseWrite>),
    /// Patch the local Node's annotations. Answer: [`PassAnswer::Patched`].
    PatchAnnotations(AnnotationPatch),
}

/// A shell's answer to a [`PassEffect`].
#[derive(Debug)]
pub enum PassAnswer {
    /// The device runs again, with no peers and a bare link (its index given), or why it
    /// could not start.
    EngineRecreated(anyhow::Result<u32>),
    /// The host as listed, or why it could not be.
    HostListed {
        /// What the shells listed.
        listed: anyhow::Result<HostView>,
        /// True when the listing kept the last route dump (nothing changed the kernel's
        /// routes since): kg's record of its routes holds.
        dump_kept: bool,
    },
    /// The answer to a [`PassEffect::Host`].
    Host(HostAnswer),
    /// What the tunnels say, for the lease step.
    TunnelsRead(TunnelReadings),
    /// The backend took the patch, or why it did not.
    Patched(anyhow::Result<()>),
}

/// What one mesh step found ([`PassEffect::Meshed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MeshReport {
    /// The ready nodes the topology was computed from (the local one included when ready).
    pub nodes: usize,
    /// The ready Peers.
    pub peers: usize,
    /// True when the topology was computed (false while the local node is not ready).
    pub computed: bool,
}

/// What the pass found about the local node and the cluster once the host was known: what
/// every later step works from.
pub(super) struct Observed {
    /// The local node as kg sees it this pass.
    pub(super) local: Node,
    pub(super) changes: Changes,
    /// True when leaders are elected this pass.
    pub(super) elect: bool,
    /// The ready nodes, listed by the election.
    pub(super) ready: Option<Vec<Node>>,
    /// True once leaders were elected this pass.
    pub(super) elected: bool,
    pub(super) leaders_changed: bool,
    /// The ready nodes and Peers the mesh was computed from (for NAT discovery).
    pub(super) meshed: Option<(Vec<Node>, Vec<Peer>)>,
}

/// Where a pass stands: each step holds what the steps before it found.
pub(super) enum Step {
    /// The device was lost (why): start it again before anything else.
    Recreate(String, DetectionInputs),
    /// Waiting for the device to start again.
    AwaitRecreated(String, DetectionInputs),
    /// The host must be listed first.
    ListHost(DetectionInputs),
    /// Waiting for the host as listed.
    AwaitHost(DetectionInputs),
    /// The host is known: work out the local node and what changed.
    Observe,
    /// Elect leaders when due, then mesh.
    Elect(Observed),
    /// Compute the topology.
    Mesh(Observed),
    /// Converge the host, part by part.
    Converge(Observed, Box<HostWork>),
    /// The lease step, when due.
    Lease(Observed),
    /// Waiting for the tunnels' readings.
    AwaitReadings(Observed),
    /// Send the lease write, then publish.
    SendLease(Observed, LeaseWrite),
    /// Publish the local Node's annotations.
    Publish(Observed),
    /// Waiting for the backend to take the patch.
    AwaitPatched(AnnotationPatch),
    /// Nothing left to do.
    Done,
}

/// The pass in progress.
pub(super) struct Pass {
    pub(super) trigger: Trigger,
    /// True when the host was listed this pass (every part is compared afresh).
    pub(super) full: bool,
    /// True when this pass's listing kept the last route dump.
    pub(super) dump_kept: bool,
    /// The local Node's object as the backend has it.
    pub(super) local_object: Option<Arc<KubeNode>>,
    /// The time readiness is judged at (frozen during an outage).
    pub(super) readiness_now: i64,
    pub(super) step: Step,
    /// Why the pass failed, if it did.
    pub(super) failure: Option<anyhow::Error>,
    /// Whether the host was converged whole this pass (`None`: no convergence was tried).
    pub(super) converged: Option<bool>,
}

/// What one turn of [`Reconciler::advance`] did.
enum Progress {
    /// Moved to the next step with nothing for the shells.
    Moved,
    /// The shells must do this.
    Effect(PassEffect),
    /// Done, or waiting for an answer.
    Idle,
}

impl Reconciler {
    /// The next thing the pass in progress needs done, at `now`; `None` when it is over or
    /// waits for the answer to the last effect. Decisions that need no shell run here.
    pub fn poll_effect(&mut self, now: Now) -> Option<PassEffect> {
        let mut pass = self.pass.take()?;
        let effect = loop {
            match self.advance(&mut pass, now) {
                Ok(Progress::Moved) => {}
                Ok(Progress::Effect(effect)) => break Some(effect),
                Ok(Progress::Idle) => break None,
                Err(e) => {
                    pass.failure = Some(e);
                    pass.step = Step::Done;
                    break None;
                }
            }
        };
        self.pass = Some(pass);
        effect
    }

    /// Takes a shell's answer to the last effect at `now`. A failure ends the pass (the next
    /// one tries again); an answer the pass does not wait for is ignored.
    pub fn handle(&mut self, answer: PassAnswer, now: Now) {
        let Some(mut pass) = self.pass.take() else {
            tracing::debug!(?answer, "an answer after its pass ended; ignored");
            return;
        };
        let step = std::mem::replace(&mut pass.step, Step::Done);
        pass.step = match (step, answer) {
            (Step::AwaitRecreated(why, detection), PassAnswer::EngineRecreated(started)) => {
                match started {
                    Ok(kilo_index) => {
                        self.engine_lost = None;
                        self.kilo_index = kilo_index;
                        self.host_book.forget_applied();
                        self.journal.record(
                            Reason::EngineRecreated,
                            self.config.interface.clone(),
                            format!("{why}; kg started it again and applies the mesh anew"),
                        );
                        Step::ListHost(detection)
                    }
                    Err(e) => fail(
                        &mut pass.failure,
                        e.context(format!("{why}; starting it again failed")),
                    ),
                }
            }
            (Step::AwaitHost(detection), PassAnswer::HostListed { listed, dump_kept }) => {
                match listed {
                    Ok(host) => {
                        pass.dump_kept = dump_kept;
                        self.host = Some(host);
                        self.detection = detection;
                        Step::Observe
                    }
                    Err(e) => fail(&mut pass.failure, e),
                }
            }
            (Step::Converge(observed, mut work), PassAnswer::Host(answer)) => {
                self.converge_answer(&mut work, observed.meshed.as_ref(), answer, now);
                Step::Converge(observed, work)
            }
            (Step::AwaitReadings(observed), PassAnswer::TunnelsRead(readings)) => {
                let nodes = observed.ready.as_deref().unwrap_or_default();
                let hostname = &self.config.hostname;
                match self.leases.tend(hostname, nodes, &readings, now.unix_ms) {
                    Some(write) => Step::SendLease(observed, write),
                    None => Step::Publish(observed),
                }
            }
            (Step::AwaitPatched(patch), PassAnswer::Patched(result)) => {
                self.patched(patch, result.is_ok(), pass.local_object.as_deref());
                match result {
                    Ok(()) => Step::Done,
                    Err(e) => fail(&mut pass.failure, e),
                }
            }
            (step, answer) => {
                tracing::debug!(?answer, "an answer the pass does not wait for; ignored");
                step
            }
        };
        self.pass = Some(pass);
    }

    /// One step of `pass` at `now`.
    fn advance(&mut self, pass: &mut Pass, now: Now) -> anyhow::Result<Progress> {
        let step = std::mem::replace(&mut pass.step, Step::Done);
        let (next, progress) = match step {
            Step::Done => (Step::Done, Progress::Idle),
            Step::Recreate(why, detection) => {
                let effect = PassEffect::RecreateEngine(why.clone());
                (
                    Step::AwaitRecreated(why, detection),
                    Progress::Effect(effect),
                )
            }
            Step::ListHost(detection) => {
                let effect = PassEffect::ListHost(detection.clone());
                (Step::AwaitHost(detection), Progress::Effect(effect))
            }
            waiting @ (Step::AwaitRecreated(..)
            | Step::AwaitHost(_)
            | Step::AwaitReadings(_)
            | Step::AwaitPatched(_)) => (waiting, Progress::Idle),
            Step::Observe => {
                let observed = self.observe(pass, now)?;
                match self.rotation_step(pass.local_object.as_deref(), now) {
                    Some(rotation) => (
                        Step::Elect(observed),
                        Progress::Effect(PassEffect::RotateKey(rotation)),
                    ),
                    None => (Step::Elect(observed), Progress::Moved),
                }
            }
            Step::Elect(mut observed) => {
                if observed.elect {
                    self.elect(&mut observed, pass.readiness_now, now);
                    (Step::Mesh(observed), Progress::Effect(PassEffect::Elected))
                } else {
                    (Step::Mesh(observed), Progress::Moved)
                }
            }
            Step::Mesh(mut observed) => match self.mesh(pass, &mut observed, now)? {
                None => (Step::Lease(observed), Progress::Moved),
                Some((report, converge)) => {
                    let next = match converge {
                        Some(c) => {
                            let work = Box::new(HostWork::new(c, pass.dump_kept));
                            Step::Converge(observed, work)
                        }
                        None => Step::Lease(observed),
                    };
                    (next, Progress::Effect(PassEffect::Meshed(report)))
                }
            },
            Step::Converge(observed, mut work) => match self.converge_turn(&mut work, now) {
                HostProgress::Moved => (Step::Converge(observed, work), Progress::Moved),
                HostProgress::Effect(effect) => (
                    Step::Converge(observed, work),
                    Progress::Effect(PassEffect::Host(effect)),
                ),
                HostProgress::Waiting => (Step::Converge(observed, work), Progress::Idle),
                HostProgress::Done(converged) => {
                    let ok = converged.is_ok();
                    self.converged(work.c, ok, self.routes_known());
                    // A part that failed without failing the pass (a route change, the
                    // firewall) is tried again on the retry timer too.
                    pass.converged = Some(self.converged_whole);
                    match converged {
                        Ok(()) => (Step::Lease(observed), Progress::Moved),
                        Err(e) => return Err(e),
                    }
                }
            },
            Step::Lease(observed) => {
                if tends_lease(pass.trigger, observed.elected) {
                    (
                        Step::AwaitReadings(observed),
                        Progress::Effect(PassEffect::ReadTunnels),
                    )
                } else {
                    (Step::Publish(observed), Progress::Moved)
                }
            }
            Step::SendLease(observed, write) => (
                Step::Publish(observed),
                Progress::Effect(PassEffect::WriteLease(Box::new(write))),
            ),
            Step::Publish(observed) => {
                let check_in = pass.trigger == Trigger::CheckIn;
                match self.annotation_patch(pass, &observed, check_in, now) {
                    Some(patch) => {
                        let effect = PassEffect::PatchAnnotations(patch.clone());
                        (Step::AwaitPatched(patch), Progress::Effect(effect))
                    }
                    None => (Step::Done, Progress::Idle),
                }
            }
        };
        pass.step = next;
        Ok(progress)
    }
}

/// Records `e` as the pass's failure; the pass is done.
fn fail(failure: &mut Option<anyhow::Error>, e: anyhow::Error) -> Step {
    *failure = Some(e);
    Step::Done
}
