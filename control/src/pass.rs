//! Which stages one reconcile pass runs, decided from what woke it ([`Trigger`]) and what
//! changed since the last pass ([`Changes`]), both plain values: the agent observes, asks
//! these functions, and runs only the stages they name. A check-in that moves nothing but
//! `last-seen` runs none; a resync or a kernel notification lists the host and runs them all.

/// What woke the reconcile loop. Only the resync timer and the kernel's own notifications list
/// the host again; anything else is compared against what kg last read and applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// A Node or Peer changed in the backend.
    Event,
    /// A DNS name is due for re-resolution.
    Dns,
    /// `--resync-period` elapsed: everything is listed and compared again.
    Resync,
    /// The check-in period elapsed: `last-seen` is refreshed.
    CheckIn,
    /// The kernel reported a change to addresses, protocol-static routes or rules.
    Kernel,
    /// The lease period elapsed: leaders are elected again and this node's lease tended.
    Lease,
    /// Readiness flips held back ([`crate::coalesce`]) are due.
    Readiness,
    /// A key rotation's next step is due ([`crate::rotation`]).
    Key,
    /// Post-quantum preshared keys changed ([`crate::pq`]): the device takes them.
    PostQuantum,
    /// A peer moved to another endpoint candidate ([`crate::endpoints`]): the device takes it.
    Endpoints,
    /// The last pass failed and its backoff ran out: the host is listed and every part
    /// compared again.
    Retry,
}

impl Trigger {
    /// True when this reconcile lists the host (links, addresses, routes, rules, iptables, the
    /// device) instead of trusting what kg last read and applied.
    pub fn lists_the_host(self) -> bool {
        matches!(self, Self::Resync | Self::Kernel | Self::Retry)
    }
}

/// What changed since the last pass, as the agent observed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Changes {
    /// The host is listed this pass: the trigger asks for it, it was never listed, or what
    /// address detection reads from the local Node changed.
    pub host: bool,
    /// A Node's content changed.
    pub nodes: bool,
    /// Readiness flips fell due ([`crate::coalesce::ReadinessBatch`]).
    pub readiness: bool,
    /// A firewall write held back fell due ([`crate::coalesce::FirewallHold`]).
    pub firewall: bool,
    /// The valid Peers changed.
    pub peers: bool,
    /// The local node changed beyond its check-in.
    pub local: bool,
    /// A DNS answer changed an endpoint's address.
    pub dns: bool,
    /// A lease changed (or the backend came back, which counts every lease as renewed).
    pub leases: bool,
    /// The post-quantum preshared keys differ from the device's.
    pub keys: bool,
    /// A peer moved to another endpoint candidate.
    pub endpoints: bool,
}

impl Changes {
    /// Whether the host must be listed: `trigger` asks for it, it never was
    /// (`host_known` false), or address detection's inputs changed.
    pub fn host_listing(trigger: Trigger, host_known: bool, detection_changed: bool) -> bool {
        trigger.lists_the_host() || !host_known || detection_changed
    }

    /// True when the DNS names in use may have changed and must be tracked again.
    pub fn names_may_change(&self) -> bool {
        self.host || self.nodes || self.readiness || self.peers || self.local
    }

    /// True when readiness flips alone changed the mesh (no leader moved with them,
    /// `leaders_changed` false): the firewall may then wait ([`crate::coalesce::FirewallHold`]).
    pub fn flips_only(&self, leaders_changed: bool) -> bool {
        self.readiness
            && !(self.host || self.nodes || self.peers || self.local || self.dns || leaders_changed)
    }

    /// True when leaders must be elected again (with lease election on, `leases_on`): anything
    /// they depend on moved, or the lease timer fired (leases expire with time alone). DNS
    /// answers and Peers never move a leader.
    pub fn elect(&self, leases_on: bool, trigger: Trigger) -> bool {
        leases_on
            && (self.host
                || self.nodes
                || self.readiness
                || self.local
                || self.leases
                || trigger == Trigger::Lease)
    }

    /// True when the mesh (topology, then the host state) must be computed again: something
    /// it is made of changed (`leaders_changed`: the election just run moved a leader), or the
    /// last attempt did not settle (`settled` false), which retries it.
    pub fn mesh(&self, leaders_changed: bool, settled: bool) -> bool {
        self.host
            || self.nodes
            || self.readiness
            || self.firewall
            || self.peers
            || self.local
            || self.dns
            || self.keys
            || self.endpoints
            || leaders_changed
            || !settled
    }
}

