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
fn an_annotation_written_twice_takes_its_last_value() {
    let dir = scratch("duplicate-key");
    let yaml = "apiVersion: v1\nkind: Node\nmetadata:\n  name: twice\n  annotations:\n    \
                kilo.squat.ai/location: east\n    kilo.squat.ai/location: west\n";
    fs::write(dir.join("twice.yaml"), yaml).unwrap();
    let backend = FileBackend::open(&dir).unwrap();
    let snap = backend.subscribe().borrow().clone();
    assert_eq!(
        snap.nodes["twice"].metadata.annotations.as_ref().unwrap()["kilo.squat.ai/location"],
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
        cut_off_predecessor: Some("n0".into()),
        handed_over_by: Some("n4".into()),
    };
    let object = lease_object("kilotun-leader-east", &state);
    assert_eq!(
        object.metadata.annotations.as_ref().unwrap()[HANDED_OVER_BY_ANNOTATION],
        "n4"
    );
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
        cut_off_predecessor: None,
        handed_over_by: None,
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

/// The watch's path (only the files it names read, only their names changed in the snapshot)
/// ends where a full listing would: a Node moving between files, a Node defined in two files
/// (the first by name wins) losing its first definition, a file removed, a Peer and a lease
/// written. Only the names those files held or hold are recorded as changed.
#[test]
fn reading_the_files_the_watch_names_ends_where_a_full_listing_does() {
    let dir = scratch("names");
    fs::write(dir.join("a.yaml"), MULTI).unwrap();
    fs::write(dir.join("list.yaml"), LIST).unwrap();
    fs::write(dir.join("d.json"), JSON).unwrap();
    let backend = FileBackend::open(&dir).unwrap();
    let node = |name: &str, cidr: &str| {
        format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {name}\nspec:\n  podCIDR: {cidr}\n")
    };
    let steps: Vec<(&str, Option<String>)> = vec![
        // c moves out of list.yaml into its own file; b stays.
        ("c.yaml", Some(node("c", "10.42.33.0/24"))),
        ("list.yaml", Some(node("b", "10.42.2.0/24"))),
        // d defined again in a file after d.json: d.json's stays; then d.json goes.
        ("e.yaml", Some(node("d", "10.42.44.0/24"))),
        ("d.json", None),
        // a.yaml goes (its Node and its Peer), a Peer and a lease come in files of their own.
        ("a.yaml", None),
        (
            "peer-x.yaml",
            Some("apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: x\nspec:\n  allowedIPs: [10.5.0.9/32]\n  publicKey: a2V5MQAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n".to_string()),
        ),
    ];
    let mut rx = backend.subscribe();
    for (file, text) in steps {
        let revision = rx.borrow_and_update().changes.revision();
        match &text {
            Some(text) => fs::write(dir.join(file), text).unwrap(),
            None => fs::remove_file(dir.join(file)).unwrap(),
        }
        backend.scan_names(&[file.into()]);
        let watched = rx.borrow_and_update().clone();
        // Only what the file held or holds is named as changed.
        let named: Vec<String> = watched
            .changes
            .since(revision)
            .map(|names| names.map(str::to_string).collect())
            .unwrap_or_default();
        assert!(named.len() <= 2, "{file}: {named:?}");
        let listed = FileBackend::open(&dir)
            .unwrap()
            .subscribe()
            .borrow()
            .clone();
        assert_eq!(watched.nodes, listed.nodes, "after {file}");
        assert_eq!(watched.peers, listed.peers, "after {file}");
        assert_eq!(watched.leases, listed.leases, "after {file}");
    }
    let snap = rx.borrow().clone();
    let names: Vec<&str> = snap.nodes.keys().map(String::as_str).collect();
    assert_eq!(names, ["b", "c", "d"]);
    assert_eq!(
        snap.nodes["d"].spec.as_ref().unwrap().pod_cidr.as_deref(),
        Some("10.42.44.0/24")
    );
    assert_eq!(snap.peers.keys().collect::<Vec<_>>(), ["x"]);
    fs::remove_dir_all(&dir).unwrap();
}

const IPAM: &str = "\
apiVersion: crd.projectcalico.org/v1
kind: BlockAffinity
metadata:
  name: a-10-60-1-0-26
spec:
  node: a
  cidr: 10.60.1.0/26
  state: confirmed
  deleted: 'false'
---
apiVersion: crd.projectcalico.org/v1
kind: BlockAffinity
metadata:
  name: broken
spec:
  node: a
  cidr: 10.60.1.0/99
---
apiVersion: cilium.io/v2
kind: CiliumNode
metadata:
  name: b
spec:
  ipam:
    podCIDRs: [10.0.2.0/24]
---
apiVersion: v1
kind: Pod
metadata:
  name: web
  namespace: shop
spec:
  nodeName: c
status:
  podIPs:
  - ip: 10.1.3.7
";

#[test]
fn ipam_objects_are_read_beside_the_nodes_and_a_malformed_one_is_refused_alone() {
    let dir = scratch("ipam");
    fs::write(dir.join("ipam.yaml"), IPAM).unwrap();
    let backend = FileBackend::open(&dir).unwrap();
    let snap = backend.subscribe().borrow().clone();
    let ipam = &snap.ipam;
    assert_eq!(ipam.affinities.len(), 1, "{:?}", ipam.affinities);
    assert!(ipam.affinities["a-10-60-1-0-26"].confirmed);
    assert_eq!(
        ipam.cilium_nodes["b"].pod_cidrs,
        vec!["10.0.2.0/24".parse::<ipnet::IpNet>().unwrap()]
    );
    assert_eq!(ipam.pods["shop/web"].node, "c");
    // Removed: the snapshot follows, through the watch's path as through a listing.
    fs::remove_file(dir.join("ipam.yaml")).unwrap();
    assert!(backend.scan());
    assert_eq!(*backend.subscribe().borrow().ipam, Default::default());
    fs::remove_dir_all(&dir).unwrap();
}
