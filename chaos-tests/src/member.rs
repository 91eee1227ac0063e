//! A member cluster and its agent.
//!
//! **Real**: [`AgentState`] (admission state, lease via [`kvota_fairness::lease::AgentLease`],
//! usage meter `take_usage`), [`SimCluster`] (nodes, first-fit binding, pods submitted as
//! AdmissionReviews through the webhook's `review`, i.e. the real `decide`; the gate
//! queue; reclaim through the Eviction API).
//!
//! **Modelled**: the journal (in memory with the semantics of `member-agent/src/journal.rs`:
//! a report is written with its sequence number before it is sent, only durable
//! entries are sent, kept until acknowledged, resent unchanged and in order; the last
//! adopted lease is saved; a crash loses what was not yet durable), and the report loop
//! of `member-agent/src/agent.rs` (`report_once`: one request in flight, each answer
//! adopted at the *send* time, then the next unacknowledged report; a sequence gap
//! with `expected > seq` acknowledges through `expected - 1`). The agent's clock runs at
//! `1 + rate_ppm/10^6` of real time and, unlike the real agent's `Instant`, continues
//! across restarts (nothing but reservation and denial TTLs depends on it). A restart
//! rebuilds the state from the cluster's inventory ([`SimCluster::list_pods`]), the
//! saved lease ([`AgentLease::restored`]) and the last policy it knew, then restores
//! the state the leader kept in the cluster ([`Kept`], `member-agent/src/persist.rs`):
//! the policy, and the lease for what is left of its life minus the margin
//! ([`AgentLease::restore_anchored`]). A **takeover** is a standby starting instead:
//! it has none of the old process's disk (journal, saved lease, policy), only the kept
//! state; its reports follow the control plane's sequence once it answers one of them
//! as a duplicate (`Agent::follow`), and the old journal's reports it never sends are
//! counted as lost unless the control plane had applied them. As in the real agent, a
//! report acknowledges no newer lease than the kept state holds (the control plane
//! stops counting older leases at that acknowledgement), and the kept state may be
//! stale (writes failing for a while) or unreadable at a restart.
//!
//! Ground truth for the checker is kept beside it: GPUe-ms the cluster's running pods
//! produced, and which part of it the agent could not meter (it was down, or a crash
//! lost its meter or a not-yet-durable report).

use std::collections::{BTreeMap, VecDeque};

use kvota_fairness::federation::{Command, UsageReport, UsageWindow};
use kvota_fairness::lease::{AgentLease, Lease, LeaseUpdate};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::{Policy, TENANT_LABEL};
use kvota_fairness::{MilliGpue, Millis};
use kvota_member_agent::review::{AdmissionState, Effect};
use kvota_member_agent::sim::{PodPhase, SimCluster, SimPod};
use kvota_member_agent::state::{AgentState, PodRec};

use crate::msg::{AgentAnswer, AgentRequest, AnswerOutcome, Msg};
use crate::net::{Addr, Net};
use crate::rng::Rng;

/// Reports are written this often (agent clock).
pub const REPORT_MS: Millis = 1_000;
/// A request without an answer after this long is given up (the client's deadline).
pub const REQUEST_TIMEOUT_MS: Millis = 4_000;
/// Pods denied and waiting for their owner's retry, at most, per agent.
const MAX_RETRIES: usize = 40;

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

/// Fault switches on the agent side (tests that show the checker catches bugs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AgentBugs {
    /// The agent keeps re-anchoring its lease at its own clock: it never expires.
    pub ignore_expiry: bool,
    /// Reports leave the journal when sent, not when acknowledged, and a sequence gap
    /// is "repaired" by renumbering from the control plane's expectation.
    pub ack_on_send: bool,
    /// Reports acknowledge the lease held even before the kept state holds it.
    pub ack_unkept: bool,
    /// A lease taken is enforced at once, while its journal write is on the way.
    pub enforce_unjournaled: bool,
    /// The usage taken for a report the journal refuses is dropped (as the agent did
    /// before it gave it back).
    pub drop_refused_report: bool,
    /// A round whose report the journal refuses ends there, without sending what the
    /// journal holds (as the agent did before 2026-12-05): a journal at its backlog
    /// limit never drains.
    pub stop_on_refused_report: bool,
}

