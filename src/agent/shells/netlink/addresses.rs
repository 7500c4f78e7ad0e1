//! Addresses: listing every link's, and making one the only address of a link.

use anyhow::{Context, Result};
use futures::TryStreamExt;
use ipnet::IpNet;
use netlink_packet_route::address::AddressAttribute;

use super::Netlink;

impl Netlink {
    /// Every address, with its link index and prefix length.
    pub async fn addresses(&self) -> Result<Vec<(u32, IpNet)>> {
        let mut out = Vec::new();
        let mut stream = self.handle.address().get().execute();
        while let Some(msg) = stream.try_next().await.context("listing addresses")? {
            let mut local = None;
            let mut address = None;
            for attr in &msg.attributes {
                match attr {
                    AddressAttribute::Local(ip) => local = Some(*ip),
                    AddressAttribute::Address(ip) => address = Some(*ip),
                    _ => {}
                }
            }
            if let Some(ip) = local.or(address) {
                if let Ok(net) = IpNet::new(ip, msg.header.prefix_len) {
                    out.push((msg.header.index, net));
                }
            }
        }
        Ok(out)
    }

    /// Makes `want` the only addresses of the link (`None`: remove all).
    pub async fn set_address(&self, index: u32, want: Option<IpNet>) -> Result<()> {
        let mut has_wanted = false;
        let mut stream = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute();
        let mut stale = Vec::new();
        while let Some(msg) = stream.try_next().await.context("listing addresses")? {
            let ip = msg.attributes.iter().find_map(|a| match a {
                AddressAttribute::Local(ip) | AddressAttribute::Address(ip) => Some(*ip),
                _ => None,
            });
            let Some(ip) = ip else { continue };
            if ip.is_ipv6() && ip.to_string().starts_with("fe80") {
                continue;
            }
            match IpNet::new(ip, msg.header.prefix_len) {
                Ok(net) if Some(net) == want => has_wanted = true,
                _ => stale.push(msg),
            }
        }
        for msg in stale {
            self.handle
                .address()
                .del(msg)
                .execute()
                .await
                .context("removing a stale address")?;
        }
        if let (Some(net), false) = (want, has_wanted) {
            self.handle
                .address()
                .add(index, net.addr(), net.prefix_len())
                .replace()
                .execute()
                .await
                .with_context(|| format!("adding {net} to link {index}"))?;
        }
        Ok(())
    }
}
