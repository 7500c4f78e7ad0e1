//! The Peer webhook as a test meets it, whichever cluster runs it: its self-signed serving
//! certificate, a Peer's YAML, and the wait for the API server to refuse one.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::{Duration, Instant};

/// A self-signed serving certificate (its own CA bundle) for the common name `cn` and the
/// subject alternative names `san` (`DNS:…`, `IP:…`), written in `dir`: (cert, key).
pub fn self_signed_cert(dir: &Path, cn: &str, san: &str) -> (PathBuf, PathBuf) {
    let (cert, key) = (dir.join("webhook.crt"), dir.join("webhook.key"));
    super::run(&[
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-sha256",
        "-days",
        "1",
        "-subj",
        &format!("/CN={cn}"),
        "-addext",
        &format!("subjectAltName={san}"),
        "-keyout",
        key.to_str().unwrap(),
        "-out",
        cert.to_str().unwrap(),
    ]);
    (cert, key)
}

/// A Peer named `name` with public key `key`, one allowed IP and a 10 s keepalive.
pub fn peer_yaml(name: &str, key: &str, allowed: &str) -> String {
    format!(
        "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: {name}\nspec:\n  \
         allowedIPs:\n  - {allowed}\n  publicKey: {key}\n  persistentKeepalive: 10\n"
    )
}

/// Applies `yaml` (Peer `name`) with `apply` until the webhook refuses it, for up to `within`
/// (the API server may take a moment to use a new webhook configuration), deleting with
/// `delete` whatever got through meanwhile; the refusal must name `field`. Returns it.
pub fn refused_by_webhook(
    name: &str,
    yaml: &str,
    field: &str,
    within: Duration,
    apply: impl Fn(&str) -> Output,
    delete: impl Fn(&str),
) -> String {
    let deadline = Instant::now() + within;
    loop {
        let out = apply(yaml);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() && stderr.contains("denied the request") {
            assert!(stderr.contains(field), "{name}: {stderr}");
            return stderr;
        }
        delete(name);
        assert!(
            Instant::now() < deadline,
            "{name} was not refused by the webhook: {stderr}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}
