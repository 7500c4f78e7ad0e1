//! Key rotation end to end: three nodes in a full mesh (n1, n2 in east, n3 in west), pings at
//! 10 a second from n2 and n3 to n1's pod address and from n2 to n3's, and n1's key rotated
//! with `kgctl rotate-key`, once undisturbed and once with n1's kg killed while its next key
//! stands published. The links to n1 lose at most two echoes, the n2–n3 link none, and every
//! peer ends with n1's new key alone.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::pinger::Pinger;

const KEY: &str = "kilo.squat.ai/key";
const NEXT_KEY: &str = "kilotun.io/next-key";
const KEY_ROTATED: &str = "kilotun.io/key-rotated";

/// Runs `kgctl rotate-key n1` against the cluster; returns the request's id.
pub(crate) fn rotate_n1(c: &Cluster) -> String {
    let dir = format!("--cluster-dir={}", c.dir.display());
    let out = common::run(&[
        common::cluster::kgctl_bin(),
        "--backend=file",
        &dir,
        "rotate-key",
        "n1",
    ]);
    out.split("(request ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .unwrap_or_else(|| panic!("kgctl rotate-key said: {out}"))
        .to_string()
}

/// Waits until n1 publishes a key other than `old` and says it carried out `id`, with no next
/// key left; returns the new key.
fn wait_rotated(c: &Cluster, old: &str, id: &str, within: Duration) -> String {
    let done = c.wait_for(within, |c| {
        let a = c.annotations("n1");
        a[KEY] != old
            && a.get(KEY_ROTATED).map(String::as_str) == Some(id)
            && !a.contains_key(NEXT_KEY)
    });
    assert!(done, "{:?}\n{}", c.annotations("n1"), c.logs());
    c.annotations("n1")[KEY].clone()
}

/// Every peer of n1 holds `new` with n1's pod range and neither `old` nor a peer without
/// allowed IPs.
fn peers_follow(c: &Cluster, old: &str, new: &str) {
    let settled = c.wait_for(Duration::from_secs(10), |c| {
        ["n2", "n3"].iter().all(|n| {
            let allowed = c.node(n).wg("allowed-ips");
            !allowed.contains(old)
                && allowed
                    .lines()
                    .any(|l| l.starts_with(new) && l.contains("10.42.1.0/24"))
        })
    });
    assert!(
        settled,
        "n2: {}\nn3: {}\n{}",
        c.node("n2").wg("allowed-ips"),
        c.node("n3").wg("allowed-ips"),
        c.logs()
    );
}

fn pinging(c: &Cluster) -> [Pinger; 3] {
    let n1_pod = &c.node("n1").pod_ip;
    let pingers = [
        Pinger::start(&c.node("n2").ns.name, n1_pod),
        Pinger::start(&c.node("n3").ns.name, n1_pod),
        Pinger::start(&c.node("n2").ns.name, &c.node("n3").pod_ip),
    ];
    let since = Instant::now() - Duration::from_secs(1);
    for p in &pingers {
        assert!(
            p.wait_flowing(since, Duration::from_secs(10)),
            "{}",
            c.logs()
        );
    }
    pingers
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_rotated_key_costs_its_links_at_most_two_echoes_and_touches_no_other_link() {
    common::require_root(
        "a_rotated_key_costs_its_links_at_most_two_echoes_and_touches_no_other_link",
    );
    let c = Cluster::meshed_east_west(&["--mesh-granularity=full", "--encapsulate=never"]);
    let old = c.annotations("n1")[KEY].clone();
    let [to_n1_east, to_n1_west, between] = pinging(&c);
    let since = Instant::now();
    let id = rotate_n1(&c);
    let new = wait_rotated(&c, &old, &id, Duration::from_secs(20));
    peers_follow(&c, &old, &new);
    std::thread::sleep(Duration::from_secs(2));
    let lost = [
        to_n1_east.lost_after(since),
        to_n1_west.lost_after(since),
        between.lost_after(since),
    ];
    eprintln!(
        "rotation: echoes lost n2→n1 {}, n3→n1 {}, n2→n3 {}; longest gaps {:?} {:?}",
        lost[0],
        lost[1],
        lost[2],
        to_n1_east.longest_gap_after(since),
        to_n1_west.longest_gap_after(since)
    );
    assert!(lost[0] <= 2 && lost[1] <= 2, "{lost:?}\n{}", c.logs());
    assert_eq!(lost[2], 0, "the n2–n3 link is not touched\n{}", c.logs());
    // The key on disk is the new one, private, and its next-key file is gone.
    let key_file = c.work.join("keys").join("n1");
    let mode = std::fs::metadata(&key_file).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    assert!(!c.work.join("keys").join("n1.next").exists());
    let private = std::fs::read_to_string(&key_file).unwrap();
    let log = c.node("n1").log_text();
    assert!(!log.contains(private.trim()), "the private key was logged");
    let (_, metrics) = c.node("n1").http_get("/metrics");
    assert!(
        metrics.contains("kilotun_key_rotations_total 1"),
        "{metrics}"
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_rotation_interrupted_by_a_killed_kg_ends_with_one_key_its_peers_know() {
    common::require_root("a_rotation_interrupted_by_a_killed_kg_ends_with_one_key_its_peers_know");
    let mut c = Cluster::meshed_east_west(&["--mesh-granularity=full", "--encapsulate=never"]);
    let old = c.annotations("n1")[KEY].clone();
    let id = rotate_n1(&c);
    // n1's kg dies while its next key stands published, before it uses it.
    let published = c.wait_for(Duration::from_secs(10), |c| {
        c.annotations("n1").contains_key(NEXT_KEY)
    });
    assert!(published, "{}", c.logs());
    c.nodes[0].kill();
    assert!(c.work.join("keys").join("n1.next").exists());
    let [to_n1_east, to_n1_west, _] = {
        c.start_kg(0, &["--mesh-granularity=full", "--encapsulate=never"]);
        pinging(&c)
    };
    let new = wait_rotated(&c, &old, &id, Duration::from_secs(30));
    peers_follow(&c, &old, &new);
    let since = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(to_n1_east.lost_after(since), 0, "{}", c.logs());
    assert_eq!(to_n1_west.lost_after(since), 0, "{}", c.logs());
    // Asked once, rotated once: the restarted kg did not start another rotation.
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(c.annotations("n1")[KEY], new);
    assert!(!c.annotations("n1").contains_key(NEXT_KEY));
    let (_, metrics) = c.node("n1").http_get("/metrics");
    assert!(
        metrics.contains("kilotun_key_rotations_total 1"),
        "{metrics}"
    );
}
