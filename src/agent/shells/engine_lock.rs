//! One engine per interface per node: the kg that runs the embedded engine of `kilo0` holds an
//! exclusive `flock` on `<socket-dir>/kilo0.lock` (the directory the UAPI socket lives in,
//! shared by every kg pod of the node) for as long as it lives.
//!
//! This is what makes a surge rollout (`maxSurge` on the DaemonSet, Kubernetes 1.22 and later)
//! a handover rather than a fight: the new pod's kg starts while the old one still forwards,
//! finds the lock held, and stands by (its `/health` answers, so the pod turns Ready and the
//! DaemonSet controller stops the old pod). The old kg exits, the kernel releases the lock, and
//! the new kg takes the link, the port and the saved peers in the same instant, handshaking
//! with every peer at once. Without surge the lock is simply free.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// The lock file of interface `interface` under `socket_dir`.
pub fn path(socket_dir: &Path, interface: &str) -> PathBuf {
    socket_dir.join(format!("{interface}.lock"))
}

/// An open lock file, held or not.
#[derive(Debug)]
pub struct EngineLock {
    file: File,
    path: PathBuf,
}

impl EngineLock {
    /// Opens (creating it, mode 0600) the lock file of `interface` under `socket_dir`.
    pub fn open(socket_dir: &Path, interface: &str) -> Result<Self> {
        std::fs::create_dir_all(socket_dir)
            .with_context(|| format!("creating {}", socket_dir.display()))?;
        let path = path(socket_dir, interface);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Self { file, path })
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Takes the lock if nobody holds it. Returns false when another process does.
    pub fn try_lock(&mut self) -> Result<bool> {
        match flock(&self.file, libc::LOCK_EX | libc::LOCK_NB) {
            Ok(()) => {
                self.record_holder();
                Ok(true)
            }
            Err(e) if e.raw_os_error() == Some(libc::EWOULDBLOCK) => Ok(false),
            Err(e) => Err(e).with_context(|| format!("locking {}", self.path.display())),
        }
    }

    /// Waits until the lock is free and takes it (a blocking call: run it off the runtime).
    pub fn lock(mut self) -> Result<Self> {
        loop {
            match flock(&self.file, libc::LOCK_EX) {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(e).with_context(|| format!("locking {}", self.path.display()))
                }
            }
        }
        self.record_holder();
        Ok(self)
    }

    /// The process id the holder wrote into the file, if it wrote one.
    pub fn holder(&mut self) -> Option<u32> {
        let mut text = String::new();
        self.file.rewind().ok()?;
        self.file.read_to_string(&mut text).ok()?;
        text.trim().parse().ok()
    }

    /// Writes this process's id into the file, for the next kg's log (best effort: the lock,
    /// not the text, is what counts).
    fn record_holder(&mut self) {
        let pid = std::process::id();
        let _ = self
            .file
            .set_len(0)
            .and_then(|()| self.file.rewind())
            .and_then(|()| writeln!(self.file, "{pid}"));
    }
}

fn flock(file: &File, operation: libc::c_int) -> std::io::Result<()> {
    // SAFETY: flock on a descriptor this process owns; no memory is passed.
    if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_waits_until_the_first_lets_go() {
        let dir = std::env::temp_dir().join(format!("kilotun-lock-{}", std::process::id()));
        let mut first = EngineLock::open(&dir, "kilo9").unwrap();
        assert!(first.try_lock().unwrap());
        // flock locks belong to the open file description: a second open is a second holder,
        // as another process would be.
        let mut second = EngineLock::open(&dir, "kilo9").unwrap();
        assert!(!second.try_lock().unwrap());
        assert_eq!(second.holder(), Some(std::process::id()));
        let waiter = std::thread::spawn(move || second.lock().map(|_| ()));
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!waiter.is_finished(), "took a held lock");
        drop(first);
        waiter.join().unwrap().unwrap();
        // Another interface has its own lock.
        let mut other = EngineLock::open(&dir, "kilo8").unwrap();
        assert!(other.try_lock().unwrap());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
