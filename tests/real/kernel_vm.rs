//! kilotun against the kernel's own WireGuard, and the wireguard and ipip modules, under Debian's
//! kernels 6.1 (bookworm) and 5.10 (bullseye): this machine's kernel may lack those modules (CI's
//! has none), so `scripts/kernel-vm.sh` boots each kernel in a virtual machine (virtme-ng, qemu
//! under TCG, this machine's file system as the guest's root) and runs
//! `tests/kernel_vm_interop.sh` there with the kilotun built for this test. The script proves that
//! the modules load (`ip link add ... type wireguard`, an ipip tunnel), that kilotun and the
//! kernel handshake whichever starts, ping both ways, move 4 MiB each way intact, and that
//! `wg show dump` reads alike on both ends, that each end follows the other when it roams (a new
//! listen port, a new address) and that a peer removed and added again on either end stops the
//! traffic and then handshakes anew; it prints a `KVM_OK` line per step and
//! `KVM_INTEROP_PASS` at the end. In the same machine, `tests/kernel_mixed_fleet.sh` then runs
//! kg on the kernel's WireGuard (`--wireguard=kernel` and `auto`) meshed with kg on the
//! embedded engine, restarts the kernel's kg (the link and its sessions outlive kg) and switches
//! a node each way between the two on restart (the goal is at most 1 s lost each; the script
//! fails above 4 s, below the 15 s of the other end's timers, since emulation on a busy host
//! slows kg's start), in a location that mixes the kernel's IPIP and kilotun's
//! userspace IPIP (`--ipip=userspace`), then restarts all four with `--mesh-granularity=full`
//! (the last run's routes over the tunnels must go); it prints `CHECK <name> ok` per step and
//! `GAP` lines with what each lost. A third machine, on 5.10, runs two of
//! `tests/netns/kg_mesh.rs`'s tests with the `netns` test binary cargo built for the suite
//! (`CORE_ON_5_10`).
//!
//! Needs root and qemu-system-x86, busybox-static, kmod, python3 (venv), socat, iproute2,
//! wireguard-tools, iputils-ping; the kernels and virtme-ng are fetched once into
//! `${KILOTUN_CACHE:-/var/cache/kilotun}/kernel-vm` (`scripts/kernel-vm.sh --prepare`, about
//! 15 s each on a fresh machine). Without any of that the tests skip themselves with a message,
//! unless `CI` is set: then they fail. A run takes one to three minutes per kernel under TCG.

use crate::common;

use std::process::{Command, Output, Stdio};
use std::sync::Mutex;

use common::cluster::kg_bin;
use common::{kilotun_bin, which};

const REPO: &str = env!("CARGO_MANIFEST_DIR");

/// An emulated machine takes both cores of a test machine; one at a time (within this process,
/// as `cargo test` runs the tier; nextest runs each test in a process of its own and keeps them
/// apart with its `cpu-heavy` test group, `.config/nextest.toml`).
static SERIAL: Mutex<()> = Mutex::new(());

/// The steps tests/kernel_vm_interop.sh reports, in order.
const STEPS: [&str; 9] = [
    "KVM_OK wireguard-module",
    "KVM_OK ipip-module",
    "KVM_OK handshake-kernel-initiated",
    "KVM_OK handshake-kilotun-initiated",
    "KVM_OK ping",
    "KVM_OK transfer",
    "KVM_OK dump",
    "KVM_OK roaming",
    "KVM_OK peer-readd",
];

/// The steps tests/kernel_mixed_fleet.sh reports, in order.
const FLEET_STEPS: [&str; 7] = [
    "CHECK mesh ok",
    "CHECK mixed-ipip ok",
    "CHECK kinds ok",
    "CHECK restart ok",
    "CHECK to-engine ok",
    "CHECK to-kernel ok",
    "CHECK full ok",
];

/// Fails the test, saying why it cannot run here (it is `#[ignore]`d: it runs only when asked for).
fn unavailable(test: &str, why: &str) -> ! {
    panic!("{test}: cannot run here: {why}");
}

