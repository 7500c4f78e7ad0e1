//! `kgctl connect`: joins this machine to the mesh as a Peer, through kilotun's own
//! userspace engine, so it works where the wireguard kernel module is missing. It registers the
//! Peer if needed, creates the TUN device (with a UAPI socket, so `wg show` works), and keeps
//! the WireGuard configuration and routes in step with the cluster every resync period.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{ArgAction, Args};
use control::ip::Host;
use control::peer::PeerObject;
use control::routes::{diff, RoutePlan};
use dataplane::SecretKey;
use ipnet::IpNet;

use crate::agent::args::{parse_duration, BackendKind};
use crate::agent::shells::netlink::Netlink;
use crate::agent::shells::wireguard::WireGuard;
use crate::backend::{file::FileBackend, kube::KubeBackend, Backend, Snapshot};

use super::KgctlArgs;

/// `kgctl connect`'s flags (Kilo's names and defaults).
#[derive(Debug, Clone, Args)]
pub struct ConnectArgs {
    /// The Peer's name (default: this machine's hostname).
    pub name: Option<String>,
    /// The Peer's own address in the mesh, put on the interface.
    #[arg(short = 'a', long, default_value = "10.10.10.10/32")]
    pub allowed_ip: String,
    /// Extra cluster CIDRs to route through the mesh (the service CIDR, say).
    #[arg(long, value_delimiter = ',')]
    pub allowed_ips: Vec<String>,
    /// A file holding the WireGuard private key (created, mode 0600, if missing); by default a
    /// fresh key is generated.
    #[arg(long)]
    pub private_key: Option<PathBuf>,
    /// Delete the Peer (if kgctl created it) and the interface on exit.
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    pub clean_up: bool,
    /// The interface's MTU.
    #[arg(long, default_value_t = 1420)]
    pub mtu: u32,
    /// How often to re-read the cluster.
    #[arg(long, default_value = "30s")]
    pub resync_period: String,
    /// The interface to create.
    #[arg(short = 'i', long, default_value = "kilo0")]
    pub interface: String,
    /// Keepalive seconds the nodes send to this Peer (it is usually behind NAT).
    #[arg(long, default_value_t = 10)]
    pub persistent_keepalive: u16,
    /// Log level to use. Possible values: all, debug, info, warn, error, none.
    #[arg(long, default_value = "info")]
    pub log_level: String,
    /// Directory of UAPI sockets (for tests).
    #[arg(long, default_value = "/var/run/wireguard", hide = true)]
    pub socket_dir: PathBuf,
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// The Peer object `kgctl connect` registers.
pub fn peer_object(name: &str, allowed_ip: IpNet, key: &SecretKey, keepalive: u16) -> PeerObject {
    let peer = control::wgconf::WgPeer {
        public_key: control::Key(*key.public_key().as_bytes()),
        allowed_ips: vec![allowed_ip],
        endpoint: None,
        persistent_keepalive: keepalive,
        preshared_key: None,
        replaces: None,
    };
    control::wgconf::peer_object(name, &peer)
}

async fn open_backend(global: &KgctlArgs) -> Result<Backend> {
    Ok(match global.backend {
        BackendKind::File => {
            if global.cluster_dir.is_empty() {
                bail!("--backend=file needs --cluster-dir");
            }
            let backend = FileBackend::open(&PathBuf::from(&global.cluster_dir))?;
            backend.spawn_poller();
            Backend::File(backend)
        }
        BackendKind::Kubernetes => {
            let config =
                crate::backend::kube::client_config(&super::kubeconfig_path(global), "").await?;
            let backend = KubeBackend::start(config, false)?;
            let kinds = crate::backend::kube::ipam::kinds(global.ipam.source());
            let auto = global.ipam == crate::agent::args::IpamChoice::Auto;
            backend.watch_ipam(&kinds, auto);
            if !backend
                .wait_listed(std::time::Duration::from_secs(10))
                .await
            {
                bail!("the Kubernetes API did not list Nodes within 10 s");
            }
            Backend::Kube(backend)
        }
    })
}

/// Resolves the DNS endpoints of the view's nodes (a failure leaves the node without one).
async fn resolve(view: &mut super::View) {
    for node in &mut view.nodes {
        let Some(endpoint) = node.endpoint.as_mut() else {
            continue;
        };
        if let Host::Dns { name, resolved } = &mut endpoint.host {
            let looked_up = tokio::net::lookup_host((name.as_str(), endpoint.port)).await;
            *resolved = looked_up
                .ok()
                .and_then(|mut addrs| addrs.next())
                .map(|a| a.ip());
        }
    }
}

/// The connected Peer: device, link and what was applied.
struct Connection {
    name: String,
    key: SecretKey,
    extra: Vec<IpNet>,
    wg: WireGuard,
    netlink: Netlink,
    index: u32,
    owned: RoutePlan,
}

impl Connection {
    async fn reconcile(&mut self, global: &KgctlArgs, snapshot: &Snapshot) -> Result<()> {
        let mut view = super::view_with_ipam(
            snapshot,
            &global.mesh_granularity,
            &global.topology_label,
            super::now_unix(),
            global.ipam,
        )?;
        resolve(&mut view).await;
        let topology = view.topology(None, global.port)?;
        if !topology.peers.iter().any(|p| p.name == self.name) {
            bail!("Peer {:?} is not in the cluster (yet)", self.name);
        }
        let mut conf = topology.peer_conf(&self.name);
        conf.listen_port = Some(global.port);
        let desired = crate::wiring::device_config(&conf, &self.key);
        if self.wg.apply(&desired)? {
            tracing::info!(
                peers = desired.peers.len(),
                "WireGuard configuration applied"
            );
        }
        let plan = topology.peer_routes(&self.name, self.index, &self.extra);
        self.set_routes(plan).await
    }

