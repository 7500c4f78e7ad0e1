//! Threads that help a worker through the crypto of one batch.
//!
//! A worker that holds a big batch of packets for one peer (one TCP stream's segments, or a
//! location leader's whole link) splits the batch's sealing or opening into chunks and offers
//! them here; idle helpers take chunks while the worker takes them too, so one peer's crypto runs
//! on every core while the worker keeps the batch's order (it alone assigned the counters before,
//! and it alone goes through the results after, its own chunks while the helpers still run
//! theirs: [`Helpers::run_in_order`]). The worker never waits for a chunk nobody took: a helper
//! that wakes late finds the batch done and goes back to sleep. When awake helpers keep starting
//! too late to take their share (every core is busy, so moving crypto only costs switches), the
//! worker stops offering for a while, backing off further each time, up to 256 batches; and the
//! device closes the helpers while the machine shows no idle core ([`IdleCores`]).

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

mod idle;
pub use idle::{CpuTimes, IdleCores};

/// How long an idle helper keeps looking for work (yielding its core to anyone who wants it)
/// before it sleeps: a loaded worker's next batch follows within tens of microseconds, and a
/// sleeping helper costs a wake-up (tens of microseconds more) to reach.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(200);
/// The longest run of batches a worker keeps to itself after offers that no helper took.
const MAX_BACKOFF_BATCHES: u32 = 256;

/// One batch's work, offered on the board while its worker runs it too. It lives on the
/// worker's stack: the worker withdraws it and waits until no helper is inside before
/// returning, which is what makes handing helpers a pointer to it sound.
///
/// The worker takes chunks from the front and helpers from the back, each time about
/// 1/(2 × threads) of what is left (at least one): while much is left few claims are made,
/// near the end chunks come one at a time, so whoever finishes last waits little. From batch to
/// batch the worker writes the same front part of its buffers and the helpers the back part, so
/// those stay in each core's cache instead of moving between cores.
struct Job<'a> {
    work: &'a (dyn Fn(usize) + Sync),
    shared: &'a Shared,
    /// The chunks still to take, `front << 32 | back`: from `front` up to (not including) `back`.
    left: AtomicU64,
    /// The threads that may take part (the worker and every helper).
    threads: usize,
    /// Helpers that took this job from the board and have not let go of it.
    inside: AtomicUsize,
    /// Chunks run by helpers.
    helped: AtomicUsize,
    /// Set when a chunk panicked on a helper; the worker panics in turn.
    panicked: AtomicBool,
}

impl Job<'_> {
    /// A helper's share: chunks taken from the back until none is left; returns how many ran.
    fn run_back(&self) -> usize {
        let mut ran = 0;
        while let Some(chunks) = self.claim(false) {
            ran += chunks.len();
            for chunk in chunks {
                self.shared.jitter();
                (self.work)(chunk);
            }
        }
        ran
    }

    /// The worker's share: chunks taken from the front until none is left, each claim handed
    /// to `done` once it ran. Returns where the last claim ended.
    fn run_front(&self, done: &mut dyn FnMut(std::ops::Range<usize>)) -> usize {
        let mut upto = 0;
        while let Some(chunks) = self.claim(true) {
            for chunk in chunks.clone() {
                self.shared.jitter();
                (self.work)(chunk);
            }
            // Only the worker takes from the front, so its claims follow one another from 0.
            debug_assert_eq!(chunks.start, upto, "the front's claims are consecutive");
            upto = chunks.end;
            done(chunks);
        }
        upto
    }

    fn claim(&self, from_front: bool) -> Option<std::ops::Range<usize>> {
        let mut left = self.left.load(Ordering::Relaxed);
        loop {
            let (front, back) = (left >> 32, left & 0xffff_ffff);
            if front >= back {
                return None;
            }
            let take = ((back - front) / (2 * self.threads as u64)).max(1);
            let (next, claimed) = if from_front {
                ((front + take) << 32 | back, front..front + take)
            } else {
                (front << 32 | (back - take), back - take..back)
            };
            match self
                .left
                .compare_exchange_weak(left, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(claimed.start as usize..claimed.end as usize),
                Err(now) => left = now,
            }
        }
    }

    fn has_chunks_left(&self) -> bool {
        let left = self.left.load(Ordering::Relaxed);
        left >> 32 < left & 0xffff_ffff
    }
}

/// A pointer to a [`Job`] on some worker's stack, with its lifetime erased.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Offer(*const Job<'static>);

