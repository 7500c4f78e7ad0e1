//! `kg`'s command line: every flag of Kilo's `kg` with the same name and default, plus
//! `--backend=file`, `--cluster-dir` and `--key-file`.

pub use super::host::encap::IpipChoice;
use super::host::Mtu;
pub use super::shells::wireguard::WireGuardChoice;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{ArgAction, Parser};
use control::node::{Granularity, DEFAULT_TOPOLOGY_LABEL};
use control::routes::{Compatibility, Encapsulate};
use ipnet::IpNet;

/// Where the cluster's Nodes and Peers come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackendKind {
    /// The Kubernetes API (Kilo's only backend).
    Kubernetes,
    /// A directory of Node and Peer objects in YAML or JSON, for running without Kubernetes.
    File,
}

/// kg: the Kilo agent with an embedded userspace WireGuard engine.
#[derive(Debug, Clone, Parser)]
#[command(name = "kg", version = crate::VERSION, about, args_override_self = true)]
pub struct KgArgs {
    /// The backend for the mesh.
    #[arg(long, value_enum, default_value = "kubernetes")]
    pub backend: BackendKind,
    /// With --backend=file: the directory holding Node and Peer objects.
    #[arg(long, default_value = "")]
    pub cluster_dir: String,
    /// Should Kilo clean up routes and annotations when it shuts down?
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub clean_up: bool,
    /// kilotun: when kg stops while its DaemonSet remains (a rollout, a restart), leave the
    /// node's annotations, routes, rules, iptables and link to the kg that replaces it, so
    /// traffic through this node pauses only while no engine runs; `--clean-up` and
    /// `--clean-up-interface` then apply when kilotun is uninstalled. (A node taken out of the
    /// DaemonSet's node selector keeps them too; and a leader whose next kg is slow to start
    /// is failed over by lease after 6 s, by Kilo's rule only after 60 s.)
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub keep_on_replace: bool,
    /// Should Kilo delete its interface when it shuts down?
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub clean_up_interface: bool,
    /// Should Kilo manage the node's CNI configuration?
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub cni: bool,
    /// Path to CNI config.
    #[arg(long, default_value = "/etc/cni/net.d/10-kilo.conflist")]
    pub cni_path: PathBuf,
    /// Should Kilo run in compatibility mode? Possible values: flannel, cilium.
    #[arg(long, default_value = "")]
    pub compatibility: String,
    /// Should kg create the interface (with the embedded engine)? With false, kg drives an existing
    /// userspace device (kilotun or wireguard-go) over its UAPI socket.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub create_interface: bool,
    /// kilotun: which WireGuard kg creates the interface with: embedded (the engine inside kg),
    /// kernel (the kernel's WireGuard module) or auto (the kernel's where it has one, the
    /// embedded engine elsewhere).
    #[arg(long, value_enum, default_value = "embedded")]
    pub wireguard: WireGuardChoice,
    /// kilotun: which IPIP kg encapsulates with inside a location: auto (the kernel's tunl0
    /// where the kernel has IPIP, kilotun's userspace IPIP elsewhere), kernel or userspace
    /// (for a host whose tunl0 another agent owns). A location may mix both kinds.
    #[arg(long, value_enum, default_value = "auto")]
    pub ipip: IpipChoice,
    /// When should Kilo encapsulate packets within a location? Possible values: never, crosssubnet, always.
    #[arg(long, default_value = "always")]
    pub encapsulate: String,
    /// Hostname of the node on which this process is running.
    #[arg(long, default_value = "")]
    pub hostname: String,
    /// Name of the Kilo interface to use; if it does not exist, it will be created.
    #[arg(long, default_value = control::DEFAULT_INTERFACE)]
    pub interface: String,
    /// Restrict private-IP auto-detection to these CIDRs, IPv4 or IPv6 (repeatable); only
    /// IPv6 prefixes make a dual-stack node detect an IPv6 internal IP.
    #[arg(long = "internal-cidr")]
    pub internal_cidrs: Vec<String>,
    /// Add FORWARD ACCEPT rules for pod CIDRs.
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub iptables_forward_rules: bool,
    /// Which iptables back end to write to: auto (the one the host's rules are already in), legacy or nft.
    #[arg(long, value_enum, default_value = "auto")]
    pub iptables_backend: super::shells::xtables::BackendMode,
    /// Where Kilo's rules go: auto (the nftables table `inet kilo`, whose address lists are
    /// sets, where the host's rules are in nf_tables and the kernel takes it; iptables where
    /// they are in legacy iptables, with --iptables-forward-rules, or when nftables fails),
    /// nftables or iptables.
    #[arg(long, value_enum, default_value = "auto")]
    pub firewall: super::shells::firewall::FirewallChoice,
    /// How each location's leader is chosen: kilo (Kilo's rule: annotated, then public, then
    /// first by name; a dead leader is replaced once its last-seen is 60 s old) or lease (a
    /// lease per location, renewed by its healthy holder: failover in seconds).
    #[arg(long, value_enum, default_value = "kilo")]
    pub leader_election: LeaderElection,
    /// Active leaders per location (location granularity), each carrying a share of the
    /// location's nodes; 1 is Kilo's single leader. More take effect once every node runs with
    /// at least as many (published as kilotun.io/leader-shares): a node that publishes fewer,
    /// Kilo's kg among them, holds the cluster at its number, and one running an earlier
    /// kilotun (which published kilotun.io/leaders-per-location) at 1.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub leaders_per_location: u16,
    /// Path to kubeconfig.
    #[arg(long, default_value = "")]
    pub kubeconfig: String,
    /// The address at which to listen for health and metrics.
    #[arg(long, default_value = ":1107")]
    pub listen: String,
    /// Should Kilo manage routes within a location?
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub local: bool,
    /// Log level to use. Possible values: all, debug, info, warn, error, none.
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// The address of the Kubernetes API server (overrides any value in kubeconfig).
    #[arg(long, default_value = "")]
    pub master: String,
    /// The granularity of the network mesh to create. Possible values: location, full, cross.
    #[arg(long, default_value = "location")]
    pub mesh_granularity: String,
    /// The MTU of the WireGuard interface: a number, or auto (default-route MTU − 80).
    #[arg(long, default_value = "auto")]
    pub mtu: String,
    /// The port over which WireGuard peers should communicate.
    #[arg(long, default_value_t = control::DEFAULT_PORT)]
    pub port: u16,
    /// Use the private IP as the endpoint instead of the public one.
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub prioritise_private_addresses: bool,
    /// How often should the Kilo controllers reconcile?
    #[arg(long, default_value = "30s")]
    pub resync_period: String,
    /// Service CIDRs that peers' traffic must not be masqueraded to (repeatable).
    #[arg(long = "service-cidr")]
    pub service_cidrs: Vec<String>,
    /// CIDR from which to allocate addresses for WireGuard interfaces.
    #[arg(long, default_value = control::DEFAULT_SUBNET)]
    pub subnet: String,
    /// Kubernetes node label used to group nodes into logical locations.
    #[arg(long, default_value = DEFAULT_TOPOLOGY_LABEL)]
    pub topology_label: String,
    /// Where the WireGuard private key is kept (created, mode 0600, if missing).
    #[arg(long, default_value = "/var/lib/kilo/key")]
    pub key_file: PathBuf,
    /// kilotun: make a new WireGuard key when the key in use is this old (a Go duration, at
    /// least 1m; empty: only when `kgctl rotate-key` asks). The peers follow without losing
    /// the link (see docs/keys.md).
    #[arg(long, default_value = "")]
    pub key_rotation_period: String,
    /// kilotun: post-quantum preshared keys (ML-KEM-768) on the links to nodes whose kg runs
    /// with it too (see docs/keys.md). Off by default.
    #[arg(long, default_value_t = false, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub post_quantum: bool,
    /// kilotun: how often a post-quantum link's preshared key changes (a Go duration, at
    /// least 10s).
    #[arg(long, default_value = "2m")]
    pub psk_rotation_period: String,
    /// kilotun: how long a peer's endpoint candidate (`kilotun.io/endpoints`) has to complete
    /// a handshake before kg tries the next one (a Go duration, at least 1s).
    #[arg(long, default_value = "15s")]
    pub endpoint_probe_window: String,
    /// kilotun: which of this node's addresses kg publishes as candidates: comma-separated
    /// CIDRs, `!CIDR` to exclude (empty: every usable address).
    #[arg(long, default_value = "")]
    pub advertise_endpoints: String,
    /// kilotun: which of a peer's candidates kg tries: comma-separated CIDRs, `!CIDR` to
    /// exclude (empty: every one).
    #[arg(long, default_value = "")]
    pub accept_endpoints: String,
    /// kilotun: which family of a peer's candidates kg tries first: auto (the list's order,
    /// among the families this host has), ipv4 or ipv6.
    #[arg(long, default_value = "auto")]
    pub underlay_family: String,
    /// kilotun: how WireGuard's own packets are kept out of the tunnel. mark: WireGuard's
    /// socket carries --tunnel-guard-mark and policy rules route it by the host's own routes
    /// only; routes: a host route per endpoint that kg's routes cover (see docs/endpoints.md).
    #[arg(long, default_value = "mark")]
    pub tunnel_guard: String,
    /// kilotun: the mark WireGuard's socket carries with --tunnel-guard=mark (a number, 0x for
    /// hexadecimal): one bit no other agent on the host uses.
    #[arg(long, default_value = "0x1000")]
    pub tunnel_guard_mark: String,
    /// kilotun: where each node's pods live. node: the Nodes' spec.podCIDRs (Kilo's); calico:
    /// Calico's block affinities and the addresses it lends out of other nodes' blocks;
    /// cilium: the CiliumNode pod ranges (cluster-pool and multi-pool IPAM); pods: the
    /// addresses of each node's pods, aggregated into ranges; auto: calico where Calico's IPAM
    /// gave out blocks, cilium where CiliumNodes hold pod ranges, node otherwise (said in one
    /// log line). Other than node, the CNI's configuration is left to the CNI.
    #[arg(long, value_enum, default_value = "node")]
    pub ipam: IpamChoice,
    /// Packet-engine worker threads (default: one per CPU).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Directory of UAPI sockets (for tests).
    #[arg(long, default_value = "/var/run/wireguard", hide = true)]
    pub socket_dir: PathBuf,
}

