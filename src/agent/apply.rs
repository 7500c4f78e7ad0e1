//! Applies a topology to the host: the link's MTU, address and state, the CNI configuration,
//! the tunnel, the routes and rules, then the WireGuard device, then the firewall. Each part is compared
//! as a value against what kg last applied (and, for routes, against the kernel state kg last
//! observed plus its own changes); only a part that differs is written. A full reconcile
//! (resync, kernel notification) compares against freshly listed state instead, so
//! anything changed behind kg's back comes back within one resync.

use std::net::IpAddr;
use std::time::Instant;

use anyhow::Result;
use control::iptables::{IptablesOptions, RuleSet};
use control::nat::discover_nat_endpoints;
use control::node::Node;
use control::routes::{
    apply_ops, diff, Encapsulate, Links, Route, RouteOptions, RoutePlan, Withheld,
};
use control::{Peer, Topology};
use dataplane::DeviceConfig;
use ipnet::IpNet;

use super::shells::{Engine, Firewall, Kernel};
use super::stages::Stage;
use super::{state, Agent};

/// What the tunnel was prepared for: the IPv4 pod CIDR, the private link's MTU, whether the
/// private IP is IPv6 (a larger outer header) and whether a node of the location has an IPv6
/// internal IP (the kernel's IPv6-outer link is needed).
type TunnelInputs = (IpNet, Option<u32>, bool, bool);

/// What the links and routes step leaves for the firewall and `/status`.
struct Routed {
    /// How traffic inside the location is encapsulated.
    encapsulate: Encapsulate,
    /// The tunnel link's index, if there is one.
    tunnel: Option<u32>,
    /// The CIDRs not routed because they cover a connected network.
    withheld: Vec<Withheld>,
}

/// What kg last applied to the host, part by part (`None`: unknown, apply it).
#[derive(Debug, Default)]
pub(super) struct Applied {
    wg: Option<DeviceConfig>,
    address: Option<Option<IpNet>>,
    cni: Option<(Vec<IpNet>, u32)>,
    /// The tunnel's inputs, the link it gave and the kernel's IPv6-outer link beside it.
    tunnel: Option<(TunnelInputs, Option<u32>, Option<u32>)>,
    /// The kernel's routes and rules as last observed, with kg's changes since.
    kernel_routes: Option<RoutePlan>,
    rules: Option<RuleSet>,
}

impl Applied {
    /// False when some part failed last time and must be applied again.
    pub(super) fn complete(&self) -> bool {
        self.kernel_routes.is_some() && self.rules.is_some()
    }
}

impl<N: Kernel, F: Firewall, W: Engine> Agent<N, F, W> {
    /// Brings the host to `t`. `nodes` and `peers` are the ready ones (for NAT discovery).
    ///
    /// The engine changes after the links and routes: a node taking over a location answers
    /// its new peers' first initiations (held by the engine for this moment) at once, and the
    /// answers must leave by the new routes, not by the old ones through the location's last
    /// leader, which sent them to a dead node and cost a 5 s handshake retry. It changes even
    /// when the links or routes failed, so a failing host step never keeps the node's peers
    /// from it; the failure is returned after.
    pub(super) async fn apply(
        &mut self,
        t: &Topology,
        nodes: &[Node],
        peers: &[Peer],
        full: bool,
    ) -> Result<()> {
        if full {
            self.memo.applied = Applied::default();
        }
        let started = Instant::now();
        let routed = self.apply_links_and_routes(t, nodes, peers, full).await;
        self.stages.lap(Stage::Routes, started);
        let started = Instant::now();
        self.apply_engine(t)?;
        self.stages.lap(Stage::Engine, started);
        let Routed {
            encapsulate,
            tunnel,
            withheld,
        } = routed?;
        let kilo = self.kilo_index;
        let started = Instant::now();
        let rules = t.iptables_rules(&IptablesOptions {
            cni: self.s.args.cni,
            forward_rules: self.s.args.iptables_forward_rules,
            service_cidrs: self.s.service_cidrs.clone(),
            ipip: self.tunnel.is_ipip() && self.s.args.local && encapsulate != Encapsulate::Never,
        });
        self.apply_rules(rules.clone()).await?;
        self.stages.lap(Stage::Firewall, started);
        let mtu = self
            .memo
            .host
            .as_ref()
            .and_then(|h| h.link(kilo))
            .map_or(0, |l| l.mtu);
        let owned = self.owned.clone();
        let tunnel_name = tunnel.and(self.tunnel.name().map(str::to_string));
        let withheld = withheld.iter().map(ToString::to_string).collect();
        self.status.update(|p| {
            p.node = self.s.hostname.clone();
            p.interface = self.s.args.interface.clone();
            p.granularity = self.s.granularity.as_str().to_string();
            p.topology = Some(std::sync::Arc::new(t.clone()));
            p.encapsulate = encapsulate;
            p.tunnel = tunnel_name;
            p.mtu = mtu;
            p.kilo_index = kilo;
            p.plan = owned;
            p.rules = Some(rules);
            p.withheld = withheld;
        });
        Ok(())
    }

