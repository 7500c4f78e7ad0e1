//! Address helpers with Kilo's semantics: public/private classification, CIDR parsing that keeps
//! host bits, the sequential WireGuard-IP allocator, and endpoint (`host:port`) parsing.

use std::cmp::Ordering;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

/// True when Kilo considers `ip` public.
///
/// IPv4 is private in 10/8, 172.16/12 and 192.168/16 (everything else, CGNAT included, is public).
/// IPv6 is private in the unique-local range fc00::/7; Kilo checks only fd00::/16, a quirk fixed
/// here.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => !v4.is_private(),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return !v4.is_private();
            }
            (v6.segments()[0] & 0xfe00) != 0xfc00
        }
    }
}

/// True for addresses kg never uses: loopback, link-local unicast and link-local multicast.
pub fn is_unusable(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            v4.is_loopback() || v4.is_link_local() || (v4.octets()[0..3] == [224, 0, 0])
        }
        IpAddr::V6(v6) => {
            v6.is_loopback()
                || (v6.segments()[0] & 0xffc0) == 0xfe80
                || (v6.segments()[0] & 0xff0f) == 0xff02
        }
    }
}

/// Orders addresses IPv4 first, then numerically (Kilo compares the text, so `10.19.x` sorted
/// before `10.134.x`; issue #367).
pub fn compare_ips(a: &IpNet, b: &IpNet) -> Ordering {
    match (a.addr(), b.addr()) {
        (IpAddr::V4(_), IpAddr::V6(_)) => Ordering::Less,
        (IpAddr::V6(_), IpAddr::V4(_)) => Ordering::Greater,
        (x, y) => x.cmp(&y).then(a.prefix_len().cmp(&b.prefix_len())),
    }
}

/// Parses `a.b.c.d/len` or `v6/len`, keeping the host bits (Kilo's `ParseCIDR` + IP re-insert).
/// A bare address without a prefix length is an error.
pub fn parse_cidr(text: &str) -> Option<IpNet> {
    text.parse::<IpNet>().ok()
}

/// `ip` as a host prefix: /32 for IPv4, /128 for IPv6.
pub fn host_net(ip: IpAddr) -> IpNet {
    IpNet::from(ip)
}

/// Hands out addresses of a subnet in order, starting after the network address (Kilo's
/// allocator: `.0` is never returned, `.255` in a larger subnet is).
#[derive(Debug, Clone)]
pub struct Allocator {
    subnet: IpNet,
    next: u128,
}

impl Allocator {
    /// An allocator over `subnet` (its host bits are ignored).
    pub fn new(subnet: IpNet) -> Self {
        Self {
            subnet: subnet.trunc(),
            next: 0,
        }
    }

    /// The next address with the subnet's prefix length, or `None` when the subnet is exhausted.
    pub fn next_ip(&mut self) -> Option<IpNet> {
        let host_bits = u32::from(self.subnet.max_prefix_len() - self.subnet.prefix_len());
        let size: u128 = if host_bits >= 128 {
            u128::MAX
        } else {
            1u128 << host_bits
        };
        self.next += 1;
        if self.next >= size {
            return None;
        }
        let addr = match self.subnet {
            IpNet::V4(n) => {
                let base = u32::from(n.network());
                IpAddr::V4(Ipv4Addr::from(base.wrapping_add(self.next as u32)))
            }
            IpNet::V6(n) => {
                let base = u128::from(n.network());
                IpAddr::V6(Ipv6Addr::from(base.wrapping_add(self.next)))
            }
        };
        IpNet::new(addr, self.subnet.prefix_len()).ok()
    }
}

/// Where a peer can be reached: an address or a DNS name, plus a UDP port.
#[derive(Debug, Clone, Eq)]
pub struct Endpoint {
    /// The host part.
    pub host: Host,
    /// The UDP port, 1–65535.
    pub port: u16,
}

/// The host of an [`Endpoint`].
#[derive(Debug, Clone, Eq)]
pub enum Host {
    /// A literal address.
    Ip(IpAddr),
    /// A DNS name, with the address it last resolved to (filled in by the agent before the
    /// topology is computed).
    Dns {
        /// The name as written, e.g. `node-b.example.com`.
        name: String,
        /// The last good resolution, if any.
        resolved: Option<IpAddr>,
    },
}

impl PartialEq for Host {
    /// DNS first, as Kilo compares: two DNS hosts are equal when their names are.
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Host::Ip(a), Host::Ip(b)) => a == b,
            (Host::Dns { name: a, .. }, Host::Dns { name: b, .. }) => a == b,
            _ => false,
        }
    }
}

