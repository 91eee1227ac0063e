//! Reclaim in an agent over a simulated cluster: the four cases. The agent's
//! real state and admission path are used; the cluster is `SimCluster` (its Eviction API
//! honours PodDisruptionBudgets and its Events are a list), and leases are handed to the
//! agent directly instead of coming from a control plane.

use kvota_fairness::names::{ClusterName, TenantName};
use std::collections::BTreeMap;

use kvota_fairness::federation::EvictionOutcome;
use kvota_fairness::lease::{AgentLease, Lease, TenantBudget};
use kvota_fairness::policy::Policy;
use kvota_fairness::reclaim::Decision;
use kvota_fairness::Millis;
use kvota_member_agent::review::Outcome;
use kvota_member_agent::sim::{SimCluster, SimPod};
use kvota_member_agent::state::AgentState;

const POLICY: &str = "apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: reclaim-test}
spec:
  tenants:
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, preemptible: false, namespaces: [inference]}
  - {name: training, weight: 40, minShare: 20, maxShare: 60, preemptible: true, namespaces: [training]}
";

fn lease(epoch: u64, budgets: &[(&str, u64)]) -> Lease {
    Lease {
        cluster: ClusterName::from_static("c"),
        epoch,
        duration_ms: 3_600_000,
        margin_ms: 60_000,
        issued_at_ms: 0,
        budgets: budgets
            .iter()
            .map(|&(t, gpus)| {
                (
                    TenantName::parse(t).expect("name"),
                    TenantBudget {
                        budget: gpus * 1000,
                        fallback: gpus * 1000,
                        entitlement: gpus * 1000,
                        borrow: 0,
                        ceiling: 0,
                    },
                )
            })
            .collect::<BTreeMap<_, _>>(),
    }
}

/// 4 nodes x 4 GPUs, training holding all 16 (one pod per second, so ages differ),
/// then budgets move to training 8 / inference 8.
fn full_of_training(policy: &str) -> (SimCluster, AgentState, Millis) {
    let mut c = SimCluster::new(&[4, 4, 4, 4]);
    let mut st = AgentState::new(
        ClusterName::from_static("c"),
        16_000,
        AgentLease::new(ClusterName::from_static("c")),
    );
    st.set_policy(Policy::from_yaml(policy).expect("policy"));
    st.lease.on_lease(lease(1, &[("training", 16), ("inference", 8)]), 0);
    let mut now = 0;
    for i in 0..16 {
        now += 1_000;
        st.set_now(now);
        assert_eq!(
            c.submit(
                &mut st,
                &SimPod::gpus("training", &format!("t{i:02}"), 1, 86_400_000, 0)
            ),
            Outcome::Allowed
        );
        c.bind(&mut st, now);
    }
    assert_eq!(c.running(), 16);
    st.lease.on_lease(lease(2, &[("training", 8), ("inference", 8)]), now);
    (c, st, now)
}

struct Run {
    evictions: Vec<(Millis, String)>,
    first_starved: Option<Millis>,
}

/// Steps every 5 s for `secs`: finish/release/bind, reclaim, bind again; `each` may
/// submit more pods.
fn drive(
    c: &mut SimCluster,
    st: &mut AgentState,
    from: Millis,
    secs: u64,
    mut each: impl FnMut(&mut SimCluster, &mut AgentState, Millis),
) -> Run {
    let mut run = Run {
        evictions: Vec::new(),
        first_starved: None,
    };
    let mut t = from;
    while t < from + secs * 1000 {
        t += 5_000;
        st.set_now(t);
        each(c, st, t);
        c.step(st, t);
        let before = c.events().len();
        if let Decision::Idle(why) = c.reclaim(st, t) {
            if why.contains("less than starvedFor") && run.first_starved.is_none() {
                run.first_starved = Some(t);
            }
        }
        for e in &c.events()[before..] {
            if e.reason == "Evicted" {
                run.evictions.push((t, e.pod.clone()));
            }
        }
        c.bind(st, t);
    }
    run
}

fn max_in_a_minute(ev: &[(Millis, String)]) -> usize {
    ev.iter()
        .map(|(t0, _)| ev.iter().filter(|(t, _)| *t >= *t0 && *t < t0 + 60_000).count())
        .max()
        .unwrap_or(0)
}