    /// The link's MTU, address and state, the CNI configuration, the tunnel and the routes and
    /// rules, brought to `t`.
    async fn apply_links_and_routes(
        &mut self,
        t: &Topology,
        nodes: &[Node],
        peers: &[Peer],
        full: bool,
    ) -> Result<Routed> {
        let kilo = self.kilo_index;
        let host = self
            .memo
            .host
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("the host has not been listed"))?;
        let mtu = host.mtu(self.s.mtu);
        let link = host.links.iter_mut().find(|l| l.index == kilo);
        if let Some(link) = link.filter(|l| l.mtu != mtu) {
            self.netlink.set_mtu(kilo, mtu).await?;
            link.mtu = mtu;
        }
        let pod_cidrs: Vec<IpNet> = t.local_pod_cidrs().collect();
        let cni_applied = self
            .memo
            .applied
            .cni
            .as_ref()
            .is_some_and(|(cidrs, m)| *cidrs == pod_cidrs && *m == mtu);
        if self.s.args.cni && !cni_applied {
            self.sync_cni(&pod_cidrs, mtu);
            self.memo.applied.cni = Some((pod_cidrs, mtu));
        }
        self.metrics.set_leader(t.leader, &t.location);
        let address = t.leader.then_some(t.wireguard_cidr);
        if self.memo.applied.address != Some(address) {
            self.netlink.set_address(kilo, address).await?;
            self.memo.applied.address = Some(address);
        }
        let host = self.memo.host.as_mut().expect("listed above");
        match host.links.iter_mut().find(|l| l.index == kilo) {
            Some(link) if link.up == t.leader => {}
            link => {
                self.netlink.set_up(kilo, t.leader).await?;
                if let Some(link) = link {
                    link.up = t.leader;
                }
            }
        }

        if full {
            // Endpoints learnt from handshakes: a device that cannot be read leaves the last.
            match self.wg.device_peers() {
                Ok(device) => {
                    self.discovered =
                        discover_nat_endpoints(&device, nodes, peers, &self.discovered)
                }
                Err(e) => tracing::warn!(
                    error = format!("{e:#}"),
                    "reading the device's endpoints for NAT discovery failed"
                ),
            }
        }

