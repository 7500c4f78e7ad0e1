//! What is due when: the moments a pass is wanted without an event (held readiness flips and
//! firewall writes, a lease running out, a DNS lookup), and the DNS lookups themselves.

use control::clock::Now;
use control::dns::Answer;
use control::node::Node;

use super::Reconciler;

impl Reconciler {
    /// When the readiness flips or the firewall write held back are due: `None` when none
    /// is held.
    pub fn readiness_deadline(&self) -> Option<std::time::Instant> {
        let batch = self.readiness_batch.deadline();
        let firewall = self.firewall_hold.deadline();
        batch.into_iter().chain(firewall).min()
    }

    /// When the lease step is next due before its timer: the moment a lease this node saw
    /// held expires unless renewed, so that a dead leader's successor is elected (and every
    /// node routes through it) when its lease runs out, not up to a lease step later. `None`
    /// without leases, or while the backend is unreachable.
    pub fn lease_deadline(&self) -> Option<std::time::Instant> {
        let at = self.ingested_at?;
        if !self.leases_on() {
            return None;
        }
        let expiry = self.leases.next_expiry_ms(at.unix_ms)?;
        let after = u64::try_from(expiry - at.unix_ms).ok()?;
        Some(at.instant + std::time::Duration::from_millis(after))
    }

    /// When the next DNS lookup is due (`None`: no name to resolve).
    pub fn dns_deadline(&self) -> Option<std::time::Instant> {
        self.dns.next_deadline()
    }

    /// The DNS names whose lookup is due at `now`, marked as asked.
    pub fn start_lookups(&mut self, now: Now) -> Vec<String> {
        self.dns.start(now.instant)
    }

    /// Takes in lookup answers that came at `now` (a failure keeps the last good address);
    /// returns how many failed. The next pass computes the mesh again when an address changed.
    pub fn take_lookups(
        &mut self,
        answers: Vec<(String, Result<std::net::IpAddr, String>)>,
        now: Now,
    ) -> usize {
        let mut failed = 0;
        for (name, result) in answers {
            let error = result.as_ref().err().cloned();
            match self.dns.record(&name, result, now.instant) {
                Answer::Changed { old, new } => {
                    self.dns_changed = true;
                    tracing::info!(name = %name, ?old, %new, "DNS endpoint resolved")
                }
                Answer::Failed { kept } => {
                    failed += 1;
                    tracing::warn!(name = %name, error = error.unwrap_or_default(), ?kept, "DNS lookup failed; keeping the last good address");
                }
                Answer::Unchanged | Answer::Untracked => {}
            }
        }
        failed
    }

    /// Tracks every DNS name in use (Nodes, ready or not, and Peers) for re-resolution.
    pub(super) fn track_dns_names(&mut self, local: &Node, now: Now) {
        let hostname = &self.s.hostname;
        let names: Vec<String> = self
            .table
            .iter()
            .map(|(n, _)| n)
            .filter(|n| n.name != *hostname)
            .chain(std::iter::once(local))
            .filter_map(|n| n.endpoint.as_ref()?.dns_name().map(str::to_string))
            .chain(
                self.peers
                    .iter()
                    .filter_map(|p| p.endpoint.as_ref()?.dns_name().map(str::to_string)),
            )
            .collect();
        self.dns
            .track(names.iter().map(String::as_str), now.instant);
    }
}
