//! A member cluster and its agent.
//!
//! **Real**: the report round ([`Reporter`], the state machine `Agent` drives:
//! journal before send, leases written before they are enforced, acknowledgements,
//! gaps, refused writes, takeovers, re-registration, the backoff), the usage journal's
//! logic ([`Journal`]: framing, checksums, torn tails, the backlog limit, compaction,
//! renumbering) over a simulated disk ([`SimDisk`]), [`AgentState`] (admission state,
//! lease via [`kvota_fairness::lease::AgentLease`], usage meter, lending), and
//! [`SimCluster`] (nodes, first-fit binding, pods submitted as AdmissionReviews through
//! the webhook's `review`, the gate queue, reclaim through the Eviction API).
//!
//! **The environment** (this file): the disk, the network, the clocks and the cluster's
//! workload; how the effects of the report round are carried out in simulated time (a
//! journal write's outcome arrives once the disk made it durable, a call's when its
//! answer arrives or it times out); what the agent process keeps in the cluster
//! ([`Kept`], the ConfigMap of `member-agent/src/persist.rs`), restarts and standby
//! takeovers. The agent's clock runs at `1 + rate_ppm/10^6` of real time and, unlike
//! the real agent's `Instant`, continues across restarts. The policy rides on every
//! answer (the real agent fetches it with `GetPolicy`).
//!
//! Ground truth for the checker is kept beside it: GPUe-ms the cluster's running pods
//! produced, and which part of it the agent could not meter (it was down, or a crash
//! lost its meter or reports the disk had not made durable), and which pods were
//! admitted on borrowed GPUs.

use std::collections::{BTreeMap, BTreeSet};

use kvota_fairness::federation::{Command, UsageReport};
use kvota_fairness::lease::{AgentLease, Lease};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::{Policy, TENANT_LABEL};
use kvota_fairness::{MilliGpue, Millis};
use kvota_member_agent::journal::{Journal, JournalError, MemDisk, Options};
use kvota_member_agent::review::{AdmissionState, Effect as Recorded};
use kvota_member_agent::round::{
    self, Answer, CallError, ClusterInfo, Effect, Faults, Input, JournalFault, Reporter, RoundError, Taken,
};
use kvota_member_agent::sim::{PodPhase, SimCluster, SimPod};
use kvota_member_agent::state::{AgentState, PodRec};

use crate::disk::SimDisk;
use crate::msg::{AgentAnswer, AgentRequest, AnswerOutcome, Msg};
use crate::net::{Addr, Net};
use crate::rng::Rng;

/// Reports are written this often (agent clock), while they get through.
pub const REPORT_MS: Millis = 1_000;
/// A request without an answer after this long is given up (the client's deadline).
pub const REQUEST_TIMEOUT_MS: Millis = 4_000;
/// Pods denied and waiting for their owner's retry, at most, per agent.
const MAX_RETRIES: usize = 40;
/// How far an agent host's wall clock is from real time at most (NTP).
pub const WALL_SKEW_MS: u64 = 200;

/// One tenant's arrivals at one cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// Chance of an arrival per 100 ms step, per mille.
    pub per_mille: u64,
    /// GPUs per pod, at most.
    pub max_gpus: u64,
    /// Run time range (ms).
    pub run_ms: (u64, u64),
    /// Pod priority.
    pub priority: i32,
}

/// An admission that happened in a step (for the admission and lending invariants).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admitted {
    /// Tenant.
    pub tenant: TenantName,
    /// Pod key.
    pub pod: String,
    /// GPUe.
    pub gpue: MilliGpue,
    /// The agent's in-use of the tenant right after.
    pub inuse_after: MilliGpue,
    /// Budget the agent enforced at that instant.
    pub budget: MilliGpue,
    /// The lease's borrow limit for the tenant then (0: none).
    pub borrow_limit: MilliGpue,
    /// Admitted on borrowed GPUs.
    pub borrowed: bool,
    /// GPUe the agent could lend at that instant, before the admission.
    pub lendable_before: MilliGpue,
    /// The tenant may be preempted (the policy in force).
    pub preemptible: bool,
    /// The policy lent at the lease's standing then (`lendWhen`).
    pub lends_then: bool,
    /// The agent's lease epoch then.
    pub epoch: u64,
}

/// What the leader keeps in its cluster for the next process (a ConfigMap in the real
/// agent, written after each report round).
#[derive(Clone, Debug)]
pub struct Kept {
    policy: Option<Policy>,
    lease: Option<Lease>,
    /// Until when the lease may be enforced, on the agent clock (which continues across
    /// processes here; the real agent goes through the wall clock).
    usable_until: Millis,
    acked: (u64, u64),
}

impl Kept {
    /// The kept lease's epoch.
    pub fn lease_epoch(&self) -> Option<u64> {
        self.lease.as_ref().map(|l| l.epoch)
    }
}

/// Which program of the report protocol runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Program {
    Register,
    Round,
    Restore,
}

/// What the running program waits for.
#[derive(Clone, Debug)]
enum Waiting {
    /// A journal call's outcome, until the disk has made it durable.
    Disk { input: Box<Input>, at_ms: Millis },
    /// A call on the network, sent at `sent_ms` (agent clock) to node `node`, tried on
    /// `tries` nodes so far.
    Call { sent_ms: Millis, tries: usize, call: Call },
}

#[derive(Clone, Debug)]
enum Call {
    Report(Box<UsageReport>),
    Register,
    Describe,
}

/// What the agent's last reclaim step did, for the lending invariant: the node it made
/// room on, for whom, its victims (and whether each was borrowed), and the borrowed pods
/// on that node that could have gone instead but stayed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReclaimSeen {
    /// The node.
    pub node: usize,
    /// The tenant room was made for.
    pub for_tenant: TenantName,
    /// The victims, whether the agent admitted each on borrowed GPUs, and whether
    /// evicting it took its tenant below its budget here.
    pub victims: Vec<(String, bool, bool)>,
    /// Borrowed pods there that were candidates and stayed.
    pub spared: Vec<String>,
}

