//! The demo's scenario, one tick at a time: the script's phases and faults, admissions
//! and reclaim, the scheduler, the measures and the view. [`Run`] holds what the ticks
//! share; each step of a tick is a method of its own.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::link::LinkProxy;
use anyhow::Result;
use kvota_fairness::policy::Policy;
use kvota_fairness::reclaim::Decision;
use kvota_fairness::resources::ResourceWeights;
use kvota_fairness::MilliGpue;
use kvota_member_agent::review::Outcome;
use kvota_member_agent::sim::SimPod;

use super::measure::{self, Candidate, Measures, Sample, TenantPoint};
use super::scenario::{self, Script};
use super::{
    lease_kind, ms_of, real_ms, running_by_tenant, submit, totals, view, CpProc, CpView, DemoArgs, Member, Open,
    STARVATION_GRACE_MS, TENANTS, TICK,
};

/// The scenario's state between ticks.
pub(super) struct Run<'a> {
    pub args: &'a DemoArgs,
    pub out: view::Out,
    pub exe: PathBuf,
    pub procs: Vec<CpProc>,
    pub fleet: Vec<Member>,
    pub capacity: MilliGpue,
    pub measures: Measures,
    pub open: BTreeMap<String, Open>,
    /// `(proc index, killed at, term at kill)`.
    pub killed: Option<(usize, u64, u64)>,
    pub failover_ms: Option<u64>,
    pub partition_lease_expired: bool,
    tty: bool,
    script: Script,
    cp_view: Arc<Mutex<CpView>>,
    weights: ResourceWeights,
    max_share: BTreeMap<String, MilliGpue>,
    guarantee: BTreeMap<String, MilliGpue>,
    /// `(due, arrival)`.
    retries: Vec<(u64, usize)>,
    /// First denials a webhook holds for the report round they trigger (as `kvota
    /// agent` does, `--admission-hold-ms`): `(arrival, round mark, give up at)`.
    held: Vec<(usize, u64, u64)>,
    hold_ms: u64,
    /// Evicted pods, recreated after a retry delay: `(due, cluster, pod)`.
    requeued: Vec<(u64, usize, SimPod)>,
    evicted_n: u64,
    next_arrival: usize,
    next_phase: usize,
    phase_name: &'static str,
    pending: Vec<Candidate>,
    prev_committed: BTreeMap<String, MilliGpue>,
    seen_seq: u64,
    last_sample: u64,
    last_render: u64,
    end_real: u64,
}

/// One tick's in-use per tenant before and after admissions, and what runs.
struct Admitted {
    after: BTreeMap<String, MilliGpue>,
    bound_total: MilliGpue,
}

