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
    /// Per peer, the handshakes that failed the way differing preshared keys make them fail,
    /// as a test's network says.
    failed: std::collections::BTreeMap<control::Key, FailedHandshakes>,
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

impl Device for MemDevice {
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