/// An admission that happened in a step (for the admission invariant).
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
    /// processes here; the real agent goes through the wall clock and takes the margin
    /// off again, as [`SimAgent::restart`] does).
    usable_until: Option<Millis>,
    acked_through: u64,
}

impl Kept {
    /// The kept lease's epoch.
    pub fn lease_epoch(&self) -> Option<u64> {
        self.lease.as_ref().map(|l| l.epoch)
    }
}

#[derive(Clone, Debug)]
struct Journaled {
    report: UsageReport,
    durable_at_ms: Millis,
}

/// How far an agent host's wall clock is from real time at most (NTP).
pub const WALL_SKEW_MS: u64 = 200;

/// A member cluster, its agent, and the ground truth about both.
#[derive(Debug)]
pub struct SimAgent {
    /// Index on the network.
    pub index: usize,
    /// Cluster id.
    pub id: ClusterName,
    /// Agent process running.
    pub up: bool,
    /// The agent's state (replaced on restart).
    pub state: AgentState,
    /// The cluster.
    pub sim: SimCluster,
    capacity_gpue: MilliGpue,
    /// Clock rate error, parts per million.
    pub rate_ppm: i64,
    offset_ms: u64,
    journal: VecDeque<Journaled>,
    next_seq: u64,
    /// Highest sequence acknowledged.
    pub acked_through: u64,
    /// Lease saved on disk (durable).
    pub saved_lease: Option<Lease>,
    /// A lease being written to the journal: the lease state to enforce once the write
    /// is durable, at the given agent-clock time (the journal's disk delay); lost if the
    /// process dies before. Meanwhile the lease before it is enforced and acknowledged,
    /// and the report loop waits, as in `Agent::take_lease`.
    saving_lease: Option<(AgentLease, Millis)>,
    policy: Option<Policy>,
    registered: bool,
    guess: usize,
    cp_nodes: usize,
    inflight: Option<(Option<u64>, Millis)>,
    next_report_ms: Millis,
    /// Start of the usage the next report carries, on the host's wall clock (see
    /// [`SimAgent::wall`]), as the real agent's report windows.
    window_start: Millis,
    /// Journal fsync latency.
    pub disk_delay_ms: Millis,
    /// Ground truth: GPUe-ms produced by running pods, per tenant.
    pub produced: BTreeMap<TenantName, u64>,
    /// Produced but never metered into a durable report (agent down, crash).
    pub unmetered: BTreeMap<TenantName, u64>,
    /// Metered into durable reports.
    pub metered: BTreeMap<TenantName, u64>,
    last_host_ms: Millis,
    /// Arrivals per tenant.
    pub load: BTreeMap<TenantName, Load>,
    retry: Vec<(Millis, SimPod)>,
    pods: u64,
    rng: Rng,
    /// Fault switches.
    pub bugs: AgentBugs,
    /// Crashes so far.
    pub crashes: u64,
    next_reclaim_ms: Millis,
    /// The state kept in the cluster (see [`Kept`]).
    pub kept: Option<Kept>,
    /// The lease epoch the kept state holds: reports acknowledge no newer one.
    kept_epoch: u64,
    /// Writes of the kept state fail (the API server is unreachable from the agent).
    pub store_down: bool,
    /// The kept state is unreadable at the next restart.
    pub kept_corrupt: bool,
    /// The journal's disk is full: report and lease writes fail.
    pub disk_full: bool,
    /// Unacknowledged reports the journal holds at most; at the limit it refuses the
    /// next report as on a full disk. A small stand-in for the real journal's
    /// `MAX_BACKLOG` (set by the world), so that a partition of a few seconds reaches it.
    pub max_backlog: usize,
    /// Reports the journal refused at its backlog limit (the disk not full).
    pub backlog_refusals: u64,
    /// A standby took over: a duplicate answer means "follow the control plane's
    /// sequence" until a report of ours is applied.
    renumber_pending: bool,
    /// Reports the old process journaled that the standby never had.
    pub lost: Vec<UsageReport>,
    /// Standby takeovers so far.
    pub takeovers: u64,
    /// Down, and a standby (not this process) starts next.
    pub standby_next: bool,
    /// Restores that did not enforce a still-valid kept lease (the takeover invariant).
    pub restore_violations: Vec<String>,
}

