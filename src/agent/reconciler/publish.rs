//! The step of a pass that publishes the local Node's annotations, returned as the patch to
//! send.

use control::clock::Now;
use control::node::WrittenAnnotations;

use k8s_openapi::api::core::v1::Node as KubeNode;

use super::pass::{Observed, Pass};
use super::{Reconciler, CHECK_IN_PERIOD};
use crate::agent::host::local::{self, AnnotationPatch};

impl Reconciler {
    /// The patch that makes the local Node's annotations say what this kg publishes at `now`
    /// in `pass`
    /// (`check_in`: the check-in period elapsed, so `last-seen` is refreshed), if one is due.
    pub(super) fn annotation_patch(
        &self,
        pass: &Pass,
        observed: &Observed,
        check_in: bool,
        now: Now,
    ) -> Option<AnnotationPatch> {
        let local = &observed.local;
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
        let cni_compatibility_ip = match self.config.compatibility {
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
            granularity: self.config.granularity,
            cni_compatibility_ip,
            second_internal_ip: local.second_internal_ip,
            leader_election: self.leases_on(),
            leaders_per_location: self.config.leaders_per_location,
            next_key: self.rotation.next.as_ref().map(|n| n.key),
            pq: self.pq_announcement(),
            endpoints: self.published_candidates(local, annotations),
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

    /// The backend took `patch` (`ok`) or refused it, sent against `local_object`: a refusal
    /// counts the backend as unhealthy until a patch is taken again.
    pub(super) fn patched(
        &mut self,
        patch: AnnotationPatch,
        ok: bool,
        local_object: Option<&KubeNode>,
    ) {
        self.patch_failed = !ok;
        if ok {
            let annotations = local_object
                .and_then(|o| o.metadata.annotations.clone())
                .unwrap_or_default();
            self.last_patch = Some(local::SentPatch::new(annotations, patch));
        }
    }
}
