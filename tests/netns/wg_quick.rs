//! kilotun as wg-quick's userspace implementation (`WG_QUICK_USERSPACE_IMPLEMENTATION`, for a
//! kernel without WireGuard): `up`, `down`, `up`, `down` of one configuration file, in a split
//! tunnel and in a full one (`AllowedIPs = 0.0.0.0/0`, which wg-quick routes through a table of
//! its own, a fwmark on the device's sockets and policy rules). Each `down` deletes the link,
//! which must end the daemon and free its socket at once for the next `up`. Root only.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

use common::{kilotun_bin, ping_ok, Impl, Link, Underlay, WgDevice};

/// Fails the test unless wg-quick is here.
fn require_wg_quick(test: &str) {
    assert!(
        common::which("wg-quick"),
        "{test}: needs wg-quick (wireguard-tools; .ci/run installs it)"
    );
}

/// Processes whose command line is this kilotun binary serving `interface`.
fn daemons(interface: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
            args.first() == Some(&kilotun_bin().as_bytes()) && args.contains(&interface.as_bytes())
        })
        .collect()
}

/// A wg-quick configuration file `<dir>/<interface>.conf`, removed on drop with its folder.
struct QuickConf {
    dir: PathBuf,
    path: String,
    interface: String,
    ns: String,
}

impl QuickConf {
    fn up(&self) -> Output {
        self.quick("up")
    }

    fn down(&self) -> Output {
        self.quick("down")
    }

    fn quick(&self, verb: &str) -> Output {
        common::output(&[
            "ip",
            "netns",
            "exec",
            &self.ns,
            "env",
            &format!("WG_QUICK_USERSPACE_IMPLEMENTATION={}", kilotun_bin()),
            "wg-quick",
            verb,
            &self.path,
        ])
    }
}

impl Drop for QuickConf {
    fn drop(&mut self) {
        // Deleting the link ends the daemon; the namespace's deletion would too.
        let _ = common::output(&["ip", "-n", &self.ns, "link", "del", &self.interface]);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Waits up to `timeout` for `done`; returns how long it took, or `None`.
fn wait_for(timeout: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < timeout {
        if done() {
            return Some(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

/// `up`, a ping through the tunnel, `down` (the daemon gone, its socket removed, wg-quick's
/// routes and rules with it), and the same again. `allowed` is the left end's `AllowedIPs`.
fn up_down_twice(test: &str, allowed: &str, subnet: u8) {
    common::require_root(test);
    require_wg_quick(test);
    let link = Link::new(Underlay::V4);
    let right = WgDevice::start(&link.right, Impl::Kilotun);
    let interface = common::unique("wq");
    let key = common::run(&["wg", "genkey"]);
    let public = common::pipe_to(&["wg", "pubkey"], key.as_bytes());
    right.configure(51821, &[&format!("10.{subnet}.0.2/24")]);
    right.wg(&[
        "set",
        &right.name,
        "peer",
        public.trim(),
        "endpoint",
        "192.168.200.1:51820",
        "allowed-ips",
        &format!("10.{subnet}.0.1/32"),
    ]);

    let dir = std::env::temp_dir().join(format!("kilotun-{interface}"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{interface}.conf"));
    std::fs::write(
        &path,
        format!(
            "[Interface]\nPrivateKey = {}\nAddress = 10.{subnet}.0.1/24\nListenPort = 51820\n\n\
             [Peer]\nPublicKey = {}\nEndpoint = 192.168.200.2:51821\nAllowedIPs = {allowed}\n",
            key.trim(),
            right.public_key
        ),
    )
    .unwrap();
    let conf = QuickConf {
        dir,
        path: path.to_str().unwrap().to_string(),
        interface: interface.clone(),
        ns: link.left.name.clone(),
    };
    let socket = Path::new("/var/run/wireguard").join(format!("{interface}.sock"));
    let full = allowed.contains("/0");
    for round in 1..=2 {
        let up = conf.up();
        assert!(
            up.status.success(),
            "round {round}: wg-quick up failed:\n{}",
            common::output_text(&up)
        );
        assert_eq!(daemons(&interface).len(), 1, "round {round}: one daemon");
        let shown = link.left.run(&["ip", "link", "show", &interface]);
        assert!(
            shown.contains(",UP"),
            "round {round}: wg-quick set it up: {shown}"
        );
        if full {
            let rules = link.left.run(&["ip", "-4", "rule", "show"]);
            assert!(
                rules.contains("not from all fwmark 0xca6c lookup 51820"),
                "round {round}: wg-quick's policy rules: {rules}"
            );
            let fwmark = link.left.run(&["wg", "show", &interface, "fwmark"]);
            assert_eq!(
                fwmark.trim(),
                "0xca6c",
                "round {round}: the device's fwmark"
            );
        }
        // Through the tunnel; under a full tunnel the handshake itself only reaches the other
        // end because the device's sockets carry wg-quick's fwmark, which the rules exempt.
        assert!(
            ping_ok(
                &link.left.name,
                &format!("10.{subnet}.0.2"),
                Duration::from_secs(10)
            ),
            "round {round}: ping through the tunnel"
        );
        if full {
            assert!(
                ping_ok(&link.left.name, "192.168.200.2", Duration::from_secs(5)),
                "round {round}: the other end's underlay address, through the tunnel"
            );
        }

        let down_at = Instant::now();
        let down = conf.down();
        assert!(
            down.status.success(),
            "round {round}: wg-quick down failed:\n{}",
            common::output_text(&down)
        );
        let gone = wait_for(Duration::from_secs(2), || {
            daemons(&interface).is_empty() && !socket.exists()
        });
        println!(
            "{test} round {round}: wg-quick down took {:?}; the daemon and its socket gone {:?} after it returned",
            down_at.elapsed(),
            gone
        );
        let gone = gone.expect("the daemon ends and removes its socket after wg-quick down");
        assert!(gone < Duration::from_secs(1), "round {round}: {gone:?}");
        assert!(
            !link
                .left
                .output(&["ip", "link", "show", &interface])
                .status
                .success(),
            "round {round}: the link is gone"
        );
        if full {
            let rules = link.left.run(&["ip", "-4", "rule", "show"]);
            assert!(
                !rules.contains("51820"),
                "round {round}: rules removed: {rules}"
            );
        }
    }
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn wg_quick_up_down_up_down_in_a_split_tunnel() {
    up_down_twice(
        "wg_quick_up_down_up_down_in_a_split_tunnel",
        "10.81.0.2/32",
        81,
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn wg_quick_up_down_up_down_in_a_full_tunnel() {
    up_down_twice("wg_quick_up_down_up_down_in_a_full_tunnel", "0.0.0.0/0", 82);
}
