//! The model's events and faults, and how a byte string decodes to a sequence of them: every
//! byte string is a valid sequence, so a fuzzer's mutations are never wasted on a parse error.

use std::fmt;

/// How many nodes a sequence may have at once.
pub const MAX_NODES: usize = 8;
/// How many locations the nodes are spread over.
pub const LOCATIONS: usize = 3;
/// How many events one sequence may hold (the rest of a longer input is ignored).
pub const MAX_EVENTS: usize = 64;

/// One thing that happens to the cluster, a node or its agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Model time passes, with every agent's timers firing as they fall due.
    Wait {
        /// Seconds.
        secs: u32,
    },
    /// A new node registers in `location` and its agent starts.
    Join {
        /// Its location's number.
        location: usize,
    },
    /// The agent dies at once (SIGKILL, OOM): nothing is cleaned up.
    Kill {
        /// Which node (an index into the nodes, in order of name).
        node: usize,
    },
    /// The agent starts again (it is killed first if it runs), with the WireGuard state it
    /// saved or, as on a node whose last agent was Kilo's, without it.
    Restart {
        /// Which node.
        node: usize,
        /// Whether the saved peers are still on disk.
        with_saved_state: bool,
    },
    /// The node leaves: its agent stops and its Node object is deleted.
    Leave {
        /// Which node.
        node: usize,
    },
    /// The node's location label changes.
    Move {
        /// Which node.
        node: usize,
        /// The new location's number.
        location: usize,
    },
    /// An operator writes a malformed annotation on the node.
    Break {
        /// Which node.
        node: usize,
        /// Which of [`BROKEN_ANNOTATIONS`].
        which: usize,
    },
    /// The malformed annotations are removed.
    Mend {
        /// Which node.
        node: usize,
    },
    /// The node is cordoned (`spec.unschedulable`) or uncordoned.
    Cordon {
        /// Which node.
        node: usize,
        /// Cordoned or not.
        on: bool,
    },
    /// The node is annotated `kilo.squat.ai/leader` (preferred as its location's leader), or
    /// the annotation is removed.
    Prefer {
        /// Which node.
        node: usize,
        /// Annotated or not.
        on: bool,
    },
    /// The node's agent loses the API server (its watch stops, its writes fail), or gets it
    /// back.
    Outage {
        /// Which node.
        node: usize,
        /// Cut off or not.
        on: bool,
    },
    /// The node's WireGuard port is blocked (a firewall, a broken uplink) while its API
    /// connection stays up, or opened again.
    Block {
        /// Which node.
        node: usize,
        /// Blocked or not.
        on: bool,
    },
    /// Every agent loses the API server at once, or gets it back.
    OutageAll {
        /// Cut off or not.
        on: bool,
    },
    /// The node goes behind NAT (annotated with a persistent keepalive, as Kilo's NATed nodes
    /// are), or comes out. Not a fault: it stays when the faults stop.
    Nat {
        /// Which node.
        node: usize,
        /// Behind NAT or not.
        on: bool,
    },
    /// The node's kernel refuses every change of links, addresses and routes (its agent's
    /// passes fail and are retried), or takes them again.
    Refuse {
        /// Which node.
        node: usize,
        /// Refusing or not.
        on: bool,
    },
    /// The node's addresses or the paths to them change.
    Endpoint {
        /// Which node.
        node: usize,
        /// What changes.
        change: EndpointChange,
    },
    /// A Kilo Peer is added (a valid one, or one with a malformed field), or removed.
    Peer {
        /// Which of three Peers.
        which: usize,
        /// Added (valid or not) or removed.
        change: PeerChange,
    },
}

/// What happens to a node's addresses or the paths to them: what its peers' choice among its
/// endpoint candidates meets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointChange {
    /// Packets to its address on an uplink (0: `eth0`, Kilo's endpoint; 1: `eth1`) are
    /// dropped (a firewall rule, a broken route), or get through again.
    BlackHole {
        /// Which uplink.
        uplink: usize,
        /// Black-holed or not.
        on: bool,
    },
    /// Its second uplink's address is removed.
    AddressRemoved,
    /// Its second uplink gets a new address.
    AddressRenewed,
    /// Its NAT maps it to a new public port (when it is behind NAT).
    NatMoved,
}

/// What happens to a Peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerChange {
    /// Added or replaced, valid.
    Valid,
    /// Added or replaced with a malformed allowed IP.
    Malformed,
    /// Deleted.
    Removed,
}

/// Malformed annotations an operator might write, each with the annotation it breaks.
pub const BROKEN_ANNOTATIONS: [(&str, &str); 5] = [
    ("kilo.squat.ai/force-endpoint", "not an endpoint"),
    ("kilo.squat.ai/allowed-location-ips", "10.0.0.0/33,garbage"),
    ("kilo.squat.ai/persistent-keepalive", "-5"),
    ("kilo.squat.ai/force-internal-ip", "300.1.2.3/24"),
    ("kilo.squat.ai/location", ""),
];

/// Reads values from a byte string; past its end every value is zero.
struct Bytes<'a> {
    data: &'a [u8],
}

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((first, rest)) => {
                self.data = rest;
                *first
            }
            None => 0,
        }
    }

    fn below(&mut self, bound: usize) -> usize {
        usize::from(self.byte()) % bound
    }

    fn flag(&mut self) -> bool {
        self.byte() & 1 == 1
    }
}

