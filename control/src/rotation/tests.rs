use super::*;

fn key(n: u8) -> Key {
    Key([n; 32])
}

fn inputs<'a>(requested: Option<&'a str>, rotated: Option<&'a str>) -> RotationInputs<'a> {
    RotationInputs {
        requested,
        rotated,
        published_next: None,
        key_made_ms: 0,
        period_ms: None,
    }
}

#[test]
fn a_request_not_yet_carried_out_makes_a_next_key_and_one_carried_out_does_not() {
    let mut r = Rotation::default();
    assert_eq!(r.step(&inputs(None, None), 1_000), None);
    assert_eq!(r.step(&inputs(Some("a"), Some("a")), 1_000), None);
    assert_eq!(
        r.step(&inputs(Some("b"), Some("a")), 1_000),
        Some(RotationStep::MakeNextKey {
            request: Some("b".into())
        })
    );
}

#[test]
fn the_next_key_is_used_a_grace_after_the_nodes_own_watch_shows_it() {
    let mut r = Rotation::default();
    r.prepared(key(7), Some("b".into()));
    let mut seen = inputs(Some("b"), Some("a"));
    // Not yet published: nothing, however long.
    assert_eq!(r.step(&seen, 1_000), None);
    assert_eq!(r.step(&seen, 100_000), None);
    assert_eq!(r.deadline_ms(), None);
    seen.published_next = Some(key(7));
    assert_eq!(r.step(&seen, 200_000), None);
    assert_eq!(r.deadline_ms(), Some(200_000 + ROTATION_GRACE_MS));
    assert_eq!(r.step(&seen, 200_000 + ROTATION_GRACE_MS - 1), None);
    assert_eq!(
        r.step(&seen, 200_000 + ROTATION_GRACE_MS),
        Some(RotationStep::Commit)
    );
    assert_eq!(r.committed(), Some(key(7)));
    // Done: the request counts as carried out even before key-rotated says so.
    assert_eq!(r.step(&inputs(Some("b"), Some("a")), 300_000), None);
    assert_eq!(r.rotated_to_publish(Some("a")), Some("b"));
}

#[test]
fn a_next_key_that_disappears_from_the_node_waits_the_grace_again() {
    let mut r = Rotation::default();
    r.prepared(key(7), None);
    let mut seen = inputs(None, None);
    seen.published_next = Some(key(7));
    assert_eq!(r.step(&seen, 0), None);
    seen.published_next = None;
    assert_eq!(r.step(&seen, ROTATION_GRACE_MS), None);
    seen.published_next = Some(key(7));
    assert_eq!(r.step(&seen, ROTATION_GRACE_MS + 1), None);
    assert_eq!(
        r.step(&seen, 2 * ROTATION_GRACE_MS + 1),
        Some(RotationStep::Commit)
    );
}

#[test]
fn the_request_is_published_with_the_next_key_so_a_restart_after_the_switch_does_not_rotate_again()
{
    let mut r = Rotation::default();
    r.prepared(key(7), Some("b".into()));
    assert_eq!(r.rotated_to_publish(Some("a")), Some("b"));
    // A restart after the switch finds no key.next and key-rotated = b.
    let mut restarted = Rotation::resumed(None);
    assert_eq!(restarted.step(&inputs(Some("b"), Some("b")), 0), None);
    // A restart before it resumes the rotation from disk, request and all.
    let mut resumed = Rotation::resumed(Some((key(7), Some("b".into()))));
    assert_eq!(resumed.rotated_to_publish(Some("a")), Some("b"));
    let mut seen = inputs(Some("b"), Some("b"));
    seen.published_next = Some(key(7));
    assert_eq!(resumed.step(&seen, 0), None);
    assert_eq!(
        resumed.step(&seen, ROTATION_GRACE_MS),
        Some(RotationStep::Commit)
    );
}

#[test]
fn the_period_rotates_a_key_older_than_it() {
    let mut r = Rotation::default();
    let mut i = inputs(None, None);
    i.key_made_ms = 1_000;
    i.period_ms = Some(60_000);
    assert_eq!(r.step(&i, 60_999), None);
    assert_eq!(
        r.step(&i, 61_000),
        Some(RotationStep::MakeNextKey { request: None })
    );
    r.prepared(key(3), None);
    assert_eq!(r.committed(), Some(key(3)));
    assert_eq!(r.rotated, None, "a period leaves key-rotated as it was");
}

fn node(name: &str, k: u8, next: Option<u8>) -> Node {
    Node {
        name: name.into(),
        key: Some(key(k)),
        next_key: next.map(key),
        ..Default::default()
    }
}

#[test]
fn successors_pair_each_rotating_nodes_keys() {
    let nodes = [
        node("a", 1, None),
        node("b", 2, Some(9)),
        node("c", 3, Some(3)),
    ];
    assert_eq!(successors(&nodes), BTreeMap::from([(key(2), key(9))]));
}

#[test]
fn a_rotating_peer_gets_a_successor_entry_with_its_endpoint_and_no_allowed_ips() {
    use crate::fixtures::{f1_nodes, f1_params, f1_peers};
    use crate::node::Granularity;
    let mut nodes = f1_nodes();
    let next = key(42);
    let rotating = nodes.iter_mut().find(|n| n.name != "a").unwrap();
    rotating.next_key = Some(next);
    let old = rotating.key.unwrap();
    let t = Topology::new(&nodes, &f1_peers(), &f1_params("a", Granularity::Full)).unwrap();
    let conf = t.conf(None);
    let current = conf.peers.iter().find(|p| p.public_key == old).unwrap();
    let successor = conf.peers.iter().find(|p| p.public_key == next).unwrap();
    assert!(!current.allowed_ips.is_empty());
    assert!(successor.allowed_ips.is_empty());
    assert_eq!(successor.endpoint, current.endpoint);
    assert_eq!(successor.replaces, Some(old));
    assert_eq!(successor.persistent_keepalive, 0);
    assert_eq!(
        conf.peers.iter().filter(|p| p.replaces.is_some()).count(),
        1,
        "only the rotating node's link has one"
    );
}
