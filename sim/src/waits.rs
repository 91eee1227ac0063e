//! Why kvota's pods wait: each waiting pod, at each tick, charged to the first thing that
//! holds it, walking from the fairness model down to the node.
//!
//! For a pod of `g` GPUe of tenant `t` waiting in cluster `c`, with `U_t` the tenant's
//! in-use over all clusters, `u_tc` its in-use in `c`, `E_t` its target entitlement,
//! `E0_t` the target the model would give with no usage history (decay bias off),
//! `Ê_t` its committed entitlement and `b_tc` its budget in `c`:
//! - [`Cause::Weights`]: `E0_t < U_t + g`: the weights and demand alone say wait (the
//!   wait max-min fairness intends);
//! - [`Cause::Decay`]: `E_t < U_t + g <= E0_t`: the decay bias holds it;
//! - [`Cause::Committed`]: `Ê_t < U_t + g <= E_t`: the target allows it, the committed
//!   entitlement has not risen to it yet (break-before-make: capacity still committed
//!   to others);
//! - [`Cause::Rounding`]: as `Committed`, but the committed entitlement is short by less
//!   than the pod (a fraction of a GPU that no pod can use);
//! - [`Cause::Budgets`]: `sum_c b_tc < U_t + g <= min(Ê_t, E_t)`: the leases have not
//!   caught up with the committed entitlement (lease lag, the safety clip);
//! - [`Cause::Split`]: `b_tc < u_tc + g` while `sum_c b_tc >= U_t + g`: there is budget,
//!   in another cluster (the split across clusters, and its rounding);
//! - [`Cause::Capacity`]: the budget allows it and no node has room.
//!
//! Pod-ticks times the tick are waiting time, so the counts say where the wait goes.

use kvota_fairness::MilliGpue;

/// What holds a waiting pod (see the module docs), in the order they are tested.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Cause {
    /// The weights and demand (no usage history) leave no room.
    Weights,
    /// The decay bias leaves no room.
    Decay,
    /// The committed entitlement lags the target by at least the pod.
    Committed,
    /// The committed entitlement lags the target by less than the pod.
    Rounding,
    /// The budgets summed over clusters lag the committed entitlement.
    Budgets,
    /// The budget is in another cluster.
    Split,
    /// The budget allows it; no node has room.
    Capacity,
}

impl Cause {
    /// Every cause, in test order.
    pub const ALL: [Cause; 7] = [
        Cause::Weights,
        Cause::Decay,
        Cause::Committed,
        Cause::Rounding,
        Cause::Budgets,
        Cause::Split,
        Cause::Capacity,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Cause::Weights => "weights",
            Cause::Decay => "decay",
            Cause::Committed => "break-before-make",
            Cause::Rounding => "rounding",
            Cause::Budgets => "lease lag",
            Cause::Split => "split",
            Cause::Capacity => "capacity",
        }
    }
}

/// One tenant's numbers for [`classify`], GPUe.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TenantNumbers {
    /// In-use over all clusters, `U_t`.
    pub inuse: MilliGpue,
    /// Target entitlement, `E_t`.
    pub target: MilliGpue,
    /// Target with the decay bias off, `E0_t`.
    pub target_no_decay: MilliGpue,
    /// Committed entitlement, `Ê_t`.
    pub committed: MilliGpue,
    /// Budgets summed over the clusters.
    pub budgets: MilliGpue,
}

/// What holds a pod of `g` GPUe waiting in a cluster where its tenant uses `inuse_here`
/// under `budget_here` (see the module docs).
pub fn classify(n: &TenantNumbers, g: MilliGpue, inuse_here: MilliGpue, budget_here: MilliGpue) -> Cause {
    let want = n.inuse.saturating_add(g);
    if inuse_here.saturating_add(g) <= budget_here {
        Cause::Capacity
    } else if n.target_no_decay < want {
        Cause::Weights
    } else if n.target < want {
        Cause::Decay
    } else if n.committed < want {
        if want - n.committed < g {
            Cause::Rounding
        } else {
            Cause::Committed
        }
    } else if n.budgets < want {
        Cause::Budgets
    } else {
        Cause::Split
    }
}

/// Pod-ticks per cause, in all and per tenant (policy order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WaitCauses {
    /// Ticks measured.
    pub ticks: u64,
    /// Pod-ticks per cause, indexed as [`Cause::ALL`].
    pub total: [u64; 7],
    /// Per tenant, pod-ticks per cause.
    pub per_tenant: Vec<[u64; 7]>,
}

impl WaitCauses {
    /// Counts one waiting pod of tenant `t`.
    pub fn add(&mut self, t: usize, cause: Cause) {
        let k = Cause::ALL.iter().position(|&c| c == cause).unwrap_or(0);
        self.total[k] += 1;
        if self.per_tenant.len() <= t {
            self.per_tenant.resize(t + 1, [0; 7]);
        }
        self.per_tenant[t][k] += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_is_the_first_that_holds() {
        let n = TenantNumbers {
            inuse: 10_000,
            target: 12_000,
            target_no_decay: 14_000,
            committed: 12_000,
            budgets: 12_000,
        };
        // Room in its own budget: only the nodes hold it.
        assert_eq!(classify(&n, 1000, 3000, 4000), Cause::Capacity);
        // Budget elsewhere: the sum allows it, this cluster's does not.
        assert_eq!(classify(&n, 1000, 3000, 3000), Cause::Split);
        assert_eq!(
            classify(&TenantNumbers { budgets: 10_500, ..n }, 1000, 3000, 3000),
            Cause::Budgets
        );
        assert_eq!(
            classify(&TenantNumbers { committed: 10_500, ..n }, 1000, 3000, 3000),
            Cause::Rounding
        );
        assert_eq!(
            classify(&TenantNumbers { committed: 10_000, ..n }, 1000, 3000, 3000),
            Cause::Committed
        );
        assert_eq!(
            classify(&TenantNumbers { target: 10_000, ..n }, 1000, 3000, 3000),
            Cause::Decay
        );
        assert_eq!(
            classify(
                &TenantNumbers {
                    target: 10_000,
                    target_no_decay: 10_000,
                    ..n
                },
                1000,
                3000,
                3000
            ),
            Cause::Weights
        );
    }

    #[test]
    fn counts_add_up_per_tenant_and_in_all() {
        let mut w = WaitCauses::default();
        w.add(2, Cause::Split);
        w.add(0, Cause::Split);
        w.add(2, Cause::Decay);
        assert_eq!(w.total[5], 2);
        assert_eq!(w.total[1], 1);
        assert_eq!(w.per_tenant.len(), 3);
        assert_eq!(w.per_tenant[2][5] + w.per_tenant[2][1], 2);
    }
}
