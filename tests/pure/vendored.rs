//! `vendor/boringtun` is boringtun 0.7.1 as published on crates.io plus exactly the changes in
//! `vendor/boringtun.patch`: undoing the patch on a copy gives back every file of the published
//! crate, byte for byte (their SHA-256 sums, taken from the crate as cargo unpacked it, are in
//! `vendor/boringtun-0.7.1.sha256`), and no other file.

use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn run(command: &mut Command) -> String {
    let output = command.output().expect("runs");
    assert!(
        output.status.success(),
        "{command:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8")
}

#[test]
#[ignore = "needs GNU patch (Debian's patch package): .ci/run installs it and runs ignored tests"]
fn vendored_boringtun_is_the_published_0_7_1_plus_the_patch() {
    assert!(
        Command::new("patch").arg("--version").output().is_ok(),
        "vendored_boringtun_is_the_published_0_7_1_plus_the_patch: no `patch` program (apt-get install patch)"
    );
    let vendor = Path::new(ROOT).join("vendor");
    let copy = std::env::temp_dir().join(format!("kilotun-vendored-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&copy);
    run(Command::new("cp")
        .arg("-r")
        .arg(vendor.join("boringtun"))
        .arg(&copy));
    run(Command::new("patch")
        .args(["-R", "-p1", "--no-backup-if-mismatch", "-s", "-i"])
        .arg(vendor.join("boringtun.patch"))
        .arg("-d")
        .arg(&copy));
    let sums = vendor.join("boringtun-0.7.1.sha256");
    let checked = run(Command::new("sha256sum")
        .arg("-c")
        .arg(&sums)
        .current_dir(&copy));
    let listed = std::fs::read_to_string(&sums).unwrap().lines().count();
    assert_eq!(
        checked.lines().filter(|l| l.ends_with(": OK")).count(),
        listed
    );
    let present = run(Command::new("find")
        .args([".", "-type", "f"])
        .current_dir(&copy));
    std::fs::remove_dir_all(&copy).unwrap();
    assert_eq!(
        present.lines().count(),
        listed,
        "files beside the published crate's:\n{present}"
    );
    assert!(listed > 30, "only {listed} files listed");
}
