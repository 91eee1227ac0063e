//! The discrete-event engine: jobs arrive, start, finish and are preempted; the
//! scheduler under test decides starts and preemptions; the engine measures.
//!
//! Time is integer milliseconds of trace time. Events at the same instant are handled
//! in a fixed order (finishes, then arrivals, then the periodic tick, then one
//! scheduling pass), and every tie is broken by job index, so a run is a pure function
//! of (trace, policy, configuration, seed).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use kvota_fairness::decay::Ledger;
use kvota_fairness::entitlement::{self, TenantInput};
use kvota_fairness::measures::{percentile, tenant_score, ShareClock};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::Policy;
use kvota_fairness::MilliGpue;

use crate::sched::Scheduler;
use crate::trace::{Kind, Trace};

/// A cut between one cluster and the control plane (only kvota's wfq-decay has a
/// control plane; the baselines are per-cluster and do not notice).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    /// Index of the cut-off cluster.
    pub cluster: usize,
    /// Start, trace ms.
    pub from_ms: u64,
    /// End, trace ms.
    pub to_ms: u64,
}

/// How a run is set up (the same for every scheduler compared).
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Clusters: name and GPU capacity in GPUe.
    pub clusters: Vec<(ClusterName, MilliGpue)>,
    /// GPUe per node (the last node of a cluster takes the remainder); 0 models each
    /// cluster as one pool. A pod no larger than a node must fit on one node; a larger
    /// one takes whole free nodes.
    pub node_gpue: MilliGpue,
    /// Period of reports, lease renewals, rebalancing and measurement samples.
    pub tick_ms: u64,
    /// Training checkpoints this often; a preempted job loses the work since its last one.
    pub checkpoint_ms: u64,
    /// Chooses each job's cluster (weighted by capacity) when there are several.
    pub seed: u64,
    /// An optional partition of one cluster from the control plane.
    pub partition: Option<Partition>,
    /// How deep into a tenant's queue a pass looks for a job that fits (Kubernetes does
    /// not block on the head of a queue; a bound keeps passes cheap).
    pub scan_limit: usize,
    /// Points in the time series kept for charts.
    pub samples: usize,
    /// Inference latency model: utilisation of a fully provisioned service.
    pub inference_load: f64,
    /// Inference SLO: latency at most this multiple of the fully provisioned latency.
    pub slo_factor: f64,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            clusters: vec![(ClusterName::from_static("cluster"), 64_000)],
            node_gpue: 8000,
            tick_ms: 60_000,
            checkpoint_ms: 30 * 60_000,
            seed: 1,
            partition: None,
            scan_limit: 64,
            samples: 400,
            inference_load: 0.6,
            slo_factor: 2.0,
        }
    }
}

/// Latency of an inference service relative to its fully provisioned latency, when it
/// runs `running` of the `demand` GPUe it asks for: an M/M/1-style `(1 - r0) / (1 - r)`
/// with `r = r0 * demand / running`, capped at 20x when it saturates. 1.0 when it has
/// all it asked for.
pub fn latency_factor(running: MilliGpue, demand: MilliGpue, load: f64) -> f64 {
    const CAP: f64 = 20.0;
    if demand == 0 || running >= demand {
        return 1.0;
    }
    if running == 0 {
        return CAP;
    }
    let r = load * demand as f64 / running as f64;
    if r >= 0.95 {
        return CAP;
    }
    ((1.0 - load) / (1.0 - r)).min(CAP)
}

/// Eviction order of a running pod: victim rank, then youngest (latest start, later
/// index), then the job.
type EvictKey = (u64, Reverse<(u64, usize)>, usize);

/// A job at run time.
#[derive(Clone, Debug)]
pub struct JobRt {
    /// Tenant index (policy order).
    pub tenant: usize,
    /// Cluster index.
    pub cluster: usize,
    /// GPUe.
    pub gpue: MilliGpue,
    /// Batch or service.
    pub kind: Kind,
    /// Submitted at.
    pub submit_ms: u64,
    /// Work left, ms (at the start of the current run, if running).
    pub remaining_ms: u64,
    /// Start of the current run.
    pub run_start: Option<u64>,
    /// First start (admission delay = first start - submit).
    pub first_start: Option<u64>,
    /// Bumped at every start so stale finish events are ignored.
    pub generation: u32,
    /// Times preempted.
    pub preemptions: u32,
    /// Finished.
    pub done: bool,
    /// Nodes and GPUe it occupies while running.
    pub placement: Vec<(usize, MilliGpue)>,
    /// Running on borrowed GPUs (kvota admitted it over its tenant's budget).
    pub borrowed: bool,
    /// Larger than its tenant may ever hold in its cluster under the policy: the
    /// cluster's capacity or the tenant's maxShare of the federation, whichever is less.
    /// kvota's agent denies such a pod at once and does not count it as demand; the fair
    /// target does not count it while it waits either, for every scheduler (a scheduler
    /// that runs it anyway is judged on what it holds).
    pub beyond_policy: bool,
}

