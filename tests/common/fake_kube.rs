//! An in-process fake Kubernetes API server speaking real HTTP/1.1: list and watch (chunked
//! event streams that resume from a resourceVersion) for Nodes and Peers, and JSON merge patches
//! on Nodes. The Peer CRD can be absent (404, as on a cluster without it) and installed later.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Node,
    Peer,
}

struct Event {
    rv: u64,
    kind: Kind,
    line: String,
}

#[derive(Default)]
struct State {
    rv: u64,
    nodes: BTreeMap<String, Value>,
    peers: Option<BTreeMap<String, Value>>,
    history: Vec<Event>,
    watchers: Vec<(Kind, mpsc::UnboundedSender<String>)>,
    patches: Vec<(String, Value)>,
    /// While set, every request gets a 503 and the connection is closed (an API outage).
    unavailable: bool,
}

impl State {
    fn record(&mut self, kind: Kind, kind_of_event: &str, mut object: Value) -> Value {
        self.rv += 1;
        object["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let line = json!({"type": kind_of_event, "object": object}).to_string();
        self.watchers
            .retain(|(k, tx)| *k != kind || tx.send(line.clone()).is_ok());
        self.history.push(Event {
            rv: self.rv,
            kind,
            line,
        });
        object
    }
}

/// The fake API server. Dropping it stops serving (its runtime thread exits with the process).
pub struct FakeKube {
    state: Arc<Mutex<State>>,
    pub url: String,
}

/// RFC 7386 JSON merge patch.
fn merge(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(map) => {
            if !target.is_object() {
                *target = json!({});
            }
            let t = target.as_object_mut().unwrap();
            for (k, v) in map {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

impl FakeKube {
    /// Starts serving on 127.0.0.1 (in the calling thread's network namespace).
    pub fn start() -> Self {
        Self::start_on("127.0.0.1")
    }

    /// Starts serving on `ip`, on a free port, in the calling thread's network namespace.
    pub fn start_on(ip: &str) -> Self {
        let std_listener = std::net::TcpListener::bind((ip, 0)).unwrap();
        std_listener.set_nonblocking(true).unwrap();
        let url = format!("http://{}", std_listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        let shared = Arc::clone(&state);
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = TcpListener::from_std(std_listener).unwrap();
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        return;
                    };
                    let state = Arc::clone(&shared);
                    tokio::spawn(async move {
                        let _ = serve(stream, state).await;
                    });
                }
            });
        });
        Self { state, url }
    }

    /// Starts (`false`) or ends (`true`) an outage: while it lasts, open watch streams are cut
    /// and every request is answered 503 Service Unavailable.
    pub fn set_available(&self, available: bool) {
        let mut s = self.state.lock().unwrap();
        s.unavailable = !available;
        if !available {
            s.watchers.clear();
        }
    }

    pub fn put_node(&self, node: Value) {
        let mut s = self.state.lock().unwrap();
        let name = node["metadata"]["name"].as_str().unwrap().to_string();
        let event = if s.nodes.contains_key(&name) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let stored = s.record(Kind::Node, event, node);
        s.nodes.insert(name, stored);
    }

    pub fn delete_node(&self, name: &str) {
        let mut s = self.state.lock().unwrap();
        if let Some(node) = s.nodes.remove(name) {
            s.record(Kind::Node, "DELETED", node);
        }
    }

    pub fn install_peer_crd(&self) {
        self.state
            .lock()
            .unwrap()
            .peers
            .get_or_insert_with(BTreeMap::new);
    }

    pub fn put_peer(&self, peer: Value) {
        let mut s = self.state.lock().unwrap();
        let name = peer["metadata"]["name"].as_str().unwrap().to_string();
        let event = if s.peers.as_ref().is_some_and(|p| p.contains_key(&name)) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let stored = s.record(Kind::Peer, event, peer);
        s.peers
            .get_or_insert_with(BTreeMap::new)
            .insert(name, stored);
    }

    pub fn node(&self, name: &str) -> Option<Value> {
        self.state.lock().unwrap().nodes.get(name).cloned()
    }

    /// Every merge patch received, in order: (node name, body).
    pub fn patches(&self) -> Vec<(String, Value)> {
        self.state.lock().unwrap().patches.clone()
    }
}

