//! The order in which kg changes the host when its node takes over a location, on in-memory
//! twins (no root needed).
//!
//! A node that is not its location's leader routes the other locations, their nodes' private
//! IPs included, through the leader over the underlay. When the leader dies and this node
//! takes over, its engine gets the other locations' leaders as peers and at once answers the
//! initiations they already sent (the engine holds them for this moment). If the engine
//! changes before the routes do, that answer to a remote leader's endpoint still follows the
//! route through the dead leader and is lost, and the remote side retries only after
//! WireGuard's 5 s `REKEY_TIMEOUT`: `tests/netns/kg_failover.rs` saw the dead leader's replacement
//! take 10 s instead of 5 in one of four runs of the whole file. So every change of the engine
//! must find the routes already in their new state: no route of kg's sends a peer's endpoint
//! through the old leader or into the WireGuard link. And a host step that fails (a link that
//! cannot be brought up) must not keep the new peers from the engine.

use std::net::IpAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use control::fixtures::{kube_node, node};
use control::routes::RoutePlan;
use kilotun::agent::twin_agent::TwinAgent;
use kilotun::agent::Trigger;
use kilotun::backend::{Listed, Snapshot};

const OLD_LEADER: &str = "192.168.0.11";
const WEST: &str = "192.168.20.3";
/// The WireGuard link's index on the twin kernel (`MemKernel::host`).
const KILO_LINK: u32 = 3;

/// kg's routes in `routes` that would send a packet for `ip` through the old leader or into
/// the WireGuard link (a route to it over the underlay, such as an endpoint bypass, is fine).
fn misrouting(routes: &RoutePlan, ip: IpAddr) -> Vec<String> {
    let old_leader: IpAddr = OLD_LEADER.parse().unwrap();
    routes
        .routes
        .iter()
        .filter(|r| r.dst.contains(&ip) && (r.gateway == Some(old_leader) || r.link == KILO_LINK))
        .map(|r| format!("{} via {:?} dev {}", r.dst, r.gateway, r.link))
        .collect()
}

/// n2 on twins, following n1 in east, with n3 alone in west; and the snapshot it saw.
async fn follower_of_east(test: &str) -> (TwinAgent, Snapshot, std::path::PathBuf) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let dir = std::env::temp_dir().join(format!("kilotun-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut twin = TwinAgent::start(&[
        "--backend=file",
        &format!("--cluster-dir={}", dir.display()),
        &format!("--key-file={}", dir.join("key").display()),
        "--hostname=n2",
        "--encapsulate=never",
        "--cni=false",
        "--mtu=1420",
    ])
    .await
    .unwrap();
    twin.engine.record_routes_of(&twin.kernel);
    // east: n1 (the leader by Kilo's rule: first by name) and n2 (this node, on eth0's
    // 192.168.0.0/24); west: n3 alone.
    let mut nodes = vec![
        node(
            "n1",
            &format!("{OLD_LEADER}:51820"),
            Some(&format!("{OLD_LEADER}/24")),
            "east",
            "10.42.1.0/24",
            "key1",
        ),
        node(
            "n2",
            "192.168.0.10:51820",
            Some("192.168.0.10/24"),
            "east",
            "10.42.2.0/24",
            "key2",
        ),
        node(
            "n3",
            &format!("{WEST}:51820"),
            Some(&format!("{WEST}/24")),
            "west",
            "10.42.3.0/24",
            "key3",
        ),
    ];
    for n in &mut nodes {
        n.last_seen = now;
    }
    let mut snapshot = Snapshot {
        listed: Listed::EVERYTHING,
        ..Snapshot::default()
    };
    for (rv, n) in nodes.iter().enumerate() {
        snapshot.put_node(&n.name, kube_node(n, rv as u64 + 1));
    }
    twin.agent
        .reconcile(&snapshot, Trigger::Resync)
        .await
        .unwrap();
    let before = twin.kernel.routes();
    assert!(
        !misrouting(&before, WEST.parse().unwrap()).is_empty(),
        "as a follower, n2 routes west's private IP through n1: {before:?}"
    );
    assert!(
        twin.engine.config().peers.is_empty(),
        "a follower has no peers"
    );
    (twin, snapshot, dir)
}

#[tokio::test]
async fn the_routes_change_before_the_engine_when_a_node_takes_over_its_location() {
    let (mut twin, mut snapshot, dir) = follower_of_east("handover-order").await;
    // n1 is gone: n2 takes over east and peers with n3.
    snapshot.remove_node("n1");
    twin.agent
        .reconcile(&snapshot, Trigger::Event)
        .await
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let changes = twin.engine.changes();
    let (config, routes) = changes
        .iter()
        .find(|(config, _)| !config.peers.is_empty())
        .expect("n2's engine got a peer once it led east");
    let endpoint = config.peers[0].endpoint.expect("n3's endpoint");
    assert_eq!(endpoint.ip(), WEST.parse::<IpAddr>().unwrap());
    let stale = misrouting(routes, endpoint.ip());
    assert!(
        stale.is_empty(),
        "when the engine got n3 as a peer, kg's routes still sent n3's endpoint {endpoint} \
         elsewhere: {stale:?}"
    );
}

#[tokio::test]
async fn a_link_that_cannot_come_up_does_not_keep_the_new_peers_from_the_engine() {
    let (mut twin, mut snapshot, dir) = follower_of_east("handover-refused").await;
    twin.kernel.refuse_link_up(true);
    snapshot.remove_node("n1");
    let result = twin.agent.reconcile(&snapshot, Trigger::Event).await;
    let _ = std::fs::remove_dir_all(&dir);
    let error = format!("{:#}", result.expect_err("the link step failed"));
    assert!(error.contains("refused"), "{error}");
    let peers = twin.engine.config().peers;
    assert_eq!(
        peers.len(),
        1,
        "the engine still got n3 as a peer, though the link could not come up"
    );
}
