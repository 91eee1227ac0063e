//! End to end with the real control plane: 3 `kvota server` nodes in this process (real
//! loopback gRPC, real data directories), 2 agents with simulated clusters. A burst of 200 GPU pods
//! never takes a tenant above its budget or its maxShare; an agent cut off from the
//! control plane (its connections dropped by a real TCP proxy) keeps enforcing, falling
//! back to its safe budget; after it reconnects, the control plane's ledger holds exactly
//! the usage the clusters produced. And a standby replica taking over from a leader that
//! died between reports counts the stretch the leader never reported, once.

/// The demo's fault proxy (`kvota demo` ships it; the binary has no library to import).
/// This test does not ask whether a link is cut, as the demo does.
#[path = "../src/demo/link.rs"]
#[allow(dead_code)]
mod link;

use kvota_fairness::names::PodKey;
use kvota_fairness::names::{ClusterName, TenantName};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvota_client::client::Client;
use kvota_control_plane::server::ServerHandle;
use kvota_fairness::lease::LeaseStatus;
use kvota_member_agent::agent::Agent;
use kvota_member_agent::review::Outcome;
use kvota_member_agent::sim::{SimCluster, SimPod};
use kvota_proto::v1;
use link::LinkProxy;

const POLICY: &str = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: e2e}
spec:
  decayHalfLife: 24h
  lease: {duration: 3s, clockSkewMargin: 300ms}
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, preemptible: true, namespaces: [ml]}
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, namespaces: [serving]}
  - {name: research, weight: 10, minShare: 5, maxShare: 25, preemptible: true, namespaces: [lab]}
";

/// Three control-plane nodes in this process (see `kvota_testkit::Cluster`).
async fn control_plane() -> (kvota_testkit::Cluster, Vec<String>) {
    let cl = kvota_testkit::Cluster::start(3).await;
    let endpoints = cl.endpoints();
    (cl, endpoints)
}

/// Applies [`POLICY`] once the control plane has elected a leader (15 s at most).
async fn apply_policy(endpoints: &[String]) {
    let admin = Client::new(endpoints).expect("client");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let y = POLICY.to_string();
        let r = admin
            .call(|ch| {
                let y = y.clone();
                async move {
                    Ok(Client::admin(ch)
                        .apply_policy(v1::PolicyRequest { yaml: y })
                        .await?
                        .into_inner())
                }
            })
            .await;
        if r.is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "no leader: {r:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn gpu_capacity(gpus: u64) -> BTreeMap<String, u64> {
    [("nvidia.com/gpu".to_string(), gpus * 1000)].into()
}

