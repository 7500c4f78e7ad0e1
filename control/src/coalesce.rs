//! Readiness flips batched. In a large cluster with a flaky network, nodes cross Kilo's
//! `last-seen` bound and come back all the time (with 10% of 5,000 nodes crossing it every
//! minute, some 16 flips a second), and each flip changes the topology. Taken one by one they
//! would reconfigure the engine and the routes many times a second, and a real change would
//! queue behind them. A flip alone changes the mesh at most once per [`READINESS_INTERVAL`]:
//! flips that arrive sooner are held and taken together when the interval has passed, or at
//! once with the next change of another kind (a Node added, removed or re-annotated, a Peer, a
//! DNS answer, a lease). Kilo's readiness rule itself is unchanged: a node past its bound
//! still leaves the topology, at most [`READINESS_INTERVAL`] later.
//!
//! The firewall follows flips more slowly still ([`FirewallHold`]): its rules only keep
//! traffic to other nodes' pods from being masqueraded, and nftables takes tens of
//! milliseconds to remove one element from a set of thousands. A change that flips alone
//! cause reaches the engine and the routes at once and the firewall at most once per
//! [`FIREWALL_INTERVAL`]; any other change writes it at once.
//!
//! Pure: the time comes in as an argument.

use std::time::{Duration, Instant};

/// The shortest time between two mesh computations that readiness flips alone cause.
pub const READINESS_INTERVAL: Duration = Duration::from_secs(2);

/// The shortest time between two firewall writes that readiness flips alone cause.
pub const FIREWALL_INTERVAL: Duration = Duration::from_secs(10);

/// Something held back until an interval has passed since it was last done: the one
/// mechanism behind [`ReadinessBatch`] and [`FirewallHold`].
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pace {
    interval: Duration,
    held: bool,
    last: Option<Instant>,
}

impl Pace {
    const fn new(interval: Duration) -> Self {
        Self {
            interval,
            held: false,
            last: None,
        }
    }

    /// True when the interval has passed at `now` since it was last done (or it never was).
    fn open(&self, now: Instant) -> bool {
        self.last.is_none_or(|last| now >= last + self.interval)
    }

    /// It was done at `now`: nothing is held.
    fn done(&mut self, now: Instant) {
        self.held = false;
        self.last = Some(now);
    }

    /// When what is held is due (`None` when nothing is held).
    fn deadline(&self) -> Option<Instant> {
        if !self.held {
            return None;
        }
        self.last.map(|last| last + self.interval)
    }

    /// A reconcile at `now` ended: what it held past its deadline (it failed before it could
    /// do it) waits another interval, so that the event loop never spins on a deadline in the
    /// past.
    fn reconciled(&mut self, now: Instant) {
        if self.deadline().is_some_and(|at| at <= now) {
            self.last = Some(now);
        }
    }
}

/// The readiness flips not yet taken into the mesh, and when the mesh was last computed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadinessBatch(Pace);

impl Default for ReadinessBatch {
    fn default() -> Self {
        Self(Pace::new(READINESS_INTERVAL))
    }
}

impl ReadinessBatch {
    /// Takes in whether readiness `flipped` since the last call, at `now`; true when the
    /// flips held so far are due to change the mesh now.
    pub fn due(&mut self, flipped: bool, now: Instant) -> bool {
        self.0.held |= flipped;
        self.0.held && self.0.open(now)
    }

    /// The mesh was computed at `now`, with every flip held so far.
    pub fn meshed(&mut self, now: Instant) {
        self.0.done(now);
    }

    /// A reconcile at `now` ended. Flips it held past their deadline (it failed before it
    /// could take them) wait another interval, so that the event loop never spins on a
    /// deadline in the past.
    pub fn reconciled(&mut self, now: Instant) {
        self.0.reconciled(now);
    }

    /// When the flips held are due (`None` when none is held): the event loop wakes then.
    pub fn deadline(&self) -> Option<Instant> {
        self.0.deadline()
    }

    /// True when flips are held, waiting for [`ReadinessBatch::deadline`].
    pub fn holds(&self) -> bool {
        self.0.held
    }
}

/// Firewall writes held back while only readiness flips change the rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FirewallHold(Pace);

impl Default for FirewallHold {
    fn default() -> Self {
        Self(Pace::new(FIREWALL_INTERVAL))
    }
}

impl FirewallHold {
    /// Whether rules that differ from the applied ones are written at `now`: at once unless
    /// readiness flips alone changed them (`flips_only`) and the firewall was written less
    /// than [`FIREWALL_INTERVAL`] ago; then they are held until
    /// [`FirewallHold::deadline`].
    pub fn write_now(&mut self, flips_only: bool, now: Instant) -> bool {
        let write = !flips_only || self.0.open(now);
        self.0.held = !write;
        write
    }

    /// The firewall was written (or found as wanted) at `now`.
    pub fn written(&mut self, now: Instant) {
        self.0.done(now);
    }

    /// The rules came back to the applied ones while held: nothing is left to write.
    pub fn unneeded(&mut self) {
        self.0.held = false;
    }

    /// A reconcile at `now` ended. A write it held past its deadline (it failed before it
    /// reached the firewall) waits another interval, so that the event loop never spins on a
    /// deadline in the past.
    pub fn reconciled(&mut self, now: Instant) {
        self.0.reconciled(now);
    }

    /// True when a write is held.
    pub fn holds(&self) -> bool {
        self.0.held
    }

    /// When the held write is due (`None` when none is held): the event loop wakes then.
    pub fn deadline(&self) -> Option<Instant> {
        self.0.deadline()
    }

