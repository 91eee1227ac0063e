//! Reclaim: which pods an agent evicts so that a starved tenant gets its guarantee back.
//!
//! Pure, like the rest of the core: the agent passes what its cluster looks like and the
//! evictions of the last minute; the plan comes back with its reasons in words. The
//! article's rules, and how they hold here:
//! - **Only for a starved tenant.** A tenant is starved in a cluster while it holds less
//!   than its guarantee there, `min(demand here, minShare x this cluster's capacity)`,
//!   with a pod waiting (admitted and unbound, gated, or recently denied); it is
//!   evicted for only when no node has room for that pod. Its *budget* is not the yardstick: while others hold the
//!   cluster, break-before-make keeps the starved tenant's budget at what is free, so
//!   the budget only grows once pods over their budgets are gone, which is what
//!   reclaim does. The freed GPUs are not admitted to anyone over budget; the next
//!   lease hands them to the starved tenant. Reclaim
//!   acts only after it has been starved for `starvedFor`, and only for a pod that could
//!   run on some node of the cluster at all: large enough, and allowed there by its node
//!   selector, required node affinity and tolerations (an unschedulable pod never evicts
//!   anyone); room is made only on a node the pod may use.
//! - **And for pods within a budget.** A tenant at or above its guarantee whose waiting
//!   pod fits its budget here (`inuse + pod <= budget`) is owed that room too: GPUs the
//!   agent lent to tenants over their budgets ([`crate::admission::borrow_room`]) come
//!   back this way. Guarantees are served first; the same victims, limits and damping
//!   apply.
//! - **Only from preemptible tenants above their entitlement here** (their budget in
//!   this cluster's lease). Non-preemptible tenants are never victims, whatever the
//!   numbers, and an eviction never takes a victim tenant below its budget (a pod
//!   larger than the tenant's excess stays: evicting a whole-node pod to seat a small
//!   one fragments the cluster, which the simulator showed costs inference dearly).
//! - **Just enough**: on the node where the fewest GPUe of victims make room for the
//!   pod (ties: the node whose victims have run least); within a node the
//!   most-over-entitlement tenant first, then the lowest pod priority, then the youngest
//!   pod (least work lost). Pods younger than `minRuntime`
//!   are spared unless nothing else frees enough.
//! - **Damped**: at most `maxEvictionsPerMinute` per cluster and
//!   `maxEvictionsPerMinutePerTenant` per victim tenant in any 60 s window; a runaway
//!   tenant that keeps asking cannot exceed them, and gets nothing once it is at its
//!   guarantee.
//!
//! It acts on the budgets of this cluster's lease only (never across clusters), so a
//! partitioned agent restores guarantees locally with its safe budgets.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::entitlement::share_of;
use crate::names::{PodKey, TenantName};
use crate::policy::ReclaimConfig;
use crate::units::format_gpue as g;
use crate::{MilliGpue, Millis};

/// The rate-limit window.
pub const WINDOW_MS: Millis = 60_000;

/// A tenant's standing in this cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantHere {
    /// Name.
    pub name: TenantName,
    /// May its pods be evicted?
    pub preemptible: bool,
    /// Guaranteed share, basis points (of this cluster's capacity, here).
    pub min_share_bp: u32,
    /// Its budget in this cluster now (lease budget, or safe budget after expiry).
    pub budget: MilliGpue,
    /// GPUe its pods on nodes hold here (bound). Admitted pods still waiting for a node
    /// are not in it: they are among the waiting pods, and counting them here too would
    /// make a tenant whose admitted pods cannot be placed look satisfied.
    pub inuse: MilliGpue,
}

/// A running pod that could be evicted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunningPod {
    /// `namespace/name`.
    pub key: PodKey,
    /// Tenant.
    pub tenant: TenantName,
    /// GPUe it holds.
    pub gpue: MilliGpue,
    /// Pod priority.
    pub priority: i32,
    /// When it started running (agent clock).
    pub started_ms: Millis,
    /// Node index.
    pub node: usize,
    /// Device resource it holds, and how many.
    pub resource: String,
    /// Devices.
    pub count: u64,
    /// Admitted on borrowed GPUs (over its tenant's budget, into idle capacity; the
    /// agent that admitted it remembers it). Only these are taken for a pod within its
    /// budget, and they go first for a guarantee too.
    pub borrowed: bool,
}

/// A pod waiting for room (admitted, not yet bound).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WaitingPod {
    /// `namespace/name`.
    pub key: PodKey,
    /// Tenant.
    pub tenant: TenantName,
    /// GPUe it asks for.
    pub gpue: MilliGpue,
    /// Pod priority.
    pub priority: i32,
    /// Waiting since (agent clock).
    pub since_ms: Millis,
    /// Device resource it needs, and how many.
    pub resource: String,
    /// Devices.
    pub count: u64,
    /// The nodes (indices) its node selector, required node affinity and tolerations let
    /// it run on; `None`: any node.
    pub nodes: Option<Vec<usize>>,
}

