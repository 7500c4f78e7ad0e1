//! Flow ordering across worker threads: `kilotun` runs one worker per TUN queue, and several
//! flows through one peer are spread over them, yet no flow may be reordered (TCP would take a
//! reordered segment for a loss). Four UDP flows at once through a two-worker tunnel, each
//! numbered, must each arrive in the order sent. Root only (skipped otherwise).

use crate::common;

use std::net::{SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use common::{peered, ping_ok, Impl};

/// Concurrent flows (distinct source and destination ports).
const FLOWS: u16 = 4;
/// Datagrams per flow.
const DATAGRAMS: u32 = 5_000;
/// Bytes per datagram (with its sequence number in the first four).
const SIZE: usize = 1_000;

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn concurrent_flows_through_a_multi_worker_tunnel_each_arrive_in_order() {
    common::require_root("concurrent_flows_through_a_multi_worker_tunnel_each_arrive_in_order");
    let (link, a, _b) = peered(Impl::Kilotun, Impl::Kilotun, 71);
    assert!(ping_ok(&a.ns, "10.71.0.2", Duration::from_secs(10)));

    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let receivers: Vec<_> = (0..FLOWS)
        .map(|flow| {
            let ready = ready_tx.clone();
            link.right.in_ns(move || {
                let socket = UdpSocket::bind(("10.71.0.2", 6000 + flow)).unwrap();
                socket
                    .set_read_timeout(Some(Duration::from_secs(2)))
                    .unwrap();
                ready.send(()).unwrap();
                let mut buf = [0u8; 2048];
                let mut seen = Vec::with_capacity(DATAGRAMS as usize);
                while let Ok(n) = socket.recv(&mut buf) {
                    assert_eq!(n, SIZE);
                    seen.push(u32::from_be_bytes(buf[..4].try_into().unwrap()));
                    if seen.last() == Some(&(DATAGRAMS - 1)) {
                        break;
                    }
                }
                seen
            })
        })
        .collect();
    for _ in 0..FLOWS {
        ready_rx.recv_timeout(Duration::from_secs(5)).unwrap();
    }
    let senders: Vec<_> = (0..FLOWS)
        .map(|flow| {
            link.left.in_ns(move || {
                let socket = UdpSocket::bind(("10.71.0.1", 7000 + flow)).unwrap();
                let to = SocketAddr::from(([10, 71, 0, 2], 6000 + flow));
                let mut payload = [0u8; SIZE];
                let started = Instant::now();
                for seq in 0..DATAGRAMS {
                    payload[..4].copy_from_slice(&seq.to_be_bytes());
                    // A full send queue is a loss, not a failure: the check is about order.
                    let _ = socket.send_to(&payload, to);
                    // About 250 Mbit/s per flow: fast enough to keep both workers busy, slow
                    // enough that the receiving sockets keep up.
                    if seq % 16 == 15 {
                        std::thread::sleep(Duration::from_micros(500));
                    }
                }
                started.elapsed()
            })
        })
        .collect();
    for sender in senders {
        sender.join().unwrap();
    }
    for (flow, receiver) in receivers.into_iter().enumerate() {
        let seen = receiver.join().unwrap();
        let out_of_order = seen.windows(2).filter(|w| w[1] <= w[0]).count();
        eprintln!(
            "flow {flow}: {} of {DATAGRAMS} datagrams arrived, {out_of_order} out of order",
            seen.len()
        );
        assert_eq!(out_of_order, 0, "flow {flow} was reordered");
        // Enough datagrams for the order to mean something: on a machine busy with other
        // tests the engines fall behind the senders, and the TUN queues drop the excess.
        assert!(
            seen.len() as u32 >= DATAGRAMS / 10,
            "flow {flow}: only {} of {DATAGRAMS} arrived",
            seen.len()
        );
    }
}
