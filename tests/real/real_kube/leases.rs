//! `--leader-election=lease` against the real API server: a leader whose port is blocked, and
//! a dead leader, each handing over through the `kube-system` Lease.

use super::*;
use control::journal::Reason;

impl KubeCluster {
    /// n1 and n2 in east, n3 in west, every kg electing by lease. Returns the cluster, east's
    /// leader (the Lease's holder), the other east node with its pod address, and n3 pinging
    /// that pod through the leader (already flowing).
    fn east_west_by_lease(
        test: &str,
    ) -> Option<(Self, String, (&'static str, &'static str), Pinger)> {
        let k = Self::meshed_with(
            test,
            "",
            &[("n1", "east"), ("n2", "east"), ("n3", "west")],
            &["--leader-election=lease"],
        )?;
        let held =
            k.c.wait_for(Duration::from_secs(20), |_| east_lease_holder(&k).is_some());
        assert!(held, "no lease\n{}", k.c.logs());
        let leader = east_lease_holder(&k).unwrap();
        let other = if leader == "n1" {
            ("n2", "10.42.2.1")
        } else {
            ("n1", "10.42.1.1")
        };
        let pinger = Pinger::start(&k.c.node("n3").ns.name, other.1);
        assert!(pinger.wait_flowing(
            Instant::now() - Duration::from_secs(1),
            Duration::from_secs(10)
        ));
        Some((k, leader, other, pinger))
    }
}

/// The holder of east's Lease, read with kubectl.
fn east_lease_holder(k: &KubeCluster) -> Option<String> {
    east_lease_field(k, "{.spec.holderIdentity}")
}

/// A field of east's Lease (a kubectl JSONPath), when it is set.
fn east_lease_field(k: &KubeCluster, path: &str) -> Option<String> {
    lease_field(k, "kilotun-leader-east", path)
}

