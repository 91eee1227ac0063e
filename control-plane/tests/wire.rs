//! The Raft port's protobuf schema (`proto/kvota/raft/v1/raft.proto`, converted in
//! `control-plane/src/wire.rs`, the log's commands in `proto/src/log.rs`): every kind of
//! log entry and every Raft message crosses the wire unchanged; the entries of
//! `tests/golden/raft-entries.format-1.binpb`, encoded when the schema was introduced,
//! still decode to the golden log; garbled or arbitrary bytes are refused with an error
//! that names the field, or read whole, never a panic.

#![allow(clippy::unwrap_used)]

mod common;

use kvota_fairness::names::{ClusterName, TenantName};
use std::collections::BTreeMap;
use std::path::PathBuf;

use common::*;
use kvota_control_plane::types::{Node, Request, TypeConfig, LOG_FORMAT};
use kvota_control_plane::wire::{self, WireError};
use kvota_fairness::federation::{Command, UsageReport};
use kvota_fairness::policy::Policy;
use kvota_proto::raft::v1 as pb;
use openraft::error::{InstallSnapshotError, SnapshotMismatch};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::testing::log_id;
use openraft::{Entry, EntryPayload, Membership, SnapshotMeta, SnapshotSegmentId, StoredMembership, Vote};
use prost::Message;

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn node(port: u16) -> Node {
    Node {
        rpc_addr: format!("10.0.0.1:{port}"),
        http_addr: format!("10.0.0.1:{}", port + 1),
        raft_addr: String::new(),
    }
}

/// What [`full_log`] does not use: a policy with queue admission, resource weights and a
/// default tenant; a report with a new capacity and one with an empty one; a raised
/// feature level; a joint membership with a learner.
fn more_entries() -> Vec<Entry<TypeConfig>> {
    let policy = Policy::from_yaml(
        "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: wire}
spec:
  defaultTenant: lab
  resourceWeights: {example.com/tpu: 250}
  reclaim: {enabled: false}
  tenants:
  - {name: lab, weight: 1, namespaces: [lab], admission: queue, maxQueued: 7, burstFactor: 2, namespaceSelector: {matchLabels: {team: lab}}}
  - {name: prod, weight: 3, minShare: 40, preemptible: false, namespaces: [prod]}
",
    )
    .unwrap();
    let Command::Report(mut with_capacity) = report("east", 3, 1_000) else {
        unreachable!()
    };
    with_capacity.capacity = Some(
        [
            ("nvidia.com/gpu".to_string(), 8_000),
            ("example.com/tpu".to_string(), 4_000),
        ]
        .into(),
    );
    let empty_capacity = UsageReport {
        capacity: Some(BTreeMap::new()),
        seq: 4,
        ..with_capacity.clone()
    };
    let mut raise = Request::new(9_000, vec![Command::Tick]);
    raise.raise_feature_level = Some(1);
    let joint = Membership::new(
        vec![[1u64, 2].into(), [2u64, 3].into()],
        BTreeMap::from([(1, node(7000)), (2, node(7010)), (3, node(7020)), (4, node(7030))]),
    );
    vec![
        entry(3, 11, normal(8_500, Command::ApplyPolicy(policy))),
        entry(
            3,
            12,
            EntryPayload::Normal(Request::new(
                8_600,
                vec![Command::Report(with_capacity), Command::Report(empty_capacity)],
            )),
        ),
        entry(3, 13, EntryPayload::Normal(raise)),
        entry(4, 14, EntryPayload::Membership(joint)),
        entry(4, 15, EntryPayload::Normal(Request::new(9_500, Vec::new()))),
    ]
}

fn all_entries() -> Vec<Entry<TypeConfig>> {
    let mut log = full_log();
    log.extend(more_entries());
    log
}

fn through_the_wire(e: &Entry<TypeConfig>) -> Entry<TypeConfig> {
    let bytes = wire::entry_to(e).encode_to_vec();
    wire::entry_from(pb::RaftEntry::decode(bytes.as_slice()).unwrap(), "entry").unwrap()
}

