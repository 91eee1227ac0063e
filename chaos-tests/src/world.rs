//! The harness: one seed, one world, simulated time only.
//!
//! Everything random comes from [`Rng`] seeded with the run's seed: the topology (3 or 5
//! control-plane nodes, 3 to 6 clusters of 2-4 nodes with 4 or 8 GPUs), clock offsets and
//! rates, the workload and its mid-run shift, and the nemesis schedule. Time advances in
//! [`STEP_MS`] steps of a simulated clock; nothing sleeps or reads the wall clock, so a
//! seed replays exactly.

use std::collections::{BTreeMap, BTreeSet};

use kvota_control_plane::feature::FeatureLevel;
use kvota_fairness::decay::Ledger;
use kvota_fairness::federation::{Applied, Command, Federation};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::Policy;

use crate::invariants::{self, Violation};
use crate::member::{Load, SimAgent};
use crate::msg::Msg;
use crate::net::{Addr, Conditions, Net, NetStats};
use crate::raft::{Cp, LogEntry, Machine};
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

/// Fault switches that break the system on purpose (the checker must notice). Every one
/// but `clock_beyond_margin` (a fault of the environment) turns on a bug in the real
/// code, behind the `fault-injection` feature: the report round's
/// (`kvota_member_agent::round::Faults`), the core's and the apply path's
/// (`kvota_fairness::faults::Faults`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bugs {
    /// Leases carry the budgets the split wants before the break-before-make clip.
    pub make_before_break: bool,
    /// Agents' leases never expire (their budgets stay in force).
    pub ignore_expiry: bool,
    /// A report whose sequence number was applied before is counted again.
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
    /// Reclaim never evicts a pod admitted on borrowed GPUs.
    pub borrowed_not_evictable: bool,
    /// Borrowing ignores the lease's borrow limit.
    pub borrow_past_limit: bool,
    /// Replicas apply log entries they applied before (replaying the log over a
    /// snapshot counts them twice).
    pub apply_replayed_entry: bool,
}

