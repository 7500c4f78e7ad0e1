//! The WireGuard device kg drives: the embedded engine (default), the kernel's WireGuard
//! (`--wireguard=kernel`, or `auto` where the kernel has it), or an existing device with
//! `--create-interface=false` (a userspace one over its UAPI socket, else a kernel link).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use control::nat::DevicePeer;
use dataplane::device::{Device, LinkLost, LinuxUdpBinder};
use dataplane::io::linux_tun::LinuxTun;
use dataplane::uapi_server::{self, SocketGuard, UapiServer};
use dataplane::{DeviceConfig, PeerStats};

use super::allowed_ips::{AllowedIpsMethod, AllowedIpsUpdates};
use super::kernel_wireguard::KernelWireGuard;
use super::netlink::Netlink;

mod choose;

pub use choose::WireGuardChoice;

/// A WireGuard device kg can configure and read.
pub enum WireGuard {
    /// The engine running inside kg, serving the UAPI socket like `kilotun`.
    Embedded {
        /// The running engine and its UAPI server, replaced whole by [`WireGuard::recreate`].
        run: parking_lot::RwLock<EmbeddedRun>,
        /// How the engine was started, so it can be started again the same way.
        recipe: EmbeddedRecipe,
    },
    /// The kernel's WireGuard link, driven over generic netlink.
    Kernel(KernelWireGuard),
    /// Another process's device, driven through its UAPI socket.
    Uapi {
        /// The socket path.
        path: PathBuf,
        /// The interface name.
        interface: String,
        /// Edits until the device refuses a removal of one allowed IP (`allowed_ip=-`, which
        /// wireguard-go before 0.0.20250522 does not know), whole lists after; and what was sent.
        allowed_ips: AllowedIpsMethod,
    },
}

impl WireGuard {
    /// Creates (or attaches to) the TUN link `name` and starts the engine on it. With
    /// `persist`, the link outlives the process, so a crash keeps its addresses and routes.
    pub fn embedded(name: &str, threads: usize, socket_dir: &Path, persist: bool) -> Result<Self> {
        let recipe = EmbeddedRecipe {
            interface: name.to_string(),
            threads,
            socket_dir: socket_dir.to_path_buf(),
            persist,
        };
        let run = recipe.start()?;
        Ok(Self::Embedded {
            run: parking_lot::RwLock::new(run),
            recipe,
        })
    }

    /// The embedded engine's running device (`None` for a device kg does not run).
    pub fn engine_device(&self) -> Option<Arc<Device<LinuxUdpBinder>>> {
        match self {
            Self::Embedded { run, .. } => Some(Arc::clone(&run.read().device)),
            Self::Kernel(_) | Self::Uapi { .. } => None,
        }
    }

    /// Starts the embedded engine again, as [`WireGuard::embedded`] started it, after its TUN
    /// link was lost ([`WireGuard::link_lost`]): the old engine is stopped and its socket
    /// removed, the link opened anew (created again when it was deleted, so without the
    /// addresses and routes the kernel took with it) and a new engine started on it with no
    /// peers. When the new start fails the stopped engine stays, still lost, and a later call
    /// tries again. Any other device refuses: kg does not run it.
    pub fn recreate(&self) -> Result<()> {
        let Self::Embedded { run, recipe } = self else {
            bail!(
                "{} is not kg's embedded engine: kg cannot start it again",
                self.interface()
            );
        };
        let mut run = run.write();
        drop(run.server.take());
        run.device.stop();
        *run = recipe.start()?;
        Ok(())
    }

    /// Creates the interface `name` with the WireGuard `choice` names, taking over the link of
    /// the last run when it is of that kind and replacing it when it is not (a switch between
    /// the engine and the kernel's WireGuard on restart). Logs once which it drives and why.
    pub async fn create(
        choice: WireGuardChoice,
        name: &str,
        threads: usize,
        socket_dir: &Path,
        netlink: &Netlink,
    ) -> Result<Self> {
        match choose::kernel_link(
            choice,
            name,
            netlink,
            KernelWireGuard::available,
            Self::kernel,
        )
        .await?
        {
            Some(kernel) => Ok(kernel),
            None => Self::embedded(name, threads, socket_dir, true),
        }
    }