/// `--ipam`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum IpamChoice {
    /// The Nodes' `spec.podCIDRs`.
    Node,
    /// Calico's IPAM blocks.
    Calico,
    /// Cilium's `CiliumNode` ranges.
    Cilium,
    /// The pods' own addresses.
    Pods,
    /// Whichever the cluster uses ([`control::ipam::detect`]).
    Auto,
}

impl IpamChoice {
    /// The source chosen, `None` for `auto` (decided from the cluster's objects).
    pub fn source(self) -> Option<control::ipam::IpamSource> {
        use control::ipam::IpamSource;
        match self {
            Self::Node => Some(IpamSource::Node),
            Self::Calico => Some(IpamSource::Calico),
            Self::Cilium => Some(IpamSource::Cilium),
            Self::Pods => Some(IpamSource::Pods),
            Self::Auto => None,
        }
    }
}

/// `--leader-election`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LeaderElection {
    /// Kilo's rule, computed by every node alone.
    Kilo,
    /// A lease per location (see `control::leader`).
    Lease,
}

/// The flags, parsed and checked: nothing on the host is touched before this succeeds.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The raw flags.
    pub args: KgArgs,
    /// `--hostname` or the OS hostname.
    pub hostname: String,
    /// `--mesh-granularity`.
    pub granularity: Granularity,
    /// `--encapsulate`.
    pub encapsulate: Encapsulate,
    /// `--compatibility`.
    pub compatibility: Compatibility,
    /// `--subnet`.
    pub subnet: IpNet,
    /// `--internal-cidr`s.
    pub internal_cidrs: Vec<IpNet>,
    /// `--service-cidr`s.
    pub service_cidrs: Vec<IpNet>,
    /// `--resync-period`.
    pub resync: Duration,
    /// `--mtu`.
    pub mtu: Mtu,
    /// `--key-rotation-period` (`None`: only on request).
    pub key_rotation: Option<Duration>,
    /// `--psk-rotation-period`.
    pub psk_rotation: Duration,
    /// `--advertise-endpoints`.
    pub advertise_endpoints: control::endpoints::EndpointFilter,
    /// `--endpoint-probe-window`, `--accept-endpoints` and `--underlay-family`.
    pub probe_rules: control::endpoints::ProbeRules,
    /// `--tunnel-guard` and `--tunnel-guard-mark`.
    pub tunnel_guard: control::routes::TunnelGuard,
}

