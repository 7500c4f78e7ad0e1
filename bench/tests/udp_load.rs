//! `udp-load`, the UDP generator and sink of `bench/throughput.sh`, over loopback: what it says
//! it sent arrives and is counted, at the rate asked for.

use std::net::UdpSocket;
use std::process::{Command, Stdio};
use std::time::Duration;

const UDP_LOAD: &str = env!("CARGO_BIN_EXE_udp-load");

/// DATAGRAMS, BYTES and SYSCALLS from udp-load's line starting with `word`.
fn counts(output: &[u8], word: &str) -> (u64, u64, u64) {
    let text = String::from_utf8_lossy(output);
    let fields: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(fields.first(), Some(&word), "{text}");
    assert_eq!(fields.len(), 4, "{text}");
    (
        fields[1].parse().unwrap(),
        fields[2].parse().unwrap(),
        fields[3].parse().unwrap(),
    )
}

fn free_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A sink on a free loopback port (with `recv_flags`) and 80 Mbit/s of 1000-byte datagrams sent
/// to it for 1 s (with `send_flags`): the sender's and the sink's counts.
fn run_over_loopback(
    send_flags: &[&str],
    recv_flags: &[&str],
) -> ((u64, u64, u64), (u64, u64, u64)) {
    let port = free_port().to_string();
    let sink = Command::new(UDP_LOAD)
        .arg("recv")
        .args(recv_flags)
        .args([port.as_str(), "2"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let sender = Command::new(UDP_LOAD)
        .arg("send")
        .args(send_flags)
        .args([&format!("127.0.0.1:{port}"), "80", "1", "1000"])
        .output()
        .unwrap();
    assert!(sender.status.success(), "{sender:?}");
    let sink = sink.wait_with_output().unwrap();
    (
        counts(&sender.stdout, "sent"),
        counts(&sink.stdout, "received"),
    )
}

#[test]
fn what_is_sent_over_loopback_is_received_at_the_offered_rate() {
    let ((sent, sent_bytes, _), (received, received_bytes, _)) = run_over_loopback(&[], &[]);
    // 80 Mbit/s of 1000-byte datagrams for 1 s is 10,000 datagrams.
    assert!((9_000..=10_000).contains(&sent), "sent {sent}");
    assert_eq!(sent_bytes, sent * 1000);
    assert_eq!((received, received_bytes), (sent, sent_bytes));
}

#[test]
fn a_quic_style_run_is_sent_and_received_whole_and_counted_by_the_datagram() {
    let ((sent, sent_bytes, sends), (received, received_bytes, receives)) =
        run_over_loopback(&["--gso"], &["--gro"]);
    // 10,000 datagrams of 1000 bytes, in runs of 64 (65,000 bytes at most per send).
    assert!((9_000..=10_000).contains(&sent), "sent {sent}");
    assert_eq!(sent_bytes, sent * 1000);
    assert!(
        sends * 60 <= sent,
        "{sent} datagrams in {sends} sends: not sent in runs"
    );
    assert_eq!((received, received_bytes), (sent, sent_bytes));
    // Loopback keeps a run whole to a UDP_GRO socket: far fewer receives than datagrams (the
    // sink's count comes from the segment size the kernel reports).
    assert!(
        receives * 10 <= received,
        "{received} datagrams in {receives} receives: not coalesced"
    );
}

#[test]
fn bad_arguments_are_named() {
    let out = Command::new(UDP_LOAD)
        .args(["send", "127.0.0.1:9", "10", "1", "4"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("DATAGRAM_BYTES must be 8 to 65507, not 4")
    );
    let out = Command::new(UDP_LOAD)
        .args(["send", "nowhere"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("usage: udp-load"));
}