#[test]
fn inference_below_its_guarantee_gets_exactly_enough_youngest_training_pods_evicted() {
    let (mut c, mut st, now) = full_of_training(POLICY);
    for i in 0..4 {
        assert_eq!(
            c.submit(
                &mut st,
                &SimPod::gpus("inference", &format!("i{i}"), 2, 86_400_000, 100)
            ),
            Outcome::Allowed
        );
    }
    let run = drive(&mut c, &mut st, now, 300, |_, _, _| {});
    // 4 pods x 2 GPUs need 8 GPUs: exactly 8 training pods go, the 8 youngest.
    let mut gone: Vec<String> = run.evictions.iter().map(|e| e.1.clone()).collect();
    gone.sort();
    let youngest: Vec<String> = (8..16).map(|i| format!("training/t{i:02}")).collect();
    assert_eq!(gone, youngest);
    assert_eq!(st.inuse("inference"), 8_000, "all four inference pods bound");
    assert_eq!(c.unbound(), 0);
    // Damping: starved for at least starvedFor (30 s) first, then at most 5 evictions of
    // training in any minute (the per-tenant default).
    let first = run.evictions.first().map(|e| e.0).expect("evictions");
    assert!(
        first - run.first_starved.expect("starvation seen") >= 25_000,
        "evicted {} ms after starvation began",
        first - run.first_starved.unwrap_or(0)
    );
    assert!(max_in_a_minute(&run.evictions) <= 5, "{:?}", run.evictions);
    // Explained: an Event on every victim and an audit record saying who was starved.
    for e in c.events() {
        assert_eq!(e.reason, "Evicted");
        assert!(
            e.message.contains("give tenant `inference` GPUs it is owed")
                && e.message.contains("its guarantee gives it")
                && e.message.contains("above its budget"),
            "{}",
            e.message
        );
    }
    let audit: Vec<_> = st.reclaim_audit().collect();
    assert_eq!(audit.len(), 8);
    assert!(audit.iter().all(|r| r.for_tenant == "inference"
        && r.victim_tenant == "training"
        && r.outcome == EvictionOutcome::Evicted));
    assert_eq!(
        st.eviction_counts()
            .get(&(TenantName::from_static("training"), EvictionOutcome::Evicted)),
        Some(&8)
    );
    // The next usage reports carry them to the control plane's audit log, each once.
    let oldest = audit[0].victim.clone();
    let notes = st.take_eviction_notes(5);
    assert_eq!(notes.len(), 5);
    assert_eq!(notes[0].victim, oldest, "oldest first");
    assert!(notes.iter().all(|n| n.for_tenant == "inference"
        && n.outcome == EvictionOutcome::Evicted
        && n.milli_gpue == 1_000
        && !n.why.is_empty()));
    assert_eq!(st.take_eviction_notes(64).len(), 3, "the rest in the next report");
    assert!(st.take_eviction_notes(64).is_empty());
    // The checkpoint model: each victim lost the work since its last 10-minute checkpoint.
    let cost = c.eviction_cost()["training"];
    assert_eq!(cost.pods, 8);
    assert!(
        cost.lost_gpue_ms > 0 && cost.lost_gpue_ms <= 8 * 1000 * 600_000,
        "{cost:?}"
    );
    assert_eq!(c.take_evicted().len(), 8, "their owners get them back to recreate");
}

