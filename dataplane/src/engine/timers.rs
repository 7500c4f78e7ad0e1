//! The engine's clock-driven work: boringtun's timers (handshake retries, rekeys, passive
//! keepalives) and persistent keepalives, run every [`TIMER_TICK`](super::TIMER_TICK).

use std::time::{Duration, Instant};

use boringtun::noise::errors::WireGuardError;
use boringtun::noise::TunnResult;

use super::peer::{PeerCore, PeerShared};
use super::{eager_retry_after, Engine, GaveUp, EAGER_RETRIES, KEEPALIVE_TIMEOUT, MIN_OUTPUT};
use crate::config::PeerConfig;
use crate::endpoint::Endpoint;
use crate::outbox::{offset_within, Outbox};

impl Engine {
    /// Runs every peer's timers: handshake retries, rekeys, passive and persistent keepalives.
    /// First it answers the initiations held because their sender was not a peer when they
    /// arrived, if it is one now (see [`super::held`]). Call every [`TIMER_TICK`].
    ///
    /// Returns the peers whose handshake boringtun gave up on at this tick, each once until a
    /// handshake with it completes again: a caller can say so in one line however many there
    /// are (boringtun's own lines, one per peer and retry, are not for an operator).
    pub fn handle_timers(&self, now: Instant, out: &mut Outbox) -> GaveUp {
        let mut gave_up = GaveUp::default();
        let state = self.state.load();
        let claimed = self
            .held
            .take_claimed(now, |key| state.peers.contains_key(key));
        for (from, message) in &claimed {
            self.handle_datagram(now, *from, message, out);
        }
        if let Some(identity) = &state.identity {
            let mut last = self.last_rate_reset.lock();
            if last.is_none_or(|at| now.duration_since(at) >= Duration::from_secs(1)) {
                identity.rate_limiter.reset_count();
                *last = Some(now);
            }
        }
        let local = state
            .identity
            .as_ref()
            .map_or([0; 32], |i| *i.public_key.as_bytes());
        for key in &state.order {
            let entry = &state.peers[key];
            let shared = &entry.shared;
            let mut core = shared.core.lock();
            let endpoint = core.destination();
            let unshaken = core.last_handshake.is_none() && endpoint.is_some();
            let rekey = std::mem::take(&mut core.rekey_due);
            let initiate = (std::mem::take(&mut core.handshake_due) && unshaken) || rekey;
            let retry = !initiate && unshaken && core.eager_retry.is_some_and(|(at, _)| now >= at);
            let after = |left| eager_retry_after(&local, key.as_bytes(), left);
            if initiate {
                core.eager_retry = Some((now + after(EAGER_RETRIES), EAGER_RETRIES));
            } else if retry {
                core.eager_retry = core
                    .eager_retry
                    .and_then(|(_, left)| (left > 1).then(|| (now + after(left - 1), left - 1)));
            }
            let Some(tunn) = core.tunn.as_mut() else {
                continue;
            };
            let slot = out.to_network.reserve(MIN_OUTPUT);
            let base = slot.as_ptr();
            let result = if initiate || retry {
                // A retry replaces the unanswered initiation (a new ephemeral key and index).
                tunn.format_handshake_initiation(slot, retry || rekey)
            } else {
                tunn.update_timers(slot)
            };
            let sent = match result {
                TunnResult::Err(WireGuardError::ConnectionExpired) => {
                    out.to_network.abort();
                    if !core.gave_up {
                        core.gave_up = true;
                        gave_up.note(*key);
                    }
                    false
                }
                TunnResult::WriteToNetwork(packet) if endpoint.is_some() => {
                    let (offset, len) = (offset_within(base, packet), packet.len());
                    // boringtun's timers send initiations and passive keepalives, never data.
                    shared.note_sent(&mut core, packet, false, now);
                    out.to_network.commit(endpoint, offset, len);
                    shared.add_tx(len);
                    true
                }
                _ => {
                    out.to_network.abort();
                    false
                }
            };
            if sent {
                core.sent_at(now);
            }
            self.persistent_keepalive(&entry.config, &mut core, shared, now, out);
            self.passive_keepalive(&mut core, shared, now, out);
        }
        gave_up
    }

    /// WireGuard's passive keepalive, timed exactly as the kernel times it: data that arrived
    /// and that nothing sent has followed for [`KEEPALIVE_TIMEOUT`] gets a keepalive. boringtun
    /// has one too, but its timers count in ticks, and a request and its response within one
    /// tick leave it silent: the peer whose data came last would never hear back.
    fn passive_keepalive(
        &self,
        core: &mut PeerCore,
        shared: &PeerShared,
        now: Instant,
        out: &mut Outbox,
    ) {
        let due = core
            .unacknowledged_since
            .is_some_and(|at| now.saturating_duration_since(at) >= KEEPALIVE_TIMEOUT);
        let (true, Some(endpoint)) = (due, core.destination()) else {
            return;
        };
        if send_keepalive(core, shared, endpoint, now, out) {
            core.sent_at(now);
        }
    }

    fn persistent_keepalive(
        &self,
        config: &PeerConfig,
        core: &mut PeerCore,
        shared: &PeerShared,
        now: Instant,
        out: &mut Outbox,
    ) {
        let interval = Duration::from_secs(u64::from(config.persistent_keepalive));
        let Some(endpoint) = core.destination() else {
            return;
        };
        if interval.is_zero() {
            return;
        }
        let last_traffic = core.last_sent.max(core.last_received);
        let due = core.keepalive_due
            || last_traffic.is_none_or(|at| now.saturating_duration_since(at) >= interval);
        if !due {
            return;
        }
        if send_keepalive(core, shared, endpoint, now, out) {
            core.keepalive_due = false;
            core.sent_at(now);
        }
    }
}

/// Sends a keepalive to `endpoint` (a handshake initiation instead while the peer has no
/// session, as boringtun's `encapsulate` does). False when the device has no private key yet,
/// so nothing could be sent; the caller then leaves its timer due.
fn send_keepalive(
    core: &mut PeerCore,
    shared: &PeerShared,
    endpoint: Endpoint,
    now: Instant,
    out: &mut Outbox,
) -> bool {
    let Some(tunn) = core.tunn.as_mut() else {
        return false;
    };
    let slot = out.to_network.reserve(MIN_OUTPUT);
    let base = slot.as_ptr();
    match tunn.encapsulate(&[], slot) {
        TunnResult::WriteToNetwork(packet) => {
            let (offset, len) = (offset_within(base, packet), packet.len());
            shared.note_sent(core, packet, false, now);
            out.to_network.commit(Some(endpoint), offset, len);
            shared.add_tx(len);
        }
        _ => out.to_network.abort(),
    }
    true
}
