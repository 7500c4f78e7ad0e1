//! `kgctl uninstall`: deletes kg's DaemonSet and waits until its pods are gone.
//!
//! A kg whose pod is deleted asks whether its DaemonSet still exists; when it does not (an
//! uninstall) kg cleans its node up: its `kilo.squat.ai` annotations, its routes and rules. It
//! does so with its own ServiceAccount, so that account and its ClusterRole must outlive the
//! pods. Deleting everything at once (`helm uninstall`, `kubectl delete -f` of the manifests
//! with `rbac.yaml`) takes the RBAC away while the pods still stop, and the annotations stay.
//! The chart runs this command as a `pre-delete` hook, before Helm deletes anything; with the
//! plain manifests it is the first step of removing kilotun (docs/helm.md, docs/rollouts.md).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, ListParams};
use kube::Api;

use super::KgctlArgs;
use crate::agent::args::{parse_duration, BackendKind};

/// `kgctl uninstall`.
#[derive(Debug, Args)]
pub struct UninstallArgs {
    /// The DaemonSet's namespace.
    #[arg(long, default_value = "kube-system")]
    pub namespace: String,
    /// The DaemonSet's name.
    #[arg(long, default_value = "kilo")]
    pub daemonset: String,
    /// How long to wait for its pods to be gone (a kg cleans up within about 12 s of its
    /// pod's deletion, then the kubelet removes the pod).
    #[arg(long, default_value = "180s")]
    pub timeout: String,
}

/// The label selector of `match_labels` (`a=b,c=d`), or an error for a DaemonSet that selects
/// its pods otherwise.
pub fn selector(match_labels: Option<&BTreeMap<String, String>>) -> Result<String> {
    let labels = match_labels.filter(|l| !l.is_empty()).context(
        "the DaemonSet selects its pods without matchLabels: kgctl cannot tell which are its",
    )?;
    Ok(labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(","))
}

/// Runs `kgctl uninstall`.
pub async fn run(args: &KgctlArgs, uninstall: &UninstallArgs) -> Result<String> {
    if args.backend != BackendKind::Kubernetes {
        bail!("kgctl uninstall deletes a DaemonSet: it needs --backend=kubernetes");
    }
    let timeout = parse_duration(&uninstall.timeout).context("--timeout")?;
    let config = crate::backend::kube::client_config(&super::kubeconfig_path(args), "").await?;
    let client = kube::Client::try_from(config)?;
    let (namespace, name) = (&uninstall.namespace, &uninstall.daemonset);
    let daemon_sets: Api<DaemonSet> = Api::namespaced(client.clone(), namespace);
    let Some(ds) = daemon_sets
        .get_opt(name)
        .await
        .with_context(|| format!("reading DaemonSet {namespace}/{name}"))?
    else {
        return Ok(format!(
            "no DaemonSet {namespace}/{name}: nothing to delete\n"
        ));
    };
    let labels = selector(ds.spec.selector.match_labels.as_ref())?;
    daemon_sets
        .delete(name, &DeleteParams::background())
        .await
        .with_context(|| format!("deleting DaemonSet {namespace}/{name}"))?;
    let pods: Api<Pod> = Api::namespaced(client, namespace);
    let started = Instant::now();
    loop {
        let left: Vec<String> = pods
            .list(&ListParams::default().labels(&labels))
            .await
            .with_context(|| format!("listing the pods of {labels} in {namespace}"))?
            .items
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .collect();
        if left.is_empty() {
            return Ok(format!(
                "deleted DaemonSet {namespace}/{name}; its pods were gone after {:.0?}: each node's kg has cleaned its node up\n",
                started.elapsed()
            ));
        }
        if started.elapsed() >= timeout {
            bail!(
                "deleted DaemonSet {namespace}/{name}, but after {timeout:?} its pods {} remain (kubectl -n {namespace} describe pod NAME)",
                left.join(", ")
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}
