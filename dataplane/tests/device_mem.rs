//! Two full devices (worker threads, timer thread, UAPI handling) joined by the in-memory
//! twins: no root, no kernel TUN, no sockets.

use std::net::IpAddr;
use std::time::Duration;

use dataplane::device::{link, Device, LinkLost};
use dataplane::io::mem::{MemBinder, MemNet, MemTun};
use dataplane::testing::ip_packet;
use dataplane::SecretKey;

fn uapi_config(
    own: &SecretKey,
    port: u16,
    peer: &SecretKey,
    peer_port: u16,
    peer_ip: &str,
) -> String {
    format!(
        "private_key={}\nlisten_port={port}\npublic_key={}\nendpoint=192.0.2.{}:{peer_port}\n\
         allowed_ip={peer_ip}/32\n",
        own.expose_hex().as_str(),
        peer.public_key().to_hex(),
        if peer_ip.ends_with(".2") { 2 } else { 1 },
    )
}

#[test]
fn two_devices_over_the_in_memory_twins_exchange_packets_both_ways() {
    let net = MemNet::new();
    let (tun_a, tun_b) = (MemTun::new(), MemTun::new());
    let a = Device::start(
        vec![tun_a.clone()],
        MemBinder::new(&net, [192, 0, 2, 1].into()),
    )
    .unwrap();
    let b = Device::start(
        vec![tun_b.clone()],
        MemBinder::new(&net, [192, 0, 2, 2].into()),
    )
    .unwrap();
    let (ka, kb) = (SecretKey::generate(), SecretKey::generate());
    a.uapi_set(&uapi_config(&ka, 51820, &kb, 51821, "10.0.0.2"))
        .unwrap();
    b.uapi_set(&uapi_config(&kb, 51821, &ka, 51820, "10.0.0.1"))
        .unwrap();
    assert_eq!(a.listen_port(), 51820);

    let (ip_a, ip_b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
    let ping = ip_packet(ip_a, ip_b, b"ping");
    tun_a.inject(ping.clone());
    assert_eq!(tun_b.written(Duration::from_secs(5)), Some(ping));
    let pong = ip_packet(ip_b, ip_a, b"pong");
    tun_b.inject(pong.clone());
    assert_eq!(tun_a.written(Duration::from_secs(5)), Some(pong));

    let get = a.uapi_get();
    assert!(get.contains("listen_port=51820\n"), "{get}");
    assert!(get.contains("endpoint=192.0.2.2:51821\n"), "{get}");
    assert!(!get.contains("last_handshake_time_sec=0\n"), "{get}");

    // A port something else holds is refused with EADDRINUSE, and nothing changes.
    let _squatter = net.bind("192.0.2.1:51999".parse().unwrap());
    let err = a.uapi_set("listen_port=51999\n").unwrap_err();
    assert_eq!(err.errno, dataplane::uapi::EADDRINUSE);
    assert_eq!(a.listen_port(), 51820);
    // Moving to a free port works, and b follows a's new source port.
    a.uapi_set("listen_port=52000\n").unwrap();
    let again = ip_packet(ip_a, ip_b, b"moved");
    tun_a.inject(again.clone());
    assert_eq!(tun_b.written(Duration::from_secs(5)), Some(again));
    let b_view = b.uapi_get();
    assert!(b_view.contains("endpoint=192.0.2.1:52000\n"), "{b_view}");
    a.shutdown();
    b.shutdown();
}

/// What a kg that hands its node to the next one relies on: `stop` frees the listen port at
/// once, even while something else (a UAPI client, an HTTP handler) still holds the device.
#[test]
fn a_stopped_device_frees_its_port_while_others_still_hold_it() {
    use std::sync::Arc;
    let device =
        Arc::new(Device::start(vec![MemTun::new()], dataplane::device::LinuxUdpBinder).unwrap());
    let key = SecretKey::generate();
    device
        .uapi_set(&format!(
            "private_key={}\nlisten_port=0\n",
            key.expose_hex().as_str()
        ))
        .unwrap();
    let port = device.listen_port();
    assert!(
        std::net::UdpSocket::bind(("0.0.0.0", port)).is_err(),
        "the device holds {port}"
    );
    let other_holder = Arc::clone(&device);
    device.stop();
    let rebound = std::net::UdpSocket::bind(("0.0.0.0", port));
    assert!(
        rebound.is_ok(),
        "port {port} still held after stop: {rebound:?}"
    );
    // Reads still answer; a change is refused rather than binding the port again.
    assert!(other_holder
        .uapi_get()
        .contains(&format!("listen_port={port}\n")));
    assert!(other_holder.uapi_set("listen_port=0\n").is_err());
    device.stop(); // twice is harmless
    drop(device);
    drop(other_holder);
}

/// Two queues over one in-memory link, as a multi-queue TUN device has.
fn two_queue_device(tun: &MemTun) -> Device<MemBinder> {
    let net = MemNet::new();
    Device::start(
        vec![tun.clone(), tun.clone()],
        MemBinder::new(&net, [192, 0, 2, 1].into()),
    )
    .unwrap()
}

#[test]
fn a_deleted_link_is_reported_at_once_and_the_device_stops_cleanly() {
    let tun = MemTun::new();
    let device = two_queue_device(&tun);
    assert_eq!(device.wait_link_lost(Some(Duration::from_millis(50))), None);
    let deleted = std::time::Instant::now();
    tun.delete();
    let lost = device.wait_link_lost(Some(Duration::from_secs(5)));
    let took = deleted.elapsed();
    println!("link loss seen {took:?} after the deletion");
    assert_eq!(lost, Some(LinkLost::Deleted));
    assert!(took < Duration::from_secs(1), "{took:?}");
    // Still reported (and the descriptor still readable) on every later look.
    assert_eq!(device.wait_link_lost(None), Some(LinkLost::Deleted));
    device.shutdown();
}

#[test]
fn a_queue_that_keeps_failing_is_retried_then_given_up_and_one_that_mends_is_kept() {
    let tun = MemTun::new();
    let device = two_queue_device(&tun);
    tun.fail_reads(Some(libc::EIO));
    std::thread::sleep(link::RETRY_PAUSE * 3);
    tun.fail_reads(None);
    assert_eq!(
        device.wait_link_lost(Some(link::RETRY_PAUSE * (link::MAX_FAILURES + 5))),
        None,
        "a few failed reads are retried"
    );
    tun.fail_reads(Some(libc::EIO));
    let started = std::time::Instant::now();
    let lost = device.wait_link_lost(Some(link::RETRY_PAUSE * (link::MAX_FAILURES + 20)));
    println!("given up after {:?}: {lost:?}", started.elapsed());
    match lost {
        Some(LinkLost::Failed {
            failures, error, ..
        }) => {
            assert_eq!(failures, link::MAX_FAILURES);
            assert!(error.contains("Input/output error"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    device.shutdown();
}
