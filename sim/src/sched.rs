//! The schedulers compared by `kvota sim`: five, and a variant of one.
//!
//! - [`WfqDecay`] is kvota itself: the real [`Federation`] state machine (entitlements
//!   from weights, min/max shares and decayed usage, split into per-cluster budgets and
//!   handed out as leases), each cluster's [`AgentLease`], and the real admission
//!   decision ([`judge`], which is `decide` without its message). Tenants under their
//!   budget are served first. At every tick it runs
//!   the agent's reclaim (`reclaim::plan`, with the policy's damping):
//!   pods of preemptible tenants above their budget are evicted, just enough, for a
//!   tenant below its guarantee whose admitted pod has no room.
//! - [`RoundRobin`]: the Kubernetes default with priority classes and no quotas. Pods of
//!   non-preemptible tenants form the high class and are served first; within a class
//!   tenants take turns, one pod per turn. No preemption.
//! - [`StrictPriority`]: priority queueing with preemption and no quotas. Priority:
//!   non-preemptible tenants first, then by weight. A pod that does not fit preempts
//!   the youngest pods of lower-priority, preemptible tenants (lowest priority first)
//!   until it fits. Non-preemptible tenants are never victims.
//! - [`StaticReservation`]: each tenant owns a fixed pool of each cluster in proportion
//!   to its weight; a pool is never lent, however idle.
//! - [`DrfElastic`]: dominant-resource fairness with GPUs as the one resource (so it is
//!   weighted max-min fairness over demand), elastic: it lends idle capacity to anyone
//!   and, every tick, takes it back by preempting the youngest pods of tenants above
//!   their fair share, whatever the tenant (resizing every tenant to its current share
//!   is what makes it elastic), for the tenant furthest below.
//! - `drf-elastic-np` ([`DrfElastic::sparing`]): the same, except that pods of
//!   non-preemptible tenants are never victims (`docs/guarantees.md` D3): it rebalances
//!   only by preempting preemptible tenants above their fair share, and where every
//!   tenant is non-preemptible it is a work-conserving scheduler that serves the tenant
//!   furthest below its weighted max-min share first. Not in the default comparison;
//!   name it in `--scheduler`.
//!
//! All of them work per cluster on the pods submitted there; only kvota coordinates
//! clusters. All scan each tenant's queue up to the same depth and never block on the
//! head of a queue, as the Kubernetes scheduler does not.

use std::collections::BTreeMap;

use kvota_fairness::admission::{
    borrow_room, judge, lendable, lends_now, release_rank, urgent, LocalView, PodRequest, Reason, Verdict,
};
use kvota_fairness::entitlement::water_fill;
use kvota_fairness::federation::{Applied, Command, Federation, TenantReport, UsageReport};
use kvota_fairness::lease::AgentLease;
use kvota_fairness::names::{PodKey, TenantName};
use kvota_fairness::policy::Policy;
use kvota_fairness::reclaim::{self, ClusterView, Decision, RunningPod, TenantHere, WaitingPod};
use kvota_fairness::MilliGpue;

use crate::engine::{ClusterRt, Partition, World};

/// A scheduling policy under test.
pub trait Scheduler {
    /// Its name in reports.
    fn name(&self) -> &'static str;
    /// Before the first event.
    fn init(&mut self, _w: &mut World) {}
    /// Every tick (report, lease, rebalance period), before the pass.
    fn tick(&mut self, _w: &mut World) {}
    /// After every batch of simultaneous events: start and preempt jobs.
    fn schedule(&mut self, w: &mut World);
}

/// Names accepted by [`by_name`], in report order.
pub const ALL: [&str; 6] = [
    "wfq-decay",
    "round-robin",
    "strict-priority",
    "static-reservation",
    "drf-elastic",
    "drf-elastic-np",
];

/// Builds a scheduler by name.
pub fn by_name(name: &str, policy: &Policy, tick_ms: u64, partition: Option<Partition>) -> Option<Box<dyn Scheduler>> {
    Some(match name {
        "wfq-decay" => Box::new(WfqDecay::new(policy, tick_ms, partition)),
        "round-robin" => Box::new(RoundRobin::default()),
        "strict-priority" => Box::new(StrictPriority),
        "static-reservation" => Box::new(StaticReservation),
        "drf-elastic" => Box::new(DrfElastic::default()),
        "drf-elastic-np" => Box::new(DrfElastic::sparing()),
        _ => return None,
    })
}

