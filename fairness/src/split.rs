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
///
/// 16 bytes on purpose: a recompute streams through `T x C` of these (10,000 x 100 is
/// a million), so the layout is what bounds its speed. A *pinned* cell (the cluster is
/// unreachable; its budget is what it may hold, `inuse`) is marked by
/// `demand == Cell::PINNED`; build cells with [`Cell::new`] and [`Cell::pinned`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Cell {
    /// Bound plus reserved GPUe last reported (for a pinned cell: what it may hold).
    pub inuse: MilliGpue,
    /// Effective demand last reported (`>= inuse` for sensible reports).
    pub demand: MilliGpue,
}

impl Cell {
    /// The `demand` value that marks a pinned cell.
    pub const PINNED: MilliGpue = u64::MAX;

    /// A reachable cluster's cell (demand is clamped below the pinned marker).
    pub fn new(inuse: MilliGpue, demand: MilliGpue) -> Cell {
        Cell {
            inuse,
            demand: demand.min(Self::PINNED - 1),
        }
    }

    /// An unreachable cluster that may hold `hold`: its budget is exactly that.
    pub fn pinned(hold: MilliGpue) -> Cell {
        Cell {
            inuse: hold,
            demand: Self::PINNED,
        }
    }

    /// `Some(hold)` for a pinned cell.
    pub fn pinned_amount(&self) -> Option<MilliGpue> {
        (self.demand == Self::PINNED).then_some(self.inuse)
    }

    fn pending(&self) -> MilliGpue {
        self.demand.saturating_sub(self.inuse)
    }
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
        match c.pinned_amount() {
            Some(p) => {
                *o = p;
                left = left.saturating_sub(p);
            }
            None => {
                inuse_sum += u128::from(c.inuse);
                pending_sum += u128::from(c.pending());
            }
        }
    }
    if inuse_sum <= u128::from(left) {
        // In-use first; `apportion` adds the pending shares on top.
        let rest = u128::from(left) - inuse_sum;
        if rest >= pending_sum {
            for (c, o) in cells.iter().zip(out.iter_mut()) {
                if c.pinned_amount().is_none() {
                    *o = c.inuse.max(c.demand);
                }
            }
        } else {
            apportion(rest, pending_sum, cells, out, |c| c.inuse, Cell::pending);
        }
    } else {
        apportion(u128::from(left), inuse_sum, cells, out, |_| 0, |c| c.inuse);
    }
}

/// Makes room for the tenant's largest waiting pod, after [`split_tenant`] filled `out`.
///
/// `largest[i]` is the GPUe of the largest pod of the tenant waiting in cluster `i` (0:
/// none; ignored for pinned cells). A proportional split can leave every cluster's
/// headroom (`out - inuse`) below the size of a pod the tenant's amount would cover: an
/// 8-GPU job waits forever behind a 3 + 3 + 2 split. So the largest waiting pod that fits
/// what the tenant may add anywhere (`amount - pinned - sum inuse`) gets room in its own
/// cluster: first from amount the split left unassigned, then from the other clusters'
/// headroom, in proportion to it (cumulative rounding). Ties between equal pods go to the
/// cluster with more headroom already, then the lower index.
///
/// Keeps what [`split_tenant`] holds: the sum is unchanged or grows only into unassigned
/// amount, no budget drops below its in-use, none exceeds its demand (given
/// `largest <= demand - inuse`, which callers ensure), pinned cells are untouched, and the
/// result is deterministic. Cost `O(C)`.
pub fn fit_largest(amount: MilliGpue, cells: &[Cell], largest: &[MilliGpue], out: &mut [MilliGpue]) {
    debug_assert!(cells.len() == out.len() && largest.len() == out.len());
    let mut left = u128::from(amount);
    let (mut inuse_sum, mut given) = (0u128, 0u128);
    for (c, &o) in cells.iter().zip(out.iter()) {
        match c.pinned_amount() {
            Some(p) => left = left.saturating_sub(u128::from(p)),
            None => {
                inuse_sum += u128::from(c.inuse);
                given += u128::from(o);
            }
        }
    }
    if inuse_sum >= left {
        return; // the tenant holds its amount already: nothing to make room with
    }
    let room = left - inuse_sum;
    let headroom = |out: &[MilliGpue], i: usize| out[i].saturating_sub(cells[i].inuse);
    let mut pick: Option<(MilliGpue, MilliGpue, usize)> = None;
    for (i, c) in cells.iter().enumerate() {
        let big = largest.get(i).copied().unwrap_or(0);
        if c.pinned_amount().is_some() || big == 0 || u128::from(big) > room || out[i] < c.inuse {
            continue;
        }
        let key = (big, headroom(out, i), i);
        if pick.is_none_or(|(b, h, _)| (big, key.1) > (b, h)) {
            pick = Some(key);
        }
    }
    let Some((big, head, at)) = pick else { return };
    if head >= big {
        return; // it fits already
    }
    let mut need = big - head;
    // Amount the split assigned nowhere (only when every demand was met, which a
    // waiting pod makes rare) goes first.
    let spare = u64::try_from(left.saturating_sub(given)).unwrap_or(u64::MAX);
    let take = need.min(spare);
    out[at] += take;
    need -= take;
    if need == 0 {
        return;
    }
    let others: u128 = (0..cells.len())
        .filter(|&i| i != at && cells[i].pinned_amount().is_none())
        .map(|i| u128::from(headroom(out, i)))
        .sum();
    // big <= room = spare + sum of all headroom, so need <= others; guard anyway.
    let need = u128::from(need).min(others);
    let (mut cum, mut before) = (0u128, 0u128);
    for i in 0..cells.len() {
        if i == at || cells[i].pinned_amount().is_some() {
            continue;
        }
        let h = headroom(out, i);
        if h == 0 {
            continue;
        }
        cum += u128::from(h);
        let through = need * cum / others;
        // floor(n (C + h) / T) - floor(n C / T) <= h for n <= T.
        let share = u64::try_from(through - before).unwrap_or(0).min(h);
        out[i] -= share;
        out[at] += share;
        before = through;
    }
}

