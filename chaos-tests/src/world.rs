//! The harness: one seed, one world, simulated time only.
//!
//! Everything random comes from [`Rng`] seeded with the run's seed: the topology (3 or 5
//! control-plane nodes, 3 to 6 clusters of 2-4 nodes with 4 or 8 GPUs), clock offsets and
//! rates, the workload and its mid-run shift, and the nemesis schedule. Time advances in
//! [`STEP_MS`] steps of a simulated clock; nothing sleeps or reads the wall clock, so a
//! seed replays exactly.

use std::collections::{BTreeMap, BTreeSet};

use kvota_fairness::decay::Ledger;
use kvota_fairness::federation::{Applied, Command, Federation};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::Policy;

use crate::invariants::{self, Violation};
use crate::member::{Load, SimAgent};
use crate::msg::Msg;
use crate::net::{Addr, Conditions, Net, NetStats};
use crate::raft::{apply_entry, Cp, LogEntry};
use crate::rng::Rng;

/// One simulation step.
pub const STEP_MS: u64 = 100;
/// Faults are injected during this first part of the run.
pub const FAULT_PHASE_MS: u64 = 80_000;
/// Report rounds, with time standing still, after the post-heal drain (liveness bound).
pub const SETTLE_ROUNDS: usize = 6;
/// Largest control-plane node clock offset from real time. With the policy's 10 s lease
/// and 1 s margin, offsets of +-200 ms and agent clock rates within +-5 % keep every
/// agent's lease end before the control plane's (see `docs/testing.md`).
pub const MAX_CP_OFFSET_MS: u64 = 200;
/// Largest agent clock-rate error within the margin (parts per million).
pub const MAX_AGENT_DRIFT_PPM: u64 = 50_000;

/// The base policy: the article's three tenants, a 10 s lease, training in queue mode,
/// reclaim fast enough to act within a run.
pub const POLICY_A: &str = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: chaos-a}
spec:
  decayHalfLife: 10m
  lease: {duration: 10s, clockSkewMargin: 1s}
  reclaim: {starvedFor: 5s, minRuntime: 10s, maxEvictionsPerMinute: 6, maxEvictionsPerMinutePerTenant: 3}
  tenants:
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, preemptible: false}
  - {name: research, weight: 10, minShare: 5, maxShare: 25, preemptible: true}
  - {name: training, weight: 40, minShare: 20, maxShare: 60, preemptible: true, admission: queue, maxQueued: 30}
";

/// The policy a mid-run change applies: weights and caps move (research's cap up,
/// training's down, inference's guarantee down).
pub const POLICY_B: &str = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: chaos-b}
spec:
  decayHalfLife: 10m
  lease: {duration: 10s, clockSkewMargin: 1s}
  reclaim: {starvedFor: 5s, minRuntime: 10s, maxEvictionsPerMinute: 6, maxEvictionsPerMinutePerTenant: 3}
  tenants:
  - {name: inference, weight: 40, minShare: 30, maxShare: 70, preemptible: false}
  - {name: research, weight: 30, minShare: 10, maxShare: 45, preemptible: true}
  - {name: training, weight: 30, minShare: 20, maxShare: 40, preemptible: true, admission: queue, maxQueued: 30}
";

/// Fault switches that break the system on purpose (the checker must notice).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bugs {
    /// Leader answers with unclipped budgets (make before break).
    pub make_before_break: bool,
    /// Agents never let their lease expire.
    pub ignore_expiry: bool,
    /// The leader's adapter renumbers resent (duplicate) reports so they apply again.
    pub double_apply_resent: bool,
    /// Agents drop reports from the journal when sent.
    pub ack_on_send: bool,
    /// Agent 0's clock runs 40 % slow: beyond what the margin covers.
    pub clock_beyond_margin: bool,
    /// Agents acknowledge a lease before the state they keep in the cluster holds it.
    pub ack_unkept: bool,
    /// Agents enforce a lease before their journal holds it.
    pub enforce_unjournaled: bool,
    /// Agents drop the usage of a report their journal refuses (a full disk).
    pub drop_refused_report: bool,
    /// Agents end a report round whose report the journal refused without sending
    /// what the journal holds.
    pub stop_on_refused_report: bool,
}

impl Bugs {
    /// Parses a `--bug` name.
    pub fn parse(name: &str) -> Option<Bugs> {
        let mut b = Bugs::default();
        match name {
            "none" => {}
            "make-before-break" => b.make_before_break = true,
            "ignore-expiry" => b.ignore_expiry = true,
            "double-apply-resent" => b.double_apply_resent = true,
            "ack-on-send" => b.ack_on_send = true,
            "clock-beyond-margin" => b.clock_beyond_margin = true,
            "ack-unkept" => b.ack_unkept = true,
            "enforce-unjournaled" => b.enforce_unjournaled = true,
            "drop-refused-report" => b.drop_refused_report = true,
            "stop-on-refused-report" => b.stop_on_refused_report = true,
            _ => return None,
        }
        Some(b)
    }

