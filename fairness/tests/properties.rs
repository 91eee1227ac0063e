//! Property tests for the fairness model: one test per guarantee of
//! `docs/guarantees.md`, "Entitlement" (G1-G7), plus the budget split and the admission decision.

use kvota_fairness::admission::{borrow_room, decide, lendable, LocalView, PodRequest, Reason, Verdict};
use kvota_fairness::entitlement::{compute, share_of, water_fill, TenantInput};
use kvota_fairness::lease::LeaseStatus;
use kvota_fairness::names::ClusterName;
use kvota_fairness::names::TenantName;
use kvota_fairness::policy::AdmissionMode;
use kvota_fairness::split::{split_tenant, Cell};
use proptest::prelude::*;

/// A valid set of tenants: weights > 0, min <= max, sum of mins <= 100 %.
fn tenants(max_n: usize) -> impl Strategy<Value = Vec<TenantInput>> {
    prop::collection::vec(
        (
            1u64..200_000,
            0u32..=10_000,
            0u32..=10_000,
            0u64..200_000,
            0u64..(1 << 40),
            any::<bool>(),
        ),
        1..max_n,
    )
    .prop_map(|raw| {
        let n = u32::try_from(raw.len()).unwrap_or(u32::MAX);
        raw.into_iter()
            .map(|(w, a, b, d, u, zero_usage)| {
                let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
                // Keep the sum of minimum shares within 100 %.
                let lo = lo / n;
                TenantInput {
                    weight_milli: w,
                    min_share_bp: lo,
                    max_share_bp: hi.max(lo),
                    demand: d,
                    usage: if zero_usage { 0 } else { u },
                }
            })
            .collect()
    })
}

