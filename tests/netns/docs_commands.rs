//! The documentation's commands cannot rot:
//! - every fenced block marked ` ```sh runnable ` in README.md and `docs/` runs as written, as
//!   root, in a network namespace of its own that looks like a small host (an `eth0` with an
//!   address and a default route), in an empty working directory, with kilotun's binaries on
//!   the `PATH` and a private `/run/wireguard`; it must exit 0 within a minute;
//! - in every `sh` block, each `--flag` given to `kg`, `kgctl` (per subcommand) or `kilotun`
//!   is one the binary's `--help` lists, and each path into this repository exists.
//!
//! The other blocks (installing on a cluster, cross builds, the test suite itself) are what
//! `.ci/run` and the real-API-server and real-kubelet tests run; these checks keep their names
//! and flags honest.

use crate::common;
use crate::markdown;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use markdown::documents;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// A fenced code block: its file, first line, info string and text.
struct Block {
    file: PathBuf,
    line: usize,
    info: String,
    body: String,
}

/// The fenced blocks of `file`.
fn blocks(file: &Path) -> Vec<Block> {
    let text = std::fs::read_to_string(file).expect("readable");
    let mut out = Vec::new();
    let mut open: Option<Block> = None;
    for (number, line) in text.lines().enumerate() {
        let fence = line.trim_start().strip_prefix("```");
        match (fence, open.take()) {
            (Some(_), Some(block)) => out.push(block),
            (Some(info), None) => {
                open = Some(Block {
                    file: file.to_path_buf(),
                    line: number + 1,
                    info: info.trim().to_string(),
                    body: String::new(),
                })
            }
            (None, Some(mut block)) => {
                block.body.push_str(line);
                block.body.push('\n');
                open = Some(block);
            }
            (None, None) => {}
        }
    }
    out
}

fn sh_blocks() -> Vec<Block> {
    documents()
        .iter()
        .flat_map(|f| blocks(f))
        .filter(|b| b.info == "sh" || b.info.starts_with("sh "))
        .collect()
}

fn where_(block: &Block) -> String {
    format!(
        "{}:{}",
        block
            .file
            .strip_prefix(ROOT)
            .unwrap_or(&block.file)
            .display(),
        block.line
    )
}

fn run(args: &[&str]) -> std::process::Output {
    Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
}

