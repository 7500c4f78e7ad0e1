//! What the lease step asks the agent's shell to write, and why.

use super::super::{Expectation, LeaseState};
use crate::journal::Reason;

/// A lease write the step wants: `next` over the lease `name`, if the backend still holds
/// what `expected` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseWrite {
    /// The lease.
    pub name: String,
    /// Its new state.
    pub next: LeaseState,
    /// The compare of the compare-and-swap.
    pub expected: Expectation,
    /// Why, when worth saying (a change of hands or of the cut-off mark); `None` for a
    /// renewal.
    pub why: Option<LeaseWhy>,
}

impl LeaseWrite {
    /// The reason of the event this write records, if it records one.
    pub fn reason(&self) -> Option<Reason> {
        self.why.as_ref().map(|w| w.reason)
    }
}

/// Why a lease write changes hands or marks: the event's reason and a sentence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseWhy {
    /// The event this write records once it holds.
    pub reason: Reason,
    /// For people.
    pub message: String,
}

impl LeaseWhy {
    pub(super) fn new(reason: Reason, message: String) -> Self {
        Self { reason, message }
    }
}