impl<'a> Run<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        args: &'a DemoArgs,
        policy: &Policy,
        out: view::Out,
        tty: bool,
        exe: PathBuf,
        procs: Vec<CpProc>,
        fleet: Vec<Member>,
        cp_view: Arc<Mutex<CpView>>,
    ) -> Run<'a> {
        let capacity: MilliGpue = fleet.iter().map(|m| m.capacity).sum();
        let share = |bp: u32| capacity * u64::from(bp) / 10_000;
        let mut measures = Measures::default();
        for t in TENANTS {
            measures.tenants.entry(t.to_string()).or_default();
        }
        Run {
            args,
            out,
            exe,
            procs,
            fleet,
            capacity,
            measures,
            open: BTreeMap::new(),
            killed: None,
            failover_ms: None,
            partition_lease_expired: false,
            tty,
            script: scenario::script(args.seed),
            cp_view,
            weights: ResourceWeights::new(),
            max_share: policy
                .tenants
                .iter()
                .map(|t| (t.name.to_string(), share(t.max_share_bp)))
                .collect(),
            guarantee: policy
                .tenants
                .iter()
                .map(|t| (t.name.to_string(), share(t.min_share_bp)))
                .collect(),
            retries: Vec::new(),
            held: Vec::new(),
            hold_ms: u64::try_from(kvota_member_agent::webhook::DEFAULT_ADMISSION_HOLD.as_millis()).unwrap_or(u64::MAX),
            requeued: Vec::new(),
            evicted_n: 0,
            next_arrival: 0,
            next_phase: 0,
            phase_name: "starting",
            pending: Vec::new(),
            prev_committed: BTreeMap::new(),
            seen_seq: 0,
            last_sample: 0,
            last_render: 0,
            end_real: real_ms(scenario::END_MS, args.speed),
        }
    }

    /// Plays the scenario to its end, a tick every [`TICK`]; true when Ctrl-C stopped it.
    pub async fn play(&mut self, t0: Instant) -> Result<bool> {
        let mut ctrl_c = Box::pin(tokio::signal::ctrl_c());
        let mut ticker = tokio::time::interval(TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = &mut ctrl_c => return Ok(true),
            }
            let now = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
            if now >= self.end_real {
                return Ok(false);
            }
            let s_now = ms_of(now as f64 * self.args.speed);
            self.phases(now, s_now).await?;
            let view_now = self.read_control_plane(now);
            let admitted = self.admissions(now, s_now);
            self.measure(now, &view_now, &admitted);
            self.render(now, &view_now, &admitted);
        }
    }

    /// The script's phases and faults due by `s_now` (scenario time).
    async fn phases(&mut self, now: u64, s_now: u64) -> Result<()> {
        while let Some(ph) = self.script.phases.get(self.next_phase).filter(|p| p.at_ms <= s_now) {
            self.phase_name = ph.name;
            self.out.event(now, &ph.text);
            match ph.at_ms {
                scenario::BURST_AT_MS => self.measures.after_burst.arm(now),
                scenario::PARTITION_FROM_MS => self.cut_partitioned(true),
                scenario::PARTITION_TO_MS => {
                    self.cut_partitioned(false);
                    self.measures.after_partition.arm(now);
                }
                scenario::KILL_LEADER_AT_MS => self.kill_leader(now).await,
                scenario::RESTART_AT_MS => {
                    if let Some((i, _, _)) = self.killed {
                        self.procs[i].spawn(&self.exe, None)?;
                        let text = format!(
                            "control-plane node {} restarted from its data directory",
                            self.procs[i].id
                        );
                        self.out.event(now, &text);
                    }
                }
                _ => {}
            }
            self.next_phase += 1;
        }
        Ok(())
    }

    fn cut_partitioned(&self, cut: bool) {
        for p in &self.fleet[scenario::PARTITIONED].proxies {
            p.set_cut(cut);
        }
    }

    async fn kill_leader(&mut self, now: u64) {
        let (leader, term) = {
            let v = self.cp_view.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            (v.leader, v.term)
        };
        match leader.and_then(|l| self.procs.iter().position(|p| p.id == l)) {
            Some(i) => {
                self.procs[i].kill().await;
                let text = format!("control-plane node {} (the leader) killed", self.procs[i].id);
                self.out.event(now, &text);
                self.killed = Some((i, now, term));
            }
            None => self.out.event(now, "no leader known at this moment; nothing killed"),
        }
    }

    /// A new reading of the control plane judges the admissions made before it; a later
    /// term with a leader after the kill is the failover.
    fn read_control_plane(&mut self, now: u64) -> CpView {
        let view_now = self
            .cp_view
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        if view_now.seq != self.seen_seq {
            let committed: BTreeMap<String, MilliGpue> = view_now
                .tenants
                .iter()
                .map(|(t, i)| (t.clone(), i.entitlement_milli_gpue))
                .collect();
            if self.seen_seq > 0 {
                self.measures
                    .judge(&self.pending, &self.prev_committed, &committed, &self.max_share);
                self.pending.clear();
            }
            self.prev_committed = committed;
            self.seen_seq = view_now.seq;
        }
        // Failed over once some node leads in a later term (the restarted node may win).
        if let (Some((_, at, term)), None) = (self.killed, self.failover_ms) {
            if view_now.term > term && view_now.leader.is_some() {
                self.failover_ms = Some(now - at);
                let text = format!(
                    "node {} leads now (term {}), {} ms after the kill",
                    view_now.leader.unwrap_or(0),
                    view_now.term,
                    now - at
                );
                self.out.event(now, &text);
            }
        }
        view_now
    }

    /// Pods finish, new pods and retries go through admission, gates open where budget
    /// freed, reclaim evicts, then the scheduler binds. The admissions are candidates for
    /// the over-admission check at the next reading of the control plane.
    fn admissions(&mut self, now: u64, s_now: u64) -> Admitted {
        for m in &mut self.fleet {
            let mut st = m.agent.state();
            let t = st.now_ms();
            m.sim.finish(&mut st, t);
        }
        let before = totals(&self.fleet);
        let mut lease_e: BTreeMap<String, MilliGpue> = BTreeMap::new();
        self.submit_due(now, s_now, &mut lease_e);
        self.release_gates(&mut lease_e);
        self.reclaim(now);
        let after = totals(&self.fleet);
        for (t, &a) in &after {
            let b = before.get(t).copied().unwrap_or(0);
            if a > b {
                self.pending.push(Candidate {
                    tenant: t.clone(),
                    before: b,
                    after: a,
                    lease_entitlement: lease_e.get(t).copied().unwrap_or(0),
                });
            }
        }
        let bound_total = self.bind(now);
        Admitted { after, bound_total }
    }

    /// Submits the arrivals due by `s_now` and the retries due by `now`; held reviews
    /// whose report round completed are judged once more (the API server sees only that
    /// answer), and one that waited as long as a webhook holds is answered with its
    /// first denial, as the webhook does.
    fn submit_due(&mut self, now: u64, s_now: u64, lease_e: &mut BTreeMap<String, MilliGpue>) {
        let mut due: Vec<usize> = Vec::new();
        while self
            .script
            .arrivals
            .get(self.next_arrival)
            .is_some_and(|a| a.at_ms <= s_now)
        {
            due.push(self.next_arrival);
            self.next_arrival += 1;
        }
        self.retries.retain(|&(at, idx)| {
            if at <= now {
                due.push(idx);
                false
            } else {
                true
            }
        });
        let (mut judged_again, mut timed_out) = (Vec::new(), Vec::new());
        let (script, fleet) = (&self.script, &self.fleet);
        self.held.retain(|&(idx, mark, give_up)| {
            let cluster = script.arrivals.get(idx).map_or(0, |a| a.cluster);
            if fleet.get(cluster).is_some_and(|m| m.agent.rounds_done() > mark) {
                judged_again.push(idx);
                false
            } else if now >= give_up {
                timed_out.push(idx);
                false
            } else {
                true
            }
        });
        let retry_at = now + real_ms(scenario::RETRY_MS, self.args.speed);
        for idx in timed_out {
            let Some(a) = self.script.arrivals.get(idx) else {
                continue;
            };
            self.retries.push((retry_at, idx));
            self.measures.denied(a.tenant, idx);
        }
        // Held reviews first: a webhook answers them the moment their round completes,
        // before reviews that arrive later.
        let again = judged_again.len();
        judged_again.extend(due);
        for (n, idx) in judged_again.into_iter().enumerate() {
            let Some(a) = self.script.arrivals.get(idx) else {
                continue;
            };
            // Retries go to the same cluster (a job stays where it was submitted; moving
            // it would chase budgets that follow demand).
            let m = &mut self.fleet[a.cluster];
            let (outcome, mark) = submit(m, a, self.args.speed, &self.weights, &mut self.open, now, lease_e);
            if let (Outcome::Denied, Some(mark), true) = (outcome, mark, n >= again) {
                self.held.push((idx, mark, now + self.hold_ms));
                continue;
            }
            if matches!(outcome, Outcome::Denied | Outcome::Error) {
                self.retries.push((retry_at, idx));
                self.measures.denied(a.tenant, idx);
            }
        }
    }

    /// The gate controller releases queued pods where budget freed.
    fn release_gates(&mut self, lease_e: &mut BTreeMap<String, MilliGpue>) {
        for m in &mut self.fleet {
            let mut st = m.agent.state();
            for key in m.sim.release(&mut st) {
                if let Some(o) = self.open.get(key.as_str()) {
                    let e = st
                        .lease
                        .lease()
                        .and_then(|l| l.budgets.get(o.tenant.as_str()))
                        .map_or(0, |b| b.entitlement);
                    let slot = lease_e.entry(o.tenant.clone()).or_insert(0);
                    *slot = (*slot).max(e);
                }
            }
        }
    }

    /// Reclaim: an agent evicts pods over their budget for a tenant below its
    /// guarantee; their owners recreate them (under new names) after a retry delay.
    fn reclaim(&mut self, now: u64) {
        let retry_at = now + real_ms(scenario::RETRY_MS, self.args.speed);
        for (ci, m) in self.fleet.iter_mut().enumerate() {
            let mut st = m.agent.state();
            let t = st.now_ms();
            if let Decision::Evict {
                for_tenant, victims, ..
            } = m.sim.reclaim(&mut st, t)
            {
                let gone = m.sim.take_evicted();
                if !gone.is_empty() {
                    let who = victims.first().map_or("?", |v| v.tenant.as_str());
                    let text = format!(
                        "{}: reclaim evicted {} {who} pod(s) for {for_tenant}",
                        m.spec.name,
                        gone.len()
                    );
                    self.out.event(now, &text);
                }
                for mut pod in gone {
                    self.evicted_n += 1;
                    pod.name = format!("{}-r{}", pod.name, self.evicted_n);
                    self.requeued.push((retry_at, ci, pod));
                }
            }
        }
        let mut still = Vec::new();
        for (at, ci, pod) in std::mem::take(&mut self.requeued) {
            if at > now {
                still.push((at, ci, pod));
                continue;
            }
            let m = &mut self.fleet[ci];
            let mut st = m.agent.state();
            if matches!(m.sim.submit(&mut st, &pod), Outcome::Denied | Outcome::Error) {
                still.push((retry_at, ci, pod));
            }
        }
        self.requeued = still;
    }

    /// The scheduler binds; lease changes are events. Returns the GPUe running.
    fn bind(&mut self, now: u64) -> MilliGpue {
        let mut bound_total = 0;
        for m in &mut self.fleet {
            let mut st = m.agent.state();
            let t = st.now_ms();
            for b in m.sim.bind(&mut st, t) {
                if let Some(o) = self.open.remove(b.key.as_str()) {
                    if let Some(tm) = self.measures.tenants.get_mut(&o.tenant) {
                        tm.delays_ms.push(now - o.first_ms);
                    }
                }
            }
            bound_total += m.sim.running_gpue();
            let kind = lease_kind(st.lease.status(st.now_ms()));
            if kind != m.lease_kind && (kind == "safe" || m.lease_kind == "safe" || m.lease_kind == "none") {
                let text = match kind {
                    "safe" => format!("{}: lease expired; enforcing safe budgets", m.spec.name),
                    _ => format!("{}: {} lease, epoch {}", m.spec.name, kind, st.lease.held_epoch()),
                };
                self.out.event(now, &text);
            }
            if kind == "safe" && m.proxies.iter().any(LinkProxy::is_cut) {
                self.partition_lease_expired = true;
            }
            m.lease_kind = kind;
        }
        bound_total
    }

    /// The measures of this tick: utilization, share clocks, fairness and recovery, and
    /// a sample of the timeline each second.
    fn measure(&mut self, now: u64, view_now: &CpView, a: &Admitted) {
        self.measures.util_num += a.bound_total as f64 * TICK.as_millis() as f64;
        self.measures.util_den += self.capacity as f64 * TICK.as_millis() as f64;
        if view_now.seq == 0 {
            return;
        }
        let mut all_fair = true;
        let sample_now = now - self.last_sample >= 1_000;
        let mut points = BTreeMap::new();
        for t in TENANTS {
            let inuse = a.after.get(t).copied().unwrap_or(0);
            let target = view_now.tenants.get(t).map_or(0, |i| i.target_milli_gpue);
            let (fittable, aged) = self.waiting_of(t, now);
            let g = self.guarantee.get(t).copied().unwrap_or(0);
            if let Some(tm) = self.measures.tenants.get_mut(t) {
                tm.clock.observe(now, inuse, target, inuse + aged, g);
            }
            all_fair &= measure::tenant_fair(inuse, target, fittable);
            if sample_now {
                let cp_score = view_now.tenants.get(t).map_or(1.0, |i| i.fairness_score);
                let score = self.measures.score(t, cp_score);
                points.insert(
                    t.to_string(),
                    TenantPoint {
                        inuse_gpue: inuse as f64 / 1000.0,
                        entitlement_gpue: target as f64 / 1000.0,
                        waiting: self.open.values().filter(|o| o.tenant == t).count(),
                        score,
                    },
                );
            }
        }
        // After the burst, fairness also means training got what it is entitled to (not
        // merely that the control plane had not heard of its demand yet).
        let t_in = a.after.get("training").copied().unwrap_or(0) as f64;
        let t_target = view_now.tenants.get("training").map_or(0, |i| i.target_milli_gpue) as f64;
        let burst_served = t_target > 0.0 && t_in >= t_target * 0.8 - 1_000.0;
        self.measures.after_burst.observe(now, all_fair && burst_served);
        self.measures.after_partition.observe(now, all_fair);
        if sample_now {
            self.last_sample = now;
            self.measures.timeline.push(Sample {
                t_s: now as f64 / 1000.0,
                phase: self.phase_name.to_string(),
                utilization: a.bound_total as f64 / self.capacity.max(1) as f64,
                tenants: points,
            });
        }
    }

    /// `tenant`'s waiting pods that would fit on a node right now (held back by kvota,
    /// not by physics: a job pinned to a full cluster is not kvota's to place), and those
    /// waiting longer than the starvation grace.
    fn waiting_of(&self, tenant: &str, now: u64) -> (MilliGpue, MilliGpue) {
        let mine = || self.open.values().filter(move |o| o.tenant == tenant);
        let fittable = mine()
            .filter(|o| self.fleet[o.cluster].sim.fits(o.resource, o.count))
            .map(|o| o.gpue)
            .sum();
        let aged = mine()
            .filter(|o| now - o.first_ms >= STARVATION_GRACE_MS)
            .map(|o| o.gpue)
            .sum();
        (fittable, aged)
    }

    /// The live table (a terminal) or a status line, every half second or five seconds.
    fn render(&mut self, now: u64, view_now: &CpView, a: &Admitted) {
        if now - self.last_render < if self.tty { 500 } else { 5_000 } {
            return;
        }
        self.last_render = now;
        let waiting: BTreeMap<String, usize> = TENANTS
            .iter()
            .map(|t| (t.to_string(), self.open.values().filter(|o| o.tenant == *t).count()))
            .collect();
        let clusters: Vec<view::ClusterRow> = self
            .fleet
            .iter()
            .map(|m| {
                let st = m.agent.state();
                view::ClusterRow {
                    name: m.spec.name.to_string(),
                    capacity: m.capacity,
                    running: m.sim.running(),
                    gated: m.sim.gated(),
                    lease: st.lease.status(st.now_ms()),
                    epoch: st.lease.held_epoch(),
                    backlog: m.agent.backlog(),
                    cut: m.proxies.iter().any(LinkProxy::is_cut),
                }
            })
            .collect();
        let frame = view::Frame {
            seed: self.args.seed,
            speed: self.args.speed,
            now_ms: now,
            end_ms: self.end_real,
            phase: self.phase_name,
            cp: view_now,
            http: self
                .procs
                .iter()
                .find(|p| Some(p.id) == view_now.leader)
                .map(|p| p.http.clone()),
            inuse: &a.after,
            running: &running_by_tenant(&self.fleet),
            waiting: &waiting,
            capacity: self.capacity,
            clusters: &clusters,
            utilization: a.bound_total as f64 / self.capacity.max(1) as f64,
        };
        self.out.frame(&frame);
    }
}