// SAFETY: a job is only reached through its offer while it is on the board or while a helper
// counts itself `inside` it (counted under the board's lock, while the job is on the board); its
// worker withdraws it and waits for `inside` to reach zero before the job goes away. Everything
// the job holds is `Sync`.
unsafe impl Send for Offer {}

#[derive(Default)]
struct Board {
    offers: Vec<Offer>,
    sleeping: usize,
    stop: bool,
}

#[derive(Default)]
struct Shared {
    board: Mutex<Board>,
    wake: Condvar,
    /// Offers made so far, changed under the board's lock: a helper that found nothing to take
    /// spins until this moves, without touching the board (whose lock the worker needs to
    /// withdraw its job).
    offers_made: AtomicU64,
    /// Batches still to run alone before offering again, and the length of the last backoff.
    skip: AtomicU32,
    backoff: AtomicU32,
    spread: AtomicU64,
    helped_chunks: AtomicU64,
    /// Whether workers offer batches at all (see [`Helpers::set_open`]).
    closed: AtomicBool,
    /// Time helpers spent running chunks, in nanoseconds.
    busy_nanos: AtomicU64,
    /// For tests: each chunk first waits a pseudo-random time below this many nanoseconds.
    jitter_nanos: u64,
    jitter_draws: AtomicU64,
}

impl Shared {
    /// Waits the test's jitter before a chunk, if any.
    fn jitter(&self) {
        if self.jitter_nanos == 0 {
            return;
        }
        // splitmix64 of a shared draw counter: a different wait for every chunk.
        let mut z = self
            .jitter_draws
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        std::thread::sleep(Duration::from_nanos((z ^ (z >> 31)) % self.jitter_nanos));
    }
}

/// Counters of what the helpers did, for tests and benchmarks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HelperStats {
    /// Batches offered to the helpers.
    pub spread: u64,
    /// Chunks run by helpers rather than the batch's worker.
    pub helped_chunks: u64,
}

/// Helper threads shared by a device's workers. See the module documentation.
pub struct Helpers {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Helpers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Helpers")
            .field("threads", &self.threads.len())
            .finish()
    }
}

impl Helpers {
    /// Starts `count` helper threads (none: every batch runs on its worker alone).
    ///
    /// # Errors
    /// When a thread cannot be spawned.
    pub fn start(count: usize) -> std::io::Result<Self> {
        Self::start_jittered(count, Duration::ZERO)
    }