impl SimAgent {
    /// A cluster with `node_gpus` whole-GPU nodes, clock `rate_ppm`, talking to
    /// `cp_nodes` control-plane nodes.
    pub fn new(index: usize, node_gpus: &[u32], rate_ppm: i64, offset_ms: u64, cp_nodes: usize, rng: Rng) -> SimAgent {
        let id = ClusterName::parse(format!("c{index}")).expect("c0, c1, ... are cluster names");
        let sim = SimCluster::new(node_gpus);
        let capacity_gpue: MilliGpue = node_gpus.iter().map(|&g| u64::from(g) * 1_000).sum();
        SimAgent {
            index,
            state: AgentState::new(id.clone(), capacity_gpue, AgentLease::new(id.clone())),
            id,
            up: true,
            sim,
            capacity_gpue,
            rate_ppm,
            offset_ms,
            journal: VecDeque::new(),
            next_seq: 1,
            acked_through: 0,
            saved_lease: None,
            saving_lease: None,
            policy: None,
            registered: false,
            guess: index % cp_nodes.max(1),
            cp_nodes: cp_nodes.max(1),
            inflight: None,
            next_report_ms: 0,
            window_start: offset_ms % WALL_SKEW_MS,
            disk_delay_ms: 0,
            produced: BTreeMap::new(),
            unmetered: BTreeMap::new(),
            metered: BTreeMap::new(),
            last_host_ms: offset_ms,
            load: BTreeMap::new(),
            retry: Vec::new(),
            pods: 0,
            rng,
            bugs: AgentBugs::default(),
            crashes: 0,
            next_reclaim_ms: 0,
            kept: None,
            kept_epoch: 0,
            store_down: false,
            kept_corrupt: false,
            disk_full: false,
            max_backlog: usize::MAX,
            backlog_refusals: 0,
            renumber_pending: false,
            lost: Vec::new(),
            takeovers: 0,
            standby_next: false,
            restore_violations: Vec::new(),
        }
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
        self.journal.len()
    }

    /// Next sequence number the journal will assign.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
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

    /// Ground truth: the budget the agent enforces now (0 while down: nothing is
    /// admitted without a webhook).
    pub fn true_budget(&self, tenant: &str, real_ms: u64) -> MilliGpue {
        if self.up {
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
            self.state.set_namespace(&t.name, [(TENANT_LABEL.to_string(), t.name.to_string())].into());
        }
        self.state.set_policy(p.clone());
        self.policy = Some(p);
    }

