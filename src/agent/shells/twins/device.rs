//! The WireGuard device's twin.

use std::sync::Arc;

use anyhow::Result;
use control::nat::DevicePeer;
use control::pq::link::FailedHandshakes;
use control::routes::RoutePlan;
use dataplane::DeviceConfig;
use parking_lot::Mutex;

use super::super::Device;
use super::{Calls, MemKernel};

/// An in-memory WireGuard device: its configuration and how often it was read or changed.
#[derive(Debug, Clone, Default)]
pub struct MemDevice {
    state: Arc<Mutex<EngineState>>,
}

#[derive(Debug, Default)]
struct EngineState {
    config: DeviceConfig,
    calls: Calls,
    /// The kernel whose routes each change is recorded with, if any.
    kernel: Option<MemKernel>,
    /// Each change of the configuration, with kg's routes in `kernel` at that moment.
    changes: Vec<(DeviceConfig, RoutePlan)>,
    /// Bytes received and sent per peer, as a test's network says ([`MemDevice::set_traffic`]).
    traffic: std::collections::BTreeMap<control::Key, (u64, u64)>,
    /// The peers with a completed handshake, as a test's network says.
    handshakes: std::collections::BTreeSet<control::Key>,
    /// When each peer's last handshake completed (Unix milliseconds), as a test's network
    /// says ([`MemDevice::set_last_handshakes`]); a peer not named reads as none.
    last_handshakes: std::collections::BTreeMap<control::Key, i64>,
    /// Per peer, the handshakes that failed the way differing preshared keys make them fail,
    /// as a test's network says.
    failed: std::collections::BTreeMap<control::Key, FailedHandshakes>,
    /// Why the device stopped carrying packets, as a test makes it ([`MemDevice::lose_link`]).
    lost: Option<String>,
    /// The link [`Device::recreate`] makes again, in its kernel: as the engine's new TUN link.
    link: Option<(MemKernel, String)>,
    /// How many times the device was started again.
    recreated: u32,
    /// `recreate` fails, as on a host whose `/dev/net/tun` went away.
    refuse_recreate: bool,
}

impl MemDevice {
    /// A device that already holds `config`, as one that outlived the last kg.
    pub fn holding(config: DeviceConfig) -> Self {
        let engine = Self::default();
        engine.state.lock().config = config;
        engine
    }

    /// Records, with every change of the configuration from now on, kg's routes in `kernel`
    /// at that moment (see [`MemDevice::changes`]): what a packet the engine sends right
    /// after the change would be routed by.
    pub fn record_routes_of(&self, kernel: &MemKernel) {
        self.state.lock().kernel = Some(kernel.clone());
    }

    /// The changes recorded since [`MemDevice::record_routes_of`], oldest first: each new
    /// configuration and the routes the kernel held when the engine took it.
    pub fn changes(&self) -> Vec<(DeviceConfig, RoutePlan)> {
        self.state.lock().changes.clone()
    }

    /// The calls so far: every `apply` reads the configuration; one that changes it writes.
    pub fn calls(&self) -> Calls {
        self.state.lock().calls
    }

    /// The device's configuration.
    pub fn config(&self) -> DeviceConfig {
        self.state.lock().config.clone()
    }

    /// Sets the bytes received and sent per peer and the peers with a completed handshake, as
    /// the network around this device would make them (a peer not named has none).
    pub fn set_traffic(
        &self,
        traffic: std::collections::BTreeMap<control::Key, (u64, u64)>,
        handshakes: std::collections::BTreeSet<control::Key>,
    ) {
        let mut s = self.state.lock();
        s.traffic = traffic;
        s.handshakes = handshakes;
    }

    /// Sets when each peer's last handshake completed (Unix milliseconds), as the network
    /// around this device would make it: what [`Device::peer_readings`] reads.
    pub fn set_last_handshakes(&self, at: std::collections::BTreeMap<control::Key, i64>) {
        self.state.lock().last_handshakes = at;
    }

