//! An agent on the shells' in-memory twins ([`super::shells::twins`]), for tests and benchmarks
//! that count what a reconcile asks of the host.

use anyhow::Result;
use control::clock::Now;
use dataplane::{DeviceConfig, SecretKey};

use super::args::Settings;
use super::shells::cni_file::MemCniFile;
use super::shells::twins::{Calls, MemDevice, MemFirewall, MemKernel};
use crate::backend::Backend;

/// How a [`TwinAgent`] starts: its key, the peers it restores (as `kg` restores the last run's
/// saved state) and when.
pub struct Start {
    /// The node's private key.
    pub key: SecretKey,
    /// The peers of the last run, restored before the first reconcile.
    pub restored: Option<DeviceConfig>,
    /// The moment it starts.
    pub now: Now,
}

/// `kg` flags `args`, parsed.
fn settings(args: &[&str]) -> Result<Settings> {
    use clap::Parser as _;
    super::args::KgArgs::try_parse_from(std::iter::once("kg").chain(args.iter().copied()))?
        .settings()
}

/// An agent on in-memory twins, and the twins, to count what it does.
pub struct TwinAgent {
    /// The agent.
    pub agent: crate::agent::Agent<MemKernel, MemFirewall, MemDevice>,
    /// Its kernel.
    pub kernel: MemKernel,
    /// Its firewall.
    pub firewall: MemFirewall,
    /// Its WireGuard device.
    pub engine: MemDevice,
    /// Its CNI configuration file (`--cni-path`, missing at start).
    pub cni: MemCniFile,
    /// The post-quantum exchanges' datagrams it sent (`--post-quantum`), for a test's network
    /// to deliver.
    pub pq_outbox: crate::agent::pq::PqOutbox,
}

impl TwinAgent {
    /// Starts an agent with `kg` flags `args` (which must use `--backend=file`, whose
    /// directory it may write its Node into) on a fresh kernel ([`MemKernel::host`]), firewall
    /// and device.
    pub async fn start(args: &[&str]) -> Result<Self> {
        Self::start_on(args, MemDevice::default()).await
    }

    /// [`TwinAgent::start`] on `engine`, a device that may hold a configuration already (one
    /// that outlived the last kg).
    pub async fn start_on(args: &[&str], engine: MemDevice) -> Result<Self> {
        let settings = settings(args)?;
        let backend = Backend::File(crate::backend::file::FileBackend::open(
            std::path::Path::new(&settings.args.cluster_dir),
        )?);
        let kernel = MemKernel::host(&settings.args.interface);
        let start = Start {
            key: SecretKey::generate(),
            restored: None,
            now: crate::agent::read_clock(),
        };
        Self::start_settled(settings, backend, kernel, engine, start).await
    }

    /// Starts an agent with `kg` flags `args` on `backend` (whatever `--backend` says), on
    /// `kernel` and `engine`, as `start` says.
    pub async fn start_with(
        args: &[&str],
        backend: Backend,
        kernel: MemKernel,
        engine: MemDevice,
        start: Start,
    ) -> Result<Self> {
        Self::start_settled(settings(args)?, backend, kernel, engine, start).await
    }

    /// [`TwinAgent::start_with`] on flags already parsed.
    async fn start_settled(
        settings: Settings,
        backend: Backend,
        kernel: MemKernel,
        engine: MemDevice,
        start: Start,
    ) -> Result<Self> {
        let firewall = MemFirewall::default();
        engine.on_link(&kernel, &settings.args.interface);
        let cni = MemCniFile::holding(settings.args.cni_path.clone(), None);
        let pq_outbox = crate::agent::pq::PqOutbox::default();
        let shells = crate::agent::Shells {
            kernel: kernel.clone(),
            firewall: firewall.clone(),
            engine: engine.clone(),
            cni: Box::new(cni.clone()),
            pq_outbox: Some(pq_outbox.clone()),
        };
        let agent = crate::agent::Agent::with_shells(
            settings,
            start.key,
            backend,
            shells,
            start.restored,
            std::future::ready(Vec::new()),
            start.now,
        )
        .await?;
        Ok(Self {
            agent,
            kernel,
            firewall,
            engine,
            cni,
            pq_outbox,
        })
    }