    /// One step at real time `real_ms`: meter, finish/release/bind, arrivals, reclaim,
    /// reports. Returns the admissions it made.
    pub fn step(&mut self, real_ms: u64, net: &mut Net<Msg>, arrivals: bool) -> Vec<Admitted> {
        let h = self.clock(real_ms);
        self.advance_truth(h);
        let mut admitted = Vec::new();
        if !self.up {
            // Kubernetes goes on without the agent: pods finish, admitted pods bind.
            let mut scratch = AgentState::new(self.id.clone(), self.capacity_gpue, AgentLease::new(self.id.clone()));
            self.sim.finish(&mut scratch, h);
            self.sim.bind(&mut scratch, h);
            if arrivals {
                self.arrivals(h, None);
            }
            return admitted;
        }
        self.state.set_now(h);
        if self.bugs.ignore_expiry {
            if let Some(l) = self.state.lease.lease().cloned() {
                self.state.lease.on_lease(l, h);
            }
        }
        self.sim.finish(&mut self.state, h);
        for key in self.sim.release(&mut self.state) {
            // Each tenant's pods run in the namespace of its name.
            let tenant = TenantName::parse(key.split('/').next().unwrap_or_default()).expect("a tenant's namespace");
            let gpue = self.state.reservations().iter().find(|r| r.0 == key).map_or(0, |r| r.2);
            admitted.push(self.admitted(&tenant, &key, gpue, h));
        }
        self.sim.bind(&mut self.state, h);
        for pod in self.sim.take_evicted() {
            self.retry.push((h, pod));
        }
        if arrivals {
            self.arrivals(h, Some(&mut admitted));
        }
        if h >= self.next_reclaim_ms {
            self.next_reclaim_ms = h + 2_000;
            self.sim.reclaim(&mut self.state, h);
        }
        if h >= self.next_report_ms {
            self.next_report_ms = h + REPORT_MS;
            self.report_round(h, net, real_ms);
        }
        admitted
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

    fn admitted(&self, tenant: &TenantName, pod: &str, gpue: MilliGpue, h: Millis) -> Admitted {
        Admitted {
            tenant: tenant.clone(),
            pod: pod.to_string(),
            gpue,
            inuse_after: self.state.inuse(tenant),
            budget: self.state.lease.budget(tenant, h),
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
                todo.push(SimPod::gpus(&t, &format!("p{}-{}", self.index, self.pods), gpus, run, l.priority));
            }
        }
        for mut pod in todo {
            let Some(adm) = admitted.as_deref_mut() else {
                // The webhook is down (failurePolicy: Fail): the owner retries later.
                if self.retry.len() < MAX_RETRIES {
                    self.retry.push((h + 3_000, pod));
                }
                continue;
            };
            // Owners recreate pods under new names, as controllers do.
            self.pods += 1;
            pod.name = format!("p{}-{}", self.index, self.pods);
            match self.sim.submit(&mut self.state, &pod) {
                kvota_member_agent::review::Outcome::Allowed => {
                    let gpue = u64::from(pod.count) * 1_000;
                    let tenant = TenantName::parse(pod.namespace.as_str()).expect("a tenant's namespace");
                    adm.push(self.admitted(&tenant, &pod.key(), gpue, h));
                }
                kvota_member_agent::review::Outcome::Denied if self.retry.len() < MAX_RETRIES && self.rng.chance(70) => {
                    let at = h + self.rng.range(2_000, 6_000);
                    self.retry.push((at, pod));
                }
                _ => {}
            }
        }
    }

    /// Keeps the enforcement state in the cluster (after the previous round's answers).
    fn persist(&mut self) {
        if self.store_down {
            return;
        }
        let lease = self.state.lease.lease().cloned();
        self.kept_epoch = self.kept_epoch.max(lease.as_ref().map_or(0, |l| l.epoch));
        self.kept = Some(Kept {
            policy: self.policy.clone(),
            usable_until: self.state.lease.valid_until(),
            lease,
            acked_through: self.acked_through,
        });
    }

    /// The lease being written reaches the disk once its delay has passed; then it is
    /// enforced.
    fn settle_lease(&mut self, h: Millis) {
        if self.saving_lease.as_ref().is_some_and(|(_, at)| *at <= h) {
            if let Some((next, _)) = self.saving_lease.take() {
                self.saved_lease = next.lease().cloned();
                self.state.lease = next;
            }
        }
    }

    /// Takes a lease: `update` decides on a copy; a lease taken is written to the
    /// journal (at once, or after the disk delay) and only then enforced.
    fn take_lease(&mut self, h: Millis, update: impl FnOnce(&mut AgentLease) -> LeaseUpdate) -> LeaseUpdate {
        // From the lease being written, if any: it is what the next one follows.
        let mut next = self.saving_lease.as_ref().map_or_else(|| self.state.lease.clone(), |(l, _)| l.clone());
        let r = update(&mut next);
        if matches!(r, LeaseUpdate::Adopted | LeaseUpdate::Renewed) {
            if self.bugs.enforce_unjournaled {
                self.state.lease = next.clone();
            }
            if self.disk_full {
                // The write fails: only a renewal of an epoch the journal holds is
                // enforced (a restart finds that epoch), and nothing is acknowledged.
                if self.journaled_epoch() >= next.held_epoch() && self.saving_lease.is_none() {
                    self.state.lease = next;
                }
                return r;
            }
            self.saving_lease = Some((next, h + self.disk_delay_ms));
            self.settle_lease(h);
        }
        r
    }

