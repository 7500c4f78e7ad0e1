//! Endpoint candidates: every address a node can be reached at, published in
//! `kilotun.io/endpoints` beside Kilo's single `kilo.squat.ai/endpoint`, and, for each peer,
//! the candidate in use, chosen by handshake ([`EndpointProbes`]).
//!
//! A node publishes its forced endpoint first, then Kilo's detected one, then its other
//! addresses: public before private, IPv4 before IPv6 ([`local_candidates`]), those
//! `--advertise-endpoints` admits. A peer's list is cut to what `--accept-endpoints` admits,
//! what this host has an address family and a route outside the tunnel for, in the order
//! `--underlay-family` prefers ([`ProbeRules::usable`]); kg then uses one candidate at a time
//! and moves to the next while no handshake completes within the probe window. A candidate
//! that worked stays until it fails.

mod candidates;
mod probe;
#[cfg(test)]
mod tests;

pub use candidates::{
    encode_candidates, local_candidates, parse_candidates, EndpointFilter, FilterError,
    UnderlayFamily, MAX_CANDIDATES,
};
pub use probe::{
    CandidateLeft, EndpointMove, EndpointProbes, ProbeRules, ProbeState, ProbeStatus, Refusal,
    TrackedPeer, MAX_BACKOFF, SESSION_LIFETIME,
};
