//! The shells' side of a key rotation ([`control::rotation`]): the next key written to disk,
//! then made the key on disk and the device's. The private keys are never logged.

use control::clock::Now;
use control::rotation::RotationStep;
use control::Key;
use dataplane::SecretKey;

use super::shells::keyfile;
use super::shells::{Device, Firewall, Kernel};
use super::Agent;

impl<N: Kernel, F: Firewall, W: Device> Agent<N, F, W> {
    /// Carries out `step` at `now`. A step that fails is said and retried at the next pass;
    /// the key in use stays.
    pub(super) fn rotate_key(&mut self, step: RotationStep, now: Now) {
        let path = &self.settings.args.key_file;
        match step {
            RotationStep::MakeNextKey { request } => {
                let next = SecretKey::generate();
                if let Err(e) = keyfile::store_next(path, &next, request.as_deref()) {
                    self.say_rotation_failed("storing the next key", &e);
                    return;
                }
                let public = Key(*next.public_key().as_bytes());
                self.next_key = Some(next);
                self.core.key_prepared(public, request);
            }
            RotationStep::Commit => {
                let Some(next) = self.next_key.clone() else {
                    return;
                };
                if let Err(e) = keyfile::commit_next(path, &next) {
                    self.say_rotation_failed("storing the next key as the key", &e);
                    return;
                }
                self.key = next;
                self.next_key = None;
                self.core.key_committed(now);
                self.metrics.keys.key_rotations.inc();
                // The ML-KEM key changes with it: no exchange made under the old keys carries
                // over.
                if self.pq.is_some() {
                    let identity = match super::pq::PqShell::renew(path) {
                        Ok(identity) => Some(identity),
                        Err(e) => {
                            let line = format!("key rotation: making a new ML-KEM key failed: {e:#}; the old one stays");
                            tracing::warn!("{line}");
                            self.status.error(line);
                            None
                        }
                    };
                    self.core.pq_key_committed(self.key.clone(), identity);
                }
            }
        }
    }

    fn say_rotation_failed(&mut self, what: &str, e: &anyhow::Error) {
        let line = format!("key rotation: {what} failed: {e:#}; the key in use stays");
        tracing::warn!("{line}");
        self.status.error(line);
    }
}
