//! What a node's network looks like, as listed from its kernel: links, addresses and the main
//! table's routes. The agent lists it (through its netlink shell) and hands it here as a value;
//! [`crate::desired`] plans the host's state from it.

use std::net::IpAddr;

use ipnet::IpNet;

use crate::routes::Route;

/// The MTU used when the default route's cannot be read.
pub const DEFAULT_MTU: u32 = 1420;
/// WireGuard's overhead, subtracted by `--mtu=auto`.
pub const WIREGUARD_OVERHEAD: u32 = 80;

/// `--mtu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mtu {
    /// The default-route interface's MTU minus 80, re-detected every reconcile.
    Auto,
    /// A fixed MTU.
    Fixed(u32),
}

/// A network link as the kernel lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Interface index.
    pub index: u32,
    /// Name.
    pub name: String,
    /// MTU.
    pub mtu: u32,
    /// Administratively up.
    pub up: bool,
}

/// The host's links, addresses and main-table routes as last listed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HostNet {
    /// The default route's link.
    pub default_link: Option<u32>,
    /// Every link.
    pub links: Vec<Link>,
    /// Every address with its link.
    pub addresses: Vec<(u32, IpNet)>,
    /// The main table's unicast routes, kg's among them.
    pub main_routes: Vec<Route>,
}

impl HostNet {
    /// The link with index `index`.
    pub fn link(&self, index: u32) -> Option<&Link> {
        self.links.iter().find(|l| l.index == index)
    }

    /// The index of the link named `name`.
    pub fn link_index(&self, name: &str) -> Option<u32> {
        self.links.iter().find(|l| l.name == name).map(|l| l.index)
    }

    /// The index of the link holding the private IP `private` (0 when there is none).
    pub fn private_link(&self, private: Option<IpNet>) -> u32 {
        let Some(private) = private else { return 0 };
        self.addresses
            .iter()
            .find(|(_, n)| n.addr() == private.addr())
            .map_or(0, |(i, _)| *i)
    }

    /// The networks this node is directly connected to: the network of every address that
    /// gives the kernel a connected route (canonical, de-duplicated), leaving out kg's own links
    /// `own` (the WireGuard link, the tunnel), `lo`, loopback and link-local addresses, and
    /// host addresses (`/32`, `/128`: no connected route, only a local one, which no route of
    /// kg's overrides; kube-proxy's `kube-ipvs0` holds every Service IP so). The routes kg
    /// installs must never replace or cover these networks.
    pub fn connected_networks(&self, own: &[u32]) -> Vec<IpNet> {
        let mut nets: Vec<IpNet> = self
            .addresses
            .iter()
            .filter(|(i, _)| !own.contains(i) && self.link(*i).is_none_or(|l| l.name != "lo"))
            .map(|(_, n)| n.trunc())
            .filter(|n| n.prefix_len() < n.max_prefix_len())
            .filter(|n| match n.addr() {
                IpAddr::V4(a) => !a.is_loopback() && !a.is_link_local(),
                IpAddr::V6(a) => !a.is_loopback() && !a.is_unicast_link_local(),
            })
            .collect();
        nets.sort();
        nets.dedup();
        nets
    }

    /// The WireGuard link's MTU: `--mtu`, or with `auto` the default route's link's minus
    /// WireGuard's overhead, never under 1280 (1420 when the default route's link is unknown).
    pub fn mtu(&self, mtu: Mtu) -> u32 {
        match mtu {
            Mtu::Fixed(m) => m,
            Mtu::Auto => self
                .default_link
                .and_then(|i| self.link(i))
                .map_or(DEFAULT_MTU, |l| {
                    l.mtu.saturating_sub(WIREGUARD_OVERHEAD).max(1280)
                }),
        }
    }

    /// An address the host holds inside `net` on a link other than `except`.
    pub fn address_in(&self, net: IpNet, except: u32) -> Option<IpAddr> {
        self.addresses
            .iter()
            .filter(|(i, _)| *i != except)
            .map(|(_, n)| n.addr())
            .find(|a| net.contains(a))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(index: u32, name: &str, mtu: u32) -> Link {
        Link {
            index,
            name: name.into(),
            mtu,
            up: true,
        }
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn connected_networks_leave_out_kgs_links_loopback_link_local_and_host_addresses() {
        let host = HostNet {
            default_link: Some(2),
            links: vec![
                link(1, "lo", 65536),
                link(2, "eth0", 1500),
                link(3, "kilo0", 1420),
                link(4, "tunl0", 1480),
                link(5, "kube-ipvs0", 1500),
                link(6, "pods0", 1500),
            ],
            addresses: vec![
                (1, net("127.0.0.1/8")),
                (1, net("::1/128")),
                (2, net("192.168.10.1/24")),
                (2, net("192.168.10.9/24")),
                (2, net("169.254.3.1/16")),
                (2, net("fe80::1/64")),
                (2, net("2001:db8::1/64")),
                (3, net("10.4.0.1/16")),
                (4, net("10.42.1.1/32")),
                (5, net("10.96.0.1/32")),
                (6, net("10.42.1.1/24")),
            ],
            main_routes: Vec::new(),
        };
        assert_eq!(
            host.connected_networks(&[3, 4]),
            [
                net("10.42.1.0/24"),
                net("192.168.10.0/24"),
                net("2001:db8::/64")
            ]
        );
        assert_eq!(host.private_link(Some(net("192.168.10.9/24"))), 2);
        assert_eq!(host.private_link(Some(net("192.168.99.9/24"))), 0);
        assert_eq!(host.link_index("tunl0"), Some(4));
        assert_eq!(
            host.address_in(net("10.42.1.0/24"), 4),
            Some("10.42.1.1".parse().unwrap())
        );
        assert_eq!(host.address_in(net("10.43.0.0/16"), 0), None);
    }

    #[test]
    fn auto_mtu_follows_the_default_links_less_wireguards_overhead_never_under_1280() {
        let mut host = HostNet {
            default_link: Some(2),
            links: vec![link(2, "eth0", 9000)],
            ..Default::default()
        };
        assert_eq!(host.mtu(Mtu::Auto), 8920);
        assert_eq!(host.mtu(Mtu::Fixed(1300)), 1300);
        host.links[0].mtu = 1300;
        assert_eq!(host.mtu(Mtu::Auto), 1280);
        host.default_link = None;
        assert_eq!(host.mtu(Mtu::Auto), DEFAULT_MTU);
    }
}
