//! Evictions reported by agents reach the federation's audit log exactly once, show in
//! `explain tenant`, and bad notes are refused without changing anything.

mod common;

use kvota_fairness::federation::{
    Applied, AuditEvent, Command, CommandError, EvictionNote, EvictionOutcome, Federation, TenantReport, UsageReport,
    MAX_EVICTION_TEXT, MAX_REPORT_EVICTIONS,
};
use kvota_fairness::names::ClusterName;
use kvota_fairness::names::TenantName;

use common::east_federation as federation;

fn note(victim: &str) -> EvictionNote {
    EvictionNote {
        victim: format!("train/{victim}"),
        victim_tenant: "training".into(),
        for_tenant: "inference".into(),
        for_pod: "serve/api-0".into(),
        milli_gpue: 1_000,
        outcome: EvictionOutcome::Evicted,
        why: "training is 4 GPUe above its budget; youngest pod".into(),
    }
}

fn report(seq: u64, epoch: u64, evictions: Vec<EvictionNote>) -> Command {
    let tenants = [(
        TenantName::from_static("training"),
        TenantReport {
            used_milli_gpue_ms: 0,
            inuse: 8_000,
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
        evictions,
        decisions: Vec::new(),
        window: None,
        status: None,
    })
}

fn evictions(fed: &Federation) -> Vec<(String, String)> {
    fed.audit()
        .filter_map(|r| match &r.event {
            AuditEvent::Eviction { cluster, note } => Some((cluster.clone(), note.victim.clone())),
            _ => None,
        })
        .collect()
}

#[test]
fn reported_evictions_are_audited_once_and_explained() {
    let (mut fed, epoch) = federation();
    fed.apply(1_000, report(1, epoch, vec![note("t1"), note("t2")]))
        .expect("report");
    // The agent resends the same report (its answer was lost): applied at most once.
    match fed.apply(2_000, report(1, epoch, vec![note("t1"), note("t2")])) {
        Ok(Applied::Reported { applied: false, .. }) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(
        evictions(&fed),
        vec![
            ("east".to_string(), "train/t1".to_string()),
            ("east".to_string(), "train/t2".to_string())
        ]
    );

    let e = fed.explain_tenant("inference").expect("explain");
    assert_eq!(e.evictions.len(), 2);
    let text = e.to_string();
    assert!(
        text.contains("gained room")
            && text.contains("evicted train/t2")
            && text.contains("for inference pod serve/api-0"),
        "{text}"
    );
    let text = fed.explain_tenant("training").expect("explain").to_string();
    assert!(text.contains("lost") && text.contains("youngest pod"), "{text}");
    assert!(fed.explain_tenant("research").expect("explain").evictions.is_empty());
}

#[test]
fn bad_eviction_notes_are_refused_and_change_nothing() {
    let (mut fed, epoch) = federation();
    let before = fed.clone();
    let long = EvictionNote {
        why: "x".repeat(MAX_EVICTION_TEXT + 1),
        ..note("t1")
    };
    let odd = EvictionNote {
        outcome: EvictionOutcome::parse("forced"),
        ..note("t1")
    };
    for bad in [vec![long], vec![odd], vec![note("t"); MAX_REPORT_EVICTIONS + 1]] {
        match fed.apply(1_000, report(1, epoch, bad)) {
            Err(CommandError::Invalid { what, why }) => {
                assert!(what.contains("report") && !why.is_empty(), "{what}: {why}")
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(fed == before, "nothing changed");
    assert!(evictions(&fed).is_empty());
}

/// An outcome is written as its word in log entries and snapshots, as before it was an
/// enum; a word no kvota sends (in a refused report an older log may hold) still reads,
/// keeps its word, and is refused when applied with the words it always was.
#[test]
fn outcomes_are_written_as_their_words_and_unknown_words_still_read() {
    let json = serde_json::to_value(note("t1")).expect("json");
    assert_eq!(json["outcome"], "evicted");
    let blocked = EvictionNote {
        outcome: EvictionOutcome::Blocked,
        ..note("t1")
    };
    assert_eq!(serde_json::to_value(&blocked).expect("json")["outcome"], "blocked");
    let mut odd = json.clone();
    odd["outcome"] = "forced".into();
    let read: EvictionNote = serde_json::from_value(odd.clone()).expect("an unknown word reads");
    assert_eq!(read.outcome, EvictionOutcome::Unrecognized("forced".into()));
    assert_eq!(
        serde_json::to_value(&read).expect("json"),
        odd,
        "and is written back unchanged"
    );
    let (mut fed, epoch) = federation();
    match fed.apply(1_000, report(1, epoch, vec![read])) {
        Err(CommandError::Invalid { why, .. }) => assert_eq!(why, "outcome `forced`: `evicted` or `blocked`"),
        other => panic!("{other:?}"),
    }
    for word in ["evicted", "blocked"] {
        assert_eq!(EvictionOutcome::parse(word).as_str(), word);
    }
}
