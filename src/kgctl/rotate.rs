//! `kgctl rotate-key NODE`: asks a node's kg for a new WireGuard key by writing a new id into
//! its `kilotun.io/rotate-key` annotation; the kg carries the rotation out (see
//! `control::rotation`) and writes the id into `kilotun.io/key-rotated` when it has.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use control::node::annotation;

use super::KgctlArgs;
use crate::agent::args::BackendKind;
use crate::backend::Snapshot;

/// `kgctl rotate-key`.
#[derive(Debug, Args)]
pub struct RotateKeyArgs {
    /// The node whose key changes.
    pub node: String,
    /// Rotate even though Peer objects exist: a Peer's own WireGuard configuration holds the
    /// node's key (when the node leads its location) and does not follow.
    #[arg(long)]
    pub force: bool,
}

/// What [`request`] decided: the annotation to write, or why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RotationRequest {
    /// The id written to `kilotun.io/rotate-key`.
    pub id: String,
    /// What to tell the user.
    pub message: String,
}

/// The request for `args` against `snapshot` with id `id`, or the error that stops it: an
/// unknown node, one whose kg has published no key, or Peers that would not follow (unless
/// `--force`).
pub fn request(snapshot: &Snapshot, args: &RotateKeyArgs, id: &str) -> Result<RotationRequest> {
    let Some(object) = snapshot.nodes.get(&args.node) else {
        bail!("no node called {:?}", args.node);
    };
    let annotations = object.metadata.annotations.clone().unwrap_or_default();
    if !annotations.contains_key(annotation::KEY) {
        bail!(
            "node {:?} has no {} annotation: its kg has not published a key yet",
            args.node,
            annotation::KEY
        );
    }
    if let Some(next) = annotations.get(annotation::NEXT_KEY) {
        bail!(
            "node {:?} is rotating its key already (its {} is {next}); ask again once it is done",
            args.node,
            annotation::NEXT_KEY
        );
    }
    let peers: Vec<&str> = snapshot.peers.keys().map(String::as_str).collect();
    if !peers.is_empty() && !args.force {
        bail!(
            "the Peers {} are configured outside the cluster with the keys of the locations' leaders and will not follow a new key; rotate with --force and update them (kgctl showconf peer NAME)",
            peers.join(", ")
        );
    }
    Ok(RotationRequest {
        id: id.to_string(),
        message: format!(
            "asked node {} for a new key (request {id}); its kg writes {}: {id} with its next key, and uses it 3 s later\n",
            args.node,
            annotation::KEY_ROTATED
        ),
    })
}

/// Runs `kgctl rotate-key`: reads the backend, checks, and writes the request.
pub async fn run(args: &KgctlArgs, rotate: &RotateKeyArgs) -> Result<String> {
    let snapshot = super::snapshot(args).await?;
    let id = format!(
        "{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis())
    );
    let request = request(&snapshot, rotate, &id)?;
    let changes = BTreeMap::from([(annotation::ROTATE_KEY.to_string(), Some(request.id.clone()))]);
    let written = match args.backend {
        BackendKind::File => {
            crate::backend::file::FileBackend::open(&PathBuf::from(&args.cluster_dir))
                .and_then(|backend| backend.patch_annotations(&rotate.node, &changes))
        }
        BackendKind::Kubernetes => {
            let config =
                crate::backend::kube::client_config(&super::kubeconfig_path(args), "").await?;
            let client = kube::Client::try_from(config)?;
            let api: kube::Api<k8s_openapi::api::core::v1::Node> = kube::Api::all(client);
            let body = serde_json::json!({ "metadata": { "annotations": changes } });
            api.patch(
                &rotate.node,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&body),
            )
            .await
            .map(drop)
            .map_err(anyhow::Error::from)
        }
    };
    written
        .with_context(|| format!("writing {} on node {}", annotation::ROTATE_KEY, rotate.node))?;
    Ok(request.message)
}
