//! The plan's grid, kept between commands and updated one cluster at a time.
//!
//! Row `i` is tenant `i` of the plan's names (the policy's tenants in policy order, then
//! retiring ones), column `j` the `j`-th cluster in id order. Each cell holds what the
//! plan, the split and a grant read of that pair: the tenant's last reported usage there
//! and what the cluster's open leases let it enforce at the state's clock, and, derived
//! from those, the split's [`Cell`] and the largest waiting pod that fits the cluster.
//! Per row the grid also keeps the sums over all clusters that the plan and a grant need
//! (effective demand, in-use, what the clusters may hold).
//!
//! A column is recomputed only when its inputs moved: the cluster's usage or leases
//! (their [`crate::stamped::Stamped`] stamps), its capacity, or which of its leases have
//! expired at the state's clock. Recomputing a column subtracts its old part of the row
//! sums and adds the new one, `O(T)`; a report changes its own cluster's column, and a
//! lease expiring changes one column once. So the plan, whose inputs are the row sums,
//! costs `O(T)` per command instead of `O(T x C)`. A change of the plan's tenants (a
//! policy change) or of the set of clusters rebuilds the whole grid.
//!
//! Sums are kept exactly (`u128`, never more than `C * 2^64`); a reader caps them at
//! `u64::MAX`, which is what adding the cells one by one with `saturating_add` gives.

use std::collections::BTreeMap;

use super::{join_sorted, ClusterRecord, TenantUsage};
use crate::entitlement::effective_demand;
use crate::names::{ClusterName, TenantName};
use crate::split::Cell;
use crate::{MilliGpue, Millis};

/// One (tenant, cluster) pair as the plan reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct GridCell {
    pub usage: TenantUsage,
    pub enforceable: MilliGpue,
    /// The most any open lease lets the cluster admit for the tenant, borrowing
    /// included: its budget plus its borrow limit. Pods admitted while a lease was live
    /// keep running after it expires, so expiry does not lower this (as it does not
    /// lower [`TenantUsage::bound`]); a report acknowledging a newer lease closes the
    /// older ones.
    pub allowance: MilliGpue,
}

/// A row's sums over every cluster.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct RowSums {
    /// Effective demand (with burst headroom; an unreachable cluster counts at least what
    /// it may hold).
    demand: u128,
    inuse: u128,
    hold: u128,
    /// What the clusters may hold or admit, borrowing included (`max(hold, allowance)`).
    reach: u128,
}

impl RowSums {
    fn add(&mut self, c: (u64, u64, u64, u64)) {
        self.demand += u128::from(c.0);
        self.inuse += u128::from(c.1);
        self.hold += u128::from(c.2);
        self.reach += u128::from(c.3);
    }

    fn sub(&mut self, c: (u64, u64, u64, u64)) {
        self.demand -= u128::from(c.0);
        self.inuse -= u128::from(c.1);
        self.hold -= u128::from(c.2);
        self.reach -= u128::from(c.3);
    }
}