    /// The `--bug` name (for replay commands).
    pub fn name(&self) -> &'static str {
        match *self {
            b if b.make_before_break => "make-before-break",
            b if b.ignore_expiry => "ignore-expiry",
            b if b.double_apply_resent => "double-apply-resent",
            b if b.ack_on_send => "ack-on-send",
            b if b.clock_beyond_margin => "clock-beyond-margin",
            b if b.ack_unkept => "ack-unkept",
            b if b.enforce_unjournaled => "enforce-unjournaled",
            b if b.drop_refused_report => "drop-refused-report",
            b if b.stop_on_refused_report => "stop-on-refused-report",
            _ => "none",
        }
    }
}

/// A fault the nemesis injects for a while.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// These control-plane nodes are cut off from the others (both ways).
    CpIsolate(Vec<usize>),
    /// Whoever leads when it starts is cut off from the other nodes.
    LeaderIsolate,
    /// An agent cut from every control-plane node: both ways, or one way.
    AgentCut {
        /// Agent.
        agent: usize,
        /// Requests lost.
        to_cp: bool,
        /// Answers lost.
        from_cp: bool,
    },
    /// A control-plane node crashes; restarts with its disk when the fault ends.
    CpCrash(usize),
    /// An agent crashes; restarts when the fault ends.
    AgentCrash(usize),
    /// An agent is cut off from every control-plane node and killed; a new process
    /// starts at `restart_ms`, still cut off (its kept state unreadable if `corrupt`).
    AgentRestartCut {
        /// Agent.
        agent: usize,
        /// When the new process starts.
        restart_ms: u64,
        /// The kept state is unreadable then.
        corrupt: bool,
    },
    /// As [`Fault::AgentRestartCut`], but the standby takes over: none of the first
    /// process's disk (journal, saved lease) survives, only the state kept in the
    /// cluster.
    AgentTakeover {
        /// Agent.
        agent: usize,
        /// When the standby starts.
        restart_ms: u64,
        /// The kept state is unreadable then.
        corrupt: bool,
    },
    /// The agent cannot write its kept state (it goes stale).
    AgentStoreDown(usize),
    /// The agent's disk is full: its journal takes no report and no lease.
    AgentDiskFull(usize),
    /// Loss and delay on every link.
    NetChaos {
        /// Loss percent.
        loss_pct: u64,
        /// Largest delay.
        max_delay_ms: u64,
    },
    /// A control-plane node's disk is slow.
    CpSlowDisk(usize, u64),
    /// An agent's journal disk is slow.
    AgentSlowDisk(usize, u64),
}

impl Fault {
    /// A short name for counting.
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::CpIsolate(nodes) => {
                if nodes.len() == 1 {
                    "cp-isolate-one"
                } else {
                    "cp-isolate-group"
                }
            }
            Fault::LeaderIsolate => "leader-isolate",
            Fault::AgentCut { to_cp: true, from_cp: true, .. } => "agent-cut",
            Fault::AgentCut { .. } => "agent-cut-one-way",
            Fault::CpCrash(_) => "cp-crash",
            Fault::AgentCrash(_) => "agent-crash",
            Fault::AgentRestartCut { .. } => "agent-restart-in-partition",
            Fault::AgentTakeover { .. } => "standby-takeover-in-partition",
            Fault::AgentStoreDown(_) => "agent-kept-state-stale",
            Fault::AgentDiskFull(_) => "agent-disk-full",
            Fault::NetChaos { .. } => "net-loss-delay",
            Fault::CpSlowDisk(..) => "cp-slow-disk",
            Fault::AgentSlowDisk(..) => "agent-slow-disk",
        }
    }
}

#[derive(Clone, Debug)]
struct Scheduled {
    start_ms: u64,
    end_ms: u64,
    fault: Fault,
    /// Resolved at start (the leader isolated).
    resolved: Vec<usize>,
    active: bool,
    /// The mid-fault restart happened.
    restarted: bool,
}

