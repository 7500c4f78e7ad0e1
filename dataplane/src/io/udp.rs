//! UDP sockets for the listen port: `recvmmsg`/`sendmmsg` batches, `SO_MARK`, large buffers,
//! and segmentation offload both ways where the kernel has it:
//!
//! - send (UDP GSO): consecutive datagrams to one destination of one size (the last may be
//!   shorter) go out as one message with `UDP_SEGMENT`, so the stack handles the run once and
//!   splits it at the end (or in the NIC). If the kernel refuses such a message (`EIO` from a
//!   device without checksum offload, say), GSO is switched off for the socket.
//! - receive (UDP GRO): with `UDP_GRO` on, one receive may return a run of datagrams from one
//!   sender; the `UDP_GRO` control message gives their size and [`RecvBatch`] splits them.
//!
//! And sticky source addresses: with `IP_PKTINFO` / `IPV6_RECVPKTINFO` on, each received
//! datagram comes with the local address it was sent to, and a datagram whose
//! [`Endpoint`](crate::endpoint::Endpoint) names a local address goes out from it (an
//! `IP_PKTINFO` / `IPV6_PKTINFO` control message). A GSO message never mixes sources. A
//! source the kernel refuses (it left the host) is dropped from the rest of the batch, the
//! datagrams go out without it, and [`SendOutcome::refused_source`] names it.

use std::io;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::{RecvBatch, SendOutcome, UdpIo};
mod cmsg;
mod refusal;
mod send_run;
use crate::endpoint::Endpoint;
use crate::outbox::Batch;
use cmsg::{Control, UDP_GRO, UDP_SEGMENT};
use refusal::{gso_unsupported, segmentation_refused, source_refused};
use send_run::SendRun;

/// Socket buffer size asked for (wireguard-go uses the same 7 MiB).
const SOCKET_BUFFER: usize = 7 << 20;
/// Most messages in one `sendmmsg`/`recvmmsg` call.
const MAX_MMSG: usize = 128;
/// Most segments the kernel accepts in one GSO message (`UDP_MAX_SEGMENTS`).
const MAX_SEGMENTS: usize = 64;
/// Most payload bytes put in one GSO message (below the 65,507 an IPv4 datagram can carry).
const MAX_GSO_BYTES: usize = 64_000;

/// A bound, non-blocking UDP socket of one family.
#[derive(Debug)]
pub struct UdpSocketIo {
    socket: UdpSocket,
    ipv6: bool,
    /// Whether sends may use `UDP_SEGMENT`; cleared when the kernel or the device cannot
    /// segment (see `refusal::gso_unsupported`).
    gso: AtomicBool,
    /// The send scratch, reused by every [`UdpIo::send_batch`]: building it afresh (some
    /// 30 KiB of names, iovecs and headers) cost more than the sends of a small batch. Each
    /// socket serves one worker (the timer thread sends on the first now and then), so the
    /// lock is all but never contended.
    scratch: Mutex<Box<SendRun>>,
}