/// Starts waiting jobs of tenant `t` in cluster `c` that fit the free GPUs and `room`
/// (GPUe the tenant may still add); at most `max` jobs. Returns how many started.
fn start_fitting(w: &mut World, c: usize, t: usize, mut room: MilliGpue, max: usize) -> usize {
    let cands: Vec<usize> = w.candidates(c, t).collect();
    let mut n = 0;
    for j in cands {
        if n == max || w.clusters[c].free == 0 {
            break;
        }
        let g = w.jobs[j].gpue;
        if g <= room && w.start(j) {
            room -= g;
            n += 1;
        }
    }
    n
}

/// Since when each tenant is starved, and the evictions of the last minute.
type ReclaimMemory = (BTreeMap<TenantName, u64>, Vec<(u64, TenantName)>);

/// Lease epoch held (if any) and whether it has expired (fallbacks apply), with the
/// budgets read under it.
type BudgetKey = ((Option<u64>, bool), LeaseRead);

/// What the scheduling pass reads from a cluster's lease, per tenant (policy order):
/// budgets enforced now, borrow limits and ceilings.
type LeaseRead = (Vec<MilliGpue>, Vec<MilliGpue>, Vec<MilliGpue>);

/// kvota: the federation's leases and the admission decision.
#[derive(Debug)]
pub struct WfqDecay {
    policy: Policy,
    fed: Federation,
    agents: Vec<AgentLease>,
    seq: Vec<u64>,
    partition: Option<Partition>,
    /// Commands the federation refused (a bug if ever above 0).
    pub refused: u64,
    /// GPUe x ms the federation counted per tenant (applied reports only).
    pub reported: Vec<u128>,
    /// Ticks at which some cluster enforced safe (fallback) budgets.
    pub safe_ticks: u64,
    /// Per cluster: since when each tenant is starved, and recent evictions.
    reclaim: Vec<ReclaimMemory>,
    /// Pods evicted by reclaim.
    pub reclaimed: u64,
    /// Pods admitted on borrowed GPUs (over their tenant's budget, on lent idle GPUs).
    pub borrowed_admissions: u64,
    reclaim_due: bool,
    /// Per cluster: each tenant's enforced budget (policy order) under the lease epoch
    /// and standing (in force, or expired: fallbacks) it was read for. A lease's
    /// budgets never change within an epoch, so the scheduling pass after every event
    /// reads the lease once per renewal instead of once per tenant per pass.
    budget_cache: Vec<Option<BudgetKey>>,
    /// Whether budgets are sized to waiting pods, as the control plane does from its
    /// feature level 4 (default). Off gives the split of level 3, for comparisons.
    pub sized_budgets: bool,
    /// Whether free capacity fills the smallest shortfalls of committed entitlement
    /// first, as the control plane does from its feature level 8 (default). Off gives
    /// the proportional rise of levels 1 to 7, for comparisons.
    pub small_first: bool,
    /// When set, what holds each waiting pod after every tick's pass ([`crate::waits`]).
    pub wait_causes: Option<crate::waits::WaitCauses>,
}

impl WfqDecay {
    /// Leases last ten ticks (agents report every tick), with a one-tick margin.
    pub fn new(policy: &Policy, tick_ms: u64, partition: Option<Partition>) -> Self {
        let mut policy = policy.clone();
        policy.lease.duration_ms = tick_ms.saturating_mul(10);
        policy.lease.clock_skew_margin_ms = tick_ms;
        WfqDecay {
            policy,
            fed: Federation::new(),
            agents: Vec::new(),
            seq: Vec::new(),
            partition,
            refused: 0,
            reported: Vec::new(),
            safe_ticks: 0,
            reclaim: Vec::new(),
            reclaimed: 0,
            borrowed_admissions: 0,
            reclaim_due: false,
            budget_cache: Vec::new(),
            sized_budgets: true,
            small_first: true,
            wait_causes: None,
        }
    }

    fn cut(&self, c: usize, now: u64) -> bool {
        self.partition
            .as_ref()
            .is_some_and(|p| p.cluster == c && now >= p.from_ms && now < p.to_ms)
    }

    /// The federation (for tests).
    pub fn federation(&self) -> &Federation {
        &self.fed
    }

