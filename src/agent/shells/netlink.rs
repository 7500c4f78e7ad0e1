//! The only module that talks rtnetlink: links, addresses, routes and policy rules. No `ip`
//! command is ever run.

use anyhow::{Context, Result};
use rtnetlink::Handle;

mod addresses;
mod links;
mod routes;

pub use links::routes_ipv4_to_ipv6_gateways;

/// A network interface.
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
