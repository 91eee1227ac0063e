//! What the state machine does per usage report: validate it, add its usage to the
//! ledger, recompute the plan and grant the reporting cluster a lease, at T tenants x C
//! clusters, every tenant named in every report (as `kvota/benches/sizing.rs` sends
//! them), the federation at the newest feature level (records, lending, sizing on).
//!
//! Run: `cargo bench -p kvota-fairness --bench report`. The goal: the cost per
//! report must not grow with T x C; compare the rows.

use kvota_fairness::names::{ClusterName, TenantName};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kvota_fairness::federation::{Applied, Command, Federation, TenantReport, UsageReport, UsageWindow};
use kvota_fairness::policy::Policy;

fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn tenant(i: usize) -> TenantName {
    TenantName::parse(format!("team-{i:05}")).expect("a label")
}

fn policy(t: usize) -> Policy {
    let min_bp = 5_000 / t.max(1);
    let mut y = String::from("apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata:\n  name: bench\nspec:\n  decayHalfLife: \"24h\"\n  tenants:\n");
    for i in 0..t {
        let w = 1 + mix(i as u64) % 4;
        y.push_str(&format!(
            "  - {{name: {}, weight: {w}, minShare: {}.{:02}}}\n",
            tenant(i),
            min_bp / 100,
            min_bp % 100
        ));
    }
    Policy::from_yaml(&y).unwrap_or_else(|e| panic!("generated policy: {e}"))
}

const GPUS_PER_CLUSTER: u64 = 256;
const INTERVAL_MS: u64 = 5_000;

/// Cluster `c`'s report `seq`: every tenant, ~90 % of the GPUs in use spread unevenly,
/// some pending, moving a little between reports.
fn report(c: usize, seq: u64, epoch: u64, t: usize, now: u64) -> Command {
    let busy = GPUS_PER_CLUSTER * 1000 * 9 / 10;
    let weights: Vec<u64> = (0..t).map(|i| 1 + mix((c * 100_003 + i) as u64) % 16).collect();
    let total: u64 = weights.iter().sum();
    let tenants: BTreeMap<TenantName, TenantReport> = (0..t)
        .map(|i| {
            let jitter = mix(seq ^ (((c * 7_919 + i) as u64) << 20)) % 200;
            let inuse = (busy * weights[i] / total.max(1)) * (900 + jitter) / 1_000;
            let pending = inuse * (mix(seq.wrapping_add(i as u64)) % 60) / 100;
            (
                tenant(i),
                TenantReport {
                    used_milli_gpue_ms: inuse * INTERVAL_MS,
                    inuse,
                    pending,
                    largest: pending.min(1_000),
                    borrowed: 0,
                },
            )
        })
        .collect();
    Command::Report(UsageReport {
        cluster: ClusterName::parse(format!("c{c:03}")).expect("name"),
        seq,
        held_epoch: epoch,
        capacity: None,
        tenants,
        evictions: Vec::new(),
        decisions: Vec::new(),
        window: Some(UsageWindow {
            start_ms: now.saturating_sub(INTERVAL_MS),
            end_ms: now,
        }),
        status: None,
    })
}

/// A federation of `t` tenants and `c` clusters after two report rounds, with each
/// cluster's next sequence number and held epoch.
fn federation(t: usize, c: usize) -> (Federation, Vec<(u64, u64)>, u64) {
    let mut fed = Federation::default();
    fed.enable_records();
    fed.enable_lending();
    fed.enable_borrow_cap();
    fed.enable_sized_budgets();
    let mut now = 1_000;
    fed.apply(now, Command::ApplyPolicy(policy(t)))
        .unwrap_or_else(|e| panic!("policy: {e}"));
    let mut next = Vec::new();
    for i in 0..c {
        let capacity = [("nvidia.com/gpu".to_string(), GPUS_PER_CLUSTER * 1000)].into();
        let epoch = match fed.apply(
            now,
            Command::RegisterCluster {
                cluster: ClusterName::parse(format!("c{i:03}")).expect("name"),
                capacity,
                labels: BTreeMap::new(),
            },
        ) {
            Ok(Applied::Registered(lease)) => lease.epoch,
            other => panic!("register: {other:?}"),
        };
        next.push((1, epoch));
    }
    for _ in 0..2 {
        for i in 0..c {
            now += INTERVAL_MS / c as u64;
            step(&mut fed, &mut next, i, t, now);
        }
    }
    (fed, next, now)
}

