//! Memory with many peers: a running `kilotun` configured with 1,000 peers through its UAPI
//! socket (by stock `wg setconf`) must stay under 40 MiB of resident memory. `bench/memory.sh`
//! prints the same figure next to wireguard-go's.

use crate::common;

use std::fmt::Write as _;
use std::time::Duration;

use common::{rss_kib, Impl, Netns, WgDevice};
use dataplane::key::SecretKey;

/// Peers configured, as in the performance issue's target.
const PEERS: usize = 1_000;
/// The ceiling for the resident set with [`PEERS`] peers.
const CEILING_KIB: u64 = 40 * 1024;

/// A `wg setconf` file: `device`'s key, a listen port, and `count` peers each with an endpoint
/// and two allowed IPs (a v4 /24 and a v6 /64), like `bench/memory.sh` writes.
fn config_with_peers(device: &WgDevice, count: usize) -> String {
    let private = std::fs::read_to_string(&device.key_file).unwrap();
    let mut conf = format!(
        "[Interface]\nPrivateKey = {}\nListenPort = 51820\n",
        private.trim()
    );
    for i in 0..count {
        let public = SecretKey::generate().public_key().to_base64();
        write!(
            conf,
            "\n[Peer]\nPublicKey = {public}\nEndpoint = 192.0.2.{}:{}\nAllowedIPs = 10.{}.{}.0/24, fd00:{i:x}::/64\n",
            i % 250 + 1,
            20_000 + i,
            i / 250 + 10,
            i % 250,
        )
        .unwrap();
    }
    conf
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn a_thousand_peers_fit_in_forty_mebibytes() {
    common::require_root("a_thousand_peers_fit_in_forty_mebibytes");
    let ns = Netns::new();
    let device = WgDevice::start(&ns, Impl::Kilotun);
    let idle = rss_kib(device.pid());
    let file = format!("/tmp/{}.conf", device.name);
    std::fs::write(&file, config_with_peers(&device, PEERS)).unwrap();
    device.wg(&["setconf", &device.name, &file]);
    let _ = std::fs::remove_file(&file);
    let configured = device.wg(&["show", &device.name, "peers"]).lines().count();
    assert_eq!(configured, PEERS, "kilotun reports every configured peer");
    let allowed = device.wg(&["show", &device.name, "allowed-ips"]);
    assert!(
        allowed.contains("10.13.249.0/24") && allowed.contains("fd00:3e7::/64"),
        "the last peer's allowed IPs are in place"
    );
    std::thread::sleep(Duration::from_millis(500));
    let loaded = rss_kib(device.pid());
    eprintln!("kilotun RSS: {idle} KiB idle, {loaded} KiB with {PEERS} peers");
    assert!(
        loaded < CEILING_KIB,
        "kilotun uses {loaded} KiB with {PEERS} peers (ceiling {CEILING_KIB} KiB)"
    );
}
