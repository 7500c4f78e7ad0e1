//! No key leaks: three kg with `--post-quantum` (n1, n2 in east, n3 in west), a Peer with a
//! preshared key, every kg logging everything (`KG_LOG=trace`), and n1's key rotated with
//! `kgctl rotate-key`. While the rotation is under way and after it, every output surface (each
//! log, `/status`, `/metrics`, `/graph`, `kgctl diagnose`, `kgctl graph`, `kgctl showconf` of a
//! node with and without `--as-peer` and in each format, `kgctl showconf peer`) is scanned for
//! every private and preshared key the test knows (the nodes' keys, n1's next key, the
//! post-quantum keys, the Peer's), in base64 and in hex. Only a WireGuard configuration
//! (`showconf`, as Kilo's) may hold a Peer's preshared key, which the Peer object holds anyway. The files beside each key are 0600. A planted
//! key is found, so the scan is known to look.

use crate::common;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use base64::Engine as _;
use common::cluster::{kgctl_bin, Cluster};

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

/// The secrets the test knows, by a name that says whose (never the secret itself), with
/// whether a WireGuard configuration (`showconf`) may hold it.
#[derive(Default)]
struct Secrets(BTreeMap<String, (Vec<u8>, bool)>);

impl Secrets {
    fn add(&mut self, name: &str, raw: &[u8], in_peer_conf: bool) {
        self.0
            .insert(name.to_string(), (raw.to_vec(), in_peer_conf));
    }

    /// The base64 secret on the first line of `text` (a key file, a next key's file, the seed).
    fn add_first_line(&mut self, name: &str, text: &str) {
        let line = text.lines().next().unwrap_or_default().trim();
        let raw = B64
            .decode(line)
            .unwrap_or_else(|e| panic!("{name}: not base64: {e}"));
        self.add(name, &raw, false);
    }

    /// The post-quantum preshared keys saved in `<key-file>.psk` (its public keys are not
    /// secrets: `{"local": key, "links": {peer key: [preshared key, epoch]}}`).
    fn add_saved_psks(&mut self, name: &str, text: &str) {
        let saved: serde_json::Value = serde_json::from_str(text).expect("the saved keys' JSON");
        for (i, link) in saved["links"]
            .as_object()
            .expect("links")
            .values()
            .enumerate()
        {
            let psk = link[0].as_str().expect("a preshared key");
            self.add(&format!("{name}#{i}"), &B64.decode(psk).unwrap(), false);
        }
    }

    /// The secrets found in `text`, by name; `configuration` allows the ones a WireGuard
    /// configuration holds.
    fn leaks(&self, text: &str, configuration: bool) -> Vec<String> {
        self.0
            .iter()
            .filter(|(_, (_, allowed))| !(configuration && *allowed))
            .filter(|(_, (raw, _))| {
                let forms = [B64.encode(raw), hex::encode(raw), hex::encode_upper(raw)];
                forms.iter().any(|form| text.contains(form.as_str()))
            })
            .map(|(name, _)| name.clone())
            .collect()
    }
}

/// `kgctl ARGS…` against the cluster, from n1's namespace: its standard output and error.
fn kgctl(c: &Cluster, args: &[&str]) -> String {
    let dir = format!("--cluster-dir={}", c.dir.display());
    let mut command = vec![kgctl_bin(), "--backend=file", &dir];
    command.extend_from_slice(args);
    common::output_text(&c.node("n1").ns.output(&command))
}

/// Every output surface of the cluster, as `(name, text, is a WireGuard configuration)`.
fn surfaces(c: &Cluster) -> Vec<(String, String, bool)> {
    let mut out = Vec::new();
    for n in &c.nodes {
        out.push((format!("{}'s log", n.name), n.log_text(), false));
        for path in [
            "/status",
            "/status?probe=true",
            "/metrics",
            "/graph?format=dot",
        ] {
            out.push((format!("{}'s {path}", n.name), n.http_get(path).1, false));
        }
    }
    let url = "--kg-url=http://127.0.0.1:1107";
    let commands: [&[&str]; 9] = [
        &["diagnose", "n1", url],
        &["diagnose", "n1", url, "-o", "json"],
        &["graph"],
        &["showconf", "node", "n1"],
        &["showconf", "node", "n1", "-o", "json"],
        &["showconf", "node", "n1", "-o", "yaml"],
        &["showconf", "node", "n3", "--as-peer"],
        &["showconf", "node", "n3", "--as-peer", "-o", "yaml"],
        &["showconf", "node", "n3", "--as-peer", "-o", "json"],
    ];
    for args in commands {
        let configuration = args[0] == "showconf";
        out.push((
            format!("kgctl {}", args.join(" ")),
            kgctl(c, args),
            configuration,
        ));
    }
    for format in ["wireguard", "json", "yaml"] {
        let args = ["showconf", "peer", "laptop", "-o", format];
        out.push((format!("kgctl {}", args.join(" ")), kgctl(c, &args), true));
    }
    out
}

/// Every secret on disk beside each node's key: the key, the next key, the post-quantum keys.
fn secrets_on_disk(c: &Cluster, secrets: &mut Secrets) {
    for n in &c.nodes {
        let key = c.work.join("keys").join(&n.name);
        for suffix in ["", ".next", ".pq", ".psk"] {
            let path = format!("{}{suffix}", key.display());
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let name = format!("{}{suffix}", n.name);
            if suffix == ".psk" {
                secrets.add_saved_psks(&name, &text);
            } else {
                secrets.add_first_line(&name, &text);
            }
        }
    }
}