/// The committed log applied once, plus what the checker needs from it.
#[derive(Debug, Default)]
pub struct Oracle {
    /// The state machine at the global commit index.
    pub fed: Federation,
    /// Reports counted: `(cluster, seq)`.
    pub applied_reports: BTreeSet<(ClusterName, u64)>,
    /// The usage window's start of each counted report, by `(cluster, seq)`: which of
    /// two reports with one number (an old process's, a standby's) was counted.
    pub applied_windows: BTreeMap<(ClusterName, u64), u64>,
    /// Usage counted per `(cluster, tenant)` (undecayed).
    pub counted: BTreeMap<(ClusterName, TenantName), u64>,
    /// The ledger rebuilt from the counted reports.
    pub shadow: Ledger,
}

impl Oracle {
    fn apply(&mut self, e: &LogEntry, at_ms: u64) -> Result<Option<Policy>, Violation> {
        let results = apply_entry(&mut self.fed, &e.req);
        let mut policy = None;
        for (cmd, res) in e.req.commands.iter().zip(results) {
            match (cmd, res) {
                (Command::Report(r), Ok(Applied::Reported { applied: true, .. })) => {
                    if !self.applied_reports.insert((r.cluster.clone(), r.seq)) {
                        return Err(Violation {
                            invariant: "conservation",
                            at_ms,
                            detail: format!("report ({}, seq {}) was counted twice", r.cluster, r.seq),
                        });
                    }
                    self.applied_windows.insert((r.cluster.clone(), r.seq), r.window.map_or(0, |w| w.start_ms));
                    let now = self.fed.now_ms();
                    let Some(p) = self.fed.policy() else { continue };
                    for (t, tr) in &r.tenants {
                        if let Some(tp) = p.tenant(t) {
                            *self.counted.entry((r.cluster.clone(), t.clone())).or_default() += tr.used_milli_gpue_ms;
                            self.shadow.add(t, tr.used_milli_gpue_ms, now, tp.decay_half_life_ms);
                        }
                    }
                }
                (Command::ApplyPolicy(p), Ok(_)) => policy = Some(p.clone()),
                _ => {}
            }
        }
        Ok(policy)
    }
}

/// What a run did (for the test's output and the soak script).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Seed.
    pub seed: u64,
    /// Control-plane nodes.
    pub cp_nodes: usize,
    /// Clusters.
    pub clusters: usize,
    /// Faults injected.
    pub faults: usize,
    /// Leader elections won.
    pub elections: u64,
    /// Committed log entries.
    pub entries: usize,
    /// Reports counted.
    pub reports: usize,
    /// Admissions checked.
    pub admissions: u64,
    /// Agent crashes.
    pub agent_crashes: u64,
    /// Standby takeovers (of the crashes).
    pub takeovers: u64,
    /// Reports refused by an agent's journal at its backlog limit.
    pub backlog_refusals: u64,
    /// Usage the agents could not meter (down or crashed), GPUe-ms.
    pub unmetered_gpue_ms: u64,
    /// Network counters.
    pub net: NetStats,
    /// Faults that took effect, by kind (plus `policy-change` and `demand-shift`).
    pub fault_kinds: BTreeMap<&'static str, u64>,
}

/// The simulated world.
#[derive(Debug)]
pub struct World {
    /// Seed.
    pub seed: u64,
    /// Real (simulated) time.
    pub now_ms: u64,
    rng: Rng,
    /// The network.
    pub net: Net<Msg>,
    /// The control plane.
    pub cp: Cp,
    /// The clusters.
    pub agents: Vec<SimAgent>,
    /// The committed state and its bookkeeping.
    pub oracle: Oracle,
    policies: (Policy, Policy),
    /// Policies that came into force (real time, policy).
    pub policy_history: Vec<(u64, Policy)>,
    schedule: Vec<Scheduled>,
    pending_admin: Vec<Command>,
    policy_change_ms: Option<u64>,
    demand_shift_ms: u64,
    shifted: bool,
    /// The mid-run raise to sized budgets was applied (counted once).
    upgraded: bool,
    last_epochs: Vec<(u64, u64)>,
    inuse_cache: Vec<BTreeMap<TenantName, u64>>,
    bugs: Bugs,
    admissions: u64,
    fault_kinds: BTreeMap<&'static str, u64>,
}

fn policy(yaml: &str) -> Result<Policy, Violation> {
    Policy::from_yaml(yaml).map_err(|e| Violation { invariant: "harness", at_ms: 0, detail: format!("policy: {e}") })
}

