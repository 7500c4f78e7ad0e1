//! DNS lookups off the event loop: the agent hands over the names that are due
//! ([`control::dns::DnsBook::start`]) and takes the answers back as they come, a chunk at a
//! time, so a reconcile never waits on a name server, and thousands of names (a cluster whose
//! endpoints are all DNS names) resolve a bounded number at a time.

use std::net::IpAddr;
use std::time::Duration;

use futures::StreamExt as _;
use hickory_resolver::TokioResolver;
use tokio::sync::mpsc;

/// How many lookups run at once.
const CONCURRENCY: usize = 64;
/// The most answers delivered together.
const CHUNK: usize = 256;

/// A name and the address it resolved to (the first IPv4 one, else the first), or why not.
pub type LookupAnswer = (String, Result<IpAddr, String>);

/// The lookup task: names go in, answers come out.
pub struct Lookups {
    requests: mpsc::UnboundedSender<Vec<String>>,
    answers: mpsc::UnboundedReceiver<Vec<LookupAnswer>>,
}

impl Lookups {
    /// Starts the task on `resolver`, each lookup given up after `timeout`; it ends when the
    /// [`Lookups`] is dropped.
    pub fn spawn(resolver: TokioResolver, timeout: Duration) -> Self {
        let (requests, mut asked) = mpsc::unbounded_channel::<Vec<String>>();
        let (answer, answers) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(names) = asked.recv().await {
                let mut chunks = futures::stream::iter(names)
                    .map(|name| lookup(&resolver, name, timeout))
                    .buffer_unordered(CONCURRENCY)
                    .ready_chunks(CHUNK);
                while let Some(chunk) = chunks.next().await {
                    if answer.send(chunk).is_err() {
                        return;
                    }
                }
            }
        });
        Self { requests, answers }
    }

    /// Asks for `names` (nothing when empty).
    pub fn ask(&self, names: Vec<String>) {
        if !names.is_empty() {
            // The task lives as long as `self`.
            let _ = self.requests.send(names);
        }
    }

    /// The next answers, as they come.
    pub async fn answers(&mut self) -> Option<Vec<LookupAnswer>> {
        self.answers.recv().await
    }
}

async fn lookup(resolver: &TokioResolver, name: String, timeout: Duration) -> LookupAnswer {
    let result = match tokio::time::timeout(timeout, resolver.lookup_ip(name.as_str())).await {
        Ok(Ok(ips)) => {
            let mut ips: Vec<IpAddr> = ips.iter().collect();
            ips.sort_by_key(|ip| ip.is_ipv6());
            ips.first().copied().ok_or_else(|| "no address".to_string())
        }
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("timed out".to_string()),
    };
    (name, result)
}