    /// Every tenant's budget in cluster `c` now (policy order): exactly
    /// `agent.budget(tenant, now)`, read again only when the lease or its standing
    /// changed.
    fn budgets(&mut self, c: usize, w: &World, now: u64) -> LeaseRead {
        let agent = &self.agents[c];
        let key = (
            agent.lease().map(|l| l.epoch),
            agent.status(now) == kvota_fairness::lease::LeaseStatus::Safe,
        );
        self.budget_cache.resize_with(self.agents.len(), || None);
        match &self.budget_cache[c] {
            Some((k, b)) if *k == key => b.clone(),
            _ => {
                let b: Vec<MilliGpue> = w.tenants.iter().map(|t| agent.budget(&t.name, now)).collect();
                // Borrow limits and ceilings of the lease held (also after it expired: a
                // cut-off cluster lends its own idle GPUs under the last limits it had).
                let (limits, ceilings) = match agent.lease() {
                    Some(l) => w
                        .tenants
                        .iter()
                        .map(|t| (l.borrow(&t.name), l.ceiling(&t.name)))
                        .unzip(),
                    None => (vec![0; w.tenants.len()], vec![0; w.tenants.len()]),
                };
                let read = (b, limits, ceilings);
                self.budget_cache[c] = Some((key, read.clone()));
                read
            }
        }
    }
}

impl WfqDecay {
    /// Charges every waiting pod to what holds it ([`crate::waits::classify`]), if
    /// [`WfqDecay::wait_causes`] is set.
    fn measure_waits(&mut self, w: &World) {
        use crate::waits::{classify, TenantNumbers};
        if self.wait_causes.is_none() {
            return;
        }
        let now = w.now;
        let plan = self.fed.plan();
        let n = self.policy.tenants.len().min(plan.entitlements.len());
        let inputs: Vec<kvota_fairness::entitlement::TenantInput> = self.policy.tenants[..n]
            .iter()
            .zip(&plan.demand)
            .map(|(tp, &d)| kvota_fairness::entitlement::TenantInput {
                weight_milli: tp.weight_milli,
                min_share_bp: tp.min_share_bp,
                max_share_bp: tp.max_share_bp,
                demand: d,
                usage: 0,
            })
            .collect();
        let no_decay = kvota_fairness::entitlement::compute(plan.capacity, &inputs);
        let budgets: Vec<Vec<MilliGpue>> = (0..w.clusters.len()).map(|c| self.budgets(c, w, now).0).collect();
        let Some(wc) = self.wait_causes.as_mut() else { return };
        wc.ticks += 1;
        for (t, tp) in self.policy.tenants[..n].iter().enumerate() {
            let numbers = TenantNumbers {
                inuse: w.clusters.iter().map(|cl| cl.inuse[t]).sum(),
                target: plan.entitlements[t].total,
                target_no_decay: no_decay[t].total,
                committed: self.fed.committed().get(&tp.name).copied().unwrap_or(0),
                budgets: budgets.iter().map(|b| b[t]).sum(),
            };
            for (c, cl) in w.clusters.iter().enumerate() {
                for &j in &cl.queue[t] {
                    if w.jobs[j].beyond_policy {
                        continue;
                    }
                    wc.add(t, classify(&numbers, w.jobs[j].gpue, cl.inuse[t], budgets[c][t]));
                }
            }
        }
    }