#[test]
fn every_kind_of_entry_crosses_the_wire_unchanged() {
    let log = all_entries();
    assert!(log
        .iter()
        .any(|e| matches!(&e.payload, EntryPayload::Normal(r) if r.raise_feature_level.is_some())));
    for e in &log {
        assert_eq!(&through_the_wire(e), e);
    }
}

/// The schema's golden file: written once with `KVOTA_WRITE_GOLDEN=1` when the schema
/// was introduced, and decoded by every later build. A change to `raft.proto` that
/// renumbers or retypes a field fails here.
#[test]
fn the_golden_wire_entries_decode_to_the_golden_log() {
    let path = golden("raft-entries.format-1.binpb");
    if std::env::var_os("KVOTA_WRITE_GOLDEN").is_some() {
        let mut out = Vec::new();
        for e in all_entries() {
            wire::entry_to(&e).encode_length_delimited(&mut out).unwrap();
        }
        std::fs::write(&path, out).unwrap();
    }
    let bytes = std::fs::read(&path).unwrap();
    let mut rest = bytes.as_slice();
    let mut got = Vec::new();
    while !rest.is_empty() {
        let m = pb::RaftEntry::decode_length_delimited(&mut rest).unwrap();
        got.push(wire::entry_from(m, &format!("entries[{}]", got.len())).unwrap());
    }
    assert_eq!(got, all_entries());
    // And the bytes are what this build writes: encoding is deterministic (maps are
    // ordered), so every node sends the same entry as the same bytes.
    let mut again = Vec::new();
    for e in &got {
        wire::entry_to(e).encode_length_delimited(&mut again).unwrap();
    }
    assert_eq!(again, bytes);
}

#[test]
fn raft_messages_and_answers_cross_the_wire_unchanged() {
    let log = all_entries();
    let append = AppendEntriesRequest::<TypeConfig> {
        vote: Vote::new_committed(4, 1),
        prev_log_id: Some(log_id(2, 1, 10)),
        entries: log[10..].to_vec(),
        leader_commit: Some(log_id(2, 1, 9)),
    };
    let back = wire::append_from(
        pb::AppendEntriesRequest::decode(wire::append_to(&append).encode_to_vec().as_slice()).unwrap(),
    )
    .unwrap();
    assert_eq!(format!("{back:?}"), format!("{append:?}"));
    let heartbeat = AppendEntriesRequest::<TypeConfig> {
        vote: Vote::new_committed(1, 3),
        prev_log_id: None,
        entries: Vec::new(),
        leader_commit: None,
    };
    assert_eq!(
        format!("{:?}", wire::append_from(wire::append_to(&heartbeat)).unwrap()),
        format!("{heartbeat:?}")
    );

    for r in [
        AppendEntriesResponse::Success,
        AppendEntriesResponse::PartialSuccess(None),
        AppendEntriesResponse::PartialSuccess(Some(log_id(3, 2, 12))),
        AppendEntriesResponse::Conflict,
        AppendEntriesResponse::HigherVote(Vote::new(9, 2)),
    ] {
        assert_eq!(wire::append_reply_from(wire::append_reply_to(&r)).unwrap(), r);
    }
    for v in [
        VoteRequest {
            vote: Vote::new(5, 2),
            last_log_id: Some(log_id(4, 1, 100)),
        },
        VoteRequest {
            vote: Vote::new(1, 1),
            last_log_id: None,
        },
    ] {
        assert_eq!(wire::vote_request_from(wire::vote_request_to(&v)).unwrap(), v);
    }
    let granted = VoteResponse {
        vote: Vote::new(5, 2),
        vote_granted: true,
        last_log_id: Some(log_id(4, 1, 100)),
    };
    assert_eq!(wire::vote_reply_from(wire::vote_reply_to(&granted)).unwrap(), granted);

    let EntryPayload::Membership(joint) = &log[13].payload else {
        panic!("entry 14 is the joint membership")
    };
    let snap = InstallSnapshotRequest::<TypeConfig> {
        vote: Vote::new_committed(4, 1),
        meta: SnapshotMeta {
            last_log_id: Some(log_id(4, 1, 15)),
            last_membership: StoredMembership::new(Some(log_id(4, 1, 14)), joint.clone()),
            snapshot_id: "4-1-15-7".into(),
        },
        offset: 1 << 20,
        data: (0..=255u8).collect(),
        done: true,
    };
    let back = wire::snapshot_from(wire::snapshot_to(&snap)).unwrap();
    assert_eq!(format!("{back:?}"), format!("{snap:?}"));
    // A snapshot taken before any membership was applied carries openraft's empty
    // default: it crosses too (an entry's membership may not be empty, below).
    let early = InstallSnapshotRequest::<TypeConfig> {
        meta: SnapshotMeta {
            last_log_id: None,
            last_membership: StoredMembership::default(),
            snapshot_id: "0".into(),
        },
        ..snap.clone()
    };
    let back = wire::snapshot_from(wire::snapshot_to(&early)).unwrap();
    assert_eq!(format!("{back:?}"), format!("{early:?}"));
    let ok = InstallSnapshotResponse {
        vote: Vote::new_committed(4, 1),
    };
    assert_eq!(
        wire::snapshot_reply_from(wire::snapshot_reply_to(Ok(&ok)))
            .unwrap()
            .unwrap(),
        ok
    );
    let m = SnapshotMismatch {
        expect: SnapshotSegmentId {
            id: "a".into(),
            offset: 0,
        },
        got: SnapshotSegmentId {
            id: "b".into(),
            offset: 4096,
        },
    };
    match wire::snapshot_reply_from(wire::snapshot_reply_to(Err(&m))).unwrap() {
        Err(InstallSnapshotError::SnapshotMismatch(got)) => assert_eq!(got, m),
        other => panic!("{other:?}"),
    }
}

