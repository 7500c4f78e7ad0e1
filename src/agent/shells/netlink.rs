//! The only module that talks rtnetlink: links, addresses, routes and policy rules. No `ip`
//! command is ever run.

use anyhow::{Context, Result};
use rtnetlink::sys::AsyncSocket as _;
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
    /// The socket's netlink port: the kernel's notifications of the changes asked through it
    /// carry it ([`super::kernel_watch`] leaves them out).
    port: u32,
}

impl Netlink {
    /// Opens a netlink socket and spawns its connection task on the current tokio runtime.
    pub fn connect() -> Result<Self> {
        let (mut connection, handle, _) =
            rtnetlink::new_connection().context("opening rtnetlink")?;
        let port = connection
            .socket_mut()
            .socket_mut()
            .bind_auto()
            .context("binding the rtnetlink socket")?
            .port_number();
        tokio::spawn(connection);
        Ok(Self { handle, port })
    }

    /// The socket's netlink port, which the kernel's notifications of kg's own changes carry.
    pub fn port(&self) -> u32 {
        self.port
    }
}