/// Sets each non-pinned `out[i]` to `base(cell)` plus its cumulative-rounding share of
/// `amount`, in proportion to `claim(cell)`, where `total = sum claim` and
/// `amount <= total`.
///
/// This is the hot loop of a recompute (one pass over T x C cells), so: no division for
/// a zero claim (most cells), and 64-bit division whenever the product fits.
fn apportion(
    amount: u128,
    total: u128,
    cells: &[Cell],
    out: &mut [MilliGpue],
    base: impl Fn(&Cell) -> MilliGpue,
    claim: impl Fn(&Cell) -> MilliGpue,
) {
    if let (Ok(a), Ok(t)) = (u32::try_from(amount), u32::try_from(total)) {
        // amount, cum <= total < 2^32: every product fits in 64 bits, and the divisor is
        // the same for the whole row, so divide by multiplying with its reciprocal.
        let (a, t) = (u64::from(a), u64::from(t).max(1));
        let div = Divisor::new(t);
        let (mut cum, mut before) = (0u64, 0u64);
        for (c, o) in cells.iter().zip(out.iter_mut()) {
            if c.demand == Cell::PINNED {
                continue;
            }
            // Branch-free on purpose: which cells have a claim is data, and mispredicted
            // branches cost more than the multiply they would save.
            cum += claim(c);
            let through = div.divide(a * cum);
            *o = base(c) + (through - before);
            before = through;
        }
        return;
    }
    let (mut cum, mut before) = (0u128, 0u128);
    for (c, o) in cells.iter().zip(out.iter_mut()) {
        if c.demand == Cell::PINNED {
            continue;
        }
        let k = claim(c);
        let mut through = before;
        if k > 0 && total > 0 {
            cum += u128::from(k);
            through = amount * cum / total;
        }
        let share = u64::try_from(through - before).unwrap_or(u64::MAX);
        *o = base(c).saturating_add(share);
        before = through;
    }
}

/// Exact division of 64-bit numerators by a fixed divisor, by multiplication.
///
/// With `m = floor(2^64 / d)`, `q' = (n * m) >> 64` is `floor(n / d)` or one less
/// (`n/d - 1 < n*m/2^64 <= n/d` for `n < 2^64`), and one comparison fixes it. Gives the
/// same bits as `n / d` (checked by a property test); a hardware 64-bit division costs
/// tens of cycles, this a multiply.
#[derive(Clone, Copy, Debug)]
pub struct Divisor {
    d: u64,
    m: u64,
}

impl Divisor {
    /// A divisor; 0 is treated as 1.
    pub fn new(d: u64) -> Divisor {
        let d = d.max(1);
        // For d = 1 the reciprocal 2^64 does not fit; `divide` handles it.
        let m = if d == 1 {
            0
        } else {
            u64::try_from((1u128 << 64) / u128::from(d)).unwrap_or(u64::MAX)
        };
        Divisor { d, m }
    }

