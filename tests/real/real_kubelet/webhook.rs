//! `manifests/peer-validation.yaml` as shipped, its webhook a pod in the pod network: the API
//! server calls it through its Service (the endpoints: `scripts/kubelet-cluster.sh` starts the
//! API server with `--enable-aggregator-routing` and routes the pod CIDRs from the host, as
//! there is no kube-proxy here), and a bad Peer is refused naming the field while a good one is
//! accepted. Only the TLS secret and the configuration's CA bundle are made by the test: the
//! manifest's kube-webhook-certgen Jobs run an image from a registry, which this machine cannot
//! pull.

use std::fs;
use std::time::{Duration, Instant};

use base64::Engine as _;

use super::common::webhook::{peer_yaml as peer, refused_by_webhook, self_signed_cert};
use super::{manifest, KubeletCluster};

/// The manifest's documents but its certgen Jobs (and their account and roles).
fn without_certgen(text: &str) -> String {
    text.split("\n---\n")
        .filter(|doc| {
            !doc.lines()
                .any(|l| l.trim().starts_with("name: kube-webhook-certgen"))
        })
        .collect::<Vec<_>>()
        .join("\n---\n")
}

/// Installs the webhook, waits for its pod, and checks what the API server makes of Peers.
pub(crate) fn the_webhook_pod_validates_peers(k: &KubeletCluster) {
    let started = Instant::now();
    let work = k.dir.join("webhook");
    fs::create_dir_all(&work).unwrap();
    let (cert, key) = self_signed_cert(
        &work,
        "peer-validation.kilo.svc",
        "DNS:peer-validation.kilo.svc,DNS:peer-validation",
    );
    let text = without_certgen(&manifest("peer-validation.yaml"));
    k.apply(&text);
    k.kubectl_ok(&[
        "-n",
        "kilo",
        "create",
        "secret",
        "generic",
        "peer-validation-webhook-tls",
        &format!("--from-file=cert={}", cert.display()),
        &format!("--from-file=key={}", key.display()),
    ]);
    let ca = base64::engine::general_purpose::STANDARD.encode(fs::read(&cert).unwrap());
    k.kubectl_ok(&[
        "patch",
        "validatingwebhookconfiguration",
        "peer-validation",
        "--type=json",
        "-p",
        &format!(r#"[{{"op":"add","path":"/webhooks/0/clientConfig/caBundle","value":"{ca}"}}]"#),
    ]);
    k.rollout_status("kilo", "deployment/peer-validation", "180s");
    let pod_ip = k.kubectl_ok(&[
        "-n",
        "kilo",
        "get",
        "pods",
        "-l",
        "app.kubernetes.io/name=peer-validation",
        "-o",
        "jsonpath={.items[0].status.podIP}",
    ]);
    eprintln!(
        "peer-validation: webhook pod Ready at {} after {:.1?}",
        pod_ip.trim(),
        started.elapsed()
    );

    // Refused, naming the field.
    let refuse = |name: &str, yaml: &str, field: &str| {
        refused_by_webhook(
            name,
            yaml,
            field,
            Duration::from_secs(30),
            |yaml| k.kubectl_with_input(&["apply", "-f", "-"], yaml),
            |name| {
                let _ = k.kubectl(&["delete", "peer", name, "--ignore-not-found"]);
            },
        )
    };
    let bad_key = refuse(
        "badkey",
        &peer("badkey", "notakey", "10.5.0.1/32"),
        "publicKey",
    );
    refuse(
        "badip",
        &peer(
            "badip",
            "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
            "10.5.0.1/33",
        ),
        "allowedIPs",
    );
    eprintln!("peer-validation: refused {}", bad_key.trim());
    // A good Peer passes the same webhook (failurePolicy Fail: had the API server not reached
    // the pod, this would fail too).
    let good = k.kubectl_with_input(
        &["apply", "-f", "-"],
        &peer(
            "goodpeer",
            "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=",
            "10.5.0.1/32",
        ),
    );
    assert!(
        good.status.success(),
        "a valid Peer was refused: {}",
        String::from_utf8_lossy(&good.stderr)
    );
    k.kubectl_ok(&["get", "peer", "goodpeer"]);
    k.kubectl_ok(&["delete", "peer", "goodpeer"]);
}
