//! `kgctl`: the topology computed client-side from a backend snapshot, printed as a graph or
//! as WireGuard configurations. Everything but reading the backend is a pure function of the
//! snapshot, so it is tested without I/O.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use control::node::{Granularity, DEFAULT_TOPOLOGY_LABEL};
use control::status::NodeStatus;
use control::{translate_node, translate_peer, Node, Peer, Topology, TopologyParams};
use ipnet::IpNet;

use crate::agent::args::BackendKind;
use crate::backend::Snapshot;

/// kgctl: inspect a Kilo mesh.
#[derive(Debug, Parser)]
#[command(name = "kgctl", version = crate::VERSION, about, args_override_self = true)]
pub struct KgctlArgs {
    /// The backend for the mesh.
    #[arg(long, value_enum, default_value = "kubernetes", global = true)]
    pub backend: BackendKind,
    /// With --backend=file: the directory holding Node and Peer objects.
    #[arg(long, default_value = "", global = true)]
    pub cluster_dir: String,
    /// Path to kubeconfig (default: $KUBECONFIG or ~/.kube/config).
    #[arg(long, default_value = "", global = true)]
    pub kubeconfig: String,
    /// The granularity of the mesh: location, full, cross, or auto (read from the nodes).
    #[arg(long, default_value = "auto", global = true)]
    pub mesh_granularity: String,
    /// The WireGuard port of the nodes.
    #[arg(long, default_value_t = control::DEFAULT_PORT, global = true)]
    pub port: u16,
    /// Kubernetes node label used to group nodes into logical locations.
    #[arg(long, default_value = DEFAULT_TOPOLOGY_LABEL, global = true)]
    pub topology_label: String,
    /// Where each node's pods live, as kg's `--ipam`: node, calico, cilium, pods or auto.
    #[arg(long, value_enum, default_value = "node", global = true)]
    pub ipam: crate::agent::args::IpamChoice,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// kgctl's subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the mesh as a Graphviz DOT graph.
    Graph,
    /// Print WireGuard configurations.
    Showconf(ShowconfArgs),
    /// Join the mesh as a Peer, with kilotun's userspace engine (no kernel module needed).
    Connect(connect::ConnectArgs),
    /// Say what is wrong with a node's links, routes and annotations, and what to do.
    Diagnose(diagnose::DiagnoseArgs),
    /// Ask a node's kg for a new WireGuard key; its peers follow without losing the link.
    RotateKey(rotate::RotateKeyArgs),
    /// Delete kg's DaemonSet and wait until every kg has cleaned its node up: before its RBAC
    /// is deleted (the chart's pre-delete hook runs it).
    Uninstall(uninstall::UninstallArgs),
}

/// `kgctl showconf`.
#[derive(Debug, Args)]
pub struct ShowconfArgs {
    /// `node` or `peer`.
    pub kind: String,
    /// The node or Peer name.
    pub name: String,
    /// Print the node (or Peer) as a peer of others.
    #[arg(long)]
    pub as_peer: bool,
    /// Output format with --as-peer: wireguard, json or yaml (a Peer object).
    #[arg(short = 'o', long, default_value = "wireguard")]
    pub output: String,
    /// Extra CIDRs to add with --as-peer.
    #[arg(long, value_delimiter = ',')]
    pub allowed_ips: Vec<String>,
    /// With `node`: print each peer's endpoint as the node's kg configured it now (the
    /// candidate it chose from `kilotun.io/endpoints`, or the address found behind NAT), read
    /// from its `/status` at its internal IP on `--kg-port`.
    #[arg(long)]
    pub live: bool,
    /// The port kg serves `/status` on, for --live (kg's `--listen`).
    #[arg(long, default_value_t = 1107)]
    pub kg_port: u16,
}