    /// Whether this kg could run the WireGuard `choice` names on this node, checked without
    /// creating anything: the embedded engine needs a `/dev/net/tun` it may open, the kernel's
    /// needs the kernel to have WireGuard, and `auto` is content with either. A kg standing by
    /// beside the one that runs the engine (a surge rollout's new pod) asks before it answers
    /// `/health`: one that could not take over must never be why the running one is stopped.
    pub fn can_run(choice: WireGuardChoice) -> Result<()> {
        let tun = || dataplane::io::linux_tun::check_tun_device().map_err(anyhow::Error::from);
        match choice {
            WireGuardChoice::Embedded => tun(),
            WireGuardChoice::Kernel => KernelWireGuard::available(),
            WireGuardChoice::Auto => tun().or_else(|e| {
                KernelWireGuard::available()
                    .map_err(|kernel| anyhow::anyhow!("{e:#}; and {kernel:#}"))
            }),
        }
    }

    /// Drives the kernel's WireGuard link `name`, which must exist.
    pub fn kernel(name: &str) -> Result<Self> {
        KernelWireGuard::open(name).map(Self::Kernel)
    }

    /// Drives the device whose UAPI socket is `<socket_dir>/<name>.sock`, or, with no such
    /// socket, the kernel's WireGuard link `name` (what Kilo's `--create-interface=false`
    /// expects to find).
    pub fn uapi(name: &str, socket_dir: &Path) -> Result<Self> {
        let path = uapi_server::socket_path(socket_dir, name);
        if !path.exists() {
            return Self::kernel(name).map_err(|e| {
                anyhow::anyhow!(
                    "--create-interface=false but no userspace WireGuard device serves {} (start kilotun or wireguard-go first), and {name} is no kernel WireGuard link: {e:#}",
                    path.display()
                )
            });
        }
        Ok(Self::Uapi {
            path,
            interface: name.to_string(),
            allowed_ips: AllowedIpsMethod::new(true),
        })
    }

    /// The interface's name (the `interface` label of the WireGuard metrics).
    pub fn interface(&self) -> &str {
        match self {
            Self::Embedded { recipe, .. } => &recipe.interface,
            Self::Uapi { interface, .. } => interface,
            Self::Kernel(device) => device.interface(),
        }
    }