    /// Sets, per peer, the handshakes that failed under differing preshared keys, as the
    /// network around this device counts them (the embedded engine's counts; a peer not named
    /// has none).
    pub fn set_failed_handshakes(
        &self,
        failed: std::collections::BTreeMap<control::Key, FailedHandshakes>,
    ) {
        self.state.lock().failed = failed;
    }
}

impl MemDevice {
    /// Names the TUN link called `name` in `kernel` as this device's: [`Device::recreate`]
    /// makes it again there.
    pub fn on_link(&self, kernel: &MemKernel, name: &str) {
        self.state.lock().link = Some((kernel.clone(), name.to_string()));
    }

    /// Makes the device lose its link, as the engine does when its TUN link is deleted: it
    /// says `why` from then on, until it is started again.
    pub fn lose_link(&self, why: &str) {
        self.state.lock().lost = Some(why.to_string());
    }

    /// Makes `recreate` fail (or work again).
    pub fn refuse_recreate(&self, refuse: bool) {
        self.state.lock().refuse_recreate = refuse;
    }

    /// How many times the device was started again.
    pub fn recreated(&self) -> u32 {
        self.state.lock().recreated
    }
}

impl Device for MemDevice {
    fn lost(&self) -> Option<String> {
        self.state.lock().lost.clone()
    }
    fn recreate(&self) -> Result<()> {
        let mut s = self.state.lock();
        if s.refuse_recreate {
            anyhow::bail!("opening TUN device: No such device (the twin refuses)");
        }
        s.calls.writes += 1;
        s.lost = None;
        s.recreated += 1;
        // A new engine: the peers went with the old one, the key and port with them.
        s.config = DeviceConfig::default();
        if let Some((kernel, name)) = &s.link {
            kernel.add_link_of_kind(name, "tun");
        }
        Ok(())
    }
    fn apply(&self, desired: &DeviceConfig) -> Result<bool> {
        let mut s = self.state.lock();
        s.calls.reads += 1;
        if s.config == *desired {
            return Ok(false);
        }
        s.calls.writes += 1;
        s.config = desired.clone();
        if let Some(routes) = s.kernel.as_ref().map(MemKernel::routes) {
            s.changes.push((desired.clone(), routes));
        }
        Ok(true)
    }
    fn configuration(&self) -> Result<DeviceConfig> {
        let mut s = self.state.lock();
        s.calls.reads += 1;
        Ok(s.config.clone())
    }
    fn device_peers(&self) -> Result<Vec<DevicePeer>> {
        let mut s = self.state.lock();
        s.calls.reads += 1;
        Ok(s.config
            .peers
            .iter()
            .map(|p| {
                let public_key = control::Key(*p.public_key.as_bytes());
                DevicePeer {
                    public_key,
                    endpoint: p.endpoint,
                    has_handshake: s.handshakes.contains(&public_key),
                }
            })
            .collect())
    }
    fn peer_readings(
        &self,
    ) -> Result<std::collections::BTreeMap<control::Key, control::peer_status::PeerReading>> {
        let mut s = self.state.lock();
        s.calls.reads += 1;
        Ok(s.config
            .peers
            .iter()
            .map(|p| {
                let key = control::Key(*p.public_key.as_bytes());
                let (rx_bytes, tx_bytes) = s.traffic.get(&key).copied().unwrap_or_default();
                let reading = control::peer_status::PeerReading {
                    endpoint: p.endpoint,
                    last_handshake_ms: s.last_handshakes.get(&key).copied(),
                    rx_bytes,
                    tx_bytes,
                };
                (key, reading)
            })
            .collect())
    }
    fn counts_failed_handshakes(&self) -> bool {
        true
    }
    fn failed_handshakes(&self) -> std::collections::BTreeMap<control::Key, FailedHandshakes> {
        self.state.lock().failed.clone()
    }
    fn traffic(&self) -> Result<Vec<(control::Key, (u64, u64))>> {
        let mut s = self.state.lock();
        s.calls.reads += 1;
        Ok(s.config
            .peers
            .iter()
            .map(|p| {
                let key = control::Key(*p.public_key.as_bytes());
                (key, s.traffic.get(&key).copied().unwrap_or_default())
            })
            .collect())
    }
}
