//! A leader's loss costs only its share: two leaders per location with lease election, TCP
//! streams and pings through both east shares, and east's second leader killed. The first
//! share's traffic loses no echo; the second's share is carried again by a node that led
//! nothing, within the lease's bounds; the dead leader, back, does not take its share back.

use crate::common;

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

#[test]
fn a_lost_second_leader_costs_only_its_share() {
    if !common::can_run("a_lost_second_leader_costs_only_its_share") {
        return;
    }
    if !common::which("iperf3") {
        eprintln!("skipping a_lost_second_leader_costs_only_its_share: needs iperf3");
        return;
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
    // The node to take the second share over is the first follower by Kilo's rule (all
    // private, so by name): each share is watched from its other follower.
    let follower = |share: &[&'static str], leader: &str| {
        *share.iter().filter(|n| **n != leader).max().unwrap()
    };
    let (kept_follower, lost_follower) = (follower(&kept, &first), follower(&lost, &second));

    // Load through both shares, and pings from each share (and the first leader) to w1.
    let w2 = c.node("w2");
    let _servers: Vec<Killed> = [5201, 5202]
        .iter()
        .map(|port| {
            Killed(
                Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        &w2.ns.name,
                        "iperf3",
                        "-s",
                        "-B",
                        &w2.pod_ip,
                    ])
                    .args(["-p", &port.to_string()])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("iperf3 -s"),
            )
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let streams = [
        Killed(stream(&c, kept_follower, "w2", 5201, 40)),
        Killed(stream(&c, lost_follower, "w2", 5202, 40)),
    ];
    let target = c.node("w1").pod_ip.clone();
    let ping = |from: &str| {
        let n = c.node(from);
        Pinger::start_from(&n.ns.name, &n.pod_ip, &target)
    };
    let (kept_pinger, leader_pinger, lost_pinger) =
        (ping(kept_follower), ping(&first), ping(lost_follower));
    let started = Instant::now();
    for p in [&kept_pinger, &leader_pinger, &lost_pinger] {
        assert!(
            p.wait_flowing(started, Duration::from_secs(10)),
            "{}",
            c.logs()
        );
    }
    std::thread::sleep(Duration::from_secs(2));

    // The second leader dies: kg killed, its links cut.
    let index = NODES.iter().position(|(n, _)| *n == second).unwrap();
    let killed = Instant::now();
    c.nodes[index].kill();
    c.node(&second)
        .ns
        .run(&["ip", "link", "set", "eth0", "down"]);
    let back = lost_pinger.wait_flowing(killed, Duration::from_secs(30));
    let lost_gap = lost_pinger.longest_gap_after(killed);
    // The topology moves at the lease's expiry; the successor writes the lease on its next
    // lease step.
    c.wait_for(Duration::from_secs(10), |c| {
        c.holder_of(SECOND).is_some_and(|h| h != second)
    });
    let successor = c.holder_of(SECOND);
    std::thread::sleep(Duration::from_secs(3));
    let (kept_lost, leader_lost) = (
        kept_pinger.lost_after(killed),
        leader_pinger.lost_after(killed),
    );
    let kept_gap = kept_pinger.longest_gap_after(killed);
    eprintln!(
        "second leader {second} killed: its share back after {:.1} s (through {successor:?}); the first share ({first}) lost {kept_lost} echoes from {kept_follower} (longest gap {:.2} s) and {leader_lost} from {first}",
        lost_gap.as_secs_f64(),
        kept_gap.as_secs_f64()
    );
    assert!(back, "the second share never came back\n{}", c.logs());
    assert!(
        lost_gap < Duration::from_secs(10),
        "gap {lost_gap:?}\n{}",
        c.logs()
    );
    assert!(
        successor
            .as_deref()
            .is_some_and(|s| s != second && s != first),
        "{successor:?}"
    );
    assert_eq!(c.holder_of(FIRST).as_deref(), Some(first.as_str()));
    assert_eq!(leader_lost, 0, "{}", c.logs());
    // The follower stays in the first share unless balance moved it to the second.
    if share_of(&c, &first).contains(&kept_follower) {
        assert_eq!(kept_lost, 0, "{}", c.logs());
        assert!(kept_gap < Duration::from_secs(1), "{kept_gap:?}");
    } else {
        eprintln!("{kept_follower} moved to the second share for balance");
        assert!(
            kept_gap < Duration::from_secs(2),
            "{kept_gap:?}\n{}",
            c.logs()
        );
    }
    drop(streams);

    // The dead leader comes back: the successor keeps the share.
    c.node(&second).ns.run(&["ip", "link", "set", "eth0", "up"]);
    c.start_kg(index, &FLAGS);
    std::thread::sleep(Duration::from_secs(12));
    assert_eq!(c.holder_of(SECOND), successor, "{}", c.logs());
    assert_eq!(c.holder_of(FIRST).as_deref(), Some(first.as_str()));
    let flowing = c.wait_for(Duration::from_secs(20), |c| c.all_pods_reachable().is_ok());
    assert!(flowing, "{:?}\n{}", c.all_pods_reachable(), c.logs());
}
