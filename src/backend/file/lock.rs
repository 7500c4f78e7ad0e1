//! The directory lock (an exclusive `flock` on `.kilotun.lock`) and atomic writes by rename,
//! so kg processes sharing the directory never lose each other's writes.

use std::fs;
use std::os::fd::AsRawFd;
use std::path::Path;

use anyhow::{Context, Result};

const LOCK_FILE: &str = ".kilotun.lock";

/// An exclusive `flock` held until dropped.
pub(super) struct DirLock(fs::File);

impl DirLock {
    pub(super) fn acquire(dir: &Path) -> Result<Self> {
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(LOCK_FILE))
            .with_context(|| format!("opening the lock file in {}", dir.display()))?;
        // SAFETY: flock on a valid open descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error()).context("locking the cluster directory");
        }
        Ok(Self(file))
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // SAFETY: unlocking the descriptor we locked.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Replaces `path` with `text` atomically, keeping the mode the file has (0644 for a new one):
/// an owner who made a file private keeps it private across kg's rewrites. Not synced
/// ([`crate::files::replace_unsynced`]): these are rewritten every lease period and check-in.
pub(super) fn write_atomically(path: &Path, text: &str) -> Result<()> {
    crate::files::replace_unsynced(path, text, crate::files::mode_or(path, 0o644))
}
