//! The paths between the model's nodes: each node has two uplinks, `eth0` (where Kilo's
//! endpoint is detected, the default route) and `eth1` (a second network every node is on,
//! say a private WAN), and publishes both addresses as endpoint candidates. A handshake sent to
//! a node's address on one uplink travels that uplink's network: it is answered when the
//! address is live at both ends (present, and not black-holed by a firewall rule or a broken
//! route) and the receiver is not behind NAT. A NATed node's mapping can move: its peers'
//! packets then go to the old mapping until it next sends (its keepalive).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use ipnet::IpNet;

use super::{Family, Sim, SimNode, NAT_KEEPALIVE};

/// The second uplink every model node has.
pub const SECOND_UPLINK: &str = "eth1";

/// How many uplinks a model node has (`eth0`, then [`SECOND_UPLINK`]).
pub const UPLINKS: usize = 2;

/// A node's uplinks as the network treats them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Uplinks {
    /// The address of `eth1`, when it has one.
    pub second: Option<IpNet>,
    /// Per uplink, packets to its address are dropped.
    pub black_holed: [bool; UPLINKS],
    /// When its NAT mapping last moved.
    pub nat_moved: Option<Instant>,
}

/// The address `eth1` of the `i`th node to join gets in `family`, renewed `renewals` times.
pub(super) fn second_address(family: Family, i: u8, renewals: u8) -> IpNet {
    let net = match family {
        Family::V4 => format!("172.{}.{}.{}/16", 20 + renewals % 8, i / 200, 10 + i % 200),
        Family::V6 => format!("fd01:{renewals:x}::{:x}/64", 0x10 + u32::from(i)),
    };
    net.parse().expect("the second uplink's address")
}

impl SimNode {
    /// The address of uplink `uplink` (0: `eth0`, 1: `eth1`), if it has one.
    pub fn uplink_address(&self, uplink: usize) -> Option<IpNet> {
        match uplink {
            0 => Some(self.address),
            _ => self.uplinks.second,
        }
    }

    /// True when uplink `uplink` has an address and packets to it get through.
    pub fn uplink_live(&self, uplink: usize) -> bool {
        self.uplink_address(uplink).is_some() && !self.uplinks.black_holed[uplink]
    }

    /// The uplink whose address `endpoint` is, on this node's WireGuard port.
    fn uplink_of(&self, endpoint: SocketAddr) -> Option<usize> {
        let port = self
            .running
            .as_ref()
            .map(|r| r.twin.engine.config().interface.listen_port)?;
        (endpoint.port() == port)
            .then(|| {
                (0..UPLINKS)
                    .find(|u| self.uplink_address(*u).map(|a| a.addr()) == Some(endpoint.ip()))
            })
            .flatten()
    }
}

impl Sim {
    /// True when `from`, sending to `endpoint` (its device's endpoint for `to`), starts a
    /// handshake `to` answers at `now`: `endpoint` is `to`'s address on an uplink live at
    /// both ends, `to` is not behind NAT, and not both are.
    pub(super) fn starts_handshake(
        &self,
        from: &SimNode,
        to: &SimNode,
        endpoint: Option<SocketAddr>,
        now: Instant,
    ) -> bool {
        let keepalive = Duration::from_secs(NAT_KEEPALIVE.parse().unwrap_or(10));
        // Until a NATed end sends from its new mapping, what is sent to it is lost.
        let moved = |n: &SimNode| n.uplinks.nat_moved.is_some_and(|at| now < at + keepalive);
        if to.behind_nat || (from.behind_nat && moved(from)) {
            return false;
        }
        let Some(uplink) = endpoint.and_then(|e| to.uplink_of(e)) else {
            return false;
        };
        from.uplink_live(uplink) && to.uplink_live(uplink)
    }

    /// Black-holes `name`'s uplink `uplink` (packets to its address are dropped), or lets
    /// them through again.
    pub fn set_black_holed(&mut self, name: &str, uplink: usize, on: bool) {
        if let Some(node) = self.nodes.get_mut(name) {
            node.uplinks.black_holed[uplink % UPLINKS] = on;
        }
    }

    /// Removes the address of `name`'s second uplink, or gives it a new one, and tells its
    /// agent (as its kernel watch would).
    pub fn readdress(&mut self, name: &str, removed: bool) {
        self.renewals = self.renewals.wrapping_add(1);
        let (family, renewals) = (self.family, self.renewals);
        let Some(node) = self.nodes.get_mut(name) else {
            return;
        };
        let address = (!removed).then(|| second_address(family, node.index, renewals));
        node.uplinks.second = address;
        node.kernel.readdress(SECOND_UPLINK, address);
        self.wake(name, crate::agent::Input::Kernel);
    }

    /// Moves `name`'s NAT mapping now, when it is behind NAT.
    pub fn move_nat_mapping(&mut self, name: &str) {
        let now = self.now.instant;
        if let Some(node) = self.nodes.get_mut(name).filter(|n| n.behind_nat) {
            node.uplinks.nat_moved = Some(now);
        }
    }
}
