//! `kgctl diagnose [NODE]`: reads the cluster from the backend and the node's own view from its
//! kg (`/status` on kg's `--listen` port, with path probes), judges both with
//! `control::diagnosis`, and says in plain words what is wrong and what to do. Exits non-zero
//! when anything is wrong; `-o json` prints the findings (and the node's status) as JSON.

use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use control::diagnosis::{
    cluster_findings_with_leases, has_problems, node_findings, remote_findings, Finding, Severity,
};
use control::status::NodeStatus;
use serde::Serialize;

use super::KgctlArgs;
use crate::backend::Snapshot;

/// How long kgctl waits for kg's `/status` (the probes take a few seconds).
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(30);
/// How long kgctl waits for the `/status` (without probes) of a leader at the other end of one
/// of the node's links.
pub const REMOTE_STATUS_TIMEOUT: Duration = Duration::from_secs(5);

/// `kgctl diagnose`.
#[derive(Debug, Args)]
pub struct DiagnoseArgs {
    /// The node to diagnose (default: this machine, by its hostname).
    pub node: Option<String>,
    /// kg's HTTP address (default: 127.0.0.1 for this machine, else the node's internal IP,
    /// or its endpoint's address, on --kg-port).
    #[arg(long)]
    pub kg_url: Option<String>,
    /// kg's `--listen` port.
    #[arg(long, default_value_t = 1107)]
    pub kg_port: u16,
    /// Probe the paths to the node's peers (path MTU, IPIP); `--probe=false` skips it.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub probe: bool,
    /// Output format: text or json.
    #[arg(short = 'o', long, default_value = "text")]
    pub output: String,
}

/// What `-o json` prints.
#[derive(Debug, Serialize)]
pub struct Report {
    /// The node diagnosed.
    pub node: String,
    /// Where its kg was asked.
    pub kg_url: String,
    /// What its kg reported (`None` when it could not be reached).
    pub status: Option<NodeStatus>,
    /// Everything found, problems first.
    pub findings: Vec<Finding>,
    /// How many findings are problems.
    pub problems: usize,
}

/// Runs `kgctl diagnose`: (stdout, true when something is wrong).
pub async fn run(args: &KgctlArgs, d: &DiagnoseArgs) -> Result<(String, bool)> {
    let json = match d.output.as_str() {
        "text" => false,
        "json" => true,
        other => bail!("-o {other:?} is not one of text, json"),
    };
    let snapshot = match super::snapshot(args).await {
        Ok(snapshot) => snapshot,
        Err(e) => return render(unreadable_cluster(d, &e), json),
    };
    let now = super::now_unix();
    let all = super::translated(&snapshot, &args.topology_label, args.ipam);
    let v = super::view_with_ipam(
        &snapshot,
        &args.mesh_granularity,
        &args.topology_label,
        now,
        args.ipam,
    )?;
    let topology = v.topology(None, args.port).ok();
    let mut findings =
        cluster_findings_with_leases(&all, &v.peers, topology.as_ref(), &v.leaders, now);

    let (node, local) = match &d.node {
        Some(n) => (n.clone(), false),
        None => (
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .context("reading this machine's hostname (name the node)")?
                .trim()
                .to_string(),
            true,
        ),
    };
    let url = match &d.kg_url {
        Some(u) => u.trim_end_matches('/').to_string(),
        None if local => format!("http://127.0.0.1:{}", d.kg_port),
        None => kg_url_of(&all, &node, d.kg_port)?,
    };
    let path = format!("/status?probe={}", d.probe);
    let status = match get_json::<NodeStatus>(&url, &path, STATUS_TIMEOUT).await {
        Ok(status) => {
            findings.extend(node_findings(&status, &all, now));
            findings.extend(other_ends(&status, &all, d.kg_port, now).await);
            Some(status)
        }
        Err(e) => {
            findings.push(Finding {
                severity: Severity::Problem,
                check: "kg".into(),
                subject: format!("node {node}"),
                message: format!("kg could not be asked at {url}: {e:#}"),
                advice: format!("check that kg runs on the node and that TCP {} (kg's --listen) is reachable from here, or pass --kg-url", d.kg_port),
            });
            None
        }
    };
    findings.sort_by_key(|f| f.severity);
    let report = Report {
        node,
        kg_url: url,
        problems: findings
            .iter()
            .filter(|f| f.severity == Severity::Problem)
            .count(),
        status,
        findings,
    };
    render(report, json)
}

