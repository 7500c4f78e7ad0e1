//! The node condition `KiloMeshReady` on a real API server, written through `nodes/status` as
//! the `kilo` ServiceAccount of `manifests/rbac.yaml`: each node's judgement, a leader whose
//! tunnel stops answering, and its return.

use super::*;

/// Node `name`'s `KiloMeshReady` condition as stored: (status, reason, message).
fn condition(k: &KubeCluster, name: &str) -> Option<(String, String, String)> {
    let node = k.kube.get(&["node", name]);
    let found = node["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "KiloMeshReady")?
        .clone();
    let text = |f: &str| found[f].as_str().unwrap_or_default().to_string();
    Some((text("status"), text("reason"), text("message")))
}

/// Waits up to `secs` for `name`'s condition to have `status` and `reason`.
fn wait_condition(k: &KubeCluster, name: &str, status: &str, reason: &str, secs: u64) {
    let reached = k.c.wait_for(Duration::from_secs(secs), |_| {
        condition(k, name).is_some_and(|(s, r, _)| s == status && r == reason)
    });
    assert!(
        reached,
        "{name}: wanted {status}/{reason} within {secs} s, found {:?}\n{}",
        condition(k, name),
        k.c.logs()
    );
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn kilo_mesh_ready_says_a_leader_is_cut_off_and_back() {
    let Some(mut k) = KubeCluster::meshed_with(
        "kilo_mesh_ready_says_a_leader_is_cut_off_and_back",
        "",
        &[("n1", "east"), ("n2", "east"), ("n3", "west")],
        &["--resync-period=5s"],
    ) else {
        return;
    };
    wait_condition(&k, "n1", "True", "Meshed", 30);
    wait_condition(&k, "n3", "True", "Meshed", 30);
    wait_condition(&k, "n2", "True", "FollowsLeader", 30);
    let (_, _, follower) = condition(&k, "n2").unwrap();
    assert!(follower.contains("n1"), "n2's message: {follower}");
    // The kubelet's own conditions are not there (no kubelet), and kg's merge added only its
    // own: one condition.
    let conditions = k.kube.get(&["node", "n1"])["status"]["conditions"].clone();
    assert_eq!(conditions.as_array().map(Vec::len), Some(1), "{conditions}");

    // n3's WireGuard port blocked while n1 sends to it: n1's only tunnel to another location
    // answers nothing for 12 s, and n1 says so at a pass after that.
    let pinger = common::pinger::Pinger::start(&k.c.node("n1").ns.name, &k.c.node("n3").pod_ip);
    k.c.node("n3").block_wireguard();
    wait_condition(&k, "n1", "False", "NoLeaderReachable", 45);
    let (_, _, message) = condition(&k, "n1").unwrap();
    assert!(message.contains("n3"), "n1's message: {message}");
    eprintln!("n1 cut off: {message}");
    // The tunnel's fall is an event: on /status, and a Warning Event on n1's Node from n1.
    let downs = k.c.node("n1").events_of(Reason::LinkDown);
    assert_eq!(
        downs.iter().map(|e| e.subject.as_str()).collect::<Vec<_>>(),
        ["n3"],
        "{downs:?}"
    );
    // n3 may judge its own tunnel to n1 down too (it sends to n1 at a rekey or a keepalive and
    // hears nothing): that is n3's to post, about n3. n1 posts once, about n1.
    let from_n1 = |e: &[(String, String, String, String, String)]| {
        e.iter().filter(|(from, ..)| from == "kg-n1").count()
    };
    let posted = k.wait_kube_events("LinkDown", 30, |e| from_n1(e) > 0);
    assert!(
        posted.iter().all(
            |(from, kind, name, kind_of, _)| *from == format!("kg-{name}")
                && kind == "Node"
                && kind_of == "Warning"
        ),
        "{posted:?}"
    );
    assert_eq!(from_n1(&posted), 1, "{posted:?}");
    assert!(
        posted.iter().all(|(from, .., message)| {
            let other = if from == "kg-n1" { "n3" } else { "n1" };
            message.contains(&format!("tunnel to {other}"))
        }),
        "{posted:?}"
    );

    // Unblocked: n1 hears n3 again and the condition is True at most 10 s after the last write.
    for (chain, port) in [
        ("INPUT", "--dport"),
        ("OUTPUT", "--dport"),
        ("INPUT", "--sport"),
    ] {
        k.c.node("n3").ns.run(&[
            "iptables", "-D", chain, "-p", "udp", port, "51820", "-j", "DROP",
        ]);
    }
    wait_condition(&k, "n1", "True", "Meshed", 45);
    drop(pinger);
    // Its return too, once, saying how long it was down.
    let ups = k.c.node("n1").events_of(Reason::LinkUp);
    assert_eq!(ups.len(), 1, "{ups:?}");
    assert_eq!(ups[0].subject, "n3");
    assert_eq!(k.c.node("n1").events_of(Reason::LinkDown).len(), 1);
    let posted = k.wait_kube_events("LinkUp", 30, |e| from_n1(e) > 0);
    assert_eq!(from_n1(&posted), 1, "{posted:?}");

    // A restarted kg reads the condition its Node carries: the follower's status is unchanged,
    // so its lastTransitionTime and lastHeartbeatTime stay (nothing is written before the
    // heartbeat is due).
    let times = |k: &KubeCluster| {
        let node = k.kube.get(&["node", "n2"]);
        let c = node["status"]["conditions"]
            .as_array()
            .and_then(|all| all.iter().find(|c| c["type"] == "KiloMeshReady").cloned())
            .unwrap_or_default();
        (
            c["lastTransitionTime"].clone(),
            c["lastHeartbeatTime"].clone(),
        )
    };
    let before = times(&k);
    k.c.nodes[1].stop();
    k.start(1, &["--resync-period=5s"]);
    let answers =
        k.c.wait_for(Duration::from_secs(20), |c| c.node("n2").status().is_some());
    assert!(answers, "{}", k.c.logs());
    // Two resyncs, each a pass that judges the condition.
    std::thread::sleep(Duration::from_secs(11));
    wait_condition(&k, "n2", "True", "FollowsLeader", 5);
    assert_eq!(times(&k), before, "{}", k.c.node("n2").log_text());
}
