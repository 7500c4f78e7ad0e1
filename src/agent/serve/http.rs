//! kg's HTTP endpoints on `--listen`: Kilo's `/health`, `/metrics` and `/graph`, and kilotun's
//! `/status` (this node as kg sees it, JSON, read by `kgctl diagnose`).

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{Context, Result};
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use parking_lot::Mutex;
use serde::Deserialize;

use super::metrics::{Format, Metrics, WireGuardScrape};
use super::status::StatusBoard;
use crate::agent::shells::firewall::HostFirewall;
use crate::agent::shells::netlink::Netlink;
use crate::agent::shells::wireguard::WireGuard;

/// What `/graph` draws: the last topology and the CIDRs it withholds, drawn only when asked
/// (the DOT text of a 5,000-node cluster is 6 MB and takes 16 ms to write).
#[derive(Clone)]
pub struct GraphSource {
    /// The last topology.
    pub topology: Arc<control::Topology>,
    /// The CIDRs not routed on this node because they cover one of its connected networks.
    pub withheld: Arc<Vec<control::routes::Withheld>>,
}

impl GraphSource {
    /// The graph in Graphviz's DOT language.
    pub fn dot(&self) -> String {
        self.topology.dot_with_withheld(&self.withheld)
    }
}

/// What the handlers read.
#[derive(Clone)]
pub struct HttpState {
    /// The metrics registry.
    pub metrics: Arc<Metrics>,
    /// The WireGuard device, for per-peer series.
    pub wg: Arc<WireGuard>,
    /// What the graph of the last topology is drawn from, once there is one.
    pub graph: Arc<Mutex<Option<GraphSource>>>,
    /// What kg last applied, for `/status`.
    pub status: Arc<StatusBoard>,
    /// The agent's kernel shell, which `/status` compares the host's routes through.
    pub kernel: Netlink,
    /// The agent's firewall shell, which `/status` compares the host's rules through.
    pub firewall: HostFirewall,
}

/// Parses Go's listen form: `:1107` means every interface.
pub fn listen_addr(listen: &str) -> Result<SocketAddr> {
    let full = if listen.starts_with(':') {
        format!("0.0.0.0{listen}")
    } else {
        listen.to_string()
    };
    full.parse()
        .with_context(|| format!("--listen: {listen:?} is not host:port or :port"))
}

/// Binds `addr` with `SO_REUSEPORT`, so the kg of a surge rollout's new pod can answer its
/// readiness probe on the same port while the old pod's kg still serves.
fn bind_shared(addr: SocketAddr) -> Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()
    } else {
        tokio::net::TcpSocket::new_v6()
    }?;
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket
        .bind(addr)
        .and_then(|()| socket.listen(1024))
        .with_context(|| format!("listening on {addr}"))
}

/// Binds `listen` and serves in the background.
pub async fn serve(listen: &str, state: HttpState) -> Result<SocketAddr> {
    let addr = listen_addr(listen)?;
    let listener = bind_shared(addr)?;
    let local = listener.local_addr()?;
    let app = Router::new()
        .route("/", get(index))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/graph", get(graph))
        .route("/status", get(status))
        .with_state(state);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the HTTP server stopped");
        }
    });
    Ok(local)
}

/// Serves what a kg standing by for the engine can say (see `shells::engine_lock`): `/health`
/// and `/ready` answer (the process is fine, it checked that it could run the engine, and the
/// pod must turn Ready for the rollout to go on) and `/status` says why nothing else does.
/// Abort the returned task to stop serving.
pub fn serve_standby(listen: &str, why: String) -> Result<tokio::task::JoinHandle<()>> {
    let addr = listen_addr(listen)?;
    let listener = bind_shared(addr)?;
    let status = serde_json::json!({ "standby": why }).to_string();
    let ready = format!("standing by: {why}\n");
    let app = Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route(
            "/ready",
            get(move || {
                let ready = ready.clone();
                async move { ready }
            }),
        )
        .route(
            "/status",
            get(move || {
                let status = status.clone();
                async move { ([(header::CONTENT_TYPE, "application/json")], status) }
            }),
        );
    Ok(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the HTTP server stopped");
        }
    }))
}

async fn index() -> Html<&'static str> {
    Html("<html><body><ul><li><a href=\"/graph\">/graph</a></li><li><a href=\"/health\">/health</a></li><li><a href=\"/metrics\">/metrics</a></li><li><a href=\"/ready\">/ready</a></li><li><a href=\"/status\">/status</a></li></ul></body></html>\n")
}

