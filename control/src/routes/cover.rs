//! A quick "could any of these networks cover this address?" over many routes: the networks
//! grouped by family and prefix length, an address masked to each length and looked up. It
//! answers for a few lengths instead of scanning every route, and never says no when a network
//! covers the address.

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;

use ipnet::IpNet;

/// Networks by (IPv4?, prefix length), each held as its network address.
#[derive(Debug, Default)]
pub(super) struct Cover {
    by_length: BTreeMap<(bool, u8), HashSet<IpNet>>,
}

impl Cover {
    /// An index of `nets`.
    pub(super) fn of<'a>(nets: impl IntoIterator<Item = &'a IpNet>) -> Self {
        let mut cover = Self::default();
        for net in nets {
            cover.insert(*net);
        }
        cover
    }

    /// Adds `net`.
    pub(super) fn insert(&mut self, net: IpNet) {
        self.by_length
            .entry((net.addr().is_ipv4(), net.prefix_len()))
            .or_default()
            .insert(net.trunc());
    }

    /// Whether a network added may contain `ip` (true when one does).
    pub(super) fn may_cover(&self, ip: IpAddr) -> bool {
        self.by_length
            .iter()
            .filter(|((v4, _), _)| *v4 == ip.is_ipv4())
            .any(|((_, length), nets)| {
                IpNet::new(ip, *length).is_ok_and(|net| nets.contains(&net.trunc()))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn an_address_is_covered_exactly_when_a_network_contains_it() {
        let nets = [
            net("10.4.0.0/16"),
            net("10.5.3.7/24"),
            net("192.168.1.1/32"),
            net("fd00::/64"),
            net("0.0.0.0/0"),
        ];
        let cover = Cover::of(&nets[..4]);
        for (ip, covered) in [
            ("10.4.200.1", true),
            ("10.5.3.200", true),
            ("10.5.4.1", false),
            ("192.168.1.1", true),
            ("192.168.1.2", false),
            ("fd00::9", true),
            ("fd01::9", false),
            ("8.8.8.8", false),
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(cover.may_cover(ip), covered, "{ip}");
            assert_eq!(
                nets[..4].iter().any(|n| n.contains(&ip)),
                covered,
                "the scan disagrees on {ip}"
            );
        }
        let mut all = Cover::of(&nets[..4]);
        all.insert(nets[4]);
        assert!(all.may_cover("8.8.8.8".parse().unwrap()));
        assert!(!all.may_cover("fd01::9".parse().unwrap()));
    }
}
