//! The `pure` tier: tests that need no root, no network namespace and no external server (the
//! documentation, the source tree's layout, the vendored crate, kg on in-memory twins, the
//! device plugin against an in-process kubelet). `cargo nextest run --test pure` runs them
//! anywhere; `.config/nextest.toml` says how CI runs the three tiers.

#[path = "../markdown/mod.rs"]
mod markdown;
#[path = "../common/old_clusters.rs"]
#[allow(unreachable_pub)]
mod old_clusters;

mod address_layouts;
mod clock;
mod device_plugin;
mod docs;
mod handover_order;
mod layout;
mod old_clusters_line;
mod quiet_events;
mod twin_cluster;
mod vendored;
