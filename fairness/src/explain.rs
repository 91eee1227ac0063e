//! Explanations: for a tenant, the numbers that produced its entitlement and budgets;
//! for a pod, the numbers behind its admission decision. Structured (serde) for the API
//! and the dashboard, and rendered as plain text for `kvota explain`.

use std::fmt::{self, Write as _};

use serde::{Deserialize, Serialize};

use crate::admission::{Decision, LocalView, PodRequest};
use crate::federation::{AuditEvent, EvictionOutcome, Federation};
use crate::measures::{drift_ppm, tenant_score};
use crate::names::{ClusterName, TenantName};
use crate::units::{format_duration_ms, format_gpue as g};
use crate::{MilliGpue, Millis};

/// One cluster's part of a tenant's explanation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterPart {
    /// Cluster id.
    pub cluster: ClusterName,
    /// Last reported in-use.
    pub inuse: MilliGpue,
    /// Last reported pending demand.
    pub pending: MilliGpue,
    /// Budget in the newest lease.
    pub budget: MilliGpue,
    /// Fallback (safe budget, capped by the budget) in the newest lease.
    pub fallback: MilliGpue,
    /// The most the cluster may enforce now under any lease it may hold.
    pub enforceable: MilliGpue,
    /// Newest epoch issued and epoch acknowledged.
    pub epoch: (u64, u64),
    /// True when every lease of the cluster has expired (cluster unreachable).
    pub unreachable: bool,
}

/// Why a tenant is entitled to what it is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TenantExplanation {
    /// Tenant.
    pub tenant: TenantName,
    /// Policy numbers: weight (milli), min and max share (basis points), half-life.
    pub weight_milli: u64,
    /// Guaranteed share, basis points.
    pub min_share_bp: u32,
    /// Largest share, basis points.
    pub max_share_bp: u32,
    /// Decay half-life.
    pub half_life_ms: u64,
    /// Preemptible.
    pub preemptible: bool,
    /// Federation capacity.
    pub capacity: MilliGpue,
    /// Demand used by the model.
    pub demand: MilliGpue,
    /// Sum of in-use across clusters.
    pub inuse: MilliGpue,
    /// Usage share and weight share, ppm.
    pub usage_share_ppm: u32,
    /// Weight share, ppm.
    pub weight_share_ppm: u32,
    /// Effective weight relative to the policy weight, ppm (1,000,000 = no penalty).
    pub weight_kept_ppm: u64,
    /// Guarantee, cap, surplus and target entitlement.
    pub guarantee: MilliGpue,
    /// Cap.
    pub cap: MilliGpue,
    /// Surplus share.
    pub surplus: MilliGpue,
    /// Target entitlement.
    pub target: MilliGpue,
    /// Committed entitlement (budgets are cut from this).
    pub committed: MilliGpue,
    /// What the tenant's leases may let clusters hold right now.
    pub held: MilliGpue,
    /// Drift: in-use share minus entitled share, ppm of capacity.
    pub drift_ppm: i64,
    /// The article's fairness score.
    pub fairness_score: f64,
    /// Per cluster.
    pub clusters: Vec<ClusterPart>,
    /// The most recent evictions (newest last, at most [`EXPLAIN_EVICTIONS`]) that this
    /// tenant suffered or that were made for it, from the audit log.
    #[serde(default)]
    pub evictions: Vec<EvictionSeen>,
}

/// Most evictions `kvota explain tenant` lists.
pub const EXPLAIN_EVICTIONS: usize = 5;

/// One eviction, as `kvota explain tenant` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvictionSeen {
    /// Control-plane time the report carrying it was applied.
    pub at_ms: Millis,
    /// How long before the explanation that was.
    pub ago_ms: Millis,
    /// Cluster.
    pub cluster: String,
    /// What the agent reported.
    pub note: crate::federation::EvictionNote,
}

