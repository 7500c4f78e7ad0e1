//! What is due when, as one table: the periodic passes (resync, check-in, the lease step), the
//! moments a pass is wanted without an event (held readiness flips and firewall writes, a lease
//! running out, a key rotation's step), the DNS lookups and the post-quantum links' timers.
//! [`Reconciler::poll_timeout`] names the next, [`Reconciler::on_timeout`] says what its
//! firing asks for and sets it again.

use std::time::{Duration, Instant};

use control::clock::Now;
use control::dns::Answer;
use control::journal::Reason;
use control::node::Node;
use control::pass::Trigger;

use super::{Reconciler, CHECK_IN_PERIOD};

/// How often the lease step runs.
const LEASE_PERIOD: Duration = Duration::from_millis(control::leader::LEASE_RENEW_MS as u64);
/// Least time between two rounds of DNS lookups.
const DNS_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// How long after a failed pass the first retry runs; each failure after doubles it, up to the
/// resync period.
const RETRY_FIRST: Duration = Duration::from_secs(1);

/// Why the agent wakes without an event. Timers due at one moment fire in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Timer {
    /// `--resync-period`: list the host and run every stage.
    Resync,
    /// Kilo's check-in period: refresh `last-seen`.
    CheckIn,
    /// The lease step's period (with lease election).
    LeaseStep,
    /// A lease this node saw held runs out unless renewed.
    LeaseExpiry,
    /// Held readiness flips or a held firewall write are due.
    Readiness,
    /// A key rotation's next step is due.
    Rotation,
    /// The last pass failed: it is tried again after a backoff ([`RETRY_FIRST`], doubling up
    /// to the resync period).
    Retry,
    /// DNS names are due for a lookup.
    Lookups,
    /// The post-quantum links' timers are due.
    PostQuantum,
    /// A peer's endpoint candidate may have failed: the device's readings are wanted.
    Endpoints,
}

/// What a timer's firing asks of the driver ([`Reconciler::on_timeout`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Wake {
    /// Run a pass.
    Pass(Trigger),
    /// Look these names up.
    Lookups(Vec<String>),
    /// Carry out the post-quantum links' effects ([`Reconciler::poll_pq_effect`]).
    PostQuantum,
    /// Read the device's peers and hand them to [`Reconciler::endpoint_readings`].
    ReadPeers,
}

/// The periodic timers' next moments, and what the table holds for the driver's own work.
#[derive(Debug, Clone)]
pub(super) struct TimerTable {
    resync: Instant,
    check_in: Instant,
    lease_step: Instant,
    /// When lookups last started (they start at most every [`DNS_MIN_INTERVAL`]).
    last_lookups: Option<Instant>,
    /// True when names can be looked up (kg has a resolver).
    lookups: bool,
    /// When the post-quantum links are next due.
    pub(super) post_quantum: Option<Instant>,
    /// When a failed pass is tried again, and how many passes failed in a row.
    retry: Option<(Instant, u32)>,
}

impl TimerTable {
    /// A table whose periodic timers all fire at `start`.
    pub(super) fn new(start: Instant) -> Self {
        Self {
            resync: start,
            check_in: start,
            lease_step: start,
            last_lookups: None,
            lookups: false,
            post_quantum: None,
            retry: None,
        }
    }

    /// A pass ended at `now` with `outcome`, `resync` the longest backoff: a failure sets the
    /// retry a backoff later (doubled for each failure in a row), a host converged whole
    /// clears it, and a pass that tried nothing leaves it as it is.
    pub(super) fn pass_ended(&mut self, outcome: PassOutcome, now: Instant, resync: Duration) {
        match outcome {
            PassOutcome::Untried => {}
            PassOutcome::Whole => self.retry = None,
            PassOutcome::Failed => {
                let failures = self.retry.map_or(0, |(_, n)| n).saturating_add(1);
                let doublings = (failures - 1).min(16);
                let backoff = RETRY_FIRST.saturating_mul(1 << doublings).min(resync);
                self.retry = Some((now + backoff, failures));
            }
        }
    }

    /// True while a retry is set.
    pub(super) fn retrying(&self) -> bool {
        self.retry.is_some()
    }
}

/// How a pass ended, for the retry timer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PassOutcome {
    /// It failed, or left a part of the host unconverged.
    Failed,
    /// It converged the host whole.
    Whole,
    /// It tried no convergence and did not fail.
    Untried,
}

impl Reconciler {
    /// The next moment the agent must wake without an event, and why: the earliest of every
    /// timer (those due together in [`Timer`]'s order).
    pub fn poll_timeout(&self) -> Option<(Instant, Timer)> {
        self.timers_due().into_iter().min()
    }

    /// Every timer set, with its moment.
    pub fn timers_due(&self) -> Vec<(Instant, Timer)> {
        let t = &self.timers;
        let lookups = t.lookups.then(|| self.dns_deadline()).flatten().map(|due| {
            t.last_lookups
                .map_or(due, |last| due.max(last + DNS_MIN_INTERVAL))
        });
        let leases = self.leases_on();
        [
            (Some(t.resync), Timer::Resync),
            (Some(t.check_in), Timer::CheckIn),
            (leases.then_some(t.lease_step), Timer::LeaseStep),
            (
                leases.then(|| self.lease_deadline()).flatten(),
                Timer::LeaseExpiry,
            ),
            (self.readiness_deadline(), Timer::Readiness),
            (self.rotation_deadline(), Timer::Rotation),
            (lookups, Timer::Lookups),
            (t.retry.map(|(at, _)| at), Timer::Retry),
            (t.post_quantum, Timer::PostQuantum),
            (self.endpoint_probes.next_check(), Timer::Endpoints),
        ]
        .into_iter()
        .filter_map(|(at, timer)| Some((at?, timer)))
        .collect()
    }