    /// True when a held write is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.0.deadline().is_some_and(|at| now >= at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_first_flip_is_taken_at_once() {
        let mut batch = ReadinessBatch::default();
        let t0 = Instant::now();
        assert!(batch.due(true, t0));
        assert_eq!(
            batch.deadline(),
            None,
            "nothing is due before a mesh was computed"
        );
    }

    #[test]
    fn flips_within_the_interval_are_held_until_it_passes() {
        let mut batch = ReadinessBatch::default();
        let t0 = Instant::now();
        batch.meshed(t0);
        let soon = t0 + Duration::from_millis(100);
        assert!(!batch.due(true, soon), "a flip 100 ms after a mesh waits");
        assert!(batch.holds());
        assert_eq!(batch.deadline(), Some(t0 + READINESS_INTERVAL));
        let later = t0 + Duration::from_millis(300);
        assert!(!batch.due(false, later), "still held, still not due");
        assert!(
            batch.due(false, t0 + READINESS_INTERVAL),
            "due once the interval passed"
        );
        batch.meshed(t0 + READINESS_INTERVAL);
        assert!(!batch.holds());
        assert_eq!(batch.deadline(), None);
    }

    #[test]
    fn nothing_held_is_never_due() {
        let mut batch = ReadinessBatch::default();
        let t0 = Instant::now();
        batch.meshed(t0);
        assert!(!batch.due(false, t0 + Duration::from_secs(60)));
        assert_eq!(batch.deadline(), None);
    }

    #[test]
    fn a_mesh_for_another_reason_takes_the_held_flips() {
        let mut batch = ReadinessBatch::default();
        let t0 = Instant::now();
        batch.meshed(t0);
        assert!(!batch.due(true, t0 + Duration::from_millis(50)));
        // A Node's annotation changed: the mesh is computed anyway, with the held flips.
        batch.meshed(t0 + Duration::from_millis(60));
        assert!(!batch.holds());
        assert!(
            !batch.due(true, t0 + Duration::from_millis(400)),
            "the interval counts from the last mesh, whatever caused it"
        );
        assert_eq!(
            batch.deadline(),
            Some(t0 + Duration::from_millis(60) + READINESS_INTERVAL)
        );
    }

    #[test]
    fn flips_a_failed_reconcile_left_behind_wait_another_interval() {
        let mut batch = ReadinessBatch::default();
        let t0 = Instant::now();
        batch.meshed(t0);
        assert!(!batch.due(true, t0 + Duration::from_millis(10)));
        // The reconcile at the deadline failed before it took the flips.
        let at = t0 + READINESS_INTERVAL;
        batch.reconciled(at);
        assert_eq!(batch.deadline(), Some(at + READINESS_INTERVAL));
        // One that ends before the deadline leaves it alone.
        batch.reconciled(at + Duration::from_millis(100));
        assert_eq!(batch.deadline(), Some(at + READINESS_INTERVAL));
    }

    #[test]
    fn flapping_meshes_at_most_twice_a_second() {
        // A flip every 10 ms for 10 s, a reconcile after each; count the meshes.
        let mut batch = ReadinessBatch::default();
        let t0 = Instant::now();
        let mut meshes = 0;
        for step in 0..1_000u64 {
            let now = t0 + Duration::from_millis(10 * step);
            if batch.due(true, now) {
                batch.meshed(now);
                meshes += 1;
            }
        }
        let expected = (10_000 / READINESS_INTERVAL.as_millis()) as i32;
        assert!(
            (expected - 1..=expected + 1).contains(&meshes),
            "{meshes} meshes in 10 s, not about {expected}"
        );
    }

    #[test]
    fn the_firewall_follows_flips_at_most_once_per_interval_and_other_changes_at_once() {
        let mut hold = FirewallHold::default();
        let t0 = Instant::now();
        assert!(hold.write_now(true, t0), "the first write is never held");
        hold.written(t0);
        let soon = t0 + Duration::from_secs(2);
        assert!(!hold.write_now(true, soon), "flips 2 s later wait");
        assert!(hold.holds());
        assert_eq!(hold.deadline(), Some(t0 + FIREWALL_INTERVAL));
        assert!(!hold.due(soon));
        assert!(hold.due(t0 + FIREWALL_INTERVAL));
        assert!(hold.write_now(true, t0 + FIREWALL_INTERVAL), "due: written");
        hold.written(t0 + FIREWALL_INTERVAL);
        assert_eq!(hold.deadline(), None);
        let later = t0 + FIREWALL_INTERVAL + Duration::from_secs(1);
        assert!(
            hold.write_now(false, later),
            "a Node added or re-annotated writes at once"
        );
        assert!(!hold.holds());
    }

    #[test]
    fn flapping_writes_the_firewall_at_most_once_per_interval() {
        let mut batch = ReadinessBatch::default();
        let mut hold = FirewallHold::default();
        let t0 = Instant::now();
        let (mut meshes, mut writes) = (0, 0);
        for step in 0..6_000u64 {
            let now = t0 + Duration::from_millis(10 * step);
            if batch.due(true, now) || hold.due(now) {
                batch.meshed(now);
                meshes += 1;
                if hold.write_now(true, now) {
                    hold.written(now);
                    writes += 1;
                }
            }
        }
        let expected = (60 / FIREWALL_INTERVAL.as_secs()) as i32;
        assert!(
            (expected..=expected + 1).contains(&writes),
            "{writes} firewall writes in 60 s ({meshes} meshes)"
        );
        assert!(meshes > writes * 2, "{meshes} meshes, {writes} writes");
    }
}
