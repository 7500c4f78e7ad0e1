//! A Kilo cluster in network namespaces: each node is a namespace running its own `kg` on the
//! file backend (one shared cluster directory), with its own key file and TUN device. Locations
//! are bridges in a router namespace that routes between them; pod CIDRs are addresses on a
//! port-less bridge in each node.

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kilotun::backend::file::FileBackend;

use super::{output, run, unique, Impl, Netns, WgDevice};

pub fn kgctl_bin() -> &'static str {
    env!("CARGO_BIN_EXE_kgctl")
}

pub fn kg_bin() -> &'static str {
    env!("CARGO_BIN_EXE_kg")
}

/// Gives `ns`'s `eth0` the address `ip`/24, brings it up and routes by default via `gateway`.
fn up_with_default_route(ns: &Netns, ip: &str, gateway: &str) {
    ns.run(&["ip", "addr", "add", &format!("{ip}/24"), "dev", "eth0"]);
    ns.run(&["ip", "link", "set", "eth0", "up"]);
    ns.run(&["ip", "route", "add", "default", "via", gateway]);
}

/// One node: its namespace, addresses and `kg` process.
pub struct KgNode {
    pub name: String,
    pub ns: Netns,
    pub ip: String,
    pub pod_ip: String,
    pub iface: String,
    pub log: PathBuf,
    /// `/etc/netns/<ns>`, when the test gave the node its own resolv.conf.
    pub etc: Option<PathBuf>,
    child: Option<Child>,
}

impl KgNode {
    /// Drops the node's WireGuard traffic (UDP 51820, in and out) with iptables, as a firewall
    /// or a security group would; kg, its API connection and every other packet stay up.
    pub fn block_wireguard(&self) {
        for (chain, port) in [
            ("INPUT", "--dport"),
            ("OUTPUT", "--dport"),
            ("INPUT", "--sport"),
        ] {
            self.ns.run(&[
                "iptables", "-I", chain, "-p", "udp", port, "51820", "-j", "DROP",
            ]);
        }
    }

    /// `wg show <iface> <what>` inside the node.
    pub fn wg(&self, what: &str) -> String {
        String::from_utf8_lossy(&self.ns.output(&["wg", "show", &self.iface, what]).stdout)
            .into_owned()
    }