fn capacity() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..1_000, 1_000u64..2_000_000]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    /// Property 1, guarantee: `E_t >= min(D_t, m_t * G)`.
    #[test]
    fn p1_guarantee(g in capacity(), ts in tenants(40)) {
        let e = compute(g, &ts);
        for (t, x) in ts.iter().zip(&e) {
            prop_assert!(x.total >= t.demand.min(share_of(g, t.min_share_bp)), "{t:?} -> {x:?}");
        }
    }

    /// Property 2, cap: `E_t <= min(D_t, M_t * G)`.
    #[test]
    fn p2_cap(g in capacity(), ts in tenants(40)) {
        let e = compute(g, &ts);
        for (t, x) in ts.iter().zip(&e) {
            prop_assert!(x.total <= t.demand.min(share_of(g, t.max_share_bp)), "{t:?} -> {x:?}");
        }
    }

    /// Property 3, capacity: `sum E_t <= G`.
    #[test]
    fn p3_capacity(g in capacity(), ts in tenants(40)) {
        let sum: u64 = compute(g, &ts).iter().map(|x| x.total).sum();
        prop_assert!(sum <= g);
    }

    /// Property 4, work conservation: if some tenant is below `min(D, M*G)`, all of `G`
    /// is handed out.
    #[test]
    fn p4_work_conservation(g in capacity(), ts in tenants(40)) {
        let e = compute(g, &ts);
        let starved = ts.iter().zip(&e).any(|(t, x)| x.total < t.demand.min(share_of(g, t.max_share_bp)));
        if starved {
            prop_assert_eq!(e.iter().map(|x| x.total).sum::<u64>(), g);
        }
    }

    /// Property 5a, decay bias: using more (others unchanged) never raises a tenant's
    /// entitlement (up to one milli-GPUe of rounding).
    #[test]
    fn p5_more_usage_never_helps(g in 1_000u64..2_000_000, ts in tenants(12), who in any::<prop::sample::Index>(), extra in 1u64..(1 << 40)) {
        let i = who.index(ts.len());
        let before = compute(g, &ts)[i].total;
        let mut more = ts.clone();
        more[i].usage = more[i].usage.saturating_add(extra);
        let after = compute(g, &more)[i].total;
        prop_assert!(after <= before + 1, "usage up, entitlement {before} -> {after}");
    }

    /// Property 5b: with usage in proportion to weights (or none), and nobody capped or
    /// guaranteed, the split follows the weights exactly (to one milli-GPUe).
    #[test]
    fn p5_equal_usage_follows_weights(g in 1_000u64..2_000_000, ws in prop::collection::vec(1u64..1000, 2..12), k in 0u64..4) {
        let ts: Vec<TenantInput> = ws.iter().map(|&w| TenantInput {
            weight_milli: w * 1000,
            min_share_bp: 0,
            max_share_bp: 10_000,
            demand: g, // everyone wants everything
            usage: w * k * 1_000_000,
        }).collect();
        let e = compute(g, &ts);
        let wsum: u64 = ws.iter().sum();
        for (w, x) in ws.iter().zip(&e) {
            let exact = g as f64 * *w as f64 / wsum as f64;
            prop_assert!((x.total as f64 - exact).abs() <= 1.0, "weight {w}: {} vs {exact}", x.total);
        }
    }

    /// Property 6, determinism: the same inputs give the same bits (run twice, and on a
    /// copy that went through serialization, as Raft replicas would).
    #[test]
    fn p6_determinism(g in capacity(), ts in tenants(40)) {
        let json = serde_json::to_string(&ts).expect("serialize");
        let copy: Vec<TenantInput> = serde_json::from_str(&json).expect("deserialize");
        prop_assert_eq!(compute(g, &ts), compute(g, &copy));
    }

    /// Property 7, share decay not cliffs (the part the core owns): a tenant holding more
    /// than its amount gets budgets at or below what it runs in every cluster -- it is
    /// throttled, and nothing in the split asks for a pod to be removed.
    #[test]
    fn p7_over_share_is_throttled(amount in 0u64..100_000, cells in prop::collection::vec((0u64..50_000, 0u64..50_000), 1..20)) {
        let cells: Vec<Cell> = cells.into_iter().map(|(i, p)| Cell::new(i, i + p)).collect();
        let mut out = vec![0; cells.len()];
        split_tenant(amount, &cells, &mut out);
        let inuse: u64 = cells.iter().map(|c| c.inuse).sum();
        if inuse > amount {
            for (c, b) in cells.iter().zip(&out) {
                prop_assert!(*b <= c.inuse);
            }
            prop_assert_eq!(out.iter().sum::<u64>(), amount);
        } else {
            // Everyone keeps what it runs; the rest follows pending demand.
            for (c, b) in cells.iter().zip(&out) {
                prop_assert!(*b >= c.inuse && *b <= c.demand);
            }
            let demand: u64 = cells.iter().map(|c| c.demand).sum();
            prop_assert_eq!(out.iter().sum::<u64>(), amount.min(demand));
        }
    }

    /// Property 7, admission side: no pod is admitted beyond the tenant's budget, and a
    /// queue never grows past its bound.
    /// Borrowing admits a pod over budget only within the borrowable room.
    #[test]
    fn p7_admission_never_exceeds_budget(budget in 0u64..100_000, inuse in 0u64..100_000, gpue in 0u64..20_000, queued in 0u32..10, max_queued in 0u32..10, queue in any::<bool>(), borrow in prop_oneof![Just(0u64), 0u64..30_000]) {
        let view = LocalView {
            cluster: ClusterName::from_static("c"),
            tenant: Some(TenantName::from_static("t")),
            mode: if queue { AdmissionMode::Queue } else { AdmissionMode::Reject },
            max_queued,
            budget,
            inuse,
            queued,
            entitlement: budget,
            ceiling: None,
            lease: LeaseStatus::Safe,
            borrow,
        };
        let d = decide(&PodRequest { namespace: "n".into(), name: "p".into(), gpue }, &view);
        match d.verdict {
            Verdict::Allow if d.reason == Reason::Borrowed => prop_assert!(inuse + gpue > budget && gpue <= borrow),
            Verdict::Allow => prop_assert!(gpue == 0 || inuse + gpue <= budget),
            Verdict::Queue => prop_assert!(queue && queued < max_queued && inuse + gpue > budget),
            Verdict::Deny => prop_assert!(gpue > 0 && inuse + gpue > budget),
        }
    }

    /// Lending never hands out GPUs a budget of the cluster needs now, and borrowing
    /// never passes `budget + limit`.
    #[test]
    fn borrowing_stays_within_idle_capacity_and_the_limit(
        capacity in 0u64..200_000,
        tenants in prop::collection::vec((0u64..60_000, 0u64..60_000, 0u64..60_000), 0..8),
        limit in 0u64..50_000,
        pick in 0usize..8,
    ) {
        let lend = lendable(capacity, tenants.iter().copied());
        // Every tenant's in-use and the room its budget keeps for its waiting pods are
        // never lent.
        let claimed: u64 = tenants.iter().map(|&(i, p, b)| i + p.min(b.saturating_sub(i))).sum();
        prop_assert_eq!(lend, capacity.saturating_sub(claimed));
        if let Some(&(inuse, _, budget)) = tenants.get(pick) {
            let room = borrow_room(limit, budget, inuse, lend);
            prop_assert!(room <= lend);
            prop_assert!(inuse + room <= (budget + limit).max(inuse));
            if limit == 0 {
                prop_assert_eq!(room, 0);
            }
        }
    }

    /// The water-filling primitive: exact sum, within room, deterministic.
    #[test]
    fn water_fill_is_exact(amount_frac in 0u64..1000, room in prop::collection::vec(0u64..100_000, 1..30), ws in prop::collection::vec(1u64..1_000_000, 30)) {
        let total: u64 = room.iter().sum();
        prop_assume!(total > 0);
        let amount = total * amount_frac / 1000; // strictly below total
        let w = &ws[..room.len()];
        let out = water_fill(amount, &room, w);
        prop_assert_eq!(out.iter().sum::<u64>(), amount);
        for (o, r) in out.iter().zip(&room) {
            prop_assert!(o <= r);
        }
        // Max-min: a claimant below its room is not behind another by more than one unit
        // of its weight-normalised level.
        for i in 0..out.len() {
            for j in 0..out.len() {
                if out[i] < room[i] && out[j] > 0 {
                    let li = (out[i] + 1) as f64 / w[i] as f64;
                    let lj = out[j] as f64 / w[j] as f64;
                    prop_assert!(li + 1e-9 >= lj - 1.0 / w[j] as f64, "i {i} {li} j {j} {lj}");
                }
            }
        }
    }
}

