//! One batch's data-phase crypto, set apart from its bookkeeping so that it can run on every
//! core.
//!
//! A batch goes through three steps. The worker walks it in order, under each peer's lock only
//! long enough to take the session and the next sending counters, and writes down a job per data
//! packet. The jobs then run (a copy into place and one AEAD call each), on the worker alone or
//! spread over the device's [`Helpers`] when the batch is big enough to be worth it. Finally the
//! worker walks the results in order: its own share (the front of the batch) as soon as it ran,
//! while the helpers still run theirs (the back), which it walks last. Everything the peer sees
//! in order (the counters on the wire, the packets into the TUN device) is decided by the first
//! and last steps, which only the batch's worker runs; the middle step may run in any order.

use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;

use boringtun::noise::session::{
    OpenedCounter, ReceivingCounter, ReceivingWindow, SendingCounter, Session,
};
use parking_lot::Mutex;

use super::peer::PeerEntry;
use super::reason_for;
use crate::allowed_ips::AllowedIps;
use crate::endpoint::LocalAddr;
use crate::helpers::Helpers;
use crate::packet;
use crate::stats::DropReason;

/// The least plaintext a batch carries before its crypto is offered to helpers: below it, a
/// helper's wake-up costs about what it would save. Messages refused before decryption (replays)
/// carry none: a replayed flood wakes no helper.
const SPREAD_MIN_BYTES: usize = 32 * 1024;
/// About how many bytes of packets one chunk of spread work holds (two or three microseconds of
/// AEAD). Threads take several chunks at a time while much is left, so small chunks cost
/// little, and they let whoever finishes last wait little for the others.
const CHUNK_BYTES: usize = 4 * 1024;
/// Bytes of a data message before its encrypted payload: type, receiver index, counter.
pub(super) const DATA_HEADER: usize = 16;

/// A data packet to seal: its plaintext, and where its datagram goes in the outbox.
pub(super) struct SealJob<'p> {
    pub(super) session: usize,
    pub(super) counter: Option<SendingCounter>,
    pub(super) plaintext: &'p [u8],
    pub(super) datagram: Range<usize>,
}

/// What opening a data message gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Opened {
    /// Not run yet (or its chunk panicked).
    Pending,
    /// An IP packet of `len` bytes whose source is among the sender's allowed IPs (cryptokey
    /// routing's reverse-path check) if `allowed`.
    Inner { len: usize, allowed: bool },
    /// An empty payload: a keepalive.
    Keepalive,
    /// Authenticated, but not an IP packet.
    NotIp,
    /// Refused: authentication, replay window or index, counted as this.
    Failed(DropReason),
}

/// A data message's counter, as the replay window's first check finds it.
pub(super) enum JobCounter {
    /// As the header gives it, not checked yet.
    Unchecked(u64),
    /// One the window may still accept: the message is to be opened.
    Checked(ReceivingCounter),
    /// Opened: to be marked received (the window's second check) when it is delivered.
    Opened(OpenedCounter),
    /// Not to be opened, or opened already and marked or refused.
    Done,
}

/// Checks the counters of `jobs` (their senders' receiver indexes in `notes`) against their
/// sessions' replay windows before anything is decrypted, so that a replayed flood costs no
/// AEAD; a refused job is done, failed. One lock of a window per run of one session's jobs,
/// not one per packet: a lock and an unlock are locked instructions, each of which waits for
/// all of this core's earlier stores.
pub(super) fn check_counters(
    jobs: &mut [OpenJob<'_, '_>],
    notes: &[OpenNote],
    sessions: &[Arc<Session>],
) {
    let mut window = None;
    for (job, note) in jobs.iter_mut().zip(notes) {
        let JobCounter::Unchecked(counter) = job.counter else {
            continue;
        };
        match locked_window(&mut window, sessions, job.session).check(note.receiver_idx, counter) {
            Ok(checked) => job.counter = JobCounter::Checked(checked),
            Err(error) => {
                job.counter = JobCounter::Done;
                job.opened = Opened::Failed(reason_for(error));
            }
        }
    }
}

