//! UDP sockets for the listen port: `recvmmsg`/`sendmmsg` batches, `SO_MARK`, large buffers.

use std::io;
use std::mem::MaybeUninit;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

use super::{RecvBatch, SendOutcome, UdpIo};
use crate::outbox::Batch;

/// Socket buffer size asked for (wireguard-go uses the same 7 MiB).
const SOCKET_BUFFER: usize = 7 << 20;
/// Most messages in one `sendmmsg`/`recvmmsg` call.
const MAX_MMSG: usize = 128;

/// A bound, non-blocking UDP socket of one family.
#[derive(Debug)]
pub struct UdpSocketIo {
    socket: UdpSocket,
    ipv6: bool,
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
        Ok(Self {
            socket: socket.into(),
            ipv6,
        })
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
        if received < 0 {
            batch.count = 0;
            return Err(io::Error::last_os_error());
        }
        let received = received as usize;
        for i in 0..received {
            // SAFETY: the kernel initialised the first `received` headers and their names.
            let header = unsafe { headers[i].assume_init_ref() };
            batch.lens[i] = header.msg_len as usize;
            // SAFETY: the kernel filled the name buffer of every received message.
            let name = unsafe { names[i].assume_init_ref() };
            batch.sources[i] =
                socket_addr(name).map_or(SocketAddr::from(([0, 0, 0, 0], 0)), normalise);
        }
        batch.count = received;
        Ok(received)
    }

    fn send_batch(&self, batch: &Batch) -> io::Result<SendOutcome> {
        // Everything on the stack: no allocation per batch or per packet.
        // SAFETY: an all-zero sockaddr_in6 is a valid value; it is overwritten before use.
        let mut names: [libc::sockaddr_in6; MAX_MMSG] = [unsafe { std::mem::zeroed() }; MAX_MMSG];
        let mut name_lens = [0 as libc::socklen_t; MAX_MMSG];
        let mut iovecs = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; MAX_MMSG];
        let mut outcome = SendOutcome::default();
        let mut n = 0;
        for (destination, packet) in batch.iter() {
            let Some(destination) = destination.and_then(|d| self.convert(d)) else {
                continue;
            };
            let name = SockAddr::from(destination);
            // SAFETY: a socket address of either family is at most sizeof(sockaddr_in6) bytes,
            // copied from socket2's storage into our slot.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    name.as_ptr().cast::<u8>(),
                    (&mut names[n] as *mut libc::sockaddr_in6).cast::<u8>(),
                    name.len() as usize,
                );
            }
            name_lens[n] = name.len();
            iovecs[n] = libc::iovec {
                iov_base: packet.as_ptr() as *mut libc::c_void,
                iov_len: packet.len(),
            };
            n += 1;
            if n == MAX_MMSG {
                self.sendmmsg(&mut names, &name_lens, &mut iovecs, n, &mut outcome);
                n = 0;
            }
        }
        if n > 0 {
            self.sendmmsg(&mut names, &name_lens, &mut iovecs, n, &mut outcome);
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

    /// Sends the first `n` prepared messages with `sendmmsg`, retrying after partial sends and
    /// skipping datagrams the kernel refuses.
    fn sendmmsg(
        &self,
        names: &mut [libc::sockaddr_in6; MAX_MMSG],
        name_lens: &[libc::socklen_t; MAX_MMSG],
        iovecs: &mut [libc::iovec; MAX_MMSG],
        n: usize,
        outcome: &mut SendOutcome,
    ) {
        // SAFETY: an all-zero mmsghdr is a valid value; the pointers set below outlive the call.
        let mut headers: [libc::mmsghdr; MAX_MMSG] = [unsafe { std::mem::zeroed() }; MAX_MMSG];
        for i in 0..n {
            let header = &mut headers[i].msg_hdr;
            header.msg_name = (&mut names[i] as *mut libc::sockaddr_in6).cast();
            header.msg_namelen = name_lens[i];
            header.msg_iov = &mut iovecs[i];
            header.msg_iovlen = 1;
        }
        let mut start = 0usize;
        while start < n {
            // SAFETY: headers[start..n] are initialised and reference live names and buffers.
            let sent = unsafe {
                libc::sendmmsg(
                    self.socket.as_raw_fd(),
                    headers[start..n].as_mut_ptr(),
                    (n - start) as u32,
                    0,
                )
            };
            if sent > 0 {
                outcome.sent += sent as usize;
                start += sent as usize;
            } else {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // The first datagram was refused (no route, unreachable, buffer full): drop it
                // and go on with the rest.
                outcome.failed += 1;
                start += 1;
            }
        }
    }
}

/// Raises a socket buffer past `net.core.*mem_max` (needs CAP_NET_ADMIN; best effort).
fn force_buffer(socket: &Socket, option: libc::c_int) {
    let size = SOCKET_BUFFER as libc::c_int;
    // SAFETY: passes a live c_int of the right size to setsockopt on our own socket.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
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
mod tests {
    use super::*;
    use crate::outbox::Outbox;

    #[test]
    fn loopback_batch_round_trip() {
        let a = UdpSocketIo::bind(false, 0, false, 0).unwrap();
        let b = UdpSocketIo::bind(false, 0, false, 0).unwrap();
        let to_b = SocketAddr::from(([127, 0, 0, 1], b.local_port().unwrap()));
        let mut out = Outbox::default();
        for i in 0..10u8 {
            out.to_network.push_copy(Some(to_b), &[i; 100]);
        }
        // A datagram of the other family is skipped, not an error.
        out.to_network
            .push_copy(Some("[::1]:9".parse().unwrap()), b"skipped");
        let outcome = a.send_batch(&out.to_network).unwrap();
        assert_eq!(
            outcome,
            SendOutcome {
                sent: 10,
                failed: 0
            }
        );
        let mut batch = RecvBatch::new(32, 2048);
        let mut got = Vec::new();
        for _ in 0..100 {
            match b.recv_batch(&mut batch) {
                Ok(_) => got.extend(batch.iter().map(|(src, p)| (src, p.to_vec()))),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if got.len() == 10 {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(got.len(), 10);
        assert_eq!(got[3].1, vec![3u8; 100]);
        assert_eq!(got[0].0.port(), a.local_port().unwrap());
    }
}
