//! Which of the agent's events become Kubernetes Events (`events.k8s.io/v1`), and when: the
//! pure half of posting them. The driver sends the writes this decides ([`ApiWrite`]).
//!
//! Three rules keep a large cluster's API server from paying for what every agent sees alike:
//! - **Who posts.** An event about this node's own state or decisions is posted by this node
//!   only, regarding its Node. An event every agent records alike (a bad Peer, a range the
//!   topology dropped, the way leaders are chosen) is posted by one agent: the first ready node
//!   by name ([`Poster::reports_cluster`]). A bad annotation on another node is left to that
//!   node's own agent.
//! - **Repeats are a series.** The same reason, subject and message again within
//!   [`SERIES_WINDOW_MS`] of the last time adds to the first Event's `series.count` instead of
//!   posting another, written at most every [`SERIES_WRITE_MS`].
//! - **A budget.** Each agent holds [`BURST`] writes and earns one back every [`REFILL_MS`] (as
//!   client-go's event recorder does per source and object); a write beyond it is dropped and
//!   counted ([`ApiEventBook::dropped`]).

use std::collections::BTreeMap;

use crate::journal::{Event, EventKind, Reason};

/// Writes an agent may make at once.
pub const BURST: u32 = 25;
/// One write more is allowed every 5 minutes once the burst is spent.
pub const REFILL_MS: i64 = 300_000;
/// An identical event within 10 minutes of the last is counted in the first one's series.
pub const SERIES_WINDOW_MS: i64 = 600_000;
/// A series' count is written at most every 30 seconds.
pub const SERIES_WRITE_MS: i64 = 30_000;
/// The API server's limit on an Event's `note`, in bytes.
pub const NOTE_LIMIT: usize = 1024;
/// The Events' `reportingController`.
pub const REPORTING_CONTROLLER: &str = "kilotun.io/kg";

/// The object an Event is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Regarding {
    /// A Node (`v1`).
    Node(String),
    /// A Peer (`kilo.squat.ai/v1alpha1`).
    Peer(String),
}

/// A new Event to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiEvent {
    /// Its name: the reporting node, then the time and sequence in hexadecimal, unique across
    /// the agent's restarts.
    pub name: String,
    /// What it is about.
    pub regarding: Regarding,
    /// The journal's reason, as the Event's `reason`.
    pub reason: Reason,
    /// `Normal` or `Warning`.
    pub kind: EventKind,
    /// What the agent was doing: the Event's `action`.
    pub action: &'static str,
    /// The message, with the subject when the object does not name it, cut to [`NOTE_LIMIT`].
    pub note: String,
    /// When it happened (Unix milliseconds): the Event's `eventTime`.
    pub at_unix_ms: i64,
}

/// One write to the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiWrite {
    /// Create an Event.
    Create(ApiEvent),
    /// Set the series of the Event `name`: seen `count` times, the last at `last_unix_ms`.
    Repeat {
        /// The Event's name.
        name: String,
        /// Occurrences so far, the first included (2 or more).
        count: u32,
        /// When the last occurred.
        last_unix_ms: i64,
    },
}

/// Who the agent is, for the rule of who posts.
#[derive(Debug, Clone, Copy)]
pub struct Poster<'a> {
    /// This node's name.
    pub node: &'a str,
    /// True when this node posts the events every agent records alike: it is the first ready
    /// node by name.
    pub reports_cluster: bool,
}

/// Who posts an event of each reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// This node's own state or decision: posted by this node, regarding its Node.
    ThisNode,
    /// About the node its subject names: posted by that node's own agent.
    SubjectNode,
    /// Recorded alike by every agent: posted by the cluster's reporter.
    Cluster,
    /// Not posted: said while the API server cannot be written, or only of this agent's log.
    NotPosted,
}

fn scope(reason: Reason) -> Scope {
    match reason {
        Reason::BadAnnotation => Scope::SubjectNode,
        Reason::BadPeer
        | Reason::RangeDropped
        | Reason::NoEndpoint
        | Reason::LeadersByLease
        | Reason::LeadersByKiloRule
        | Reason::EndpointResolved => Scope::Cluster,
        Reason::BackendUnreachable | Reason::BackendReachable => Scope::NotPosted,
        _ => Scope::ThisNode,
    }
}

/// The Event's `action`: what the agent was doing when it recorded `reason`.
pub fn action(reason: Reason) -> &'static str {
    match reason {
        Reason::LeaderElected
        | Reason::LeaderReplacedCutOff
        | Reason::LeaderHandedOver
        | Reason::LeaderReleased
        | Reason::LeaderCutOff
        | Reason::LeaderCutOffUnconfirmed
        | Reason::LeaderReconnected
        | Reason::LeaderSharesLimited
        | Reason::LeadersByLease
        | Reason::LeadersByKiloRule => "Elect",
        Reason::KeyRotation => "RotateKey",
        Reason::EndpointResolved | Reason::EndpointLookupFailed => "Resolve",
        Reason::ConditionRefused => "WriteCondition",
        Reason::PeerStatusRefused => "WriteStatus",
        Reason::PeersRestored
        | Reason::PeersNotRestored
        | Reason::HandshakesStarted
        | Reason::TookOver => "Start",
        Reason::Replaced | Reason::Removed => "Stop",
        _ => "Reconcile",
    }
}

