//! Showback: the GPU time each tenant used in each cluster, undecayed, in hourly
//! buckets. Kept in the replicated state beside the decayed ledger and fed by the same
//! reports with the same amounts, so over any period the buckets hold exactly what the
//! ledger was given (before decay).
//!
//! A report's usage is spread over the hours its metering window covers (the agent's
//! wall clock; a report without a usable window is counted in the hour the control
//! plane applied it), so usage reported late, after a partition, still lands in the
//! hours it happened. The split is integer arithmetic with the remainder in the last
//! hour: the parts add up to the whole, and every node computes the same buckets.
//!
//! Bounded: buckets older than the policy's retention (`spec.showback.retention`) are
//! dropped, and so are the oldest hours while more than [`MAX_CELLS`] cells are kept.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::names::{ClusterName, TenantName};
use crate::Millis;

/// One hour in milliseconds.
pub const HOUR_MS: Millis = 3_600_000;

/// Most (hour, tenant, cluster) cells kept; past it the oldest hours go first. At about
/// 60 bytes a cell this bounds the showback to some 60 MB of state.
pub const MAX_CELLS: usize = 1_000_000;

/// A window longer than this many hours is spread over its last this many hours only
/// (a clock that jumped; the total is still counted).
pub const MAX_SPREAD_HOURS: u64 = 24 * 7;

/// Usage per hour: hour (ms since the Unix epoch / [`HOUR_MS`]) -> tenant -> cluster ->
/// milli-GPUe x ms.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Showback {
    hours: BTreeMap<u64, BTreeMap<TenantName, BTreeMap<ClusterName, u64>>>,
    cells: usize,
}

/// How to group [`Showback::query`]'s rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct GroupBy {
    /// One row per tenant.
    pub tenant: bool,
    /// One row per cluster.
    pub cluster: bool,
}

/// One row of a showback query: usage of a tenant (or all) in a cluster (or all).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageRow {
    /// The tenant, when grouped by tenant.
    pub tenant: Option<String>,
    /// The cluster, when grouped by cluster.
    pub cluster: Option<String>,
    /// GPU-equivalent milliseconds, in thousandths of a GPU (divide by 3.6e9 for
    /// GPU-hours).
    pub milli_gpue_ms: u128,
}

impl Showback {
    /// An empty showback.
    pub fn new() -> Self {
        Self::default()
    }

    /// Cells kept.
    pub fn cells(&self) -> usize {
        self.cells
    }

    /// Start of the oldest hour kept (ms), if any.
    pub fn oldest_ms(&self) -> Option<Millis> {
        self.hours.keys().next().map(|h| h.saturating_mul(HOUR_MS))
    }

    fn add(&mut self, hour: u64, tenant: &TenantName, cluster: &ClusterName, amount: u64) {
        if amount == 0 {
            return;
        }
        let tenants = self.hours.entry(hour).or_default();
        let per_tenant = match tenants.get_mut(tenant) {
            Some(p) => p,
            None => tenants.entry(tenant.clone()).or_default(),
        };
        match per_tenant.get_mut(cluster) {
            Some(v) => *v = v.saturating_add(amount),
            None => {
                per_tenant.insert(cluster.clone(), amount);
                self.cells += 1;
            }
        }
    }

    /// Records `used` (milli-GPUe x ms) of `tenant` in `cluster`, spread over
    /// `[start_ms, end_ms)`; an empty or backwards span counts in the hour of `end_ms`.
    pub fn record(&mut self, tenant: &TenantName, cluster: &ClusterName, used: u64, start_ms: Millis, end_ms: Millis) {
        if used == 0 {
            return;
        }
        let start = start_ms.max(end_ms.saturating_sub(MAX_SPREAD_HOURS * HOUR_MS));
        if end_ms <= start {
            self.add(end_ms / HOUR_MS, tenant, cluster, used);
            return;
        }
        let span = u128::from(end_ms - start);
        let (first, last) = (start / HOUR_MS, (end_ms - 1) / HOUR_MS);
        let mut given = 0u64;
        for hour in first..=last {
            let part = if hour == last {
                used - given
            } else {
                let from = start.max(hour * HOUR_MS);
                let to = end_ms.min((hour + 1) * HOUR_MS);
                // <= used: (to - from) <= span.
                u64::try_from(u128::from(used) * u128::from(to - from) / span).unwrap_or(0)
            };
            given += part;
            self.add(hour, tenant, cluster, part);
        }
    }

    /// Drops hours that ended more than `retention_ms` before `now_ms`, then the oldest
    /// hours while more than [`MAX_CELLS`] cells are kept (never the current hour).
    pub fn prune(&mut self, now_ms: Millis, retention_ms: Millis) {
        let keep_from = now_ms.saturating_sub(retention_ms) / HOUR_MS;
        let current = now_ms / HOUR_MS;
        while let Some((&hour, _)) = self.hours.first_key_value() {
            if hour >= keep_from && (self.cells <= MAX_CELLS || hour >= current) {
                break;
            }
            if let Some(gone) = self.hours.remove(&hour) {
                self.cells -= gone.values().map(BTreeMap::len).sum::<usize>();
            }
        }
    }

