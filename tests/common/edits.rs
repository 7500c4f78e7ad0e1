//! A change that edits one peer's allowed IPs: the tests of per-entry edits (UAPI and the
//! kernel's WireGuard) make it the same way.

use std::time::Duration;

use super::cluster::Cluster;

/// On a meshed two-node cluster of n1 (east) and n2 (west): each location routes one more range
/// (`kilo.squat.ai/allowed-location-ips`), then another in its place, so the other node's peer
/// gains a range and then loses one. Waits up to `timeout` for each step on both devices and
/// checks the pods' own ranges stayed.
pub fn add_then_move_location_ranges(c: &Cluster, timeout: Duration) {
    const RANGES: &str = "kilo.squat.ai/allowed-location-ips";
    c.annotate("n1", &[(RANGES, Some("10.77.1.0/24"))]);
    c.annotate("n2", &[(RANGES, Some("10.78.1.0/24"))]);
    let added = c.wait_for(timeout, |c| {
        c.node("n2").wg("allowed-ips").contains("10.77.1.0/24")
            && c.node("n1").wg("allowed-ips").contains("10.78.1.0/24")
    });
    assert!(added, "{}", c.logs());
    c.annotate("n1", &[(RANGES, Some("10.77.2.0/24"))]);
    c.annotate("n2", &[(RANGES, Some("10.78.2.0/24"))]);
    let moved = c.wait_for(timeout, |c| {
        let (on1, on2) = (
            c.node("n1").wg("allowed-ips"),
            c.node("n2").wg("allowed-ips"),
        );
        on2.contains("10.77.2.0/24")
            && !on2.contains("10.77.1.0/24")
            && on1.contains("10.78.2.0/24")
            && !on1.contains("10.78.1.0/24")
    });
    assert!(
        moved,
        "n1: {}\nn2: {}\n{}",
        c.node("n1").wg("allowed-ips"),
        c.node("n2").wg("allowed-ips"),
        c.logs()
    );
    // The pods' own ranges stayed on both.
    assert!(c.node("n1").wg("allowed-ips").contains("10.42.2.0/24"));
    assert!(c.node("n2").wg("allowed-ips").contains("10.42.1.0/24"));
}
