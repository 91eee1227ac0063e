//! Partition safety of the lease protocol, checked against ground truth.
//!
//! A model federation: the real [`Federation`] state machine as the control plane, and
//! agents built on the real [`AgentLease`] and [`decide`]. Between them a network that
//! delays, reorders and loses messages, agents that are cut off and healed, restart
//! (keeping their disk: journal and last lease), and clocks that run fast or slow within
//! the policy's margin. Pods are admitted and finish at random.
//!
//! After every step the test checks, for every tenant and cluster:
//! - the control plane's own inequality ([`Federation::check_safety`]);
//! - ground truth against the control plane's accounting: what the agent really has
//!   admitted, and the budget it really enforces, never exceed what the control plane
//!   assumes the cluster may hold (`hold`) or may still admit (`enforceable`);
//! - hence `sum_c max(true inuse, true budget) <= max(committed, sum reported inuse)`;
//! - committed entitlements never exceed capacity; epochs never go back at an agent.
//!
//! At the end, all faults heal: entitlements converge to the model's target, every
//! report was applied exactly once, and the usage the control plane counted equals the
//! usage the agents produced.

use std::collections::{BTreeMap, VecDeque};

use kvota_fairness::admission::{decide, LocalView, PodRequest, Verdict};
use kvota_fairness::federation::{Applied, Command, CommandError, Federation, TenantReport, UsageReport};
use kvota_fairness::lease::{AgentLease, Lease};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::{AdmissionMode, Policy};
use proptest::prelude::*;

const POLICY: &str = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: model}
spec:
  decayHalfLife: 1h
  lease: {duration: 10s, clockSkewMargin: 1s}
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, preemptible: true}
  - {name: inference, weight: 50, minShare: 40, maxShare: 80}
  - {name: research, weight: 10, minShare: 5, maxShare: 25, preemptible: true}
";
const TENANTS: [&str; 3] = ["inference", "research", "training"];
/// Report rounds after healing within which every tenant must reach its target: one to
/// learn demand, one for decreases to be acknowledged, one for increases, plus slack
/// for rounding at each step.
const SETTLE_ROUNDS: usize = 5;

/// xorshift64*: all randomness of a run comes from one seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

struct Agent {
    id: ClusterName,
    lease: AgentLease,
    /// Clock rate error in parts per million (negative: slow).
    rate_ppm: i64,
    offset_ms: u64,
    pods: BTreeMap<&'static str, Vec<u64>>,
    pending: BTreeMap<&'static str, u64>,
    /// Reports written to "disk" and not yet acknowledged, oldest first.
    journal: VecDeque<UsageReport>,
    next_seq: u64,
    last_snapshot_agent_ms: u64,
    cut: bool,
    produced_usage: u64,
}

impl Agent {
    fn clock(&self, real_ms: u64) -> u64 {
        let drift = i128::from(real_ms) * i128::from(self.rate_ppm) / 1_000_000;
        u64::try_from(i128::from(self.offset_ms) + i128::from(real_ms) + drift).unwrap_or(0)
    }
    fn inuse(&self, t: &str) -> u64 {
        self.pods.get(t).map_or(0, |p| p.iter().sum())
    }
}

enum Msg {
    Report {
        agent: usize,
        report: UsageReport,
        sent_agent_ms: u64,
    },
    Lease {
        agent: usize,
        lease: Lease,
        request_sent_agent_ms: u64,
        seq: u64,
    },
}

struct World {
    fed: Federation,
    agents: Vec<Agent>,
    net: Vec<(u64, u64, Msg)>,
    now: u64,
    order: u64,
    rng: Rng,
    loss_pct: u64,
    max_delay_ms: u64,
    applied_usage: BTreeMap<ClusterName, u64>,
    last_epoch: Vec<u64>,
}