/// The files beside each node's key that are readable or writable by others.
fn wide_files(c: &Cluster) -> Vec<String> {
    let dir = c.work.join("keys");
    let mut wide = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            wide.push(format!("{} is {mode:04o}", display(&path)));
        }
    }
    wide
}

fn display(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

fn scan(c: &Cluster, secrets: &Secrets, when: &str) {
    let mut found = Vec::new();
    let all = surfaces(c);
    for (surface, text, peer_conf) in &all {
        assert!(
            !text.is_empty(),
            "{when}: {surface} is empty: nothing was scanned"
        );
        for name in secrets.leaks(text, *peer_conf) {
            found.push(format!("{name} in {surface}"));
        }
    }
    assert!(found.is_empty(), "{when}: keys leaked: {found:?}");
    eprintln!(
        "{when}: {} surfaces, {} KiB, {} secrets: none found",
        all.len(),
        all.iter().map(|s| s.1.len()).sum::<usize>() / 1024,
        secrets.0.len()
    );
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn no_key_appears_on_any_output_surface() {
    common::require_root("no_key_appears_on_any_output_surface");
    let mut c = Cluster::with_nodes(
        &["east", "west"],
        &[("n1", "east"), ("n2", "east"), ("n3", "west")],
    );
    // A Peer with a preshared key (one that never connects: its key is in every device).
    let mut secrets = Secrets::default();
    let mut psk = [0u8; 32];
    rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut psk);
    secrets.add("the Peer's preshared key", &psk, true);
    let laptop = dataplane::SecretKey::generate();
    secrets.add("the Peer's private key", laptop.as_bytes(), false);
    std::fs::write(
        c.dir.join("laptop.yaml"),
        format!(
            "apiVersion: kilo.squat.ai/v1alpha1\nkind: Peer\nmetadata:\n  name: laptop\nspec:\n  \
             allowedIPs:\n  - 10.5.0.9/32\n  publicKey: {}\n  presharedKey: {}\n  \
             persistentKeepalive: 10\n",
            laptop.public_key().to_base64(),
            B64.encode(psk)
        ),
    )
    .unwrap();
    let trace = [("KG_LOG", "trace".to_string())];
    for i in 0..3 {
        c.start_kg_with_env(
            i,
            &[
                "--post-quantum",
                "--mesh-granularity=full",
                "--log-level=all",
            ],
            &trace,
        );
    }
    let keyed = c.wait_for(Duration::from_secs(60), |c| {
        c.all_pods_reachable().is_ok()
            && c.nodes.iter().all(|n| {
                let keys = n.preshared_keys();
                keys.len() == 3 && keys.values().all(|k| k != "(none)")
            })
    });
    assert!(keyed, "{:?}\n{}", c.all_pods_reachable(), c.logs());
    let psk_b64 = B64.encode(psk);
    assert!(
        c.nodes
            .iter()
            .all(|n| n.preshared_keys().values().any(|k| *k == psk_b64)),
        "every device holds the Peer's preshared key"
    );

    // The planted leak: the scan finds a key in each form, and only the Peer's may be in a
    // configuration.
    let node_key = std::fs::read_to_string(c.work.join("keys").join("n1")).unwrap();
    let raw = B64.decode(node_key.trim()).unwrap();
    let planted = Secrets(BTreeMap::from([(
        "planted".to_string(),
        (raw.clone(), false),
    )]));
    for form in [
        node_key.trim().to_string(),
        hex::encode(&raw),
        hex::encode_upper(&raw),
    ] {
        assert_eq!(planted.leaks(&format!("x {form} y"), false), ["planted"]);
        assert_eq!(planted.leaks(&format!("x {form} y"), true), ["planted"]);
    }
    assert!(secrets
        .leaks(&format!("PresharedKey = {psk_b64}"), true)
        .is_empty());
    assert_eq!(
        secrets
            .leaks(&format!("PresharedKey = {psk_b64}"), false)
            .len(),
        1
    );

    // A rotation under way: n1's next key is on disk and published (--force: the Peer is
    // configured with the leaders' keys and would not follow).
    let said = kgctl(&c, &["rotate-key", "n1", "--force"]);
    let id = said
        .split("(request ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .unwrap_or_else(|| panic!("kgctl rotate-key said: {said}"))
        .to_string();
    let next = c.work.join("keys").join("n1.next");
    let published = c.wait_for(Duration::from_secs(20), |c| {
        next.exists() && c.annotations("n1").contains_key("kilotun.io/next-key")
    });
    assert!(published, "{:?}\n{}", c.annotations("n1"), c.logs());
    secrets_on_disk(&c, &mut secrets);
    assert!(
        secrets.0.keys().any(|k| k.starts_with("n1.next")),
        "n1's next key was read from disk"
    );
    assert!(
        secrets.0.keys().filter(|k| k.contains(".psk#")).count() >= 6,
        "the post-quantum keys were read from disk: {:?}",
        secrets.0.keys().collect::<Vec<_>>()
    );
    scan(&c, &secrets, "during the rotation");

    // The rotation done: the new key joins the secrets, and every surface is scanned again.
    let done = c.wait_for(Duration::from_secs(30), |c| {
        c.annotations("n1").get("kilotun.io/key-rotated") == Some(&id) && !next.exists()
    });
    assert!(done, "{:?}\n{}", c.annotations("n1"), c.logs());
    secrets_on_disk(&c, &mut secrets);
    scan(&c, &secrets, "after the rotation");
    assert_eq!(
        wide_files(&c),
        Vec::<String>::new(),
        "files beside the keys"
    );
}
