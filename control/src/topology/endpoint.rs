//! Which endpoint kg sends a target's handshakes to.

use super::Topology;
use crate::ip::Endpoint;
use crate::key::Key;

impl Topology {
    /// The endpoint to use for a target: its discovered endpoint when the target's
    /// keepalive is non-zero and one is known, else the candidate kg's probing chose, else
    /// its configured endpoint.
    pub fn effective_endpoint(
        &self,
        endpoint: Option<&Endpoint>,
        key: &Key,
        keepalive: u16,
    ) -> Option<Endpoint> {
        if keepalive > 0 {
            if let Some(addr) = self.discovered_endpoints.get(key) {
                return Some(Endpoint::from_addr(*addr));
            }
        }
        if let Some(addr) = self.chosen_endpoints.get(key) {
            return Some(Endpoint::from_addr(*addr));
        }
        endpoint.cloned()
    }
}