impl PartialEq for Endpoint {
    fn eq(&self, other: &Self) -> bool {
        self.port == other.port && self.host == other.host
    }
}

/// Why an endpoint string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    /// No `:port`, or IPv6 without brackets.
    #[error("want host:port (IPv6 as [addr]:port)")]
    NotHostPort,
    /// The port is not a number in 1–65535.
    #[error("port {0:?} is not in 1-65535")]
    BadPort(String),
    /// The host is neither an IP address nor a DNS-1123 subdomain.
    #[error("host {0:?} is neither an IP address nor a DNS name")]
    BadHost(String),
}

impl Endpoint {
    /// An endpoint at a literal socket address.
    pub fn from_addr(addr: SocketAddr) -> Self {
        Self {
            host: Host::Ip(addr.ip()),
            port: addr.port(),
        }
    }

    /// Parses `host:port` with Go's `SplitHostPort` rules: IPv6 needs brackets; the host is an IP
    /// or a DNS-1123 subdomain; the port is 1–65535.
    pub fn parse(text: &str) -> Result<Self, EndpointError> {
        let (host, port) = split_host_port(text).ok_or(EndpointError::NotHostPort)?;
        let port = match port.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(EndpointError::BadPort(port.to_string())),
        };
        let host = if let Ok(ip) = host.parse::<IpAddr>() {
            Host::Ip(ip)
        } else if is_dns_subdomain(host) {
            Host::Dns {
                name: host.to_string(),
                resolved: None,
            }
        } else {
            return Err(EndpointError::BadHost(host.to_string()));
        };
        Ok(Self { host, port })
    }

    /// The address packets go to: the literal address, or the last resolution of the name.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.ip().map(|ip| SocketAddr::new(ip, self.port))
    }

    /// The IP part of [`Endpoint::addr`].
    pub fn ip(&self) -> Option<IpAddr> {
        match &self.host {
            Host::Ip(ip) => Some(*ip),
            Host::Dns { resolved, .. } => *resolved,
        }
    }

    /// The DNS name, if the endpoint has one.
    pub fn dns_name(&self) -> Option<&str> {
        match &self.host {
            Host::Dns { name, .. } => Some(name),
            Host::Ip(_) => None,
        }
    }

    /// Kilo's readiness rule: an IP with a non-zero port, or a DNS name.
    pub fn is_ready(&self) -> bool {
        self.port > 0
    }
}

impl fmt::Display for Endpoint {
    /// DNS first: `name:port`, else `ip:port` or `[v6]:port`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Dns { name, .. } => write!(f, "{name}:{}", self.port),
            Host::Ip(IpAddr::V4(ip)) => write!(f, "{ip}:{}", self.port),
            Host::Ip(IpAddr::V6(ip)) => write!(f, "[{ip}]:{}", self.port),
        }
    }
}

/// Go's `net.SplitHostPort` for the forms Kilo accepts.
fn split_host_port(text: &str) -> Option<(&str, &str)> {
    if let Some(rest) = text.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = after.strip_prefix(':')?;
        return Some((host, port));
    }
    let (host, port) = text.rsplit_once(':')?;
    if host.contains(':') || host.contains('[') || host.contains(']') {
        return None;
    }
    Some((host, port))
}

/// True for a Kubernetes DNS-1123 subdomain: lowercase labels of `[a-z0-9-]`, each starting and
/// ending with an alphanumeric, joined by dots, at most 253 characters.
pub fn is_dns_subdomain(name: &str) -> bool {
    if name.is_empty() || name.len() > 253 {
        return false;
    }
    name.split('.').all(|label| {
        let bytes = label.as_bytes();
        !bytes.is_empty()
            && bytes
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
            && bytes[0] != b'-'
            && bytes[bytes.len() - 1] != b'-'
    })
}