/// One cluster at run time.
#[derive(Clone, Debug)]
pub struct ClusterRt {
    /// Name.
    pub name: ClusterName,
    /// Capacity, GPUe.
    pub capacity: MilliGpue,
    /// Free GPUe.
    pub free: MilliGpue,
    /// Running GPUe per tenant.
    pub inuse: Vec<MilliGpue>,
    /// Waiting GPUe per tenant.
    pub pending: Vec<MilliGpue>,
    /// Of `pending`, the GPUe of jobs beyond the policy ([`JobRt::beyond_policy`]).
    pub pending_beyond: Vec<MilliGpue>,
    /// Waiting jobs per tenant, oldest first.
    pub queue: Vec<VecDeque<usize>>,
    /// Running jobs per tenant, by start time (youngest last).
    pub running: Vec<Vec<usize>>,
    /// GPUe x ms used per tenant since the scheduler last took it (for usage reports).
    pub used_since: Vec<u128>,
    /// GPUe per node (0: one pool, no nodes).
    pub node_size: MilliGpue,
    /// Capacity of each node.
    pub node_cap: Vec<MilliGpue>,
    /// Free GPUe of each node.
    pub node_free: Vec<MilliGpue>,
    max_node_free: MilliGpue,
    whole_free: MilliGpue,
}

impl ClusterRt {
    fn new(name: &ClusterName, capacity: MilliGpue, node_size: MilliGpue, tenants: usize) -> Self {
        let mut node_cap = Vec::new();
        if node_size > 0 {
            let mut left = capacity;
            while left > 0 {
                let n = left.min(node_size);
                node_cap.push(n);
                left -= n;
            }
        }
        let mut c = ClusterRt {
            name: name.clone(),
            capacity,
            free: capacity,
            inuse: vec![0; tenants],
            pending: vec![0; tenants],
            pending_beyond: vec![0; tenants],
            queue: vec![VecDeque::new(); tenants],
            running: vec![Vec::new(); tenants],
            used_since: vec![0; tenants],
            node_size,
            node_free: node_cap.clone(),
            node_cap,
            max_node_free: 0,
            whole_free: 0,
        };
        c.refresh();
        c
    }

    /// Waiting GPUe of tenant `t` that the policy allows it ever to hold: demand as kvota
    /// counts it (jobs [`JobRt::beyond_policy`] are none).
    pub fn pending_owed(&self, t: usize) -> MilliGpue {
        self.pending[t] - self.pending_beyond[t]
    }

    fn refresh(&mut self) {
        self.max_node_free = self.node_free.iter().copied().max().unwrap_or(0);
        self.whole_free = self
            .node_free
            .iter()
            .zip(&self.node_cap)
            .filter(|(f, c)| f == c)
            .map(|(f, _)| *f)
            .sum();
    }

    /// Whether a pod of `g` GPUe can be placed now: on one node if it fits a node,
    /// else on whole free nodes (a gang of full nodes, as distributed training needs).
    pub fn fits(&self, g: MilliGpue) -> bool {
        if g > self.free {
            false
        } else if self.node_cap.is_empty() {
            true
        } else if g <= self.node_size {
            self.max_node_free >= g
        } else {
            self.whole_free >= g
        }
    }

    /// Places `g` (which [`ClusterRt::fits`]): best fit on one node, or whole free
    /// nodes in index order.
    fn place(&mut self, g: MilliGpue) -> Vec<(usize, MilliGpue)> {
        let mut out = Vec::new();
        if self.node_cap.is_empty() {
        } else if g <= self.node_size {
            let best = (0..self.node_free.len())
                .filter(|&n| self.node_free[n] >= g)
                .min_by_key(|&n| (self.node_free[n], n));
            if let Some(n) = best {
                self.node_free[n] -= g;
                out.push((n, g));
            }
        } else {
            let mut left = g;
            for n in 0..self.node_free.len() {
                if left == 0 {
                    break;
                }
                if self.node_free[n] == self.node_cap[n] && self.node_cap[n] > 0 {
                    let take = left.min(self.node_cap[n]);
                    self.node_free[n] -= take;
                    left -= take;
                    out.push((n, take));
                }
            }
        }
        self.free -= g;
        self.refresh();
        out
    }

    fn unplace(&mut self, g: MilliGpue, placement: &[(usize, MilliGpue)]) {
        for &(n, amount) in placement {
            self.node_free[n] += amount;
        }
        self.free += g;
        self.refresh();
    }
}

/// A tenant as the engine sees it.
#[derive(Clone, Debug)]
pub struct TenantRt {
    /// Name.
    pub name: TenantName,
    /// Weight, milli.
    pub weight_milli: u64,
    /// Guarantee, basis points.
    pub min_share_bp: u32,
    /// Cap, basis points.
    pub max_share_bp: u32,
    /// May its pods be preempted?
    pub preemptible: bool,
    /// Half-life of decayed usage.
    pub half_life_ms: u64,
    /// Submits inference jobs.
    pub serves: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Finish { job: usize, generation: u32 },
    Arrive { job: usize },
    Tick,
}

/// The world the scheduler acts on.
#[derive(Debug)]
pub struct World {
    /// Now, trace ms.
    pub now: u64,
    /// Jobs (trace order).
    pub jobs: Vec<JobRt>,
    /// Tenants (policy order).
    pub tenants: Vec<TenantRt>,
    /// Clusters.
    pub clusters: Vec<ClusterRt>,
    /// Checkpoint interval.
    pub checkpoint_ms: u64,
    /// Queue scan bound.
    pub scan_limit: usize,
    events: BinaryHeap<Reverse<(u64, Ev)>>,
    /// Preemptions per victim tenant.
    pub preempted: Vec<u64>,
    /// GPUe x ms of work lost to preemption per tenant.
    pub lost: Vec<u128>,
}

