//! Passes that fail, and how the reconciler tries again: shells that fail, a firewall write
//! refused, a patch refused, an engine lost under kg.

use super::*;

#[test]
fn a_lost_engine_is_started_again_before_the_host_is_listed_and_converged_whole() {
    use control::journal::Reason;
    let mut bench = Bench::settled(&[]);
    bench.core.take_events(0);
    let why = "the embedded engine's TUN link kilo0: the TUN link was deleted";
    // Starting it fails: the pass ends there, naming both, and the next one asks again.
    bench.recreate_ok = false;
    bench.core.engine_lost(why.to_string());
    let pass = bench.pass(Trigger::Kernel);
    assert_eq!(pass.order, ["recreate"], "{pass:?}");
    assert!(pass.failed);
    bench.recreate_ok = true;
    let pass = bench.pass(Trigger::Event);
    assert_eq!(pass.order[..2], ["recreate", "list"], "{pass:?}");
    let c = pass.converged.expect("converged after the start");
    assert!(c.full, "every part compared with the host as listed");
    assert!(!pass.failed);
    let recreated: Vec<_> = bench
        .core
        .take_events(0)
        .into_iter()
        .filter(|e| e.reason == Reason::EngineRecreated)
        .collect();
    assert_eq!(recreated.len(), 1);
    assert!(
        recreated[0].message.starts_with(why),
        "{}",
        recreated[0].message
    );
    assert_eq!(recreated[0].subject, "kilo0");
    // Once started, the engine is not started again.
    let pass = bench.pass(Trigger::Kernel);
    assert!(!pass.order.contains(&"recreate"), "{pass:?}");
}

#[test]
fn a_convergence_that_failed_is_tried_again_on_the_next_pass() {
    let mut bench = Bench::settled(&[]);
    bench.annotate("c", annotation::LOCATION, "l3");
    bench.converge_ok = false;
    let failed = bench.pass(Trigger::Event);
    assert!(failed.converged.is_some() && failed.patch.is_none());
    assert!(bench.core.topology().is_none(), "not applied: forgotten");
    bench.converge_ok = true;
    let retried = bench.pass(Trigger::Dns);
    let c = retried.converged.expect("retried with nothing new");
    assert!(c.changed && !c.full);
    assert!(bench.pass(Trigger::Event).converged.is_none());
}

/// A failed pass is tried again on the retry timer, a second after it, then two, four, ... up
/// to the resync period; a pass that works clears it.
#[test]
fn a_failed_pass_is_retried_after_a_backoff_that_doubles_up_to_the_resync_period() {
    let mut bench = Bench::settled(&[]);
    let retry = |bench: &Bench| {
        bench
            .core
            .timers_due()
            .into_iter()
            .find(|(_, timer)| *timer == Timer::Retry)
            .map(|(at, _)| at.saturating_duration_since(bench.now.instant))
    };
    assert_eq!(retry(&bench), None, "nothing failed");
    bench.converge_ok = false;
    let mut waits = Vec::new();
    for round in 0..7 {
        bench.annotate("c", annotation::LOCATION, &format!("l{}", 3 + round));
        assert!(bench.pass(Trigger::Event).failed);
        let wait = retry(&bench).expect("a retry is due");
        waits.push(wait.as_secs());
        bench.advance(wait);
        assert_eq!(retry(&bench), Some(Duration::ZERO), "due now");
        let now = bench.now;
        let wake = bench.core.on_timeout(Timer::Retry, now);
        assert_eq!(wake, Wake::Pass(Trigger::Retry));
    }
    assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
    bench.converge_ok = true;
    let retried = bench.pass(Trigger::Retry);
    assert!(!retried.failed && retried.listed_host, "{retried:?}");
    assert_eq!(retry(&bench), None, "cleared once a pass works");
}

#[test]
fn a_firewall_write_that_failed_is_tried_again_with_the_next_change_reading_the_host() {
    let mut bench = Bench::new(&[]);
    bench.firewall_ok = false;
    bench.pass(Trigger::Event);
    bench.firewall_ok = true;
    let quiet = bench.pass(Trigger::Dns);
    assert_eq!(
        quiet.firewall, None,
        "a pass that changes nothing writes nothing"
    );
    bench.annotate("c", annotation::LOCATION, "l3");
    let pass = bench.pass(Trigger::Event);
    assert_eq!(
        pass.firewall,
        Some(FirewallStep::Write { previous: None }),
        "the failed write is not trusted: the host's rules are read"
    );
    let mut d = node("d", "203.0.113.4:51820", None, "l4", "10.2.4.0/24", "d");
    d.last_seen = bench.now.unix_secs();
    bench.rv += 1;
    bench.snapshot.put_node("d", kube_node(&d, bench.rv));
    assert!(
        matches!(
            bench.pass(Trigger::Event).firewall,
            Some(FirewallStep::Write { previous: Some(_) })
        ),
        "then only the difference is written (d's pods)"
    );
}

#[test]
fn a_refused_patch_is_sent_again_and_counts_the_backend_as_unreachable() {
    let mut bench = Bench::new(&[]);
    bench.patch_ok = false;
    let first = bench.pass(Trigger::Event).patch.expect("published");
    bench.patch_ok = true;
    let again = bench.pass(Trigger::Event).patch;
    assert_eq!(again, Some(first), "the same patch, sent again");
}
