//! **Partition safety** (docs/guarantees.md G14 (a)), against ground
//! truth, after every step. For every tenant `t`, with borrowed pods left out:
//!
//! ```text
//! sum_c max(true_within_tc, true_budget_tc) <= max(committed_t, sum_c reported_within_tc)
//! ```
//!
//! where `true_within_tc` is what the simulated cluster really holds for `t` (running plus
//! admitted-unbound pods) except the pods admitted on borrowed GPUs (ground truth: the
//! world records each borrowed admission), `true_budget_tc` the budget the agent really
//! enforces at this instant (its lease or fallback; 0 while its webhook does not serve),
//! and `committed_t`, `reported_within_tc` (the reported in-use without what the report
//! says borrowed pods hold) come from the committed control-plane state (what every
//! present and future leader knows). Per cluster, the control plane's accounting must
//! cover the truth: `true_budget_tc <= enforceable_tc` and `true_within_tc <=
//! held_within_budgets_tc`, evaluated at the latest time any control-plane clock may show
//! now (real time plus the largest node clock offset). Also the state machine's own
//! check (`Federation::check_safety`, borrowed usage left out, including `sum_t
//! committed_t <= G`) must be empty. Borrowed pods are bounded instead by [`super::lending`].

use super::{fail, Violation};
use crate::world::World;

const NAME: &str = "partition_safety";

/// Checks the invariant at the world's current instant.
pub fn check(w: &World) -> Result<(), Violation> {
    let fed = &w.oracle.fed;
    let now = w.now_ms;
    let v = fed.check_safety();
    if !v.is_empty() {
        return fail(NAME, now, format!("control plane's own check: {v:?}"));
    }
    let t_cp = w.cp_check_time();
    for t in w.tenant_names() {
        let mut truth = 0u64;
        let mut reported = 0u64;
        let mut parts = Vec::new();
        for (i, a) in w.agents.iter().enumerate() {
            let (enf, hold, inuse) = match fed.clusters().get(&a.id) {
                Some(rec) => {
                    let u = rec.usage.get(&t).copied().unwrap_or_default();
                    let enf = rec.leases.enforceable(&t, t_cp);
                    (enf, u.held_within_budgets(enf), u.inuse_within_budgets())
                }
                None => (0, 0, 0),
            };
            let tb = a.true_budget(&t, now);
            let ti = w.true_within_budgets(i, &t);
            if tb > enf {
                return fail(
                    NAME,
                    now,
                    format!(
                        "{} enforces {tb} for {t} but the control plane bounds what it may enforce by {enf} (lease {}, epoch {})",
                        a.id,
                        a.state.lease.status(a.clock(now)),
                        a.state.lease.held_epoch()
                    ),
                );
            }
            if ti > hold {
                return fail(
                    NAME,
                    now,
                    format!("{} holds {ti} of {t}; the control plane assumes at most {hold}", a.id),
                );
            }
            truth += ti.max(tb);
            reported += inuse;
            parts.push(format!("{}: inuse {ti} budget {tb}", a.id));
        }
        let bound = fed.committed().get(&t).copied().unwrap_or(0).max(reported);
        if truth > bound {
            return fail(
                NAME,
                now,
                format!(
                    "tenant {t}: clusters may hold {truth} > max(committed, reported in-use) = {bound} [{}]",
                    parts.join("; ")
                ),
            );
        }
    }
    Ok(())
}