impl World {
    /// Starts `job` now if it fits its cluster; returns whether it started.
    pub fn start(&mut self, job: usize) -> bool {
        let now = self.now;
        let (t, c, g) = (self.jobs[job].tenant, self.jobs[job].cluster, self.jobs[job].gpue);
        if self.jobs[job].run_start.is_some() || self.jobs[job].done || !self.clusters[c].fits(g) {
            return false;
        }
        let cl = &mut self.clusters[c];
        let placement = cl.place(g);
        if let Some(pos) = cl.queue[t].iter().position(|&q| q == job) {
            cl.queue[t].remove(pos);
        }
        cl.pending[t] -= g;
        if self.jobs[job].beyond_policy {
            cl.pending_beyond[t] -= g;
        }
        cl.inuse[t] += g;
        cl.running[t].push(job);
        let j = &mut self.jobs[job];
        j.placement = placement;
        j.run_start = Some(now);
        j.first_start.get_or_insert(now);
        j.generation = j.generation.wrapping_add(1);
        let ev = Ev::Finish {
            job,
            generation: j.generation,
        };
        self.events.push(Reverse((now.saturating_add(j.remaining_ms), ev)));
        true
    }

    /// Preempts a running `job`: it goes back to the end of its tenant's queue and, if
    /// it is training, loses the work since its last checkpoint.
    pub fn preempt(&mut self, job: usize) {
        let now = self.now;
        let ckpt = self.checkpoint_ms.max(1);
        let j = &mut self.jobs[job];
        let Some(start) = j.run_start.take() else { return };
        let ran = now - start;
        let lost = if j.kind == Kind::Training { ran % ckpt } else { 0 };
        j.remaining_ms = j.remaining_ms.saturating_sub(ran - lost).max(1);
        j.preemptions += 1;
        j.generation = j.generation.wrapping_add(1);
        j.borrowed = false;
        let (t, c, g, beyond) = (j.tenant, j.cluster, j.gpue, j.beyond_policy);
        let placement = std::mem::take(&mut j.placement);
        self.preempted[t] += 1;
        self.lost[t] += u128::from(g) * u128::from(lost);
        let cl = &mut self.clusters[c];
        if let Some(pos) = cl.running[t].iter().position(|&r| r == job) {
            cl.running[t].remove(pos);
        }
        cl.inuse[t] -= g;
        cl.unplace(g, &placement);
        cl.pending[t] += g;
        if beyond {
            cl.pending_beyond[t] += g;
        }
        cl.queue[t].push_back(job);
    }

    /// Cluster `c`'s pods that may be preempted, by node, each node's list in eviction
    /// order; and per node whether it holds a pod that may not go.
    fn victims_by_node(
        &self,
        c: usize,
        victim_rank: &impl Fn(usize) -> Option<u64>,
    ) -> (Vec<Vec<EvictKey>>, Vec<bool>) {
        let cl = &self.clusters[c];
        // Victim pods by node, each node's list in eviction order.
        let mut by_node: Vec<Vec<EvictKey>> = vec![Vec::new(); cl.node_cap.len().max(1)];
        let mut blocked = vec![false; by_node.len()]; // holds a pod that may not go
        for (t, running) in cl.running.iter().enumerate() {
            let rank = victim_rank(t);
            for &j in running {
                // Youngest first: latest start, then the later of pods started together.
                let key = (rank.unwrap_or(0), Reverse((self.jobs[j].run_start.unwrap_or(0), j)), j);
                let nodes: Vec<usize> = if cl.node_cap.is_empty() {
                    vec![0]
                } else {
                    self.jobs[j].placement.iter().map(|p| p.0).collect()
                };
                for n in nodes {
                    match rank {
                        Some(_) => by_node[n].push(key),
                        None => blocked[n] = true,
                    }
                }
            }
        }
        for v in &mut by_node {
            v.sort_unstable();
        }
        (by_node, blocked)
    }

