//! The three shells kg changes the host through, as small traits: the kernel's links, addresses,
//! routes and rules ([`Kernel`], rtnetlink in [`Netlink`]), the firewall ([`Firewall`],
//! nftables or `iptables-restore` in [`firewall::HostFirewall`]) and the WireGuard device ([`Device`], [`WireGuard`]).
//! [`twins`] holds in-memory twins of each that count what they are asked to do. Every adapter
//! that talks to the kernel, a child process or a file lives in this folder; nothing here
//! imports the pipeline above it.

use control::pq::link::FailedHandshakes;
use std::future::Future;

use anyhow::Result;
use control::iptables::RuleSet;
use control::nat::DevicePeer;
use control::routes::{Route, RouteOp, RoutePlan};
use dataplane::DeviceConfig;
use ipnet::IpNet;

pub mod allowed_ips;
pub mod cni_file;
pub mod engine_lock;
pub mod firewall;
pub mod iptables;
pub mod kernel_watch;
pub mod kernel_wireguard;
pub mod keyfile;
pub mod lookups;
pub mod netlink;
pub mod nftables;
pub mod state;
pub mod twins;
pub mod wireguard;
pub mod xtables;

use netlink::{Link, Netlink};
use wireguard::WireGuard;

/// Runs `bin args` with `script` on its standard input: `Ok(None)` when it succeeded, its
/// standard error when it failed. `missing` says what to install when `bin` cannot be run.
pub fn feed(bin: &str, args: &[&str], script: &str, missing: &str) -> Result<Option<String>> {
    use anyhow::Context as _;
    use std::io::Write as _;
    use std::process::{Command, Stdio};
    let mut child = Command::new(bin)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {bin}{missing}"))?;
    child
        .stdin
        .take()
        .context("the child's stdin")?
        .write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    Ok((!out.status.success()).then(|| String::from_utf8_lossy(&out.stderr).trim().to_string()))
}

pub use crate::files::replace as write_file;

/// Links, addresses, routes and policy rules.
pub trait Kernel: Send + Sync {
    /// Every link.
    fn links(&self) -> impl Future<Output = Result<Vec<Link>>> + Send;
    /// Every address, with its link index.
    fn addresses(&self) -> impl Future<Output = Result<Vec<(u32, IpNet)>>> + Send;
    /// The main table's unicast routes (the host's and kg's), IPv4 first.
    fn main_routes(&self) -> impl Future<Output = Result<Vec<Route>>> + Send;
    /// The link called `name`.
    fn link_by_name(&self, name: &str) -> impl Future<Output = Result<Option<Link>>> + Send {
        async move { Ok(self.links().await?.into_iter().find(|l| l.name == name)) }
    }
    /// The kind of the link called `name` as `ip -d link` names it (`tun`, `wireguard`, …;
    /// empty when the kernel names none), or `None` when there is no such link.
    fn link_kind(&self, name: &str) -> impl Future<Output = Result<Option<String>>> + Send;
    /// Makes sure the kernel's WireGuard link `name` exists; fails where the kernel has none.
    fn add_wireguard(&self, name: &str) -> impl Future<Output = Result<()>> + Send;
    /// Makes sure the kernel IPIP link `name` exists.
    fn add_ipip(&self, name: &str) -> impl Future<Output = Result<()>> + Send;
    /// Makes sure the kernel `ip6tnl` link `name` exists in `ipip6` mode over link `over`, with
    /// no fixed endpoints (IPv4 to the IPv6 gateways of its routes).
    fn add_ip6tnl(&self, name: &str, over: u32) -> impl Future<Output = Result<()>> + Send;
    /// True when the kernel has IPIP (loaded or loadable), without creating anything.
    fn has_ipip(&self) -> impl Future<Output = Result<bool>> + Send;
    /// Deletes a link.
    fn delete_link(&self, index: u32) -> impl Future<Output = Result<()>> + Send;
    /// Sets a link's MTU.
    fn set_mtu(&self, index: u32, mtu: u32) -> impl Future<Output = Result<()>> + Send;
    /// Brings a link up or down.
    fn set_up(&self, index: u32, up: bool) -> impl Future<Output = Result<()>> + Send;
    /// Makes `want` the only address of the link (`None`: remove all).
    fn set_address(
        &self,
        index: u32,
        want: Option<IpNet>,
    ) -> impl Future<Output = Result<()>> + Send;
    /// kg's routes and rules as the kernel has them.
    fn observe(&self) -> impl Future<Output = Result<RoutePlan>> + Send;
    /// Applies route and rule changes in order, collecting failures.
    fn apply(&self, ops: &[RouteOp]) -> impl Future<Output = Vec<anyhow::Error>> + Send;
}

