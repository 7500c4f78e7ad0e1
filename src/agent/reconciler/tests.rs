//! The reconciler driven with values alone: a snapshot, a host listed from the kernel's twin,
//! a manual clock, and shells that succeed or fail as each test says. Each pass is driven the
//! way `super::super::reconcile` drives it, and what the reconciler asked for is recorded.

use std::time::Duration;

use crate::backend::Snapshot;
use control::clock::Now;
use control::desired::ResolvedLinks;
use control::fixtures::{kube_node, node};
use control::leader::book::{LeaseWrite, TunnelReadings, TunnelTraffic};
use control::node::annotation;
use control::routes::RoutePlan;
use control::Node;

use super::*;
use control::host::{HostNet, Link};
use control::routes::Route;

use crate::agent::args::KgArgs;
use crate::agent::host::OwnSide;
use crate::backend::Listed;

/// What one pass asked of the shells.
#[derive(Debug, Default)]
struct PassLog {
    waited: bool,
    /// The effects in the order handed out (by name), for tests of their order.
    order: Vec<&'static str>,
    listed_host: bool,
    elected: bool,
    /// `Some(computed)` when the mesh step ran.
    meshed: Option<bool>,
    converged: Option<Convergence>,
    /// The converge step's effects in the order handed out (by name).
    host: Vec<&'static str>,
    firewall: Option<FirewallStep>,
    lease: Option<LeaseWrite>,
    patch: Option<local::AnnotationPatch>,
    /// True when the pass ended with a failure.
    failed: bool,
    /// The device write's peers (key, endpoint) and the peers it handshakes with at once.
    device: Option<DeviceRecord>,
}

/// A device write as the log keeps it: the peers (key, endpoint) and the keys handshaken at once.
type DeviceRecord = (Vec<(Key, Option<String>)>, Vec<Key>);

/// One reconciler, the snapshot it reads, the host's links, addresses and routes as the
/// netlink shell would list them, a manual clock, and whether the shells succeed.
struct Bench {
    core: Reconciler,
    snapshot: Snapshot,
    rv: u64,
    now: Now,
    listing: HostNet,
    backend_healthy: bool,
    converge_ok: bool,
    /// Whether setting the WireGuard link's MTU, address or state works.
    link_ok: bool,
    firewall_ok: bool,
    patch_ok: bool,
    /// Whether starting a lost engine again works.
    recreate_ok: bool,
}

/// Nodes a (the local one) and b in location l1, c in l2, checked in at `now`.
fn cluster(now: i64) -> Vec<Node> {
    [
        (
            "a",
            "192.168.0.10:51820",
            "192.168.0.10/24",
            "l1",
            "10.2.1.0/24",
            "a",
        ),
        (
            "b",
            "192.168.0.11:51820",
            "192.168.0.11/24",
            "l1",
            "10.2.2.0/24",
            "b",
        ),
        (
            "c",
            "198.51.100.3:51820",
            "172.16.0.3/24",
            "l2",
            "10.2.3.0/24",
            "c",
        ),
    ]
    .into_iter()
    .map(|(name, endpoint, internal, location, pods, key)| Node {
        last_seen: now,
        ..node(name, endpoint, Some(internal), location, pods, key)
    })
    .collect()
}

/// A host with `eth0` (192.168.0.10/24, the default route's link) and `kilo0` (index 3, down).
fn listing() -> HostNet {
    let link = |index, name: &str, mtu, up| Link {
        index,
        name: name.to_string(),
        mtu,
        up,
    };
    HostNet {
        default_link: None,
        links: vec![
            link(1, "lo", 65536, true),
            link(2, "eth0", 1500, true),
            link(3, "kilo0", 1420, false),
        ],
        addresses: vec![
            (1, "127.0.0.1/8".parse().unwrap()),
            (2, "192.168.0.10/24".parse().unwrap()),
        ],
        main_routes: vec![Route {
            table: 254,
            dst: "0.0.0.0/0".parse().unwrap(),
            gateway: Some("192.168.0.1".parse().unwrap()),
            link: 2,
            src: None,
            onlink: false,
        }],
    }
}

