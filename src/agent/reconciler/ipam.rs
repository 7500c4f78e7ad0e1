//! The nodes' pod ranges from the IPAM source `--ipam` names ([`control::ipam`]): taken into
//! the node table whenever the IPAM objects change, so everything that follows a node's pod
//! ranges follows them.

use control::ipam::{detect, kilo_agents_under, pod_ranges, IpamObjects, IpamSource};
use control::journal::Reason;

use super::Reconciler;

/// What the reconciler remembers of the IPAM objects.
#[derive(Debug, Default)]
pub(super) struct IpamState {
    /// The revision of the objects the node table's ranges were last taken from.
    seen: Option<u64>,
    /// The source they were read as (`--ipam=auto` decides it from the objects).
    source: Option<IpamSource>,
}

impl Reconciler {
    /// The IPAM source in use: `--ipam`'s, or what `auto` chose last (`None` before it did).
    pub fn ipam_source(&self) -> Option<IpamSource> {
        self.config.ipam.or(self.ipam.source)
    }

    /// Brings the node table's pod ranges to `objects` (at `revision`; `listed` once the
    /// backend listed every IPAM kind it watches) when they changed since the last call (with `--ipam=node`, the Nodes keep their own and nothing is
    /// read). Problems (ranges refused for overlapping) are said once each.
    pub(super) fn take_ipam(&mut self, objects: &IpamObjects, revision: u64, listed: bool) {
        let choice = self.config.ipam;
        // `auto` decides once every kind it looks for was listed, not on the first to arrive.
        let undecided = choice.is_none() && !listed;
        if choice == Some(IpamSource::Node) || undecided || self.ipam.seen == Some(revision) {
            return;
        }
        self.ipam.seen = Some(revision);
        let source = match choice {
            Some(source) => source,
            None => {
                let (source, why) = detect(objects);
                if self.ipam.source != Some(source) {
                    let line = format!("--ipam=auto: pod ranges from {} ({why})", source.as_str());
                    self.journal
                        .record(Reason::IpamSource, source.as_str(), line);
                }
                source
            }
        };
        self.ipam.source = Some(source);
        let ranges = pod_ranges(source, objects);
        let problems = ranges
            .as_ref()
            .map(|r| r.problems.clone())
            .unwrap_or_default();
        for line in self.problems.fresh_lines("ipam", problems) {
            self.journal.record(Reason::IpamProblem, "ipam", line);
        }
        self.table.set_pod_ranges(ranges.map(|r| r.by_node));
    }

    /// Names once each node run by Kilo's kg (an `IpamProblem` event whose subject is the
    /// node) while the pods' ranges come from elsewhere than
    /// the Nodes (only when this kg elects by lease: then kilotun's agents say so, and the
    /// others are Kilo's).
    pub(super) fn say_which_agents_route_node_cidrs(&mut self, nodes: &[control::Node]) {
        let Some(source) = self.ipam_source() else {
            return;
        };
        if !self.leases_on() {
            return;
        }
        let named = kilo_agents_under(source, nodes);
        let lines = named.iter().map(|(_, line)| line.clone()).collect();
        let fresh = self.problems.fresh_lines("ipam kilo agents", lines);
        for (node, line) in named.into_iter().filter(|(_, l)| fresh.contains(l)) {
            self.journal.record(Reason::IpamProblem, node, line);
        }
    }
}
