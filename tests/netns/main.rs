//! The `netns` tier: kilotun and kg in network namespaces on this machine (root: namespaces and
//! TUN devices; without root each test says it is skipped and passes), against each other and
//! against wireguard-go and gotatun, the kg scenarios on the file backend and the in-process
//! fake API server, the firewall back ends, and the documentation's runnable commands.

#[path = "../common/mod.rs"]
mod common;
#[path = "../markdown/mod.rs"]
mod markdown;

mod bad_input;
mod demo;
mod docs_commands;
mod firewall;
mod flood;
mod interop;
mod kg_cross;
mod kg_ddns_nat;
mod kg_diagnose;
mod kg_dual_stack;
mod kg_endpoints;
mod kg_failover;
mod kg_faults;
mod kg_guard;
mod kg_ipam;
mod kg_ipip;
mod kg_ipv6;
mod kg_kernel;
mod kg_kube;
mod kg_mesh;
mod kg_migration;
mod kg_pq;
mod kg_relay;
mod kg_rotation;
mod kg_shares;
mod kg_shares_failover;
mod kg_vpc_range;
mod leaks;
mod lifecycle;
mod memory;
mod ordering;
mod soak;
mod sticky_source;
mod wg_quick;
mod wg_tool;
