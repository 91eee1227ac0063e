//! Persistent formats of the control plane: what an earlier build wrote still reads,
//! what a newer build wrote is refused with an error that says so, and the feature
//! level moves only when every voter supports it.
//!
//! `tests/golden/` holds bytes as the build before format versions wrote them (log
//! entries as stored and replicated, a snapshot, which is also the persisted state);
//! they are format 1 and must decode, unchanged, to the values [`common::full_log`]
//! builds. A change that breaks them needs a new format version and a migration (the
//! upgrade rule in docs/operations.md).

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use kvota_client::client::Client;
use kvota_control_plane::feature::FeatureLevel;
use kvota_control_plane::store::{self, segments, StateMachineData, StoreError};
use kvota_control_plane::types::{Request, TypeConfig, LOG_FORMAT};

const FEATURE_LEVEL: FeatureLevel = FeatureLevel::NEWEST;
use kvota_fairness::policy::Policy;
use kvota_proto::raft::v1 as rv1;
use kvota_proto::v1;
use openraft::storage::{RaftLogStorageExt, RaftStateMachine};
use openraft::{Entry, EntryPayload, RaftLogReader, SnapshotMeta, StoredMembership};
use prost::Message;

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name)
}

fn golden_log() -> Vec<Entry<TypeConfig>> {
    std::fs::read_to_string(golden("log-entries.format-1.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("a format-1 entry does not decode: {e}\n{l}")))
        .collect()
}

/// The state the golden log leaves, built by applying it here.
fn state_after(log: &[Entry<TypeConfig>]) -> StateMachineData {
    let EntryPayload::Membership(m) = &log[0].payload else {
        panic!("the log starts with a membership")
    };
    StateMachineData {
        last_applied: Some(log.last().unwrap().log_id),
        last_membership: StoredMembership::new(Some(log[0].log_id), m.clone()),
        federation: replay(log),
        ..StateMachineData::default()
    }
}

#[test]
fn format_1_log_entries_decode_to_what_was_written() {
    let got = golden_log();
    assert_eq!(got, full_log());
    for e in &got {
        if let EntryPayload::Normal(r) = &e.payload {
            assert_eq!(r.format, 1, "entries without a format field are format 1");
        }
    }
    // Written today: the format first, and it reads back the same.
    let r = Request::new(5, vec![kvota_fairness::federation::Command::Tick]);
    let json = serde_json::to_string(&r).unwrap();
    assert!(json.starts_with(&format!("{{\"format\":{LOG_FORMAT},")), "{json}");
    assert_eq!(serde_json::from_str::<Request>(&json).unwrap(), r);
}

#[test]
fn a_format_1_snapshot_decodes_to_the_state_its_log_leaves() {
    let bytes = std::fs::read(golden("snapshot.format-1.json")).unwrap();
    let got = StateMachineData::decode(&bytes, FEATURE_LEVEL).unwrap();
    assert_eq!(got, state_after(&full_log()));
    assert_eq!((got.format, got.feature_level.get()), (1, 1));
    assert!(
        got.federation.policy().is_some() && got.federation.now_ms() == 8_000,
        "a state with content, not an empty one"
    );
}

/// The golden files through a real store: the entries appended and read back, the
/// snapshot installed, then the store reopened.
#[tokio::test]
async fn a_store_takes_format_1_entries_and_snapshot() {
    let dir = tempfile::tempdir().unwrap();
    let log = golden_log();
    {
        let (mut logs, mut sm) = store::open(dir.path()).unwrap();
        logs.blocking_append(log.clone()).await.unwrap();
        assert_eq!(logs.try_get_log_entries(..).await.unwrap(), log);
        let want = state_after(&log);
        let meta = SnapshotMeta {
            last_log_id: want.last_applied,
            last_membership: want.last_membership.clone(),
            snapshot_id: "golden".into(),
        };
        let bytes = std::fs::read(golden("snapshot.format-1.json")).unwrap();
        sm.install_snapshot(&meta, Box::new(std::io::Cursor::new(bytes)))
            .await
            .unwrap();
        assert_eq!(*sm.shared().read().await, want);
    }
    let mut tries = 0;
    let (mut logs, sm) = loop {
        match store::open(dir.path()) {
            Ok(s) => break s,
            Err(e) if tries < 100 && e.to_string().contains("lock") => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => panic!("reopen: {e}"),
        }
    };
    assert_eq!(logs.try_get_log_entries(..).await.unwrap(), log);
    assert_eq!(*sm.shared().read().await, state_after(&log));
}

#[test]
fn newer_formats_are_refused_with_an_error_that_says_so() {
    let line = std::fs::read_to_string(golden("log-entries.format-1.jsonl"))
        .unwrap()
        .lines()
        .nth(3)
        .unwrap()
        .to_string();
    assert!(line.contains("\"Normal\":{\"now_ms\""), "{line}");
    // The same entry marked format 2: refused, whatever follows.
    let newer = line.replacen("\"Normal\":{", "\"Normal\":{\"format\":2,", 1);
    let e = serde_json::from_str::<Entry<TypeConfig>>(&newer)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("log entry format 2 is newer than this node reads (up to 1)"),
        "{e}"
    );
    assert!(e.contains("upgrade this node"), "{e}");
    // A field this build does not know is refused, not dropped.
    let unknown = line.replacen("\"Normal\":{", "\"Normal\":{\"priority\":3,", 1);
    let e = serde_json::from_str::<Entry<TypeConfig>>(&unknown)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown field `priority`"), "{e}");
    for bad in ["\"format\":0,", "\"format\":1,\"format\":1,"] {
        let b = line.replacen("\"Normal\":{", &format!("\"Normal\":{{{bad}"), 1);
        assert!(serde_json::from_str::<Entry<TypeConfig>>(&b).is_err(), "{b}");
    }

    let snap = String::from_utf8(std::fs::read(golden("snapshot.format-1.json")).unwrap()).unwrap();
    let newer = snap.replacen('{', "{\"format\":2,", 1);
    let e = StateMachineData::decode(newer.as_bytes(), FEATURE_LEVEL).unwrap_err();
    assert!(e.contains("snapshot format 2") && e.contains("newer kvota"), "{e}");
    let next = FEATURE_LEVEL.get() + 1;
    let higher = snap.replacen('{', &format!("{{\"feature_level\":{next},"), 1);
    let e = StateMachineData::decode(higher.as_bytes(), FEATURE_LEVEL).unwrap_err();
    assert!(
        e.contains(&format!("feature level {next}")) && e.contains("upgrade this node"),
        "{e}"
    );
    assert!(
        StateMachineData::decode(higher.as_bytes(), FeatureLevel::new(next)).is_ok(),
        "a node that supports level {next} reads it"
    );
}

#[tokio::test]
async fn a_data_directory_of_a_newer_layout_or_without_its_metadata_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("meta.json"), br#"{"format":3,"node_id":1}"#).unwrap();
    let e = store::open(dir.path()).unwrap_err();
    assert!(matches!(e, StoreError::Newer { found: 3, reads: 2, .. }), "{e}");
    assert!(e.to_string().contains("newer than this kvota reads"), "{e}");
    assert!(dir.path().join("meta.json").is_file(), "nothing removed");

    // A directory whose metadata (the vote) is gone but which holds a log: refused, not
    // started empty.
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut logs, _sm) = store::open(dir.path()).unwrap();
        logs.blocking_append(golden_log()).await.unwrap();
    }
    std::fs::remove_file(dir.path().join("meta.json")).unwrap();
    let e = store::open(dir.path()).unwrap_err().to_string();
    assert!(e.contains("meta.json is missing") && e.contains("vote"), "{e}");
    assert!(
        dir.path().join("log").read_dir().unwrap().next().is_some(),
        "the log is left as it was"
    );

    // A sled directory (layout 1) that claims a later layout: refused, not migrated.
    let dir = tempfile::tempdir().unwrap();
    {
        let db = sled::open(dir.path()).unwrap();
        db.open_tree("meta")
            .unwrap()
            .insert("format", &2u32.to_le_bytes())
            .unwrap();
        db.flush().unwrap();
    }
    let e = open_retrying(dir.path()).map(|_| ()).unwrap_err();
    assert!(matches!(e, StoreError::Newer { found: 2, .. }), "{e}");
    assert!(
        dir.path().join("db").is_file() && !dir.path().join("meta.json").exists(),
        "left as it was"
    );
}

