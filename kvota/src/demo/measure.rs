//! What the demo measures, from ground truth (the simulated clusters and the agents'
//! state) and the control plane's answers. Nothing here is scripted: every number in the
//! summary comes from these accumulators.

use std::collections::BTreeMap;

use kvota_fairness::measures::{percentile, ShareClock};
use kvota_fairness::MilliGpue;
use serde::Serialize;

/// A tenant is "fair" at an instant when it is not more than 20 % (+1 GPU of rounding)
/// over its entitlement and, if it has waiting pods that would fit on a node now
/// (`waiting` GPUe), not more than 20 % (-1 GPU) under.
pub fn tenant_fair(inuse: MilliGpue, target: MilliGpue, waiting: MilliGpue) -> bool {
    let (inuse, target) = (inuse as f64, target as f64);
    let not_over = inuse <= target * 1.2 + 1_000.0;
    let not_under = waiting == 0 || inuse >= target * 0.8 - 1_000.0;
    not_over && not_under
}

/// How long after an event until every tenant was fair and stayed so for
/// [`Recovery::STABLE_MS`].
#[derive(Clone, Debug, Default)]
pub struct Recovery {
    armed_at: Option<u64>,
    stable_from: Option<u64>,
    /// Milliseconds from the event to the start of the stable fair period.
    pub done_ms: Option<u64>,
}

impl Recovery {
    /// Fair must hold this long to count as recovered.
    pub const STABLE_MS: u64 = 2_000;

    /// Starts timing at `now`.
    pub fn arm(&mut self, now: u64) {
        *self = Recovery {
            armed_at: Some(now),
            ..Default::default()
        };
    }

    /// A sample: whether everything is fair at `now`.
    pub fn observe(&mut self, now: u64, fair: bool) {
        let Some(armed) = self.armed_at else { return };
        if self.done_ms.is_some() {
            return;
        }
        if !fair {
            self.stable_from = None;
            return;
        }
        let from = *self.stable_from.get_or_insert(now);
        if now.saturating_sub(from) >= Self::STABLE_MS {
            self.done_ms = Some(from.saturating_sub(armed));
        }
    }
}

/// Per-tenant accumulators.
#[derive(Clone, Debug, Default)]
pub struct TenantMeasures {
    /// Admission delays (first submission to bound), ms.
    pub delays_ms: Vec<u64>,
    /// Time over entitlement and time starved below the guarantee.
    pub clock: ShareClock,
    /// Sum of the control plane's fairness-score samples and their count.
    pub score_sum: f64,
    /// Samples.
    pub score_n: u64,
    /// The last sample.
    pub score_last: Option<f64>,
    /// Pods denied at least once (by arrival index): a pod's retries are one pod.
    pub denied_pods: std::collections::BTreeSet<usize>,
    /// Denial answers, retries included.
    pub denial_answers: u64,
}

/// One point of the timeline (every second).
#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    /// Seconds since the scenario started (wall clock).
    pub t_s: f64,
    /// Scenario phase.
    pub phase: String,
    /// GPUe bound / capacity.
    pub utilization: f64,
    /// Per tenant: in use, entitlement (GPUe) and fairness score.
    pub tenants: BTreeMap<String, TenantPoint>,
}

/// A tenant at one instant.
#[derive(Clone, Debug, Serialize)]
pub struct TenantPoint {
    /// GPUe in use (bound + reserved), federation-wide.
    pub inuse_gpue: f64,
    /// Target entitlement (GPUe).
    pub entitlement_gpue: f64,
    /// Pods submitted and not yet running.
    pub waiting: usize,
    /// The control plane's fairness score ([`kvota_control_plane::view::SCORE_DEFINITION`]).
    pub score: f64,
}

/// Everything the demo accumulates.
#[derive(Clone, Debug, Default)]
pub struct Measures {
    /// Per tenant.
    pub tenants: BTreeMap<String, TenantMeasures>,
    /// Integral of bound GPUe over time, and of capacity over time.
    pub util_num: f64,
    /// Denominator of utilization.
    pub util_den: f64,
    /// Admissions that took a tenant above `max(committed entitlement, what it already
    /// held)`: how many, and by how much in total.
    pub over_admissions: u64,
    /// Milli-GPUe beyond the bound, summed.
    pub over_admitted_milli: u64,
    /// Admissions that took a tenant above its maxShare (beyond what it held).
    pub over_max_share: u64,
    /// Admissions checked.
    pub admissions_checked: u64,
    /// Fairness recovery after the burst.
    pub after_burst: Recovery,
    /// Fairness recovery after the partition heals.
    pub after_partition: Recovery,
    /// Timeline.
    pub timeline: Vec<Sample>,
}

/// An admission to judge once the control plane's entitlement on both sides of it is
/// known.
#[derive(Clone, Debug)]
pub struct Candidate {
    /// Tenant.
    pub tenant: String,
    /// Federation-wide in-use before this tick's admissions.
    pub before: MilliGpue,
    /// And after.
    pub after: MilliGpue,
    /// Committed entitlement named by the lease each admitting cluster enforced (max).
    pub lease_entitlement: MilliGpue,
}

impl Measures {
    /// Judges candidates against the committed entitlements read just before and just
    /// after them, and the maxShare cap.
    pub fn judge(
        &mut self,
        candidates: &[Candidate],
        before: &BTreeMap<String, MilliGpue>,
        after: &BTreeMap<String, MilliGpue>,
        max_share: &BTreeMap<String, MilliGpue>,
    ) {
        for c in candidates {
            self.admissions_checked += 1;
            let e = before
                .get(&c.tenant)
                .copied()
                .unwrap_or(0)
                .max(after.get(&c.tenant).copied().unwrap_or(0))
                .max(c.lease_entitlement);
            let bound = e.max(c.before);
            if c.after > bound {
                self.over_admissions += 1;
                self.over_admitted_milli += c.after - bound;
            }
            if let Some(&cap) = max_share.get(&c.tenant) {
                if c.after > cap.max(c.before) {
                    self.over_max_share += 1;
                }
            }
        }
    }