    /// kvota's reclaim in every cluster: the agent's `reclaim::plan` over the cluster's
    /// pods and this cluster's lease budgets, repeated while it finds something to do.
    fn reclaim_step(&mut self, w: &mut World) {
        let now = w.now;
        self.reclaim.resize_with(w.clusters.len(), Default::default);
        for c in 0..w.clusters.len() {
            // Cheap test first: is any tenant below its guarantee with something waiting?
            let cl = &w.clusters[c];
            let agent = &self.agents[c];
            let below = self.policy.tenants.iter().enumerate().any(|(t, tp)| {
                let demand = cl.inuse[t] + cl.pending_owed(t);
                let owed = demand
                    .min(kvota_fairness::entitlement::share_of(cl.capacity, tp.min_share_bp))
                    .max(demand.min(agent.budget(&tp.name, now)));
                cl.pending_owed(t) > 0 && cl.inuse[t] < owed
            });
            if !below {
                self.reclaim[c].0.clear();
                continue;
            }
            for round in 0..16 {
                let cl = &w.clusters[c];
                let agent = &self.agents[c];
                let tenants: Vec<TenantHere> = self
                    .policy
                    .tenants
                    .iter()
                    .enumerate()
                    .map(|(t, tp)| TenantHere {
                        name: tp.name.clone(),
                        preemptible: tp.preemptible,
                        min_share_bp: tp.min_share_bp,
                        budget: agent.budget(&tp.name, now),
                        inuse: cl.inuse[t],
                    })
                    .collect();
                let (running, waiting) = reclaim_pods(w, c, &tenants, now);
                let (free, total) = node_gpus(cl);
                let view = ClusterView {
                    now_ms: now,
                    capacity: cl.capacity,
                    node_free: &free,
                    node_total: &total,
                    tenants: &tenants,
                    running: &running,
                    waiting: &waiting,
                };
                let (since, recent) = &mut self.reclaim[c];
                if round == 0 {
                    let hungry: Vec<TenantName> = reclaim::starved(&view).into_iter().map(|s| s.tenant).collect();
                    since.retain(|t, _| hungry.contains(t));
                    for t in hungry {
                        since.entry(t).or_insert(now);
                    }
                }
                recent.retain(|(at, _)| now.saturating_sub(*at) < reclaim::WINDOW_MS);
                let Decision::Evict { victims, .. } = reclaim::plan(&view, &self.policy.reclaim, since, recent) else {
                    break;
                };
                let ids: Vec<(usize, TenantName)> = victims
                    .iter()
                    .filter_map(|v| Some((v.key.name().strip_prefix('j')?.parse().ok()?, v.tenant.clone())))
                    .collect();
                for (j, tenant) in ids {
                    w.preempt(j);
                    recent.push((now, tenant));
                    self.reclaimed += 1;
                }
            }
        }
    }
}

/// Cluster `c`'s usage report as its agent would send it (numbered `seq`, carrying
/// `held_epoch`), and what each tenant's entry says it used, in tenant order. The usage
/// it reports is taken out of the cluster's meter.
fn cluster_report(w: &mut World, c: usize, seq: u64, held_epoch: u64) -> (UsageReport, Vec<u64>) {
    // The largest waiting pod of each tenant among those a pass considers (as an
    // agent sees its queued and denied pods; one it denied as never fitting is no
    // demand, and neither is in the report).
    let largest: Vec<MilliGpue> = (0..w.tenants.len())
        .map(|t| {
            w.candidates(c, t)
                .filter(|&j| !w.jobs[j].beyond_policy)
                .map(|j| w.jobs[j].gpue)
                .max()
                .unwrap_or(0)
        })
        .collect();
    let cl = &mut w.clusters[c];
    // What each tenant's report says it used, in tenant order, as it is built
    // (looking each name up again in the report cost a search per tenant).
    let mut sent: Vec<u64> = Vec::with_capacity(w.tenants.len());
    let tenants: BTreeMap<TenantName, TenantReport> = w
        .tenants
        .iter()
        .enumerate()
        .map(|(t, tr)| {
            let used = u64::try_from(std::mem::take(&mut cl.used_since[t])).unwrap_or(u64::MAX);
            sent.push(used);
            let (inuse, pending) = (cl.inuse[t], cl.pending_owed(t));
            // As the agent reports it (feature level 7): what pods admitted on
            // borrowed GPUs hold, which the partition-safety check leaves out.
            let borrowed: MilliGpue = cl.running[t]
                .iter()
                .filter(|&&j| w.jobs[j].borrowed)
                .map(|&j| w.jobs[j].gpue)
                .sum();
            (
                tr.name.clone(),
                TenantReport {
                    used_milli_gpue_ms: used,
                    inuse,
                    pending,
                    largest: largest[t].min(pending),
                    borrowed: borrowed.min(inuse),
                },
            )
        })
        .collect();
    let report = UsageReport {
        cluster: cl.name.clone(),
        seq,
        held_epoch,
        capacity: None,
        tenants,
        evictions: Vec::new(),
        decisions: Vec::new(),
        window: None,
        status: None,
    };
    (report, sent)
}