#[derive(Clone, Debug)]
enum Op {
    Advance(u64),
    Send(usize),
    Deliver,
    Admit(usize, usize, u64),
    Finish(usize, usize),
    Pending(usize, usize, u64),
    Cut(usize),
    Heal(usize),
    Restart(usize),
    Tick,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u64..4_000).prop_map(Op::Advance),
        3 => (0usize..3).prop_map(Op::Send),
        3 => Just(Op::Deliver),
        5 => (0usize..3, 0usize..3, 1u64..9).prop_map(|(a, t, g)| Op::Admit(a, t, g * 1000)),
        2 => (0usize..3, 0usize..3).prop_map(|(a, t)| Op::Finish(a, t)),
        2 => (0usize..3, 0usize..3, 0u64..40).prop_map(|(a, t, g)| Op::Pending(a, t, g * 1000)),
        1 => (0usize..3).prop_map(Op::Cut),
        1 => (0usize..3).prop_map(Op::Heal),
        1 => (0usize..3).prop_map(Op::Restart),
        1 => Just(Op::Tick),
    ]
}

impl World {
    fn new(seed: u64, rates_ppm: [i64; 3], loss_pct: u64, max_delay_ms: u64) -> World {
        let policy = Policy::from_yaml(POLICY).expect("model policy");
        let mut fed = Federation::new();
        fed.apply(0, Command::ApplyPolicy(policy)).expect("policy");
        // As the control plane runs today: budgets sized to the largest waiting pod.
        fed.enable_sized_budgets();
        let mut agents = Vec::new();
        for (i, (id, gpus)) in [("east", 32u64), ("west", 32), ("edge", 16)].iter().enumerate() {
            let capacity = [("nvidia.com/gpu".to_string(), gpus * 1000)].into();
            let id = ClusterName::from_static(id);
            let mut lease = AgentLease::new(id.clone());
            if let Ok(Applied::Registered(l)) = fed.apply(
                0,
                Command::RegisterCluster {
                    cluster: id.clone(),
                    capacity,
                    labels: BTreeMap::new(),
                },
            ) {
                lease.on_lease(l, 0);
            }
            agents.push(Agent {
                id,
                lease,
                rate_ppm: rates_ppm[i],
                offset_ms: 1_000 * i as u64,
                pods: BTreeMap::new(),
                pending: BTreeMap::new(),
                journal: VecDeque::new(),
                next_seq: 1,
                last_snapshot_agent_ms: 0,
                cut: false,
                produced_usage: 0,
            });
        }
        let last_epoch = agents.iter().map(|a| a.lease.held_epoch()).collect();
        World {
            fed,
            agents,
            net: Vec::new(),
            now: 0,
            order: 0,
            rng: Rng(seed | 1),
            loss_pct,
            max_delay_ms,
            applied_usage: BTreeMap::new(),
            last_epoch,
        }
    }

    fn post(&mut self, msg: Msg, lossy: bool) {
        if lossy && self.rng.below(100) < self.loss_pct {
            return;
        }
        let at = self.now + self.rng.below(self.max_delay_ms + 1);
        self.order += 1;
        self.net.push((at, self.order, msg));
    }

    fn snapshot(&mut self, i: usize) {
        let now = self.now;
        let a = &mut self.agents[i];
        let at = a.clock(now);
        let dt = at.saturating_sub(a.last_snapshot_agent_ms);
        a.last_snapshot_agent_ms = at;
        let mut tenants = BTreeMap::new();
        for t in TENANTS {
            let inuse = a.inuse(t);
            let used = inuse * dt;
            a.produced_usage += used;
            tenants.insert(TenantName::from_static(t), {
                // What waits is one pod (`Op::Pending`): it is also the largest.
                let pending = a.pending.get(t).copied().unwrap_or(0);
                TenantReport {
                    used_milli_gpue_ms: used,
                    inuse,
                    pending,
                    largest: pending,
                    borrowed: 0,
                }
            });
        }
        let report = UsageReport {
            cluster: a.id.clone(),
            seq: a.next_seq,
            held_epoch: a.lease.held_epoch(),
            capacity: None,
            tenants,
            evictions: Vec::new(),
            decisions: Vec::new(),
            window: None,
            status: None,
        };
        a.next_seq += 1;
        a.journal.push_back(report);
    }