impl World {
    /// Builds the world for `seed` with fault switches `bugs`.
    pub fn new(seed: u64, bugs: Bugs) -> Result<World, Violation> {
        let mut rng = Rng::new(seed);
        let policies = (policy(POLICY_A)?, policy(POLICY_B)?);
        let cp_nodes = if rng.chance(50) { 3 } else { 5 };
        let offsets: Vec<i64> = (0..cp_nodes).map(|_| rng.signed(MAX_CP_OFFSET_MS)).collect();
        let mut cp = Cp::new(cp_nodes, &offsets, rng.fork());
        cp.bug_make_before_break = bugs.make_before_break;
        // Half the runs upgrade to sized budgets mid-run (the leader raises the feature
        // level while agents report and faults strike), half run at that level from the
        // first entry. Drawn from a stream of its own, so every other draw of a seed is
        // what it was.
        let mut upgrade = Rng::new(seed ^ 0x005E_ED0F_512E);
        cp.sized_at_ms = if upgrade.chance(50) { upgrade.range(2_000, FAULT_PHASE_MS) } else { 0 };
        // A third of the agents have a journal that fills within a partition's first
        // seconds (one report a second); the others never reach their limit. Its own
        // stream too.
        let mut backlogs = Rng::new(seed ^ 0x0BAC_C106_F011);
        let n_agents = usize::try_from(rng.range(3, 6)).unwrap_or(3);
        let tenants = ["inference", "research", "training"];
        let mut agents = Vec::new();
        for i in 0..n_agents {
            let nodes = rng.range(2, 4);
            let per = if rng.chance(50) { 4 } else { 8 };
            let node_gpus: Vec<u32> = (0..nodes).map(|_| per).collect();
            let mut rate = rng.signed(MAX_AGENT_DRIFT_PPM);
            if bugs.clock_beyond_margin && i == 0 {
                rate = -400_000;
            }
            let offset = rng.range(0, 3_600_000);
            let mut a = SimAgent::new(i, &node_gpus, rate, offset, cp_nodes, rng.fork());
            if backlogs.chance(33) {
                a.max_backlog = usize::try_from(backlogs.range(2, 12)).unwrap_or(2);
            }
            a.bugs.ignore_expiry = bugs.ignore_expiry;
            a.bugs.ack_on_send = bugs.ack_on_send;
            a.bugs.ack_unkept = bugs.ack_unkept;
            a.bugs.enforce_unjournaled = bugs.enforce_unjournaled;
            a.bugs.drop_refused_report = bugs.drop_refused_report;
            a.bugs.stop_on_refused_report = bugs.stop_on_refused_report;
            for t in tenants {
                a.load.insert(TenantName::from_static(t), random_load(&mut rng, t));
            }
            agents.push(a);
        }
        let mut schedule = Vec::new();
        let n_faults = rng.range(4, 12);
        for _ in 0..n_faults {
            let start_ms = rng.range(3_000, FAULT_PHASE_MS - 5_000);
            let end_ms = (start_ms + rng.range(1_000, 25_000)).min(FAULT_PHASE_MS);
            let fault = match rng.below(13) {
                0 => {
                    // A minority or a majority of the control plane, cut off.
                    let k = rng.range(1, u64::try_from(cp_nodes - 1).unwrap_or(1));
                    let mut nodes: Vec<usize> = (0..cp_nodes).collect();
                    for j in (1..nodes.len()).rev() {
                        nodes.swap(j, rng.index(j + 1));
                    }
                    nodes.truncate(usize::try_from(k).unwrap_or(1));
                    nodes.sort_unstable();
                    Fault::CpIsolate(nodes)
                }
                1 => Fault::LeaderIsolate,
                2 | 3 => {
                    let dir = rng.below(3);
                    Fault::AgentCut { agent: rng.index(n_agents), to_cp: dir != 2, from_cp: dir != 1 }
                }
                4 => Fault::CpCrash(rng.index(cp_nodes)),
                5 => Fault::AgentCrash(rng.index(n_agents)),
                6 => Fault::NetChaos { loss_pct: rng.range(0, 40), max_delay_ms: rng.range(50, 1_500) },
                7 => Fault::CpSlowDisk(rng.index(cp_nodes), rng.range(50, 800)),
                8 => Fault::AgentSlowDisk(rng.index(n_agents), rng.range(50, 3_000)),
                9 => Fault::AgentRestartCut { agent: rng.index(n_agents), restart_ms: (start_ms + end_ms) / 2, corrupt: rng.chance(15) },
                10 => Fault::AgentTakeover { agent: rng.index(n_agents), restart_ms: (start_ms + end_ms) / 2, corrupt: rng.chance(15) },
                11 => Fault::AgentStoreDown(rng.index(n_agents)),
                _ => Fault::AgentDiskFull(rng.index(n_agents)),
            };
            schedule.push(Scheduled { start_ms, end_ms, fault, resolved: Vec::new(), active: false, restarted: false });
        }
        let policy_change_ms = if rng.chance(60) { Some(rng.range(10_000, FAULT_PHASE_MS)) } else { None };
        let demand_shift_ms = rng.range(20_000, FAULT_PHASE_MS);
        let mut w = World {
            seed,
            now_ms: 0,
            rng,
            net: Net::new(),
            cp,
            last_epochs: vec![(0, 0); agents.len()],
            inuse_cache: vec![BTreeMap::new(); agents.len()],
            agents,
            oracle: Oracle { fed: crate::raft::initial_state(), ..Oracle::default() },
            policies,
            policy_history: Vec::new(),
            schedule,
            pending_admin: Vec::new(),
            policy_change_ms,
            demand_shift_ms,
            shifted: false,
            upgraded: false,
            bugs,
            admissions: 0,
            fault_kinds: BTreeMap::new(),
        };
        // The operator applies the policy first (`kvota policy apply`).
        w.pending_admin.push(Command::ApplyPolicy(w.policies.0.clone()));
        Ok(w)
    }