#[test]
fn a_non_preemptible_tenant_is_never_a_victim() {
    // Inference holds all 16 GPUs and is far above its new budget; training is starved.
    let mut c = SimCluster::new(&[4, 4, 4, 4]);
    let mut st = AgentState::new(
        ClusterName::from_static("c"),
        16_000,
        AgentLease::new(ClusterName::from_static("c")),
    );
    st.set_policy(Policy::from_yaml(POLICY).expect("policy"));
    st.lease.on_lease(lease(1, &[("inference", 16), ("training", 4)]), 0);
    st.set_now(1_000);
    for i in 0..16 {
        c.submit(
            &mut st,
            &SimPod::gpus("inference", &format!("i{i:02}"), 1, 86_400_000, 0),
        );
    }
    c.bind(&mut st, 1_000);
    st.lease
        .on_lease(lease(2, &[("inference", 2), ("training", 14)]), 1_000);
    for i in 0..4 {
        assert_eq!(
            c.submit(&mut st, &SimPod::gpus("training", &format!("t{i}"), 1, 60_000, 0)),
            Outcome::Allowed
        );
    }
    let run = drive(&mut c, &mut st, 1_000, 600, |_, _, _| {});
    assert!(run.evictions.is_empty(), "{:?}", run.evictions);
    assert_eq!(c.running(), 16);
    match c.reclaim(&mut st, 700_000) {
        Decision::Idle(why) => assert!(why.contains("no preemptible tenant is above its budget"), "{why}"),
        d => panic!("{d:?}"),
    }
}

#[test]
fn a_runaway_tenant_cannot_evict_past_the_rate_limit_nor_beyond_its_guarantee() {
    // The article's healthcare story: a stuck inference replica re-requests GPUs every
    // 5 s for 10 minutes. Admission denies what its budget does not cover, and reclaim
    // stops once inference holds its guarantee.
    let (mut c, mut st, now) = full_of_training(POLICY);
    let mut n = 0;
    let run = drive(&mut c, &mut st, now, 600, |c, st, _| {
        n += 1;
        c.submit(
            st,
            &SimPod::gpus("inference", &format!("stuck-{n}"), 2, 86_400_000, 100),
        );
    });
    assert!(max_in_a_minute(&run.evictions) <= 5, "{:?}", run.evictions);
    assert!(
        run.evictions.len() <= 8,
        "at most what brings inference to its budget: {:?}",
        run.evictions
    );
    assert_eq!(st.inuse("inference"), 8_000);
    let last = run.evictions.last().map_or(0, |e| e.0);
    assert!(
        last < now + 600_000 - 120_000,
        "evictions went on after inference reached its guarantee (last at {last})"
    );
}

#[test]
fn evictions_a_pod_disruption_budget_refuses_are_retried_and_reported_not_forced() {
    let (mut c, mut st, now) = full_of_training(POLICY);
    c.set_pdb("training", 16); // every training pod must stay
    c.submit(&mut st, &SimPod::gpus("inference", "i0", 2, 86_400_000, 100));
    let run = drive(&mut c, &mut st, now, 120, |_, _, _| {});
    assert!(run.evictions.is_empty());
    assert_eq!(c.running(), 16, "nothing was forced");
    let blocked: Vec<_> = c.events().iter().filter(|e| e.reason == "EvictionBlocked").collect();
    assert!(blocked.len() >= 2, "refusals are reported, and retried: {blocked:?}");
    assert!(
        blocked[0]
            .message
            .contains("PodDisruptionBudget of namespace `training`"),
        "{}",
        blocked[0].message
    );
    assert!(st.reclaim_audit().any(|r| r.outcome == EvictionOutcome::Blocked));
    // The budget relaxes: the next attempt succeeds.
    c.set_pdb("training", 12);
    let run = drive(&mut c, &mut st, now + 120_000, 60, |_, _, _| {});
    assert_eq!(run.evictions.len(), 2);
    assert_eq!(st.inuse("inference"), 2_000);
}

#[test]
fn a_tenant_whose_budget_is_held_by_others_is_still_restored() {
    // The usual case: training holds the cluster, so break-before-make leaves inference a
    // budget of 0 and its pods are denied. Their demand still counts: reclaim evicts
    // training pods above training's budget, and the freed GPUs stay free (training is
    // over budget) until the next lease gives them to inference.
    let (mut c, mut st, now) = full_of_training(POLICY);
    st.lease.on_lease(lease(3, &[("training", 8), ("inference", 0)]), now);
    let run = drive(&mut c, &mut st, now, 60, |c, st, t| {
        c.submit(st, &SimPod::gpus("inference", &format!("i-{t}"), 2, 86_400_000, 100));
    });
    assert_eq!(run.evictions.len(), 2, "{:?}", run.evictions);
    assert_eq!(c.running(), 14);
    assert_eq!(
        c.submit(&mut st, &SimPod::gpus("training", "again", 1, 1_000, 0)),
        Outcome::Denied,
        "over budget: no re-admission"
    );
}