    fn send(&mut self, i: usize) {
        if self.agents[i].journal.len() < 8 {
            self.snapshot(i);
        }
        let sent = self.agents[i].clock(self.now);
        let reports: Vec<UsageReport> = self.agents[i].journal.iter().cloned().collect();
        for report in reports {
            self.post(
                Msg::Report {
                    agent: i,
                    report,
                    sent_agent_ms: sent,
                },
                true,
            );
        }
    }

    fn deliver(&mut self) {
        let now = self.now;
        let mut due: Vec<(u64, u64, Msg)> = Vec::new();
        let mut keep = Vec::new();
        for m in self.net.drain(..) {
            if m.0 <= now {
                due.push(m)
            } else {
                keep.push(m)
            }
        }
        self.net = keep;
        due.sort_by_key(|m| (m.0, m.1));
        for (_, _, msg) in due {
            match msg {
                Msg::Report {
                    agent,
                    report,
                    sent_agent_ms,
                } => {
                    if self.agents[agent].cut {
                        continue;
                    }
                    let seq = report.seq;
                    let used: u64 = report.tenants.values().map(|t| t.used_milli_gpue_ms).sum();
                    let id = report.cluster.clone();
                    match self.fed.apply(now, Command::Report(report)) {
                        Ok(Applied::Reported { applied, lease }) => {
                            if applied {
                                *self.applied_usage.entry(id).or_default() += used;
                            }
                            self.post(
                                Msg::Lease {
                                    agent,
                                    lease,
                                    request_sent_agent_ms: sent_agent_ms,
                                    seq,
                                },
                                true,
                            );
                        }
                        Err(CommandError::SequenceGap { .. }) => {}
                        other => panic!("unexpected answer to a report: {other:?}"),
                    }
                }
                Msg::Lease {
                    agent,
                    lease,
                    request_sent_agent_ms,
                    seq,
                } => {
                    let a = &mut self.agents[agent];
                    if a.cut {
                        continue;
                    }
                    a.lease.on_lease(lease, request_sent_agent_ms);
                    while a.journal.front().is_some_and(|r| r.seq <= seq) {
                        a.journal.pop_front();
                    }
                }
            }
        }
    }

    fn step(&mut self, op: &Op) {
        match *op {
            Op::Advance(ms) => self.now += ms,
            Op::Send(i) => self.send(i),
            Op::Deliver => self.deliver(),
            Op::Admit(i, t, gpue) => {
                let tenant = TENANTS[t];
                let a = &mut self.agents[i];
                let at = a.clock(self.now);
                let view = LocalView {
                    cluster: a.id.clone(),
                    tenant: Some(TenantName::parse(tenant).expect("name")),
                    mode: AdmissionMode::Reject,
                    max_queued: 0,
                    budget: a.lease.budget(tenant, at),
                    inuse: a.inuse(tenant),
                    queued: 0,
                    entitlement: 0,
                    ceiling: None,
                    lease: a.lease.status(at),
                    borrow: 0,
                };
                let pod = PodRequest {
                    namespace: tenant.into(),
                    name: String::new(),
                    gpue,
                };
                if decide(&pod, &view).verdict == Verdict::Allow {
                    a.pods.entry(tenant).or_default().push(gpue);
                }
            }
            Op::Finish(i, t) => {
                let k = usize::try_from(self.rng.next() % 1024).unwrap_or(0);
                if let Some(p) = self.agents[i].pods.get_mut(TENANTS[t]) {
                    if !p.is_empty() {
                        let idx = k % p.len();
                        p.swap_remove(idx);
                    }
                }
            }
            Op::Pending(i, t, g) => {
                self.agents[i].pending.insert(TENANTS[t], g);
            }
            Op::Cut(i) => self.agents[i].cut = true,
            Op::Heal(i) => self.agents[i].cut = false,
            Op::Restart(i) => {
                let a = &mut self.agents[i];
                if let Some(l) = a.lease.lease().cloned() {
                    a.lease = AgentLease::restored(l);
                }
            }
            Op::Tick => {
                self.fed.apply(self.now, Command::Tick).expect("tick");
            }
        }
        // Keep the state machine's clock at real time for the checks.
        self.fed.apply(self.now, Command::Tick).expect("tick");
    }