    /// Policy tenant names (plus retiring ones), in order.
    pub fn tenant_names(&self) -> Vec<TenantName> {
        let mut names: BTreeSet<TenantName> = self.oracle.fed.committed().keys().cloned().collect();
        if let Some(p) = self.oracle.fed.policy() {
            names.extend(p.tenants.iter().map(|t| t.name.clone()));
        }
        names.into_iter().collect()
    }

    /// The latest time any control-plane node's clock may show now.
    pub fn cp_check_time(&self) -> u64 {
        self.now_ms + MAX_CP_OFFSET_MS
    }

    /// Ground truth in-use of `tenant` in cluster `i` (cached per step).
    pub fn true_inuse(&self, i: usize, tenant: &str) -> u64 {
        self.inuse_cache.get(i).and_then(|m| m.get(tenant)).copied().unwrap_or(0)
    }

    fn refresh_inuse(&mut self, i: usize) {
        let mut m = BTreeMap::new();
        if let Some(a) = self.agents.get(i) {
            for p in a.sim.list_pods() {
                if let (Some(t), true) = (p.tenant, p.phase != kvota_member_agent::sim::PodPhase::Gated) {
                    *m.entry(t).or_insert(0) += p.gpue;
                }
            }
        }
        if let Some(c) = self.inuse_cache.get_mut(i) {
            *c = m;
        }
    }

    /// The largest maxShare `tenant` had under any policy in force during the last
    /// lease duration plus 5 s.
    pub fn recent_max_share_bp(&self, tenant: &str) -> u32 {
        let window = self.oracle.fed.policy().map_or(30_000, |p| p.lease.duration_ms) + 5_000;
        let mut best = self.oracle.fed.policy().and_then(|p| p.tenant(tenant)).map_or(0, |t| t.max_share_bp);
        let mut prev: Option<&Policy> = None;
        for (at, p) in &self.policy_history {
            if at + window >= self.now_ms {
                // The policy before this one was in force until `at`.
                for q in prev.iter().chain(std::iter::once(&p)) {
                    if let Some(t) = q.tenant(tenant) {
                        best = best.max(t.max_share_bp);
                    }
                }
            }
            prev = Some(p);
        }
        best
    }