impl UdpSocketIo {
    /// Binds `port` on all addresses of one family. With `reuse_port`, several sockets may
    /// share the port so the kernel spreads peers across them by flow hash.
    ///
    /// # Errors
    /// The bind error (`AddrInUse` when the port is taken, `AddrNotAvailable` without IPv6).
    pub fn bind(ipv6: bool, port: u16, reuse_port: bool, fwmark: u32) -> io::Result<Self> {
        let (domain, addr) = if ipv6 {
            (
                Domain::IPV6,
                SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)),
            )
        } else {
            (
                Domain::IPV4,
                SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
            )
        };
        let socket = Socket::new(domain, Type::DGRAM.cloexec(), Some(Protocol::UDP))?;
        if ipv6 {
            socket.set_only_v6(true)?;
        }
        if reuse_port {
            socket.set_reuse_port(true)?;
        }
        if socket.set_recv_buffer_size(SOCKET_BUFFER).is_err()
            || socket.recv_buffer_size().unwrap_or(0) < SOCKET_BUFFER
        {
            force_buffer(&socket, libc::SO_RCVBUFFORCE);
        }
        if socket.set_send_buffer_size(SOCKET_BUFFER).is_err()
            || socket.send_buffer_size().unwrap_or(0) < SOCKET_BUFFER
        {
            force_buffer(&socket, libc::SO_SNDBUFFORCE);
        }
        if fwmark != 0 {
            socket.set_mark(fwmark)?;
        }
        socket.bind(&SockAddr::from(addr))?;
        socket.set_nonblocking(true)?;
        // Both offloads are best effort: without them the socket moves one datagram per
        // message, as before.
        let gso = getsockopt_int(&socket, libc::SOL_UDP, UDP_SEGMENT).is_ok();
        setsockopt_int(&socket, libc::SOL_UDP, UDP_GRO, 1);
        // Best effort too: without it no local address is learnt, and the kernel picks every
        // source.
        if ipv6 {
            setsockopt_int(&socket, libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO, 1);
        } else {
            setsockopt_int(&socket, libc::IPPROTO_IP, libc::IP_PKTINFO, 1);
        }
        Ok(Self {
            socket: socket.into(),
            ipv6,
            gso: AtomicBool::new(gso),
            scratch: Mutex::new(Box::new(SendRun::new())),
        })
    }

    /// Whether sends still use UDP segmentation offload.
    pub fn uses_gso(&self) -> bool {
        self.gso.load(Ordering::Relaxed)
    }

    /// Turns UDP segmentation offload off (for tests and for kernels that refuse it).
    pub fn disable_gso(&self) {
        self.gso.store(false, Ordering::Relaxed);
    }

    /// The port this socket is bound to.
    pub fn local_port(&self) -> io::Result<u16> {
        Ok(self.socket.local_addr()?.port())
    }

    /// Sets `SO_MARK` (0 clears it).
    ///
    /// # Errors
    /// The setsockopt error.
    pub fn set_fwmark(&self, fwmark: u32) -> io::Result<()> {
        socket2::SockRef::from(&self.socket).set_mark(fwmark)
    }
}

impl UdpIo for UdpSocketIo {
    fn recv_batch(&self, batch: &mut RecvBatch) -> io::Result<usize> {
        let n = batch.capacity().min(MAX_MMSG);
        let slot_size = batch.slot_size;
        let mut iovecs: [MaybeUninit<libc::iovec>; MAX_MMSG] = [MaybeUninit::uninit(); MAX_MMSG];
        let mut names: [MaybeUninit<libc::sockaddr_storage>; MAX_MMSG] =
            [MaybeUninit::uninit(); MAX_MMSG];
        let mut headers: [MaybeUninit<libc::mmsghdr>; MAX_MMSG] = [MaybeUninit::uninit(); MAX_MMSG];
        // Only the `n` slots in use are initialised (zeroing all of them cost more than a
        // small receive).
        let mut controls: [MaybeUninit<Control>; MAX_MMSG] = [MaybeUninit::uninit(); MAX_MMSG];
        let base = batch.buffer.as_mut_ptr();
        for i in 0..n {
            // SAFETY: slot i lies within `batch.buffer`, whose length is capacity * slot_size.
            let iov = libc::iovec {
                iov_base: unsafe { base.add(i * slot_size) }.cast(),
                iov_len: slot_size,
            };
            iovecs[i].write(iov);
            // SAFETY: a zeroed mmsghdr is a valid value; pointers are filled in below.
            let mut header: libc::mmsghdr = unsafe { std::mem::zeroed() };
            header.msg_hdr.msg_name = names[i].as_mut_ptr().cast();
            header.msg_hdr.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as u32;
            header.msg_hdr.msg_iov = iovecs[i].as_mut_ptr();
            header.msg_hdr.msg_iovlen = 1;
            // Zeroed, so that the padding the kernel skips between messages is initialised.
            header.msg_hdr.msg_control = (controls[i].write(Control::ZERO) as *mut Control).cast();
            header.msg_hdr.msg_controllen = std::mem::size_of::<Control>() as _;
            headers[i].write(header);
        }
        // SAFETY: `headers[..n]` are initialised and point at live iovecs, names and buffer
        // slots that outlive the call.
        let received = unsafe {
            libc::recvmmsg(
                self.socket.as_raw_fd(),
                headers.as_mut_ptr().cast(),
                n as u32,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
            )
        };
        batch.clear();
        if received < 0 {
            return Err(io::Error::last_os_error());
        }
        let received = received as usize;
        for i in 0..received {
            // SAFETY: the kernel initialised the first `received` headers and their names.
            let header = unsafe { headers[i].assume_init_ref() };
            // SAFETY: the kernel filled the name buffer of every received message.
            let name = unsafe { names[i].assume_init_ref() };
            let source = socket_addr(name).map_or(SocketAddr::from(([0, 0, 0, 0], 0)), normalise);
            // SAFETY: slot i's control buffer was zeroed above, and the kernel wrote at most
            // its size.
            let control = unsafe { &controls[i].assume_init_ref().0 };
            // A size_t with glibc, a socklen_t with musl.
            #[allow(clippy::unnecessary_cast)]
            let used = (header.msg_hdr.msg_controllen as usize).min(control.len());
            let received = cmsg::parse(&control[..used]);
            let local = received
                .local
                .filter(|l| l.ip.is_ipv6() == source.is_ipv6());
            batch.push_received(
                i,
                header.msg_len as usize,
                received.segment,
                Endpoint::new(source, local),
            );
        }
        Ok(batch.len())
    }

