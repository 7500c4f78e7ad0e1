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
            args: self,
        })
    }
}

fn os_hostname() -> Result<String> {
    let text = std::fs::read_to_string("/proc/sys/kernel/hostname")?;
    Ok(text.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Settings> {
        let mut full = vec!["kg", "--hostname=n1"];
        full.extend_from_slice(args);
        KgArgs::try_parse_from(full)?.settings()
    }

    #[test]
    fn version_names_the_target_it_was_built_for() {
        use clap::CommandFactory;
        let version = KgArgs::command().render_version();
        assert!(version.starts_with("kg "), "{version}");
        assert!(version.contains(crate::TARGET), "{version}");
        // The triple is the one this binary runs as (under qemu-user too).
        // (armv7-… and armv6-… triples both run as "arm".)
        let arch = std::env::consts::ARCH;
        assert!(
            crate::TARGET.starts_with(arch),
            "{} vs {arch}",
            crate::TARGET
        );
    }

    #[test]
    fn defaults_match_kilo() {
        let s = parse(&[]).unwrap();
        assert_eq!(s.args.backend, BackendKind::Kubernetes);
        assert!(s.args.clean_up && s.args.cni && s.args.create_interface && s.args.local);
        assert_eq!(s.args.wireguard, WireGuardChoice::Embedded);
        assert!(!s.args.clean_up_interface && !s.args.iptables_forward_rules);
        assert_eq!(s.args.interface, "kilo0");
        assert_eq!(s.args.listen, ":1107");
        assert_eq!(s.args.port, 51820);
        assert_eq!(s.subnet.to_string(), "10.4.0.0/16");
        assert_eq!(s.resync, Duration::from_secs(30));
        assert_eq!(s.mtu, Mtu::Auto);
        assert_eq!(s.granularity, Granularity::Location);
        assert_eq!(s.encapsulate, Encapsulate::Always);
        assert_eq!(s.args.topology_label, "topology.kubernetes.io/region");
        assert_eq!(
            s.args.cni_path,
            PathBuf::from("/etc/cni/net.d/10-kilo.conflist")
        );
    }

    #[test]
    fn go_style_booleans_and_repeatable_flags() {
        let s = parse(&[
            "--local=false",
            "--cni=false",
            "--clean-up",
            "--internal-cidr=10.0.0.0/8",
            "--internal-cidr",
            "192.168.0.0/16",
        ])
        .unwrap();
        assert!(!s.args.local && !s.args.cni && s.args.clean_up);
        assert_eq!(s.internal_cidrs.len(), 2);
    }

    #[test]
    fn internal_cidrs_take_ipv6_prefixes() {
        let s = parse(&["--internal-cidr=fd50::/64", "--internal-cidr=2001:db8::/32"]).unwrap();
        assert_eq!(
            s.internal_cidrs,
            [
                "fd50::/64".parse::<IpNet>().unwrap(),
                "2001:db8::/32".parse().unwrap()
            ]
        );
        for bad in ["--internal-cidr=fd50::zz/64", "--internal-cidr=fd50::/129"] {
            let err = format!("{:#}", parse(&[bad]).unwrap_err());
            assert!(err.contains("--internal-cidr"), "{bad}: {err}");
        }
    }

    #[test]
    fn bad_flags_are_named() {
        for (args, needle) in [
            (vec!["--mesh-granularity=crisscross"], "--mesh-granularity"),
            (vec!["--encapsulate=sometimes"], "--encapsulate"),
            (vec!["--subnet=10.4.0.0"], "--subnet"),
            (vec!["--resync-period=soon"], "--resync-period"),
            (vec!["--mtu=9"], "--mtu"),
            (vec!["--compatibility=calico"], "--compatibility"),
            (vec!["--backend=file"], "--cluster-dir"),
            (vec!["--service-cidr=nope"], "--service-cidr"),
            (vec!["--interface=this-name-is-far-too-long"], "--interface"),
            (vec!["--key-rotation-period=30s"], "--key-rotation-period"),
            (vec!["--key-rotation-period=soon"], "--key-rotation-period"),
            (vec!["--psk-rotation-period=1s"], "--psk-rotation-period"),
        ] {
            let err = format!("{:#}", parse(&args).unwrap_err());
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }

    #[test]
    fn the_key_rotation_period_is_off_unless_given() {
        assert_eq!(parse(&[]).unwrap().key_rotation, None);
        let s = parse(&["--key-rotation-period=24h"]).unwrap();
        assert_eq!(s.key_rotation, Some(Duration::from_secs(86_400)));
    }

    #[test]
    fn go_durations_parse() {
        assert_eq!(parse_duration("1m30s").unwrap(), Duration::from_secs(90));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert!(parse_duration("30").is_err());
        let too_long = parse_duration("100000000000000000000h")
            .unwrap_err()
            .to_string();
        assert!(too_long.contains("too long"), "{too_long}");
    }
}
