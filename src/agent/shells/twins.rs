//! In-memory twins of the shells ([`super`]) for tests and benchmarks: each holds the
//! state the real one would change on the host and counts every call, split into reads (a
//! netlink dump, `iptables -S`, a UAPI `get`) and writes.

use std::sync::Arc;

use anyhow::Result;
use control::iptables::RuleSet;
use control::routes::{apply_ops, Route, RouteOp, RoutePlan, MAIN_TABLE};
use ipnet::IpNet;
use parking_lot::Mutex;

use super::netlink::Link;
use super::{Firewall, Kernel};

mod device;
pub use device::MemDevice;

/// What a twin was asked to do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Calls {
    /// Calls that read state (a dump, a listing, a `get`).
    pub reads: u64,
    /// Calls that change state.
    pub writes: u64,
}

#[derive(Debug, Default)]
struct KernelState {
    links: Vec<Link>,
    addresses: Vec<(u32, IpNet)>,
    default_link: Option<u32>,
    routes: RoutePlan,
    calls: Calls,
    /// The kernel has IPIP: `add_ipip` creates the link.
    ipip: bool,
    /// The kernel has `ip6_tunnel`: `add_ip6tnl` creates the link.
    ip6tnl: bool,
    /// The kernel has WireGuard: `add_wireguard` creates the link.
    wireguard: bool,
    /// The kind of each link that has one, by name.
    kinds: std::collections::BTreeMap<String, String>,
    /// `set_up` fails, as on a host whose link cannot be brought up.
    refuse_link_up: bool,
    /// Every change of links, addresses and routes fails and changes nothing, as on a host
    /// whose netlink refuses them (a full table, a lost capability).
    refuse_changes: bool,
    /// The highest index a link was given: as the kernel's, an index is never given twice.
    highest_index: u32,
}

impl KernelState {
    /// Adds a link called `name` of `kind` (down, with `mtu`) unless one exists.
    fn add_link(&mut self, name: &str, kind: &str, mtu: u32) {
        if !self.links.iter().any(|l| l.name == name) {
            self.kinds.insert(name.to_string(), kind.to_string());
            let highest = self.links.iter().map(|l| l.index).max().unwrap_or(0);
            let index = highest.max(self.highest_index) + 1;
            self.highest_index = index;
            self.links.push(Link {
                index,
                name: name.to_string(),
                mtu,
                up: false,
            });
        }
    }
}

/// An in-memory kernel: links, addresses, a default route per family, kg's routes and rules.
#[derive(Debug, Clone, Default)]
pub struct MemKernel {
    state: Arc<Mutex<KernelState>>,
}

impl MemKernel {
    /// A kernel with `links`, `addresses` and the default route over `default_link`.
    pub fn new(links: Vec<Link>, addresses: Vec<(u32, IpNet)>, default_link: Option<u32>) -> Self {
        Self {
            state: Arc::new(Mutex::new(KernelState {
                links,
                addresses,
                default_link,
                ..Default::default()
            })),
        }
    }

    /// Gives this kernel `ip6_tunnel`: `add_ip6tnl` creates links.
    pub fn with_ip6tnl(self) -> Self {
        self.state.lock().ip6tnl = true;
        self
    }

    /// Gives this kernel IPIP: `tunl0` exists, as the loaded module makes it, and `add_ipip`
    /// creates links.
    pub fn with_ipip(self) -> Self {
        {
            let mut s = self.state.lock();
            s.ipip = true;
            let index = s.links.iter().map(|l| l.index).max().unwrap_or(0) + 1;
            s.links.push(Link {
                index,
                name: "tunl0".into(),
                mtu: 1480,
                up: false,
            });
            s.kinds.insert("tunl0".into(), "ipip".into());
        }
        self
    }

    /// Gives this kernel WireGuard: `add_wireguard` creates links.
    pub fn with_wireguard(self) -> Self {
        self.state.lock().wireguard = true;
        self
    }

    /// Adds a link called `name` of `kind`, as a process other than kg (or kg's last run)
    /// would have made it.
    pub fn add_link_of_kind(&self, name: &str, kind: &str) {
        self.state.lock().add_link(name, kind, 1420);
    }