    /// Which WireGuard this is: `embedded`, `kernel` or `uapi` (the `implementation` label of
    /// `kilotun_wireguard_info`, and `/status`).
    pub fn implementation(&self) -> &'static str {
        match self {
            Self::Embedded { .. } => "embedded",
            Self::Kernel(_) => "kernel",
            Self::Uapi { .. } => "uapi",
        }
    }

    /// True for the engine inside kg, whose own counters (handshakes, failures, roaming, drops)
    /// are known; a device over UAPI reports only what `wg show` does.
    pub fn is_embedded(&self) -> bool {
        matches!(self, Self::Embedded { .. })
    }

    /// Why the embedded engine's TUN link stopped carrying packets: deleted under it, or
    /// failing past the engine's retries (see [`dataplane::device::link`]). `None` while it
    /// works, and always for a device kg does not run.
    pub fn link_lost(&self) -> Option<LinkLost> {
        match self {
            Self::Embedded { run, .. } => run.read().device.link_lost(),
            Self::Kernel(_) | Self::Uapi { .. } => None,
        }
    }

    /// The device's configuration and live peer state.
    pub fn read(&self) -> Result<(DeviceConfig, Vec<PeerStats>)> {
        match self {
            Self::Embedded { run, .. } => {
                let device = &run.read().device;
                Ok((device.engine().config(), device.peer_stats()))
            }
            Self::Kernel(device) => device.read(),
            Self::Uapi { path, .. } => {
                let answer = exchange(path, "get=1\n\n")?;
                dataplane::uapi::parse_get(&answer)
                    .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))
            }
        }
    }

    /// Makes the device's configuration `desired`, changing only what differs so unchanged peers
    /// keep their sessions. Returns true when something changed.
    pub fn apply(&self, desired: &DeviceConfig) -> Result<bool> {
        match self {
            Self::Embedded { run, .. } => {
                let device = &run.read().device;
                let current = device.engine().config();
                if current == *desired {
                    return Ok(false);
                }
                device
                    .set_config(desired)
                    .context("configuring the embedded engine")?;
                Ok(true)
            }
            Self::Kernel(device) => device.apply(desired),
            Self::Uapi {
                path, allowed_ips, ..
            } => {
                use dataplane::uapi_diff::{self, AllowedIpsStyle};
                let (current, _) = self.read()?;
                let Some(change) = uapi_diff::change(&current, desired) else {
                    return Ok(false);
                };
                let style = allowed_ips.style();
                let answer = uapi_set(path, &uapi_diff::render_set(&change, style))?;
                if answer == "errno=0" {
                    allowed_ips.sent(&change, style);
                    return Ok(true);
                }
                if style == AllowedIpsStyle::Edit && change.removes_allowed_ips() {
                    // The lines before the refused one were applied: read the device again
                    // and replace what still differs. Only when that succeeds was the removal
                    // the trouble (and not, say, a port in use).
                    let (current, _) = self.read()?;
                    let replaced = match uapi_diff::change(&current, desired) {
                        Some(change) => {
                            let body = uapi_diff::render_set(&change, AllowedIpsStyle::Replace);
                            let done = uapi_set(path, &body)? == "errno=0";
                            if done {
                                allowed_ips.sent(&change, AllowedIpsStyle::Replace);
                            }
                            done
                        }
                        None => true,
                    };
                    if replaced {
                        allowed_ips.refused(format!("{} refused the removal of one allowed IP (allowed_ip=-; wireguard-go takes it from 0.0.20250522), answering {answer:?}", path.display()));
                        return Ok(true);
                    }
                }
                bail!("{} answered {answer:?}", path.display())
            }
        }
    }

    /// What changed peers' allowed IPs were sent as since the last call (nothing for the
    /// embedded engine, which kg configures whole and which edits its own tables).
    pub fn take_allowed_ips_updates(&self) -> AllowedIpsUpdates {
        match self {
            Self::Embedded { .. } => AllowedIpsUpdates::default(),
            Self::Kernel(device) => device.take_allowed_ips_updates(),
            Self::Uapi { allowed_ips, .. } => allowed_ips.take(),
        }
    }

    /// Packets the embedded engine dropped, by reason (none known for a device over UAPI).
    pub fn drops(&self) -> Vec<(dataplane::DropReason, u64)> {
        match self {
            Self::Embedded { run, .. } => run.read().device.engine().drops().snapshot(),
            Self::Kernel(_) | Self::Uapi { .. } => Vec::new(),
        }
    }

    /// The last handshakes the embedded engine refused (none known over UAPI).
    pub fn rejected_handshakes(&self) -> Vec<dataplane::RejectedHandshake> {
        match self {
            Self::Embedded { run, .. } => run.read().device.engine().rejected_handshakes(),
            Self::Kernel(_) | Self::Uapi { .. } => Vec::new(),
        }
    }

    /// Peers as NAT discovery needs them.
    pub fn device_peers(&self) -> Result<Vec<DevicePeer>> {
        let (_, stats) = self.read()?;
        Ok(stats
            .into_iter()
            .map(|s| DevicePeer {
                public_key: control::Key(*s.public_key.as_bytes()),
                endpoint: s.endpoint,
                has_handshake: s.last_handshake.is_some(),
            })
            .collect())
    }

    /// Stops the embedded engine (removing its socket). Returns true when the caller should
    /// delete the link: `delete_link` is set and the link is kg's (the engine's TUN link, a
    /// persistent one kg attached to after a restart included, or the kernel's WireGuard link
    /// kg created or took over). A kernel link left in place keeps forwarding with no kg.
    ///
    /// It takes `&self`: other holders (the HTTP handlers' copies) may remain, and still the
    /// engine's threads end, its sockets close and its TUN queues are released when this
    /// returns. That is what lets the next kg of the node, waiting on the engine lock, bind the
    /// port at once.
    pub fn shutdown(&self, delete_link: bool) -> bool {
        match self {
            Self::Embedded { run, .. } => {
                let mut run = run.write();
                drop(run.server.take());
                run.device.stop();
                delete_link
            }
            Self::Kernel(_) => delete_link,
            Self::Uapi { .. } => false,
        }
    }
}