impl Bench {
    /// kg as node `a` with `flags` on the cluster of [`cluster`], before its first pass.
    fn new(flags: &[&str]) -> Self {
        let mut args = vec![
            "--backend=file",
            "--cluster-dir=/nonexistent",
            "--hostname=a",
            "--encapsulate=never",
        ];
        args.extend_from_slice(flags);
        use clap::Parser as _;
        let s = KgArgs::try_parse_from(std::iter::once("kg").chain(args))
            .expect("flags")
            .settings()
            .expect("settings");
        let now = Now {
            instant: std::time::Instant::now(),
            unix_ms: control::fixtures::NOW * 1000,
        };
        let mut snapshot = Snapshot {
            listed: Listed::EVERYTHING,
            ..Snapshot::default()
        };
        let mut rv = 0;
        for n in cluster(now.unix_secs()) {
            rv += 1;
            snapshot.put_node(&n.name.clone(), kube_node(&n, rv));
        }
        let mut core = Reconciler::new(
            s.reconciler_config(),
            Key::padded("a-public"),
            Default::default(),
            now,
        );
        core.start_host(RoutePlan::default(), None, 3);
        Self {
            core,
            snapshot,
            rv,
            now,
            listing: listing(),
            backend_healthy: true,
            converge_ok: true,
            link_ok: true,
            firewall_ok: true,
            patch_ok: true,
            recreate_ok: true,
        }
    }

    /// One pass woken by `trigger`: every effect the reconciler hands out is answered as the
    /// bench's shells would, and recorded.
    fn pass(&mut self, trigger: Trigger) -> PassLog {
        let now = self.now;
        let mut log = PassLog::default();
        self.core.ingest(&self.snapshot, now);
        log.waited = !self.core.begin_pass(trigger, self.backend_healthy, now);
        while let Some(effect) = self.core.poll_effect(now) {
            log.order.push(match &effect {
                PassEffect::RecreateEngine(_) => "recreate",
                PassEffect::ListHost(_) => "list",
                PassEffect::Host(HostEffect::Converging(_)) => "converge",
                PassEffect::PatchAnnotations(_) => "patch",
                _ => "other",
            });
            let answer = match effect {
                PassEffect::RecreateEngine(_) => PassAnswer::EngineRecreated(if self.recreate_ok {
                    Ok(3)
                } else {
                    Err(anyhow::anyhow!("the bench cannot open /dev/net/tun"))
                }),
                PassEffect::ListHost(detection) => {
                    let own = OwnSide {
                        kilo_index: 3,
                        tunnel: None,
                        hostname_ips: &[],
                        subnet: "10.4.0.0/16".parse().unwrap(),
                        internal_cidrs: &[],
                    };
                    log.listed_host = true;
                    PassAnswer::HostListed {
                        listed: HostView::of(self.listing.clone(), &own, &detection),
                        dump_kept: false,
                    }
                }
                PassEffect::RotateKey(_) => continue,
                PassEffect::Elected => {
                    log.elected = true;
                    continue;
                }
                PassEffect::Meshed(report) => {
                    log.meshed = Some(report.computed);
                    continue;
                }
                PassEffect::Host(effect) => match self.answer_host(effect, &mut log) {
                    Some(answer) => PassAnswer::Host(answer),
                    None => continue,
                },
                PassEffect::ReadTunnels => PassAnswer::TunnelsRead(TunnelReadings {
                    traffic: TunnelTraffic::NotLeading,
                    standby_reached: Vec::new(),
                }),
                PassEffect::WriteLease(write) => {
                    log.lease = Some(*write);
                    continue;
                }
                PassEffect::PatchAnnotations(patch) => {
                    log.patch = Some(patch);
                    PassAnswer::Patched(if self.patch_ok {
                        Ok(())
                    } else {
                        Err(anyhow::anyhow!("the bench's backend refused the patch"))
                    })
                }
            };
            self.core.handle(answer, now);
        }
        log.failed = self.core.end_pass(now).is_err();
        log
    }

    /// The answer the bench's shells give to one step of a convergence, if it has one.
    fn answer_host(&mut self, effect: HostEffect, log: &mut PassLog) -> Option<HostAnswer> {
        let failed = |what: &str| anyhow::anyhow!("the bench's {what} failed");
        log.host.push(match &effect {
            HostEffect::Converging(_) => "converging",
            HostEffect::ReadEndpoints => "endpoints",
            HostEffect::ConfigureDevice(_) => "device",
            HostEffect::SetLink(_) => "link",
            HostEffect::WriteCni(_) => "cni",
            HostEffect::PrepareTunnel(_) => "tunnel",
            HostEffect::PlanResolved(_) => "plan-resolved",
            HostEffect::ObserveRoutes => "observe-routes",
            HostEffect::ChangeRoutes(_) => "change-routes",
            HostEffect::SaveRoutes(_) => "save-routes",
            HostEffect::WriteFirewall(_) => "firewall",
            HostEffect::Converged(_) => "converged",
        });
        match effect {
            HostEffect::Converging(c) => {
                log.converged = Some(c);
                None
            }
            HostEffect::ReadEndpoints => Some(HostAnswer::Endpoints(Ok(Vec::new()))),
            HostEffect::ConfigureDevice(write) => Some(HostAnswer::Device(if self.converge_ok {
                let peers = write.conf.peers.iter();
                let endpoints = peers
                    .map(|p| (p.public_key, p.endpoint.as_ref().map(ToString::to_string)))
                    .collect();
                log.device = Some((endpoints, write.handshake));
                Ok(DeviceOutcome::default())
            } else {
                Err(failed("device"))
            })),
            HostEffect::SetLink(_) => Some(HostAnswer::Link(if self.link_ok {
                Ok(())
            } else {
                Err(failed("link"))
            })),
            HostEffect::PrepareTunnel(_) => Some(HostAnswer::Tunnel(Ok(ResolvedLinks {
                kilo: 3,
                ..Default::default()
            }))),
            HostEffect::ObserveRoutes => Some(HostAnswer::ObservedRoutes(if self.converge_ok {
                Ok(RoutePlan::default())
            } else {
                Err(failed("route listing"))
            })),
            HostEffect::ChangeRoutes(_) => Some(HostAnswer::ChangedRoutes(Vec::new())),
            HostEffect::WriteFirewall(write) => {
                let previous = write.previous;
                log.firewall = Some(FirewallStep::Write { previous });
                Some(HostAnswer::Firewall(if self.firewall_ok {
                    FirewallOutcome::Written
                } else {
                    FirewallOutcome::Failed("the bench's iptables failed".to_string())
                }))
            }
            HostEffect::WriteCni(_)
            | HostEffect::PlanResolved(_)
            | HostEffect::SaveRoutes(_)
            | HostEffect::Converged(_) => None,
        }
    }