#[test]
fn idle_gpus_are_lent_to_a_preemptible_tenant_and_taken_back_for_pods_within_budgets() {
    // 16 GPUs. Training's budget is 4 with a borrow limit of 8; inference's budget is 8,
    // and it has nothing running yet: its budget is idle, so lendable.
    let mut c = SimCluster::new(&[4, 4, 4, 4]);
    let mut st = AgentState::new(
        ClusterName::from_static("c"),
        16_000,
        AgentLease::new(ClusterName::from_static("c")),
    );
    st.set_policy(Policy::from_yaml(POLICY).expect("policy"));
    let mut l = lease(1, &[("training", 4), ("inference", 8)]);
    if let Some(b) = l.budgets.get_mut("training") {
        b.borrow = 8_000;
    }
    if let Some(b) = l.budgets.get_mut("inference") {
        b.borrow = 0;
    }
    st.lease.on_lease(l, 0);
    let mut now = 0;
    let mut outcomes = Vec::new();
    for i in 0..14 {
        now += 1_000;
        st.set_now(now);
        outcomes.push(c.submit(
            &mut st,
            &SimPod::gpus("training", &format!("t{i:02}"), 1, 86_400_000, 0),
        ));
        c.bind(&mut st, now);
    }
    // 4 within the budget, 8 borrowed (the limit), then denied.
    assert_eq!(
        outcomes.iter().filter(|o| **o == Outcome::Allowed).count(),
        12,
        "{outcomes:?}"
    );
    assert_eq!(st.inuse("training"), 12_000);
    let borrowed: Vec<String> = (0..14)
        .map(|i| format!("training/t{i:02}"))
        .filter(|k| st.is_borrowed(k))
        .collect();
    assert_eq!(
        borrowed,
        (4..12).map(|i| format!("training/t{i:02}")).collect::<Vec<_>>()
    );
    let d = st.explain_pod("training/t05").expect("judged");
    assert!(d.text.contains("borrowed GPUs"), "{}", d.text);
    // A non-preemptible tenant never borrows: inference's pods over its budget are denied
    // even with GPUs idle.
    let big = c.submit(&mut st, &SimPod::gpus("inference", "huge", 9, 86_400_000, 100));
    assert_ne!(big, Outcome::Allowed);
    // Inference comes back within its budget: 4 x 2 GPUs. 4 GPUs are free, the rest is
    // taken back from borrowed pods only, the youngest first.
    inference_takes_back_borrowed_gpus(&mut c, &mut st, now, &borrowed);
    assert!(st.inuse("training") >= 4_000, "training keeps its budget");
    for e in c.events() {
        assert!(e.message.contains("borrowed GPUs"), "{}", e.message);
    }
}

