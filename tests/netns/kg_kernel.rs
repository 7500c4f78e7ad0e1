//! kg driving the kernel's WireGuard (`--wireguard=kernel`). This machine's kernel may have no
//! WireGuard (CI's has none): tests/real/kernel_vm.rs runs these in a virtual machine booted
//! from Debian's newest kernel, and they skip themselves, saying so, on a kernel without it.

use crate::common;

use std::process::Command;
use std::time::Duration;

use common::cluster::Cluster;

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

#[test]
fn kg_edits_allowed_ips_on_the_kernels_wireguard_from_linux_6_16() {
    let test = "kg_edits_allowed_ips_on_the_kernels_wireguard_from_linux_6_16";
    if !common::can_run(test) {
        return;
    }
    if !kernel_has_wireguard() {
        // In scripts/kernel-vm.sh's machine the kernel must have it: never pass by skipping.
        assert!(
            std::env::var_os("KILOTUN_VM_KERNEL").is_none(),
            "{test}: kernel {} in the virtual machine makes no WireGuard link",
            release()
        );
        eprintln!(
            "skipped {test}: kernel {} makes no WireGuard link; tests/real/kernel_vm.rs runs it \
             under Debian's newest kernel",
            release()
        );
        return;
    }
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
    // What each kg sent (its debug line of each netlink set): from 6.16 the range that moved
    // and nothing else, before it the peer's whole list.
    for (node, gone, came) in [
        ("n1", "10.78.1.0/24", "10.78.2.0/24"),
        ("n2", "10.77.1.0/24", "10.77.2.0/24"),
    ] {
        let log = c.node(node).log_text();
        let edited = log.contains(&format!(" +{came} -{gone}"));
        assert_eq!(edited, edits, "kernel {}: {node}: {log}", release());
        assert!(!log.contains("refused the removal"), "{log}");
    }
    assert_eq!(handshakes(&c), before, "no session ended");
    c.all_pods_reachable().unwrap();
}