impl WaitingPod {
    /// May it run on node `n`?
    pub fn may_use(&self, n: usize) -> bool {
        self.nodes.as_ref().is_none_or(|ns| ns.contains(&n))
    }
}

/// The cluster as the agent sees it.
#[derive(Clone, Debug)]
pub struct ClusterView<'a> {
    /// Agent clock.
    pub now_ms: Millis,
    /// Cluster capacity, GPUe.
    pub capacity: MilliGpue,
    /// Free devices per node, by resource name.
    pub node_free: &'a [BTreeMap<String, u64>],
    /// Total devices per node, by resource name (to tell unschedulable pods).
    pub node_total: &'a [BTreeMap<String, u64>],
    /// Tenants (policy tenants).
    pub tenants: &'a [TenantHere],
    /// Running pods.
    pub running: &'a [RunningPod],
    /// Pods waiting: admitted and unbound, gated, or recently denied.
    pub waiting: &'a [WaitingPod],
}

/// One eviction, with its reason.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Victim {
    /// `namespace/name`.
    pub key: PodKey,
    /// Its tenant.
    pub tenant: TenantName,
    /// GPUe it frees.
    pub gpue: MilliGpue,
    /// Why this pod, in words.
    pub why: String,
}

/// What to do now.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    /// Evict these pods so that `for_pod` of `for_tenant` can run.
    Evict {
        /// The starved tenant.
        for_tenant: TenantName,
        /// Its pod that will get the room.
        for_pod: PodKey,
        /// The node the room is made on.
        node: usize,
        /// The victims, in eviction order.
        victims: Vec<Victim>,
        /// The whole story, for the audit log.
        summary: String,
    },
    /// Nothing to do; why (for logs and `kvota explain`).
    Idle(String),
}

/// A starved tenant: what it holds, what it is guaranteed, and the pod it waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Starved {
    /// Tenant.
    pub tenant: TenantName,
    /// GPUe held here.
    pub inuse: MilliGpue,
    /// What it is owed here: its guarantee, or what its budget covers of its demand if
    /// that is more.
    pub guarantee: MilliGpue,
    /// At or above its guarantee, claiming a pod its budget covers (GPUs lent to tenants
    /// over their budgets come back); false: below its guarantee.
    pub within_budget: bool,
    /// The waiting pod reclaim would seat (highest priority, then oldest).
    pub pod: WaitingPod,
    /// Some node has room for it now (then the next lease admits it; no eviction).
    pub room: bool,
}

/// Some node the pod may use has `count` of its device (in `nodes`: free or total).
fn fits_some_node(nodes: &[BTreeMap<String, u64>], pod: &WaitingPod) -> bool {
    nodes
        .iter()
        .enumerate()
        .any(|(i, n)| pod.may_use(i) && n.get(&pod.resource).copied().unwrap_or(0) >= pod.count)
}

/// Tenants starved right now (see the module docs), in name order.
pub fn starved(view: &ClusterView<'_>) -> Vec<Starved> {
    let mut out = Vec::new();
    let lent = view.running.iter().any(|p| p.borrowed);
    for t in view.tenants {
        let mine: Vec<&WaitingPod> = view
            .waiting
            .iter()
            .filter(|w| w.tenant == t.name && fits_some_node(view.node_total, w))
            .collect();
        let demand = t.inuse.saturating_add(mine.iter().map(|w| w.gpue).sum());
        let guarantee = demand.min(share_of(view.capacity, t.min_share_bp));
        let below_guarantee = t.inuse < guarantee;
        // Owed: the guarantee, or what its budget here covers of its demand, whichever
        // is more (a pod within the budget takes back GPUs lent to others, so only while
        // some are lent).
        let owed = if lent {
            guarantee.max(demand.min(t.budget))
        } else {
            guarantee
        };
        if t.inuse >= owed {
            continue;
        }
        // The pod to seat: highest priority, then oldest, then key; above its guarantee,
        // only a pod its budget covers.
        let pod = mine
            .iter()
            .filter(|w| below_guarantee || t.inuse.saturating_add(w.gpue) <= t.budget)
            .min_by(|a, b| {
                b.priority
                    .cmp(&a.priority)
                    .then(a.since_ms.cmp(&b.since_ms))
                    .then(a.key.cmp(&b.key))
            });
        if let Some(pod) = pod {
            out.push(Starved {
                tenant: t.name.clone(),
                inuse: t.inuse,
                guarantee: owed,
                within_budget: !below_guarantee,
                room: fits_some_node(view.node_free, pod),
                pod: (*pod).clone(),
            });
        }
    }
    out
}

/// Evictions in the rate window: per cluster and per victim tenant.
fn recent_counts(recent: &[(Millis, TenantName)], now_ms: Millis) -> (u32, BTreeMap<&str, u32>) {
    let mut all = 0u32;
    let mut per = BTreeMap::new();
    for (at, tenant) in recent {
        if now_ms.saturating_sub(*at) < WINDOW_MS {
            all += 1;
            *per.entry(tenant.as_str()).or_insert(0u32) += 1;
        }
    }
    (all, per)
}

