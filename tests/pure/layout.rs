//! The source tree's shape, checked so it does not drift as files are added:
//! - imports inside `src/agent` go one way. The pipeline (the files directly in `src/agent`)
//!   uses the four folders; `serve/` and `host/` use `shells/`; `shells/` uses nothing else
//!   of the agent; `reconciler/` (the decisions) uses the values of `host/` and its own
//!   configuration, neither a shell nor the flags (`args.rs`, which only its tests name). A path that climbs out of its folder (`crate::agent::...` naming another
//!   part, or a `super::` chain reaching `src/agent` itself) is a violation, in a `use` or in
//!   code.
//! - no source file of the three crates is much over 500 lines.

use std::path::{Path, PathBuf};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// The parts of the agent each folder may name: itself and what is below it.
const ALLOWED: [(&str, &[&str]); 4] = [
    ("shells", &["shells"]),
    ("host", &["host", "shells"]),
    ("serve", &["serve", "shells"]),
    // The decisions: values from `host/` and their own configuration, never a shell nor the
    // flags (its tests build the configuration from flags: [`TESTS_MAY_ALSO`]).
    ("reconciler", &["reconciler", "host"]),
];

/// What a folder's test files (`tests.rs`, or under `tests/`) may name besides.
const TESTS_MAY_ALSO: [&str; 1] = ["args"];

/// The longest a source file may be (about 500 lines, with a little slack for the next edit).
const MAX_LINES: usize = 560;

/// Every `.rs` file under `dir`, into `out` (also the clock check's walk of the tree).
pub(crate) fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.expect("directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` without `//` comments (doc comments included), so prose may name any module.
fn code(text: &str) -> String {
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The identifiers that follow `crate::agent::` in `code`, with `{a, b}` groups opened.
fn agent_paths(code: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::agent::") {
        rest = &rest[at + "crate::agent::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let end = group.find('}').unwrap_or(group.len());
            names.extend(group[..end].split(',').filter_map(|part| {
                let name = part.trim().split("::").next()?.trim();
                (!name.is_empty()).then(|| name.to_string())
            }));
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            names.push(name);
        }
    }
    names
}

/// How many `super::` a path in `code` chains at most.
fn deepest_super(code: &str) -> usize {
    let mut deepest = 0;
    for (at, _) in code.match_indices("super::") {
        if code[..at].ends_with("super::") {
            continue;
        }
        let chain = code.as_bytes()[at..]
            .chunks(7)
            .take_while(|c| *c == b"super::")
            .count();
        deepest = deepest.max(chain);
    }
    deepest
}

#[test]
fn imports_inside_the_agent_go_one_way() {
    let agent = Path::new(ROOT).join("src/agent");
    let mut violations = Vec::new();
    let mut checked = 0;
    for (folder, allowed) in ALLOWED {
        let mut files = Vec::new();
        rust_files(&agent.join(folder), &mut files);
        assert!(!files.is_empty(), "src/agent/{folder} has no files");
        for file in files {
            let relative = file.strip_prefix(&agent).expect("under src/agent");
            let text = code(&std::fs::read_to_string(&file).expect("readable"));
            let test_file = relative
                .components()
                .any(|c| c.as_os_str() == "tests" || c.as_os_str() == "tests.rs");
            for name in agent_paths(&text) {
                let also = test_file && TESTS_MAY_ALSO.contains(&name.as_str());
                if !allowed.contains(&name.as_str()) && !also {
                    violations.push(format!(
                        "src/agent/{}: names crate::agent::{name} ({folder}/ may use only {allowed:?})",
                        relative.display()
                    ));
                }
            }
            // A file `folder/a.rs` is module agent::folder::a, whose `super::super` is the
            // agent itself; one folder deeper, one `super::` more (`folder/a/b.rs`, or
            // `folder/a/mod.rs`... but `folder/mod.rs` is agent::folder, one less).
            let mut depth = relative.components().count();
            if relative.file_name().is_some_and(|n| n == "mod.rs") {
                depth -= 1;
            }
            // An inline `mod tests { ... }` (last in the file) is one level deeper.
            let (main, tests) = text.split_at(text.find("mod tests {").unwrap_or(text.len()));
            let climbs = deepest_super(main) > depth - 1 || deepest_super(tests) > depth;
            if climbs {
                violations.push(format!(
                    "src/agent/{}: a super:: chain climbs out of {folder}/ into the pipeline",
                    relative.display(),
                ));
            }
            checked += 1;
        }
    }
    assert!(checked > 20, "only {checked} files checked");
    assert!(
        violations.is_empty(),
        "imports against the layout:\n{}",
        violations.join("\n")
    );
}

#[test]
fn no_source_file_is_much_over_500_lines() {
    let mut files = Vec::new();
    for dir in ["src", "control/src", "dataplane/src"] {
        rust_files(&Path::new(ROOT).join(dir), &mut files);
    }
    assert!(files.len() > 50, "only {} files found", files.len());
    let mut long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let lines = std::fs::read_to_string(f)
                .expect("readable")
                .lines()
                .count();
            (lines > MAX_LINES).then(|| format!("{} ({lines} lines)", f.display()))
        })
        .collect();
    long.sort();
    assert!(
        long.is_empty(),
        "files over {MAX_LINES} lines: split them by role:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_checks_catch_what_they_are_for() {
    // The parsers themselves, on lines a violation would have.
    assert_eq!(
        agent_paths("use crate::agent::{shells::Kernel, apply};"),
        ["shells", "apply"]
    );
    assert_eq!(
        agent_paths("let x = crate::agent::Agent::new();"),
        ["Agent"]
    );
    assert_eq!(deepest_super("use super::super::reconcile::Memo;"), 2);
    assert_eq!(deepest_super("use super::Link;"), 1);
    assert_eq!(code("use x; // crate::agent::apply"), "use x; ");
}