    /// The epoch the journal holds: a report acknowledges no newer one.
    fn journaled_epoch(&self) -> u64 {
        self.saved_lease.as_ref().map_or(0, |l| l.epoch)
    }

    fn report_round(&mut self, h: Millis, net: &mut Net<Msg>, real_ms: u64) {
        self.settle_lease(h);
        if self.saving_lease.is_some() {
            // The report loop is still writing the last lease to the journal.
            return;
        }
        // A lease restored from the kept state that the journal could not take is
        // written again each round (`Agent::rejournal`).
        if !self.disk_full && self.state.lease.held_epoch() > self.journaled_epoch() {
            self.saved_lease = self.state.lease.lease().cloned();
        }
        self.persist();
        if self.registered && (self.disk_full || self.journal.len() >= self.max_backlog) {
            // The journal refuses the report (no space, or at its backlog limit): the
            // usage stays metered for the next round, and the reports the journal holds
            // are still sent (`Agent::report_round`).
            if !self.disk_full {
                self.backlog_refusals += 1;
            }
            if self.bugs.drop_refused_report {
                let _ = self.state.take_usage();
            }
            if self.bugs.stop_on_refused_report {
                return;
            }
        } else if self.registered {
            let tenants = self.state.take_usage();
            for (t, r) in &tenants {
                *self.metered.entry(t.clone()).or_default() += r.used_milli_gpue_ms;
            }
            let report = UsageReport {
                cluster: self.id.clone(),
                seq: self.next_seq,
                held_epoch: {
                    let held = self.state.lease.held_epoch();
                    let kept = if self.bugs.ack_unkept { held } else { self.kept_epoch };
                    held.min(kept).min(self.journaled_epoch())
                },
                capacity: None,
                tenants,
                evictions: Vec::new(),
                decisions: Vec::new(),
                window: Some(UsageWindow { start_ms: self.window_start, end_ms: self.wall(real_ms) }),
            };
            self.window_start = self.wall(real_ms);
            self.next_seq += 1;
            self.journal.push_back(Journaled { report, durable_at_ms: h + self.disk_delay_ms });
        }
        match self.inflight {
            Some((_, sent)) if h < sent + REQUEST_TIMEOUT_MS => {}
            Some(_) => {
                // The call timed out: try the next node (the client follows leader hints;
                // without one it walks the endpoint list).
                self.inflight = None;
                self.guess = (self.guess + 1) % self.cp_nodes;
                self.send_next(h, net, real_ms);
            }
            None => self.send_next(h, net, real_ms),
        }
    }

    fn send_next(&mut self, h: Millis, net: &mut Net<Msg>, real_ms: u64) {
        self.settle_lease(h);
        if self.saving_lease.is_some() {
            // The report loop is still writing the last lease to the journal.
            return;
        }
        let command = if !self.registered {
            Command::RegisterCluster { cluster: self.id.clone(), capacity: self.sim.capacity_milli(), labels: BTreeMap::new() }
        } else {
            let Some(j) = self.journal.front() else { return };
            if j.durable_at_ms > h {
                return;
            }
            Command::Report(j.report.clone())
        };
        let seq = match &command {
            Command::Report(r) => Some(r.seq),
            _ => None,
        };
        if self.bugs.ack_on_send && seq.is_some() {
            self.journal.pop_front();
        }
        self.inflight = Some((seq, h));
        let req = AgentRequest { agent: self.index, sent_agent_ms: h, command, forwarded: false };
        net.send(&mut self.rng, real_ms, Addr::Agent(self.index), Addr::Cp(self.guess), Msg::Request(req));
    }

    fn ack_through(&mut self, seq: u64) {
        while self.journal.front().is_some_and(|j| j.report.seq <= seq) {
            self.journal.pop_front();
        }
        self.acked_through = self.acked_through.max(seq);
    }

