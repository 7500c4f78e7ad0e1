//! The simulated cluster: agents on the shells' in-memory twins, one in-memory API server, and a
//! manual clock. Every agent runs kg's own loop body ([`crate::agent::Agent::step`]) and timer
//! table ([`crate::agent::Agent::poll_timeout`]). Time moves only in [`Sim::advance`], which
//! fires every agent's timers as they fall due and delivers every change of the cluster to the
//! agents that can see it, in name order, until nothing changes any more.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use control::clock::Now;
use control::node::Granularity;
use dataplane::SecretKey;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node as KubeNode, NodeSpec};

use crate::agent::shells::state;
use crate::agent::shells::twins::{MemDevice, MemKernel};
use crate::agent::twin_agent::{Start, TwinAgent};
use crate::agent::Input;
use crate::backend::memory::{MemoryBackend, MemoryCluster};
use crate::backend::{Backend, Snapshot};

use super::settings::agent_args;
pub use super::settings::{Election, Family};

mod paths;
mod tunnel;

pub use paths::{Uplinks, SECOND_UPLINK, UPLINKS};

/// The agents' `--resync-period`.
pub const RESYNC: Duration = Duration::from_secs(30);
/// How many rounds of change delivery one moment may take before the agents are said to keep
/// answering each other's writes.
const MAX_ROUNDS: usize = 50;

/// One node of the model.
pub struct SimNode {
    /// Its location label.
    pub location: String,
    /// Its address on `eth0`, where its agent detects its endpoint and internal IP.
    pub address: IpNet,
    /// Its `spec.podCIDR`.
    pub pod_cidr: IpNet,
    /// Its WireGuard key (kept in its key file across restarts).
    pub key: SecretKey,
    /// Its kernel: links, addresses and routes outlive the agent.
    pub kernel: MemKernel,
    /// Its connection to the API server.
    pub backend: Arc<MemoryBackend>,
    /// Its running agent, if any.
    pub running: Option<Running>,
    /// Where its key file (and the agent's saved state beside it) lives.
    dir: PathBuf,
    /// The snapshot it saw when it lost the API server: what its watch keeps showing.
    frozen: Option<Arc<Snapshot>>,
    /// Its WireGuard port is blocked: nothing reaches its device, nothing from it arrives.
    pub blocked: bool,
    /// It is behind NAT: nothing reaches it before it sent first, so it never hears another
    /// node behind NAT (they need a relay).
    pub behind_nat: bool,
    /// Its second uplink's address, the uplinks black-holed, its NAT mapping's last move.
    pub uplinks: Uplinks,
    /// Its number in order of joining (its addresses derive from it).
    index: u8,
}

impl SimNode {
    /// Its WireGuard public key, as the control plane names keys.
    pub fn public_key(&self) -> control::Key {
        control::Key(*self.key.public_key().as_bytes())
    }

    /// True when its agent made it its location's leader: the WireGuard link is up and holds
    /// the node's WireGuard IP (a follower's is down and bare).
    pub fn leads(&self) -> bool {
        let link = control::DEFAULT_INTERFACE;
        self.kernel.link_up(link) && !self.kernel.addresses_on(link).is_empty()
    }

    /// Its agent's `--key-file` (the agent's saved state lies beside it).
    pub fn key_file(&self) -> PathBuf {
        self.dir.join("key")
    }

    /// Its device's peers, with their allowed IPs, while its agent runs.
    pub fn device_peers(&self) -> Option<Vec<(control::Key, Vec<IpNet>)>> {
        let config = self.running.as_ref()?.twin.engine.config();
        Some(
            config
                .peers
                .into_iter()
                .map(|p| (control::Key(*p.public_key.as_bytes()), p.allowed_ips))
                .collect(),
        )
    }
}