/// The mesh as kgctl sees it: ready nodes and peers, subnet and granularity worked out.
pub struct View {
    /// Ready nodes in list order.
    pub nodes: Vec<Node>,
    /// Ready peers.
    pub peers: Vec<Peer>,
    /// The Kilo subnet, from any node's `wireguard-ip`.
    pub subnet: IpNet,
    /// The granularity.
    pub granularity: Granularity,
    /// Leaders chosen by lease (`--leader-election=lease`), by location.
    pub leaders: std::collections::BTreeMap<String, Vec<control::topology::ShareLeader>>,
    /// The nodes the leases keep from leading (see `control::leader::Election::kept_out`).
    pub kept_out: std::collections::BTreeSet<String>,
}

/// Every Node of `snapshot`, translated, with its pod ranges from the IPAM source `ipam`
/// names (`--ipam`; `auto` decides from the snapshot's objects).
pub fn translated(
    snapshot: &Snapshot,
    topology_label: &str,
    ipam: crate::agent::args::IpamChoice,
) -> Vec<Node> {
    let mut all: Vec<Node> = snapshot
        .nodes
        .values()
        .map(|n| translate_node(n, topology_label).0)
        .collect();
    let source = ipam
        .source()
        .unwrap_or_else(|| control::ipam::detect(&snapshot.ipam).0);
    if let Some(ranges) = control::ipam::pod_ranges(source, &snapshot.ipam) {
        for node in &mut all {
            control::ipam::set_pod_ranges(node, &ranges.by_node);
        }
    }
    all
}

/// Builds the view of `snapshot` at `now_unix` (Kilo's kgctl rules), with the Nodes' own pod
/// CIDRs.
pub fn view(
    snapshot: &Snapshot,
    granularity: &str,
    topology_label: &str,
    now_unix: i64,
) -> Result<View> {
    let node = crate::agent::args::IpamChoice::Node;
    view_with_ipam(snapshot, granularity, topology_label, now_unix, node)
}

/// [`view`] with the pod ranges from the IPAM source `ipam` names.
pub fn view_with_ipam(
    snapshot: &Snapshot,
    granularity: &str,
    topology_label: &str,
    now_unix: i64,
    ipam: crate::agent::args::IpamChoice,
) -> Result<View> {
    let all = translated(snapshot, topology_label, ipam);
    let granularity = match granularity {
        "auto" => all.first().and_then(|n| n.granularity).unwrap_or_default(),
        other => Granularity::parse(other).with_context(|| {
            format!("--mesh-granularity: {other:?} is not one of location, full, cross, auto")
        })?,
    };
    let subnet = all.iter().find_map(|n| n.wireguard_ip).map_or_else(
        || control::DEFAULT_SUBNET.parse().expect("default subnet"),
        |n| n.trunc(),
    );
    let nodes: Vec<Node> = all.into_iter().filter(|n| n.is_ready(now_unix)).collect();
    let peers: Vec<Peer> = snapshot
        .peers
        .values()
        .filter(|p| p.validate().is_ok())
        .map(translate_peer)
        .filter(Peer::is_ready)
        .collect();
    // Leases are judged by this machine's clock against their renewal time.
    let shares = leaders_per_location(&nodes, granularity);
    let elections =
        control::leader::lease_leaders(&nodes, &snapshot.leases, shares, now_unix * 1000);
    let kept_out = elections
        .values()
        .flatten()
        .flat_map(|e| e.kept_out.iter().cloned())
        .collect();
    let leaders = elections
        .into_iter()
        .map(|(location, shares)| {
            let leaders = shares
                .into_iter()
                .map(|e| control::topology::ShareLeader {
                    share: e.share,
                    name: e.leader,
                    predecessors: e.predecessors,
                })
                .collect();
            (location, leaders)
        })
        .collect();
    Ok(View {
        nodes,
        peers,
        subnet,
        granularity,
        leaders,
        kept_out,
    })
}

/// The leaders per location as the agents compute them: the smallest number any ready node
/// publishes (1 when one publishes none), and 1 outside location granularity.
fn leaders_per_location(nodes: &[Node], granularity: Granularity) -> usize {
    if granularity != Granularity::Location {
        return 1;
    }
    usize::from(control::topology::shares::agreed_leaders_per_location(
        nodes,
    ))
}