    /// The endpoint this node's device sends to for the peer whose public key is `key`
    /// (base64), from `wg show endpoints`; empty when there is none.
    pub fn endpoint_of_key(&self, key: &str) -> String {
        self.wg("endpoints")
            .lines()
            .find(|l| !key.is_empty() && l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap_or("")
            .to_string()
    }

    /// `wg show <iface> preshared-keys` inside the node, by peer key (`(none)` for a peer
    /// without one).
    #[allow(dead_code)]
    pub fn preshared_keys(&self) -> BTreeMap<String, String> {
        self.wg("preshared-keys")
            .lines()
            .filter_map(|l| {
                let mut parts = l.split_whitespace();
                Some((parts.next()?.to_string(), parts.next()?.to_string()))
            })
            .collect()
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// SIGKILL, as the OOM killer or a node crash would: no clean-up runs.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub fn stop(&mut self) {
        if let Some(child) = self.child.take() {
            terminate(child);
        }
    }

    /// Lets go of the running kg so a successor can start beside it, as a surge rollout's new
    /// pod does: the node's log moves to a new file, and the old process is the caller's.
    pub fn detach(&mut self) -> Detached {
        let log = self.log.clone();
        let mut next = log.clone().into_os_string();
        next.push(".next");
        self.log = next.into();
        Detached {
            child: self.child.take(),
            log,
        }
    }
}

/// A kg a test let go of with [`KgNode::detach`]; killed if still running when dropped.
pub struct Detached {
    child: Option<Child>,
    /// Its log.
    pub log: PathBuf,
}

impl Detached {
    /// SIGTERM, then waits (SIGKILL after 5 s); true when it exited by itself with status 0.
    pub fn stop(&mut self) -> bool {
        self.child
            .take()
            .and_then(terminate)
            .is_some_and(|status| status.success())
    }

    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Detached {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// SIGTERM, then SIGKILL if `child` has not exited 5 s later.
/// SIGTERM, then SIGKILL after 5 s; the exit status when it exited by itself.
fn terminate(mut child: Child) -> Option<std::process::ExitStatus> {
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if let Some(status) = child.try_wait().ok().flatten() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

impl KgNode {
    /// `GET path` against kg's HTTP server (`:1107`) from inside the node: (status, body).
    pub fn http_get(&self, path: &str) -> (u16, String) {
        super::http_get(&self.ns, "127.0.0.1:1107", path)
    }

    /// kg's `/status`, when it answers with one.
    #[allow(dead_code)]
    pub fn status(&self) -> Option<control::status::NodeStatus> {
        let (code, body) = self.http_get("/status");
        if code != 200 {
            return None;
        }
        serde_json::from_str(&body).ok()
    }

    /// The events kg's `/status` holds, oldest first; none while it does not answer.
    #[allow(dead_code)]
    pub fn events(&self) -> Vec<control::journal::Event> {
        self.status().map(|s| s.events).unwrap_or_default()
    }

    /// The events of `reason` in kg's `/status`, oldest first.
    #[allow(dead_code)]
    pub fn events_of(&self, reason: control::journal::Reason) -> Vec<control::journal::Event> {
        self.events()
            .into_iter()
            .filter(|e| e.reason == reason)
            .collect()
    }

    /// Makes the node resolve names through `nameserver` (`ip netns exec` bind-mounts it).
    pub fn use_nameserver(&mut self, nameserver: &str) {
        let etc = PathBuf::from("/etc/netns").join(&self.ns.name);
        fs::create_dir_all(&etc).unwrap();
        fs::write(
            etc.join("resolv.conf"),
            format!("nameserver {nameserver}\n"),
        )
        .unwrap();
        self.etc = Some(etc);
    }

    /// Makes the node's own name resolve from its hosts file, as a host's usually does (Debian
    /// writes it there; `ip netns exec` bind-mounts this one): without it the lookup that kg's
    /// start includes waits for a DNS server the namespace cannot reach, a second per start.
    #[allow(dead_code)]
    pub fn resolve_own_name(&mut self) {
        let etc = PathBuf::from("/etc/netns").join(&self.ns.name);
        fs::create_dir_all(&etc).unwrap();
        fs::write(
            etc.join("hosts"),
            format!("127.0.0.1 localhost\n{} {}\n", self.ip, self.name),
        )
        .unwrap();
        self.etc = Some(etc);
    }
}

impl Drop for KgNode {
    fn drop(&mut self) {
        self.stop();
        // Anything else the test started in the namespace (wireguard-go, say).
        let pids = String::from_utf8_lossy(&output(&["ip", "netns", "pids", &self.ns.name]).stdout)
            .into_owned();
        for pid in pids
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
        {
            // SAFETY: signalling a process the test started in its own namespace.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        if let Some(etc) = self.etc.take() {
            let _ = fs::remove_dir_all(etc);
        }
        // A kg killed with SIGKILL (and never restarted) leaves its UAPI socket behind in the
        // shared directory.
        let _ = fs::remove_file(format!("/var/run/wireguard/{}.sock", self.iface));
    }
}

/// A dnsmasq serving names from a hosts directory it watches.
pub struct Dns {
    pub ip: String,
    hosts: PathBuf,
    child: Child,
}

impl Dns {
    /// Starts dnsmasq in its own namespace on `segment`'s bridge.
    pub fn start(cluster: &mut Cluster, segment: &str) -> Self {
        let ns = Netns::new();
        let ip = cluster.attach(&ns, segment, 53);
        let hosts = cluster.work.join("hosts.d");
        fs::create_dir_all(&hosts).unwrap();
        let child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &ns.name,
                "dnsmasq",
                "--keep-in-foreground",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
            ])
            .arg(format!("--listen-address={ip}"))
            .arg(format!("--hostsdir={}", hosts.display()))
            .args([
                "--local-ttl=0",
                "--pid-file=",
                "--user=root",
                "--group=root",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawning dnsmasq");
        cluster.extra.push(ns);
        Self { ip, hosts, child }
    }

    /// Points `name` at `ip` (dnsmasq picks the change up by itself).
    pub fn set(&self, name: &str, ip: &str) {
        let tmp = self.hosts.join(".tmp");
        fs::write(&tmp, format!("{ip} {name}\n")).unwrap();
        fs::rename(&tmp, self.hosts.join(name)).unwrap();
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The cluster: router, nodes, the shared directory.
pub struct Cluster {
    pub dir: PathBuf,
    pub work: PathBuf,
    pub router: Netns,
    pub nodes: Vec<KgNode>,
    bridges: BTreeMap<String, (String, u8)>,
    /// Other namespaces (NAT boxes, DNS servers), removed with the cluster.
    pub extra: Vec<Netns>,
}

/// A node to create: name, location, and whether it starts with extra annotations.
pub struct NodeSpec<'a> {
    pub name: &'a str,
    pub location: &'a str,
    pub annotations: &'a [(&'a str, &'a str)],
}

impl Cluster {
    /// A cluster of `nodes` (name, location, `kilo.squat.ai/allowed-location-ips` or `""` for
    /// none), each on its location's subnet as host 1, 2, ... in order, kg started on each
    /// with `--encapsulate=never --resync-period=1s`; returned once every pod reaches every
    /// other.
    #[allow(dead_code)]
    pub fn claiming_location_ips(locations: &[&str], nodes: &[(&str, &str, &str)]) -> Self {
        let mut c = Self::new(locations);
        for (i, (name, location, claim)) in nodes.iter().enumerate() {
            let annotations: &[(&str, &str)] = if claim.is_empty() {
                &[]
            } else {
                &[("kilo.squat.ai/allowed-location-ips", claim)]
            };
            let spec = NodeSpec {
                name,
                location,
                annotations,
            };
            c.add_node(&spec, i as u8 + 1);
        }
        for i in 0..nodes.len() {
            c.start_kg(i, &["--encapsulate=never", "--resync-period=1s"]);
        }
        let meshed = c.wait_for(Duration::from_secs(40), |c| c.all_pods_reachable().is_ok());
        assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
        c
    }

    /// Creates the router and one bridge (subnet `192.168.<10·k>.0/24`) per location.
    pub fn new(locations: &[&str]) -> Self {
        let work = std::env::temp_dir().join(unique("kgcluster"));
        let dir = work.join("cluster");
        fs::create_dir_all(&dir).unwrap();
        let router = Netns::new();
        router.run(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        let mut bridges = BTreeMap::new();
        for (k, loc) in locations.iter().enumerate() {
            let octet = 10 * (k as u8 + 1);
            let br = format!("br{k}");
            router.run(&["ip", "link", "add", &br, "type", "bridge"]);
            router.run(&[
                "ip",
                "addr",
                "add",
                &format!("192.168.{octet}.254/24"),
                "dev",
                &br,
            ]);
            router.run(&["ip", "link", "set", &br, "up"]);
            bridges.insert(loc.to_string(), (br, octet));
        }
        Self {
            dir,
            work,
            router,
            nodes: Vec::new(),
            bridges,
            extra: Vec::new(),
        }
    }

    /// A cluster with plain nodes `(name, location)`, numbered from 1 in the given order.
    pub fn with_nodes(locations: &[&str], nodes: &[(&str, &str)]) -> Self {
        let mut c = Self::new(locations);
        for (i, (name, location)) in nodes.iter().enumerate() {
            c.add_node(
                &NodeSpec {
                    name,
                    location,
                    annotations: &[],
                },
                i as u8 + 1,
            );
        }
        c
    }

    /// n1 and n2 in east, n3 in west, each running kg with `extra`, returned once every node
    /// reaches every other node's pods (the test fails if that takes over 30 s).
    pub fn meshed_east_west(extra: &[&str]) -> Self {
        let mut c = Self::with_nodes(
            &["east", "west"],
            &[("n1", "east"), ("n2", "east"), ("n3", "west")],
        );
        for i in 0..3 {
            c.start_kg(i, extra);
        }
        let meshed = c.wait_for(Duration::from_secs(30), |c| c.all_pods_reachable().is_ok());
        assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
        c
    }

    /// Plugs `ns` into the bridge of `segment` as `eth0` with address `192.168.<segment>.<host>`
    /// and a default route through the router. Returns the address.
    pub fn attach(&self, ns: &Netns, segment: &str, host: u8) -> String {
        let (bridge, octet) = self.bridges[segment].clone();
        self.plug(ns, &bridge);
        let ip = format!("192.168.{octet}.{host}");
        up_with_default_route(ns, &ip, &format!("192.168.{octet}.254"));
        ip
    }

    /// Plugs `ns` into the router's `bridge` through a veth whose inner end is `eth0`.
    fn plug(&self, ns: &Netns, bridge: &str) {
        let veth = unique("ve");
        run(&[
            "ip", "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", &ns.name,
        ]);
        run(&["ip", "link", "set", &veth, "netns", &self.router.name]);
        self.router
            .run(&["ip", "link", "set", &veth, "master", bridge]);
        self.router.run(&["ip", "link", "set", &veth, "up"]);
    }

    /// Adds node number `index` (1-based, unique): namespace, underlay, pod bridge, Node file.
    pub fn add_node(&mut self, spec: &NodeSpec<'_>, index: u8) -> usize {
        let ns = Netns::new();
        let ip = self.attach(&ns, spec.location, index);
        self.add_node_in(ns, ip, spec, index)
    }

    /// Like [`Cluster::add_node`], but plugged into the bridge of `segment` whatever the
    /// node's Kilo location: nodes of several locations on one L2 subnet.
    pub fn add_node_on(&mut self, spec: &NodeSpec<'_>, segment: &str, index: u8) -> usize {
        let ns = Netns::new();
        let ip = self.attach(&ns, segment, index);
        self.add_node_in(ns, ip, spec, index)
    }

    /// Like [`Cluster::add_node`], but on another subnet (`192.168.<octet>.<index>/24`) of the
    /// same location's bridge: the router routes between the location's subnets.
    pub fn add_node_in_subnet(&mut self, spec: &NodeSpec<'_>, index: u8, octet: u8) -> usize {
        let (bridge, _) = self.bridges[spec.location].clone();
        let gateway = format!("192.168.{octet}.254");
        self.router.run(&[
            "ip",
            "addr",
            "replace",
            &format!("{gateway}/24"),
            "dev",
            &bridge,
        ]);
        let ns = Netns::new();
        self.plug(&ns, &bridge);
        let ip = format!("192.168.{octet}.{index}");
        up_with_default_route(&ns, &ip, &gateway);
        self.add_node_in(ns, ip, spec, index)
    }

    /// Adds node `index` behind a masquerading NAT box plugged into `spec.location`: the node
    /// has only the private address `10.99.<index>.2`; the NAT box is `192.168.<loc>.<100+index>`
    /// (returned).
    pub fn add_nated_node(&mut self, spec: &NodeSpec<'_>, index: u8) -> (usize, String) {
        let nat = Netns::new();
        let outside = self.attach(&nat, spec.location, 100 + index);
        nat.run(&["sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        let ns = Netns::new();
        run(&[
            "ip", "link", "add", "lan0", "netns", &nat.name, "type", "veth", "peer", "name",
            "eth0", "netns", &ns.name,
        ]);
        nat.run(&[
            "ip",
            "addr",
            "add",
            &format!("10.99.{index}.1/24"),
            "dev",
            "lan0",
        ]);
        nat.run(&["ip", "link", "set", "lan0", "up"]);
        nat.run(&[
            "iptables",
            "-t",
            "nat",
            "-A",
            "POSTROUTING",
            "-o",
            "eth0",
            "-j",
            "MASQUERADE",
        ]);
        let ip = format!("10.99.{index}.2");
        up_with_default_route(&ns, &ip, &format!("10.99.{index}.1"));
        let i = self.add_node_in(ns, ip, spec, index);
        self.extra.push(nat);
        (i, outside)
    }

    fn add_node_in(&mut self, ns: Netns, ip: String, spec: &NodeSpec<'_>, index: u8) -> usize {
        let pod_ip = format!("10.42.{index}.1");
        ns.run(&["ip", "link", "add", "pods0", "type", "bridge"]);
        ns.run(&["ip", "addr", "add", &format!("{pod_ip}/24"), "dev", "pods0"]);
        ns.run(&["ip", "link", "set", "pods0", "up"]);
        for key in [
            "net.ipv4.ip_forward=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ] {
            ns.run(&["sysctl", "-qw", key]);
        }
        let mut annotations = format!("    kilo.squat.ai/location: \"{}\"\n", spec.location);
        for (k, v) in spec.annotations {
            annotations += &format!("    {k}: {v:?}\n");
        }
        let yaml = format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {}\n  annotations:\n{annotations}spec:\n  podCIDR: 10.42.{index}.0/24\n",
            spec.name
        );
        fs::write(self.dir.join(format!("{}.yaml", spec.name)), yaml).unwrap();
        self.nodes.push(KgNode {
            name: spec.name.to_string(),
            ns,
            ip,
            pod_ip,
            iface: unique("kg"),
            etc: None,
            log: self.work.join(format!("{}.log", spec.name)),
            child: None,
        });
        self.nodes.len() - 1
    }

    /// Replaces the pod CIDRs of `node`'s Node file, as a dual-stack cluster lists them:
    /// `spec.podCIDR` is the first, `spec.podCIDRs` all of them.
    pub fn set_pod_cidrs(&self, node: &str, cidrs: &[&str]) {
        let path = self.dir.join(format!("{node}.yaml"));
        let text = fs::read_to_string(&path).unwrap();
        let (head, _) = text.split_once("spec:\n").expect("a Node file with a spec");
        let mut spec = format!("spec:\n  podCIDR: {}\n  podCIDRs:\n", cidrs[0]);
        for cidr in cidrs {
            spec += &format!("  - {cidr}\n");
        }
        fs::write(&path, format!("{head}{spec}")).unwrap();
    }

    /// Cordons `name`: `spec.unschedulable` in its Node file, written whole in one rename.
    pub fn cordon(&self, name: &str) {
        let path = self.dir.join(format!("{name}.yaml"));
        let text = fs::read_to_string(&path).unwrap();
        let mut value: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
        value["spec"]["unschedulable"] = serde_json::Value::Bool(true);
        let tmp = path.with_extension("tmp");
        fs::write(&tmp, serde_saphyr::to_string(&value).unwrap()).unwrap();
        fs::rename(&tmp, &path).unwrap();
    }

    /// Starts `kg` on node `i` with the file backend and `extra` flags.
    pub fn start_kg(&mut self, i: usize, extra: &[&str]) {
        self.start_kg_with_env(i, extra, &[]);
    }

    /// [`Cluster::start_kg`] with extra environment variables.
    pub fn start_kg_with_env(&mut self, i: usize, extra: &[&str], env: &[(&str, String)]) {
        self.start_kg_wrapped(i, &[], extra, env);
    }

    /// [`Cluster::start_kg_with_env`] with kg run through `wrapper` inside the namespace
    /// (`ip netns exec <ns> <wrapper...> kg ...`); the wrapper must exec kg in place.
    pub fn start_kg_wrapped(
        &mut self,
        i: usize,
        wrapper: &[&str],
        extra: &[&str],
        env: &[(&str, String)],
    ) {
        let node = &mut self.nodes[i];
        let log = fs::File::create(&node.log).unwrap();
        let key = self.work.join("keys").join(&node.name);
        let mut args: Vec<String> = vec!["netns".into(), "exec".into(), node.ns.name.clone()];
        args.extend(wrapper.iter().map(|s| s.to_string()));
        args.extend([
            kg_bin().into(),
            "--backend=file".into(),
            format!("--cluster-dir={}", self.dir.display()),
            format!("--hostname={}", node.name),
            format!("--interface={}", node.iface),
            format!("--key-file={}", key.display()),
            // Never the host's real conflist: the namespaces share the filesystem.
            format!(
                "--cni-path={}",
                self.work.join(format!("{}.conflist", node.name)).display()
            ),
            "--resync-period=2s".into(),
            "--threads=1".into(),
            "--log-level=debug".into(),
        ]);
        args.extend(extra.iter().map(|s| s.to_string()));
        let child = Command::new("ip")
            .args(&args)
            .env("KG_LOG", "debug,kilotun=trace,netlink_proto=error,hickory_net=warn,hickory_resolver=warn,hickory_proto=warn")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawning kg");
        node.child = Some(child);
    }

    /// Runs `command` as node `i`'s kg (for a kg started some other way, such as in a
    /// container): its output goes to the node's log, and stopping the node signals it.
    pub fn start_kg_command(&mut self, i: usize, mut command: Command) {
        let node = &mut self.nodes[i];
        let log = fs::File::create(&node.log).unwrap();
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("spawning kg");
        node.child = Some(child);
    }

    pub fn node(&self, name: &str) -> &KgNode {
        self.nodes.iter().find(|n| n.name == name).unwrap()
    }

    /// The nodes of `names` whose WireGuard link is up: the leaders.
    pub fn leading(&self, names: &[&str]) -> Vec<String> {
        names
            .iter()
            .filter(|n| {
                let node = self.node(n);
                let out = node.ns.output(&["ip", "-br", "link", "show", &node.iface]);
                let text = String::from_utf8_lossy(&out.stdout);
                text.contains(" UP ") || text.contains("UNKNOWN")
            })
            .map(|n| n.to_string())
            .collect()
    }

    /// The nodes whose pod range is among the allowed IPs of `viewer`'s WireGuard peer for
    /// `leader`: the share `leader` leads, as `viewer` routes it.
    #[allow(dead_code)]
    pub fn routed_through(&self, viewer: &str, leader: &str) -> Vec<String> {
        let key = self.node(leader).wg("public-key").trim().to_string();
        let allowed = self.node(viewer).wg("allowed-ips");
        let Some(line) = allowed.lines().find(|l| l.starts_with(&key)) else {
            return Vec::new();
        };
        let ranges: Vec<&str> = line.split_whitespace().skip(1).collect();
        self.nodes
            .iter()
            .filter(|n| {
                let prefix = n.pod_ip.rsplit_once('.').map_or("", |(p, _)| p);
                ranges.contains(&format!("{prefix}.0/24").as_str())
            })
            .map(|n| n.name.clone())
            .collect()
    }

    /// The holder of `location`'s lease in the cluster directory, if any.
    pub fn lease_holder(&self, location: &str) -> Option<String> {
        self.holder_of(&format!("kilotun-leader-{location}"))
    }

    /// The holder of the lease `name` in the cluster directory, if any.
    pub fn holder_of(&self, name: &str) -> Option<String> {
        let path = self.dir.join(format!("lease-{name}.yaml"));
        let value: serde_json::Value =
            serde_saphyr::from_str(&fs::read_to_string(path).ok()?).ok()?;
        value["spec"]["holderIdentity"].as_str().map(str::to_string)
    }

    /// Sets (or with `None` removes) annotations on a Node the way another writer would.
    pub fn annotate(&self, node: &str, changes: &[(&str, Option<&str>)]) {
        let backend = FileBackend::open(&self.dir).unwrap();
        let changes = changes
            .iter()
            .map(|(k, v)| (k.to_string(), v.map(str::to_string)))
            .collect();
        backend.patch_annotations(node, &changes).unwrap();
    }

    /// The annotations of `node` as stored in the cluster directory.
    pub fn annotations(&self, node: &str) -> BTreeMap<String, String> {
        let backend = FileBackend::open(&self.dir).unwrap();
        let snapshot = backend.subscribe().borrow().clone();
        snapshot
            .nodes
            .get(node)
            .and_then(|n| n.metadata.annotations.clone())
            .unwrap_or_default()
    }

    /// Waits until `check` holds, up to `timeout`.
    /// The timeout is multiplied by `KILOTUN_WAIT_SCALE` (1 by default): under TCG emulation
    /// (`tests/real/kernel_vm.rs` sets 4) kg starts many times slower, and how long these
    /// waits take is not what the tests are about.
    pub fn wait_for(&self, timeout: Duration, mut check: impl FnMut(&Self) -> bool) -> bool {
        let deadline = Instant::now() + timeout.mul_f64(wait_scale());
        while Instant::now() < deadline {
            if check(self) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        check(self)
    }

    /// The endpoint `on`'s device sends to for node `peer`, as `wg show endpoints` prints it
    /// (empty while `peer` has no key or `on` no such peer).
    #[allow(dead_code)]
    pub fn peer_endpoint(&self, on: &str, peer: &str) -> String {
        let key = self
            .annotations(peer)
            .get("kilo.squat.ai/key")
            .cloned()
            .unwrap_or_default();
        self.node(on).endpoint_of_key(&key)
    }

    /// True when node `from` gets a reply from `to`'s pod address within a second.
    #[allow(dead_code)]
    pub fn pod_pings(&self, from: &str, to: &str) -> bool {
        let target = self.node(to).pod_ip.clone();
        super::ping_ok(&self.node(from).ns.name, &target, Duration::from_secs(1))
    }

    /// Every node pings every other node's pod address (one reply each).
    pub fn all_pods_reachable(&self) -> Result<(), String> {
        for a in &self.nodes {
            for b in &self.nodes {
                if a.name == b.name {
                    continue;
                }
                // From a's pod address, as pod traffic is; up to 3 echoes, one answer suffices.
                let out = output(&[
                    "ip", "netns", "exec", &a.ns.name, "ping", "-c", "3", "-i", "0.2", "-w", "2",
                    "-W", "1", "-I", &a.pod_ip, &b.pod_ip,
                ]);
                if !out.status.success() {
                    return Err(format!(
                        "{} cannot reach {}'s pod address {}",
                        a.name, b.name, b.pod_ip
                    ));
                }
            }
        }
        Ok(())
    }

    /// Lines of every node's log that say a route or rule change failed.
    pub fn failed_route_changes(&self) -> Vec<String> {
        self.nodes
            .iter()
            .flat_map(|n| {
                n.log_text()
                    .lines()
                    .filter(|l| {
                        l.contains("route change failed") || l.contains("rule change failed")
                    })
                    .map(|l| format!("{}: {l}", n.name))
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// Routes of every node that mix families: an IPv4 destination through an IPv6 gateway is
    /// allowed (`via inet6`, on the underlay), a route whose source is of the other family is
    /// not, and neither is one through the WireGuard link whose gateway is of the other family.
    pub fn mixed_routes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for n in &self.nodes {
            for family in ["-4", "-6"] {
                let text =
                    n.ns.output(&["ip", family, "route", "show", "table", "all"])
                        .stdout;
                for line in String::from_utf8_lossy(&text).lines() {
                    let v6 = family == "-6";
                    let words: Vec<&str> = line.split_whitespace().collect();
                    let after = |key: &str| {
                        words
                            .iter()
                            .position(|w| *w == key)
                            .and_then(|i| words.get(i + 1))
                            .copied()
                    };
                    let src_mixed = after("src").is_some_and(|s| s.contains(':') != v6);
                    let via_mixed = after("dev") == Some(n.iface.as_str())
                        && after("via").is_some_and(|g| g == "inet6" || g.contains(':') != v6);
                    if src_mixed || via_mixed {
                        out.push(format!("{}: {line}", n.name));
                    }
                }
            }
        }
        out
    }

    /// Per node, how many times its kg has applied a WireGuard configuration or reconciled
    /// routes so far: unchanged across resyncs in a steady state (Kilo's
    /// reconfigure-every-resync problem, issues #82 and #273).
    pub fn reconfigurations(&self) -> Vec<usize> {
        self.nodes
            .iter()
            .map(|n| {
                let (_, metrics) = n.http_get("/metrics");
                let counted = |name: &str| super::metric_value(&metrics, name).unwrap_or(0.0);
                (counted("kilotun_wireguard_configurations_total")
                    + counted("kilotun_route_changes_total")) as usize
            })
            .collect()
    }

    /// Logs of every node, for failure messages.
    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                let routes =
                    String::from_utf8_lossy(&n.ns.output(&["ip", "route"]).stdout).into_owned();
                let links = String::from_utf8_lossy(&n.ns.output(&["ip", "-br", "addr"]).stdout)
                    .into_owned();
                let wg = String::from_utf8_lossy(&n.ns.output(&["wg", "show", &n.iface]).stdout)
                    .into_owned();
                format!(
                    "==== {} ====\n{}\n---- routes\n{routes}---- addresses\n{links}---- wg\n{wg}\n",
                    n.name,
                    n.log_text()
                )
            })
            .collect()
    }
}

/// A machine outside the cluster joined as a Kilo Peer: a userspace WireGuard device in its own
/// namespace on a location's bridge, configured from `kgctl showconf peer` as Kilo's docs have
/// users do. It has no listen port of its own (the kernel picks one) and keeps its tunnels alive.
pub struct Laptop {
    pub device: WgDevice,
    pub ns: Netns,
    /// The address it holds in the mesh (`<ip>/32`, the Peer's allowed IP).
    pub ip: String,
    /// Its IPv6 address in the mesh (`<ipv6>/128`, a second allowed IP), if it has one.
    pub ipv6: Option<String>,
    conf: PathBuf,
}

impl Laptop {
    /// Plugs a new laptop into `segment` as host `host`, writes its Peer (allowed IP
    /// `10.5.0.<host>/32`, keepalive `keepalive` s) into the cluster directory, and configures
    /// its device from `kgctl showconf peer`, with a route to the pods over the device.
    pub fn join(cluster: &Cluster, name: &str, segment: &str, host: u8, keepalive: u32) -> Self {
        Self::join_announcing(cluster, name, segment, host, keepalive, None)
    }

    /// [`Laptop::join`], with the Peer announcing `announced` as its public key instead of the
    /// device's own (a wrong key, as a stale or mistyped Peer has).
    pub fn join_announcing(
        cluster: &Cluster,
        name: &str,
        segment: &str,
        host: u8,
        keepalive: u32,
        announced: Option<&str>,
    ) -> Self {
        Self::join_with(cluster, name, segment, host, keepalive, announced, false)
    }

    /// [`Laptop::join`] with an IPv6 address in the mesh too: its Peer also allows
    /// `fd05::<host>/128`, and it routes the IPv6 pods (`fd42::/16`) over the device.
    pub fn join_dual_stack(
        cluster: &Cluster,
        name: &str,
        segment: &str,
        host: u8,
        keepalive: u32,
    ) -> Self {
        Self::join_with(cluster, name, segment, host, keepalive, None, true)
    }

    fn join_with(
        cluster: &Cluster,
        name: &str,
        segment: &str,
        host: u8,
        keepalive: u32,
        announced: Option<&str>,
        dual_stack: bool,
    ) -> Self {
        let ns = Netns::new();
        cluster.attach(&ns, segment, host);
        let device = WgDevice::start(&ns, Impl::Kilotun);
        let ip = format!("10.5.0.{host}");
        let ipv6 = dual_stack.then(|| format!("fd05::{host}"));
        let ipv6_line = ipv6
            .as_ref()
            .map(|a| format!("  - {a}/128\n"))
            .unwrap_or_default();
        let peer_yaml = format!(
            "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: {name}\nspec:\n  allowedIPs:\n  - {ip}/32\n{ipv6_line}  publicKey: {}\n  persistentKeepalive: {keepalive}\n",
            announced.unwrap_or(&device.public_key)
        );
        fs::write(cluster.dir.join(format!("{name}.yaml")), peer_yaml).unwrap();
        let dir = format!("--cluster-dir={}", cluster.dir.display());
        let conf = run(&[
            kgctl_bin(),
            "--backend=file",
            &dir,
            "showconf",
            "peer",
            name,
        ]);
        let conf_path = cluster.work.join(format!("{name}.conf"));
        fs::write(&conf_path, &conf).unwrap();
        let laptop = Self {
            device,
            ns,
            ip,
            ipv6,
            conf: conf_path,
        };
        laptop.bring_up();
        laptop
    }

    /// The `[Peer]` sections kgctl wrote for this laptop.
    pub fn conf(&self) -> String {
        fs::read_to_string(&self.conf).unwrap()
    }

    fn bring_up(&self) {
        let d = &self.device;
        d.wg(&["set", &d.name, "private-key", &d.key_file]);
        d.wg(&["addconf", &d.name, self.conf.to_str().unwrap()]);
        d.ip(&["addr", "add", &format!("{}/32", self.ip), "dev", &d.name]);
        d.ip(&["link", "set", &d.name, "up"]);
        d.ip(&["route", "add", "10.42.0.0/16", "dev", &d.name]);
        if let Some(ipv6) = &self.ipv6 {
            let address = format!("{ipv6}/128");
            d.ip(&["-6", "addr", "add", &address, "dev", &d.name, "nodad"]);
            d.ip(&["-6", "route", "add", "fd42::/16", "dev", &d.name]);
        }
    }

    /// Stops the device and starts a new one with the same private key and configuration;
    /// it gets a new ephemeral port, as a restarted client would.
    pub fn restart(&mut self) {
        let key = fs::read_to_string(&self.device.key_file).unwrap();
        let mut device = WgDevice::start(&self.ns, Impl::Kilotun);
        fs::write(&device.key_file, &key).unwrap();
        device.public_key = self.device.public_key.clone();
        drop(std::mem::replace(&mut self.device, device));
        self.bring_up();
    }

    /// The UDP port the device listens on.
    pub fn port(&self) -> String {
        self.device
            .wg(&["show", &self.device.name, "listen-port"])
            .trim()
            .to_string()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.stop();
        }
        self.nodes.clear();
        self.extra.clear();
        let _ = fs::remove_dir_all(&self.work);
    }
}

/// How much slower than this machine the tests run: `KILOTUN_WAIT_SCALE` (1 by default;
/// `tests/real/kernel_vm.rs` sets 4 under TCG emulation, where kg starts many times slower).
/// Waits and latency bounds that are not about the emulator are multiplied by it.
pub fn wait_scale() -> f64 {
    std::env::var("KILOTUN_WAIT_SCALE")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s >= 1.0)
        .unwrap_or(1.0)
}
