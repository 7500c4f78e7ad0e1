use std::time::Duration;

use super::*;

fn key(byte: u8) -> PublicKey {
    SecretKey::from_bytes([byte; 32]).public_key()
}

fn set(current: &DeviceConfig, lines: &[String]) -> Result<DeviceConfig, UapiError> {
    apply_set(current, &(lines.join("\n") + "\n"))
}

#[test]
fn wg_setconf_request_builds_the_whole_config() {
    let private = SecretKey::from_bytes([7; 32]);
    let lines = vec![
        format!("private_key={}", private.expose_hex().as_str()),
        "listen_port=51820".into(),
        "fwmark=0x0".replace("0x0", "7"),
        "replace_peers=true".into(),
        format!("public_key={}", key(1).to_hex()),
        "endpoint=192.0.2.1:51820".into(),
        "persistent_keepalive_interval=25".into(),
        "replace_allowed_ips=true".into(),
        "allowed_ip=10.4.0.1/32".into(),
        "allowed_ip=10.2.3.4/24".into(),
        format!("public_key={}", key(2).to_hex()),
        format!("preshared_key={}", "ab".repeat(32)),
        "endpoint=[2001:db8::1]:4000".into(),
        "protocol_version=1".into(),
        "allowed_ip=fd00::/64".into(),
    ];
    let next = set(&DeviceConfig::default(), &lines).unwrap();
    assert_eq!(next.interface.listen_port, 51820);
    assert_eq!(next.interface.fwmark, 7);
    assert_eq!(next.interface.private_key, Some(private));
    assert_eq!(next.peers.len(), 2);
    let a = &next.peers[0];
    assert_eq!(a.public_key, key(1));
    assert_eq!(a.endpoint, Some("192.0.2.1:51820".parse().unwrap()));
    assert_eq!(a.persistent_keepalive, 25);
    assert_eq!(
        a.allowed_ips,
        vec![
            "10.4.0.1/32".parse().unwrap(),
            "10.2.3.0/24".parse().unwrap()
        ]
    );
    let b = &next.peers[1];
    assert_eq!(
        b.preshared_key.as_ref().unwrap().expose_hex().as_str(),
        "ab".repeat(32)
    );
    assert_eq!(b.endpoint, Some("[2001:db8::1]:4000".parse().unwrap()));
}

#[test]
fn invalid_request_changes_nothing_and_names_the_line() {
    let base = set(
        &DeviceConfig::default(),
        &[
            format!("public_key={}", key(1).to_hex()),
            "allowed_ip=10.0.0.1/32".into(),
        ],
    )
    .unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["listen_port=70000".into()], "line 2: listen_port"),
        (vec!["bogus".into()], "line 2: expected key=value"),
        (vec!["private_key=zz".into()], "line 2: private_key"),
        (vec!["what=1".into()], "unknown interface key"),
        (
            vec![
                format!("public_key={}", key(3).to_hex()),
                "allowed_ip=10.0.0.300/32".into(),
            ],
            "line 3: allowed_ip",
        ),
        (
            vec![
                format!("public_key={}", key(3).to_hex()),
                "endpoint=nohost".into(),
            ],
            "line 3: endpoint",
        ),
        (
            vec![
                format!("public_key={}", key(3).to_hex()),
                "protocol_version=2".into(),
            ],
            "protocol_version",
        ),
        (
            vec![
                format!("public_key={}", key(3).to_hex()),
                "persistent_keepalive_interval=-1".into(),
            ],
            "persistent_keepalive",
        ),
        (
            vec![
                format!("public_key={}", key(3).to_hex()),
                "listen_port=1".into(),
            ],
            "unknown peer key",
        ),
        (vec!["replace_peers=false".into()], "only \"true\""),
        (
            vec![format!("public_key={}", "00".repeat(31))],
            "public_key",
        ),
    ];
    for (lines, expected) in cases {
        let err = set(&base, &lines).unwrap_err();
        assert_eq!(err.errno, EINVAL, "{lines:?}");
        assert!(err.message.contains(expected), "{lines:?}: {}", err.message);
    }
}