#[test]
fn what_cannot_be_read_is_refused_naming_the_field() {
    let good = wire::append_to(&AppendEntriesRequest::<TypeConfig> {
        vote: Vote::new_committed(2, 1),
        prev_log_id: None,
        entries: full_log(),
        leader_commit: None,
    });
    let err = |f: &dyn Fn(&mut pb::AppendEntriesRequest)| {
        let mut m = good.clone();
        f(&mut m);
        wire::append_from(m).expect_err("refused")
    };
    assert_eq!(err(&|m| m.vote = None), WireError::Missing("vote".into()));
    assert_eq!(
        err(&|m| m.entries[3].log_id = None),
        WireError::Missing("entries[3].log_id".into())
    );
    assert!(err(&|m| m.entries[1].payload = None)
        .to_string()
        .starts_with("entries[1].payload: absent, or of a kind this build does not know"));
    let normal = |m: &mut pb::AppendEntriesRequest, i: usize| -> pb::LogBatch {
        match m.entries[i].payload.take() {
            Some(pb::raft_entry::Payload::Normal(b)) => b,
            other => panic!("entry {i} is {other:?}"),
        }
    };
    let e = err(&|m| {
        let mut b = normal(m, 2);
        b.format = LOG_FORMAT + 1;
        m.entries[2].payload = Some(pb::raft_entry::Payload::Normal(b));
    });
    assert_eq!(
        e,
        WireError::NewerFormat {
            field: "entries[2].normal".into(),
            format: LOG_FORMAT + 1
        }
    );
    assert!(
        e.to_string().contains("is newer than this node reads") && e.to_string().contains("upgrade this node"),
        "{e}"
    );
    let e = err(&|m| {
        let mut b = normal(m, 2);
        b.format = 0;
        m.entries[2].payload = Some(pb::raft_entry::Payload::Normal(b));
    });
    assert!(
        e.to_string()
            .starts_with("entries[2].normal.format: log entry format 0 does not exist"),
        "{e}"
    );
    let e = err(&|m| {
        let mut b = normal(m, 9);
        b.commands[0].command = None;
        m.entries[9].payload = Some(pb::raft_entry::Payload::Normal(b));
    });
    assert!(
        e.to_string()
            .starts_with("entries[9].normal.commands[0]: absent, or a command this build does not know"),
        "{e}"
    );
    let e = err(&|m| {
        let mut b = normal(m, 2);
        if let Some(pb::log_command::Command::ApplyPolicy(p)) = &mut b.commands[0].command {
            p.tenants[1].admission = 7;
        }
        m.entries[2].payload = Some(pb::raft_entry::Payload::Normal(b));
    });
    assert!(
        e.to_string()
            .starts_with("entries[2].normal.commands[0].apply_policy.tenants[1].admission: admission mode 7"),
        "{e}"
    );
    // Names: every writer parsed them before proposing, so a name that is not a DNS
    // label is a damaged or foreign entry, refused where it stands.
    let e = err(&|m| {
        let mut b = normal(m, 2);
        if let Some(pb::log_command::Command::ApplyPolicy(p)) = &mut b.commands[0].command {
            p.tenants[1].name = "Not_A_Label".into();
        }
        m.entries[2].payload = Some(pb::raft_entry::Payload::Normal(b));
    });
    assert!(e.to_string().starts_with("entries[2].normal.commands[0].apply_policy.tenants[1].name: tenant name \"Not_A_Label\" is not valid: 1-63 lowercase"), "{e}");
    let find = |m: &pb::AppendEntriesRequest, want: &dyn Fn(&pb::log_command::Command) -> bool| -> usize {
        m.entries
            .iter()
            .position(|e| matches!(&e.payload, Some(pb::raft_entry::Payload::Normal(b)) if b.commands.iter().any(|c| c.command.as_ref().is_some_and(want))))
            .expect("the full log has one")
    };
    let at = find(&good, &|c| matches!(c, pb::log_command::Command::Report(_)));
    let e = err(&|m| {
        let mut b = normal(m, at);
        for c in &mut b.commands {
            if let Some(pb::log_command::Command::Report(r)) = &mut c.command {
                r.cluster = "east.example".into();
            }
        }
        m.entries[at].payload = Some(pb::raft_entry::Payload::Normal(b));
    });
    assert!(
        e.to_string().starts_with(&format!(
            "entries[{at}].normal.commands[0].report.cluster: cluster name \"east.example\" is not valid"
        )),
        "{e}"
    );
    // A report's tenant that is no DNS label is dropped, not refused: builds before
    // 2026-12-04 let `team-` into the log, and applying the report ignored it.
    let mut m = good.clone();
    let mut b = normal(&mut m, at);
    for c in &mut b.commands {
        if let Some(pb::log_command::Command::Report(r)) = &mut c.command {
            let usage = r.tenants.values().next().cloned().unwrap_or_default();
            r.tenants.insert("training-".into(), usage);
        }
    }
    m.entries[at].payload = Some(pb::raft_entry::Payload::Normal(b));
    let read = wire::append_from(m).expect("the entry is read");
    let EntryPayload::Normal(req) = &read.entries[at].payload else {
        panic!("a normal entry")
    };
    let Command::Report(r) = &req.commands[0] else {
        panic!("a report")
    };
    let EntryPayload::Normal(want) = &full_log()[at].payload else {
        panic!("a normal entry")
    };
    let Command::Report(want) = &want.commands[0] else {
        panic!("a report")
    };
    assert_eq!(
        r.tenants, want.tenants,
        "the tenant that is no label is dropped, the others kept"
    );
    let at = find(&good, &|c| matches!(c, pb::log_command::Command::RemoveCluster(_)));
    let e = err(&|m| {
        let mut b = normal(m, at);
        for c in &mut b.commands {
            if let Some(pb::log_command::Command::RemoveCluster(r)) = &mut c.command {
                r.cluster = String::new();
            }
        }
        m.entries[at].payload = Some(pb::raft_entry::Payload::Normal(b));
    });
    assert!(
        e.to_string()
            .contains(".remove_cluster.cluster: cluster name \"\" is not valid"),
        "{e}"
    );
    // Memberships that openraft could not work with.
    let membership = |f: &dyn Fn(&mut pb::RaftMembership)| {
        err(&|m| {
            let Some(pb::raft_entry::Payload::Membership(mut ms)) = m.entries[0].payload.take() else {
                panic!("entry 0 is the membership")
            };
            f(&mut ms);
            m.entries[0].payload = Some(pb::raft_entry::Payload::Membership(ms));
        })
        .to_string()
    };
    assert!(membership(&|ms| ms.configs.clear()).contains("entries[0].membership.configs: 0 voter sets"));
    assert!(
        membership(&|ms| ms.configs[0].voters.clear()).contains("entries[0].membership.configs[0]: an empty voter set")
    );
    assert!(membership(&|ms| ms.configs[0].voters.push(5)).contains("voter 5 has no entry in nodes"));
    assert!(membership(&|ms| ms.configs = vec![ms.configs[0].clone(); 3]).contains("3 voter sets"));
    assert_eq!(
        wire::vote_request_from(pb::VoteRequest::default()).unwrap_err(),
        WireError::Missing("vote".into())
    );
    assert_eq!(
        wire::snapshot_from(pb::InstallSnapshotRequest {
            vote: Some(pb::RaftVote::default()),
            ..Default::default()
        })
        .unwrap_err(),
        WireError::Missing("meta".into())
    );
    assert_eq!(
        wire::append_reply_from(pb::AppendEntriesReply::default()).unwrap_err(),
        WireError::Missing("result".into())
    );
    assert_eq!(
        wire::snapshot_reply_from(pb::InstallSnapshotReply::default()).unwrap_err(),
        WireError::Missing("result".into())
    );
}

