//! The candidate list's text form, the endpoint filters and the family preference.

use std::fmt;
use std::net::{IpAddr, SocketAddr};

use ipnet::IpNet;

use crate::ip::is_public;

/// Most candidates read from one node's list; the rest are named and left out.
pub const MAX_CANDIDATES: usize = 16;

/// Reads a `kilotun.io/endpoints` value: comma-separated `address:port` entries (IPv6 in
/// brackets), in preference order. Returns the candidates, without repeats, and each entry
/// that was left out with why (malformed, a host name, port 0, beyond [`MAX_CANDIDATES`]).
pub fn parse_candidates(text: &str) -> (Vec<SocketAddr>, Vec<(String, String)>) {
    let mut found: Vec<SocketAddr> = Vec::new();
    let mut left_out = Vec::new();
    for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        match entry.parse::<SocketAddr>() {
            Ok(addr) if addr.port() == 0 => {
                left_out.push((entry.to_string(), "port 0 is no WireGuard port".to_string()))
            }
            Ok(addr) if found.contains(&addr) => {}
            Ok(_) if found.len() == MAX_CANDIDATES => left_out.push((
                entry.to_string(),
                format!("more than {MAX_CANDIDATES} candidates"),
            )),
            Ok(addr) => found.push(addr),
            Err(_) => left_out.push((
                entry.to_string(),
                "not an address:port (IPv6 in brackets; host names belong in kilo.squat.ai/force-endpoint)"
                    .to_string(),
            )),
        }
    }
    (found, left_out)
}

/// The annotation value for `candidates` (`""` for none).
pub fn encode_candidates(candidates: &[SocketAddr]) -> String {
    candidates
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// A filter on addresses, as `--advertise-endpoints` and `--accept-endpoints` take it: CIDRs
/// an address must be inside (any of them; none listed admits every address) and `!CIDR`s it
/// must not be inside.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointFilter {
    include: Vec<IpNet>,
    exclude: Vec<IpNet>,
}

/// A filter entry that is not a CIDR.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{entry:?} is not a CIDR or a !CIDR")]
pub struct FilterError {
    /// The entry as written.
    pub entry: String,
}

impl EndpointFilter {
    /// Parses `CIDR,!CIDR,...`; an empty text admits everything. A bare address counts as its
    /// host network.
    pub fn parse(text: &str) -> Result<Self, FilterError> {
        let mut filter = Self::default();
        for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (negated, cidr) = match entry.strip_prefix('!') {
                Some(rest) => (true, rest.trim()),
                None => (false, entry),
            };
            let net = cidr
                .parse::<IpNet>()
                .or_else(|_| cidr.parse::<IpAddr>().map(IpNet::from))
                .map_err(|_| FilterError {
                    entry: entry.to_string(),
                })?;
            if negated {
                filter.exclude.push(net.trunc());
            } else {
                filter.include.push(net.trunc());
            }
        }
        Ok(filter)
    }

    /// True when `ip` passes: inside an included range (or none is listed), in no excluded one.
    pub fn admits(&self, ip: IpAddr) -> bool {
        (self.include.is_empty() || self.include.iter().any(|n| n.contains(&ip)))
            && !self.exclude.iter().any(|n| n.contains(&ip))
    }

    /// True when the filter admits everything.
    pub fn is_open(&self) -> bool {
        self.include.is_empty() && self.exclude.is_empty()
    }
}

impl fmt::Display for EndpointFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let entries: Vec<String> = self
            .include
            .iter()
            .map(ToString::to_string)
            .chain(self.exclude.iter().map(|n| format!("!{n}")))
            .collect();
        f.write_str(&entries.join(","))
    }
}

/// Which address family a peer's candidates are tried in first (`--underlay-family`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum UnderlayFamily {
    /// The family this host and the peer both have first (IPv4 when both have both), then
    /// the list's order.
    #[default]
    Auto,
    /// IPv4 candidates first.
    Ipv4,
    /// IPv6 candidates first.
    Ipv6,
}

impl UnderlayFamily {
    /// Parses `auto`, `ipv4` or `ipv6`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "auto" => Some(Self::Auto),
            "ipv4" => Some(Self::Ipv4),
            "ipv6" => Some(Self::Ipv6),
            _ => None,
        }
    }

    /// The flag's value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Ipv4 => "ipv4",
            Self::Ipv6 => "ipv6",
        }
    }
}

/// The candidates this node publishes, in preference order: `forced` (its
/// `kilo.squat.ai/force-endpoint`, kept whatever the filter says), then `detected` (the
/// endpoint Kilo's detection chose), then its other `addresses` on `port`, public before
/// private, IPv4 before IPv6, lowest first; the addresses `advertise` admits, without repeats.
/// `addresses` are the host's usable ones (no loopback, link-local, kg's own links or pod
/// ranges).
pub fn local_candidates(
    forced: Option<SocketAddr>,
    detected: Option<SocketAddr>,
    addresses: &[IpAddr],
    port: u16,
    advertise: &EndpointFilter,
) -> Vec<SocketAddr> {
    let mut others: Vec<IpAddr> = addresses.to_vec();
    others.sort_by_key(|ip| (!is_public(*ip), ip.is_ipv6(), *ip));
    let mut list: Vec<SocketAddr> = forced.into_iter().collect();
    let admitted = detected
        .into_iter()
        .chain(others.into_iter().map(|ip| SocketAddr::new(ip, port)))
        .filter(|a| advertise.admits(a.ip()));
    for addr in admitted {
        if !list.contains(&addr) && list.len() < MAX_CANDIDATES {
            list.push(addr);
        }
    }
    list
}
