//! The Helm chart (`charts/kilotun`) with the real helm v4.1.4 and kubectl v1.35.2
//! (`scripts/helm-tools.sh`): lint, schema and render checks (`tests/helm/lint.sh`, no cluster),
//! and install, upgrade, rollback and uninstall against a real kube-apiserver 1.20.2
//! (`tests/helm/install.sh`), and the takeover from Cozystack's chart (`tests/helm/cozystack.sh`,
//! which needs Cozystack's source; `.ci/run` leaves it out where that is missing). Each script
//! prints what it checked; exit 77 means a tool or source is missing, which fails here (the test
//! is run only where `.ci/run` installed the tools).

use std::process::Command;

/// Runs `tests/helm/<script>` and fails with its output unless it exits 0.
fn run_script(script: &str) {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("bash")
        .arg(format!("{root}/tests/helm/{script}"))
        .current_dir(root)
        .output()
        .unwrap_or_else(|e| panic!("running tests/helm/{script}: {e}"));
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    eprintln!("{stdout}{stderr}");
    match out.status.code() {
        Some(0) => {}
        Some(77) => {
            panic!("tests/helm/{script} could not run: a tool or source is missing\n{stderr}")
        }
        other => panic!("tests/helm/{script} failed ({other:?})\n{stdout}\n{stderr}"),
    }
}

#[test]
#[ignore = "needs the helm that scripts/helm-tools.sh fetches (.ci/run does)"]
fn the_chart_lints_renders_the_manifests_and_refuses_bad_values() {
    run_script("lint.sh");
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn the_chart_installs_upgrades_rolls_back_and_uninstalls_on_a_real_api_server() {
    crate::common::require_root(
        "the_chart_installs_upgrades_rolls_back_and_uninstalls_on_a_real_api_server",
    );
    run_script("install.sh");
}

#[test]
#[ignore = "needs root, the real parts .ci/run installs and Cozystack's source"]
fn the_chart_takes_over_from_cozystacks_chart_on_a_real_api_server() {
    crate::common::require_root("the_chart_takes_over_from_cozystacks_chart_on_a_real_api_server");
    run_script("cozystack.sh");
}