    /// Chooses which running pods to preempt so that a pod of `g` GPUe fits in cluster
    /// `c`, as the Kubernetes scheduler does: only pods of tenants for which
    /// `victim_rank` is `Some` may go (lower rank first, then the youngest), and the
    /// node (or, for a pod larger than a node, the set of whole nodes) that needs the
    /// fewest GPUe of victims is chosen. `None`: no preemption can make it fit.
    pub fn plan_preemption(
        &self,
        c: usize,
        g: MilliGpue,
        victim_rank: impl Fn(usize) -> Option<u64>,
    ) -> Option<Vec<usize>> {
        let cl = &self.clusters[c];
        let (by_node, blocked) = self.victims_by_node(c, &victim_rank);
        let pool = cl.node_cap.is_empty();
        let node_free = |n: usize| if pool { cl.free } else { cl.node_free[n] };
        let node_cap = |n: usize| if pool { cl.capacity } else { cl.node_cap[n] };
        if pool || g <= cl.node_size {
            // One node: the one needing the least victim GPUe.
            let mut best: Option<(MilliGpue, usize, Vec<usize>)> = None;
            for (n, victims) in by_node.iter().enumerate() {
                let mut free = node_free(n);
                let mut taken = Vec::new();
                let mut cost = 0;
                for &(_, _, j) in victims {
                    if free >= g {
                        break;
                    }
                    // A gang pod frees only its share of this node here.
                    let here = if pool {
                        self.jobs[j].gpue
                    } else {
                        self.jobs[j].placement.iter().filter(|p| p.0 == n).map(|p| p.1).sum()
                    };
                    free += here;
                    cost += self.jobs[j].gpue;
                    taken.push(j);
                }
                if free >= g && best.as_ref().is_none_or(|b| (cost, taken.len()) < (b.0, b.2.len())) {
                    best = Some((cost, n, taken));
                }
            }
            return best.map(|b| b.2);
        }
        // Larger than a node: whole nodes, cheapest first, none holding a protected pod.
        let mut nodes: Vec<(MilliGpue, usize)> = (0..by_node.len())
            .filter(|&n| !blocked[n])
            .map(|n| (by_node[n].iter().map(|&(_, _, j)| self.jobs[j].gpue).sum(), n))
            .collect();
        nodes.sort_unstable();
        let mut cap = 0;
        let mut victims = Vec::new();
        for (_, n) in nodes {
            if cap >= g {
                break;
            }
            cap += node_cap(n);
            victims.extend(by_node[n].iter().map(|&(_, _, j)| j));
        }
        if cap < g {
            return None;
        }
        victims.sort_unstable();
        victims.dedup();
        Some(victims)
    }

    /// Waiting jobs of tenant `t` in cluster `c` a pass may consider, oldest first.
    pub fn candidates(&self, c: usize, t: usize) -> impl Iterator<Item = usize> + '_ {
        self.clusters[c].queue[t].iter().copied().take(self.scan_limit)
    }

    fn finish(&mut self, job: usize) {
        let j = &mut self.jobs[job];
        j.run_start = None;
        j.done = true;
        let (t, c, g) = (j.tenant, j.cluster, j.gpue);
        let placement = std::mem::take(&mut j.placement);
        let cl = &mut self.clusters[c];
        if let Some(pos) = cl.running[t].iter().position(|&r| r == job) {
            cl.running[t].remove(pos);
        }
        cl.inuse[t] -= g;
        cl.unplace(g, &placement);
    }

    /// Total capacity.
    pub fn capacity(&self) -> MilliGpue {
        self.clusters.iter().map(|c| c.capacity).sum()
    }
}

/// Measured outcome for one tenant.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantResult {
    /// Tenant.
    pub tenant: String,
    /// Jobs in the trace.
    pub jobs: usize,
    /// Jobs that never started before the run ended.
    pub never_started: usize,
    /// Admission delay percentiles, ms (jobs that never started count with the time
    /// they waited until the end).
    pub delay_p50_ms: u64,
    /// p99.
    pub delay_p99_ms: u64,
    /// Fraction of time above the fair target (share-violation time).
    pub violation: f64,
    /// Fraction of time below `min(demand, guarantee)`.
    pub starved: f64,
    /// Mean fairness score while it had demand.
    pub mean_score: f64,
    /// Inference only: fraction of time with demand that the latency was within the SLO.
    pub sla: Option<f64>,
    /// Inference only: p99 of the latency factor over time.
    pub latency_p99: Option<f64>,
    /// Times its jobs were preempted.
    pub preemptions: u64,
    /// GPU-hours of work lost to preemption.
    pub lost_gpu_hours: f64,
    /// Mean share of capacity held.
    pub mean_share: f64,
}

/// One point of the time series.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Trace time, ms.
    pub t_ms: u64,
    /// Mean fairness score over tenants with demand.
    pub score: f64,
    /// Share of capacity held per tenant.
    pub shares: Vec<f64>,
}

/// Everything a run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RunResult {
    /// Scheduler name.
    pub scheduler: String,
    /// Per tenant, policy order.
    pub tenants: Vec<TenantResult>,
    /// Time-averaged GPU utilisation while any job was waiting or running.
    pub utilization: f64,
    /// Time-averaged mean fairness score.
    pub mean_score: f64,
    /// Fraction of time the mean fairness score was below [`UNFAIR_BELOW`].
    pub unfair: f64,
    /// Unfair episodes (score below [`UNFAIR_BELOW`]): count, median and longest, ms.
    pub episodes: usize,
    /// Median time to return to a fair allocation.
    pub recovery_p50_ms: u64,
    /// Longest.
    pub recovery_max_ms: u64,
    /// Total preemptions.
    pub preemptions: u64,
    /// Simulated span, ms.
    pub span_ms: u64,
    /// Time series for charts.
    pub series: Vec<Sample>,
    /// Events handled.
    pub events: u64,
    /// Admission delay of every job in trace order (`None`: never started).
    pub job_delays: Vec<Option<u64>>,
    /// Jobs preempted at least once, in trace order.
    pub preempted_jobs: Vec<usize>,
    /// GPUe x ms each tenant's running jobs actually used.
    pub used_gpue_ms: Vec<u128>,
}

/// Idle ticks (nothing running, nothing left to arrive) after which a run ends.
const STUCK_TICKS: u32 = 10;

/// A mean fairness score below this opens an unfair episode; recovery time is how long
/// it lasts.
pub const UNFAIR_BELOW: f64 = 0.8;