/// The report when the cluster cannot be read: one problem saying why, so `-o json` stays
/// machine-readable and the exit status says something is wrong.
fn unreadable_cluster(d: &DiagnoseArgs, e: &anyhow::Error) -> Report {
    let node = d.node.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default()
    });
    Report {
        node,
        kg_url: d
            .kg_url
            .clone()
            .unwrap_or_else(|| "(not asked: its address comes from the cluster)".into()),
        status: None,
        findings: vec![Finding {
            severity: Severity::Problem,
            check: "cluster".into(),
            subject: "the cluster".into(),
            message: format!("the cluster could not be read: {e:#}"),
            advice: "check --kubeconfig (or --backend=file and --cluster-dir) and that this user may list Nodes, Peers and Leases".into(),
        }],
        problems: 1,
    }
}

/// `report` as text or JSON: (stdout, true when it holds a problem).
fn render(report: Report, json: bool) -> Result<(String, bool)> {
    let wrong = has_problems(&report.findings);
    let out = if json {
        serde_json::to_string_pretty(&report)? + "\n"
    } else {
        render_text(&report)
    };
    Ok((out, wrong))
}

/// The `/status` (without probes) of `node`'s kg, at its internal IP on `port`, from
/// `snapshot`'s Nodes: what `kgctl showconf --live` reads.
pub async fn node_status(
    args: &KgctlArgs,
    snapshot: &Snapshot,
    node: &str,
    port: u16,
) -> Result<NodeStatus> {
    let all = super::translated(snapshot, &args.topology_label, args.ipam);
    let url = kg_url_of(&all, node, port)?;
    get_json::<NodeStatus>(&url, "/status?probe=false", REMOTE_STATUS_TIMEOUT)
        .await
        .with_context(|| format!("asking node {node}'s kg at {url} for its /status"))
}

/// Where the kg of `node` listens: its internal IP, else its endpoint's address, on `port`.
fn kg_url_of(all: &[control::Node], node: &str, port: u16) -> Result<String> {
    let n = all
        .iter()
        .find(|n| n.name == node)
        .with_context(|| format!("no node {node:?} in the cluster"))?;
    let ip = n
        .internal_ip
        .map(|i| i.addr())
        .or_else(|| n.endpoint.as_ref().and_then(|e| e.ip()))
        .with_context(|| format!("node {node:?} has no internal IP or endpoint address to reach its kg at; pass --kg-url"))?;
    Ok(format!("http://{}", std::net::SocketAddr::new(ip, port)))
}

/// What the leaders at the other end of the node's links say about it (see
/// [`remote_findings`]): a node that only answers sends nothing that could go unanswered, so
/// only the other side sees that its packets stopped arriving. A leader whose kg cannot be
/// asked is said as information: its view is missing, nothing more.
async fn other_ends(
    status: &NodeStatus,
    all: &[control::Node],
    port: u16,
    now: i64,
) -> Vec<Finding> {
    let leaders: std::collections::BTreeSet<&str> = status
        .peers
        .iter()
        .map(|p| p.leader.as_str())
        .filter(|l| !l.is_empty() && *l != status.node)
        .collect();
    let asks = leaders.into_iter().map(|leader| async move {
        let url = kg_url_of(all, leader, port)?;
        get_json::<NodeStatus>(&url, "/status?probe=false", REMOTE_STATUS_TIMEOUT)
            .await
            .with_context(|| format!("asking node {leader}'s kg at {url}"))
    });
    let mut out = Vec::new();
    for answer in futures::future::join_all(asks).await {
        match answer {
            Ok(remote) => out.extend(remote_findings(status, &remote, now)),
            Err(e) => out.push(Finding {
                severity: Severity::Info,
                check: "other-end".into(),
                subject: format!("node {}", status.node),
                message: format!("the other end's view is missing: {e:#}"),
                advice: String::new(),
            }),
        }
    }
    out
}

/// The report as text: a heading, then one block per finding.
pub fn render_text(r: &Report) -> String {
    let mut out = match &r.status {
        Some(s) if !s.location.is_empty() => format!(
            "node {} ({}, {}), kg at {}\n",
            r.node,
            s.location,
            if s.leader { "leader" } else { "not the leader" },
            r.kg_url
        ),
        _ => format!("node {}, kg at {}\n", r.node, r.kg_url),
    };
    for f in &r.findings {
        let label = match f.severity {
            Severity::Problem => "PROBLEM",
            Severity::Warning => "WARNING",
            Severity::Info => "INFO",
        };
        out.push_str(&format!("\n{label:<8} {}: {}\n", f.check, f.subject));
        for line in f.message.lines() {
            out.push_str(&format!("         {line}\n"));
        }
        if !f.advice.is_empty() {
            out.push_str(&format!("         what to do: {}\n", f.advice));
        }
    }
    let warnings = r
        .findings
        .iter()
        .filter(|f| f.severity == Severity::Warning)
        .count();
    out.push_str(&format!(
        "\n{} problem(s), {warnings} warning(s)\n",
        r.problems
    ));
    out
}

