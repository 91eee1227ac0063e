//! **Liveness**: once every fault has healed, the federation converges, within a stated
//! bound, to the fair split, and every tenant with demand gets its guarantee.
//!
//! Bound: after the last fault heals, one lease duration plus margin plus 5 s of
//! fault-free running (in-flight messages land, old leases expire, a leader is elected),
//! then [`crate::world::SETTLE_ROUNDS`] report rounds with time standing still (the
//! decayed ledger moves targets a little every second; liveness is about reaching a
//! target, not chasing one). Then, from the committed state's plan, with
//! `want_t = max(target_t, inuse_t)` (a tenant above its target is throttled, never
//! preempted by the control plane):
//! 1. `committed_t <= want_t` for every tenant, and if `sum_t want_t <= G`, then
//!    `committed_t == want_t` (converged to the fair split);
//! 2. if `sum_t want_t <= G`, every tenant gets its guarantee: summed over clusters,
//!    `max(true_inuse_tc, budget in force_tc) >= min(demand_t, minShare_t * G)` (what it
//!    runs, or may admit where its demand is);
//! 3. every running agent holds its cluster's latest lease epoch, in force.

use kvota_fairness::entitlement::share_of;
use kvota_fairness::lease::LeaseStatus;

use super::{fail, Violation};
use crate::world::World;

const NAME: &str = "liveness";

/// The end-of-run checks.
pub fn check_end(w: &World) -> Result<(), Violation> {
    let now = w.now_ms;
    let fed = &w.oracle.fed;
    let Some(policy) = fed.policy() else {
        return fail(NAME, now, "no policy in force after settling".to_string());
    };
    let plan = fed.plan();
    let want: Vec<u64> = plan
        .entitlements
        .iter()
        .zip(&plan.inuse)
        .map(|(e, &u)| e.total.max(u))
        .collect();
    let fits = want.iter().sum::<u64>() <= plan.capacity;
    let describe = || {
        format!(
            "capacity {} committed {:?} targets {:?} inuse {:?} held {:?} demand {:?}",
            plan.capacity,
            plan.committed,
            plan.entitlements.iter().map(|e| e.total).collect::<Vec<_>>(),
            plan.inuse,
            plan.held,
            plan.demand
        )
    };
    for (i, name) in plan.tenants.iter().enumerate() {
        let committed = plan.committed.get(i).copied().unwrap_or(0);
        let wanted = want.get(i).copied().unwrap_or(0);
        if committed > wanted {
            return fail(
                NAME,
                now,
                format!(
                    "{name}: committed {committed} > max(target, inuse) {wanted}; {}",
                    describe()
                ),
            );
        }
        if fits && committed != wanted {
            return fail(
                NAME,
                now,
                format!(
                    "{name} did not converge after healing: committed {committed} != {wanted}; {}",
                    describe()
                ),
            );
        }
        if fits {
            let Some(tp) = policy.tenant(name) else { continue };
            let guarantee = share_of(plan.capacity, tp.min_share_bp).min(plan.demand.get(i).copied().unwrap_or(0));
            let budgets: u64 = (0..w.agents.len())
                .filter_map(|i| {
                    w.agents
                        .get(i)
                        .map(|a| a.true_budget(name, now).max(w.true_inuse(i, name)))
                })
                .sum();
            if budgets < guarantee {
                return fail(
                    NAME,
                    now,
                    format!(
                        "{name}: what it holds or may admit adds up to {budgets} < guarantee {guarantee}; {}",
                        describe()
                    ),
                );
            }
        }
    }
    for a in &w.agents {
        if !a.up {
            return fail(NAME, now, format!("{} is still down after healing", a.id));
        }
        let latest = fed.clusters().get(&a.id).map_or(0, |r| r.leases.last_epoch);
        if a.state.lease.held_epoch() != latest {
            return fail(
                NAME,
                now,
                format!(
                    "{} holds epoch {} but the latest issued is {latest}",
                    a.id,
                    a.state.lease.held_epoch()
                ),
            );
        }
        let status = a.state.lease.status(a.clock(now));
        if matches!(status, LeaseStatus::Safe | LeaseStatus::None) {
            return fail(
                NAME,
                now,
                format!("{}'s lease is not in force after settling: {status}", a.id),
            );
        }
    }
    Ok(())
}
