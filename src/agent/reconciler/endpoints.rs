//! Endpoint candidates in the machine: which of each peer's published candidates the mesh
//! step configures ([`control::endpoints::EndpointProbes`]), the device readings that move a
//! peer to its next candidate, and the list this node publishes.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use control::clock::Now;
use control::endpoints::{local_candidates, ProbeStatus, TrackedPeer};
use control::ip::is_unusable;
use control::journal::Reason;
use control::node::Node;
use control::peer_status::PeerReading;
use control::{Key, Topology};

use super::Reconciler;
use crate::agent::host::local::{forced_endpoint, ForcedEndpoint};

impl Reconciler {
    /// Sets the candidate in use for every peer of `t` that publishes candidates (the mesh
    /// step, at `now`), saying each candidate refused once.
    pub(super) fn choose_endpoints(&mut self, t: &mut Topology, now: Now) {
        let tracked: Vec<TrackedPeer> = if t.leader {
            t.segments
                .iter()
                .filter(|s| !t.in_local_location(s) && !s.endpoint_candidates.is_empty())
                // A peer found behind NAT is sent to where its handshakes come from, whatever
                // it publishes: nothing to probe.
                .filter(|s| {
                    s.persistent_keepalive == 0
                        || !t.discovered_endpoints.contains_key(&s.public_key)
                })
                .map(|s| TrackedPeer {
                    node: s.members[s.leader].name.clone(),
                    key: s.public_key,
                    candidates: s.endpoint_candidates.clone(),
                })
                .collect()
        } else {
            Vec::new()
        };
        let kilo = self.kilo_index;
        let host = self.host.as_ref();
        if let Some(host) = host {
            let families = host.detected.families;
            self.endpoint_probes
                .set_families(families.ipv4, families.ipv6);
        }
        // A route of the host's own covers it (kg's routes into the WireGuard link do not
        // count: at scale they are thousands, the host's own a few); unknown before the host
        // is listed.
        let own: Option<Vec<ipnet::IpNet>> = host.map(|h| {
            h.net
                .main_routes
                .iter()
                .filter(|r| r.link != kilo)
                .map(|r| r.dst)
                .collect()
        });
        let outside_route = |ip: IpAddr| {
            own.as_ref()
                .is_none_or(|own| own.iter().any(|d| d.contains(&ip)))
        };
        let refused = self.endpoint_probes.track(&tracked, outside_route, now);
        let statuses = if refused.is_empty() {
            Vec::new()
        } else {
            self.endpoint_probes.statuses()
        };
        for r in refused {
            let none_left = statuses
                .iter()
                .any(|s| s.node == r.node && s.in_use.is_none());
            let fallback = if none_left {
                "; none of its candidates is usable, so kg sends to its kilo.squat.ai/endpoint"
            } else {
                ""
            };
            self.journal.record(
                Reason::EndpointRefused,
                r.node.clone(),
                format!(
                    "kg does not try {} for node {} (kilotun.io/endpoints): {}{fallback}",
                    r.endpoint, r.node, r.why
                ),
            );
        }
        t.chosen_endpoints = self.endpoint_probes.choices();
    }

    /// Takes the device's `readings` at `now`, read when [`super::Timer::Endpoints`] fired:
    /// moves each peer whose candidate failed to its next one. Returns how many moved; the
    /// next pass then gives the device their endpoints ([`control::pass::Trigger::Endpoints`]).
    pub fn endpoint_readings(&mut self, readings: &BTreeMap<Key, PeerReading>, now: Now) -> usize {
        let moves = self.endpoint_probes.observe(readings, now);
        for m in &moves {
            self.journal.record(
                Reason::EndpointCandidateLeft,
                m.node.clone(),
                format!(
                    "kg sends to node {} at {} now, no longer at {}: {}",
                    m.node, m.to, m.from, m.why
                ),
            );
        }
        self.endpoints_moved |= !moves.is_empty();
        moves.len()
    }

    /// Every peer's endpoint probing, for `/status`.
    pub fn endpoint_statuses(&self) -> Vec<ProbeStatus> {
        self.endpoint_probes.statuses()
    }

    /// Changes whenever [`Reconciler::endpoint_statuses`] would show something else.
    pub fn endpoint_statuses_revision(&self) -> u64 {
        self.endpoint_probes.revision()
    }

    /// The candidates this node publishes in `kilotun.io/endpoints` (`local` as this pass
    /// sees it, `annotations` its Node's): none while its endpoint is disabled
    /// (`force-endpoint: "-"`) or the host was never listed.
    pub(super) fn published_candidates(
        &self,
        local: &Node,
        annotations: &BTreeMap<String, String>,
    ) -> Vec<SocketAddr> {
        let Some(host) = &self.host else {
            return Vec::new();
        };
        let port = local.endpoint.as_ref().map_or(self.config.port, |e| e.port);
        let (forced, detected) = match forced_endpoint(annotations) {
            ForcedEndpoint::Disabled => return Vec::new(),
            ForcedEndpoint::Forced(e) => (e.addr(), None),
            ForcedEndpoint::Detect => (None, local.endpoint.as_ref().and_then(|e| e.addr())),
        };
        let exclude = &host.exclude;
        let addresses: Vec<IpAddr> = host
            .net
            .addresses
            .iter()
            .map(|(_, net)| net.addr())
            .filter(|ip| {
                !is_unusable(*ip)
                    && !exclude.addresses.contains(ip)
                    && !exclude.networks.iter().any(|n| n.contains(ip))
            })
            .collect();
        local_candidates(
            forced,
            detected,
            &addresses,
            port,
            &self.config.advertise_endpoints,
        )
    }
}
