//! Handshake initiations that arrived a moment before their sender was configured.
//!
//! When two nodes learn of each other at nearly the same time (a new leader taking over a
//! location, a node joining the mesh), one side's first initiation can reach the other before
//! that side has added it as a peer. WireGuard drops such a message, and the initiator tries
//! again only after `REKEY_TIMEOUT` (5 s): a 5 s hole in a failover that otherwise takes well
//! under a second. The engine instead holds a few of these initiations (they have already
//! passed the MAC check and the static key inside them decrypted, so they are well formed and
//! addressed to us) and answers them at the next timer tick if their sender has been added by
//! then. An initiation not claimed within [`HOLD_FOR`] is forgotten: by then its sender has
//! sent a fresh one.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::endpoint::Endpoint;
use crate::key::PublicKey;

/// How long an initiation is held: WireGuard's `REKEY_TIMEOUT`, after which its sender retries.
const HOLD_FOR: Duration = Duration::from_secs(5);
/// Most initiations held at once; beyond it the oldest goes.
const HELD_KEPT: usize = 32;
/// Length of a WireGuard handshake initiation.
const INITIATION_LEN: usize = 148;

/// One held initiation.
struct Held {
    at: Instant,
    /// Where it came from, and the local address it reached: the answer leaves from there.
    from: Endpoint,
    sender: PublicKey,
    message: [u8; INITIATION_LEN],
}

/// A small queue of initiations from keys that are not peers (yet).
#[derive(Default)]
pub(crate) struct HeldInitiations {
    held: Mutex<VecDeque<Held>>,
}

impl HeldInitiations {
    /// Holds `message`, an initiation from `sender` (not a configured peer) received from
    /// `from` at `now`. A newer initiation from the same key replaces the older one. Never
    /// waits: under contention the message is simply not held.
    pub(crate) fn hold(&self, now: Instant, from: Endpoint, sender: PublicKey, message: &[u8]) {
        let Ok(message) = <[u8; INITIATION_LEN]>::try_from(message) else {
            return;
        };
        let Some(mut held) = self.held.try_lock() else {
            return;
        };
        held.retain(|h| h.sender != sender);
        if held.len() == HELD_KEPT {
            held.pop_front();
        }
        held.push_back(Held {
            at: now,
            from,
            sender,
            message,
        });
    }

    /// Removes and returns, oldest first, the held initiations whose sender `is_peer` now
    /// says is configured; forgets those older than [`HOLD_FOR`]. Nothing is allocated when
    /// nothing is claimed.
    pub(crate) fn take_claimed(
        &self,
        now: Instant,
        is_peer: impl Fn(&PublicKey) -> bool,
    ) -> Vec<(Endpoint, [u8; INITIATION_LEN])> {
        let mut claimed = Vec::new();
        self.held.lock().retain(|h| {
            if now.saturating_duration_since(h.at) >= HOLD_FOR {
                false
            } else if is_peer(&h.sender) {
                claimed.push((h.from, h.message));
                false
            } else {
                true
            }
        });
        claimed
    }

    /// How many initiations are held.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.held.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::SecretKey;

    fn key() -> PublicKey {
        SecretKey::generate().public_key()
    }

    fn from(n: u8) -> Endpoint {
        std::net::SocketAddr::from(([192, 0, 2, n], 51820)).into()
    }

    #[test]
    fn only_initiations_are_held_and_a_newer_one_replaces_the_older() {
        let held = HeldInitiations::default();
        let (now, sender) = (Instant::now(), key());
        held.hold(now, from(1), sender, &[1; 32]);
        assert_eq!(held.len(), 0, "not an initiation's length");
        held.hold(now, from(1), sender, &[1; INITIATION_LEN]);
        held.hold(now, from(2), sender, &[2; INITIATION_LEN]);
        assert_eq!(held.len(), 1);
        let claimed = held.take_claimed(now, |k| *k == sender);
        assert_eq!(claimed.len(), 1);
        assert_eq!(claimed[0].0, from(2));
        assert_eq!(claimed[0].1[0], 2);
        assert_eq!(held.len(), 0);
    }

    #[test]
    fn unclaimed_initiations_stay_until_they_expire() {
        let held = HeldInitiations::default();
        let (now, stranger) = (Instant::now(), key());
        held.hold(now, from(1), stranger, &[0; INITIATION_LEN]);
        assert!(held.take_claimed(now, |_| false).is_empty());
        assert_eq!(held.len(), 1);
        assert!(held.take_claimed(now + HOLD_FOR, |_| true).is_empty());
        assert_eq!(held.len(), 0, "expired, not claimed");
    }

    #[test]
    fn the_oldest_goes_when_full() {
        let held = HeldInitiations::default();
        let now = Instant::now();
        let keys: Vec<_> = (0..=HELD_KEPT).map(|_| key()).collect();
        for k in &keys {
            held.hold(now, from(1), *k, &[0; INITIATION_LEN]);
        }
        assert_eq!(held.len(), HELD_KEPT);
        assert!(held.take_claimed(now, |k| *k == keys[0]).is_empty());
        assert_eq!(held.take_claimed(now, |k| *k == keys[HELD_KEPT]).len(), 1);
    }
}