    /// Deletes the link called `name` as `ip link del` does: its addresses and the routes
    /// through it go with it. Returns false when there was none.
    pub fn delete_link_named(&self, name: &str) -> bool {
        let mut s = self.state.lock();
        let Some(index) = s.links.iter().find(|l| l.name == name).map(|l| l.index) else {
            return false;
        };
        s.links.retain(|l| l.index != index);
        s.highest_index = s.highest_index.max(index);
        s.kinds.remove(name);
        s.addresses.retain(|(i, _)| *i != index);
        s.routes.routes.retain(|r| r.link != index);
        true
    }

    /// The index of the link called `name`, if there is one.
    pub fn index_of(&self, name: &str) -> Option<u32> {
        let s = self.state.lock();
        s.links.iter().find(|l| l.name == name).map(|l| l.index)
    }

    /// The kind of the link called `name`, if there is one.
    pub fn link_kind_of(&self, name: &str) -> Option<String> {
        let s = self.state.lock();
        s.links
            .iter()
            .any(|l| l.name == name)
            .then(|| s.kinds.get(name).cloned().unwrap_or_default())
    }

    /// True when the link called `name` exists and is up.
    pub fn link_up(&self, name: &str) -> bool {
        self.state
            .lock()
            .links
            .iter()
            .any(|l| l.name == name && l.up)
    }

    /// The addresses of the link called `name`.
    pub fn addresses_on(&self, name: &str) -> Vec<IpNet> {
        let s = self.state.lock();
        let Some(index) = s.links.iter().find(|l| l.name == name).map(|l| l.index) else {
            return Vec::new();
        };
        s.addresses
            .iter()
            .filter(|(i, _)| *i == index)
            .map(|(_, a)| *a)
            .collect()
    }

    /// Names of the links this kernel has.
    pub fn link_names(&self) -> Vec<String> {
        self.state
            .lock()
            .links
            .iter()
            .map(|l| l.name.clone())
            .collect()
    }

    /// The calls so far.
    pub fn calls(&self) -> Calls {
        self.state.lock().calls
    }

    /// kg's routes and rules as this kernel holds them.
    pub fn routes(&self) -> RoutePlan {
        self.state.lock().routes.clone()
    }

    fn read<T>(&self, f: impl FnOnce(&KernelState) -> T) -> T {
        let mut s = self.state.lock();
        s.calls.reads += 1;
        f(&s)
    }

    fn write<T>(&self, f: impl FnOnce(&mut KernelState) -> T) -> T {
        let mut s = self.state.lock();
        s.calls.writes += 1;
        f(&mut s)
    }

    /// Fails when this kernel refuses changes ([`MemKernel::refuse_changes`]).
    fn refusing(&self, index: u32) -> Result<()> {
        if self.state.lock().refuse_changes {
            anyhow::bail!("changing link {index}: refused");
        }
        Ok(())
    }

    fn link_mut(s: &mut KernelState, index: u32) -> Result<&mut Link> {
        s.links
            .iter_mut()
            .find(|l| l.index == index)
            .ok_or_else(|| anyhow::anyhow!("no link {index}"))
    }
}

