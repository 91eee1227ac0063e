//! **Replicas agree**: every control-plane node that has applied the whole committed log
//! holds a state machine equal to the one built by applying that log once (the
//! state machine is deterministic: docs/guarantees.md G6, docs/ARCHITECTURE.md
//! invariant 2), and after healing at least a majority has caught up.

use super::{fail, Violation};
use crate::world::World;

const NAME: &str = "replicas";

/// The end-of-run check.
pub fn check_end(w: &World) -> Result<(), Violation> {
    let n = w.cp.committed.len();
    let mut caught_up = 0;
    for (i, r) in w.cp.replicas.iter().enumerate() {
        if r.up && r.applied == n {
            caught_up += 1;
            if r.state != w.oracle.fed {
                return fail(
                    NAME,
                    w.now_ms,
                    format!("node {i} applied all {n} committed entries but its state differs"),
                );
            }
        }
    }
    if caught_up < w.cp.replicas.len() / 2 + 1 {
        return fail(
            NAME,
            w.now_ms,
            format!(
                "only {caught_up} of {} nodes applied the committed log after healing",
                w.cp.replicas.len()
            ),
        );
    }
    Ok(())
}