#[test]
fn peer_operations_remove_update_only_and_allowed_ip_removal() {
    let base = set(
        &DeviceConfig::default(),
        &[
            format!("public_key={}", key(1).to_hex()),
            "allowed_ip=10.0.0.1/32".into(),
            "allowed_ip=10.0.1.0/24".into(),
            format!("public_key={}", key(2).to_hex()),
        ],
    )
    .unwrap();
    let next = set(
        &base,
        &[
            format!("public_key={}", key(1).to_hex()),
            "allowed_ip=-10.0.1.0/24".into(),
            format!("public_key={}", key(2).to_hex()),
            "remove=true".into(),
            format!("public_key={}", key(3).to_hex()),
            "update_only=true".into(),
            "allowed_ip=10.9.9.9/32".into(),
        ],
    )
    .unwrap();
    assert_eq!(next.peers.len(), 1);
    assert_eq!(
        next.peers[0].allowed_ips,
        vec!["10.0.0.1/32".parse().unwrap()]
    );
}

#[test]
fn own_public_key_as_peer_is_ignored() {
    let private = SecretKey::from_bytes([9; 32]);
    let next = set(
        &DeviceConfig::default(),
        &[
            format!("private_key={}", private.expose_hex().as_str()),
            format!("public_key={}", private.public_key().to_hex()),
            "allowed_ip=10.0.0.1/32".into(),
        ],
    )
    .unwrap();
    assert!(next.peers.is_empty());
}

#[test]
fn zero_keys_mean_none() {
    let next = set(
        &DeviceConfig::default(),
        &[
            format!("private_key={}", "00".repeat(32)),
            format!("public_key={}", key(1).to_hex()),
            format!("preshared_key={}", "00".repeat(32)),
        ],
    )
    .unwrap();
    assert_eq!(next.interface.private_key, None);
    assert_eq!(next.peers[0].preshared_key, None);
}

#[test]
fn get_answer_has_every_field_in_wireguard_go_order_and_round_trips() {
    let private = SecretKey::from_bytes([5; 32]);
    let mut config = DeviceConfig::default();
    config.interface.private_key = Some(private.clone());
    config.interface.fwmark = 3;
    let mut peer = PeerConfig::new(key(1));
    peer.persistent_keepalive = 5;
    peer.add_allowed_ip("10.0.0.1/32".parse().unwrap());
    config.peers.push(peer);
    let handshake = UNIX_EPOCH + Duration::new(1_700_000_000, 123_456_789);
    let stats = vec![PeerStats {
        public_key: key(1),
        endpoint: Some("198.51.100.7:9".parse().unwrap()),
        last_handshake: Some(handshake),
        unanswered_since: None,
        rx_bytes: 10,
        tx_bytes: 20,
        handshakes: 1,
        handshake_failures: 0,
        endpoint_changes: 0,
        refused_responses: 0,
        unused_answers: 0,
    }];
    let text = format_get(&config, 51820, &stats);
    let expected = format!(
        "private_key={}\nlisten_port=51820\nfwmark=3\npublic_key={}\npreshared_key={}\n\
         protocol_version=1\nendpoint=198.51.100.7:9\nlast_handshake_time_sec=1700000000\n\
         last_handshake_time_nsec=123456789\ntx_bytes=20\nrx_bytes=10\n\
         persistent_keepalive_interval=5\nallowed_ip=10.0.0.1/32\n",
        private.expose_hex().as_str(),
        key(1).to_hex(),
        "0".repeat(64)
    );
    assert_eq!(text, expected);
    let (parsed, parsed_stats) = parse_get(&(text + "errno=0\n")).unwrap();
    assert_eq!(parsed.peers[0].allowed_ips, config.peers[0].allowed_ips);
    assert_eq!(parsed_stats[0].last_handshake, Some(handshake));
    assert_eq!(parsed_stats[0].tx_bytes, 20);
}

