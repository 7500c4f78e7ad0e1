//! The kernel's word on what changed in the cluster directory (inotify), so the backend reads
//! only the files that changed instead of listing the whole directory every
//! [`super::POLL_INTERVAL`]: with many agents sharing one directory, each of them listing it
//! five times a second costs more than everything else they do at rest.

use std::ffi::OsString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::Path;
use std::time::Duration;

/// What one wait saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Changed {
    /// Nothing, within the time waited.
    Nothing,
    /// These entries of the directory were written, created, renamed or removed.
    Names(Vec<OsString>),
    /// Something the names do not tell (the directory itself changed, or the kernel's queue
    /// overflowed): read the whole directory.
    Everything,
}

/// An inotify watch on one directory.
pub(super) struct DirWatch {
    fd: OwnedFd,
}

/// What the watch reports: an entry written and closed, created, renamed in or out, removed,
/// its attributes changed; the directory itself removed or moved.
const MASK: u32 = libc::IN_CLOSE_WRITE
    | libc::IN_CREATE
    | libc::IN_MOVED_TO
    | libc::IN_MOVED_FROM
    | libc::IN_DELETE
    | libc::IN_ATTRIB
    | libc::IN_DELETE_SELF
    | libc::IN_MOVE_SELF;

/// The fixed part of one event: watch descriptor, mask, cookie and the name's length.
const HEADER: usize = std::mem::size_of::<libc::inotify_event>();

impl DirWatch {
    /// Watches `dir`.
    pub(super) fn new(dir: &Path) -> io::Result<Self> {
        // SAFETY: inotify_init1 takes no pointer; a non-negative result is a new descriptor
        // that this value owns from here on.
        let raw = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor just opened and owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        // SAFETY: `path` is a NUL-terminated string that outlives the call.
        let wd = unsafe { libc::inotify_add_watch(fd.as_raw_fd(), path.as_ptr(), MASK) };
        if wd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd })
    }

    /// Waits up to `timeout` for changes and says what changed. An error means the watch no
    /// longer works (read the directory some other way).
    pub(super) fn wait(&self, timeout: Duration) -> io::Result<Changed> {
        let mut poll = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let millis = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd, counted as one.
        let ready = unsafe { libc::poll(&mut poll, 1, millis) };
        if ready < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::Interrupted => Ok(Changed::Nothing),
                _ => Err(e),
            };
        }
        if ready == 0 {
            return Ok(Changed::Nothing);
        }
        let mut names = Vec::new();
        let mut buf = [0u8; 16 * 1024];
        loop {
            // SAFETY: `buf` is writable for its whole length.
            let read =
                unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if read < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::WouldBlock {
                    break;
                }
                return Err(e);
            }
            match parse(&buf[..read as usize], &mut names) {
                Some(()) => {}
                None => return Ok(Changed::Everything),
            }
            if (read as usize) < buf.len() / 2 {
                break;
            }
        }
        names.sort();
        names.dedup();
        Ok(Changed::Names(names))
    }
}

/// Appends the entry names of the events in `bytes` to `names`; `None` when an event is about
/// the directory itself or the queue overflowed, so the names do not tell what changed.
fn parse(bytes: &[u8], names: &mut Vec<OsString>) -> Option<()> {
    let mut rest = bytes;
    while rest.len() >= HEADER {
        // The header's fields, read without assuming the buffer's alignment.
        let field = |at: usize| u32::from_ne_bytes(rest[at..at + 4].try_into().expect("4 bytes"));
        let mask = field(4);
        let len = field(12) as usize;
        let end = (HEADER + len).min(rest.len());
        if mask
            & (libc::IN_Q_OVERFLOW | libc::IN_DELETE_SELF | libc::IN_MOVE_SELF | libc::IN_IGNORED)
            != 0
            || len == 0
        {
            return None;
        }
        let name = &rest[HEADER..end];
        let name = &name[..name.iter().position(|b| *b == 0).unwrap_or(name.len())];
        names.push(OsString::from_vec(name.to_vec()));
        rest = &rest[end..];
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(mask: u32, name: &str) -> Vec<u8> {
        let mut padded = name.as_bytes().to_vec();
        padded.resize(name.len().div_ceil(16) * 16, 0);
        let mut out = Vec::new();
        out.extend(1i32.to_ne_bytes());
        out.extend(mask.to_ne_bytes());
        out.extend(0u32.to_ne_bytes());
        out.extend((padded.len() as u32).to_ne_bytes());
        out.extend(padded);
        out
    }

    #[test]
    fn events_name_their_entries_and_the_directory_itself_asks_for_everything() {
        let mut bytes = event(libc::IN_CLOSE_WRITE, "a.yaml");
        bytes.extend(event(libc::IN_MOVED_TO, "node-with-a-long-name.yaml"));
        let mut names = Vec::new();
        assert_eq!(parse(&bytes, &mut names), Some(()));
        assert_eq!(names, ["a.yaml", "node-with-a-long-name.yaml"]);
        assert_eq!(parse(&event(libc::IN_Q_OVERFLOW, ""), &mut names), None);
        assert_eq!(parse(&event(libc::IN_ATTRIB, ""), &mut names), None);
        assert_eq!(parse(&event(libc::IN_DELETE_SELF, ""), &mut names), None);
    }

    #[test]
    fn a_watch_reports_what_is_written_renamed_and_removed() {
        let dir = std::env::temp_dir().join(format!("kilotun-dirwatch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let watch = DirWatch::new(&dir).unwrap();
        assert_eq!(
            watch.wait(Duration::from_millis(10)).unwrap(),
            Changed::Nothing
        );
        std::fs::write(dir.join(".a.yaml.tmp"), "x").unwrap();
        std::fs::rename(dir.join(".a.yaml.tmp"), dir.join("a.yaml")).unwrap();
        std::fs::write(dir.join("b.yaml"), "y").unwrap();
        std::fs::remove_file(dir.join("b.yaml")).unwrap();
        let Changed::Names(names) = watch.wait(Duration::from_secs(5)).unwrap() else {
            panic!("names expected");
        };
        for name in ["a.yaml", "b.yaml"] {
            assert!(names.iter().any(|n| n == name), "{name} in {names:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            watch.wait(Duration::from_secs(5)).unwrap(),
            Changed::Everything,
            "the directory itself went"
        );
    }
}
