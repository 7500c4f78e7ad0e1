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

/// The address families a host holds usable addresses of: on an interface, neither loopback
/// nor link-local, and outside kg's own links, the pod CIDRs and the Kilo subnet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Families {
    /// An IPv4 address.
    pub ipv4: bool,
    /// An IPv6 address.
    pub ipv6: bool,
}

impl Families {
    /// True when the host has an address of `ip`'s family.
    pub fn holds_family_of(&self, ip: IpAddr) -> bool {
        if ip.is_ipv4() {
            self.ipv4
        } else {
            self.ipv6
        }
    }
}

impl std::fmt::Display for Families {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match (self.ipv4, self.ipv6) {
            (true, true) => "IPv4 and IPv6",
            (true, false) => "IPv4 only",
            (false, true) => "IPv6 only",
            (false, false) => "none",
        })
    }
}

/// The detected addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Detected {
    /// The private IP (with mask), if any.
    pub private: Option<IpNet>,
    /// The public IP; the private one when there is no public one.
    pub public: IpNet,
    /// The families the host has usable addresses of.
    pub families: Families,
}

/// What detection must leave out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Exclusions {
    /// Addresses on the Kilo, tunnel and `kube-bridge` links.
    pub addresses: Vec<IpAddr>,
    /// Networks whose addresses are never the node's: its pod CIDRs and the Kilo subnet.
    pub networks: Vec<IpNet>,
}

/// Picks the private and public IPs, leaving out `exclude`; `internal_cidrs`
/// (`--internal-cidr`, IPv4 or IPv6) restricts private candidates to the addresses inside them,
/// which are then private whatever their scope (a global IPv6 prefix a cluster uses inside).
///
/// On a dual-stack host IPv4 wins, as Kilo's docs say: the private IP is the first private IPv4
/// address of the pools (hostname, Node `InternalIP`, default route, every interface), and an
/// IPv6 one only when no IPv4 address qualifies, which is how `--internal-cidr` with only IPv6
/// prefixes selects IPv6. The public IP is then looked for in the private IP's family, falling
/// back to the private IP itself, so the endpoint and the internal IP agree on a family; a host
/// with a private IPv4 and a public IPv6 address announces the IPv4 one unless
/// `force-endpoint` names the IPv6 address (and `force-internal-ip` an IPv6 internal IP).
pub fn choose(c: &Candidates, exclude: &Exclusions, internal_cidrs: &[IpNet]) -> Option<Detected> {
    let usable = |n: &&IpNet| {
        !is_unusable(n.addr())
            && !exclude.addresses.contains(&n.addr())
            && !exclude.networks.iter().any(|x| x.contains(&n.addr()))
    };
    let qualifies = |n: &IpNet, public: bool| {
        if public {
            is_public(n.addr())
        } else if internal_cidrs.is_empty() {
            !is_public(n.addr())
        } else {
            internal_cidrs.iter().any(|c| c.contains(&n.addr()))
        }
    };
    let pick = |public: bool, ipv4: bool| -> Option<IpNet> {
        [&c.hostname, &c.node_internal, &c.default_route, &c.all]
            .into_iter()
            .find_map(|pool| {
                let mut pool: Vec<IpNet> = pool
                    .iter()
                    .filter(usable)
                    .filter(|n| n.addr().is_ipv4() == ipv4 && qualifies(n, public))
                    .copied()
                    .collect();
                pool.sort_by(compare_ips);
                pool.first().copied()
            })
    };
    let families = Families {
        ipv4: c.all.iter().filter(usable).any(|n| n.addr().is_ipv4()),
        ipv6: c.all.iter().filter(usable).any(|n| n.addr().is_ipv6()),
    };
    let private = pick(false, true).or_else(|| pick(false, false));
    let public = match private {
        Some(p) => pick(true, p.addr().is_ipv4()).unwrap_or(p),
        None => pick(true, true).or_else(|| pick(true, false))?,
    };
    Some(Detected {
        private,
        public,
        families,
    })
}

