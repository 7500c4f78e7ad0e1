//! Kubernetes Events (`events.k8s.io/v1`) on a real API server, written as the `kilo`
//! ServiceAccount of `manifests/rbac.yaml`: a node's own problem is posted by its own kg,
//! what every kg sees alike by one kg, and nothing twice.

use super::*;

impl KubeCluster {
    /// kg's Events of `reason`, as stored: (reporting instance, regarding kind, regarding
    /// name, type, note).
    pub(super) fn kube_events(
        &self,
        reason: &str,
    ) -> Vec<(String, String, String, String, String)> {
        let list = self
            .kube
            .get(&["events.events.k8s.io", "-n", "kube-system"]);
        let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
        list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["reportingController"] == "kilotun.io/kg" && e["reason"] == reason)
            .map(|e| {
                (
                    text(&e["reportingInstance"]),
                    text(&e["regarding"]["kind"]),
                    text(&e["regarding"]["name"]),
                    text(&e["type"]),
                    text(&e["note"]),
                )
            })
            .collect()
    }

    /// Waits up to `secs` for kg's Events of `reason` to satisfy `done`; panics with what there
    /// is otherwise.
    pub(super) fn wait_kube_events(
        &self,
        reason: &str,
        secs: u64,
        done: impl Fn(&[(String, String, String, String, String)]) -> bool,
    ) -> Vec<(String, String, String, String, String)> {
        let reached = self.c.wait_for(Duration::from_secs(secs), |_| {
            done(&self.kube_events(reason))
        });
        let events = self.kube_events(reason);
        assert!(reached, "{reason}: {events:?}\n{}", self.c.logs());
        events
    }
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn each_problem_is_one_kubernetes_event_from_the_kg_it_concerns() {
    let Some(k) = KubeCluster::meshed_east_west(
        "each_problem_is_one_kubernetes_event_from_the_kg_it_concerns",
    ) else {
        return;
    };
    // A bad annotation on n3: n3's kg posts it, regarding its Node; n1 and n2 see it too and
    // leave it to n3.
    k.kube.kubectl(&[
        "annotate",
        "node",
        "n3",
        "kilo.squat.ai/persistent-keepalive=often",
    ]);
    let bad = k.wait_kube_events("BadAnnotation", 30, |e| !e.is_empty());
    let (instance, kind, name, kind_of, note) = &bad[0];
    assert_eq!(
        (
            instance.as_str(),
            kind.as_str(),
            name.as_str(),
            kind_of.as_str()
        ),
        ("kg-n3", "Node", "n3", "Warning"),
        "{bad:?}"
    );
    assert!(note.contains("persistent-keepalive"), "{note}");

    // A Peer whose key is not a key: every kg finds it bad, one posts it (n1, the first ready
    // node by name), regarding the Peer.
    k.kube.apply(
        "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: broken\nspec:\n  allowedIPs:\n  - 10.5.0.9/32\n  publicKey: not-a-key\n  persistentKeepalive: 0\n",
    );
    let peer = k.wait_kube_events("BadPeer", 30, |e| !e.is_empty());
    assert_eq!(
        (peer[0].0.as_str(), peer[0].1.as_str(), peer[0].2.as_str()),
        ("kg-n1", "Peer", "broken"),
        "{peer:?}"
    );

    // Ten seconds on, and a resync of every kg later: still one of each (no other kg posted,
    // none posted again).
    std::thread::sleep(Duration::from_secs(10));
    assert_eq!(
        k.kube_events("BadAnnotation").len(),
        1,
        "{:?}",
        k.kube_events("BadAnnotation")
    );
    assert_eq!(
        k.kube_events("BadPeer").len(),
        1,
        "{:?}",
        k.kube_events("BadPeer")
    );
    // Each kg counted what it wrote: n3 one Event at least, none failed.
    let metrics = k.c.node("n3").http_get("/metrics").1;
    let count = |result: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(&format!("kilotun_api_events_total{{result=\"{result}\"}}")))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    assert!(count("posted") >= 1.0, "{metrics}");
    assert_eq!(count("failed"), 0.0, "{metrics}");
}
