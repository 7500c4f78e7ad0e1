//! Kubernetes Events ([`control::api_events`]): the reconciler decides which of the events it
//! recorded the API server gets, and when; the driver sends them.

use control::api_events::{ApiWrite, Poster};
use control::journal::Event;

use super::Reconciler;

impl Reconciler {
    /// The Event writes due for `events` (just taken at `now_ms`) and for series counts not yet
    /// written, and how many writes the budget left out meanwhile.
    pub fn api_writes(&mut self, events: &[Event], now_ms: i64) -> (Vec<ApiWrite>, u64) {
        let dropped_before = self.api_events.dropped();
        let poster = Poster {
            node: &self.config.hostname,
            reports_cluster: self.reports_cluster_events(),
        };
        let mut writes: Vec<ApiWrite> = events
            .iter()
            .filter_map(|e| self.api_events.admit(e, poster))
            .collect();
        writes.extend(self.api_events.due_repeats(now_ms));
        (writes, self.api_events.dropped() - dropped_before)
    }

    /// True when this node posts the events every agent records alike: it is the first ready
    /// node by name.
    pub fn reports_cluster_events(&self) -> bool {
        self.table
            .iter()
            .find(|(_, ready)| *ready)
            .is_some_and(|(node, _)| node.name == self.config.hostname)
    }
}