    /// `floor(n / d)`.
    #[inline]
    pub fn divide(&self, n: u64) -> u64 {
        if self.d == 1 {
            return n;
        }
        let q = u64::try_from((u128::from(n) * u128::from(self.m)) >> 64).unwrap_or(u64::MAX);
        let r = n - q * self.d;
        q + u64::from(r >= self.d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(inuse: u64, demand: u64) -> Cell {
        Cell::new(inuse, demand)
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
        let cells = [Cell::pinned(8), cell(0, 50)];
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

    #[test]
    fn the_largest_waiting_pod_gets_room_in_its_cluster() {
        // 8 GPUe to give, 8 waiting in each of three clusters: 3 + 3 + 2 (rounded)
        // fits no 8-GPU job anywhere.
        let cells = [cell(0, 8_000), cell(0, 8_000), cell(0, 8_000)];
        let mut out = [0; 3];
        split_tenant(8_000, &cells, &mut out);
        assert!(out.iter().all(|&b| b < 8_000), "{out:?}");
        // The 8-GPU job waits in the second cluster; the others wait with 2-GPU pods.
        fit_largest(8_000, &cells, &[2_000, 8_000, 2_000], &mut out);
        assert_eq!(out, [0, 8_000, 0]);
    }

    #[test]
    fn room_comes_from_the_others_headroom_never_their_inuse() {
        let cells = [cell(2_000, 6_000), cell(1_000, 9_000), cell(0, 4_000)];
        let mut out = [0; 3];
        split_tenant(9_000, &cells, &mut out);
        let before: u64 = out.iter().sum();
        fit_largest(9_000, &cells, &[0, 6_000, 0], &mut out);
        assert_eq!(out.iter().sum::<u64>(), before);
        assert!(out[1] - cells[1].inuse >= 6_000, "{out:?}");
        assert!(out[0] >= 2_000 && out[2] == 0, "{out:?}");
    }

    #[test]
    fn a_pod_larger_than_what_the_tenant_may_add_moves_nothing() {
        // 10 to give, 6 in use: at most 4 may be added, so a 5-GPU pod cannot be helped.
        let cells = [cell(6_000, 8_000), cell(0, 5_000)];
        let mut out = [0; 2];
        split_tenant(10_000, &cells, &mut out);
        let split = out;
        fit_largest(10_000, &cells, &[0, 5_000], &mut out);
        assert_eq!(out, split);
        // A smaller pod elsewhere that fits is helped instead.
        fit_largest(10_000, &cells, &[2_000, 5_000], &mut out);
        assert!(out[0] - 6_000 >= 2_000, "{out:?}");
    }

    #[test]
    fn pinned_clusters_keep_their_budget_and_count_against_the_room() {
        let cells = [Cell::pinned(4_000), cell(0, 6_000), cell(0, 6_000)];
        let mut out = [0; 3];
        split_tenant(10_000, &cells, &mut out);
        fit_largest(10_000, &cells, &[8_000, 6_000, 1_000], &mut out);
        assert_eq!(out, [4_000, 6_000, 0]);
    }

    proptest::proptest! {
        #[test]
        fn fit_largest_keeps_the_split_s_bounds(
            amount in 0u64..40_000,
            rows in proptest::collection::vec((0u64..10_000, 0u64..10_000, 0u64..12_000, proptest::bool::weighted(0.2)), 1..6),
        ) {
            let cells: Vec<Cell> = rows.iter().map(|&(i, p, _, pinned)| if pinned { Cell::pinned(i) } else { cell(i, i + p) }).collect();
            // The largest waiting pod is at most what waits.
            let largest: Vec<u64> = rows.iter().map(|&(_, p, l, _)| l.min(p)).collect();
            let mut split = vec![0; cells.len()];
            split_tenant(amount, &cells, &mut split);
            let mut out = split.clone();
            fit_largest(amount, &cells, &largest, &mut out);
            let pinned: u64 = cells.iter().filter_map(Cell::pinned_amount).sum();
            let inuse: u64 = cells.iter().filter(|c| c.pinned_amount().is_none()).map(|c| c.inuse).sum();
            proptest::prop_assert!(out.iter().sum::<u64>() >= split.iter().sum::<u64>());
            proptest::prop_assert!(out.iter().sum::<u64>() <= amount.max(pinned));
            let room = amount.saturating_sub(pinned).saturating_sub(inuse);
            let fits = (0..cells.len()).filter(|&i| cells[i].pinned_amount().is_none() && largest[i] > 0 && largest[i] <= room).map(|i| largest[i]).max();
            for (i, c) in cells.iter().enumerate() {
                match c.pinned_amount() {
                    Some(p) => proptest::prop_assert_eq!(out[i], p),
                    None => {
                        proptest::prop_assert!(out[i] <= c.demand.max(split[i]), "cell {i}: {} > demand {}", out[i], c.demand);
                        proptest::prop_assert!(out[i] >= split[i].min(c.inuse), "cell {i}: {} below in-use {}", out[i], c.inuse);
                    }
                }
            }
            // The largest pod that fits the room fits its own cluster afterwards.
            if let Some(big) = fits {
                if inuse < amount.saturating_sub(pinned) {
                    let ok = (0..cells.len()).any(|i| cells[i].pinned_amount().is_none() && largest[i] == big && out[i].saturating_sub(cells[i].inuse) >= big);
                    proptest::prop_assert!(ok, "largest fitting pod {big} has no room: {out:?} {cells:?}");
                }
            }
        }

        #[test]
        fn divisor_matches_hardware_division(n: u64, d: u64) {
            let d = d.max(1);
            proptest::prop_assert_eq!(Divisor::new(d).divide(n), n / d);
        }

        #[test]
        fn divisor_exact_near_multiples(d in 1u64..u64::from(u32::MAX), k in 0u64..u64::from(u32::MAX), delta in 0u64..3) {
            let n = (d.saturating_mul(k)).saturating_sub(delta);
            proptest::prop_assert_eq!(Divisor::new(d).divide(n), n / d);
        }
    }
}