/// The host's address of the other family than `internal`'s, published as
/// `kilotun.io/second-internal-ip`: among `same_link` (the addresses of the link holding
/// `internal`), one usable as for detection, a private one before a public one, lowest first.
/// On a dual-stack host it is the gateway the location's other nodes route that family's pods
/// through. The `published` one is kept while the link still has it, so an address added
/// later (an IPv6 privacy address, say) does not move the location's routes.
pub fn second_internal_ip(
    internal: IpNet,
    same_link: &[IpNet],
    exclude: &Exclusions,
    published: Option<IpNet>,
) -> Option<IpNet> {
    let mut pool: Vec<IpNet> = same_link
        .iter()
        .filter(|n| n.addr().is_ipv4() != internal.addr().is_ipv4())
        .filter(|n| {
            !is_unusable(n.addr())
                && !exclude.addresses.contains(&n.addr())
                && !exclude.networks.iter().any(|x| x.contains(&n.addr()))
        })
        .copied()
        .collect();
    if let Some(kept) = published.filter(|p| pool.contains(p)) {
        return Some(kept);
    }
    pool.sort_by(compare_ips);
    pool.iter()
        .find(|n| !is_public(n.addr()))
        .or(pool.first())
        .copied()
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

    #[test]
    fn ipv4_wins_on_a_dual_stack_host_whatever_pool_holds_the_ipv6_address() {
        let c = Candidates {
            hostname: nets(&["fd50::5/64", "2001:db8::5/64"]),
            default_route: nets(&["2001:db8::5/64", "fd50::5/64", "192.168.1.5/24"]),
            all: nets(&["2001:db8::5/64", "fd50::5/64", "192.168.1.5/24"]),
            ..Default::default()
        };
        let d = choose(&c, &Exclusions::default(), &[]).unwrap();
        assert_eq!(d.private, Some("192.168.1.5/24".parse().unwrap()));
        assert_eq!(
            d.public,
            "192.168.1.5/24".parse().unwrap(),
            "no public IPv4: the endpoint stays in the internal IP's family"
        );
        let with_public_v4 = Candidates {
            all: nets(&["2001:db8::5/64", "192.168.1.5/24", "198.51.100.5/24"]),
            ..Default::default()
        };
        let d = choose(&with_public_v4, &Exclusions::default(), &[]).unwrap();
        assert_eq!(d.public, "198.51.100.5/24".parse().unwrap());
    }

    #[test]
    fn an_ipv6_only_host_detects_ipv6() {
        let c = Candidates {
            default_route: nets(&["fe80::1/64", "fd50::5/64"]),
            all: nets(&["127.0.0.1/8", "::1/128", "10.42.1.1/24", "fd50::5/64"]),
            ..Default::default()
        };
        let exclude = Exclusions {
            addresses: vec![],
            networks: nets(&["10.42.1.0/24", "10.4.0.0/16"]),
        };
        let d = choose(&c, &exclude, &[]).unwrap();
        assert_eq!(d.private, Some("fd50::5/64".parse().unwrap()));
        assert_eq!(d.public, "fd50::5/64".parse().unwrap());
        assert_eq!(
            d.families,
            Families {
                ipv4: false,
                ipv6: true
            },
            "the pod bridge's IPv4 address is not the host's"
        );
        let global = Candidates {
            all: nets(&["fd50::5/64", "2001:db8::5/64"]),
            ..Default::default()
        };
        let d = choose(&global, &exclude, &[]).unwrap();
        assert_eq!(d.private, Some("fd50::5/64".parse().unwrap()));
        assert_eq!(d.public, "2001:db8::5/64".parse().unwrap());
    }

    #[test]
    fn an_ipv6_internal_cidr_selects_ipv6_on_a_dual_stack_host() {
        let c = Candidates {
            default_route: nets(&["192.168.1.5/24", "203.0.113.5/24", "2001:db8:1::5/64"]),
            all: nets(&[
                "192.168.1.5/24",
                "203.0.113.5/24",
                "fd50::5/64",
                "2001:db8:1::5/64",
            ]),
            ..Default::default()
        };
        let d = choose(&c, &Exclusions::default(), &nets(&["fd50::/64"])).unwrap();
        assert_eq!(d.private, Some("fd50::5/64".parse().unwrap()));
        assert_eq!(
            d.public,
            "2001:db8:1::5/64".parse().unwrap(),
            "the endpoint follows the internal IP's family"
        );
        // A global prefix named internal is the internal IP.
        let d = choose(&c, &Exclusions::default(), &nets(&["2001:db8:1::/48"])).unwrap();
        assert_eq!(d.private, Some("2001:db8:1::5/64".parse().unwrap()));
        // Both families named: IPv4 still wins.
        let both = nets(&["fd50::/64", "192.168.0.0/16"]);
        let d = choose(&c, &Exclusions::default(), &both).unwrap();
        assert_eq!(d.private, Some("192.168.1.5/24".parse().unwrap()));
        assert_eq!(d.public, "203.0.113.5/24".parse().unwrap());
    }

    #[test]
    fn the_second_internal_ip_is_of_the_other_family_and_stays_put() {
        let internal: IpNet = "192.168.1.5/24".parse().unwrap();
        let link = nets(&[
            "192.168.1.5/24",
            "fe80::5/64",
            "2001:db8:1::5/64",
            "fd50::9/64",
            "fd50::5/64",
        ]);
        let none = Exclusions::default();
        // Link-local never; a private address before a global one, lowest first.
        assert_eq!(
            second_internal_ip(internal, &link, &none, None),
            Some("fd50::5/64".parse().unwrap())
        );
        // The published one stays while the link has it, even when a lower one appears.
        let published = Some("fd50::9/64".parse().unwrap());
        assert_eq!(
            second_internal_ip(internal, &link, &none, published),
            published
        );
        // Gone from the link: the choice starts over.
        let gone = Some("fd50::7/64".parse().unwrap());
        assert_eq!(
            second_internal_ip(internal, &link, &none, gone),
            Some("fd50::5/64".parse().unwrap())
        );
        // An IPv4-only link has none.
        assert_eq!(
            second_internal_ip(
                internal,
                &nets(&["192.168.1.5/24", "fe80::5/64"]),
                &none,
                None
            ),
            None
        );
    }
}