    /// Changes Node `name` as the API server would: a new object, a new resourceVersion.
    fn update(&mut self, name: &str, change: impl FnOnce(&mut KubeNode)) {
        let mut object = (*self.snapshot.nodes[name]).clone();
        change(&mut object);
        self.rv += 1;
        object.metadata.resource_version = Some(self.rv.to_string());
        self.snapshot.put_node(name, object);
    }

    fn annotate(&mut self, name: &str, key: &str, value: &str) {
        self.update(name, |n| {
            n.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(key.to_string(), value.to_string());
        });
    }

    /// The first pass, and the local Node's annotations coming back as the backend's event.
    fn settled(flags: &[&str]) -> Self {
        let mut bench = Self::new(flags);
        let first = bench.pass(Trigger::Event);
        let patch = first.patch.expect("the first pass publishes");
        bench.update("a", |n| {
            let annotations = n.metadata.annotations.get_or_insert_with(Default::default);
            for (key, value) in patch {
                match value {
                    Some(value) => annotations.insert(key, value),
                    None => annotations.remove(&key),
                };
            }
        });
        let echo = bench.pass(Trigger::Event);
        assert!(
            echo.patch.is_none(),
            "its own annotations came back: {echo:?}"
        );
        bench
    }

    fn advance(&mut self, by: Duration) {
        self.now = self.now.after(by);
    }
}

#[test]
fn nothing_is_decided_before_the_backend_listed_everything() {
    let mut bench = Bench::new(&[]);
    bench.snapshot.listed = Listed {
        nodes: true,
        ..Listed::default()
    };
    let pass = bench.pass(Trigger::Event);
    assert!(
        pass.waited && !pass.listed_host && pass.patch.is_none(),
        "{pass:?}"
    );
}

#[test]
fn the_first_pass_lists_the_host_converges_it_whole_and_publishes_the_node() {
    let mut bench = Bench::new(&[]);
    let pass = bench.pass(Trigger::Event);
    assert!(pass.listed_host, "the host was never listed");
    let c = pass.converged.expect("the first mesh is applied");
    assert!(c.full && c.changed && !c.flips_only);
    assert!(
        c.topology.leader,
        "a leads l1 by Kilo's rule (first by name)"
    );
    assert_eq!(
        pass.firewall,
        Some(FirewallStep::Write { previous: None }),
        "nothing written yet: the host's rules are read"
    );
    let patch = pass.patch.expect("published");
    assert_eq!(
        patch.get(annotation::KEY),
        Some(&Some(Key::padded("a-public").to_string()))
    );
    let wireguard_ip = patch.get(annotation::WIREGUARD_IP).cloned().flatten();
    assert!(
        wireguard_ip.is_some_and(|ip| ip.starts_with("10.4.")),
        "a leader publishes its WireGuard IP: {patch:?}"
    );
    assert!(bench.core.topology().is_some());
}

#[test]
fn a_check_in_that_moves_only_last_seen_runs_no_stage() {
    let mut bench = Bench::settled(&[]);
    bench.advance(Duration::from_secs(10));
    let now = bench.now.unix_secs().to_string();
    bench.annotate("b", annotation::LAST_SEEN, &now);
    let pass = bench.pass(Trigger::Event);
    assert!(
        !pass.listed_host && pass.meshed.is_none() && pass.patch.is_none(),
        "{pass:?}"
    );
    // Its own check-in is due on the check-in timer alone.
    let pass = bench.pass(Trigger::CheckIn);
    assert_eq!(
        pass.patch
            .and_then(|p| p.get(annotation::LAST_SEEN).cloned()),
        Some(Some(now))
    );
    assert!(pass.meshed.is_none());
}