impl Settings {
    /// What the reconciler decides with, taken from these flags.
    pub fn reconciler_config(&self) -> super::reconciler::Config {
        let a = &self.args;
        super::reconciler::Config {
            hostname: self.hostname.clone(),
            interface: a.interface.clone(),
            granularity: self.granularity,
            encapsulate: self.encapsulate,
            compatibility: self.compatibility,
            subnet: self.subnet,
            service_cidrs: self.service_cidrs.clone(),
            resync: self.resync,
            mtu: self.mtu,
            key_rotation: self.key_rotation,
            port: a.port,
            leaders_per_location: a.leaders_per_location,
            prioritise_private_addresses: a.prioritise_private_addresses,
            elects_by_lease: self.elects_by_lease(),
            topology_label: a.topology_label.clone(),
            ipam: a.ipam.source(),
            cni: a.cni,
            local: a.local,
            forward_rules: a.iptables_forward_rules,
            advertise_endpoints: self.advertise_endpoints.clone(),
            probe_rules: self.probe_rules.clone(),
            tunnel_guard: self.tunnel_guard,
        }
    }

    /// True when this kg takes and renews its location's lease: `--leader-election=lease` in
    /// location granularity. In full and cross granularity no location has a leader to elect,
    /// so the flag changes nothing and kg writes no Lease.
    pub fn elects_by_lease(&self) -> bool {
        self.args.leader_election == LeaderElection::Lease
            && self.granularity == Granularity::Location
    }
}

