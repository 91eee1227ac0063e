//! **Admission**: no new admission takes a tenant above its budget, its entitlement or
//! its maxShare. Checked at every admission (a pod allowed by the webhook, or released
//! from the scheduling gate) of tenant `t` in cluster `c`:
//!
//! 1. locally, `inuse_tc <= budget_tc` right after it (the budget the agent enforced at
//!    that instant), or, for a pod admitted on borrowed GPUs, `inuse_tc <= budget_tc +
//!    borrow_limit_tc` (the lease's borrow limit). (Not `<= capacity_c`: a budget may
//!    exceed what one cluster can run, and pods admitted beyond it wait unbound, holding
//!    their reservation, as Kubernetes pods wait for room);
//! 2. federation-wide, in ground truth and with borrowed pods left out, `sum_c
//!    true_within_tc <= max(committed_t, sum_c reported_within_tc)` (docs/guarantees.md G8:
//!    no admission anywhere takes a tenant above its entitlement; borrowed pods are held to
//!    the borrow limits and the cap instead);
//! 3. federation-wide, `sum_c true_inuse_tc` after the admission is at most
//!    `max(sum before, maxShare_t * G)`, where `maxShare_t` is the largest this tenant had
//!    under any policy in force during the last lease duration plus 5 s (a lease issued
//!    under the old policy may be enforced that long), or under the policy the admitting
//!    agent's lease was issued under (its ceiling: a cluster cut off since before a
//!    policy change enforces that lease's safe budgets until it hears again, docs/guarantees.md
//!    G11): an admission never takes a tenant above its cap, nor further above it.

use std::collections::BTreeMap;

use kvota_fairness::entitlement::share_of;

use super::{fail, Violation};
use crate::member::Admitted;
use crate::world::World;

const NAME: &str = "admission";

/// Checks the admissions agent `i` made in its last step; `before` is each tenant's
/// federation-wide true in-use before that step.
pub fn check(
    w: &World,
    i: usize,
    admitted: &[Admitted],
    before: &BTreeMap<kvota_fairness::names::TenantName, u64>,
) -> Result<(), Violation> {
    let now = w.now_ms;
    let Some(a) = w.agents.get(i) else { return Ok(()) };
    let fed = &w.oracle.fed;
    for ad in admitted {
        let limit = if ad.borrowed {
            ad.budget.saturating_add(ad.borrow_limit)
        } else {
            ad.budget
        };
        if ad.inuse_after > limit {
            return fail(
                NAME,
                now,
                format!(
                    "{} admitted {} ({} GPUe{}) for {}: in use {} > budget {} + borrow limit {} (epoch {})",
                    a.id,
                    ad.pod,
                    ad.gpue,
                    if ad.borrowed { ", borrowed" } else { "" },
                    ad.tenant,
                    ad.inuse_after,
                    ad.budget,
                    if ad.borrowed { ad.borrow_limit } else { 0 },
                    ad.epoch
                ),
            );
        }
        let t = &ad.tenant;
        let after: u64 = (0..w.agents.len()).map(|j| w.true_inuse(j, t)).sum();
        let within: u64 = (0..w.agents.len()).map(|j| w.true_within_budgets(j, t)).sum();
        let reported: u64 = fed
            .clusters()
            .values()
            .map(|rec| rec.usage.get(t).map_or(0, |u| u.inuse_within_budgets()))
            .sum();
        let committed = fed.committed().get(t).copied().unwrap_or(0);
        if within > committed.max(reported) {
            return fail(
                NAME,
                now,
                format!(
                    "{} admitted {} for {t}: federation-wide {within} within budgets > max(committed {committed}, reported {reported})",
                    a.id, ad.pod
                ),
            );
        }
        // The lease's ceiling is `maxShare x G` of the policy it was issued under.
        let ceiling = a.state.lease.lease().map_or(0, |l| l.ceiling(t));
        let cap = share_of(fed.capacity(), w.recent_max_share_bp(t)).max(ceiling);
        let was = before.get(t).copied().unwrap_or(0);
        if after > was.max(cap) && w.max_share_binds_borrowing() {
            return fail(
                NAME,
                now,
                format!(
                    "{} admitted {} for {t}: federation-wide {was} -> {after}, above maxShare cap {cap} (budget {}, epoch {}, lease {:?}, committed {committed}, policies {:?})",
                    a.id,
                    ad.pod,
                    ad.budget,
                    ad.epoch,
                    a.state.lease.lease().map(|l| (l.issued_at_ms, l.budgets.get(t))),
                    w.policy_history.iter().map(|(at, p)| (*at, p.name.clone())).collect::<Vec<_>>()
                ),
            );
        }
    }
    Ok(())
}
