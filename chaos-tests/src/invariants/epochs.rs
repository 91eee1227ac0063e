//! **Epochs only move forward** at each agent: the lease epoch an agent holds (in memory,
//! or on its disk while it is down) never decreases, across restarts included
//! (`AgentLease::on_lease` refuses older epochs; the journal saves every adopted lease
//! before it is acknowledged).
//!
//! A standby that takes over has none of that disk: it starts from the state the
//! leader kept in the cluster (or from nothing, if that is unreadable). Its epochs only
//! move forward from there, and what it starts from is never a lease the control plane
//! stopped counting: a kept lease's epoch is at least the highest epoch the control
//! plane saw acknowledged (reports acknowledge no newer lease than the kept state
//! holds). A kept state with no lease at all (a process that took over from an
//! unreadable state keeps what it holds: nothing, until the control plane answers) is
//! no such lease: a standby starting from it admits no governed pod until it hears
//! from the control plane.

use super::{fail, Violation};
use crate::world::World;

const NAME: &str = "epochs";

/// Checks and advances `last` (one entry per agent: the epoch, and the takeovers seen).
pub fn check(w: &World, last: &mut [(u64, u64)]) -> Result<(), Violation> {
    for (a, (prev, takeovers)) in w.agents.iter().zip(last.iter_mut()) {
        let e = if a.serving_now() {
            a.state.lease.held_epoch()
        } else if a.up {
            // Restoring the kept state before the webhook serves: it starts from that.
            let kept = a.kept.as_ref().and_then(|k| k.lease_epoch()).unwrap_or(0);
            a.state.lease.held_epoch().max(kept)
        } else if a.standby_next {
            // What the standby will start from.
            if a.kept_corrupt {
                0
            } else {
                a.kept.as_ref().and_then(|k| k.lease_epoch()).unwrap_or(0)
            }
        } else {
            // A restart reads its journal's lease and the kept state.
            let kept = if a.kept_corrupt {
                0
            } else {
                a.kept.as_ref().and_then(|k| k.lease_epoch()).unwrap_or(0)
            };
            a.disk_epoch.max(kept)
        };
        if a.takeovers > *takeovers {
            *takeovers = a.takeovers;
            let acked = w.oracle.fed.clusters().get(&a.id).map_or(0, |r| r.leases.acked_epoch);
            let kept = a.kept.as_ref().and_then(|k| k.lease_epoch());
            if let Some(kept) = kept.filter(|k| *k < acked) {
                return fail(NAME, w.now_ms, format!("{}: the standby starts from kept epoch {kept}, older than epoch {acked} the control plane saw acknowledged", a.id));
            }
            *prev = e;
            continue;
        }
        if e < *prev {
            return fail(
                NAME,
                w.now_ms,
                format!("{} went back from epoch {} to {e}", a.id, *prev),
            );
        }
        *prev = e;
    }
    Ok(())
}
