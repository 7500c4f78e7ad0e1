//! The container image archive under test (`tests/real/image.rs`, `tests/real/real_kubelet/`):
//! `image/build.sh` run on the binaries this test run was built with, once per test run.
//!
//! nextest runs every test in a process of its own, so a per-process cache would build the
//! image once per test (and several builds would write the same file at once). The first test
//! of a run to need the archive builds it under an exclusive lock (`<archive>.lock`) and
//! records the run beside it (`<archive>.run`: `NEXTEST_RUN_ID`, then `ok` or the build's
//! error); the other tests of the same run wait on the lock and take the archive, or the same
//! error, without building again. Under `cargo test`, where a tier is one process, the run is
//! that process.

use std::fs::{self, File};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

const REPO: &str = env!("CARGO_MANIFEST_DIR");
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The image archive under test: `KILOTUN_IMAGE_ARCHIVE`, or
/// `target/image/kilotun-<version>.oci.tar` built once per test run by [`build`].
pub fn archive() -> Result<PathBuf, String> {
    static ARCHIVE: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    ARCHIVE
        .get_or_init(|| {
            if let Some(path) = std::env::var_os("KILOTUN_IMAGE_ARCHIVE") {
                return Ok(PathBuf::from(path));
            }
            let out = Path::new(REPO).join(format!("target/image/kilotun-{VERSION}.oci.tar"));
            once_per_run(&out, || build(&out))?;
            Ok(out)
        })
        .clone()
}

/// Builds the image into `out` with `image/build.sh`, from the binaries this test run was built
/// with (so the image holds exactly what was tested); the platforms are build.sh's default or
/// `KILOTUN_IMAGE_PLATFORMS` (`.ci/run` sets `all`).
pub fn build(out: &Path) -> Result<(), String> {
    let bins = Path::new(env!("CARGO_BIN_EXE_kg")).parent().unwrap();
    let started = Instant::now();
    let result = Command::new("bash")
        .arg(Path::new(REPO).join("image/build.sh"))
        .arg(out)
        .env("KILOTUN_BIN_DIR", bins)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running image/build.sh: {e}"))?;
    if !result.status.success() {
        return Err(format!(
            "image/build.sh failed:\n{}{}",
            String::from_utf8_lossy(&result.stdout),
            String::from_utf8_lossy(&result.stderr)
        ));
    }
    eprintln!("image/build.sh: {:.0?}", started.elapsed());
    Ok(())
}

/// `path` with `suffix` appended to its file name.
fn beside(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

/// Runs `make` (which writes `out`) unless a test of this run already did, across processes;
/// its result either way.
fn once_per_run(out: &Path, make: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    let run = std::env::var("NEXTEST_RUN_ID")
        .unwrap_or_else(|_| format!("process {}", std::process::id()));
    let dir = out.parent().unwrap();
    fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let lock_path = beside(out, ".lock");
    let lock = File::options()
        .create(true)
        .append(true)
        .open(&lock_path)
        .map_err(|e| format!("opening {}: {e}", lock_path.display()))?;
    // SAFETY: flock on a descriptor `lock` owns; the lock goes when `lock` is closed (on return,
    // or with the process).
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        let error = std::io::Error::last_os_error();
        return Err(format!("locking {}: {error}", lock_path.display()));
    }
    let stamp = beside(out, ".run");
    if let Some((first, outcome)) = fs::read_to_string(&stamp)
        .ok()
        .as_deref()
        .and_then(|text| text.split_once('\n'))
    {
        if first == run && outcome == "ok" && out.exists() {
            return Ok(());
        }
        if first == run && outcome != "ok" {
            return Err(format!("(built earlier in this run) {outcome}"));
        }
    }
    let _ = fs::remove_file(&stamp);
    let result = make();
    let outcome = result.as_ref().err().map_or("ok", String::as_str);
    fs::write(&stamp, format!("{run}\n{outcome}"))
        .map_err(|e| format!("writing {}: {e}", stamp.display()))?;
    result
}
