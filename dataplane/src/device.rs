//! A running device: worker threads that move packets between the TUN queues, the UDP sockets
//! and the [`Engine`], plus a timer thread.
//!
//! Each worker owns one TUN queue and one socket per address family (the sockets share the
//! listen port through `SO_REUSEPORT`, so the kernel keeps each peer's datagrams on one worker,
//! and the multi-queue TUN keeps each flow on one queue: nothing is reordered). A worker reads a
//! batch, hands it to the engine, and writes the engine's output; no lock is held across a
//! syscall. A big batch's crypto is shared with helper threads (one fewer than the cores), while
//! the worker alone decides the batch's order, so one peer's traffic (a location leader's whole
//! link) uses every core. The timer thread keeps the helpers closed while the machine has no
//! idle core for them (read from `/proc/stat` once a tick). Configuration changes swap the engine's snapshot; a listen-port change binds the new
//! sockets first, so a port in use fails the change and leaves everything as it was.
//!
//! A worker whose TUN queue is detached (the link was deleted) ends, and one whose queue keeps
//! failing gives it up after a bounded number of retries ([`link`]); either way the device
//! reports it through [`Device::link_lost`] and [`Device::link_lost_fd`], and its owner
//! decides what follows (the `kilotun` daemon exits, as wireguard-go does).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Instant, SystemTime};

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::config::{ApplyReport, DeviceConfig};
use crate::engine::{Engine, TIMER_TICK};
use crate::eventfd::{poll, readable, EventFd};
use crate::helpers::{CpuTimes, Helpers, IdleCores};
use crate::io::udp::UdpSocketIo;
use crate::io::{TunIo, UdpIo};
use crate::outbox::Outbox;
use crate::stats::PeerStats;
use crate::uapi::{self, UapiError};

pub mod link;
mod worker;

pub use link::LinkLost;
use link::LossLatch;
use worker::{pick, worker};

/// Datagrams read per batch from a socket.
pub const BATCH: usize = 64;
/// Receive slots per UDP batch (each up to 64 KiB: one datagram, or a coalesced run).
const UDP_SLOTS: usize = 16;
/// Packet buffers per TUN read batch: room for one 64 KiB TCP segment split at the smallest
/// segment size the kernel offloads (about 128 pieces), plus one more such read.
const TUN_BATCH: usize = 256;
/// Largest packet a TUN read or UDP receive may return.
const MAX_PACKET: usize = 65536;

/// The environment variable that sets how many helper threads a device starts (see
/// [`default_helpers`]).
pub const HELPERS_ENV: &str = "KILOTUN_HELPERS";

/// How many threads help the workers through big batches' crypto: one fewer than the cores
/// this process may run on (the worker holding the batch is the last), or `KILOTUN_HELPERS`.
pub fn default_helpers() -> usize {
    std::env::var(HELPERS_ENV)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()) - 1)
}

/// Sockets bound to the listen port: `v4[i]` and `v6[i]` serve worker `i` (modulo their count).
#[derive(Debug)]
pub struct Bound<S> {
    /// The port all sockets share.
    pub port: u16,
    /// IPv4 sockets (empty if IPv4 is unavailable).
    pub v4: Vec<S>,
    /// IPv6 sockets (empty if IPv6 is unavailable).
    pub v6: Vec<S>,
}

/// Binds the UDP sockets of the listen port.
pub trait UdpBinder: Send + Sync + 'static {
    /// The socket type.
    type Socket: UdpIo;

    /// Binds `count` sockets per family on `port` (0 picks a free one).
    ///
    /// # Errors
    /// `AddrInUse` when another socket holds the port.
    fn bind(&self, port: u16, fwmark: u32, count: usize) -> io::Result<Bound<Self::Socket>>;

    /// Applies a new fwmark to bound sockets.
    ///
    /// # Errors
    /// The setsockopt error.
    fn set_fwmark(&self, bound: &Bound<Self::Socket>, fwmark: u32) -> io::Result<()>;
}

/// Binds real UDP sockets on all addresses.
#[derive(Debug, Clone, Copy, Default)]
pub struct LinuxUdpBinder;

impl UdpBinder for LinuxUdpBinder {
    type Socket = UdpSocketIo;

