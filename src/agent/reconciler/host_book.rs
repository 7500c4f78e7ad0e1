//! What kg knows of the host it converges ([`HostBook`]: what it applied to each part, the
//! links it resolved, the routes it holds), and the converge step's decisions about one part
//! at a time: which part of the link differs, what kg holds after a route change, what the
//! host was converged to.

use std::sync::Arc;

use control::desired::{CniState, DesiredHost, ResolvedLinks, TunnelKind, TunnelSpec};
use control::journal::Reason;
use control::routes::{apply_ops, RouteOp, RoutePlan};
use control::wgconf::Conf;
use ipnet::IpNet;

use super::converge::HostProgress;
use super::host_effects::{DeviceOutcome, HostEffect, HostReport, LinkWrite};
use super::mesh::Convergence;
use super::Reconciler;

/// What kg last applied to the host, part by part (`None`: unknown, apply it). A full pass
/// forgets it, so every part is compared with the host as listed.
#[derive(Debug, Default)]
pub(super) struct Applied {
    /// The device's plan when it was last configured, and whether this node led then.
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

/// What kg knows of the host it converges: what it applied, the links it resolved, the
/// routes it holds.
#[derive(Debug, Default)]
pub(super) struct HostBook {
    pub(super) applied: Applied,
    /// The links the tunnel's preparation last resolved the plan's roles to.
    pub(super) resolved: ResolvedLinks,
    /// True once the device was first configured (and asked to handshake with every peer).
    pub(super) engine_configured: bool,
    /// The routes and rules kg installed (saved beside the key, so a restart claims them).
    pub(super) owned: RoutePlan,
    /// The encapsulation link kg uses, if any.
    pub(super) tunnel_kind: Option<TunnelKind>,
}

impl HostBook {
    /// Forgets everything applied: the device and its link are new (started again after a
    /// loss), so every part is applied afresh.
    pub(super) fn forget_applied(&mut self) {
        self.applied = Applied::default();
        self.resolved = ResolvedLinks::default();
        self.engine_configured = false;
    }
}

impl Reconciler {
    /// The device took its configuration: its first one, and what it said, journaled.
    pub(super) fn device_configured(&mut self, outcome: DeviceOutcome) {
        let interface = self.config.interface.clone();
        if let Some(started) = outcome.handshakes_started {
            self.journal
                .record(Reason::HandshakesStarted, interface.clone(), started);
        }
        if let Some(answer) = outcome.edit_refused {
            self.journal.record(
                Reason::AllowedIpEditRefused,
                interface,
                format!("{answer}: replacing changed peers' allowed IPs whole from now on"),
            );
        }
        self.host_book.engine_configured = true;
    }

    /// The links the plan names by role, as last resolved, with the WireGuard link's index.
    pub(super) fn links(&self) -> ResolvedLinks {
        ResolvedLinks {
            kilo: self.kilo_index,
            ..self.host_book.resolved
        }
    }

    /// The WireGuard link as listed: its MTU and whether it is up.
    pub(super) fn listed_link(&self) -> Option<(u32, bool)> {
        let host = self.host.as_ref()?;
        host.net.link(self.kilo_index).map(|l| (l.mtu, l.up))
    }

    /// The next part of the link that differs from `want`, in the order MTU, address, state,
    /// after the part `after` written this pass (each part is set at most once a pass): the
    /// MTU and state compared with what kg set or, not knowing, with the host as listed; the
    /// address with what kg set.
    pub(super) fn link_write(
        &self,
        want: &DesiredHost,
        after: Option<LinkWrite>,
    ) -> Option<LinkWrite> {
        let want = want.link;
        let listed = self.listed_link();
        let applied = &self.host_book.applied;
        let rank = |part: LinkWrite| match part {
            LinkWrite::Mtu(_) => 0,
            LinkWrite::Address(_) => 1,
            LinkWrite::Up(_) => 2,
        };
        let next = after.map_or(0, |part| rank(part) + 1);
        let mtu = applied.link_mtu.or(listed.map(|(mtu, _)| mtu));
        if next <= 0 && mtu.is_some_and(|mtu| mtu != want.mtu) {
            return Some(LinkWrite::Mtu(want.mtu));
        }
        if next <= 1 && applied.address != Some(want.address) {
            return Some(LinkWrite::Address(want.address));
        }
        let up = applied.link_up.or(listed.map(|(_, up)| up));
        (next <= 2 && up != Some(want.up)).then_some(LinkWrite::Up(want.up))
    }

