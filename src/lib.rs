//! kilotun's agent side: the `kg` runtime (backends, netlink, the WireGuard device, the
//! reconcile loop) around the pure `control` core and the `dataplane` engine.

pub mod agent;
pub mod backend;
pub mod device_plugin;
pub mod files;
pub mod kgctl;
pub mod model;
mod periodic;
pub mod webhook;
pub mod wiring;

/// The target triple these binaries were built for (`x86_64-unknown-linux-gnu`,
/// `aarch64-unknown-linux-gnu`, `armv7-unknown-linux-gnueabihf`…).
pub const TARGET: &str = env!("KILOTUN_TARGET");

/// What `--version` prints after the program's name: the version and the target triple.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("KILOTUN_TARGET"), ")");

#[cfg(test)]
mod manifest_tests;
