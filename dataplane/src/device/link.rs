//! The TUN link's health as the workers see it. A link deleted under the device (`ip link del`)
//! detaches every queue for good: each worker ends at once and the loss is reported. Any other
//! failure of a queue is retried every [`RETRY_PAUSE`], up to [`MAX_FAILURES`] times in a row,
//! then reported too. The device never stops itself: its owner watches
//! [`super::Device::link_lost`] (or polls [`super::Device::link_lost_fd`]) and decides.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use parking_lot::Mutex;

use crate::eventfd::EventFd;

/// Pause between two reads of a queue that failed while still attached to its link.
pub const RETRY_PAUSE: Duration = Duration::from_millis(100);
/// Failed reads in a row (about 3 s at [`RETRY_PAUSE`]) after which a queue that is still
/// attached is given up as [`LinkLost::Failed`].
pub const MAX_FAILURES: u32 = 30;

/// Why a device's TUN link stopped carrying packets.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LinkLost {
    /// The link was deleted (`ip link del`, or its namespace went away): its queues are
    /// detached for good, and a link made again under the name is another link.
    #[error("the TUN link was deleted")]
    Deleted,
    /// A queue kept failing while still attached to the link.
    #[error("TUN queue {queue} failed {failures} times in a row, the last with: {error}")]
    Failed {
        /// The worker's queue.
        queue: usize,
        /// Failed reads in a row.
        failures: u32,
        /// The last error.
        error: String,
    },
}

/// The first loss any worker reports, kept, and an eventfd readable from then on.
#[derive(Debug)]
pub(super) struct LossLatch {
    lost: Mutex<Option<LinkLost>>,
    event: EventFd,
}

impl LossLatch {
    pub(super) fn new() -> io::Result<Self> {
        Ok(Self {
            lost: Mutex::new(None),
            event: EventFd::new()?,
        })
    }

    /// Keeps `loss` unless one was reported before; true when it is the first.
    pub(super) fn report(&self, loss: LinkLost) -> bool {
        let mut lost = self.lost.lock();
        if lost.is_some() {
            return false;
        }
        *lost = Some(loss);
        // Never drained: the descriptor stays readable for every later poll.
        self.event.wake();
        true
    }

    pub(super) fn get(&self) -> Option<LinkLost> {
        self.lost.lock().clone()
    }

    pub(super) fn fd(&self) -> RawFd {
        self.event.fd()
    }
}

/// What a worker does after a failed read of its queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Pause [`RETRY_PAUSE`] and read again.
    Retry,
    /// Give the queue up and report this.
    Lost(LinkLost),
}

/// One worker's count of the failed reads of its queue in a row.
#[derive(Debug)]
pub(super) struct QueueHealth {
    queue: usize,
    failures: u32,
}

impl QueueHealth {
    pub(super) fn new(queue: usize) -> Self {
        Self { queue, failures: 0 }
    }

    /// A read succeeded.
    pub(super) fn ok(&mut self) {
        if self.failures > 0 {
            tracing::info!(
                queue = self.queue,
                failures = self.failures,
                "the TUN queue reads again"
            );
            self.failures = 0;
        }
    }

    /// A read failed with `error`; `attached` says whether the queue still belongs to a link
    /// (`TUNGETIFF` answers `EBADFD` once the link is deleted).
    pub(super) fn failed(&mut self, attached: io::Result<bool>, error: &io::Error) -> Verdict {
        if matches!(attached, Ok(false)) {
            return Verdict::Lost(LinkLost::Deleted);
        }
        self.failures += 1;
        if self.failures >= MAX_FAILURES {
            let loss = LinkLost::Failed {
                queue: self.queue,
                failures: self.failures,
                error: error.to_string(),
            };
            tracing::error!(queue = self.queue, "{loss}: giving the TUN queue up");
            return Verdict::Lost(loss);
        }
        if self.failures == 1 {
            tracing::warn!(
                queue = self.queue,
                error = %error,
                "reading the TUN queue failed; retrying every {} ms, up to {MAX_FAILURES} times",
                RETRY_PAUSE.as_millis()
            );
        }
        Verdict::Retry
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_detached_queue_is_a_deleted_link_at_once() {
        let mut health = QueueHealth::new(0);
        let err = io::Error::from_raw_os_error(libc::EBADFD);
        assert_eq!(
            health.failed(Ok(false), &err),
            Verdict::Lost(LinkLost::Deleted)
        );
    }

    #[test]
    fn an_attached_queue_is_retried_up_to_the_bound_and_a_success_resets_it() {
        let mut health = QueueHealth::new(3);
        let err = io::Error::from_raw_os_error(libc::EIO);
        for _ in 1..MAX_FAILURES {
            assert_eq!(health.failed(Ok(true), &err), Verdict::Retry);
        }
        health.ok();
        for _ in 1..MAX_FAILURES {
            assert_eq!(
                health.failed(Err(io::Error::other("x")), &err),
                Verdict::Retry
            );
        }
        match health.failed(Ok(true), &err) {
            Verdict::Lost(LinkLost::Failed {
                queue, failures, ..
            }) => assert_eq!((queue, failures), (3, MAX_FAILURES)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_first_loss_is_kept_and_its_descriptor_stays_readable() {
        let latch = LossLatch::new().unwrap();
        assert_eq!(latch.get(), None);
        assert!(latch.report(LinkLost::Deleted));
        assert!(!latch.report(LinkLost::Failed {
            queue: 0,
            failures: 1,
            error: String::new()
        }));
        assert_eq!(latch.get(), Some(LinkLost::Deleted));
        for _ in 0..2 {
            let mut fds = [crate::eventfd::readable(latch.fd())];
            assert_eq!(crate::eventfd::poll(&mut fds, Some(Duration::ZERO)), 1);
        }
    }
}