    fn bind(&self, port: u16, fwmark: u32, count: usize) -> io::Result<Bound<UdpSocketIo>> {
        // Probe with an exclusive socket so a port held by anyone (even another SO_REUSEPORT
        // group) is reported as in use rather than silently shared.
        let probe = UdpSocketIo::bind(false, port, false, 0)?;
        let port = probe.local_port()?;
        let probe6 = UdpSocketIo::bind(true, port, false, 0);
        if let Err(e) = &probe6 {
            if e.kind() == io::ErrorKind::AddrInUse {
                return Err(io::ErrorKind::AddrInUse.into());
            }
        }
        let has_v6 = probe6.is_ok();
        drop((probe, probe6));
        let reuse = count > 1;
        let mut bound = Bound {
            port,
            v4: Vec::new(),
            v6: Vec::new(),
        };
        for _ in 0..count.max(1) {
            bound
                .v4
                .push(UdpSocketIo::bind(false, port, reuse, fwmark)?);
            if has_v6 {
                bound.v6.push(UdpSocketIo::bind(true, port, reuse, fwmark)?);
            }
        }
        Ok(bound)
    }

    fn set_fwmark(&self, bound: &Bound<UdpSocketIo>, fwmark: u32) -> io::Result<()> {
        for socket in bound.v4.iter().chain(&bound.v6) {
            socket.set_fwmark(fwmark)?;
        }
        Ok(())
    }
}

/// State shared by the device's threads.
struct Shared<S> {
    engine: Engine,
    sockets: ArcSwap<Bound<S>>,
    generation: AtomicU64,
    stop: AtomicBool,
    /// Set to make the timer thread run its timers at once rather than at its next tick.
    timers_now: AtomicBool,
    wakers: Vec<EventFd>,
    tun_write_errors: AtomicU64,
    /// Why the TUN link stopped carrying packets, once it has.
    lost: LossLatch,
}

/// A running userspace WireGuard device.
pub struct Device<B: UdpBinder> {
    shared: Arc<Shared<B::Socket>>,
    binder: B,
    /// The workers and the timer thread; emptied by [`Device::stop`].
    threads: Mutex<Vec<JoinHandle<()>>>,
    config_lock: Mutex<()>,
}

impl<B: UdpBinder> std::fmt::Debug for Device<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("engine", &self.shared.engine)
            .field("port", &self.shared.sockets.load().port)
            .finish_non_exhaustive()
    }
}

impl<B: UdpBinder> Device<B> {
    /// Starts one worker per TUN queue plus a timer thread, listening on a random port until
    /// configured otherwise.
    ///
    /// # Errors
    /// Failure to bind the sockets or create the wake-up eventfds.
    pub fn start<T: TunIo>(queues: Vec<T>, binder: B) -> io::Result<Self> {
        Self::start_with_helpers(queues, binder, default_helpers())
    }

    /// [`Device::start`] with `helpers` threads to help the workers through big batches'
    /// crypto (see [`Helpers`]); 0 leaves each batch to its worker alone.
    ///
    /// # Errors
    /// As [`Device::start`], or failure to spawn a helper.
    pub fn start_with_helpers<T: TunIo>(
        queues: Vec<T>,
        binder: B,
        helpers: usize,
    ) -> io::Result<Self> {
        let workers = queues.len().max(1);
        let sockets = binder.bind(0, 0, workers)?;
        let wakers = (0..=workers)
            .map(|_| EventFd::new())
            .collect::<io::Result<Vec<_>>>()?;
        let anchor = (Instant::now(), SystemTime::now());
        let first_index = u32::from_le_bytes(random_bytes());
        let shared = Arc::new(Shared {
            engine: Engine::new(anchor, first_index),
            sockets: ArcSwap::from_pointee(sockets),
            generation: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            timers_now: AtomicBool::new(false),
            wakers,
            tun_write_errors: AtomicU64::new(0),
            lost: LossLatch::new()?,
        });
        let helpers = Arc::new(Helpers::start(helpers)?);
        // Closed until the timer thread has seen idle cores for them.
        helpers.set_open(false);
        shared.engine.use_helpers(Arc::clone(&helpers));
        let mut threads = Vec::with_capacity(workers + 1);
        for (i, tun) in queues.into_iter().enumerate() {
            let shared = Arc::clone(&shared);
            threads.push(
                std::thread::Builder::new()
                    .name(format!("kilotun-worker-{i}"))
                    .spawn(move || worker(&shared, i, &tun))?,
            );
        }
        let timer_shared = Arc::clone(&shared);
        threads.push(
            std::thread::Builder::new()
                .name("kilotun-timers".into())
                .spawn(move || timers(&timer_shared, workers, &helpers))?,
        );
        Ok(Self {
            shared,
            binder,
            threads: Mutex::new(threads),
            config_lock: Mutex::new(()),
        })
    }

