//! Splitting one tenant's federation-wide amount into per-cluster budgets.
//!
//! Rule, for a tenant with amount `A` (its committed entitlement):
//! 1. *pinned* clusters (ones that stopped talking to the control plane) keep exactly
//!    what they may still enforce; the control plane cannot change it, so it is
//!    subtracted first;
//! 2. if what is in use in the other clusters fits in what is left, each of them gets
//!    its in-use, and the rest is shared in proportion to pending demand
//!    (`demand - in use`), never more than that demand;
//! 3. otherwise (the tenant holds more than it is now entitled to) the rest is shared in
//!    proportion to in-use: every cluster's budget is then at or below its in-use, which
//!    throttles new admissions and preempts nothing.
//!
//! Proportional shares use cumulative rounding (`floor(A*P_{<=c}/P) - floor(A*P_{<c}/P)`)
//! so they add up exactly, never exceed their claim, and need one multiply and one
//! divide per cluster. Cost `O(C)` per tenant.

use serde::{Deserialize, Serialize};

use crate::MilliGpue;

/// One cluster's view of one tenant, input to [`split_tenant`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Cell {
    /// Bound plus reserved GPUe last reported.
    pub inuse: MilliGpue,
    /// Effective demand last reported (`>= inuse` for sensible reports).
    pub demand: MilliGpue,
    /// `Some(b)`: the cluster is unreachable and may enforce `b`; its budget is `b`.
    pub pinned: Option<MilliGpue>,
}

/// Splits `amount` across `cells` into `out` (same length). See the module docs.
///
/// Holds: `sum out <= max(amount, sum pinned)`; for a non-pinned cell, `out <= demand`
/// whenever in-use fits, and `out <= inuse` when it does not; deterministic.
pub fn split_tenant(amount: MilliGpue, cells: &[Cell], out: &mut [MilliGpue]) {
    debug_assert_eq!(cells.len(), out.len());
    let mut left = amount;
    let mut inuse_sum: u128 = 0;
    let mut pending_sum: u128 = 0;
    for (c, o) in cells.iter().zip(out.iter_mut()) {
        match c.pinned {
            Some(p) => {
                *o = p;
                left = left.saturating_sub(p);
            }
            None => {
                *o = 0;
                inuse_sum += u128::from(c.inuse);
                pending_sum += u128::from(c.demand.saturating_sub(c.inuse));
            }
        }
    }
    if inuse_sum <= u128::from(left) {
        for (c, o) in cells.iter().zip(out.iter_mut()) {
            if c.pinned.is_none() {
                *o = c.inuse;
            }
        }
        let rest = u128::from(left) - inuse_sum;
        if rest >= pending_sum {
            for (c, o) in cells.iter().zip(out.iter_mut()) {
                if c.pinned.is_none() {
                    *o += c.demand.saturating_sub(c.inuse);
                }
            }
        } else {
            apportion(rest, pending_sum, cells, out, |c| c.demand.saturating_sub(c.inuse));
        }
    } else {
        apportion(u128::from(left), inuse_sum, cells, out, |c| c.inuse);
    }
}

/// Adds to each non-pinned `out[i]` its cumulative-rounding share of `amount`, in
/// proportion to `claim(cell)`, where `total = sum claim` and `amount <= total`.
fn apportion(
    amount: u128,
    total: u128,
    cells: &[Cell],
    out: &mut [MilliGpue],
    claim: impl Fn(&Cell) -> MilliGpue,
) {
    if total == 0 || amount == 0 {
        return;
    }
    let mut cum: u128 = 0;
    let mut given_before: u128 = 0;
    for (c, o) in cells.iter().zip(out.iter_mut()) {
        if c.pinned.is_some() {
            continue;
        }
        cum += u128::from(claim(c));
        let given_through = amount * cum / total;
        let share = given_through - given_before;
        given_before = given_through;
        *o = o.saturating_add(u64::try_from(share).unwrap_or(u64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(inuse: u64, demand: u64) -> Cell {
        Cell { inuse, demand, pinned: None }
    }

    #[test]
    fn in_use_first_then_pending_in_proportion() {
        let cells = [cell(10, 30), cell(0, 10), cell(5, 5)];
        let mut out = [0; 3];
        // 15 in use, 30 pending (20 + 10), 15 left to share 2:1.
        split_tenant(30, &cells, &mut out);
        assert_eq!(out, [20, 5, 5]);
        // Enough for everything.
        split_tenant(100, &cells, &mut out);
        assert_eq!(out, [30, 10, 5]);
    }

    #[test]
    fn over_entitled_tenant_is_throttled_not_preempted() {
        let cells = [cell(30, 40), cell(10, 10)];
        let mut out = [0; 2];
        split_tenant(20, &cells, &mut out);
        assert_eq!(out, [15, 5]);
        assert!(out[0] <= cells[0].inuse && out[1] <= cells[1].inuse);
    }

    #[test]
    fn pinned_clusters_are_subtracted_first() {
        let cells = [Cell { inuse: 4, demand: 4, pinned: Some(8) }, cell(0, 50)];
        let mut out = [0; 2];
        split_tenant(20, &cells, &mut out);
        assert_eq!(out, [8, 12]);
    }

    #[test]
    fn cumulative_rounding_adds_up() {
        let cells = [cell(0, 1), cell(0, 1), cell(0, 1)];
        let mut out = [0; 3];
        split_tenant(2, &cells, &mut out);
        assert_eq!(out.iter().sum::<u64>(), 2);
        assert!(out.iter().all(|&b| b <= 1));
    }
}
