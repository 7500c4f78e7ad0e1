//! The documentation's links: every relative link in README.md and `docs/` names a file that
//! exists and, with a `#fragment`, a heading of that file (GitHub's anchor for it); every page
//! of `docs/` is linked from the README. Links inside fenced code blocks are not links.

use crate::markdown;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use markdown::documents;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.trim_start().starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// The targets of the inline links `[text](target)` of `text`, outside code blocks and spans.
fn link_targets(text: &str) -> Vec<String> {
    let mut targets = Vec::new();
    for line in prose(text) {
        // Code spans may hold `](`: drop them first.
        let mut plain = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                plain.push_str(part);
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let Some(end) = after.find(')') else { break };
            targets.push(after[..end].to_string());
            rest = &after[end..];
        }
    }
    targets
}

/// GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped,
/// spaces made `-`.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of every heading of the Markdown file `path`.
fn anchors(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    prose(&text)
        .into_iter()
        .filter_map(|line| {
            let hashes = line.chars().take_while(|c| *c == '#').count();
            (hashes > 0 && line[hashes..].starts_with(' ')).then(|| anchor(&line[hashes..]))
        })
        .collect()
}

/// What is wrong with `target`, linked from `from`, if anything.
fn broken(from: &Path, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (file, fragment) = match target.split_once('#') {
        Some((file, fragment)) => (file, Some(fragment)),
        None => (target, None),
    };
    let path = if file.is_empty() {
        from.to_path_buf()
    } else {
        from.parent().unwrap().join(file)
    };
    if !path.exists() {
        return Some(format!("{target}: no file {}", path.display()));
    }
    let fragment = fragment?;
    (!anchors(&path).contains(fragment)).then(|| {
        format!(
            "{target}: no heading in {} has the anchor #{fragment}",
            path.display()
        )
    })
}

#[test]
fn every_relative_link_names_a_file_and_heading_that_exist() {
    let mut problems = Vec::new();
    let mut checked = 0;
    for doc in documents() {
        let text = std::fs::read_to_string(&doc).expect("readable");
        for target in link_targets(&text) {
            checked += 1;
            if let Some(problem) = broken(&doc, &target) {
                problems.push(format!("{}: {problem}", doc.display()));
            }
        }
    }
    assert!(
        checked > 20,
        "only {checked} links found: is the parser broken?"
    );
    assert!(
        problems.is_empty(),
        "broken links:\n{}",
        problems.join("\n")
    );
}

#[test]
fn every_page_of_docs_is_linked_from_the_readme() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let linked: BTreeSet<String> = link_targets(&readme)
        .into_iter()
        .map(|t| t.split('#').next().unwrap_or_default().to_string())
        .collect();
    let orphans: Vec<String> = documents()
        .into_iter()
        .skip(1)
        .map(|p| format!("docs/{}", p.file_name().unwrap().to_string_lossy()))
        .filter(|page| !linked.contains(page))
        .collect();
    assert!(
        orphans.is_empty(),
        "pages the README does not link: {orphans:?}"
    );
}

#[test]
fn the_link_checker_catches_a_missing_file_and_a_missing_heading() {
    let readme = root().join("README.md");
    assert!(broken(&readme, "docs/kg.md").is_none());
    assert!(broken(&readme, "docs/no-such-page.md").is_some());
    assert!(broken(&readme, "docs/ipv6.md#an-ipv6-underlay").is_none());
    assert!(broken(&readme, "docs/ipv6.md#no-such-heading").is_some());
    assert!(broken(&readme, "https://kilo.squat.ai").is_none());
    assert_eq!(
        anchor("Dual-stack and IPv6-only pods (Kilo #94)"),
        "dual-stack-and-ipv6-only-pods-kilo-94"
    );
    assert_eq!(
        link_targets("see [a](x.md) and `[b](not-a-link)` then [c](y.md#z)"),
        ["x.md", "y.md#z"]
    );
}

#[test]
fn every_event_reason_is_named_in_the_troubleshooting_guide() {
    let guide = std::fs::read_to_string(root().join("docs/troubleshooting.md")).unwrap();
    let missing: Vec<&str> = control::journal::Reason::ALL
        .iter()
        .map(|r| r.as_str())
        .filter(|name| !guide.contains(&format!("`{name}`")))
        .collect();
    assert!(
        missing.is_empty(),
        "docs/troubleshooting.md does not name these event reasons: {missing:?}"
    );
}
