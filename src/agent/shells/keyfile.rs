//! The node's WireGuard private key on disk: base64 in a 0600 file inside a 0700 directory,
//! generated when missing or invalid. The key itself is never logged.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use anyhow::{Context, Result};
use dataplane::SecretKey;
use zeroize::Zeroizing;

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
    write_private(path, &format!("{}\n", key.expose_base64().as_str()))
}

/// The file kg keeps beside `key_file` under `suffix` (`<key-file><suffix>`): the next key,
/// the saved state and routes, the ML-KEM seed, the post-quantum keys.
pub fn beside(key_file: &Path, suffix: &str) -> std::path::PathBuf {
    let mut name = key_file.as_os_str().to_owned();
    name.push(suffix);
    name.into()
}

/// Writes `text` to `path` atomically, a file that is 0600 from its creation
/// ([`super::write_file`]).
pub(crate) fn write_private(path: &Path, text: &str) -> Result<()> {
    super::write_file(path, text, 0o600)
}

/// The files kg keeps beside `key_file` that hold secrets or what a peer must not learn: the
/// next key, the saved device state and routes (the state holds preshared keys), the ML-KEM
/// seed and the post-quantum keys.
pub const SECRET_SUFFIXES: [&str; 5] = [".next", ".state", ".routes", ".pq", ".psk"];

/// Makes every secret file beside `key_file` private: a file readable or writable by others is
/// set to 0600 and said once, with its path and the mode it had. A file that cannot be made
/// private is an error, so kg stops rather than run with a secret readable.
pub fn make_secrets_private(key_file: &Path) -> Result<()> {
    for suffix in SECRET_SUFFIXES {
        let path = beside(key_file, suffix);
        let mode = match fs::metadata(&path) {
            Ok(meta) => meta.permissions().mode() & 0o7777,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(e).with_context(|| format!("reading the mode of {}", path.display()))
            }
        };
        if mode & 0o077 != 0 {
            fs::set_permissions(&path, fs::Permissions::from_mode(0o600)).with_context(|| {
                format!(
                    "{} is mode {mode:04o} and cannot be made 0600",
                    path.display()
                )
            })?;
            tracing::warn!(path = %path.display(), mode = format!("{mode:04o}"), "a secret file was readable by others; made 0600");
        }
    }
    Ok(())
}

/// Where the next key of a rotation waits: `<key file>.next`.
pub fn next_path(path: &Path) -> std::path::PathBuf {
    beside(path, ".next")
}

/// Stores a rotation's next key beside the key (`<key file>.next`, 0600), with the
/// `kilotun.io/rotate-key` request it answers, so a restart resumes the rotation.
pub fn store_next(path: &Path, key: &SecretKey, request: Option<&str>) -> Result<()> {
    let request = request.unwrap_or("");
    if request.contains('\n') {
        anyhow::bail!("a rotation request holds a line break");
    }
    write_private(
        &next_path(path),
        &format!("{}\n{request}\n", key.expose_base64().as_str()),
    )
}

/// The next key a rotation left on disk and the request it answers, if any. A next key that
/// is unreadable, or already the key in use (`current`: the switch happened), is removed.
pub fn load_next(path: &Path, current: &SecretKey) -> Result<Option<(SecretKey, Option<String>)>> {
    let next = next_path(path);
    let text = match fs::read_to_string(&next) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("reading {}", next.display())),
    };
    let mut lines = text.lines();
    let key = lines.next().and_then(|l| SecretKey::parse(l.trim()).ok());
    let request = lines.next().map(str::trim).filter(|r| !r.is_empty());
    match key {
        Some(key) if !key.is_zero() && key.public_key() != current.public_key() => {
            Ok(Some((key, request.map(str::to_string))))
        }
        _ => {
            fs::remove_file(&next).with_context(|| format!("removing {}", next.display()))?;
            Ok(None)
        }
    }
}

/// Makes `next` the key on disk and removes the next key's file.
pub fn commit_next(path: &Path, next: &SecretKey) -> Result<()> {
    store(path, next)?;
    match fs::remove_file(next_path(path)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", next_path(path).display()))
        }
        _ => Ok(()),
    }
}