impl Federation {
    /// Explains `tenant`; `None` if the policy does not name it.
    pub fn explain_tenant(&self, tenant: &str) -> Option<TenantExplanation> {
        let policy = self.policy()?;
        let tp = policy.tenant(tenant)?;
        let plan = self.plan();
        let i = plan.tenants.iter().position(|n| n == tenant)?;
        let e = plan.entitlements.get(i).copied().unwrap_or_default();
        let now = self.now_ms();
        let committed = self.committed().get(tenant).copied().unwrap_or(0);
        let w = u128::from(tp.weight_milli) << crate::entitlement::EFF_WEIGHT_BITS;
        let weight_kept_ppm = (u128::from(e.effective_weight_q20) * 1_000_000)
            .checked_div(w)
            .map_or(0, |v| u64::try_from(v).unwrap_or(u64::MAX));
        let clusters = self.cluster_parts(tenant, now);
        let inuse = plan.inuse.get(i).copied().unwrap_or(0);
        let evictions = self.evictions_seen(tenant, now);
        Some(TenantExplanation {
            tenant: tp.name.clone(),
            weight_milli: tp.weight_milli,
            min_share_bp: tp.min_share_bp,
            max_share_bp: tp.max_share_bp,
            half_life_ms: tp.decay_half_life_ms,
            preemptible: tp.preemptible,
            capacity: plan.capacity,
            demand: plan.demand.get(i).copied().unwrap_or(0),
            inuse,
            usage_share_ppm: e.usage_share_ppm,
            weight_share_ppm: e.weight_share_ppm,
            weight_kept_ppm,
            guarantee: e.guarantee,
            cap: e.cap,
            surplus: e.surplus,
            target: e.total,
            committed,
            held: plan.held.get(i).copied().unwrap_or(0),
            drift_ppm: drift_ppm(inuse, committed, plan.capacity),
            fairness_score: tenant_score(inuse, committed, plan.capacity),
            clusters,
            evictions,
        })
    }
    /// The tenant's numbers in each cluster at `now`.
    fn cluster_parts(&self, tenant: &str, now: Millis) -> Vec<ClusterPart> {
        self.clusters()
            .iter()
            .map(|(id, rec)| {
                let u = rec.usage.get(tenant).copied().unwrap_or_default();
                let newest = rec
                    .leases
                    .latest()
                    .and_then(|l| l.budgets.get(tenant).copied())
                    .unwrap_or_default();
                ClusterPart {
                    cluster: id.clone(),
                    inuse: u.inuse,
                    pending: u.pending,
                    budget: newest.budget,
                    fallback: newest.fallback,
                    enforceable: rec.leases.enforceable(tenant, now),
                    epoch: (rec.leases.last_epoch, rec.leases.acked_epoch),
                    unreachable: rec.leases.last_epoch > 0 && rec.leases.all_expired(now),
                }
            })
            .collect()
    }

    /// The latest evictions the tenant lost or gained room by, oldest first.
    fn evictions_seen(&self, tenant: &str, now: Millis) -> Vec<EvictionSeen> {
        let mut evictions: Vec<EvictionSeen> = self
            .audit()
            .rev()
            .filter_map(|r| match &r.event {
                AuditEvent::Eviction { cluster, note } if note.victim_tenant == tenant || note.for_tenant == tenant => {
                    Some(EvictionSeen {
                        at_ms: r.at_ms,
                        ago_ms: now.saturating_sub(r.at_ms),
                        cluster: cluster.clone(),
                        note: note.clone(),
                    })
                }
                _ => None,
            })
            .take(EXPLAIN_EVICTIONS)
            .collect();
        evictions.reverse();
        evictions
    }
}

fn pct_bp(bp: u32) -> String {
    let whole = bp / 100;
    let frac = bp % 100;
    if frac == 0 {
        format!("{whole}%")
    } else {
        format!("{whole}.{frac:02}%")
    }
}

fn pct_ppm(ppm: i64) -> String {
    format!("{:.1}%", ppm as f64 / 10_000.0)
}

impl fmt::Display for TenantExplanation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "tenant {}: entitled to {} GPUe now (target {}), holds {} in use",
            self.tenant,
            g(self.committed),
            g(self.target),
            g(self.inuse)
        );
        let _ = writeln!(
            s,
            "  policy:    weight {}, minShare {}, maxShare {}, half-life {}, {}",
            g(self.weight_milli),
            pct_bp(self.min_share_bp),
            pct_bp(self.max_share_bp),
            format_duration_ms(self.half_life_ms),
            if self.preemptible {
                "preemptible"
            } else {
                "never preempted"
            }
        );
        let _ = writeln!(
            s,
            "  capacity:  {} GPUe federation-wide; demand {} GPUe",
            g(self.capacity),
            g(self.demand)
        );
        let _ = writeln!(
            s,
            "  guarantee: min(demand {}, minShare x capacity) = {}",
            g(self.demand),
            g(self.guarantee)
        );
        let _ = writeln!(
            s,
            "  cap:       min(demand {}, maxShare x capacity) = {}",
            g(self.demand),
            g(self.cap)
        );
        self.write_shares(&mut s);
        self.write_places(&mut s);
        f.write_str(s.trim_end())
    }
}