/// The replay window of `sessions[session]`, locked: the one `held` already holds if it is that
/// session's, else that session's, locked after the one held is let go of (so that no thread
/// ever holds two windows).
pub(super) fn locked_window<'h, 'w>(
    held: &'h mut Option<(usize, ReceivingWindow<'w>)>,
    sessions: &'w [Arc<Session>],
    session: usize,
) -> &'h mut ReceivingWindow<'w> {
    if held.as_ref().is_none_or(|(locked, _)| *locked != session) {
        *held = None;
        *held = Some((session, sessions[session].receiving_window()));
    }
    &mut held.as_mut().expect("just locked").1
}

/// A data message to open: who sent it, its sealed payload, its counter, where its plaintext
/// goes in the outbox (as many bytes as `sealed`, from `plaintext_at`), and what opening it
/// gave. What only the batch's worker needs is apart, in an [`OpenNote`], so that the lines a
/// helper reads and writes hold little else.
pub(super) struct OpenJob<'s, 'p> {
    pub(super) entry: &'s Arc<PeerEntry>,
    /// The snapshot's routes, to check the inner packet's source.
    pub(super) routes: &'s AllowedIps<Arc<PeerEntry>>,
    pub(super) session: usize,
    pub(super) counter: JobCounter,
    pub(super) sealed: &'p [u8],
    pub(super) plaintext_at: usize,
    pub(super) opened: Opened,
}

/// What the worker alone notes of a data message to open, for its delivery: where it came from
/// and the receiver index in its header.
pub(super) struct OpenNote {
    pub(super) from: SocketAddr,
    /// The local address the message was sent to, if the socket told.
    pub(super) local: Option<LocalAddr>,
    pub(super) receiver_idx: u32,
}

/// A job that writes its output in place, in its own range of one buffer.
pub(super) trait InPlace: Send {
    /// Where its output goes in the buffer.
    fn range(&self) -> Range<usize>;
    /// How many bytes of crypto it does (none for a job refused before it).
    fn work(&self) -> usize;
    /// Does the crypto; `out` is the job's range of the buffer.
    fn run(&mut self, sessions: &[Arc<Session>], out: &mut [u8]);
}

impl InPlace for SealJob<'_> {
    fn range(&self) -> Range<usize> {
        self.datagram.clone()
    }

    fn work(&self) -> usize {
        self.plaintext.len()
    }

    fn run(&mut self, sessions: &[Arc<Session>], out: &mut [u8]) {
        let len = self.plaintext.len();
        out[DATA_HEADER..DATA_HEADER + len].copy_from_slice(self.plaintext);
        if let Some(counter) = self.counter.take() {
            sessions[self.session].seal_in_place(counter, out, len);
        }
    }
}

impl InPlace for OpenJob<'_, '_> {
    fn range(&self) -> Range<usize> {
        self.plaintext_at..self.plaintext_at + self.sealed.len()
    }

    fn work(&self) -> usize {
        match self.counter {
            JobCounter::Checked(_) => self.sealed.len(),
            _ => 0,
        }
    }

    fn run(&mut self, sessions: &[Arc<Session>], out: &mut [u8]) {
        let JobCounter::Checked(counter) = &self.counter else {
            return;
        };
        let sealed = &mut out[..self.sealed.len()];
        sealed.copy_from_slice(self.sealed);
        match sessions[self.session].open_checked_in_place(counter, sealed) {
            Ok((opened, plain)) => {
                self.opened = classify(plain, self.routes, self.entry);
                self.counter = JobCounter::Opened(opened);
            }
            Err(error) => {
                self.opened = Opened::Failed(reason_for(error));
                self.counter = JobCounter::Done;
            }
        }
    }
}

/// What an opened plaintext is: a keepalive, an IP packet (from an allowed source or not), or
/// not IP.
fn classify(plain: &[u8], routes: &AllowedIps<Arc<PeerEntry>>, sender: &Arc<PeerEntry>) -> Opened {
    if plain.is_empty() {
        return Opened::Keepalive;
    }
    // The same checks as boringtun's own: a whole IPv4 or IPv6 header, and a declared length
    // that fits (what follows it is padding).
    match packet::parse_header(plain) {
        Some(header) if header.total_len <= plain.len() => Opened::Inner {
            len: header.total_len,
            allowed: routes.lookup(header.source).is_some_and(|owner| {
                Arc::ptr_eq(&owner.shared, &sender.shared)
                    || sender.config.replaces == Some(owner.config.public_key)
            }),
        },
        _ => Opened::NotIp,
    }
}

