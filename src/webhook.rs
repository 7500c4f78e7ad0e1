//! `kg webhook`: validates Peers for the API server (AdmissionReview `admission.k8s.io/v1` over
//! HTTPS, `POST /validate`), with the same checks kg applies when it reads them. Metrics
//! and `/health` are served over plain HTTP on `--listen-metrics`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use control::peer::PeerObject;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use kube::core::DynamicObject;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::TlsAcceptor;

use crate::agent::serve::http::listen_addr;
use crate::agent::serve::metrics::{encode_registry, Format, ProcessCollector};

/// How long a client may take to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// `kg webhook`'s flags (Kilo's names and defaults).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "kg webhook",
    about = "Validate Peers for the Kubernetes API server"
)]
pub struct WebhookArgs {
    /// The PEM certificate (chain) for HTTPS.
    #[arg(long)]
    pub cert_file: PathBuf,
    /// The PEM private key for HTTPS.
    #[arg(long)]
    pub key_file: PathBuf,
    /// The HTTPS address of the webhook.
    #[arg(long, default_value = ":8443")]
    pub listen: String,
    /// The HTTP address of `/metrics` and `/health`.
    #[arg(long, default_value = ":1107")]
    pub listen_metrics: String,
    /// Log level to use. Possible values: all, debug, info, warn, error, none.
    #[arg(long, default_value = "info")]
    pub log_level: String,
}

/// Why a request body is not an AdmissionReview we can answer (an HTTP 400).
#[derive(Debug, thiserror::Error)]
pub enum BadReview {
    /// The Content-Type is not `application/json`.
    #[error("Content-Type must be application/json, not {0:?}")]
    ContentType(String),
    /// The body is not AdmissionReview JSON.
    #[error("the body is not an admission.k8s.io/v1 AdmissionReview: {0}")]
    Json(String),
    /// The review has no request.
    #[error("the AdmissionReview has no request: {0}")]
    NoRequest(String),
}

/// The verdict on one AdmissionReview body: the review to send back, and whether it allowed.
pub fn review(
    content_type: &str,
    body: &[u8],
) -> Result<(AdmissionReview<DynamicObject>, bool), BadReview> {
    let media = content_type.split(';').next().unwrap_or("").trim();
    if !media.eq_ignore_ascii_case("application/json") {
        return Err(BadReview::ContentType(content_type.to_string()));
    }
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_slice(body).map_err(|e| BadReview::Json(e.to_string()))?;
    let request: AdmissionRequest<DynamicObject> =
        review
            .try_into()
            .map_err(|e: kube::core::admission::ConvertAdmissionReviewError| {
                BadReview::NoRequest(e.to_string())
            })?;
    let verdict = match request.object.as_ref() {
        None => Err("the request carries no Peer object".to_string()),
        Some(object) => serde_json::to_value(object)
            .and_then(serde_json::from_value::<PeerObject>)
            .map_err(|e| format!("not a Peer: {e}"))
            .and_then(|peer| peer.validate().map_err(|e| e.to_string())),
    };
    let response = AdmissionResponse::from(&request);
    Ok(match verdict {
        Ok(()) => (response.into_review(), true),
        Err(message) => (response.deny(message).into_review(), false),
    })
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

struct WebhookState {
    requests: Family<ResultLabel, Counter>,
    registry: Registry,
}

impl WebhookState {
    fn new() -> Self {
        let requests = Family::<ResultLabel, Counter>::default();
        // Every result from the start, at 0, so rates over them have a series at once.
        for result in ["allowed", "denied", "invalid"] {
            requests.get_or_create(&ResultLabel { result }).inc_by(0);
        }
        let mut registry = Registry::default();
        registry.register(
            "kilo_peer_validation_requests",
            "Peer validation requests by result: allowed, denied or invalid",
            requests.clone(),
        );
        registry.register_collector(Box::new(ProcessCollector));
        Self { requests, registry }
    }

    fn count(&self, result: &'static str) {
        self.requests.get_or_create(&ResultLabel { result }).inc();
    }
}

async fn validate(
    State(state): State<Arc<WebhookState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    match review(content_type, &body) {
        Ok((answer, allowed)) => {
            state.count(if allowed { "allowed" } else { "denied" });
            match serde_json::to_vec(&answer) {
                Ok(bytes) => ([(header::CONTENT_TYPE, "application/json")], bytes).into_response(),
                Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
            }
        }
        Err(e) => {
            state.count("invalid");
            tracing::warn!(error = %e, "rejected a malformed admission request");
            (StatusCode::BAD_REQUEST, e.to_string()).into_response()
        }
    }
}

/// `/metrics`: OpenMetrics when the scraper asks for it, the 0.0.4 text format otherwise.
async fn metrics(State(state): State<Arc<WebhookState>>, headers: HeaderMap) -> Response {
    let format = Format::negotiate(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()));
    (
        [(header::CONTENT_TYPE, format.content_type())],
        encode_registry(&state.registry, format),
    )
        .into_response()
}

