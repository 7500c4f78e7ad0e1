//! The node condition `KiloMeshReady` ([`control::condition`]): the reconciler judges the node
//! from what the driver read and says which write is due; the driver sends it.

use control::condition::{ConditionWrite, LinkChange, MeshInputs, DOWN_WINDOW_MS};
use control::journal::Reason;

use super::Reconciler;

impl Reconciler {
    /// Judges the node at `now_ms` as `inputs` show it: records each tunnel that went down or
    /// came back (`LinkDown`, `LinkUp`), and returns the condition write due, if any.
    pub fn condition_due(&mut self, inputs: &MeshInputs, now_ms: i64) -> Option<ConditionWrite> {
        let judged = self.mesh_watch.judge(inputs, now_ms);
        for change in self.mesh_watch.take_link_changes() {
            match change {
                LinkChange::Down { name } => {
                    let message = format!(
                        "the tunnel to {name} was sent to and answered nothing for {} s",
                        DOWN_WINDOW_MS / 1000
                    );
                    self.journal.record(Reason::LinkDown, name, message);
                }
                LinkChange::Up { name, down_ms } => {
                    let message = format!(
                        "the tunnel to {name} answers again, after {:.0} s judged down",
                        down_ms as f64 / 1000.0
                    );
                    self.journal.record(Reason::LinkUp, name, message);
                }
            }
        }
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