fn step(fed: &mut Federation, next: &mut [(u64, u64)], i: usize, t: usize, now: u64) {
    let (seq, epoch) = next[i];
    match fed.apply(now, report(i, seq, epoch, t, now)) {
        Ok(Applied::Reported { lease, .. }) => next[i] = (seq + 1, lease.epoch),
        other => panic!("report: {other:?}"),
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("apply_report");
    g.sample_size(10).measurement_time(Duration::from_secs(5));
    for (t, cl) in [(100, 8), (1_000, 16), (1_000, 64), (1_000, 256)] {
        let (mut fed, mut next, mut now) = federation(t, cl);
        let open: usize = fed.clusters().values().map(|r| r.leases.open.len()).sum();
        let entries: usize = fed
            .clusters()
            .values()
            .flat_map(|r| r.leases.open.iter())
            .map(|l| l.budgets.len())
            .sum();
        // What a snapshot of this state costs: its size, and decoding it (most of
        // installing one on a new node, besides the transfer and one file write).
        let json = serde_json::to_vec(&fed).unwrap_or_default();
        let t0 = Instant::now();
        let back: Federation = serde_json::from_slice(&json).unwrap_or_else(|e| panic!("decode: {e}"));
        let decode = t0.elapsed();
        assert!(back == fed, "the state reads back as written");
        eprintln!(
            "{t}x{cl}: {open} open leases, {entries} budget entries; state as JSON {:.1} MiB, decoded in {:.0} ms",
            json.len() as f64 / (1024.0 * 1024.0),
            decode.as_secs_f64() * 1_000.0
        );
        let mut i = 0;
        g.bench_function(BenchmarkId::from_parameter(format!("{t}x{cl}")), |b| {
            b.iter_custom(|iters| {
                // The reports are built outside the timed part.
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    now += INTERVAL_MS / cl as u64;
                    let (seq, epoch) = next[i];
                    let cmd = report(i, seq, epoch, t, now);
                    let start = Instant::now();
                    let r = fed.apply(now, cmd);
                    spent += start.elapsed();
                    match black_box(r) {
                        Ok(Applied::Reported { lease, .. }) => next[i] = (seq + 1, lease.epoch),
                        other => panic!("report: {other:?}"),
                    }
                    i = (i + 1) % cl;
                }
                spent
            });
        });
    }
    g.finish();
    // What the audit log holds after the benchmark's reports: every changed tenant of a
    // lease with a notable change is recorded, drift included.
    for (t, cl) in [(1_000, 64)] {
        let (mut fed, mut next, mut now) = federation(t, cl);
        for k in 0..(4 * cl) {
            now += INTERVAL_MS / cl as u64;
            step(&mut fed, &mut next, k % cl, t, now);
        }
        let (mut records, mut changes, mut notable, mut bytes) = (0, 0, 0, 0);
        for r in fed.audit() {
            if let kvota_fairness::federation::AuditEvent::BudgetsChanged { changes: c, .. } = &r.event {
                records += 1;
                changes += c.len();
                notable += c
                    .iter()
                    .filter(|x| {
                        x.from.abs_diff(x.to) >= kvota_fairness::federation::AUDIT_MIN_CHANGE
                            || x.from == 0
                            || x.to == 0
                    })
                    .count();
                bytes += serde_json::to_vec(r).map_or(0, |v| v.len());
            }
        }
        eprintln!("{t}x{cl} after {} reports: {records} budget records, {changes} changes ({notable} notable), {:.1} MiB as JSON", 6 * cl, bytes as f64 / (1024.0 * 1024.0));
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
