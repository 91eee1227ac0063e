//! Lending idle GPUs: the borrow limits leases carry, the admission of a pod on borrowed
//! GPUs, and the policy switch. The limits are what keeps budgets plus borrowing within
//! each tenant's maxShare, so they are checked against that sum, not against numbers
//! written down here.

use std::collections::BTreeMap;

use kvota_fairness::admission::{borrow_room, decide, lendable, lends_now, LocalView, PodRequest, Reason, Verdict};
use kvota_fairness::entitlement::share_of;
use kvota_fairness::federation::{Applied, Command, Federation, TenantReport, UsageReport};
use kvota_fairness::lease::{Lease, LeaseStatus};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::{AdmissionMode, LendWhen, Policy};

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

fn report(fed: &mut Federation, cluster: &str, seq: u64, epoch: u64, demand: &[(&str, u64, u64)]) -> Lease {
    let tenants = demand
        .iter()
        .map(|&(t, inuse, pending)| {
            (
                TenantName::parse(t).expect("name"),
                TenantReport {
                    used_milli_gpue_ms: 0,
                    inuse: inuse * 1000,
                    pending: pending * 1000,
                    largest: 0,
                    borrowed: 0,
                },
            )
        })
        .collect();
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

/// The article's policy over two clusters (64 + 32 GPUs), with lending on or off, after
/// one report from each: training wants more than it gets, research less than its maxShare.
fn federation(lend: bool, policy: &str) -> (Federation, Lease, Lease) {
    let mut fed = Federation::new();
    fed.apply(0, Command::ApplyPolicy(Policy::from_yaml(policy).expect("policy")))
        .expect("policy");
    if lend {
        fed.enable_lending();
        fed.enable_borrow_cap();
    }
    let east = register(&mut fed, "east", 64);
    let west = register(&mut fed, "west", 32);
    let demand = [("inference", 10, 0), ("research", 2, 4), ("training", 20, 60)];
    let east = report(&mut fed, "east", 1, east.epoch, &demand);
    let west = report(&mut fed, "west", 1, west.epoch, &demand);
    let east = report(&mut fed, "east", 2, east.epoch, &demand);
    (fed, east, west)
}

#[test]
fn limits_keep_budgets_and_borrowing_within_max_share() {
    let (fed, east, west) = federation(true, Policy::article_example_yaml());
    let policy = fed.policy().expect("policy");
    let g = fed.capacity();
    let mut lent_somewhere = false;
    for t in &policy.tenants {
        let (e, w) = (&east.budgets[&t.name], &west.budgets[&t.name]);
        let max = share_of(g, t.max_share_bp);
        assert_eq!(
            (e.ceiling, w.ceiling),
            (max, max),
            "{}: ceiling is maxShare x G",
            t.name
        );
        if !t.preemptible {
            assert_eq!(
                (e.borrow, w.borrow),
                (0, 0),
                "{} is not preemptible: it never borrows",
                t.name
            );
            continue;
        }
        // Each limit is the cluster's part (by capacity) of maxShare x G - entitlement.
        let room = max - e.entitlement;
        assert_eq!(e.borrow, room * 64 / 96, "{}", t.name);
        assert!(
            e.budget + w.budget + e.borrow + w.borrow <= max,
            "{}: {e:?} {w:?} above maxShare {max}",
            t.name
        );
        lent_somewhere |= e.borrow > 0;
    }
    assert!(
        lent_somewhere,
        "some preemptible tenant is below its maxShare: {east:?}"
    );
}

#[test]
fn nothing_is_lent_before_the_feature_level_or_when_the_policy_says_no() {
    let (_, east, west) = federation(false, Policy::article_example_yaml());
    assert!(
        east.budgets
            .values()
            .chain(west.budgets.values())
            .all(|b| b.borrow == 0 && b.ceiling == 0),
        "{east:?}"
    );
    let off = Policy::article_example_yaml().replacen("spec:\n", "spec:\n  reclaim: {lendIdle: false}\n", 1);
    let (_, east, _) = federation(true, &off);
    assert!(
        east.budgets.values().all(|b| b.borrow == 0 && b.ceiling > 0),
        "{east:?}"
    );
    // Without reclaim, lent GPUs could never be taken back: nothing is lent.
    let no_reclaim = Policy::article_example_yaml().replacen("spec:\n", "spec:\n  reclaim: {enabled: false}\n", 1);
    let (_, east, _) = federation(true, &no_reclaim);
    assert!(east.budgets.values().all(|b| b.borrow == 0), "{east:?}");
}

/// `spec.reclaim.lendWhen`: `cutOff` lends only once the lease expired; it survives the
/// policy's own text; a setting that could not lend (lending or reclaim off) and an
/// unknown word are refused with the field's path.
#[test]
fn lend_when_cut_off_lends_only_on_an_expired_lease() {
    let with = |reclaim: &str| {
        Policy::article_example_yaml().replacen("spec:\n", &format!("spec:\n  reclaim: {{{reclaim}}}\n"), 1)
    };
    let always = Policy::from_yaml(Policy::article_example_yaml()).expect("default");
    assert_eq!(always.reclaim.lend_when, LendWhen::Always);
    assert!(!always.to_yaml().contains("lendWhen"), "the default is not written");
    let p = Policy::from_yaml(&with("lendWhen: cutOff")).expect("cutOff");
    assert_eq!(p.reclaim.lend_when, LendWhen::CutOff);
    assert!(p.to_yaml().contains("lendWhen: cutOff"), "{}", p.to_yaml());
    assert_eq!(Policy::from_yaml(&p.to_yaml()).expect("its own text"), p);
    assert_eq!(Policy::from_yaml(&with("lendWhen: always")).expect("always"), always);
    // Kept state and `kvota policy diff` use the serde encoding: the YAML's words, and
    // nothing at all for the default (what a build before the field wrote).
    let json = serde_json::to_string(&p.reclaim).expect("encode");
    assert!(json.contains(r#""lend_when":"cutOff""#), "{json}");
    assert!(!serde_json::to_string(&always.reclaim)
        .expect("encode")
        .contains("lend_when"));
    assert_eq!(
        serde_json::from_str::<kvota_fairness::policy::ReclaimConfig>(&json).expect("decode"),
        p.reclaim
    );
    let fresh = LeaseStatus::Fresh { remaining_ms: 20_000 };
    let expiring = LeaseStatus::Expiring { remaining_ms: 1_000 };
    let standings = [LeaseStatus::None, fresh, expiring, LeaseStatus::Safe];
    let lends = |p: &Policy| standings.map(|s| lends_now(&p.reclaim, s));
    assert_eq!(lends(&always), [true; 4]);
    assert_eq!(lends(&p), [false, false, false, true], "only an expired lease lends");
    let off = Policy::from_yaml(&with("lendIdle: false")).expect("off");
    assert_eq!(lends(&off), [false; 4]);
    let no_reclaim = Policy::from_yaml(&with("enabled: false")).expect("no reclaim");
    assert_eq!(lends(&no_reclaim), [false; 4]);
    for (reclaim, says) in [
        ("lendIdle: false, lendWhen: cutOff", "spec.reclaim.lendIdle is false"),
        ("enabled: false, lendWhen: cutOff", "spec.reclaim.enabled is false"),
        ("lendWhen: sometimes", "`sometimes` is not a choice"),
        ("lendWhen: true", "spec.reclaim.lendWhen"),
    ] {
        let e = Policy::from_yaml(&with(reclaim)).expect_err(reclaim).to_string();
        assert!(
            e.contains("spec.reclaim.lendWhen") && e.contains(says),
            "{reclaim}: {e}"
        );
    }
}

#[test]
fn the_switch_survives_the_policy_text_and_refuses_nonsense() {
    let off = Policy::article_example_yaml().replacen("spec:\n", "spec:\n  reclaim: {lendIdle: false}\n", 1);
    let p = Policy::from_yaml(&off).expect("lendIdle: false");
    assert!(!p.reclaim.lend_idle);
    let again = Policy::from_yaml(&p.to_yaml()).expect("its own text");
    assert_eq!(again, p);
    assert!(
        Policy::from_yaml(Policy::article_example_yaml())
            .expect("default")
            .reclaim
            .lend_idle
    );
    let bad = Policy::article_example_yaml().replacen("spec:\n", "spec:\n  reclaim: {lendIdle: sometimes}\n", 1);
    let e = Policy::from_yaml(&bad).expect_err("not a boolean").to_string();
    assert!(e.contains("spec.reclaim.lendIdle"), "{e}");
}

fn view(budget: u64, inuse: u64, borrow: u64) -> LocalView {
    LocalView {
        cluster: ClusterName::from_static("east"),
        tenant: Some(TenantName::from_static("training")),
        mode: AdmissionMode::Reject,
        max_queued: 0,
        budget,
        inuse,
        queued: 0,
        entitlement: 40_000,
        ceiling: Some(64_000),
        lease: LeaseStatus::Fresh { remaining_ms: 20_000 },
        borrow,
    }
}

#[test]
fn a_pod_over_budget_is_admitted_on_borrowed_gpus_only_within_the_room() {
    // 16 GPUs; inference holds 4 and waits for 4 more within its budget of 10; training
    // holds its budget of 6; research holds nothing and has budget 0. Idle: 6 GPUs, of
    // which inference's waiting pods need 4: 2 may be lent.
    let lend = lendable(16_000, [(4_000, 4_000, 10_000), (0, 0, 0), (6_000, 3_000, 6_000)]);
    assert_eq!(lend, 2_000);
    // A budget nothing waits for is lent whole; one with pods waiting keeps their room.
    assert_eq!(lendable(8_000, [(2_000, 0, 6_000)]), 6_000);
    assert_eq!(lendable(8_000, [(2_000, 1_500, 6_000)]), 4_500);
    let room = borrow_room(5_000, 6_000, 6_000, lend);
    assert_eq!(room, 2_000);
    let pod = |gpue| PodRequest {
        namespace: "ml".into(),
        name: "trainer-7".into(),
        gpue,
    };
    let d = decide(&pod(2_000), &view(6_000, 6_000, room));
    assert_eq!(
        (d.verdict, d.reason, d.after),
        (Verdict::Allow, Reason::Borrowed, 8_000)
    );
    for needle in ["borrowed", "8 GPUe", "budget of 6", "borrowable 2", "evicting this pod"] {
        assert!(d.message.contains(needle), "missing {needle:?} in {}", d.message);
    }
    let d = decide(&pod(3_000), &view(6_000, 6_000, room));
    assert_eq!((d.verdict, d.reason), (Verdict::Deny, Reason::OverBudget));
    // A tenant with pods of its own behind the gate does not overtake them by borrowing.
    let mut queued = view(6_000, 6_000, room);
    (queued.mode, queued.max_queued, queued.queued) = (AdmissionMode::Queue, 5, 1);
    let d = decide(&pod(2_000), &queued);
    assert_eq!((d.verdict, d.reason), (Verdict::Queue, Reason::OverBudget));
    // The borrow limit bounds it too: budget 6 + limit 1 leaves room for 1.
    assert_eq!(borrow_room(1_000, 6_000, 6_000, lend), 1_000);
    assert_eq!(borrow_room(0, 6_000, 6_000, lend), 0, "no limit, no borrowing");
    // A pod above the ceiling (maxShare x G, or the cluster) is refused at once.
    let mut v = view(6_000, 0, 60_000);
    v.ceiling = Some(24_000);
    let d = decide(&pod(32_000), &v);
    assert_eq!((d.verdict, d.reason), (Verdict::Deny, Reason::NeverFits));
    assert!(d.message.contains("maxShare"), "{}", d.message);
}