/// The embedded engine as it runs: the device and the server of its UAPI socket (so `wg show`
/// works; taken and stopped by [`WireGuard::shutdown`] and [`WireGuard::recreate`]).
pub struct EmbeddedRun {
    device: Arc<Device<LinuxUdpBinder>>,
    server: Option<UapiServer>,
}

/// How kg starts its embedded engine: on the TUN link `interface` with `threads` queues,
/// serving `<socket_dir>/<interface>.sock`, the link made persistent with `persist`.
#[derive(Debug, Clone)]
pub struct EmbeddedRecipe {
    interface: String,
    threads: usize,
    socket_dir: PathBuf,
    persist: bool,
}

impl EmbeddedRecipe {
    /// Binds the UAPI socket, opens (or creates) the TUN link and starts the engine on it.
    fn start(&self) -> Result<EmbeddedRun> {
        let name = &self.interface;
        let path = uapi_server::socket_path(&self.socket_dir, name);
        std::fs::create_dir_all(&self.socket_dir)
            .with_context(|| format!("creating {}", self.socket_dir.display()))?;
        let listener = uapi_server::bind(&path)?;
        let guard = SocketGuard::new(&path);
        let (queues, _existed) = LinuxTun::open_offloaded(name, self.threads)
            .with_context(|| format!("opening TUN device {name}"))?;
        tracing::info!(
            queues = queues.len(),
            offload = queues[0].has_offload(),
            "TUN device {name} open (offload: TCP segments split on read, coalesced on write)"
        );
        if self.persist {
            if let Err(e) = queues[0].set_persist(true) {
                tracing::warn!(error = %e, "cannot make {name} persistent; a crash will remove it");
            }
        }
        let device = Arc::new(
            Device::start(queues, LinuxUdpBinder)
                .with_context(|| format!("starting the engine on {name}"))?,
        );
        let server = UapiServer::start(listener, path, Arc::clone(&device) as Arc<_>)
            .context("serving the UAPI socket")?;
        guard.keep();
        Ok(EmbeddedRun {
            device,
            server: Some(server),
        })
    }
}

/// Sends the `set=1` request `body` to the UAPI socket at `path` (keys redacted in the debug
/// line) and returns the device's answer, trimmed.
fn uapi_set(path: &Path, body: &str) -> Result<String> {
    let redacted: Vec<&str> = body
        .lines()
        .map(|l| {
            if l.starts_with("private_key=") || l.starts_with("preshared_key=") {
                "(key redacted)"
            } else {
                l
            }
        })
        .collect();
    tracing::debug!(request = redacted.join(" "), "UAPI set");
    let answer = exchange(path, &format!("set=1\n{body}\n"))?;
    Ok(answer.trim().to_string())
}

/// One UAPI request/answer over a Unix socket, with a timeout.
fn exchange(path: &Path, request: &str) -> Result<String> {
    let mut stream =
        UnixStream::connect(path).with_context(|| format!("connecting to {}", path.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(request.as_bytes())?;
    let mut answer = String::new();
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            break;
        }
        let done = line.starts_with("errno=");
        answer.push_str(&line);
        if done {
            break;
        }
    }
    Ok(answer)
}
