//! Demand the control plane has not seen brings the next report forward: an agent that
//! denies a pod (or queues one) starts its next round a short gap after the last one
//! instead of a whole interval later, so a tenant without budget in this cluster gets
//! one within a round trip; with nothing denied, rounds keep the interval. Real timers,
//! a real agent state and simulated pods (no control plane is needed to time rounds).

use kvota_fairness::names::ClusterName;
use std::time::Duration;

use kvota_fairness::policy::Policy;
use kvota_member_agent::agent::Agent;
use kvota_member_agent::review::Outcome;
use kvota_member_agent::runtime::early_gap;
use kvota_member_agent::sim::{SimCluster, SimPod};
use tokio::time::Instant;

fn agent(dir: &std::path::Path) -> Agent {
    let a = Agent::open(
        &ClusterName::from_static("east"),
        [("nvidia.com/gpu".to_string(), 8_000)].into(),
        dir,
        &["127.0.0.1:1".to_string()],
    )
    .expect("agent");
    let policy = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: early}
spec:
  tenants:
  - {name: training, weight: 1, namespaces: [ml-team]}
";
    a.state().set_policy(Policy::from_yaml(policy).expect("policy"));
    a
}

#[tokio::test]
async fn a_denied_pod_brings_the_next_report_forward_and_nothing_else_does() {
    let tmp = tempfile::tempdir().expect("tmp");
    let a = agent(tmp.path());
    let every = Duration::from_millis(1_500);
    let gap = early_gap(every);
    assert_eq!(gap, Duration::from_millis(300));

    // Nothing denied: the round waits the whole interval.
    let last = Instant::now();
    a.next_round(last, every, gap).await;
    assert!(last.elapsed() >= every, "{:?}", last.elapsed());

    // A pod denied (no lease yet: no budget here): the next round starts after the gap.
    let mut sim = SimCluster::new(&[8]);
    let outcome = {
        let mut st = a.state();
        sim.submit(&mut st, &SimPod::gpus("ml-team", "train-0", 2, 60_000, 0))
    };
    assert_eq!(outcome, Outcome::Denied);
    let last = Instant::now();
    a.next_round(last, every, gap).await;
    let took = last.elapsed();
    assert!(took >= gap && took < every, "{took:?}");

    // The denial was carried by that round: the one after waits the interval again.
    let last = Instant::now();
    a.next_round(last, every, gap).await;
    assert!(last.elapsed() >= every, "{:?}", last.elapsed());

    // A flood of denials during a round costs one early round, not one per denial.
    for i in 0..50 {
        let mut st = a.state();
        sim.submit(&mut st, &SimPod::gpus("ml-team", &format!("flood-{i}"), 2, 60_000, 0));
    }
    let last = Instant::now();
    a.next_round(last, every, gap).await;
    assert!(last.elapsed() < every);
    let last = Instant::now();
    a.next_round(last, every, gap).await;
    assert!(last.elapsed() >= every, "{:?}", last.elapsed());
}

#[test]
fn the_gap_is_a_fifth_of_the_interval_and_at_least_100_ms() {
    assert_eq!(early_gap(Duration::from_secs(5)), Duration::from_secs(1));
    assert_eq!(early_gap(Duration::from_millis(300)), Duration::from_millis(100));
}