impl Kernel for MemKernel {
    async fn links(&self) -> Result<Vec<Link>> {
        Ok(self.read(|s| s.links.clone()))
    }
    async fn addresses(&self) -> Result<Vec<(u32, IpNet)>> {
        Ok(self.read(|s| s.addresses.clone()))
    }
    async fn main_routes(&self) -> Result<Vec<Route>> {
        Ok(self.read(|s| {
            // A default route over the default link for IPv4, and for IPv6 when that link
            // holds an IPv6 address (as an IPv6 host's router advertisement gives it).
            let v6 = s
                .addresses
                .iter()
                .any(|(i, a)| Some(*i) == s.default_link && a.addr().is_ipv6());
            let families = ["0.0.0.0/0"].into_iter().chain(v6.then_some("::/0"));
            let default = s.default_link.into_iter().flat_map(|link| {
                families.clone().map(move |dst| Route {
                    table: MAIN_TABLE,
                    dst: dst.parse().expect("default route"),
                    gateway: None,
                    link,
                    src: None,
                    onlink: false,
                })
            });
            default
                .chain(
                    s.routes
                        .routes
                        .iter()
                        .filter(|r| r.table == MAIN_TABLE)
                        .cloned(),
                )
                .collect()
        }))
    }
    async fn link_kind(&self, name: &str) -> Result<Option<String>> {
        self.read(|_| ());
        Ok(self.link_kind_of(name))
    }
    async fn add_wireguard(&self, name: &str) -> Result<()> {
        if !self.read(|s| s.wireguard) {
            anyhow::bail!("this kernel has no WireGuard link kind (creating {name})")
        }
        self.write(|s| s.add_link(name, "wireguard", 1420));
        Ok(())
    }
    async fn add_ipip(&self, name: &str) -> Result<()> {
        if !self.read(|s| s.ipip) {
            anyhow::bail!("this kernel has no IPIP (creating {name})")
        }
        self.write(|s| s.add_link(name, "ipip", 1480));
        Ok(())
    }
    async fn add_ip6tnl(&self, name: &str, over: u32) -> Result<()> {
        if !self.read(|s| s.ip6tnl) {
            anyhow::bail!("this kernel has no ip6_tunnel (creating {name})")
        }
        if !self.read(|s| s.links.iter().any(|l| l.index == over)) {
            anyhow::bail!("no link {over} to create {name} over")
        }
        self.write(|s| s.add_link(name, "ip6tnl", 1452));
        Ok(())
    }
    async fn has_ipip(&self) -> Result<bool> {
        Ok(self.read(|s| s.ipip))
    }
    async fn delete_link(&self, index: u32) -> Result<()> {
        self.write(|s| {
            if let Some(gone) = s.links.iter().find(|l| l.index == index) {
                let name = gone.name.clone();
                s.kinds.remove(&name);
                s.highest_index = s.highest_index.max(index);
            }
            s.links.retain(|l| l.index != index)
        });
        Ok(())
    }
    async fn set_mtu(&self, index: u32, mtu: u32) -> Result<()> {
        self.refusing(index)?;
        self.write(|s| Self::link_mut(s, index).map(|l| l.mtu = mtu))
    }
    async fn set_up(&self, index: u32, up: bool) -> Result<()> {
        self.refusing(index)?;
        if self.state.lock().refuse_link_up {
            anyhow::bail!("setting link {index} up: refused")
        }
        self.write(|s| Self::link_mut(s, index).map(|l| l.up = up))
    }
    async fn set_address(&self, index: u32, want: Option<IpNet>) -> Result<()> {
        // Like the real one: a listing, then a write only when the link's addresses differ.
        let have: Vec<IpNet> = self.read(|s| {
            s.addresses
                .iter()
                .filter(|(i, _)| *i == index)
                .map(|(_, n)| *n)
                .collect()
        });
        if have != want.into_iter().collect::<Vec<_>>() {
            self.refusing(index)?;
            self.write(|s| {
                s.addresses.retain(|(i, _)| *i != index);
                s.addresses.extend(want.map(|n| (index, n)));
            });
        }
        Ok(())
    }
    async fn observe(&self) -> Result<RoutePlan> {
        Ok(self.read(|s| s.routes.clone()))
    }
    async fn apply(&self, ops: &[RouteOp]) -> Vec<anyhow::Error> {
        if self.state.lock().refuse_changes {
            return ops
                .iter()
                .map(|op| anyhow::anyhow!("{op:?}: refused"))
                .collect();
        }
        for op in ops {
            self.write(|s| s.routes = apply_ops(&s.routes, std::slice::from_ref(op)));
        }
        Vec::new()
    }
}

/// An in-memory firewall: the rules last reconciled, and how often it was called (each call of
/// the real one runs `iptables` children).
#[derive(Debug, Clone, Default)]
pub struct MemFirewall {
    state: Arc<Mutex<(Option<RuleSet>, Calls)>>,
}

