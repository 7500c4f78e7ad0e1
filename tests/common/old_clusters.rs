//! Kubernetes before 1.22 cannot surge a DaemonSet, so the manifests' rollout strategy is
//! refused there; `docs/rollouts.md` gives one `sed` line that rewrites it. The tests on the
//! 1.20 API server and kubelets apply the manifests through that very line, read from the page.

use std::io::Write;
use std::process::{Command, Stdio};

const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// The `sed` command `docs/rollouts.md` gives for clusters before 1.22, without its file
/// argument: it reads a manifest on its standard input.
pub fn documented_command() -> String {
    let page = std::fs::read_to_string(format!("{REPO}/docs/rollouts.md"))
        .expect("reading docs/rollouts.md");
    let line = page
        .lines()
        .find(|l| l.starts_with("sed -e '/maxSurge"))
        .expect("docs/rollouts.md gives the sed line for clusters before 1.22");
    let file = line
        .split_whitespace()
        .find(|w| w.ends_with(".yaml"))
        .unwrap_or_else(|| panic!("the sed line of docs/rollouts.md names no manifest: {line}"));
    line[..line.find(file).unwrap()].trim_end().to_string()
}

/// `manifest` (a manifest's text) as [`documented_command`] rewrites it.
pub fn before_1_22(manifest: &str) -> String {
    let command = documented_command();
    let mut child = Command::new("sh")
        .args(["-c", &command])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("running {command}: {e}"));
    let mut stdin = child.stdin.take().unwrap();
    let text = manifest.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
    let out = child.wait_with_output().expect("waiting for sed");
    writer.join().unwrap().expect("writing the manifest to sed");
    assert!(
        out.status.success(),
        "{command} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("sed's output is UTF-8")
}