/// Cluster `c`'s jobs as the reclaim planner sees pods: running pods of tenants that
/// could give some up (preemptible, over budget) and waiting pods of tenants below what
/// they are owed.
fn reclaim_pods(w: &World, c: usize, tenants: &[TenantHere], now: u64) -> (Vec<RunningPod>, Vec<WaitingPod>) {
    let cl = &w.clusters[c];
    // Jobs as pods of one namespace; `j7` is job 7 (every such key is valid).
    let key = |j: usize| PodKey::new("sim", &format!("j{j}")).ok();
    let node_of = |j: usize| w.jobs[j].placement.first().map_or(0, |p| p.0);
    // Only what the plan can use: pods of possible victims (preemptible, over
    // budget) and waiting pods of tenants below their guarantee.
    let victim = |t: usize| tenants[t].preemptible && tenants[t].inuse > tenants[t].budget;
    let hungry = |t: usize| {
        let demand = cl.inuse[t] + cl.pending_owed(t);
        let owed = demand
            .min(kvota_fairness::entitlement::share_of(
                cl.capacity,
                tenants[t].min_share_bp,
            ))
            .max(demand.min(tenants[t].budget));
        cl.pending_owed(t) > 0 && cl.inuse[t] < owed
    };
    let running: Vec<RunningPod> = (0..tenants.len())
        .filter(|&t| victim(t))
        .flat_map(|t| cl.running[t].iter().map(move |&j| (t, j)))
        .filter_map(|(t, j)| {
            Some(RunningPod {
                key: key(j)?,
                tenant: tenants[t].name.clone(),
                gpue: w.jobs[j].gpue,
                priority: 0,
                started_ms: w.jobs[j].run_start.unwrap_or(now),
                node: node_of(j),
                resource: "gpu".into(),
                count: w.jobs[j]
                    .placement
                    .iter()
                    .filter(|p| p.0 == node_of(j))
                    .map(|p| p.1)
                    .sum::<u64>()
                    .max(1),
                borrowed: w.jobs[j].borrowed,
            })
        })
        .collect();
    let waiting: Vec<WaitingPod> = (0..tenants.len())
        .filter(|&t| hungry(t))
        .flat_map(|t| w.candidates(c, t).map(move |j| (t, j)))
        .filter(|&(_, j)| !w.jobs[j].beyond_policy)
        .filter_map(|(t, j)| {
            Some(WaitingPod {
                key: key(j)?,
                tenant: tenants[t].name.clone(),
                gpue: w.jobs[j].gpue,
                priority: 0,
                since_ms: w.jobs[j].submit_ms,
                resource: "gpu".into(),
                count: w.jobs[j].gpue,
                nodes: None,
            })
        })
        .collect();
    (running, waiting)
}

/// Free and total GPUs per node (one node for a pool cluster) as the planner reads them.
#[allow(clippy::type_complexity)]
fn node_gpus(cl: &ClusterRt) -> (Vec<BTreeMap<String, u64>>, Vec<BTreeMap<String, u64>>) {
    let pool = cl.node_cap.is_empty();
    let free: Vec<BTreeMap<String, u64>> = if pool {
        vec![BTreeMap::from([("gpu".to_string(), cl.free)])]
    } else {
        cl.node_free
            .iter()
            .map(|&f| BTreeMap::from([("gpu".to_string(), f)]))
            .collect()
    };
    let total: Vec<BTreeMap<String, u64>> = if pool {
        vec![BTreeMap::from([("gpu".to_string(), cl.capacity)])]
    } else {
        cl.node_cap
            .iter()
            .map(|&f| BTreeMap::from([("gpu".to_string(), f)]))
            .collect()
    };
    (free, total)
}