/// A policy's showback retention crosses the wire (and its default is no bytes at all,
/// so entries written before the field existed read the same).
#[test]
fn a_showback_retention_crosses_the_wire_and_its_default_costs_nothing() {
    let base = Policy::from_yaml(Policy::article_example_yaml()).unwrap();
    let mut set = base.clone();
    set.showback.retention_ms = 30 * 24 * 3_600_000;
    for p in [&base, &set] {
        let e = entry(1, 1, normal(1, Command::ApplyPolicy(p.clone())));
        assert_eq!(through_the_wire(&e), e);
    }
    let size = |p: &Policy| {
        wire::entry_to(&entry(1, 1, normal(1, Command::ApplyPolicy(p.clone()))))
            .encode_to_vec()
            .len()
    };
    assert!(size(&set) > size(&base), "the retention is written when set");
}

/// `spec.reclaim.lendWhen` crosses the wire both ways; its default (`always`) is no
/// bytes at all, so entries written before the field existed read the same, and
/// `lendIdle: false` next to it keeps its own field.
#[test]
fn lend_when_crosses_the_wire_and_its_default_costs_nothing() {
    let base = Policy::from_yaml(Policy::article_example_yaml()).unwrap();
    let cut_off = Policy::from_yaml(&Policy::article_example_yaml().replacen(
        "spec:\n",
        "spec:\n  reclaim: {lendWhen: cutOff}\n",
        1,
    ))
    .unwrap();
    assert_eq!(cut_off.reclaim.lend_when, kvota_fairness::policy::LendWhen::CutOff);
    let off = Policy::from_yaml(&Policy::article_example_yaml().replacen(
        "spec:\n",
        "spec:\n  reclaim: {lendIdle: false}\n",
        1,
    ))
    .unwrap();
    for p in [&base, &cut_off, &off] {
        let e = entry(1, 1, normal(1, Command::ApplyPolicy(p.clone())));
        assert_eq!(through_the_wire(&e), e);
    }
    let size = |p: &Policy| {
        wire::entry_to(&entry(1, 1, normal(1, Command::ApplyPolicy(p.clone()))))
            .encode_to_vec()
            .len()
    };
    assert!(size(&cut_off) > size(&base), "cutOff is written when set");
    assert_eq!(
        size(&off),
        size(&base) + 2,
        "lendIdle: false is its own field (tag and value)"
    );
}

