//! What each kg publishes on its Node, against other writers: an annotation kg writes that
//! another writer removes is written again within one resync, also when the Node is set back to
//! exactly what kg's last patch was sent against (the patch is not mistaken for one the watch
//! has not shown yet), and the mesh heals.

use std::collections::BTreeSet;
use std::time::Duration;

use control::node::annotation;
use control::node::Granularity;

use super::check;
use super::settings::Election;
use super::sim::Sim;

fn published(sim: &Sim, name: &str, key: &str) -> Option<String> {
    sim.cluster.snapshot().nodes[name]
        .metadata
        .annotations
        .as_ref()?
        .get(key)
        .cloned()
}

#[test]
fn an_annotation_removed_by_another_writer_is_written_again_each_time() {
    for granularity in [Granularity::Location, Granularity::Full] {
        let mut sim = Sim::meshed(Election::Lease, granularity).unwrap();
        for location in [0, 0, 1] {
            sim.join(&format!("l{location}")).unwrap();
        }
        sim.advance(Duration::from_secs(10)).unwrap();
        check::converged(&sim, &BTreeSet::new(), &[])
            .unwrap_or_else(|e| panic!("{granularity:?}: {e}"));
        let key = published(&sim, "n01", annotation::KEY).expect("n01 publishes its key");
        for round in 1..=3 {
            sim.annotate("n01", annotation::KEY, None);
            sim.advance(Duration::from_secs(3)).unwrap();
            assert_eq!(
                published(&sim, "n01", annotation::KEY).as_deref(),
                Some(key.as_str()),
                "{granularity:?}: n01's key not written again 3 s after removal {round}"
            );
        }
        sim.advance(Duration::from_secs(10)).unwrap();
        check::converged(&sim, &BTreeSet::new(), &[])
            .unwrap_or_else(|e| panic!("{granularity:?}: {e}"));
    }
}