/// Counts the fixed seed set requires to have happened.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Happened {
    /// Pods admitted on borrowed GPUs.
    pub borrowed_admissions: u64,
    /// Borrowed pods evicted by reclaim.
    pub borrowed_reclaimed: u64,
    /// Reports the journal refused at its backlog limit.
    pub backlog_refusals: u64,
    /// Crashes that left a torn journal write behind, on disks no longer used.
    pub torn_writes: u64,
    /// Journal writes the disk refused (full or failing), on disks no longer used.
    pub refused_writes: u64,
}

/// A member cluster, its agent, and the ground truth about both.
#[derive(Debug)]
pub struct SimAgent {
    /// Index on the network.
    pub index: usize,
    /// Cluster id.
    pub id: ClusterName,
    /// Agent process running.
    pub up: bool,
    /// The agent's admission state (replaced on restart).
    pub state: AgentState,
    /// The cluster.
    pub sim: SimCluster,
    capacity_gpue: MilliGpue,
    /// Clock rate error, parts per million.
    pub rate_ppm: i64,
    offset_ms: u64,
    /// The report protocol (replaced on restart).
    reporter: Reporter,
    /// The journal on `disk` (`None` while down).
    journal: Option<Journal>,
    disk: SimDisk,
    program: Option<Program>,
    waiting: Option<Waiting>,
    /// The webhook serves (after a restart, once the kept state is restored).
    serving: bool,
    policy: Option<Policy>,
    registered: bool,
    guess: usize,
    cp_nodes: usize,
    next_report_ms: Millis,
    failures: u32,
    /// Ground truth: GPUe-ms produced by running pods, per tenant.
    pub produced: BTreeMap<TenantName, u64>,
    /// Produced but never metered into a report that survived (agent down, crash).
    pub unmetered: BTreeMap<TenantName, u64>,
    /// Metered into journal reports that survived.
    pub metered: BTreeMap<TenantName, u64>,
    /// Ground truth: pods admitted on borrowed GPUs that still exist.
    pub borrowed_pods: BTreeSet<String>,
    /// The lease epoch a journal reopened now would hold (what a restart starts from).
    pub disk_epoch: u64,
    last_host_ms: Millis,
    /// Arrivals per tenant.
    pub load: BTreeMap<TenantName, Load>,
    retry: Vec<(Millis, SimPod)>,
    pods: u64,
    rng: Rng,
    /// Fault switches of the report round (real code, `fault-injection`).
    pub faults: Faults,
    /// Crashes so far.
    pub crashes: u64,
    next_reclaim_ms: Millis,
    /// The state kept in the cluster (see [`Kept`]).
    pub kept: Option<Kept>,
    /// Writes of the kept state fail (the API server is unreachable from the agent).
    pub store_down: bool,
    /// The kept state is unreadable at the next restart.
    pub kept_corrupt: bool,
    /// Unacknowledged reports the journal holds at most (its real limit, set low by
    /// the world for a third of the agents so a partition of seconds reaches it).
    pub max_backlog: usize,
    /// What happened that the fixed set counts.
    pub happened: Happened,
    /// Reports the old process's journal held that a standby taking over never had.
    pub lost: Vec<UsageReport>,
    /// Standby takeovers so far.
    pub takeovers: u64,
    /// Down, and a standby (not this process) starts next.
    pub standby_next: bool,
    /// Restores that did not enforce a still-valid kept lease (the takeover invariant).
    pub restore_violations: Vec<String>,
    /// The kept lease being restored and until when it may be enforced (checked once
    /// the restore ends).
    restoring: Option<(Lease, Millis)>,
    /// What the last reclaim step evicted (this step's, or `None`).
    pub last_reclaim: Option<ReclaimSeen>,
}

fn fault(e: &JournalError) -> JournalFault {
    JournalFault(e.to_string())
}

impl SimAgent {
    /// A cluster with `node_gpus` whole-GPU nodes, clock `rate_ppm`, talking to
    /// `cp_nodes` control-plane nodes.
    pub fn new(
        index: usize,
        node_gpus: &[u32],
        rate_ppm: i64,
        offset_ms: u64,
        cp_nodes: usize,
        mut rng: Rng,
    ) -> SimAgent {
        let id = ClusterName::parse(format!("c{index}")).expect("c0, c1, ... are cluster names");
        let sim = SimCluster::new(node_gpus);
        let capacity_gpue: MilliGpue = node_gpus.iter().map(|&g| u64::from(g) * 1_000).sum();
        let disk = SimDisk::new(rng.fork());
        let mut a = SimAgent {
            index,
            state: AgentState::new(id.clone(), capacity_gpue, AgentLease::new(id.clone())),
            reporter: Reporter::new(id.clone(), AgentLease::new(id.clone()), 0),
            id,
            up: false,
            sim,
            capacity_gpue,
            rate_ppm,
            offset_ms,
            journal: None,
            disk,
            program: None,
            waiting: None,
            serving: false,
            policy: None,
            registered: false,
            guess: index % cp_nodes.max(1),
            cp_nodes: cp_nodes.max(1),
            next_report_ms: 0,
            failures: 0,
            produced: BTreeMap::new(),
            unmetered: BTreeMap::new(),
            metered: BTreeMap::new(),
            borrowed_pods: BTreeSet::new(),
            disk_epoch: 0,
            last_host_ms: offset_ms,
            load: BTreeMap::new(),
            retry: Vec::new(),
            pods: 0,
            rng,
            faults: Faults::default(),
            crashes: 0,
            next_reclaim_ms: 0,
            kept: None,
            store_down: false,
            kept_corrupt: false,
            max_backlog: kvota_member_agent::journal::MAX_BACKLOG,
            happened: Happened::default(),
            lost: Vec::new(),
            takeovers: 0,
            standby_next: false,
            restore_violations: Vec::new(),
            restoring: None,
            last_reclaim: None,
        };
        a.start(0);
        a
    }

