//! What the shells wrote to the host, part by part, and the last route dump: what
//! [`super`] compares the desired state with, so only a part that differs is written.

use control::desired::{self, CniState, ResolvedLinks, TunnelSpec};
use control::routes::{Route, RoutePlan};
use control::wgconf::Conf;
use dataplane::DeviceConfig;
use ipnet::IpNet;

use crate::agent::shells::kernel_watch::RoutingChanges;
use crate::agent::Trigger;

/// What kg last applied to the host, part by part (`None`: unknown, apply it). A full pass
/// forgets it, so every part is compared with the host as listed.
#[derive(Debug, Default)]
pub(super) struct Applied {
    pub(super) device: Option<DeviceConfig>,
    /// The device as planned when it was last applied, and whether this node led then.
    pub(super) conf: Option<(Conf, bool)>,
    /// The WireGuard link's MTU and state as kg last set them.
    pub(super) link_mtu: Option<u32>,
    pub(super) link_up: Option<bool>,
    pub(super) address: Option<Option<IpNet>>,
    pub(super) cni: Option<CniState>,
    /// What the tunnel was prepared for, and the links that gave.
    pub(super) tunnel: Option<(TunnelSpec, ResolvedLinks)>,
    /// The kernel's routes and rules as last observed, with kg's changes since.
    pub(super) kernel_routes: Option<RoutePlan>,
}

/// What the shells wrote to the host and what its links resolved to.
#[derive(Debug, Default)]
pub(in crate::agent) struct HostRecord {
    pub(super) applied: Applied,
    /// The links the netlink shell last resolved the host state's roles to.
    pub(super) resolved: ResolvedLinks,
    /// True once the engine was first configured (and asked to handshake with every peer).
    pub(super) engine_configured: bool,
    /// The kernel's notifications of routing changes (`None`: none are watched, and every
    /// listing of the host dumps the routes).
    pub(in crate::agent) routing: Option<RoutingChanges>,
    /// The last route dump: the notification count before it, and the host's own main-table
    /// routes it found (kg's left out, as kg's routes then were).
    pub(super) last_dump: Option<(u64, Vec<Route>)>,
    /// True when this pass kept the last dump: kg's record of the kernel's routes holds.
    pub(super) dump_kept: bool,
}

impl HostRecord {
    /// Forgets everything applied and dumped: the device and its link are new (started again
    /// after a loss), so every part is applied afresh. The routing watch stays.
    pub(super) fn forget_applied(&mut self) {
        self.applied = Applied::default();
        self.resolved = ResolvedLinks::default();
        self.engine_configured = false;
        self.last_dump = None;
        self.dump_kept = false;
    }

    /// The device configuration kg last applied, if known.
    pub(in crate::agent) fn applied_device(&self) -> Option<&DeviceConfig> {
        self.applied.device.as_ref()
    }

    /// Records `device` as applied (a change made outside a pass: post-quantum keys).
    pub(in crate::agent) fn set_applied_device(&mut self, device: DeviceConfig) {
        self.applied.device = Some(device);
    }

    /// True when the kernel's routes and rules are known (false after a failed change, when
    /// they must be listed again).
    pub(in crate::agent) fn routes_known(&self) -> bool {
        self.applied.kernel_routes.is_some()
    }

    /// The host's own main-table routes of the last dump, when a pass listing the host after
    /// `trigger` may keep it instead of dumping again ([`control::pass::dumps_routes`]). A
    /// route of kg's since (`owned`) replaced any of the host's with its table and destination
    /// (the kernel says nothing of a route a replace evicts), so those are left out.
    pub(in crate::agent) fn kept_dump(
        &mut self,
        trigger: Trigger,
        owned: &RoutePlan,
    ) -> Option<Vec<Route>> {
        let seen = self.routing.as_ref().and_then(RoutingChanges::seen);
        let last = self.last_dump.as_ref();
        let holds = last.is_some() && self.routes_known();
        let quiet = seen.is_some() && seen == last.map(|(count, _)| *count);
        self.dump_kept = !control::pass::dumps_routes(trigger, holds, quiet);
        if !self.dump_kept {
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
