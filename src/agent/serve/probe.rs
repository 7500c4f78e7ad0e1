//! Path probes for `/status?probe=true`, run only when asked: ICMP echo over raw sockets, with
//! "don't fragment" set, to learn whether packets of the size WireGuard sends reach a peer's
//! endpoint, and whether IP protocol 4 passes between the nodes of a location.

use std::io::ErrorKind;
use std::mem::MaybeUninit;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use control::status::{IpipProbe, MtuOutcome, MtuProbe};
use socket2::{Domain, Protocol, Socket, Type};

/// How long one echo waits for its reply.
pub const ECHO_TIMEOUT: Duration = Duration::from_millis(800);
/// WireGuard's data-message overhead on top of the inner packet: header and tag (32), UDP (8).
pub const WIREGUARD_DATA_OVERHEAD: u32 = 32 + 8;
/// The smallest echo sent, to learn whether an address answers at all.
const SMALL: u32 = 84;

/// The outer IP header's size for `ip`.
pub fn ip_header(ip: IpAddr) -> u32 {
    if ip.is_ipv4() {
        20
    } else {
        40
    }
}

/// What one echo came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Echo {
    /// The reply arrived.
    Answered,
    /// The kernel refused to send it: the path MTU it knows is this.
    TooBig(u32),
    /// No reply within [`ECHO_TIMEOUT`].
    Lost,
}

/// One ICMP echo of `size` bytes (the whole IP packet) to `dst`, never fragmented.
pub fn echo(dst: IpAddr, size: u32, sequence: u16) -> std::io::Result<Echo> {
    let v6 = dst.is_ipv6();
    let socket = if v6 {
        Socket::new(Domain::IPV6, Type::RAW, Some(Protocol::ICMPV6))?
    } else {
        Socket::new(Domain::IPV4, Type::RAW, Some(Protocol::ICMPV4))?
    };
    // IP_PMTUDISC_DO (2): set DF and refuse to send above the known path MTU.
    let (level, option) = if v6 {
        (libc::IPPROTO_IPV6, libc::IPV6_MTU_DISCOVER)
    } else {
        (libc::IPPROTO_IP, libc::IP_MTU_DISCOVER)
    };
    set_int(&socket, level, option, 2)?;
    socket.connect(&SocketAddr::new(dst, 0).into())?;
    socket.set_read_timeout(Some(ECHO_TIMEOUT))?;
    let identifier = (std::process::id() as u16) ^ sequence.rotate_left(8);
    let payload = size.saturating_sub(ip_header(dst) + 8).max(8) as usize;
    let mut message = vec![0u8; 8 + payload];
    message[0] = if v6 { 128 } else { 8 };
    message[4..6].copy_from_slice(&identifier.to_be_bytes());
    message[6..8].copy_from_slice(&sequence.to_be_bytes());
    if !v6 {
        let sum = checksum(&message);
        message[2..4].copy_from_slice(&sum.to_be_bytes());
    }
    match socket.send(&message) {
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => {
            let (level, option) = if v6 {
                (libc::IPPROTO_IPV6, libc::IPV6_MTU)
            } else {
                (libc::IPPROTO_IP, libc::IP_MTU)
            };
            return Ok(Echo::TooBig(get_int(&socket, level, option)? as u32));
        }
        Err(e) => return Err(e),
    }
    let deadline = Instant::now() + ECHO_TIMEOUT;
    let mut buf = [MaybeUninit::<u8>::uninit(); 2048];
    while Instant::now() < deadline {
        let n = match socket.recv(&mut buf) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
            // A "fragmentation needed" for our packet surfaces as EMSGSIZE on the socket.
            Err(e) if e.raw_os_error() == Some(libc::EMSGSIZE) => continue,
            Err(e) => return Err(e),
        };
        // SAFETY: `recv` initialised the first `n` bytes.
        let bytes: Vec<u8> = buf[..n]
            .iter()
            .map(|b| unsafe { b.assume_init() })
            .collect();
        // Raw IPv4 sockets deliver the IP header; raw IPv6 sockets do not.
        let icmp = if v6 {
            &bytes[..]
        } else {
            let ihl = usize::from(bytes.first().map_or(0, |b| b & 0x0f)) * 4;
            bytes.get(ihl..).unwrap_or(&[])
        };
        let reply_type = if v6 { 129 } else { 0 };
        if icmp.len() >= 8
            && icmp[0] == reply_type
            && icmp[4..6] == identifier.to_be_bytes()
            && icmp[6..8] == sequence.to_be_bytes()
        {
            return Ok(Echo::Answered);
        }
    }
    Ok(Echo::Lost)
}

