//! The steps of a pass that write to the backend: the lease step and the local Node's
//! annotations, each returned as the write to send.

use control::clock::Now;
use control::leader::book::{LeaseWrite, TunnelReadings};
use control::node::WrittenAnnotations;

use super::{Reconciler, CHECK_IN_PERIOD};
use crate::agent::host::local::{self, AnnotationPatch};

impl Reconciler {
    /// True when the lease step runs this pass (on the lease timer, with leaders just
    /// elected): the shells then read the tunnels ([`TunnelReadings`]) for
    /// [`Reconciler::tend_lease`].
    pub fn lease_due(&self) -> bool {
        self.tends_lease()
    }

    /// The lease step at `now`, given what the tunnels say: the compare-and-swap that renews,
    /// takes or hands over this node's location's lease, if one is due.
    pub fn tend_lease(&mut self, readings: &TunnelReadings, now: Now) -> Option<LeaseWrite> {
        if !self.tends_lease() {
            return None;
        }
        let nodes = self.pass.as_ref()?.ready.as_ref()?;
        self.leases
            .tend(&self.s.hostname, nodes, readings, now.unix_ms)
    }

    /// The patch that makes the local Node's annotations say what this kg publishes at `now`
    /// (`check_in`: the check-in period elapsed, so `last-seen` is refreshed), if one is due.
    pub fn annotation_patch(&self, check_in: bool, now: Now) -> Option<AnnotationPatch> {
        let pass = self.pass.as_ref()?;
        let local = pass.local.as_ref()?;
        let empty = Default::default();
        let annotations = pass
            .local_object
            .as_ref()
            .and_then(|o| o.metadata.annotations.as_ref())
            .unwrap_or(&empty);
        let current_last_seen = annotations
            .get(control::node::annotation::LAST_SEEN)
            .and_then(|v| v.parse::<i64>().ok());
        let last_seen = local::last_seen_to_publish(
            current_last_seen,
            now.unix_secs(),
            check_in,
            CHECK_IN_PERIOD.as_secs() as i64,
        );
        let cni_compatibility_ip = match self.s.compatibility {
            control::routes::Compatibility::Cilium => {
                self.host.as_ref().and_then(|h| h.cilium_host_ip())
            }
            _ => None,
        };
        let written = WrittenAnnotations {
            endpoint: local.endpoint.clone(),
            internal_ip: local.internal_ip,
            key: self.public,
            last_seen,
            wireguard_ip: self
                .topology
                .as_ref()
                .filter(|t| t.leader)
                .map(|t| t.wireguard_cidr),
            discovered_endpoints: self.discovered.clone(),
            granularity: self.s.granularity,
            cni_compatibility_ip,
            second_internal_ip: local.second_internal_ip,
            leader_election: self.leases_on(),
            leaders_per_location: self.s.args.leaders_per_location,
            next_key: self.rotation.next.as_ref().map(|n| n.key),
            pq: self.pq_announcement,
            key_rotated: self
                .rotation
                .rotated_to_publish(
                    annotations
                        .get(control::node::annotation::KEY_ROTATED)
                        .map(String::as_str),
                )
                .map(str::to_string),
        };
        local::patch_due(annotations, &written, self.last_patch.as_ref())
    }

    /// The backend took `patch` (`ok`) or refused it: a refusal counts the backend as
    /// unhealthy until a patch is taken again.
    pub fn patched(&mut self, patch: AnnotationPatch, ok: bool) {
        self.patch_failed = !ok;
        if ok {
            let annotations = self
                .pass
                .as_ref()
                .and_then(|p| p.local_object.as_ref())
                .and_then(|o| o.metadata.annotations.clone())
                .unwrap_or_default();
            self.last_patch = Some(local::SentPatch::new(annotations, patch));
        }
    }
}