    /// Usage of hours that overlap `[since_ms, until_ms)` (whole hours), grouped as
    /// asked, in name order; tenants or clusters with no usage are absent.
    pub fn query(&self, since_ms: Millis, until_ms: Millis, by: GroupBy) -> Vec<UsageRow> {
        let mut rows: BTreeMap<(Option<&str>, Option<&str>), u128> = BTreeMap::new();
        if until_ms <= since_ms {
            return Vec::new();
        }
        let (first, last) = (since_ms / HOUR_MS, (until_ms - 1) / HOUR_MS);
        for (_, tenants) in self.hours.range(first..=last) {
            for (tenant, clusters) in tenants {
                for (cluster, v) in clusters {
                    let key = (
                        by.tenant.then_some(tenant.as_str()),
                        by.cluster.then_some(cluster.as_str()),
                    );
                    *rows.entry(key).or_default() += u128::from(*v);
                }
            }
        }
        rows.into_iter()
            .map(|((t, c), v)| UsageRow {
                tenant: t.map(str::to_string),
                cluster: c.map(str::to_string),
                milli_gpue_ms: v,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn total(s: &Showback) -> u128 {
        s.query(0, u64::MAX, GroupBy::default())
            .first()
            .map_or(0, |r| r.milli_gpue_ms)
    }

    #[test]
    fn a_window_over_an_hour_boundary_is_split_by_time_and_adds_up() {
        let mut s = Showback::new();
        // 30 minutes before 10:00 and 90 after: a quarter, a half, a quarter.
        let ten = 10 * HOUR_MS;
        s.record(
            &TenantName::from_static("a"),
            &ClusterName::from_static("east"),
            1_000_001,
            ten - HOUR_MS / 2,
            ten + HOUR_MS + HOUR_MS / 2,
        );
        let hours: Vec<u128> = (9..12)
            .map(|h| {
                s.query(h * HOUR_MS, (h + 1) * HOUR_MS, GroupBy::default())
                    .first()
                    .map_or(0, |r| r.milli_gpue_ms)
            })
            .collect();
        assert_eq!(
            hours,
            vec![250_000, 500_000, 250_001],
            "the remainder goes to the last hour"
        );
        assert_eq!(total(&s), 1_000_001);
        assert_eq!(s.cells(), 3);
    }

    #[test]
    fn a_report_without_a_span_counts_in_its_hour_and_queries_group() {
        let mut s = Showback::new();
        s.record(
            &TenantName::from_static("a"),
            &ClusterName::from_static("east"),
            10,
            5 * HOUR_MS + 7,
            5 * HOUR_MS + 7,
        );
        s.record(
            &TenantName::from_static("a"),
            &ClusterName::from_static("west"),
            20,
            5 * HOUR_MS + 9,
            5 * HOUR_MS + 1,
        );
        s.record(
            &TenantName::from_static("b"),
            &ClusterName::from_static("east"),
            30,
            6 * HOUR_MS,
            6 * HOUR_MS + 10,
        );
        s.record(
            &TenantName::from_static("b"),
            &ClusterName::from_static("east"),
            0,
            0,
            6 * HOUR_MS,
        );
        let by_tenant = s.query(
            0,
            7 * HOUR_MS,
            GroupBy {
                tenant: true,
                cluster: false,
            },
        );
        assert_eq!(
            by_tenant
                .iter()
                .map(|r| (r.tenant.clone(), r.milli_gpue_ms))
                .collect::<Vec<_>>(),
            vec![(Some("a".into()), 30), (Some("b".into()), 30)]
        );
        let both = s.query(
            0,
            7 * HOUR_MS,
            GroupBy {
                tenant: true,
                cluster: true,
            },
        );
        assert_eq!(both.len(), 3);
        assert_eq!(
            s.query(
                6 * HOUR_MS,
                7 * HOUR_MS,
                GroupBy {
                    tenant: false,
                    cluster: true
                }
            )[0]
            .cluster
            .as_deref(),
            Some("east")
        );
        assert!(s.query(7 * HOUR_MS, 7 * HOUR_MS, GroupBy::default()).is_empty());
    }

    #[test]
    fn retention_and_the_cell_cap_drop_the_oldest_hours() {
        let mut s = Showback::new();
        for h in 0..10 {
            s.record(
                &TenantName::from_static("a"),
                &ClusterName::from_static("east"),
                5,
                h * HOUR_MS,
                h * HOUR_MS + 1,
            );
        }
        s.prune(10 * HOUR_MS, 3 * HOUR_MS);
        assert_eq!(s.oldest_ms(), Some(7 * HOUR_MS));
        assert_eq!(s.cells(), 3);
        assert_eq!(total(&s), 15);
        let mut big = Showback::new();
        for i in 0..(MAX_CELLS as u64 + 2) {
            big.record(
                &TenantName::parse(format!("t{}", i % 1000)).expect("name"),
                &ClusterName::parse(format!("c{}", i / 1000 % 1000)).expect("name"),
                1,
                (i / 1_000_000) * HOUR_MS,
                (i / 1_000_000) * HOUR_MS,
            );
        }
        big.prune(HOUR_MS, 365 * 24 * HOUR_MS);
        assert!(big.cells() <= MAX_CELLS, "{} cells", big.cells());
        assert_eq!(big.oldest_ms(), Some(HOUR_MS), "the older hour went");
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn the_parts_always_add_up(used in 0u64..u64::MAX / 2, start in 0u64..1u64 << 45, len in 0u64..(30 * HOUR_MS), back in any::<bool>()) {
                let mut s = Showback::new();
                let (a, b) = if back { (start + len, start) } else { (start, start + len) };
                s.record(&TenantName::from_static("t"), &ClusterName::from_static("c"), used, a, b);
                prop_assert_eq!(total(&s), u128::from(used));
                prop_assert!(s.cells() as u64 <= MAX_SPREAD_HOURS + 1);
            }
        }
    }
}
