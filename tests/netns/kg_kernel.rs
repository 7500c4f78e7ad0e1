//! kg driving the kernel's WireGuard (`--wireguard=kernel`). This machine's kernel may have no
//! WireGuard (CI's has none): tests/real/kernel_vm.rs runs these in a virtual machine booted
//! from Debian's newest kernel, and they skip themselves, saying so, on a kernel without it:
//! allowed IPs edited entry by entry, and post-quantum preshared keys with a key rotation.

use crate::common;
use control::journal::Reason;

use std::process::Command;
use std::time::{Duration, Instant};

use common::cluster::Cluster;
use common::pinger::Pinger;

/// Whether this kernel makes WireGuard links (probed in a namespace of its own).
fn kernel_has_wireguard() -> bool {
    let ns = format!("kt-wgprobe-{}", std::process::id());
    let ip = |args: &[&str]| {
        Command::new("ip")
            .args(args)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !ip(&["netns", "add", &ns]) {
        return false;
    }
    let made = ip(&["-n", &ns, "link", "add", "wgprobe", "type", "wireguard"]);
    ip(&["netns", "del", &ns]);
    made
}

/// The running kernel's release (`uname -r`).
fn release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Fails `test` unless it can run here: as root, on a kernel with WireGuard. Where the kernel
/// has none, `.ci/run` leaves these tests out (the runner reports them as skipped) and
/// tests/real/kernel_vm.rs runs them under Debian's newest kernel.
fn require_the_kernels_wireguard(test: &str) {
    common::require_root(test);
    assert!(
        kernel_has_wireguard(),
        "{test}: kernel {} makes no WireGuard link (tests/real/kernel_vm.rs runs this test under \
         Debian's newest kernel; .ci/run leaves it out where the kernel has none)",
        release()
    );
}

#[test]
#[ignore = "needs root and a kernel with WireGuard (tests/real/kernel_vm.rs runs it in a VM)"]
fn kg_edits_allowed_ips_on_the_kernels_wireguard_from_linux_6_16() {
    require_the_kernels_wireguard("kg_edits_allowed_ips_on_the_kernels_wireguard_from_linux_6_16");
    let edits = kilotun::agent::shells::kernel_wireguard::kernel_takes_removals(&release());
    let mut c = Cluster::with_nodes(&["east", "west"], &[("n1", "east"), ("n2", "west")]);
    for i in 0..2 {
        c.start_kg(i, &["--encapsulate=never", "--wireguard=kernel"]);
    }
    let meshed = c.wait_for(Duration::from_secs(60), |c| c.all_pods_reachable().is_ok());
    assert!(meshed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    let handshakes = |c: &Cluster| {
        (
            c.node("n1").wg("latest-handshakes"),
            c.node("n2").wg("latest-handshakes"),
        )
    };
    // Both ends start handshakes at once when their kg starts, and under emulation the
    // second can complete seconds after the mesh is up: the sessions count as made once two
    // readings 7 s apart (past WireGuard's 5 s retry) agree.
    let mut before = handshakes(&c);
    for _ in 0..6 {
        std::thread::sleep(Duration::from_secs(7));
        let now = handshakes(&c);
        if now == before {
            break;
        }
        before = now;
    }

    common::edits::add_then_move_location_ranges(&c, Duration::from_secs(30));
    // What each kg sent: from 6.16 each change of the peer's list as an edit, the removal
    // included, before it the whole list; and no refusal either way.
    for node in ["n1", "n2"] {
        let (_, metrics) = c.node(node).http_get("/metrics");
        let updates = |method: &str| {
            let series =
                format!("kilotun_wireguard_allowed_ips_updates_total{{method=\"{method}\"}}");
            common::metric_value(&metrics, &series).unwrap_or(0.0)
        };
        let (edited, replaced) = (updates("edit"), updates("replace"));
        let (used, unused) = if edits {
            (edited, replaced)
        } else {
            (replaced, edited)
        };
        assert!(
            used >= 2.0 && unused == 0.0,
            "kernel {}: {node}: {edited} edits, {replaced} whole lists",
            release()
        );
        let refused = c.node(node).events_of(Reason::AllowedIpEditRefused);
        assert!(refused.is_empty(), "{node}: {refused:?}");
    }
    assert_eq!(handshakes(&c), before, "no session ended");
    c.all_pods_reachable().unwrap();
}

/// `wg show <iface> preshared-keys` of `node`: the key it holds for its one peer.
fn psk(c: &Cluster, node: &str) -> String {
    let shown = c.node(node).wg("preshared-keys");
    shown
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_string()
}

/// True when both kernel devices hold one post-quantum preshared key for each other.
fn keyed(c: &Cluster) -> bool {
    let (a, b) = (psk(c, "n1"), psk(c, "n2"));
    !a.is_empty() && a != "(none)" && a == b
}

#[test]
#[ignore = "needs root and a kernel with WireGuard (tests/real/kernel_vm.rs runs it in a VM)"]
fn post_quantum_keys_and_a_key_rotation_on_the_kernels_wireguard() {
    let test = "post_quantum_keys_and_a_key_rotation_on_the_kernels_wireguard";
    require_the_kernels_wireguard(test);
    let mut c = Cluster::with_nodes(&["east", "west"], &[("n1", "east"), ("n2", "west")]);
    let flags = [
        "--encapsulate=never",
        "--wireguard=kernel",
        "--post-quantum",
        "--psk-rotation-period=10s",
    ];
    for i in 0..2 {
        c.start_kg(i, &flags);
    }
    let meshed = c.wait_for(Duration::from_secs(60), |c| {
        c.all_pods_reachable().is_ok() && keyed(c)
    });
    assert!(
        meshed,
        "{:?} {} {}\n{}",
        c.all_pods_reachable(),
        psk(&c, "n1"),
        psk(&c, "n2"),
        c.logs()
    );
    let first = psk(&c, "n1");
    let pinger = Pinger::start(&c.node("n2").ns.name, &c.node("n1").pod_ip);
    assert!(pinger.wait_flowing(
        Instant::now() - Duration::from_secs(1),
        Duration::from_secs(20)
    ));
    // The key changes every 10 s: the kernel keeps the session, and its next handshake uses
    // the new key at both ends.
    let since = Instant::now();
    let changed = c.wait_for(Duration::from_secs(40), |c| {
        keyed(c) && psk(c, "n1") != first
    });
    assert!(changed, "{} {}\n{}", psk(&c, "n1"), psk(&c, "n2"), c.logs());
    std::thread::sleep(Duration::from_secs(1));
    let lost = pinger.lost_after(since);
    eprintln!(
        "{test}: {lost} echoes lost n2→n1 over a preshared key change; longest gap {:?}",
        pinger.longest_gap_after(since)
    );
    assert!(lost <= 2, "{lost} echoes lost\n{}", c.logs());

    // n1's key rotates: n2 follows, and the link is keyed again under the new keys.
    let key = c.annotations("n1")["kilo.squat.ai/key"].clone();
    let since = Instant::now();
    crate::kg_rotation::rotate_n1(&c);
    let rotated = c.wait_for(Duration::from_secs(60), |c| {
        let new = c.annotations("n1")["kilo.squat.ai/key"].clone();
        new != key && c.node("n2").wg("peers").trim() == new && keyed(c)
    });
    assert!(rotated, "{}\n{}", c.node("n2").wg("peers"), c.logs());
    eprintln!(
        "{test}: n1's key rotated and the link keyed again {:?} later",
        since.elapsed()
    );
    std::thread::sleep(Duration::from_secs(1));
    let lost = pinger.lost_after(since);
    eprintln!(
        "{test}: {lost} echoes lost n2→n1 over the rotation; longest gap {:?}",
        pinger.longest_gap_after(since)
    );
    assert!(lost <= 10, "{lost} echoes lost\n{}", c.logs());
    c.all_pods_reachable().unwrap();
}
