//! Budgets sized to waiting pods: a tenant's entitlement split across clusters in
//! proportion to pending demand can leave no cluster with room for its largest pod (an
//! 8-GPU job behind a 4 + 4 split waits forever). Once budgets are sized
//! ([`Federation::enable_sized_budgets`]), the largest waiting pod that fits the tenant's
//! room gets it in its own cluster.

use kvota_fairness::names::ClusterName;
use kvota_fairness::names::TenantName;
use std::collections::BTreeMap;

use kvota_fairness::federation::{Applied, Command, Federation, TenantReport, UsageReport};
use kvota_fairness::lease::Lease;
use kvota_fairness::policy::Policy;

/// Two tenants on two clusters of 16 GPUs: `train` may hold at most 25 % (8 GPUs),
/// `serve` wants nothing now.
const POLICY: &str = include_str!("fixtures/sized.yaml");

fn register(fed: &mut Federation, cluster: &str, gpus: u64) -> Lease {
    let capacity = [("nvidia.com/gpu".to_string(), gpus * 1000)].into();
    match fed.apply(
        0,
        Command::RegisterCluster {
            cluster: ClusterName::parse(cluster).expect("name"),
            capacity,
            labels: BTreeMap::new(),
        },
    ) {
        Ok(Applied::Registered(l)) => l,
        other => panic!("{other:?}"),
    }
}

/// One report of `train`'s numbers in GPUs: (in use, pending, largest waiting pod).
fn report(
    fed: &mut Federation,
    cluster: &str,
    seq: u64,
    epoch: u64,
    (inuse, pending, largest): (u64, u64, u64),
) -> Lease {
    let row = TenantReport {
        used_milli_gpue_ms: 0,
        inuse: inuse * 1000,
        pending: pending * 1000,
        largest: largest * 1000,
        borrowed: 0,
    };
    let tenants = [(TenantName::from_static("train"), row)].into();
    let r = UsageReport {
        cluster: ClusterName::parse(cluster).expect("name"),
        seq,
        held_epoch: epoch,
        capacity: None,
        tenants,
        evictions: Vec::new(),
        decisions: Vec::new(),
        window: None,
        status: None,
    };
    match fed.apply(1_000 * seq, Command::Report(r)) {
        Ok(Applied::Reported { lease, .. }) => lease,
        other => panic!("{other:?}"),
    }
}

/// `train`'s budgets (east, west) in GPUe after each cluster reported its row (in use,
/// pending, largest waiting pod; GPUs) three times.
fn run(sized: bool, gpus: (u64, u64), east_row: (u64, u64, u64), west_row: (u64, u64, u64)) -> (Federation, u64, u64) {
    let mut fed = Federation::new();
    fed.apply(0, Command::ApplyPolicy(Policy::from_yaml(POLICY).expect("policy")))
        .expect("policy");
    if sized {
        fed.enable_sized_budgets();
    }
    let (mut east, mut west) = (register(&mut fed, "east", gpus.0), register(&mut fed, "west", gpus.1));
    for seq in 1..=3 {
        east = report(&mut fed, "east", seq, east.epoch, east_row);
        west = report(&mut fed, "west", seq, west.epoch, west_row);
    }
    let (e, w) = (east.budgets["train"].budget, west.budgets["train"].budget);
    (fed, e, w)
}

/// `train` waits with one 8-GPU job in `east` and four 2-GPU pods in `west`.
fn budgets(sized: bool) -> (Federation, u64, u64) {
    run(sized, (16, 16), (0, 8, 8), (0, 8, 2))
}

#[test]
fn the_largest_waiting_pod_that_fits_the_entitlement_gets_room_in_its_cluster() {
    let (fed, e, w) = budgets(false);
    assert_eq!(fed.committed()["train"], 8_000, "train is entitled to its maxShare");
    // Unsized: in proportion to pending demand, and the 8-GPU job fits nowhere.
    assert_eq!((e, w), (4_000, 4_000));

    let (fed, e, w) = budgets(true);
    assert!(fed.sizes_budgets());
    assert_eq!(fed.committed()["train"], 8_000);
    assert_eq!((e, w), (8_000, 0), "the job's cluster holds the whole entitlement");
    assert!(fed.check_safety().is_empty(), "{:?}", fed.check_safety());
}

#[test]
fn a_pod_above_the_room_or_its_cluster_moves_nothing() {
    // A 9-GPU pod can never run under train's maxShare of 8 GPUs; the next largest
    // waiting pod (1 GPU, in west) fits its budget already: the split stands.
    let (_, e, w) = run(true, (16, 16), (0, 9, 9), (0, 9, 1));
    assert_eq!((e, w), (4_000, 4_000));
    // A 6-GPU pod in a cluster of 4 GPUs can never start there: nothing moves to it.
    let plain = run(false, (4, 60), (0, 6, 6), (0, 20, 1));
    let sized = run(true, (4, 60), (0, 6, 6), (0, 20, 1));
    assert_eq!((sized.1, sized.2), (plain.1, plain.2));
    assert!(sized.1 < 6_000, "{sized:?}");
    // The same pod in a cluster it fits gets its room.
    let (_, e, _) = run(true, (8, 56), (0, 6, 6), (0, 20, 1));
    assert!(e >= 6_000, "{e}");
}

#[test]
fn before_the_switch_the_largest_pod_is_not_even_kept() {
    let (fed, ..) = budgets(false);
    assert!(fed
        .clusters()
        .values()
        .all(|c| c.usage.values().all(|u| u.largest == 0)));
    let (fed, ..) = budgets(true);
    assert_eq!(fed.clusters()["east"].usage["train"].largest, 8_000);
    // The state says it sizes, in its own encoding, so a replica restored from it does too.
    let text = serde_json::to_string(&fed).expect("encode");
    let back: Federation = serde_json::from_str(&text).expect("decode");
    assert!(back.sizes_budgets());
    let old: Federation =
        serde_json::from_str(&serde_json::to_string(&budgets(false).0).expect("encode")).expect("decode");
    assert!(!old.sizes_budgets());
}
