//! The key rotation step of a pass ([`control::rotation`]): what the node's own Node asks for,
//! and what the shells report back when the next key is on disk and when it is in use.

use control::clock::Now;
use control::journal::Reason;
use control::node::annotation;
use control::rotation::{RotationInputs, RotationStep};
use control::Key;

use k8s_openapi::api::core::v1::Node as KubeNode;

use super::Reconciler;

impl Reconciler {
    /// Takes over a rotation found on disk at start (`next`: the next key and the request it
    /// answers) and when the key in use was made (Unix milliseconds).
    pub fn resume_rotation(&mut self, next: Option<(Key, Option<String>)>, key_made_ms: i64) {
        if let Some((key, _)) = &next {
            let line = format!("resuming a key rotation: the next key {key} is on disk");
            self.journal
                .record(Reason::KeyRotation, &self.config.hostname, line);
        }
        self.rotation = control::rotation::Rotation::resumed(next);
        self.key_made_ms = key_made_ms;
    }

    /// The rotation step due at `now`, if any, for the local Node `local_object`.
    pub(super) fn rotation_step(
        &mut self,
        local_object: Option<&KubeNode>,
        now: Now,
    ) -> Option<RotationStep> {
        let annotations = local_object?.metadata.annotations.as_ref();
        let get = |name| annotations.and_then(|a| a.get(name)).map(String::as_str);
        let inputs = RotationInputs {
            requested: get(annotation::ROTATE_KEY)
                .filter(|id| !id.is_empty() && !id.chars().any(char::is_whitespace)),
            rotated: get(annotation::KEY_ROTATED),
            published_next: get(annotation::NEXT_KEY).and_then(|k| Key::parse(k).ok()),
            key_made_ms: self.key_made_ms,
            period_ms: self
                .config
                .key_rotation
                .and_then(|p| i64::try_from(p.as_millis()).ok()),
        };
        self.rotation.step(&inputs, now.unix_ms)
    }

    /// The next key `key`, answering `request`, is on disk: the annotations publish it.
    pub fn key_prepared(&mut self, key: Key, request: Option<String>) {
        let line = format!(
            "key rotation: next key {key} made (request {}), publishing it beside the current one",
            request.as_deref().unwrap_or("period")
        );
        self.journal
            .record(Reason::KeyRotation, &self.config.hostname, line);
        self.rotation.prepared(key, request);
    }

    /// The next key is on disk as the key and is the device's from this pass on: the mesh is
    /// applied again and the annotations publish it as `kilo.squat.ai/key`.
    pub fn key_committed(&mut self, now: Now) {
        if let Some(key) = self.rotation.committed() {
            let line = format!(
                "key rotation: using the next key {key} (was {})",
                self.public
            );
            self.journal
                .record(Reason::KeyRotation, &self.config.hostname, line);
            self.public = key;
            self.key_made_ms = now.unix_ms;
            self.settled = false;
            self.converged_whole = false;
        }
    }

    /// The key this node publishes and its device uses.
    pub fn public_key(&self) -> Key {
        self.public
    }

    /// When the rotation's next step is due without an event: the commit, a grace after the
    /// next key was seen published, or the period's end.
    pub fn rotation_deadline(&self) -> Option<std::time::Instant> {
        let at = self.ingested_at?;
        let commit = self.rotation.deadline_ms();
        let period = match (&self.rotation.next, self.config.key_rotation) {
            (None, Some(p)) => i64::try_from(p.as_millis())
                .ok()
                .map(|p| self.key_made_ms.saturating_add(p)),
            _ => None,
        };
        let due = commit.into_iter().chain(period).min()?;
        let after = u64::try_from(due - at.unix_ms).unwrap_or(0);
        Some(at.instant + std::time::Duration::from_millis(after))
    }
}
