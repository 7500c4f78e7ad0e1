use super::*;

fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("kilotun-clusterdir-{}-{name}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
}

const MULTI: &str = "\
apiVersion: v1
kind: Node
metadata:
  name: a
  labels:
    topology.kubernetes.io/region: east
spec:
  podCIDR: 10.42.1.0/24
---
apiVersion: kilo.squat.ai/v1alpha1
kind: Peer
metadata:
  name: laptop
spec:
  allowedIPs: [10.5.0.1/32]
  publicKey: a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=
";

const LIST: &str = "\
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Node
  metadata:
    name: b
  spec:
    podCIDR: 10.42.2.0/24
- apiVersion: v1
  kind: Node
  metadata:
    name: c
    annotations:
      kilo.squat.ai/location: west
  spec:
    podCIDR: 10.42.3.0/24
";

const JSON: &str = r#"{"apiVersion":"v1","kind":"Node","metadata":{"name":"d"},"spec":{"podCIDR":"10.42.4.0/24"}}"#;

#[test]
fn reads_multi_document_yaml_lists_and_json() {
    let dir = scratch("read");
    fs::write(dir.join("a.yaml"), MULTI).unwrap();
    fs::write(dir.join("list.yml"), LIST).unwrap();
    fs::write(dir.join("d.json"), JSON).unwrap();
    fs::write(dir.join("notes.txt"), "ignored").unwrap();
    let backend = FileBackend::open(&dir).unwrap();
    let snap = backend.subscribe().borrow().clone();
    let names: Vec<&str> = snap.nodes.keys().map(String::as_str).collect();
    assert_eq!(names, ["a", "b", "c", "d"]);
    assert_eq!(snap.peers["laptop"].spec.allowed_ips, ["10.5.0.1/32"]);
    assert_eq!(
        snap.nodes["c"].metadata.annotations.as_ref().unwrap()["kilo.squat.ai/location"],
        "west"
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn patches_land_in_the_file_holding_the_node_and_keep_the_rest() {
    let dir = scratch("patch");
    fs::write(dir.join("a.yaml"), MULTI).unwrap();
    fs::write(dir.join("list.yaml"), LIST).unwrap();
    let backend = FileBackend::open(&dir).unwrap();
    let changes = BTreeMap::from([("kilo.squat.ai/key".to_string(), Some("k".to_string()))]);
    backend.patch_annotations("c", &changes).unwrap();
    let snap = backend.subscribe().borrow().clone();
    let c = &snap.nodes["c"];
    assert_eq!(
        c.metadata.annotations.as_ref().unwrap()["kilo.squat.ai/key"],
        "k"
    );
    assert_eq!(
        c.metadata.annotations.as_ref().unwrap()["kilo.squat.ai/location"],
        "west"
    );
    assert_eq!(
        snap.nodes["b"].spec.as_ref().unwrap().pod_cidr.as_deref(),
        Some("10.42.2.0/24")
    );
    assert!(snap.peers.contains_key("laptop"));
    let removal = BTreeMap::from([("kilo.squat.ai/location".to_string(), None)]);
    backend.patch_annotations("c", &removal).unwrap();
    let snap = backend.subscribe().borrow().clone();
    assert!(!snap.nodes["c"]
        .metadata
        .annotations
        .as_ref()
        .unwrap()
        .contains_key("kilo.squat.ai/location"));
    let leftovers: Vec<_> = fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty());
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_node_without_a_file_gets_one() {
    let dir = scratch("create");
    let backend = FileBackend::open(&dir).unwrap();
    let changes = BTreeMap::from([(
        "kilo.squat.ai/endpoint".to_string(),
        Some("1.2.3.4:51820".to_string()),
    )]);
    backend.patch_annotations("new-node", &changes).unwrap();
    assert!(dir.join("new-node.yaml").exists());
    let snap = backend.subscribe().borrow().clone();
    assert_eq!(
        snap.nodes["new-node"]
            .metadata
            .annotations
            .as_ref()
            .unwrap()["kilo.squat.ai/endpoint"],
        "1.2.3.4:51820"
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_broken_file_keeps_its_last_good_content() {
    let dir = scratch("broken");
    fs::write(dir.join("a.yaml"), MULTI).unwrap();
    let backend = FileBackend::open(&dir).unwrap();
    fs::write(dir.join("a.yaml"), "kind: Node\nmetadata: [unclosed\n").unwrap();
    backend.scan();
    assert!(backend.subscribe().borrow().nodes.contains_key("a"));
    fs::remove_file(dir.join("a.yaml")).unwrap();
    assert!(backend.scan());
    assert!(
        backend.subscribe().borrow().nodes.is_empty(),
        "a deleted file removes its nodes"
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn concurrent_writers_sharing_a_file_never_lose_updates() {
    let dir = scratch("concurrent");
    fs::write(dir.join("list.yaml"), LIST).unwrap();
    fs::write(dir.join("d.json"), JSON).unwrap();
    // Separate backends stand in for separate kg processes: they share only the directory.
    let writers: Vec<_> = ["b", "c", "d"]
        .into_iter()
        .map(|name| {
            let backend = FileBackend::open(&dir).unwrap();
            std::thread::spawn(move || {
                for i in 0..40 {
                    let changes = BTreeMap::from([(format!("test/{name}"), Some(i.to_string()))]);
                    backend.patch_annotations(name, &changes).unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    let backend = FileBackend::open(&dir).unwrap();
    let snap = backend.subscribe().borrow().clone();
    for name in ["b", "c", "d"] {
        let annotations = snap.nodes[name].metadata.annotations.as_ref().unwrap();
        assert_eq!(annotations[&format!("test/{name}")], "39", "{name}");
    }
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_lease_keeps_its_holder_and_cut_off_mark_through_the_kubernetes_object() {
    let state = LeaseState {
        holder: Some("n1".into()),
        renewed_ms: 1_700_000_000_123,
        duration_ms: 6_000,
        transitions: 3,
        cut_off: true,
        deposed: BTreeMap::from([("n0".to_string(), 1_700_000_000), ("n2".to_string(), 5)]),
    };
    let object = lease_object("kilotun-leader-east", &state);
    assert_eq!(
        object.metadata.annotations.as_ref().unwrap()[CUT_OFF_ANNOTATION],
        "true"
    );
    assert_eq!(
        object.metadata.annotations.as_ref().unwrap()[DEPOSED_ANNOTATION],
        "n0=1700000000,n2=5"
    );
    assert_eq!(lease_state(&object), state);
    let healthy = LeaseState {
        cut_off: false,
        deposed: BTreeMap::new(),
        ..state.clone()
    };
    let mut garbled = lease_object("kilotun-leader-east", &state);
    garbled.metadata.annotations.as_mut().unwrap().insert(
        DEPOSED_ANNOTATION.to_string(),
        "n0=1700000000,nonsense,=5,n3=x,n4=7".to_string(),
    );
    assert_eq!(
        lease_state(&garbled).deposed,
        BTreeMap::from([("n0".to_string(), 1_700_000_000), ("n4".to_string(), 7)]),
        "malformed pairs are skipped"
    );
    let object = lease_object("kilotun-leader-east", &healthy);
    assert!(object.metadata.annotations.is_none());
    assert_eq!(lease_state(&object), healthy);
}

/// The directory gone (renamed away, an unmounted volume): the backend says it is unhealthy and
/// keeps the last good Nodes; back, it is healthy again and reads what changed meanwhile.
#[test]
fn a_directory_that_goes_away_is_unhealthy_and_keeps_the_last_good_state() {
    let dir = scratch("away");
    fs::write(dir.join("nodes.yaml"), MULTI).unwrap();
    let backend = FileBackend::open(&dir).unwrap();
    assert!(backend.healthy());
    let away = dir.with_file_name(format!(
        "{}-away",
        dir.file_name().unwrap().to_string_lossy()
    ));
    fs::rename(&dir, &away).unwrap();
    assert!(!backend.scan());
    assert!(!backend.healthy());
    assert!(backend.subscribe().borrow().nodes.contains_key("a"));
    fs::write(
        away.join("more.yaml"),
        MULTI.replace("name: a\n", "name: b\n"),
    )
    .unwrap();
    fs::rename(&away, &dir).unwrap();
    assert!(backend.scan());
    assert!(backend.healthy());
    assert!(backend.subscribe().borrow().nodes.contains_key("b"));
    fs::remove_dir_all(&dir).unwrap();
}
