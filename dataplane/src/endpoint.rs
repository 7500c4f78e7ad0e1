//! Where a peer is, and which of our addresses it talks to.
//!
//! A peer reached at one of several addresses of this host expects its answers from that
//! address: a reply from another one is, to its firewall or NAT, a stranger. So, as Linux's
//! WireGuard and wireguard-go do, the engine learns each peer's local address from the
//! datagrams it sends us (the sockets read it from `IP_PKTINFO` / `IPV6_PKTINFO`) and sends
//! from it. An address that leaves the host is forgotten at the first send it fails
//! ([`Engine::forget_local`](crate::Engine::forget_local)); the next datagram from the peer
//! teaches the new one.

use std::net::{IpAddr, SocketAddr};

/// One of this host's addresses, as a received datagram named it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LocalAddr {
    /// The address the datagram was sent to.
    pub ip: IpAddr,
    /// The interface it came in on (0 when unknown). Sends name it only for an IPv6
    /// link-local address, which means nothing without it.
    pub ifindex: u32,
}

impl LocalAddr {
    /// A local address with no interface.
    pub fn new(ip: IpAddr) -> Self {
        Self { ip, ifindex: 0 }
    }
}

/// A peer's address and the local address it reaches us at, if known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// The peer's address and port.
    pub peer: SocketAddr,
    /// Our address the peer sends to: the source of what goes back. `None` leaves the choice
    /// to the kernel's routing.
    pub local: Option<LocalAddr>,
}

impl Endpoint {
    /// `peer`, reached at `local`.
    pub fn new(peer: SocketAddr, local: Option<LocalAddr>) -> Self {
        Self { peer, local }
    }
}

impl From<SocketAddr> for Endpoint {
    /// An endpoint with no local address: the kernel picks the source.
    fn from(peer: SocketAddr) -> Self {
        Self { peer, local: None }
    }
}
