//! Where kg converges does not depend on the way it got there, in every address layout of
//! `bench/scale.sh`: kg taken through readiness flips (held and released in batches, the
//! firewall later still), a leader moving to a new location, a node deleted and nodes coming
//! back ends with the same routes and rules, the same WireGuard peers and the same firewall
//! rules as a kg started afresh on the final cluster. Needs no root; kg runs on twins.

use std::time::Duration;

use control::coalesce::{FIREWALL_INTERVAL, READINESS_INTERVAL};
use control::fixtures::synthetic_cluster;
use control::ip::Endpoint;
use control::node::annotation;
use control::Node;
use ipnet::IpNet;
use kilotun::agent::Trigger;

use super::twin_cluster::{unix_now, Fixture};

const NODES: usize = 200;
const LOCATIONS: usize = 20;
const LOCAL: &str = "node-00000";

/// The layouts of `bench/scale.sh --layout`.
const LAYOUTS: [&str; 6] = ["apart", "internal", "ipv6", "dual", "dns", "nat"];

fn net(text: &str) -> IpNet {
    text.parse().unwrap()
}

fn endpoint(text: &str) -> Option<Endpoint> {
    Some(Endpoint::parse(text).unwrap())
}

/// The synthetic cluster with its addresses laid out as `layout`.
fn cluster(layout: &str) -> Vec<Node> {
    let mut nodes = synthetic_cluster(NODES, LOCATIONS);
    for (i, n) in nodes.iter_mut().enumerate() {
        let (hi, lo) = (i >> 8, i & 0xff);
        let v6_pods = net(&format!("fd42:{:x}:{lo:x}::/64", 64 + hi));
        match layout {
            "apart" => {}
            "internal" => {
                n.endpoint = endpoint(&format!("172.16.{hi}.{lo}:51820"));
                n.internal_ip = Some(net(&format!("172.16.{hi}.{lo}/12")));
            }
            "ipv6" => {
                n.endpoint = endpoint(&format!("[fd00:1::{i:x}]:51820"));
                n.internal_ip = Some(net(&format!("fd00:172:16::{i:x}/64")));
                n.subnet = Some(v6_pods);
            }
            "dual" => {
                n.second_internal_ip = Some(net(&format!("fd00:172:16::{i:x}/64")));
                n.extra_subnets = vec![v6_pods];
            }
            "dns" => n.endpoint = endpoint(&format!("node-{i}.layout.test:51820")),
            "nat" => {
                n.endpoint = endpoint(&format!("10.200.{hi}.{lo}:51820"));
                n.internal_ip = Some(net(&format!("10.200.{hi}.{lo}/16")));
                n.persistent_keepalive = 25;
            }
            other => panic!("no layout {other}"),
        }
    }
    nodes
}

/// What kg left on its host: its routes and rules, its device's peers and its firewall's rules.
fn host_state(
    f: &Fixture,
) -> (
    control::routes::RoutePlan,
    Vec<dataplane::PeerConfig>,
    String,
) {
    (
        f.twin.kernel.routes(),
        f.twin.engine.config().peers,
        format!("{:?}", f.twin.firewall.rules()),
    )
}

/// The pod CIDRs of Node `name` in `f`'s snapshot.
fn pods_of(f: &Fixture, name: &str) -> Vec<IpNet> {
    let object = &f.snapshot.nodes[name];
    let spec = object.spec.as_ref().unwrap();
    let mut cidrs: Vec<IpNet> = spec.pod_cidr.iter().map(|c| net(c)).collect();
    for c in spec.pod_cidrs.iter().flatten() {
        let c = net(c);
        if !cidrs.contains(&c) {
            cidrs.push(c);
        }
    }
    cidrs
}

fn routed(f: &Fixture, cidr: IpNet) -> bool {
    let peers = f.twin.engine.config().peers;
    peers.iter().any(|p| p.allowed_ips.contains(&cidr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kg_converges_where_a_fresh_start_would_in_every_address_layout() {
    for layout in LAYOUTS {
        let mut f = Fixture::with_nodes(&format!("layout-{layout}"), LOCAL, cluster(layout)).await;
        let peers_at_start = f.twin.engine.config().peers.len();
        assert_eq!(
            peers_at_start,
            LOCATIONS - 1,
            "{layout}: one peer per other location"
        );
        // Ten nodes of other locations go stale, one event each, 10 ms apart.
        let stale: Vec<String> = (21..31).map(|i| format!("node-{i:05}")).collect();
        for name in &stale {
            f.set_annotation(name, annotation::LAST_SEEN, "5".into());
            f.reconcile(Trigger::Event).await;
            f.advance(Duration::from_millis(10)).await;
        }
        f.advance(READINESS_INTERVAL).await;
        for name in &stale {
            for cidr in pods_of(&f, name) {
                assert!(
                    !routed(&f, cidr),
                    "{layout}: stale {name}'s {cidr} still routed"
                );
            }
        }
        // The leader of loc-005 moves to a new location; node-00150 is deleted; five of the
        // stale nodes check in again.
        f.set_annotation("node-00005", annotation::LOCATION, "loc-new".into());
        f.reconcile(Trigger::Event).await;
        let gone = pods_of(&f, "node-00150");
        f.snapshot.remove_node("node-00150");
        f.reconcile(Trigger::Event).await;
        let fresh = unix_now();
        for name in &stale[..5] {
            f.set_annotation(name, annotation::LAST_SEEN, fresh.to_string());
            f.reconcile(Trigger::Event).await;
            f.advance(Duration::from_millis(10)).await;
        }
        f.advance(FIREWALL_INTERVAL + READINESS_INTERVAL).await;
        assert_eq!(
            f.twin.agent.readiness_deadline(),
            None,
            "{layout}: nothing is held any more"
        );
        assert_eq!(
            f.twin.engine.config().peers.len(),
            LOCATIONS,
            "{layout}: the new location is a peer"
        );
        for cidr in pods_of(&f, "node-00005") {
            assert!(routed(&f, cidr), "{layout}: the moved leader's {cidr}");
        }
        for cidr in gone {
            assert!(!routed(&f, cidr), "{layout}: deleted node-00150's {cidr}");
        }
        for name in &stale[..5] {
            for cidr in pods_of(&f, name) {
                assert!(
                    routed(&f, cidr),
                    "{layout}: {name}, back, has its {cidr} routed"
                );
            }
        }

        let reached = host_state(&f);
        let started = Fixture::on_snapshot(
            &format!("layout-{layout}-fresh"),
            LOCAL,
            f.snapshot.clone(),
            u64::MAX / 2,
        )
        .await;
        let fresh = host_state(&started);
        assert!(
            !reached.0.routes.is_empty(),
            "{layout}: kg installed routes"
        );
        assert_eq!(reached.0, fresh.0, "{layout}: routes and rules");
        assert_eq!(reached.1, fresh.1, "{layout}: WireGuard peers");
        assert_eq!(reached.2, fresh.2, "{layout}: firewall rules");
    }
}