impl Scheduler for WfqDecay {
    fn name(&self) -> &'static str {
        "wfq-decay"
    }

    fn init(&mut self, w: &mut World) {
        let now = w.now;
        // As a control plane at its current feature level: leases lend, budgets are sized.
        self.fed.enable_lending();
        self.fed.enable_borrow_cap();
        if self.sized_budgets {
            self.fed.enable_sized_budgets();
        }
        if self.small_first {
            self.fed.enable_small_first();
        }
        if self.fed.apply(now, Command::ApplyPolicy(self.policy.clone())).is_err() {
            self.refused += 1;
        }
        for cl in &w.clusters {
            let mut agent = AgentLease::new(cl.name.clone());
            let cmd = Command::RegisterCluster {
                cluster: cl.name.clone(),
                capacity: BTreeMap::from([("nvidia.com/gpu".to_string(), cl.capacity)]),
                labels: BTreeMap::new(),
            };
            match self.fed.apply(now, cmd) {
                Ok(Applied::Registered(lease)) => {
                    agent.on_lease(lease, now);
                }
                _ => self.refused += 1,
            }
            self.agents.push(agent);
            self.seq.push(0);
        }
    }

    fn tick(&mut self, w: &mut World) {
        let now = w.now;
        if self.fed.apply(now, Command::Tick).is_err() {
            self.refused += 1;
        }
        self.reported.resize(w.tenants.len(), 0);
        if self
            .agents
            .iter()
            .any(|a| a.status(now) == kvota_fairness::lease::LeaseStatus::Safe)
        {
            self.safe_ticks += 1;
        }
        for c in 0..w.clusters.len() {
            if self.cut(c, now) {
                continue; // the agent cannot reach the control plane; usage accumulates
            }
            let (report, sent) = cluster_report(w, c, self.seq[c] + 1, self.agents[c].held_epoch());
            match self.fed.apply(now, Command::Report(report)) {
                Ok(Applied::Reported { lease, applied }) => {
                    if applied {
                        for (sum, t) in self.reported.iter_mut().zip(&sent) {
                            *sum += u128::from(*t);
                        }
                    }
                    self.seq[c] += 1;
                    self.agents[c].on_lease(lease, now);
                }
                _ => self.refused += 1,
            }
        }
        self.reclaim_due = true;
    }

    fn schedule(&mut self, w: &mut World) {
        let now = w.now;
        for c in 0..w.clusters.len() {
            if w.clusters[c].free == 0 {
                continue;
            }
            let status = self.agents[c].status(now);
            let (budgets, mut limits, ceilings) = self.budgets(c, w, now);
            // The agent's rule for when it lends (`spec.reclaim.lendWhen`).
            if !lends_now(&self.policy.reclaim, status) {
                limits.iter_mut().for_each(|l| *l = 0);
            }
            // GPUs no budget needs now; unchanged by admissions within budgets, lowered by
            // every borrowed admission.
            let cl = &w.clusters[c];
            let mut lend = lendable(
                cl.capacity,
                (0..w.tenants.len()).map(|t| (cl.inuse[t], cl.pending_owed(t), budgets[t])),
            );
            // In the line the agent releases gated pods in when the room is short
            // (`release_rank`): latency-sensitive (non-preemptible) tenants below their
            // guarantee here first; then non-preemptible tenants with no guarantee below
            // budget, by the fraction of it they use; then the others furthest under
            // budget first.
            let cl = &w.clusters[c];
            let is_urgent = |t: usize| {
                let tp = &self.policy.tenants[t];
                urgent(
                    tp.preemptible,
                    tp.min_share_bp,
                    cl.capacity,
                    cl.inuse[t],
                    cl.pending_owed(t),
                )
            };
            let mut order: Vec<usize> = (0..w.tenants.len()).collect();
            order.sort_by_key(|&t| {
                let tp = &self.policy.tenants[t];
                (
                    release_rank(is_urgent(t), tp.preemptible, tp.min_share_bp, cl.inuse[t], budgets[t]),
                    t,
                )
            });
            for t in order {
                if w.clusters[c].free == 0 {
                    break; // nothing more can start here (each tenant's loop would stop at once)
                }
                self.admit_tenant(w, c, t, (&budgets, &limits, &ceilings), status, &mut lend);
            }
        }
        // After each tick's pass: the agents' reclaim (what it frees is admitted by the
        // next lease).
        if std::mem::take(&mut self.reclaim_due) {
            self.measure_waits(w);
            self.reclaim_step(w);
        }
    }
}

impl WfqDecay {
    /// Admits tenant `t`'s waiting jobs in cluster `c` as the agent's webhook would,
    /// given the cluster's `(budgets, borrow limits, ceilings)` and lease status; `lend`
    /// falls with every borrowed admission.
    fn admit_tenant(
        &mut self,
        w: &mut World,
        c: usize,
        t: usize,
        (budgets, limits, ceilings): (&[MilliGpue], &[MilliGpue], &[MilliGpue]),
        status: kvota_fairness::lease::LeaseStatus,
        lend: &mut MilliGpue,
    ) {
        let tp = &self.policy.tenants[t];
        let cands: Vec<usize> = w.candidates(c, t).collect();
        let mut denied_at = MilliGpue::MAX;
        // One view per tenant, its in-use kept current as pods start (building it
        // per pod cloned three strings per candidate).
        let mut view: Option<LocalView> = None;
        for j in cands {
            let g = w.jobs[j].gpue;
            if w.clusters[c].free == 0 {
                break;
            }
            if g >= denied_at || !w.clusters[c].fits(g) {
                continue;
            }
            let view = view.get_or_insert_with(|| LocalView {
                cluster: w.clusters[c].name.clone(),
                tenant: Some(tp.name.clone()),
                mode: tp.admission,
                max_queued: tp.max_queued,
                budget: budgets[t],
                inuse: 0,
                queued: 0,
                entitlement: self.fed.committed().get(&tp.name).copied().unwrap_or(0),
                ceiling: Some(match ceilings[t] {
                    0 => w.clusters[c].capacity,
                    x => x.min(w.clusters[c].capacity),
                }),
                lease: status,
                borrow: 0,
            });
            view.inuse = w.clusters[c].inuse[t];
            view.borrow = borrow_room(limits[t], budgets[t], view.inuse, *lend);
            let pod = PodRequest {
                namespace: tp.name.to_string(),
                name: String::new(),
                gpue: g,
            };
            // `judge` is `decide` without the message, which nothing here reads.
            let (verdict, reason) = judge(&pod, view);
            if verdict == Verdict::Allow {
                if w.start(j) && reason == Reason::Borrowed {
                    *lend = lend.saturating_sub(g);
                    w.jobs[j].borrowed = true;
                    self.borrowed_admissions += 1;
                }
            } else {
                denied_at = g; // larger pods of this tenant would be refused too
            }
        }
    }
}

