//! What the driver keeps of what it wrote and listed: the device's configuration as last sent
//! (it holds the keys, which stay on the driver's side) and the last route dump, which a pass
//! listing the host may keep instead of dumping again.

use control::desired;
use control::routes::{Route, RoutePlan};
use dataplane::DeviceConfig;

use crate::agent::shells::kernel_watch::RoutingChanges;
use crate::agent::Trigger;

/// The device as last configured and the last route dump.
#[derive(Debug, Default)]
pub(in crate::agent) struct HostRecord {
    /// The device's configuration as kg last sent it (`None`: unknown, send it).
    pub(in crate::agent) device: Option<DeviceConfig>,
    /// The kernel's notifications of routing changes (`None`: none are watched, and every
    /// listing of the host dumps the routes).
    pub(in crate::agent) routing: Option<RoutingChanges>,
    /// The last route dump: the notification count before it, and the host's own main-table
    /// routes it found (kg's left out, as kg's routes then were).
    last_dump: Option<(u64, Vec<Route>)>,
}

impl HostRecord {
    /// Forgets what was written and dumped: the device and its link are new (started again
    /// after a loss). The routing watch stays.
    pub(in crate::agent) fn forget_written(&mut self) {
        self.device = None;
        self.last_dump = None;
    }

    /// The host's own main-table routes of the last dump, when a pass listing the host after
    /// `trigger` may keep it instead of dumping again ([`control::pass::dumps_routes`]; only
    /// while kg's record of the kernel's routes holds, `routes_known`). A
    /// route of kg's since (`owned`) replaced any of the host's with its table and destination
    /// (the kernel says nothing of a route a replace evicts), so those are left out.
    pub(in crate::agent) fn kept_dump(
        &self,
        trigger: Trigger,
        owned: &RoutePlan,
        routes_known: bool,
    ) -> Option<Vec<Route>> {
        let seen = self.routing.as_ref().and_then(RoutingChanges::seen);
        let last = self.last_dump.as_ref();
        let holds = last.is_some() && routes_known;
        let quiet = seen.is_some() && seen == last.map(|(count, _)| *count);
        if control::pass::dumps_routes(trigger, holds, quiet) {
            return None;
        }
        let replaced: std::collections::BTreeSet<_> =
            owned.routes.iter().map(|r| (r.table, r.dst)).collect();
        last.map(|(_, routes)| {
            routes
                .iter()
                .filter(|r| !replaced.contains(&(r.table, r.dst)))
                .cloned()
                .collect()
        })
    }

    /// The count to record a dump under, read before the dump: a change during it counts
    /// as unseen.
    pub(in crate::agent) fn count_before_dump(&self) -> Option<u64> {
        self.routing.as_ref().and_then(RoutingChanges::seen)
    }

    /// Records a dump taken at notification count `count` that found `main_routes`, with
    /// `owned` kg's routes at the time.
    pub(in crate::agent) fn dumped(
        &mut self,
        count: Option<u64>,
        main_routes: &[Route],
        owned: &RoutePlan,
    ) {
        self.last_dump = count.map(|count| {
            let host = desired::host_routes(main_routes, owned).cloned().collect();
            (count, host)
        });
    }
}
