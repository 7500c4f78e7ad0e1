//! Control-plane costs: Kilo's topology at 10 to 5,000 nodes (location and full granularity),
//! the leader's WireGuard configuration, and the route plan plus its diff against the kernel.

#![allow(missing_docs)]

use control::fixtures::synthetic_cluster;
use control::node::Granularity;
use control::routes::{diff, Compatibility, Encapsulate, Links, RouteOptions, RoutePlan};
use control::{Topology, TopologyParams};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};

fn params(granularity: Granularity) -> TopologyParams {
    TopologyParams {
        granularity,
        hostname: "node-00000".into(),
        port: 51820,
        subnet: "10.4.0.0/16".parse().expect("subnet"),
        persistent_keepalive: 0,
    }
}

fn topology(c: &mut Criterion) {
    let mut group = c.benchmark_group("topology");
    for &count in &[10usize, 100, 1_000, 5_000] {
        let nodes = synthetic_cluster(count, (count / 10).max(1));
        for (label, granularity) in [
            ("location", Granularity::Location),
            ("full", Granularity::Full),
        ] {
            group.bench_with_input(BenchmarkId::new(label, count), &nodes, |b, nodes| {
                b.iter(|| Topology::new(nodes, &[], &params(granularity)).expect("topology"));
            });
        }
        let t = Topology::new(&nodes, &[], &params(Granularity::Full)).expect("topology");
        group.bench_with_input(BenchmarkId::new("leader_conf_full", count), &t, |b, t| {
            b.iter(|| t.conf(None))
        });
    }
    group.finish();
}

fn routes(c: &mut Criterion) {
    let options = RouteOptions {
        kilo_name: "kilo0".into(),
        links: Links {
            kilo: 10,
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
    let mut group = c.benchmark_group("routes");
    for &count in &[100usize, 1_000, 5_000] {
        let nodes = synthetic_cluster(count, (count / 10).max(1));
        let t = Topology::new(&nodes, &[], &params(Granularity::Full)).expect("topology");
        let plan = t.route_plan(&options);
        group.bench_with_input(BenchmarkId::new("plan_full", count), &t, |b, t| {
            b.iter(|| t.route_plan(&options))
        });
        // Churn: one node leaves; the diff against the old plan.
        let fewer =
            Topology::new(&nodes[..count - 1], &[], &params(Granularity::Full)).expect("topology");
        let new_plan = fewer.route_plan(&options);
        group.bench_with_input(
            BenchmarkId::new("diff_one_node_gone", count),
            &(new_plan, plan),
            |b, (new, old)| b.iter(|| diff(new, old, old, 10)),
        );
        let empty = RoutePlan::default();
        group.bench_with_input(
            BenchmarkId::new("diff_from_empty", count),
            &t.route_plan(&options),
            |b, p| b.iter(|| diff(p, &empty, &empty, 10)),
        );
    }
    group.finish();
}

criterion_group!(benches, topology, routes);
criterion_main!(benches);