/// Round robin with priority classes, no quotas, no preemption.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: Vec<usize>,
}

impl Scheduler for RoundRobin {
    fn name(&self) -> &'static str {
        "round-robin"
    }

    fn schedule(&mut self, w: &mut World) {
        self.next.resize(w.clusters.len(), 0);
        let nt = w.tenants.len();
        for c in 0..w.clusters.len() {
            for high in [true, false] {
                let class: Vec<usize> = (0..nt).filter(|&t| w.tenants[t].preemptible != high).collect();
                if class.is_empty() {
                    continue;
                }
                loop {
                    let mut progress = false;
                    for k in 0..class.len() {
                        let t = class[(self.next[c] + k) % class.len()];
                        if w.clusters[c].free == 0 {
                            break;
                        }
                        progress |= start_fitting(w, c, t, MilliGpue::MAX, 1) > 0;
                    }
                    if !progress || w.clusters[c].free == 0 {
                        break;
                    }
                }
            }
            self.next[c] = self.next[c].wrapping_add(1);
        }
    }
}

/// Strict priority with preemption, no quotas.
#[derive(Debug)]
pub struct StrictPriority;

/// Priority order: non-preemptible tenants first, then by weight, then by name.
pub fn priority_order(w: &World) -> Vec<usize> {
    let mut order: Vec<usize> = (0..w.tenants.len()).collect();
    order.sort_by(|&a, &b| {
        let (ta, tb) = (&w.tenants[a], &w.tenants[b]);
        ta.preemptible
            .cmp(&tb.preemptible)
            .then(tb.weight_milli.cmp(&ta.weight_milli))
            .then(a.cmp(&b))
    });
    order
}

impl Scheduler for StrictPriority {
    fn name(&self) -> &'static str {
        "strict-priority"
    }

    fn schedule(&mut self, w: &mut World) {
        let order = priority_order(w);
        for c in 0..w.clusters.len() {
            for (rank, &t) in order.iter().enumerate() {
                let lower: Vec<usize> = order[rank + 1..]
                    .iter()
                    .rev()
                    .copied()
                    .filter(|&v| w.tenants[v].preemptible)
                    .collect();
                let cands: Vec<usize> = w.candidates(c, t).collect();
                let mut hopeless = MilliGpue::MAX; // no preemption seats a pod this large
                for j in cands {
                    let g = w.jobs[j].gpue;
                    if w.start(j) || g >= hopeless {
                        continue;
                    }
                    let reclaimable: MilliGpue = lower.iter().map(|&v| w.clusters[c].inuse[v]).sum();
                    if w.clusters[c].free + reclaimable < g {
                        hopeless = g;
                        continue;
                    }
                    // Lower-priority preemptible tenants, the lowest first.
                    let plan = w.plan_preemption(c, g, |v| lower.iter().position(|&x| x == v).map(|i| i as u64));
                    let Some(victims) = plan else {
                        hopeless = g;
                        continue;
                    };
                    for v in victims {
                        w.preempt(v);
                    }
                    w.start(j);
                }
            }
        }
    }
}

/// Static pools in proportion to weight, never lent.
#[derive(Debug)]
pub struct StaticReservation;

