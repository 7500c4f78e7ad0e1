//! A lean UDP load generator and sink for `bench/throughput.sh`: it sends and receives with
//! `sendmmsg`/`recvmmsg` in batches of 64, so that on a small machine the generator, not the
//! tunnel, stops being the limit (iperf3 moves one datagram per syscall and, on the 2-core
//! machine of the benchmarks, sends at most about 1.5 Gbit/s of 1300-byte datagrams even with
//! no tunnel in the way).
//!
//! ```text
//! udp-load send [--gso] ADDRESS:PORT MBIT_PER_S SECONDS [DATAGRAM_BYTES]
//!                                              prints "sent DATAGRAMS BYTES SYSCALLS"
//! udp-load recv [--gro] PORT SECONDS           prints "received DATAGRAMS BYTES SYSCALLS"
//! ```
//!
//! (SYSCALLS: the sends made, and the receives that returned data.)
//!
//! The sender paces itself every millisecond to the offered rate (a blocking socket: when the
//! path cannot take more it waits, so what it sent is what it could offer). The receiver stops
//! one second after the last datagram, or `SECONDS` + 5 after it started.
//!
//! `--gso` and `--gro` send and receive the way QUIC stacks do on Linux: the sender hands the
//! kernel up to 64 KiB of equal datagrams per call (`UDP_SEGMENT`), the receiver takes runs of
//! them coalesced into one buffer (`UDP_GRO`) and counts the datagrams by the segment size the
//! kernel reports. The datagrams on the wire are the same; what changes is the applications' own
//! cost per datagram, and that a tunnel whose device has UDP segmentation offload can read and
//! write such runs whole.

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const BATCH: usize = 64;
const RECV_SLOT: usize = 2048;
/// Bytes a `--gso` send hands the kernel at most (an IP datagram's limit, less headers).
const GSO_BYTES: usize = 65_000;
/// Receive buffers of a `--gro` sink: a coalesced run is at most 64 KiB.
const GRO_SLOT: usize = 65_536;
const GRO_BATCH: usize = 8;

fn main() -> Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let gso = take_flag(&mut args, "--gso");
    let gro = take_flag(&mut args, "--gro");
    match args.first().map(String::as_str) {
        Some("send") if args.len() >= 4 => {
            let to: SocketAddr = args[1].parse().context("ADDRESS:PORT")?;
            let mbit: f64 = args[2].parse().context("MBIT_PER_S")?;
            let secs: f64 = args[3].parse().context("SECONDS")?;
            let size: usize = match args.get(4) {
                Some(s) => s.parse().context("DATAGRAM_BYTES")?,
                None => 1300,
            };
            if !(8..=65507).contains(&size) {
                bail!("DATAGRAM_BYTES must be 8 to 65507, not {size}");
            }
            let (count, bytes, calls) = send(to, mbit, Duration::from_secs_f64(secs), size, gso)?;
            println!("sent {count} {bytes} {calls}");
        }
        Some("recv") if args.len() >= 3 => {
            let port: u16 = args[1].parse().context("PORT")?;
            let secs: f64 = args[2].parse().context("SECONDS")?;
            let (count, bytes, calls) = recv(port, Duration::from_secs_f64(secs), gro)?;
            println!("received {count} {bytes} {calls}");
        }
        _ => bail!(
            "usage: udp-load send [--gso] ADDRESS:PORT MBIT_PER_S SECONDS [DATAGRAM_BYTES] | udp-load recv [--gro] PORT SECONDS"
        ),
    }
    Ok(())
}

/// Removes `flag` from `args`, saying whether it was there.
fn take_flag(args: &mut Vec<String>, flag: &str) -> bool {
    let before = args.len();
    args.retain(|a| a != flag);
    args.len() != before
}

/// Sets an integer socket option at the UDP level.
fn set_udp_option(fd: libc::c_int, option: libc::c_int, value: libc::c_int) -> Result<()> {
    // SAFETY: `value` is a live c_int and its size is passed with it.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_UDP,
            option,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error()).context("setsockopt(IPPROTO_UDP)");
    }
    Ok(())
}

fn send(
    to: SocketAddr,
    mbit: f64,
    duration: Duration,
    size: usize,
    gso: bool,
) -> Result<(u64, u64, u64)> {
    let bind: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let socket = UdpSocket::bind(bind)?;
    socket.connect(to)?;
    // With `--gso`, one send carries up to this many datagrams; without, one sendmmsg does.
    let per_call = if gso {
        set_udp_option(socket.as_raw_fd(), libc::UDP_SEGMENT, size as libc::c_int)
            .context("UDP_SEGMENT (--gso)")?;
        (GSO_BYTES / size).clamp(1, BATCH)
    } else {
        BATCH
    };
    // One buffer of `per_call` datagrams: sent whole with `--gso`, one iovec per datagram
    // with sendmmsg.
    let mut run = vec![0u8; size * per_call];
    let mut iovecs: Vec<libc::iovec> = run
        .chunks_mut(size)
        .map(|datagram| libc::iovec {
            iov_base: datagram.as_mut_ptr().cast(),
            iov_len: size,
        })
        .collect();
    let mut headers = one_iovec_each(&mut iovecs);
    let per_second = mbit * 1e6 / 8.0 / size as f64;
    let start = Instant::now();
    let (mut sent, mut bytes, mut calls) = (0u64, 0u64, 0u64);
    loop {
        let elapsed = start.elapsed();
        if elapsed >= duration {
            break;
        }
        let due = (per_second * elapsed.as_secs_f64()) as u64;
        // A `--gso` sender waits for a whole run to be due (runs are what it is for); the
        // other sends whatever is due.
        let least = if gso { per_call as u64 } else { 1 };
        if sent + least > due {
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        let n = ((due - sent) as usize).min(per_call);
        let datagrams = if gso {
            // One run of `n` equal datagrams; the kernel cuts it at `size` (UDP_SEGMENT).
            socket.send(&run[..n * size]).map(|b| b / size)
        } else {
            // SAFETY: `headers` holds `per_call` headers pointing, through `iovecs`, at `run`,
            // all alive until the function returns; the first `n` (at most `per_call`) are sent.
            let rc =
                unsafe { libc::sendmmsg(socket.as_raw_fd(), headers.as_mut_ptr(), n as u32, 0) };
            if rc < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(rc as usize)
            }
        };
        calls += 1;
        match datagrams {
            Ok(count) => {
                sent += count as u64;
                bytes += (count * size) as u64;
            }
            Err(error) if error.raw_os_error() == Some(libc::ECONNREFUSED) => {}
            Err(error) => return Err(error).context("send"),
        }
    }
    Ok((sent, bytes, calls))
}