/// Errors that stop a run before it starts.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The trace uses a tenant the policy does not have.
    #[error("the trace has tenant `{tenant}` but the policy does not (policy tenants: {known}); use a policy that names every trace tenant")]
    UnknownTenant {
        /// Tenant.
        tenant: String,
        /// Policy tenants.
        known: String,
    },
    /// Bad configuration.
    #[error("{0}")]
    Config(String),
}

/// The seeded generator: the only source of randomness of a run.
pub use kvota_fairness::rng::Rng;

/// Where a run has got to, for a progress display (trace time, relative to the first
/// submission).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Trace time reached, ms.
    pub reached_ms: u64,
    /// Expected end, ms: when the last job would finish had nothing waited (a lower
    /// bound; a run ends later when jobs wait), never below `reached_ms`.
    pub end_ms: u64,
}

/// Runs one scheduler over the trace.
pub fn run(trace: &Trace, policy: &Policy, cfg: &SimConfig, sched: &mut dyn Scheduler) -> Result<RunResult, SimError> {
    run_with_progress(trace, policy, cfg, sched, &mut |_| {})
}

/// The most a tenant with `max_share_bp` may hold of a federation of `total_cap` GPUe,
/// as the agent reads its lease's ceiling (a ceiling of 0 is none: the cluster's
/// capacity bounds it alone).
fn policy_ceiling(total_cap: u128, max_share_bp: u32) -> MilliGpue {
    match kvota_fairness::entitlement::share_of(u64::try_from(total_cap).unwrap_or(u64::MAX), max_share_bp) {
        0 => MilliGpue::MAX,
        x => x,
    }
}

/// [`run`], calling `progress` at every tick (the caller decides what to show and how
/// often; the engine reads no clock).
pub fn run_with_progress(
    trace: &Trace,
    policy: &Policy,
    cfg: &SimConfig,
    sched: &mut dyn Scheduler,
    progress: &mut dyn FnMut(Progress),
) -> Result<RunResult, SimError> {
    let mut w = build_world(trace, policy, cfg)?;
    let start_ms = w.jobs.first().map_or(0, |j| j.submit_ms);
    let last_arrival = w.jobs.last().map_or(0, |j| j.submit_ms);
    for (i, j) in w.jobs.iter().enumerate() {
        w.events.push(Reverse((j.submit_ms, Ev::Arrive { job: i })));
    }
    w.now = start_ms;
    w.events.push(Reverse((start_ms, Ev::Tick)));
    sched.init(&mut w);

    let mut m = Meter::new(&w, cfg, last_arrival.saturating_sub(start_ms));
    let planned_end_ms = w
        .jobs
        .iter()
        .map(|j| j.submit_ms.saturating_add(j.remaining_ms))
        .max()
        .unwrap_or(start_ms);
    let mut events = 0u64;
    let mut arrived = 0usize;
    let mut stuck = 0u32;
    while let Some(Reverse((at, _))) = w.events.peek().copied() {
        m.advance(&w, at);
        let dt = u128::from(at - w.now);
        for cl in &mut w.clusters {
            for (used, &inuse) in cl.used_since.iter_mut().zip(&cl.inuse) {
                *used += u128::from(inuse) * dt;
            }
        }
        w.now = at;
        let tick = w.handle_events_at(at, &mut events, &mut arrived);
        if tick {
            m.sample(&w);
            sched.tick(&mut w);
            let reached_ms = at - start_ms;
            progress(Progress {
                reached_ms,
                end_ms: planned_end_ms.saturating_sub(start_ms).max(reached_ms),
            });
        }
        sched.schedule(&mut w);
        if tick {
            w.schedule_next_tick(at, cfg.tick_ms, arrived, &mut stuck);
        }
    }
    Ok(m.finish(&w, sched.name(), events, start_ms))
}

/// The world before the first event: the policy's tenants, every trace job placed on
/// a cluster (weighted by capacity, drawn from the seeded generator), no events yet.
fn build_world(trace: &Trace, policy: &Policy, cfg: &SimConfig) -> Result<World, SimError> {
    if cfg.clusters.is_empty() || cfg.clusters.iter().any(|c| c.1 == 0) {
        return Err(SimError::Config("every cluster needs a capacity above 0".into()));
    }
    if cfg.tick_ms == 0 {
        return Err(SimError::Config("the tick must be longer than 0 ms".into()));
    }
    let mut tenants: Vec<TenantRt> = policy.tenants.iter().map(TenantRt::from_policy).collect();
    let nt = tenants.len();
    let total_cap: u128 = cfg.clusters.iter().map(|c| u128::from(c.1)).sum();
    let mut rng = Rng::new(cfg.seed);
    let mut jobs = Vec::with_capacity(trace.jobs.len());
    for j in &trace.jobs {
        let Some(t) = policy.tenant_index(&j.tenant) else {
            return Err(unknown_tenant(policy, &j.tenant));
        };
        if j.kind == Kind::Inference {
            tenants[t].serves = true;
        }
        let cluster = pick_cluster(&mut rng, &cfg.clusters, total_cap);
        jobs.push(JobRt {
            tenant: t,
            cluster,
            gpue: j.gpue,
            kind: j.kind,
            submit_ms: j.submit_ms,
            remaining_ms: j.duration_ms.max(1),
            run_start: None,
            first_start: None,
            generation: 0,
            preemptions: 0,
            done: false,
            placement: Vec::new(),
            borrowed: false,
            beyond_policy: j.gpue
                > cfg.clusters[cluster]
                    .1
                    .min(policy_ceiling(total_cap, tenants[t].max_share_bp)),
        });
    }
    let clusters = cfg
        .clusters
        .iter()
        .map(|(name, cap)| ClusterRt::new(name, *cap, cfg.node_gpue, nt))
        .collect();
    Ok(World {
        now: 0,
        jobs,
        tenants,
        clusters,
        checkpoint_ms: cfg.checkpoint_ms,
        scan_limit: cfg.scan_limit.max(1),
        events: BinaryHeap::new(),
        preempted: vec![0; nt],
        lost: vec![0; nt],
    })
}