/// `spec.audit` crosses the wire; its default is no bytes at all (entries written
/// before the field existed read the same).
#[test]
fn an_audit_setting_crosses_the_wire_and_its_default_costs_nothing() {
    let base = Policy::from_yaml(Policy::article_example_yaml()).unwrap();
    let set = Policy::from_yaml(&Policy::article_example_yaml().replacen(
        "spec:\n",
        "spec:\n  audit: {retention: 30d, maxSize: 64Mi}\n",
        1,
    ))
    .unwrap();
    for p in [&base, &set] {
        let e = entry(1, 1, normal(1, Command::ApplyPolicy(p.clone())));
        assert_eq!(through_the_wire(&e), e);
    }
    let size = |p: &Policy| {
        wire::entry_to(&entry(1, 1, normal(1, Command::ApplyPolicy(p.clone()))))
            .encode_to_vec()
            .len()
    };
    assert!(size(&set) > size(&base), "the setting is written when set");
}

/// A report's cluster status crosses the wire; a report without one is the bytes it
/// always was.
#[test]
fn a_cluster_status_crosses_the_wire_and_its_absence_costs_nothing() {
    let Command::Report(plain) = report("east", 3, 1_000) else {
        unreachable!()
    };
    let mut with = plain.clone();
    with.status = Some(kvota_fairness::federation::ClusterStatus {
        agent_version: "0.9.0".into(),
        feature_level: 6,
        policy_revision: 7,
        report_interval_ms: 5_000,
        running: [(TenantName::from_static("training"), 2_000)].into(),
    });
    let e = |r: &UsageReport| entry(2, 3, normal(5, Command::Report(r.clone())));
    assert_eq!(through_the_wire(&e(&with)), e(&with));
    assert_eq!(through_the_wire(&e(&plain)), e(&plain));
    let json = serde_json::to_string(&e(&plain)).unwrap();
    assert!(!json.contains("status"), "{json}");
}

