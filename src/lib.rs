//! kilotun's agent side: the `kg` runtime (backends, netlink, the WireGuard device, the
//! reconcile loop) around the pure `control` core and the `dataplane` engine.

pub mod agent;
pub mod backend;
pub mod kgctl;
pub mod webhook;
pub mod wiring;

#[cfg(test)]
mod manifest_tests;
