//! Who may read the clock: only the shells and the drivers. Every decision (the `control` crate,
//! the `keys` crate, the engine's packet logic, the agent's reconciler and host logic, the
//! reference model) takes `now` as an argument, so a test or the model can run it on a manual
//! clock. This scans the code (comments and `#[cfg(test)]` items left out) for
//! `Instant::now()` and `SystemTime::now()` and fails on one outside [`MAY_READ_THE_CLOCK`].

use std::path::Path;

use crate::layout::rust_files;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The source folders scanned.
const SCANNED: [&str; 4] = ["src", "control/src", "dataplane/src", "keys/src"];

/// The files and folders (a trailing `/`) whose code may read the clock: the I/O shells, the
/// drivers that feed them and the decisions the time, and the programs around them.
const MAY_READ_THE_CLOCK: [&str; 20] = [
    // The agent's shells: the kernel, the firewall, the devices, files, child processes.
    "src/agent/shells/",
    // What kg serves: HTTP, path probes (round-trip times).
    "src/agent/serve/",
    // The backends: the API server's client, its pacing, the file backend's poller.
    "src/backend/",
    // The agent's driver: its loop (`read_clock`), the pass it runs, the time its stages take.
    "src/agent/mod.rs",
    "src/agent/reconcile.rs",
    "src/agent/start.rs",
    "src/agent/stages.rs",
    // The timers of the loops.
    "src/periodic.rs",
    // The reference model's driver anchors its manual clock once.
    "src/model/sim.rs",
    // The command-line programs and their servers.
    "src/kgctl.rs",
    "src/kgctl/",
    "src/webhook.rs",
    "src/device_plugin/",
    "src/bin/",
    // The engine's runtime around the packet logic: its threads and sockets, and the twins.
    "dataplane/src/device.rs",
    "dataplane/src/device/",
    "dataplane/src/helpers.rs",
    "dataplane/src/io/",
    "dataplane/src/testing.rs",
    // The fuzz targets' drivers of the engine.
    "dataplane/src/fuzzing.rs",
];

/// True for a file that holds tests only (`tests.rs`, `*_tests.rs`, anything under `tests/`).
fn is_test_file(relative: &str) -> bool {
    let name = relative.rsplit('/').next().unwrap_or(relative);
    name == "tests.rs" || name.ends_with("_tests.rs") || relative.contains("/tests/")
}

/// `text` without `//` comments and without the items under `#[cfg(test)]` (a `mod x;`
/// declaration, or a block counted to its closing brace).
fn production_code(text: &str) -> String {
    let mut out = Vec::new();
    let mut lines = text.lines().map(|l| l.find("//").map_or(l, |at| &l[..at]));
    while let Some(line) = lines.next() {
        if line.trim() != "#[cfg(test)]" {
            out.push(line);
            continue;
        }
        let mut depth = 0i32;
        for item in lines.by_ref() {
            depth += item.matches('{').count() as i32 - item.matches('}').count() as i32;
            if depth <= 0 && (item.contains('}') || item.trim_end().ends_with(';')) {
                break;
            }
        }
    }
    out.join("\n")
}

/// The clock reads in `code`, as `(line, call)`.
fn clock_reads(code: &str) -> Vec<(usize, &'static str)> {
    let mut found = Vec::new();
    for (at, line) in code.lines().enumerate() {
        for call in ["Instant::now()", "SystemTime::now()"] {
            if line.contains(call) {
                found.push((at + 1, call));
            }
        }
    }
    found
}

fn may_read(relative: &str) -> bool {
    MAY_READ_THE_CLOCK
        .iter()
        .any(|allowed| match allowed.strip_suffix('/') {
            Some(folder) => relative.starts_with(&format!("{folder}/")),
            None => relative == *allowed,
        })
}

#[test]
fn only_the_shells_and_the_drivers_read_the_clock() {
    let mut files = Vec::new();
    for dir in SCANNED {
        rust_files(&Path::new(ROOT).join(dir), &mut files);
    }
    let mut violations = Vec::new();
    let mut reads = 0;
    for path in &files {
        let relative = path
            .strip_prefix(ROOT)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        if is_test_file(&relative) {
            continue;
        }
        let text = std::fs::read_to_string(path).unwrap();
        for (line, call) in clock_reads(&production_code(&text)) {
            reads += 1;
            if !may_read(&relative) {
                violations.push(format!(
                    "{relative}: {call} (line {line} without comments and tests)"
                ));
            }
        }
    }
    assert!(
        reads > 10,
        "only {reads} clock reads found: is the scan still reading the tree?"
    );
    assert!(
        violations.is_empty(),
        "the clock is read outside the shells and the drivers (take `now` as an argument, or \
         list the file in MAY_READ_THE_CLOCK with why):\n{}",
        violations.join("\n")
    );
}

#[test]
fn the_clock_check_catches_what_it_is_for() {
    let planted = "fn decide() -> bool {\n    // Instant::now() in a comment is prose\n    let t = Instant::now();\n    t.elapsed().is_zero()\n}\n#[cfg(test)]\nmod tests {\n    fn t() { let _ = SystemTime::now(); }\n}\n#[cfg(test)]\nmod more;\nfn after() { let _ = SystemTime::now(); }\n";
    let reads = clock_reads(&production_code(planted));
    assert_eq!(reads.len(), 2, "{reads:?}");
    assert_eq!(reads[0].1, "Instant::now()");
    assert_eq!(reads[1].1, "SystemTime::now()");
    assert!(may_read("src/agent/shells/netlink.rs"));
    assert!(may_read("src/agent/mod.rs"));
    assert!(!may_read("src/agent/reconciler/mod.rs"));
    assert!(!may_read("control/src/dns.rs"));
    assert!(!may_read("dataplane/src/engine/inbound.rs"));
    assert!(!may_read("src/agent/modx.rs"));
    assert!(is_test_file("src/agent/reconciler/tests.rs") && is_test_file("src/model/pq_tests.rs"));
}
