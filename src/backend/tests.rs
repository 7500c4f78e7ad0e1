//! The change log's catch-up rules.

use super::{ChangeLog, CHANGE_LOG_LENGTH};

fn names(log: &ChangeLog, seen: u64) -> Option<Vec<String>> {
    log.since(seen)
        .map(|names| names.map(str::to_string).collect())
}

#[test]
fn a_reader_catches_up_on_the_names_changed_after_its_revision() {
    let mut log = ChangeLog::default();
    assert_eq!(names(&log, 0), Some(vec![]));
    log.node("a");
    log.node("b");
    let seen = log.revision();
    log.node("c");
    log.node("a");
    assert_eq!(names(&log, seen), Some(vec!["c".into(), "a".into()]));
    assert_eq!(
        names(&log, 0),
        Some(
            vec!["a", "b", "c", "a"]
                .into_iter()
                .map(String::from)
                .collect()
        )
    );
    assert_eq!(names(&log, log.revision()), Some(vec![]));
}

#[test]
fn a_reset_or_a_reader_too_far_behind_walks_everything() {
    let mut log = ChangeLog::default();
    log.node("a");
    let before = log.revision();
    log.reset();
    assert_eq!(names(&log, before), None, "a re-list came after it");
    let after = log.revision();
    assert_eq!(names(&log, after), Some(vec![]));
    for i in 0..CHANGE_LOG_LENGTH + 1 {
        log.node(&format!("n{i}"));
    }
    assert_eq!(names(&log, after), None, "the log no longer reaches back");
    assert_eq!(names(&log, log.revision() - 1).map(|n| n.len()), Some(1));
    assert_eq!(
        names(&log, log.revision() + 1),
        None,
        "a revision from elsewhere"
    );
}

#[test]
fn peer_changes_move_the_revision_but_name_no_node() {
    let mut log = ChangeLog::default();
    let seen = log.revision();
    log.peer();
    assert_eq!(log.peer_revision(), log.revision());
    assert_eq!(names(&log, seen), Some(vec![]));
}