    /// Capacity in GPUe.
    pub fn capacity_gpue(&self) -> MilliGpue {
        self.capacity_gpue
    }

    /// The host's wall clock at real time `real_ms`: NTP keeps it within
    /// [`WALL_SKEW_MS`] of real time (the control plane's clocks are as close), unlike
    /// the monotonic clock of [`SimAgent::clock`], whose origin is arbitrary. Report
    /// windows are on this clock, as the real agent's.
    pub fn wall(&self, real_ms: u64) -> u64 {
        real_ms + self.offset_ms % WALL_SKEW_MS
    }

    /// The agent host's clock at real time `real_ms`.
    pub fn clock(&self, real_ms: u64) -> Millis {
        let drift = i128::from(real_ms) * i128::from(self.rate_ppm) / 1_000_000;
        u64::try_from(i128::from(self.offset_ms) + i128::from(real_ms) + drift).unwrap_or(0)
    }

    /// Reports written and not yet acknowledged.
    pub fn backlog(&self) -> usize {
        self.journal.as_ref().map_or(0, Journal::backlog)
    }

    /// Next sequence number the journal will assign.
    pub fn next_seq(&self) -> u64 {
        self.journal.as_ref().map_or(0, Journal::last_seq) + 1
    }

    /// The journal's disk is full (`true`): every write fails.
    pub fn set_disk_full(&mut self, full: bool) {
        self.disk.set_full(full);
    }

    /// The journal's disk makes writes durable this much later.
    pub fn set_disk_delay(&mut self, delay_ms: Millis) {
        self.disk.set_delay(delay_ms);
    }

    /// This per mille of the journal disk's writes and syncs fail.
    pub fn set_disk_flaky(&mut self, per_mille: u64) {
        self.disk.set_flaky(per_mille);
    }

    /// Ground truth: GPUe the tenant holds here (running plus admitted-unbound pods).
    pub fn true_inuse(&self, tenant: &str) -> MilliGpue {
        self.sim
            .list_pods()
            .iter()
            .filter(|p| p.tenant.as_deref() == Some(tenant) && p.phase != PodPhase::Gated)
            .map(|p| p.gpue)
            .sum()
    }

    /// Ground truth: the budget the agent enforces now (0 while it does not serve:
    /// nothing is admitted without a webhook).
    pub fn true_budget(&self, tenant: &str, real_ms: u64) -> MilliGpue {
        if self.up && self.serving {
            self.state.lease.budget(tenant, self.clock(real_ms))
        } else {
            0
        }
    }

    fn install_policy(&mut self, p: Policy) {
        if self.policy.as_ref() == Some(&p) {
            return;
        }
        for t in &p.tenants {
            self.state
                .set_namespace(&t.name, [(TENANT_LABEL.to_string(), t.name.to_string())].into());
        }
        self.state.set_policy(p.clone());
        self.policy = Some(p);
    }

    /// One step at real time `real_ms`: meter, finish/release/bind, arrivals, reclaim,
    /// the report protocol. Returns the admissions it made.
    pub fn step(&mut self, real_ms: u64, net: &mut Net<Msg>, arrivals: bool) -> Vec<Admitted> {
        let h = self.clock(real_ms);
        self.advance_truth(h);
        self.disk.set_now(h);
        let mut admitted = Vec::new();
        if !self.up {
            // Kubernetes goes on without the agent: pods finish, admitted pods bind.
            let mut scratch = AgentState::new(self.id.clone(), self.capacity_gpue, AgentLease::new(self.id.clone()));
            self.sim.finish(&mut scratch, h);
            self.sim.bind(&mut scratch, h);
            self.forget_gone_pods();
            if arrivals {
                self.arrivals(h, None);
            }
            return admitted;
        }
        self.state.set_now(h);
        self.poll(h, net, real_ms);
        if !self.up {
            return admitted;
        }
        self.sim.finish(&mut self.state, h);
        for key in self.sim.release(&mut self.state) {
            // Each tenant's pods run in the namespace of its name.
            let tenant =
                TenantName::parse(key.as_str().split('/').next().unwrap_or_default()).expect("a tenant's namespace");
            let gpue = self.state.reservations().iter().find(|r| r.0 == key).map_or(0, |r| r.2);
            let ad = self.admitted(&tenant, key.as_str(), gpue, h, None);
            admitted.push(ad);
        }
        self.sim.bind(&mut self.state, h);
        // The controller's inventory sync (`inventory::sync_state`) reads which pods are
        // borrowed again once after a start or takeover; the ground truth follows what
        // the agent decides.
        self.state.reclassify_once();
        self.borrowed_pods
            .extend(self.state.borrowed_keys().map(|k| k.to_string()));
        for pod in self.sim.take_evicted() {
            self.retry.push((h, pod));
        }
        self.forget_gone_pods();
        if arrivals && self.serving {
            self.arrivals(h, Some(&mut admitted));
        } else if arrivals {
            self.arrivals(h, None);
        }
        self.last_reclaim = None;
        if self.serving && h >= self.next_reclaim_ms {
            self.next_reclaim_ms = h + 2_000;
            self.reclaim(h);
        }
        if self.serving && self.program.is_none() && h >= self.next_report_ms {
            self.begin(h, net, real_ms);
        }
        admitted
    }

    /// Pods no longer in the cluster are no longer borrowed.
    fn forget_gone_pods(&mut self) {
        if self.borrowed_pods.is_empty() {
            return;
        }
        let listed: BTreeSet<String> = self.sim.list_pods().into_iter().map(|p| p.key.to_string()).collect();
        self.borrowed_pods.retain(|k| listed.contains(k));
    }