    /// `timer` fired at `now`: sets it again (a periodic one a period from now) and says what
    /// it asks for.
    pub fn on_timeout(&mut self, timer: Timer, now: Now) -> Wake {
        let t = &mut self.timers;
        match timer {
            Timer::Resync => {
                t.resync = now.instant + self.config.resync;
                Wake::Pass(Trigger::Resync)
            }
            Timer::CheckIn => {
                t.check_in = now.instant + CHECK_IN_PERIOD;
                Wake::Pass(Trigger::CheckIn)
            }
            Timer::LeaseStep => {
                t.lease_step = now.instant + LEASE_PERIOD;
                Wake::Pass(Trigger::Lease)
            }
            Timer::LeaseExpiry => Wake::Pass(Trigger::Lease),
            Timer::Readiness => Wake::Pass(Trigger::Readiness),
            Timer::Rotation => Wake::Pass(Trigger::Key),
            Timer::Retry => {
                // Set again by the pass's end: later if it fails too, cleared if it does not.
                if let Some((at, _)) = &mut t.retry {
                    *at = now.instant + self.config.resync;
                }
                Wake::Pass(Trigger::Retry)
            }
            Timer::Lookups => {
                t.last_lookups = Some(now.instant);
                Wake::Lookups(self.dns.start(now.instant))
            }
            Timer::PostQuantum => {
                t.post_quantum = None;
                self.pq_timeout(now)
            }
            Timer::Endpoints => Wake::ReadPeers,
        }
    }

    /// Names may be looked up from now on (the driver has a resolver).
    pub fn enable_lookups(&mut self) {
        self.timers.lookups = true;
    }

    /// When the readiness flips or the firewall write held back are due: `None` when none
    /// is held.
    pub fn readiness_deadline(&self) -> Option<Instant> {
        let batch = self.readiness_batch.deadline();
        let firewall = self.firewall_hold.deadline();
        batch.into_iter().chain(firewall).min()
    }

    /// When the lease step is next due before its timer: the moment a lease this node saw
    /// held expires unless renewed, so that a dead leader's successor is elected (and every
    /// node routes through it) when its lease runs out, not up to a lease step later. `None`
    /// without leases, or while the backend is unreachable.
    pub fn lease_deadline(&self) -> Option<Instant> {
        let at = self.ingested_at?;
        if !self.leases_on() {
            return None;
        }
        let expiry = self.leases.next_expiry_ms(at.unix_ms)?;
        let after = u64::try_from(expiry - at.unix_ms).ok()?;
        Some(at.instant + Duration::from_millis(after))
    }

    /// When the next DNS lookup is due (`None`: no name to resolve).
    pub fn dns_deadline(&self) -> Option<Instant> {
        self.dns.next_deadline()
    }

    /// Takes in lookup answers that came at `now` (a failure keeps the last good address);
    /// returns how many failed. The next pass computes the mesh again when an address changed.
    pub fn take_lookups(
        &mut self,
        answers: Vec<(String, Result<std::net::IpAddr, String>)>,
        now: Now,
    ) -> usize {
        let mut failed = 0;
        for (name, result) in answers {
            let error = result.as_ref().err().cloned();
            match self.dns.record(&name, result, now.instant) {
                Answer::Changed { old, new } => {
                    self.dns_changed = true;
                    let was = old.map_or("nothing".to_string(), |o| o.to_string());
                    let line = format!("DNS endpoint {name} resolved to {new} (was {was})");
                    self.journal.record(Reason::EndpointResolved, &name, line);
                }
                Answer::Failed { kept } => {
                    failed += 1;
                    let kept = kept.map_or("none".to_string(), |k| k.to_string());
                    let line = format!(
                        "DNS lookup of {name} failed ({}); keeping the last good address ({kept})",
                        error.unwrap_or_default()
                    );
                    self.journal
                        .record(Reason::EndpointLookupFailed, &name, line);
                }
                Answer::Unchanged | Answer::Untracked => {}
            }
        }
        failed
    }

    /// Tracks every DNS name in use (Nodes, ready or not, and Peers) for re-resolution.
    pub(super) fn track_dns_names(&mut self, local: &Node, now: Now) {
        let hostname = &self.config.hostname;
        let names: Vec<String> = self
            .table
            .iter()
            .map(|(n, _)| n)
            .filter(|n| n.name != *hostname)
            .chain(std::iter::once(local))
            .filter_map(|n| n.endpoint.as_ref()?.dns_name().map(str::to_string))
            .chain(
                self.peers
                    .iter()
                    .filter_map(|p| p.endpoint.as_ref()?.dns_name().map(str::to_string)),
            )
            .collect();
        self.dns
            .track(names.iter().map(String::as_str), now.instant);
    }
}
