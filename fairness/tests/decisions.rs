//! Admission decisions carried by reports: kept per cluster once records are on, a pod
//! judged again replaces its earlier decision, bounded per cluster, malformed ones
//! dropped without costing the report its usage, forgotten with their cluster.

mod common;

use common::east_federation;
use kvota_fairness::admission::Verdict;
use kvota_fairness::federation::{
    Applied, Command, Federation, PodDecision, TenantReport, UsageReport, DECISIONS_PER_CLUSTER, MAX_REPORT_DECISIONS,
};
use kvota_fairness::names::{ClusterName, TenantName};

fn decision(pod: &str, verdict: Verdict, at_ms: u64) -> PodDecision {
    PodDecision {
        pod: pod.into(),
        tenant: "training".into(),
        verdict,
        milli_gpue: 2_000,
        at_ms,
        text: format!("why {pod} at {at_ms}"),
    }
}

fn report(seq: u64, epoch: u64, decisions: Vec<PodDecision>) -> Command {
    let tenants = [(
        TenantName::from_static("training"),
        TenantReport {
            used_milli_gpue_ms: 1_000,
            inuse: 0,
            pending: 0,
            largest: 0,
            borrowed: 0,
        },
    )]
    .into();
    Command::Report(UsageReport {
        cluster: ClusterName::from_static("east"),
        seq,
        held_epoch: epoch,
        capacity: None,
        tenants,
        evictions: Vec::new(),
        decisions,
        window: None,
        status: None,
    })
}

