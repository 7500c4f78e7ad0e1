//! Annotation names, exactly as Kilo spells them.

/// User-set: overrides the endpoint (`host:port`); its port is also the listen port.
pub const FORCE_ENDPOINT: &str = "kilo.squat.ai/force-endpoint";
/// User-set: overrides the internal IP (CIDR), or `""`/`-` to have none.
pub const FORCE_INTERNAL_IP: &str = "kilo.squat.ai/force-internal-ip";
/// User-set, presence-only: prefer this node as its segment's leader.
pub const LEADER: &str = "kilo.squat.ai/leader";
/// User-set: the logical location (wins over the topology label).
pub const LOCATION: &str = "kilo.squat.ai/location";
/// User-set: keepalive seconds; non-zero on a remote node marks it as behind NAT.
pub const PERSISTENT_KEEPALIVE: &str = "kilo.squat.ai/persistent-keepalive";
/// User-set: comma-separated CIDRs routed to this node's location.
pub const ALLOWED_LOCATION_IPS: &str = "kilo.squat.ai/allowed-location-ips";
/// Written by kg: the endpoint in use.
pub const ENDPOINT: &str = "kilo.squat.ai/endpoint";
/// Written by kg: the private IP with its interface mask.
pub const INTERNAL_IP: &str = "kilo.squat.ai/internal-ip";
/// Written by kg: the WireGuard public key.
pub const KEY: &str = "kilo.squat.ai/key";
/// Written by kg: Unix seconds of the last check-in.
pub const LAST_SEEN: &str = "kilo.squat.ai/last-seen";
/// Written by kg: a leader's WireGuard IP with the Kilo subnet mask, else `""`.
pub const WIREGUARD_IP: &str = "kilo.squat.ai/wireguard-ip";
/// Written by kg: endpoints learned from NATed peers (JSON).
pub const DISCOVERED_ENDPOINTS: &str = "kilo.squat.ai/discovered-endpoints";
/// Written by kg: the mesh granularity this agent runs with.
pub const GRANULARITY: &str = "kilo.squat.ai/granularity";
/// Written by kg: the `cilium_host` address in Cilium compatibility mode, else `""`.
pub const CNI_COMPATIBILITY_IP: &str = "kilo.squat.ai/cni-compatibility-ip";
/// Written by kilotun's kg (not Kilo's): `lease` when it takes part in lease-based leader
/// election (see `crate::leader`).
pub const LEADER_ELECTION: &str = "kilotun.io/leader-election";
/// User-set on any node of a location (kilotun's, not Kilo's): only locations so marked may
/// relay between two locations behind NAT; without it, any reachable location may.
pub const RELAY: &str = "kilotun.io/relay";
/// Written by kilotun's kg (not Kilo's): on a host with addresses of both families, its
/// address of the family `internal-ip` is not (with mask), else `""`. When `internal-ip` is
/// IPv4, the other nodes of its location route IPv6 pods and Peers through it (a route
/// cannot take a gateway of the other family).
pub const SECOND_INTERNAL_IP: &str = "kilotun.io/second-internal-ip";

/// Written by kilotun's kg (not Kilo's) run with `--leaders-per-location` above 1: that number.
/// The cluster has as many leaders per location as the smallest number any node publishes, 1
/// for a node that publishes none (Kilo's kg among them) and for one that publishes
/// [`LEADERS_PER_LOCATION`] instead.
pub const LEADER_SHARES: &str = "kilotun.io/leader-shares";

/// What an earlier kilotun wrote instead of [`LEADER_SHARES`]: its kg splits a location into
/// shares otherwise (a leader's loss may move nodes of other shares), so it and this one would
/// disagree on some node's share. A node that publishes it counts as 1, which every version
/// agrees on: one leader per location, the location's lease holder. Removed by this kg.
pub const LEADERS_PER_LOCATION: &str = "kilotun.io/leaders-per-location";

/// Written by kilotun's kg (not Kilo's) while it rotates its key: the public key it will use
/// next. Its peers add it beside the current key (see `crate::rotation`).
pub const NEXT_KEY: &str = "kilotun.io/next-key";
/// User-set (by `kgctl rotate-key`): any new value asks the node's kg for a new key.
pub const ROTATE_KEY: &str = "kilotun.io/rotate-key";
/// Written by kilotun's kg: the [`ROTATE_KEY`] value it last carried out.
pub const KEY_ROTATED: &str = "kilotun.io/key-rotated";

/// Written by kilotun's kg run with `--post-quantum`: `v1:` and the base64 BLAKE2s-256
/// fingerprint of its ML-KEM-768 encapsulation key. Its links to other such nodes get
/// post-quantum preshared keys (see `crate::pq`).
pub const PQ: &str = "kilotun.io/pq";

/// Written by kilotun's kg (not Kilo's): every `address:port` a peer could reach this node
/// at, comma-separated, IPv6 in brackets, in preference order (see `crate::endpoints`). Kilo's
/// agents read only [`ENDPOINT`], which kg writes as before.
pub const ENDPOINTS: &str = "kilotun.io/endpoints";

/// Every annotation kg writes, in the order it writes them (and the earlier one it removes).
pub const WRITTEN: [&str; 16] = [
    ENDPOINT,
    INTERNAL_IP,
    KEY,
    LAST_SEEN,
    WIREGUARD_IP,
    DISCOVERED_ENDPOINTS,
    GRANULARITY,
    CNI_COMPATIBILITY_IP,
    LEADER_ELECTION,
    SECOND_INTERNAL_IP,
    LEADER_SHARES,
    NEXT_KEY,
    KEY_ROTATED,
    PQ,
    ENDPOINTS,
    LEADERS_PER_LOCATION,
];