    fn check(&mut self, context: &str) {
        let v = self.fed.check_safety();
        assert!(v.is_empty(), "{context}: control plane invariant violated: {v:?}");
        let committed = self.fed.committed().clone();
        for t in TENANTS {
            let mut truth = 0u64;
            let mut reported = 0u64;
            for a in &self.agents {
                let rec = &self.fed.clusters()[&a.id];
                let u = rec.usage.get(t).copied().unwrap_or_default();
                let enf = rec.leases.enforceable(t, self.now);
                let hold = u.hold(enf);
                let at = a.clock(self.now);
                let true_inuse = a.inuse(t);
                let true_budget = a.lease.budget(t, at);
                assert!(
                    true_budget <= enf,
                    "{context}: {} enforces {true_budget} for {t} but the control plane bounds it by {enf} (status {})",
                    a.id,
                    a.lease.status(at)
                );
                assert!(
                    true_inuse <= hold,
                    "{context}: {} holds {true_inuse} of {t}, control plane assumes at most {hold}",
                    a.id
                );
                truth += true_inuse.max(true_budget);
                reported += u.inuse;
            }
            let bound = committed.get(t).copied().unwrap_or(0).max(reported);
            assert!(
                truth <= bound,
                "{context}: tenant {t}: clusters may hold {truth} > {bound}"
            );
        }
        let total: u64 = committed.values().sum();
        assert!(total <= self.fed.capacity(), "{context}: committed {total} > capacity");
        for (i, a) in self.agents.iter().enumerate() {
            let e = a.lease.held_epoch();
            assert!(
                e >= self.last_epoch[i],
                "{context}: {} went back from epoch {} to {e}",
                a.id,
                self.last_epoch[i]
            );
            self.last_epoch[i] = e;
        }
    }

    /// Heals everything and runs clean rounds of reports. Time stands still while they
    /// run: the decayed ledger shifts targets a little every second, and liveness is
    /// about reaching a target, not chasing one.
    fn heal_and_settle(&mut self) {
        for a in &mut self.agents {
            a.cut = false;
        }
        self.loss_pct = 0;
        self.max_delay_ms = 0;
        // Let everything in flight arrive first.
        self.now += 7_000;
        self.deliver();
        for round in 0..SETTLE_ROUNDS {
            for i in 0..self.agents.len() {
                self.send(i);
                self.deliver();
                self.deliver();
            }
            self.fed.apply(self.now, Command::Tick).expect("tick");
            self.check(&format!("settle round {round}"));
        }
    }
}

