//! The converge step's order and failures, as the effects it hands out show them.

use super::*;

/// The position of the first effect called `name` in `log`.
fn at(log: &PassLog, name: &str) -> usize {
    log.host
        .iter()
        .position(|n| *n == name)
        .unwrap_or_else(|| panic!("no {name} in {:?}", log.host))
}

#[test]
fn the_first_convergence_routes_before_it_configures_the_device_and_writes_the_firewall_last() {
    let mut bench = Bench::new(&[]);
    let pass = bench.pass(Trigger::Event);
    assert!(!pass.failed, "{pass:?}");
    // A full pass reads the endpoints first, then plans; the device's first configuration
    // waits for the routes (no role is known to keep).
    assert_eq!(
        pass.host[..2],
        ["endpoints", "converging"],
        "{:?}",
        pass.host
    );
    assert!(at(&pass, "link") < at(&pass, "plan-resolved"));
    assert!(at(&pass, "plan-resolved") < at(&pass, "observe-routes"));
    assert!(at(&pass, "change-routes") < at(&pass, "device"));
    assert!(at(&pass, "device") < at(&pass, "firewall"));
    assert_eq!(pass.host.last(), Some(&"converged"));
    assert!(bench.core.routes_known(), "the routes changed as planned");
    assert!(!bench.core.owned_routes().routes.is_empty());
}

#[test]
fn a_peer_range_added_later_configures_the_device_before_the_routes() {
    let mut bench = Bench::settled(&[]);
    bench.annotate("c", annotation::ALLOWED_LOCATION_IPS, "10.77.0.0/24");
    let pass = bench.pass(Trigger::Event);
    assert!(!pass.failed, "{pass:?}");
    // The node keeps its role and no endpoint's route moves: the engine goes first.
    assert_eq!(pass.host[..2], ["converging", "device"], "{:?}", pass.host);
    assert!(at(&pass, "device") < at(&pass, "change-routes"));
    // The kernel's routes are known from the last pass: they are changed, not listed.
    assert!(!pass.host.contains(&"observe-routes"), "{:?}", pass.host);
    // The link was set last time and is as planned: nothing of it is set again.
    assert!(!pass.host.contains(&"link"), "{:?}", pass.host);
    let routes = bench.core.owned_routes();
    assert!(
        routes
            .routes
            .iter()
            .any(|r| r.dst.to_string() == "10.77.0.0/24"),
        "{routes:?}"
    );
}

#[test]
fn a_link_that_cannot_be_set_still_gets_the_device_configured_and_fails_the_pass() {
    let mut bench = Bench::new(&[]);
    bench.link_ok = false;
    let pass = bench.pass(Trigger::Event);
    assert!(pass.failed, "{pass:?}");
    // The links and routes stop at the failure; the device is configured all the same, and
    // the firewall waits for a pass that converges.
    assert_eq!(
        pass.host,
        ["endpoints", "converging", "link", "device"],
        "{pass:?}"
    );
    assert!(!bench.core.routes_known());
    bench.link_ok = true;
    bench.advance(Duration::from_secs(1));
    let retried = bench.pass(Trigger::Retry);
    assert!(!retried.failed, "{retried:?}");
    assert!(retried.host.contains(&"link") && retried.host.contains(&"observe-routes"));
    assert_eq!(retried.host.last(), Some(&"converged"));
}

#[test]
fn a_link_missing_from_the_listing_is_set_once_a_pass_and_again_the_next() {
    let mut bench = Bench::new(&[]);
    bench.listing.links.retain(|l| l.index != 3);
    let pass = bench.pass(Trigger::Event);
    // Its address and state are set once each (its MTU is unknown, so left alone), and the
    // state, not recorded for a link kg did not see, is set again on the next full pass.
    let links = |log: &PassLog| log.host.iter().filter(|n| **n == "link").count();
    assert_eq!(links(&pass), 2, "{:?}", pass.host);
    assert_eq!(pass.host.last(), Some(&"converged"), "{pass:?}");
    let resync = bench.pass(Trigger::Resync);
    assert!(links(&resync) >= 1, "{:?}", resync.host);
}
