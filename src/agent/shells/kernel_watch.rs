//! Kernel change notifications: kg lists the host again when the kernel reports that an
//! address, a protocol-static route or a policy rule changed, instead of listing it on every
//! backend event. Links are left to the resync.
//!
//! The same notifications, with every link and route change besides, are counted
//! ([`RoutingChanges`]): a resync dumps the kernel's routes again only when the count moved
//! since the last dump, so a quiet host costs a resync no route dump, however many routes kg
//! holds for the cluster.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use netlink_packet_route::route::RouteProtocol;
use netlink_packet_route::RouteNetlinkMessage;
use rtnetlink::constants::{
    RTMGRP_IPV4_IFADDR, RTMGRP_IPV4_ROUTE, RTMGRP_IPV4_RULE, RTMGRP_IPV6_IFADDR, RTMGRP_IPV6_ROUTE,
    RTMGRP_LINK,
};
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::sys::{AsyncSocket, SocketAddr};
use tokio::sync::mpsc;

/// `RTNLGRP_IPV6_RULE` (19) as a legacy group bit, which rtnetlink does not name.
const RTMGRP_IPV6_RULE: u32 = 1 << (19 - 1);

/// The count's value once the watch has stopped: every later resync dumps the routes.
const STOPPED: u64 = u64::MAX;

/// How many notifications that may change the host's routing the watch has seen: any route or
/// rule change kg did not ask for itself, any link or address change (kg's own too: the kernel
/// removes an IPv4 route whose link goes down or whose source address goes away, and says
/// nothing of the route), and any notification lost to a full socket buffer.
#[derive(Debug, Clone, Default)]
pub struct RoutingChanges(Arc<AtomicU64>);

impl RoutingChanges {
    /// The count now; `None` once the watch stopped (nothing is known to be unchanged).
    pub fn seen(&self) -> Option<u64> {
        let n = self.0.load(Ordering::Acquire);
        (n != STOPPED).then_some(n)
    }

    /// Counts one notification (the watch's own; a test's stand-in for the kernel).
    pub(crate) fn saw(&self) {
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n != STOPPED).then_some(n + 1)
            });
    }

    fn stopped(&self) {
        self.0.store(STOPPED, Ordering::Release);
    }
}

/// True for the notifications [`RoutingChanges`] counts (see there).
fn may_change_routing(message: &NetlinkMessage<RouteNetlinkMessage>, own: u32) -> bool {
    let asked_by_kg = own != 0 && message.header.port_number == own;
    match &message.payload {
        NetlinkPayload::Overrun(_) => true,
        NetlinkPayload::InnerMessage(inner) => match inner {
            RouteNetlinkMessage::NewRoute(_)
            | RouteNetlinkMessage::DelRoute(_)
            | RouteNetlinkMessage::NewRule(_)
            | RouteNetlinkMessage::DelRule(_) => !asked_by_kg,
            RouteNetlinkMessage::NewLink(_)
            | RouteNetlinkMessage::DelLink(_)
            | RouteNetlinkMessage::NewAddress(_)
            | RouteNetlinkMessage::DelAddress(_) => true,
            _ => false,
        },
        _ => false,
    }
}

/// True for the notifications that may concern kg: any address or rule change, changes to
/// protocol-static routes (an administrator's that kg may have to replace) and to default
/// routes of any protocol, unless kg asked
/// for it through the socket whose netlink port is `own` (the kernel puts the asking socket's
/// port in the notification): kg knows what it changed, and listing the host after each of
/// its own changes would double every change's cost.
fn relevant(message: &NetlinkMessage<RouteNetlinkMessage>, own: u32) -> bool {
    if own != 0 && message.header.port_number == own {
        return false;
    }
    match &message.payload {
        // Notifications were lost: anything may have changed.
        NetlinkPayload::Overrun(_) => true,
        NetlinkPayload::InnerMessage(inner) => match inner {
            // A default route of any origin too (DHCP, router advertisements, a routing
            // daemon): the tunnel guard's table copies the host's routes, and a gateway that
            // moved must reach it at once.
            RouteNetlinkMessage::NewRoute(r) | RouteNetlinkMessage::DelRoute(r) => {
                r.header.protocol == RouteProtocol::Static
                    || r.header.destination_prefix_length == 0
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

/// Subscribes to the kernel's link, address, route and rule notifications. The receiver gets
/// one message per burst of relevant ones ([`relevant`]: not those of changes asked through
/// netlink port `own`): after one, further ones are swallowed for `settle`. The count counts
/// the notifications that may change the host's routing, whether relevant or not.
pub fn watch_changes(settle: Duration, own: u32) -> Result<(mpsc::Receiver<()>, RoutingChanges)> {
    let (mut connection, _handle, mut messages) =
        rtnetlink::new_connection().context("opening rtnetlink for notifications")?;
    let groups = RTMGRP_LINK
        | RTMGRP_IPV4_IFADDR
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
    let changes = RoutingChanges::default();
    let count = changes.clone();
    tokio::spawn(async move {
        let count_of = |message: &NetlinkMessage<RouteNetlinkMessage>| {
            if may_change_routing(message, own) {
                count.saw();
            }
        };
        'watch: while let Some((message, _)) = messages.next().await {
            count_of(&message);
            if !relevant(&message, own) {
                continue;
            }
            let settled = tokio::time::sleep(settle);
            tokio::pin!(settled);
            loop {
                tokio::select! {
                    _ = &mut settled => break,
                    next = messages.next() => match next {
                        Some((message, _)) => count_of(&message),
                        None => break 'watch,
                    },
                }
            }
            if tx.try_send(()).is_err() && tx.is_closed() {
                break;
            }
        }
        count.stopped();
    });
    Ok((rx, changes))
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
            r.header.destination_prefix_length = 24;
        }
        assert!(!relevant(&kernel, 4242), "not a protocol-static route");
        let mut dhcp = static_route_added(0);
        if let NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(r)) = &mut dhcp.payload {
            r.header.protocol = RouteProtocol::Dhcp;
        }
        assert!(
            relevant(&dhcp, 4242),
            "a default route of any origin: the guard's table copies it"
        );
    }

    #[test]
    fn the_count_takes_every_routing_change_but_kgs_own_routes_and_rules() {
        assert!(
            !may_change_routing(&static_route_added(4242), 4242),
            "kg's own route"
        );
        assert!(
            may_change_routing(&static_route_added(0), 4242),
            "the kernel's"
        );
        let mut link = NetlinkMessage::from(RouteNetlinkMessage::DelLink(Default::default()));
        link.header.port_number = 4242;
        assert!(
            may_change_routing(&link, 4242),
            "kg's own link change may take routes with it"
        );
        assert!(
            !relevant(&link, 4242),
            "a link change alone lists nothing at once"
        );
        let mut lost = NetlinkMessage::from(RouteNetlinkMessage::NewLink(Default::default()));
        lost.payload = NetlinkPayload::Overrun(Vec::new());
        assert!(
            may_change_routing(&lost, 4242) && relevant(&lost, 4242),
            "lost notifications"
        );
    }

    #[test]
    fn a_stopped_watch_counts_no_more_and_says_so() {
        let changes = RoutingChanges::default();
        assert_eq!(changes.seen(), Some(0));
        changes.saw();
        assert_eq!(changes.seen(), Some(1));
        changes.stopped();
        changes.saw();
        assert_eq!(changes.seen(), None);
    }
}