impl Kernel for Netlink {
    async fn links(&self) -> Result<Vec<Link>> {
        Netlink::links(self).await
    }
    async fn addresses(&self) -> Result<Vec<(u32, IpNet)>> {
        Netlink::addresses(self).await
    }
    async fn main_routes(&self) -> Result<Vec<Route>> {
        Netlink::main_routes(self).await
    }
    async fn link_kind(&self, name: &str) -> Result<Option<String>> {
        Netlink::link_kind(self, name).await
    }
    async fn add_wireguard(&self, name: &str) -> Result<()> {
        Netlink::add_wireguard(self, name).await
    }
    async fn add_ipip(&self, name: &str) -> Result<()> {
        Netlink::add_ipip(self, name).await
    }
    async fn add_ip6tnl(&self, name: &str, over: u32) -> Result<()> {
        Netlink::add_ip6tnl(self, name, over).await
    }
    async fn has_ipip(&self) -> Result<bool> {
        Netlink::has_ipip(self).await
    }
    async fn delete_link(&self, index: u32) -> Result<()> {
        Netlink::delete_link(self, index).await
    }
    async fn set_mtu(&self, index: u32, mtu: u32) -> Result<()> {
        Netlink::set_mtu(self, index, mtu).await
    }
    async fn set_up(&self, index: u32, up: bool) -> Result<()> {
        Netlink::set_up(self, index, up).await
    }
    async fn set_address(&self, index: u32, want: Option<IpNet>) -> Result<()> {
        Netlink::set_address(self, index, want).await
    }
    async fn observe(&self) -> Result<RoutePlan> {
        Netlink::observe(self).await
    }
    async fn apply(&self, ops: &[RouteOp]) -> Vec<anyhow::Error> {
        Netlink::apply(self, ops).await
    }
}

/// Kilo's firewall rules. Calls block (the real one runs child processes).
pub trait Firewall: Clone + Send + Sync + 'static {
    /// Brings both families to `rules`; true when something was changed. `previous` is what
    /// the last call applied, `None` at start and on a resync: then the host's state is read
    /// and compared, otherwise only the difference from `previous` is written.
    fn reconcile(
        &self,
        rules: &RuleSet,
        previous: Option<&RuleSet>,
        v6_available: bool,
    ) -> Result<bool>;
    /// Removes every rule and chain kg added.
    fn clean_up(&self, v6_available: bool) -> Result<()>;
    /// True when the IPv6 family can be managed here.
    fn v6_available(&self) -> bool;
    /// What differs between the host's rules and `rules`, one line per difference (`/status`).
    fn drift(&self, rules: &RuleSet, v6_available: bool) -> Result<Vec<String>>;
    /// Gets ready before the first rule is read (the real one picks nftables or iptables and
    /// the latter's back end, which takes child processes: kg does it while it restores the
    /// last run's peers and its first pass brings up the engine and the routes).
    fn prepare(&self) -> Result<()> {
        Ok(())
    }
    /// True when its calls wait on child processes, so the driver runs them off its loop
    /// ([`firewall::off_loop`]); the in-memory twin answers at once.
    fn blocks(&self) -> bool {
        true
    }
}

/// The WireGuard device.
pub trait Device: Send + Sync {
    /// Makes the device's configuration `desired`, changing only what differs; true when
    /// something changed.
    fn apply(&self, desired: &DeviceConfig) -> Result<bool>;
    /// [`Device::apply`] for a device this process just started: the peers of the last run
    /// after a restart, or the first configuration. A device that has no sessions yet (the
    /// embedded engine) also starts handshakes with every peer at once: the other ends may
    /// still send on sessions that died with the last process (kg's own, or Kilo's
    /// wireguard-go when a node migrates) and, on a link where only they send, would wait for
    /// their own timers (about 15 s) before starting a new one. Returns whether something
    /// changed, and what was started, said for the journal (`None`: no handshake started).
    fn apply_and_handshake(&self, desired: &DeviceConfig) -> Result<(bool, Option<String>)> {
        Ok((self.apply(desired)?, None))
    }
    /// Why the device no longer carries packets, for one that can tell (the embedded engine
    /// whose TUN link was deleted); `None` while it works.
    fn lost(&self) -> Option<String> {
        None
    }
    /// Starts a lost device ([`Device::lost`]) again: afterwards it has no peers, and its link
    /// (a new one when the old was deleted) may have none of the addresses and routes, so the
    /// pass that asked applies them all. A device that cannot be lost cannot be started again either.
    fn recreate(&self) -> Result<()> {
        anyhow::bail!("this device cannot be started again by kg")
    }
    /// The device's configuration now: empty for a device this process just created, the
    /// peers of the last run for one that outlived it (the kernel's link, a userspace device
    /// over UAPI).
    fn configuration(&self) -> Result<DeviceConfig>;
    /// The device's peers as NAT discovery needs them.
    fn device_peers(&self) -> Result<Vec<DevicePeer>>;
    /// Bytes received and sent per peer.
    fn traffic(&self) -> Result<Vec<(control::Key, (u64, u64))>>;
    /// What the device knows of each peer, for the Peers' status: its endpoint and bytes,
    /// and its last handshake where the device says when (the default knows no time).
    fn peer_readings(
        &self,
    ) -> Result<std::collections::BTreeMap<control::Key, control::peer_status::PeerReading>> {
        let traffic: std::collections::BTreeMap<_, _> = self.traffic()?.into_iter().collect();
        Ok(self
            .device_peers()?
            .into_iter()
            .map(|p| {
                let (rx_bytes, tx_bytes) = traffic.get(&p.public_key).copied().unwrap_or_default();
                let reading = control::peer_status::PeerReading {
                    endpoint: p.endpoint,
                    last_handshake_ms: None,
                    rx_bytes,
                    tx_bytes,
                };
                (p.public_key, reading)
            })
            .collect())
    }
    /// Starts a handshake with `peer` now, session or not, where the device can be asked to
    /// (the embedded engine); elsewhere the next rekey uses a new preshared key.
    fn rekey(&self, _peer: &control::Key) {}
    /// True when the device counts handshakes that fail the way differing preshared keys make
    /// them fail (the embedded engine).
    fn counts_failed_handshakes(&self) -> bool {
        false
    }
    /// Per peer with any, what the device counted of those handshakes (see
    /// [`Device::counts_failed_handshakes`]); empty for a device that does not count them.
    fn failed_handshakes(&self) -> std::collections::BTreeMap<control::Key, FailedHandshakes> {
        std::collections::BTreeMap::new()
    }
    /// How peers' changed allowed IPs were sent since the last call, for a device kg
    /// configures over UAPI or netlink (edits or whole lists, and a refused edit); nothing
    /// for one that does not say.
    fn take_allowed_ips_updates(&self) -> allowed_ips::AllowedIpsUpdates {
        allowed_ips::AllowedIpsUpdates::default()
    }
}