/// The error for a trace tenant the policy does not have.
fn unknown_tenant(policy: &Policy, tenant: &str) -> SimError {
    SimError::UnknownTenant {
        tenant: tenant.to_owned(),
        known: policy
            .tenants
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    }
}

impl TenantRt {
    /// A policy tenant at the start of a run (serving nothing yet).
    fn from_policy(t: &kvota_fairness::policy::TenantPolicy) -> TenantRt {
        TenantRt {
            name: t.name.clone(),
            weight_milli: t.weight_milli,
            min_share_bp: t.min_share_bp,
            max_share_bp: t.max_share_bp,
            preemptible: t.preemptible,
            half_life_ms: t.decay_half_life_ms,
            serves: false,
        }
    }
}

/// A cluster drawn with probability proportional to its capacity (no draw when there
/// is one cluster).
fn pick_cluster(rng: &mut Rng, clusters: &[(ClusterName, MilliGpue)], total_cap: u128) -> usize {
    if clusters.len() == 1 {
        return 0;
    }
    let mut x = u128::from(rng.next_u64()) % total_cap;
    for (i, c) in clusters.iter().enumerate() {
        if x < u128::from(c.1) {
            return i;
        }
        x -= u128::from(c.1);
    }
    0
}

impl World {
    /// Handles every event due at `at`; true if one of them was a tick.
    fn handle_events_at(&mut self, at: u64, events: &mut u64, arrived: &mut usize) -> bool {
        let mut tick = false;
        while let Some(Reverse((t, ev))) = self.events.peek().copied() {
            if t != at {
                break;
            }
            self.events.pop();
            *events += 1;
            match ev {
                Ev::Finish { job, generation } => {
                    if self.jobs[job].generation == generation && self.jobs[job].run_start.is_some() {
                        self.finish(job);
                    }
                }
                Ev::Arrive { job } => {
                    let (t, c, g) = (self.jobs[job].tenant, self.jobs[job].cluster, self.jobs[job].gpue);
                    self.clusters[c].pending[t] += g;
                    if self.jobs[job].beyond_policy {
                        self.clusters[c].pending_beyond[t] += g;
                    }
                    self.clusters[c].queue[t].push_back(job);
                    *arrived += 1;
                }
                Ev::Tick => tick = true,
            }
        }
        tick
    }

    /// Queues the next tick while work remains, unless the run is stuck.
    fn schedule_next_tick(&mut self, at: u64, tick_ms: u64, arrived: usize, stuck: &mut u32) {
        let busy = self
            .clusters
            .iter()
            .any(|c| c.inuse.iter().any(|&u| u > 0) || c.pending.iter().any(|&p| p > 0));
        if arrived < self.jobs.len() || busy {
            // Stop once everything left waits for capacity that never comes (e.g. a
            // job larger than its static pool): nothing runs and nothing arrives
            // for STUCK_TICKS ticks in a row.
            let idle = arrived == self.jobs.len() && self.clusters.iter().all(|c| c.inuse.iter().all(|&u| u == 0));
            *stuck = if idle { *stuck + 1 } else { 0 };
            if *stuck < STUCK_TICKS {
                self.events.push(Reverse((at + tick_ms, Ev::Tick)));
            }
        }
    }
}

/// Measures as the run goes.
struct Meter {
    last_ms: u64,
    busy_ms: u64,
    used: u128,
    used_by: Vec<u128>,
    cap_ms: u128,
    clocks: Vec<ShareClock>,
    score_sum: Vec<f64>,
    score_n: Vec<u64>,
    share_sum: Vec<f64>,
    lat: Vec<Vec<u64>>, // latency factor x 1000 per sample
    sla_ok: Vec<u64>,
    sla_n: Vec<u64>,
    ledger: Ledger,
    mean_score_sum: f64,
    mean_score_n: u64,
    unfair_samples: u64,
    episode_start: Option<u64>,
    episodes: Vec<u64>,
    series: Vec<Sample>,
    every: u64,
    n_samples: u64,
    last_sample_ms: Option<u64>,
    load: f64,
    slo: f64,
    tick_ms: u64,
}

