//! A Linux eventfd: one thread sleeps in `poll` on it, another wakes it. The device's threads
//! and the UAPI server block on one of these instead of waking on a timeout to check whether
//! they should stop, so an idle device makes no wake-up at all.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

/// A non-blocking eventfd used to wake a thread out of `poll`.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    /// A new eventfd (non-blocking, closed on exec).
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: eventfd returns a new descriptor or -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor we own.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// The descriptor to poll for `POLLIN`.
    pub(crate) fn fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Makes the descriptor readable, waking whoever polls it.
    pub(crate) fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(self.fd(), (&one as *const u64).cast(), 8) };
    }

    /// Consumes the wake-ups so far (the descriptor is no longer readable).
    pub(crate) fn drain(&self) {
        let mut value: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
        unsafe { libc::read(self.fd(), (&mut value as *mut u64).cast(), 8) };
    }
}

/// `poll` on `fds` for at most `timeout` (`None`: until one is ready). Returns how many are
/// ready (0 on timeout or on an interrupted call).
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Option<std::time::Duration>) -> usize {
    let millis = timeout.map_or(-1, |t| {
        // Round up, so a wait for a deadline never returns just before it.
        libc::c_int::try_from(t.as_nanos().div_ceil(1_000_000)).unwrap_or(libc::c_int::MAX)
    });
    // SAFETY: `fds` is a live, exclusively borrowed array of pollfd of the given length.
    let ready = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, millis) };
    usize::try_from(ready).unwrap_or(0)
}

/// A pollfd waiting for `fd` to be readable.
pub(crate) fn readable(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

/// A stop request that threads sleeping in `poll` see at once: a flag, and an eventfd that
/// stays readable once set (every thread polling it wakes, none drains it).
#[derive(Debug)]
pub(crate) struct StopSignal {
    flag: AtomicBool,
    waker: EventFd,
}

impl StopSignal {
    /// A signal not yet given.
    pub(crate) fn new() -> io::Result<Self> {
        Ok(Self {
            flag: AtomicBool::new(false),
            waker: EventFd::new()?,
        })
    }

    /// Asks every thread watching this signal to stop, and wakes them.
    pub(crate) fn stop(&self) {
        self.flag.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Whether [`StopSignal::stop`] was called.
    pub(crate) fn is_stopped(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// The descriptor that becomes readable on [`StopSignal::stop`], to poll beside others.
    pub(crate) fn fd(&self) -> RawFd {
        self.waker.fd()
    }
}