/// The sequence `input` stands for: one event per leading byte and its arguments.
pub fn decode(input: &[u8]) -> Vec<Event> {
    let mut bytes = Bytes { data: input };
    let mut events = Vec::new();
    while !bytes.data.is_empty() && events.len() < MAX_EVENTS {
        let node = |b: &mut Bytes| b.below(MAX_NODES);
        // Waits and restarts weigh most: faults need time to play out, and a dead node
        // tells the converged mesh little.
        let event = match bytes.below(23) {
            0..=3 => Event::Wait {
                secs: 1 + bytes.below(40) as u32,
            },
            4 | 5 => Event::Join {
                location: bytes.below(LOCATIONS),
            },
            6 => Event::Kill {
                node: node(&mut bytes),
            },
            7..=9 => Event::Restart {
                node: node(&mut bytes),
                with_saved_state: bytes.flag(),
            },
            10 => Event::Leave {
                node: node(&mut bytes),
            },
            11 => Event::Move {
                node: node(&mut bytes),
                location: bytes.below(LOCATIONS),
            },
            12 => Event::Break {
                node: node(&mut bytes),
                which: bytes.below(BROKEN_ANNOTATIONS.len()),
            },
            13 => Event::Mend {
                node: node(&mut bytes),
            },
            14 => Event::Cordon {
                node: node(&mut bytes),
                on: bytes.flag(),
            },
            15 => Event::Prefer {
                node: node(&mut bytes),
                on: bytes.flag(),
            },
            16 => Event::Outage {
                node: node(&mut bytes),
                on: bytes.flag(),
            },
            17 => Event::OutageAll { on: bytes.flag() },
            18 => Event::Block {
                node: node(&mut bytes),
                on: bytes.flag(),
            },
            19 => Event::Endpoint {
                node: node(&mut bytes),
                change: match bytes.below(4) {
                    0 => EndpointChange::BlackHole {
                        uplink: bytes.below(2),
                        on: bytes.flag(),
                    },
                    1 => EndpointChange::AddressRemoved,
                    2 => EndpointChange::AddressRenewed,
                    _ => EndpointChange::NatMoved,
                },
            },
            20 => Event::Refuse {
                node: node(&mut bytes),
                on: bytes.flag(),
            },
            21 => Event::Nat {
                node: node(&mut bytes),
                on: bytes.flag(),
            },
            _ => Event::Peer {
                which: bytes.below(3),
                change: match bytes.below(3) {
                    0 => PeerChange::Valid,
                    1 => PeerChange::Malformed,
                    _ => PeerChange::Removed,
                },
            },
        };
        events.push(event);
    }
    events
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Wait { secs } => write!(f, "wait {secs} s"),
            Self::Join { location } => write!(f, "a node joins location l{location}"),
            Self::Kill { node } => write!(f, "kill node #{node}"),
            Self::Restart {
                node,
                with_saved_state,
            } => write!(
                f,
                "restart node #{node} {}",
                if *with_saved_state {
                    "with its saved state"
                } else {
                    "without saved state"
                }
            ),
            Self::Leave { node } => write!(f, "node #{node} leaves"),
            Self::Move { node, location } => write!(f, "node #{node} moves to l{location}"),
            Self::Break { node, which } => write!(
                f,
                "node #{node} gets {}={:?}",
                BROKEN_ANNOTATIONS[*which].0, BROKEN_ANNOTATIONS[*which].1
            ),
            Self::Mend { node } => write!(f, "node #{node}'s malformed annotations removed"),
            Self::Cordon { node, on } => write!(f, "node #{node} cordoned: {on}"),
            Self::Prefer { node, on } => write!(f, "node #{node} annotated leader: {on}"),
            Self::Outage { node, on } => write!(f, "node #{node} cut off from the API: {on}"),
            Self::OutageAll { on } => write!(f, "every node cut off from the API: {on}"),
            Self::Block { node, on } => write!(f, "node #{node}'s WireGuard port blocked: {on}"),
            Self::Nat { node, on } => write!(f, "node #{node} behind NAT: {on}"),
            Self::Refuse { node, on } => {
                write!(f, "node #{node}'s kernel refuses changes: {on}")
            }
            Self::Endpoint { node, change } => match change {
                EndpointChange::BlackHole { uplink, on } => {
                    write!(f, "node #{node}'s uplink {uplink} black-holed: {on}")
                }
                EndpointChange::AddressRemoved => {
                    write!(f, "node #{node}'s second uplink loses its address")
                }
                EndpointChange::AddressRenewed => {
                    write!(f, "node #{node}'s second uplink gets a new address")
                }
                EndpointChange::NatMoved => write!(f, "node #{node}'s NAT mapping moves"),
            },
            Self::Peer { which, change } => write!(f, "Peer p{which}: {change:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_string_decodes_and_the_empty_one_to_nothing() {
        assert!(decode(&[]).is_empty());
        assert_eq!(decode(&[0, 9]), vec![Event::Wait { secs: 10 }]);
        assert_eq!(
            decode(&[7, 2, 1, 17]),
            vec![
                Event::Restart {
                    node: 2,
                    with_saved_state: true
                },
                Event::OutageAll { on: false }
            ]
        );
        let long = vec![3u8; 1000];
        assert_eq!(decode(&long).len(), MAX_EVENTS);
    }
}