#[test]
fn a_node_joining_changes_the_topology_and_only_that_is_converged() {
    let mut bench = Bench::settled(&[]);
    let mut d = node("d", "203.0.113.4:51820", None, "l3", "10.2.4.0/24", "d");
    d.last_seen = bench.now.unix_secs();
    bench.rv += 1;
    bench.snapshot.put_node("d", kube_node(&d, bench.rv));
    let pass = bench.pass(Trigger::Event);
    let c = pass.converged.expect("a new location is a new peer");
    assert!(c.changed && !c.full && !pass.listed_host);
    assert!(c.topology.segments.iter().any(|s| s.location == "l3"));
    assert!(
        matches!(
            pass.firewall,
            Some(FirewallStep::Write { previous: Some(_) })
        ),
        "the rules change from the ones written: {:?}",
        pass.firewall
    );
    let again = bench.pass(Trigger::Event);
    assert!(again.converged.is_none(), "{again:?}");
}

#[test]
fn a_resync_lists_the_host_and_compares_every_part_afresh() {
    let mut bench = Bench::settled(&[]);
    let pass = bench.pass(Trigger::Resync);
    assert!(pass.listed_host);
    let c = pass.converged.expect("a resync converges every part");
    assert!(c.full && !c.changed);
    assert_eq!(pass.firewall, Some(FirewallStep::Write { previous: None }));
}

#[test]
fn a_local_node_without_pods_is_not_meshed_and_says_why() {
    let mut bench = Bench::new(&[]);
    bench.update("a", |n| {
        n.spec.get_or_insert_with(Default::default).pod_cidr = None;
        n.spec.get_or_insert_with(Default::default).pod_cidrs = None;
    });
    let pass = bench.pass(Trigger::Event);
    assert_eq!(pass.meshed, Some(false), "{pass:?}");
    assert!(pass.converged.is_none() && bench.core.topology().is_none());
    assert!(
        pass.patch.is_some(),
        "it still publishes its key and endpoint"
    );
}

#[test]
fn a_malformed_annotation_on_another_node_leaves_the_mesh_converging() {
    let mut bench = Bench::settled(&[]);
    bench.annotate("c", annotation::FORCE_ENDPOINT, "not an endpoint");
    bench.annotate("b", annotation::LOCATION, "l4");
    let pass = bench.pass(Trigger::Event);
    let c = pass.converged.expect("b's move is converged");
    let locations: Vec<&str> = c
        .topology
        .segments
        .iter()
        .map(|s| s.location.as_str())
        .collect();
    assert!(
        locations.contains(&"l4") && locations.contains(&"l2"),
        "{locations:?}"
    );
}

#[test]
fn the_lease_step_takes_the_free_lease_of_its_location_on_the_lease_timer() {
    let mut bench = Bench::settled(&["--leader-election=lease"]);
    let event = bench.pass(Trigger::Event);
    assert!(
        event.lease.is_none(),
        "only the lease timer tends the lease"
    );
    bench.advance(Duration::from_secs(2));
    let pass = bench.pass(Trigger::Lease);
    assert!(pass.elected);
    let write = pass.lease.expect("a free lease is taken");
    assert_eq!(write.next.holder.as_deref(), Some("a"));
    assert!(write.name.contains("l1"), "{}", write.name);
}

#[test]
fn an_unreachable_backend_freezes_readiness_and_keeps_the_mesh() {
    let mut bench = Bench::settled(&[]);
    bench.backend_healthy = false;
    // Far past every check-in: with the backend unreachable, nobody's is judged stale.
    bench.advance(Duration::from_secs(600));
    let pass = bench.pass(Trigger::CheckIn);
    assert!(pass.converged.is_none(), "{pass:?}");
    let t = bench.core.topology().expect("kept");
    assert!(t.segments.iter().any(|s| s.location == "l2"));
    // Back, every node has a grace period to check in again before its check-in is judged.
    bench.backend_healthy = true;
    let back = bench.pass(Trigger::Event);
    assert!(back.converged.is_none(), "{back:?}");
    let grace = CHECK_IN_PERIOD + bench.core.config.resync;
    bench.advance(grace + Duration::from_secs(1));
    let pass = bench.pass(Trigger::CheckIn);
    let c = pass
        .converged
        .expect("the nodes that never checked in leave the mesh");
    assert!(!c.topology.segments.iter().any(|s| s.location == "l2"));
}

mod converge;
mod endpoints;
mod failures;
mod ipam;