    /// Records a sample of `tenant`'s fairness score as the control plane computes it
    /// (what `kvota tenants` and the dashboard show at that instant).
    pub fn score(&mut self, tenant: &str, score: f64) -> f64 {
        let m = self.tenants.entry(tenant.to_string()).or_default();
        m.score_sum += score;
        m.score_n += 1;
        m.score_last = Some(score);
        score
    }

    /// Records a denial answered to the pod of arrival `idx` of `tenant`.
    pub fn denied(&mut self, tenant: &str, idx: usize) {
        let m = self.tenants.entry(tenant.to_string()).or_default();
        m.denied_pods.insert(idx);
        m.denial_answers += 1;
    }
}

/// Final per-tenant numbers.
#[derive(Clone, Debug, Serialize)]
pub struct TenantSummary {
    /// Pods that ran.
    pub pods_started: usize,
    /// Pods still waiting at the end.
    pub pods_waiting_at_end: usize,
    /// Admission delay percentiles, wall-clock ms (None: no pod started).
    pub delay_p50_ms: Option<u64>,
    /// 99th percentile.
    pub delay_p99_ms: Option<u64>,
    /// Time over entitlement, ms, and as a fraction of the run.
    pub share_violation_ms: u64,
    /// Fraction.
    pub share_violation_fraction: f64,
    /// Time below `min(demand waiting > grace, guarantee)`, ms.
    pub starved_below_guarantee_ms: u64,
    /// Mean over the run of the control plane's fairness score (one sample a second).
    pub mean_fairness_score: f64,
    /// The control plane's fairness score at the end (what `kvota tenants` shows).
    pub fairness_score_at_end: f64,
    /// Pods denied at least once (a pod's retries are not counted again).
    pub pods_denied: usize,
    /// Denial answers, retries included.
    pub denial_answers: u64,
    /// GPUe-seconds its pods used (ground truth).
    pub used_gpue_s: f64,
    /// GPUe-seconds the control plane's ledger holds for it at the end.
    pub ledger_gpue_s: f64,
}

/// Final usage accounting.
#[derive(Clone, Debug, Serialize)]
pub struct UsageCheck {
    /// GPUe-seconds the agents measured and journaled.
    pub produced_gpue_s: f64,
    /// GPUe-seconds in the control plane's ledger.
    pub ledger_gpue_s: f64,
    /// Decay the ledger may legitimately have applied (24 h half-life over the run).
    pub decay_allowance_gpue_s: f64,
    /// Usage missing beyond that allowance (must be 0).
    pub lost_gpue_s: f64,
    /// Usage counted more than once (must be 0).
    pub double_counted_gpue_s: f64,
    /// Reports still unacknowledged at the end (must be 0).
    pub unacknowledged_reports: usize,
}

/// Percentile helper over a copy.
pub fn pct(samples: &[u64], p: u32) -> Option<u64> {
    let mut v = samples.to_vec();
    percentile(&mut v, p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_needs_a_stable_fair_period() {
        let mut r = Recovery::default();
        r.observe(0, true); // not armed: ignored
        r.arm(1_000);
        r.observe(1_500, false);
        r.observe(2_000, true);
        r.observe(3_000, false); // broken before 2 s
        r.observe(4_000, true);
        r.observe(5_000, true);
        assert_eq!(r.done_ms, None);
        r.observe(6_000, true);
        assert_eq!(r.done_ms, Some(3_000));
        r.observe(7_000, false);
        assert_eq!(r.done_ms, Some(3_000), "once recovered, stays recorded");
    }

    #[test]
    fn over_admission_is_judged_against_the_larger_entitlement_and_prior_holding() {
        let mut m = Measures::default();
        let e_before: BTreeMap<String, u64> = [("t".to_string(), 10_000)].into();
        let e_after: BTreeMap<String, u64> = [("t".to_string(), 12_000)].into();
        let cap: BTreeMap<String, u64> = [("t".to_string(), 30_000)].into();
        let ok = Candidate {
            tenant: "t".into(),
            before: 9_000,
            after: 12_000,
            lease_entitlement: 0,
        };
        let held_more = Candidate {
            tenant: "t".into(),
            before: 15_000,
            after: 15_000,
            lease_entitlement: 0,
        };
        let over = Candidate {
            tenant: "t".into(),
            before: 11_000,
            after: 14_000,
            lease_entitlement: 13_000,
        };
        m.judge(&[ok, held_more, over], &e_before, &e_after, &cap);
        assert_eq!(
            (m.admissions_checked, m.over_admissions, m.over_admitted_milli),
            (3, 1, 1_000)
        );
        let capped = Candidate {
            tenant: "t".into(),
            before: 29_000,
            after: 31_000,
            lease_entitlement: 40_000,
        };
        m.judge(&[capped], &e_before, &e_after, &cap);
        assert_eq!(m.over_max_share, 1);
    }

    #[test]
    fn fairness_predicate() {
        assert!(tenant_fair(10_000, 10_000, 5));
        assert!(tenant_fair(2_000, 10_000, 0), "under, but nothing waiting");
        assert!(!tenant_fair(2_000, 10_000, 1_000), "under with pods waiting");
        assert!(!tenant_fair(14_000, 10_000, 0), "40 % over");
    }
}
