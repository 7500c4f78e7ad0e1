//! Two minutes of bidirectional traffic between kilotun and wireguard-go with a 25 s persistent
//! keepalive: the scenario of boringtun issue #495 (sessions going one-way deaf 15-30 s after a
//! handshake in 0.7.1). Pings in both directions must keep being answered: a deaf session
//! loses 150 to 300 of the 1,200, so at most 30 may go to the transfers' congestion. Root only;
//! wireguard-go missing fails the test (see `common::require_engine`).

use crate::common;

use std::time::Duration;

use common::{ping_ok, tcp_transfer, Impl};

fn lost(summary: &str) -> u32 {
    // "1200 packets transmitted, 1200 received, 0% packet loss, ..."
    let mut words = summary.split_whitespace();
    let sent: u32 = words.next().unwrap().parse().unwrap();
    let received: u32 = words.nth(2).unwrap().parse().unwrap();
    sent - received
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn two_minutes_bidirectional_against_wireguard_go_loses_nothing() {
    let test = "two_minutes_bidirectional_against_wireguard_go_loses_nothing";
    common::require_root(test);
    common::require_engine(Impl::WireguardGo, test);
    let (link, a, b) = common::peered(Impl::Kilotun, Impl::WireguardGo, 73);
    a.wg(&[
        "set",
        &a.name,
        "peer",
        &b.public_key,
        "persistent-keepalive",
        "25",
    ]);
    assert!(ping_ok(&a.ns, "10.73.0.2", Duration::from_secs(10)));

    let ping = |ns: String, target: &'static str| {
        std::thread::spawn(move || {
            let out = common::output(&[
                "ip", "netns", "exec", &ns, "ping", "-q", "-i", "0.1", "-c", "1200", "-W", "1",
                target,
            ]);
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            let line = text
                .lines()
                .find(|l| l.contains("packets transmitted"))
                .unwrap_or_default()
                .to_string();
            line
        })
    };
    let forward = ping(a.ns.clone(), "10.73.0.2");
    let backward = ping(b.ns.clone(), "10.73.0.1");
    for _ in 0..4 {
        std::thread::sleep(Duration::from_secs(20));
        tcp_transfer(
            &link.left,
            &link.right,
            "10.73.0.2".parse().unwrap(),
            20 << 20,
        );
        tcp_transfer(
            &link.right,
            &link.left,
            "10.73.0.1".parse().unwrap(),
            20 << 20,
        );
    }
    let (forward, backward) = (forward.join().unwrap(), backward.join().unwrap());
    eprintln!("kilotun -> wireguard-go: {forward}\nwireguard-go -> kilotun: {backward}");
    // A deaf session loses 150 to 300 pings (15-30 s at 10 a second). A few can go missing
    // for a mundane reason: the eight bulk transfers push kilotun's side at several Gbit/s
    // into wireguard-go's side at about 0.6, so its receive queue overflows (that is how TCP
    // finds the rate), and a ping in that queue at that moment goes with it: up to 7 of 1,200
    // on a CI run with other tests beside it. 30 stays far below a deaf session's 150.
    assert!(lost(&forward) <= 30, "{forward}");
    assert!(lost(&backward) <= 30, "{backward}");
}