    /// Integrates the ground truth up to `h`: what the running pods produced, and
    /// whether the agent was there to meter it.
    fn advance_truth(&mut self, h: Millis) {
        let dt = h.saturating_sub(self.last_host_ms);
        self.last_host_ms = self.last_host_ms.max(h);
        if dt == 0 {
            return;
        }
        for (t, g) in self.sim.running_by_tenant() {
            *self.produced.entry(t.clone()).or_default() += g * dt;
            if !self.up {
                *self.unmetered.entry(t).or_default() += g * dt;
            }
        }
    }

    /// What the admission of `pod` looked like, right after it (`lendable_before`: what
    /// the agent could lend just before, for a webhook admission).
    fn admitted(
        &mut self,
        tenant: &TenantName,
        pod: &str,
        gpue: MilliGpue,
        h: Millis,
        lendable_before: Option<MilliGpue>,
    ) -> Admitted {
        let borrowed = self.state.is_borrowed(pod);
        if borrowed {
            self.borrowed_pods.insert(pod.to_string());
            self.happened.borrowed_admissions += 1;
        }
        Admitted {
            tenant: tenant.clone(),
            pod: pod.to_string(),
            gpue,
            inuse_after: self.state.inuse(tenant),
            budget: self.state.lease.budget(tenant, h),
            borrow_limit: self.state.lease.lease().map_or(0, |l| l.borrow(tenant)),
            borrowed,
            lendable_before: lendable_before.unwrap_or(MilliGpue::MAX),
            preemptible: self
                .policy
                .as_ref()
                .and_then(|p| p.tenant(tenant))
                .is_some_and(|t| t.preemptible),
            lends_then: self.state.lends_now(),
            epoch: self.state.lease.held_epoch(),
        }
    }

    fn arrivals(&mut self, h: Millis, mut admitted: Option<&mut Vec<Admitted>>) {
        let mut todo: Vec<SimPod> = Vec::new();
        let due: Vec<SimPod> = {
            let (now, later): (Vec<_>, Vec<_>) = self.retry.drain(..).partition(|(at, _)| *at <= h);
            self.retry = later;
            now.into_iter().map(|(_, p)| p).collect()
        };
        todo.extend(due);
        let loads: Vec<(TenantName, Load)> = self.load.iter().map(|(t, l)| (t.clone(), *l)).collect();
        for (t, l) in loads {
            if self.rng.chance_per_mille(l.per_mille) {
                self.pods += 1;
                let gpus = u32::try_from(self.rng.range(1, l.max_gpus)).unwrap_or(1);
                let run = self.rng.range(l.run_ms.0, l.run_ms.1);
                todo.push(SimPod::gpus(
                    &t,
                    &format!("p{}-{}", self.index, self.pods),
                    gpus,
                    run,
                    l.priority,
                ));
            }
        }
        for mut pod in todo {
            if admitted.is_none() {
                // The webhook is down (failurePolicy: Fail): the owner retries later.
                if self.retry.len() < MAX_RETRIES {
                    self.retry.push((h + 3_000, pod));
                }
                continue;
            }
            // Owners recreate pods under new names, as controllers do.
            self.pods += 1;
            pod.name = format!("p{}-{}", self.index, self.pods);
            let lendable = self.state.lendable();
            match self.sim.submit(&mut self.state, &pod) {
                kvota_member_agent::review::Outcome::Allowed => {
                    let gpue = u64::from(pod.count) * 1_000;
                    let tenant = TenantName::parse(pod.namespace.as_str()).expect("a tenant's namespace");
                    let ad = self.admitted(&tenant, &pod.key(), gpue, h, Some(lendable));
                    if let Some(list) = admitted.as_deref_mut() {
                        list.push(ad);
                    }
                }
                kvota_member_agent::review::Outcome::Denied
                    if self.retry.len() < MAX_RETRIES && self.rng.chance(70) =>
                {
                    let at = h + self.rng.range(2_000, 6_000);
                    self.retry.push((at, pod));
                }
                _ => {}
            }
        }
    }

    /// Keeps the enforcement state in the cluster (after each report round), as
    /// `Agent::persist` does; the kept epoch then bounds what reports acknowledge.
    fn persist(&mut self) {
        if self.store_down {
            return;
        }
        let lease = self.state.lease.lease().cloned();
        let epoch = lease.as_ref().map_or(0, |l| l.epoch);
        self.kept = Some(Kept {
            policy: self.policy.clone(),
            usable_until: self.state.lease.valid_until().unwrap_or(0),
            lease,
            acked: self.reporter.acked(),
        });
        self.reporter.kept(epoch);
    }

    /// Starts the next program: registration while unregistered, else a report round.
    fn begin(&mut self, h: Millis, net: &mut Net<Msg>, real_ms: u64) {
        let first = if self.registered {
            self.program = Some(Program::Round);
            // The agent without history of pods' run times is always ready to settle.
            self.reporter.begin_round(true)
        } else {
            self.program = Some(Program::Register);
            self.reporter.begin_register()
        };
        self.drive(first, h, net, real_ms);
    }

    /// Carries out effects until one has to wait (for the disk or the network) or the
    /// program finishes.
    fn drive(&mut self, mut effect: Effect, h: Millis, net: &mut Net<Msg>, real_ms: u64) {
        for _ in 0..10_000 {
            let input = match effect {
                Effect::Finish(result) => return self.finished(result, h),
                e => match self.perform(e, h, net, real_ms) {
                    Some(input) => input,
                    None => return,
                },
            };
            effect = self.reporter.resume(input);
        }
    }

