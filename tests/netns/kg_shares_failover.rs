//! A leader's loss costs only its share: two leaders per location with lease election, TCP
//! streams and pings through both east shares, and east's second leader killed, or its
//! WireGuard port blocked, or it cordoned. The first share's traffic loses no echo and keeps its followers; the
//! second share is carried again by one of its own followers, within the lease's bounds; the dead leader, back, does not
//! take its share back.

use crate::common;
use control::journal::Reason;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::pinger::Pinger;

const NODES: [(&str, &str); 8] = [
    ("e1", "east"),
    ("e2", "east"),
    ("e3", "east"),
    ("e4", "east"),
    ("e5", "east"),
    ("e6", "east"),
    ("w1", "west"),
    ("w2", "west"),
];
const FLAGS: [&str; 3] = [
    "--leaders-per-location=2",
    "--leader-election=lease",
    "--encapsulate=never",
];
const FIRST: &str = "kilotun-leader-east";
const SECOND: &str = "kilotun-leader-east.share2";

/// The east nodes of the share whose leader is `leader`, as w1 routes them.
fn share_of(c: &Cluster, leader: &str) -> Vec<&'static str> {
    let routed = c.routed_through("w1", leader);
    NODES
        .iter()
        .map(|(n, _)| *n)
        .filter(|n| routed.iter().any(|r| r == n))
        .collect()
}