/// Tenant `t`'s pool in a cluster of `capacity`.
pub fn static_pool(w: &World, t: usize, capacity: MilliGpue) -> MilliGpue {
    let total: u128 = w.tenants.iter().map(|t| u128::from(t.weight_milli)).sum();
    let share = u128::from(capacity) * u128::from(w.tenants[t].weight_milli) / total.max(1);
    MilliGpue::try_from(share).unwrap_or(capacity)
}

impl Scheduler for StaticReservation {
    fn name(&self) -> &'static str {
        "static-reservation"
    }

    fn schedule(&mut self, w: &mut World) {
        for c in 0..w.clusters.len() {
            for t in 0..w.tenants.len() {
                let pool = static_pool(w, t, w.clusters[c].capacity);
                let room = pool.saturating_sub(w.clusters[c].inuse[t]);
                start_fitting(w, c, t, room, usize::MAX);
            }
        }
    }
}

/// Elastic DRF: weighted max-min over demand, lending idle capacity and taking it back.
#[derive(Debug, Default)]
pub struct DrfElastic {
    /// Never preempt a pod of a non-preemptible tenant (`drf-elastic-np`).
    pub spare_non_preemptible: bool,
}

/// Weighted max-min fair shares of `capacity` for `demand`.
pub fn fair_shares(capacity: MilliGpue, demand: &[MilliGpue], weights: &[u64]) -> Vec<MilliGpue> {
    let total: u128 = demand.iter().map(|&d| u128::from(d)).sum();
    if total <= u128::from(capacity) {
        demand.to_vec()
    } else {
        water_fill(capacity, demand, weights)
    }
}

impl DrfElastic {
    /// `drf-elastic-np`: elastic DRF that never preempts non-preemptible tenants.
    pub fn sparing() -> Self {
        DrfElastic {
            spare_non_preemptible: true,
        }
    }

    fn shares(w: &World, c: usize) -> Vec<MilliGpue> {
        let cl = &w.clusters[c];
        let demand: Vec<MilliGpue> = (0..w.tenants.len()).map(|t| cl.inuse[t] + cl.pending[t]).collect();
        let weights: Vec<u64> = w.tenants.iter().map(|t| t.weight_milli.max(1)).collect();
        fair_shares(cl.capacity, &demand, &weights)
    }

    fn by_deficit(w: &World, c: usize, fair: &[MilliGpue]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..w.tenants.len()).collect();
        order.sort_by_key(|&t| (i128::from(w.clusters[c].inuse[t]) - i128::from(fair[t]), t));
        order
    }
}

impl Scheduler for DrfElastic {
    fn name(&self) -> &'static str {
        if self.spare_non_preemptible {
            "drf-elastic-np"
        } else {
            "drf-elastic"
        }
    }

    fn tick(&mut self, w: &mut World) {
        // Rebalance: give the tenant furthest below its fair share room by preempting the
        // youngest pods of tenants above theirs.
        for c in 0..w.clusters.len() {
            let fair = Self::shares(w, c);
            for t in Self::by_deficit(w, c, &fair) {
                let Some(j) = w
                    .candidates(c, t)
                    .find(|&j| w.clusters[c].inuse[t] + w.jobs[j].gpue <= fair[t])
                else {
                    continue;
                };
                let g = w.jobs[j].gpue;
                if !w.clusters[c].fits(g) {
                    // Tenants above their fair share, the furthest above first (only
                    // preemptible ones when sparing the others).
                    let spare = self.spare_non_preemptible;
                    let plan = w.plan_preemption(c, g, |v| {
                        let (u, f) = (w.clusters[c].inuse[v], fair[v]);
                        let may = !spare || w.tenants[v].preemptible;
                        (v != t && u > f && may).then(|| u64::MAX - (u - f))
                    });
                    let Some(victims) = plan else { continue };
                    for v in victims {
                        w.preempt(v);
                    }
                }
                w.start(j);
            }
        }
    }

    fn schedule(&mut self, w: &mut World) {
        for c in 0..w.clusters.len() {
            if w.clusters[c].free == 0 {
                continue;
            }
            let fair = Self::shares(w, c);
            let order = Self::by_deficit(w, c, &fair);
            for &t in &order {
                let room = fair[t].saturating_sub(w.clusters[c].inuse[t]);
                start_fitting(w, c, t, room, usize::MAX);
            }
            // Elastic: idle capacity is lent to whoever waits.
            for &t in &order {
                start_fitting(w, c, t, MilliGpue::MAX, usize::MAX);
            }
        }
    }
}
