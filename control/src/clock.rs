//! The moment an input is handled, as a value. The core never reads a clock: the agent's event
//! loop reads it once per input (and a model test moves it by hand) and passes it down.

use std::time::{Duration, Instant};

/// One moment on the two clocks kg's decisions use: the monotonic one, for timers and DNS
/// re-resolution, and the wall clock, for what nodes publish and compare with each other
/// (`last-seen`, lease renewals).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Now {
    /// The monotonic clock.
    pub instant: Instant,
    /// The wall clock, in milliseconds since the Unix epoch.
    pub unix_ms: i64,
}

impl Now {
    /// Whole seconds since the Unix epoch (the unit of Kilo's `last-seen`).
    pub fn unix_secs(self) -> i64 {
        self.unix_ms.div_euclid(1000)
    }

    /// The moment `elapsed` after this one, on both clocks.
    pub fn after(self, elapsed: Duration) -> Self {
        Self {
            instant: self.instant + elapsed,
            unix_ms: self.unix_ms + elapsed.as_millis() as i64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_clocks_move_together_and_seconds_round_down() {
        let start = Now {
            instant: Instant::now(),
            unix_ms: 1_700_000_000_999,
        };
        assert_eq!(start.unix_secs(), 1_700_000_000);
        let later = start.after(Duration::from_millis(1_500));
        assert_eq!(later.unix_ms, 1_700_000_002_499);
        assert_eq!(later.unix_secs(), 1_700_000_002);
        assert_eq!(later.instant - start.instant, Duration::from_millis(1_500));
    }
}