/// Every `--bug` name, in order.
pub const BUG_NAMES: [&str; 12] = [
    "make-before-break",
    "ignore-expiry",
    "double-apply-resent",
    "ack-on-send",
    "clock-beyond-margin",
    "ack-unkept",
    "enforce-unjournaled",
    "drop-refused-report",
    "stop-on-refused-report",
    "borrowed-not-evictable",
    "borrow-past-limit",
    "apply-replayed-entry",
];

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
            "borrowed-not-evictable" => b.borrowed_not_evictable = true,
            "borrow-past-limit" => b.borrow_past_limit = true,
            "apply-replayed-entry" => b.apply_replayed_entry = true,
            _ => return None,
        }
        Some(b)
    }

    /// The `--bug` name (for replay commands).
    pub fn name(&self) -> &'static str {
        BUG_NAMES
            .iter()
            .copied()
            .find(|n| Bugs::parse(n).as_ref() == Some(self))
            .unwrap_or("none")
    }

    /// The report round's switches among these.
    pub fn agent_faults(&self) -> kvota_member_agent::round::Faults {
        kvota_member_agent::round::Faults {
            ack_on_send: self.ack_on_send,
            ack_unkept: self.ack_unkept,
            enforce_unjournaled: self.enforce_unjournaled,
            drop_refused_report: self.drop_refused_report,
            stop_on_refused_report: self.stop_on_refused_report,
        }
    }

    /// The core's and the apply path's switches among these.
    pub fn core_faults(&self) -> kvota_fairness::faults::Faults {
        kvota_fairness::faults::Faults {
            make_before_break: self.make_before_break,
            ignore_expiry: self.ignore_expiry,
            double_apply_resent: self.double_apply_resent,
            borrowed_not_evictable: self.borrowed_not_evictable,
            borrow_past_limit: self.borrow_past_limit,
            apply_replayed_entry: self.apply_replayed_entry,
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
            Fault::AgentCut {
                to_cp: true,
                from_cp: true,
                ..
            } => "agent-cut",
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
    /// The group's feature level at the global commit index.
    pub level: FeatureLevel,
    /// Committed entries applied.
    pub applied: u64,
}

impl Oracle {
    fn apply(&mut self, e: &LogEntry, at_ms: u64) -> Result<Option<Policy>, Violation> {
        // The control plane's own apply path, as every replica runs it.
        let mut m = Machine {
            fed: std::mem::take(&mut self.fed),
            level: self.level,
            last: self.applied.checked_sub(1).map(|_| self.applied),
        };
        self.applied += 1;
        let results = m.apply(self.applied, &e.req).unwrap_or_default();
        (self.fed, self.level) = (m.fed, m.level);
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
                    self.applied_windows
                        .insert((r.cluster.clone(), r.seq), r.window.map_or(0, |w| w.start_ms));
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
    /// Pods admitted on borrowed GPUs.
    pub borrowed_admissions: u64,
    /// Borrowed pods reclaim evicted.
    pub borrowed_reclaimed: u64,
    /// Agent crashes that left a torn journal write behind.
    pub torn_writes: u64,
    /// Journal writes an agent's disk refused (full or failing).
    pub refused_writes: u64,
    /// The group's feature level at the end.
    pub feature_level: u32,
    /// The policy lent only once a cluster was cut off (`lendWhen: cutOff`).
    pub lend_when_cut_off: bool,
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
    /// Since when (real time) the committed state keeps lending within maxShare
    /// federation-wide (feature level 7, `Federation::caps_borrowing`); `None` before.
    pub borrow_cap_since: Option<u64>,
    last_epochs: Vec<(u64, u64)>,
    inuse_cache: Vec<BTreeMap<TenantName, u64>>,
    borrowed_cache: Vec<BTreeMap<TenantName, u64>>,
    /// Claims that borrowed pods alone could serve, and since when (see
    /// [`invariants::lending`]).
    lender_waiting: BTreeMap<usize, (String, u64)>,
    admissions: u64,
    fault_kinds: BTreeMap<&'static str, u64>,
    /// Agents whose journal disk fails some writes for a while: (agent, from, to, per mille).
    flaky_disks: Vec<(usize, u64, u64, u64)>,
    /// The seed's policies lend only once a cluster is cut off (`lendWhen: cutOff`).
    lend_when_cut_off: bool,
    /// The operator has set `lendWhen: cutOff` (the group runs at its level).
    lend_when_set: bool,
}

fn policy(yaml: &str) -> Result<Policy, Violation> {
    Policy::from_yaml(yaml).map_err(|e| Violation {
        invariant: "harness",
        at_ms: 0,
        detail: format!("policy: {e}"),
    })
}

impl World {
    /// Builds the world for `seed` with fault switches `bugs`.
    pub fn new(seed: u64, bugs: Bugs) -> Result<World, Violation> {
        let mut rng = Rng::new(seed);
        let policies = (policy(POLICY_A)?, policy(POLICY_B)?);
        let cp_nodes = if rng.chance(50) { 3 } else { 5 };
        let offsets: Vec<i64> = (0..cp_nodes).map(|_| rng.signed(MAX_CP_OFFSET_MS)).collect();
        let mut cp = Cp::new(cp_nodes, &offsets, rng.fork());
        // Half the runs upgrade mid-run from level 2 (no lending, no sized budgets) to
        // the newest (the leader raises the feature level while agents report and faults
        // strike), half run at the newest from the first entry. Drawn from a stream of
        // its own, so every other draw of a seed is what it was.
        let mut upgrade = Rng::new(seed ^ 0x005E_ED0F_512E);
        if upgrade.chance(50) {
            cp.start_level = FeatureLevel::RECORDS;
            cp.upgrade_at_ms = upgrade.range(2_000, FAULT_PHASE_MS);
        }
        // Lending at the lease standing `spec.reclaim.lendWhen` names: always (the
        // default) or only once cut off, drawn per seed from a stream of its own; the
        // operator sets it once the group runs at its level.
        let lend_when_cut_off = Rng::new(seed ^ 0x1E4D_0A7C_0FF0).chance(50);
        // Some agents' journal disks fail a write now and then, for a while.
        let mut flaky = Rng::new(seed ^ 0xF1A4_D15C_0BAD);
        // Half the agents have a journal that fills within a partition's first
        // rounds (a round while cut off waits seconds for its calls to time out); the others
        // never reach their limit. Its own stream too.
        let mut backlogs = Rng::new(seed ^ 0x0BAC_C106_F011);
        let n_agents = usize::try_from(rng.range(3, 6)).unwrap_or(3);
        let tenants = ["inference", "research", "training"];
        let mut agents = Vec::new();
        let mut flaky_disks = Vec::new();
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
            if backlogs.chance(50) {
                // A real agent's round waits for its calls to time out while cut off
                // (seconds each), so a limit of a few reports is what a partition of
                // seconds fills.
                a.max_backlog = usize::try_from(backlogs.range(1, 3)).unwrap_or(1);
            }
            if flaky.chance(25) {
                let from = flaky.range(3_000, FAULT_PHASE_MS - 10_000);
                flaky_disks.push((i, from, from + flaky.range(2_000, 15_000), flaky.range(20, 200)));
            }
            a.faults = bugs.agent_faults();
            a.restart(0);
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
                    Fault::AgentCut {
                        agent: rng.index(n_agents),
                        to_cp: dir != 2,
                        from_cp: dir != 1,
                    }
                }
                4 => Fault::CpCrash(rng.index(cp_nodes)),
                5 => Fault::AgentCrash(rng.index(n_agents)),
                6 => Fault::NetChaos {
                    loss_pct: rng.range(0, 40),
                    max_delay_ms: rng.range(50, 1_500),
                },
                7 => Fault::CpSlowDisk(rng.index(cp_nodes), rng.range(50, 800)),
                8 => Fault::AgentSlowDisk(rng.index(n_agents), rng.range(50, 3_000)),
                9 => Fault::AgentRestartCut {
                    agent: rng.index(n_agents),
                    restart_ms: (start_ms + end_ms) / 2,
                    corrupt: rng.chance(15),
                },
                10 => Fault::AgentTakeover {
                    agent: rng.index(n_agents),
                    restart_ms: (start_ms + end_ms) / 2,
                    corrupt: rng.chance(15),
                },
                11 => Fault::AgentStoreDown(rng.index(n_agents)),
                _ => Fault::AgentDiskFull(rng.index(n_agents)),
            };
            schedule.push(Scheduled {
                start_ms,
                end_ms,
                fault,
                resolved: Vec::new(),
                active: false,
                restarted: false,
            });
        }
        // Some standby takeovers find the kept state stale: the API server was out of
        // the old leader's reach for a while before it died (its own stream).
        let mut stale = Rng::new(seed ^ 0x57A1_E0FF_CAFE);
        let takeovers: Vec<(u64, usize)> = schedule
            .iter()
            .filter_map(|s| match s.fault {
                Fault::AgentTakeover { agent, .. } => Some((s.start_ms, agent)),
                _ => None,
            })
            .collect();
        for (start_ms, agent) in takeovers {
            if stale.chance(50) {
                schedule.push(Scheduled {
                    start_ms: start_ms.saturating_sub(stale.range(2_000, 10_000)),
                    end_ms: start_ms + 1_000,
                    fault: Fault::AgentStoreDown(agent),
                    resolved: Vec::new(),
                    active: false,
                    restarted: false,
                });
            }
        }
        let policy_change_ms = if rng.chance(60) {
            Some(rng.range(10_000, FAULT_PHASE_MS))
        } else {
            None
        };
        let demand_shift_ms = rng.range(20_000, FAULT_PHASE_MS);
        let mut w = World {
            seed,
            now_ms: 0,
            rng,
            net: Net::new(),
            cp,
            last_epochs: vec![(0, 0); agents.len()],
            inuse_cache: vec![BTreeMap::new(); agents.len()],
            borrowed_cache: vec![BTreeMap::new(); agents.len()],
            lender_waiting: BTreeMap::new(),
            agents,
            oracle: Oracle {
                fed: crate::raft::initial_state(),
                ..Oracle::default()
            },
            policies,
            policy_history: Vec::new(),
            schedule,
            pending_admin: Vec::new(),
            policy_change_ms,
            demand_shift_ms,
            shifted: false,
            upgraded: false,
            borrow_cap_since: None,
            admissions: 0,
            fault_kinds: BTreeMap::new(),
            flaky_disks,
            lend_when_cut_off,
            lend_when_set: false,
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
        self.inuse_cache
            .get(i)
            .and_then(|m| m.get(tenant))
            .copied()
            .unwrap_or(0)
    }

    /// Ground truth of what `tenant`'s pods admitted on borrowed GPUs hold in cluster
    /// `i` (cached per step).
    pub fn true_borrowed(&self, i: usize, tenant: &str) -> u64 {
        self.borrowed_cache
            .get(i)
            .and_then(|m| m.get(tenant))
            .copied()
            .unwrap_or(0)
    }

    /// Ground truth in-use of `tenant` in cluster `i` within budgets: borrowed pods
    /// left out (they stand outside the partition-safety inequality).
    pub fn true_within_budgets(&self, i: usize, tenant: &str) -> u64 {
        self.true_inuse(i, tenant).saturating_sub(self.true_borrowed(i, tenant))
    }

    fn refresh_inuse(&mut self, i: usize) {
        let (mut m, mut b) = (BTreeMap::new(), BTreeMap::new());
        if let Some(a) = self.agents.get(i) {
            for p in a.sim.list_pods() {
                if let (Some(t), true) = (p.tenant, p.phase != kvota_member_agent::sim::PodPhase::Gated) {
                    if a.borrowed_pods.contains(p.key.as_str()) {
                        *b.entry(t.clone()).or_insert(0) += p.gpue;
                    }
                    *m.entry(t).or_insert(0) += p.gpue;
                }
            }
        }
        if let Some(c) = self.inuse_cache.get_mut(i) {
            *c = m;
        }
        if let Some(c) = self.borrowed_cache.get_mut(i) {
            *c = b;
        }
    }

    /// The largest maxShare `tenant` had under any policy in force during the last
    /// lease duration plus 5 s.
    /// Whether maxShare bounds a tenant's pods federation-wide, borrowed ones included,
    /// now: the committed state has kept lending within maxShare (level 7) for longer
    /// than a lease lives plus 5 s, so no lease cut before it is still in force
    /// (docs/guarantees.md G14 (b): below level 7 borrowing may pass maxShare).
    pub fn max_share_binds_borrowing(&self) -> bool {
        self.borrow_cap_since
            .is_some_and(|at| at + self.lease_window_ms() <= self.now_ms)
    }

    /// A lease's life plus 5 s: how long a lease cut under an older rule may still be
    /// in force.
    fn lease_window_ms(&self) -> u64 {
        self.oracle.fed.policy().map_or(30_000, |p| p.lease.duration_ms) + 5_000
    }

    pub fn recent_max_share_bp(&self, tenant: &str) -> u32 {
        let window = self.lease_window_ms();
        let mut best = self
            .oracle
            .fed
            .policy()
            .and_then(|p| p.tenant(tenant))
            .map_or(0, |t| t.max_share_bp);
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
            let Some(s) = self.schedule.get(k).cloned() else {
                continue;
            };
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
                            a.set_disk_full(true);
                        }
                    }
                    Fault::CpSlowDisk(i, ms) => {
                        if let Some(r) = self.cp.replicas.get_mut(*i) {
                            r.disk_delay_ms = *ms;
                        }
                    }
                    Fault::AgentSlowDisk(i, ms) => {
                        if let Some(a) = self.agents.get_mut(*i) {
                            a.set_disk_delay(*ms);
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
                if let Fault::AgentRestartCut { agent, restart_ms, .. }
                | Fault::AgentTakeover { agent, restart_ms, .. } = &s.fault
                {
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
                            a.set_disk_full(false);
                        }
                    }
                    Fault::CpSlowDisk(i, _) => {
                        if let Some(r) = self.cp.replicas.get_mut(*i) {
                            r.disk_delay_ms = 0;
                        }
                    }
                    Fault::AgentSlowDisk(i, _) => {
                        if let Some(a) = self.agents.get_mut(*i) {
                            a.set_disk_delay(0);
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
            let now = self.now_ms;
            match (to, msg) {
                (Addr::Cp(k), Msg::Request(req)) => self.cp.deliver(k, req, now, &mut self.net),
                (Addr::Cp(k), Msg::Describe { agent, sent_agent_ms }) => {
                    self.cp.describe(k, agent, sent_agent_ms, now, &mut self.net)
                }
                (Addr::Agent(i), Msg::Answer(ans)) => {
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
        let newly = self.cp.step(self.now_ms, &mut self.net).map_err(|detail| Violation {
            invariant: "harness",
            at_ms: self.now_ms,
            detail,
        })?;
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
            invariants::lending::check_admissions(self, i, &admitted)?;
            invariants::lending::check_reclaim(self, i)?;
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
        if self.borrow_cap_since.is_none() && self.oracle.fed.caps_borrowing() {
            self.borrow_cap_since = Some(self.now_ms);
        }
        if self.cp.upgrade_at_ms > 0 && !self.upgraded && self.oracle.level >= self.cp.target_level {
            self.upgraded = true;
            *self.fault_kinds.entry("upgrade").or_insert(0) += 1;
        }
        self.flaky_disks_now();
        if self.lend_when_cut_off && !self.lend_when_set && self.oracle.level >= FeatureLevel::LEND_WHEN {
            // The operator sets `lendWhen: cutOff` once the group runs at its level (the
            // control plane refuses it below).
            self.lend_when_set = true;
            *self.fault_kinds.entry("lend-when-cut-off").or_insert(0) += 1;
            let current = if self.policy_change_ms.is_none() {
                &self.policies.1
            } else {
                &self.policies.0
            };
            let p = self.with_lend_when(current);
            self.pending_admin.push(Command::ApplyPolicy(p));
        }
        if self.policy_change_ms.is_some_and(|t| self.now_ms >= t) {
            self.policy_change_ms = None;
            *self.fault_kinds.entry("policy-change").or_insert(0) += 1;
            let p = self.with_lend_when(&self.policies.1);
            self.pending_admin.push(Command::ApplyPolicy(p));
        }
        self.deliver();
        self.control_plane()?;
        self.agents_step(arrivals)?;
        self.check_continuous()
    }

    /// `p` with the seed's `lendWhen`, once the operator has set it.
    fn with_lend_when(&self, p: &Policy) -> Policy {
        let mut p = p.clone();
        if self.lend_when_set {
            p.reclaim.lend_when = kvota_fairness::policy::LendWhen::CutOff;
        }
        p
    }

    /// Agents' journal disks that fail some writes now.
    fn flaky_disks_now(&mut self) {
        let now = self.now_ms;
        for &(i, from, to, per_mille) in &self.flaky_disks {
            if let Some(a) = self.agents.get_mut(i) {
                if now == from + STEP_MS - (from % STEP_MS) {
                    *self.fault_kinds.entry("agent-disk-flaky").or_insert(0) += 1;
                }
                a.set_disk_flaky(if (from..to).contains(&now) { per_mille } else { 0 });
            }
        }
    }

    fn check_continuous(&mut self) -> Result<(), Violation> {
        invariants::partition_safety::check(self)?;
        let mut waiting = std::mem::take(&mut self.lender_waiting);
        let r = invariants::lending::check_taken_back(self, &mut waiting);
        self.lender_waiting = waiting;
        r?;
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
            a.set_disk_delay(0);
            a.set_disk_full(false);
            a.set_disk_flaky(0);
            a.restart(now);
            a.store_down = false;
        }
    }

    /// Settling with time standing still: each agent reports, and messages flow with no
    /// delay until nothing is in flight.
    pub fn settle(&mut self) -> Result<(), Violation> {
        self.net.conditions = Conditions {
            loss_pct: 0,
            min_delay_ms: 0,
            max_delay_ms: 0,
        };
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
            backlog_refusals: self.agents.iter().map(|a| a.happened.backlog_refusals).sum(),
            borrowed_admissions: self.agents.iter().map(|a| a.happened.borrowed_admissions).sum(),
            borrowed_reclaimed: self.agents.iter().map(|a| a.happened.borrowed_reclaimed).sum(),
            torn_writes: self.agents.iter().map(|a| a.disk_counts().1).sum(),
            refused_writes: self.agents.iter().map(|a| a.disk_counts().0).sum(),
            feature_level: self.oracle.level.get(),
            lend_when_cut_off: self.lend_when_set,
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

fn random_load(rng: &mut Rng, tenant: &str) -> Load {
    match tenant {
        "inference" => Load {
            per_mille: rng.range(10, 60),
            max_gpus: 2,
            run_ms: (15_000, 90_000),
            priority: 100,
        },
        "training" => Load {
            per_mille: rng.range(10, 70),
            max_gpus: 4,
            run_ms: (20_000, 120_000),
            priority: 0,
        },
        _ => Load {
            per_mille: rng.range(5, 50),
            max_gpus: 2,
            run_ms: (5_000, 40_000),
            priority: 0,
        },
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
    let bug = if bugs == Bugs::default() {
        String::new()
    } else {
        format!(" --bug {}", bugs.name())
    };
    format!("cargo run -p kvota-chaos-tests --bin chaos-sim -- --seed {seed}{bug}")
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "chaos seed {} FAILED: {}\n  replay: {}",
            self.seed,
            self.violation,
            self.replay_command()
        )
    }
}

/// Runs one seed: faults for [`FAULT_PHASE_MS`], heal, drain for a lease duration plus
/// margin plus 5 s, settle, final checks.
///
/// A panic anywhere in the run (production code included) is a failure of this seed
/// like any other, reported with its replay command.
pub fn run(seed: u64, bugs: Bugs) -> Result<Summary, Failure> {
    // The core's and the apply path's bugs are switched per thread (one world per
    // thread), and off again whatever happens.
    kvota_fairness::faults::set(bugs.core_faults());
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run_inner(seed, bugs)));
    kvota_fairness::faults::set(kvota_fairness::faults::Faults::default());
    let result = match result {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".to_string());
            // The state machine's own check, asserted after every applied command in
            // debug builds (`entry::apply`), is this invariant's; any other panic is one.
            let invariant = if what.contains("partition-safety check failed") {
                "partition_safety"
            } else {
                "no-panic"
            };
            Err(Violation {
                invariant,
                at_ms: 0,
                detail: what,
            })
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
    let lease = w
        .oracle
        .fed
        .policy()
        .map_or(30_000, |p| p.lease.duration_ms + p.lease.clock_skew_margin_ms);
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