    fn apply_faults(&mut self) {
        let now = self.now_ms;
        let mut changed = false;
        for k in 0..self.schedule.len() {
            let Some(s) = self.schedule.get(k).cloned() else { continue };
            if !s.active && s.start_ms <= now && now < s.end_ms {
                let mut resolved = Vec::new();
                *self.fault_kinds.entry(s.fault.kind()).or_insert(0) += 1;
                match &s.fault {
                    Fault::CpCrash(i) => self.cp.crash(*i),
                    Fault::AgentCrash(i) => {
                        if let Some(a) = self.agents.get_mut(*i) {
                            a.crash(now);
                        }
                    }
                    Fault::AgentRestartCut { agent, corrupt, .. } => {
                        if let Some(a) = self.agents.get_mut(*agent).filter(|a| a.up) {
                            a.crash(now);
                            a.kept_corrupt = *corrupt;
                        }
                    }
                    Fault::AgentTakeover { agent, corrupt, .. } => {
                        if let Some(a) = self.agents.get_mut(*agent).filter(|a| a.up) {
                            a.takeover_crash(now);
                            a.kept_corrupt = *corrupt;
                        }
                    }
                    Fault::AgentStoreDown(i) => {
                        if let Some(a) = self.agents.get_mut(*i) {
                            a.store_down = true;
                        }
                    }
                    Fault::AgentDiskFull(i) => {
                        if let Some(a) = self.agents.get_mut(*i) {
                            a.disk_full = true;
                        }
                    }
                    Fault::CpSlowDisk(i, ms) => {
                        if let Some(r) = self.cp.replicas.get_mut(*i) {
                            r.disk_delay_ms = *ms;
                        }
                    }
                    Fault::AgentSlowDisk(i, ms) => {
                        if let Some(a) = self.agents.get_mut(*i) {
                            a.disk_delay_ms = *ms;
                        }
                    }
                    Fault::LeaderIsolate => resolved.extend(self.cp.leader()),
                    _ => {}
                }
                if let Some(s) = self.schedule.get_mut(k) {
                    s.active = true;
                    s.resolved = resolved;
                }
                changed = true;
            } else if s.active && !s.restarted && now < s.end_ms {
                // The new agent process starts while the partition lasts.
                if let Fault::AgentRestartCut { agent, restart_ms, .. } | Fault::AgentTakeover { agent, restart_ms, .. } = &s.fault {
                    if now >= *restart_ms {
                        if let Some(a) = self.agents.get_mut(*agent) {
                            a.restart(now);
                        }
                        if let Some(s) = self.schedule.get_mut(k) {
                            s.restarted = true;
                        }
                    }
                }
            } else if s.active && now >= s.end_ms {
                match &s.fault {
                    Fault::CpCrash(i) => self.cp.restart(*i, now),
                    Fault::AgentCrash(i) => {
                        if let Some(a) = self.agents.get_mut(*i) {
                            a.restart(now);
                        }
                    }
                    Fault::AgentRestartCut { agent, .. } | Fault::AgentTakeover { agent, .. } => {
                        if let Some(a) = self.agents.get_mut(*agent) {
                            a.restart(now);
                        }
                    }
                    Fault::AgentStoreDown(i) => {
                        if let Some(a) = self.agents.get_mut(*i) {
                            a.store_down = false;
                        }
                    }
                    Fault::AgentDiskFull(i) => {
                        if let Some(a) = self.agents.get_mut(*i) {
                            a.disk_full = false;
                        }
                    }
                    Fault::CpSlowDisk(i, _) => {
                        if let Some(r) = self.cp.replicas.get_mut(*i) {
                            r.disk_delay_ms = 0;
                        }
                    }
                    Fault::AgentSlowDisk(i, _) => {
                        if let Some(a) = self.agents.get_mut(*i) {
                            a.disk_delay_ms = 0;
                        }
                    }
                    _ => {}
                }
                if let Some(s) = self.schedule.get_mut(k) {
                    s.active = false;
                    s.start_ms = u64::MAX;
                }
                changed = true;
            }
        }
        if changed {
            self.rebuild_links();
        }
    }

    fn rebuild_links(&mut self) {
        self.net.heal_all();
        let mut cond = Conditions::CALM;
        let n = self.cp.replicas.len();
        for s in self.schedule.iter().filter(|s| s.active) {
            match &s.fault {
                Fault::CpIsolate(nodes) => cut_group(&mut self.net, nodes, n),
                Fault::LeaderIsolate => cut_group(&mut self.net, &s.resolved, n),
                Fault::AgentRestartCut { agent, .. } | Fault::AgentTakeover { agent, .. } => {
                    for c in 0..n {
                        self.net.cut(Addr::Agent(*agent), Addr::Cp(c));
                        self.net.cut(Addr::Cp(c), Addr::Agent(*agent));
                    }
                }
                Fault::AgentCut { agent, to_cp, from_cp } => {
                    for c in 0..n {
                        if *to_cp {
                            self.net.cut(Addr::Agent(*agent), Addr::Cp(c));
                        }
                        if *from_cp {
                            self.net.cut(Addr::Cp(c), Addr::Agent(*agent));
                        }
                    }
                }
                Fault::NetChaos { loss_pct, max_delay_ms } => {
                    cond.loss_pct = cond.loss_pct.max(*loss_pct);
                    cond.max_delay_ms = cond.max_delay_ms.max(*max_delay_ms);
                }
                _ => {}
            }
        }
        self.net.conditions = cond;
    }

    fn deliver(&mut self) {
        for (_, to, msg) in self.net.due(self.now_ms) {
            match (to, msg) {
                (Addr::Cp(k), Msg::Request(mut req)) => {
                    if self.bugs.double_apply_resent {
                        renumber_duplicate(&self.cp, k, &mut req.command);
                    }
                    self.cp.deliver(k, req, self.now_ms, &mut self.net);
                }
                (Addr::Agent(i), Msg::Answer(ans)) => {
                    let now = self.now_ms;
                    if let Some(a) = self.agents.get_mut(i) {
                        a.on_answer(ans, now, &mut self.net);
                    }
                }
                _ => {}
            }
        }
    }