fn run(seed: u64, ops: &[Op], rates: [i64; 3], loss_pct: u64) {
    let mut w = World::new(seed, rates, loss_pct, 6_000);
    for (k, op) in ops.iter().enumerate() {
        w.step(op);
        w.check(&format!("seed {seed} step {k} {op:?}"));
    }
    w.heal_and_settle();
    // Liveness: a tenant converges to its target, or to what it still runs if that is
    // more (it is throttled, never preempted) -- whenever capacity allows all of that.
    let plan = w.fed.plan();
    let want: Vec<u64> = (0..plan.tenants.len())
        .map(|i| plan.entitlements[i].total.max(plan.inuse[i]))
        .collect();
    for (i, name) in plan.tenants.iter().enumerate() {
        assert!(
            plan.committed[i] <= want[i],
            "seed {seed}: {name} committed {} > {}",
            plan.committed[i],
            want[i]
        );
        if want.iter().sum::<u64>() <= plan.capacity {
            assert_eq!(
                plan.committed[i], want[i],
                "seed {seed}: {name} did not converge after healing; plan: capacity {} committed {:?} targets {:?} inuse {:?} held {:?} demand {:?}",
                plan.capacity,
                plan.committed,
                plan.entitlements.iter().map(|e| e.total).collect::<Vec<_>>(),
                plan.inuse,
                plan.held,
                plan.demand
            );
        }
    }
    for a in &w.agents {
        assert!(
            a.journal.is_empty(),
            "seed {seed}: {} still has unacknowledged reports",
            a.id
        );
        assert_eq!(
            w.fed.clusters()[&a.id].last_seq,
            a.next_seq - 1,
            "seed {seed}: {} reports lost",
            a.id
        );
        assert_eq!(
            w.applied_usage.get(&a.id).copied().unwrap_or(0),
            a.produced_usage,
            "seed {seed}: {}: usage counted != usage produced",
            a.id
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Clock rates within the margin (10 %): the invariant must hold at every step.
    #[test]
    fn safety_holds_under_loss_reordering_partitions_restarts_and_drift(
        seed in any::<u64>(),
        ops in prop::collection::vec(op(), 50..300),
        rates in prop::array::uniform3(-90_000i64..90_000),
        loss in 0u64..60,
    ) {
        run(seed, &ops, rates, loss);
    }
}

/// A clock that runs 40 % slow (beyond the 10 % margin) keeps enforcing a lease after
/// the control plane counts it as expired: the checker must notice.
#[test]
fn checker_catches_a_clock_beyond_the_margin() {
    let result = std::panic::catch_unwind(|| {
        let mut w = World::new(7, [-400_000, 0, 0], 0, 0);
        w.step(&Op::Pending(0, 0, 20_000));
        w.step(&Op::Send(0));
        w.step(&Op::Deliver);
        w.step(&Op::Deliver);
        // The lease is fresh at the agent; let it expire at the control plane.
        for _ in 0..12 {
            w.step(&Op::Advance(1_000));
            w.check("slow clock");
        }
    });
    let err = result.expect_err("a 40% slow clock must be caught");
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("enforces"), "unexpected failure: {msg}");
}

/// Break before make: with the clip removed (grants limited only by the committed
/// entitlement, as a naive implementation would), a decrease that the agent has not
/// acknowledged lets another cluster's increase overshoot. Shown at the level of the
/// invariant the checker uses: the first cluster still holds its old lease.
#[test]
fn unacknowledged_decrease_still_counts() {
    let mut w = World::new(11, [0, 0, 0], 0, 0);
    // Inference wants lots in east; it gets a big budget there.
    w.step(&Op::Pending(0, 0, 30_000));
    w.step(&Op::Send(0));
    w.step(&Op::Deliver);
    w.step(&Op::Deliver);
    let east_budget = w.agents[0].lease.budget("inference", w.agents[0].clock(w.now));
    assert!(east_budget > 0);
    // Demand moves to west; east's agent is cut off before hearing of any decrease.
    w.step(&Op::Pending(0, 0, 0));
    w.step(&Op::Send(0));
    w.step(&Op::Cut(0));
    w.step(&Op::Deliver);
    w.step(&Op::Pending(1, 0, 30_000));
    w.step(&Op::Send(1));
    w.step(&Op::Deliver);
    w.step(&Op::Deliver);
    w.check("after move");
    // West may not yet have what east may still use: together within the entitlement.
    let west_budget = w.agents[1].lease.budget("inference", w.agents[1].clock(w.now));
    let committed = w.fed.committed()["inference"];
    assert!(
        east_budget + west_budget <= committed,
        "{east_budget} + {west_budget} > {committed}"
    );
}
