//! kg on in-memory twins of the kernel, the firewall and the WireGuard device, fed snapshots
//! of a synthetic cluster on a manual clock: the fixture of the tests that count what a
//! reconcile asks of the host and compare where it converges.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use control::clock::Now;
use control::fixtures::kube_node;
use control::Node;
use kilotun::agent::twin_agent::TwinAgent;
use kilotun::agent::{read_clock, Trigger};
use kilotun::backend::{Listed, Snapshot};

/// The Unix time now, in seconds.
pub(crate) fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// One kg on in-memory twins, a snapshot it reads, and a manual clock.
pub(crate) struct Fixture {
    pub(crate) twin: TwinAgent,
    /// The agent's clock, moved by the test.
    pub(crate) clock: Now,
    pub(crate) snapshot: Snapshot,
    /// The cluster directory kg writes its Node into.
    pub(crate) dir: std::path::PathBuf,
    rv: u64,
    local: String,
}

impl Fixture {
    /// kg as `local` on twins, in a cluster of `nodes` (all checked in now), after its first
    /// resync and the event of its own annotations coming back.
    pub(crate) async fn with_nodes(test: &str, local: &str, nodes: Vec<Node>) -> Self {
        let now = unix_now();
        let mut snapshot = Snapshot {
            listed: Listed::EVERYTHING,
            ..Snapshot::default()
        };
        let mut rv = 0;
        for mut node in nodes {
            node.last_seen = now;
            rv += 1;
            let name = node.name.clone();
            snapshot.put_node(&name, kube_node(&node, rv));
        }
        Self::on_snapshot(test, local, snapshot, rv).await
    }

    /// kg as `local` on fresh twins reading `snapshot` (whose highest resourceVersion is
    /// `rv`), after its first resync and the event of its own annotations coming back.
    pub(crate) async fn on_snapshot(test: &str, local: &str, snapshot: Snapshot, rv: u64) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "kilotun-{test}-{}-{}",
            std::process::id(),
            unix_now()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let cluster_dir = format!("--cluster-dir={}", dir.display());
        let key_file = format!("--key-file={}", dir.join("key").display());
        let twin = TwinAgent::start(&[
            "--backend=file",
            &cluster_dir,
            &key_file,
            "--hostname",
            local,
            "--encapsulate=never",
            "--cni=false",
            "--mtu=1420",
        ])
        .await
        .unwrap();
        let mut f = Self {
            twin,
            clock: read_clock(),
            snapshot,
            dir,
            rv,
            local: local.to_string(),
        };
        f.reconcile(Trigger::Resync).await;
        // What kg published about itself comes back as an update of its own Node.
        let published = f.annotations_written();
        f.update(local, |n| {
            n.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .extend(published)
        });
        f.reconcile(Trigger::Event).await;
        f
    }

    fn annotations_written(&self) -> std::collections::BTreeMap<String, String> {
        let text = std::fs::read_to_string(self.dir.join(format!("{}.yaml", self.local))).unwrap();
        let node: k8s_openapi::api::core::v1::Node = serde_saphyr::from_str(&text).unwrap();
        node.metadata.annotations.unwrap_or_default()
    }

    pub(crate) async fn reconcile(&mut self, trigger: Trigger) {
        let snapshot = self.snapshot.clone();
        self.twin
            .agent
            .reconcile_at(&snapshot, trigger, self.clock)
            .await
            .unwrap();
    }

    /// Moves the clock by `by`, then reconciles as the event loop would when the readiness
    /// flips held back fall due on the way.
    pub(crate) async fn advance(&mut self, by: Duration) {
        let end = self.clock.instant + by;
        while let Some(due) = self.twin.agent.readiness_deadline().filter(|at| *at <= end) {
            self.clock = self
                .clock
                .after(due.saturating_duration_since(self.clock.instant));
            self.reconcile(Trigger::Readiness).await;
        }
        self.clock = self
            .clock
            .after(end.saturating_duration_since(self.clock.instant));
    }

    /// Changes Node `name` as the API server would: a new object with a new resourceVersion.
    pub(crate) fn update(
        &mut self,
        name: &str,
        change: impl FnOnce(&mut k8s_openapi::api::core::v1::Node),
    ) {
        let mut node = (*self.snapshot.nodes[name]).clone();
        change(&mut node);
        self.rv += 1;
        node.metadata.resource_version = Some(self.rv.to_string());
        self.snapshot.put_node(name, node);
    }

    pub(crate) fn set_annotation(&mut self, name: &str, key: &str, value: String) {
        self.update(name, |n| {
            n.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(key.to_string(), value);
        });
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
