//! kilotun's control plane: Kilo's behaviour as a pure core.
//!
//! Nothing in this crate does I/O or reads the clock: Kubernetes objects, DNS answers, device
//! state and `now` come in as arguments; topology, WireGuard configurations, route plans and
//! annotation values go out as data. The agent (`kg`) supplies the I/O.

pub mod api_events;
pub mod clock;
pub mod cni;
pub mod coalesce;
pub mod condition;
pub mod desired;
pub mod diagnosis;
pub mod dns;
pub mod endpoints;
pub mod fixtures;
pub mod fuzzing;
pub mod graph;
pub mod host;
pub mod ip;
pub mod ipam;
pub mod iptables;
pub mod journal;
pub mod key;
pub mod leader;
pub mod nat;
pub mod nftables;
pub mod node;
pub mod pass;
pub mod peer;
pub mod peer_status;
pub mod pq;
pub mod readiness;
pub mod rotation;
pub mod routes;
pub mod standby;
pub mod status;
pub mod table;
pub mod topology;
pub mod wgconf;

pub use ip::{Endpoint, Host};
pub use key::Key;
pub use node::{translate_node, Granularity, Node};
pub use peer::{translate_peer, Peer, PeerObject};
pub use topology::{Topology, TopologyParams};

/// Kilo's default WireGuard interface name.
pub const DEFAULT_INTERFACE: &str = "kilo0";

/// Kilo's default WireGuard listen port.
pub const DEFAULT_PORT: u16 = 51820;

/// Kilo's default `--subnet`.
pub const DEFAULT_SUBNET: &str = "10.4.0.0/16";