/// The article's three tenants on 96 GPUs across three clusters of 32, through the whole
/// control-plane state machine: guarantees, surplus by weight, budgets by demand.
#[test]
fn article_worked_example_across_three_clusters() {
    use kvota_fairness::federation::{Applied, Command, Federation, TenantReport, UsageReport};
    use kvota_fairness::policy::Policy;
    use std::collections::BTreeMap;

    let mut fed = Federation::new();
    fed.apply(
        0,
        Command::ApplyPolicy(Policy::from_yaml(Policy::article_example_yaml()).expect("policy")),
    )
    .expect("apply");
    let mut epochs = BTreeMap::new();
    for c in ["c1", "c2", "c3"] {
        let capacity = [("nvidia.com/gpu".to_string(), 32_000)].into();
        match fed.apply(
            0,
            Command::RegisterCluster {
                cluster: ClusterName::parse(c).expect("name"),
                capacity,
                labels: BTreeMap::new(),
            },
        ) {
            Ok(Applied::Registered(l)) => epochs.insert(c, l.epoch),
            other => panic!("{other:?}"),
        };
    }
    // Monday 8 AM: training wants 64 GPUs in each cluster; inference runs 20 in c1 and
    // wants 10 more in c2; research runs 4 in c3.
    let want: BTreeMap<&str, Vec<(&str, u64, u64)>> = [
        ("c1", vec![("training", 0, 64_000), ("inference", 20_000, 0)]),
        ("c2", vec![("training", 0, 64_000), ("inference", 0, 10_000)]),
        ("c3", vec![("training", 0, 64_000), ("research", 4_000, 0)]),
    ]
    .into();
    for seq in 1..=4u64 {
        for (c, rows) in &want {
            let tenants = rows
                .iter()
                .map(|&(t, inuse, pending)| {
                    (
                        TenantName::from_static(t),
                        TenantReport {
                            used_milli_gpue_ms: 0,
                            inuse,
                            pending,
                            largest: 0,
                            borrowed: 0,
                        },
                    )
                })
                .collect();
            let r = UsageReport {
                cluster: ClusterName::from_static(c),
                seq,
                held_epoch: epochs[c],
                capacity: None,
                tenants,
                evictions: Vec::new(),
                decisions: Vec::new(),
                window: None,
                status: None,
            };
            match fed.apply(seq * 1000, Command::Report(r)) {
                Ok(Applied::Reported { lease, applied: true }) => {
                    epochs.insert(c, lease.epoch);
                }
                other => panic!("{other:?}"),
            }
            assert!(fed.check_safety().is_empty());
        }
    }
    // Guarantees: inference min(30, 38.4) = 30, research min(4, 4.8) = 4, training
    // min(192, 19.2) = 19.2. Surplus 96 - 53.2 = 42.8; inference and research are at
    // their demand, so training takes it up to its cap of 57.6 (60 %), not more.
    let committed = fed.committed();
    assert_eq!(committed["inference"], 30_000);
    assert_eq!(committed["research"], 4_000);
    assert_eq!(committed["training"], 57_600);
    // Budgets: inference keeps 20 in c1 and gets its 10 pending in c2; training's 57.6
    // split evenly by pending demand (19.2 each).
    let budget = |c: &str, t: &str| fed.clusters()[c].leases.latest().expect("lease").budgets[t].budget;
    assert_eq!(budget("c1", "inference"), 20_000);
    assert_eq!(budget("c2", "inference"), 10_000);
    assert_eq!(budget("c3", "research"), 4_000);
    for c in ["c1", "c2", "c3"] {
        assert_eq!(budget(c, "training"), 19_200, "{c}");
    }
    // Safe budgets: inference's 40 % of 32 GPUs = 12.8 per cluster, capped by its budget.
    let fallback = |c: &str, t: &str| fed.clusters()[c].leases.latest().expect("lease").budgets[t].fallback;
    assert_eq!(fallback("c1", "inference"), 12_800);
    assert_eq!(fallback("c3", "inference"), 0);
    assert_eq!(fallback("c1", "training"), 6_400);
    // The explanation carries the same numbers.
    let e = fed.explain_tenant("training").expect("explain");
    assert_eq!(
        (e.guarantee, e.cap, e.target, e.committed),
        (19_200, 57_600, 57_600, 57_600)
    );
    let text = e.to_string();
    assert!(text.contains("guarantee 19.2 + surplus 38.4 = 57.6"), "{text}");
}

