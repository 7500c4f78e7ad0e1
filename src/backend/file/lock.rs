//! The directory lock (an exclusive `flock` on `.kilotun.lock`) and atomic writes by rename,
//! so kg processes sharing the directory never lose each other's writes.

use std::fs;
use std::io::Write as _;
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

/// Writes `text` to `path` through a temporary file and a rename.
pub(super) fn write_atomically(path: &Path, text: &str) -> Result<()> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let mut file = fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    file.write_all(text.as_bytes())?;
    file.sync_all()?;
    fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    Ok(())
}
