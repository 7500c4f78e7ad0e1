//! How soon a failed Kubernetes watch is retried.
//!
//! The delay doubles from half a second to a ceiling of ten seconds, and each delay is cut by a
//! random amount of up to half, so a cluster's nodes do not retry in step when the API server
//! comes back. Kubernetes' own clients (client-go's reflector, kube-runtime's default) go up to
//! 30 s and, with their jitter, to a minute. kg keeps the ceiling at ten seconds, so it sees
//! changes again within seconds of an API outage ending. A retry against an API server that is
//! down costs it one refused request.

use std::time::Duration;

/// The first retry's delay (before jitter).
pub const FIRST_DELAY: Duration = Duration::from_millis(500);
/// The longest delay (before jitter).
pub const CEILING: Duration = Duration::from_secs(10);

/// Delays between watch retries: see the module documentation. A success resets it.
#[derive(Debug, Clone)]
pub struct WatchBackoff {
    /// Failures since the last success.
    failures: u32,
    /// xorshift64 state for the jitter (never zero).
    state: u64,
}

impl WatchBackoff {
    /// A backoff whose jitter comes from `seed` (any value; zero is replaced).
    pub fn new(seed: u64) -> Self {
        Self {
            failures: 0,
            state: seed.max(1),
        }
    }

    /// A backoff with a random seed (std's per-process random hasher keys: plenty for jitter).
    pub fn random() -> Self {
        use std::hash::{BuildHasher, Hasher};
        Self::new(
            std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish(),
        )
    }

    /// The delay before jitter after `failures` failures in a row.
    fn base(failures: u32) -> Duration {
        FIRST_DELAY
            .saturating_mul(1u32 << failures.min(16))
            .min(CEILING)
    }

    /// A factor in [0.5, 1.0).
    fn jitter(&mut self) -> f64 {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        0.5 + (self.state >> 11) as f64 / (1u64 << 53) as f64 / 2.0
    }
}

impl Iterator for WatchBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let base = Self::base(self.failures);
        self.failures = self.failures.saturating_add(1);
        Some(base.mul_f64(self.jitter()))
    }
}

impl kube::runtime::utils::Backoff for WatchBackoff {
    fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::runtime::utils::Backoff;

    #[test]
    fn delays_double_to_the_ceiling_each_cut_by_at_most_half() {
        let mut backoff = WatchBackoff::new(42);
        let delays: Vec<Duration> = backoff.by_ref().take(12).collect();
        for (i, delay) in delays.iter().enumerate() {
            let base = (FIRST_DELAY * (1 << i.min(5))).min(CEILING);
            assert!(
                *delay >= base / 2 && *delay < base,
                "retry {i}: {delay:?} outside [{:?}, {base:?})",
                base / 2
            );
        }
        assert!(delays[8..].iter().all(|d| *d >= CEILING / 2));
    }

    #[test]
    fn a_success_starts_over_from_the_first_delay() {
        let mut backoff = WatchBackoff::new(7);
        for _ in 0..10 {
            backoff.next();
        }
        backoff.reset();
        let first = backoff.next().unwrap();
        assert!(first < FIRST_DELAY, "{first:?}");
    }

    #[test]
    fn nodes_with_different_seeds_spread_their_retries() {
        let at_ceiling = |seed| WatchBackoff::new(seed).nth(10).unwrap();
        let delays: std::collections::BTreeSet<_> = (1..=20).map(at_ceiling).collect();
        assert!(delays.len() >= 15, "{delays:?}");
        let spread = *delays.last().unwrap() - *delays.first().unwrap();
        assert!(spread >= Duration::from_secs(2), "{delays:?}");
    }

    #[test]
    fn a_thousand_failures_neither_overflow_nor_pass_the_ceiling() {
        let mut backoff = WatchBackoff::new(0);
        assert!(backoff.by_ref().take(1000).all(|d| d < CEILING));
    }
}
