//! kilotun's control plane.
//!
//! This crate will hold Kilo's topology computation as a pure core (no I/O, `now` passed in) plus
//! the Kubernetes and file backends. For now it holds only the shared names the agent and `kgctl`
//! agree on.

/// Kilo's default WireGuard interface name.
pub const DEFAULT_INTERFACE: &str = "kilo0";

/// Kilo's default WireGuard listen port.
pub const DEFAULT_PORT: u16 = 51820;
