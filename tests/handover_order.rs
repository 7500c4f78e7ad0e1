//! The order in which kg changes the host when its node takes over a location, on in-memory
//! twins (no root needed).
//!
//! A node that is not its location's leader routes the other locations, their nodes' private
//! IPs included, through the leader over the underlay. When the leader dies and this node
//! takes over, its engine gets the other locations' leaders as peers and at once answers the
//! initiations they already sent (the engine holds them for this moment). If the engine
//! changes before the routes do, that answer to a remote leader's endpoint still follows the
//! route through the dead leader and is lost, and the remote side retries only after
//! WireGuard's 5 s `REKEY_TIMEOUT`: `tests/kg_failover.rs` saw the dead leader's replacement
//! take 10 s instead of 5 in one run of three. So every change of the engine must find the
//! routes already in their new state: none of kg's routes covers a peer's endpoint.

use std::net::IpAddr;
use std::time::{SystemTime, UNIX_EPOCH};

use control::fixtures::{kube_node, node};
use control::routes::RoutePlan;
use kilotun::agent::twin_agent::TwinAgent;
use kilotun::agent::Trigger;
use kilotun::backend::{Listed, Snapshot};

/// kg's routes in `routes` that would carry a packet to `ip`.
fn covering(routes: &RoutePlan, ip: IpAddr) -> Vec<String> {
    routes
        .routes
        .iter()
        .filter(|r| r.dst.contains(&ip))
        .map(|r| format!("{} via {:?} dev {}", r.dst, r.gateway, r.link))
        .collect()
}

#[tokio::test]
async fn the_routes_change_before_the_engine_when_a_node_takes_over_its_location() {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let dir = std::env::temp_dir().join(format!("kilotun-handover-order-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let twin = TwinAgent::start(&[
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
    let mut agent = twin.agent;
    twin.engine.record_routes_of(&twin.kernel);

    // east: n1 (the leader by Kilo's rule: first by name) and n2 (this node, on eth0's
    // 192.168.0.0/24); west: n3 alone.
    let mut nodes = vec![
        node(
            "n1",
            "192.168.0.11:51820",
            Some("192.168.0.11/24"),
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
            "192.168.20.3:51820",
            Some("192.168.20.3/24"),
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
    agent.reconcile(&snapshot, Trigger::Resync).await.unwrap();
    let west = "192.168.20.3".parse().unwrap();
    let before = twin.kernel.routes();
    assert!(
        !covering(&before, west).is_empty(),
        "as a follower, n2 routes west's private IP through n1: {before:?}"
    );
    assert!(
        twin.engine.config().peers.is_empty(),
        "a follower has no peers"
    );

    // n1 is gone: n2 takes over east and peers with n3.
    snapshot.remove_node("n1");
    agent.reconcile(&snapshot, Trigger::Event).await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let changes = twin.engine.changes();
    let (config, routes) = changes
        .iter()
        .find(|(config, _)| !config.peers.is_empty())
        .expect("n2's engine got a peer once it led east");
    let endpoint = config.peers[0].endpoint.expect("n3's endpoint");
    assert_eq!(endpoint.ip(), west);
    let stale = covering(routes, endpoint.ip());
    assert!(
        stale.is_empty(),
        "when the engine got n3 as a peer, kg's routes still sent n3's endpoint {endpoint} \
         elsewhere: {stale:?}"
    );
}