    /// One effect: its outcome now, or `None` when it waits (recorded in `waiting`).
    fn perform(&mut self, effect: Effect, h: Millis, net: &mut Net<Msg>, real_ms: u64) -> Option<Input> {
        let Some(journal) = self.journal.clone() else {
            return Some(Input::Done);
        };
        match effect {
            Effect::SaveLease(l) => {
                self.after_disk(Input::LeaseSaved(journal.save_lease(&l).map_err(|e| fault(&e))), h)
            }
            Effect::Enforce(next) => {
                self.state.lease = next;
                Some(Input::Done)
            }
            Effect::Renumber { first, counted } => {
                let keep = |r: &UsageReport| {
                    counted.is_none_or(|c| !round::already_counted(r, c.last_seq, c.reported_through_ms))
                };
                let r = journal.renumber_keeping(first, keep).map_err(|e| fault(&e));
                self.after_disk(Input::Renumbered(r), h)
            }
            Effect::RebaseMeter { .. } => {
                // No standby readings and no pods' run times here: the meter starts when
                // this process started (what ran before is unmetered in the ground truth).
                Some(Input::MeterRebased {
                    window_start_ms: self.reporter.window_start_ms(),
                })
            }
            Effect::TakeUsage { evictions, decisions } => Some(Input::Taken(Taken {
                wall_ms: self.wall(real_ms),
                tenants: self.state.take_usage(),
                evictions: self.state.take_eviction_notes(evictions),
                decisions: self.state.take_decision_notes(decisions),
                capacity: None,
            })),
            Effect::WriteReport(report) => {
                let written = journal.write(|seq| UsageReport { seq, ..report });
                match &written {
                    Ok(r) => {
                        for (t, tr) in &r.tenants {
                            *self.metered.entry(t.clone()).or_default() += tr.used_milli_gpue_ms;
                        }
                    }
                    Err(JournalError::Full { .. }) => self.happened.backlog_refusals += 1,
                    Err(_) => {}
                }
                self.after_disk(Input::Written(written.map_err(|e| fault(&e))), h)
            }
            Effect::GiveBack { usage, .. } => {
                self.state.add_usage(&usage);
                Some(Input::Done)
            }
            Effect::ReadUnacked(limit) => Some(Input::Unacked(journal.unacked(limit).map_err(|e| fault(&e)))),
            Effect::AckThrough(seq) => Some(Input::Acked(journal.ack_through(seq).map_err(|e| fault(&e)))),
            Effect::Send(report) => self.call(Call::Report(Box::new(report)), 0, h, net, real_ms),
            Effect::Register => self.call(Call::Register, 0, h, net, real_ms),
            Effect::Describe => self.call(Call::Describe, 0, h, net, real_ms),
            Effect::Finish(_) => Some(Input::Done),
        }
    }

    /// A journal call's outcome: now if the disk has it durable, else once it has.
    fn after_disk(&mut self, input: Input, h: Millis) -> Option<Input> {
        let at_ms = self.disk.durable_at();
        if at_ms <= h {
            return Some(input);
        }
        self.waiting = Some(Waiting::Disk {
            input: Box::new(input),
            at_ms,
        });
        None
    }

    /// Sends a call to the node it guesses leads; waits for the answer.
    fn call(&mut self, call: Call, tries: usize, h: Millis, net: &mut Net<Msg>, real_ms: u64) -> Option<Input> {
        let msg = match &call {
            Call::Report(r) => Msg::Request(AgentRequest {
                agent: self.index,
                sent_agent_ms: h,
                command: Command::Report((**r).clone()),
                forwarded: false,
            }),
            Call::Register => Msg::Request(AgentRequest {
                agent: self.index,
                sent_agent_ms: h,
                command: Command::RegisterCluster {
                    cluster: self.id.clone(),
                    capacity: self.sim.capacity_milli(),
                    labels: BTreeMap::new(),
                },
                forwarded: false,
            }),
            Call::Describe => Msg::Describe {
                agent: self.index,
                sent_agent_ms: h,
            },
        };
        net.send(
            &mut self.rng,
            real_ms,
            Addr::Agent(self.index),
            Addr::Cp(self.guess),
            msg,
        );
        self.waiting = Some(Waiting::Call {
            sent_ms: h,
            tries: tries + 1,
            call,
        });
        None
    }

    /// Delivers what waited, if it is due: a disk's durable outcome, or a call that
    /// timed out (the client tries the next node, then gives up).
    fn poll(&mut self, h: Millis, net: &mut Net<Msg>, real_ms: u64) {
        match self.waiting.take() {
            Some(Waiting::Disk { input, at_ms }) if at_ms <= h => {
                let next = self.reporter.resume(*input);
                self.drive(next, h, net, real_ms);
            }
            Some(Waiting::Call { sent_ms, tries, call }) if h >= sent_ms + REQUEST_TIMEOUT_MS => {
                // The call timed out: try the next node (the client follows leader hints;
                // without one it walks the endpoint list), then give up.
                self.guess = (self.guess + 1) % self.cp_nodes;
                if tries < self.cp_nodes.min(2) {
                    let _ = self.call(call, tries, h, net, real_ms);
                    return;
                }
                let why = CallError::Unreachable("no answer before the deadline".into());
                let input = match call {
                    Call::Report(_) => Input::Answered {
                        sent_ms,
                        answer: Answer::Failed(why),
                    },
                    Call::Register => Input::Registered {
                        sent_ms,
                        result: Err(why),
                    },
                    Call::Describe => Input::Described(Err(why)),
                };
                let next = self.reporter.resume(input);
                self.drive(next, h, net, real_ms);
            }
            other => self.waiting = other,
        }
    }

    /// A program ended: the next round is scheduled with the real backoff, and the
    /// leader keeps its state in the cluster.
    fn finished(&mut self, result: Result<(), RoundError>, h: Millis) {
        let program = self.program.take();
        self.waiting = None;
        match program {
            Some(Program::Register) if result.is_ok() => {
                self.registered = true;
                self.next_report_ms = h;
                return;
            }
            Some(Program::Restore) => {
                self.serving = true;
                self.check_restored(h);
                return;
            }
            _ => {}
        }
        if matches!(result, Err(RoundError::NotRegistered)) {
            self.registered = true;
        }
        self.failures = round::failures_after(&result, self.failures);
        let jitter = self.rng.range(0, 250);
        let report_ms = REPORT_MS;
        self.next_report_ms = h + round::next_round_in_ms(report_ms, self.failures, jitter);
        if program == Some(Program::Round) {
            self.persist();
        }
    }