        let host = self.memo.host.as_ref().expect("listed above");
        let private = host.private_link(t.private_ip);
        let private_mtu = host.link(private).filter(|_| private != 0).map(|l| l.mtu);
        let private_ipv6 = t.private_ip.is_some_and(|n| n.addr().is_ipv6());
        // The tunnel's address comes from the IPv4 pod CIDR (IPIP carries IPv4 only).
        let ipv4_pods = t
            .local_pod_cidrs()
            .find(|n| n.addr().is_ipv4())
            .unwrap_or(t.subnet);
        // A node of the location with an IPv6 internal IP: IPv4 to it goes in IPv6.
        let ipv6_members = t
            .local_segment()
            .is_some_and(|s| s.private_ips().any(|ip| ip.is_ipv6()));
        let inputs = (ipv4_pods, private_mtu, private_ipv6, ipv6_members);
        let (tunnel, tunnel6) = match self.memo.applied.tunnel {
            Some((applied, Some(index), six)) if applied == inputs => (Some(index), six),
            _ => {
                let index = self
                    .tunnel
                    .prepare(&self.netlink, ipv4_pods, private_mtu, private_ipv6)
                    .await?;
                let six = match index {
                    Some(_) => {
                        self.tunnel
                            .prepare_ipv6_outer(&self.netlink, ipv6_members, private, private_mtu)
                            .await?
                    }
                    None => None,
                };
                self.memo.applied.tunnel = Some((inputs, index, six));
                (index, six)
            }
        };
        let encapsulate = match (self.tunnel.name(), tunnel) {
            (Some(_), Some(_)) => self.s.encapsulate,
            (Some(name), None) => {
                let message = format!("the tunnel link {name} does not exist (yet); routing inside the location without encapsulation");
                self.warn_once("tunnel-missing", &message);
                Encapsulate::Never
            }
            (None, _) => Encapsulate::Never,
        };
        // An address the host holds in each of its own pod CIDRs (the CNI bridge's, or the
        // tunnel's).
        let addresses = &self.memo.host.as_ref().expect("listed above").addresses;
        let pod_sources: Vec<IpAddr> = t
            .local_pod_cidrs()
            .filter_map(|pods| {
                addresses
                    .iter()
                    .filter(|(i, _)| *i != kilo)
                    .map(|(_, n)| n.addr())
                    .find(|a| pods.contains(a))
            })
            .collect();
        let options = RouteOptions {
            kilo_name: self.s.args.interface.clone(),
            links: Links {
                kilo,
                private,
                tunnel: tunnel.unwrap_or(0),
                tunnel6: tunnel6.unwrap_or(0),
            },
            local: self.s.args.local,
            encapsulate,
            compatibility: self.s.compatibility,
            pod_sources,
            ipip_over_ipv6: tunnel.is_some() && self.tunnel.carries_ipv6_outer(),
        };
        let own: Vec<u32> = [Some(kilo), tunnel, tunnel6]
            .into_iter()
            .flatten()
            .collect();
        let connected = self
            .memo
            .host
            .as_ref()
            .expect("listed above")
            .connected_networks(&own);
        let (mut plan, withheld) = t.guarded_route_plan(&options, &connected);
        self.report_withheld(&withheld);
        // The host's own routes: what the kernel has in main, less kg's.
        let kgs: std::collections::BTreeSet<(u32, IpNet, u32)> = self
            .owned
            .routes
            .iter()
            .map(|o| (o.table, o.dst, o.link))
            .collect();
        let underlay: Vec<Route> = self
            .memo
            .host
            .as_ref()
            .expect("listed above")
            .main_routes
            .iter()
            .filter(|r| !own.contains(&r.link) && !kgs.contains(&(r.table, r.dst, r.link)))
            .cloned()
            .collect();
        let bypasses = t.bypass_endpoints(&mut plan, kilo, &underlay);
        let lines = bypasses
            .iter()
            .filter(|b| !b.standby)
            .map(ToString::to_string)
            .collect();
        for line in self.problems.fresh_lines("endpoint bypasses", lines) {
            tracing::warn!("{line}");
        }
        let lines = plan.no_gateway.iter().map(ToString::to_string).collect();
        for line in self.problems.fresh_lines("routes without a gateway", lines) {
            tracing::warn!("{line}");
        }
        if let Some(index) = tunnel {
            self.tunnel.update(&plan, index, t);
        }
        self.apply_routes(plan).await?;
        Ok(Routed {
            encapsulate,
            tunnel,
            withheld,
        })
    }

    /// The WireGuard device's configuration, brought to `t`.
    fn apply_engine(&mut self, t: &Topology) -> Result<()> {
        let conf = if t.leader {
            t.conf(Some(&self.public))
        } else {
            t.standby_conf(Some(&self.public))
        };
        let desired = crate::wiring::device_config(&conf, &self.key);
        if self.memo.applied.wg.as_ref() != Some(&desired) {
            // The first configuration of this process's engine handshakes at once, restored
            // peers or not (a node whose last agent was Kilo has nothing to restore).
            let changed = if self.memo.engine_configured {
                self.wg.apply(&desired)?
            } else {
                let changed = self.wg.apply_and_handshake(&desired)?;
                self.memo.engine_configured = true;
                changed
            };
            if changed {
                tracing::info!(
                    leader = t.leader,
                    peers = desired.peers.len(),
                    "WireGuard configuration applied"
                );
                if let Err(e) = state::save(&self.s.args.key_file, &desired) {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        "saving the WireGuard state failed"
                    );
                }
            }
            self.memo.applied.wg = Some(desired);
        }
        Ok(())
    }

    /// Says once, at warning level, which CIDRs are not routed on this node because they
    /// contain or equal one of its connected networks, and counts them in
    /// `kilotun_withheld_cidrs`; `/graph` marks them.
    fn report_withheld(&mut self, withheld: &[Withheld]) {
        self.metrics.withheld_cidrs.set(withheld.len() as i64);
        // The graph already holds this topology (set when it changed): only its marks change.
        if let Some(graph) = self.graph.lock().as_mut() {
            graph.withheld = std::sync::Arc::new(withheld.to_vec());
        }
        let lines = withheld.iter().map(ToString::to_string).collect();
        for line in self.problems.fresh_lines("withheld routes", lines) {
            tracing::warn!("{line}");
        }
    }

    /// Takes the kernel's routes and rules to `plan`, listing them only when kg does not know
    /// them (after a full reconcile's reset, or a failed change).
    async fn apply_routes(&mut self, plan: RoutePlan) -> Result<()> {
        if self.memo.applied.kernel_routes.is_some() && plan == self.owned {
            return Ok(());
        }
        let observed = match self.memo.applied.kernel_routes.take() {
            Some(known) => known,
            None => self.netlink.observe().await?,
        };
        let ops = diff(&plan, &observed, &self.owned, self.kilo_index);
        if !ops.is_empty() {
            tracing::debug!(changes = ops.len(), "reconciling routes");
        }
        let errors = self.netlink.apply(&ops).await;
        for e in &errors {
            self.status.error(format!("route change failed: {e:#}"));
            tracing::warn!(error = format!("{e:#}"), "route change failed");
        }
        if errors.is_empty() {
            self.memo.applied.kernel_routes = Some(apply_ops(&observed, &ops));
        }
        if plan != self.owned {
            if let Err(e) = state::save_routes(&self.s.args.key_file, &plan) {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "saving the routes kg installed failed"
                );
            }
        }
        self.owned = plan;
        Ok(())
    }

    /// Takes iptables to `rules` unless they are the rules last applied.
    async fn apply_rules(&mut self, rules: RuleSet) -> Result<()> {
        if self.memo.applied.rules.as_ref() == Some(&rules) {
            return Ok(());
        }
        let v6 = self.ip6tables;
        let firewall = self.firewall.clone();
        let wanted = rules.clone();
        // What was applied last: the firewall writes only the difference (none on a resync,
        // which cleared it: then the host's rules are read and compared).
        let previous = self.memo.applied.rules.take();
        let reconciled =
            tokio::task::spawn_blocking(move || firewall.reconcile(&wanted, previous.as_ref(), v6));
        match reconciled.await? {
            Ok(changed) => {
                if changed {
                    tracing::debug!("firewall rules reconciled");
                }
                self.memo.applied.rules = Some(rules);
            }
            Err(e) => {
                self.metrics.error("apply");
                self.status
                    .error(format!("applying iptables rules failed: {e:#}"));
                tracing::warn!(error = format!("{e:#}"), "applying iptables rules failed");
            }
        }
        Ok(())
    }
}