impl View {
    /// The topology from `hostname`'s point of view (the last ready node when `None`).
    pub fn topology(&self, hostname: Option<&str>, port: u16) -> Result<Topology> {
        let Some(last) = self.nodes.last() else {
            bail!("no ready nodes")
        };
        let params = TopologyParams {
            granularity: self.granularity,
            hostname: hostname.unwrap_or(&last.name).to_string(),
            port,
            subnet: self.subnet,
            persistent_keepalive: 0,
            leaders_per_location: leaders_per_location(&self.nodes, self.granularity),
            kept_out: self.kept_out.clone(),
        };
        Ok(Topology::with_leaders(
            &self.nodes,
            &self.peers,
            &params,
            &self.leaders,
        )?)
    }
}

/// The output of `kgctl graph`.
pub fn graph(v: &View) -> Result<String> {
    Ok(v.topology(None, control::DEFAULT_PORT)?.dot())
}

/// Sets each peer of `conf` to the endpoint the node's kg configured for it, as its `/status`
/// says (`live`). Returns one line per peer `live` does not name or names without an endpoint:
/// those keep the endpoint the topology gives them.
pub fn live_endpoints(conf: &mut control::wgconf::Conf, live: &NodeStatus) -> Vec<String> {
    let mut notes = Vec::new();
    for peer in &mut conf.peers {
        let key = peer.public_key.to_string();
        let configured = live
            .peers
            .iter()
            .find(|p| p.public_key == key)
            .and_then(|p| p.configured_endpoint.as_deref());
        match configured.map(control::ip::Endpoint::parse) {
            Some(Ok(endpoint)) => peer.endpoint = Some(endpoint),
            Some(Err(e)) => notes.push(format!(
                "peer {key}: node {}'s kg reports endpoint {:?}, which is not one ({e}); kept the topology's",
                live.node,
                configured.unwrap_or_default()
            )),
            None => notes.push(format!(
                "peer {key}: node {}'s kg configures no endpoint for it; kept the topology's",
                live.node
            )),
        }
    }
    notes
}

/// The output of `kgctl showconf`: (stdout, stderr). `live` is the node's `/status`, for
/// `--live`.
pub fn showconf(
    v: &View,
    args: &ShowconfArgs,
    port: u16,
    live: Option<&NodeStatus>,
) -> Result<(String, String)> {
    let output = Output::parse(&args.output)?;
    if args.live && (args.kind != "node" || args.as_peer) {
        bail!("--live prints the endpoints a node's kg configured: it goes with `showconf node NAME` alone, not with --as-peer or a Peer");
    }
    if output != Output::WireGuard && !args.as_peer {
        bail!("-o {}: only --as-peer prints a Peer object; without it the output is a WireGuard configuration", args.output);
    }
    let extra: Vec<IpNet> = args
        .allowed_ips
        .iter()
        .map(|s| {
            s.parse()
                .with_context(|| format!("--allowed-ips: {s:?} is not a CIDR"))
        })
        .collect::<Result<_>>()?;
    match args.kind.as_str() {
        "node" => {
            let node = v
                .nodes
                .iter()
                .find(|n| n.name == args.name)
                .with_context(|| format!("no ready node {:?}", args.name))?;
            let t = v.topology(Some(&args.name), port)?;
            if args.as_peer {
                let mut peer = t.as_peer().context("the node has no segment")?;
                for ip in extra {
                    if !peer.allowed_ips.contains(&ip.trunc()) {
                        peer.allowed_ips.push(ip.trunc());
                    }
                }
                return Ok((output.render(&args.name, &peer)?, String::new()));
            }
            if !t.leader {
                return Ok((
                    String::new(),
                    format!("Node {:?} is not a leader node\n", args.name),
                ));
            }
            let mut conf = t.conf(node.key.as_ref());
            conf.listen_port = Some(port);
            let notes = live.map_or_else(Vec::new, |l| live_endpoints(&mut conf, l));
            let stderr: String = notes.iter().map(|n| format!("{n}\n")).collect();
            Ok((conf.to_ini(None), stderr))
        }
        "peer" => {
            let peer = v
                .peers
                .iter()
                .find(|p| p.name == args.name)
                .with_context(|| format!("no ready Peer {:?}", args.name))?;
            let t = v.topology(None, control::DEFAULT_PORT)?;
            if args.as_peer {
                let wg = control::wgconf::WgPeer {
                    public_key: peer.public_key.expect("ready peers have keys"),
                    allowed_ips: peer.allowed_ips.iter().map(|n| n.trunc()).collect(),
                    endpoint: peer.endpoint.clone(),
                    persistent_keepalive: peer.persistent_keepalive,
                    preshared_key: peer.preshared_key.clone(),
                    replaces: None,
                };
                return Ok((output.render(&args.name, &wg)?, String::new()));
            }
            Ok((t.peer_conf(&args.name).to_ini(None), String::new()))
        }
        other => bail!("showconf: {other:?} is not node or peer"),
    }
}

