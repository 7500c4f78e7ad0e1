//! The converge step's effects and answers: what it asks the shells to do to the host, one
//! call at a time ([`HostEffect`]), and what they answer ([`HostAnswer`]).

use std::sync::Arc;

use control::desired::{CniState, ResolvedLinks, TunnelSpec};
use control::iptables::RuleSet;
use control::nat::DevicePeer;
use control::routes::{Encapsulate, RouteOp, RoutePlan, Withheld};
use control::wgconf::Conf;
use control::Topology;
use ipnet::IpNet;

use super::mesh::Convergence;

/// What the converge step needs done outside the reconciler. Those marked "answer" wait for
/// the [`HostAnswer`] of the same name before the step goes on.
#[derive(Debug)]
pub enum HostEffect {
    /// The host is converged to this topology from now on: for the driver's views (`/graph`,
    /// the leader metric) and, on a full pass, to forget what it wrote to the device.
    Converging(Convergence),
    /// Read the device's peers for the endpoints their handshakes came from (NAT discovery).
    /// Answer: [`HostAnswer::Endpoints`].
    ReadEndpoints,
    /// Configure the device. Answer: [`HostAnswer::Device`].
    ConfigureDevice(DeviceWrite),
    /// Set one part of the WireGuard link. Answer: [`HostAnswer::Link`].
    SetLink(LinkWrite),
    /// Write the CNI configuration.
    WriteCni(CniState),
    /// Prepare the tunnel for this spec. Answer: [`HostAnswer::Tunnel`].
    PrepareTunnel(TunnelSpec),
    /// The plan, once the links are resolved.
    PlanResolved(Box<ResolvedPlan>),
    /// List the kernel's routes and rules. Answer: [`HostAnswer::ObservedRoutes`].
    ObserveRoutes,
    /// Make these route and rule changes. Answer: [`HostAnswer::ChangedRoutes`].
    ChangeRoutes(Vec<RouteOp>),
    /// Save these as the routes and rules kg holds (beside the key, for the next kg).
    SaveRoutes(RoutePlan),
    /// Write the firewall's rules. Answer: [`HostAnswer::Firewall`].
    WriteFirewall(Box<FirewallWrite>),
    /// The host was converged to this.
    Converged(Box<HostReport>),
}

/// The firewall's rules to write ([`HostEffect::WriteFirewall`]).
#[derive(Debug)]
pub struct FirewallWrite {
    /// The rules to write.
    pub rules: RuleSet,
    /// The rules last written (`None`: unknown, read the host's).
    pub previous: Option<RuleSet>,
}

/// One part of the WireGuard link to set ([`HostEffect::SetLink`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkWrite {
    /// Its MTU.
    Mtu(u32),
    /// Its address (`None`: none).
    Address(Option<IpNet>),
    /// Up or down.
    Up(bool),
}

/// The device's configuration to apply ([`HostEffect::ConfigureDevice`]): the plan and the
/// post-quantum preshared keys, which the driver completes with the private key.
#[derive(Debug, Clone)]
pub struct DeviceWrite {
    /// The peers and interface as planned.
    pub conf: Conf,
    /// True when this node leads its location.
    pub leader: bool,
    /// True for the first configuration of this engine: it handshakes with every peer at once.
    pub first: bool,
    /// The post-quantum preshared keys, by peer (a Peer's own preshared key stays where
    /// none is given).
    pub psks: std::collections::BTreeMap<control::Key, dataplane::SecretKey>,
    /// Peers moved to another endpoint candidate: the device starts a handshake with each at
    /// once, so the new candidate is tried without waiting for the device's retry timer.
    pub handshake: Vec<control::Key>,
    /// The mark the device's socket carries (`--tunnel-guard=mark`; 0: none).
    pub fwmark: u32,
}

/// What configuring the device found, for the journal ([`HostAnswer::Device`]).
#[derive(Debug, Default)]
pub struct DeviceOutcome {
    /// The handshakes the first configuration started, said.
    pub handshakes_started: Option<String>,
    /// The device's answer when it refused an `allowed_ip=-` removal (kg replaces changed
    /// peers' allowed IPs whole from then on).
    pub edit_refused: Option<String>,
}

/// What became of a firewall write ([`HostAnswer::Firewall`]).
#[derive(Debug)]
pub enum FirewallOutcome {
    /// The rules are on the host.
    Written,
    /// The write failed (said): the next one reads the host's rules first.
    Failed(String),
    /// The firewall's back end is not chosen yet (or choosing it stopped kg): nothing written.
    NotReady,
}

/// The plan once the tunnel's links are known ([`HostEffect::PlanResolved`]): what the driver's
/// views of it show, and where the userspace tunnel sends.
#[derive(Debug, Clone)]
pub struct ResolvedPlan {
    /// The topology planned for.
    pub topology: Arc<Topology>,
    /// The CIDRs not routed because they cover a connected network.
    pub withheld: Vec<Withheld>,
    /// The routes, and the tunnel's link when it exists (the userspace tunnel's table).
    pub tunnel_routes: Option<(RoutePlan, u32)>,
}

/// What the host was converged to ([`HostEffect::Converged`]), for `/status`.
#[derive(Debug, Clone)]
pub struct HostReport {
    /// The topology applied.
    pub topology: Arc<Topology>,
    /// How traffic inside the location is encapsulated.
    pub encapsulate: Encapsulate,
    /// True when the tunnel's link exists and is used.
    pub tunnel: bool,
    /// The WireGuard link's MTU.
    pub mtu: u32,
    /// The WireGuard link.
    pub kilo_index: u32,
    /// The routes and rules kg holds.
    pub plan: RoutePlan,
    /// The firewall's rules.
    pub rules: RuleSet,
    /// The CIDRs not routed because they cover a connected network.
    pub withheld: Vec<Withheld>,
}

/// A shell's answer to one of the converge step's effects ([`HostEffect`]).
#[derive(Debug)]
pub enum HostAnswer {
    /// The device's peers, or why they could not be read.
    Endpoints(anyhow::Result<Vec<DevicePeer>>),
    /// The link's part was set, or why not.
    Link(anyhow::Result<()>),
    /// The links the tunnel resolves to, or why it could not be prepared.
    Tunnel(anyhow::Result<ResolvedLinks>),
    /// The kernel's routes and rules, or why they could not be listed.
    ObservedRoutes(anyhow::Result<RoutePlan>),
    /// The changes that failed (none: all were made).
    ChangedRoutes(Vec<anyhow::Error>),
    /// What configuring the device found, or why it failed.
    Device(anyhow::Result<DeviceOutcome>),
    /// What became of the firewall write.
    Firewall(FirewallOutcome),
}