/// A running agent.
pub struct Running {
    /// The agent and its twins.
    pub twin: TwinAgent,
    /// The snapshot it last took in.
    seen: Option<Arc<Snapshot>>,
    /// The last reconcile's error, if it failed.
    pub last_error: Option<String>,
    /// The inputs after which its device was written though no pass ran.
    pub writes_outside_pass: Vec<String>,
}

/// The `kilo.squat.ai/persistent-keepalive` a node behind NAT is annotated with.
pub const NAT_KEEPALIVE: &str = "10";

/// The model: a cluster, its nodes and the clock.
pub struct Sim {
    /// The API server's state.
    pub cluster: Arc<MemoryCluster>,
    /// The nodes by name (those that left are gone).
    pub nodes: BTreeMap<String, SimNode>,
    /// The model's clock.
    pub now: Now,
    dir: PathBuf,
    joined: u8,
    /// How every agent chooses leaders.
    pub election: Election,
    /// How every agent meshes (`--mesh-granularity`): location or full.
    pub granularity: Granularity,
    /// The family of the addresses and pod CIDRs of nodes joining from now on.
    pub family: Family,
    /// Every agent's `--leaders-per-location` (agents started from now on).
    pub leaders_per_location: u16,
    /// Every agent's `--post-quantum` (agents started from now on), with a 30 s
    /// `--psk-rotation-period`.
    pub post_quantum: bool,
    /// Bytes received and sent so far by each node's device, per peer.
    traffic: BTreeMap<(String, control::Key), (u64, u64)>,
    /// When the traffic was last brought up to date.
    flowed: Instant,
    /// The WireGuard sessions between two keys (the lower first), by when a handshake last
    /// renewed them ([`tunnel`]).
    sessions: BTreeMap<(control::Key, control::Key), Instant>,
    /// Per node and peer, the seconds of handshakes refused under differing preshared keys
    /// since data last flowed: what its engine counts as refused responses.
    refused: BTreeMap<(String, control::Key), u32>,
    /// Per node and peer, when its device last completed a handshake (Unix milliseconds).
    handshaked: BTreeMap<(String, control::Key), i64>,
    /// How many times a second uplink was given a new address.
    renewals: u8,
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Sim {
    /// An empty cluster at a fixed moment whose agents choose leaders by `election` in
    /// location granularity, its files in a fresh directory.
    pub fn new(election: Election) -> Result<Self> {
        Self::meshed(election, Granularity::Location)
    }

    /// [`Sim::new`], the agents meshing with `granularity`.
    pub fn meshed(election: Election, granularity: Granularity) -> Result<Self> {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("kilotun-model-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let start = Instant::now();
        Ok(Self {
            cluster: MemoryCluster::new(),
            nodes: BTreeMap::new(),
            now: Now {
                instant: start,
                unix_ms: 1_800_000_000_000,
            },
            dir,
            joined: 0,
            election,
            granularity,
            family: Family::V4,
            leaders_per_location: 1,
            post_quantum: false,
            traffic: BTreeMap::new(),
            flowed: start,
            sessions: BTreeMap::new(),
            refused: BTreeMap::new(),
            handshaked: BTreeMap::new(),
            renewals: 0,
        })
    }

    /// The name of the `index`th node (in name order, wrapping), if there is any node.
    pub fn nth(&self, index: usize) -> Option<String> {
        let count = self.nodes.len();
        (count > 0).then(|| {
            self.nodes
                .keys()
                .nth(index % count)
                .expect("in range")
                .clone()
        })
    }

    /// How many agents run.
    pub fn running(&self) -> usize {
        self.nodes.values().filter(|n| n.running.is_some()).count()
    }

    /// Who holds `location`'s lease, if anyone.
    pub fn lease_holder(&self, location: &str) -> Option<String> {
        let leases = &self.cluster.snapshot().leases;
        leases
            .get(&control::leader::lease_name(location))?
            .holder
            .clone()
    }

    /// Registers a new node in `location` (as its kubelet would) and starts its agent.
    pub fn join(&mut self, location: &str) -> Result<String> {
        self.joined += 1;
        let i = self.joined;
        let name = format!("n{i:02}");
        let dir = self.dir.join(&name);
        std::fs::create_dir_all(&dir)?;
        let (address, pod_cidr): (IpNet, IpNet) = match self.family {
            Family::V4 => (
                format!("192.168.{}.{}/16", i / 200, 10 + i % 200).parse()?,
                format!("10.42.{i}.0/24").parse()?,
            ),
            Family::V6 => (
                format!("fd00::{:x}/64", 0x10 + u32::from(i)).parse()?,
                format!("fd42:0:0:{i:x}::/64").parse()?,
            ),
        };
        let mut object = KubeNode::default();
        object.metadata.name = Some(name.clone());
        object.metadata.labels = Some(BTreeMap::from([(
            control::node::DEFAULT_TOPOLOGY_LABEL.to_string(),
            location.to_string(),
        )]));
        object.spec = Some(NodeSpec {
            pod_cidr: Some(pod_cidr.to_string()),
            ..NodeSpec::default()
        });
        self.cluster.update(|s| s.put_node(&name, object));
        let kernel = MemKernel::host_at(control::DEFAULT_INTERFACE, address);
        let second = paths::second_address(self.family, i, 0);
        kernel.add_uplink(SECOND_UPLINK, second);
        let node = SimNode {
            location: location.to_string(),
            address,
            pod_cidr,
            key: SecretKey::from_bytes([i; 32]),
            kernel,
            backend: self.cluster.connect(),
            running: None,
            dir,
            frozen: None,
            blocked: false,
            behind_nat: false,
            uplinks: Uplinks {
                second: Some(second),
                ..Uplinks::default()
            },
            index: i,
        };
        self.nodes.insert(name.clone(), node);
        self.start(&name, false)?;
        Ok(name)
    }

    /// Starts `name`'s agent (killing a running one first), restoring its saved peers when
    /// `with_saved_state`.
    pub fn start(&mut self, name: &str, with_saved_state: bool) -> Result<()> {
        self.kill(name);
        let now = self.now;
        let node = self.nodes.get_mut(name).context("no such node")?;
        let key_file = node.key_file();
        // Without saved state: the saved peers are gone, as on a node whose last agent was
        // Kilo's. (The record of the routes kg installed stays: without it, kg claims only the
        // routes on its own link, and a route it left on the private link to a node that left
        // meanwhile would stay, as Kilo's do after a restart.)
        if !with_saved_state {
            let _ = std::fs::remove_file(state::path(&key_file));
        }
        let restored = state::load(&key_file, &node.key, control::DEFAULT_PORT)?;
        let args = agent_args(
            name,
            &key_file,
            self.election,
            self.granularity,
            self.leaders_per_location,
            self.post_quantum,
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let start = Start {
            key: node.key.clone(),
            restored: restored.clone(),
            now,
        };
        // The embedded engine dies with its agent: a new one starts empty.
        let engine = MemDevice::default();
        let backend = Backend::Memory(Arc::clone(&node.backend));
        let kernel = node.kernel.clone();
        let twin = run_to_end(TwinAgent::start_with(&args, backend, kernel, engine, start))?;
        // The saved peers come back before the first reconcile, unless another node holds
        // this location's valid lease and this node is not preferred: then it may have led
        // before it died and its peers are stale.
        let snapshot = self.cluster.snapshot();
        let led_by_another = snapshot.nodes.get(name).is_some_and(|object| {
            let (own, _) =
                control::node::translate_node(object, control::node::DEFAULT_TOPOLOGY_LABEL);
            control::leader::led_by_another(&own, &snapshot.leases, now.unix_ms).is_some()
        });
        if let Some(restored) = restored.filter(|r| !r.peers.is_empty() && !led_by_another) {
            let peers = twin.engine.config().peers;
            anyhow::ensure!(
                peers == restored.peers,
                "{name} restarted with saved state but its engine does not hold the saved peers before the first reconcile"
            );
        }
        node.running = Some(Running {
            twin,
            seen: None,
            last_error: None,
            writes_outside_pass: Vec::new(),
        });
        // The event loop's timers all fire at once when it starts.
        self.fire_due(name);
        Ok(())
    }

    /// Kills `name`'s agent, if it runs: nothing is cleaned up.
    pub fn kill(&mut self, name: &str) {
        self.drop_sessions(name);
        if let Some(node) = self.nodes.get_mut(name) {
            node.running = None;
        }
    }

    /// `name` leaves the cluster: its agent stops and its Node is deleted.
    pub fn leave(&mut self, name: &str) {
        self.kill(name);
        self.nodes.remove(name);
        self.cluster.update(|s| s.remove_node(name));
    }

    /// Changes `name`'s Node object with `change` (as an operator or the kubelet would).
    pub fn edit_node(&mut self, name: &str, change: impl FnOnce(&mut KubeNode)) {
        self.cluster.update(|s| {
            let Some(node) = s.nodes.get(name) else {
                return false;
            };
            let mut node = (**node).clone();
            change(&mut node);
            s.put_node(name, node)
        });
    }

    /// Sets (`Some`) or removes an annotation on `name`'s Node.
    pub fn annotate(&mut self, name: &str, key: &str, value: Option<&str>) {
        self.edit_node(name, |node| {
            let annotations = node.metadata.annotations.get_or_insert_with(BTreeMap::new);
            match value {
                Some(v) => annotations.insert(key.to_string(), v.to_string()),
                None => annotations.remove(key),
            };
        });
    }

    /// Cuts `name`'s agent off from the API server, or reconnects it.
    pub fn set_outage(&mut self, name: &str, on: bool) {
        let snapshot = self.cluster.snapshot();
        if let Some(node) = self.nodes.get_mut(name) {
            node.backend.set_reachable(!on);
            node.frozen = match (on, node.frozen.take()) {
                (true, Some(frozen)) => Some(frozen),
                (true, None) => Some(snapshot),
                (false, _) => None,
            };
        }
    }

    /// Blocks `name`'s WireGuard port, or opens it.
    pub fn set_blocked(&mut self, name: &str, blocked: bool) {
        if let Some(node) = self.nodes.get_mut(name) {
            node.blocked = blocked;
        }
    }

    /// Puts `name` behind NAT, or takes it out, and annotates it as Kilo's NATed nodes are:
    /// `kilo.squat.ai/persistent-keepalive` set (or removed).
    pub fn set_nat(&mut self, name: &str, on: bool) {
        if let Some(node) = self.nodes.get_mut(name) {
            node.behind_nat = on;
        }
        let value = on.then_some(NAT_KEEPALIVE);
        self.annotate(name, control::node::annotation::PERSISTENT_KEEPALIVE, value);
    }

    /// Moves the clock `by`, firing every timer that falls due on the way and delivering the
    /// cluster's changes after each.
    pub fn advance(&mut self, by: Duration) -> Result<()> {
        let end = self.now.instant + by;
        self.deliver()?;
        self.carry_pq()?;
        let mut steps_at = (self.now.instant, 0);
        loop {
            let next = self
                .nodes
                .values()
                .filter_map(|n| n.running.as_ref()?.twin.agent.poll_timeout())
                .map(|(at, _)| at)
                .min();
            let Some(next) = next.filter(|at| *at <= end) else {
                break;
            };
            // Timers due now are fired and set later: one that stays due spins.
            steps_at = match steps_at {
                (at, n) if at >= next => (at, n + 1),
                _ => (next, 0),
            };
            anyhow::ensure!(
                steps_at.1 < MAX_ROUNDS,
                "an agent's timers stayed due at one moment for {MAX_ROUNDS} steps"
            );
            self.now = self
                .now
                .after(next.saturating_duration_since(self.now.instant));
            self.flow();
            let names: Vec<String> = self.nodes.keys().cloned().collect();
            for name in names {
                self.fire_due(&name);
            }
            self.deliver()?;
            self.carry_pq()?;
        }
        self.now = self
            .now
            .after(end.saturating_duration_since(self.now.instant));
        Ok(())
    }

    /// Fires `name`'s timers that are due now, each once, in the agent's own order
    /// ([`crate::agent::Agent::poll_timeout`]).
    fn fire_due(&mut self, name: &str) {
        let mut fired = std::collections::BTreeSet::new();
        loop {
            let Some(running) = self.nodes.get(name).and_then(|n| n.running.as_ref()) else {
                return;
            };
            let due = running.twin.agent.poll_timeout();
            // A timer its pass left due fires again in the next round (where the model says
            // the agent spins), not here.
            let Some((_, timer)) =
                due.filter(|(at, t)| *at <= self.now.instant && !fired.contains(t))
            else {
                return;
            };
            fired.insert(timer);
            self.wake(name, Input::Timeout(timer));
        }
    }

    /// What `name`'s watch shows: the cluster, or what it last saw before losing the API.
    fn visible(&self, name: &str) -> Arc<Snapshot> {
        match &self.nodes[name].frozen {
            Some(frozen) => Arc::clone(frozen),
            None => self.cluster.snapshot(),
        }
    }

    /// `name`'s agent woken by `input`, through the agent's own loop body
    /// ([`crate::agent::Agent::step`]), on what it can see.
    pub(super) fn wake(&mut self, name: &str, input: Input<'_>) {
        let mut snapshot = self.visible(name);
        let now = self.now;
        let Some(node) = self.nodes.get_mut(name) else {
            return;
        };
        let Some(running) = node.running.as_mut() else {
            return;
        };
        let writes = running.twin.engine.calls().writes;
        let woken_by = match &input {
            Input::Timeout(timer) => format!("the {timer:?} timer"),
            Input::PqDatagram { from, .. } => format!("a post-quantum datagram from {from}"),
            Input::Lookups(_) => "lookup answers".to_string(),
            Input::Snapshot | Input::Kernel => format!("{input:?}"),
        };
        let Some(result) = run_to_end(running.twin.agent.step(input, &mut snapshot, now)) else {
            if running.twin.engine.calls().writes != writes {
                running.writes_outside_pass.push(woken_by);
            }
            return;
        };
        running.last_error = result.err().map(|e| format!("{e:#}"));
        running.seen = Some(snapshot);
        // A rotated key is the node's from now on (its key file holds it too).
        let device = crate::agent::shells::Device::configuration(&running.twin.engine).ok();
        node.key = device
            .and_then(|d| d.interface.private_key)
            .unwrap_or(node.key.clone());
    }

    /// Delivers the cluster's changes to every running agent that can see them, round after
    /// round, until a round changes nothing.
    fn deliver(&mut self) -> Result<()> {
        for _ in 0..MAX_ROUNDS {
            let mut delivered = false;
            let names: Vec<String> = self.nodes.keys().cloned().collect();
            for name in names {
                let visible = self.visible(&name);
                let stale = self.nodes[&name]
                    .running
                    .as_ref()
                    .is_some_and(|r| !r.seen.as_ref().is_some_and(|s| Arc::ptr_eq(s, &visible)));
                if stale {
                    self.wake(&name, Input::Snapshot);
                    delivered = true;
                }
            }
            if !delivered {
                return Ok(());
            }
        }
        anyhow::bail!(
            "the agents still answered each other's writes after {MAX_ROUNDS} rounds at one moment"
        )
    }
}

/// Runs `work` to its end on this thread, with no runtime: every shell of the model is an
/// in-memory twin that answers at once, so nothing it awaits waits on a reactor or a timer (one
/// that did would panic here, and the model would say so).
fn run_to_end<T>(work: impl std::future::Future<Output = T>) -> T {
    futures::executor::block_on(work)
}