    fn control_plane(&mut self) -> Result<(), Violation> {
        if !self.pending_admin.is_empty() {
            let cmds = std::mem::take(&mut self.pending_admin);
            for c in cmds {
                if !self.cp.propose_admin(c.clone()) {
                    self.pending_admin.push(c);
                }
            }
        }
        let newly = self
            .cp
            .step(self.now_ms, &mut self.net)
            .map_err(|detail| Violation { invariant: "harness", at_ms: self.now_ms, detail })?;
        for e in &newly {
            if let Some(p) = self.oracle.apply(e, self.now_ms)? {
                self.policy_history.push((self.now_ms, p));
            }
        }
        Ok(())
    }

    fn agents_step(&mut self, arrivals: bool) -> Result<(), Violation> {
        for i in 0..self.agents.len() {
            let before: BTreeMap<TenantName, u64> = {
                let mut m = BTreeMap::new();
                for c in &self.inuse_cache {
                    for (t, g) in c {
                        *m.entry(t.clone()).or_insert(0) += g;
                    }
                }
                m
            };
            let now = self.now_ms;
            let admitted = match self.agents.get_mut(i) {
                Some(a) => a.step(now, &mut self.net, arrivals),
                None => Vec::new(),
            };
            self.refresh_inuse(i);
            self.admissions += u64::try_from(admitted.len()).unwrap_or(0);
            invariants::admission::check(self, i, &admitted, &before)?;
        }
        Ok(())
    }

    /// One step of `STEP_MS`: faults, network, control plane, agents, checks.
    pub fn step(&mut self, arrivals: bool) -> Result<(), Violation> {
        self.now_ms += STEP_MS;
        self.apply_faults();
        if !self.shifted && self.now_ms >= self.demand_shift_ms {
            self.shifted = true;
            *self.fault_kinds.entry("demand-shift").or_insert(0) += 1;
            self.shift_demand();
        }
        if self.cp.sized_at_ms > 0 && !self.upgraded && self.oracle.fed.sizes_budgets() {
            self.upgraded = true;
            *self.fault_kinds.entry("upgrade-to-sized-budgets").or_insert(0) += 1;
        }
        if self.policy_change_ms.is_some_and(|t| self.now_ms >= t) {
            self.policy_change_ms = None;
            *self.fault_kinds.entry("policy-change").or_insert(0) += 1;
            self.pending_admin.push(Command::ApplyPolicy(self.policies.1.clone()));
        }
        self.deliver();
        self.control_plane()?;
        self.agents_step(arrivals)?;
        self.check_continuous()
    }

    fn check_continuous(&mut self) -> Result<(), Violation> {
        invariants::partition_safety::check(self)?;
        invariants::takeover::check(self)?;
        let mut last = std::mem::take(&mut self.last_epochs);
        let r = invariants::epochs::check(self, &mut last);
        self.last_epochs = last;
        r
    }

    fn shift_demand(&mut self) {
        for a in &mut self.agents {
            for l in a.load.values_mut() {
                l.per_mille = match self.rng.below(4) {
                    0 => 0,
                    1 => l.per_mille / 2,
                    2 => l.per_mille,
                    _ => l.per_mille * 3,
                };
            }
        }
    }

    /// Heals every fault: links, disks, crashed nodes and agents.
    pub fn heal_all(&mut self) {
        let now = self.now_ms;
        for s in &mut self.schedule {
            s.active = false;
            s.start_ms = u64::MAX;
        }
        self.net.heal_all();
        self.net.conditions = Conditions::CALM;
        for i in 0..self.cp.replicas.len() {
            self.cp.restart(i, now);
            if let Some(r) = self.cp.replicas.get_mut(i) {
                r.disk_delay_ms = 0;
            }
        }
        for a in &mut self.agents {
            a.restart(now);
            a.disk_delay_ms = 0;
            a.store_down = false;
        }
    }

    /// Settling with time standing still: each agent reports, and messages flow with no
    /// delay until nothing is in flight.
    pub fn settle(&mut self) -> Result<(), Violation> {
        self.net.conditions = Conditions { loss_pct: 0, min_delay_ms: 0, max_delay_ms: 0 };
        for _ in 0..SETTLE_ROUNDS {
            for i in 0..self.agents.len() {
                let now = self.now_ms;
                if let Some(a) = self.agents.get_mut(i) {
                    a.report_now(now, &mut self.net);
                }
                // Bounded: each exchange acknowledges a report or ends the agent's round.
                for _ in 0..200 {
                    if self.net.in_flight() == 0 {
                        break;
                    }
                    self.deliver();
                    self.control_plane()?;
                }
                self.check_continuous()?;
            }
        }
        Ok(())
    }

