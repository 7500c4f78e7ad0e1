//! The only module that talks rtnetlink: links, addresses, routes and policy rules. No `ip`
//! command is ever run.

use anyhow::{Context, Result};
use rtnetlink::Handle;

mod addresses;
mod links;
mod routes;

pub use links::routes_ipv4_to_ipv6_gateways;

pub use control::host::Link;

/// A connection to the kernel's routing netlink.
#[derive(Clone)]
pub struct Netlink {
    handle: Handle,
}

impl Netlink {
    /// Opens a netlink socket and spawns its connection task on the current tokio runtime.
    pub fn connect() -> Result<Self> {
        let (connection, handle, _) = rtnetlink::new_connection().context("opening rtnetlink")?;
        tokio::spawn(connection);
        Ok(Self { handle })
    }
}
