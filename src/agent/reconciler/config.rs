//! What the reconciler decides with: its own values, taken once from kg's parsed flags
//! ([`crate::agent::args::Settings::reconciler_config`]), so no flag type reaches a decision.

use std::time::Duration;

use control::ipam::IpamSource;
use control::node::Granularity;
use control::routes::{Compatibility, Encapsulate};
use ipnet::IpNet;

use crate::agent::host::Mtu;

/// The reconciler's configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The local node's name.
    pub hostname: String,
    /// The WireGuard link's name.
    pub interface: String,
    /// How the mesh is cut into segments (`--mesh-granularity`).
    pub granularity: Granularity,
    /// When traffic inside a location is encapsulated (`--encapsulate`).
    pub encapsulate: Encapsulate,
    /// The CNI kg works beside (`--compatibility`).
    pub compatibility: Compatibility,
    /// The WireGuard subnet (`--subnet`).
    pub subnet: IpNet,
    /// The cluster's service ranges (`--service-cidr`).
    pub service_cidrs: Vec<IpNet>,
    /// How often everything is listed and compared again (`--resync-period`).
    pub resync: Duration,
    /// The WireGuard link's MTU (`--mtu`).
    pub mtu: Mtu,
    /// How often the key rotates by itself (`None`: only on request).
    pub key_rotation: Option<Duration>,
    /// The WireGuard port announced when the node's endpoint names none (`--port`).
    pub port: u16,
    /// Leaders per location (`--leaders-per-location`).
    pub leaders_per_location: u16,
    /// Private addresses before public ones for the endpoint
    /// (`--prioritise-private-addresses`).
    pub prioritise_private_addresses: bool,
    /// True when this kg takes and renews its location's lease.
    pub elects_by_lease: bool,
    /// The label that names a node's location (`--topology-label`).
    pub topology_label: String,
    /// Where the pod ranges come from (`--ipam`; `None`: decided from the objects found).
    pub ipam: Option<IpamSource>,
    /// True when kg keeps the CNI configuration's ranges on the pod CIDRs (`--cni`).
    pub cni: bool,
    /// True when kg routes inside the location (`--local`).
    pub local: bool,
    /// True when kg writes FORWARD rules for the pods (`--iptables-forward-rules`).
    pub forward_rules: bool,
    /// Which local addresses go into `kilotun.io/endpoints` (`--advertise-endpoints`).
    pub advertise_endpoints: control::endpoints::EndpointFilter,
    /// How a peer's candidates are picked (`--endpoint-probe-window`, `--accept-endpoints`,
    /// `--underlay-family`; the host's families are set when it is listed).
    pub probe_rules: control::endpoints::ProbeRules,
    /// How WireGuard's packets are kept out of the tunnel (`--tunnel-guard`): the device's
    /// mark and the guard's rules, or a host route per covered endpoint.
    pub tunnel_guard: control::routes::TunnelGuard,
}