/// Loads the 64-byte ML-KEM seed at `path` (base64, 0600), or makes and stores one.
pub fn load_or_generate_seed(path: &Path) -> Result<Zeroizing<[u8; 64]>> {
    use base64::Engine as _;
    let engine = base64::engine::general_purpose::STANDARD;
    match fs::read_to_string(path).map(Zeroizing::new) {
        Ok(text) => {
            let decoded = engine.decode(text.trim()).ok().map(Zeroizing::new);
            if let Some(seed) = decoded.and_then(|d| <[u8; 64]>::try_from(d.as_slice()).ok()) {
                return Ok(Zeroizing::new(seed));
            }
            tracing::warn!(path = %path.display(), "the ML-KEM seed file holds no valid seed; making a new one");
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    }
    generate_seed(path)
}

/// Makes a new 64-byte ML-KEM seed and stores it at `path` (base64, 0600), replacing any.
pub fn generate_seed(path: &Path) -> Result<Zeroizing<[u8; 64]>> {
    use base64::Engine as _;
    let mut seed = Zeroizing::new([0u8; 64]);
    rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut *seed);
    let mut text =
        Zeroizing::new(base64::engine::general_purpose::STANDARD.encode(seed.as_slice()));
    text.push('\n');
    write_private(path, &text)?;
    Ok(seed)
}

/// When the key at `path` was written (Unix milliseconds), if that can be read.
pub fn made_ms(path: &Path) -> Option<i64> {
    let modified = fs::metadata(path).ok()?.modified().ok()?;
    let since = modified.duration_since(std::time::UNIX_EPOCH).ok()?;
    i64::try_from(since.as_millis()).ok()
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
    fn a_next_key_is_private_resumes_with_its_request_and_goes_once_committed() {
        let dir = scratch("next");
        let path = dir.join("key");
        let key = load_or_generate(&path).unwrap();
        assert!(load_next(&path, &key).unwrap().is_none());
        let next = SecretKey::generate();
        store_next(&path, &next, Some("r1")).unwrap();
        let mode = fs::metadata(next_path(&path)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let (loaded, request) = load_next(&path, &key).unwrap().unwrap();
        assert_eq!(loaded.public_key(), next.public_key());
        assert_eq!(request.as_deref(), Some("r1"));
        commit_next(&path, &next).unwrap();
        assert!(!next_path(&path).exists());
        assert_eq!(
            load_or_generate(&path).unwrap().public_key(),
            next.public_key()
        );
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        // Killed between the two writes of a commit: the next key is the key, and goes.
        store_next(&path, &next, None).unwrap();
        assert!(load_next(&path, &next).unwrap().is_none());
        assert!(!next_path(&path).exists());
        assert!(store_next(&path, &next, Some("a\nb")).is_err());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_world_readable_key_is_tightened_and_garbage_replaced() {
        let dir = scratch("perm");
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("key");
        let key = SecretKey::generate();
        fs::write(&path, key.expose_base64().as_str()).unwrap();
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

    #[test]
    fn the_secrets_beside_the_key_are_made_private_and_others_left_alone() {
        let dir = scratch("beside");
        fs::create_dir_all(&dir).unwrap();
        let key_file = dir.join("key");
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        for (suffix, was) in [(".state", 0o644), (".psk", 0o640), (".pq", 0o600)] {
            let path = beside(&key_file, suffix);
            fs::write(&path, "x").unwrap();
            fs::set_permissions(&path, fs::Permissions::from_mode(was)).unwrap();
        }
        // Not a secret of kg's: its mode stays.
        let other = dir.join("key.notes");
        fs::write(&other, "x").unwrap();
        fs::set_permissions(&other, fs::Permissions::from_mode(0o644)).unwrap();
        make_secrets_private(&key_file).unwrap();
        for suffix in [".state", ".psk", ".pq"] {
            assert_eq!(mode(&beside(&key_file, suffix)), 0o600, "{suffix}");
        }
        assert_eq!(mode(&other), 0o644);
        // Missing files are no error.
        fs::remove_file(beside(&key_file, ".state")).unwrap();
        make_secrets_private(&key_file).unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }
}
