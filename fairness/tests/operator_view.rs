//! The operator view (the control plane's feature level 6): the policy's revision, each
//! cluster's status, an audit log of the events an operator looks for, budget changes
//! coalesced per cluster per minute, and retention by the policy's age and size.

use std::collections::BTreeMap;

use kvota_fairness::federation::{
    Applied, AuditEvent, ClusterStatus, Command, Federation, TenantReport, UsageReport, AUDIT_CAPACITY,
    BUDGET_COALESCE_MS, KIND_BUDGETS, POLICY_UNCHANGED,
};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::{describe_changes, Policy};

const LEASE_MS: u64 = 6_000;

fn policy(extra: &str) -> Policy {
    let yaml = Policy::article_example_yaml().replacen(
        "spec:\n",
        &format!("spec:\n  lease: {{duration: 6s, clockSkewMargin: 500ms}}\n{extra}"),
        1,
    );
    Policy::from_yaml(&yaml).expect("policy")
}

/// A federation with the operator view on (or not), a policy, and clusters `east` and
/// `west` registered; the epochs of their leases.
fn federation(view: bool) -> (Federation, BTreeMap<&'static str, u64>) {
    let mut fed = Federation::new();
    fed.enable_records();
    if view {
        fed.enable_operator_view();
    }
    fed.apply(1_000, Command::ApplyPolicy(policy(""))).expect("policy");
    let mut epochs = BTreeMap::new();
    for c in ["east", "west"] {
        let capacity = [("nvidia.com/gpu".to_string(), 16_000)].into();
        match fed.apply(
            1_000,
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
    (fed, epochs)
}

fn report(cluster: &str, seq: u64, epoch: u64, inuse: u64, status: Option<ClusterStatus>) -> Command {
    let tenants = [(
        TenantName::from_static("training"),
        TenantReport {
            used_milli_gpue_ms: 0,
            inuse,
            pending: 4_000,
            largest: 0,
            borrowed: 0,
        },
    )]
    .into();
    Command::Report(UsageReport {
        cluster: ClusterName::parse(cluster).expect("name"),
        seq,
        held_epoch: epoch,
        capacity: None,
        tenants,
        evictions: Vec::new(),
        decisions: Vec::new(),
        window: None,
        status,
    })
}

fn send(fed: &mut Federation, at: u64, cmd: Command) -> u64 {
    match fed.apply(at, cmd) {
        Ok(Applied::Reported { lease, .. }) => lease.epoch,
        other => panic!("{other:?}"),
    }
}

fn kinds(fed: &Federation) -> Vec<&'static str> {
    fed.audit().map(|r| r.event.kind()).collect()
}

#[test]
fn a_policy_that_changes_something_gets_the_next_revision_and_its_changes_in_words() {
    let (mut fed, _) = federation(true);
    assert_eq!(fed.policy_revision(), (1, 1_000), "the first policy is revision 1");
    // The same policy again: no new revision, and it says nothing changed.
    fed.apply(2_000, Command::ApplyPolicy(policy(""))).expect("same");
    assert_eq!(fed.policy_revision().0, 1);
    match &fed.audit().last().expect("a record").event {
        AuditEvent::PolicyApplied { revision, changes, .. } => {
            assert_eq!(
                (*revision, changes.as_slice()),
                (1, [POLICY_UNCHANGED.to_string()].as_slice())
            );
        }
        other => panic!("{other:?}"),
    }
    let halved = policy("")
        .to_yaml()
        .replace("decayHalfLife: \"24h\"", "decayHalfLife: \"6h\"")
        .replace("weight: 10\n", "weight: 20\n");
    fed.apply(3_000, Command::ApplyPolicy(Policy::from_yaml(&halved).expect("halved")))
        .expect("apply");
    assert_eq!(fed.policy_revision(), (2, 3_000));
    let last = fed.audit().last().expect("a record");
    match &last.event {
        AuditEvent::PolicyApplied { revision, changes, .. } => {
            assert_eq!(*revision, 2);
            assert!(
                changes.contains(&"spec.tenants[research].weight: 10 -> 20".to_string()),
                "{changes:?}"
            );
            assert!(
                changes.contains(&"spec.tenants[training].decayHalfLife: 24h -> 6h".to_string()),
                "{changes:?}"
            );
        }
        other => panic!("{other:?}"),
    }
    // Without the operator view: no revision, no changes (the records older builds write).
    let (mut old, _) = federation(false);
    old.apply(3_000, Command::ApplyPolicy(Policy::from_yaml(&halved).expect("halved")))
        .expect("apply");
    assert_eq!(old.policy_revision().0, 0);
    assert!(old.audit().all(|r| match &r.event {
        AuditEvent::PolicyApplied { revision, changes, .. } => *revision == 0 && changes.is_empty(),
        _ => true,
    }));
}

#[test]
fn policy_changes_are_told_in_the_documents_words_tenants_by_name_and_bounded() {
    let a = policy("");
    let b = Policy::from_yaml(&a.to_yaml().replace("duration: \"6s\"", "duration: \"10s\"").replace(
        "  - name: \"research\"",
        "  - name: ops\n    weight: 1\n  - name: \"research\"",
    ))
    .expect("b");
    let changes = describe_changes(&a, &b, 40);
    assert_eq!(
        changes,
        vec![
            "spec.lease.duration: 6s -> 10s".to_string(),
            "spec.tenants[ops]: added".to_string()
        ]
    );
    assert_eq!(describe_changes(&b, &a, 40)[1], "spec.tenants[ops]: removed");
    assert!(describe_changes(&a, &a, 40).is_empty());
    let many = describe_changes(&a, &b, 1);
    assert_eq!(many, vec!["and 2 more changes".to_string()]);
}

#[test]
fn a_clusters_status_is_kept_with_running_at_most_its_in_use() {
    let (mut fed, epochs) = federation(true);
    let status = ClusterStatus {
        agent_version: "0.9.0\u{7}-beta".into(),
        feature_level: 6,
        policy_revision: 1,
        report_interval_ms: 1_000,
        running: [
            (TenantName::from_static("training"), 9_000),
            (TenantName::from_static("research"), 1_000),
        ]
        .into(),
    };
    send(&mut fed, 2_000, report("east", 1, epochs["east"], 6_000, Some(status)));
    let rec = &fed.clusters()["east"];
    let kept = rec.status.as_ref().expect("kept");
    assert_eq!(kept.agent_version, "0.9.0-beta", "printable ASCII only");
    assert_eq!(rec.running("training"), 6_000, "at most its in-use");
    assert_eq!(rec.running("research"), 0, "no in-use, nothing running");
    // An agent that says nothing of what runs: all of its in-use counts as running.
    send(&mut fed, 2_000, report("west", 1, epochs["west"], 3_000, None));
    assert_eq!(fed.clusters()["west"].running("training"), 3_000);
    // Without the operator view nothing is kept.
    let (mut old, epochs) = federation(false);
    send(
        &mut old,
        2_000,
        report("east", 1, epochs["east"], 6_000, Some(ClusterStatus::default())),
    );
    assert_eq!(old.clusters()["east"].status, None);
}

#[test]
fn a_cut_off_cluster_is_an_event_and_so_is_its_return() {
    let (mut fed, epochs) = federation(true);
    let mut east = send(&mut fed, 2_000, report("east", 1, epochs["east"], 1_000, None));
    send(&mut fed, 2_000, report("west", 1, epochs["west"], 1_000, None));
    // east keeps reporting; west goes silent and its lease runs out.
    for (seq, at) in (2..).zip((3_000..=2_000 + LEASE_MS + 2_000).step_by(1_000)) {
        east = send(&mut fed, at, report("east", seq, east, 1_000, None));
        fed.apply(at, Command::Tick).expect("tick");
    }
    let expired: Vec<_> = fed
        .audit()
        .filter_map(|r| match &r.event {
            AuditEvent::LeaseExpired {
                cluster,
                last_report_ms,
            } => Some((cluster.clone(), *last_report_ms, r.at_ms)),
            _ => None,
        })
        .collect();
    assert_eq!(expired.len(), 1, "once, not at every tick: {expired:?}");
    assert_eq!(expired[0].0, "west");
    assert_eq!(expired[0].1, Some(2_000));
    assert!(fed.cut_off().contains_key("west") && !fed.cut_off().contains_key("east"));
    // west reports again: renewed, with how long it was cut off.
    send(&mut fed, 12_000, report("west", 2, epochs["west"], 1_000, None));
    let renewed = fed.audit().last().expect("a record");
    match &renewed.event {
        AuditEvent::LeaseRenewed { cluster, cut_off_ms } => {
            assert_eq!(cluster, "west");
            assert_eq!(*cut_off_ms, 12_000 - (2_000 + LEASE_MS));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(renewed.actor.as_deref(), Some("cluster/west"));
    assert!(fed.cut_off().is_empty());
}

#[test]
fn budget_changes_are_their_own_kind_and_coalesced_per_cluster_per_minute() {
    let (mut fed, epochs) = federation(true);
    let mut epoch = epochs["east"];
    let before = fed.audit().filter(|r| r.event.kind() == KIND_BUDGETS).count();
    // Demand moves every second for two minutes: one record per minute, not per lease.
    for (i, at) in (2_000..2_000 + 2 * BUDGET_COALESCE_MS).step_by(1_000).enumerate() {
        let inuse = if i % 2 == 0 { 2_000 } else { 6_000 };
        epoch = send(&mut fed, at, report("east", i as u64 + 1, epoch, inuse, None));
    }
    let records: Vec<_> = fed
        .audit()
        .filter(|r| r.event.kind() == KIND_BUDGETS)
        .skip(before)
        .filter(|r| matches!(&r.event, AuditEvent::BudgetsChanged { cluster, .. } if cluster == "east"))
        .collect();
    assert!(
        (2..=3).contains(&records.len()),
        "two minutes of changes in two or three records, not {}",
        records.len()
    );
    for r in &records {
        if let AuditEvent::BudgetsChanged { until_ms, changes, .. } = &r.event {
            assert!(until_ms.is_none_or(|u| u - r.at_ms < BUDGET_COALESCE_MS));
            let mut tenants: Vec<&str> = changes.iter().map(|c| c.tenant.as_str()).collect();
            tenants.dedup();
            assert_eq!(tenants.len(), changes.len(), "one line per tenant: {changes:?}");
        }
    }
    // Below the operator view: a record per lease that changed budgets, as always.
    let (mut old, epochs) = federation(false);
    let mut epoch = epochs["east"];
    for (i, at) in (2_000..12_000).step_by(1_000).enumerate() {
        let inuse = if i % 2 == 0 { 2_000 } else { 6_000 };
        epoch = send(&mut old, at, report("east", i as u64 + 1, epoch, inuse, None));
    }
    assert!(old.audit().filter(|r| r.event.kind() == KIND_BUDGETS).count() > 5);
}

#[test]
fn retention_drops_by_age_then_by_size_budget_changes_first() {
    let (mut fed, epochs) = federation(true);
    let small = policy("  audit: {retention: 1h, maxSize: 1Mi}\n");
    fed.apply(1_500, Command::ApplyPolicy(small)).expect("policy");
    // An hour and more later the first records are gone, the policy's among them.
    fed.apply(1_500 + 3_600_000 + 1, Command::Tick).expect("tick");
    assert!(
        fed.audit().all(|r| r.at_ms > 1_500),
        "records older than the retention are dropped"
    );
    // Fill past a megabyte with evictions noted... and budget changes: budgets go first.
    let mut epoch = epochs["east"];
    let t0 = 4_000_000u64;
    let mut at = t0;
    for seq in 1..=3_000u64 {
        at += BUDGET_COALESCE_MS; // a record per change, none coalesced
        let inuse = if seq % 2 == 0 { 2_000 } else { 6_000 };
        epoch = send(
            &mut fed,
            at.min(t0 + 3_000_000),
            report("east", seq, epoch, inuse, None),
        );
        if seq % 3 == 0 {
            let r = kvota_fairness::federation::AuditEvent::LeaderChanged { node: seq, term: seq };
            fed.note(r);
        }
    }
    let total: u64 = fed.audit().map(|r| r.size()).sum();
    assert!(total <= 1 << 20, "within maxSize: {total}");
    let leaders = fed.audit().filter(|r| r.event.kind() == "leader").count();
    assert_eq!(leaders, 1_000, "no other event dropped while budget changes could go");
    assert!(
        fed.audit().count() > AUDIT_CAPACITY,
        "no longer a ring of {AUDIT_CAPACITY}"
    );
    // A copy of the state (as a snapshot reads it) prunes the same.
    let end = t0 + 3_000_001;
    let mut copy = fed.clone();
    copy.apply(end, Command::Tick).expect("tick");
    fed.apply(end, Command::Tick).expect("tick");
    assert_eq!(copy, fed);
    assert_eq!(kinds(&copy).iter().filter(|k| **k == "leader").count(), 1_000);
}

#[test]
fn events_the_control_plane_notes_are_kept_from_the_operator_view_on_only() {
    let (mut old, _) = federation(false);
    let n = old.audit().count();
    old.note(AuditEvent::LeaderChanged { node: 2, term: 7 });
    assert_eq!(old.audit().count(), n, "below level 6 nothing is noted");
    let (mut fed, _) = federation(true);
    fed.note(AuditEvent::NodeAdded {
        node: 4,
        voter: false,
        rpc_addr: "10.0.0.4:7401".into(),
    });
    let r = fed.audit().last().expect("noted");
    assert_eq!(r.event.kind(), "node");
    assert_eq!(r.actor.as_deref(), Some("kvota"));
}

#[test]
fn the_audit_setting_parses_bounded_and_round_trips() {
    let p = policy("  audit: {retention: 30d, maxSize: 64Mi}\n");
    assert_eq!(p.audit.retention_ms, 30 * 86_400_000);
    assert_eq!(p.audit.max_bytes, 64 << 20);
    assert_eq!(Policy::from_yaml(&p.to_yaml()).expect("round trip"), p);
    assert!(!policy("").to_yaml().contains("audit"), "written only when set");
    for (bad, want) in [
        ("{retention: 10m}", "spec.audit.retention"),
        ("{maxSize: 1Ki}", "spec.audit.maxSize"),
        ("{maxSize: lots}", "spec.audit.maxSize"),
        ("{keep: 3}", "spec.audit.keep"),
    ] {
        let e = Policy::from_yaml(&Policy::article_example_yaml().replacen(
            "spec:\n",
            &format!("spec:\n  audit: {bad}\n"),
            1,
        ))
        .expect_err(bad);
        assert!(e.issues.iter().any(|i| i.path == want), "{bad}: {e}");
    }
}
