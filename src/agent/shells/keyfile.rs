//! The node's WireGuard private key on disk: base64 in a 0600 file inside a 0700 directory,
//! generated when missing or invalid. The key itself is never logged.

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use anyhow::{Context, Result};
use dataplane::SecretKey;

/// Loads the private key at `path`, or generates and stores one.
pub fn load_or_generate(path: &Path) -> Result<SecretKey> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if !dir.exists() {
            fs::create_dir_all(dir)
                .with_context(|| format!("creating key directory {}", dir.display()))?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
                .with_context(|| format!("setting mode 0700 on {}", dir.display()))?;
        }
    }
    match fs::read_to_string(path) {
        Ok(text) => {
            let mode = fs::metadata(path)?.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                tracing::warn!(path = %path.display(), mode = format!("{mode:04o}"), "private key file was readable by others; tightened to 0600");
                fs::set_permissions(path, fs::Permissions::from_mode(0o600))
                    .with_context(|| format!("setting mode 0600 on {}", path.display()))?;
            }
            match SecretKey::parse(text.trim()) {
                Ok(key) if !key.is_zero() => return Ok(key),
                _ => {
                    tracing::warn!(path = %path.display(), "private key file holds no valid key; generating a new one")
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            tracing::info!(path = %path.display(), "no private key yet; generating one");
        }
        Err(e) => return Err(e).with_context(|| format!("reading private key {}", path.display())),
    }
    let key = SecretKey::generate();
    store(path, &key)?;
    Ok(key)
}

/// Writes `key` atomically with mode 0600.
fn store(path: &Path, key: &SecretKey) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    writeln!(file, "{}", key.to_base64())?;
    file.sync_all()?;
    fs::rename(&tmp, path).with_context(|| format!("storing private key {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("kilotun-keyfile-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_missing_key_is_generated_private_and_then_reused() {
        let dir = scratch("gen");
        let path = dir.join("kilo").join("key");
        let key = load_or_generate(&path).unwrap();
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(
            fs::metadata(path.parent().unwrap())
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o700
        );
        let again = load_or_generate(&path).unwrap();
        assert_eq!(key.public_key(), again.public_key());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_world_readable_key_is_tightened_and_garbage_replaced() {
        let dir = scratch("perm");
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("key");
        let key = SecretKey::generate();
        fs::write(&path, key.to_base64()).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o644)).unwrap();
        let loaded = load_or_generate(&path).unwrap();
        assert_eq!(loaded.public_key(), key.public_key());
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        fs::write(&path, "garbage").unwrap();
        let fresh = load_or_generate(&path).unwrap();
        assert_ne!(fresh.public_key(), key.public_key());
        fs::remove_dir_all(&dir).unwrap();
    }
}
