//! Checks every file in `manifests/`: each document parses into its Kubernetes type with no field
//! the type does not know (a typo would be dropped silently by the API server), every `kg`
//! command line in a workload is one `kg` accepts, and the pieces refer to each other correctly.

use std::collections::BTreeSet;
use std::path::PathBuf;

use clap::Parser;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, Namespace, PodSpec, Service, ServiceAccount,
};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::agent::args::KgArgs;
use crate::device_plugin::DevicePluginArgs;
use crate::webhook::WebhookArgs;

fn manifests_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("manifests")
}

/// Every document of every YAML file: (file name, document).
fn documents() -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(manifests_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 5, "manifests/ has only {files:?}");
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let documents: Vec<serde_json::Value> =
            serde_saphyr::from_multiple(&text).unwrap_or_else(|e| panic!("{name}: not YAML: {e}"));
        for value in documents {
            if value.is_null() {
                continue;
            }
            out.push((name.clone(), value));
        }
    }
    out
}

/// Numbers compare by value (the API types turn `1` into `1.0` in some schemas).
fn normalise(value: &Value) -> Value {
    match value {
        Value::Number(n) => serde_json::json!(n.as_f64().unwrap()),
        Value::Array(items) => Value::Array(items.iter().map(normalise).collect()),
        Value::Object(map) => {
            Value::Object(map.iter().map(|(k, v)| (k.clone(), normalise(v))).collect())
        }
        other => other.clone(),
    }
}

/// Parses `document` as `T` and checks nothing was lost on the way.
fn typed<T: DeserializeOwned + Serialize>(file: &str, document: &Value) -> T {
    let object: T = serde_json::from_value(document.clone())
        .unwrap_or_else(|e| panic!("{file}: {} does not parse: {e}", document["kind"]));
    let back = serde_json::to_value(&object).unwrap();
    assert_eq!(
        normalise(&back),
        normalise(document),
        "{file}: {} {} has fields its type does not know",
        document["kind"],
        document["metadata"]["name"]
    );
    object
}

/// Replaces `$(VAR)` with a value, checking the container defines `VAR`.
fn expand(container: &Container, arg: &str) -> String {
    let mut out = arg.to_string();
    while let Some(start) = out.find("$(") {
        let end = out[start..].find(')').expect("unterminated $(") + start;
        let var = &out[start + 2..end];
        let defined = container.env.iter().flatten().any(|e| e.name == var);
        assert!(
            defined,
            "container {} uses $({var}) but does not define it",
            container.name
        );
        out.replace_range(start..=end, "node-1");
    }
    out
}

/// Whether the pod runs `kg device-plugin`.
fn runs_device_plugin(pod: &PodSpec) -> bool {
    pod.containers.iter().any(|c| {
        c.args
            .as_ref()
            .and_then(|a| a.first())
            .is_some_and(|a| a == "device-plugin")
    })
}

/// Checks `kg device-plugin`'s DaemonSet: flags `kg` accepts, the kubelet's plugin directory
/// and the device on the host, nothing privileged, and that the patch its header tells users
/// to apply asks kg's container for the resource the plugin offers. Returns the resource.
fn check_device_plugin(file: &str, pod: &PodSpec, header: &str) -> String {
    assert_eq!(pod.containers.len(), 1, "{file}: one container");
    let container = &pod.containers[0];
    let args = container.args.clone().unwrap_or_default();
    let parsed = DevicePluginArgs::try_parse_from(
        std::iter::once("kg".to_string()).chain(args[1..].iter().cloned()),
    )
    .unwrap_or_else(|e| panic!("{file}: kg device-plugin rejects {args:?}: {e}"));
    let inventory = parsed
        .inventory()
        .unwrap_or_else(|e| panic!("{file}: kg device-plugin rejects {args:?}: {e:#}"));
    let host_path = |mount_path: &str| {
        let mount = container
            .volume_mounts
            .iter()
            .flatten()
            .find(|m| m.mount_path == mount_path)
            .unwrap_or_else(|| panic!("{file}: {mount_path} is not mounted"));
        pod.volumes
            .iter()
            .flatten()
            .find(|v| v.name == mount.name)
            .and_then(|v| v.host_path.clone())
            .unwrap_or_else(|| panic!("{file}: {mount_path} is not a host path"))
    };
    let dir = host_path(parsed.plugin_dir.to_str().unwrap());
    assert_eq!(
        Some(dir.path.as_str()),
        parsed.plugin_dir.to_str(),
        "{file}"
    );
    // The device's directory, so that the plugin sees the host's device come and go.
    let parent = std::path::Path::new(&inventory.device)
        .parent()
        .and_then(|p| p.to_str())
        .unwrap();
    let device_dir = host_path(parent);
    assert_eq!(device_dir.path, parent, "{file}");
    assert_eq!(device_dir.type_.as_deref(), Some("Directory"), "{file}");
    let security = container.security_context.clone().unwrap_or_default();
    assert_ne!(security.privileged, Some(true), "{file}: privileged");
    // The patch in the header, as the user would paste it.
    let patch = header
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .find_map(|l| {
            l.trim()
                .strip_prefix('\'')
                .and_then(|p| p.strip_suffix('\''))
        })
        .unwrap_or_else(|| panic!("{file}: no '…' patch in the header"));
    let patch: Value =
        serde_json::from_str(patch).unwrap_or_else(|e| panic!("{file}: the patch: {e}"));
    let patched = &patch["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(
        patched["name"], "kilo",
        "{file}: the patch names kg's container"
    );
    assert_eq!(
        patched["resources"]["limits"][inventory.resource_name.as_str()],
        "1",
        "{file}: the patch asks for another resource than {}",
        inventory.resource_name
    );
    inventory.resource_name
}

