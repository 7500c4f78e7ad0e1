//! Kernel change notifications: kg lists the host again when the kernel reports that an
//! address, a protocol-static route or a policy rule changed, instead of listing it on every
//! backend event. Links are left to the resync.

use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use netlink_packet_route::route::RouteProtocol;
use netlink_packet_route::RouteNetlinkMessage;
use rtnetlink::constants::{
    RTMGRP_IPV4_IFADDR, RTMGRP_IPV4_ROUTE, RTMGRP_IPV4_RULE, RTMGRP_IPV6_IFADDR, RTMGRP_IPV6_ROUTE,
};
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::sys::{AsyncSocket, SocketAddr};
use tokio::sync::mpsc;

/// `RTNLGRP_IPV6_RULE` (19) as a legacy group bit, which rtnetlink does not name.
const RTMGRP_IPV6_RULE: u32 = 1 << (19 - 1);

/// True for the notifications that may concern kg: any address or rule change, and changes to
/// protocol-static routes (an administrator's that kg may have to replace), unless kg asked
/// for it through the socket whose netlink port is `own` (the kernel puts the asking socket's
/// port in the notification): kg knows what it changed, and listing the host after each of
/// its own changes would double every change's cost.
fn relevant(message: &NetlinkMessage<RouteNetlinkMessage>, own: u32) -> bool {
    if own != 0 && message.header.port_number == own {
        return false;
    }
    match &message.payload {
        NetlinkPayload::InnerMessage(inner) => match inner {
            RouteNetlinkMessage::NewRoute(r) | RouteNetlinkMessage::DelRoute(r) => {
                r.header.protocol == RouteProtocol::Static
            }
            RouteNetlinkMessage::NewAddress(_)
            | RouteNetlinkMessage::DelAddress(_)
            | RouteNetlinkMessage::NewRule(_)
            | RouteNetlinkMessage::DelRule(_) => true,
            _ => false,
        },
        _ => false,
    }
}

/// Subscribes to the kernel's address, route and rule notifications, except those of changes
/// asked through netlink port `own`. The receiver gets one message per burst: after a relevant
/// notification, further ones are swallowed for `settle`.
pub fn watch_changes(settle: Duration, own: u32) -> Result<mpsc::Receiver<()>> {
    let (mut connection, _handle, mut messages) =
        rtnetlink::new_connection().context("opening rtnetlink for notifications")?;
    let groups = RTMGRP_IPV4_IFADDR
        | RTMGRP_IPV6_IFADDR
        | RTMGRP_IPV4_ROUTE
        | RTMGRP_IPV6_ROUTE
        | RTMGRP_IPV4_RULE
        | RTMGRP_IPV6_RULE;
    connection
        .socket_mut()
        .socket_mut()
        .bind(&SocketAddr::new(0, groups))
        .context("subscribing to rtnetlink notifications")?;
    tokio::spawn(connection);
    let (tx, rx) = mpsc::channel(1);
    tokio::spawn(async move {
        while let Some((message, _)) = messages.next().await {
            if !relevant(&message, own) {
                continue;
            }
            let settled = tokio::time::sleep(settle);
            tokio::pin!(settled);
            loop {
                tokio::select! {
                    _ = &mut settled => break,
                    next = messages.next() => if next.is_none() { return },
                }
            }
            if tx.try_send(()).is_err() && tx.is_closed() {
                return;
            }
        }
    });
    Ok(rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_route::route::RouteMessage;

    fn static_route_added(port: u32) -> NetlinkMessage<RouteNetlinkMessage> {
        let mut route = RouteMessage::default();
        route.header.protocol = RouteProtocol::Static;
        let mut message = NetlinkMessage::from(RouteNetlinkMessage::NewRoute(route));
        message.header.port_number = port;
        message
    }

    #[test]
    fn kgs_own_changes_are_left_out_and_everyone_elses_count() {
        assert!(!relevant(&static_route_added(4242), 4242), "kg's own");
        assert!(
            relevant(&static_route_added(0), 4242),
            "the kernel's or `ip`'s"
        );
        assert!(relevant(&static_route_added(99), 4242), "another process's");
        let mut kernel = static_route_added(0);
        if let NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(r)) = &mut kernel.payload
        {
            r.header.protocol = RouteProtocol::Kernel;
        }
        assert!(!relevant(&kernel, 4242), "not a protocol-static route");
    }
}
