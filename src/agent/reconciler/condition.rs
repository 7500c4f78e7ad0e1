//! The node condition `KiloMeshReady` ([`control::condition`]): the reconciler judges the node
//! from what the driver read and says which write is due; the driver sends it.

use control::condition::{ConditionWrite, MeshInputs};

use super::Reconciler;

impl Reconciler {
    /// The condition write due at `now_ms` for the node as `inputs` show it, if any.
    pub fn condition_due(&mut self, inputs: &MeshInputs, now_ms: i64) -> Option<ConditionWrite> {
        let judged = self.mesh_watch.judge(inputs, now_ms);
        self.condition_book.due(&judged, now_ms)
    }

    /// Records that `write` was sent (taken or refused: a refused one is not tried again
    /// before the next change or heartbeat).
    pub fn condition_sent(&mut self, write: ConditionWrite) {
        self.condition_book.written(write);
    }

    /// True until the Node's own `KiloMeshReady` (the last run's) was read or a condition was
    /// written: the driver reads it once, before the first write.
    pub fn condition_wants_present(&self) -> bool {
        self.condition_book.wants_present()
    }

    /// Takes the Node's own condition as read (`None`: it has none), so an unchanged status
    /// keeps its `lastTransitionTime` across a restart.
    pub fn condition_adopt(&mut self, present: Option<ConditionWrite>) {
        self.condition_book.adopt(present);
    }
}
