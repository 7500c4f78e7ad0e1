//! `kilotun IFACE`: a userspace WireGuard device driven by `wg` over
//! `/var/run/wireguard/IFACE.sock`, a drop-in for `wireguard-go IFACE`.
//!
//! Without `--foreground` it starts itself again detached (as wireguard-go does) and exits once
//! the device is up, or with the device's error if it could not come up.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use dataplane::device::{Device, LinkLost, LinuxUdpBinder};
use dataplane::io::linux_tun::{existing_link, LinuxTun};
use dataplane::uapi_server::{self, SocketGuard, UapiBindError, UapiServer};

/// Environment variable naming the pipe a detached child reports readiness on.
const READY_FD_ENV: &str = "KILOTUN_READY_FD";

/// Userspace WireGuard device, driven by `wg` like wireguard-go.
#[derive(Debug, Parser)]
#[command(name = "kilotun", version = kilotun::VERSION, about)]
struct Args {
    /// Stay in the foreground instead of detaching.
    #[arg(short = 'f', long)]
    foreground: bool,
    /// Worker threads (default: number of cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Open the TUN device without segmentation offload: one packet per read and write, as on
    /// kernels that lack it (for a kernel whose offload misbehaves).
    #[arg(long)]
    no_offload: bool,
    /// Log level: error, warn, info, debug or trace.
    #[arg(long, default_value = "info", env = "LOG_LEVEL")]
    log_level: String,
    /// Directory of the UAPI socket.
    #[arg(long, default_value = uapi_server::SOCKET_DIR, hide = true)]
    socket_dir: String,
    /// Interface name.
    interface: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.threads == Some(0) {
        eprintln!("kilotun: --threads must be at least 1");
        return ExitCode::from(2);
    }
    let result = if args.foreground || std::env::var_os(READY_FD_ENV).is_some() {
        run_foreground(&args)
    } else {
        detach()
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kilotun: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Starts this program again in its own session, with `--foreground`, and waits for it to say
/// it is up (or why not).
fn detach() -> Result<()> {
    let (read_end, write_end) = pipe()?;
    let exe = std::env::current_exe().context("finding our own executable")?;
    // SAFETY: setsid is async-signal-safe and touches no state of the parent.
    let child = unsafe {
        Command::new(exe)
            .args(std::env::args_os().skip(1))
            .arg("--foreground")
            .env(READY_FD_ENV, write_end.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .pre_exec(move || {
                libc::close(read_end);
                libc::setsid();
                Ok(())
            })
            .spawn()
    }
    .context("starting the detached device")?;
    // SAFETY: both ends are fresh descriptors of our own pipe.
    drop(unsafe { OwnedFd::from_raw_fd(write_end) });
    // SAFETY: as above; the read end is ours alone now.
    let mut reader = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(read_end) });
    let mut message = String::new();
    let _ = reader.read_to_string(&mut message);
    drop(child);
    match message.strip_prefix("ok") {
        Some(_) => Ok(()),
        None if message.is_empty() => anyhow::bail!("the device exited before coming up"),
        None => anyhow::bail!("{}", message.trim_end()),
    }
}

fn pipe() -> Result<(RawFd, RawFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` has room for the two descriptors pipe writes.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error()).context("creating a pipe");
    }
    Ok((fds[0], fds[1]))
}

/// Reports readiness (or an error) to a waiting parent, if there is one.
fn report_to_parent(message: &str) {
    let Some(fd) = std::env::var(READY_FD_ENV)
        .ok()
        .and_then(|v| v.parse::<RawFd>().ok())
    else {
        return;
    };
    // SAFETY: the parent gave us this descriptor for exactly this one write.
    let mut pipe = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    let _ = pipe.write_all(message.as_bytes());
}

fn run_foreground(args: &Args) -> Result<()> {
    init_logging(&args.log_level);
    // Before anything exists: a SIGTERM while the device comes up still ends it through the
    // path below, which removes the socket.
    let signals = SignalPipe::new().context("installing signal handlers")?;
    let up = bring_up(args);
    let (device, server, created) = match up {
        Ok(up) => up,
        Err(e) => {
            report_to_parent(&format!("{e:#}"));
            return Err(e);
        }
    };
    tracing::info!(
        interface = %args.interface,
        port = device.listen_port(),
        created,
        "device up"
    );
    report_to_parent("ok");

    let end = wait_for_end(&signals, &device);
    // The socket first, so a device started again under this name finds the name free.
    drop(server);
    device.stop();
    outcome(end, &args.interface)
}

/// How the daemon exits after `end`: status 0 on a signal or a deleted link (as wireguard-go
/// exits when its TUN goes away), an error naming `interface` and the failure (status 1) when
/// a queue kept failing.
fn outcome(end: End, interface: &str) -> Result<()> {
    match end {
        End::Signal(signal) => {
            tracing::info!(signal, "shut down");
            Ok(())
        }
        End::Lost(LinkLost::Deleted) => {
            tracing::info!(interface, "the interface was deleted: exiting");
            Ok(())
        }
        End::Lost(loss) => Err(anyhow::anyhow!("interface {interface}: {loss}")),
    }
}

/// Why the daemon ends.
enum End {
    /// SIGINT or SIGTERM.
    Signal(i32),
    /// The device lost its TUN link.
    Lost(LinkLost),
}

/// SIGINT and SIGTERM, each noted on a socket pair of its own that this process polls.
struct SignalPipe {
    pipes: Vec<(i32, UnixStream)>,
}

impl SignalPipe {
    fn new() -> Result<Self> {
        let mut pipes = Vec::new();
        for signal in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
            let (read, write) = UnixStream::pair()?;
            read.set_nonblocking(true)?;
            signal_hook::low_level::pipe::register_raw(signal, write.into_raw_fd())?;
            pipes.push((signal, read));
        }
        Ok(Self { pipes })
    }

    /// The signal received, if one was.
    fn take(&self) -> Option<i32> {
        let mut byte = [0u8; 1];
        self.pipes
            .iter()
            .find(|(_, read)| matches!((&*read).read(&mut byte), Ok(1)))
            .map(|(signal, _)| *signal)
    }
}

/// Sleeps until a signal arrives or the device loses its link.
fn wait_for_end(signals: &SignalPipe, device: &Device<LinuxUdpBinder>) -> End {
    loop {
        if let Some(loss) = device.link_lost() {
            return End::Lost(loss);
        }
        if let Some(signal) = signals.take() {
            return End::Signal(signal);
        }
        let mut fds: Vec<libc::pollfd> = signals
            .pipes
            .iter()
            .map(|(_, read)| read.as_raw_fd())
            .chain([device.link_lost_fd()])
            .map(|fd| libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `fds` is a live array of pollfd of the given length.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
    }
}

type Up = (Arc<Device<LinuxUdpBinder>>, UapiServer, bool);

/// How long a live socket whose interface no longer exists may take to go: the device that
/// served the name is exiting, its link deleted a moment ago (`wg-quick down`, then `up`).
const EXITING_DEVICE_PATIENCE: Duration = Duration::from_secs(1);

/// [`uapi_server::bind`], waiting up to [`EXITING_DEVICE_PATIENCE`] for a device whose link is
/// gone to release the name.
fn bind_socket(path: &Path, name: &str) -> Result<UnixListener> {
    let deadline = Instant::now() + EXITING_DEVICE_PATIENCE;
    loop {
        match uapi_server::bind(path) {
            Err(UapiBindError::InUse { .. })
                if existing_link(name).is_none() && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            bound => return Ok(bound?),
        }
    }
}

/// True when this process holds CAP_NET_ADMIN (bit 12 of `CapEff` in /proc/self/status).
fn has_net_admin() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(hex.trim(), 16).ok()
        })
        .is_some_and(|caps| caps & (1 << 12) != 0)
}

fn bring_up(args: &Args) -> Result<Up> {
    let name = &args.interface;
    dataplane::io::linux_tun::validate_name(name)?;
    if !has_net_admin() {
        anyhow::bail!("creating TUN device {name:?} needs CAP_NET_ADMIN (run as root)");
    }
    let path = uapi_server::socket_path(Path::new(&args.socket_dir), name);
    // The socket first: if another device serves this name, touch nothing.
    let listener = bind_socket(&path, name)?;
    let guard = SocketGuard::new(&path);
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let (queues, existed) = if args.no_offload {
        LinuxTun::open(name, threads)
    } else {
        LinuxTun::open_offloaded(name, threads)
    }?;
    tracing::info!(
        queues = queues.len(),
        offload = queues[0].has_offload(),
        "TUN device {name} open (offload: TCP segments split on read, coalesced on write)"
    );
    let device =
        Device::start(queues, LinuxUdpBinder).with_context(|| format!("starting device {name}"))?;
    let device = Arc::new(device);
    let server = UapiServer::start(listener, path, Arc::clone(&device) as Arc<_>)
        .context("serving the UAPI socket")?;
    guard.keep();
    Ok((device, server, !existed))
}

/// `level` (`--log-level` or a filter of tracing's), with the libraries' own chatter (boringtun's
/// line per peer and handshake retry among it) left out unless the filter names them.
fn init_logging(level: &str) {
    let filter =
        tracing_subscriber::EnvFilter::try_new(kilotun::agent::with_quiet_libraries(level))
            .unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(kilotun::agent::with_quiet_libraries("info"))
            });
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_queue_exits_with_an_error_naming_it_and_a_deletion_or_signal_cleanly() {
        assert!(outcome(End::Signal(libc::SIGTERM), "wg7").is_ok());
        assert!(outcome(End::Lost(LinkLost::Deleted), "wg7").is_ok());
        let failed = LinkLost::Failed {
            queue: 1,
            failures: 30,
            error: "Input/output error (os error 5)".into(),
        };
        let e = outcome(End::Lost(failed), "wg7").unwrap_err().to_string();
        assert_eq!(
            e,
            "interface wg7: TUN queue 1 failed 30 times in a row, the last with: Input/output error (os error 5)"
        );
    }
}