impl Meter {
    fn new(w: &World, cfg: &SimConfig, span_hint: u64) -> Self {
        let nt = w.tenants.len();
        let ticks = (span_hint / cfg.tick_ms.max(1)).max(1);
        Meter {
            last_ms: w.now,
            busy_ms: 0,
            used: 0,
            used_by: vec![0; nt],
            cap_ms: 0,
            clocks: vec![ShareClock::default(); nt],
            score_sum: vec![0.0; nt],
            score_n: vec![0; nt],
            share_sum: vec![0.0; nt],
            lat: vec![Vec::new(); nt],
            sla_ok: vec![0; nt],
            sla_n: vec![0; nt],
            ledger: Ledger::new(),
            mean_score_sum: 0.0,
            mean_score_n: 0,
            unfair_samples: 0,
            episode_start: None,
            episodes: Vec::new(),
            series: Vec::new(),
            every: (ticks / cfg.samples.max(1) as u64).max(1),
            n_samples: 0,
            last_sample_ms: None,
            load: cfg.inference_load,
            slo: cfg.slo_factor,
            tick_ms: cfg.tick_ms,
        }
    }

    /// Integrates utilisation up to `to`.
    fn advance(&mut self, w: &World, to: u64) {
        let dt = to.saturating_sub(self.last_ms);
        if dt == 0 {
            return;
        }
        for cl in &w.clusters {
            for (sum, &u) in self.used_by.iter_mut().zip(&cl.inuse) {
                *sum += u128::from(u) * u128::from(dt);
            }
        }
        let busy = w
            .clusters
            .iter()
            .any(|c| c.inuse.iter().any(|&u| u > 0) || c.pending.iter().any(|&p| p > 0));
        if busy {
            let inuse: u128 = w
                .clusters
                .iter()
                .map(|c| c.inuse.iter().map(|&u| u128::from(u)).sum::<u128>())
                .sum();
            self.used += inuse * u128::from(dt);
            self.cap_ms += u128::from(w.capacity()) * u128::from(dt);
            self.busy_ms += dt;
        }
        self.last_ms = to;
    }

    /// One measurement at a tick.
    fn sample(&mut self, w: &World) {
        let now = w.now;
        let nt = w.tenants.len();
        let cap = w.capacity();
        let inuse: Vec<MilliGpue> = (0..nt).map(|t| w.clusters.iter().map(|c| c.inuse[t]).sum()).collect();
        // Demand as kvota's own model counts it: a waiting job beyond the policy is none.
        let pending: Vec<MilliGpue> = (0..nt)
            .map(|t| w.clusters.iter().map(|c| c.pending_owed(t)).sum())
            .collect();
        if let Some(prev) = self.last_sample_ms {
            let dt = now.saturating_sub(prev);
            for (t, tr) in w.tenants.iter().enumerate() {
                self.ledger
                    .add(&tr.name, inuse[t].saturating_mul(dt), now, tr.half_life_ms);
            }
        }
        self.last_sample_ms = Some(now);
        // The fair target: kvota's own model over demand and decayed usage, the same
        // yardstick for every scheduler.
        let inputs: Vec<TenantInput> = w
            .tenants
            .iter()
            .enumerate()
            .map(|(t, tr)| TenantInput {
                weight_milli: tr.weight_milli,
                min_share_bp: tr.min_share_bp,
                max_share_bp: tr.max_share_bp,
                demand: inuse[t] + pending[t],
                usage: self.ledger.usage_at(&tr.name, now, tr.half_life_ms),
            })
            .collect();
        let ent = entitlement::compute(cap, &inputs);
        let mut sum = 0.0;
        let mut n = 0u32;
        for t in 0..nt {
            let demand = inuse[t] + pending[t];
            self.clocks[t].observe(now, inuse[t], ent[t].total, demand, ent[t].guarantee);
            self.share_sum[t] += inuse[t] as f64 / cap as f64;
            if demand > 0 {
                let s = tenant_score(inuse[t], ent[t].total, cap);
                self.score_sum[t] += s;
                self.score_n[t] += 1;
                sum += s;
                n += 1;
            }
            if w.tenants[t].serves {
                let (run, dem) = inference_load(w, t);
                self.record_latency(t, run, dem);
            }
        }
        let mean = if n == 0 { 1.0 } else { sum / f64::from(n) };
        self.mean_score_sum += mean;
        self.mean_score_n += 1;
        if mean < UNFAIR_BELOW {
            self.unfair_samples += 1;
            self.episode_start.get_or_insert(now);
        } else if let Some(s) = self.episode_start.take() {
            self.episodes.push(now - s);
        }
        if self.n_samples % self.every == 0 {
            self.series.push(Sample {
                t_ms: now,
                score: mean,
                shares: inuse.iter().map(|&u| u as f64 / cap as f64).collect(),
            });
        }
        self.n_samples += 1;
    }

    /// Tenant `t`'s results: its `(jobs, never started)`, its admission `delays` and
    /// the number of samples `n`.
    fn tenant_result(
        &mut self,
        w: &World,
        t: usize,
        (jobs, never): (usize, usize),
        delays: &mut [u64],
        n: f64,
    ) -> TenantResult {
        let c = &self.clocks[t];
        let frac = |x: u64| {
            if c.observed_ms == 0 {
                0.0
            } else {
                x as f64 / c.observed_ms as f64
            }
        };
        let serves = w.tenants[t].serves;
        TenantResult {
            tenant: w.tenants[t].name.to_string(),
            jobs,
            never_started: never,
            delay_p50_ms: percentile(delays, 50).unwrap_or(0),
            delay_p99_ms: percentile(delays, 99).unwrap_or(0),
            violation: frac(c.violation_ms),
            starved: frac(c.starved_ms),
            mean_score: if self.score_n[t] == 0 {
                1.0
            } else {
                self.score_sum[t] / self.score_n[t] as f64
            },
            sla: (serves && self.sla_n[t] > 0).then(|| self.sla_ok[t] as f64 / self.sla_n[t] as f64),
            latency_p99: (serves && !self.lat[t].is_empty())
                .then(|| percentile(&mut self.lat[t], 99).unwrap_or(1000) as f64 / 1000.0),
            preemptions: w.preempted[t],
            lost_gpu_hours: w.lost[t] as f64 / 1000.0 / 3_600_000.0,
            mean_share: self.share_sum[t] / n,
        }
    }

