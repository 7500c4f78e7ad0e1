//! The lease step with several leaders per location: each share's leader keeps its own lease.

use super::*;
use crate::fixtures::location_nodes;
use crate::leader::shares::share_lease_name;
use crate::leader::LEASE_RENEW_MS;

const T0: i64 = 1_700_000_000_000;

/// A cluster of east (e1..e4) and west (w1), every node running its own lease book.
struct Cluster {
    nodes: Vec<Node>,
    books: BTreeMap<String, LeaseBook>,
    leases: BTreeMap<String, LeaseState>,
}

impl Cluster {
    fn new() -> Self {
        Self::with_east(4)
    }

    /// East of `count` nodes (e1..) and west (w1).
    fn with_east(count: u8) -> Self {
        let mut nodes = location_nodes("e", "east", 10, count);
        nodes.extend(location_nodes("w", "west", 20, 1));
        for n in &mut nodes {
            n.lease_election = true;
        }
        let books = nodes
            .iter()
            .map(|n| (n.name.clone(), LeaseBook::default()))
            .collect();
        Cluster {
            nodes,
            books,
            leases: BTreeMap::new(),
        }
    }

    /// One lease step of every node in `alive` at `now` with `shares` leaders per location:
    /// the writes the backend took, with what they say.
    fn step(&mut self, alive: &[&str], shares: usize, now: i64) -> Vec<LeaseWrite> {
        let quiet = TunnelReadings {
            traffic: TunnelTraffic::NotLeading,
            standby_reached: Vec::new(),
        };
        let mut taken = Vec::new();
        for name in alive {
            let book = self.books.get_mut(*name).unwrap();
            book.ingest(&self.leases, now);
            book.elect(&self.nodes, shares, now);
            let Some(w) = book.tend(name, &self.nodes, &quiet, now) else {
                continue;
            };
            let current = self.leases.get(&w.name).cloned().unwrap_or_default();
            if w.next.may_replace(&current, &w.expected) {
                self.leases.insert(w.name.clone(), w.next.clone());
                taken.push(w);
            }
        }
        taken
    }

    fn holder(&self, share: usize) -> Option<&str> {
        self.leases
            .get(&share_lease_name("east", share))?
            .holder
            .as_deref()
    }

    /// East's leaders as `name`'s book has them.
    fn leaders_seen_by(&self, name: &str) -> Vec<String> {
        self.books[name].leader_names()["east"]
            .iter()
            .map(|l| l.name.clone())
            .collect()
    }

    /// Each east node's share as `name`'s book splits the location, by share label.
    fn shares_seen_by(&self, name: &str, count: usize) -> BTreeMap<String, String> {
        let book = &self.books[name];
        let group: Vec<&Node> = self.nodes.iter().filter(|n| n.location == "east").collect();
        let split = crate::topology::shares::split(
            &group,
            count,
            &book.leader_names()["east"],
            &book.kept_out(),
        );
        group
            .iter()
            .enumerate()
            .map(|(i, n)| (n.name.clone(), split.labels[split.share_of[i]].clone()))
            .collect()
    }
}

const ALL: [&str; 5] = ["e1", "e2", "e3", "e4", "w1"];

#[test]
fn each_shares_leader_takes_and_renews_its_own_lease() {
    let mut c = Cluster::new();
    let taken = c.step(&ALL, 2, T0);
    let names: Vec<&str> = taken.iter().map(|w| w.name.as_str()).collect();
    assert!(names.contains(&"kilotun-leader-east"));
    assert!(names.contains(&"kilotun-leader-east.share2"));
    assert_eq!((c.holder(0), c.holder(1)), (Some("e1"), Some("e2")));
    let share2 = taken.iter().find(|w| w.name.ends_with("share2")).unwrap();
    assert_eq!(share2.reason(), Some(Reason::LeaderElected));
    let renewals = c.step(&ALL, 2, T0 + 2_000);
    assert!(renewals.iter().all(|w| w.why.is_none()), "{renewals:?}");
    assert_eq!(c.leaders_seen_by("w1"), ["e1", "e2"]);
}