/// A build from before layout 2 opens the data directory as a sled database: on a
/// layout-2 directory that must fail, not start an empty node that could vote twice.
#[tokio::test]
async fn a_build_before_layout_2_cannot_open_a_layout_2_directory() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (logs, _sm) = store::open(dir.path()).unwrap();
        logs.claim_for_node(1).await.unwrap();
    }
    let e = sled::open(dir.path()).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("Is a directory"), "{e}");
    assert!(std::fs::read_to_string(dir.path().join("db/README"))
        .unwrap()
        .contains("layout 2"));
    // And the directory still opens as what it is.
    let (logs, _sm) = store::open(dir.path()).unwrap();
    assert!(matches!(
        logs.claim_for_node(2).await,
        Err(StoreError::OtherNode {
            stored: 1,
            requested: 2
        })
    ));
}

/// Opens a store, waiting for sled's lock on a layout-1 directory to be let go (sled
/// releases it when its background threads notice the last handle gone).
fn open_retrying(path: &std::path::Path) -> Result<(store::LogStore, store::StateMachineStore), StoreError> {
    let mut tries = 0;
    loop {
        match store::open(path) {
            Err(e) if tries < 100 && e.to_string().contains("lock") => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

/// A data directory of layout 1, as builds before layout 2 wrote it (one sled database:
/// the log as JSON under big-endian indexes, the metadata and the snapshot as JSON), is
/// migrated on open: the same log, vote, owner and state; sled's files moved aside; and
/// the migrated directory reopens as layout 2.
#[tokio::test]
async fn a_layout_1_directory_is_migrated_whole() {
    use openraft::storage::RaftLogStorage;
    let dir = tempfile::tempdir().unwrap();
    let log = golden_log();
    let want = state_after(&log);
    let snapshot = std::fs::read(golden("snapshot.format-1.json")).unwrap();
    let snap_meta = SnapshotMeta {
        last_log_id: want.last_applied,
        last_membership: want.last_membership.clone(),
        snapshot_id: "1-9-7".into(),
    };
    let vote = openraft::Vote::new_committed(4, 2);
    {
        let db = sled::open(dir.path()).unwrap();
        let logs = db.open_tree("logs").unwrap();
        for (i, line) in std::fs::read_to_string(golden("log-entries.format-1.jsonl"))
            .unwrap()
            .lines()
            .enumerate()
        {
            logs.insert(log[i].log_id.index.to_be_bytes(), line.as_bytes()).unwrap();
        }
        let meta = db.open_tree("meta").unwrap();
        meta.insert("format", &1u32.to_le_bytes()).unwrap();
        meta.insert("node_id", serde_json::to_vec(&2u64).unwrap()).unwrap();
        meta.insert("vote", serde_json::to_vec(&vote).unwrap()).unwrap();
        meta.insert("committed", serde_json::to_vec(&Some(log[3].log_id)).unwrap())
            .unwrap();
        let state = db.open_tree("state").unwrap();
        state
            .insert("snapshot_meta", serde_json::to_vec(&snap_meta).unwrap())
            .unwrap();
        state.insert("snapshot_data", snapshot.clone()).unwrap();
        state.insert("sm", snapshot.clone()).unwrap();
        db.flush().unwrap();
    }
    for round in 0..2 {
        let (mut logs, mut sm) = open_retrying(dir.path()).unwrap();
        assert_eq!(logs.try_get_log_entries(..).await.unwrap(), log, "round {round}");
        // Node 2's own leadership vote, read back uncommitted: a restarted leader must
        // win a new term (`store::flush`).
        assert_eq!(
            logs.read_vote().await.unwrap(),
            Some(openraft::Vote::new(vote.leader_id().term, 2))
        );
        assert!(vote.is_committed());
        assert!(matches!(
            logs.claim_for_node(1).await,
            Err(StoreError::OtherNode {
                stored: 2,
                requested: 1
            })
        ));
        logs.claim_for_node(2).await.unwrap();
        assert_eq!(*sm.shared().read().await, want);
        let current = sm.get_current_snapshot().await.unwrap().expect("the snapshot");
        assert_eq!(current.meta, snap_meta);
        assert_eq!(current.snapshot.into_inner(), snapshot);
        assert!(dir.path().join("meta.json").is_file() && dir.path().join("log").is_dir());
        assert!(
            dir.path().join("db").is_dir() && !dir.path().join("conf").exists(),
            "sled's files moved aside (db/ is the guard against older builds)"
        );
        assert!(
            dir.path().join("sled-layout-1.migrated").join("db").is_file(),
            "and kept"
        );
    }
}

async fn apply_policy(c: &Client) {
    let yaml = Policy::article_example_yaml().to_string();
    c.call(|ch| {
        let yaml = yaml.clone();
        async move {
            Ok(Client::admin(ch)
                .apply_policy(v1::PolicyRequest { yaml })
                .await?
                .into_inner())
        }
    })
    .await
    .unwrap();
}

async fn wait_for<F: Fn() -> bool>(what: &str, within: Duration, f: F) {
    let deadline = Instant::now() + within;
    while !f() {
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A node meets, in its own log, an entry of a format newer than it reads (as after a
/// downgrade): it stops with an error that names the format, instead of misreading it.
#[tokio::test]
async fn a_node_that_meets_a_newer_log_entry_stops_with_a_clear_error() {
    let mut cl = kvota_testkit::Cluster::start(1).await;
    cl.leader(Duration::from_secs(10)).await;
    apply_policy(&Client::new(&cl.endpoints()).unwrap()).await;
    // Let ticks append entries after it, so that the marked entry is met on replay.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let applied = cl.node(1).raft().metrics().borrow().last_applied.unwrap().index;
    cl.stop(1).await;
    // Mark the policy's entry (committed and applied, after no snapshot: it is replayed
    // at the next start) as format 2, in its segment, checksum and all.
    let log_dir = cl.dirs[0].join("raft").join("log");
    let mut marked = None;
    for seg in std::fs::read_dir(&log_dir).unwrap() {
        let path = seg.unwrap().path();
        let mut bytes = std::fs::read(&path).unwrap();
        let scanned = segments::scan(&bytes, true, &path).unwrap();
        for (i, (offset, len)) in scanned.records.iter().enumerate() {
            let index = scanned.first + i as u64;
            let offset = usize::try_from(*offset).expect("an offset in memory");
            let at = offset + segments::RECORD_HEAD;
            let mut entry = rv1::RaftEntry::decode(&bytes[at..at + *len as usize]).unwrap();
            let Some(rv1::raft_entry::Payload::Normal(batch)) = entry.payload.as_mut() else {
                continue;
            };
            let decoded = kvota_control_plane::wire::batch_from(batch.clone(), "batch").unwrap();
            if !decoded
                .commands
                .iter()
                .any(|c| matches!(c, kvota_fairness::federation::Command::ApplyPolicy(_)))
            {
                continue;
            }
            assert_eq!(batch.format, 1);
            batch.format = 2;
            let framed = segments::frame(index, &entry.encode_to_vec()).unwrap();
            assert_eq!(
                framed.len(),
                segments::RECORD_HEAD + *len as usize,
                "format 2 takes the bytes format 1 took"
            );
            bytes[offset..offset + framed.len()].copy_from_slice(&framed);
            marked = Some(index);
        }
        std::fs::write(&path, &bytes).unwrap();
    }
    let marked = marked.expect("the policy's entry");
    assert!(marked <= applied);

    // Met while the Raft core starts (it reads the log's last entry) the start fails;
    // met on replay, the core stops (`ServerHandle::broken`). Same words either way.
    let why = match cl.try_restart(1).await {
        Err(why) => why,
        Ok(()) => tokio::time::timeout(Duration::from_secs(20), cl.node(1).broken())
            .await
            .expect("the node stops"),
    };
    assert!(
        why.contains("log entry format 2 is newer than this node reads (up to 1)"),
        "{why}"
    );
    assert!(why.contains("upgrade this node"), "{why}");
    assert!(
        why.contains(&format!("LogIndex({marked})")),
        "the error names the entry: {why}"
    );
    cl.shutdown().await;
}

fn supports_2(c: &mut kvota_control_plane::server::ServerConfig) {
    c.feature_level_max = FeatureLevel::RECORDS;
}

fn node_3_supports_1(c: &mut kvota_control_plane::server::ServerConfig) {
    c.feature_level_max = if c.id == 3 {
        FeatureLevel::BASE
    } else {
        FeatureLevel::RECORDS
    };
}

/// Applies the policy `yaml` through the admin service.
async fn apply_yaml(c: &Client, yaml: &str) -> Result<v1::PolicyReply, tonic::Status> {
    c.call(|ch| {
        let yaml = yaml.to_string();
        async move {
            Ok(Client::admin(ch)
                .apply_policy(v1::PolicyRequest { yaml })
                .await?
                .into_inner())
        }
    })
    .await
}

async fn levels(cl: &kvota_testkit::Cluster) -> Vec<u32> {
    let mut out = Vec::new();
    for n in cl.nodes.iter().flatten() {
        out.push(n.ctx.state.read().await.feature_level.get());
    }
    out
}

/// The upgrade gate: while one voter supports only level 1 the group stays there; once
/// every voter supports level 2 the leader raises it on every node; a node that cannot
/// run at it (an old build started again) stops with an error that says to upgrade it.
#[tokio::test]
async fn the_feature_level_rises_only_when_every_voter_supports_it() {
    let mut cl = kvota_testkit::Cluster::start_with(3, None, node_3_supports_1).await;
    cl.leader(Duration::from_secs(10)).await;
    let client = Client::new(&cl.endpoints()).unwrap();
    apply_policy(&client).await;
    // Several ticks (200 ms each) with fresh readings from every voter: no raise.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(levels(&cl).await, vec![1, 1, 1], "node 3 supports level 1 only");
    assert!(cl.federation(1).await.showback().is_none(), "no showback at level 1");
    // A policy that sets showback needs level 2: refused, nothing changed.
    let with_showback = Policy::article_example_yaml().replacen("spec:\n", "spec:\n  showback: {retention: 30d}\n", 1);
    assert!(with_showback.contains("showback"));
    let refused = apply_yaml(&client, &with_showback).await.expect_err("needs level 2");
    assert!(
        refused.code() == tonic::Code::FailedPrecondition && refused.message().contains("feature level 2"),
        "{refused:?}"
    );
    // So does a policy that turns lending off, which needs level 3.
    let no_lending = Policy::article_example_yaml().replacen("spec:\n", "spec:\n  reclaim: {lendIdle: false}\n", 1);
    let refused = apply_yaml(&client, &no_lending).await.expect_err("needs level 3");
    assert!(
        refused.code() == tonic::Code::FailedPrecondition
            && refused.message().contains("lendIdle needs feature level 3"),
        "{refused:?}"
    );
    // And one that lends only while cut off, which needs level 5.
    let cut_off = Policy::article_example_yaml().replacen("spec:\n", "spec:\n  reclaim: {lendWhen: cutOff}\n", 1);
    let refused = apply_yaml(&client, &cut_off).await.expect_err("needs level 5");
    assert!(
        refused.code() == tonic::Code::FailedPrecondition
            && refused.message().contains("lendWhen needs feature level 5"),
        "{refused:?}"
    );

    // Node 3 upgraded: the next ticks raise the level everywhere.
    cl.set_tweak(supports_2);
    cl.stop(3).await;
    cl.restart(3).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while levels(&cl).await != vec![2, 2, 2] {
        assert!(Instant::now() < deadline, "level not raised: {:?}", levels(&cl).await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    apply_policy(&client).await;
    // Level 2: every node keeps showback from the raise on, and the policy may set it.
    for id in 1..=3 {
        assert!(
            cl.federation(id).await.showback().is_some(),
            "node {id} keeps showback at level 2"
        );
    }
    apply_yaml(&client, &with_showback)
        .await
        .expect("showback settings at level 2");

    // Node 3 downgraded: it replays the raise and stops, saying why (as it starts, when
    // the Raft core replays its log then; or right after, if it learns of it later).
    cl.set_tweak(node_3_supports_1);
    cl.stop(3).await;
    let why = match cl.try_restart(3).await {
        Err(why) => why,
        Ok(()) => tokio::time::timeout(Duration::from_secs(20), cl.node(3).broken())
            .await
            .expect("node 3 stops"),
    };
    assert!(
        why.contains("feature level 2") && why.contains("supports up to 1") && why.contains("upgrade"),
        "{why}"
    );
    // The others go on.
    wait_for("a leader among 1 and 2", Duration::from_secs(10), || {
        [1u64, 2]
            .iter()
            .any(|id| cl.node(*id).raft().metrics().borrow().state == openraft::ServerState::Leader)
    })
    .await;
    cl.stop(3).await;
    apply_policy(&client).await;
    cl.shutdown().await;
}

fn supports_3(c: &mut kvota_control_plane::server::ServerConfig) {
    c.feature_level_max = FeatureLevel::LENDING;
}

fn supports_sized(c: &mut kvota_control_plane::server::ServerConfig) {
    c.feature_level_max = FeatureLevel::SIZED;
}

/// Sends cluster `east`'s report `seq` with `training` waiting for 6 GPUe, the largest
/// pod of it 4 GPUe.
async fn report_with_largest(c: &Client, seq: u64, epoch: u64) {
    let r = v1::ReportRequest {
        cluster: "east".into(),
        seq,
        held_epoch: epoch,
        tenants: vec![v1::TenantUsage {
            tenant: "training".into(),
            used_milli_gpue_ms: 0,
            inuse_milli_gpue: 0,
            pending_milli_gpue: 6_000,
            largest_pending_milli_gpue: 4_000,
            borrowed_milli_gpue: 0,
        }],
        ..Default::default()
    };
    kvota_testkit::send_report(c, &r).await.expect("report");
}

/// The largest waiting pod of each tenant in `east`'s reports, in the order the node's
/// log holds them (read from its data directory once it is stopped).
async fn largest_in_log(dir: &std::path::Path) -> Vec<u64> {
    let mut tries = 0;
    let (mut logs, _sm) = loop {
        match store::open(&dir.join("raft")) {
            Ok(s) => break s,
            Err(e) if tries < 100 && e.to_string().contains("lock") => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("open the stopped node's store: {e}"),
        }
    };
    let mut out = Vec::new();
    for e in logs.try_get_log_entries(..).await.unwrap() {
        if let EntryPayload::Normal(r) = e.payload {
            for c in r.commands {
                if let kvota_fairness::federation::Command::Report(r) = c {
                    out.extend(r.tenants.values().map(|t| t.largest));
                }
            }
        }
    }
    out
}

/// Below the sized-budgets level the leader takes a report's largest waiting pod out
/// before it proposes the entry (a replica of an older build could not read it, and
/// none would use it); from that level on the log carries what the agent reported, and
/// the state keeps it.
#[tokio::test]
async fn a_reports_largest_waiting_pod_reaches_the_log_only_from_the_sized_level() {
    let sized = FeatureLevel::SIZED;
    let mut cl = kvota_testkit::Cluster::start_with(1, None, supports_3).await;
    cl.leader(Duration::from_secs(10)).await;
    let client = Client::new(&cl.endpoints()).unwrap();
    apply_policy(&client).await;
    cl.feature_level(FeatureLevel::LENDING, Duration::from_secs(20)).await;
    let epoch = kvota_testkit::register_gpus(&client, "east", 32_000).await;
    report_with_largest(&client, 1, epoch).await;
    let fed = cl.federation(1).await;
    assert_eq!(
        fed.clusters()["east"].usage["training"].pending,
        6_000,
        "the report was applied"
    );
    assert_eq!(
        fed.clusters()["east"].usage["training"].largest,
        0,
        "not kept below level {sized}"
    );

    // The same node upgraded: the group rises to the sized level, and a report's
    // largest pod is logged and kept.
    cl.set_tweak(supports_sized);
    cl.stop(1).await;
    cl.restart(1).await;
    cl.leader(Duration::from_secs(10)).await;
    cl.feature_level(sized, Duration::from_secs(20)).await;
    report_with_largest(&client, 2, epoch).await;
    assert_eq!(
        cl.federation(1).await.clusters()["east"].usage["training"].largest,
        4_000,
        "kept at level {sized}"
    );
    cl.stop(1).await;
    assert_eq!(
        largest_in_log(&cl.dirs[0]).await,
        vec![0, 4_000],
        "the first report was logged without it, the second with it"
    );
    cl.shutdown().await;
}

fn supports_below_lend_when(c: &mut kvota_control_plane::server::ServerConfig) {
    c.feature_level_max = FeatureLevel::SIZED;
}

fn supports_lend_when(c: &mut kvota_control_plane::server::ServerConfig) {
    c.feature_level_max = FeatureLevel::LEND_WHEN;
}

/// `spec.reclaim.lendWhen: cutOff` at the edge of its level: refused one level below
/// (nothing changed: the policy in force still lends always), applied and kept on the
/// same node once the group runs at it.
#[tokio::test]
async fn lend_when_is_refused_just_below_its_level_and_kept_at_it() {
    let level = FeatureLevel::LEND_WHEN;
    let cut_off = Policy::article_example_yaml().replacen("spec:\n", "spec:\n  reclaim: {lendWhen: cutOff}\n", 1);
    let mut cl = kvota_testkit::Cluster::start_with(1, None, supports_below_lend_when).await;
    cl.leader(Duration::from_secs(10)).await;
    let client = Client::new(&cl.endpoints()).unwrap();
    apply_policy(&client).await;
    cl.feature_level(FeatureLevel::SIZED, Duration::from_secs(20)).await;
    let refused = apply_yaml(&client, &cut_off).await.expect_err("needs its level");
    assert!(
        refused.code() == tonic::Code::FailedPrecondition
            && refused
                .message()
                .contains(&format!("lendWhen needs feature level {level}")),
        "{refused:?}"
    );
    let lend_when = |fed: &kvota_fairness::federation::Federation| fed.policy().map(|p| p.reclaim.lend_when);
    assert_eq!(
        lend_when(&cl.federation(1).await),
        Some(kvota_fairness::policy::LendWhen::Always),
        "nothing changed"
    );

    cl.set_tweak(supports_lend_when);
    cl.stop(1).await;
    cl.restart(1).await;
    cl.leader(Duration::from_secs(10)).await;
    cl.feature_level(level, Duration::from_secs(20)).await;
    apply_yaml(&client, &cut_off).await.expect("lendWhen at its level");
    assert_eq!(
        lend_when(&cl.federation(1).await),
        Some(kvota_fairness::policy::LendWhen::CutOff)
    );
    // And it survives a restart (the log replays it at the level it was written at).
    cl.stop(1).await;
    cl.restart(1).await;
    cl.leader(Duration::from_secs(10)).await;
    assert_eq!(
        lend_when(&cl.caught_up(1, Duration::from_secs(10)).await),
        Some(kvota_fairness::policy::LendWhen::CutOff),
        "after a restart"
    );
    cl.shutdown().await;
}

/// A node that is sent entries of a format newer than it reads (or a raise to a feature
/// level it does not support) refuses them and applies nothing of them; sent by the
/// leader of its group (it was added, or restarted, as an older build than the group's
/// level needs) it stays up and is not ready, with a message that names the leader and
/// the format, until it is sent entries it reads. No peer's word stops it: the same
/// payload from a node certificate that is not a member, or as a leader of an older
/// term, is only refused; and without TLS (no identities) it is only refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_sent_newer_entries_by_its_leader_is_unready_saying_why_until_it_reads_them() {
    let pki = kvota_testkit::Pki::new("kvota");
    let cl = kvota_testkit::Cluster::start_with(3, Some(&pki), |_| {}).await;
    let leader = cl.leader(Duration::from_secs(15)).await;
    let target = if leader == 3 { 2 } else { 3 };
    let sender = (1..=3).find(|n| *n != target && *n != leader).expect("a third member");
    // The target's term once it follows the leader: read before, it can be the term
    // of no leader yet, and "newer" below would not be.
    let mut watch = cl.node(target).raft().metrics();
    let term = tokio::time::timeout(
        Duration::from_secs(10),
        watch.wait_for(|m| m.current_leader == Some(leader)),
    )
    .await
    .expect("the target follows the leader")
    .expect("metrics")
    .current_term;
    // An entry of format 2 whose command this build does not know (a newer build's
    // command arrives as a field this schema lacks: an empty oneof here).
    let payload = |node: u64, term: u64, format: u32, raise: Option<u32>| rv1::AppendEntriesRequest {
        vote: Some(rv1::RaftVote {
            term,
            node_id: node,
            committed: true,
        }),
        prev_log_id: None,
        entries: vec![rv1::RaftEntry {
            log_id: Some(rv1::RaftLogId {
                term,
                node_id: node,
                index: 0,
            }),
            payload: Some(rv1::raft_entry::Payload::Normal(rv1::LogBatch {
                format,
                now_ms: 1,
                commands: if format > LOG_FORMAT {
                    vec![rv1::LogCommand::default()]
                } else {
                    vec![]
                },
                raise_feature_level: raise,
                actors: Default::default(),
            })),
        }],
        leader_commit: None,
    };
    let send = |as_node: u64, msg: rv1::AppendEntriesRequest| {
        let party = pki.party(kvota_tls::Role::Node, &as_node.to_string());
        let addr = cl.members[&target].raft_addr.clone();
        async move {
            let mut raft =
                kvota_control_plane::network::raft_client(&addr, target, Some(&party), Duration::from_secs(2)).unwrap();
            raft.append_entries(msg).await.expect_err("refused")
        }
    };
    let node = cl.node(target);
    // A heartbeat as `as_node`, leader in `term`: the target follows it.
    let lead = |as_node: u64, term: u64| {
        let party = pki.party(kvota_tls::Role::Node, &as_node.to_string());
        let addr = cl.members[&target].raft_addr.clone();
        async move {
            let mut raft =
                kvota_control_plane::network::raft_client(&addr, target, Some(&party), Duration::from_secs(2)).unwrap();
            let mut beat = payload(as_node, term, LOG_FORMAT, None);
            beat.entries.clear();
            raft.append_entries(beat).await.expect("a heartbeat")
        }
    };
    // Not a member, or a leader of an older term: refused, nothing changes.
    let s = send(9, payload(9, term + 1, 2, None)).await;
    assert!(
        s.message().contains("log entry format 2 is newer than this node reads"),
        "{s:?}"
    );
    let s = send(sender, payload(sender, term.saturating_sub(1), 2, None)).await;
    assert!(s.message().contains("format 2"), "{s:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        node.ctx.stalled(),
        None,
        "a non-member or a stale leader changes nothing"
    );
    assert_eq!(node.ctx.ready(), Ok(()));

    // The leader it follows, in its term: refused, and the node is unready saying why,
    // but up. (Here a member takes the lead by a newer term first.)
    lead(sender, term + 1).await;
    let s = send(sender, payload(sender, term + 1, 2, None)).await;
    assert!(s.message().contains("format 2"), "{s:?}");
    let why = node.ctx.ready().expect_err("unready");
    assert!(
        why.contains(&format!("node {sender}, leader in term {}", term + 1))
            && why.contains("log entries of format 2")
            && why.contains(&format!("upgrade this node's kvota, or remove node {sender}")),
        "{why}"
    );
    assert_eq!(node.ctx.fatal(), None, "the node is up");
    assert_eq!(s.code(), tonic::Code::FailedPrecondition, "{s:?}");
    // A leader of its group that sends what it reads: it follows again.
    let client = Client::with_tls(&cl.endpoints(), Some(pki.party(kvota_tls::Role::Operator, "alice"))).unwrap();
    apply_policy(&client).await;
    wait_for("ready again", Duration::from_secs(10), || node.ctx.ready().is_ok()).await;
    // A raise to a feature level it does not support: the same.
    let beyond = FeatureLevel::NEWEST.get() + 1;
    let term = node.raft().metrics().borrow().current_term;
    lead(sender, term + 1).await;
    let s = send(sender, payload(sender, term + 1, LOG_FORMAT, Some(beyond))).await;
    assert!(s.message().contains(&format!("feature level {beyond}")), "{s:?}");
    let why = node.ctx.ready().expect_err("unready");
    assert!(why.contains(&format!("feature level {beyond}")), "{why}");
    apply_policy(&client).await;
    wait_for("ready again", Duration::from_secs(10), || node.ctx.ready().is_ok()).await;
    assert_eq!(node.ctx.fatal(), None);
    cl.shutdown().await;

    // Plain text: refused, and the node goes on.
    let cl = kvota_testkit::Cluster::start(1).await;
    cl.leader(Duration::from_secs(10)).await;
    let term = cl.node(1).raft().metrics().borrow().current_term;
    let mut raft =
        kvota_control_plane::network::raft_client(&cl.members[&1].raft_addr, 1, None, Duration::from_secs(2)).unwrap();
    let s = raft
        .append_entries(payload(1, term + 1, 2, None))
        .await
        .expect_err("refused");
    assert!(s.message().contains("format 2"), "{s:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(cl.node(1).ctx.fatal(), None, "an unauthenticated payload stops nothing");
    assert_eq!(cl.node(1).ctx.stalled(), None);
    apply_policy(&Client::new(&cl.endpoints()).unwrap()).await;
    cl.shutdown().await;
}

mod hostile_bytes {
    use super::*;
    use proptest::prelude::*;

    fn golden_bytes(name: &str) -> Vec<u8> {
        std::fs::read(golden(name)).unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// A log entry with bytes changed, cut or inserted is read whole or refused
        /// with an error: never a panic, and never a format above this build's.
        #[test]
        fn garbled_log_entries_are_refused_or_read_whole(line in 0usize..10, at in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<bool>()) {
            let text = golden_bytes("log-entries.format-1.jsonl");
            let mut bytes = text.split(|b| *b == b'\n').filter(|l| !l.is_empty()).nth(line).unwrap().to_vec();
            let i = at.index(bytes.len());
            if cut { bytes.truncate(i) } else { bytes[i] = byte }
            if let Ok(Entry::<TypeConfig> { payload: EntryPayload::Normal(r), .. }) = serde_json::from_slice::<Entry<TypeConfig>>(&bytes) {
                prop_assert!(r.format >= 1 && r.format <= LOG_FORMAT);
            }
        }

        /// The same for a snapshot (which is also the persisted state).
        #[test]
        fn garbled_snapshots_are_refused_or_read_whole(at in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<bool>()) {
            let mut bytes = golden_bytes("snapshot.format-1.json");
            let i = at.index(bytes.len());
            if cut { bytes.truncate(i) } else { bytes[i] = byte }
            if let Ok(s) = StateMachineData::decode(&bytes, FEATURE_LEVEL) {
                prop_assert!(s.feature_level <= FEATURE_LEVEL && s.format <= kvota_control_plane::store::SNAPSHOT_FORMAT);
            }
        }

        /// Arbitrary bytes as a log entry or a snapshot: an answer, not a panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            let _ = serde_json::from_slice::<Entry<TypeConfig>>(&bytes);
            let _ = serde_json::from_slice::<Request>(&bytes);
            let _ = StateMachineData::decode(&bytes, FEATURE_LEVEL);
        }
    }
}

/// The state a level-6 group keeps, built by the same pure functions the store calls:
/// a raise to level 6, a leader, a learner added, clusters that join, report their
/// status, run out of leases and come back, a policy that changes something, budget
/// changes within a minute, a restore noted. What `tests/golden/snapshot.level-6.json`
/// holds.
fn level_6_state() -> StateMachineData {
    use kvota_control_plane::entry;
    use kvota_fairness::federation::{AuditEvent, ClusterStatus};
    let mut fed = kvota_fairness::federation::Federation::new();
    let mut level = FeatureLevel::BASE;
    let lease = Policy::article_example_yaml().replacen(
        "spec:\n",
        "spec:\n  lease: {duration: 6s, clockSkewMargin: 500ms}\n",
        1,
    );
    let mut raise = Request::new(
        1_000,
        vec![kvota_fairness::federation::Command::ApplyPolicy(
            Policy::from_yaml(&lease).unwrap(),
        )],
    );
    raise.raise_feature_level = Some(FeatureLevel::OPERATOR_VIEW.get());
    let mut run = |fed: &mut kvota_fairness::federation::Federation, req: Request| {
        entry::apply(fed, &mut level, req, FeatureLevel::NEWEST).unwrap();
    };
    run(&mut fed, raise);
    entry::apply_blank(&mut fed, 2, 1);
    let one = |n: u64| kvota_control_plane::types::Node {
        rpc_addr: format!("127.0.0.1:70{n}0"),
        ..Default::default()
    };
    let before = openraft::Membership::new(vec![[1u64].into()], std::collections::BTreeMap::from([(1, one(1))]));
    let after = openraft::Membership::new(
        vec![[1u64].into()],
        std::collections::BTreeMap::from([(1, one(1)), (2, one(2))]),
    );
    entry::apply_membership(&mut fed, &before, &after);
    run(
        &mut fed,
        Request::new(2_000, vec![register("east", 32), register("west", 16)]),
    );
    let status = |rev: u64| ClusterStatus {
        agent_version: "0.9.0".into(),
        feature_level: 6,
        policy_revision: rev,
        report_interval_ms: 1_000,
        running: [(kvota_fairness::names::TenantName::from_static("training"), 4_000)].into(),
    };
    let with_status = |cluster: &str, seq: u64, epoch: u64, inuse: u64, rev: u64| {
        let kvota_fairness::federation::Command::Report(mut r) = report(cluster, seq, inuse) else {
            unreachable!()
        };
        r.held_epoch = epoch;
        r.status = Some(status(rev));
        kvota_fairness::federation::Command::Report(r)
    };
    let epoch = |fed: &kvota_fairness::federation::Federation, c: &str| fed.clusters()[c].leases.last_epoch;
    let (e, w) = (epoch(&fed, "east"), epoch(&fed, "west"));
    run(
        &mut fed,
        Request::new(
            3_000,
            vec![with_status("east", 1, e, 5_000, 1), with_status("west", 1, w, 1_000, 1)],
        ),
    );
    for (seq, at) in (2..6).zip((4_000..).step_by(1_000)) {
        let e = epoch(&fed, "east");
        run(
            &mut fed,
            Request::new(
                at,
                vec![with_status("east", seq, e, if seq % 2 == 0 { 8_000 } else { 2_000 }, 1)],
            ),
        );
    }
    run(
        &mut fed,
        Request::new(12_000, vec![kvota_fairness::federation::Command::Tick]),
    );
    let changed = lease.replace("weight: 10\n", "weight: 20\n");
    run(
        &mut fed,
        Request::new(
            13_000,
            vec![kvota_fairness::federation::Command::ApplyPolicy(
                Policy::from_yaml(&changed).unwrap(),
            )],
        ),
    );
    let w = epoch(&fed, "west");
    run(
        &mut fed,
        Request::new(14_000, vec![with_status("west", 2, w, 1_000, 2)]),
    );
    fed.note(AuditEvent::SnapshotRestored {
        applied_index: 40,
        taken_at_ms: 14_500,
        taken_by: 1,
    });
    StateMachineData {
        feature_level: level,
        last_applied: Some(openraft::testing::log_id(2, 1, 20)),
        last_membership: StoredMembership::new(Some(openraft::testing::log_id(1, 1, 3)), after),
        federation: fed,
        ..StateMachineData::default()
    }
}

/// Writes the level-6 golden file from [`level_6_state`] (run once, by hand, when the
/// level is made: `KVOTA_WRITE_GOLDEN=1 cargo test -p kvota-control-plane --test formats
/// write_level_6_golden -- --ignored`). A committed golden file is never rewritten.
#[test]
#[ignore = "writes the golden file"]
fn write_level_6_golden() {
    if std::env::var_os("KVOTA_WRITE_GOLDEN").is_none() {
        return;
    }
    let path = golden("snapshot.level-6.json");
    assert!(
        !path.exists(),
        "{} exists: golden files are written once",
        path.display()
    );
    std::fs::write(&path, serde_json::to_vec(&level_6_state()).unwrap()).unwrap();
}

/// The level-6 state (policy revisions, cluster status, cut-off clusters, the audit
/// log's events, coalesced budget changes) reads back from its golden bytes to the
/// state the same steps give, and writes back to the same bytes; a build of level 5
/// refuses it with an error that says to upgrade, rather than misreading it.
#[test]
fn a_level_6_snapshot_decodes_to_the_state_its_steps_leave() {
    let bytes = std::fs::read(golden("snapshot.level-6.json")).unwrap();
    let want = level_6_state();
    let got = StateMachineData::decode(&bytes, FEATURE_LEVEL).unwrap();
    assert_eq!(got, want);
    assert_eq!(serde_json::to_vec(&want).unwrap(), bytes, "written as it was");
    let fed = &got.federation;
    assert_eq!(got.feature_level, FeatureLevel::OPERATOR_VIEW);
    assert_eq!(fed.policy_revision(), (2, 13_000));
    assert_eq!(
        fed.clusters()["west"].status.as_ref().map(|s| s.policy_revision),
        Some(2)
    );
    let kinds: std::collections::BTreeSet<&str> = fed.audit().map(|r| r.event.kind()).collect();
    for k in ["policy", "cluster", "lease", "leader", "node", "snapshot", "budgets"] {
        assert!(kinds.contains(k), "{k} in {kinds:?}");
    }
    assert!(
        fed.audit().any(|r| matches!(
            &r.event,
            kvota_fairness::federation::AuditEvent::BudgetsChanged { until_ms: Some(_), .. }
        )),
        "budget changes within a minute share a record"
    );
    let e = StateMachineData::decode(&bytes, FeatureLevel::LEND_WHEN).unwrap_err();
    assert!(e.contains("feature level 6") && e.contains("upgrade this node"), "{e}");
}

/// Below level 6 nothing of it is written: a state that saw the same steps at level 5
/// (reports carrying a status, a policy changing, leases running out) holds none of
/// the new fields, so the build before reads it; and the leader strips a report's
/// status from what it proposes below level 6.
#[test]
fn below_level_6_the_state_and_the_log_are_what_the_build_before_writes() {
    use kvota_fairness::federation::{ClusterStatus, Command};
    let mut fed = kvota_fairness::federation::Federation::new();
    FeatureLevel::LEND_WHEN.enable_in(&mut fed);
    let Command::Report(mut r) = report("east", 1, 5_000) else {
        unreachable!()
    };
    r.status = Some(ClusterStatus {
        agent_version: "0.9.0".into(),
        ..ClusterStatus::default()
    });
    let mut req = kvota_control_plane::entry::prepare(
        FeatureLevel::LEND_WHEN,
        2_000,
        vec![Command::Report(r.clone())],
        Default::default(),
        None,
    );
    let Command::Report(stripped) = &req.commands[0] else {
        unreachable!()
    };
    assert_eq!(stripped.status, None, "stripped below level 6");
    let mut level = FeatureLevel::LEND_WHEN;
    for cmd in [policy(), register("east", 32), register("west", 16)] {
        kvota_control_plane::entry::apply(
            &mut fed,
            &mut level,
            Request::new(1_000, vec![cmd]),
            FeatureLevel::NEWEST,
        )
        .unwrap();
    }
    req.commands.push(Command::Report(r));
    kvota_control_plane::entry::apply(&mut fed, &mut level, req, FeatureLevel::NEWEST).unwrap();
    kvota_control_plane::entry::apply(
        &mut fed,
        &mut level,
        Request::new(3_600_000, vec![Command::Tick]),
        FeatureLevel::NEWEST,
    )
    .unwrap();
    kvota_control_plane::entry::apply_blank(&mut fed, 3, 1);
    let json = serde_json::to_string(&fed).unwrap();
    for field in [
        "operator_view",
        "policy_revision",
        "\"status\"",
        "cut_off",
        "until_ms",
        "joined",
        "\"revision\"",
        "LeaseExpired",
        "LeaderChanged",
    ] {
        assert!(!json.contains(field), "{field} written below level 6: {json}");
    }
    assert_eq!(fed.clusters()["east"].status, None);
}

/// Messages of the member service with the new fields (a report's status, an answer's
/// policy revision) are read by the build before, which does not know them: protobuf
/// skips fields it does not know. Checked against the previous messages' schema.
#[test]
fn the_member_services_new_fields_are_skipped_by_the_build_before() {
    #[derive(Clone, PartialEq, prost::Message)]
    struct ReportReplyBefore {
        #[prost(bool, tag = "1")]
        applied: bool,
        #[prost(message, optional, tag = "2")]
        lease: Option<v1::Lease>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    struct ReportRequestBefore {
        #[prost(string, tag = "1")]
        cluster: String,
        #[prost(uint64, tag = "2")]
        seq: u64,
        #[prost(message, repeated, tag = "4")]
        tenants: Vec<v1::TenantUsage>,
    }
    let reply = v1::ReportReply {
        applied: true,
        lease: Some(v1::Lease {
            cluster: "east".into(),
            epoch: 4,
            ..Default::default()
        }),
        policy_revision: 7,
        expected_seq: 0,
    };
    let old = ReportReplyBefore::decode(reply.encode_to_vec().as_slice()).unwrap();
    assert_eq!((old.applied, old.lease.map(|l| l.epoch)), (true, Some(4)));
    let request = v1::ReportRequest {
        cluster: "east".into(),
        seq: 9,
        status: Some(v1::ClusterStatus {
            agent_version: "0.9.0".into(),
            feature_level: 6,
            policy_revision: 7,
            report_interval_ms: 5_000,
            running_milli_gpue: [("training".to_string(), 1_000)].into(),
        }),
        ..Default::default()
    };
    let old = ReportRequestBefore::decode(request.encode_to_vec().as_slice()).unwrap();
    assert_eq!((old.cluster.as_str(), old.seq), ("east", 9));
}

fn supports_operator_view(c: &mut kvota_control_plane::server::ServerConfig) {
    c.feature_level_max = FeatureLevel::OPERATOR_VIEW;
}

/// Sends cluster `east`'s report `seq` with its agent's status.
async fn report_with_status(c: &Client, seq: u64, epoch: u64) -> v1::ReportReply {
    let r = v1::ReportRequest {
        cluster: "east".into(),
        seq,
        held_epoch: epoch,
        tenants: vec![v1::TenantUsage {
            tenant: "training".into(),
            inuse_milli_gpue: 3_000,
            ..Default::default()
        }],
        status: Some(v1::ClusterStatus {
            agent_version: "0.9.0".into(),
            feature_level: 6,
            policy_revision: 1,
            report_interval_ms: 5_000,
            running_milli_gpue: [("training".to_string(), 2_000)].into(),
        }),
        ..Default::default()
    };
    kvota_testkit::send_report(c, &r).await.expect("report")
}

/// The operator view at the edge of its level, on one node: at level 5 `spec.audit` is
/// refused, a report's status does not reach the log or the state, and answers name no
/// revision; upgraded, the group rises to 6, the policy in force is revision 1, answers
/// name it, the status is kept (and logged), and `spec.audit` is applied as revision 2.
#[tokio::test]
async fn the_operator_view_starts_at_level_6_and_not_before() {
    let audit = Policy::article_example_yaml().replacen("spec:\n", "spec:\n  audit: {retention: 7d}\n", 1);
    let mut cl = kvota_testkit::Cluster::start_with(1, None, supports_lend_when).await;
    cl.leader(Duration::from_secs(10)).await;
    let client = Client::new(&cl.endpoints()).unwrap();
    apply_policy(&client).await;
    cl.feature_level(FeatureLevel::LEND_WHEN, Duration::from_secs(20)).await;
    let refused = apply_yaml(&client, &audit).await.expect_err("needs level 6");
    assert!(
        refused.code() == tonic::Code::FailedPrecondition
            && refused.message().contains("spec.audit needs feature level 6"),
        "{refused:?}"
    );
    let epoch = kvota_testkit::register_gpus(&client, "east", 32_000).await;
    let reply = report_with_status(&client, 1, epoch).await;
    assert_eq!(reply.policy_revision, 0, "no revision below level 6");
    assert_eq!(cl.federation(1).await.clusters()["east"].status, None);

    cl.set_tweak(supports_operator_view);
    cl.stop(1).await;
    cl.restart(1).await;
    cl.leader(Duration::from_secs(10)).await;
    cl.feature_level(FeatureLevel::OPERATOR_VIEW, Duration::from_secs(20))
        .await;
    assert_eq!(
        cl.federation(1).await.policy_revision().0,
        1,
        "the policy in force is revision 1"
    );
    let reply = report_with_status(&client, 2, epoch).await;
    assert_eq!(reply.policy_revision, 1);
    let fed = cl.federation(1).await;
    assert_eq!(
        fed.clusters()["east"].status.as_ref().map(|s| s.report_interval_ms),
        Some(5_000)
    );
    assert_eq!(fed.clusters()["east"].running("training"), 2_000);
    let applied = apply_yaml(&client, &audit).await.expect("spec.audit at level 6");
    assert_eq!(applied.revision, 2);
    cl.stop(1).await;
    let statuses = statuses_in_log(&cl.dirs[0]).await;
    assert_eq!(
        statuses,
        vec![false, true],
        "the first report was logged without its status"
    );
    cl.shutdown().await;
}

/// Whether each report of the stopped node's log carries a cluster status.
async fn statuses_in_log(dir: &std::path::Path) -> Vec<bool> {
    let mut tries = 0;
    let (mut logs, _sm) = loop {
        match store::open(&dir.join("raft")) {
            Ok(s) => break s,
            Err(e) if tries < 100 && e.to_string().contains("lock") => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("open the stopped node's store: {e}"),
        }
    };
    let mut out = Vec::new();
    for e in logs.try_get_log_entries(..).await.unwrap() {
        if let EntryPayload::Normal(r) = e.payload {
            for c in r.commands {
                if let kvota_fairness::federation::Command::Report(r) = c {
                    out.push(r.status.is_some());
                }
            }
        }
    }
    out
}