/// `kgctl showconf -o`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Output {
    WireGuard,
    Json,
    Yaml,
}

impl Output {
    fn parse(text: &str) -> Result<Self> {
        Ok(match text {
            "wireguard" => Self::WireGuard,
            "json" => Self::Json,
            "yaml" => Self::Yaml,
            other => bail!("-o {other:?} is not one of wireguard, json, yaml"),
        })
    }

    /// One peer as a `[Peer]` section or as a Peer object named `name`.
    fn render(self, name: &str, peer: &control::wgconf::WgPeer) -> Result<String> {
        let object = || control::wgconf::peer_object(name, peer);
        Ok(match self {
            Self::WireGuard => peer.to_ini(),
            Self::Json => serde_json::to_string_pretty(&object())? + "\n",
            Self::Yaml => serde_saphyr::to_string(&object())?,
        })
    }
}

/// `--kubeconfig`, else `$KUBECONFIG` if that file exists, else `~/.kube/config`.
pub fn kubeconfig_path(args: &KgctlArgs) -> String {
    if !args.kubeconfig.is_empty() {
        return args.kubeconfig.clone();
    }
    std::env::var("KUBECONFIG")
        .ok()
        .filter(|p| std::path::Path::new(p).exists())
        .unwrap_or_else(|| {
            std::env::var("HOME")
                .map(|h| format!("{h}/.kube/config"))
                .unwrap_or_default()
        })
}

/// Reads the backend once.
pub async fn snapshot(args: &KgctlArgs) -> Result<Snapshot> {
    match args.backend {
        BackendKind::File => {
            if args.cluster_dir.is_empty() {
                bail!("--backend=file needs --cluster-dir");
            }
            let backend =
                crate::backend::file::FileBackend::open(&PathBuf::from(&args.cluster_dir))?;
            let snapshot = backend.subscribe().borrow().as_ref().clone();
            Ok(snapshot)
        }
        BackendKind::Kubernetes => {
            let config = crate::backend::kube::client_config(&kubeconfig_path(args), "").await?;
            let backend = crate::backend::kube::KubeBackend::start(config, true)?;
            let kinds = crate::backend::kube::ipam::kinds(args.ipam.source());
            let auto = args.ipam == crate::agent::args::IpamChoice::Auto;
            backend.watch_ipam(&kinds, auto);
            if !backend
                .wait_listed(std::time::Duration::from_secs(10))
                .await
            {
                bail!("the Kubernetes API did not list Nodes (and the IPAM objects) within 10 s");
            }
            // Give the Peer watch a moment to list too (it may not exist at all).
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            let snapshot = backend.subscribe().borrow().as_ref().clone();
            Ok(snapshot)
        }
    }
}

/// Unix seconds now.
pub fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

pub mod connect;
pub mod diagnose;
pub mod rotate;
pub mod uninstall;

#[cfg(test)]
mod tests;
