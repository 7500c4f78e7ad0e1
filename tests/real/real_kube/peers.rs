//! Peers through the real API server: the validating webhook and the CRD's schema, an
//! external peer from `kgctl showconf`, `kgctl connect`, and two clusters joined through their
//! leaders.

use super::common;
use super::*;

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn the_peer_webhook_refuses_invalid_peers_for_the_api_server() {
    let test = "the_peer_webhook_refuses_invalid_peers_for_the_api_server";
    let Some(kube) = RealKube::start(test) else {
        return;
    };
    kube.apply_manifest("crds.yaml");
    let work = kube.dir.join("webhook");
    std::fs::create_dir_all(&work).unwrap();
    // An address of this process's own (no other test binds it), so fixed ports cannot collide.
    let ip = common::own_loopback();
    let (cert, key) =
        common::webhook::self_signed_cert(&work, &ip.to_string(), &format!("IP:{ip}"));
    let (port, metrics) = (8443, 8080);
    let log = std::fs::File::create(work.join("webhook.log")).unwrap();
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _webhook = Killed(
        std::process::Command::new(kg_bin())
            .arg("webhook")
            .arg(format!("--cert-file={}", cert.display()))
            .arg(format!("--key-file={}", key.display()))
            .arg(format!("--listen={ip}:{port}"))
            .arg(format!("--listen-metrics={ip}:{metrics}"))
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let listening = (0..100).any(|_| {
        std::net::TcpStream::connect((ip, port)).is_ok() || {
            std::thread::sleep(Duration::from_millis(100));
            false
        }
    });
    assert!(listening, "kg webhook did not listen");
    // peer-validation.yaml's webhook, reached by URL instead of through its Service (there is
    // no Pod network here); everything else as in the manifest.
    let ca = base64_file(&cert);
    kube.apply(&format!(
        "apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: peer-validation
webhooks:
  - name: peers.kilo.squat.ai
    admissionReviewVersions: [\"v1\"]
    sideEffects: None
    failurePolicy: Fail
    timeoutSeconds: 5
    clientConfig:
      url: https://{ip}:{port}/validate
      caBundle: {ca}
    rules:
      - apiGroups: [\"kilo.squat.ai\"]
        apiVersions: [\"v1alpha1\"]
        operations: [\"CREATE\", \"UPDATE\"]
        resources: [\"peers\"]
        scope: Cluster
"
    ));
    let peer = common::webhook::peer_yaml;
    let good_key = "a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";
    let refused = |name: &str, yaml: &str, field: &str| {
        common::webhook::refused_by_webhook(
            name,
            yaml,
            field,
            Duration::from_secs(20),
            |yaml| kube.kubectl_output(&["apply", "-f", "-"], Some(yaml)),
            |name| {
                let _ = kube.kubectl_output(&["delete", "peer", name, "--ignore-not-found"], None);
            },
        )
    };
    let bad_key = refused(
        "badkey",
        &peer("badkey", "notakey", "10.5.0.1/32"),
        "publicKey",
    );
    let bad_ip = refused(
        "badip",
        &peer("badip", good_key, "10.5.0.1/33"),
        "allowedIPs",
    );
    let empty_key = refused(
        "emptykey",
        &peer("emptykey", "\"\"", "10.5.0.1/32"),
        "publicKey",
    );
    eprintln!("refused:\n{bad_key}{bad_ip}{empty_key}");
    for name in ["badkey", "badip", "emptykey"] {
        let out = kube.kubectl_output(&["get", "peer", name], None);
        assert!(!out.status.success(), "{name} was stored");
    }
    kube.apply(&peer("good", good_key, "10.5.0.1/32"));
    let stored = kube.get(&["peer", "good"]);
    assert_eq!(stored["spec"]["publicKey"], good_key);
}

/// Kilo's e2e `test_reject_peer_empty_allowed_ips` and `test_reject_peer_empty_public_key`:
/// with only the CRD installed (no webhook), the API server's schema refuses a Peer whose
/// allowed IPs hold a null item and one whose public key is null, and stores neither.
#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn the_crd_schema_refuses_a_null_allowed_ip_and_a_missing_key() {
    let Some(kube) = RealKube::start("the_crd_schema_refuses_a_null_allowed_ip_and_a_missing_key")
    else {
        return;
    };
    kube.apply_manifest("crds.yaml");
    // The CRD is served a moment after it is created.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !kube
        .kubectl_output(&["get", "peers"], None)
        .status
        .success()
    {
        assert!(Instant::now() < deadline, "the Peer CRD is not served");
        std::thread::sleep(Duration::from_millis(250));
    }
    let cases = [
        (
            "e2e-empty-ips",
            "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: e2e-empty-ips\nspec:\n  allowedIPs:\n  -\n  persistentKeepalive: 0\n  publicKey: foo\n",
            "allowedIPs",
        ),
        (
            "e2e-empty-key",
            "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: e2e-empty-key\nspec:\n  allowedIPs:\n  - 10.5.0.1/32\n  persistentKeepalive: 0\n  publicKey:\n",
            "publicKey",
        ),
    ];
    for (name, yaml, field) in cases {
        let out = kube.kubectl_output(&["apply", "-f", "-"], Some(yaml));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name} was accepted");
        assert!(
            stderr.contains(field),
            "{name}: the error should name {field}: {stderr}"
        );
        let stored = kube.kubectl_output(&["get", "peer", name], None);
        assert!(!stored.status.success(), "{name} was stored");
    }
}

fn base64_file(path: &std::path::Path) -> String {
    common::run(&["base64", "-w0", path.to_str().unwrap()])
        .trim()
        .to_string()
}

impl KubeCluster {
    /// Brings the external Peer `name`'s `device` (in `ns`) up from `conf`, a `[Peer]`-only
    /// configuration, with its own key and `address`, and asserts that it reaches every node's
    /// pod within 30 s each.
    pub(super) fn bring_up_peer(
        &self,
        ns: &common::Netns,
        device: &common::WgDevice,
        name: &str,
        conf: &str,
        address: &str,
    ) {
        let conf_path = self.c.work.join(format!("{name}.conf"));
        std::fs::write(&conf_path, conf).unwrap();
        device.wg(&["set", &device.name, "private-key", &device.key_file]);
        device.wg(&["addconf", &device.name, conf_path.to_str().unwrap()]);
        device.ip(&["addr", "add", &format!("{address}/32"), "dev", &device.name]);
        device.ip(&["link", "set", &device.name, "up"]);
        device.ip(&["route", "add", "10.42.0.0/16", "dev", &device.name]);
        for n in &self.c.nodes {
            let pod = n.pod_ip.clone();
            let reached = self.c.wait_for(Duration::from_secs(30), |_| {
                ns.output(&["ping", "-c", "1", "-W", "1", "-I", address, &pod])
                    .status
                    .success()
            });
            assert!(
                reached,
                "{name} cannot reach {pod}\n{conf}\n{}",
                self.c.logs()
            );
        }
    }
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn an_external_peer_from_kgctl_showconf_reaches_every_pod() {
    let Some(k) =
        KubeCluster::meshed_east_west("an_external_peer_from_kgctl_showconf_reaches_every_pod")
    else {
        return;
    };
    // A laptop on east's segment: its own WireGuard device, a Peer created through the API,
    // and the configuration `kgctl showconf peer` prints from the API's Nodes.
    let ns = common::Netns::new();
    k.c.attach(&ns, "east", 50);
    let device = common::WgDevice::start(&ns, common::Impl::Kilotun);
    k.kube.apply(&format!(
        "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: laptop\nspec:\n  allowedIPs:\n  - 10.5.0.50/32\n  publicKey: {}\n  persistentKeepalive: 10\n",
        device.public_key
    ));
    let kubeconfig = format!("--kubeconfig={}", k.kube.kubeconfig.display());
    let conf = common::run(&[
        kgctl_bin(),
        "--backend=kubernetes",
        &kubeconfig,
        "showconf",
        "peer",
        "laptop",
    ]);
    k.bring_up_peer(&ns, &device, "laptop", &conf, "10.5.0.50");
    drop(device);
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn kgctl_connect_joins_from_outside_through_the_api() {
    let Some(k) = KubeCluster::meshed_east_west("kgctl_connect_joins_from_outside_through_the_api")
    else {
        return;
    };
    // A machine outside the cluster, with a user's (admin) kubeconfig: kgctl creates its Peer
    // through the API and deletes it on SIGTERM.
    let laptop = common::Netns::new();
    k.c.attach(&laptop, "east", 50);
    let _relay = k.kube.relay_into(&laptop);
    let iface = common::unique("kc");
    let log_path = k.c.work.join("connect.log");
    let kubeconfig = format!("--kubeconfig={}", k.kube.kubeconfig.display());
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut connect = KillOnDrop(
        std::process::Command::new("ip")
            .args(["netns", "exec", &laptop.name, kgctl_bin()])
            .args(["--backend=kubernetes", &kubeconfig, "connect", "laptop"])
            .args([
                "--allowed-ip=10.5.0.9/32",
                "--resync-period=2s",
                "-i",
                &iface,
            ])
            .arg("--log-level=debug")
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .unwrap(),
    );
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let registered = k.c.wait_for(Duration::from_secs(20), |_| {
        k.kube
            .kubectl_output(&["get", "peer", "laptop"], None)
            .status
            .success()
    });
    assert!(registered, "{}", log());
    let peer = k.kube.get(&["peer", "laptop"]);
    assert_eq!(peer["spec"]["allowedIPs"][0], "10.5.0.9/32", "{peer}");
    for n in &k.c.nodes {
        let reached = common::ping_ok(&laptop.name, &n.pod_ip, Duration::from_secs(30));
        assert!(
            reached,
            "the connected machine cannot reach {}\n{}\n{}",
            n.pod_ip,
            log(),
            k.c.logs()
        );
    }
    // SAFETY: signalling our own child.
    unsafe { libc::kill(connect.0.id() as i32, libc::SIGTERM) };
    let status = connect.0.wait().unwrap();
    assert!(status.success(), "{status}\n{}", log());
    let still_there = k
        .kube
        .kubectl_output(&["get", "peer", "laptop"], None)
        .status
        .success();
    assert!(!still_there, "the Peer outlived kgctl connect\n{}", log());
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn two_clusters_join_through_their_leaders_as_peers() {
    let test = "two_clusters_join_through_their_leaders_as_peers";
    common::require_root(test);
    // Kilo's multi-cluster setup: two API servers, distinct Kilo subnets, and each cluster's
    // leaders registered in the other as Peers with `kgctl showconf node --as-peer -o yaml`.
    let Some(a) = RealKube::start(test) else {
        return;
    };
    let Some(b) = RealKube::start(test) else {
        return;
    };
    for kube in [&a, &b] {
        kube.apply_manifest("crds.yaml");
        kube.apply_manifest("rbac.yaml");
    }
    // One underlay (the two clusters' nodes reach each other's endpoints), two control planes:
    // a1 and a2 belong to cluster A, b1 to cluster B.
    let mut c = Cluster::with_nodes(
        &["east", "west"],
        &[("a1", "east"), ("a2", "east"), ("b1", "west")],
    );
    let home = [
        (&a, "10.4.0.0/16"),
        (&a, "10.4.0.0/16"),
        (&b, "10.5.0.0/16"),
    ];
    let mut relays = Vec::new();
    let mut flags = Vec::new();
    for (i, n) in c.nodes.iter().enumerate() {
        let (kube, subnet) = home[i];
        let path = c.dir.join(format!("{}.yaml", n.name));
        kube.kubectl(&["apply", "-f", path.to_str().unwrap()]);
        relays.push(kube.relay_into(&n.ns));
        let kubeconfig = c.work.join(format!("{}.kubeconfig", n.name));
        kube.write_kubeconfig(
            &kubeconfig,
            &kube.service_account_token("kube-system", "kilo"),
        );
        flags.push([
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--subnet={subnet}"),
        ]);
    }
    for (i, [kubeconfig, subnet]) in flags.iter().enumerate() {
        let mut f = KG_FLAGS.to_vec();
        f.extend([kubeconfig.as_str(), subnet.as_str()]);
        c.start_kg(i, &f);
    }
    // Each cluster on its own: its leaders published their WireGuard IPs.
    let led = c.wait_for(Duration::from_secs(60), |_| {
        let ip = |kube: &RealKube, n: &str| {
            kube.get(&["node", n])["metadata"]["annotations"]["kilo.squat.ai/wireguard-ip"]
                .as_str()
                .unwrap_or("")
                .to_string()
        };
        ip(&a, "a1") == "10.4.0.1/16" && ip(&b, "b1") == "10.5.0.1/16"
    });
    assert!(led, "{}", c.logs());
    let showconf = |kube: &RealKube, node: &str| {
        let kubeconfig = format!("--kubeconfig={}", kube.kubeconfig.display());
        common::run(&[
            kgctl_bin(),
            "--backend=kubernetes",
            &kubeconfig,
            "showconf",
            "node",
            node,
            "--as-peer",
            "-o",
            "yaml",
        ])
    };
    let a1_as_peer = showconf(&a, "a1");
    let b1_as_peer = showconf(&b, "b1");
    b.apply(&a1_as_peer);
    a.apply(&b1_as_peer);
    // Every node reaches every pod, across the clusters too (a2 through its leader a1).
    let meshed = c.wait_for(Duration::from_secs(60), |c| c.all_pods_reachable().is_ok());
    assert!(
        meshed,
        "{:?}\n{a1_as_peer}\n{b1_as_peer}\n{}",
        c.all_pods_reachable(),
        c.logs()
    );
    drop(relays);
}
