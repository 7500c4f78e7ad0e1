//! Control-plane costs: Kilo's topology at 10 to 5,000 nodes (location and full granularity),
//! the leader's WireGuard configuration, the route plan plus its diff against the kernel, and
//! the whole desired host state of a location leader at 5,000 nodes in 500 locations, with each
//! of its parts (what every mesh computes again when one node's readiness flips).

#![allow(missing_docs)]

use control::desired::{self, HostSettings, ResolvedLinks};
use control::fixtures::synthetic_cluster;
use control::host::{HostNet, Link, Mtu};
use control::iptables::IptablesOptions;
use control::nftables::{change_script, FirewallSets};
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
        leaders_per_location: 1,
        kept_out: Default::default(),
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

/// A location leader's host: eth0 (index 2) holds its internal IP and the default route,
/// kilo0 is index 3.
fn leader_host(internal_ip: ipnet::IpNet) -> HostNet {
    let link = |index, name: &str, mtu| Link {
        index,
        name: name.into(),
        mtu,
        up: true,
    };
    HostNet {
        default_link: Some(2),
        links: vec![link(2, "eth0", 1500), link(3, "kilo0", 1420)],
        addresses: vec![(2, internal_ip), (3, "10.4.0.1/16".parse().expect("net"))],
        main_routes: Vec::new(),
    }
}

fn desired_state(c: &mut Criterion) {
    let mut group = c.benchmark_group("desired");
    let settings = HostSettings {
        interface: "kilo0".into(),
        mtu: Mtu::Auto,
        cni: true,
        cni_conflist: true,
        local: true,
        encapsulate: Encapsulate::Never,
        compatibility: Compatibility::Ipip,
        forward_rules: false,
        service_cidrs: Vec::new(),
        tunnel: None,
        tunnel_guard: control::routes::TunnelGuard::default(),
    };
    let links = ResolvedLinks {
        kilo: 3,
        ..Default::default()
    };
    let public = control::Key([7; 32]);
    for &count in &[1_000usize, 5_000] {
        let nodes = synthetic_cluster(count, count / 10);
        let host = leader_host(nodes[0].internal_ip.expect("internal IP"));
        let t = Topology::new(&nodes, &[], &params(Granularity::Location)).expect("topology");
        let owned =
            desired::plan(&t, &host, &links, &RoutePlan::default(), &public, &settings).routes;
        group.bench_with_input(
            BenchmarkId::new("topology_location", count),
            &nodes,
            |b, nodes| {
                b.iter(|| {
                    Topology::new(nodes, &[], &params(Granularity::Location)).expect("topology")
                })
            },
        );
        group.bench_with_input(BenchmarkId::new("plan_location", count), &t, |b, t| {
            b.iter(|| desired::plan(t, &host, &links, &owned, &public, &settings))
        });
        group.bench_with_input(BenchmarkId::new("conf", count), &t, |b, t| {
            b.iter(|| t.conf(Some(&public)))
        });
        let options = IptablesOptions {
            cni: true,
            forward_rules: false,
            service_cidrs: Vec::new(),
            ipip: false,
        };
        group.bench_with_input(BenchmarkId::new("iptables_rules", count), &t, |b, t| {
            b.iter(|| t.iptables_rules(&options))
        });
        // One node of another location no longer ready: the plan's and the rules' differences.
        let fewer: Vec<_> = nodes
            .iter()
            .filter(|n| n.name != "node-00011")
            .cloned()
            .collect();
        let t2 = Topology::new(&fewer, &[], &params(Granularity::Location)).expect("topology");
        let before = desired::plan(&t, &host, &links, &owned, &public, &settings);
        let after = desired::plan(&t2, &host, &links, &owned, &public, &settings);
        group.bench_function(BenchmarkId::new("routes_diff_one_flip", count), |b| {
            b.iter(|| diff(&after.routes, &before.routes, &before.routes, 3))
        });
        group.bench_function(BenchmarkId::new("rules_compare_one_flip", count), |b| {
            b.iter(|| after.firewall == before.firewall)
        });
        group.bench_function(BenchmarkId::new("nft_sets", count), |b| {
            b.iter(|| FirewallSets::of(&after.firewall).expect("sets"))
        });
        let (from, to) = (
            FirewallSets::of(&before.firewall).expect("sets"),
            FirewallSets::of(&after.firewall).expect("sets"),
        );
        group.bench_function(BenchmarkId::new("nft_change_one_flip", count), |b| {
            b.iter(|| change_script(&from, &to, false))
        });
    }
    group.finish();
}

criterion_group!(benches, topology, routes, desired_state);
criterion_main!(benches);
