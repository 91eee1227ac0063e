//! Entitlement + budget split for T tenants x C clusters: the work the control-plane
//! leader does on each recompute. Target: < 10 ms for 10,000 x 100 on one core, growing
//! linearly in T x C.
//!
//! Run: `cargo bench -p kvota-fairness --bench entitlement`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvota_fairness::entitlement::{compute, TenantInput};
use kvota_fairness::split::{split_tenant, Cell};

/// Small deterministic generator (the bench must not depend on a random crate's
/// version to produce the same inputs).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

struct Input {
    capacity: u64,
    tenants: Vec<TenantInput>,
    /// Row-major: tenant t's cells are `cells[t*C..(t+1)*C]`.
    cells: Vec<Cell>,
    clusters: usize,
}

fn input(tenants: usize, clusters: usize) -> Input {
    let mut rng = Lcg(42);
    let per_cluster_gpus = 64 * (tenants as u64 / clusters as u64).max(1);
    let capacity = per_cluster_gpus * 1000 * clusters as u64;
    // Guarantees: half the tenants get one, summing to 50 %.
    let guaranteed = (tenants / 2).max(1);
    let min_bp = u32::try_from(5_000 / guaranteed).unwrap_or(0);
    let mut ts = Vec::with_capacity(tenants);
    let mut cells = Vec::with_capacity(tenants * clusters);
    for i in 0..tenants {
        let mut demand = 0;
        for _ in 0..clusters {
            // About a third of (tenant, cluster) pairs have work.
            let (inuse, d) = if rng.below(3) == 0 {
                let inuse = rng.below(8) * 1000;
                (inuse, inuse + rng.below(16) * 1000)
            } else {
                (0, 0)
            };
            demand += d;
            cells.push(Cell::new(inuse, d));
        }
        ts.push(TenantInput {
            weight_milli: 1_000 + rng.below(99_000),
            min_share_bp: if i < guaranteed { min_bp } else { 0 },
            max_share_bp: 10_000,
            demand,
            usage: rng.below(1 << 40),
        });
    }
    Input {
        capacity,
        tenants: ts,
        cells,
        clusters,
    }
}

/// Entitlements, then every tenant's budget in every cluster.
fn plan(inp: &Input, budgets: &mut [u64]) {
    let ent = compute(inp.capacity, &inp.tenants);
    let c = inp.clusters;
    for (t, e) in ent.iter().enumerate() {
        split_tenant(
            e.total,
            &inp.cells[t * c..(t + 1) * c],
            &mut budgets[t * c..(t + 1) * c],
        );
    }
}

fn bench(cr: &mut Criterion) {
    let mut g = cr.benchmark_group("entitlement_and_split");
    for &(t, c) in &[(100usize, 10usize), (1_000, 100), (10_000, 10), (10_000, 100)] {
        let inp = input(t, c);
        let mut budgets = vec![0u64; t * c];
        g.throughput(Throughput::Elements((t * c) as u64));
        g.bench_with_input(BenchmarkId::from_parameter(format!("{t}x{c}")), &inp, |b, inp| {
            b.iter(|| {
                plan(black_box(inp), &mut budgets);
                black_box(&budgets);
            });
        });
    }
    g.finish();

    let mut g = cr.benchmark_group("entitlement_only");
    for &t in &[100usize, 10_000] {
        let inp = input(t, 10);
        g.bench_with_input(BenchmarkId::from_parameter(t), &inp, |b, inp| {
            b.iter(|| black_box(compute(inp.capacity, black_box(&inp.tenants))));
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