    /// Records `part` as set on the link. Its state is recorded only for a link that was
    /// listed: one that was not is set again by the next pass.
    pub(super) fn link_written(&mut self, part: LinkWrite) {
        let listed = self.listed_link().is_some();
        let applied = &mut self.host_book.applied;
        match part {
            LinkWrite::Mtu(mtu) => applied.link_mtu = Some(mtu),
            LinkWrite::Address(address) => applied.address = Some(address),
            LinkWrite::Up(up) if listed => applied.link_up = Some(up),
            LinkWrite::Up(_) => {}
        }
    }

    /// The route changes `ops` made to `observed` came back with `errors`: what kg holds is
    /// the plan `want`, and after a failed change also every route and rule it held before
    /// (one it could not remove stays its own, for the next pass or the next kg to remove).
    /// Asks for the new holdings to be saved when they changed.
    pub(super) fn routes_changed(
        &mut self,
        want: &DesiredHost,
        observed: &RoutePlan,
        ops: &[RouteOp],
        errors: &[anyhow::Error],
    ) -> HostProgress {
        for e in errors {
            self.errors.push(format!("route change failed: {e:#}"));
            tracing::warn!(error = format!("{e:#}"), "route change failed");
        }
        let book = &mut self.host_book;
        let mut held = want.routes.clone();
        if errors.is_empty() {
            book.applied.kernel_routes = Some(apply_ops(observed, ops));
        } else {
            held.routes.extend(book.owned.routes.iter().cloned());
            held.rules.extend(book.owned.rules.iter().cloned());
        }
        if held == book.owned {
            return HostProgress::Moved;
        }
        book.owned = held.clone();
        HostProgress::Effect(HostEffect::SaveRoutes(held))
    }

    /// What the host was converged to, for `/status`.
    pub(super) fn host_report(&self, c: &Convergence, want: &DesiredHost) -> HostReport {
        let book = &self.host_book;
        let listed_mtu = self.listed_link().map_or(0, |(mtu, _)| mtu);
        HostReport {
            topology: Arc::clone(&c.topology),
            encapsulate: want.encapsulate,
            tunnel: book.resolved.tunnel.is_some() && book.tunnel_kind.is_some(),
            mtu: book.applied.link_mtu.unwrap_or(listed_mtu),
            kilo_index: self.kilo_index,
            plan: book.owned.clone(),
            rules: want.firewall.clone(),
            withheld: want.withheld.clone(),
        }
    }

    /// Records, for `reason`, each (subject, message) of `items` not recorded the last time
    /// `object` was reported.
    pub(super) fn record_fresh(
        &mut self,
        object: &str,
        reason: Reason,
        items: Vec<(String, String)>,
    ) {
        let lines = items.iter().map(|(_, line)| line.clone()).collect();
        for line in self.problems.fresh_lines(object, lines) {
            let subject = items
                .iter()
                .find(|(_, l)| *l == line)
                .map(|(subject, _)| subject.clone())
                .unwrap_or_default();
            self.journal.record(reason, subject, line);
        }
    }

    /// True when the kernel's routes and rules are known (false after a failed change, when
    /// they must be listed again).
    pub fn routes_known(&self) -> bool {
        self.host_book.applied.kernel_routes.is_some()
    }

    /// The routes and rules kg holds.
    pub fn owned_routes(&self) -> &RoutePlan {
        &self.host_book.owned
    }

    /// Takes `owned` as the routes kg holds (the last run's, saved beside the key), `kind` as
    /// the encapsulation link kg uses and `kilo_index` as the WireGuard link.
    pub fn start_host(&mut self, owned: RoutePlan, kind: Option<TunnelKind>, kilo_index: u32) {
        self.host_book.owned = owned;
        self.host_book.tunnel_kind = kind;
        self.kilo_index = kilo_index;
    }
}