/// An iperf3 client in `from`'s namespace sending 20 Mbit/s of TCP from its pod address to
/// `to`'s pod address on `port` for `secs` seconds.
fn stream(c: &Cluster, from: &str, to: &str, port: u16, secs: u32) -> Child {
    let node = c.node(from);
    Command::new("ip")
        .args(["netns", "exec", &node.ns.name, "iperf3", "-c"])
        .arg(&c.node(to).pod_ip)
        .args(["-B", &node.pod_ip, "-p", &port.to_string(), "-b", "20M"])
        .args(["-t", &secs.to_string(), "--connect-timeout", "3000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("iperf3")
}

/// A process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Eight nodes meshed with two leaders a side, 20 Mbit/s of TCP through each east share and
/// pings to w1 from each share's watched follower and from the first leader.
struct Loaded {
    c: Cluster,
    /// The holders of east's two leases.
    first: String,
    second: String,
    /// The first share's follower watched, and its pings; the first leader's; the second
    /// share's follower's.
    kept_follower: &'static str,
    kept_pinger: Pinger,
    leader_pinger: Pinger,
    lost_pinger: Pinger,
    _load: Vec<Killed>,
}

impl Loaded {
    fn start(test: &str) -> Option<Self> {
        common::require_root(test);
        if !common::which("iperf3") {
            eprintln!("skipping {test}: needs iperf3");
            return None;
        }
        let mut c = Cluster::with_nodes(&["east", "west"], &NODES);
        for i in 0..NODES.len() {
            c.start_kg(i, &FLAGS);
        }
        let ready = c.wait_for(Duration::from_secs(60), |c| {
            c.all_pods_reachable().is_ok()
                && c.holder_of(FIRST).is_some()
                && c.holder_of(SECOND).is_some()
        });
        assert!(ready, "{:?}\n{}", c.all_pods_reachable(), c.logs());
        let (first, second) = (c.holder_of(FIRST).unwrap(), c.holder_of(SECOND).unwrap());
        assert_ne!(first, second);
        let (kept, lost) = (share_of(&c, &first), share_of(&c, &second));
        assert_eq!((kept.len(), lost.len()), (3, 3), "{kept:?} {lost:?}");
        // Each share is watched from its last follower by name: the node to take a dead
        // leader's share over is the first of its followers by Kilo's rule (all private, so by
        // name).
        let follower = |share: &[&'static str], leader: &str| {
            *share.iter().filter(|n| **n != leader).max().unwrap()
        };
        let (kept_follower, lost_follower) = (follower(&kept, &first), follower(&lost, &second));
        let w2 = c.node("w2");
        let mut load: Vec<Killed> = [5201, 5202]
            .iter()
            .map(|port| {
                Killed(
                    Command::new("ip")
                        .args(["netns", "exec", &w2.ns.name, "iperf3", "-s", "-B"])
                        .args([&w2.pod_ip, "-p", &port.to_string()])
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .expect("iperf3 -s"),
                )
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        load.push(Killed(stream(&c, kept_follower, "w2", 5201, 40)));
        load.push(Killed(stream(&c, lost_follower, "w2", 5202, 40)));
        let target = c.node("w1").pod_ip.clone();
        let ping = |from: &str| {
            let n = c.node(from);
            Pinger::start_from(&n.ns.name, &n.pod_ip, &target)
        };
        let (kept_pinger, leader_pinger, lost_pinger) =
            (ping(kept_follower), ping(&first), ping(lost_follower));
        let started = Instant::now();
        for p in [&kept_pinger, &leader_pinger, &lost_pinger] {
            let flowing = p.wait_flowing(started, Duration::from_secs(10));
            assert!(flowing, "{}", c.logs());
        }
        std::thread::sleep(Duration::from_secs(2));
        Some(Loaded {
            c,
            first,
            second,
            kept_follower,
            kept_pinger,
            leader_pinger,
            lost_pinger,
            _load: load,
        })
    }

    fn second_index(&self) -> usize {
        NODES.iter().position(|(n, _)| *n == self.second).unwrap()
    }

    /// After the second leader failed at `since` (`how`): its share is carried again within
    /// `bound` by a node that led nothing, and the first share lost nothing and kept its followers. The new holder of
    /// the second lease.
    fn second_share_moves(&self, since: Instant, how: &str, bound: Duration) -> String {
        let c = &self.c;
        let back = self
            .lost_pinger
            .wait_flowing(since, Duration::from_secs(40));
        let lost_gap = self.lost_pinger.longest_gap_after(since);
        // The topology moves when the lease's holder changes in the election; the successor
        // writes the lease on its next lease step.
        c.wait_for(Duration::from_secs(10), |c| {
            c.holder_of(SECOND).is_some_and(|h| h != self.second)
        });
        let successor = c.holder_of(SECOND).unwrap_or_default();
        std::thread::sleep(Duration::from_secs(3));
        let kept_lost = self.kept_pinger.lost_after(since);
        let leader_lost = self.leader_pinger.lost_after(since);
        let kept_gap = self.kept_pinger.longest_gap_after(since);
        let (first, second, kept_follower) = (&self.first, &self.second, self.kept_follower);
        eprintln!(
            "second leader {second} {how}: its share back after {:.1} s (through {successor}); the first share ({first}) lost {kept_lost} echoes from {kept_follower} (longest gap {:.2} s) and {leader_lost} from {first}",
            lost_gap.as_secs_f64(),
            kept_gap.as_secs_f64()
        );
        assert!(back, "the second share never came back\n{}", c.logs());
        assert!(lost_gap < bound, "gap {lost_gap:?}\n{}", c.logs());
        assert!(successor != *second && successor != *first, "{successor}");
        assert_eq!(c.holder_of(FIRST).as_deref(), Some(first.as_str()));
        assert_eq!(leader_lost, 0, "{}", c.logs());
        // The first share keeps its followers: the second's successor is one of its own.
        assert!(
            share_of(c, first).contains(&kept_follower),
            "{kept_follower} left the first share\n{}",
            c.logs()
        );
        assert_eq!(kept_lost, 0, "{}", c.logs());
        assert!(kept_gap < Duration::from_secs(1), "{kept_gap:?}");
        successor
    }
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_lost_second_leader_costs_only_its_share() {
    let Some(mut l) = Loaded::start("a_lost_second_leader_costs_only_its_share") else {
        return;
    };
    // The second leader dies: kg killed, its links cut.
    let index = l.second_index();
    let killed = Instant::now();
    l.c.nodes[index].kill();
    l.c.node(&l.second)
        .ns
        .run(&["ip", "link", "set", "eth0", "down"]);
    // The lease's 6 s (kg steps when a lease it saw runs out) and a handshake, with room for
    // a loaded machine.
    let successor = l.second_share_moves(killed, "killed", Duration::from_secs(8));
    l._load.clear();

    // The dead leader comes back: the successor keeps the share.
    l.c.node(&l.second)
        .ns
        .run(&["ip", "link", "set", "eth0", "up"]);
    l.c.start_kg(index, &FLAGS);
    std::thread::sleep(Duration::from_secs(12));
    assert_eq!(l.c.holder_of(SECOND), Some(successor), "{}", l.c.logs());
    assert_eq!(l.c.holder_of(FIRST).as_deref(), Some(l.first.as_str()));
    let flowing =
        l.c.wait_for(Duration::from_secs(20), |c| c.all_pods_reachable().is_ok());
    assert!(flowing, "{:?}\n{}", l.c.all_pods_reachable(), l.c.logs());
}

/// The second leader cordoned: it hands its share to one of its followers at once.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_cordoned_second_leader_hands_its_share_over_at_once() {
    let Some(l) = Loaded::start("a_cordoned_second_leader_hands_its_share_over_at_once") else {
        return;
    };
    let cordoned = Instant::now();
    l.c.cordon(&l.second);
    l.second_share_moves(cordoned, "cordoned", Duration::from_millis(1500));
    // It handed the lease over, or its successor took it first: either way the lease names it.
    let lease = std::fs::read_to_string(l.c.dir.join(format!("lease-{SECOND}.yaml"))).unwrap();
    let named = format!("kilotun.io/handed-over-by: {}", l.second);
    assert!(lease.contains(&named), "{lease}");
}

/// The second leader's WireGuard port blocked (kg and its API connection up): it marks its
/// share's lease cut off, a node that leads nothing shows with a standby handshake that it
/// reaches west, and takes the share over.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_second_leader_cut_off_gives_its_share_to_a_node_that_reaches_the_others() {
    let test = "a_second_leader_cut_off_gives_its_share_to_a_node_that_reaches_the_others";
    let Some(l) = Loaded::start(test) else {
        return;
    };
    let blocked = Instant::now();
    l.c.node(&l.second).block_wireguard();
    l.second_share_moves(blocked, "cut off", Duration::from_secs(30));
    let marked = l.c.node(&l.second).events_of(Reason::LeaderCutOff);
    assert!(marked.iter().any(|e| e.subject == SECOND), "{marked:?}");
}
