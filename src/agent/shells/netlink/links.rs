//! Links: listing them, creating the kernel's WireGuard, IPIP and `ip6tnl` links, and setting
//! a link's MTU and state.

use anyhow::{Context, Result};
use futures::TryStreamExt;
use netlink_packet_route::link::{
    InfoKind, Ip6TunnelFlags, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use rtnetlink::{LinkIp6Tnl, LinkIpIp, LinkUnspec, LinkWireguard};

use super::{Link, Netlink};

fn kind_name(kind: &InfoKind) -> String {
    match kind {
        InfoKind::Tun => "tun".to_string(),
        InfoKind::Wireguard => "wireguard".to_string(),
        other => format!("{other:?}").to_lowercase(),
    }
}

impl Netlink {
    /// Every link.
    pub async fn links(&self) -> Result<Vec<Link>> {
        let mut out = Vec::new();
        let mut stream = self.handle.link().get().execute();
        while let Some(msg) = stream.try_next().await.context("listing links")? {
            let mut link = Link {
                index: msg.header.index,
                name: String::new(),
                mtu: 0,
                up: msg.header.flags.contains(LinkFlags::Up),
            };
            for attr in msg.attributes {
                match attr {
                    LinkAttribute::IfName(n) => link.name = n,
                    LinkAttribute::Mtu(m) => link.mtu = m,
                    _ => {}
                }
            }
            out.push(link);
        }
        Ok(out)
    }

    /// The link called `name`.
    pub async fn link_by_name(&self, name: &str) -> Result<Option<Link>> {
        Ok(self.links().await?.into_iter().find(|l| l.name == name))
    }

    /// The kind of the link called `name` as `ip -d link` names it (`tun`, `wireguard`, …;
    /// empty when the kernel names none), or `None` when there is no such link.
    pub async fn link_kind(&self, name: &str) -> Result<Option<String>> {
        let mut stream = self
            .handle
            .link()
            .get()
            .match_name(name.to_string())
            .execute();
        let message = match stream.try_next().await {
            Ok(message) => message,
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => None,
            Err(e) => return Err(anyhow::Error::new(e).context(format!("reading link {name}"))),
        };
        Ok(message.map(|m| {
            m.attributes
                .iter()
                .find_map(|a| match a {
                    LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
                        LinkInfo::Kind(kind) => Some(kind_name(kind)),
                        _ => None,
                    }),
                    _ => None,
                })
                .unwrap_or_default()
        }))
    }

    /// Makes sure the kernel's WireGuard link `name` exists (`ip link add NAME type
    /// wireguard`). Fails where the kernel has no WireGuard.
    pub async fn add_wireguard(&self, name: &str) -> Result<()> {
        self.add_link_once(LinkWireguard::new(name).build(), name, "wireguard")
            .await
    }

    /// Makes sure the kernel IPIP link `name` exists (`ip tunnel add NAME mode ipip`): created,
    /// or already there. Fails where the kernel has no IPIP.
    pub async fn add_ipip(&self, name: &str) -> Result<()> {
        self.add_link_once(LinkIpIp::new(name).build(), name, "IPIP")
            .await
    }

    /// Adds the link `message` describes, called `name`: created, or already there (the
    /// kernel's error is returned only when no link of that name exists afterwards).
    async fn add_link_once(&self, message: LinkMessage, name: &str, kind: &str) -> Result<()> {
        match self.handle.link().add(message).execute().await {
            Ok(()) => Ok(()),
            Err(e) => match self.link_by_name(name).await? {
                Some(_) => Ok(()),
                None => Err(anyhow::Error::new(e).context(format!("creating {kind} link {name}"))),
            },
        }
    }

    /// Makes sure the kernel's `ip6tnl` link `name` exists in `ipip6` mode over link `over`
    /// with no fixed endpoints (`ip link add NAME type ip6tnl mode ipip6 dev OVER encaplimit
    /// none`): IPv4 inside an IPv6 header whose next header is 4, sent to the IPv6 gateway of
    /// each route through it, the bytes kilotun's userspace device sends. Binding it to `over`
    /// keeps it apart from the module's own `ip6tnl0`, which has no endpoints either. The kernel
    /// takes the outer destination from an IPv4 route's IPv6 gateway since Linux 5.18 (before,
    /// such packets are dropped), so an older kernel is refused here. Fails where the kernel has
    /// no `ip6_tunnel`.
    pub async fn add_ip6tnl(&self, name: &str, over: u32) -> Result<()> {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        if !routes_ipv4_to_ipv6_gateways(&release) {
            anyhow::bail!(
                "kernel {} is older than 5.18, whose ip6tnl cannot send IPv4 to a route's IPv6 gateway",
                release.trim()
            );
        }
        let link = LinkIp6Tnl::new(name)
            .mode(netlink_packet_route::IpProtocol::Ipip)
            .dev(over)
            .set_flag(Ip6TunnelFlags::IgnEncapLimit, true)
            .build();
        self.add_link_once(link, name, "ip6tnl").await
    }

    /// True when the kernel has IPIP, loaded or loadable: its fallback device `tunl0` exists,
    /// the `ipip` module is loaded, or the running kernel's module list has it. Creates nothing.
    pub async fn has_ipip(&self) -> Result<bool> {
        if self.link_by_name("tunl0").await?.is_some()
            || std::path::Path::new("/sys/module/ipip").exists()
        {
            return Ok(true);
        }
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let modules = format!("/lib/modules/{}/modules", release.trim());
        let listed = |file: &str| {
            std::fs::read_to_string(format!("{modules}.{file}"))
                .is_ok_and(|list| list.lines().any(|l| l.contains("/ipip.ko")))
        };
        Ok(listed("dep") || listed("builtin"))
    }

    /// Deletes a link.
    pub async fn delete_link(&self, index: u32) -> Result<()> {
        self.handle
            .link()
            .del(index)
            .execute()
            .await
            .with_context(|| format!("deleting link {index}"))
    }

    /// Sets a link's MTU.
    pub async fn set_mtu(&self, index: u32, mtu: u32) -> Result<()> {
        let msg = LinkUnspec::new_with_index(index).mtu(mtu).build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .with_context(|| format!("setting MTU {mtu} on link {index}"))
    }

    /// Brings a link up or down.
    pub async fn set_up(&self, index: u32, up: bool) -> Result<()> {
        let builder = LinkUnspec::new_with_index(index);
        let msg = if up { builder.up() } else { builder.down() }.build();
        self.handle
            .link()
            .set(msg)
            .execute()
            .await
            .with_context(|| format!("setting link {index} {}", if up { "up" } else { "down" }))
    }
}

/// True when kernel release `release` (`/proc/sys/kernel/osrelease`) is 5.18 or later: its
/// `ip6tnl` in NBMA mode sends IPv4 to the IPv6 gateway of the route that chose it.
pub fn routes_ipv4_to_ipv6_gateways(release: &str) -> bool {
    let mut parts = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= (5, 18),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::routes_ipv4_to_ipv6_gateways;

    #[test]
    fn ip6tnl_routes_ipv4_to_ipv6_gateways_from_linux_5_18() {
        for (release, yes) in [
            ("6.18.0-1-cloud-amd64\n", true),
            ("5.18.0", true),
            ("5.17.15-200.fc35.x86_64", false),
            ("5.4.0-150-generic", false),
            ("4.18.0-553.el8_10.x86_64", false),
            ("10.0", true),
            ("", false),
            ("garbage", false),
        ] {
            assert_eq!(routes_ipv4_to_ipv6_gateways(release), yes, "{release:?}");
        }
    }
}