/// Running pods on node `n` holding `resource` whose tenant is a victim tenant (and,
/// when `spare_young`, that have run for at least `minRuntime`).
fn cands_all<'v>(
    view: &'v ClusterView<'_>,
    n: usize,
    resource: &'v str,
    over: &'v BTreeMap<&str, MilliGpue>,
    spare_young: bool,
    cfg: &'v ReclaimConfig,
    only_borrowed: bool,
) -> impl Iterator<Item = &'v RunningPod> + 'v {
    let now = view.now_ms;
    view.running.iter().filter(move |p| {
        p.node == n
            && p.resource == resource
            && (p.borrowed || !only_borrowed)
            && !(p.borrowed && crate::faults::on(|f| f.borrowed_not_evictable))
            && over.contains_key(p.tenant.as_str())
            && (!spare_young || now.saturating_sub(p.started_ms) >= cfg.min_runtime_ms)
    })
}

/// Plans one reclaim step.
///
/// `starved_since` says since when each tenant has been starved (the caller keeps it
/// from [`starved`]); `recent` lists the evictions already made (time, victim tenant).
pub fn plan(
    view: &ClusterView<'_>,
    cfg: &ReclaimConfig,
    starved_since: &BTreeMap<TenantName, Millis>,
    recent: &[(Millis, TenantName)],
) -> Decision {
    if !cfg.enabled {
        return Decision::Idle("reclaim is disabled by the policy (spec.reclaim.enabled: false)".into());
    }
    let hungry = starved(view);
    // The tenant starved longest goes first; one whose pod has room needs no eviction.
    let mut ready: Vec<(&Starved, Millis)> = hungry
        .iter()
        .filter(|s| !s.room)
        .map(|s| (s, starved_since.get(&s.tenant).copied().unwrap_or(view.now_ms)))
        .collect();
    // Claims starved for starvedFor first (a fresh claim never holds up one that has
    // waited); among them guarantees before budgets, then latency-sensitive
    // (non-preemptible) tenants, then the longest starved. One claim per step: trying
    // every claim in turn was measured to evict more and lose fairness and utilization
    // on the Philly and mixed-sizes traces (docs/policy-comparison.md), so a claim that
    // cannot be served still holds up the ones behind it.
    let preemptible = |name: &str| view.tenants.iter().any(|t| t.name == name && t.preemptible);
    let waited = |since: Millis| view.now_ms.saturating_sub(since) >= cfg.starved_for_ms;
    ready.sort_by(|a, b| {
        (
            !waited(a.1),
            a.0.within_budget,
            preemptible(&a.0.tenant),
            a.1,
            &a.0.tenant,
        )
            .cmp(&(
                !waited(b.1),
                b.0.within_budget,
                preemptible(&b.0.tenant),
                b.1,
                &b.0.tenant,
            ))
    });
    let Some(&(s, since)) = ready.first() else {
        return Decision::Idle(if hungry.is_empty() {
            "no tenant is below its guarantee, or within its budget, with a pod waiting".into()
        } else {
            "tenants below what they are owed have room for their waiting pods; the next lease admits them".into()
        });
    };
    let starved_for = view.now_ms.saturating_sub(since);
    if starved_for < cfg.starved_for_ms {
        return Decision::Idle(format!(
            "tenant `{}` is below what it is owed here ({} of {} GPUe) for {} ms, less than starvedFor {} ms",
            s.tenant,
            g(s.inuse),
            g(s.guarantee),
            starved_for,
            cfg.starved_for_ms
        ));
    }
    let (in_window, per_tenant) = recent_counts(recent, view.now_ms);
    let cluster_left = cfg.max_evictions_per_minute.saturating_sub(in_window);
    if cluster_left == 0 {
        return Decision::Idle(format!(
            "{in_window} evictions in the last minute, the cluster's limit (maxEvictionsPerMinute {}); `{}` waits",
            cfg.max_evictions_per_minute, s.tenant
        ));
    }
    plan_for(view, cfg, s, starved_for, &per_tenant, cluster_left)
}