fn text(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `scripts/kernel-vm.sh --kernel KERNEL ARGS…`, its output collected.
fn kernel_vm(kernel: &str, args: &[&str]) -> Output {
    Command::new("bash")
        .arg(format!("{REPO}/scripts/kernel-vm.sh"))
        .args(["--kernel", kernel])
        .args(args)
        .current_dir(REPO)
        .stdin(Stdio::null())
        .output()
        .expect("running scripts/kernel-vm.sh")
}

/// Fails the test, saying why, unless this host can run the machine and its cache is (or could be
/// made) ready.
fn require_the_machine(test: &str, kernel: &str) {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        unavailable(
            test,
            "needs root, as the other network-namespace tests (and to prepare the cache in /var/cache/kilotun)",
        );
    }
    let tools = [
        "qemu-system-x86_64",
        "busybox",
        "python3",
        "ip",
        "wg",
        "ping",
        "socat",
    ];
    let mut missing: Vec<&str> = tools.into_iter().filter(|t| !which(t)).collect();
    if !["modprobe", "/usr/sbin/modprobe", "/sbin/modprobe"]
        .iter()
        .any(|t| which(t))
    {
        missing.push("modprobe");
    }
    if !missing.is_empty() {
        unavailable(
            test,
            &format!("needs {missing:?} (.ci/run installs them: qemu-system-x86, busybox-static, kmod, ...)"),
        );
    }
    let prepared = kernel_vm(kernel, &["--prepare"]);
    if !prepared.status.success() {
        let (_, stderr) = text(&prepared);
        let tail: Vec<&str> = stderr.lines().rev().take(15).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        unavailable(
            test,
            &format!(
                "scripts/kernel-vm.sh --kernel {kernel} --prepare failed ({}):\n{}",
                prepared.status,
                tail.join("\n")
            ),
        );
    }
}

/// The guest's standard output of a [`kernel_vm`] run, once the script's timings (boot, run,
/// power-off) are printed and the run is known to have passed.
fn guest_stdout(test: &str, out: &Output) -> String {
    let (stdout, stderr) = text(out);
    let timings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("kernel-vm.sh:"))
        .collect();
    eprintln!("{test}: {}", timings.join("\n"));
    assert!(
        out.status.success(),
        "{test}: the guest's test failed ({}):\n{stdout}\n--- stderr:\n{stderr}",
        out.status
    );
    stdout
}

fn interop(kernel: &str, test: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_the_machine(test, kernel);
    let out = kernel_vm(
        kernel,
        &[
            "--timeout",
            "900",
            "--",
            "bash",
            "-c",
            "bash tests/kernel_vm_interop.sh \"$1\" && KG=\"$2\" bash tests/kernel_mixed_fleet.sh",
            "kernel-vm",
            kilotun_bin(),
            kg_bin(),
        ],
    );
    let stdout = guest_stdout(test, &out);
    eprintln!("{test}: guest output:\n{stdout}");
    let mut from = 0;
    for step in STEPS {
        let at = stdout[from..].find(step).unwrap_or_else(|| {
            panic!("{test}: no `{step}` (in order) in the guest's output:\n{stdout}")
        });
        from += at + step.len();
    }
    for step in FLEET_STEPS {
        let at = stdout[from..].find(step).unwrap_or_else(|| {
            panic!("{test}: no `{step}` (in order) in the guest's output:\n{stdout}")
        });
        from += at + step.len();
    }
    for gap in stdout.lines().filter(|l| l.starts_with("GAP ")) {
        eprintln!("{test}: {gap}");
    }
    let release = stdout
        .lines()
        .find_map(|l| l.strip_prefix("KVM_INTEROP_PASS kernel="))
        .unwrap_or_else(|| panic!("{test}: no KVM_INTEROP_PASS in the guest's output:\n{stdout}"));
    assert!(
        release.starts_with(&format!("{kernel}.")),
        "{test}: the guest ran kernel {release}, not {kernel}"
    );
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn kilotun_and_kg_with_kernel_wireguard_on_linux_6_1() {
    interop("6.1", "kilotun_and_kg_with_kernel_wireguard_on_linux_6_1");
}

#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn kilotun_and_kg_with_kernel_wireguard_on_linux_5_10() {
    interop("5.10", "kilotun_and_kg_with_kernel_wireguard_on_linux_5_10");
}

/// The tests of `tests/netns/kg_mesh.rs` that run the core of the suite under bullseye's 5.10,
/// as the `netns` test binary names them (selected there with `--exact`): Kilo's leaders
/// elected and every pod reached across locations (with the firewall, the metrics and the
/// graph), and a machine joined with `kgctl connect`. (The other kg_mesh tests passed there too,
/// by hand; in CI they would add about four more minutes under TCG.)
const CORE_ON_5_10: [&str; 2] = [
    "kg_mesh::location_mesh_elects_kilos_leaders_and_connects_every_pod",
    "kg_mesh::kgctl_connect_joins_a_machine_to_the_mesh_with_the_userspace_engine",
];