fn apply(fed: &mut Federation, cmd: Command) {
    match fed.apply(1_000, cmd) {
        Ok(Applied::Reported { applied: true, .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn decisions_are_kept_once_records_are_on_newest_per_pod() {
    let (mut fed, epoch) = east_federation();
    apply(&mut fed, report(1, epoch, vec![decision("ml/a", Verdict::Deny, 1)]));
    assert!(
        fed.pod_decisions("ml/a", None).is_empty(),
        "not kept before records are on"
    );
    fed.enable_records();
    apply(
        &mut fed,
        report(
            2,
            epoch,
            vec![decision("ml/a", Verdict::Deny, 2), decision("ml/b", Verdict::Queue, 3)],
        ),
    );
    apply(&mut fed, report(3, epoch, vec![decision("ml/a", Verdict::Allow, 4)]));
    let a = fed.pod_decisions("ml/a", None);
    assert_eq!(a.len(), 1, "judged again: the newer decision replaces the older");
    assert_eq!((a[0].0, a[0].1.verdict, a[0].1.at_ms), ("east", Verdict::Allow, 4));
    assert_eq!(fed.pod_decisions("ml/b", Some("east"))[0].1.verdict, Verdict::Queue);
    assert!(fed.pod_decisions("ml/b", Some("west")).is_empty());
    assert!(fed.pod_decisions("ml/c", None).is_empty());
}

#[test]
fn malformed_decisions_are_dropped_and_the_report_still_counts() {
    let (mut fed, epoch) = east_federation();
    fed.enable_records();
    let mut long = decision("ml/long", Verdict::Deny, 1);
    long.text = "x".repeat(kvota_fairness::federation::MAX_DECISION_TEXT + 1);
    let bad = [
        decision("no-slash", Verdict::Deny, 1),
        decision("Ml/upper", Verdict::Deny, 1),
        long,
        PodDecision {
            tenant: "Not A Tenant".into(),
            ..decision("ml/t", Verdict::Deny, 1)
        },
    ];
    apply(&mut fed, report(1, epoch, bad.to_vec()));
    assert_eq!(
        fed.ledger().entries()["training"].value_milli_gpue_ms,
        1_000,
        "the usage counted"
    );
    for d in &bad {
        assert!(fed.pod_decisions(&d.pod, None).is_empty(), "{} kept", d.pod);
    }
    // More than a report may carry: the report is refused as a whole (an agent never
    // sends that many; the boundary refuses it first).
    let too_many = (0..=MAX_REPORT_DECISIONS)
        .map(|i| decision(&format!("ml/p{i}"), Verdict::Allow, 1))
        .collect();
    assert!(fed.apply(1_000, report(2, epoch, too_many)).is_err());
}

#[test]
fn a_cluster_keeps_a_bounded_number_and_forgets_them_when_removed() {
    let (mut fed, epoch) = east_federation();
    fed.enable_records();
    let mut seq = 0;
    for chunk in (0..DECISIONS_PER_CLUSTER + 40)
        .collect::<Vec<_>>()
        .chunks(MAX_REPORT_DECISIONS)
    {
        seq += 1;
        apply(
            &mut fed,
            report(
                seq,
                epoch,
                chunk
                    .iter()
                    .map(|i| decision(&format!("ml/p{i}"), Verdict::Allow, *i as u64))
                    .collect(),
            ),
        );
    }
    assert!(fed.pod_decisions("ml/p0", None).is_empty(), "the oldest went");
    assert_eq!(
        fed.pod_decisions(&format!("ml/p{}", DECISIONS_PER_CLUSTER + 39), None)
            .len(),
        1
    );
    let kept = (0..DECISIONS_PER_CLUSTER + 40)
        .filter(|i| !fed.pod_decisions(&format!("ml/p{i}"), None).is_empty())
        .count();
    assert_eq!(kept, DECISIONS_PER_CLUSTER);
    // Removing the cluster (once its leases ran out) forgets its decisions.
    let later = 10 * 24 * 3_600_000;
    assert!(matches!(
        fed.apply(
            later,
            Command::RemoveCluster {
                cluster: ClusterName::from_static("east")
            }
        ),
        Ok(Applied::Removed)
    ));
    assert!(fed
        .pod_decisions(&format!("ml/p{}", DECISIONS_PER_CLUSTER + 39), None)
        .is_empty());
}

#[test]
fn audit_records_name_their_actor_once_records_are_on_and_filter() {
    use kvota_fairness::federation::{AuditEvent, CONTROL_PLANE_ACTOR};
    use kvota_fairness::policy::Policy;
    let policy = || Command::ApplyPolicy(Policy::from_yaml(Policy::article_example_yaml()).expect("policy"));
    let (mut fed, _) = east_federation();
    fed.apply_as(1, policy(), Some("operator/alice".into()))
        .expect("applied");
    assert!(
        fed.audit().all(|r| r.actor.is_none()),
        "no actors before records are on"
    );
    fed.enable_records();
    fed.apply_as(2, policy(), Some("operator/alice".into()))
        .expect("applied");
    let capacity = [("nvidia.com/gpu".to_string(), 8_000)].into();
    fed.apply_as(
        3,
        Command::RegisterCluster {
            cluster: ClusterName::from_static("west"),
            capacity,
            labels: Default::default(),
        },
        None,
    )
    .expect("registered");
    let last_policy = fed
        .audit()
        .rev()
        .find(|r| matches!(r.event, AuditEvent::PolicyApplied { .. }))
        .expect("policy record");
    assert_eq!(last_policy.actor.as_deref(), Some("operator/alice"));
    let reg = fed
        .audit()
        .rev()
        .find(|r| matches!(&r.event, AuditEvent::ClusterRegistered { cluster, .. } if cluster == "west"))
        .expect("registration");
    assert_eq!(reg.actor.as_deref(), Some("cluster/west"), "implied by the event");
    assert!(fed
        .audit()
        .filter(|r| matches!(r.event, AuditEvent::BudgetsChanged { .. }) && r.seq > last_policy.seq)
        .all(|r| r.actor.as_deref() == Some(CONTROL_PLANE_ACTOR)));
    // Filters: by actor, by time, by tenant (a policy concerns every tenant).
    let by_alice: Vec<u64> = fed
        .audit_filtered(None, Some("operator/alice"), None)
        .map(|r| r.seq)
        .collect();
    assert_eq!(by_alice, vec![last_policy.seq]);
    assert!(fed.audit_filtered(None, None, Some(3)).all(|r| r.at_ms >= 3));
    assert!(fed.audit_filtered(None, None, Some(3)).count() < fed.audit().count());
    assert!(fed
        .audit_filtered(Some("training"), None, None)
        .all(|r| r.event.concerns("training")));
    assert!(fed
        .audit_filtered(Some("nobody"), None, None)
        .all(|r| matches!(r.event, AuditEvent::PolicyApplied { .. })));
    // An absurd actor is not kept.
    fed.apply_as(4, policy(), Some("x".repeat(1_000))).expect("applied");
    assert_eq!(fed.audit().next_back().map(|r| r.actor.clone()), Some(None));
}
