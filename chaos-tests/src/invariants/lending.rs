//! **Lending** (docs/guarantees.md G14 (b)): borrowed pods stand outside
//! the partition-safety inequality ([`super::partition_safety`] leaves them out), and are
//! bounded instead. Against ground truth (the world records every pod admitted on
//! borrowed GPUs):
//!
//! 1. at every borrowed admission: the tenant is preemptible; the pod is no larger than
//!    the GPUs the agent could lend just before it; the tenant's in-use after it is
//!    within its budget plus the lease's borrow limit ([`super::admission`] checks that
//!    bound, and the cap: budgets plus borrow limits never pass a tenant's maxShare); and
//!    the policy lends at the lease's standing then (`lendWhen: cutOff`: only with the
//!    lease expired);
//! 2. borrowed pods are reclaimed before pods held within a budget: when reclaim evicts a
//!    pod that takes its tenant below its budget here, no pod on that node that the agent
//!    admitted on borrowed GPUs could have gone instead (one of a preemptible tenant
//!    above its budget by at least the pod, other than the one room is made for, that
//!    has run at least `minRuntime` and whose tenant is below its per-minute eviction
//!    limit) and stayed;
//! 3. lent GPUs are taken back: when a cluster's only starved claim (reclaim's own
//!    `starved`) is a pod within its tenant's budget that has no room, and evicting such
//!    borrowed pods of other tenants on one node it may use would seat it (the cluster
//!    under its eviction limit), reclaim does so within [`LENDER_WAIT_MS`].
//!
//! What borrowed pods used is counted like any usage ([`super::conservation`]).

use std::collections::BTreeMap;

use super::{fail, Violation};
use crate::member::Admitted;
use crate::world::World;

const NAME: &str = "lending";

/// Checks agent `i`'s borrowed admissions of its last step.
pub fn check_admissions(w: &World, i: usize, admitted: &[Admitted]) -> Result<(), Violation> {
    let Some(a) = w.agents.get(i) else { return Ok(()) };
    for ad in admitted.iter().filter(|ad| ad.borrowed) {
        let what = format!(
            "{} admitted {} ({} GPUe) for {} on borrowed GPUs",
            a.id, ad.pod, ad.gpue, ad.tenant
        );
        if !ad.preemptible {
            return fail(NAME, w.now_ms, format!("{what}: the tenant is not preemptible"));
        }
        if ad.gpue > ad.lendable_before {
            return fail(
                NAME,
                w.now_ms,
                format!("{what}: only {} GPUe were lendable", ad.lendable_before),
            );
        }
        if !ad.lends_then {
            return fail(
                NAME,
                w.now_ms,
                format!("{what}: the policy does not lend at the lease's standing then"),
            );
        }
    }
    Ok(())
}

/// Checks agent `i`'s reclaim step of its last step (point 2, the order).
pub fn check_reclaim(w: &World, i: usize) -> Result<(), Violation> {
    let Some(a) = w.agents.get(i) else { return Ok(()) };
    let Some(seen) = &a.last_reclaim else { return Ok(()) };
    let within: Vec<&str> = seen
        .victims
        .iter()
        .filter(|(_, borrowed, below)| !borrowed && *below)
        .map(|(k, _, _)| k.as_str())
        .collect();
    if within.is_empty() || seen.spared.is_empty() {
        return Ok(());
    }
    fail(
        NAME,
        w.now_ms,
        format!(
            "{}: reclaim for {} on node {} evicted {within:?}, held within their tenants' budgets, and left borrowed pods there: {:?}",
            a.id, seen.for_tenant, seen.node, seen.spared
        ),
    )
}

/// How long the only starved claim of a cluster, within its tenant's budget, may wait
/// when evicting other tenants' borrowed pods on one node would seat it: `starvedFor`
/// (5 s in the world's policies), two reclaim steps (every 2 s), and slack for the pods
/// evicted to leave.
pub const LENDER_WAIT_MS: u64 = 12_000;

/// Checks that lent GPUs are taken back (point 3); `waiting` remembers, per agent, the
/// claim that could be served by borrowed pods alone and since when.
pub fn check_taken_back(w: &World, waiting: &mut BTreeMap<usize, (String, u64)>) -> Result<(), Violation> {
    let now = w.now_ms;
    for (i, a) in w.agents.iter().enumerate() {
        let Some(key) = a.lender_waits().filter(|_| a.serving_now()) else {
            waiting.remove(&i);
            continue;
        };
        let since = match waiting.get(&i) {
            Some((k, since)) if *k == key => *since,
            _ => now,
        };
        if now.saturating_sub(since) > LENDER_WAIT_MS {
            return fail(
                NAME,
                now,
                format!(
                    "{}: {key}, within its tenant's budget and the only claim, waited {} ms while evicting other tenants' borrowed pods on one node would seat it",
                    a.id,
                    now - since
                ),
            );
        }
        waiting.insert(i, (key, since));
    }
    Ok(())
}