/// `net` re-expressed with IPv4-mapped IPv6 turned back into IPv4 (Kilo stores IPv4 as 4 bytes).
pub fn normalise(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) => match v6.addr().to_ipv4_mapped() {
            Some(v4) if v6.prefix_len() >= 96 => {
                IpNet::V4(Ipv4Net::new(v4, v6.prefix_len() - 96).expect("prefix fits"))
            }
            _ => IpNet::V6(Ipv6Net::new(v6.addr(), v6.prefix_len()).expect("prefix fits")),
        },
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn is_public_matches_kilos_vectors() {
        for (text, public) in [
            ("10.0.0.1", false),
            ("172.16.0.0", false),
            ("172.24.135.46", false),
            ("172.15.255.255", true),
            ("172.160.255.255", true),
            ("192.168.0.0", false),
            ("100.64.0.1", true),
            ("8.8.8.8", true),
        ] {
            assert_eq!(is_public(ip(text)), public, "{text}");
        }
    }

    #[test]
    fn every_unique_local_ipv6_address_is_private() {
        for text in ["fd00::1", "fd12:3456::1", "fc00::1", "fdff::1"] {
            assert!(!is_public(ip(text)), "{text}");
        }
        for text in ["2001:db8::1", "fe00::1", "2a00::1"] {
            assert!(is_public(ip(text)), "{text}");
        }
    }

    #[test]
    fn sorting_puts_ipv4_first_then_numeric_order() {
        let mut ips: Vec<IpNet> = [
            "192.168.0.1/32",
            "2001::7/128",
            "10.0.0.2/32",
            "fd68:da49:9da:b27f::/128",
            "10.0.0.1/32",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        ips.sort_by(compare_ips);
        let texts: Vec<String> = ips.iter().map(|n| n.addr().to_string()).collect();
        assert_eq!(
            texts,
            [
                "10.0.0.1",
                "10.0.0.2",
                "192.168.0.1",
                "2001::7",
                "fd68:da49:9da:b27f::"
            ]
        );
        let mut quirk: Vec<IpNet> = vec![
            "10.134.0.1/32".parse().unwrap(),
            "10.19.0.23/32".parse().unwrap(),
        ];
        quirk.sort_by(compare_ips);
        assert_eq!(quirk[0].to_string(), "10.19.0.23/32");
    }

    #[test]
    fn allocator_matches_kilos_vectors() {
        let mut a = Allocator::new("10.1.0.0/16".parse().unwrap());
        assert_eq!(a.next_ip().unwrap().to_string(), "10.1.0.1/16");
        assert_eq!(a.next_ip().unwrap().to_string(), "10.1.0.2/16");
        let mut a = Allocator::new("10.1.0.0/32".parse().unwrap());
        assert_eq!(a.next_ip(), None);
        let mut a = Allocator::new("10.1.0.0/31".parse().unwrap());
        assert_eq!(a.next_ip().unwrap().to_string(), "10.1.0.1/31");
        assert_eq!(a.next_ip(), None);
        let mut a = Allocator::new("fd00:4::/126".parse().unwrap());
        assert_eq!(a.next_ip().unwrap().to_string(), "fd00:4::1/126");
    }

    #[test]
    fn endpoints_parse_with_go_rules() {
        let e = Endpoint::parse("10.0.0.1:51820").unwrap();
        assert_eq!(e.addr(), Some("10.0.0.1:51820".parse().unwrap()));
        let e = Endpoint::parse("[ff10::10]:51820").unwrap();
        assert_eq!(e.to_string(), "[ff10::10]:51820");
        let e = Endpoint::parse("node-b.mesh.test:51820").unwrap();
        assert_eq!(e.dns_name(), Some("node-b.mesh.test"));
        assert_eq!(e.addr(), None);
        assert_eq!(e.to_string(), "node-b.mesh.test:51820");
        assert_eq!(Endpoint::parse("10.0.0.1"), Err(EndpointError::NotHostPort));
        assert_eq!(
            Endpoint::parse("ff10::10:51820"),
            Err(EndpointError::NotHostPort)
        );
        assert_eq!(
            Endpoint::parse("10.0.0.1:0"),
            Err(EndpointError::BadPort("0".into()))
        );
        assert_eq!(
            Endpoint::parse("10.0.0.1:65536"),
            Err(EndpointError::BadPort("65536".into()))
        );
        assert_eq!(
            Endpoint::parse("-10.0.0.2:51821"),
            Err(EndpointError::BadHost("-10.0.0.2".into()))
        );
        assert!(Endpoint::parse("Upper.Case:1").is_err());
    }

    #[test]
    fn dns_endpoints_compare_by_name_not_resolution() {
        let mut a = Endpoint::parse("a.example:1").unwrap();
        let b = a.clone();
        if let Host::Dns { resolved, .. } = &mut a.host {
            *resolved = Some(ip("1.2.3.4"));
        }
        assert_eq!(a, b);
        assert_eq!(a.addr(), Some("1.2.3.4:1".parse().unwrap()));
    }
}
