//! The clock other nodes' check-ins are judged by. A node is ready while its `last-seen` is
//! recent, but during a backend outage nobody's check-in can arrive: judging them by the wall
//! clock would declare every other node gone after a minute and tear the mesh down (Kilo's
//! field problem). So while the backend is unreachable the clock stops at the last moment it was
//! reachable, and after it returns it stays there for a grace period in which every node checks
//! in again.

/// Readiness time, given backend health over time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadinessClock {
    /// The last time the backend was known reachable.
    last_ok: Option<i64>,
    /// While set, readiness is judged at this time.
    frozen_at: Option<i64>,
    /// After a recovery, when the frozen time ends.
    thaw_at: Option<i64>,
}

impl ReadinessClock {
    /// Notes the backend's health at `now` (Unix seconds); `grace` is how long after a recovery
    /// the clock stays frozen (one check-in period plus a resync is enough).
    pub fn observe(&mut self, now: i64, healthy: bool, grace: i64) {
        if healthy {
            if self.frozen_at.is_some() && self.thaw_at.is_none() {
                self.thaw_at = Some(now + grace);
            }
            self.last_ok = Some(now);
        } else {
            if self.frozen_at.is_none() {
                self.frozen_at = Some(self.last_ok.unwrap_or(now));
            }
            self.thaw_at = None;
        }
        if self.thaw_at.is_some_and(|t| now >= t) {
            self.frozen_at = None;
            self.thaw_at = None;
        }
    }

    /// The time to judge check-ins at.
    pub fn now(&self, now: i64) -> i64 {
        self.frozen_at.map_or(now, |f| f.min(now))
    }

    /// True while the clock is stopped.
    pub fn is_frozen(&self) -> bool {
        self.frozen_at.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_stops_the_clock_until_a_grace_period_after_recovery() {
        let mut clock = ReadinessClock::default();
        clock.observe(1000, true, 40);
        assert_eq!(clock.now(1000), 1000);
        clock.observe(1010, true, 40);
        // The backend goes away at 1020: check-ins are judged at 1010 from now on.
        clock.observe(1020, false, 40);
        assert!(clock.is_frozen());
        assert_eq!(clock.now(1020), 1010);
        clock.observe(1500, false, 40);
        assert_eq!(
            clock.now(1500),
            1010,
            "minutes later, still the last good moment"
        );
        // Back at 1600: frozen until 1640 while everybody checks in again.
        clock.observe(1600, true, 40);
        assert_eq!(clock.now(1620), 1010);
        clock.observe(1630, true, 40);
        assert_eq!(clock.now(1630), 1010);
        clock.observe(1640, true, 40);
        assert!(!clock.is_frozen());
        assert_eq!(clock.now(1640), 1640);
    }

    #[test]
    fn a_relapse_during_the_grace_period_keeps_the_clock_stopped() {
        let mut clock = ReadinessClock::default();
        clock.observe(100, true, 40);
        clock.observe(110, false, 40);
        clock.observe(200, true, 40);
        clock.observe(210, false, 40);
        clock.observe(260, true, 40);
        assert_eq!(clock.now(280), 100);
        clock.observe(300, true, 40);
        assert_eq!(clock.now(300), 300);
        // Never healthy at all: judged from the first observation.
        let mut fresh = ReadinessClock::default();
        fresh.observe(50, false, 40);
        assert_eq!(fresh.now(500), 50);
    }
}