/// Reads a PEM certificate chain and private key into a TLS server configuration.
pub fn tls_config(cert_file: &Path, key_file: &Path) -> Result<ServerConfig> {
    let certs = CertificateDer::pem_file_iter(cert_file)
        .with_context(|| format!("--cert-file {}: cannot read", cert_file.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("--cert-file {}: not PEM certificates", cert_file.display()))?;
    if certs.is_empty() {
        anyhow::bail!("--cert-file {}: no certificate in it", cert_file.display());
    }
    let key = PrivateKeyDer::from_pem_file(key_file)
        .with_context(|| format!("--key-file {}: no PEM private key", key_file.display()))?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("the certificate does not match the private key")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The addresses the webhook listens on, once bound.
#[derive(Debug, Clone, Copy)]
pub struct Bound {
    /// HTTPS (`/validate`).
    pub webhook: std::net::SocketAddr,
    /// HTTP (`/metrics`, `/health`).
    pub metrics: std::net::SocketAddr,
}

/// Binds both listeners and serves in the background.
pub async fn start(args: &WebhookArgs) -> Result<Bound> {
    let tls = TlsAcceptor::from(Arc::new(tls_config(&args.cert_file, &args.key_file)?));
    let state = Arc::new(WebhookState::new());
    let webhook_listener = TcpListener::bind(listen_addr(&args.listen)?)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let metrics_listener = TcpListener::bind(listen_addr(&args.listen_metrics)?)
        .await
        .with_context(|| format!("listening on {}", args.listen_metrics))?;
    let bound = Bound {
        webhook: webhook_listener.local_addr()?,
        metrics: metrics_listener.local_addr()?,
    };
    let webhook_app = Router::new()
        .route("/validate", post(validate))
        .with_state(state.clone());
    let metrics_app = Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/metrics", get(metrics))
        .with_state(state);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(metrics_listener, metrics_app).await {
            tracing::error!(error = %e, "the metrics server stopped");
        }
    });
    tokio::spawn(serve_tls(webhook_listener, tls, webhook_app));
    Ok(bound)
}

async fn serve_tls(listener: TcpListener, tls: TlsAcceptor, app: Router) {
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!(error = %e, "accepting a webhook connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let tls = tls.clone();
        let app = app.clone();
        tokio::spawn(async move {
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(tcp)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let service = hyper_util::service::TowerToHyperService::new(app);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await
            {
                tracing::debug!(%peer, error = %e, "webhook connection ended with an error");
            }
        });
    }
}

/// Runs the webhook until SIGTERM or SIGINT.
pub async fn run(args: WebhookArgs) -> Result<()> {
    let bound = start(&args).await?;
    tracing::info!(webhook = %bound.webhook, metrics = %bound.metrics, "validating Peers");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests;