    /// Every twin's calls: kernel, firewall, device.
    pub fn calls(&self) -> [Calls; 3] {
        [
            self.kernel.calls(),
            self.firewall.calls(),
            self.engine.calls(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use control::fixtures::{kube_node, synthetic_cluster};
    use dataplane::PeerConfig;

    /// A complete snapshot of `nodes`, each checked in now.
    fn checked_in(nodes: Vec<control::Node>) -> crate::backend::Snapshot {
        let mut snapshot = crate::backend::Snapshot {
            listed: crate::backend::Listed::EVERYTHING,
            ..Default::default()
        };
        for (rv, mut node) in nodes.into_iter().enumerate() {
            node.last_seen = crate::agent::read_clock().unix_secs();
            snapshot.put_node(&node.name.clone(), kube_node(&node, rv as u64 + 1));
        }
        snapshot
    }

    /// A twin on the file backend in a fresh directory (named after `test`), as the first of
    /// [`synthetic_cluster`]'s 4 nodes in 2 locations, without CNI or encapsulation; and those
    /// nodes.
    async fn file_twin(test: &str) -> (std::path::PathBuf, Vec<control::Node>, TwinAgent) {
        let dir = std::env::temp_dir().join(format!("kilotun-{test}-twin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let nodes = synthetic_cluster(4, 2);
        let args = [
            "--backend=file".to_string(),
            format!("--cluster-dir={}", dir.display()),
            format!("--key-file={}", dir.join("key").display()),
            format!("--hostname={}", nodes[0].name),
            "--cni=false".to_string(),
            "--encapsulate=never".to_string(),
        ];
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let twin = TwinAgent::start(&args).await.unwrap();
        (dir, nodes, twin)
    }

    #[tokio::test]
    async fn a_device_that_outlived_kg_keeps_its_peers_when_kg_starts() {
        let dir = std::env::temp_dir().join(format!("kilotun-outlived-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut peer = PeerConfig::new(SecretKey::from_bytes([3; 32]).public_key());
        peer.add_allowed_ip("10.42.2.0/24".parse().unwrap());
        peer.endpoint = Some("192.168.20.2:51820".parse().unwrap());
        let outlived = DeviceConfig {
            peers: vec![peer],
            ..DeviceConfig::default()
        };
        let engine = MemDevice::holding(outlived.clone());
        let twin = TwinAgent::start_on(
            &[
                "--backend=file",
                &format!("--cluster-dir={}", dir.display()),
                &format!("--key-file={}", dir.join("key").display()),
                "--hostname=n1",
                "--cni=false",
            ],
            engine,
        )
        .await
        .unwrap();
        let now = twin.engine.config();
        std::fs::remove_dir_all(&dir).unwrap();
        // The key and port are set, and the peer (with its session, on a real device) stays.
        assert_eq!(now.peers, outlived.peers);
        assert!(now.interface.private_key.is_some());
        assert_eq!(now.interface.listen_port, 51820);
    }

    #[tokio::test]
    async fn the_cni_configuration_follows_the_pod_cidr_through_its_shell() {
        let dir = std::env::temp_dir().join(format!("kilotun-cni-twin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let nodes = synthetic_cluster(4, 2);
        let local = nodes[0].clone();
        let mut twin = TwinAgent::start(&[
            "--backend=file",
            &format!("--cluster-dir={}", dir.display()),
            &format!("--key-file={}", dir.join("key").display()),
            &format!("--hostname={}", local.name),
            "--cni=true",
            "--mtu=1380",
            "--encapsulate=never",
        ])
        .await
        .unwrap();
        let snapshot = checked_in(nodes);
        // No conflist yet: a warning, nothing written, and the mesh still configured.
        twin.agent
            .reconcile(&snapshot, crate::agent::Trigger::Resync)
            .await
            .unwrap();
        assert_eq!((twin.cni.text(), twin.cni.writes()), (None, 0));
        assert!(!twin.engine.config().peers.is_empty());
        // The CNI's own conflist appears: the next resync puts the node's range and the MTU in.
        twin.cni.put(
            r#"{"cniVersion":"0.4.0","name":"kilo","plugins":[{"type":"bridge","bridge":"kube-bridge","mtu":1420,"ipam":{"type":"host-local"}}]}"#,
        );
        twin.agent
            .reconcile(&snapshot, crate::agent::Trigger::Resync)
            .await
            .unwrap();
        let text = twin.cni.text().unwrap();
        let pods = local.subnet.unwrap().to_string();
        assert!(text.contains(&format!(r#""subnet":"{pods}""#)), "{text}");
        assert!(text.contains(r#""mtu":1380"#), "{text}");
        // Right already: read again on the next resync, not written.
        twin.agent
            .reconcile(&snapshot, crate::agent::Trigger::Resync)
            .await
            .unwrap();
        assert_eq!(twin.cni.writes(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn readiness_follows_the_engine_from_nothing_to_restored_to_configured() {
        use crate::agent::serve::status::EngineReadiness;
        let dir = std::env::temp_dir().join(format!("kilotun-ready-twin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let nodes = synthetic_cluster(4, 2);
        let local = nodes[0].clone();
        let cluster_dir = format!("--cluster-dir={}", dir.display());
        let key_file = format!("--key-file={}", dir.join("key").display());
        let hostname = format!("--hostname={}", local.name);
        let args = [
            "--backend=file",
            cluster_dir.as_str(),
            key_file.as_str(),
            hostname.as_str(),
            "--cni=false",
            "--encapsulate=never",
        ];
        let open = || Backend::File(crate::backend::file::FileBackend::open(&dir).unwrap());
        let fresh = |restored| Start {
            key: SecretKey::generate(),
            restored,
            now: crate::agent::read_clock(),
        };
        // A node with nothing saved: the engine runs empty, and /ready says so until a
        // reconcile configures it.
        let mut twin = TwinAgent::start_with(
            &args,
            open(),
            MemKernel::host(control::DEFAULT_INTERFACE),
            MemDevice::default(),
            fresh(None),
        )
        .await
        .unwrap();
        let board = std::sync::Arc::clone(&twin.agent.status);
        assert_eq!(board.engine(), EngineReadiness::Unconfigured);
        assert!(!board.engine().answer().0);
        let snapshot = checked_in(nodes);
        twin.agent
            .reconcile(&snapshot, crate::agent::Trigger::Resync)
            .await
            .unwrap();
        assert_eq!(board.engine(), EngineReadiness::Configured);
        assert!(board.engine().answer().0);
        // A restart that restores the last run's peers is ready before its first reconcile.
        let saved = twin.engine.config();
        assert!(!saved.peers.is_empty());
        let restarted = TwinAgent::start_with(
            &args,
            open(),
            MemKernel::host(control::DEFAULT_INTERFACE),
            MemDevice::default(),
            fresh(Some(saved.clone())),
        )
        .await
        .unwrap();
        assert_eq!(
            restarted.agent.status.engine(),
            EngineReadiness::Restored {
                peers: saved.peers.len()
            }
        );
        let (ready, why) = restarted.agent.status.engine().answer();
        assert!(ready && why.contains("of the last run"), "{why}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_resync_of_a_quiet_host_keeps_the_last_route_dump_and_a_notified_one_does_not() {
        use crate::agent::shells::kernel_watch::RoutingChanges;
        use crate::agent::Trigger;
        let (dir, nodes, mut twin) = file_twin("dump").await;
        let snapshot = checked_in(nodes);
        let changes = RoutingChanges::default();
        twin.agent.record.routing = Some(changes.clone());
        let resync = async |twin: &mut TwinAgent| {
            let before = twin.kernel.calls().reads;
            twin.agent
                .reconcile(&snapshot, Trigger::Resync)
                .await
                .unwrap();
            twin.kernel.calls().reads - before
        };
        // The first resync under the watch dumps the routes, the next one does not: the links
        // and addresses are listed, the routes and rules are not.
        let dumped = resync(&mut twin).await;
        let routes = twin.kernel.routes();
        assert!(!routes.routes.is_empty(), "kg routes to the other location");
        let kept = resync(&mut twin).await;
        assert_eq!(
            kept + 2,
            dumped,
            "neither main_routes nor observe was asked"
        );
        // Someone deletes kg's routes, and the kernel says so: the next resync dumps and puts
        // them back.
        twin.kernel.set_routes(Default::default());
        changes.saw();
        assert_eq!(resync(&mut twin).await, dumped);
        assert_eq!(twin.kernel.routes(), routes);
        assert_eq!(resync(&mut twin).await, kept, "quiet again");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_lost_engine_is_started_again_and_the_mesh_applied_anew() {
        use crate::agent::Input;
        use control::journal::Reason;
        use control::routes::Route;
        let (dir, nodes, mut twin) = file_twin("lost").await;
        let mut snapshot = std::sync::Arc::new(checked_in(nodes));
        let step = async |twin: &mut TwinAgent, snapshot: &mut std::sync::Arc<_>| {
            let now = crate::agent::read_clock();
            twin.agent.step(Input::Kernel, snapshot, now).await.unwrap()
        };
        step(&mut twin, &mut snapshot).await.unwrap();
        let iface = control::DEFAULT_INTERFACE;
        let (config, routes) = (twin.engine.config(), twin.kernel.routes());
        let addresses = twin.kernel.addresses_on(iface);
        let old_index = twin.kernel.index_of(iface).unwrap();
        assert!(!config.peers.is_empty() && !routes.routes.is_empty());
        assert!(twin.kernel.link_up(iface) && !addresses.is_empty());

        // `ip link del`: the link goes with its addresses and routes, and the engine says so.
        assert!(twin.kernel.delete_link_named(iface));
        let why = format!("the embedded engine's TUN link {iface}: the TUN link was deleted");
        twin.engine.lose_link(&why);
        // A start that fails fails the pass, naming the loss and the failure; nothing else ran.
        twin.engine.refuse_recreate(true);
        let failed = step(&mut twin, &mut snapshot).await.unwrap_err();
        let said = format!("{failed:#}");
        assert!(
            said.contains(&why) && said.contains("starting it again failed"),
            "{said}"
        );
        assert!(said.contains("the twin refuses"), "{said}");
        assert_eq!(twin.engine.recreated(), 0);
        // The next pass starts it again and applies everything on the new link.
        twin.engine.refuse_recreate(false);
        step(&mut twin, &mut snapshot).await.unwrap();
        assert_eq!(twin.engine.recreated(), 1);
        assert_eq!(twin.engine.config(), config, "the same key, port and peers");
        let new_index = twin.kernel.index_of(iface).unwrap();
        assert_ne!(new_index, old_index);
        assert!(twin.kernel.link_up(iface));
        assert_eq!(twin.kernel.addresses_on(iface), addresses);
        let moved: std::collections::BTreeSet<Route> = routes
            .routes
            .iter()
            .map(|r| Route {
                link: if r.link == old_index {
                    new_index
                } else {
                    r.link
                },
                ..r.clone()
            })
            .collect();
        assert_eq!(
            twin.kernel.routes().routes,
            moved,
            "every route, on the new link"
        );
        let events = twin.agent.status.snapshot().events;
        let recreated: Vec<_> = events
            .iter()
            .filter(|e| e.reason == Reason::EngineRecreated)
            .collect();
        assert_eq!(recreated.len(), 1, "{events:?}");
        assert!(
            recreated[0].message.starts_with(&why),
            "{}",
            recreated[0].message
        );
        assert!(events.iter().any(|e| e.reason == Reason::ReconcileFailed
            && e.message.contains("starting it again failed")));
        // Steady again: the next pass starts nothing.
        step(&mut twin, &mut snapshot).await.unwrap();
        assert_eq!(twin.engine.recreated(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