/// Checks the `kg` containers of a pod: returns how many there were.
fn check_kg_containers(file: &str, pod: &PodSpec) -> usize {
    let mut count = 0;
    for container in &pod.containers {
        let command = container.command.clone().unwrap_or_default();
        if !command.last().is_some_and(|c| c.ends_with("/kg")) {
            continue;
        }
        count += 1;
        let args: Vec<String> = container
            .args
            .iter()
            .flatten()
            .map(|a| expand(container, a))
            .collect();
        if args.first().is_some_and(|a| a == "webhook") {
            let parsed = WebhookArgs::try_parse_from(
                std::iter::once("kg".to_string()).chain(args[1..].iter().cloned()),
            )
            .unwrap_or_else(|e| panic!("{file}: kg webhook rejects {args:?}: {e}"));
            let ports: Vec<i32> = container
                .ports
                .iter()
                .flatten()
                .map(|p| p.container_port)
                .collect();
            for listen in [&parsed.listen, &parsed.listen_metrics] {
                let port = crate::agent::serve::http::listen_addr(listen)
                    .unwrap()
                    .port() as i32;
                assert!(
                    ports.contains(&port),
                    "{file}: {listen} is not a container port"
                );
            }
        } else {
            let parsed =
                KgArgs::try_parse_from(std::iter::once("kg".to_string()).chain(args.clone()))
                    .unwrap_or_else(|e| panic!("{file}: kg rejects {args:?}: {e}"));
            let settings = parsed
                .settings()
                .unwrap_or_else(|e| panic!("{file}: kg rejects {args:?}: {e:#}"));
            assert_eq!(settings.hostname, "node-1", "{file}: --hostname");
            assert!(
                settings.args.create_interface,
                "{file}: the embedded engine"
            );
            // The embedded engine needs the TUN device, NET_ADMIN and the host network; nothing
            // privileged and no kernel module.
            let mounts: Vec<&str> = container
                .volume_mounts
                .iter()
                .flatten()
                .map(|m| m.mount_path.as_str())
                .collect();
            assert!(mounts.contains(&"/dev/net/tun"), "{file}: no /dev/net/tun");
            let key_dir = settings.args.key_file.parent().unwrap().to_str().unwrap();
            assert!(
                mounts.contains(&key_dir),
                "{file}: the key directory {key_dir} is not on the host"
            );
            let security = container.security_context.clone().unwrap_or_default();
            assert_ne!(security.privileged, Some(true), "{file}: privileged");
            let added = security
                .capabilities
                .and_then(|c| c.add)
                .unwrap_or_default();
            assert!(
                added.contains(&"NET_ADMIN".to_string()),
                "{file}: no NET_ADMIN"
            );
            assert_eq!(
                pod.host_network,
                Some(true),
                "{file}: not on the host network"
            );
            assert!(
                !mounts.iter().any(|m| m.starts_with("/lib/modules")),
                "{file}: mounts kernel modules"
            );
            let port = crate::agent::serve::http::listen_addr(&settings.args.listen)
                .unwrap()
                .port() as i32;
            // The probes ask kg's --listen port (by number: the container declares none).
            // Readiness asks whether the engine carries traffic (a rollout waits for it on
            // each node before the next, and with surge before the old pod goes); liveness
            // only whether kg answers.
            for (probe, path) in [
                (&container.readiness_probe, "/ready"),
                (&container.liveness_probe, "/health"),
            ] {
                let get = probe.as_ref().and_then(|p| p.http_get.as_ref());
                let probed = get.map(|g| g.port.clone());
                assert_eq!(
                    probed,
                    Some(IntOrString::Int(port)),
                    "{file}: a probe does not ask --listen"
                );
                assert_eq!(get.and_then(|g| g.path.as_deref()), Some(path), "{file}");
            }
        }
        // Every mount has a volume.
        let volumes: BTreeSet<&str> = pod
            .volumes
            .iter()
            .flatten()
            .map(|v| v.name.as_str())
            .collect();
        for mount in container.volume_mounts.iter().flatten() {
            assert!(
                volumes.contains(mount.name.as_str()),
                "{file}: no volume {}",
                mount.name
            );
        }
    }
    count
}