/// True when a pass that lists the host dumps the kernel's routes and rules too. Only a resync
/// may do without: when the last dump still holds (`last_dump_holds`: there is one, and kg's
/// record of its own routes since was not lost to a failed change) and the kernel's
/// notifications report nothing since that may have changed routing (`quiet`). Routes the
/// cluster adds make a dump cost more; a quiet host then costs a resync none.
pub fn dumps_routes(trigger: Trigger, last_dump_holds: bool, quiet: bool) -> bool {
    !(trigger == Trigger::Resync && last_dump_holds && quiet)
}

/// True when the lease step runs this pass: on the lease timer, with leaders just elected.
pub fn tends_lease(trigger: Trigger, elected: bool) -> bool {
    trigger == Trigger::Lease && elected
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_resync_of_a_quiet_host_keeps_the_last_route_dump() {
        assert!(!dumps_routes(Trigger::Resync, true, true));
        assert!(
            dumps_routes(Trigger::Resync, true, false),
            "a notification came"
        );
        assert!(
            dumps_routes(Trigger::Resync, false, true),
            "no dump, or a failed change"
        );
        assert!(
            dumps_routes(Trigger::Kernel, true, true),
            "the kernel said something changed"
        );
        assert!(
            dumps_routes(Trigger::Event, true, true),
            "detection inputs changed"
        );
    }

    #[test]
    fn a_check_in_that_moved_nothing_runs_no_stage() {
        let quiet = Changes::default();
        assert!(!Changes::host_listing(Trigger::CheckIn, true, false));
        assert!(!quiet.names_may_change());
        assert!(!quiet.elect(true, Trigger::CheckIn));
        assert!(!quiet.mesh(false, true));
        assert!(!tends_lease(Trigger::CheckIn, false));
    }

    #[test]
    fn a_resync_or_a_kernel_change_lists_the_host_and_runs_every_stage() {
        for trigger in [Trigger::Resync, Trigger::Kernel] {
            let host = Changes {
                host: Changes::host_listing(trigger, true, false),
                ..Default::default()
            };
            assert!(host.host, "{trigger:?}");
            assert!(host.names_may_change() && host.elect(true, trigger) && host.mesh(false, true));
        }
        assert!(
            Changes::host_listing(Trigger::Event, false, false),
            "never listed"
        );
        assert!(
            Changes::host_listing(Trigger::Event, true, true),
            "detection changed"
        );
    }

    #[test]
    fn the_lease_timer_elects_and_tends_even_when_nothing_changed() {
        let quiet = Changes::default();
        assert!(quiet.elect(true, Trigger::Lease));
        assert!(tends_lease(Trigger::Lease, true));
        assert!(
            !quiet.mesh(false, true),
            "an election that moved nobody meshes nothing"
        );
        assert!(quiet.mesh(true, true), "a moved leader meshes");
        assert!(
            !quiet.elect(false, Trigger::Lease),
            "Kilo's rule needs no lease timer"
        );
        assert!(!tends_lease(Trigger::Event, true));
    }

    #[test]
    fn dns_answers_and_peers_mesh_without_an_election() {
        for changes in [
            Changes {
                dns: true,
                ..Default::default()
            },
            Changes {
                peers: true,
                ..Default::default()
            },
        ] {
            assert!(!changes.elect(true, Trigger::Dns), "{changes:?}");
            assert!(changes.mesh(false, true), "{changes:?}");
        }
        let dns = Changes {
            dns: true,
            ..Default::default()
        };
        assert!(
            !dns.names_may_change(),
            "an answer changes addresses, not names"
        );
    }

    #[test]
    fn nodes_local_and_leases_elect_and_an_unsettled_mesh_retries() {
        for changes in [
            Changes {
                nodes: true,
                ..Default::default()
            },
            Changes {
                local: true,
                ..Default::default()
            },
            Changes {
                leases: true,
                ..Default::default()
            },
        ] {
            assert!(changes.elect(true, Trigger::Event), "{changes:?}");
        }
        assert!(
            Changes::default().mesh(false, false),
            "a failed apply retries"
        );
    }

    #[test]
    fn flips_alone_are_told_apart_from_flips_with_anything_else() {
        let flips = Changes {
            readiness: true,
            ..Default::default()
        };
        assert!(flips.flips_only(false));
        assert!(flips.mesh(false, true) && flips.elect(true, Trigger::Readiness));
        assert!(!flips.flips_only(true), "a leader moved with them");
        for other in [
            Changes {
                nodes: true,
                ..flips
            },
            Changes { dns: true, ..flips },
            Changes {
                host: true,
                ..flips
            },
        ] {
            assert!(!other.flips_only(false), "{other:?}");
        }
        let firewall = Changes {
            firewall: true,
            ..Default::default()
        };
        assert!(
            firewall.mesh(false, true),
            "a held firewall write falls due"
        );
        assert!(!firewall.flips_only(false) && !firewall.elect(true, Trigger::Readiness));
    }
}