/// The `netns` test binary cargo built beside this one (the newest, if several).
fn netns_binary() -> Option<std::path::PathBuf> {
    let deps = std::env::current_exe().ok()?.parent()?.to_path_buf();
    std::fs::read_dir(&deps)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix("netns-")
                .is_some_and(|hash| hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()))
        })
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .max()
        .map(|(_, path)| path)
}

/// [`CORE_ON_5_10`] run in a machine booted from bullseye's 5.10 kernel: the same netns
/// clusters, nftables, routes and TUN devices as on this machine's kernel, on an older one.
#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn the_core_of_the_mesh_suite_on_linux_5_10() {
    netns_tests_in_vm(
        "the_core_of_the_mesh_suite_on_linux_5_10",
        "5.10",
        &CORE_ON_5_10,
        |release| release.starts_with("5.10."),
    );
}

/// The tests of `tests/netns/kg_kernel.rs`, which need a kernel with WireGuard.
const KERNEL_WIREGUARD_TESTS: [&str; 2] = [
    "kg_kernel::kg_edits_allowed_ips_on_the_kernels_wireguard_from_linux_6_16",
    "kg_kernel::post_quantum_keys_and_a_key_rotation_on_the_kernels_wireguard",
];

/// [`KERNEL_WIREGUARD_TESTS`] in a machine booted from Debian unstable's kernel, the newest
/// Debian has: kg changes the kernel's WireGuard peers' allowed IPs entry by entry there
/// (`WGALLOWEDIP_F_REMOVE_ME`, Linux 6.16 on), and gives the kernel's links post-quantum
/// preshared keys through a key change and a key rotation.
#[test]
#[ignore = "needs root and the real parts .ci/run installs"]
fn kg_on_the_kernels_wireguard_under_debians_newest_kernel() {
    netns_tests_in_vm(
        "kg_on_the_kernels_wireguard_under_debians_newest_kernel",
        "sid",
        &KERNEL_WIREGUARD_TESTS,
        kilotun::agent::shells::kernel_wireguard::kernel_takes_removals,
    );
}

/// Runs the `netns` test binary's tests `names` (by their exact names) in a machine booted from
/// `kernel`, whose release must satisfy `release_ok`, and checks that each passed there.
fn netns_tests_in_vm(test: &str, kernel: &str, names: &[&str], release_ok: fn(&str) -> bool) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    require_the_machine(test, kernel);
    let Some(binary) = netns_binary() else {
        unavailable(
            test,
            "no netns test binary beside this one (cargo test builds it: run the whole suite)",
        );
    };
    let binary = binary.to_string_lossy().into_owned();
    let mut args = vec![
        "--timeout",
        "900",
        "--",
        "bash",
        "-c",
        // The cluster's waits for a mesh are four times as long: kg starts many times slower
        // under TCG, on a host that is busy with the rest of the suite.
        // Their own output (and the figures they print) joins the guest's stdout.
        "cd \"$1\" && shift && echo \"release=$(uname -r)\" && CI=1 KILOTUN_WAIT_SCALE=4 exec \"$@\" 2>&1",
        "kernel-vm",
        REPO,
        &binary,
        "--test-threads=1",
        "--nocapture",
        // They are #[ignore]d (root only): named, they run.
        "--include-ignored",
        "--exact",
    ];
    args.extend(names);
    let out = kernel_vm(kernel, &args);
    let stdout = guest_stdout(test, &out);
    let release = stdout
        .lines()
        .find_map(|l| l.strip_prefix("release="))
        .unwrap_or_else(|| panic!("{test}: the guest did not say its release:\n{stdout}"));
    assert!(
        release_ok(release),
        "{test}: the guest ran {release}:\n{stdout}"
    );
    // Each ran (their output, not captured, may stand between a name and its `ok`), and all
    // of them passed.
    for name in names {
        assert!(
            stdout.contains(&format!("test {name} ... ")),
            "{test}: {name} did not run in the guest:\n{stdout}"
        );
    }
    assert!(
        stdout.contains(&format!(
            "test result: ok. {} passed; 0 failed",
            names.len()
        )),
        "{test}: {stdout}"
    );
    // The results, and the figures the tests print (`<test function>: …`).
    let figures = |l: &str| {
        names
            .iter()
            .any(|n| l.starts_with(&format!("{}: ", n.rsplit("::").next().unwrap_or(n))))
    };
    for line in stdout
        .lines()
        .filter(|l| l.starts_with("test ") || figures(l))
    {
        eprintln!("{test}: under {release}: {line}");
    }
}