#[test]
fn every_manifest_parses_into_its_type_and_every_kg_command_line_is_valid() {
    let mut kinds = BTreeSet::new();
    let mut agents = 0;
    let mut webhooks = 0;
    let mut device_plugins = Vec::new();
    let mut daemonset_labels = Vec::new();
    let mut kg_listen = BTreeSet::new();
    let mut monitor_target = None;
    let mut cluster_roles = Vec::new();
    for (file, document) in documents() {
        let kind = document["kind"].as_str().unwrap_or_default().to_string();
        kinds.insert(kind.clone());
        match kind.as_str() {
            "ConfigMap" => {
                let map: ConfigMap = typed(&file, &document);
                if let Some(conf) = map.data.as_ref().and_then(|d| d.get("cni-conf.json")) {
                    let conf: Value = serde_json::from_str(conf)
                        .unwrap_or_else(|e| panic!("{file}: cni-conf.json: {e}"));
                    assert_eq!(conf["plugins"][0]["bridge"], "kube-bridge");
                }
            }
            "DaemonSet" => {
                let set: DaemonSet = typed(&file, &document);
                let spec = set.spec;
                let template = spec.template;
                let labels = template.metadata.unwrap().labels.unwrap();
                assert_eq!(spec.selector.match_labels.as_ref(), Some(&labels), "{file}");
                let pod = template.spec.unwrap();
                if runs_device_plugin(&pod) {
                    let header = std::fs::read_to_string(manifests_dir().join(&file)).unwrap();
                    device_plugins.push(check_device_plugin(&file, &pod, &header));
                    continue;
                }
                daemonset_labels.push(labels);
                // A surge rollout: the new kg stands by beside the old one and takes over as it
                // exits, so no node goes without an engine while its pod is replaced.
                let strategy = spec.update_strategy.unwrap_or_default();
                let rolling = strategy.rolling_update.unwrap_or_default();
                assert_eq!(strategy.type_.as_deref(), Some("RollingUpdate"), "{file}");
                assert_eq!(
                    rolling.max_surge,
                    Some(IntOrString::Int(1)),
                    "{file}: maxSurge"
                );
                assert_eq!(
                    rolling.max_unavailable,
                    Some(IntOrString::Int(0)),
                    "{file}: maxUnavailable"
                );
                assert_eq!(pod.service_account_name.as_deref(), Some("kilo"), "{file}");
                let found = check_kg_containers(&file, &pod);
                assert_eq!(found, 1, "{file}: one kg container, no sidecar");
                assert_eq!(pod.containers.len(), 1, "{file}: no sidecar");
                // With hostNetwork every declared container port is a host port, and the
                // scheduler refuses a second pod on the node with the same one: a surge
                // rollout (maxSurge) would never start (kubernetes#106417).
                assert_eq!(pod.host_network, Some(true), "{file}");
                for container in pod.init_containers.iter().flatten().chain(&pod.containers) {
                    assert!(
                        container.ports.as_ref().is_none_or(|p| p.is_empty()),
                        "{file}: container {} declares ports {:?}, which block surge rollouts",
                        container.name,
                        container.ports
                    );
                }
                let kg = &pod.containers[0];
                let listen = kg
                    .args
                    .iter()
                    .flatten()
                    .find_map(|a| a.strip_prefix("--listen="))
                    .unwrap_or_else(|| panic!("{file}: kg without --listen"));
                kg_listen.insert((
                    kg.name.clone(),
                    listen.rsplit(':').next().unwrap().to_string(),
                ));
                agents += 1;
            }
            "Deployment" => {
                let deployment: Deployment = typed(&file, &document);
                let pod = deployment.spec.template.spec.unwrap();
                webhooks += check_kg_containers(&file, &pod);
            }
            "Job" => {
                typed::<Job>(&file, &document);
            }
            "Namespace" => {
                typed::<Namespace>(&file, &document);
            }
            "Service" => {
                typed::<Service>(&file, &document);
            }
            "ServiceAccount" => {
                typed::<ServiceAccount>(&file, &document);
            }
            "ClusterRole" => cluster_roles.push(typed::<ClusterRole>(&file, &document)),
            "ClusterRoleBinding" => {
                typed::<ClusterRoleBinding>(&file, &document);
            }
            "Role" => {
                typed::<Role>(&file, &document);
            }
            "RoleBinding" => {
                typed::<RoleBinding>(&file, &document);
            }
            "CustomResourceDefinition" => {
                let crd: CustomResourceDefinition = typed(&file, &document);
                assert_eq!(crd.spec.group, control::peer::GROUP);
                assert_eq!(crd.spec.names.plural, control::peer::PLURAL);
                assert_eq!(crd.spec.names.kind, "Peer");
                assert_eq!(crd.spec.scope, "Cluster");
                let version = &crd.spec.versions[0];
                assert_eq!(version.name, control::peer::VERSION);
                let schema = serde_json::to_value(&version.schema).unwrap();
                let spec = &schema["openAPIV3Schema"]["properties"]["spec"];
                for field in [
                    "allowedIPs",
                    "publicKey",
                    "endpoint",
                    "persistentKeepalive",
                    "presharedKey",
                ] {
                    assert!(
                        spec["properties"][field].is_object(),
                        "CRD has no spec.{field}"
                    );
                }
            }
            "ValidatingWebhookConfiguration" => {
                let config: ValidatingWebhookConfiguration = typed(&file, &document);
                let hook = &config.webhooks.unwrap()[0];
                let service = hook.client_config.service.as_ref().unwrap();
                assert_eq!(service.path.as_deref(), Some("/validate"));
                assert_eq!(hook.admission_review_versions, vec!["v1"]);
                let rule = &hook.rules.as_ref().unwrap()[0];
                assert_eq!(rule.resources.as_deref(), Some(&["peers".to_string()][..]));
            }
            "PodMonitor" => {
                assert_eq!(document["apiVersion"], "monitoring.coreos.com/v1");
                let selector = &document["spec"]["selector"]["matchLabels"];
                let labels: std::collections::BTreeMap<String, String> =
                    serde_json::from_value(selector.clone()).unwrap();
                assert!(!labels.is_empty());
                let endpoint = &document["spec"]["podMetricsEndpoints"][0];
                assert_eq!(endpoint["path"], "/metrics");
                // No named port (kg's pods declare none): a container kept by name, the
                // address rewritten to the pod's IP and kg's port.
                let relabel = endpoint["relabelings"].as_array().expect("relabelings");
                let kept = relabel
                    .iter()
                    .find(|r| r["action"] == "keep")
                    .expect("a keep rule");
                assert_eq!(
                    kept["sourceLabels"][0],
                    "__meta_kubernetes_pod_container_name"
                );
                let address = relabel
                    .iter()
                    .find(|r| r["targetLabel"] == "__address__")
                    .expect("a rule writing __address__");
                assert_eq!(address["sourceLabels"][0], "__meta_kubernetes_pod_ip");
                let port = address["replacement"].as_str().unwrap().rsplit(':').next();
                monitor_target = Some((
                    kept["regex"].as_str().unwrap().to_string(),
                    port.unwrap().to_string(),
                ));
                daemonset_labels.push(labels);
            }
            other => panic!("{file}: a {other} the test does not check"),
        }
    }
    assert_eq!(agents, 2, "a DaemonSet for kubeadm and one for k3s");
    assert_eq!(webhooks, 1, "the webhook Deployment");
    assert_eq!(device_plugins, ["squat.ai/tun"], "the TUN's device plugin");
    // The PodMonitor scrapes kg's container on kg's port in both DaemonSets.
    let monitor_target = monitor_target.expect("a PodMonitor");
    assert!(
        kg_listen.iter().all(|t| *t == monitor_target),
        "PodMonitor scrapes {monitor_target:?}, kg listens on {kg_listen:?}"
    );
    // The PodMonitor selects the DaemonSets' pods.
    let monitor = daemonset_labels.pop().unwrap();
    assert!(daemonset_labels.iter().all(|l| *l == monitor));
    // kg's ClusterRole: nodes get/list/watch/patch, peers list/watch.
    let kilo = cluster_roles
        .iter()
        .find(|r| r.metadata.name.as_deref() == Some("kilo"))
        .expect("a ClusterRole named kilo");
    let allows = |resource: &str, verb: &str| {
        kilo.rules.iter().flatten().any(|r| {
            r.resources.iter().flatten().any(|x| x == resource) && r.verbs.iter().any(|v| v == verb)
        })
    };
    for verb in ["get", "list", "watch", "patch"] {
        assert!(allows("nodes", verb), "kilo may not {verb} nodes");
    }
    for verb in ["list", "watch"] {
        assert!(allows("peers", verb), "kilo may not {verb} peers");
    }
    assert!(!allows("nodes", "delete"));
    assert!(kinds.contains("CustomResourceDefinition") && kinds.contains("PodMonitor"));
}