/// A field of the `kube-system` Lease `name` (a kubectl JSONPath), when it is set.
fn lease_field(k: &KubeCluster, name: &str, path: &str) -> Option<String> {
    let out = k.kube.kubectl_output(
        &[
            "-n",
            "kube-system",
            "get",
            "lease",
            name,
            "-o",
            &format!("jsonpath={path}"),
        ],
        None,
    );
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !text.is_empty()).then_some(text)
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn a_leader_with_its_port_blocked_hands_over_through_a_kubernetes_lease() {
    let test = "a_leader_with_its_port_blocked_hands_over_through_a_kubernetes_lease";
    let Some((k, leader, (other, _), pinger)) = KubeCluster::east_west_by_lease(test) else {
        return;
    };
    // The leader stays alive and Ready, its API connection untouched; only WireGuard's port
    // is dropped.
    let blocked = Instant::now();
    k.c.node(&leader).block_wireguard();
    let back = pinger.wait_flowing(blocked, Duration::from_secs(45));
    let gap = pinger.longest_gap_after(blocked);
    eprintln!(
        "blocked leader on the Kubernetes backend: traffic back after a gap of {:.1} s",
        gap.as_secs_f64()
    );
    assert!(back, "traffic never came back\n{}", k.c.logs());
    assert!(gap < Duration::from_secs(30), "gap {gap:?}\n{}", k.c.logs());
    let moved = k.c.wait_for(Duration::from_secs(5), |_| {
        east_lease_holder(&k).as_deref() == Some(other)
    });
    assert!(moved, "{:?}\n{}", east_lease_holder(&k), k.c.logs());
    assert!(
        !k.c.node(other)
            .events_of(Reason::LeaderReplacedCutOff)
            .is_empty(),
        "{}",
        k.c.logs()
    );
    // The Lease names the holder it replaced, kept out while the new one holds it.
    assert_eq!(
        east_lease_field(
            &k,
            r"{.metadata.annotations.kilotun\.io/cut-off-predecessor}"
        )
        .as_deref(),
        Some(leader.as_str()),
        "{}",
        k.c.logs()
    );
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn a_dead_leader_hands_over_through_a_kubernetes_lease() {
    let test = "a_dead_leader_hands_over_through_a_kubernetes_lease";
    let Some((mut k, leader, (other, other_pod), pinger)) = KubeCluster::east_west_by_lease(test)
    else {
        return;
    };
    let holder = east_lease_holder;
    let killed = Instant::now();
    let index = if leader == "n1" { 0 } else { 1 };
    k.c.nodes[index].kill();
    k.c.node(&leader)
        .ns
        .run(&["ip", "link", "set", "eth0", "down"]);
    let back = pinger.wait_flowing(killed, Duration::from_secs(30));
    let gap = pinger.longest_gap_after(killed);
    eprintln!(
        "dead leader on the Kubernetes backend: traffic back after a gap of {:.1} s",
        gap.as_secs_f64()
    );
    assert!(back, "traffic never came back\n{}", k.c.logs());
    // Usually about 5 s. Both sides switch to the new leader at about the same moment; west's
    // first handshake initiation may reach it just before it has added west as a peer (14 ms
    // before, in one run). The engine holds such an initiation and answers it at its next
    // timer tick, instead of leaving west to retry after WireGuard's REKEY_TIMEOUT (5 s more).
    assert!(gap < Duration::from_secs(12), "gap {gap:?}\n{}", k.c.logs());
    let moved = k.c.wait_for(Duration::from_secs(10), |_| {
        holder(&k).as_deref() == Some(other)
    });
    assert!(moved, "{:?}\n{}", holder(&k), k.c.logs());

    // The old leader comes back (it does not take the lead back), then the new one is cordoned
    // with kubectl: the lead returns before the cordoned node goes, with next to no loss.
    k.c.node(&leader)
        .ns
        .run(&["ip", "link", "set", "eth0", "up"]);
    k.start(index, &["--leader-election=lease"]);
    std::thread::sleep(Duration::from_secs(8));
    assert_eq!(holder(&k).as_deref(), Some(other), "{}", k.c.logs());
    let pinger = Pinger::start(&k.c.node("n3").ns.name, other_pod);
    assert!(pinger.wait_flowing(
        Instant::now() - Duration::from_secs(1),
        Duration::from_secs(10)
    ));
    let cordoned = Instant::now();
    k.kube.kubectl(&["cordon", other]);
    let returned = k.c.wait_for(Duration::from_secs(10), |_| {
        holder(&k).as_deref() == Some(leader.as_str())
    });
    assert!(returned, "{:?}\n{}", holder(&k), k.c.logs());
    std::thread::sleep(Duration::from_secs(3));
    let gap = pinger.longest_gap_after(cordoned);
    eprintln!(
        "cordoned leader on the Kubernetes backend: longest gap {:.1} s",
        gap.as_secs_f64()
    );
    assert!(
        gap <= Duration::from_millis(1500),
        "gap {gap:?}\n{}",
        k.c.logs()
    );
}

/// A DaemonSet `kilo` in kube-system (no controller runs it here) and a Pod per node that it
/// owns, as the DaemonSet controller would create them; kg finds its Pod by `POD_NAME`.
fn daemon_set_with_pods(k: &KubeCluster) {
    k.kube.apply(
        "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: kilo\n  namespace: kube-system\nspec:\n  selector:\n    matchLabels:\n      app: kilo\n  template:\n    metadata:\n      labels:\n        app: kilo\n    spec:\n      containers:\n        - name: kilo\n          image: kilotun:0.1.0\n",
    );
    let uid = k.kube.get(&["-n", "kube-system", "daemonset", "kilo"])["metadata"]["uid"]
        .as_str()
        .unwrap()
        .to_string();
    for n in &k.c.nodes {
        k.kube.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: kilo-{node}\n  namespace: kube-system\n  labels:\n    app: kilo\n  ownerReferences:\n    - apiVersion: apps/v1\n      kind: DaemonSet\n      name: kilo\n      uid: {uid}\n      controller: true\nspec:\n  nodeName: {node}\n  serviceAccountName: kilo\n  automountServiceAccountToken: false\n  containers:\n    - name: kilo\n      image: kilotun:0.1.0\n",
            node = n.name
        ));
    }
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn a_replaced_kg_keeps_the_node_for_its_successor_and_an_uninstalled_one_cleans_up() {
    let test = "a_replaced_kg_keeps_the_node_for_its_successor_and_an_uninstalled_one_cleans_up";
    let Some(mut k) = KubeCluster::new(
        test,
        "",
        &["east", "west"],
        &[("n1", "east"), ("n2", "east"), ("n3", "west")],
    ) else {
        return;
    };
    daemon_set_with_pods(&k);
    let start = |k: &mut KubeCluster, i: usize| {
        let kubeconfig = format!("--kubeconfig={}", k.kilo_kubeconfig.display());
        let mut flags = KG_FLAGS.to_vec();
        flags.extend([kubeconfig.as_str(), "--leader-election=lease"]);
        let env = [
            ("POD_NAME", format!("kilo-{}", k.c.nodes[i].name)),
            ("POD_NAMESPACE", "kube-system".to_string()),
        ];
        k.c.start_kg_with_env(i, &flags, &env);
    };
    for i in 0..3 {
        start(&mut k, i);
    }
    k.assert_meshed(60);
    let held =
        k.c.wait_for(Duration::from_secs(20), |_| east_lease_holder(&k).is_some());
    assert!(held, "no lease\n{}", k.c.logs());
    let leader = east_lease_holder(&k).unwrap();
    let index = k.c.nodes.iter().position(|n| n.name == leader).unwrap();
    let other = if leader == "n1" {
        "10.42.2.1"
    } else {
        "10.42.1.1"
    };
    let pinger = Pinger::start(&k.c.node("n3").ns.name, other);
    assert!(pinger.wait_flowing(Instant::now(), Duration::from_secs(10)));

    // A rollout or restart: SIGTERM while the DaemonSet remains. The node keeps its
    // annotations (so nobody elects around it) and the lease; the next kg takes over.
    let stopped = Instant::now();
    k.c.nodes[index].stop();
    own_events(&k, &leader, "Replaced", 1);
    let annotations = k.annotations(&leader);
    assert!(
        annotations["kilo.squat.ai/key"].is_string()
            && annotations["kilo.squat.ai/endpoint"].is_string(),
        "{annotations}"
    );
    start(&mut k, index);
    let back = pinger.wait_flowing(stopped, Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(2));
    let gap = pinger.longest_gap_after(stopped);
    eprintln!(
        "SIGTERM and restart of east's leader under its DaemonSet: traffic back after a gap of {:.1} s",
        gap.as_secs_f64()
    );
    assert!(back, "traffic never came back\n{}", k.c.logs());
    assert!(gap < Duration::from_secs(2), "gap {gap:?}\n{}", k.c.logs());
    assert_eq!(
        east_lease_holder(&k).as_deref(),
        Some(leader.as_str()),
        "the lease stays"
    );

    // A surge rollout (`maxSurge`, Kubernetes 1.22 and later): the new pod's kg starts beside
    // the old one, stands by (answering /health, so the pod turns Ready) without touching the
    // engine, and takes over the moment the old kg exits.
    let mut old = k.c.nodes[index].detach();
    start(&mut k, index);
    let standing_by = k.c.wait_for(Duration::from_secs(10), |c| {
        let (status, body) = c.nodes[index].http_get("/ready");
        status == 200 && body.starts_with("standing by")
    });
    assert!(standing_by, "{}", k.c.nodes[index].log_text());
    let beside = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        pinger.longest_gap_after(beside) < Duration::from_millis(500),
        "the standby disturbed the running kg\n{}",
        k.c.logs()
    );
    assert_eq!(k.c.nodes[index].http_get("/health").0, 200);
    let stopped = Instant::now();
    assert!(
        old.stop(),
        "the old kg did not exit by itself with 0\n{}",
        old.log_text()
    );
    own_events(&k, &leader, "Replaced", 2);
    let back = pinger.wait_flowing(stopped, Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(2));
    let gap = pinger.longest_gap_after(stopped);
    eprintln!(
        "surge handover of east's leader (the new kg waited beside the old one): traffic back after a gap of {:.2} s",
        gap.as_secs_f64()
    );
    assert!(back, "traffic never came back\n{}", k.c.logs());
    own_events(&k, &leader, "TookOver", 1);
    // The old kg closed its engine before it let go of the lock: the port was free at once.
    assert!(
        !k.c.nodes[index]
            .log_text()
            .contains("waited for the UDP port to be released"),
        "{}",
        k.c.nodes[index].log_text()
    );
    assert!(gap < Duration::from_secs(1), "gap {gap:?}\n{}", k.c.logs());
    assert_eq!(
        east_lease_holder(&k).as_deref(),
        Some(leader.as_str()),
        "the lease stays"
    );

    // An uninstall: the DaemonSet is gone, so SIGTERM cleans up as Kilo does.
    // Background deletion (the default): no garbage collector runs here, so the Pods stay,
    // owned by a DaemonSet that no longer exists, as they are for a moment in a real cluster.
    k.kube.kubectl(&[
        "-n",
        "kube-system",
        "delete",
        "daemonset",
        "kilo",
        "--wait=false",
    ]);
    k.c.nodes[index].stop();
    own_events(&k, &leader, "Removed", 1);
    let annotations = k.annotations(&leader);
    assert!(annotations["kilo.squat.ai/key"].is_null(), "{annotations}");
}