/// The CNI configuration kg keeps in step with the node (Kilo's `--cni`).
impl<N: Kernel, F: Firewall, W: Engine> Agent<N, F, W> {
    /// Keeps the CNI conflist's IPAM ranges on the pod CIDRs (one set per family) and its MTU
    /// on the link's. A missing or unreadable file is a warning, never a failure.
    pub(super) fn sync_cni(&mut self, pod_cidrs: &[IpNet], mtu: u32) {
        let path = self.s.args.cni_path.clone();
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) => {
                self.warn_once(
                    "cni",
                    &format!(
                        "cannot read the CNI configuration {}: {e}; not managing it",
                        path.display()
                    ),
                );
                return;
            }
        };
        match control::cni::update_conflist(&text, pod_cidrs, Some(mtu)) {
            Ok(None) => {}
            Ok(Some(updated)) => match super::shells::write_file(&path, &updated, 0o644) {
                Ok(()) => {
                    tracing::info!(path = %path.display(), pod_cidrs = ?pod_cidrs, mtu, "CNI configuration updated")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = format!("{e:#}"), "writing the CNI configuration failed")
                }
            },
            Err(e) => self.warn_once(
                "cni",
                &format!("CNI configuration {}: {e}; not managing it", path.display()),
            ),
        }
    }
}
