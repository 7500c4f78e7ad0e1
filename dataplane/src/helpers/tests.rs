//! The helpers' own tests: chunks, sharing, backoff, panics, closing.
use super::*;
use std::time::Duration;
use std::time::Instant;

#[test]
fn every_chunk_runs_once() {
    let helpers = Helpers::start(3).unwrap();
    for round in 0..200 {
        let chunks = 1 + round % 37;
        let hits: Vec<AtomicUsize> = (0..chunks).map(|_| AtomicUsize::new(0)).collect();
        helpers.run(chunks, &|i| {
            if i % 5 == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
            hits[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    }
}

#[test]
fn idle_helpers_take_chunks() {
    let helpers = Helpers::start(1).unwrap();
    // Slow chunks leave the helper time to wake and take some.
    helpers.run(20, &|_| std::thread::sleep(Duration::from_millis(2)));
    let stats = helpers.stats();
    assert_eq!(stats.spread, 1);
    assert!(stats.helped_chunks > 0, "{stats:?}");
}

/// Waits (up to a minute: emulated machines are slow) until `done` holds.
fn wait_until(what: &str, done: impl Fn() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(60), "never: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_worker_stops_offering_for_a_while_after_awake_helpers_came_too_late() {
    let helpers = Arc::new(Helpers::start(1).unwrap());
    // Another worker's batch keeps the one helper busy (awake) in a slow chunk...
    let helper_inside = Arc::new(AtomicBool::new(false));
    let other = {
        let (helpers, inside) = (Arc::clone(&helpers), Arc::clone(&helper_inside));
        std::thread::spawn(move || {
            helpers.run(2, &|_| {
                if std::thread::current().name() == Some("kilotun-helper-0") {
                    inside.store(true, Ordering::Release);
                }
                std::thread::sleep(Duration::from_millis(300));
            });
        })
    };
    wait_until("the helper takes a chunk", || {
        helper_inside.load(Ordering::Acquire)
    });
    // ...so this worker's batch is done before the helper can take any of it: judged a miss.
    helpers.run(2, &|_| {});
    assert_eq!(
        helpers.shared.skip.load(Ordering::Relaxed),
        1,
        "one batch alone"
    );
    // The next batch runs on the worker alone, then offers resume.
    helpers.run(2, &|_| {});
    assert_eq!(helpers.shared.skip.load(Ordering::Relaxed), 0);
    other.join().unwrap();
    assert_eq!(
        helpers.stats().spread,
        2,
        "the other worker's and the missed one"
    );
}

#[test]
fn helpers_late_from_sleep_are_not_taken_for_busy_cores() {
    let helpers = Helpers::start(1).unwrap();
    wait_until("the helper sleeps", || {
        helpers.shared.board.lock().sleeping == 1
    });
    // A batch of two instant chunks is done before the sleeping helper wakes: that is its
    // wake-up, not a busy core, and does not stop the next offer.
    helpers.run(2, &|_| {});
    assert_eq!(helpers.shared.skip.load(Ordering::Relaxed), 0);
    assert_eq!(helpers.shared.backoff.load(Ordering::Relaxed), 0);
}

#[test]
fn closed_helpers_take_nothing() {
    let helpers = Helpers::start(1).unwrap();
    helpers.set_open(false);
    helpers.run(20, &|_| std::thread::sleep(Duration::from_micros(200)));
    assert_eq!(helpers.stats(), HelperStats::default());
    helpers.set_open(true);
    helpers.run(20, &|_| std::thread::sleep(Duration::from_micros(500)));
    assert_eq!(helpers.stats().spread, 1);
    assert!(helpers.busy() > Duration::ZERO);
}

#[test]
fn many_workers_share_the_helpers() {
    let helpers = Arc::new(Helpers::start(2).unwrap());
    let total = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..4)
        .map(|_| {
            let (helpers, total) = (Arc::clone(&helpers), Arc::clone(&total));
            std::thread::spawn(move || {
                for _ in 0..300 {
                    helpers.run(8, &|_| {
                        total.fetch_add(1, Ordering::Relaxed);
                    });
                }
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    assert_eq!(total.load(Ordering::Relaxed), 4 * 300 * 8);
}

#[test]
fn a_panicking_chunk_reaches_the_worker_and_the_helpers_survive() {
    let helpers = Helpers::start(2).unwrap();
    let result = catch_unwind(AssertUnwindSafe(|| {
        helpers.run(16, &|i| {
            std::thread::sleep(Duration::from_micros(200));
            assert!(i != 7, "chunk 7 fails");
        })
    }));
    assert!(result.is_err());
    let ran = AtomicUsize::new(0);
    helpers.run(16, &|_| {
        ran.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(ran.load(Ordering::Relaxed), 16);
}

#[test]
fn without_helpers_the_worker_runs_everything_in_order() {
    let helpers = Helpers::start(0).unwrap();
    let order = Mutex::new(Vec::new());
    helpers.run(5, &|i| order.lock().push(i));
    assert_eq!(*order.lock(), vec![0, 1, 2, 3, 4]);
    assert_eq!(helpers.stats(), HelperStats::default());
}

#[test]
fn results_are_handed_back_in_order_each_range_once_it_ran() {
    let helpers = Helpers::start_jittered(2, Duration::from_micros(30)).unwrap();
    for round in 0..100 {
        let chunks = 1 + round % 41;
        let ran: Vec<AtomicBool> = (0..chunks).map(|_| AtomicBool::new(false)).collect();
        let mut next = 0;
        helpers.run_in_order(
            chunks,
            &|i| {
                assert!(!ran[i].swap(true, Ordering::AcqRel), "chunk {i} ran twice");
            },
            &mut |range| {
                assert_eq!(range.start, next, "ranges follow one another from 0");
                assert!(range.end > range.start, "no empty range");
                for i in range.clone() {
                    assert!(
                        ran[i].load(Ordering::Acquire),
                        "chunk {i} handed back unrun"
                    );
                }
                next = range.end;
            },
        );
        assert_eq!(next, chunks, "every chunk handed back");
        assert!(ran.iter().all(|r| r.load(Ordering::Relaxed)));
    }
    assert!(helpers.stats().spread > 0, "some batches were spread");
}

#[test]
fn a_helper_woken_by_an_offer_takes_part_in_it() {
    // The helper falls asleep, then a batch of slow chunks is offered: the offer that woke it
    // must be the one it helps with (not only the next).
    let helpers = Helpers::start(1).unwrap();
    wait_until("the helper sleeps", || {
        helpers.shared.board.lock().sleeping == 1
    });
    helpers.run(8, &|_| std::thread::sleep(Duration::from_millis(5)));
    assert!(
        helpers.stats().helped_chunks > 0,
        "the woken helper took no chunk of the batch that woke it: {:?}",
        helpers.stats()
    );
}