    /// The engine, for statistics and configuration reads.
    pub fn engine(&self) -> &Engine {
        &self.shared.engine
    }

    /// The UDP port the device listens on now.
    pub fn listen_port(&self) -> u16 {
        self.shared.sockets.load().port
    }

    /// Decrypted packets the TUN device refused (for example while the link was down).
    pub fn tun_write_errors(&self) -> u64 {
        self.shared.tun_write_errors.load(Ordering::Relaxed)
    }

    /// Why the TUN link stopped carrying packets: `None` while it works. Once set it stays, and
    /// the workers have ended (a deleted link) or given their queue up (one that kept
    /// failing); the rest of the device still answers until [`Device::stop`].
    pub fn link_lost(&self) -> Option<LinkLost> {
        self.shared.lost.get()
    }

    /// A descriptor that polls readable once [`Device::link_lost`] has an answer, and from
    /// then on (for an owner that waits in `poll` beside other descriptors).
    pub fn link_lost_fd(&self) -> std::os::fd::RawFd {
        self.shared.lost.fd()
    }

    /// Waits up to `timeout` (`None`: for ever) for the TUN link to be lost; returns why, or
    /// `None` on timeout.
    pub fn wait_link_lost(&self, timeout: Option<std::time::Duration>) -> Option<LinkLost> {
        let mut fds = [readable(self.link_lost_fd())];
        poll(&mut fds, timeout);
        self.link_lost()
    }

    /// Applies `desired` as a diff (see [`Engine::apply`]), rebinding first if the listen port
    /// changed.
    ///
    /// # Errors
    /// `AddrInUse` (or another bind error) when the new port cannot be bound; nothing changed.
    pub fn set_config(&self, desired: &DeviceConfig) -> io::Result<ApplyReport> {
        let _serial = self.config_lock.lock();
        if self.shared.stop.load(Ordering::Acquire) {
            return Err(io::Error::other("the device is stopped"));
        }
        let current = self.shared.engine.config();
        let workers = self.shared.wakers.len() - 1;
        let new_port = desired.interface.listen_port;
        let rebind = new_port != current.interface.listen_port && new_port != self.listen_port();
        let fwmark = desired.interface.fwmark;
        let new_sockets = if rebind {
            Some(self.binder.bind(new_port, fwmark, workers)?)
        } else {
            if fwmark != current.interface.fwmark {
                self.binder
                    .set_fwmark(&self.shared.sockets.load(), fwmark)?;
            }
            None
        };
        let had_peers = self.shared.engine.has_peers();
        let report = self.shared.engine.apply(desired);
        if !had_peers && self.shared.engine.has_peers() {
            // The timer thread sleeps while there is no peer: the first one needs its timers.
            self.shared.wakers[workers].wake();
        }
        if let Some(sockets) = new_sockets {
            self.shared.sockets.store(Arc::new(sockets));
            self.shared.generation.fetch_add(1, Ordering::Release);
            for waker in &self.shared.wakers {
                waker.wake();
            }
        }
        Ok(report)
    }

    /// Starts handshakes with every peer that has an endpoint and no session yet, at the next
    /// timer tick (see [`Engine::initiate_handshakes`]). Returns how many peers it asked.
    pub fn initiate_handshakes(&self) -> usize {
        let asked = self.shared.engine.initiate_handshakes();
        if asked > 0 {
            // Now rather than at the next tick (up to TIMER_TICK away): the peers are waiting.
            self.shared.timers_now.store(true, Ordering::Release);
            self.shared.wakers[self.shared.wakers.len() - 1].wake();
        }
        asked
    }

    /// Live statistics of every peer, their handshake times read against the wall clock of now
    /// (it may have been set since the device started).
    pub fn peer_stats(&self) -> Vec<PeerStats> {
        self.shared
            .engine
            .peer_stats_at((Instant::now(), SystemTime::now()))
    }

    /// Answers a UAPI `get=1`.
    pub fn uapi_get(&self) -> String {
        let engine = &self.shared.engine;
        uapi::format_get(&engine.config(), self.listen_port(), &self.peer_stats())
    }