    /// For tests: [`Helpers::start`], but every chunk (on a helper or on the worker) first
    /// waits a pseudo-random time below `jitter`, so that chunks finish in a random order and
    /// the worker and helpers take random shares.
    ///
    /// # Errors
    /// When a thread cannot be spawned.
    pub fn start_jittered(count: usize, jitter: Duration) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            jitter_nanos: u64::try_from(jitter.as_nanos()).unwrap_or(u64::MAX),
            ..Shared::default()
        });
        let mut threads = Vec::with_capacity(count);
        for i in 0..count {
            let for_thread = Arc::clone(&shared);
            let spawned = std::thread::Builder::new()
                .name(format!("kilotun-helper-{i}"))
                .spawn(move || help(&for_thread));
            match spawned {
                Ok(thread) => threads.push(thread),
                Err(e) => {
                    Self { shared, threads }.stop();
                    return Err(e);
                }
            }
        }
        Ok(Self { shared, threads })
    }

    /// How many helper threads run.
    pub fn count(&self) -> usize {
        self.threads.len()
    }

    /// What the helpers did so far.
    pub fn stats(&self) -> HelperStats {
        HelperStats {
            spread: self.shared.spread.load(Ordering::Relaxed),
            helped_chunks: self.shared.helped_chunks.load(Ordering::Relaxed),
        }
    }

    /// Runs `work(0)` to `work(chunks - 1)`, each once, on this thread and on any helper free to
    /// take a chunk, and returns when all have run. The order in which chunks run is not
    /// defined; `work` must give each chunk its own data.
    ///
    /// # Panics
    /// When a chunk panics (on this thread or on a helper).
    pub fn run(&self, chunks: usize, work: &(dyn Fn(usize) + Sync)) {
        self.run_in_order(chunks, work, &mut |_| {});
    }

    /// [`Helpers::run`], also calling `done`, on this thread, with consecutive ranges of chunks
    /// that have all run, in order, together covering `0..chunks`. This thread takes its chunks
    /// from the front, so the ranges it ran are handed to `done` at once, while helpers still
    /// run theirs; the rest follows when every chunk has run. A caller that must go through
    /// the results in order (delivering packets) goes through its own share in the meantime.
    ///
    /// # Panics
    /// When a chunk panics (on this thread or on a helper), or `done` does.
    pub fn run_in_order(
        &self,
        chunks: usize,
        work: &(dyn Fn(usize) + Sync),
        done: &mut dyn FnMut(std::ops::Range<usize>),
    ) {
        let offering = if chunks >= 2 { self.offer() } else { None };
        match offering {
            Some(offering) => offering.run_in_order(chunks, work, done),
            None => run_alone(&self.shared, chunks, work, done),
        }
    }

    /// Whether the next batch is to be offered to the helpers: `Some` while helpers run, are
    /// open, and are not backing off after offers they took too little of (a batch turned away
    /// runs alone, and counts toward the backoff). A caller that must first prepare a batch for
    /// spreading (cut it into chunks) asks here, so that a batch the helpers will not see runs
    /// as if there were none.
    pub fn offer(&self) -> Option<Offering<'_>> {
        let open = !self.threads.is_empty()
            && !self.shared.closed.load(Ordering::Relaxed)
            && !self.backing_off();
        open.then_some(Offering { helpers: self })
    }

    /// Lets workers offer batches (`true`, the default) or not. The device closes the helpers
    /// while the machine has no idle core for them (see [`IdleCores`]).
    pub fn set_open(&self, open: bool) {
        self.shared.closed.store(!open, Ordering::Relaxed);
    }

    /// Time the helpers have spent running chunks.
    pub fn busy(&self) -> Duration {
        Duration::from_nanos(self.shared.busy_nanos.load(Ordering::Relaxed))
    }

    /// Whether this batch should run alone, after offers the helpers took too little of.
    fn backing_off(&self) -> bool {
        let skip = &self.shared.skip;
        let mut left = skip.load(Ordering::Relaxed);
        while left > 0 {
            match skip.compare_exchange_weak(left, left - 1, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(now) => left = now,
            }
        }
        false
    }

    fn note_outcome(&self, helped: bool) {
        let shared = &*self.shared;
        if helped {
            shared.backoff.store(0, Ordering::Relaxed);
        } else {
            let next = (shared.backoff.load(Ordering::Relaxed) * 2).clamp(1, MAX_BACKOFF_BATCHES);
            shared.backoff.store(next, Ordering::Relaxed);
            shared.skip.store(next, Ordering::Relaxed);
        }
    }

    fn stop(&mut self) {
        self.shared.board.lock().stop = true;
        self.shared.wake.notify_all();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// Runs every chunk on this thread, then hands them all to `done`.
fn run_alone(
    shared: &Shared,
    chunks: usize,
    work: &(dyn Fn(usize) + Sync),
    done: &mut dyn FnMut(std::ops::Range<usize>),
) {
    for chunk in 0..chunks {
        shared.jitter();
        work(chunk);
    }
    if chunks > 0 {
        done(0..chunks);
    }
}

/// One batch the helpers take part in, from [`Helpers::offer`].
#[must_use = "an offering does nothing until it runs a batch"]
pub struct Offering<'h> {
    helpers: &'h Helpers,
}