/// One claim's plan (see [`plan`]): the victims that make room for `s`'s pod, or why
/// there are none.
fn plan_for(
    view: &ClusterView<'_>,
    cfg: &ReclaimConfig,
    s: &Starved,
    starved_for: Millis,
    per_tenant: &BTreeMap<&str, u32>,
    cluster_left: u32,
) -> Decision {
    // Victim tenants: preemptible, not the starved one, above their budget here.
    let over: BTreeMap<&str, MilliGpue> = view
        .tenants
        .iter()
        .filter(|t| t.preemptible && t.name != s.tenant && t.inuse > t.budget)
        .map(|t| (t.name.as_str(), t.inuse - t.budget))
        .collect();
    if over.is_empty() {
        return Decision::Idle(format!(
            "tenant `{}` is below what it is owed here but no preemptible tenant is above its budget here",
            s.tenant
        ));
    }
    let claim = Claim {
        view,
        cfg,
        s,
        over: &over,
        per_tenant,
        cluster_left,
    };
    for spare_young in [true, false] {
        let mut best: Option<(MilliGpue, usize, Vec<&RunningPod>, u128)> = None;
        for (n, free) in view.node_free.iter().enumerate() {
            if !s.pod.may_use(n) {
                continue;
            }
            let Some((cost, taken, lost)) = claim.on_node(n, free, spare_young) else {
                continue;
            };
            // Ties between nodes go to the one whose victims have run least (least work
            // lost), then to the lower index.
            if best
                .as_ref()
                .is_none_or(|b| (cost, taken.len(), lost) < (b.0, b.2.len(), b.3))
            {
                best = Some((cost, n, taken, lost));
            }
        }
        if let Some((cost, node, taken, _)) = best {
            return claim.evict(starved_for, cost, node, &taken);
        }
    }
    Decision::Idle(format!(
        "tenant `{}` is starved but no node can make room for {} within the eviction limits (cluster {} left this minute, {} per tenant)",
        s.tenant, s.pod.key, cluster_left, cfg.max_evictions_per_minute_per_tenant
    ))
}

/// What [`plan_for`] searches with: the claim, the tenants above their budget (by how
/// much) and the eviction limits left.
struct Claim<'v, 'a> {
    view: &'v ClusterView<'a>,
    cfg: &'v ReclaimConfig,
    s: &'v Starved,
    over: &'v BTreeMap<&'v str, MilliGpue>,
    per_tenant: &'v BTreeMap<&'v str, u32>,
    cluster_left: u32,
}