/// Waits up to 10 s for `node`'s kg to have posted `n` Events of `reason` about its own Node.
fn own_events(k: &KubeCluster, node: &str, reason: &str, n: usize) {
    let instance = format!("kg-{node}");
    k.wait_kube_events(reason, 10, |events| {
        events
            .iter()
            .filter(|(by, kind, name, _, _)| *by == instance && kind == "Node" && name == node)
            .count()
            >= n
    });
}

/// The holder of the `kube-system` Lease `name`, read with kubectl.
fn lease_holder(k: &KubeCluster, name: &str) -> Option<String> {
    lease_field(k, name, "{.spec.holderIdentity}")
}

/// Two leaders in east (`--leaders-per-location=2`), each holding a Lease of its own on the
/// real API server; the second dies, and its Lease, with its share, passes to a node that led
/// nothing, while the first keeps its Lease and its share.
#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn a_second_leader_hands_its_share_over_through_its_own_kubernetes_lease() {
    let test = "a_second_leader_hands_its_share_over_through_its_own_kubernetes_lease";
    let nodes = [
        ("n1", "east"),
        ("n2", "east"),
        ("n3", "east"),
        ("n4", "east"),
        ("n5", "west"),
    ];
    let flags = ["--leader-election=lease", "--leaders-per-location=2"];
    let Some(mut k) = KubeCluster::meshed_with(test, "", &nodes, &flags) else {
        return;
    };
    let (first_lease, second_lease) = ("kilotun-leader-east", "kilotun-leader-east.share2");
    let held = k.c.wait_for(Duration::from_secs(20), |_| {
        lease_holder(&k, first_lease).is_some() && lease_holder(&k, second_lease).is_some()
    });
    assert!(held, "no leases\n{}", k.c.logs());
    let first = lease_holder(&k, first_lease).unwrap();
    let second = lease_holder(&k, second_lease).unwrap();
    assert_ne!(first, second);
    let follower =
        k.c.routed_through("n5", &second)
            .into_iter()
            .find(|n| *n != second)
            .expect("the second share has a follower");
    let pod = k.c.node(&follower).pod_ip.clone();
    let pinger = Pinger::start(&k.c.node("n5").ns.name, &pod);
    assert!(pinger.wait_flowing(
        Instant::now() - Duration::from_secs(1),
        Duration::from_secs(10)
    ));
    let killed = Instant::now();
    let index = nodes.iter().position(|(n, _)| *n == second).unwrap();
    k.c.nodes[index].kill();
    k.c.node(&second)
        .ns
        .run(&["ip", "link", "set", "eth0", "down"]);
    let back = pinger.wait_flowing(killed, Duration::from_secs(30));
    let gap = pinger.longest_gap_after(killed);
    eprintln!(
        "second leader {second} dead on the Kubernetes backend: its share ({follower}) back after {:.1} s",
        gap.as_secs_f64()
    );
    assert!(back, "the share never came back\n{}", k.c.logs());
    assert!(gap < Duration::from_secs(12), "gap {gap:?}\n{}", k.c.logs());
    let moved = k.c.wait_for(Duration::from_secs(10), |_| {
        lease_holder(&k, second_lease).is_some_and(|h| h != second && h != first)
    });
    assert!(
        moved,
        "{:?}\n{}",
        lease_holder(&k, second_lease),
        k.c.logs()
    );
    assert_eq!(lease_holder(&k, first_lease), Some(first));
}