/// Who asked for each command crosses the Raft wire and the log store's JSON unchanged;
/// an entry naming nobody carries no such field (what a level-1 member reads).
#[test]
fn actors_cross_the_wire_and_the_log_and_are_absent_when_none() {
    let mut r = Request::new(
        5,
        vec![
            Command::Tick,
            Command::RemoveCluster {
                cluster: ClusterName::from_static("east"),
            },
        ],
    );
    let plain = serde_json::to_string(&r).unwrap();
    assert!(!plain.contains("actors"), "{plain}");
    r.actors = BTreeMap::from([(1, "operator/alice".to_string())]);
    let e = entry(2, 3, EntryPayload::Normal(r.clone()));
    assert_eq!(through_the_wire(&e), e);
    let json = serde_json::to_string(&r).unwrap();
    assert_eq!(serde_json::from_str::<Request>(&json).unwrap(), r);
    let twice = json.replacen("\"actors\":", "\"actors\":{},\"actors\":", 1);
    assert!(
        serde_json::from_str::<Request>(&twice).is_err(),
        "a duplicate field is refused"
    );
}

mod hostile_bytes {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        /// A wire entry with a byte changed, or cut short: refused, or read whole as an
        /// entry of a format this build reads (protobuf has no checksum: a changed
        /// number reads as another number, which the transport's TLS rules out in
        /// practice); never a panic.
        #[test]
        fn garbled_wire_entries_are_refused_or_read_whole(which in 0usize..15, at in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<bool>()) {
            let mut bytes = wire::entry_to(&all_entries()[which]).encode_to_vec();
            let i = at.index(bytes.len());
            if cut { bytes.truncate(i) } else { bytes[i] = byte }
            if let Ok(m) = pb::RaftEntry::decode(bytes.as_slice()) {
                if let Ok(Entry { payload: EntryPayload::Normal(r), .. }) = wire::entry_from(m, "entry") {
                    prop_assert!(r.format >= 1 && r.format <= LOG_FORMAT);
                }
            }
        }