    fn send_batch(&self, batch: &Batch) -> io::Result<SendOutcome> {
        // The scratch is reused: no allocation or initialisation per batch or per packet.
        let mut scratch = self.scratch.lock();
        let run = &mut **scratch;
        run.clear();
        let mut outcome = SendOutcome::default();
        let gso = self.uses_gso();
        for (endpoint, packet) in batch.iter_endpoints() {
            let Some(endpoint) = endpoint else { continue };
            let Some(destination) = self.convert(endpoint.peer) else {
                continue;
            };
            // A source of the other family cannot be; a refused one is not asked for again.
            let source = endpoint.local.filter(|l| {
                l.ip.is_ipv6() == destination.is_ipv6() && outcome.refused_source != Some(l.ip)
            });
            if run.is_full() {
                self.send_run(run, &mut outcome);
            }
            run.push(destination, source, packet, gso);
        }
        if !run.is_empty() {
            self.send_run(run, &mut outcome);
        }
        Ok(outcome)
    }

    fn readiness_fd(&self) -> RawFd {
        self.socket.as_raw_fd()
    }
}

impl UdpSocketIo {
    /// `destination` in this socket's family, or `None` if it cannot be reached from it.
    fn convert(&self, destination: SocketAddr) -> Option<SocketAddr> {
        match (self.ipv6, destination) {
            (false, SocketAddr::V4(_)) | (true, SocketAddr::V6(_)) => Some(destination),
            _ => None,
        }
    }

    /// Sends the messages of `run` with `sendmmsg`, retrying after partial sends and
    /// skipping messages the kernel refuses; then empties `run`.
    fn send_run(&self, run: &mut SendRun, outcome: &mut SendOutcome) {
        let messages = run.messages;
        for m in 0..messages {
            run.prepare(m);
        }
        let mut start = 0usize;
        while start < messages {
            // SAFETY: headers[start..messages] are initialised and reference live names,
            // iovecs, control buffers and packet bytes.
            let sent = unsafe {
                libc::sendmmsg(
                    self.socket.as_raw_fd(),
                    run.headers[start..messages].as_mut_ptr(),
                    (messages - start) as u32,
                    0,
                )
            };
            if sent > 0 {
                for m in start..start + sent as usize {
                    outcome.sent += run.message[m].iovecs;
                }
                start += sent as usize;
                continue;
            }
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            if let Some(source) = run.sources[start].filter(|_| source_refused(&error)) {
                // The source address left the host (or its interface did): this message and
                // every later one from it go out without it, the kernel choosing the source.
                outcome.refused_source.get_or_insert(source.ip);
                run.forget_source(source.ip, start);
                continue;
            }
            let refused = run.message[start];
            if refused.iovecs > 1 && segmentation_refused(&error) {
                if gso_unsupported(&error) && self.gso.swap(false, Ordering::Relaxed) {
                    tracing::warn!(error = %error, "the kernel refused a segmented UDP send; sending one datagram per message from now on");
                }
                // Segmentation was the trouble, not the destination: the datagrams go out one
                // by one (the kernel fragments those above a smaller path MTU, as it would
                // without GSO).
                self.send_one_by_one(run, start, outcome);
            } else {
                // The message was refused (no route, unreachable, buffer full): drop its
                // datagrams, as a lossy network would, and go on with the rest.
                outcome.failed += refused.iovecs;
            }
            start += 1;
        }
        run.clear();
    }
}