struct Request {
    method: String,
    path: String,
    query: String,
    body: Vec<u8>,
}

async fn read_request(reader: &mut BufReader<tokio::net::tcp::OwnedReadHalf>) -> Option<Request> {
    let mut line = String::new();
    if reader.read_line(&mut line).await.ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let target = parts.next()?.to_string();
    let mut length = 0usize;
    loop {
        let mut header = String::new();
        reader.read_line(&mut header).await.ok()?;
        let header = header.trim_end();
        if header.is_empty() {
            break;
        }
        if let Some((k, v)) = header.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                length = v.trim().parse().ok()?;
            }
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).await.ok()?;
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    Some(Request {
        method,
        path: path.to_string(),
        query: query.to_string(),
        body,
    })
}

fn response(status: &str, body: &Value) -> String {
    let text = body.to_string();
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{text}",
        text.len()
    )
}

fn not_found() -> String {
    response(
        "404 Not Found",
        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404,
                "message": "the server could not find the requested resource"}),
    )
}

async fn serve(stream: TcpStream, state: Arc<Mutex<State>>) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    while let Some(req) = read_request(&mut reader).await {
        if state.lock().unwrap().unavailable {
            let answer = response(
                "503 Service Unavailable",
                &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "ServiceUnavailable", "code": 503}),
            );
            write.write_all(answer.as_bytes()).await?;
            return Ok(());
        }
        let kind = if req.path.starts_with("/api/v1/nodes") {
            Kind::Node
        } else if req.path.starts_with("/apis/kilo.squat.ai/v1alpha1/peers") {
            Kind::Peer
        } else {
            write.write_all(not_found().as_bytes()).await?;
            continue;
        };
        let watch = req
            .query
            .split('&')
            .any(|p| p == "watch=true" || p == "watch=1");
        if watch {
            let since: u64 = req
                .query
                .split('&')
                .find_map(|p| p.strip_prefix("resourceVersion="))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            let (tx, mut rx) = mpsc::unbounded_channel();
            let missing = {
                let mut s = state.lock().unwrap();
                if kind == Kind::Peer && s.peers.is_none() {
                    true
                } else {
                    for e in s.history.iter().filter(|e| e.kind == kind && e.rv > since) {
                        let _ = tx.send(e.line.clone());
                    }
                    s.watchers.push((kind, tx));
                    false
                }
            };
            if missing {
                write.write_all(not_found().as_bytes()).await?;
                continue;
            }
            write
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
                .await?;
            while let Some(line) = rx.recv().await {
                let chunk = format!("{:x}\r\n{line}\n\r\n", line.len() + 1);
                write.write_all(chunk.as_bytes()).await?;
            }
            return Ok(());
        }
        let answer = {
            let mut s = state.lock().unwrap();
            match (req.method.as_str(), kind) {
                ("GET", Kind::Node) => {
                    let items: Vec<Value> = s.nodes.values().cloned().collect();
                    response(
                        "200 OK",
                        &json!({"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": s.rv.to_string()}, "items": items}),
                    )
                }
                ("GET", Kind::Peer) => match &s.peers {
                    None => not_found(),
                    Some(peers) => {
                        let items: Vec<Value> = peers.values().cloned().collect();
                        response(
                            "200 OK",
                            &json!({"kind": "PeerList", "apiVersion": "kilo.squat.ai/v1alpha1", "metadata": {"resourceVersion": s.rv.to_string()}, "items": items}),
                        )
                    }
                },
                ("PATCH", Kind::Node) => {
                    let name = req.path.trim_start_matches("/api/v1/nodes/").to_string();
                    let patch: Value = serde_json::from_slice(&req.body).unwrap_or(Value::Null);
                    s.patches.push((name.clone(), patch.clone()));
                    match s.nodes.get(&name).cloned() {
                        None => not_found(),
                        Some(mut node) => {
                            merge(&mut node, &patch);
                            let stored = s.record(Kind::Node, "MODIFIED", node);
                            s.nodes.insert(name, stored.clone());
                            response("200 OK", &stored)
                        }
                    }
                }
                _ => response("405 Method Not Allowed", &json!({})),
            }
        };
        write.write_all(answer.as_bytes()).await?;
    }
    Ok(())
}