proptest! {
    /// Sharing the free room of a cluster among tenants' releasable pods
    /// (`admission::share_room`): each tenant gets a prefix of its pods, never more than
    /// the room; all of them when all fit; and no tenant is passed over while one using
    /// a later place in line is served, unless its next pod did not fit.
    #[test]
    fn room_is_shared_smallest_fraction_of_budget_first(
        raw in prop::collection::vec(((any::<bool>(), any::<bool>(), prop_oneof![Just(0u32), 1u32..5_000]), 0u64..20_000, 0u64..20_000, prop::collection::vec(1u64..4_000, 0..8)), 0..8),
        room in 0u64..40_000,
    ) {
        use kvota_fairness::admission::{release_rank, share_room, RoomClaim};
        let claims: Vec<RoomClaim> = raw
            .into_iter()
            .map(|((urgent, preemptible, min_share_bp), inuse, budget, pods)| RoomClaim { urgent, preemptible, min_share_bp, inuse, budget, pods })
            .collect();
        let got = share_room(&claims, room);
        let mut taken = vec![0usize; claims.len()];
        let mut given = vec![0u64; claims.len()];
        let mut total = 0u64;
        for &(i, p) in &got {
            prop_assert_eq!(p, taken[i], "claim {} gets a prefix of its pods", i);
            taken[i] += 1;
            given[i] += claims[i].pods[p];
            total += claims[i].pods[p];
        }
        prop_assert!(total <= room);
        let all: u64 = claims.iter().flat_map(|c| c.pods.iter()).sum();
        if all <= room {
            prop_assert_eq!(got.len(), claims.iter().map(|c| c.pods.len()).sum::<usize>());
        }
        // Nothing left over that someone could still use: a tenant left with a pod
        // has a next pod larger than the room left.
        let left = room - total;
        for (i, c) in claims.iter().enumerate() {
            if let Some(&next) = c.pods.get(taken[i]) {
                prop_assert!(next > left, "claim {}'s next pod ({}) fits the {} left", i, next, left);
            }
        }
        // In line: whenever a tenant is served, every tenant served later stood no
        // earlier in line at that moment (for non-preemptible tenants below budget: used
        // at least as large a fraction of it).
        let mut so_far = vec![0u64; claims.len()];
        for (k, &(i, p)) in got.iter().enumerate() {
            let key = |j: usize, so_far: &[u64]| {
                let c = &claims[j];
                release_rank(c.urgent, c.preemptible, c.min_share_bp, c.inuse + so_far[j], c.budget)
            };
            for &(j, _) in &got[k + 1..] {
                if j != i {
                    prop_assert!(key(j, &so_far) >= key(i, &so_far), "claim {} served before {} with a larger fraction", i, j);
                }
            }
            so_far[i] += claims[i].pods[p];
        }
    }
}