/// What goes through a batch's finished jobs in order (see [`run_jobs`]): where they are in
/// the batch, and the jobs.
pub(super) type Deliver<'d, J> = dyn FnMut(Range<usize>, &mut [J]) + 'd;

/// Runs `jobs`, whose ranges of `buffer` rise and do not overlap, on this thread or spread over
/// `helpers`. With `done`, hands them to it in order, in consecutive slices that together cover
/// `jobs`, as soon as each slice has run: this thread goes through its own share of a spread
/// batch while the helpers still run theirs.
pub(super) fn run_jobs<J: InPlace>(
    helpers: Option<&Helpers>,
    jobs: &mut [J],
    sessions: &[Arc<Session>],
    buffer: &mut [u8],
    done: Option<&mut Deliver<'_, J>>,
) {
    // Only a batch the helpers will take part in is cut into chunks: one they turn away (none
    // run, they are closed or backing off) runs and is delivered whole, as with no helpers.
    let offering = helpers
        .filter(|_| jobs.iter().map(InPlace::work).sum::<usize>() >= SPREAD_MIN_BYTES)
        .and_then(Helpers::offer);
    let Some(offering) = offering else {
        for job in jobs.iter_mut() {
            let range = job.range();
            job.run(sessions, &mut buffer[range]);
        }
        if let Some(done) = done {
            done(0..jobs.len(), jobs);
        }
        return;
    };
    // Cut the jobs, and the buffer with them, into chunks of about CHUNK_BYTES.
    let mut chunks = Vec::with_capacity(jobs.len() / 2 + 1);
    let (mut jobs, mut buffer, mut base, mut first) = (jobs, buffer, 0, 0);
    while !jobs.is_empty() {
        let (mut count, mut bytes) = (0, 0);
        while count < jobs.len() && (count == 0 || bytes < CHUNK_BYTES) {
            bytes += jobs[count].range().len();
            count += 1;
        }
        let (these, rest) = std::mem::take(&mut jobs).split_at_mut(count);
        let end = these[count - 1].range().end;
        let (region, tail) = std::mem::take(&mut buffer).split_at_mut(end - base);
        chunks.push(Mutex::new((these, region, base, first)));
        (jobs, buffer, base, first) = (rest, tail, end, first + count);
    }
    let work = |i: usize| {
        let mut chunk = chunks[i].lock();
        let (jobs, region, base, _) = &mut *chunk;
        for job in jobs.iter_mut() {
            let range = job.range();
            job.run(
                sessions,
                &mut region[range.start - *base..range.end - *base],
            );
        }
    };
    match done {
        None => offering.run(chunks.len(), &work),
        Some(done) => offering.run_in_order(chunks.len(), &work, &mut |ran| {
            for chunk in &chunks[ran] {
                let mut chunk = chunk.lock();
                let (jobs, _, _, first) = &mut *chunk;
                done(*first..*first + jobs.len(), jobs);
            }
        }),
    }
}

/// The engine's per-worker scratch for one batch's crypto, kept in the worker's
/// [`Outbox`](crate::outbox::Outbox) so that its capacity is reused from batch to batch.
#[derive(Default)]
pub(crate) struct CryptoScratch {
    /// The sessions the jobs of the batch use (consecutive jobs of one session share an entry).
    pub(super) sessions: Vec<Arc<Session>>,
    seal: Vec<SealJob<'static>>,
    open: OpenBatch<'static, 'static>,
}

impl std::fmt::Debug for CryptoScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CryptoScratch").finish_non_exhaustive()
    }
}

impl CryptoScratch {
    /// The index of `session` in [`CryptoScratch::sessions`], adding it unless it is the last.
    pub(super) fn session_index(&mut self, session: &Arc<Session>) -> usize {
        if !self
            .sessions
            .last()
            .is_some_and(|last| Arc::ptr_eq(last, session))
        {
            self.sessions.push(Arc::clone(session));
        }
        self.sessions.len() - 1
    }

    /// An empty list of seal jobs, on the capacity of the last one.
    pub(super) fn take_seal_jobs<'p>(&mut self) -> Vec<SealJob<'p>> {
        recycle(std::mem::take(&mut self.seal))
    }