    /// The run summary so far.
    pub fn summary(&self) -> Summary {
        Summary {
            seed: self.seed,
            cp_nodes: self.cp.replicas.len(),
            clusters: self.agents.len(),
            faults: self.schedule.len(),
            elections: self.cp.elections,
            entries: self.cp.committed.len(),
            reports: self.oracle.applied_reports.len(),
            admissions: self.admissions,
            agent_crashes: self.agents.iter().map(|a| a.crashes).sum(),
            takeovers: self.agents.iter().map(|a| a.takeovers).sum(),
            backlog_refusals: self.agents.iter().map(|a| a.backlog_refusals).sum(),
            unmetered_gpue_ms: self.agents.iter().flat_map(|a| a.unmetered.values()).sum(),
            net: self.net.stats,
            fault_kinds: self.fault_kinds.clone(),
        }
    }
}

fn cut_group(net: &mut Net<Msg>, group: &[usize], n: usize) {
    for &a in group {
        for b in (0..n).filter(|b| !group.contains(b)) {
            net.cut(Addr::Cp(a), Addr::Cp(b));
            net.cut(Addr::Cp(b), Addr::Cp(a));
        }
    }
}

/// The `double_apply_resent` fault: a leader that "fixes up" an old sequence number
/// to the next expected one, so a resent report is counted again.
fn renumber_duplicate(cp: &Cp, node: usize, cmd: &mut Command) {
    let Some(r) = cp.replicas.get(node).filter(|r| r.up && r.leader) else { return };
    if let Command::Report(rep) = cmd {
        if let Some(rec) = r.state.clusters().get(&rep.cluster) {
            if rep.seq <= rec.last_seq {
                rep.seq = rec.last_seq + 1;
            }
        }
    }
}

fn random_load(rng: &mut Rng, tenant: &str) -> Load {
    match tenant {
        "inference" => Load { per_mille: rng.range(10, 60), max_gpus: 2, run_ms: (15_000, 90_000), priority: 100 },
        "training" => Load { per_mille: rng.range(10, 70), max_gpus: 4, run_ms: (20_000, 120_000), priority: 0 },
        _ => Load { per_mille: rng.range(5, 50), max_gpus: 2, run_ms: (5_000, 40_000), priority: 0 },
    }
}

/// A failed run: the seed, what broke, and how to replay it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Seed.
    pub seed: u64,
    /// Fault switches of the run.
    pub bugs: Bugs,
    /// What broke.
    pub violation: Violation,
}

impl Failure {
    /// The one command that replays this run exactly.
    pub fn replay_command(&self) -> String {
        replay_command(self.seed, self.bugs)
    }
}

/// The one command that replays `seed` with `bugs`.
pub fn replay_command(seed: u64, bugs: Bugs) -> String {
    let bug = if bugs == Bugs::default() { String::new() } else { format!(" --bug {}", bugs.name()) };
    format!("cargo run -p kvota-chaos-tests --bin chaos-sim -- --seed {seed}{bug}")
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "chaos seed {} FAILED: {}\n  replay: {}", self.seed, self.violation, self.replay_command())
    }
}

/// Runs one seed: faults for [`FAULT_PHASE_MS`], heal, drain for a lease duration plus
/// margin plus 5 s, settle, final checks.
///
/// A panic anywhere in the run (production code included) is a failure of this seed
/// like any other, reported with its replay command.
pub fn run(seed: u64, bugs: Bugs) -> Result<Summary, Failure> {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_inner(seed, bugs)));
    let result = match result {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".to_string());
            Err(Violation { invariant: "no-panic", at_ms: 0, detail: what })
        }
    };
    result.map_err(|violation| Failure { seed, bugs, violation })
}

fn run_inner(seed: u64, bugs: Bugs) -> Result<Summary, Violation> {
    let mut w = World::new(seed, bugs)?;
    while w.now_ms < FAULT_PHASE_MS {
        w.step(true)?;
    }
    w.heal_all();
    let lease = w.oracle.fed.policy().map_or(30_000, |p| p.lease.duration_ms + p.lease.clock_skew_margin_ms);
    let drain_until = w.now_ms + lease + 5_000;
    while w.now_ms < drain_until {
        w.step(true)?;
    }
    w.settle()?;
    invariants::conservation::check_end(&w)?;
    invariants::liveness::check_end(&w)?;
    invariants::replicas::check_end(&w)?;
    Ok(w.summary())
}