/// Parses a Go duration (`30s`, `1m30s`, `500ms`, `2h`).
pub fn parse_duration(text: &str) -> Result<Duration> {
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        bail!("empty duration");
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, tail) = rest.split_at(digits);
        let value: f64 = number
            .parse()
            .with_context(|| format!("{text:?} is not a duration like 30s"))?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_len);
        let seconds = match unit {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => bail!("{text:?} is not a duration like 30s (unit {unit:?})"),
        };
        total = Duration::try_from_secs_f64(value * seconds)
            .ok()
            .and_then(|d| total.checked_add(d))
            .ok_or_else(|| anyhow::anyhow!("{text:?} is too long a duration"))?;
        rest = tail;
    }
    Ok(total)
}

fn parse_cidrs(flag: &str, values: &[String]) -> Result<Vec<IpNet>> {
    values
        .iter()
        .map(|v| {
            v.parse::<IpNet>()
                .with_context(|| format!("--{flag}: {v:?} is not a CIDR"))
        })
        .collect()
}

impl KgArgs {
    /// Checks every flag and resolves defaults.
    pub fn settings(self) -> Result<Settings> {
        let granularity = Granularity::parse(&self.mesh_granularity).with_context(|| {
            format!(
                "--mesh-granularity: {:?} is not one of location, full, cross",
                self.mesh_granularity
            )
        })?;
        let encapsulate = Encapsulate::parse(&self.encapsulate).with_context(|| {
            format!(
                "--encapsulate: {:?} is not one of never, crosssubnet, always",
                self.encapsulate
            )
        })?;
        let compatibility = match self.compatibility.as_str() {
            "" => Compatibility::Ipip,
            "flannel" => Compatibility::Flannel,
            "cilium" => Compatibility::Cilium,
            other => bail!("--compatibility: {other:?} is not one of flannel, cilium"),
        };
        let subnet: IpNet = self
            .subnet
            .parse()
            .with_context(|| format!("--subnet: {:?} is not a CIDR", self.subnet))?;
        if self.port == 0 {
            bail!("--port: 0 is not in 1-65535");
        }
        let resync = parse_duration(&self.resync_period).context("--resync-period")?;
        if resync < Duration::from_millis(100) {
            bail!("--resync-period: {resync:?} is too short (minimum 100ms)");
        }
        let key_rotation = match self.key_rotation_period.as_str() {
            "" => None,
            text => {
                let period = parse_duration(text).context("--key-rotation-period")?;
                if period < Duration::from_secs(60) {
                    bail!("--key-rotation-period: {period:?} is too short (minimum 1m)");
                }
                Some(period)
            }
        };
        let psk_rotation =
            parse_duration(&self.psk_rotation_period).context("--psk-rotation-period")?;
        if psk_rotation < Duration::from_secs(10) {
            bail!("--psk-rotation-period: {psk_rotation:?} is too short (minimum 10s)");
        }
        let window =
            parse_duration(&self.endpoint_probe_window).context("--endpoint-probe-window")?;
        if window < Duration::from_secs(1) {
            bail!("--endpoint-probe-window: {window:?} is too short (minimum 1s)");
        }
        let filter = |flag: &str, text: &str| {
            control::endpoints::EndpointFilter::parse(text)
                .map_err(|e| anyhow::anyhow!("--{flag}: {e}"))
        };
        let advertise_endpoints = filter("advertise-endpoints", &self.advertise_endpoints)?;
        let probe_rules = control::endpoints::ProbeRules {
            window,
            accept: filter("accept-endpoints", &self.accept_endpoints)?,
            family: control::endpoints::UnderlayFamily::parse(&self.underlay_family).with_context(
                || {
                    format!(
                        "--underlay-family: {:?} is not one of auto, ipv4, ipv6",
                        self.underlay_family
                    )
                },
            )?,
            ipv4: true,
            ipv6: true,
        };
        let mark_text = self.tunnel_guard_mark.trim();
        let mark = match mark_text.strip_prefix("0x") {
            Some(hex) => u32::from_str_radix(hex, 16),
            None => mark_text.parse(),
        }
        .map_err(|_| {
            anyhow::anyhow!("--tunnel-guard-mark: {mark_text:?} is not a 32-bit number")
        })?;
        let tunnel_guard = control::routes::TunnelGuard::parse(&self.tunnel_guard, mark)
            .map_err(anyhow::Error::msg)?;
        let mtu = match self.mtu.as_str() {
            "auto" => Mtu::Auto,
            n => match n.parse::<u32>() {
                Ok(m) if (576..=65535).contains(&m) => Mtu::Fixed(m),
                _ => bail!("--mtu: {n:?} is not auto or a number in 576-65535"),
            },
        };
        if self.backend == BackendKind::File && self.cluster_dir.is_empty() {
            bail!("--backend=file needs --cluster-dir");
        }

        if !self.log_level.is_empty() && crate::agent::log_filter(&self.log_level).is_none() {
            bail!(
                "--log-level: {:?} is not one of all, debug, info, warn, error, none",
                self.log_level
            );
        }
        dataplane::io::linux_tun::validate_name(&self.interface)
            .map_err(|e| anyhow::anyhow!("--interface: {e}"))?;
        let hostname = if self.hostname.is_empty() {
            os_hostname().context("reading the OS hostname (pass --hostname)")?
        } else {
            self.hostname.clone()
        };
        Ok(Settings {
            internal_cidrs: parse_cidrs("internal-cidr", &self.internal_cidrs)?,
            service_cidrs: parse_cidrs("service-cidr", &self.service_cidrs)?,
            hostname,
            granularity,
            encapsulate,
            compatibility,
            subnet,
            resync,
            mtu,
            key_rotation,
            psk_rotation,
            advertise_endpoints,
            probe_rules,
            tunnel_guard,
            args: self,
        })
    }
}

fn os_hostname() -> Result<String> {
    let text = std::fs::read_to_string("/proc/sys/kernel/hostname")?;
    Ok(text.trim().to_string())
}

#[cfg(test)]
mod tests;
