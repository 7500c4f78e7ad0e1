//! The Helm chart (`charts/kilotun`) under the real scheduler and kubelets, with the real helm
//! v4.1.4 of `scripts/helm-tools.sh`: `helm install` meshes the nodes as the plain manifest does
//! (pods Ready, annotations, pods reached across through kilo0); `helm upgrade` changing a flag
//! rolls every kg pod, one node at a time as Kubernetes 1.20 does (the chart's `surge: auto`),
//! with kg's parts of each node's gap bounded as in the manifest's rollout; `helm rollback` to
//! the first revision rolls them back the same way and takes the flag away; `helm uninstall`
//! leaves nothing of kg on the nodes or in the API (no pod, annotation, route, ServiceAccount,
//! ClusterRole or binding), the CRDs kept as Helm keeps `crds/`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::{assert_cleaned_up, install_by, rollout, unavailable, wait_for, KubeletCluster, REPO};

/// The release's name.
const RELEASE: &str = "kilotun";

/// helm's path, fetched and cached by `scripts/helm-tools.sh`.
fn helm(test: &str) -> PathBuf {
    let out = Command::new("bash")
        .arg(Path::new(REPO).join("scripts/helm-tools.sh"))
        .output()
        .expect("running scripts/helm-tools.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let bin = stdout.lines().last().unwrap_or_default().trim().to_string();
    let helm = Path::new(&bin).join("helm");
    if !out.status.success() || !helm.is_file() {
        unavailable(
            test,
            &format!(
                "no helm: scripts/helm-tools.sh failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        );
    }
    helm
}

/// Runs helm with `args` against the cluster, panicking with its output on failure.
fn helm_ok(k: &KubeletCluster, helm: &Path, args: &[&str]) -> String {
    let out = Command::new(helm)
        .arg("--kubeconfig")
        .arg(&k.env["KUBECONFIG"])
        .args(args)
        .output()
        .expect("running helm");
    let text = crate::common::output_text(&out);
    assert!(out.status.success(), "helm {args:?}: {text}");
    text
}

/// kg's arguments in the DaemonSet's pod template.
fn kg_args(k: &KubeletCluster) -> Vec<String> {
    let ds = k.json(&["-n", "kube-system", "get", "daemonset", "kilo"]);
    ds["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| a.as_str().map(String::from))
        .collect()
}

/// True when `kind`/`name` (cluster-scoped, or in kube-system) exists.
fn exists(k: &KubeletCluster, kind: &str, name: &str) -> bool {
    k.kubectl(&["-n", "kube-system", "get", kind, name, "-o", "name"])
        .status
        .success()
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn the_chart_installs_upgrades_rolls_back_and_uninstalls_under_real_kubelets() {
    let test = "the_chart_installs_upgrades_rolls_back_and_uninstalls_under_real_kubelets";
    super::require_the_cluster_tools(test);
    let helm = helm(test);
    let Some(k) = KubeletCluster::up(test, 2, "kubeadm", "") else {
        return;
    };
    let chart = format!("{REPO}/charts/kilotun");
    let (pod_ips, _) = install_by(&k, "helm install", |k| {
        let out = helm_ok(
            k,
            &helm,
            &[
                "install",
                RELEASE,
                &chart,
                "--namespace",
                "kube-system",
                // Nothing can be pulled here: the image is imported into each node.
                "--set",
                "image.pullPolicy=Never",
            ],
        );
        eprintln!(
            "helm install: {}",
            out.lines().take(6).collect::<Vec<_>>().join("; ")
        );
    });
    let args = kg_args(&k);
    assert!(
        !args.iter().any(|a| a.starts_with("--log-level")),
        "the chart's defaults pass no --log-level: {args:?}"
    );

    rollout::roll_every_kg(&k, &pod_ips, "helm upgrade --set logLevel=debug", |k| {
        helm_ok(
            k,
            &helm,
            &[
                "upgrade",
                RELEASE,
                &chart,
                "--namespace",
                "kube-system",
                "--reuse-values",
                "--set",
                "logLevel=debug",
            ],
        );
    });
    let args = kg_args(&k);
    assert!(
        args.iter().any(|a| a == "--log-level=debug"),
        "the upgrade's flag in kg's arguments: {args:?}"
    );

    rollout::roll_every_kg(&k, &pod_ips, "helm rollback to revision 1", |k| {
        helm_ok(
            k,
            &helm,
            &["rollback", RELEASE, "1", "--namespace", "kube-system"],
        );
    });
    let args = kg_args(&k);
    assert!(
        !args.iter().any(|a| a.starts_with("--log-level")),
        "the rollback took back the upgrade's flag: {args:?}"
    );
    let history = helm_ok(
        &k,
        &helm,
        &["history", RELEASE, "--namespace", "kube-system"],
    );
    assert!(
        history.lines().any(|l| l.contains("Rollback to 1")),
        "helm history records the rollback: {history}"
    );

    helm_ok(
        &k,
        &helm,
        &["uninstall", RELEASE, "--namespace", "kube-system"],
    );
    wait_for("the kilo pods gone", Duration::from_secs(120), || {
        k.kilo_pods().is_empty()
    });
    assert_cleaned_up(&k, &pod_ips);
    for (kind, name) in [
        ("daemonset", "kilo"),
        ("serviceaccount", "kilo"),
        ("clusterrole", "kilo"),
        ("clusterrolebinding", "kilo"),
        ("role", "kilo-leases"),
        ("rolebinding", "kilo-leases"),
    ] {
        assert!(
            !exists(&k, kind, name),
            "{kind} {name} left by helm uninstall"
        );
    }
    assert!(
        exists(&k, "crd", "peers.kilo.squat.ai"),
        "the Peer CRD kept, as Helm keeps crds/"
    );
}
