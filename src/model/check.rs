//! What the model checks: invariants that hold after every step, and the converged state every
//! surviving node must reach once the faults stop. Each is judged on what the agents did to
//! their hosts (the WireGuard device's peers, the link's address, the kernel's routes, the
//! leases written), never on what they say about themselves.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use control::node::Granularity;
use control::routes::{MAIN_TABLE, UNDERLAY_TABLE};
use ipnet::IpNet;

use super::sim::{Election, Sim, SimNode};

/// The WireGuard link's index on every model node's kernel ([`MemKernel::host_at`]).
///
/// [`MemKernel::host_at`]: crate::agent::shells::twins::MemKernel::host_at
const WIREGUARD_LINK: u32 = 3;

/// After every step, on every node: what its agent did to its host is never wrong, whatever
/// the agent was told or is still to learn ([`checks`] names each invariant).
pub fn always(sim: &Sim) -> Result<(), String> {
    for (name, node) in &sim.nodes {
        for (_, check) in checks() {
            check(name, node)?;
        }
    }
    Ok(())
}

/// An invariant judged on one node.
type NodeCheck = fn(&str, &SimNode) -> Result<(), String>;

/// Every invariant [`always`] checks, with what it says.
pub fn checks() -> [(&'static str, NodeCheck); 7] {
    [
        ("no two peers of a device share a key", distinct_keys),
        (
            "no allowed IP of one peer overlaps one of another (WireGuard would route it to one)",
            disjoint_allowed_ips,
        ),
        ("no device holds its own node's key as a peer", no_peer_is_itself),
        (
            "no route takes the node's own pod CIDR into the WireGuard link (unless its kernel refuses changes and its agent retries)",
            own_pods_stay_home,
        ),
        (
            "no peer's endpoint is routed into the WireGuard link, the engine's own packets looping into the tunnel (unless its kernel refuses changes and its agent retries)",
            endpoints_stay_outside,
        ),
        (
            "every route and rule kg holds in the kernel is in its saved record (a successor claims all of it)",
            routes_are_recorded,
        ),
        (
            "no device write outside a pass (the post-quantum keys too go in with a pass's device write)",
            device_written_in_passes,
        ),
    ]
}

fn device_written_in_passes(name: &str, node: &SimNode) -> Result<(), String> {
    match node
        .running
        .as_ref()
        .map(|r| r.writes_outside_pass.as_slice())
    {
        Some([first, ..]) => Err(format!(
            "{name}'s device was written after {first} though no pass ran"
        )),
        _ => Ok(()),
    }
}

/// The device's peers of a running agent: key, endpoint and allowed IPs.
fn device(node: &SimNode) -> Option<Vec<dataplane::PeerConfig>> {
    Some(node.running.as_ref()?.twin.engine.config().peers)
}

fn distinct_keys(name: &str, node: &SimNode) -> Result<(), String> {
    let Some(peers) = device(node) else {
        return Ok(());
    };
    let keys: BTreeSet<_> = peers.iter().map(|p| p.public_key.as_bytes()).collect();
    if keys.len() != peers.len() {
        return Err(format!("{name}'s device has two peers with one key"));
    }
    Ok(())
}

fn disjoint_allowed_ips(name: &str, node: &SimNode) -> Result<(), String> {
    let Some(peers) = node.device_peers() else {
        return Ok(());
    };
    for (i, (a, a_ips)) in peers.iter().enumerate() {
        for (b, b_ips) in &peers[i + 1..] {
            for x in a_ips {
                if let Some(y) = b_ips.iter().find(|y| x.contains(*y) || y.contains(x)) {
                    return Err(format!(
                        "{name}'s device routes {x} to peer {a} and {y} to peer {b}"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn no_peer_is_itself(name: &str, node: &SimNode) -> Result<(), String> {
    let own = node.public_key();
    match node.device_peers() {
        Some(peers) if peers.iter().any(|(k, _)| *k == own) => {
            Err(format!("{name}'s device holds its own key {own} as a peer"))
        }
        _ => Ok(()),
    }
}

/// True when the node's routes cannot be judged: its kernel refuses changes, or refused them
/// and its agent is still retrying ([`crate::agent::Agent::host_behind`]).
fn routes_behind(node: &SimNode) -> bool {
    node.kernel.refuses_changes()
        || node
            .running
            .as_ref()
            .is_some_and(|r| r.twin.agent.host_behind())
}

fn own_pods_stay_home(name: &str, node: &SimNode) -> Result<(), String> {
    if routes_behind(node) {
        return Ok(());
    }
    let own = node.pod_cidr;
    let routes = node.kernel.routes().routes;
    match routes
        .iter()
        .find(|r| r.link == WIREGUARD_LINK && (r.dst.contains(&own) || own.contains(&r.dst)))
    {
        Some(r) => Err(format!(
            "{name} routes {} (its own pod CIDR is {own}) into the WireGuard link",
            r.dst
        )),
        None => Ok(()),
    }
}

fn endpoints_stay_outside(name: &str, node: &SimNode) -> Result<(), String> {
    if routes_behind(node) {
        return Ok(());
    }
    let Some(peers) = device(node) else {
        return Ok(());
    };
    let held = node.kernel.routes();
    let (routes, rules) = (held.routes, held.rules);
    let mark = node
        .running
        .as_ref()
        .map_or(0, |r| r.twin.engine.config().interface.fwmark);
    for peer in &peers {
        let Some(endpoint) = peer.endpoint else {
            continue;
        };
        let ip = endpoint.ip();
        // A marked packet follows the tunnel guard's rules when the kernel holds them for its
        // family: the underlay table alone (no route there: unreachable, never the tunnel).
        let guarded = rules.iter().any(|r| {
            r.guard
                .is_some_and(|g| g.ipv6 == ip.is_ipv6() && g.mark == mark && mark != 0)
                && r.table == UNDERLAY_TABLE
        });
        let table = if guarded { UNDERLAY_TABLE } else { MAIN_TABLE };
        let chosen = routes
            .iter()
            .filter(|r| r.table == table && r.dst.contains(&ip))
            .max_by_key(|r| r.dst.prefix_len());
        if let Some(r) = chosen.filter(|r| r.link == WIREGUARD_LINK) {
            return Err(format!(
                "{name} sends WireGuard's packets to {endpoint} into its own tunnel: {} is routed into the WireGuard link",
                r.dst
            ));
        }
    }
    Ok(())
}

fn routes_are_recorded(name: &str, node: &SimNode) -> Result<(), String> {
    let held = node.kernel.routes();
    if held.routes.is_empty() && held.rules.is_empty() {
        return Ok(());
    }
    let recorded = crate::agent::shells::state::load_routes(&node.key_file())
        .map_err(|e| format!("{name}'s record of its routes cannot be read: {e:#}"))?;
    if let Some(r) = held.routes.iter().find(|r| !recorded.routes.contains(r)) {
        return Err(format!(
            "{name}'s kernel holds kg's route {r:?}, which its saved record does not"
        ));
    }
    if let Some(r) = held.rules.iter().find(|r| !recorded.rules.contains(r)) {
        return Err(format!(
            "{name}'s kernel holds kg's rule {r:?}, which its saved record does not"
        ));
    }
    Ok(())
}

/// The nodes expected in the converged mesh: running, reachable and with no malformed
/// annotation left (the caller has healed the faults), by segment: their location, or in full
/// granularity each node alone (its own segment and leader, as in Kilo).
fn members(sim: &Sim) -> BTreeMap<&str, Vec<(&String, &SimNode)>> {
    let mut by_segment: BTreeMap<&str, Vec<(&String, &SimNode)>> = BTreeMap::new();
    for (name, node) in &sim.nodes {
        if node.running.is_some() {
            let segment = match sim.granularity {
                Granularity::Full => name.as_str(),
                _ => node.location.as_str(),
            };
            by_segment.entry(segment).or_default().push((name, node));
        }
    }
    by_segment
}

/// True when Node `name` is annotated with a persistent keepalive, Kilo's mark of a node
/// behind NAT.
fn keeps_alive(snapshot: &crate::backend::Snapshot, name: &str) -> bool {
    snapshot
        .nodes
        .get(name)
        .and_then(|o| o.metadata.annotations.as_ref())
        .and_then(|a| a.get(control::node::annotation::PERSISTENT_KEEPALIVE))
        .and_then(|v| v.parse::<u16>().ok())
        .is_some_and(|k| k > 0)
}

/// Once the faults have stopped and enough model time has passed: every location with a
/// running node has exactly one leader, the one its lease names, chosen as Kilo's rule and the
/// operator's annotations say (uncordoned before cordoned, `kilo.squat.ai/leader` first unless
/// the lease names it the cut-off holder its holder replaced; in full granularity every node is
/// its own location and leader, and no lease is taken); every leader's device has exactly the
/// other locations' leaders and the valid Peers as peers (no standby peer stays), each running
/// node's pod CIDR routed to its location's leader alone (where both locations' leaders are
/// behind NAT, to the relay: the first location by name whose leader is not); every follower
/// routes the other locations' pods through its own leader; nothing routes to a node that left.
pub fn converged(
    sim: &Sim,
    left: &BTreeSet<IpNet>,
    peers: &[(control::Key, IpNet)],
) -> Result<(), String> {
    always(sim)?;
    let snapshot = sim.cluster.snapshot();
    let by_location = members(sim);
    let mut leaders: BTreeMap<&str, (&String, &SimNode)> = BTreeMap::new();
    for (location, nodes) in &by_location {
        let leading: Vec<&String> = nodes
            .iter()
            .filter(|(_, n)| n.leads())
            .map(|(name, _)| *name)
            .collect();
        let [leader] = leading[..] else {
            return Err(format!(
                "location {location} has {} leaders ({leading:?}) among {:?}",
                leading.len(),
                nodes.iter().map(|(n, _)| n).collect::<Vec<_>>()
            ));
        };
        let object = |name: &str| snapshot.nodes.get(name).cloned();
        let cordoned = |name: &str| {
            object(name)
                .and_then(|o| o.spec.as_ref()?.unschedulable)
                .unwrap_or(false)
        };
        let preferred = |name: &str| {
            object(name)
                .and_then(|o| o.metadata.annotations.clone())
                .is_some_and(|a| a.contains_key(control::node::annotation::LEADER))
        };
        match sim.election {
            _ if sim.granularity == Granularity::Full => {}
            Election::Lease => {
                if cordoned(leader) && nodes.iter().any(|(n, _)| !cordoned(n)) {
                    return Err(format!(
                        "location {location} is led by cordoned {leader} though an uncordoned node runs"
                    ));
                }
                // A holder a verifier found cut off and replaced is kept out, annotated or
                // not, while its replacement holds the lease.
                let lease = snapshot
                    .leases
                    .get(&control::leader::lease_name(location))
                    .cloned()
                    .unwrap_or_default();
                let replaced = |name: &str| lease.cut_off_predecessor.as_deref() == Some(name);
                if !preferred(leader)
                    && nodes
                        .iter()
                        .any(|(n, _)| preferred(n) && !cordoned(n) && !replaced(n))
                {
                    return Err(format!(
                        "location {location} is led by {leader}, not by its node annotated kilo.squat.ai/leader"
                    ));
                }
                let holder = sim.lease_holder(location);
                if holder.as_deref() != Some(leader.as_str()) {
                    return Err(format!(
                        "location {location} is led by {leader} but its lease names {holder:?}"
                    ));
                }
            }
            Election::Kilo => {
                // Kilo's rule among the running nodes (all on private addresses here): the
                // first annotated one by name, else the first by name.
                let first_preferred = nodes.iter().map(|(n, _)| *n).find(|n| preferred(n));
                let expected = first_preferred.unwrap_or(nodes[0].0);
                if leader != expected {
                    return Err(format!(
                        "location {location} is led by {leader}, where Kilo's rule picks {expected}"
                    ));
                }
            }
        }
        let node = nodes.iter().find(|(n, _)| *n == leader).expect("listed");
        leaders.insert(location, *node);
    }

    // The segments whose leader is behind NAT, by its Node's keepalive (Kilo's mark), and the
    // segment that carries traffic between two of them: the first by name that is not (the
    // model annotates no `kilotun.io/relay`); none when every segment is, as Kilo peers them.
    let behind_nat: BTreeSet<&str> = leaders
        .iter()
        .filter(|(_, (name, _))| keeps_alive(&snapshot, name))
        .map(|(segment, _)| *segment)
        .collect();
    let carrier = |from: &str, to: &str| -> control::Key {
        let relay = (behind_nat.contains(from) && behind_nat.contains(to))
            .then(|| {
                leaders
                    .keys()
                    .find(|r| **r != from && **r != to && !behind_nat.contains(**r))
            })
            .flatten();
        leaders[relay.copied().unwrap_or(to)].1.public_key()
    };

    for (location, (name, node)) in &leaders {
        let device = node.device_peers().unwrap_or_default();
        let expected: BTreeSet<control::Key> = leaders
            .keys()
            .filter(|other| *other != location)
            .map(|other| carrier(location, other))
            .chain(peers.iter().map(|(key, _)| *key))
            .collect();
        let have: BTreeSet<control::Key> = device.iter().map(|(k, _)| *k).collect();
        if have != expected {
            let named = |keys: Vec<&control::Key>| -> Vec<String> {
                keys.into_iter()
                    .map(|key| key_owner(sim, peers, key))
                    .collect()
            };
            return Err(format!(
                "leader {name} of {location} has {} peers, not the {} other leaders (or their relays) and Peers: extra {:?}, missing {:?}",
                have.len(),
                expected.len(),
                named(have.difference(&expected).collect()),
                named(expected.difference(&have).collect()),
            ));
        }
        for (other, members) in &by_location {
            if other == location {
                continue;
            }
            let their_key = carrier(location, other);
            for (member, m) in members {
                let carriers: Vec<&control::Key> = device
                    .iter()
                    .filter(|(_, ips)| ips.iter().any(|ip| ip.contains(&m.pod_cidr)))
                    .map(|(k, _)| k)
                    .collect();
                if carriers != [&their_key] {
                    return Err(format!(
                        "leader {name} of {location} routes {member}'s pods ({}) to {} peers, not to {other}'s leader (or its relay) alone",
                        m.pod_cidr,
                        carriers.len()
                    ));
                }
            }
        }
        for (key, cidr) in peers {
            if !device
                .iter()
                .any(|(k, ips)| k == key && ips.iter().any(|ip| ip.contains(cidr)))
            {
                return Err(format!(
                    "leader {name} of {location} does not route Peer {cidr}"
                ));
            }
        }
    }

    for (location, nodes) in &by_location {
        let (leader_name, leader) = leaders[location];
        let gateway: IpAddr = leader.address.addr();
        for (name, node) in nodes {
            let routes = node.kernel.routes();
            if *name != leader_name {
                for (other, members) in &by_location {
                    if other == location {
                        continue;
                    }
                    for (member, m) in members {
                        let via: Vec<Option<IpAddr>> = routes
                            .routes
                            .iter()
                            .filter(|r| r.table == MAIN_TABLE && r.dst.contains(&m.pod_cidr))
                            .map(|r| r.gateway)
                            .collect();
                        if via != [Some(gateway)] {
                            return Err(format!(
                                "follower {name} of {location} routes {member}'s pods ({}) via {via:?}, not via its leader {leader_name} ({gateway})",
                                m.pod_cidr
                            ));
                        }
                    }
                }
            }
            for gone in left {
                let device = node.device_peers().unwrap_or_default();
                let mesh_route = |r: &&control::routes::Route| r.table != UNDERLAY_TABLE;
                if let Some(route) = routes
                    .routes
                    .iter()
                    .filter(mesh_route)
                    .find(|r| r.dst.contains(gone))
                {
                    return Err(format!(
                        "{name} still routes {gone}, the pods of a node that left: {route:?}"
                    ));
                }
                if let Some((key, _)) = device
                    .iter()
                    .find(|(_, ips)| ips.iter().any(|ip| ip.contains(gone)))
                {
                    return Err(format!(
                        "{name}'s device still sends {gone}, the pods of a node that left, to peer {key}"
                    ));
                }
            }
        }
    }
    super::check_endpoints::tunnels_carry(sim)?;
    super::check_published::conditions_ready(sim)?;
    if sim.post_quantum {
        super::check_pq::keyed(sim)?;
    }
    Ok(())
}

/// Who holds `key`: a node by name (with its location), a Peer by its address, or neither.
fn key_owner(sim: &Sim, peers: &[(control::Key, IpNet)], key: &control::Key) -> String {
    if let Some(name) = super::report::key_holder(sim, key) {
        return format!("{name} in {}", sim.nodes[&name].location);
    }
    if let Some((_, cidr)) = peers.iter().find(|(k, _)| k == key) {
        return format!("Peer {cidr}");
    }
    format!("a key no node or Peer holds ({})", key)
}