impl TenantExplanation {
    /// The decay, surplus, target, committed and fairness lines.
    fn write_shares(&self, s: &mut String) {
        let kept = self.weight_kept_ppm as f64 / 10_000.0;
        let _ = writeln!(
            s,
            "  decay:     recent usage share {} vs weight share {}: keeps {kept:.1}% of its weight for the surplus",
            pct_ppm(i64::from(self.usage_share_ppm)),
            pct_ppm(i64::from(self.weight_share_ppm)),
        );
        let _ = writeln!(
            s,
            "  surplus:   {} GPUe of what is left above all guarantees (weighted max-min)",
            g(self.surplus)
        );
        let _ = writeln!(
            s,
            "  target:    guarantee {} + surplus {} = {}",
            g(self.guarantee),
            g(self.surplus),
            g(self.target)
        );
        if self.committed < self.target {
            let _ = writeln!(
                s,
                "  committed: {} (below target: the difference is still held by other tenants' leases; it moves once they acknowledge lower budgets or expire)",
                g(self.committed)
            );
        } else if self.committed > self.target {
            let _ = writeln!(
                s,
                "  committed: {} (above target: this tenant's leases may still allow {}; it falls as they are acknowledged or expire)",
                g(self.committed),
                g(self.held)
            );
        }
        let _ = writeln!(
            s,
            "  fairness:  drift {} of capacity, score {:.2}",
            pct_ppm(self.drift_ppm),
            self.fairness_score
        );
    }

    /// One line per cluster and per recent eviction.
    fn write_places(&self, s: &mut String) {
        for c in &self.clusters {
            let _ = writeln!(
                s,
                "  cluster {}: in use {}, pending {}, budget {} (safe {}), may enforce {}, epoch {} (acked {}){}",
                c.cluster,
                g(c.inuse),
                g(c.pending),
                g(c.budget),
                g(c.fallback),
                g(c.enforceable),
                c.epoch.0,
                c.epoch.1,
                if c.unreachable {
                    ", UNREACHABLE: lease expired, safe budgets apply"
                } else {
                    ""
                }
            );
        }
        for e in &self.evictions {
            let n = &e.note;
            let what = match n.outcome {
                EvictionOutcome::Evicted => "evicted",
                _ => "could not evict (PodDisruptionBudget; retried later)",
            };
            let side = if n.victim_tenant == self.tenant {
                "lost"
            } else {
                "gained room"
            };
            let _ = writeln!(
                s,
                "  reclaim:   {side}, {} ago: cluster {} {what} {} ({} GPUe of {}) for {} pod {}: {}",
                format_duration_ms(e.ago_ms),
                e.cluster,
                n.victim,
                g(n.milli_gpue),
                n.victim_tenant,
                n.for_tenant,
                n.for_pod,
                n.why
            );
        }
    }
}

/// Explains an admission decision in a few lines.
pub fn explain_pod(pod: &PodRequest, view: &LocalView, decision: &Decision) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "pod {}/{} requests {} GPUe",
        pod.namespace,
        if pod.name.is_empty() { "<unnamed>" } else { &pod.name },
        g(pod.gpue)
    );
    match &view.tenant {
        Some(t) => {
            let _ = writeln!(
                s,
                "  tenant {t} in cluster {} ({} mode, lease {})",
                view.cluster, view.mode, view.lease
            );
        }
        None => {
            let _ = writeln!(s, "  namespace belongs to no tenant");
        }
    }
    let _ = writeln!(
        s,
        "  in use {} + request {} = {} against budget {} (entitlement {} federation-wide)",
        g(view.inuse),
        g(pod.gpue),
        g(decision.after),
        g(view.budget),
        g(view.entitlement)
    );
    let _ = writeln!(s, "  decision: {:?} ({:?})", decision.verdict, decision.reason);
    let _ = write!(s, "  {}", decision.message);
    s
}