    /// An answer arrives (ignored while down, or if it does not answer the call that
    /// waits: the real client gave up on that call).
    pub fn on_answer(&mut self, ans: AgentAnswer, real_ms: u64, net: &mut Net<Msg>) {
        if !self.up {
            return;
        }
        let Some(Waiting::Call { sent_ms, call, .. }) = self.waiting.clone() else {
            return;
        };
        if sent_ms != ans.sent_agent_ms {
            return;
        }
        let h = self.clock(real_ms);
        self.state.set_now(h);
        self.disk.set_now(h);
        self.waiting = None;
        self.guess = ans.from_node;
        let input = match (call, ans.outcome) {
            (
                call,
                AnswerOutcome::Lease {
                    lease, policy, applied, ..
                },
            ) => {
                if let Some(p) = policy {
                    self.install_policy(*p);
                }
                match call {
                    Call::Register => Input::Registered {
                        sent_ms,
                        result: Ok(lease),
                    },
                    _ => Input::Answered {
                        sent_ms,
                        answer: Answer::Lease { applied, lease },
                    },
                }
            }
            (_, AnswerOutcome::SequenceGap { expected, .. }) => Input::Answered {
                sent_ms,
                answer: Answer::Gap {
                    expected: Some(expected),
                },
            },
            (
                _,
                AnswerOutcome::Described {
                    last_seq,
                    reported_through_ms,
                },
            ) => Input::Described(Ok(ClusterInfo {
                last_seq,
                reported_through_ms,
            })),
            (Call::Register, AnswerOutcome::Refused(why)) => Input::Registered {
                sent_ms,
                result: Err(CallError::Refused(why)),
            },
            (Call::Describe, AnswerOutcome::Refused(why)) => Input::Described(Err(CallError::Refused(why))),
            (Call::Report(_), AnswerOutcome::Refused(why)) if why.contains("is not registered") => Input::Answered {
                sent_ms,
                answer: Answer::NotRegistered,
            },
            (Call::Report(_), AnswerOutcome::Refused(why)) => Input::Answered {
                sent_ms,
                answer: Answer::Failed(CallError::Refused(why)),
            },
        };
        let next = self.reporter.resume(input);
        self.drive(next, h, net, real_ms);
    }

    /// The agent process dies (its host loses power): memory is gone, the disk keeps
    /// what was durable and maybe a torn part of what was not.
    pub fn crash(&mut self, real_ms: u64) {
        if !self.up {
            return;
        }
        let h = self.clock(real_ms);
        self.advance_truth(h);
        // The meter to the instant of the crash: what it holds then is lost with it.
        self.state.set_now(h);
        self.up = false;
        self.serving = false;
        self.crashes += 1;
        self.program = None;
        self.waiting = None;
        for (t, r) in self.state.take_usage() {
            *self.unmetered.entry(t).or_default() += r.used_milli_gpue_ms;
        }
        let believed = self
            .journal
            .take()
            .and_then(|j| j.unacked(usize::MAX).ok())
            .unwrap_or_default();
        self.disk.crash(h);
        // What a restart will read: the real journal's opening of the crashed bytes.
        let reopened = Journal::open_on(Box::new(MemDisk::with_bytes(self.disk.bytes())), Options::default()).ok();
        let survivors: BTreeSet<(u64, u64)> = reopened
            .as_ref()
            .and_then(|j| j.unacked(usize::MAX).ok())
            .unwrap_or_default()
            .iter()
            .map(window_of)
            .collect();
        self.disk_epoch = reopened.as_ref().and_then(Journal::load_lease).map_or(0, |l| l.epoch);
        for r in believed.iter().filter(|r| !survivors.contains(&window_of(r))) {
            // Written, not yet durable, and gone: its usage was never metered.
            for (t, tr) in &r.tenants {
                *self.unmetered.entry(t.clone()).or_default() += tr.used_milli_gpue_ms;
                if let Some(m) = self.metered.get_mut(t) {
                    *m = m.saturating_sub(tr.used_milli_gpue_ms);
                }
            }
        }
    }

    /// The agent process starts again from its disk and the cluster's inventory, as
    /// `kvota agent` does: the journal opened (a torn tail cut), the state rebuilt from
    /// the pods, the kept state restored before the webhook serves, then registration.
    /// A journal that cannot be opened (a full disk that cannot take a new header)
    /// leaves it down, to try again at the next step.
    pub fn restart(&mut self, real_ms: u64) {
        if self.up {
            return;
        }
        let h = self.clock(real_ms);
        self.advance_truth(h);
        self.disk.set_now(h);
        if !self.start(real_ms) {
            return;
        }
        self.standby_next = false;
        self.restore(h);
    }

    /// Opens the journal and builds the process's state; false if the journal does not
    /// open.
    fn start(&mut self, real_ms: u64) -> bool {
        let h = self.clock(real_ms);
        let options = Options {
            max_backlog: self.max_backlog,
        };
        let journal = match Journal::open_on(Box::new(self.disk.clone()), options) {
            Ok(j) => j,
            Err(_) => return false,
        };
        let lease = match journal.load_lease() {
            Some(l) if l.cluster == self.id => AgentLease::restored(l),
            _ => AgentLease::new(self.id.clone()),
        };
        self.disk_epoch = lease.held_epoch();
        self.journal = Some(journal);
        self.state = AgentState::new(self.id.clone(), self.capacity_gpue, lease.clone());
        // The clock first: nothing is bound yet, so nothing is metered for the downtime.
        self.state.set_now(h);
        if let Some(p) = self.policy.take() {
            self.install_policy(p);
        }
        self.rebuild_from_inventory();
        self.state.reclassify_once();
        self.reporter = Reporter::new(self.id.clone(), lease, self.wall(real_ms));
        self.reporter.set_faults(self.faults);
        self.reporter.keeps_state();
        if self.standby_next {
            self.reporter.took_over();
        } else {
            self.reporter.starts_reporting();
        }
        self.up = true;
        self.serving = true;
        self.registered = false;
        self.program = None;
        self.waiting = None;
        self.failures = 0;
        self.next_report_ms = h;
        true
    }