    async fn set_routes(&mut self, plan: RoutePlan) -> Result<()> {
        let observed = self.netlink.observe().await?;
        let ops = diff(&plan, &observed, &self.owned, self.index);
        for e in self.netlink.apply(&ops).await {
            tracing::warn!(error = format!("{e:#}"), "route change failed");
        }
        self.owned = plan;
        Ok(())
    }
}

/// Runs `kgctl connect` until SIGINT or SIGTERM.
pub async fn run(global: &KgctlArgs, args: &ConnectArgs) -> Result<()> {
    let name = args.name.clone().unwrap_or_else(hostname);
    if name.is_empty() {
        bail!("no Peer name given and no hostname to use");
    }
    let allowed_ip: IpNet = args
        .allowed_ip
        .parse()
        .with_context(|| format!("--allowed-ip: {:?} is not a CIDR", args.allowed_ip))?;
    let extra = args
        .allowed_ips
        .iter()
        .map(|s| {
            s.parse::<IpNet>()
                .with_context(|| format!("--allowed-ips: {s:?} is not a CIDR"))
        })
        .collect::<Result<Vec<_>>>()?;
    let resync = parse_duration(&args.resync_period).context("--resync-period")?;
    let key = match &args.private_key {
        Some(path) => crate::agent::shells::keyfile::load_or_generate(path)?,
        None => SecretKey::generate(),
    };

    let backend = open_backend(global).await?;
    let mut snapshots = backend.subscribe();
    let existing = snapshots.borrow().peers.get(&name).cloned();
    let created = match existing {
        None => {
            let object = peer_object(&name, allowed_ip, &key, args.persistent_keepalive);
            backend.create_peer(&object).await?;
            tracing::info!(peer = %name, "Peer created");
            true
        }
        Some(peer) => {
            if peer.spec.public_key != key.public_key().to_base64() {
                tracing::warn!(peer = %name, "the Peer exists with another public key; the nodes will not accept this machine until it is updated (pass its key with --private-key)");
            }
            false
        }
    };

    let wg = WireGuard::embedded(&args.interface, 1, &args.socket_dir, false)?;
    let netlink = Netlink::connect()?;
    let index = netlink
        .link_by_name(&args.interface)
        .await?
        .with_context(|| format!("no link {} after creating it", args.interface))?
        .index;
    netlink.set_mtu(index, args.mtu).await?;
    netlink.set_address(index, Some(allowed_ip)).await?;
    netlink.set_up(index, true).await?;
    tracing::info!(interface = %args.interface, address = %allowed_ip, peer = %name, "connected; keeping the configuration in step with the cluster");

    let mut connection = Connection {
        name: name.clone(),
        key,
        extra,
        wg,
        netlink,
        index,
        owned: RoutePlan::default(),
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut ticker = crate::periodic::periodic(resync);
    loop {
        let snapshot = Arc::clone(&snapshots.borrow_and_update());
        if let Err(e) = connection.reconcile(global, &snapshot).await {
            tracing::warn!(error = format!("{e:#}"), "reconcile failed; retrying");
        }
        tokio::select! {
            _ = ticker.tick() => {}
            changed = snapshots.changed() => {
                if changed.is_err() {
                    break;
                }
            }
            _ = term.recv() => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }

    tracing::info!("disconnecting");
    if let Err(e) = connection.set_routes(RoutePlan::default()).await {
        tracing::warn!(error = format!("{e:#}"), "removing routes failed");
    }
    // The TUN device kgctl created goes away with its last descriptor.
    connection.wg.shutdown(args.clean_up);
    if created && args.clean_up {
        backend.delete_peer(&name).await?;
        tracing::info!(peer = %name, "Peer deleted");
    }
    Ok(())
}
