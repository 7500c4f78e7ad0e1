//! In-memory twins of the TUN device and the UDP network, with eventfd readiness so the real
//! runtime can poll them.
//!
//! A [`MemTun`] has two queues: packets the "kernel" injects (read by the device) and packets
//! the device writes (collected for the test). A [`MemNet`] is a switch of UDP endpoints keyed by
//! address; datagrams can be dropped by a filter to simulate loss or a partition.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{RecvBatch, SendOutcome, TunIo, UdpIo};
use crate::outbox::Batch;

/// A queue of packets whose readiness is an eventfd.
#[derive(Debug)]
struct Queue<T> {
    items: Mutex<VecDeque<T>>,
    arrived: Condvar,
    ready: OwnedFd,
}

impl<T> Queue<T> {
    fn new() -> Self {
        // SAFETY: eventfd returns a new descriptor or -1, checked below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        assert!(fd >= 0, "eventfd: {}", io::Error::last_os_error());
        Self {
            items: Mutex::new(VecDeque::new()),
            arrived: Condvar::new(),
            // SAFETY: `fd` is a fresh descriptor we own.
            ready: unsafe { OwnedFd::from_raw_fd(fd) },
        }
    }

    fn push(&self, item: T) {
        self.items.lock().push_back(item);
        self.poke();
        self.arrived.notify_all();
    }

    /// Makes the queue poll readable (with or without an item).
    fn poke(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(self.ready.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn pop(&self) -> Option<T> {
        let mut items = self.items.lock();
        let item = items.pop_front();
        if items.is_empty() {
            let mut drain: u64 = 0;
            // SAFETY: reading 8 bytes into a live u64 from our non-blocking eventfd.
            unsafe { libc::read(self.ready.as_raw_fd(), (&mut drain as *mut u64).cast(), 8) };
        }
        item
    }

    fn wait_pop(&self, timeout: Duration) -> Option<T> {
        let deadline = Instant::now() + timeout;
        let mut items = self.items.lock();
        while items.is_empty() {
            if self.arrived.wait_until(&mut items, deadline).timed_out() {
                break;
            }
        }
        items.pop_front()
    }
}

/// An in-memory TUN device.
#[derive(Debug, Clone)]
pub struct MemTun {
    inbound: Arc<Queue<Vec<u8>>>,
    outbound: Arc<Queue<Vec<u8>>>,
    /// `Some(errno)` while reads fail: `EBADFD` once [`MemTun::delete`]d.
    read_error: Arc<Mutex<Option<i32>>>,
}

impl Default for MemTun {
    fn default() -> Self {
        Self::new()
    }
}

impl MemTun {
    /// An empty device.
    pub fn new() -> Self {
        Self {
            inbound: Arc::new(Queue::new()),
            outbound: Arc::new(Queue::new()),
            read_error: Arc::new(Mutex::new(None)),
        }
    }

    /// Deletes the link under the device, as `ip link del` does: reads fail with `EBADFD` and
    /// [`TunIo::is_attached`] answers false from now on.
    pub fn delete(&self) {
        *self.read_error.lock() = Some(libc::EBADFD);
        self.inbound.poke();
    }

    /// Makes every read fail with `errno` (`None`: read again) while the link stays attached.
    pub fn fail_reads(&self, errno: Option<i32>) {
        *self.read_error.lock() = errno;
        self.inbound.poke();
    }

    /// Injects a packet as if an application sent it into the tunnel.
    pub fn inject(&self, packet: Vec<u8>) {
        self.inbound.push(packet);
    }

    /// Waits up to `timeout` for a packet the device wrote (a decrypted packet).
    pub fn written(&self, timeout: Duration) -> Option<Vec<u8>> {
        self.outbound.wait_pop(timeout)
    }
}

impl TunIo for MemTun {
    fn recv(&self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(errno) = *self.read_error.lock() {
            return Err(io::Error::from_raw_os_error(errno));
        }
        let packet = self.inbound.pop().ok_or(io::ErrorKind::WouldBlock)?;
        let n = packet.len().min(buf.len());
        buf[..n].copy_from_slice(&packet[..n]);
        Ok(n)
    }

    fn send(&self, packet: &[u8]) -> io::Result<()> {
        self.outbound.push(packet.to_vec());
        Ok(())
    }

    fn readiness_fd(&self) -> RawFd {
        self.inbound.ready.as_raw_fd()
    }

    fn is_attached(&self) -> io::Result<bool> {
        Ok(*self.read_error.lock() != Some(libc::EBADFD))
    }
}

/// A datagram in flight: its source and bytes.
type Datagram = (SocketAddr, Vec<u8>);

type Filter = Box<dyn Fn(SocketAddr, SocketAddr, &[u8]) -> bool + Send + Sync>;

/// An in-memory UDP network: a switch between [`MemUdp`] endpoints.
#[derive(Clone, Default)]
pub struct MemNet {
    inner: Arc<NetInner>,
}

#[derive(Default)]
struct NetInner {
    endpoints: Mutex<HashMap<SocketAddr, Arc<Queue<Datagram>>>>,
    filter: Mutex<Option<Filter>>,
}

impl std::fmt::Debug for MemNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemNet").finish_non_exhaustive()
    }
}

