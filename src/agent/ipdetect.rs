//! Private and public IP auto-detection, in Kilo's order: candidates from the hostname, then the
//! Node's own `InternalIP` addresses (Kilo #367), the default-route interface and every
//! interface. Addresses inside this node's pod CIDR or the Kilo subnet are never chosen: they
//! belong to the pod bridge or the tunnel, and a mesh built on them never forms. The choice is
//! a pure function.

use std::net::IpAddr;

use control::ip::{compare_ips, is_public, is_unusable};
use ipnet::IpNet;

/// Addresses to choose from, each pool with its interface mask.
#[derive(Debug, Clone, Default)]
pub struct Candidates {
    /// Local addresses the hostname resolves to.
    pub hostname: Vec<IpNet>,
    /// Local addresses the Node lists as `InternalIP` in `status.addresses`.
    pub node_internal: Vec<IpNet>,
    /// Addresses on the default route's interface.
    pub default_route: Vec<IpNet>,
    /// Addresses on every interface.
    pub all: Vec<IpNet>,
}

/// The detected addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Detected {
    /// The private IP (with mask), if any.
    pub private: Option<IpNet>,
    /// The public IP; the private one when there is no public one.
    pub public: IpNet,
}

/// What detection must leave out.
#[derive(Debug, Clone, Default)]
pub struct Exclusions {
    /// Addresses on the Kilo, tunnel and `kube-bridge` links.
    pub addresses: Vec<IpAddr>,
    /// Networks whose addresses are never the node's: its pod CIDRs and the Kilo subnet.
    pub networks: Vec<IpNet>,
}

/// Picks the private and public IPs, leaving out `exclude`; `internal_cidrs`
/// (`--internal-cidr`) restricts private candidates.
pub fn choose(c: &Candidates, exclude: &Exclusions, internal_cidrs: &[IpNet]) -> Option<Detected> {
    let usable = |n: &&IpNet| {
        !is_unusable(n.addr())
            && !exclude.addresses.contains(&n.addr())
            && !exclude.networks.iter().any(|x| x.contains(&n.addr()))
    };
    let pick = |public: bool| -> Option<IpNet> {
        [&c.hostname, &c.node_internal, &c.default_route, &c.all]
            .into_iter()
            .find_map(|pool| {
                let mut pool: Vec<IpNet> = pool
                    .iter()
                    .filter(usable)
                    .filter(|n| is_public(n.addr()) == public)
                    .filter(|n| {
                        public
                            || internal_cidrs.is_empty()
                            || internal_cidrs.iter().any(|c| c.contains(&n.addr()))
                    })
                    .copied()
                    .collect();
                pool.sort_by(compare_ips);
                pool.first().copied()
            })
    };
    let private = pick(false);
    let public = pick(true).or(private)?;
    Some(Detected { private, public })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(texts: &[&str]) -> Vec<IpNet> {
        texts.iter().map(|t| t.parse().unwrap()).collect()
    }

    #[test]
    fn the_hostname_pool_wins_then_the_default_route() {
        let c = Candidates {
            hostname: nets(&["192.168.1.5/24"]),
            node_internal: nets(&["192.168.2.5/24"]),
            default_route: nets(&["10.0.0.5/8", "203.0.113.5/24"]),
            all: nets(&["127.0.0.1/8", "172.16.0.1/12"]),
        };
        let d = choose(&c, &Exclusions::default(), &[]).unwrap();
        assert_eq!(d.private, Some("192.168.1.5/24".parse().unwrap()));
        assert_eq!(d.public, "203.0.113.5/24".parse().unwrap());
    }

    #[test]
    fn no_public_ip_means_the_private_one_is_the_endpoint() {
        let c = Candidates {
            default_route: nets(&["192.168.10.2/24"]),
            ..Default::default()
        };
        let d = choose(&c, &Exclusions::default(), &[]).unwrap();
        assert_eq!(Some(d.public), d.private);
    }

    #[test]
    fn ignored_loopback_link_local_and_filtered_addresses_are_skipped() {
        let c = Candidates {
            all: nets(&[
                "127.0.0.1/8",
                "169.254.1.1/16",
                "fe80::1/64",
                "10.4.0.1/16",
                "10.19.0.23/16",
                "10.134.0.1/16",
                "192.168.7.7/24",
            ]),
            ..Default::default()
        };
        let ignore = Exclusions {
            addresses: vec!["10.4.0.1".parse().unwrap()],
            networks: vec![],
        };
        let d = choose(&c, &ignore, &[]).unwrap();
        assert_eq!(
            d.private,
            Some("10.19.0.23/16".parse().unwrap()),
            "numeric order"
        );
        let d = choose(&c, &Exclusions::default(), &nets(&["192.168.0.0/16"])).unwrap();
        assert_eq!(
            d.private,
            Some("192.168.7.7/24".parse().unwrap()),
            "--internal-cidr"
        );
        assert!(choose(&Candidates::default(), &Exclusions::default(), &[]).is_none());
    }

    /// A namespace without a default route, whose only other address is its pod bridge's:
    /// the pod bridge and the Kilo subnet are never the node's IP.
    #[test]
    fn addresses_in_the_pod_cidr_or_the_kilo_subnet_are_never_chosen() {
        let c = Candidates {
            all: nets(&["10.42.1.1/24", "10.4.0.3/16", "192.168.10.1/24"]),
            ..Default::default()
        };
        let exclude = Exclusions {
            addresses: vec![],
            networks: nets(&["10.42.1.0/24", "10.4.0.0/16"]),
        };
        let d = choose(&c, &exclude, &[]).unwrap();
        assert_eq!(d.private, Some("192.168.10.1/24".parse().unwrap()));
        let only_pods = Candidates {
            all: nets(&["10.42.1.1/24"]),
            ..Default::default()
        };
        assert!(choose(&only_pods, &exclude, &[]).is_none());
    }

    #[test]
    fn the_nodes_internal_ip_comes_before_the_default_route() {
        let c = Candidates {
            hostname: vec![],
            node_internal: nets(&["192.168.20.4/24"]),
            default_route: nets(&["10.0.0.5/8"]),
            all: nets(&["10.0.0.5/8", "192.168.20.4/24"]),
        };
        let d = choose(&c, &Exclusions::default(), &[]).unwrap();
        assert_eq!(d.private, Some("192.168.20.4/24".parse().unwrap()));
    }
}