#[test]
fn with_lend_when_cut_off_a_cluster_lends_only_once_its_lease_expired() {
    // The case above with `spec.reclaim.lendWhen: cutOff`: training's budget is 4 with a
    // borrow limit of 8, inference's 8 GPUs idle. While the lease is fresh nothing is
    // lent; once it expired (the control plane unreachable, fallback budgets enforced)
    // the agent lends under the lease's limit; a fresh lease stops the lending again,
    // and the pods lent stay borrowed, the first taken back for inference.
    let policy = POLICY.replacen("spec:\n", "spec:\n  reclaim: {lendWhen: cutOff}\n", 1);
    let mut c = SimCluster::new(&[4, 4, 4, 4]);
    let mut st = AgentState::new(
        ClusterName::from_static("c"),
        16_000,
        AgentLease::new(ClusterName::from_static("c")),
    );
    st.set_policy(Policy::from_yaml(&policy).expect("policy"));
    let with_limit = |epoch: u64, limit: u64| {
        let mut l = lease(epoch, &[("training", 4), ("inference", 8)]);
        if let Some(b) = l.budgets.get_mut("training") {
            b.borrow = limit;
        }
        l
    };
    st.lease.on_lease(with_limit(1, 8_000), 0);
    let mut now = 0;
    let submit = |c: &mut SimCluster, st: &mut AgentState, from: usize, to: usize, now: &mut Millis| -> Vec<Outcome> {
        (from..to)
            .map(|i| {
                *now += 1_000;
                st.set_now(*now);
                let o = c.submit(st, &SimPod::gpus("training", &format!("t{i:02}"), 1, 86_400_000, 0));
                c.bind(st, *now);
                o
            })
            .collect()
    };
    let fresh = submit(&mut c, &mut st, 0, 8, &mut now);
    assert_eq!(
        fresh.iter().filter(|o| **o == Outcome::Allowed).count(),
        4,
        "a fresh lease lends nothing: {fresh:?}"
    );
    assert_eq!(st.inuse("training"), 4_000);
    let d = st.explain_pod("training/t05").expect("judged");
    assert!(!d.text.contains("borrowed GPUs"), "{}", d.text);
    // The lease (an hour, less a minute's margin) runs out: the agent enforces fallbacks
    // (4 and 8) and lends training up to its limit of 8 more.
    now = 3_600_000;
    st.set_now(now);
    assert_eq!(st.lease.status(now), kvota_fairness::lease::LeaseStatus::Safe);
    let cut_off = submit(&mut c, &mut st, 8, 18, &mut now);
    assert_eq!(
        cut_off.iter().filter(|o| **o == Outcome::Allowed).count(),
        8,
        "cut off, the agent lends: {cut_off:?}"
    );
    assert_eq!(st.inuse("training"), 12_000);
    let borrowed: Vec<String> = (0..18)
        .map(|i| format!("training/t{i:02}"))
        .filter(|k| st.is_borrowed(k))
        .collect();
    assert_eq!(borrowed.len(), 8, "{borrowed:?}");
    // Back in touch ten minutes later (every pod past minRuntime, so age does not pick
    // the victims): a fresh lease, no more lending, the borrowed pods still marked. Its
    // limit (12) leaves room to borrow (4 idle GPUs, 12 + 1 <= 4 + 12), so only
    // `cutOff` stops it: the same pod under the default policy is lent.
    now += 600_000;
    st.set_now(now);
    st.lease.on_lease(with_limit(2, 12_000), now);
    let again = submit(&mut c, &mut st, 18, 20, &mut now);
    assert!(
        again.iter().all(|o| *o != Outcome::Allowed),
        "a fresh lease lends nothing: {again:?}"
    );
    st.set_policy(Policy::from_yaml(POLICY).expect("policy"));
    assert_eq!(
        submit(&mut c, &mut st, 20, 21, &mut now),
        [Outcome::Allowed],
        "lendWhen: always lends here"
    );
    assert!(st.is_borrowed("training/t20"));
    st.set_policy(Policy::from_yaml(&policy).expect("policy"));
    let borrowed: Vec<String> = (0..21)
        .map(|i| format!("training/t{i:02}"))
        .filter(|k| st.is_borrowed(k))
        .collect();
    assert_eq!(borrowed.len(), 9, "{borrowed:?}");
    inference_takes_back_borrowed_gpus(&mut c, &mut st, now, &borrowed);
}

/// Inference submits 4 x 2 GPUs within its budget of 8 on a cluster where training
/// borrowed: within ten minutes all of them run, and only pods in `borrowed` were
/// evicted (at least one).
fn inference_takes_back_borrowed_gpus(c: &mut SimCluster, st: &mut AgentState, now: Millis, borrowed: &[String]) {
    for i in 0..4 {
        assert_eq!(
            c.submit(st, &SimPod::gpus("inference", &format!("i{i}"), 2, 86_400_000, 100)),
            Outcome::Allowed
        );
    }
    c.bind(st, now);
    let run = drive(c, st, now, 600, |_, _, _| {});
    let gone: Vec<String> = run.evictions.iter().map(|e| e.1.clone()).collect();
    assert!(!gone.is_empty(), "nothing taken back");
    assert!(
        gone.iter().all(|k| borrowed.contains(k)),
        "only borrowed pods are evicted: {gone:?}"
    );
    assert_eq!(
        st.inuse("inference"),
        8_000,
        "all of inference's pods within its budget run"
    );
}
