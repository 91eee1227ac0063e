//! Committed entitlement rising into freed capacity: in proportion to the shortfall
//! (levels 1 to 7), or the smallest shortfalls filled whole first
//! ([`Federation::enable_small_first`], level 8). With one GPU freed and two tenants
//! short by one GPU and one and a half, the proportional rule gives them 0.4 and 0.6 of
//! a GPU (neither can start a one-GPU pod); filling the smallest first gives the first
//! a whole GPU.

use std::collections::BTreeMap;

use kvota_fairness::federation::{Applied, Command, Federation, TenantReport, UsageReport};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::Policy;

const POLICY: &str = "apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: small-first}
spec:
  lease: {duration: 30s}
  tenants:
  - {name: a, weight: 1, minShare: 0, maxShare: 100, preemptible: false}
  - {name: b, weight: 1, minShare: 0, maxShare: 100, preemptible: false}
  - {name: c, weight: 1, minShare: 0, maxShare: 100, preemptible: false}
";

/// One report at `now_ms` of each tenant's (in use, pending) in GPUs.
fn report(fed: &mut Federation, now_ms: u64, seq: u64, epoch: u64, rows: &[(&'static str, u64, u64)]) -> u64 {
    let tenants = rows
        .iter()
        .map(|&(t, inuse, pending)| {
            (
                TenantName::from_static(t),
                TenantReport {
                    used_milli_gpue_ms: 0,
                    inuse: inuse * 1000,
                    pending: pending * 1000,
                    largest: if pending > 0 { 1000 } else { 0 },
                    borrowed: 0,
                },
            )
        })
        .collect();
    let r = UsageReport {
        cluster: ClusterName::from_static("one"),
        seq,
        held_epoch: epoch,
        capacity: None,
        tenants,
        evictions: Vec::new(),
        decisions: Vec::new(),
        window: None,
        status: None,
    };
    match fed.apply(now_ms, Command::Report(r)) {
        Ok(Applied::Reported { lease, .. }) => lease.epoch,
        other => panic!("{other:?}"),
    }
}

/// b's and c's committed entitlement (GPUe) once a's fourth pod has ended.
fn committed_after_a_pod_ends(small_first: bool) -> (u64, u64, Federation) {
    let mut fed = Federation::new();
    fed.apply(0, Command::ApplyPolicy(Policy::from_yaml(POLICY).expect("policy")))
        .expect("policy");
    fed.enable_sized_budgets();
    if small_first {
        fed.enable_small_first();
    }
    let capacity = [("nvidia.com/gpu".to_string(), 4_000)].into();
    let mut epoch = match fed.apply(
        0,
        Command::RegisterCluster {
            cluster: ClusterName::from_static("one"),
            capacity,
            labels: BTreeMap::new(),
        },
    ) {
        Ok(Applied::Registered(l)) => l.epoch,
        other => panic!("{other:?}"),
    };
    // a takes the whole cluster; then b (1 GPU) and c (2 GPUs) wait: the targets are
    // b 1, c 1.5, a 1.5, but a's four running pods hold its committed entitlement at 4.
    epoch = report(&mut fed, 1_000, 1, epoch, &[("a", 0, 4)]);
    epoch = report(&mut fed, 2_000, 2, epoch, &[("a", 4, 0), ("b", 0, 1), ("c", 0, 2)]);
    assert_eq!(fed.committed()["a"], 4_000);
    assert!(!fed.committed().contains_key("b"));
    // One of a's pods ends; once the leases that let a hold four have run out, one GPU
    // is free to commit.
    for (i, now) in (3..).zip([40_000, 80_000, 120_000]) {
        epoch = report(&mut fed, now, i, epoch, &[("a", 3, 0), ("b", 0, 1), ("c", 0, 2)]);
    }
    let get = |t: &str| fed.committed().get(t).copied().unwrap_or(0);
    (get("b"), get("c"), fed)
}

#[test]
fn freed_capacity_fills_the_smallest_shortfall_whole_first() {
    let (b, c, fed) = committed_after_a_pod_ends(false);
    assert_eq!(fed.committed()["a"], 3_000);
    assert_eq!((b, c), (400, 600), "in proportion to the shortfalls 1 and 1.5");

    let (b, c, fed) = committed_after_a_pod_ends(true);
    assert!(fed.fills_small_first());
    assert_eq!(fed.committed()["a"], 3_000);
    assert_eq!((b, c), (1_000, 0), "b's whole GPU first");
    assert!(fed.check_safety().is_empty(), "{:?}", fed.check_safety());
}