impl MemNet {
    /// An empty network.
    pub fn new() -> Self {
        Self::default()
    }

    /// Attaches an endpoint at `addr`.
    pub fn bind(&self, addr: SocketAddr) -> MemUdp {
        let queue = Arc::new(Queue::new());
        self.inner.endpoints.lock().insert(addr, Arc::clone(&queue));
        MemUdp {
            net: self.clone(),
            addr,
            queue,
        }
    }

    /// Delivers only datagrams for which `filter(from, to, bytes)` is true.
    pub fn set_filter(
        &self,
        filter: impl Fn(SocketAddr, SocketAddr, &[u8]) -> bool + Send + Sync + 'static,
    ) {
        *self.inner.filter.lock() = Some(Box::new(filter));
    }

    /// Delivers everything again.
    pub fn clear_filter(&self) {
        *self.inner.filter.lock() = None;
    }

    fn deliver(&self, from: SocketAddr, to: SocketAddr, bytes: &[u8]) -> bool {
        if let Some(filter) = self.inner.filter.lock().as_ref() {
            if !filter(from, to, bytes) {
                return true;
            }
        }
        let queue = self.inner.endpoints.lock().get(&to).cloned();
        match queue {
            Some(q) => {
                q.push((from, bytes.to_vec()));
                true
            }
            None => false,
        }
    }
}

/// One endpoint of a [`MemNet`].
#[derive(Clone)]
pub struct MemUdp {
    net: MemNet,
    addr: SocketAddr,
    queue: Arc<Queue<Datagram>>,
}

impl std::fmt::Debug for MemUdp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemUdp").field("addr", &self.addr).finish()
    }
}

impl MemUdp {
    /// This endpoint's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl UdpIo for MemUdp {
    fn recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        batch.clear();
        let mut n = 0;
        while n < batch.capacity() {
            let Some((from, bytes)) = self.queue.pop() else {
                break;
            };
            let slot = batch.slot_mut(n);
            let len = bytes.len().min(slot.len());
            slot[..len].copy_from_slice(&bytes[..len]);
            batch.push_received(n, len, 0, from.into());
            n += 1;
        }
        if n == 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    }

    fn send_batch(&self, batch: &Batch) -> io::Result<SendOutcome> {
        let mut outcome = SendOutcome::default();
        for (to, bytes) in batch.iter() {
            let Some(to) = to else { continue };
            if to.is_ipv6() != self.addr.is_ipv6() {
                continue;
            }
            if self.net.deliver(self.addr, to, bytes) {
                outcome.sent += 1;
            } else {
                outcome.failed += 1;
            }
        }
        Ok(outcome)
    }

    fn readiness_fd(&self) -> RawFd {
        self.queue.ready.as_raw_fd()
    }
}

/// Binds [`MemUdp`] endpoints on one IP of a [`MemNet`]; port 0 picks the next free port from
/// 40000. Several "sockets" of one family share a port by sharing the endpoint.
#[derive(Debug, Clone)]
pub struct MemBinder {
    net: MemNet,
    ip: std::net::IpAddr,
    next_port: Arc<std::sync::atomic::AtomicU16>,
}

impl MemBinder {
    /// A binder for the host at `ip` on `net`.
    pub fn new(net: &MemNet, ip: std::net::IpAddr) -> Self {
        Self {
            net: net.clone(),
            ip,
            next_port: Arc::new(std::sync::atomic::AtomicU16::new(40000)),
        }
    }
}

impl crate::device::UdpBinder for MemBinder {
    type Socket = MemUdp;

    fn bind(
        &self,
        port: u16,
        _fwmark: u32,
        count: usize,
    ) -> io::Result<crate::device::Bound<MemUdp>> {
        let port = if port == 0 {
            self.next_port
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        } else {
            port
        };
        let addr = SocketAddr::new(self.ip, port);
        if self.net.inner.endpoints.lock().contains_key(&addr) {
            return Err(io::ErrorKind::AddrInUse.into());
        }
        let endpoint = self.net.bind(addr);
        let sockets = vec![endpoint; count.max(1)];
        let (v4, v6) = if self.ip.is_ipv4() {
            (sockets, Vec::new())
        } else {
            (Vec::new(), sockets)
        };
        Ok(crate::device::Bound { port, v4, v6 })
    }

    fn set_fwmark(&self, _bound: &crate::device::Bound<MemUdp>, _fwmark: u32) -> io::Result<()> {
        Ok(())
    }
}