/// `/metrics`: OpenMetrics when the scraper asks for it, the 0.0.4 text format otherwise.
async fn metrics(State(state): State<HttpState>, headers: HeaderMap) -> Response {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let format = Format::negotiate(accept.as_deref());
    let wg = Arc::clone(&state.wg);
    let metrics = Arc::clone(&state.metrics);
    let body = tokio::task::spawn_blocking(move || {
        let scrape = match wg.read() {
            Ok((config, peers)) => Some(WireGuardScrape::new(
                wg.interface(),
                wg.implementation(),
                &config,
                peers,
                wg.is_embedded().then(|| wg.drops()),
            )),
            Err(e) => {
                tracing::debug!(error = format!("{e:#}"), "reading the device for /metrics");
                None
            }
        };
        metrics.render(scrape, format)
    })
    .await;
    match body {
        Ok(body) => ([(header::CONTENT_TYPE, format.content_type())], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

/// `/ready`: 200 once the engine carries the last run's peers or a reconcile's configuration,
/// 503 before; the body says which. `/health` only says the process answers.
async fn ready(State(state): State<HttpState>) -> (StatusCode, String) {
    let (ready, why) = state.status.engine().answer();
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, why + "\n")
}

/// `/status` query parameters.
#[derive(Debug, Deserialize)]
pub struct StatusQuery {
    /// `true`: also probe the paths to the peers (takes a few seconds).
    probe: Option<bool>,
}

async fn status(State(state): State<HttpState>, Query(q): Query<StatusQuery>) -> Response {
    let status = super::status::collect(
        &state.status,
        &state.wg,
        &state.kernel,
        &state.firewall,
        q.probe.unwrap_or(false),
    )
    .await;
    match serde_json::to_string_pretty(&status) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body + "\n").into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

/// `/graph` query parameters.
#[derive(Debug, Deserialize)]
pub struct GraphQuery {
    format: Option<String>,
    layout: Option<String>,
}

const LAYOUTS: [&str; 5] = ["circo", "dot", "neato", "twopi", "fdp"];

fn content_type(format: &str) -> Option<&'static str> {
    Some(match format {
        "svg" => "image/svg+xml",
        "png" => "image/png",
        "gif" => "image/gif",
        "bmp" => "image/bmp",
        "json" => "application/json",
        "ps" => "application/postscript",
        "fig" => "application/x-xfig",
        _ => return None,
    })
}

async fn graph(State(state): State<HttpState>, Query(q): Query<GraphQuery>) -> Response {
    let format = q.format.unwrap_or_else(|| "svg".into());
    let layout = q.layout.unwrap_or_else(|| "circo".into());
    if !LAYOUTS.contains(&layout.as_str()) {
        return (
            StatusCode::BAD_REQUEST,
            format!(
                "unsupported layout {layout:?}; use one of {}\n",
                LAYOUTS.join(", ")
            ),
        )
            .into_response();
    }
    let raw = matches!(format.as_str(), "dot" | "gv");
    let mime = if raw {
        Some("text/vnd.graphviz")
    } else {
        content_type(&format)
    };
    let Some(mime) = mime else {
        return (
            StatusCode::BAD_REQUEST,
            format!(
                "unsupported format {format:?}; use dot, gv, svg, png, gif, bmp, json, ps or fig\n"
            ),
        )
            .into_response();
    };
    let source = state.graph.lock().clone();
    let Some(dot) = source.map(|s| s.dot()) else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "no topology yet: the local node is not ready\n",
        )
            .into_response();
    };
    if raw {
        return ([(header::CONTENT_TYPE, mime)], dot).into_response();
    }
    match render(&dot, &layout, &format).await {
        Ok(bytes) => ([(header::CONTENT_TYPE, mime)], bytes).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n")).into_response(),
    }
}

/// Runs Graphviz: `dot -K<layout> -T<format>`.
async fn render(dot: &str, layout: &str, format: &str) -> Result<Vec<u8>> {
    use tokio::io::AsyncWriteExt;
    let mut child = tokio::process::Command::new("dot")
        .arg(format!("-K{layout}"))
        .arg(format!("-T{format}"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running Graphviz `dot` (is graphviz installed?)")?;
    let mut stdin = child.stdin.take().context("dot's stdin")?;
    stdin.write_all(dot.as_bytes()).await?;
    drop(stdin);
    let out = child.wait_with_output().await?;
    if !out.status.success() {
        anyhow::bail!(
            "dot failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out.stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_style_listen_addresses() {
        assert_eq!(
            listen_addr(":1107").unwrap(),
            "0.0.0.0:1107".parse().unwrap()
        );
        assert_eq!(
            listen_addr("127.0.0.1:9").unwrap(),
            "127.0.0.1:9".parse().unwrap()
        );
        assert!(listen_addr("1107").is_err());
    }
}