        /// Arbitrary bytes as any message of the Raft port: an answer, not a panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..1024)) {
            let b = bytes.as_slice();
            if let Ok(m) = pb::AppendEntriesRequest::decode(b) { let _ = wire::newest_entry_format(&m); let _ = wire::append_from(m); }
            if let Ok(m) = pb::VoteRequest::decode(b) { let _ = wire::vote_request_from(m); }
            if let Ok(m) = pb::InstallSnapshotRequest::decode(b) { let _ = wire::snapshot_from(m); }
            if let Ok(m) = pb::AppendEntriesReply::decode(b) { let _ = wire::append_reply_from(m); }
            if let Ok(m) = pb::VoteReply::decode(b) { let _ = wire::vote_reply_from(m); }
            if let Ok(m) = pb::InstallSnapshotReply::decode(b) { let _ = wire::snapshot_reply_from(m); }
        }

        /// Reports with arbitrary contents cross the wire unchanged (absent and empty
        /// capacity stay apart; every field survives).
        #[test]
        fn any_report_crosses_the_wire_unchanged(
            cluster in "[a-z0-9]([a-z0-9-]{0,18}[a-z0-9])?",
            seq in any::<u64>(),
            held in any::<u64>(),
            capacity in proptest::option::of(prop::collection::btree_map("[a-z./-]{1,12}", any::<u64>(), 0..4)),
            tenants in prop::collection::btree_map("[a-z]{1,8}", (any::<u64>(), any::<u64>(), any::<u64>()), 0..6),
            window in proptest::option::of((any::<u64>(), any::<u64>())),
            now in any::<u64>(),
            decisions in prop::collection::vec(("[a-z]{1,6}/[a-z0-9.-]{1,12}", "[a-z]{1,8}", 0usize..3, any::<u64>(), any::<u64>(), ".{0,60}"), 0..4),
            status in proptest::option::of(("[ -~]{0,20}", any::<u32>(), any::<u64>(), any::<u64>(), prop::collection::btree_map("[a-z]{1,8}", any::<u64>(), 0..4))),
        ) {
            let Command::Report(mut r) = report("x", 1, 0) else { unreachable!() };
            r.cluster = ClusterName::parse(cluster).expect("the pattern makes labels");
            r.seq = seq;
            r.held_epoch = held;
            r.capacity = capacity;
            r.tenants = tenants.into_iter().map(|(k, (u, i, p))| (TenantName::parse(k).expect("the pattern makes labels"), kvota_fairness::federation::TenantReport { used_milli_gpue_ms: u, inuse: i, pending: p, largest: 0, borrowed: 0 })).collect();
            r.window = window.map(|(start_ms, end_ms)| kvota_fairness::federation::UsageWindow { start_ms, end_ms });
            use kvota_fairness::admission::Verdict;
            r.decisions = decisions
                .into_iter()
                .map(|(pod, tenant, v, milli_gpue, at_ms, text)| kvota_fairness::federation::PodDecision { pod, tenant, verdict: [Verdict::Allow, Verdict::Queue, Verdict::Deny][v], milli_gpue, at_ms, text })
                .collect();
            r.status = status.map(|(agent_version, feature_level, policy_revision, report_interval_ms, running)| kvota_fairness::federation::ClusterStatus {
                agent_version, feature_level, policy_revision, report_interval_ms,
                running: running.into_iter().map(|(t, g)| (TenantName::parse(t).expect("the pattern makes labels"), g)).collect(),
            });
            let e = entry(1, 1, EntryPayload::Normal(Request::new(now, vec![Command::Report(r)])));
            prop_assert_eq!(through_the_wire(&e), e);
        }
    }
}
