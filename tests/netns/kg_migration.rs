//! End-to-end: a cluster migrates from Kilo to kilotun node by node, in every order an operator
//! may choose, while pods ping across locations (file backend, network namespaces).
//!
//! Kilo's agents are emulated by kg with `--leader-election=kilo`: it elects every location's
//! leader by Kilo's rule and never writes `kilotun.io/leader-election: lease`, which is what
//! decides whether kilotun's agents may use leases (real Kilo writes no such annotation either).
//! Kilo itself is in no package registry, so a fresh CI machine cannot build it; the same orders
//! run against Kilo's own `kg` in `tests/real/real_kube/kilo_peer.rs` where its source is present.
//! Each migrated node gets the manifests' `--leader-election=lease`; each step's longest
//! cross-location gap is printed and must be at most 2 s, and every location's leader stays the
//! one Kilo's rule chose until the last emulated Kilo agent is gone, when the leases take over
//! with the same leaders.

use crate::common;

use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::pinger::Pinger;

const EAST: [&str; 2] = ["n1", "n2"];
const WEST: [&str; 2] = ["n3", "n4"];
const KILO: [&str; 2] = ["--encapsulate=never", "--leader-election=kilo"];
const KILOTUN: [&str; 2] = ["--encapsulate=never", "--leader-election=lease"];

/// How the old agent leaves when its node migrates.
#[derive(Clone, Copy, Debug)]
enum Departure {
    /// Killed (a node whose old agent crashed, or was replaced with `--clean-up=false`).
    Killed,
    /// SIGTERM with `--clean-up=true`, as Kilo's manifests run it: routes, rules and the node's
    /// annotations are removed before the new agent starts.
    CleanedUp,
}

/// Each location's one leader, or `None` while a location has none or several.
fn leaders(c: &Cluster) -> Option<(String, String)> {
    let (east, west) = (c.leading(&EAST), c.leading(&WEST));
    (east.len() == 1 && west.len() == 1).then(|| (east[0].clone(), west[0].clone()))
}

/// The follower of a location given its leader.
fn follower<'a>(location: &[&'a str; 2], leader: &str) -> &'a str {
    if location[0] == leader {
        location[1]
    } else {
        location[0]
    }
}

/// The order in which nodes migrate, given the leaders (east's, west's) Kilo's rule chose.
type Order = fn(&str, &str) -> Vec<String>;

fn migrate_in_order(test: &str, order: Order, departure: Departure) {
    common::require_root(test);
    let mut c = Cluster::with_nodes(
        &["east", "west"],
        &[
            ("n1", "east"),
            ("n2", "east"),
            ("n3", "west"),
            ("n4", "west"),
        ],
    );
    for i in 0..4 {
        c.start_kg(i, &KILO);
    }
    let meshed = c.wait_for(Duration::from_secs(40), |c| {
        c.all_pods_reachable().is_ok() && leaders(c).is_some()
    });
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    let chosen = leaders(&c).unwrap();
    // Pod to pod both ways, so each direction's first sender is tested: n2 and n4 are
    // followers or leaders depending on Kilo's rule, and every pair crosses the leaders' link.
    let pod = |n: &str| c.node(n).pod_ip.clone();
    let pingers: Vec<(String, Pinger)> = [("n2", "n4"), ("n3", "n1")]
        .iter()
        .map(|(from, to)| {
            let p = Pinger::start_from(&c.node(from).ns.name, &pod(from), &pod(to));
            (format!("{from}→{to}"), p)
        })
        .collect();
    for (pair, p) in &pingers {
        assert!(
            p.wait_flowing(Instant::now(), Duration::from_secs(10)),
            "{pair}\n{}",
            c.logs()
        );
    }
    let order = order(&chosen.0, &chosen.1);
    eprintln!("{test}: leaders {chosen:?}, migrating {order:?}");
    let mut gaps = Vec::new();
    for (step, name) in order.iter().enumerate() {
        let i = c.nodes.iter().position(|n| n.name == *name).unwrap();
        let moved = Instant::now();
        match departure {
            Departure::Killed => c.nodes[i].kill(),
            Departure::CleanedUp => c.nodes[i].stop(),
        }
        c.start_kg(i, &KILOTUN);
        for (pair, p) in &pingers {
            assert!(
                p.wait_flowing(moved, Duration::from_secs(30)),
                "{pair} never flowed again after migrating {name}\n{}",
                c.logs()
            );
        }
        // Late disturbances (a leader change, a re-handshake) count too.
        std::thread::sleep(Duration::from_secs(3));
        let (pair, gap) = pingers
            .iter()
            .map(|(pair, p)| (pair.clone(), p.longest_gap_after(moved)))
            .max_by_key(|(_, gap)| *gap)
            .unwrap();
        eprintln!(
            "{test}: {name} migrated ({departure:?}): longest cross-location gap {:.2} s ({pair})",
            gap.as_secs_f64()
        );
        gaps.push((name.to_string(), gap));
        let last = step + 1 == order.len();
        if !last {
            // Kilo's rule governs while an emulated Kilo agent remains: the same leaders.
            assert_eq!(
                leaders(&c).as_ref(),
                Some(&chosen),
                "after migrating {name}\n{}",
                c.logs()
            );
        }
    }
    // Every node runs kilotun: the leases take over, each held by the leader Kilo's rule chose.
    let leased = c.wait_for(Duration::from_secs(15), |c| {
        c.lease_holder("east").as_ref() == Some(&chosen.0)
            && c.lease_holder("west").as_ref() == Some(&chosen.1)
    });
    assert!(
        leased,
        "leases {:?} {:?}, chosen {chosen:?}\n{}",
        c.lease_holder("east"),
        c.lease_holder("west"),
        c.logs()
    );
    assert_eq!(leaders(&c), Some(chosen), "{}", c.logs());
    for (name, gap) in gaps {
        assert!(
            gap <= Duration::from_secs(2),
            "migrating {name}: gap {gap:?}\n{}",
            c.logs()
        );
    }
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn nodes_migrate_from_kilo_leaders_first() {
    migrate_in_order(
        "nodes_migrate_from_kilo_leaders_first",
        |east, west| {
            let followers = [follower(&EAST, east), follower(&WEST, west)];
            [east, west]
                .into_iter()
                .chain(followers)
                .map(String::from)
                .collect()
        },
        Departure::Killed,
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn nodes_migrate_from_kilo_leaders_last() {
    migrate_in_order(
        "nodes_migrate_from_kilo_leaders_last",
        |east, west| {
            let followers = [follower(&EAST, east), follower(&WEST, west)];
            followers
                .into_iter()
                .chain([east, west])
                .map(String::from)
                .collect()
        },
        Departure::Killed,
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn nodes_migrate_from_kilo_location_by_location() {
    migrate_in_order(
        "nodes_migrate_from_kilo_location_by_location",
        |east, west| {
            let (e, w) = (follower(&EAST, east), follower(&WEST, west));
            [east, e, w, west].map(String::from).to_vec()
        },
        Departure::Killed,
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn nodes_migrate_from_kilo_cleaning_up_as_kilos_manifests_do() {
    // Followers and leaders interleaved, each old agent cleaning up on SIGTERM.
    migrate_in_order(
        "nodes_migrate_from_kilo_cleaning_up_as_kilos_manifests_do",
        |east, west| {
            let (e, w) = (follower(&EAST, east), follower(&WEST, west));
            [e, east, west, w].map(String::from).to_vec()
        },
        Departure::CleanedUp,
    );
}
