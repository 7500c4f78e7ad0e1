//! The DNS re-resolution schedule for endpoints given as names (DDNS), as a pure state
//! machine: the agent asks what is due, resolves it, and records the answer.
//!
//! Unlike Kilo, Peer names are re-resolved like node names, every refresh period; a failed lookup
//! keeps the last good address and is retried sooner, with backoff.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::ip::{Endpoint, Host};

/// The first retry after a failed lookup; doubled per failure, capped at the refresh period.
pub const FIRST_RETRY: Duration = Duration::from_secs(1);

/// How long a lookup [`DnsBook::start`]ed may go unanswered before it is due again (the
/// answer was lost): longer than any lookup's timeout.
pub const ANSWER_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
struct Entry {
    addr: Option<IpAddr>,
    next_at: Instant,
    failures: u32,
}

/// What recording an answer changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The first address, or a different one.
    Changed {
        /// The previous address, if any.
        old: Option<IpAddr>,
        /// The new address.
        new: IpAddr,
    },
    /// The same address as before.
    Unchanged,
    /// The lookup failed; the last good address (if any) stays in use.
    Failed {
        /// The address still in use.
        kept: Option<IpAddr>,
    },
    /// The name is no longer tracked.
    Untracked,
}

/// Names to resolve, their last good addresses and when each is due.
#[derive(Debug, Clone)]
pub struct DnsBook {
    refresh: Duration,
    entries: BTreeMap<String, Entry>,
}

impl DnsBook {
    /// A book that re-resolves every name each `refresh` (kg uses `--resync-period`).
    pub fn new(refresh: Duration) -> Self {
        Self {
            refresh,
            entries: BTreeMap::new(),
        }
    }

