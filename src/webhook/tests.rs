use std::sync::Arc;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

use super::*;

const KEY: &str = "GfCEvHxSHGbi97vnMv+Gu6MTRr3EemKPBMkQJZfdVzo=";

fn admission_review(spec: Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "kilo.squat.ai", "version": "v1alpha1", "kind": "Peer"},
            "resource": {"group": "kilo.squat.ai", "version": "v1alpha1", "resource": "peers"},
            "name": "laptop",
            "operation": "CREATE",
            "userInfo": {"username": "admin"},
            "object": {
                "apiVersion": "kilo.squat.ai/v1alpha1",
                "kind": "Peer",
                "metadata": {"name": "laptop"},
                "spec": spec,
            },
            "dryRun": false
        }
    })
}

fn verdict(spec: Value) -> (bool, Value) {
    let body = serde_json::to_vec(&admission_review(spec)).unwrap();
    let (answer, allowed) = review("application/json", &body).unwrap();
    (allowed, serde_json::to_value(answer).unwrap())
}

#[test]
fn a_valid_peer_is_allowed_with_the_request_uid() {
    let (allowed, answer) = verdict(json!({
        "allowedIPs": ["10.5.0.1/32"],
        "publicKey": KEY,
        "persistentKeepalive": 10,
        "endpoint": {"dnsOrIP": {"ip": "192.0.2.1"}, "port": 51820}
    }));
    assert!(allowed);
    assert_eq!(answer["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(
        answer["response"]["uid"],
        "705ab4f5-6393-11e8-b7cc-42010a800002"
    );
    assert_eq!(answer["response"]["allowed"], true);
}

#[test]
fn no_answer_holds_the_peers_preshared_key() {
    let psk = "q0RBtsx1Zq3uZ6y4+dU1Vx8kEwXt2H5Vb4LJq1mKq2Q=";
    let hex_psk = hex::encode(
        base64::Engine::decode(&base64::engine::general_purpose::STANDARD, psk).unwrap(),
    );
    for (spec, allowed) in [
        (
            json!({"allowedIPs": ["10.5.0.1/32"], "publicKey": KEY, "presharedKey": psk}),
            true,
        ),
        (
            json!({"allowedIPs": ["nope"], "publicKey": KEY, "presharedKey": psk}),
            false,
        ),
        (
            json!({"allowedIPs": ["10.5.0.1/32"], "publicKey": "short", "presharedKey": psk}),
            false,
        ),
        // A preshared key one character short: refused, and not echoed either.
        (
            json!({"allowedIPs": ["10.5.0.1/32"], "publicKey": KEY, "presharedKey": &psk[1..]}),
            false,
        ),
    ] {
        let (was_allowed, answer) = verdict(spec);
        assert_eq!(was_allowed, allowed, "{answer}");
        let text = answer.to_string();
        assert!(
            !text.contains(&psk[1..]) && !text.contains(&hex_psk),
            "{text}"
        );
    }
}

#[test]
fn each_invalid_field_is_denied_with_its_name_in_the_message() {
    let cases = [
        (
            json!({"allowedIPs": ["10.5.0.1/33"], "publicKey": KEY}),
            "allowedIPs",
        ),
        (
            json!({"allowedIPs": ["10.5.0.1/32"], "publicKey": "short"}),
            "publicKey",
        ),
        (
            json!({"allowedIPs": [], "publicKey": KEY, "persistentKeepalive": -1}),
            "persistentKeepalive",
        ),
        (
            json!({"allowedIPs": [], "publicKey": KEY,
                   "endpoint": {"dnsOrIP": {"ip": "192.0.2.1"}, "port": 70000}}),
            "endpoint.port",
        ),
        (
            json!({"allowedIPs": [], "publicKey": KEY,
                   "endpoint": {"dnsOrIP": {"dns": "not a name"}, "port": 1}}),
            "endpoint.dnsOrIP.dns",
        ),
        (
            json!({"allowedIPs": [], "publicKey": KEY, "endpoint": {"dnsOrIP": {}, "port": 1}}),
            "endpoint",
        ),
        (
            json!({"allowedIPs": "10.0.0.0/8", "publicKey": KEY}),
            "not a Peer",
        ),
    ];
    for (spec, field) in cases {
        let (allowed, answer) = verdict(spec.clone());
        assert!(!allowed, "{spec} was allowed");
        assert_eq!(answer["response"]["allowed"], false);
        let message = answer["response"]["status"]["message"].as_str().unwrap();
        assert!(
            message.contains(field),
            "{spec}: {message:?} names no {field}"
        );
    }
}

#[test]
fn malformed_requests_are_bad_requests() {
    let body = serde_json::to_vec(&admission_review(json!({}))).unwrap();
    assert!(matches!(
        review("text/plain", &body),
        Err(BadReview::ContentType(_))
    ));
    assert!(matches!(
        review("application/json", b"{not json"),
        Err(BadReview::Json(_))
    ));
    let no_request = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"});
    assert!(matches!(
        review("application/json", no_request.to_string().as_bytes()),
        Err(BadReview::NoRequest(_))
    ));
    // A charset parameter is fine.
    assert!(review("application/json; charset=utf-8", &body).is_ok());
}

/// One HTTP/1.1 request over TLS, trusting only `ca`: (status, body).
async fn https(
    addr: std::net::SocketAddr,
    ca: &rcgen::Certificate,
    request: String,
) -> (u16, String) {
    let mut roots = RootCertStore::empty();
    roots.add(ca.der().clone()).unwrap();
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls_pki_types::ServerName::try_from("peer-validation.kilo.svc").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut bytes = Vec::new();
    tls.read_to_end(&mut bytes).await.unwrap();
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let status = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = text.split_once("\r\n\r\n").unwrap().1.to_string();
    (status, body)
}

fn post(content_type: &str, body: &str) -> String {
    format!(
        "POST /validate HTTP/1.1\r\nHost: peer-validation.kilo.svc\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test]
async fn the_webhook_answers_over_https_and_counts_verdicts() {
    let certified =
        rcgen::generate_simple_self_signed(vec!["peer-validation.kilo.svc".into()]).unwrap();
    let dir = std::env::temp_dir().join(format!("kilotun-webhook-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cert_file = dir.join("cert");
    let key_file = dir.join("key");
    std::fs::write(&cert_file, certified.cert.pem()).unwrap();
    std::fs::write(&key_file, certified.key_pair.serialize_pem()).unwrap();
    let args = WebhookArgs {
        cert_file,
        key_file,
        listen: "127.0.0.1:0".into(),
        listen_metrics: "127.0.0.1:0".into(),
        log_level: "info".into(),
    };
    let bound = start(&args).await.unwrap();

    let good = admission_review(json!({"allowedIPs": ["10.5.0.1/32"], "publicKey": KEY}));
    let (status, body) = https(
        bound.webhook,
        &certified.cert,
        post("application/json", &good.to_string()),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["response"]["allowed"], true);

    let bad = admission_review(json!({"allowedIPs": ["nope"], "publicKey": KEY}));
    let (status, body) = https(
        bound.webhook,
        &certified.cert,
        post("application/json", &bad.to_string()),
    )
    .await;
    assert_eq!(status, 200);
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["response"]["allowed"], false);
    assert!(answer["response"]["status"]["message"]
        .as_str()
        .unwrap()
        .contains("\"nope\""));

    let (status, body) = https(
        bound.webhook,
        &certified.cert,
        post("text/plain", &good.to_string()),
    )
    .await;
    assert_eq!(status, 400);
    assert!(body.contains("application/json"), "{body}");

    let metrics = plain_get(bound.metrics, "/metrics").await;
    for line in [
        "kilo_peer_validation_requests_total{result=\"allowed\"} 1",
        "kilo_peer_validation_requests_total{result=\"denied\"} 1",
        "kilo_peer_validation_requests_total{result=\"invalid\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} missing from:\n{metrics}");
    }
    let health = plain_get(bound.metrics, "/health").await;
    assert!(health.starts_with("HTTP/1.0 200 OK"), "{health}");
    std::fs::remove_dir_all(dir).unwrap();
}

/// A plain-HTTP GET: the whole response text.
async fn plain_get(addr: std::net::SocketAddr, path: &str) -> String {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(format!("GET {path} HTTP/1.0\r\nHost: kg\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut bytes = Vec::new();
    tcp.read_to_end(&mut bytes).await.unwrap();
    String::from_utf8(bytes).unwrap()
}

#[test]
fn a_key_that_does_not_match_the_certificate_is_refused_at_start() {
    let a = rcgen::generate_simple_self_signed(vec!["a".into()]).unwrap();
    let b = rcgen::generate_simple_self_signed(vec!["b".into()]).unwrap();
    let dir = std::env::temp_dir().join(format!("kilotun-webhook-mismatch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("cert"), a.cert.pem()).unwrap();
    std::fs::write(dir.join("key"), b.key_pair.serialize_pem()).unwrap();
    std::fs::write(dir.join("empty"), "").unwrap();
    let error = tls_config(&dir.join("cert"), &dir.join("key")).unwrap_err();
    assert!(format!("{error:#}").contains("does not match"), "{error:#}");
    let error = tls_config(&dir.join("empty"), &dir.join("key")).unwrap_err();
    assert!(format!("{error:#}").contains("--cert-file"), "{error:#}");
    let error = tls_config(&dir.join("cert"), &dir.join("empty")).unwrap_err();
    assert!(format!("{error:#}").contains("--key-file"), "{error:#}");
    std::fs::remove_dir_all(dir).unwrap();
}