impl UdpSocketIo {
    /// Sends the datagrams of message `m` of `run` one `sendmsg` each, unsegmented.
    fn send_one_by_one(&self, run: &mut SendRun, m: usize, outcome: &mut SendOutcome) {
        let message = run.message[m];
        let name = (&mut run.names[m] as *mut libc::sockaddr_in6).cast::<libc::c_void>();
        let name_len = run.name_lens[m];
        let mut control = Control::ZERO;
        let control_len = run.sources[m]
            .and_then(|source| cmsg::put_source(&mut control.0, 0, &source))
            .unwrap_or(0);
        for iovec in &mut run.iovecs[message.first_iovec..message.first_iovec + message.iovecs] {
            // SAFETY: a zeroed msghdr is valid (no name, no iovecs, no control).
            let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
            header.msg_name = name;
            header.msg_namelen = name_len;
            header.msg_iov = iovec;
            header.msg_iovlen = 1;
            if control_len > 0 {
                header.msg_control = (&mut control as *mut Control).cast();
                header.msg_controllen = control_len as _;
            }
            // SAFETY: the header names the run's address slot, one iovec and the control
            // buffer, all live for the call.
            let sent = unsafe { libc::sendmsg(self.socket.as_raw_fd(), &header, 0) };
            if sent < 0 {
                outcome.failed += 1;
            } else {
                outcome.sent += 1;
            }
        }
    }
}

/// Sets an int socket option, best effort.
fn setsockopt_int(socket: &Socket, level: libc::c_int, option: libc::c_int, value: libc::c_int) {
    // SAFETY: passes a live c_int of the right size to setsockopt on our own socket.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            option,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
}

fn getsockopt_int(
    socket: &Socket,
    level: libc::c_int,
    option: libc::c_int,
) -> io::Result<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into the live c_int.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            level,
            option,
            (&mut value as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(value)
}

/// Raises a socket buffer past `net.core.*mem_max` (needs CAP_NET_ADMIN; best effort).
fn force_buffer(socket: &Socket, option: libc::c_int) {
    setsockopt_int(
        socket,
        libc::SOL_SOCKET,
        option,
        SOCKET_BUFFER as libc::c_int,
    );
}

/// Reads an IPv4 or IPv6 socket address out of a `sockaddr_storage`.
fn socket_addr(storage: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match libc::c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says this storage holds a sockaddr_in, which it is large
            // and aligned enough for.
            let v4 =
                unsafe { &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(u32::from_be(v4.sin_addr.s_addr));
            Some(SocketAddr::from((ip, u16::from_be(v4.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for sockaddr_in6.
            let v6 = unsafe {
                &*(storage as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            let ip = Ipv6Addr::from(v6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(std::net::SocketAddrV6::new(
                ip,
                u16::from_be(v6.sin6_port),
                v6.sin6_flowinfo,
                v6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// Maps IPv4-mapped IPv6 sources back to IPv4, so endpoints print as `wg` expects.
fn normalise(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::from((v4, v6.port())),
            None => addr,
        },
        SocketAddr::V4(_) => addr,
    }
}

#[cfg(test)]
mod tests;