    /// Tracks exactly `names`: new ones are due at once, names no longer used are forgotten.
    pub fn track<'a>(&mut self, names: impl IntoIterator<Item = &'a str>, now: Instant) {
        let wanted: BTreeMap<&str, ()> = names.into_iter().map(|n| (n, ())).collect();
        self.entries
            .retain(|name, _| wanted.contains_key(name.as_str()));
        for name in wanted.keys() {
            self.entries.entry((*name).to_string()).or_insert(Entry {
                addr: None,
                next_at: now,
                failures: 0,
            });
        }
    }

    /// Names whose lookup is due at `now`.
    pub fn due(&self, now: Instant) -> Vec<String> {
        self.entries
            .iter()
            .filter(|(_, e)| e.next_at <= now)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Names whose lookup is due at `now`, each marked as asked: it is not due again until
    /// its answer is [`DnsBook::record`]ed, or [`ANSWER_GRACE`] passed without one. The
    /// lookups run off the reconcile, which goes on with the last good addresses.
    pub fn start(&mut self, now: Instant) -> Vec<String> {
        self.entries
            .iter_mut()
            .filter(|(_, e)| e.next_at <= now)
            .map(|(n, e)| {
                e.next_at = now + ANSWER_GRACE;
                n.clone()
            })
            .collect()
    }

    /// The earliest time a lookup is due.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.entries.values().map(|e| e.next_at).min()
    }

    /// Records the outcome of a lookup of `name` made at `now`.
    pub fn record(&mut self, name: &str, result: Result<IpAddr, String>, now: Instant) -> Answer {
        let refresh = self.refresh;
        let Some(entry) = self.entries.get_mut(name) else {
            return Answer::Untracked;
        };
        match result {
            Ok(addr) => {
                entry.failures = 0;
                entry.next_at = now + refresh;
                let old = entry.addr.replace(addr);
                if old == Some(addr) {
                    Answer::Unchanged
                } else {
                    Answer::Changed { old, new: addr }
                }
            }
            Err(_) => {
                let backoff = FIRST_RETRY.saturating_mul(1 << entry.failures.min(16));
                entry.failures += 1;
                entry.next_at = now + backoff.min(refresh);
                Answer::Failed { kept: entry.addr }
            }
        }
    }

    /// The last good address of `name`.
    pub fn addr(&self, name: &str) -> Option<IpAddr> {
        self.entries.get(name).and_then(|e| e.addr)
    }

    /// Fills a DNS endpoint's resolution from the book (literal endpoints are left alone).
    pub fn fill(&self, endpoint: &mut Endpoint) {
        if let Host::Dns { name, resolved } = &mut endpoint.host {
            *resolved = self.addr(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn a_started_lookup_is_not_due_again_until_answered_or_lost() {
        let t0 = Instant::now();
        let mut book = DnsBook::new(Duration::from_secs(30));
        book.track(["a.mesh.test", "b.mesh.test"], t0);
        assert_eq!(book.start(t0), ["a.mesh.test", "b.mesh.test"]);
        assert!(book.start(t0).is_empty(), "both asked already");
        assert!(book.due(t0 + Duration::from_secs(5)).is_empty());
        book.record(
            "a.mesh.test",
            Ok(ip("10.0.0.1")),
            t0 + Duration::from_secs(1),
        );
        assert_eq!(
            book.next_deadline(),
            Some(t0 + Duration::from_secs(30)),
            "a: the refresh after its answer; b: the grace"
        );
        assert_eq!(
            book.start(t0 + ANSWER_GRACE),
            ["b.mesh.test"],
            "b's answer was lost"
        );
        assert_eq!(book.start(t0 + Duration::from_secs(31)), ["a.mesh.test"]);
    }

    #[test]
    fn new_names_are_due_at_once_and_then_every_refresh() {
        let t0 = Instant::now();
        let mut book = DnsBook::new(Duration::from_secs(30));
        book.track(["b.mesh.test"], t0);
        assert_eq!(book.due(t0), ["b.mesh.test"]);
        assert_eq!(
            book.record("b.mesh.test", Ok(ip("10.0.0.2")), t0),
            Answer::Changed {
                old: None,
                new: ip("10.0.0.2")
            }
        );
        assert!(book.due(t0 + Duration::from_secs(29)).is_empty());
        assert_eq!(book.due(t0 + Duration::from_secs(30)).len(), 1);
        assert_eq!(
            book.record("b.mesh.test", Ok(ip("10.0.0.2")), t0),
            Answer::Unchanged
        );
        assert_eq!(
            book.record("b.mesh.test", Ok(ip("10.0.0.3")), t0),
            Answer::Changed {
                old: Some(ip("10.0.0.2")),
                new: ip("10.0.0.3")
            }
        );
    }

    #[test]
    fn failures_keep_the_last_good_address_and_back_off() {
        let t0 = Instant::now();
        let mut book = DnsBook::new(Duration::from_secs(30));
        book.track(["n"], t0);
        book.record("n", Ok(ip("1.1.1.1")), t0);
        let t1 = t0 + Duration::from_secs(30);
        assert_eq!(
            book.record("n", Err("timeout".into()), t1),
            Answer::Failed {
                kept: Some(ip("1.1.1.1"))
            }
        );
        assert_eq!(book.next_deadline(), Some(t1 + Duration::from_secs(1)));
        book.record("n", Err("timeout".into()), t1);
        assert_eq!(book.next_deadline(), Some(t1 + Duration::from_secs(2)));
        for _ in 0..10 {
            book.record("n", Err("timeout".into()), t1);
        }
        assert_eq!(
            book.next_deadline(),
            Some(t1 + Duration::from_secs(30)),
            "capped at the refresh"
        );
        let mut e = Endpoint::parse("n:51820").unwrap();
        book.fill(&mut e);
        assert_eq!(e.addr(), Some("1.1.1.1:51820".parse().unwrap()));
    }

    #[test]
    fn names_no_longer_used_are_forgotten() {
        let t0 = Instant::now();
        let mut book = DnsBook::new(Duration::from_secs(30));
        book.track(["a", "b"], t0);
        book.track(["b"], t0);
        assert_eq!(book.due(t0), ["b"]);
        assert_eq!(book.record("a", Ok(ip("1.1.1.1")), t0), Answer::Untracked);
    }
}
