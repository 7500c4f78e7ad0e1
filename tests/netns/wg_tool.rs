//! kilotun driven by stock `wg`: what `wg show`/`wg showconf` report, `wg setconf` of an
//! identical configuration during a transfer, roaming, persistent keepalive. Root only.

use crate::common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{ping_ok, tcp_transfer, Impl, Link, Underlay, WgDevice};

fn pair(right: Impl) -> (Link, WgDevice, WgDevice) {
    common::peered(Impl::Kilotun, right, 71)
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `wg show IF latest-handshakes` for the only peer.
fn latest_handshake(dev: &WgDevice) -> u64 {
    let out = dev.wg(&["show", &dev.name, "latest-handshakes"]);
    out.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// `wg show IF transfer` for the only peer: (rx, tx).
fn transfer(dev: &WgDevice) -> (u64, u64) {
    let out = dev.wg(&["show", &dev.name, "transfer"]);
    let mut f = out.split_whitespace().skip(1);
    (
        f.next().unwrap().parse().unwrap(),
        f.next().unwrap().parse().unwrap(),
    )
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn wg_showconf_reports_exactly_what_was_set() {
    common::require_root("wg_showconf_reports_exactly_what_was_set");
    let link = Link::new(Underlay::V4);
    let a = WgDevice::start(&link.left, Impl::Kilotun);
    let peer_key = common::pipe_to(&["wg", "pubkey"], common::run(&["wg", "genkey"]).as_bytes());
    let peer_key = peer_key.trim();
    let psk = common::run(&["wg", "genpsk"]);
    let psk_file = format!("/tmp/{}.psk", a.name);
    std::fs::write(&psk_file, &psk).unwrap();
    a.wg(&[
        "set",
        &a.name,
        "private-key",
        &a.key_file,
        "listen-port",
        "51999",
        "fwmark",
        "0x42",
        "peer",
        peer_key,
        "preshared-key",
        &psk_file,
        "endpoint",
        "192.168.200.2:4000",
        "persistent-keepalive",
        "25",
        "allowed-ips",
        "10.1.2.3/24,fd00:1::/64,10.9.9.9/32",
    ]);
    std::fs::remove_file(&psk_file).unwrap();
    let private = std::fs::read_to_string(&a.key_file).unwrap();
    let expected = format!(
        "[Interface]\nListenPort = 51999\nFwMark = 0x42\nPrivateKey = {}\n\n[Peer]\n\
         PublicKey = {peer_key}\nPresharedKey = {}\n\
         AllowedIPs = 10.1.2.0/24, fd00:1::/64, 10.9.9.9/32\n\
         Endpoint = 192.168.200.2:4000\nPersistentKeepalive = 25\n",
        private.trim(),
        psk.trim()
    );
    assert_eq!(a.wg(&["showconf", &a.name]), expected);
    let show = a.wg(&["show", &a.name]);
    assert!(
        show.contains(&format!("public key: {}", a.public_key)),
        "{show}"
    );
    assert!(show.contains("listening port: 51999"), "{show}");
    assert!(show.contains("fwmark: 0x42"), "{show}");
    // Removing an allowed IP and the peer work too.
    a.wg(&[
        "set",
        &a.name,
        "peer",
        peer_key,
        "allowed-ips",
        "10.9.9.9/32",
    ]);
    assert!(a
        .wg(&["show", &a.name, "allowed-ips"])
        .contains("10.9.9.9/32"));
    a.wg(&["set", &a.name, "peer", peer_key, "remove"]);
    assert_eq!(a.wg(&["show", &a.name, "peers"]), "");
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn handshake_time_is_recent_wall_clock_and_counters_grow() {
    common::require_root("handshake_time_is_recent_wall_clock_and_counters_grow");
    let (_link, a, b) = pair(Impl::WireguardGo);
    assert_eq!(latest_handshake(&a), 0, "no handshake before traffic");
    assert!(ping_ok(&a.ns, "10.71.0.2", Duration::from_secs(10)));
    let at = latest_handshake(&a);
    let now = now_unix();
    assert!(at <= now && now - at < 10, "handshake at {at}, now {now}");
    let (rx1, tx1) = transfer(&a);
    assert!(rx1 > 0 && tx1 > 0);
    assert!(ping_ok(&a.ns, "10.71.0.2", Duration::from_secs(5)));
    let (rx2, tx2) = transfer(&a);
    assert!(rx2 > rx1 && tx2 > tx1, "({rx1},{tx1}) -> ({rx2},{tx2})");
    // wireguard-go agrees on what it received from us.
    let (b_rx, _) = transfer(&b);
    assert!(b_rx >= tx1, "wireguard-go received {b_rx}, we sent {tx2}");
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn setconf_of_the_same_config_during_a_transfer_keeps_the_session() {
    common::require_root("setconf_of_the_same_config_during_a_transfer_keeps_the_session");
    let (link, a, b) = pair(Impl::Kilotun);
    assert!(ping_ok(&a.ns, "10.71.0.2", Duration::from_secs(10)));
    let (handshake_a, handshake_b) = (latest_handshake(&a), latest_handshake(&b));
    let conf = a.wg(&["showconf", &a.name]);
    let conf_file = format!("/tmp/{}.conf", a.name);
    std::fs::write(&conf_file, &conf).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (ns, name, file, flag) = (
        a.ns.clone(),
        a.name.clone(),
        conf_file.clone(),
        stop.clone(),
    );
    let reloader = std::thread::spawn(move || {
        let mut n = 0;
        while !flag.load(std::sync::atomic::Ordering::Relaxed) {
            common::run(&["ip", "netns", "exec", &ns, "wg", "setconf", &name, &file]);
            n += 1;
            std::thread::sleep(Duration::from_millis(50));
        }
        n
    });
    tcp_transfer(
        &link.left,
        &link.right,
        "10.71.0.2".parse().unwrap(),
        200 * 1024 * 1024,
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reloads = reloader.join().unwrap();
    std::fs::remove_file(&conf_file).unwrap();
    assert!(
        reloads >= 3,
        "only {reloads} reloads happened during the transfer"
    );
    assert_eq!(latest_handshake(&a), handshake_a, "no new handshake on a");
    assert_eq!(latest_handshake(&b), handshake_b, "no new handshake on b");
    assert_eq!(
        a.wg(&["showconf", &a.name]),
        conf,
        "configuration unchanged"
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn endpoint_follows_the_peer_when_its_port_changes() {
    common::require_root("endpoint_follows_the_peer_when_its_port_changes");
    let (_link, a, b) = pair(Impl::WireguardGo);
    assert!(ping_ok(&b.ns, "10.71.0.1", Duration::from_secs(10)));
    assert!(a
        .wg(&["show", &a.name, "endpoints"])
        .contains("192.168.200.2:51821"));
    b.wg(&["set", &b.name, "listen-port", "52444"]);
    assert!(ping_ok(&b.ns, "10.71.0.1", Duration::from_secs(10)));
    let endpoints = a.wg(&["show", &a.name, "endpoints"]);
    assert!(endpoints.contains("192.168.200.2:52444"), "{endpoints}");
    // And a -> b now goes to the new port.
    assert!(ping_ok(&a.ns, "10.71.0.2", Duration::from_secs(5)));
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn persistent_keepalive_is_sent_at_the_configured_interval() {
    common::require_root("persistent_keepalive_is_sent_at_the_configured_interval");
    common::require_tcpdump("persistent_keepalive_is_sent_at_the_configured_interval");
    let (link, a, b) = pair(Impl::WireguardGo);
    assert!(ping_ok(&a.ns, "10.71.0.2", Duration::from_secs(10)));
    let capture = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &link.right.name,
            "timeout",
            "6.5",
            "tcpdump",
            "-i",
        ])
        .args([&link.right_dev, "-n", "-tt", "-l", "udp and src port 51820"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    a.wg(&[
        "set",
        &a.name,
        "peer",
        &b.public_key,
        "persistent-keepalive",
        "1",
    ]);
    let out = capture.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let times: Vec<f64> = text
        .lines()
        .filter(|l| l.ends_with("length 32"))
        .filter_map(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    assert!(times.len() >= 5, "keepalives seen: {text}");
    for gap in times.windows(2).map(|w| w[1] - w[0]).skip(1) {
        assert!((0.9..1.4).contains(&gap), "keepalive gap {gap:.3}s: {text}");
    }
}

/// A `wg setconf` file: one peer with `count` allowed IPs (distinct /32s from 10.0.0.0 up),
/// 256 to an `AllowedIPs` line.
fn big_config(private_key: &str, peer: &str, count: u32) -> String {
    let mut conf = format!(
        "[Interface]\nPrivateKey = {}\n\n[Peer]\nPublicKey = {peer}\n",
        private_key.trim()
    );
    let ips: Vec<String> = (0..count)
        .map(|i| format!("{}/32", std::net::Ipv4Addr::from(0x0a00_0000 + i)))
        .collect();
    for line in ips.chunks(256) {
        conf.push_str(&format!("AllowedIPs = {}\n", line.join(", ")));
    }
    conf
}

/// `wg setconf` of one peer with 8,000, 32,000 and 130,560 allowed IPs: the times are printed
/// (wireguard-go's beside them when it is installed), and every prefix is there after.
#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn wg_setconf_of_130560_allowed_ips_on_one_peer() {
    common::require_root("wg_setconf_of_130560_allowed_ips_on_one_peer");
    let link = Link::new(Underlay::V4);
    let mut engines = vec![Impl::Kilotun];
    if common::which("wireguard-go") {
        engines.push(Impl::WireguardGo);
    }
    let peer = common::pipe_to(&["wg", "pubkey"], common::run(&["wg", "genkey"]).as_bytes());
    for engine in engines {
        let device = WgDevice::start(&link.left, engine);
        let key = std::fs::read_to_string(&device.key_file).unwrap();
        for count in [8_000, 32_000, 130_560] {
            let path = format!("/tmp/{}-{count}.conf", device.name);
            std::fs::write(&path, big_config(&key, peer.trim(), count)).unwrap();
            let started = std::time::Instant::now();
            device.wg(&["setconf", &device.name, &path]);
            let took = started.elapsed();
            std::fs::remove_file(&path).unwrap();
            println!("{engine:?}: wg setconf of {count} allowed IPs on one peer: {took:?}");
            let shown = device.wg(&["show", &device.name, "allowed-ips"]);
            assert_eq!(
                shown.split_whitespace().count(),
                count as usize + 1,
                "{engine:?}: every prefix is there"
            );
            // A loose bound: the time is the figure printed above.
            assert!(took < Duration::from_secs(10), "{engine:?}: {took:?}");
        }
    }
}