impl Offering<'_> {
    /// [`Helpers::run`] for the batch that was offered.
    ///
    /// # Panics
    /// When a chunk panics (on this thread or on a helper).
    pub fn run(self, chunks: usize, work: &(dyn Fn(usize) + Sync)) {
        self.run_in_order(chunks, work, &mut |_| {});
    }

    /// [`Helpers::run_in_order`] for the batch that was offered.
    ///
    /// # Panics
    /// When a chunk panics (on this thread or on a helper), or `done` does.
    pub fn run_in_order(
        self,
        chunks: usize,
        work: &(dyn Fn(usize) + Sync),
        done: &mut dyn FnMut(std::ops::Range<usize>),
    ) {
        let this = self.helpers;
        if chunks < 2 || chunks > u32::MAX as usize {
            return run_alone(&this.shared, chunks, work, done);
        }
        let job = Job {
            work,
            shared: &this.shared,
            left: AtomicU64::new(chunks.min(u32::MAX as usize) as u64),
            threads: this.threads.len() + 1,
            inside: AtomicUsize::new(0),
            helped: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
        };
        let offer = Offer((&raw const job).cast());
        let shared = &*this.shared;
        let (to_wake, all_asleep) = {
            let mut board = shared.board.lock();
            board.offers.push(offer);
            shared.offers_made.fetch_add(1, Ordering::Release);
            (
                board.sleeping.min(chunks - 1),
                board.sleeping == this.threads.len(),
            )
        };
        for _ in 0..to_wake {
            shared.wake.notify_one();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| job.run_front(done)));
        {
            let mut board = shared.board.lock();
            board.offers.retain(|o| *o != offer);
        }
        // Helpers still inside are finishing a chunk each (none can start one: if `mine` ran
        // to the end, no chunk is left; if it panicked, they may take the rest, which is fine).
        let mut spins = 0u32;
        while job.inside.load(Ordering::Acquire) != 0 {
            spins += 1;
            if spins < 100 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let helped = job.helped.load(Ordering::Relaxed);
        shared.spread.fetch_add(1, Ordering::Relaxed);
        shared
            .helped_chunks
            .fetch_add(helped as u64, Ordering::Relaxed);
        // The helpers' fair share is (threads - 1) / threads of the chunks. Helpers that took
        // less than half of it started late: no core was idle for them (they ran only when the
        // scheduler took a core from someone else, the worker or the traffic's own programs),
        // and moving crypto then costs more in switches than it saves.
        // Helpers that were all asleep are late by their wake-up, which says nothing of idle
        // cores: only offers to helpers already awake are judged.
        let threads = this.threads.len() + 1;
        if !all_asleep {
            this.note_outcome(2 * threads * helped >= (threads - 1) * chunks);
        }
        let upto = mine.unwrap_or_else(|panic| resume_unwind(panic));
        assert!(
            !job.panicked.load(Ordering::Relaxed),
            "a helper panicked running a chunk"
        );
        if upto < chunks {
            done(upto..chunks);
        }
    }
}

impl Drop for Helpers {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Lets go of a job when a helper is done with it, even if its chunk panicked.
struct Inside<'j>(&'j Job<'j>);

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        // The helper's last touch of the job: after this its worker may return.
        self.0.inside.fetch_sub(1, Ordering::Release);
    }
}

/// A helper thread: take a chunk of any offered job, else spin a little, else sleep.
fn help(shared: &Shared) {
    let mut idle_since = Instant::now();
    loop {
        // The offer taken, or how many offers had been made when there was none to take.
        let taken: Result<Offer, u64> = {
            let mut board = shared.board.lock();
            if board.stop {
                return;
            }
            let found = board.offers.iter().copied().find(|offer| {
                // SAFETY: the offer is on the board, so its job is alive (see `Offer`).
                unsafe { &*offer.0 }.has_chunks_left()
            });
            match found {
                Some(offer) => {
                    // SAFETY: as above; counting ourselves inside keeps it alive after we
                    // release the board.
                    unsafe { &*offer.0 }.inside.fetch_add(1, Ordering::Acquire);
                    Ok(offer)
                }
                None if idle_since.elapsed() >= SPIN_BEFORE_SLEEP => {
                    board.sleeping += 1;
                    shared.wake.wait(&mut board);
                    board.sleeping -= 1;
                    idle_since = Instant::now();
                    // Woken for an offer (or to stop): look at the board again at once.
                    continue;
                }
                None => Err(shared.offers_made.load(Ordering::Relaxed)),
            }
        };
        let offer = match taken {
            Ok(offer) => offer,
            Err(seen) => {
                spin_until_offered(shared, seen, idle_since);
                continue;
            }
        };
        // SAFETY: we are counted inside the job, so it outlives this borrow (see `Offer`).
        let job: &Job<'_> = unsafe { &*offer.0 };
        let inside = Inside(job);
        let started = Instant::now();
        match catch_unwind(AssertUnwindSafe(|| job.run_back())) {
            Ok(ran) => {
                job.helped.fetch_add(ran, Ordering::Relaxed);
            }
            Err(_) => job.panicked.store(true, Ordering::Relaxed),
        }
        idle_since = Instant::now();
        let busy = u64::try_from((idle_since - started).as_nanos()).unwrap_or(u64::MAX);
        shared.busy_nanos.fetch_add(busy, Ordering::Relaxed);
        // Let go last, so that the batch's worker finds this helper's time counted.
        drop(inside);
    }
}

/// Spins, without the board's lock, until an offer is made after the first `seen` (the ones on
/// the board now have nothing left to take), or until the helper has been idle since
/// `idle_since` for [`SPIN_BEFORE_SLEEP`].
fn spin_until_offered(shared: &Shared, seen: u64, idle_since: Instant) {
    let mut spins = 0u32;
    while shared.offers_made.load(Ordering::Acquire) == seen {
        spins += 1;
        if spins.is_multiple_of(64) {
            if idle_since.elapsed() >= SPIN_BEFORE_SLEEP {
                return;
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests;