    /// An answer arrives (ignored while down, or if it does not answer the request in
    /// flight: the real client gave up on that call).
    pub fn on_answer(&mut self, ans: AgentAnswer, real_ms: u64, net: &mut Net<Msg>) {
        if !self.up {
            return;
        }
        let Some((seq_sent, sent)) = self.inflight else { return };
        if sent != ans.sent_agent_ms {
            return;
        }
        let h = self.clock(real_ms);
        self.inflight = None;
        self.guess = ans.from_node;
        match ans.outcome {
            AnswerOutcome::Lease { lease, seq, policy, applied, last_seq, reported_through_ms } => {
                if let Some(p) = policy {
                    self.install_policy(*p);
                }
                self.state.set_now(h);
                let sent = ans.sent_agent_ms;
                self.take_lease(h, |l| l.on_lease(lease, sent));
                match seq {
                    Some(s) if seq_sent == Some(s) && !applied && self.renumber_pending => {
                        // Taken for a duplicate after a takeover: the old process's
                        // reports used this number, or it was ours, applied, its answer
                        // lost. Those the counted usage covers are done (by window, as
                        // `Agent::follow`); the others follow the control plane's sequence.
                        self.journal.retain(|j| !kvota_member_agent::agent::already_counted(&j.report, last_seq, reported_through_ms));
                        let mut n = last_seq + 1;
                        for j in &mut self.journal {
                            j.report.seq = n;
                            n += 1;
                        }
                        self.next_seq = n;
                    }
                    Some(s) if seq_sent == Some(s) && self.disk_full => {
                        // The journal refuses the acknowledgement record too: the round
                        // ends there; the report is sent again later and answered as a
                        // duplicate (`Agent::report_round`).
                        return;
                    }
                    Some(s) if seq_sent == Some(s) => {
                        self.ack_through(s);
                        if applied {
                            self.renumber_pending = false;
                        }
                    }
                    None => self.registered = true,
                    Some(_) => {}
                }
                self.send_next(h, net, real_ms);
            }
            AnswerOutcome::SequenceGap { seq, expected } => {
                if expected > seq {
                    self.ack_through(expected - 1);
                    self.send_next(h, net, real_ms);
                } else if self.bugs.ack_on_send {
                    // The broken agent "resyncs" by renumbering what it still has.
                    let mut s = expected;
                    for j in &mut self.journal {
                        j.report.seq = s;
                        s += 1;
                    }
                    self.next_seq = s;
                    self.send_next(h, net, real_ms);
                }
            }
            AnswerOutcome::Refused(why) => {
                if why.contains("is not registered") {
                    self.registered = false;
                }
            }
        }
    }

    /// The agent process dies: memory is gone, the journal keeps what was durable.
    pub fn crash(&mut self, real_ms: u64) {
        if !self.up {
            return;
        }
        let h = self.clock(real_ms);
        self.up = false;
        self.crashes += 1;
        self.inflight = None;
        // A lease still being written is lost with the process.
        self.settle_lease(h);
        self.saving_lease = None;
        for (t, r) in self.state.take_usage() {
            *self.unmetered.entry(t).or_default() += r.used_milli_gpue_ms;
        }
        let mut first_lost = None;
        while self.journal.back().is_some_and(|j| j.durable_at_ms > h) {
            if let Some(j) = self.journal.pop_back() {
                first_lost = Some(j.report.seq);
                for (t, r) in &j.report.tenants {
                    *self.unmetered.entry(t.clone()).or_default() += r.used_milli_gpue_ms;
                    if let Some(m) = self.metered.get_mut(t) {
                        *m = m.saturating_sub(r.used_milli_gpue_ms);
                    }
                }
            }
        }
        if let Some(s) = first_lost {
            self.next_seq = s;
        }
    }

