//! How often a backend wakes the snapshot's readers.
//!
//! Readers are told of changes at most once per interval: the first change after a quiet
//! interval at once, later ones together when the interval since the last notification has
//! passed. At 5,000 nodes the check-in churn is 167 events a second; paced at
//! [`NOTIFY_INTERVAL`], the reconcile loop wakes about 10 times a second instead of 167 and takes
//! each wake's changes together (through the snapshot's change log), while a single change (a
//! location, an endpoint, a new Node) waits at most one interval (and, on the Node watch, the
//! drain limit).
//!
//! How the backends read meanwhile differs. The Node watch leaves held-back events in its
//! socket and reads them together when they fall due, until the stream has been quiet for
//! [`DRAIN_GAP`], for at most [`DRAIN_LIMIT`] ([`Pace`]). The IPAM watches ([`Pace`] too) read and
//! apply each event as it comes and only tell readers per interval. The file backend's thread
//! sleeps out the interval ([`hold`]) and then reads everything its inotify queue gathered; its
//! own writes (kg's annotations, leases) are read back and told at once.

use std::time::Duration;

use tokio::time::Instant;

/// The shortest time between two notifications of changes.
pub const NOTIFY_INTERVAL: Duration = Duration::from_millis(100);

/// When held-back events are read, the reading stops once no event has come for this long.
pub const DRAIN_GAP: Duration = Duration::from_millis(2);

/// The longest the reading of held-back events goes on after they fell due, so a stream that
/// never pauses still has its changes announced (at most `NOTIFY_INTERVAL + DRAIN_LIMIT` late).
pub const DRAIN_LIMIT: Duration = Duration::from_millis(50);

/// When the next notification may go out (see the module documentation).
#[derive(Debug, Clone)]
pub struct Pace {
    interval: Duration,
    last: Option<Instant>,
    due: Option<Instant>,
}

impl Pace {
    /// Nothing notified yet: the first change is notified at once.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: None,
            due: None,
        }
    }

    /// A change was made at `now`. True when readers are to be told now (and that is recorded);
    /// false when a notification is already due or the last one went out less than an
    /// interval ago, and then one falls due an interval after it ([`Pace::due`]).
    pub fn changed(&mut self, now: Instant) -> bool {
        if self.due.is_some() {
            return false;
        }
        if let Some(next) = self.last.map(|last| last + self.interval) {
            if now < next {
                self.due = Some(next);
                return false;
            }
        }
        self.last = Some(now);
        true
    }

    /// When the held-back changes are to be notified (`None`: nothing is held back).
    pub fn due(&self) -> Option<Instant> {
        self.due
    }

    /// Readers were told of every change so far at `now`.
    pub fn notified(&mut self, now: Instant) {
        self.last = Some(now);
        self.due = None;
    }
}

/// How long a reader that last told of changes at `last` waits at `now` before reading more
/// (zero once an interval has passed).
pub fn hold(last: Option<std::time::Instant>, now: std::time::Instant) -> Duration {
    last.map_or(Duration::ZERO, |last| {
        (last + NOTIFY_INTERVAL).saturating_duration_since(now)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_change_after_a_quiet_interval_is_told_at_once() {
        let t = Instant::now();
        let mut pace = Pace::new(100 * MS);
        assert!(pace.changed(t));
        assert_eq!(pace.due(), None);
        assert!(pace.changed(t + 100 * MS));
        assert!(pace.changed(t + 350 * MS));
        assert_eq!(pace.due(), None);
    }

    #[test]
    fn a_burst_is_told_once_per_interval() {
        let t = Instant::now();
        let mut pace = Pace::new(100 * MS);
        assert!(pace.changed(t));
        // 167 events a second: every 6 ms.
        let mut told = 1;
        let mut now = t;
        for _ in 0..167 {
            now += 6 * MS;
            if let Some(due) = pace.due().filter(|d| *d <= now) {
                pace.notified(due);
                told += 1;
            }
            if pace.changed(now) {
                told += 1;
            }
            // A held-back change is never due later than an interval after it was made.
            assert!(pace.due().is_none_or(|d| d <= now + 100 * MS));
        }
        assert!(
            (10..=11).contains(&told),
            "{told} notifications in a second"
        );
    }

    #[test]
    fn a_reader_holds_for_what_is_left_of_the_interval() {
        let t = std::time::Instant::now();
        assert_eq!(hold(None, t), Duration::ZERO);
        assert_eq!(hold(Some(t), t + 30 * MS), 70 * MS);
        assert_eq!(hold(Some(t), t + 100 * MS), Duration::ZERO);
        assert_eq!(hold(Some(t), t + 500 * MS), Duration::ZERO);
    }

    #[test]
    fn a_change_soon_after_one_waits_for_the_interval() {
        let t = Instant::now();
        let mut pace = Pace::new(100 * MS);
        assert!(pace.changed(t));
        assert!(!pace.changed(t + 30 * MS));
        assert_eq!(pace.due(), Some(t + 100 * MS));
        // Further changes join the one already due.
        assert!(!pace.changed(t + 60 * MS));
        assert_eq!(pace.due(), Some(t + 100 * MS));
        pace.notified(t + 100 * MS);
        assert_eq!(pace.due(), None);
        assert!(!pace.changed(t + 150 * MS));
        assert_eq!(pace.due(), Some(t + 200 * MS));
    }
}