    /// Keeps the capacity of `jobs` for the next batch.
    pub(super) fn keep_seal_jobs(&mut self, jobs: Vec<SealJob<'_>>) {
        self.seal = recycle(jobs);
        self.sessions.clear();
    }

    /// An empty batch of data messages to open, on the capacity of the last one.
    pub(super) fn take_open_batch<'s, 'p>(&mut self) -> OpenBatch<'s, 'p> {
        let OpenBatch { jobs, notes } = std::mem::take(&mut self.open);
        OpenBatch {
            jobs: recycle(jobs),
            notes,
        }
    }

    /// Keeps the capacity of `batch` for the next one.
    pub(super) fn keep_open_batch(&mut self, batch: OpenBatch<'_, '_>) {
        let OpenBatch { jobs, mut notes } = batch;
        notes.clear();
        self.open = OpenBatch {
            jobs: recycle(jobs),
            notes,
        };
        self.sessions.clear();
    }
}

/// A batch's data messages to open: the jobs, and the worker's notes, one for each.
#[derive(Default)]
pub(super) struct OpenBatch<'s, 'p> {
    pub(super) jobs: Vec<OpenJob<'s, 'p>>,
    pub(super) notes: Vec<OpenNote>,
}

impl<'s, 'p> OpenBatch<'s, 'p> {
    /// Adds a data message to open.
    pub(super) fn push(&mut self, job: OpenJob<'s, 'p>, note: OpenNote) {
        self.jobs.push(job);
        self.notes.push(note);
    }

    /// Forgets the messages.
    pub(super) fn clear(&mut self) {
        self.jobs.clear();
        self.notes.clear();
    }
}

/// Empties `jobs` and returns its allocation as a vector of another type of the same layout
/// (here: the same job with other lifetimes). Collecting a vector's own `into_iter` reuses its
/// allocation when the layouts match, so this allocates nothing.
fn recycle<T, U>(mut jobs: Vec<T>) -> Vec<U> {
    jobs.clear();
    jobs.into_iter().map(|_| -> U { unreachable!() }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job that fills its range of the buffer.
    struct Fill {
        range: Range<usize>,
        ran: bool,
    }

    impl InPlace for Fill {
        fn range(&self) -> Range<usize> {
            self.range.clone()
        }

        fn work(&self) -> usize {
            self.range.len()
        }

        fn run(&mut self, _: &[Arc<Session>], out: &mut [u8]) {
            out.fill(1);
            self.ran = true;
        }
    }

    /// Runs 64 jobs of 1500 bytes (96 KB, past the spreading threshold) through `run_jobs` and
    /// returns the slices they were delivered in, after checking that every job ran before its
    /// delivery and that the slices cover the batch in order.
    fn deliveries(helpers: &Helpers) -> Vec<Range<usize>> {
        let mut jobs: Vec<Fill> = (0..64)
            .map(|i| Fill {
                range: i * 1500..(i + 1) * 1500,
                ran: false,
            })
            .collect();
        let mut buffer = vec![0u8; 64 * 1500];
        let mut slices = Vec::new();
        let mut deliver = |range: Range<usize>, jobs: &mut [Fill]| {
            assert!(jobs.iter().all(|job| job.ran));
            assert_eq!(range.len(), jobs.len());
            slices.push(range);
        };
        run_jobs(
            Some(helpers),
            &mut jobs,
            &[],
            &mut buffer,
            Some(&mut deliver),
        );
        assert!(buffer.iter().all(|&b| b == 1), "every job ran");
        let mut next = 0;
        for slice in &slices {
            assert_eq!(slice.start, next, "slices in order: {slices:?}");
            next = slice.end;
        }
        assert_eq!(next, 64);
        slices
    }

    #[test]
    fn a_batch_the_helpers_turn_away_runs_and_is_delivered_whole() {
        let helpers = Helpers::start(1).unwrap();
        helpers.set_open(false);
        // Closed helpers: no chunks, one delivery of the whole batch, as with no helpers.
        assert_eq!(deliveries(&helpers), vec![0..64]);
        assert_eq!(helpers.stats().spread, 0);
        // Open: the batch is offered, cut into chunks of about CHUNK_BYTES (three jobs each),
        // and delivered chunk by chunk.
        helpers.set_open(true);
        assert_eq!(deliveries(&helpers).len(), 64usize.div_ceil(3));
        assert_eq!(helpers.stats().spread, 1);
    }
}