impl MemFirewall {
    /// The calls so far: every reconcile reads (lists the chains); one that changes rules also
    /// writes.
    pub fn calls(&self) -> Calls {
        self.state.lock().1
    }

    /// The rules last reconciled.
    pub fn rules(&self) -> Option<RuleSet> {
        self.state.lock().0.clone()
    }
}

impl Firewall for MemFirewall {
    fn blocks(&self) -> bool {
        false
    }

    fn reconcile(
        &self,
        rules: &RuleSet,
        _previous: Option<&RuleSet>,
        _v6_available: bool,
    ) -> Result<bool> {
        let mut s = self.state.lock();
        s.1.reads += 1;
        let changed = s.0.as_ref() != Some(rules);
        if changed {
            s.1.writes += 1;
            s.0 = Some(rules.clone());
        }
        Ok(changed)
    }
    fn clean_up(&self, _v6_available: bool) -> Result<()> {
        let mut s = self.state.lock();
        s.1.writes += 1;
        s.0 = None;
        Ok(())
    }
    fn v6_available(&self) -> bool {
        true
    }
    fn drift(&self, rules: &RuleSet, _v6_available: bool) -> Result<Vec<String>> {
        let s = self.state.lock();
        Ok(match &s.0 {
            Some(held) if held == rules => Vec::new(),
            Some(_) => vec!["the firewall's rules differ from the rules kg applied".to_string()],
            None => vec!["the firewall holds none of kg's rules".to_string()],
        })
    }
}

impl MemKernel {
    /// A host with a loopback, `eth0` (192.168.0.10/24, the default route, MTU 1500) and the
    /// WireGuard link `interface` (down, MTU 1420).
    pub fn host(interface: &str) -> Self {
        Self::host_at(interface, "192.168.0.10/24".parse().expect("CIDR"))
    }

    /// [`MemKernel::host`] with `address` on `eth0`.
    pub fn host_at(interface: &str, address: IpNet) -> Self {
        let link = |index, name: &str, mtu, up| Link {
            index,
            name: name.to_string(),
            mtu,
            up,
        };
        Self::new(
            vec![
                link(1, "lo", 65536, true),
                link(2, "eth0", 1500, true),
                link(3, interface, 1420, false),
            ],
            vec![(1, "127.0.0.1/8".parse().expect("CIDR")), (2, address)],
            Some(2),
        )
    }

    /// Adds the link `name` (up, MTU 1500) holding `address`, as a host's second uplink.
    pub fn add_uplink(&self, name: &str, address: IpNet) {
        let mut s = self.state.lock();
        s.add_link(name, "", 1500);
        if let Some(link) = s.links.iter_mut().find(|l| l.name == name) {
            link.up = true;
            let index = link.index;
            s.addresses.push((index, address));
        }
    }

    /// Gives the link called `name` the address `address` alone, or none, as DHCP or an
    /// operator would (a link that does not exist is left alone).
    pub fn readdress(&self, name: &str, address: Option<IpNet>) {
        let mut s = self.state.lock();
        if let Some(index) = s.links.iter().find(|l| l.name == name).map(|l| l.index) {
            s.addresses.retain(|(i, _)| *i != index);
            s.addresses.extend(address.map(|a| (index, a)));
        }
    }

    /// Makes every change of links, addresses and routes fail from now on (`true`), changing
    /// nothing, or work again.
    pub fn refuse_changes(&self, refuse: bool) {
        self.state.lock().refuse_changes = refuse;
    }

    /// True while this kernel refuses changes.
    pub fn refuses_changes(&self) -> bool {
        self.state.lock().refuse_changes
    }

    /// Makes every `set_up` fail from now on (`true`) or work again.
    pub fn refuse_link_up(&self, refuse: bool) {
        self.state.lock().refuse_link_up = refuse;
    }

    /// Replaces kg's routes and rules, as someone else changing the kernel would.
    pub fn set_routes(&self, routes: RoutePlan) {
        self.state.lock().routes = routes;
    }
}
