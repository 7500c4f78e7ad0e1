//! What kg reads from the host for its own node: the IP to publish (Kilo's detection order),
//! the default route's link, the private IP's link, `cilium_host`'s address and the MTU.

use std::net::IpAddr;

use anyhow::{Context, Result};
use ipnet::IpNet;

use super::args::Mtu;
use super::ipdetect::{self, Candidates, Detected, Exclusions};
use super::{encap, Agent, DEFAULT_MTU, WIREGUARD_OVERHEAD};

impl Agent {
    /// Chooses this node's IP among the host's addresses, ignoring kg's own links, the pod
    /// CIDRs of `local` (this node's object) and the Kilo subnet, and preferring the Node's
    /// `InternalIP` after the hostname's addresses; also returns the default route's link.
    pub(super) async fn detect(
        &self,
        local: Option<&k8s_openapi::api::core::v1::Node>,
    ) -> Result<(Detected, Option<u32>)> {
        let links = self.netlink.links().await?;
        let addresses = self.netlink.addresses().await?;
        let ignored_links: Vec<u32> = links
            .iter()
            .filter(|l| {
                l.index == self.kilo_index
                    || l.name == "kube-bridge"
                    || Some(l.name.as_str()) == self.tunnel.name()
            })
            .map(|l| l.index)
            .collect();
        let spec = local.and_then(|n| n.spec.as_ref());
        let pod_cidrs = spec
            .and_then(|s| s.pod_cidrs.clone())
            .unwrap_or_default()
            .into_iter()
            .chain(spec.and_then(|s| s.pod_cidr.clone()))
            .filter_map(|c| c.parse::<IpNet>().ok());
        let exclude = Exclusions {
            addresses: addresses
                .iter()
                .filter(|(i, _)| ignored_links.contains(i))
                .map(|(_, n)| n.addr())
                .collect(),
            networks: pod_cidrs.chain([self.s.subnet]).collect(),
        };
        let node_internal: Vec<IpAddr> = local
            .and_then(|n| n.status.as_ref()?.addresses.as_ref())
            .into_iter()
            .flatten()
            .filter(|a| a.type_ == "InternalIP")
            .filter_map(|a| a.address.parse().ok())
            .collect();
        let default_link = self.netlink.default_route_link().await?;
        let candidates = Candidates {
            hostname: addresses
                .iter()
                .filter(|(_, n)| self.hostname_ips.contains(&n.addr()))
                .map(|(_, n)| *n)
                .collect(),
            node_internal: addresses
                .iter()
                .filter(|(_, n)| node_internal.contains(&n.addr()))
                .map(|(_, n)| *n)
                .collect(),
            default_route: addresses
                .iter()
                .filter(|(i, _)| Some(*i) == default_link)
                .map(|(_, n)| *n)
                .collect(),
            all: addresses.iter().map(|(_, n)| *n).collect(),
        };
        let detected = ipdetect::choose(&candidates, &exclude, &self.s.internal_cidrs)
            .context("no valid IP was found")?;
        Ok((detected, default_link))
    }

    /// With `--compatibility=cilium`: the IPv4 address of `cilium_host`, which other nodes use
    /// as this node's gateway inside the location.
    pub(super) async fn cni_compatibility_ip(&self) -> Result<Option<IpNet>> {
        if self.s.compatibility != control::routes::Compatibility::Cilium {
            return Ok(None);
        }
        let Some(host) = self.netlink.link_by_name(encap::CILIUM_HOST).await? else {
            return Ok(None);
        };
        Ok(self
            .netlink
            .addresses()
            .await?
            .into_iter()
            .find(|(i, n)| *i == host.index && n.addr().is_ipv4())
            .map(|(_, n)| IpNet::from(n.addr())))
    }

    /// The index of the link holding the private IP `private` (0 when there is none).
    pub(super) async fn private_link(&self, private: Option<IpNet>) -> Result<u32> {
        let Some(private) = private else { return Ok(0) };
        let addresses = self.netlink.addresses().await?;
        Ok(addresses
            .iter()
            .find(|(_, n)| n.addr() == private.addr())
            .map_or(0, |(i, _)| *i))
    }

    /// The WireGuard link's MTU: `--mtu`, or with `auto` the default route's link's minus
    /// WireGuard's overhead, never under 1280 (1420 when the default route's link is unknown).
    pub(super) async fn mtu(&self, default_link: Option<u32>) -> Result<u32> {
        Ok(match self.s.mtu {
            Mtu::Fixed(m) => m,
            Mtu::Auto => {
                let links = self.netlink.links().await?;
                default_link
                    .and_then(|i| links.iter().find(|l| l.index == i))
                    .map_or(DEFAULT_MTU, |l| {
                        l.mtu.saturating_sub(WIREGUARD_OVERHEAD).max(1280)
                    })
            }
        })
    }
}