fn capped(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// One row of an open lease: what the cluster may enforce while it is live, after, and
/// its borrow limit.
type LeaseRow = (MilliGpue, MilliGpue, MilliGpue);

/// What one column was computed from.
#[derive(Clone, Debug, Default)]
struct Column {
    /// Whether the column's cells hold its data (and are counted in the row sums).
    counted: bool,
    usage_stamp: u64,
    leases_stamp: u64,
    /// Bit `k`: open lease `k` had expired at the clock the column was computed at.
    expired: u64,
    capacity: MilliGpue,
    /// Per open lease: when it expires, and per row what the cluster may enforce while
    /// it is live and after, and the borrow limit.
    leases: Vec<(Millis, Vec<LeaseRow>)>,
}

/// See the module docs.
#[derive(Clone, Debug, Default)]
pub(super) struct Grid {
    names: Vec<TenantName>,
    /// Burst factor (milli) per row: the policy's, 1,000 for a retiring tenant.
    bursts: Vec<u32>,
    ids: Vec<ClusterName>,
    columns: Vec<Column>,
    cells: Vec<GridCell>,
    split: Vec<Cell>,
    big: Vec<MilliGpue>,
    unreachable: Vec<bool>,
    sums: Vec<RowSums>,
}

/// Which of `open`'s leases have expired at `now` (bit `k` for lease `k`; leases past
/// the 64th, which the lease book never keeps, share bit 63).
fn expired_mask(rec: &ClusterRecord, now: Millis) -> u64 {
    rec.leases
        .open
        .iter()
        .enumerate()
        .filter(|(_, l)| now >= l.expires_at_ms)
        .fold(0u64, |m, (k, _)| m | (1u64 << k.min(63)))
}

impl Grid {
    /// Number of columns (clusters).
    pub fn clusters(&self) -> usize {
        self.ids.len()
    }

    /// The plan's tenants, one per row.
    pub fn names(&self) -> &[TenantName] {
        &self.names
    }

    /// Row `i`'s cells, one per cluster.
    #[cfg(test)]
    pub fn row(&self, i: usize) -> &[GridCell] {
        let c = self.ids.len();
        self.cells.get(i * c..(i + 1) * c).unwrap_or(&[])
    }

    /// Row `i` as the split reads it, and the largest waiting pod per cluster (0: none,
    /// or it could never start there).
    pub fn split_row(&self, i: usize) -> (&[Cell], &[MilliGpue]) {
        let c = self.ids.len();
        (
            self.split.get(i * c..(i + 1) * c).unwrap_or(&[]),
            self.big.get(i * c..(i + 1) * c).unwrap_or(&[]),
        )
    }

    /// One cell (default outside the grid).
    pub fn cell(&self, i: usize, j: usize) -> GridCell {
        self.cells.get(i * self.ids.len() + j).copied().unwrap_or_default()
    }

    /// Whether column `j`'s cluster had let every lease expire.
    pub fn unreachable(&self, j: usize) -> bool {
        self.unreachable.get(j).copied().unwrap_or(false)
    }

    /// Row `i`'s sums, each capped at `u64::MAX`: `(demand, inuse, hold)`.
    pub fn sums(&self, i: usize) -> (MilliGpue, MilliGpue, MilliGpue) {
        let s = self.sums.get(i).copied().unwrap_or_default();
        (capped(s.demand), capped(s.inuse), capped(s.hold))
    }

    /// What row `i` may hold in every cluster but column `j`, capped at `u64::MAX`.
    /// What row `i`'s tenant may hold across every cluster (the sum of its holds).
    pub fn hold_total(&self, i: usize) -> MilliGpue {
        capped(self.sums.get(i).copied().unwrap_or_default().hold)
    }

    /// What row `i`'s tenant may hold or admit (borrowing included) in every cluster
    /// but `j`.
    pub fn reach_except(&self, i: usize, j: usize) -> MilliGpue {
        let s = self.sums.get(i).copied().unwrap_or_default();
        let own = self.cell(i, j);
        capped(s.reach - u128::from(own.usage.hold(own.enforceable).max(own.allowance)))
    }

    pub fn hold_except(&self, i: usize, j: usize) -> MilliGpue {
        let s = self.sums.get(i).copied().unwrap_or_default();
        let own = self.cell(i, j);
        capped(s.hold - u128::from(own.usage.hold(own.enforceable)))
    }

    /// Brings the grid up to date with `rows` (name and burst factor per row, in row
    /// order), `clusters` and the clock `now`, recomputing only the columns whose inputs
    /// moved.
    pub fn refresh<'a>(
        &mut self,
        rows: impl Iterator<Item = (&'a TenantName, u32)> + Clone,
        clusters: &BTreeMap<ClusterName, ClusterRecord>,
        now: Millis,
    ) {
        let same_rows = rows.clone().count() == self.names.len()
            && rows
                .clone()
                .zip(self.names.iter().zip(&self.bursts))
                .all(|((n, b), (have, hb))| n == have && b == *hb);
        let same_columns = clusters.len() == self.ids.len() && clusters.keys().zip(&self.ids).all(|(a, b)| a == b);
        if !same_rows || !same_columns {
            if !same_rows {
                (self.names, self.bursts) = rows.map(|(n, b)| (n.clone(), b)).unzip();
            }
            self.ids = clusters.keys().cloned().collect();
            let cells = self.names.len() * self.ids.len();
            self.columns = vec![Column::default(); self.ids.len()];
            self.cells = vec![GridCell::default(); cells];
            self.split = vec![Cell::default(); cells];
            self.big = vec![0; cells];
            self.unreachable = vec![false; self.ids.len()];
            self.sums = vec![RowSums::default(); self.names.len()];
        }
        let mut order: Option<Vec<usize>> = None;
        for (j, rec) in clusters.values().enumerate() {
            let expired = expired_mask(rec, now);
            let col = &self.columns[j];
            if col.counted
                && col.usage_stamp == rec.usage.stamp()
                && col.leases_stamp == rec.leases.stamp()
                && col.expired == expired
                && col.capacity == rec.capacity_gpue
            {
                continue;
            }
            let order = order.get_or_insert_with(|| {
                let mut o: Vec<usize> = (0..self.names.len()).collect();
                o.sort_unstable_by(|a, b| self.names[*a].cmp(&self.names[*b]));
                o
            });
            self.recompute(j, rec, now, expired, order);
        }
    }

    /// `(demand, inuse, hold, reach)` of cell `(i, j)` for the row sums.
    fn part(&self, i: usize, j: usize) -> (u64, u64, u64, u64) {
        let g = self.cell(i, j);
        let tu = g.usage;
        let burst = self.bursts.get(i).copied().unwrap_or(1_000);
        let hold = tu.hold(g.enforceable);
        let mut demand = effective_demand(tu.inuse, tu.pending, burst);
        if self.unreachable(j) {
            demand = demand.max(hold);
        }
        (demand, tu.inuse, hold, hold.max(g.allowance))
    }

    fn recompute(&mut self, j: usize, rec: &ClusterRecord, now: Millis, expired: u64, order: &[usize]) {
        let rows = self.names.len();
        let c = self.ids.len();
        if self.columns[j].counted {
            for i in 0..rows {
                let part = self.part(i, j);
                self.sums[i].sub(part);
            }
        }
        let col = &mut self.columns[j];
        if !col.counted || col.usage_stamp != rec.usage.stamp() {
            for i in 0..rows {
                self.cells[i * c + j].usage = TenantUsage::default();
            }
            let (names, cells) = (&self.names, &mut self.cells);
            join_sorted(names, order, &*rec.usage, |i, u| {
                if let Some(cell) = cells.get_mut(i * c + j) {
                    cell.usage = *u;
                }
            });
            col.usage_stamp = rec.usage.stamp();
        }
        if !col.counted || col.leases_stamp != rec.leases.stamp() {
            col.leases = lease_rows(&self.names, order, rec);
            col.leases_stamp = rec.leases.stamp();
        }
        col.expired = expired;
        col.capacity = rec.capacity_gpue;
        col.counted = true;
        let unreachable = rec.leases.last_epoch > 0 && rec.leases.all_expired(now);
        self.unreachable[j] = unreachable;
        let col = &self.columns[j];
        for i in 0..rows {
            let at = i * c + j;
            // What `ClusterLeases::enforceable` gives: the most any open lease allows;
            // and the most it ever let the cluster admit, borrowing included: pods
            // admitted under its budget and borrow limit while it was live outlast it
            // (a cut-off cluster lends on top of its fallback, which is never more).
            let (enforceable, allowance) = col
                .leases
                .iter()
                .map(|(expires, by_row)| {
                    let (live, after, borrow) = by_row.get(i).copied().unwrap_or((0, 0, 0));
                    let e = if now < *expires { live } else { after };
                    (e, live.max(after).saturating_add(borrow))
                })
                .fold((0, 0), |(e, a), (x, y)| (e.max(x), a.max(y)));
            let tu = self.cells[at].usage;
            self.cells[at].enforceable = enforceable;
            self.cells[at].allowance = allowance;
            let burst = self.bursts.get(i).copied().unwrap_or(1_000);
            self.split[at] = if unreachable {
                Cell::pinned(tu.hold(enforceable))
            } else {
                Cell::new(tu.inuse, effective_demand(tu.inuse, tu.pending, burst))
            };
            // A pod larger than its cluster can never start there: no room for it.
            self.big[at] = if unreachable || tu.largest > rec.capacity_gpue {
                0
            } else {
                tu.largest
            };
        }
        for i in 0..rows {
            let part = self.part(i, j);
            self.sums[i].add(part);
        }
    }
}

/// Each open lease of `rec`: when it expires, and per row (tenant) what it allows while
/// live, after it expires (the fallback), and its borrow limit.
fn lease_rows(names: &[TenantName], order: &[usize], rec: &ClusterRecord) -> Vec<(Millis, Vec<LeaseRow>)> {
    let rows = names.len();
    rec.leases
        .open
        .iter()
        .map(|lease| {
            let mut by_row = vec![(0, 0, 0); rows];
            join_sorted(names, order, &lease.budgets, |i, b| {
                if let Some(r) = by_row.get_mut(i) {
                    *r = (b.budget.max(b.fallback), b.fallback, b.borrow);
                }
            });
            (lease.expires_at_ms, by_row)
        })
        .collect()
}
