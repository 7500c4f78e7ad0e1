//! README's first command, `sudo bash tests/demo.sh`, run as a user would run it (with the
//! binaries under test instead of a fresh build): the four-node mesh comes up, the cross-location
//! ping from a non-leader gets every reply, the graph is drawn, and nothing is left behind.

use crate::common;

use std::path::Path;
use std::process::Command;

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn the_readme_demo_meshes_four_nodes_and_cleans_up() {
    common::require_root("the_readme_demo_meshes_four_nodes_and_cleans_up");
    let root = env!("CARGO_MANIFEST_DIR");
    let svg = std::env::temp_dir().join(format!("{}.svg", common::unique("demo")));
    let output = Command::new("bash")
        .arg(Path::new(root).join("tests/demo.sh"))
        .env("DEMO_KG", env!("CARGO_BIN_EXE_kg"))
        .env("DEMO_KGCTL", env!("CARGO_BIN_EXE_kgctl"))
        .env("DEMO_SVG", &svg)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "demo failed\n{stdout}\n{stderr}");
    // The final ping, from n2 (east, not a leader) to n4's pod address in west.
    assert!(
        stdout.contains("3 packets transmitted, 3 received, 0% packet loss"),
        "{stdout}"
    );
    // kgctl graph names both locations; the leader of east has west's leader as a peer.
    assert!(stdout.contains("digraph"), "{stdout}");
    for location in ["east", "west"] {
        assert!(stdout.contains(location), "{location} missing\n{stdout}");
    }
    assert!(stdout.contains("latest handshake"), "{stdout}");
    // n2 reaches the other location through its leader, over the userspace IPIP device.
    assert!(
        stdout.contains("10.42.4.0/24 via 192.168.10.1 dev kilo-ipip"),
        "{stdout}"
    );
    if common::which("circo") {
        let picture = std::fs::read_to_string(&svg).unwrap();
        let _ = std::fs::remove_file(&svg);
        assert!(picture.contains("<svg"), "{picture}");
    }
    // Torn down: no namespace of the demo's and no UAPI socket of its interfaces remain.
    let namespaces = common::run(&["ip", "netns", "list"]);
    assert!(
        !namespaces.lines().any(|l| l.starts_with("demo")),
        "{namespaces}"
    );
    for n in 1..=4 {
        let socket = format!("/var/run/wireguard/kilo-n{n}.sock");
        assert!(!Path::new(&socket).exists(), "{socket} left behind");
    }
}