impl Device for WireGuard {
    fn apply(&self, desired: &DeviceConfig) -> Result<bool> {
        WireGuard::apply(self, desired)
    }
    fn take_allowed_ips_updates(&self) -> allowed_ips::AllowedIpsUpdates {
        WireGuard::take_allowed_ips_updates(self)
    }
    fn lost(&self) -> Option<String> {
        self.link_lost().map(|loss| {
            format!(
                "the embedded engine's TUN link {}: {loss}",
                self.interface()
            )
        })
    }
    fn recreate(&self) -> Result<()> {
        WireGuard::recreate(self)
    }
    fn apply_and_handshake(&self, desired: &DeviceConfig) -> Result<(bool, Option<String>)> {
        let changed = WireGuard::apply(self, desired)?;
        let started = match self {
            WireGuard::Embedded { .. } => {
                let asked = self
                    .engine_device()
                    .map_or(0, |device| device.initiate_handshakes());
                Some(format!(
                    "started handshakes with every peer at once ({asked})"
                ))
            }
            WireGuard::Kernel(device) => match device.start_handshakes() {
                Ok(asked) => Some(format!(
                    "started handshakes with every peer that had none ({asked})"
                )),
                Err(e) => {
                    tracing::warn!(error = format!("{e:#}"), "starting handshakes");
                    None
                }
            },
            WireGuard::Uapi { .. } => None,
        };
        Ok((changed, started))
    }
    fn configuration(&self) -> Result<DeviceConfig> {
        Ok(self.read()?.0)
    }
    fn rekey(&self, peer: &control::Key) {
        if let Some(device) = self.engine_device() {
            device
                .engine()
                .rekey(&dataplane::PublicKey::from_bytes(peer.0));
        }
    }
    fn counts_failed_handshakes(&self) -> bool {
        matches!(self, WireGuard::Embedded { .. })
    }
    fn failed_handshakes(&self) -> std::collections::BTreeMap<control::Key, FailedHandshakes> {
        let Some(device) = self.engine_device() else {
            return std::collections::BTreeMap::new();
        };
        device
            .peer_stats()
            .into_iter()
            .filter(|s| s.refused_responses > 0 || s.unused_answers > 0)
            .map(|s| {
                let failed = FailedHandshakes {
                    refused_responses: s.refused_responses,
                    unused_answers: s.unused_answers,
                };
                (control::Key(*s.public_key.as_bytes()), failed)
            })
            .collect()
    }
    fn device_peers(&self) -> Result<Vec<DevicePeer>> {
        WireGuard::device_peers(self)
    }
    fn peer_readings(
        &self,
    ) -> Result<std::collections::BTreeMap<control::Key, control::peer_status::PeerReading>> {
        let (_, stats) = self.read()?;
        let ms = |t: std::time::SystemTime| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as i64)
        };
        Ok(stats
            .into_iter()
            .map(|s| {
                let reading = control::peer_status::PeerReading {
                    endpoint: s.endpoint,
                    last_handshake_ms: s.last_handshake.map(ms),
                    rx_bytes: s.rx_bytes,
                    tx_bytes: s.tx_bytes,
                };
                (control::Key(*s.public_key.as_bytes()), reading)
            })
            .collect())
    }
    fn traffic(&self) -> Result<Vec<(control::Key, (u64, u64))>> {
        let (_, stats) = self.read()?;
        Ok(stats
            .into_iter()
            .map(|s| {
                (
                    control::Key(*s.public_key.as_bytes()),
                    (s.rx_bytes, s.tx_bytes),
                )
            })
            .collect())
    }
}
