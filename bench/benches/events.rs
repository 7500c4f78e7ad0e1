//! The per-event cost of a Node update that moves only `last-seen`, at 1,000 and
//! 5,000 Nodes in locations of 10:
//!
//! - `after`: kg's whole reconcile for one such event, on in-memory twins of the kernel,
//!   iptables and the device (they count calls; none is made), including the backend's
//!   snapshot update.
//! - `table`: the node table's share (one re-translation, readiness deadline moved).
//! - `before`: the pure part of what every event cost before: every Node translated again,
//!   readiness filtered, the topology, the leader's configuration, the route plan and the
//!   iptables rules recomputed. A lower bound: the netlink dumps and the `iptables -S` children
//!   each event also ran are not counted.

#![allow(missing_docs)]

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use control::fixtures::{kube_node, synthetic_cluster};
use control::iptables::IptablesOptions;
use control::node::{annotation, Granularity, DEFAULT_TOPOLOGY_LABEL};
use control::routes::{Compatibility, Encapsulate, Links, RouteOptions};
use control::table::NodeTable;
use control::{translate_node, Topology, TopologyParams};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use k8s_openapi::api::core::v1::Node as KubeNode;
use kilotun::agent::twin_agent::TwinAgent;
use kilotun::agent::Trigger;
use kilotun::backend::{Listed, Snapshot};

const LOCAL: &str = "node-00000";

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_secs() as i64
}

fn objects(count: usize) -> BTreeMap<String, Arc<KubeNode>> {
    let now = unix_now();
    synthetic_cluster(count, count / 10)
        .into_iter()
        .enumerate()
        .map(|(i, mut n)| {
            n.last_seen = now;
            (n.name.clone(), Arc::new(kube_node(&n, i as u64 + 1)))
        })
        .collect()
}

/// The next check-in of `name`: a copy with a new `last-seen` and resourceVersion.
fn checked_in(object: &KubeNode, rv: u64) -> KubeNode {
    let mut node = object.clone();
    node.metadata.resource_version = Some(rv.to_string());
    node.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(annotation::LAST_SEEN.into(), unix_now().to_string());
    node
}

fn after(c: &mut Criterion, count: usize) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = std::env::temp_dir().join(format!("kilotun-bench-events-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let cluster_dir = format!("--cluster-dir={}", dir.display());
    let key_file = format!("--key-file={}", dir.join("key").display());
    let mut twin = rt
        .block_on(TwinAgent::start(&[
            "--backend=file",
            &cluster_dir,
            &key_file,
            "--hostname",
            LOCAL,
            "--encapsulate=never",
            "--cni=false",
            "--mtu=1420",
        ]))
        .expect("agent");
    let mut snapshot = Snapshot {
        listed: Listed::EVERYTHING,
        ..Snapshot::default()
    };
    for (name, object) in objects(count) {
        snapshot.put_node(&name, (*object).clone());
    }
    rt.block_on(twin.agent.reconcile(&snapshot, Trigger::Resync))
        .expect("first reconcile");
    // kg's own annotations come back through the backend.
    let text = std::fs::read_to_string(dir.join(format!("{LOCAL}.yaml"))).expect("published");
    let published: KubeNode = serde_saphyr::from_str(&text).expect("published node");
    let mut local = (*snapshot.nodes[LOCAL]).clone();
    local
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .extend(published.metadata.annotations.unwrap_or_default());
    snapshot.put_node(LOCAL, local);
    rt.block_on(twin.agent.reconcile(&snapshot, Trigger::Event))
        .expect("second reconcile");
    let names: Vec<String> = snapshot
        .nodes
        .keys()
        .filter(|n| *n != LOCAL)
        .cloned()
        .collect();
    let before = twin.calls();
    let mut rv = 1_000_000u64;
    let mut i = 0;
    c.bench_function(&format!("event/last_seen/after/{count}"), |b| {
        b.iter(|| {
            let name = &names[i % names.len()];
            i += 1;
            rv += 1;
            let next = checked_in(&snapshot.nodes[name], rv);
            snapshot.put_node(name, next);
            rt.block_on(twin.agent.reconcile(&snapshot, Trigger::Event))
                .expect("reconcile");
        })
    });
    assert_eq!(twin.calls(), before, "a check-in made an OS call");
    let _ = std::fs::remove_dir_all(&dir);
}

fn table(c: &mut Criterion, count: usize) {
    let objects = objects(count);
    let mut table = NodeTable::new(DEFAULT_TOPOLOGY_LABEL);
    table.advance(unix_now());
    table.sync(&objects);
    table.take_changed();
    let names: Vec<&String> = objects.keys().collect();
    let mut rv = 1_000_000u64;
    let mut i = 0;
    c.bench_function(&format!("event/last_seen/table/{count}"), |b| {
        b.iter(|| {
            let name = names[i % names.len()];
            i += 1;
            rv += 1;
            let next = Arc::new(checked_in(&objects[name], rv));
            table.update(name, Some(&next));
            table.advance(unix_now());
            assert!(!table.take_changed());
        })
    });
}

fn before(c: &mut Criterion, count: usize) {
    let objects = objects(count);
    let params = TopologyParams {
        granularity: Granularity::Location,
        hostname: LOCAL.into(),
        port: 51820,
        subnet: "10.4.0.0/16".parse().expect("subnet"),
        persistent_keepalive: 0,
        leaders_per_location: 1,
        kept_out: Default::default(),
    };
    let options = RouteOptions {
        kilo_name: "kilo0".into(),
        links: Links {
            kilo: 3,
            private: 2,
            tunnel: 0,
            tunnel6: 0,
        },
        local: true,
        encapsulate: Encapsulate::Never,
        compatibility: Compatibility::Ipip,
        pod_sources: Vec::new(),
        ipip_over_ipv6: false,
    };
    c.bench_with_input(
        BenchmarkId::new("event/last_seen/before", count),
        &objects,
        |b, objects| {
            b.iter(|| {
                let now = unix_now();
                let nodes: Vec<_> = objects
                    .values()
                    .map(|o| translate_node(o, DEFAULT_TOPOLOGY_LABEL).0)
                    .filter(|n| n.is_ready(now))
                    .collect();
                let t = Topology::new(&nodes, &[], &params).expect("topology");
                let conf = t.conf(None);
                let plan = t.route_plan(&options);
                let rules = t.iptables_rules(&IptablesOptions::default());
                (conf, plan, rules)
            })
        },
    );
}

fn events(c: &mut Criterion) {
    for count in [1_000, 5_000] {
        table(c, count);
        after(c, count);
        before(c, count);
    }
}

criterion_group!(benches, events);
criterion_main!(benches);