fn set_int(socket: &Socket, level: i32, option: i32, value: i32) -> std::io::Result<()> {
    // SAFETY: a plain int option on a socket we own.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            option,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn get_int(socket: &Socket, level: i32, option: i32) -> std::io::Result<i32> {
    let mut value: i32 = 0;
    let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
    // SAFETY: reading a plain int option into a local of the right size.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            level,
            option,
            (&mut value as *mut i32).cast(),
            &mut len,
        )
    };
    if rc == 0 {
        Ok(value)
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The Internet checksum of `data`.
fn checksum(data: &[u8]) -> u16 {
    let mut sum: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// True when `dst` answers one of three small echoes.
fn answers(dst: IpAddr, sequence: u16) -> bool {
    (0..3).any(|i| matches!(echo(dst, SMALL, sequence + i), Ok(Echo::Answered)))
}

/// Whether datagrams of `needed` bytes reach `endpoint` unfragmented.
pub fn path_mtu(peer: &str, endpoint: IpAddr, needed: u32, sequence: u16) -> MtuProbe {
    let outcome = if !answers(endpoint, sequence) {
        MtuOutcome::NoAnswer
    } else {
        // A router's "fragmentation needed" for the first large echo teaches the kernel the
        // path MTU, so the second is refused locally with it.
        let mut outcome = MtuOutcome::BlackHole;
        for i in 0..3 {
            match echo(endpoint, needed, sequence + 3 + i) {
                Ok(Echo::Answered) => {
                    outcome = MtuOutcome::Fits;
                    break;
                }
                Ok(Echo::TooBig(path_mtu)) => {
                    outcome = MtuOutcome::Smaller { path_mtu };
                    break;
                }
                Ok(Echo::Lost) | Err(_) => {}
            }
        }
        outcome
    };
    MtuProbe {
        peer: peer.to_string(),
        endpoint,
        needed,
        outcome,
    }
}

/// Whether `target` (a pod-CIDR address of `node`, routed through the IPIP link) answers, next
/// to whether `private_ip` answers plainly.
pub fn ipip(node: &str, private_ip: IpAddr, target: IpAddr, sequence: u16) -> IpipProbe {
    IpipProbe {
        node: node.to_string(),
        private_ip,
        target,
        plain: answers(private_ip, sequence),
        encapsulated: answers(target, sequence + 3),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksum_of_an_echo_request() {
        // type 8, code 0, checksum 0, id 0x1234, seq 1: the checksum makes the sum 0xffff.
        let mut m = [8u8, 0, 0, 0, 0x12, 0x34, 0, 1];
        let sum = checksum(&m);
        m[2..4].copy_from_slice(&sum.to_be_bytes());
        assert_eq!(checksum(&m), 0);
        assert_eq!(sum, 0xe5ca);
    }

    #[test]
    #[ignore = "needs root: raw sockets"]
    fn loopback_answers_and_fits() {
        assert!(
            nix_root(),
            "loopback_answers_and_fits: raw sockets need root"
        );
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        assert_eq!(echo(lo, 1480, 7).unwrap(), Echo::Answered);
        assert_eq!(path_mtu("lo", lo, 1480, 10).outcome, MtuOutcome::Fits);
    }

    fn nix_root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }
}