    /// The latency factor of tenant `t`'s inference at this sample, against its SLO.
    fn record_latency(&mut self, t: usize, run: MilliGpue, dem: MilliGpue) {
        if dem > 0 {
            let f = latency_factor(run, dem, self.load);
            self.lat[t].push(to_milli(f));
            self.sla_n[t] += 1;
            if f <= self.slo {
                self.sla_ok[t] += 1;
            }
        }
    }

    fn finish(mut self, w: &World, name: &str, events: u64, start_ms: u64) -> RunResult {
        let end = w.now;
        if let Some(s) = self.episode_start.take() {
            self.episodes.push(end.saturating_sub(s).max(self.tick_ms));
        }
        let nt = w.tenants.len();
        let mut delays: Vec<Vec<u64>> = vec![Vec::new(); nt];
        let mut jobs = vec![0usize; nt];
        let mut never = vec![0usize; nt];
        for j in &w.jobs {
            jobs[j.tenant] += 1;
            match j.first_start {
                Some(s) => delays[j.tenant].push(s - j.submit_ms),
                None => {
                    never[j.tenant] += 1;
                    delays[j.tenant].push(end.saturating_sub(j.submit_ms));
                }
            }
        }
        let n = self.n_samples.max(1) as f64;
        let tenants = (0..nt)
            .map(|t| self.tenant_result(w, t, (jobs[t], never[t]), &mut delays[t], n))
            .collect();
        let mut eps = self.episodes.clone();
        RunResult {
            scheduler: name.to_string(),
            tenants,
            utilization: if self.cap_ms == 0 {
                0.0
            } else {
                self.used as f64 / self.cap_ms as f64
            },
            mean_score: if self.mean_score_n == 0 {
                1.0
            } else {
                self.mean_score_sum / self.mean_score_n as f64
            },
            unfair: if self.mean_score_n == 0 {
                0.0
            } else {
                self.unfair_samples as f64 / self.mean_score_n as f64
            },
            episodes: eps.len(),
            recovery_p50_ms: percentile(&mut eps, 50).unwrap_or(0),
            recovery_max_ms: eps.iter().copied().max().unwrap_or(0),
            preemptions: w.preempted.iter().sum(),
            span_ms: end.saturating_sub(start_ms),
            series: self.series,
            events,
            job_delays: w.jobs.iter().map(|j| j.first_start.map(|s| s - j.submit_ms)).collect(),
            preempted_jobs: (0..w.jobs.len()).filter(|&i| w.jobs[i].preemptions > 0).collect(),
            used_gpue_ms: self.used_by,
        }
    }
}

/// Tenant `t`'s inference jobs: GPUe running, and GPUe running or waiting.
fn inference_load(w: &World, t: usize) -> (MilliGpue, MilliGpue) {
    w.clusters.iter().fold((0, 0), |(r, d), c| {
        let (ri, di) = c.running[t].iter().fold((0, 0), |(r, d), &j| {
            if w.jobs[j].kind == Kind::Inference {
                (r + w.jobs[j].gpue, d + w.jobs[j].gpue)
            } else {
                (r, d)
            }
        });
        let wi: MilliGpue = c.queue[t]
            .iter()
            .filter(|&&j| w.jobs[j].kind == Kind::Inference)
            .map(|&j| w.jobs[j].gpue)
            .sum();
        (r + ri, d + di + wi)
    })
}

fn to_milli(f: f64) -> u64 {
    let v = (f * 1000.0).round();
    if v <= 0.0 {
        0
    } else {
        // Bounded by the 20x cap: exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let out = v as u64;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_model_is_flat_when_provisioned_and_capped_when_starved() {
        assert_eq!(latency_factor(4000, 4000, 0.6), 1.0);
        assert_eq!(latency_factor(0, 4000, 0.6), 20.0);
        // 80 % provisioned: r = 0.75, (1 - 0.6) / (1 - 0.75) = 1.6.
        assert!((latency_factor(3200, 4000, 0.6) - 1.6).abs() < 1e-12);
        assert_eq!(latency_factor(2000, 4000, 0.6), 20.0);
    }

    #[test]
    fn rng_is_a_pure_function_of_the_seed() {
        let a: Vec<u64> = (0..4).scan(Rng::new(7), |r, _| Some(r.next_u64())).collect();
        let b: Vec<u64> = (0..4).scan(Rng::new(7), |r, _| Some(r.next_u64())).collect();
        let c: Vec<u64> = (0..4).scan(Rng::new(8), |r, _| Some(r.next_u64())).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }
}