/// The largest answer `kgctl diagnose` reads from a kg: `/status` of a node in a large mesh is
/// a few hundred KiB; anything past this is not a kg's.
const ANSWER_LIMIT: usize = 16 << 20;

/// `GET url+path` over HTTP/1.1 (hyper's client), at most [`ANSWER_LIMIT`] bytes, decoded from
/// JSON.
async fn get_json<T: serde::de::DeserializeOwned>(
    url: &str,
    path: &str,
    timeout: Duration,
) -> Result<T> {
    use http_body_util::BodyExt;
    let authority = url
        .strip_prefix("http://")
        .with_context(|| format!("{url:?}: only http:// URLs are supported"))?
        .trim_end_matches('/');
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(authority)
            .await
            .with_context(|| format!("connecting to {authority}"))?;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .with_context(|| format!("speaking HTTP to {authority}"))?;
        let driver = tokio::spawn(connection);
        let request = hyper::Request::get(path)
            .header(hyper::header::HOST, authority)
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .with_context(|| format!("{path:?} is not a request path"))?;
        let answer = sender
            .send_request(request)
            .await
            .with_context(|| format!("GET {path} from {authority}"))?;
        let status = answer.status();
        let body = http_body_util::Limited::new(answer.into_body(), ANSWER_LIMIT)
            .collect()
            .await
            .map_err(|e| anyhow::anyhow!("reading {path} from {authority}: {e}"))?
            .to_bytes();
        driver.abort();
        anyhow::Ok((status, body))
    };
    let (status, body) = tokio::time::timeout(timeout, exchange)
        .await
        .with_context(|| format!("no answer within {} s", timeout.as_secs()))??;
    if status != hyper::StatusCode::OK {
        bail!("{path} answered {status} (is this kilotun's kg? Kilo's kg has no /status)");
    }
    serde_json::from_slice(&body).with_context(|| format!("{path}: not a kilotun status"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// One connection's worth of a server: reads the request head, answers `reply`.
    async fn serve_once(reply: Vec<u8>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.unwrap();
            let mut head = vec![0u8; 4096];
            let _ = stream.read(&mut head).await;
            let _ = stream.write_all(&reply).await;
        });
        url
    }

    #[tokio::test]
    async fn a_chunked_answer_is_joined_and_an_error_status_named() {
        let url = serve_once(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\n[1,\r\n2\r\n2]\r\n0\r\n\r\n"
                .to_vec(),
        )
        .await;
        let got: Vec<u32> = get_json(&url, "/status", Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(got, [1, 2]);
        let url = serve_once(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_vec()).await;
        let e = get_json::<Vec<u32>>(&url, "/status", Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(format!("{e:#}").contains("/status answered 404"), "{e:#}");
    }

    #[tokio::test]
    async fn an_answer_past_the_limit_is_refused() {
        let mut reply = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
            ANSWER_LIMIT + 1
        )
        .into_bytes();
        reply.extend(std::iter::repeat_n(b' ', ANSWER_LIMIT + 1));
        let url = serve_once(reply).await;
        let e = get_json::<Vec<u32>>(&url, "/status", Duration::from_secs(10))
            .await
            .unwrap_err();
        assert!(format!("{e:#}").contains("length limit exceeded"), "{e:#}");
    }

    #[test]
    fn text_names_each_finding_and_counts_problems() {
        let report = Report {
            node: "n1".into(),
            kg_url: "http://127.0.0.1:1107".into(),
            status: None,
            findings: vec![
                Finding {
                    severity: Severity::Problem,
                    check: "ipip".into(),
                    subject: "node n2".into(),
                    message: "IP protocol 4 is blocked".into(),
                    advice: "allow it".into(),
                },
                Finding {
                    severity: Severity::Info,
                    check: "leader".into(),
                    subject: "location:east".into(),
                    message: "n1 leads".into(),
                    advice: String::new(),
                },
            ],
            problems: 1,
        };
        let text = render_text(&report);
        assert!(text.contains("PROBLEM  ipip: node n2\n         IP protocol 4 is blocked\n         what to do: allow it\n"), "{text}");
        assert!(text.contains("INFO     leader: location:east"), "{text}");
        assert!(text.ends_with("1 problem(s), 0 warning(s)\n"), "{text}");
    }
}