/// One round for an agent: report (errors are fine while cut off) and let the
/// simulated cluster move on.
async fn round(agent: &Agent, sim: &mut SimCluster) {
    let _ = agent.report_once().await;
    let mut st = agent.state();
    let now = st.now_ms();
    sim.step(&mut st, now);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn burst_partition_and_heal_keep_budgets_and_lose_no_usage() {
    let tmp = tempfile::tempdir().expect("tmp");
    let (cl, endpoints) = control_plane().await;
    let nodes: Vec<&ServerHandle> = cl.nodes.iter().flatten().collect();
    apply_policy(&endpoints).await;

    // Agent A reaches the control plane only through proxies we can cut.
    let mut proxies = Vec::new();
    for e in &endpoints {
        proxies.push(LinkProxy::start(e.clone()).await.expect("proxy"));
    }
    let a_eps: Vec<String> = proxies.iter().map(|p| p.addr().to_string()).collect();
    let a = Agent::open(
        &ClusterName::from_static("east"),
        gpu_capacity(32),
        &tmp.path().join("agent-east"),
        &a_eps,
    )
    .expect("agent a");
    let b = Agent::open(
        &ClusterName::from_static("west"),
        gpu_capacity(32),
        &tmp.path().join("agent-west"),
        &endpoints,
    )
    .expect("agent b");
    for ag in [&a, &b] {
        ag.register().await.expect("register");
        ag.fetch_policy().await.expect("policy");
    }
    let mut sim_a = SimCluster::new(&[8, 8, 8, 8]);
    let mut sim_b = SimCluster::new(&[8, 8, 8, 8]);
    let max_training = 38_400; // 60 % of 64 GPUs

    // Inference runs steadily in west.
    {
        let mut st = b.state();
        for i in 0..10 {
            let p = SimPod::gpus("serving", &format!("inf-{i}"), 1, 600_000, 100);
            sim_b.submit(&mut st, &p);
        }
    }
    // Monday 8 AM: 200 one-GPU training pods into east, a few per round; denied ones are
    // retried, as a job controller would.
    let mut next = 0;
    let mut admitted = 0;
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(8) {
        {
            let mut st = a.state();
            for _ in 0..20 {
                if next >= 200 {
                    break;
                }
                let p = SimPod::gpus("ml", &format!("train-{next}"), 1, 600_000, 0);
                let before = st.inuse("training");
                let budget = st.lease.budget("training", st.now_ms());
                let limit = st.lease.lease().map_or(0, |l| l.borrow("training"));
                match sim_a.submit(&mut st, &p) {
                    Outcome::Allowed => {
                        admitted += 1;
                        next += 1;
                        // Within the budget, or on GPUs lent within the lease's borrow limit
                        // (training is preemptible; the group runs at feature level 3).
                        if st.is_borrowed(&p.key()) {
                            assert!(
                                before + 1_000 <= budget + limit,
                                "borrowed past the limit: {before} + 1000 > {budget} + {limit}"
                            );
                        } else {
                            assert!(
                                before + 1_000 <= budget,
                                "admitted past the budget: {before} + 1000 > {budget}"
                            );
                        }
                    }
                    _ => break, // retry this pod next round
                }
            }
        }
        round(&a, &mut sim_a).await;
        round(&b, &mut sim_b).await;
        let total = a.state().bound("training") + b.state().bound("training");
        assert!(total <= max_training, "training holds {total} > maxShare");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        admitted >= 16,
        "the burst must get at least its guarantee's worth: {admitted}"
    );
    let held_before_cut = a.state().inuse("training");

    // Cut east off. Its lease expires (3 s) and it falls back to safe budgets.
    for p in &proxies {
        p.set_cut(true);
    }
    let cut_at = Instant::now();
    let mut denied_while_cut = 0;
    let mut admitted_cap = held_before_cut;
    while cut_at.elapsed() < Duration::from_secs(5) {
        {
            let mut st = a.state();
            let now = st.now_ms();
            let budget = st.lease.budget("training", now);
            let before = st.inuse("training");
            let p = SimPod::gpus("ml", &format!("train-cut-{denied_while_cut}"), 1, 600_000, 0);
            let out = sim_a.submit(&mut st, &p);
            if out == Outcome::Allowed {
                // Until the lease expires the last fresh budget applies (a slow machine may
                // not have filled it before the cut); after, the safe one.
                assert!(before + 1_000 <= budget, "partitioned agent admitted past its budget");
                admitted_cap = admitted_cap.max(before + 1_000);
            } else {
                denied_while_cut += 1;
            }
        }
        round(&a, &mut sim_a).await;
        round(&b, &mut sim_b).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    {
        let st = a.state();
        assert_eq!(
            st.lease.status(st.now_ms()),
            LeaseStatus::Safe,
            "lease must have expired while cut off"
        );
        let fallback = st.lease.budget("training", st.now_ms());
        assert!(
            fallback <= 6_400,
            "fallback {fallback} above the safe budget (20% of 32 GPUs)"
        );
        assert!(
            st.inuse("training") <= admitted_cap.max(fallback),
            "nothing beyond what each admission's budget allowed: {} > max({admitted_cap}, {fallback})",
            st.inuse("training")
        );
    }
    assert!(a.backlog() > 0, "reports pile up in the journal while cut off");
    assert!(denied_while_cut > 0);
    // Reclaim acts locally while cut off; its audit record travels with the journal.
    let evicted_while_cut = kvota_member_agent::state::ReclaimRecord {
        at_ms: a.state().now_ms(),
        for_tenant: TenantName::from_static("inference"),
        for_pod: PodKey::from_static("serve/api-0"),
        victim: PodKey::from_static("train/t-cut"),
        victim_tenant: TenantName::from_static("training"),
        gpue: 1_000,
        outcome: kvota_fairness::federation::EvictionOutcome::Evicted,
        why: "recorded while the link was cut".into(),
    };
    a.state().record_eviction(evicted_while_cut);
    round(&a, &mut sim_a).await;

    // Heal: the journal drains, the control plane catches up.
    for p in &proxies {
        p.set_cut(false);
    }
    let healed = Instant::now();
    while a.backlog() > 0 || b.backlog() > 0 {
        assert!(
            healed.elapsed() < Duration::from_secs(20),
            "journal did not drain: {}",
            a.backlog()
        );
        round(&a, &mut sim_a).await;
        round(&b, &mut sim_b).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    {
        let st = a.state();
        assert_ne!(
            st.lease.status(st.now_ms()),
            LeaseStatus::Safe,
            "fresh lease after healing"
        );
    }

    // The ledger holds the usage the clusters produced: every report once, none lost.
    let fed = nodes[0].ctx.state.read().await.federation.clone();
    let produced = {
        let mut p = a.written_usage();
        for (t, u) in b.written_usage() {
            *p.entry(t).or_default() += u;
        }
        p
    };
    for (tenant, want) in &produced {
        let got = fed.ledger().entries().get(tenant).map_or(0, |u| u.value_milli_gpue_ms);
        // Decay over ~20 s of a 24 h half-life (< 0.02 %) and one rounding per report.
        assert!(
            got <= *want && got as f64 >= *want as f64 * 0.9995 - 1_000.0,
            "{tenant}: ledger {got} vs produced {want}"
        );
    }
    assert!(produced.get("training").copied().unwrap_or(0) > 0);
    // The eviction made while cut off is in the federation's audit log exactly once.
    let cut_evictions: Vec<String> = fed
        .audit()
        .filter_map(|r| match &r.event {
            kvota_fairness::federation::AuditEvent::Eviction { cluster, note } if note.victim == "train/t-cut" => {
                Some(cluster.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(cut_evictions, vec![a.cluster().to_string()]);
    drop(nodes);
    cl.shutdown().await;
}

/// The training usage the control-plane nodes agree on, once all of them applied the
/// same (a follower may trail the leader by the entries in flight).
async fn agreed_training_usage(nodes: &[&ServerHandle]) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut seen = Vec::new();
        for n in nodes {
            let st = n.ctx.state.read().await;
            seen.push(
                st.federation
                    .ledger()
                    .entries()
                    .get("training")
                    .map_or(0, |u| u.value_milli_gpue_ms),
            );
        }
        if seen.iter().all(|&v| v == seen[0]) {
            return seen[0];
        }
        assert!(Instant::now() < deadline, "nodes disagree: {seen:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two replicas of one cluster's agent (as a leader-elected pair runs them): the leader
/// reports, then dies between two reports; the standby, which watched the same pods and
/// kept readings of its meter, takes over a while later. Its first report carries what
/// it metered since its reading nearest before the old leader's last applied report, and
/// the control plane counts only the part after it: the ledger then holds the usage the
/// pods produced through the standby's report, the dead leader's unreported last stretch
/// and the time until the takeover included, nothing counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_standby_that_takes_over_reports_what_the_dead_leader_did_not() {
    use kvota_member_agent::state::PodRec;
    let tmp = tempfile::tempdir().expect("tmp");
    let (cl, endpoints) = control_plane().await;
    let nodes: Vec<&ServerHandle> = cl.nodes.iter().flatten().collect();
    apply_policy(&endpoints).await;
    let leader = Agent::open(
        &ClusterName::from_static("north"),
        gpu_capacity(32),
        &tmp.path().join("agent-1"),
        &endpoints,
    )
    .expect("agent 1");
    let standby = Agent::open(
        &ClusterName::from_static("north"),
        gpu_capacity(32),
        &tmp.path().join("agent-2"),
        &endpoints,
    )
    .expect("agent 2");
    leader.register().await.expect("register");
    for ag in [&leader, &standby] {
        ag.fetch_policy().await.expect("policy");
    }
    // 4 training GPUs bound the whole time; both replicas see them (each lists the pods).
    let bound = Instant::now();
    for ag in [&leader, &standby] {
        ag.state().pod_bound(
            &PodKey::from_static("ml/train-0"),
            PodRec {
                tenant: Some(TenantName::from_static("training")),
                gpue: 4_000,
            },
        );
    }
    let rate = 4_000u64; // milli-GPUe per ms
    let round = Duration::from_millis(200);
    for _ in 0..8 {
        leader.report_once().await.expect("leader reports");
        standby.stand_by();
        tokio::time::sleep(round).await;
    }
    // The leader dies here, with ~200 ms metered and never reported. The standby keeps
    // its readings until its Lease wait is over.
    let died = Instant::now();
    drop(leader);
    while died.elapsed() < Duration::from_millis(1_500) {
        standby.stand_by();
        tokio::time::sleep(round).await;
    }
    let reported_before = agreed_training_usage(&nodes).await;
    standby.took_over();
    // The first attempt renumbers its reports after the old leader's; the next applies.
    let mut ok = false;
    for _ in 0..5 {
        if standby.report_once().await.is_ok() {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let produced = rate * u64::try_from(bound.elapsed().as_millis()).expect("ms");
    assert!(ok, "the standby's reports were never applied");
    let got = agreed_training_usage(&nodes).await;
    // Without the takeover carry-over the ledger would miss the last ~1.7 s of ~3.5 s.
    let missed_by_old_behaviour = rate * 1_700;
    assert!(
        got > reported_before + missed_by_old_behaviour,
        "takeover counted {} after {reported_before}",
        got - reported_before
    );
    // Both meters ran at the same rate, so the pro-rata cut is exact up to the clocks'
    // milliseconds and the time the retries took (a few report round trips).
    let slack = rate * 300;
    assert!(
        got <= produced && got + slack >= produced,
        "ledger {got} vs produced {produced} (off by {} ms of usage)",
        (produced as i64 - got as i64) / rate as i64
    );
    drop(nodes);
    cl.shutdown().await;
}
