//! **Epochs only move forward** at each agent: the lease epoch an agent holds (in memory,
//! or on its disk while it is down) never decreases, across restarts included
//! (`AgentLease::on_lease` refuses older epochs; the journal saves every adopted lease
//! before it is acknowledged).

use super::{fail, Violation};
use crate::world::World;

const NAME: &str = "epochs";

/// Checks and advances `last` (one entry per agent).
pub fn check(w: &World, last: &mut [u64]) -> Result<(), Violation> {
    for (a, prev) in w.agents.iter().zip(last.iter_mut()) {
        let e = if a.up {
            a.state.lease.held_epoch()
        } else {
            a.saved_lease.as_ref().map_or(0, |l| l.epoch)
        };
        if e < *prev {
            return fail(NAME, w.now_ms, format!("{} went back from epoch {} to {e}", a.id, *prev));
        }
        *prev = e;
    }
    Ok(())
}