impl<'v> Claim<'v, '_> {
    /// The victims on node `n` (with `free` idle) that make room for the pod: their
    /// GPUe, the pods and the work lost (GPUe x ms run), or `None` if none do.
    fn on_node(
        &self,
        n: usize,
        free: &BTreeMap<String, u64>,
        spare_young: bool,
    ) -> Option<(MilliGpue, Vec<&'v RunningPod>, u128)> {
        let (view, cfg, s, over) = (self.view, self.cfg, self.s, self.over);
        let mut room = free.get(&s.pod.resource).copied().unwrap_or(0);
        let mut cands: Vec<&RunningPod> =
            cands_all(view, n, &s.pod.resource, over, spare_young, cfg, s.within_budget).collect();
        cands.sort_by(|a, b| {
            b.borrowed
                .cmp(&a.borrowed)
                .then(over[b.tenant.as_str()].cmp(&over[a.tenant.as_str()]))
                .then(a.priority.cmp(&b.priority))
                .then(b.started_ms.cmp(&a.started_ms))
                .then(b.key.cmp(&a.key)) // same start: the later name first
        });
        let mut left_over = over.clone();
        let mut taken_per: BTreeMap<&str, u32> = BTreeMap::new();
        let mut taken = Vec::new();
        let mut cost = 0;
        for p in cands {
            if room >= s.pod.count {
                break;
            }
            let t = p.tenant.as_str();
            let used = self.per_tenant.get(t).copied().unwrap_or(0) + taken_per.get(t).copied().unwrap_or(0);
            // Never below its budget: a pod larger than the tenant's excess stays (evicting
            // a whole-node pod to seat a small one fragments the cluster).
            let still_over = left_over.get(t).copied().unwrap_or(0) >= p.gpue;
            let fits_limits = u32::try_from(taken.len()).unwrap_or(u32::MAX) < self.cluster_left
                && used < cfg.max_evictions_per_minute_per_tenant;
            if !still_over || !fits_limits {
                continue;
            }
            room += p.count;
            cost += p.gpue;
            if let Some(o) = left_over.get_mut(t) {
                *o = o.saturating_sub(p.gpue);
            }
            *taken_per.entry(t).or_insert(0) += 1;
            taken.push(p);
        }
        if room < s.pod.count {
            // The greedy order ran into a limit: one pod that frees enough on its own
            // (the smallest such) may still do.
            room = free.get(&s.pod.resource).copied().unwrap_or(0);
            if let Some(p) = self.single_victim(n, room, spare_young) {
                room += p.count;
                cost = p.gpue;
                taken = vec![p];
            }
        }
        let lost: u128 = taken
            .iter()
            .map(|p| u128::from(p.gpue) * u128::from(view.now_ms.saturating_sub(p.started_ms)))
            .sum();
        (room >= s.pod.count).then_some((cost, taken, lost))
    }

    /// The smallest single pod on node `n` that frees enough on its own (with `room`
    /// idle) within the per-tenant limit.
    fn single_victim(&self, n: usize, room: u64, spare_young: bool) -> Option<&'v RunningPod> {
        let (s, over) = (self.s, self.over);
        cands_all(
            self.view,
            n,
            &s.pod.resource,
            over,
            spare_young,
            self.cfg,
            s.within_budget,
        )
        .filter(|p| room + p.count >= s.pod.count)
        .filter(|p| over.get(p.tenant.as_str()).copied().unwrap_or(0) >= p.gpue)
        .filter(|p| {
            self.per_tenant.get(p.tenant.as_str()).copied().unwrap_or(0) < self.cfg.max_evictions_per_minute_per_tenant
        })
        .min_by(|a, b| {
            a.gpue
                .cmp(&b.gpue)
                .then(b.started_ms.cmp(&a.started_ms))
                .then(a.key.cmp(&b.key))
        })
    }

    /// The eviction of `taken` (costing `cost` GPUe) on `node`, with its reasons.
    fn evict(&self, starved_for: Millis, cost: MilliGpue, node: usize, taken: &[&RunningPod]) -> Decision {
        let (view, cfg, s, over) = (self.view, self.cfg, self.s, self.over);
        let budget_of = |name: &str| view.tenants.iter().find(|t| t.name == name).map_or(0, |t| t.budget);
        let victims: Vec<Victim> = taken
            .iter()
            .map(|p| Victim {
                key: p.key.clone(),
                tenant: p.tenant.clone(),
                gpue: p.gpue,
                why: format!(
                    "{}tenant `{}` holds {} GPUe above its budget of {} GPUe here; pod priority {}, running {} s{}",
                    if p.borrowed {
                        "admitted on borrowed GPUs, lent while idle; "
                    } else {
                        ""
                    },
                    p.tenant,
                    g(over[p.tenant.as_str()]),
                    g(budget_of(&p.tenant)),
                    p.priority,
                    view.now_ms.saturating_sub(p.started_ms) / 1000,
                    if view.now_ms.saturating_sub(p.started_ms) < cfg.min_runtime_ms {
                        " (younger than minRuntime: nothing older frees enough)"
                    } else {
                        ""
                    }
                ),
            })
            .collect();
        let summary = format!(
            "tenant `{}` starved for {} s: holds {} of the {} GPUe its {} here and pod {} ({} GPUe) has no room; evicting {} pod(s) ({} GPUe) on node {}: {}",
            s.tenant,
            starved_for / 1000,
            g(s.inuse),
            g(s.guarantee),
            if s.within_budget { "budget covers" } else { "guarantee gives it" },
            s.pod.key,
            g(s.pod.gpue),
            victims.len(),
            g(cost),
            node,
            victims.iter().map(|v| v.key.as_str()).collect::<Vec<_>>().join(", ")
        );
        Decision::Evict {
            for_tenant: s.tenant.clone(),
            for_pod: s.pod.key.clone(),
            node,
            victims,
            summary,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(gpus: u64) -> BTreeMap<String, u64> {
        [("nvidia.com/gpu".to_string(), gpus)].into()
    }

    fn run(key: &str, tenant: &str, gpus: u64, priority: i32, started_ms: Millis, node: usize) -> RunningPod {
        RunningPod {
            key: PodKey::parse(key).expect("a pod key"),
            tenant: TenantName::parse(tenant).expect("name"),
            gpue: gpus * 1000,
            priority,
            started_ms,
            node,
            resource: "nvidia.com/gpu".into(),
            count: gpus,
            borrowed: false,
        }
    }

    fn wait(key: &str, tenant: &str, gpus: u64) -> WaitingPod {
        WaitingPod {
            key: PodKey::parse(key).expect("a pod key"),
            tenant: TenantName::parse(tenant).expect("name"),
            gpue: gpus * 1000,
            priority: 0,
            since_ms: 0,
            resource: "nvidia.com/gpu".into(),
            count: gpus,
            nodes: None,
        }
    }

    fn tenant(name: &str, preemptible: bool, min_pct: u32, budget: u64, inuse: u64) -> TenantHere {
        TenantHere {
            name: TenantName::parse(name).expect("name"),
            preemptible,
            min_share_bp: min_pct * 100,
            budget: budget * 1000,
            inuse: inuse * 1000,
        }
    }

    #[test]
    fn evicts_just_enough_youngest_first_on_the_cheapest_node() {
        // Two 4-GPU nodes full of training (over its budget of 4 by 4). Inference (budget
        // 4, guarantee 40 % of 8 = 3.2) holds nothing and waits for a 2-GPU pod.
        let free = [node(0), node(0)];
        let total = [node(4), node(4)];
        let tenants = [tenant("inference", false, 40, 4, 0), tenant("training", true, 20, 4, 8)];
        let running = [
            run("t/a", "training", 2, 0, 0, 0),
            run("t/b", "training", 1, 0, 1_000, 0),
            run("t/c", "training", 1, 0, 2_000, 0),
            run("t/d", "training", 4, 0, 3_000, 1),
        ];
        let waiting = [wait("i/x", "inference", 2)];
        let view = ClusterView {
            now_ms: 1_000_000,
            capacity: 8000,
            node_free: &free,
            node_total: &total,
            tenants: &tenants,
            running: &running,
            waiting: &waiting,
        };
        let cfg = ReclaimConfig::default();
        let since = BTreeMap::from([(TenantName::from_static("inference"), 0)]);
        let Decision::Evict {
            victims, node, for_pod, ..
        } = plan(&view, &cfg, &since, &[])
        else {
            panic!("expected evictions")
        };
        // Node 0 needs 2 GPUe of victims (the two youngest 1-GPU pods), node 1 needs 4.
        assert_eq!(node, 0);
        assert_eq!(
            victims.iter().map(|v| v.key.as_str()).collect::<Vec<_>>(),
            ["t/c", "t/b"]
        );
        assert_eq!(for_pod, "i/x");
    }

    #[test]
    fn never_a_non_preemptible_victim_and_never_before_starved_for() {
        let free = [node(0)];
        let total = [node(4)];
        // Inference over its budget but not preemptible; training starved.
        let tenants = [tenant("inference", false, 40, 1, 4), tenant("training", true, 50, 3, 0)];
        let running = [run("i/a", "inference", 4, 0, 0, 0)];
        let waiting = [wait("t/x", "training", 1)];
        let view = ClusterView {
            now_ms: 100_000,
            capacity: 4000,
            node_free: &free,
            node_total: &total,
            tenants: &tenants,
            running: &running,
            waiting: &waiting,
        };
        let since = BTreeMap::from([(TenantName::from_static("training"), 0)]);
        match plan(&view, &ReclaimConfig::default(), &since, &[]) {
            Decision::Idle(why) => assert!(why.contains("no preemptible tenant is above its budget"), "{why}"),
            d => panic!("evicted a non-preemptible tenant: {d:?}"),
        }
        let tenants = [tenant("inference", false, 40, 4, 0), tenant("training", true, 50, 0, 4)];
        let running = [run("t/a", "training", 4, 0, 0, 0)];
        let waiting = [wait("i/x", "inference", 1)];
        let view = ClusterView {
            tenants: &tenants,
            running: &running,
            waiting: &waiting,
            ..view
        };
        let since = BTreeMap::from([(TenantName::from_static("inference"), 90_000)]);
        match plan(&view, &ReclaimConfig::default(), &since, &[]) {
            Decision::Idle(why) => assert!(why.contains("less than starvedFor"), "{why}"),
            d => panic!("evicted before starvedFor: {d:?}"),
        }
    }

    #[test]
    fn a_pod_within_its_budget_takes_back_lent_gpus_after_guarantees() {
        // One 8-GPU node. Training (guarantee 20 % = 1.6, budget 6) holds 2 and waits for
        // a 2-GPU pod its budget covers; research borrowed 6 (budget 0). Inference is
        // below its guarantee with a pod waiting too: it goes first.
        let free = [node(0)];
        let total = [node(8)];
        let tenants = [
            tenant("inference", false, 40, 2, 0),
            tenant("research", true, 0, 0, 6),
            tenant("training", true, 20, 6, 2),
        ];
        let lent = |p: RunningPod| RunningPod { borrowed: true, ..p };
        let running = [
            lent(run("r/a", "research", 2, 0, 0, 0)),
            lent(run("r/b", "research", 2, 0, 1_000, 0)),
            lent(run("r/c", "research", 2, 0, 2_000, 0)),
            run("t/a", "training", 2, 0, 0, 0),
        ];
        let waiting = [wait("t/x", "training", 2), wait("i/x", "inference", 1)];
        let view = ClusterView {
            now_ms: 1_000_000,
            capacity: 8000,
            node_free: &free,
            node_total: &total,
            tenants: &tenants,
            running: &running,
            waiting: &waiting,
        };
        let hungry = starved(&view);
        assert_eq!(
            hungry
                .iter()
                .map(|s| (s.tenant.as_str(), s.within_budget, s.guarantee))
                .collect::<Vec<_>>(),
            [("inference", false, 1000), ("training", true, 4000)]
        );
        let since = BTreeMap::from([
            (TenantName::from_static("inference"), 0),
            (TenantName::from_static("training"), 0),
        ]);
        let Decision::Evict {
            for_tenant, victims, ..
        } = plan(&view, &ReclaimConfig::default(), &since, &[])
        else {
            panic!("expected evictions")
        };
        assert_eq!((for_tenant.as_str(), victims.len()), ("inference", 1));
        // Without inference waiting, training's pod within its budget evicts research's
        // youngest borrowed pod; a pod its budget does not cover claims nothing.
        let waiting = [wait("t/x", "training", 2)];
        let view = ClusterView {
            waiting: &waiting,
            ..view
        };
        let Decision::Evict {
            for_tenant,
            victims,
            summary,
            ..
        } = plan(&view, &ReclaimConfig::default(), &since, &[])
        else {
            panic!("expected evictions")
        };
        assert_eq!((for_tenant.as_str(), victims[0].key.as_str()), ("training", "r/c"));
        assert!(summary.contains("budget covers"), "{summary}");
        // Pods over budget that were not borrowed (their tenant's entitlement fell) are
        // left to finish: a pod within its budget takes back lent GPUs only.
        let unmarked: Vec<RunningPod> = running
            .iter()
            .map(|p| RunningPod {
                borrowed: false,
                ..p.clone()
            })
            .collect();
        let view2 = ClusterView {
            running: &unmarked,
            ..view.clone()
        };
        assert!(matches!(
            plan(&view2, &ReclaimConfig::default(), &since, &[]),
            Decision::Idle(_)
        ));
        let waiting = [wait("t/y", "training", 5)];
        let view = ClusterView {
            waiting: &waiting,
            ..view
        };
        assert!(starved(&view).is_empty());
    }

    #[test]
    fn a_fresh_claim_does_not_hold_up_one_that_has_waited() {
        // Two 4-GPU nodes. Inference (not preemptible, so its claim sorts first) waits
        // for a 4-GPU pod allowed only on node 1, where training holds exactly its budget:
        // nothing there can be evicted. Batch is below its guarantee with a 1-GPU pod;
        // research borrowed node 0.
        let free = [node(0), node(0)];
        let total = [node(4), node(4)];
        let tenants = [
            tenant("batch", true, 25, 2, 0),
            tenant("inference", false, 40, 8, 0),
            tenant("research", true, 0, 0, 4),
            tenant("training", true, 50, 4, 4),
        ];
        let running = [
            RunningPod {
                borrowed: true,
                ..run("r/a", "research", 4, 0, 0, 0)
            },
            run("t/a", "training", 4, 0, 0, 1),
        ];
        let only_node_1 = WaitingPod {
            nodes: Some(vec![1]),
            ..wait("i/x", "inference", 4)
        };
        let waiting = [only_node_1, wait("b/x", "batch", 1)];
        let view = ClusterView {
            now_ms: 1_000_000,
            capacity: 8000,
            node_free: &free,
            node_total: &total,
            tenants: &tenants,
            running: &running,
            waiting: &waiting,
        };
        let hungry: Vec<TenantName> = starved(&view).into_iter().map(|s| s.tenant).collect();
        assert_eq!(hungry, ["batch", "inference"]);
        // Inference only just started waiting: batch, which waited long, is served.
        let since = BTreeMap::from([
            (TenantName::from_static("inference"), 999_000),
            (TenantName::from_static("batch"), 0),
        ]);
        let Decision::Evict {
            for_tenant, victims, ..
        } = plan(&view, &ReclaimConfig::default(), &since, &[])
        else {
            panic!("held up by a fresh claim")
        };
        assert_eq!((for_tenant.as_str(), victims[0].key.as_str()), ("batch", "r/a"));
        // Both waited long: inference's claim comes first and cannot be served; one claim
        // per step, so batch waits (a limitation the comparison page states).
        let since = BTreeMap::from([
            (TenantName::from_static("inference"), 0),
            (TenantName::from_static("batch"), 0),
        ]);
        let Decision::Idle(why) = plan(&view, &ReclaimConfig::default(), &since, &[]) else {
            panic!("more than one claim per step")
        };
        assert!(why.contains("`inference`"), "{why}");
        // Only inference waiting, and for less than starvedFor: nothing yet, and it says so.
        let since = BTreeMap::from([
            (TenantName::from_static("inference"), 999_000),
            (TenantName::from_static("batch"), 999_000),
        ]);
        let Decision::Idle(why) = plan(&view, &ReclaimConfig::default(), &since, &[]) else {
            panic!("evicted before starvedFor")
        };
        assert!(why.contains("less than starvedFor"), "{why}");
    }

    #[test]
    fn rate_limits_and_unschedulable_pods_stop_it() {
        let free = [node(0)];
        let total = [node(4)];
        let tenants = [tenant("inference", false, 50, 4, 0), tenant("training", true, 0, 0, 4)];
        let running = [
            run("t/a", "training", 1, 0, 0, 0),
            run("t/b", "training", 1, 0, 0, 0),
            run("t/c", "training", 2, 0, 0, 0),
        ];
        let waiting = [wait("i/x", "inference", 2)];
        let view = ClusterView {
            now_ms: 1_000_000,
            capacity: 4000,
            node_free: &free,
            node_total: &total,
            tenants: &tenants,
            running: &running,
            waiting: &waiting,
        };
        let since = BTreeMap::from([(TenantName::from_static("inference"), 0)]);
        let cfg = ReclaimConfig {
            max_evictions_per_minute_per_tenant: 1,
            ..ReclaimConfig::default()
        };
        // One eviction allowed: only the 2-GPU pod alone makes room.
        let Decision::Evict { victims, .. } = plan(&view, &cfg, &since, &[]) else {
            panic!("expected an eviction")
        };
        assert_eq!(victims.iter().map(|v| v.key.as_str()).collect::<Vec<_>>(), ["t/c"]);
        // That one spent: nothing more this minute.
        let recent = [(990_000, TenantName::from_static("training"))];
        assert!(matches!(plan(&view, &cfg, &since, &recent), Decision::Idle(_)));
        // A pod larger than any node never evicts anyone.
        let waiting = [wait("i/huge", "inference", 8)];
        let tenants = [tenant("inference", false, 100, 8, 0), tenant("training", true, 0, 0, 4)];
        let view = ClusterView {
            waiting: &waiting,
            tenants: &tenants,
            ..view
        };
        assert!(matches!(
            plan(&view, &ReclaimConfig::default(), &since, &[]),
            Decision::Idle(_)
        ));
    }

    #[test]
    fn room_is_made_only_on_nodes_the_pod_may_use() {
        // Two full nodes of training; the inference pod may use only node 1.
        let free = [node(0), node(0)];
        let total = [node(2), node(2)];
        let tenants = [tenant("inference", false, 50, 2, 0), tenant("training", true, 0, 0, 4)];
        let running = [
            run("t/n0", "training", 2, 0, 0, 0), // the youngest would go first on node 0 (ties)
            run("t/n1", "training", 2, 0, 0, 1),
        ];
        let mut w = wait("i/x", "inference", 2);
        w.nodes = Some(vec![1]);
        let waiting = [w.clone()];
        let view = ClusterView {
            now_ms: 1_000_000,
            capacity: 4000,
            node_free: &free,
            node_total: &total,
            tenants: &tenants,
            running: &running,
            waiting: &waiting,
        };
        let since = BTreeMap::from([(TenantName::from_static("inference"), 0)]);
        let Decision::Evict { victims, node: at, .. } = plan(&view, &ReclaimConfig::default(), &since, &[]) else {
            panic!("expected an eviction")
        };
        assert_eq!((at, victims[0].key.as_str()), (1, "t/n1"));
        // Room already free on a node it may not use does not count as room.
        let free = [node(2), node(0)];
        let view = ClusterView {
            node_free: &free,
            ..view
        };
        let starving = starved(&view);
        assert!(!starving[0].room, "node 0 is free but not for this pod");
        // A pod no node admits (a selector nobody satisfies) evicts no one.
        w.nodes = Some(vec![]);
        let waiting = [w];
        let view = ClusterView {
            waiting: &waiting,
            ..view
        };
        assert!(starved(&view).is_empty());
        assert!(matches!(
            plan(&view, &ReclaimConfig::default(), &since, &[]),
            Decision::Idle(_)
        ));
    }

    #[test]
    fn young_pods_are_spared_unless_nothing_else_frees_enough() {
        let free = [node(0)];
        let total = [node(2)];
        let tenants = [tenant("inference", false, 50, 1, 0), tenant("training", true, 0, 0, 2)];
        let running = [
            run("t/old", "training", 1, 0, 0, 0),
            run("t/new", "training", 1, 0, 990_000, 0),
        ];
        let waiting = [wait("i/x", "inference", 1)];
        let view = ClusterView {
            now_ms: 1_000_000,
            capacity: 2000,
            node_free: &free,
            node_total: &total,
            tenants: &tenants,
            running: &running,
            waiting: &waiting,
        };
        let since = BTreeMap::from([(TenantName::from_static("inference"), 0)]);
        let Decision::Evict { victims, .. } = plan(&view, &ReclaimConfig::default(), &since, &[]) else {
            panic!()
        };
        assert_eq!(
            victims[0].key, "t/old",
            "the young pod is spared while an older one frees enough"
        );
        let running = [run("t/new", "training", 2, 0, 990_000, 0)];
        let view = ClusterView {
            running: &running,
            ..view
        };
        let Decision::Evict { victims, .. } = plan(&view, &ReclaimConfig::default(), &since, &[]) else {
            panic!()
        };
        assert!(victims[0].why.contains("younger than minRuntime"), "{}", victims[0].why);
    }

    #[test]
    fn a_victim_tenant_is_never_taken_below_its_budget() {
        // Training is 1 GPU over its budget but runs one 4-GPU pod: evicting it would
        // free a whole node for a 1-GPU pod and put training 3 below its budget.
        let free = [node(0)];
        let total = [node(4)];
        let tenants = [tenant("inference", false, 50, 2, 0), tenant("training", true, 0, 3, 4)];
        let running = [run("t/big", "training", 4, 0, 0, 0)];
        let waiting = [wait("i/x", "inference", 1)];
        let view = ClusterView {
            now_ms: 1_000_000,
            capacity: 4000,
            node_free: &free,
            node_total: &total,
            tenants: &tenants,
            running: &running,
            waiting: &waiting,
        };
        let since = BTreeMap::from([(TenantName::from_static("inference"), 0)]);
        assert!(matches!(
            plan(&view, &ReclaimConfig::default(), &since, &[]),
            Decision::Idle(_)
        ));
    }
}