#[test]
fn replace_peers_then_same_peer_gives_a_fresh_peer_config() {
    let base = set(
        &DeviceConfig::default(),
        &[
            format!("public_key={}", key(1).to_hex()),
            "persistent_keepalive_interval=9".into(),
            "allowed_ip=10.0.0.1/32".into(),
        ],
    )
    .unwrap();
    let next = set(
        &base,
        &[
            "replace_peers=true".into(),
            format!("public_key={}", key(1).to_hex()),
        ],
    )
    .unwrap();
    assert_eq!(next.peers, vec![PeerConfig::new(key(1))]);
}

/// `count` distinct /32s from 10.0.0.0 up.
fn host_prefixes(count: u32) -> Vec<IpNet> {
    (0..count)
        .map(|i| {
            IpNet::from(std::net::IpAddr::V4(std::net::Ipv4Addr::from(
                0x0a00_0000 + i,
            )))
        })
        .collect()
}

#[test]
fn a_request_of_130560_allowed_ips_is_linear_and_its_edits_too() {
    let prefixes = host_prefixes(130_560);
    let mut lines = vec![
        "replace_peers=true".to_string(),
        format!("public_key={}", key(1).to_hex()),
        "replace_allowed_ips=true".into(),
    ];
    lines.extend(prefixes.iter().map(|p| format!("allowed_ip={p}")));
    let started = std::time::Instant::now();
    let next = set(&DeviceConfig::default(), &lines).unwrap();
    let took = started.elapsed();
    println!("apply_set of 130,560 allowed IPs on one peer: {took:?}");
    assert_eq!(next.peers[0].allowed_ips, prefixes);

    // Every other prefix removed, the first one removed and added again (it goes last), a
    // repeat ignored: each line in constant time.
    let mut edit = vec![format!("public_key={}", key(1).to_hex())];
    edit.extend(
        prefixes
            .iter()
            .step_by(2)
            .map(|p| format!("allowed_ip=-{p}")),
    );
    edit.push(format!("allowed_ip={}", prefixes[0]));
    edit.push(format!("allowed_ip={}", prefixes[1]));
    let started = std::time::Instant::now();
    let edited = set(&next, &edit).unwrap();
    println!("65,280 removals from it: {:?}", started.elapsed());
    let mut expected: Vec<IpNet> = prefixes.iter().skip(1).step_by(2).copied().collect();
    expected.push(prefixes[0]);
    assert_eq!(edited.peers[0].allowed_ips, expected);
    // A loose bound: quadratic, this took minutes.
    assert!(took < Duration::from_secs(10), "{took:?}");

    // The answer to get=1 and its reading back are linear too.
    let started = std::time::Instant::now();
    let answer = format_get(&next, 51820, &[]);
    let (read, _) = parse_get(&answer).unwrap();
    println!(
        "get=1 of it, rendered and read back: {:?}",
        started.elapsed()
    );
    assert_eq!(read.peers[0].allowed_ips, prefixes);
}

#[test]
fn a_peer_removed_and_added_again_in_one_request_goes_last() {
    let mut current = DeviceConfig::default();
    for byte in 1..=3 {
        let mut peer = PeerConfig::new(key(byte));
        peer.allowed_ips = host_prefixes(u32::from(byte));
        current.peers.push(peer);
    }
    let lines = vec![
        format!("public_key={}", key(1).to_hex()),
        "remove=true".into(),
        "allowed_ip=10.9.9.9/32".into(),
        format!("public_key={}", key(1).to_hex()),
        "allowed_ip=10.8.8.8/32".into(),
        format!("public_key={}", key(2).to_hex()),
        "allowed_ip=-10.0.0.0/32".into(),
    ];
    let next = set(&current, &lines).unwrap();
    let order: Vec<PublicKey> = next.peers.iter().map(|p| p.public_key).collect();
    assert_eq!(order, [key(2), key(3), key(1)]);
    assert_eq!(next.peers[2].allowed_ips, ["10.8.8.8/32".parse().unwrap()]);
    assert_eq!(next.peers[0].allowed_ips, host_prefixes(2)[1..]);
    assert_eq!(
        next.peers[1], current.peers[2],
        "an untouched peer is kept whole"
    );
}