#[test]
fn a_dead_second_leader_is_replaced_within_the_lease_and_the_first_is_untouched() {
    let mut c = Cluster::new();
    c.step(&ALL, 2, T0);
    let mut now = T0;
    // e2 dies: the others step on, e1 renewing share 1's lease the whole time.
    let alive = ["e1", "e3", "e4", "w1"];
    let mut replaced_at = None;
    while now < T0 + 20_000 {
        now += 2_000;
        for w in c.step(&alive, 2, now) {
            if w.name == "kilotun-leader-east" {
                assert_eq!(w.next.holder.as_deref(), Some("e1"), "{w:?}");
                assert_eq!(w.why, None, "share 1 never changes hands: {w:?}");
            }
        }
        if replaced_at.is_none() && c.holder(1) == Some("e3") {
            replaced_at = Some(now);
        }
    }
    let replaced_at = replaced_at.expect("share 2 taken over");
    assert!(
        replaced_at - T0 <= LEASE_DURATION_MS + LEASE_RENEW_MS,
        "taken over after {} ms",
        replaced_at - T0
    );
    let lease = &c.leases[&share_lease_name("east", 1)];
    assert!(lease.deposed.contains_key("e2"), "{lease:?}");
    assert_eq!(c.leaders_seen_by("w1"), ["e1", "e3"]);
    // e2 comes back and checks in: it leads nothing while e1 and e3 hold their shares.
    c.nodes[1].last_seen += 60;
    for _ in 0..3 {
        now += 2_000;
        c.step(&ALL, 2, now);
    }
    assert_eq!((c.holder(0), c.holder(1)), (Some("e1"), Some("e3")));
}

#[test]
fn fewer_shares_release_the_leases_that_elect_nobody() {
    let mut c = Cluster::new();
    c.step(&ALL, 3, T0);
    assert_eq!(c.holder(2), Some("e3"));
    let taken = c.step(&ALL, 2, T0 + 2_000);
    let release = taken
        .iter()
        .find(|w| w.name == share_lease_name("east", 2))
        .expect("share 3's lease released");
    assert_eq!(release.next.holder, None);
    assert_eq!(release.reason(), Some(Reason::LeaderReleased));
    // A released lease keeps nobody out: back to three shares, e3 may lead again.
    c.step(&ALL, 3, T0 + 4_000);
    assert_eq!(c.holder(2), Some("e3"));
}

#[test]
fn a_holder_of_a_share_gone_releases_it_before_leading_another() {
    let mut c = Cluster::new();
    c.step(&ALL, 3, T0);
    assert_eq!(
        (c.holder(0), c.holder(1), c.holder(2)),
        (Some("e1"), Some("e2"), Some("e3"))
    );
    // Down to two shares, with e2 cordoned: e3 is elected for the second share while it still
    // holds the third's lease. It lets that go first, then takes the second.
    c.nodes[1].cordoned = true;
    let taken = c.step(&["e3"], 2, T0 + 2_000);
    assert_eq!(taken.len(), 1, "{taken:?}");
    assert_eq!(taken[0].name, share_lease_name("east", 2));
    assert_eq!(taken[0].next.holder, None);
    c.step(&["e2"], 2, T0 + 2_000);
    c.step(&["e3"], 2, T0 + 4_000);
    assert_eq!((c.holder(1), c.holder(2)), (Some("e3"), None));
}

#[test]
fn a_share_leader_with_no_other_candidate_never_marks_itself_cut_off() {
    let mut nodes = location_nodes("e", "east", 10, 2);
    nodes.extend(location_nodes("w", "west", 20, 1));
    for n in &mut nodes {
        n.lease_election = true;
    }
    let west = Key::padded("kw1");
    let silent = |tx: u64| TunnelReadings {
        traffic: TunnelTraffic::Read {
            watched: vec![west],
            peers: BTreeMap::from([(west, (100, tx))]),
        },
        standby_reached: Vec::new(),
    };
    let mut leases = BTreeMap::new();
    let mut books = [LeaseBook::default(), LeaseBook::default()];
    for step in 0..12_i64 {
        let now = T0 + step * 2_000;
        for (book, name) in books.iter_mut().zip(["e1", "e2"]) {
            book.ingest(&leases, now);
            book.elect(&nodes, 2, now);
            let tx = 100 + 50 * step as u64;
            if let Some(w) = book.tend(name, &nodes, &silent(tx), now) {
                assert!(!w.next.cut_off, "{name} has nobody to ask: {w:?}");
                leases.insert(w.name.clone(), w.next.clone());
            }
        }
    }
    let second = &leases[&share_lease_name("east", 1)];
    assert_eq!(second.holder.as_deref(), Some("e2"));
}