fn recv(port: u16, duration: Duration, gro: bool) -> Result<(u64, u64, u64)> {
    let socket = socket2::Socket::new(
        socket2::Domain::IPV6,
        socket2::Type::DGRAM,
        Some(socket2::Protocol::UDP),
    )?;
    socket.set_only_v6(false)?;
    socket.set_recv_buffer_size(4 << 20)?;
    let addr: SocketAddr = format!("[::]:{port}").parse()?;
    socket.bind(&addr.into())?;
    socket.set_read_timeout(Some(Duration::from_millis(100)))?;
    if gro {
        set_udp_option(socket.as_raw_fd(), libc::UDP_GRO, 1).context("UDP_GRO (--gro)")?;
    }
    let (slot, batch) = if gro {
        (GRO_SLOT, GRO_BATCH)
    } else {
        (RECV_SLOT, BATCH)
    };
    let mut buffer = vec![0u8; slot * batch];
    let mut iovecs: Vec<libc::iovec> = buffer
        .chunks_mut(slot)
        .map(|slot| libc::iovec {
            iov_base: slot.as_mut_ptr().cast(),
            iov_len: slot.len(),
        })
        .collect();
    let mut headers = one_iovec_each(&mut iovecs);
    // Room for one UDP_GRO control message (an int) per buffer, u64-aligned.
    let mut controls = vec![[0u64; 4]; batch];
    let start = Instant::now();
    let (mut count, mut bytes, mut calls) = (0u64, 0u64, 0u64);
    let mut last = None;
    loop {
        let now = Instant::now();
        if now.duration_since(start) > duration + Duration::from_secs(5)
            || last.is_some_and(|at: Instant| now.duration_since(at) > Duration::from_secs(1))
        {
            break;
        }
        if gro {
            for (header, control) in headers.iter_mut().zip(&mut controls) {
                header.msg_hdr.msg_control = control.as_mut_ptr().cast();
                header.msg_hdr.msg_controllen = std::mem::size_of_val(control);
            }
        }
        // SAFETY: `headers` holds `batch` initialised headers pointing at live buffer slots
        // and, with `--gro`, at live control buffers whose lengths they carry.
        let rc = unsafe {
            libc::recvmmsg(
                socket.as_raw_fd(),
                headers.as_mut_ptr(),
                batch as u32,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        if rc <= 0 {
            continue;
        }
        calls += 1;
        last = Some(Instant::now());
        for header in &headers[..rc as usize] {
            let len = u64::from(header.msg_len);
            bytes += len;
            count += match gro_segment_size(&header.msg_hdr) {
                Some(segment) if segment > 0 => len.div_ceil(segment),
                _ => 1,
            };
        }
    }
    Ok((count, bytes, calls))
}

/// The segment size of a coalesced run, from its `UDP_GRO` control message; `None` for a
/// buffer holding one datagram (or a socket without `--gro`).
fn gro_segment_size(header: &libc::msghdr) -> Option<u64> {
    if header.msg_control.is_null() {
        return None;
    }
    // SAFETY: the kernel filled `msg_control` up to `msg_controllen`; the CMSG macros stay
    // inside it, and the data of a UDP_GRO message is one int (read unaligned to be safe).
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(header);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::IPPROTO_UDP && (*cmsg).cmsg_type == libc::UDP_GRO {
                let size = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>());
                return u64::try_from(size).ok();
            }
            cmsg = libc::CMSG_NXTHDR(header, cmsg);
        }
    }
    None
}

/// One `mmsghdr` per iovec, no address and no control data: the headers of a `sendmmsg` on a
/// connected socket or of a `recvmmsg`. They point into `iovecs`, which must outlive their use.
fn one_iovec_each(iovecs: &mut [libc::iovec]) -> Vec<libc::mmsghdr> {
    iovecs
        .iter_mut()
        .map(|iov| {
            // SAFETY: an all-zero mmsghdr is valid; the iovec pointer is set here.
            let mut header: libc::mmsghdr = unsafe { std::mem::zeroed() };
            header.msg_hdr.msg_iov = iov;
            header.msg_hdr.msg_iovlen = 1;
            header
        })
        .collect()
}
