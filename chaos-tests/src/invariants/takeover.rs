//! **Takeover**: a new agent process (the same replica restarted, or the standby) goes
//! on enforcing at once. When it starts and the state the last leader kept in the
//! cluster holds a lease that is still valid (its kept life minus the margin has not
//! run out), the new process enforces that lease's budgets right away, partition or
//! not: a pod that fits under them is admitted. (That it never enforces more than the
//! control plane accounts for is [`super::partition_safety`]'s business.)

use super::{fail, Violation};
use crate::world::World;

const NAME: &str = "takeover";

/// Fails on the first restore that did not enforce a still-valid kept lease.
pub fn check(w: &World) -> Result<(), Violation> {
    for a in &w.agents {
        if let Some(v) = a.restore_violations.first() {
            return fail(NAME, w.now_ms, v.clone());
        }
    }
    Ok(())
}
