//! A lean UDP load generator and sink for `bench/throughput.sh`: it sends and receives with
//! `sendmmsg`/`recvmmsg` in batches of 64, so that on a small machine the generator, not the
//! tunnel, stops being the limit (iperf3 moves one datagram per syscall and, on the 2-core
//! machine of the benchmarks, sends at most about 1.5 Gbit/s of 1300-byte datagrams even with
//! no tunnel in the way).
//!
//! ```text
//! udp-load send ADDRESS:PORT MBIT_PER_S SECONDS [DATAGRAM_BYTES]   prints "sent N BYTES"
//! udp-load recv PORT SECONDS                                        prints "received N BYTES"
//! ```
//!
//! The sender paces itself every millisecond to the offered rate (a blocking socket: when the
//! path cannot take more it waits, so what it sent is what it could offer). The receiver stops
//! one second after the last datagram, or `SECONDS` + 5 after it started.

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

const BATCH: usize = 64;
const RECV_SLOT: usize = 2048;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
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
            let (count, bytes) = send(to, mbit, Duration::from_secs_f64(secs), size)?;
            println!("sent {count} {bytes}");
        }
        Some("recv") if args.len() >= 3 => {
            let port: u16 = args[1].parse().context("PORT")?;
            let secs: f64 = args[2].parse().context("SECONDS")?;
            let (count, bytes) = recv(port, Duration::from_secs_f64(secs))?;
            println!("received {count} {bytes}");
        }
        _ => bail!(
            "usage: udp-load send ADDRESS:PORT MBIT_PER_S SECONDS [DATAGRAM_BYTES] | udp-load recv PORT SECONDS"
        ),
    }
    Ok(())
}

fn send(to: SocketAddr, mbit: f64, duration: Duration, size: usize) -> Result<(u64, u64)> {
    let bind: SocketAddr = if to.is_ipv4() {
        "0.0.0.0:0".parse()?
    } else {
        "[::]:0".parse()?
    };
    let socket = UdpSocket::bind(bind)?;
    socket.connect(to)?;
    let mut buffers = vec![vec![0u8; size]; BATCH];
    let mut iovecs: Vec<libc::iovec> = buffers
        .iter_mut()
        .map(|buffer| libc::iovec {
            iov_base: buffer.as_mut_ptr().cast(),
            iov_len: size,
        })
        .collect();
    let mut headers = one_iovec_each(&mut iovecs);
    let per_second = mbit * 1e6 / 8.0 / size as f64;
    let start = Instant::now();
    let (mut sent, mut bytes) = (0u64, 0u64);
    loop {
        let elapsed = start.elapsed();
        if elapsed >= duration {
            break;
        }
        let due = (per_second * elapsed.as_secs_f64()) as u64;
        if sent >= due {
            std::thread::sleep(Duration::from_micros(200));
            continue;
        }
        let n = ((due - sent) as usize).min(BATCH);
        // SAFETY: `headers` holds BATCH headers pointing, through `iovecs`, at `buffers`, all
        // alive until the function returns; the first `n` are sent.
        let rc = unsafe { libc::sendmmsg(socket.as_raw_fd(), headers.as_mut_ptr(), n as u32, 0) };
        if rc < 0 {
            let error = std::io::Error::last_os_error();
            if error.raw_os_error() == Some(libc::ECONNREFUSED) {
                continue;
            }
            return Err(error).context("sendmmsg");
        }
        sent += rc as u64;
        bytes += rc as u64 * size as u64;
    }
    Ok((sent, bytes))
}

fn recv(port: u16, duration: Duration) -> Result<(u64, u64)> {
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
    let mut buffer = vec![0u8; RECV_SLOT * BATCH];
    let mut iovecs: Vec<libc::iovec> = buffer
        .chunks_mut(RECV_SLOT)
        .map(|slot| libc::iovec {
            iov_base: slot.as_mut_ptr().cast(),
            iov_len: RECV_SLOT,
        })
        .collect();
    let mut headers = one_iovec_each(&mut iovecs);
    let start = Instant::now();
    let (mut count, mut bytes) = (0u64, 0u64);
    let mut last = None;
    loop {
        let now = Instant::now();
        if now.duration_since(start) > duration + Duration::from_secs(5)
            || last.is_some_and(|at: Instant| now.duration_since(at) > Duration::from_secs(1))
        {
            break;
        }
        // SAFETY: `headers` holds BATCH initialised headers pointing at live buffer slots.
        let rc = unsafe {
            libc::recvmmsg(
                socket.as_raw_fd(),
                headers.as_mut_ptr(),
                BATCH as u32,
                libc::MSG_WAITFORONE,
                std::ptr::null_mut(),
            )
        };
        if rc <= 0 {
            continue;
        }
        last = Some(Instant::now());
        count += rc as u64;
        bytes += headers[..rc as usize]
            .iter()
            .map(|h| u64::from(h.msg_len))
            .sum::<u64>();
    }
    Ok((count, bytes))
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