    fn rebuild_from_inventory(&mut self) {
        for p in self.sim.list_pods() {
            match (p.phase, &p.tenant) {
                (PodPhase::Running, _) => self.state.pod_bound(
                    &p.key,
                    PodRec {
                        tenant: p.tenant.clone(),
                        gpue: p.gpue,
                    },
                ),
                (PodPhase::Unbound, Some(t)) => self.state.record(Recorded::Reserve {
                    tenant: t.clone(),
                    pod: p.key.clone(),
                    gpue: p.gpue,
                }),
                (PodPhase::Gated, Some(t)) => self.state.record(Recorded::Enqueue {
                    tenant: t.clone(),
                    pod: p.key.clone(),
                    gpue: p.gpue,
                    priority: p.priority,
                }),
                _ => {}
            }
        }
    }

    /// Takes what the last leader kept (see [`Kept`]), unless it is unreadable, through
    /// the real restore program; the webhook serves once it ends.
    fn restore(&mut self, h: Millis) {
        if std::mem::take(&mut self.kept_corrupt) {
            return;
        }
        let Some(k) = self.kept.clone() else { return };
        if self.policy.is_none() {
            if let Some(p) = k.policy {
                self.install_policy(p);
            }
        }
        self.reporter.restore_acked(k.acked.0, k.acked.1);
        let Some(l) = k.lease else { return };
        // The kept life, minus the margin again and never more than a fresh request's
        // (`round::restorable_for_ms`), on the agent clock that continues here.
        let left = round::restorable_for_ms(&l, k.usable_until, h);
        let until = (left > 0).then(|| h + left);
        self.serving = false;
        self.program = Some(Program::Restore);
        self.restoring = until.map(|u| (l.clone(), u));
        let first = self.reporter.begin_restore(l, until);
        // No network is involved: the net is not touched by a restore.
        let mut none = Net::new();
        self.drive(first, h, &mut none, 0);
    }
}

impl SimAgent {
    /// Checks, once a restore ended, that a kept lease still valid is enforced at once.
    fn check_restored(&mut self, h: Millis) {
        let Some((l, until)) = self.restoring.take() else {
            return;
        };
        if until <= h || self.state.lease.held_epoch() != l.epoch {
            return;
        }
        for (t, b) in &l.budgets {
            let enforced = self.state.lease.budget(t, h);
            if enforced != b.budget {
                self.restore_violations.push(format!(
                    "{}: restarted with a kept lease (epoch {}) valid for {} ms more, yet enforces {enforced} for {t}, not its budget {}",
                    self.id,
                    l.epoch,
                    until - h,
                    b.budget
                ));
            }
        }
    }

    /// The agent process dies and a standby takes over later ([`SimAgent::restart`]):
    /// the standby has none of this process's disk. Reports the old journal held are
    /// lost to it (whether the control plane applied them is settled at the end).
    pub fn takeover_crash(&mut self, real_ms: u64) {
        if !self.up {
            return;
        }
        self.crash(real_ms);
        self.takeovers += 1;
        self.standby_next = true;
        let old = Journal::open_on(Box::new(MemDisk::with_bytes(self.disk.bytes())), Options::default())
            .ok()
            .and_then(|j| j.unacked(usize::MAX).ok())
            .unwrap_or_default();
        for r in old {
            for (t, tr) in &r.tenants {
                if let Some(m) = self.metered.get_mut(t) {
                    *m = m.saturating_sub(tr.used_milli_gpue_ms);
                }
            }
            self.lost.push(r);
        }
        // The standby's disk is another: the old one's counts are kept.
        let (refused, torn) = self.disk.counts();
        self.happened.refused_writes += refused;
        self.happened.torn_writes += torn;
        self.disk = SimDisk::new(self.rng.fork());
        self.disk_epoch = 0;
        self.policy = None;
    }

    /// Runs a report round now (settling, with time standing still): a call still
    /// waiting is given up as the client would after its deadline.
    pub fn report_now(&mut self, real_ms: u64, net: &mut Net<Msg>) {
        if !self.up || !self.serving {
            return;
        }
        let h = self.clock(real_ms);
        self.state.set_now(h);
        self.disk.set_now(h);
        if let Some(Waiting::Call { sent_ms, call, .. }) = self.waiting.clone() {
            self.waiting = None;
            self.guess = (self.guess + 1) % self.cp_nodes;
            let why = CallError::Unreachable("given up while settling".into());
            let input = match call {
                Call::Report(_) => Input::Answered {
                    sent_ms,
                    answer: Answer::Failed(why),
                },
                Call::Register => Input::Registered {
                    sent_ms,
                    result: Err(why),
                },
                Call::Describe => Input::Described(Err(why)),
            };
            let next = self.reporter.resume(input);
            self.drive(next, h, net, real_ms);
        }
        self.poll(h, net, real_ms);
        if self.program.is_none() {
            self.begin(h, net, real_ms);
        }
    }

    /// Journal writes the disk refused, and crashes that tore a write.
    pub fn disk_counts(&self) -> (u64, u64) {
        let (refused, torn) = self.disk.counts();
        (refused + self.happened.refused_writes, torn + self.happened.torn_writes)
    }

    /// The agent process runs and its webhook serves.
    pub fn serving_now(&self) -> bool {
        self.up && self.serving
    }