/// An event's series: the Event first posted for it and the occurrences since.
#[derive(Debug, Clone)]
struct Series {
    name: String,
    count: u32,
    last_ms: i64,
    written_count: u32,
    written_ms: i64,
}

/// The Events posted and the budget left.
#[derive(Debug)]
pub struct ApiEventBook {
    tokens: u32,
    /// When the last token was earned back (`None`: the budget is whole).
    refilled_ms: Option<i64>,
    series: BTreeMap<(Reason, String, String), Series>,
    dropped: u64,
}

impl Default for ApiEventBook {
    fn default() -> Self {
        Self {
            tokens: BURST,
            refilled_ms: None,
            series: BTreeMap::new(),
            dropped: 0,
        }
    }
}

impl ApiEventBook {
    /// The write `event` asks for, if any, as posted by `poster`.
    pub fn admit(&mut self, event: &Event, poster: Poster<'_>) -> Option<ApiWrite> {
        let now = event.at_unix_ms;
        self.forget_old(now);
        let regarding = match scope(event.reason) {
            Scope::ThisNode => Regarding::Node(poster.node.to_string()),
            Scope::SubjectNode if event.subject == poster.node => {
                Regarding::Node(poster.node.to_string())
            }
            Scope::Cluster if poster.reports_cluster => match event.reason {
                Reason::BadPeer => Regarding::Peer(event.subject.clone()),
                _ => Regarding::Node(poster.node.to_string()),
            },
            Scope::SubjectNode | Scope::Cluster | Scope::NotPosted => return None,
        };
        let key = (event.reason, event.subject.clone(), event.message.clone());
        if let Some(series) = self.series.get_mut(&key) {
            series.count += 1;
            series.last_ms = now;
            return self.repeat_due(&key, now);
        }
        if !self.take_token(now) {
            return None;
        }
        let name = format!(
            "{}.{:x}{:04x}",
            poster.node,
            now.max(0),
            event.sequence & 0xffff
        );
        self.series.insert(
            key,
            Series {
                name: name.clone(),
                count: 1,
                last_ms: now,
                written_count: 1,
                written_ms: now,
            },
        );
        Some(ApiWrite::Create(ApiEvent {
            name,
            note: note(event, &regarding),
            regarding,
            reason: event.reason,
            kind: event.kind,
            action: action(event.reason),
            at_unix_ms: now,
        }))
    }

    /// The series counts due for a write at `now`: those with occurrences not yet written and
    /// no write for [`SERIES_WRITE_MS`].
    pub fn due_repeats(&mut self, now: i64) -> Vec<ApiWrite> {
        self.forget_old(now);
        let keys: Vec<_> = self
            .series
            .iter()
            .filter(|(_, s)| s.count > s.written_count && now - s.written_ms >= SERIES_WRITE_MS)
            .map(|(k, _)| k.clone())
            .collect();
        keys.into_iter()
            .filter_map(|k| self.repeat_due(&k, now))
            .collect()
    }

    /// Writes dropped by the budget so far.
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    fn repeat_due(&mut self, key: &(Reason, String, String), now: i64) -> Option<ApiWrite> {
        let series = self.series.get(key)?;
        if now - series.written_ms < SERIES_WRITE_MS || series.count == series.written_count {
            return None;
        }
        if !self.take_token(now) {
            return None;
        }
        let series = self.series.get_mut(key)?;
        series.written_count = series.count;
        series.written_ms = now;
        Some(ApiWrite::Repeat {
            name: series.name.clone(),
            count: series.count,
            last_unix_ms: series.last_ms,
        })
    }

    fn take_token(&mut self, now: i64) -> bool {
        if let Some(since) = self.refilled_ms {
            let earned = (now - since).max(0) / REFILL_MS;
            if earned > 0 {
                self.tokens = BURST.min(self.tokens + earned.min(i64::from(BURST)) as u32);
                self.refilled_ms = (self.tokens < BURST).then_some(since + earned * REFILL_MS);
            }
        }
        if self.tokens == 0 {
            self.dropped += 1;
            return false;
        }
        self.tokens -= 1;
        if self.refilled_ms.is_none() {
            self.refilled_ms = Some(now);
        }
        true
    }

    fn forget_old(&mut self, now: i64) {
        self.series
            .retain(|_, s| now - s.last_ms < SERIES_WINDOW_MS || s.count > s.written_count);
    }
}

/// The Event's note: the message, led by the subject when the object does not name it, cut at
/// a character boundary within [`NOTE_LIMIT`].
fn note(event: &Event, regarding: &Regarding) -> String {
    let named = match regarding {
        Regarding::Node(name) | Regarding::Peer(name) => name == &event.subject,
    };
    let mut text = if named || event.subject.is_empty() || event.message.contains(&event.subject) {
        event.message.clone()
    } else {
        format!("{}: {}", event.subject, event.message)
    };
    if text.len() > NOTE_LIMIT {
        let mut end = NOTE_LIMIT - 3;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("...");
    }
    text
}

#[cfg(test)]
#[path = "api_events_tests.rs"]
mod tests;