#[test]
fn a_leaders_death_moves_no_follower_of_any_share() {
    let mut c = Cluster::with_east(9);
    let everyone: Vec<String> = c.nodes.iter().map(|n| n.name.clone()).collect();
    let all: Vec<&str> = everyone.iter().map(String::as_str).collect();
    let mut now = T0;
    for _ in 0..3 {
        c.step(&all, 3, now);
        now += LEASE_RENEW_MS;
    }
    let before = c.shares_seen_by("w1", 3);
    let dead = c.holder(1).unwrap().to_string();
    let alive: Vec<&str> = all.iter().copied().filter(|n| *n != dead).collect();
    for _ in 0..8 {
        c.step(&alive, 3, now);
        // At every step (the lease valid, expired, taken over, renewed) every node, the dead
        // one included, is in the share it was in.
        assert_eq!(c.shares_seen_by("w1", 3), before, "at +{} ms", now - T0);
        now += LEASE_RENEW_MS;
    }
    let successor = c.holder(1).unwrap();
    assert_ne!(successor, dead);
    assert_eq!(
        before[successor], before[&dead],
        "{successor} was in the dead leader's share"
    );
    assert!(c.leases[&share_lease_name("east", 1)]
        .deposed
        .contains_key(&dead));
}

/// Whether the cordoned holder hands its lease over first or its successor takes it first, and
/// whether or not it had once handed the location's lease over in the start-up race.
#[test]
fn a_cordoned_leader_hands_its_share_to_its_own_follower_and_stays_in_it() {
    for (successor_first, raced) in [(false, false), (true, false), (false, true)] {
        let mut c = Cluster::with_east(6);
        let everyone: Vec<String> = c.nodes.iter().map(|n| n.name.clone()).collect();
        let mut all: Vec<&str> = everyone.iter().map(String::as_str).collect();
        let mut now = T0;
        for _ in 0..3 {
            c.step(&all, 2, now);
            now += LEASE_RENEW_MS;
        }
        let cordoned = c.holder(1).unwrap().to_string();
        if raced {
            // The first share's holder took its lease from the second's in the start-up race;
            // its next renewal forgets it, since that node leads the second share.
            let first = share_lease_name("east", 0);
            c.leases.get_mut(&first).unwrap().handed_over_by = Some(cordoned.clone());
            c.step(&all, 2, now);
            now += LEASE_RENEW_MS;
            assert_eq!(c.leases[&first].handed_over_by, None);
        }
        let before = c.shares_seen_by("w1", 2);
        let node = c.nodes.iter_mut().find(|n| n.name == cordoned).unwrap();
        node.cordoned = true;
        // The cordoned holder steps first, or last.
        all.retain(|n| *n != cordoned);
        if successor_first {
            all.push(&cordoned);
        } else {
            all.insert(0, &cordoned);
        }
        for _ in 0..4 {
            c.step(&all, 2, now);
            let seen = c.shares_seen_by("w1", 2);
            let at = now - T0;
            assert_eq!(
                seen, before,
                "successor first: {successor_first}, at +{at} ms"
            );
            now += LEASE_RENEW_MS;
        }
        let successor = c.holder(1).unwrap();
        assert_ne!(successor, cordoned);
        assert_eq!(before[successor], before[&cordoned]);
        let lease = &c.leases[&share_lease_name("east", 1)];
        assert_eq!(lease.handed_over_by.as_deref(), Some(cordoned.as_str()));
    }
}
