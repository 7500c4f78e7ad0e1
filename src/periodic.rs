//! The timer every periodic loop of kg, `kgctl connect` and the device plugin runs on.

use std::time::Duration;

/// A timer that fires at once, then every `period` after the last tick was taken. A tick missed
/// while the loop was busy (a reconcile that ran long) is taken once, late, and the next one a
/// whole period after it: tokio's default would fire every missed tick back to back, so one slow
/// reconcile (seconds on a loaded or emulated machine) would be followed by a burst of resyncs
/// that nothing asked for.
pub(crate) fn periodic(period: Duration) -> tokio::time::Interval {
    let mut timer = tokio::time::interval(period);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    timer
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After a stall of three periods, one late tick comes at once and the next a whole period
    /// later, not three ticks back to back.
    #[tokio::test(start_paused = true)]
    async fn a_long_reconcile_is_followed_by_one_resync_not_a_burst() {
        let period = Duration::from_secs(2);
        let mut timer = periodic(period);
        timer.tick().await; // the first tick is immediate
        tokio::time::advance(period * 3 + Duration::from_millis(500)).await;
        let stalled = tokio::time::Instant::now();
        timer.tick().await;
        assert_eq!(
            tokio::time::Instant::now(),
            stalled,
            "the missed tick is taken at once"
        );
        timer.tick().await;
        assert_eq!(
            tokio::time::Instant::now() - stalled,
            period,
            "the next tick waits a whole period"
        );
    }
}
