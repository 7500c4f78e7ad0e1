//! A Peer's `status` on a real API server, written through `peers/status` by one kg (the
//! leader of the first segment) as the `kilo` ServiceAccount of `manifests/rbac.yaml`: who
//! serves it, what that kg's engine sees of it, and its configuration, which brings a laptop
//! up against the mesh; `kubectl get peers` prints the CRD's columns from it.

use super::*;

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn a_peers_status_comes_from_one_leader_and_its_config_brings_the_peer_up() {
    let Some(k) = KubeCluster::meshed_east_west(
        "a_peers_status_comes_from_one_leader_and_its_config_brings_the_peer_up",
    ) else {
        return;
    };
    let ns = common::Netns::new();
    k.c.attach(&ns, "east", 51);
    let device = common::WgDevice::start(&ns, common::Impl::Kilotun);
    k.kube.apply(&format!(
        "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: tablet\nspec:\n  allowedIPs:\n  - 10.5.0.51/32\n  publicKey: {}\n  persistentKeepalive: 10\n",
        device.public_key
    ));
    let status = |k: &KubeCluster| k.kube.get(&["peer", "tablet"])["status"].clone();
    let written = k.c.wait_for(Duration::from_secs(30), |_| {
        status(&k)["config"]
            .as_str()
            .is_some_and(|c| c.contains("[Peer]"))
    });
    assert!(
        written,
        "no status on Peer tablet: {}\n{}",
        status(&k),
        k.c.logs()
    );
    let first = status(&k);
    let reporter = first["reporter"].as_str().unwrap().to_string();
    let served: Vec<(String, String)> = first["servedBy"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["location"].as_str().unwrap().into(),
                s["node"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        served.iter().map(|(l, _)| l.as_str()).collect::<Vec<_>>(),
        ["east", "west"],
        "{first}"
    );
    assert_eq!(
        served[0].1, reporter,
        "the first segment's leader reports: {first}"
    );
    assert_eq!(
        first["connected"], false,
        "nothing heard from the tablet yet: {first}"
    );
    let config = first["config"].as_str().unwrap().to_string();
    assert!(
        !config.contains("PrivateKey") && !config.contains("PresharedKey"),
        "{config}"
    );
    // Only the reporter's kg wrote the status (its field manager), no other.
    let peer = k.kube.get(&["peer", "tablet"]);
    let status_managers: Vec<&str> = peer["metadata"]["managedFields"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["fieldsV1"].get("f:status").is_some())
        .filter_map(|m| m["manager"].as_str())
        .collect();
    assert_eq!(status_managers, [format!("kg-{reporter}")], "{peer}");

    // The status's configuration, with the tablet's key, brings it up against the mesh.
    k.bring_up_peer(&ns, &device, "tablet", &config, "10.5.0.51");
    // Connected now: the reporter's engine has the tablet's endpoint and a handshake.
    let connected =
        k.c.wait_for(Duration::from_secs(60), |_| status(&k)["connected"] == true);
    let now = status(&k);
    assert!(connected, "{now}\n{}", k.c.logs());
    assert_eq!(now["reporter"], reporter.as_str());
    assert!(
        now["endpoint"].as_str().is_some_and(|e| !e.is_empty()),
        "{now}"
    );
    assert!(
        now["lastHandshakeTime"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{now}"
    );
    assert!(now["rxBytes"].as_u64().is_some_and(|b| b > 0), "{now}");
    // kubectl prints the CRD's columns from it.
    let table = k.kube.kubectl(&["get", "peers"]);
    let header = table.lines().next().unwrap_or_default();
    for column in ["CONNECTED", "ENDPOINT", "LAST HANDSHAKE", "SERVED BY"] {
        assert!(header.contains(column), "{table}");
    }
    let row = table
        .lines()
        .find(|l| l.starts_with("tablet"))
        .unwrap_or_default();
    assert!(
        row.contains("true") && row.contains(&format!("east={reporter}")),
        "{table}"
    );
    println!("kubectl get peers:\n{table}");
    drop(device);
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn a_crd_without_the_status_subresource_is_said_once_and_meshing_goes_on() {
    let Some(k) = KubeCluster::meshed_east_west(
        "a_crd_without_the_status_subresource_is_said_once_and_meshing_goes_on",
    ) else {
        return;
    };
    // Kilo's own CRD has no status subresource: take it away from kilotun's.
    k.kube.kubectl(&[
        "patch",
        "crd",
        "peers.kilo.squat.ai",
        "--type=json",
        "-p",
        r#"[{"op":"remove","path":"/spec/versions/0/subresources"}]"#,
    ]);
    for (name, ip) in [("phone", "10.5.0.61/32"), ("watch", "10.5.0.62/32")] {
        let key = common::run(&["sh", "-c", "wg genkey | wg pubkey"]);
        k.kube.apply(&format!(
            "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: {name}\nspec:\n  allowedIPs:\n  - {ip}\n  publicKey: {}\n",
            key.trim()
        ));
    }
    let refused = k.wait_kube_events("PeerStatusRefused", 30, |e| !e.is_empty());
    std::thread::sleep(Duration::from_secs(10));
    let refused_later = k.kube_events("PeerStatusRefused");
    assert_eq!(
        refused_later.len(),
        1,
        "said once for two Peers: {refused_later:?}"
    );
    let (instance, _, _, kind, note) = &refused[0];
    assert_eq!(
        (instance.as_str(), kind.as_str()),
        ("kg-n1", "Warning"),
        "{refused:?}"
    );
    assert!(note.contains("status subresource"), "{note}");
    // The mesh goes on: both Peers are in the leaders' engines and every pod reaches every other.
    let peers = k.c.node("n1").wg("peers");
    assert_eq!(peers.lines().count(), 3, "n3 and both Peers: {peers}");
    assert!(
        k.c.all_pods_reachable().is_ok(),
        "{:?}\n{}",
        k.c.all_pods_reachable(),
        k.c.logs()
    );
    let status = k.kube.get(&["peer", "phone"])["status"].clone();
    assert!(status.is_null(), "no status written: {status}");
}