    /// The agent process starts again from its disk and the cluster's inventory.
    pub fn restart(&mut self, real_ms: u64) {
        if self.up {
            return;
        }
        let h = self.clock(real_ms);
        // Up to the restart the agent was not there to meter anything.
        self.advance_truth(h);
        let lease = match &self.saved_lease {
            Some(l) => AgentLease::restored(l.clone()),
            None => AgentLease::new(self.id.clone()),
        };
        self.state = AgentState::new(self.id.clone(), self.capacity_gpue, lease);
        // The clock first: nothing is bound yet, so nothing is metered for the downtime.
        self.state.set_now(h);
        if let Some(p) = self.policy.take() {
            self.install_policy(p);
        }
        for p in self.sim.list_pods() {
            match (p.phase, &p.tenant) {
                (PodPhase::Running, _) => self.state.pod_bound(&p.key, PodRec { tenant: p.tenant.clone(), gpue: p.gpue }),
                (PodPhase::Unbound, Some(t)) => {
                    self.state.record(Effect::Reserve { tenant: t.clone(), pod: p.key.clone(), gpue: p.gpue })
                }
                (PodPhase::Gated, Some(t)) => self.state.record(Effect::Enqueue {
                    tenant: t.clone(),
                    pod: p.key.clone(),
                    gpue: p.gpue,
                    priority: p.priority,
                }),
                _ => {}
            }
        }
        self.restore(h);
        self.standby_next = false;
        self.up = true;
        self.next_report_ms = h;
        // Metering starts again now (the downtime is unmetered).
        self.window_start = self.wall(real_ms);
    }

    /// Takes what the last leader kept (see [`Kept`]), unless it is unreadable; checks
    /// that a kept lease still valid is enforced at once.
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
        self.acked_through = self.acked_through.max(k.acked_through);
        let Some(l) = k.lease else { return };
        self.kept_epoch = self.kept_epoch.max(l.epoch);
        let until = k.usable_until.map(|u| u.saturating_sub(l.margin_ms)).filter(|u| *u > h);
        // Taken from the kept state: the real agent writes it to the journal and then
        // enforces it, before its webhook serves; here that start is one instant.
        // Enforced even if the journal cannot take it (the kept state has it).
        let mut next = self.state.lease.clone();
        if matches!(next.restore_anchored(l.clone(), until), LeaseUpdate::Adopted | LeaseUpdate::Renewed) {
            if !self.disk_full {
                self.saved_lease = next.lease().cloned();
            }
            self.state.lease = next;
        }
        if until.is_some() && self.state.lease.held_epoch() == l.epoch {
            for (t, b) in &l.budgets {
                let enforced = self.state.lease.budget(t, h);
                if enforced != b.budget {
                    self.restore_violations.push(format!(
                        "{}: restarted with a kept lease (epoch {}) valid for {} ms more, yet enforces {enforced} for {t}, not its budget {}",
                        self.id,
                        l.epoch,
                        until.unwrap_or(h) - h,
                        b.budget
                    ));
                }
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
        for j in self.journal.drain(..) {
            for (t, r) in &j.report.tenants {
                if let Some(m) = self.metered.get_mut(t) {
                    *m = m.saturating_sub(r.used_milli_gpue_ms);
                }
            }
            self.lost.push(j.report);
        }
        self.saved_lease = None;
        self.saving_lease = None;
        self.policy = None;
        self.registered = false;
        self.next_seq = self.kept.as_ref().map_or(0, |k| k.acked_through) + 1;
        self.acked_through = 0;
        self.kept_epoch = 0;
        self.renumber_pending = true;
    }

    /// Writes a final report of what is metered (used when settling, so every GPUe-ms
    /// metered is in a report).
    pub fn flush_meter(&mut self, real_ms: u64, net: &mut Net<Msg>) {
        if self.up {
            let h = self.clock(real_ms);
            self.state.set_now(h);
            self.next_report_ms = h + REPORT_MS;
            self.report_round(h, net, real_ms);
        }
    }

    /// Sends a report now (settling rounds), without writing a new one if `write` is false.
    pub fn report_now(&mut self, real_ms: u64, net: &mut Net<Msg>) {
        if self.up {
            let h = self.clock(real_ms);
            self.inflight = None;
            self.report_round(h, net, real_ms);
        }
    }
}
