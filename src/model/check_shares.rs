//! The converged state with several leaders per location (`--leaders-per-location`), judged,
//! as [`super::check::converged`] judges one leader, on what the agents did to their hosts:
//! the devices' peers and allowed IPs, the kernels' routes, the leases written.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use control::leader::shares::share_lease_name;
use control::routes::MAIN_TABLE;
use ipnet::IpNet;

use super::check::always;
use super::sim::{Sim, SimNode};

/// Once the faults have stopped (no cordon, annotation, NAT or Peer in these scenarios) and
/// enough model time has passed, with `shares` leaders per location and leases:
/// - each location has min(`shares`, its running nodes) leaders, each holding exactly one of
///   its location's valid share leases (a lease names one holder, so no two hold the same);
/// - every leader's device has exactly the other locations' leaders as peers, and routes each
///   of their nodes' pods to one of them, the same one as every other leader does (the node's
///   share is agreed);
/// - every follower routes the other locations' pods via one leader of its own location, the
///   one the other locations route its own pods to (it is in that leader's share), and every
///   node is in exactly one share.
pub fn converged_shares(sim: &Sim, shares: usize) -> Result<(), String> {
    always(sim)?;
    let snapshot = sim.cluster.snapshot();
    let mut by_location: BTreeMap<&str, Vec<(&String, &SimNode)>> = BTreeMap::new();
    for (name, node) in sim.nodes.iter().filter(|(_, n)| n.running.is_some()) {
        by_location
            .entry(&node.location)
            .or_default()
            .push((name, node));
    }
    let mut leaders: BTreeMap<&str, Vec<(&String, &SimNode)>> = BTreeMap::new();
    for (location, nodes) in &by_location {
        let leading: Vec<(&String, &SimNode)> =
            nodes.iter().filter(|(_, n)| n.leads()).copied().collect();
        let want = shares.min(nodes.len());
        if leading.len() != want {
            return Err(format!(
                "location {location} has {} leaders ({:?}), not {want}",
                leading.len(),
                leading.iter().map(|(n, _)| n).collect::<Vec<_>>()
            ));
        }
        for (name, _) in &leading {
            let held: Vec<usize> = (0..shares)
                .filter(|&s| {
                    snapshot
                        .leases
                        .get(&share_lease_name(location, s))
                        .is_some_and(|l| {
                            l.holder.as_deref() == Some(name.as_str())
                                && l.is_valid(sim.now.unix_ms)
                        })
                })
                .collect();
            if held.len() != 1 {
                return Err(format!(
                    "{name} leads in {location} and holds {} of its {shares} shares' valid leases ({held:?}), not one",
                    held.len()
                ));
            }
        }
        leaders.insert(location, leading);
    }

    // Which leader each node's pods are routed to, as the first remote leader to route them
    // says; every other remote leader must agree.
    let mut share_of: BTreeMap<&str, control::Key> = BTreeMap::new();
    for (location, leading) in &leaders {
        let remote: BTreeSet<control::Key> = leaders
            .iter()
            .filter(|(other, _)| *other != location)
            .flat_map(|(_, l)| l.iter().map(|(_, n)| n.public_key()))
            .collect();
        for (name, node) in leading {
            let device = node.device_peers().unwrap_or_default();
            let have: BTreeSet<control::Key> = device.iter().map(|(k, _)| *k).collect();
            if have != remote {
                return Err(format!(
                    "leader {name} of {location} has {} peers, not the {} leaders of the other locations",
                    have.len(),
                    remote.len()
                ));
            }
            for (other, members) in by_location.iter().filter(|(o, _)| *o != location) {
                for (member, m) in members {
                    let carriers = carriers_of(&device, m.pod_cidr);
                    let [carrier] = carriers[..] else {
                        return Err(format!(
                            "leader {name} of {location} routes {member}'s pods to {} peers",
                            carriers.len()
                        ));
                    };
                    let theirs = leaders[other]
                        .iter()
                        .any(|(_, l)| l.public_key() == carrier);
                    if !theirs {
                        return Err(format!(
                            "leader {name} of {location} routes {member}'s pods to a peer that leads no share of {other}"
                        ));
                    }
                    let agreed = *share_of.entry(member.as_str()).or_insert(carrier);
                    if agreed != carrier {
                        return Err(format!(
                            "the leaders of the other locations disagree on {member}'s share"
                        ));
                    }
                }
            }
        }
    }

    for (location, nodes) in &by_location {
        let own: &[(&String, &SimNode)] = &leaders[location];
        let remote_cidrs: Vec<IpNet> = by_location
            .iter()
            .filter(|(o, _)| *o != location)
            .flat_map(|(_, m)| m.iter().map(|(_, n)| n.pod_cidr))
            .collect();
        for (name, node) in nodes {
            if own.iter().any(|(l, _)| l == name) {
                continue;
            }
            let routes = node.kernel.routes();
            let gateways: BTreeSet<Option<IpAddr>> = remote_cidrs
                .iter()
                .flat_map(|cidr| {
                    routes
                        .routes
                        .iter()
                        .filter(move |r| r.table == MAIN_TABLE && r.dst.contains(cidr))
                        .map(|r| r.gateway)
                })
                .collect();
            let leader = own
                .iter()
                .find(|(_, l)| gateways == BTreeSet::from([Some(l.address.addr())]));
            let Some((leader_name, leader)) = leader else {
                return Err(format!(
                    "follower {name} of {location} routes the other locations' pods via {gateways:?}, not via one leader of its own location"
                ));
            };
            if share_of.get(name.as_str()) != Some(&leader.public_key()) && leaders.len() > 1 {
                return Err(format!(
                    "follower {name} of {location} routes through {leader_name}, but the other locations route its pods to another leader"
                ));
            }
        }
    }
    Ok(())
}

/// Which share of its location each running node of `location` is in, as the first running
/// leader of another location routes its pods: the number (from 0) of the share lease its
/// carrier holds. `None` when no leader of another location routes them all.
pub fn shares_seen_from_afar(sim: &Sim, location: &str) -> Option<BTreeMap<String, usize>> {
    let snapshot = sim.cluster.snapshot();
    let running = || sim.nodes.iter().filter(|(_, n)| n.running.is_some());
    let (_, remote) = running().find(|(_, n)| n.location != location && n.leads())?;
    let device = remote.device_peers()?;
    let share_held_by = |key: control::Key| {
        let (name, _) = running().find(|(_, n)| n.public_key() == key)?;
        (0..control::leader::shares::MAX_SHARES).find(|&s| {
            snapshot
                .leases
                .get(&share_lease_name(location, s))
                .is_some_and(|l| l.holder.as_deref() == Some(name.as_str()))
        })
    };
    running()
        .filter(|(_, n)| n.location == location)
        .map(|(name, node)| {
            let carrier = *carriers_of(&device, node.pod_cidr).first()?;
            Some((name.clone(), share_held_by(carrier)?))
        })
        .collect()
}

/// The peers of a `device` whose allowed IPs hold `pod_cidr`.
fn carriers_of(device: &[(control::Key, Vec<IpNet>)], pod_cidr: IpNet) -> Vec<control::Key> {
    device
        .iter()
        .filter(|(_, ips)| ips.iter().any(|ip| ip.contains(&pod_cidr)))
        .map(|(k, _)| *k)
        .collect()
}
