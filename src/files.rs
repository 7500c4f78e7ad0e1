//! Files replaced whole and atomically, with their mode set from their creation: the one way
//! kg writes a file (its key and the secrets beside it, its saved state, CNI configuration, the
//! file backend's objects).

use anyhow::Result;

/// The mode a file being replaced has now (permission bits), or `default` when it does not
/// exist, so a rewrite keeps the mode its owner gave it.
pub fn mode_or(path: &std::path::Path, default: u32) -> u32 {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::metadata(path).map_or(default, |m| m.permissions().mode() & 0o7777)
}

/// Replaces `path` with `text` so that no reader ever sees it with a mode wider than `mode`, or
/// half written: a new temporary file beside it is created exclusively (`O_EXCL`) with `mode`,
/// set to exactly `mode` before a byte is written (a narrower umask is undone, never widened
/// past `mode`), written, synced, and renamed over `path`; the directory is synced after. A
/// failure removes the temporary file.
pub fn replace(path: &std::path::Path, text: &str, mode: u32) -> Result<()> {
    write_and_rename(path, text, mode, Durability::Synced)
}

/// [`replace`] without the syncs, for a file rewritten every few seconds whose loss at a crash
/// costs nothing (the next write brings it back): the file backend's Nodes and Leases. An fsync
/// waits for every dirty page of the file system, seconds while another process writes a lot,
/// and these writes happen on kg's event loop, where such a wait costs a leader its lease.
pub fn replace_unsynced(path: &std::path::Path, text: &str, mode: u32) -> Result<()> {
    write_and_rename(path, text, mode, Durability::Unsynced)
}

/// Whether [`write_and_rename`] syncs the file and its directory.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Durability {
    Synced,
    Unsynced,
}

fn write_and_rename(
    path: &std::path::Path,
    text: &str,
    mode: u32,
    durability: Durability,
) -> Result<()> {
    use anyhow::Context as _;
    use std::io::Write as _;
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    let tmp = path.with_file_name(format!(".{name}.kg.tmp"));
    // A temporary file a crash left behind; create_new below refuses any other.
    let _ = std::fs::remove_file(&tmp);
    let written = (|| -> Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)
            .with_context(|| format!("creating {}", tmp.display()))?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("setting mode {mode:04o} on {}", tmp.display()))?;
        file.write_all(text.as_bytes())
            .with_context(|| format!("writing {}", tmp.display()))?;
        if durability == Durability::Synced {
            file.sync_all()
                .with_context(|| format!("syncing {}", tmp.display()))?;
        }
        std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
        return written;
    }
    let synced = durability == Durability::Synced;
    if let Some(dir) = path
        .parent()
        .filter(|d| synced && !d.as_os_str().is_empty())
    {
        // Best effort: the rename is durable once the directory is; a directory that cannot be
        // opened for reading changes nothing about the file's contents or mode.
        if let Ok(dir) = std::fs::File::open(dir) {
            let _ = dir.sync_all();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kilotun-files-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn mode(path: &std::path::Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn an_unsynced_replace_gives_the_same_file_and_mode() {
        let dir = scratch("unsynced");
        let path = dir.join("lease.yaml");
        replace_unsynced(&path, "one", 0o644).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
        replace_unsynced(&path, "two", mode_or(&path, 0o644)).unwrap();
        assert_eq!(
            (std::fs::read_to_string(&path).unwrap(), mode(&path)),
            ("two".into(), 0o640)
        );
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["lease.yaml"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_replaced_file_has_its_mode_and_text_and_nothing_is_left_beside_it() {
        let dir = scratch("replace");
        let path = dir.join("secret");
        replace(&path, "one", 0o600).unwrap();
        assert_eq!(
            (std::fs::read_to_string(&path).unwrap(), mode(&path)),
            ("one".into(), 0o600)
        );
        // Over a wider file, the new one is as narrow as asked.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
        replace(&path, "two", 0o600).unwrap();
        assert_eq!(
            (std::fs::read_to_string(&path).unwrap(), mode(&path)),
            ("two".into(), 0o600)
        );
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["secret"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_stale_temporary_file_is_replaced_and_a_failure_leaves_none() {
        let dir = scratch("stale");
        let path = dir.join("state");
        // A temporary file a crash left, readable by all: not reused as it is.
        let tmp = dir.join(".state.kg.tmp");
        std::fs::write(&tmp, "old").unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644)).unwrap();
        replace(&path, "new", 0o600).unwrap();
        assert_eq!(mode(&path), 0o600);
        assert!(!tmp.exists());
        // The target is a directory: the rename fails, and no temporary file stays.
        let blocked = dir.join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("inside"), "").unwrap();
        assert!(replace(&blocked, "x", 0o600).is_err());
        assert!(!dir.join(".blocked.kg.tmp").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn mode_or_reads_an_existing_files_mode() {
        let dir = scratch("mode");
        let path = dir.join("node.yaml");
        assert_eq!(mode_or(&path, 0o644), 0o644);
        std::fs::write(&path, "").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(mode_or(&path, 0o644), 0o600);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