fn must(args: &[&str]) {
    let out = run(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A namespace like a small host: `eth0` 192.168.77.1/24 to a router namespace at .254, the
/// default route through it. Both are deleted (with what runs in them) on drop.
struct Host {
    ns: String,
    router: String,
}

impl Host {
    fn new() -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let id = format!(
            "kdoc{}x{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        );
        let host = Self {
            ns: format!("{id}h"),
            router: format!("{id}r"),
        };
        must(&["ip", "netns", "add", &host.ns]);
        must(&["ip", "netns", "add", &host.router]);
        let (ns, router) = (host.ns.as_str(), host.router.as_str());
        must(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        must(&[
            "ip", "-n", router, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0",
            "netns", ns,
        ]);
        must(&[
            "ip",
            "-n",
            router,
            "addr",
            "add",
            "192.168.77.254/24",
            "dev",
            "eth0",
        ]);
        must(&["ip", "-n", router, "link", "set", "eth0", "up"]);
        must(&[
            "ip",
            "-n",
            ns,
            "addr",
            "add",
            "192.168.77.1/24",
            "dev",
            "eth0",
        ]);
        must(&["ip", "-n", ns, "link", "set", "eth0", "up"]);
        must(&[
            "ip",
            "-n",
            ns,
            "route",
            "add",
            "default",
            "via",
            "192.168.77.254",
        ]);
        host
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        for ns in [&self.ns, &self.router] {
            let pids = run(&["ip", "netns", "pids", ns]);
            for pid in String::from_utf8_lossy(&pids.stdout).split_whitespace() {
                let _ = run(&["kill", "-KILL", pid]);
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
        for ns in [&self.ns, &self.router] {
            let _ = run(&["ip", "netns", "del", ns]);
        }
    }
}

#[test]
#[ignore = "needs root: network namespaces and TUN devices"]
fn runnable_blocks_run_as_written() {
    let runnable: Vec<Block> = sh_blocks()
        .into_iter()
        .filter(|b| b.info.split_whitespace().any(|w| w == "runnable"))
        .collect();
    assert!(
        runnable.len() >= 2,
        "only {} runnable blocks: did a page lose its marks?",
        runnable.len()
    );
    common::require_root("runnable_blocks_run_as_written");
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_kg"))
        .parent()
        .expect("bin dir");
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut failures = Vec::new();
    for block in &runnable {
        let host = Host::new();
        let work = std::env::temp_dir().join(format!("{}-work", host.ns));
        std::fs::create_dir_all(&work).expect("work dir");
        // The UAPI sockets go to a private /run/wireguard, so nothing meets the host's devices.
        let wrapper = "mkdir -p /run/wireguard && mount -t tmpfs tmpfs /run/wireguard && \
                       exec timeout 60 bash -euo pipefail -c \"$1\"";
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &host.ns,
                "unshare",
                "--mount",
                "--propagation",
                "private",
            ])
            .args(["bash", "-c", wrapper, "block", &block.body])
            .current_dir(&work)
            .env("PATH", &path)
            .output()
            .expect("ip netns exec");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprintln!("== {} ({})\n{stdout}{stderr}", where_(block), out.status);
        let _ = std::fs::remove_dir_all(&work);
        if !out.status.success() {
            failures.push(format!(
                "{} exited {}:\n{}\n-- stdout\n{stdout}\n-- stderr\n{stderr}",
                where_(block),
                out.status,
                block.body
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The commands of `line` (split at `|`, `&&`, `||`, `;` and `&`), each as its words, with a
/// leading `sudo` and `VAR=value` assignments dropped and comments cut.
fn commands(line: &str) -> Vec<Vec<String>> {
    let line = line.split(" #").next().unwrap_or("");
    line.split(['|', ';', '&'])
        .map(|part| {
            part.split_whitespace()
                .skip_while(|w| *w == "sudo" || *w == "exec" || w.contains('='))
                .map(str::to_string)
                .collect::<Vec<_>>()
        })
        .filter(|words| !words.is_empty())
        .collect()
}

/// Every command of `block` with the line it is on (a `\\` at a line's end continues it).
fn block_commands(block: &Block) -> Vec<(String, Vec<String>)> {
    let text = block.body.replace("\\\n", " ");
    text.lines()
        .flat_map(|line| {
            commands(line)
                .into_iter()
                .map(move |words| (line.to_string(), words))
        })
        .collect()
}

#[test]
fn every_flag_the_docs_give_a_binary_is_one_it_has() {
    let bins = [
        ("kg", env!("CARGO_BIN_EXE_kg")),
        ("kgctl", env!("CARGO_BIN_EXE_kgctl")),
        ("kilotun", env!("CARGO_BIN_EXE_kilotun")),
    ];
    let mut problems = Vec::new();
    let mut checked = 0;
    for block in sh_blocks() {
        for (line, words) in block_commands(&block) {
            let Some((name, bin)) = bins.iter().find(|(n, _)| words[0] == *n) else {
                continue;
            };
            let mut help_args: Vec<&str> = Vec::new();
            if *name == "kgctl" {
                if let Some(sub) = words[1..].iter().find(|w| !w.starts_with('-')) {
                    help_args.push(sub);
                }
            }
            help_args.push("--help");
            let help = run(&[&[*bin][..], &help_args[..]].concat());
            let help = String::from_utf8_lossy(&help.stdout).to_string();
            for word in &words[1..] {
                let Some(flag) = word.strip_prefix("--") else {
                    continue;
                };
                let flag = format!("--{}", flag.split('=').next().unwrap_or(flag));
                checked += 1;
                let listed = help
                    .split(|c: char| c.is_whitespace() || c == ',' || c == '[' || c == '=')
                    .any(|w| w == flag || w.trim_end_matches(['[', '<']) == flag);
                if !listed {
                    problems.push(format!(
                        "{}: `{}` gives {name} {flag}, which `{name} {}` does not list",
                        where_(&block),
                        line.trim(),
                        help_args.join(" ")
                    ));
                }
            }
        }
    }
    assert!(
        checked > 15,
        "only {checked} flags found: is the parser broken?"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_script_the_docs_run_directly_is_executable() {
    use std::os::unix::fs::PermissionsExt;
    let mut problems = Vec::new();
    let mut checked = 0;
    for block in sh_blocks() {
        for (_, words) in block_commands(&block) {
            let first = words[0].as_str();
            if !(first.starts_with("scripts/") || first.starts_with("image/")) {
                continue;
            }
            checked += 1;
            let mode = std::fs::metadata(Path::new(ROOT).join(first))
                .map(|m| m.permissions().mode())
                .unwrap_or(0);
            if mode & 0o111 == 0 {
                problems.push(format!(
                    "{}: runs {first} directly, but it is not executable",
                    where_(&block)
                ));
            }
        }
    }
    assert!(
        checked > 5,
        "only {checked} scripts found: is the parser broken?"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_repository_path_in_the_docs_commands_exists() {
    let roots = [
        "scripts/",
        "tests/",
        "image/",
        "manifests/",
        "docs/",
        "bench/",
        ".ci/",
    ];
    let mut problems = Vec::new();
    let mut checked = 0;
    for block in sh_blocks() {
        for word in block.body.split_whitespace() {
            let word = word.trim_matches(|c: char| "\"'`(),;".contains(c));
            let word = word.split('=').next_back().unwrap_or(word);
            if !roots.iter().any(|r| word.starts_with(r)) || word.contains('*') {
                continue;
            }
            checked += 1;
            if !Path::new(ROOT).join(word).exists() {
                problems.push(format!("{}: no {word} in the repository", where_(&block)));
            }
        }
    }
    assert!(
        checked > 10,
        "only {checked} paths found: is the parser broken?"
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
