//! The line `docs/rollouts.md` gives for clusters before 1.22 turns the manifests' surge rollout
//! into the default one-node-at-a-time rollout and changes nothing else, and the README's
//! install lines give the same command.

use crate::old_clusters::{before_1_22, documented_command};

const REPO: &str = env!("CARGO_MANIFEST_DIR");
const SURGE: &str = "    rollingUpdate:\n      maxSurge: 1\n      maxUnavailable: 0\n";
const ONE_AT_A_TIME: &str = "    rollingUpdate:\n      maxUnavailable: 1\n";

#[test]
fn the_line_for_clusters_before_1_22_turns_surge_off_and_changes_nothing_else() {
    for name in ["kilo-kubeadm.yaml", "kilo-k3s.yaml"] {
        let shipped = std::fs::read_to_string(format!("{REPO}/manifests/{name}")).unwrap();
        assert_eq!(
            shipped.matches(SURGE).count(),
            1,
            "{name}: no surge strategy"
        );
        let old = before_1_22(&shipped);
        assert_eq!(
            old,
            shipped.replace(SURGE, ONE_AT_A_TIME),
            "{name} through `{}`",
            documented_command()
        );
    }
    let readme = std::fs::read_to_string(format!("{REPO}/README.md")).unwrap();
    let line = format!(
        "{} manifests/kilo-kubeadm.yaml | kubectl apply -f -",
        documented_command()
    );
    assert!(
        readme.contains(&line),
        "README.md's install lines do not give `{line}`"
    );
}