    /// One step of the agent's reclaim loop (the real one), noting what it evicted and
    /// which borrowed pods that could have gone instead stayed.
    fn reclaim(&mut self, h: Millis) {
        let Some(cfg) = self.policy.as_ref().map(|p| p.reclaim) else {
            let _ = self.sim.reclaim(&mut self.state, h);
            return;
        };
        let tenants = self.state.reclaim_tenants();
        let excess = |t: &str| {
            tenants
                .iter()
                .find(|x| x.name.as_str() == t && x.preemptible)
                .map_or(0, |x| x.inuse.saturating_sub(x.budget))
        };
        let mut recent: BTreeMap<String, u32> = BTreeMap::new();
        for e in self
            .sim
            .events()
            .iter()
            .filter(|e| e.reason == "Evicted" && h.saturating_sub(e.at_ms) < 60_000)
        {
            *recent
                .entry(e.pod.split('/').next().unwrap_or_default().to_string())
                .or_default() += 1;
        }
        let layout = self.sim.layout(kvota_fairness::resources::NVIDIA_GPU);
        let decision = self.sim.reclaim(&mut self.state, h);
        let kvota_fairness::reclaim::Decision::Evict {
            for_tenant,
            node,
            victims,
            ..
        } = decision
        else {
            return;
        };
        for v in &victims {
            if self.borrowed_pods.contains(v.key.as_str()) {
                self.happened.borrowed_reclaimed += 1;
            }
        }
        let taken: BTreeSet<&str> = victims.iter().map(|v| v.key.as_str()).collect();
        let spared = layout
            .get(node)
            .map(|(_, pods)| {
                pods.iter()
                    .filter(|(k, n, started)| {
                        let tenant = k.as_str().split('/').next().unwrap_or_default();
                        self.state.is_borrowed(k.as_str())
                            && tenant != for_tenant.as_str()
                            && excess(tenant) >= n * 1_000
                            && h.saturating_sub(*started) >= cfg.min_runtime_ms
                            && recent.get(tenant).copied().unwrap_or(0) < cfg.max_evictions_per_minute_per_tenant
                            && !taken.contains(k.as_str())
                    })
                    .map(|(k, _, _)| k.to_string())
                    .collect()
            })
            .unwrap_or_default();
        let mut taken_of: BTreeMap<&str, u64> = BTreeMap::new();
        let victims = victims
            .iter()
            .map(|v| {
                let t = v.tenant.as_str();
                let so_far = taken_of.entry(t).or_default();
                *so_far += v.gpue;
                let below = *so_far > excess(t);
                (v.key.to_string(), self.state.is_borrowed(v.key.as_str()), below)
            })
            .collect();
        self.last_reclaim = Some(ReclaimSeen {
            node,
            for_tenant,
            victims,
            spared,
        });
    }

    /// The pod key of this cluster's only starved claim, if it is within its tenant's
    /// budget, has no room, and evicting other tenants' borrowed pods (above their
    /// budget by at least the pod, run at least `minRuntime`, under the eviction limits)
    /// on one node it may use would seat it. What reclaim must serve (the lending
    /// invariant's point 3); `starved` is reclaim's own reading of who is starved.
    pub fn lender_waits(&self) -> Option<String> {
        let cfg = &self.policy.as_ref()?.reclaim;
        if !cfg.enabled || self.state.borrowed_keys().next().is_none() {
            return None;
        }
        let h = self.state.now_ms();
        let inputs = kvota_member_agent::inventory::reclaim_view(&self.sim, &self.state);
        let view = kvota_fairness::reclaim::ClusterView {
            now_ms: h,
            capacity: self.state.capacity_gpue(),
            node_free: &inputs.node_free,
            node_total: &inputs.node_total,
            tenants: &inputs.tenants,
            running: &inputs.running,
            waiting: &inputs.waiting,
        };
        let hungry = kvota_fairness::reclaim::starved(&view);
        let [s] = hungry.as_slice() else { return None };
        if !s.within_budget || s.room {
            return None;
        }
        let mut recent: BTreeMap<&str, u32> = BTreeMap::new();
        let mut in_cluster = 0u32;
        for e in self
            .sim
            .events()
            .iter()
            .filter(|e| e.reason == "Evicted" && h.saturating_sub(e.at_ms) < 60_000)
        {
            in_cluster += 1;
            *recent.entry(e.pod.split('/').next().unwrap_or_default()).or_default() += 1;
        }
        if in_cluster >= cfg.max_evictions_per_minute {
            return None;
        }
        let excess: BTreeMap<&str, MilliGpue> = inputs
            .tenants
            .iter()
            .filter(|t| t.preemptible)
            .map(|t| (t.name.as_str(), t.inuse.saturating_sub(t.budget)))
            .collect();
        for (n, free) in inputs.node_free.iter().enumerate() {
            if !s.pod.may_use(n) {
                continue;
            }
            let mut room = free.get(&s.pod.resource).copied().unwrap_or(0);
            let mut left = excess.clone();
            for p in inputs.running.iter().filter(|p| {
                p.node == n
                    && p.resource == s.pod.resource
                    && p.borrowed
                    && p.tenant != s.tenant
                    && h.saturating_sub(p.started_ms) >= cfg.min_runtime_ms
                    && recent.get(p.tenant.as_str()).copied().unwrap_or(0) < cfg.max_evictions_per_minute_per_tenant
            }) {
                if let Some(l) = left.get_mut(p.tenant.as_str()).filter(|l| **l >= p.gpue) {
                    *l -= p.gpue;
                    room += p.count;
                }
            }
            if room >= s.pod.count {
                return Some(s.pod.key.to_string());
            }
        }
        None
    }

    /// Whether a program of the report protocol is under way.
    pub fn busy(&self) -> bool {
        self.program.is_some()
    }

    /// The policy the agent enforces.
    pub fn policy(&self) -> Option<&Policy> {
        self.policy.as_ref()
    }
}

fn window_of(r: &UsageReport) -> (u64, u64) {
    r.window.map_or((0, r.seq), |w| (w.start_ms, w.end_ms))
}
