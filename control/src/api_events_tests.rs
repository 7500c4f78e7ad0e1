use super::*;

fn event(sequence: u64, at: i64, reason: Reason, subject: &str, message: &str) -> Event {
    Event {
        sequence,
        at_unix_ms: at,
        reason,
        kind: reason.kind(),
        subject: subject.to_string(),
        message: message.to_string(),
    }
}

const N1: Poster<'static> = Poster {
    node: "n1",
    reports_cluster: false,
};
const REPORTER: Poster<'static> = Poster {
    node: "n1",
    reports_cluster: true,
};

fn created(write: Option<ApiWrite>) -> ApiEvent {
    match write {
        Some(ApiWrite::Create(e)) => e,
        other => panic!("wanted a new Event, got {other:?}"),
    }
}

#[test]
fn each_node_posts_what_is_about_itself_and_one_node_what_all_see() {
    let mut book = ApiEventBook::default();
    let own = created(book.admit(
        &event(
            1,
            1_000,
            Reason::BadAnnotation,
            "n1",
            "kilo.squat.ai/location: empty",
        ),
        N1,
    ));
    assert_eq!(own.regarding, Regarding::Node("n1".into()));
    assert_eq!((own.kind, own.action), (EventKind::Warning, "Reconcile"));
    assert_eq!(own.note, "kilo.squat.ai/location: empty");
    // Another node's bad annotation is its own agent's to post.
    let other = event(2, 1_000, Reason::BadAnnotation, "n2", "n2: bad");
    assert_eq!(book.admit(&other, N1), None);
    assert_eq!(book.admit(&other, REPORTER), None);
    // A bad Peer: only the reporter, regarding the Peer.
    let peer = event(
        3,
        1_000,
        Reason::BadPeer,
        "laptop",
        "bad Peer laptop: no key",
    );
    assert_eq!(book.admit(&peer, N1), None);
    let posted = created(book.admit(&peer, REPORTER));
    assert_eq!(posted.regarding, Regarding::Peer("laptop".into()));
    // A lease: about this node, named in the note since the object does not name it.
    let lease = created(book.admit(
        &event(
            4,
            1_000,
            Reason::LeaderElected,
            "kilo-leader-east",
            "taking the lead",
        ),
        N1,
    ));
    assert_eq!(lease.regarding, Regarding::Node("n1".into()));
    assert_eq!(lease.note, "kilo-leader-east: taking the lead");
    assert_eq!(lease.action, "Elect");
    // What is said while the API server cannot be written is not posted.
    let outage = event(5, 1_000, Reason::BackendUnreachable, "kube", "unreachable");
    assert_eq!(book.admit(&outage, REPORTER), None);
    // Names are unique per node, time and sequence, and valid object names.
    assert_ne!(own.name, lease.name);
    assert!(own.name.starts_with("n1.") && own.name.bytes().all(|b| b != b'_'));
}

#[test]
fn a_repeat_is_counted_in_the_first_events_series_at_most_every_thirty_seconds() {
    let mut book = ApiEventBook::default();
    let failed = |seq, at| {
        event(
            seq,
            at,
            Reason::ReconcileFailed,
            "n1",
            "reconcile failed: x",
        )
    };
    let first = created(book.admit(&failed(1, 0), N1));
    // Within 30 s of the first write: counted, not written.
    assert_eq!(book.admit(&failed(2, 10_000), N1), None);
    assert_eq!(book.due_repeats(20_000), vec![]);
    // Written when due, with the last occurrence's time.
    assert_eq!(
        book.due_repeats(30_000),
        vec![ApiWrite::Repeat {
            name: first.name.clone(),
            count: 2,
            last_unix_ms: 10_000
        }]
    );
    assert_eq!(book.due_repeats(90_000), vec![]);
    // A third, past 30 s since that write: written at once.
    assert_eq!(
        book.admit(&failed(3, 70_000), N1),
        Some(ApiWrite::Repeat {
            name: first.name.clone(),
            count: 3,
            last_unix_ms: 70_000
        })
    );
    // Another message is another Event.
    let other = event(
        4,
        71_000,
        Reason::ReconcileFailed,
        "n1",
        "reconcile failed: y",
    );
    assert_ne!(created(book.admit(&other, N1)).name, first.name);
    // Ten quiet minutes end the series: the next is a new Event.
    let again = created(book.admit(&failed(5, 70_000 + SERIES_WINDOW_MS), N1));
    assert_ne!(again.name, first.name);
}

#[test]
fn the_budget_holds_a_burst_and_earns_one_write_back_every_five_minutes() {
    let mut book = ApiEventBook::default();
    let distinct = |seq: u64, at| {
        event(
            seq,
            at,
            Reason::RouteWithheld,
            &format!("10.0.{seq}.0/24"),
            "withheld",
        )
    };
    let posted = (0..40)
        .filter(|seq| book.admit(&distinct(*seq, 1_000), N1).is_some())
        .count();
    assert_eq!(posted, BURST as usize);
    assert_eq!(book.dropped(), 15);
    // Just before five minutes: nothing earned.
    assert_eq!(book.admit(&distinct(100, 1_000 + REFILL_MS - 1), N1), None);
    // Five minutes after the first write: one.
    assert!(book.admit(&distinct(101, 1_000 + REFILL_MS), N1).is_some());
    assert_eq!(book.admit(&distinct(102, 1_000 + REFILL_MS), N1), None);
    // A long quiet time fills the burst again, and no more than it.
    let later = 1_000 + 1_000 * REFILL_MS;
    let posted = (200..240)
        .filter(|seq| book.admit(&distinct(*seq, later), N1).is_some())
        .count();
    assert_eq!(posted, BURST as usize);
}

#[test]
fn a_long_message_is_cut_within_the_api_servers_limit_at_a_character() {
    let mut book = ApiEventBook::default();
    let long = "é".repeat(NOTE_LIMIT);
    let posted = created(book.admit(&event(1, 0, Reason::IpamProblem, "n1", &long), N1));
    assert!(posted.note.len() <= NOTE_LIMIT, "{}", posted.note.len());
    assert!(posted.note.ends_with("..."));
}

#[test]
fn every_reason_has_an_action_the_api_server_takes() {
    for reason in Reason::ALL {
        let action = action(reason);
        assert!(!action.is_empty() && action.len() <= 128, "{reason}");
    }
}