    /// Answers a UAPI `set=1` with its body.
    ///
    /// # Errors
    /// [`UapiError`]: `EINVAL` for invalid input, `EADDRINUSE` for a taken port.
    pub fn uapi_set(&self, body: &str) -> Result<(), UapiError> {
        let next = uapi::apply_set(&self.shared.engine.config(), body)?;
        self.set_config(&next).map(|_| ()).map_err(|e| UapiError {
            errno: if e.kind() == io::ErrorKind::AddrInUse {
                uapi::EADDRINUSE
            } else {
                uapi::EIO
            },
            message: format!("binding listen port {}: {e}", next.interface.listen_port),
        })
    }

    /// Stops every thread and closes the TUN queues and sockets.
    pub fn shutdown(self) {
        self.stop();
    }

    /// Stops every thread and closes the TUN queues (each worker owns its own) and the
    /// sockets, even while other holders of this device remain (a UAPI client, an HTTP
    /// handler): when this returns the listen port is free and the TUN link has no queue of
    /// this process. The device still answers reads (`uapi_get`, the engine's statistics);
    /// [`Device::set_config`] fails. Calling it again does nothing.
    pub fn stop(&self) {
        // Under the configuration lock: no rebind can store new sockets after the swap below.
        let _serial = self.config_lock.lock();
        self.shared.stop.store(true, Ordering::Release);
        for waker in &self.shared.wakers {
            waker.wake();
        }
        for thread in self.threads.lock().drain(..) {
            let _ = thread.join();
        }
        let port = self.shared.sockets.load().port;
        self.shared.sockets.store(Arc::new(Bound {
            port,
            v4: Vec::new(),
            v6: Vec::new(),
        }));
    }
}

impl<B: UdpBinder> Drop for Device<B> {
    fn drop(&mut self) {
        self.stop();
    }
}

impl<B: UdpBinder> crate::uapi_server::UapiHandler for Device<B> {
    fn get(&self) -> String {
        self.uapi_get()
    }

    fn set(&self, body: &str) -> Result<(), UapiError> {
        self.uapi_set(body)
    }
}

/// The timer loop: every [`TIMER_TICK`] while the engine has a peer, run the engine's timers and
/// send what they produce; with no peer, sleep until one is added.
fn timers<S: UdpIo>(shared: &Shared<S>, waker_index: usize, helpers: &Helpers) {
    let mut out = Outbox::with_capacity(64, 256);
    let mut idle_cores = IdleCores::default();
    if helpers.count() > 0 && read_cpu_times().is_none() {
        // No /proc/stat to judge by: leave the helpers to the workers' own backoff.
        helpers.set_open(true);
    }
    let waker = &shared.wakers[waker_index];
    let mut next = Instant::now();
    while !shared.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        if now >= next || shared.timers_now.swap(false, Ordering::AcqRel) {
            let gave_up = shared.engine.handle_timers(now, &mut out);
            if let Some(first) = gave_up.first {
                // One line for every peer given up on at this tick, however many.
                tracing::info!(
                    peers = gave_up.peers,
                    first = %first,
                    "gave up handshaking (no answer for 90 s, or no new session for 9 minutes): trying again when traffic or a keepalive asks"
                );
            }
            if !out.to_network.is_empty() {
                let sockets = shared.sockets.load();
                let sockets = [pick(&sockets.v4, 0), pick(&sockets.v6, 0)];
                worker::send(shared, sockets, &out.to_network);
            }
            out.clear();
            next = now + TIMER_TICK;
            if helpers.count() > 0 {
                if let Some(open) =
                    read_cpu_times().and_then(|t| idle_cores.judge(t, helpers.busy()))
                {
                    helpers.set_open(open);
                }
            }
        }
        // With no peer there is nothing to time: sleep until set_config adds one (or shutdown).
        let wait = shared
            .engine
            .has_peers()
            .then(|| next.saturating_duration_since(Instant::now()));
        let mut fds = [readable(waker.fd())];
        if poll(&mut fds, wait) > 0 {
            waker.drain();
        }
    }
}

/// The machine's CPU times from `/proc/stat` (about 20 µs, once a timer tick).
fn read_cpu_times() -> Option<CpuTimes> {
    CpuTimes::parse(&std::fs::read_to_string("/proc/stat").ok()?)
}

fn random_bytes() -> [u8; 4] {
    let mut bytes = [0u8; 4];
    rand_core::RngCore::fill_bytes(&mut rand_core::OsRng, &mut bytes);
    bytes
}
