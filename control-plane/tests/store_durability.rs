//! The store survives restarts and crashes, cuts torn writes, refuses damage and bad
//! snapshots.
//!
//! The SIGKILL test re-runs this test binary as a child (`sigkill_child_writer`, which
//! does nothing unless `KVOTA_STORE_CRASH_DIR` is set): the child writes and prints
//! what it has had acknowledged, the parent kills it with SIGKILL and checks that
//! everything printed is still there after reopening.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Cursor};
use std::path::Path;
use std::process::{Command as Process, Stdio};
use std::time::{Duration, Instant};

use kvota_control_plane::store::{self, LogStore, StateMachineData};
use kvota_control_plane::types::{Response, TypeConfig};
use kvota_fairness::federation::{Applied, Command};
use openraft::storage::{RaftLogStorage, RaftLogStorageExt, RaftStateMachine};
use openraft::testing::log_id;
use openraft::{Entry, RaftLogReader, RaftSnapshotBuilder, SnapshotMeta, StoredMembership, Vote};
use tempfile::TempDir;

mod common;
use common::*;

const CRASH_DIR_ENV: &str = "KVOTA_STORE_CRASH_DIR";
/// Set for the child to write as the leader of its vote: its appends are acknowledged
/// before the flusher syncs them (`store::flush`).
const CRASH_AS_LEADER_ENV: &str = "KVOTA_STORE_CRASH_AS_LEADER";

/// Opens the store at `path`, waiting up to 5 s for a previous handle's lock: the lock
/// goes with the last handle, which a task on the blocking pool may hold a moment
/// longer.
fn open_retrying(path: &Path) -> (LogStore, kvota_control_plane::store::StateMachineStore) {
    let mut tries = 0;
    loop {
        match store::open(path) {
            Ok(s) => return s,
            Err(e) if tries < 100 && e.to_string().contains("lock") => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => panic!("open {}: {e}", path.display()),
        }
    }
}

async fn all_entries(log: &mut LogStore) -> Vec<Entry<TypeConfig>> {
    log.try_get_log_entries(..).await.unwrap()
}

#[tokio::test]
async fn restart_keeps_vote_log_state_machine_and_snapshot() {
    let dir = TempDir::new().unwrap();
    let log_entries = sample_log();

    let (before_entries, before_log_state, before_applied, before_data, before_snapshot) = {
        let (mut log, mut sm) = open_retrying(dir.path());
        log.save_vote(&Vote::new_committed(2, 1)).await.unwrap();
        log.blocking_append(log_entries.clone()).await.unwrap();
        log.save_committed(Some(log_id(2, 1, 8))).await.unwrap();

        let replies = sm.apply(log_entries.clone()).await.unwrap();
        assert_eq!(replies.len(), log_entries.len());
        assert_eq!(replies[0], Response(None), "membership");
        assert_eq!(replies[1], Response(None), "blank");
        assert_eq!(replies[2], Response(Some(vec![Ok(Applied::PolicyApplied)])));
        assert!(matches!(replies[3].0.as_deref(), Some([Ok(Applied::Registered(_))])));
        assert!(matches!(replies[6].0.as_deref(), Some([Err(_)])), "{:?}", replies[6]);
        assert_eq!(replies[7], Response(Some(vec![Ok(Applied::Ticked)])));

        let snapshot = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
        log.purge(log_id(1, 1, 2)).await.unwrap();

        let data = sm.shared().read().await.clone();
        assert_eq!(data.federation, replay(&log_entries));
        assert!(data.federation.policy().is_some());
        assert_eq!(data.federation.clusters().len(), 2);
        (
            all_entries(&mut log).await,
            log.get_log_state().await.unwrap(),
            sm.applied_state().await.unwrap(),
            data,
            snapshot,
        )
        // Both stores (and the db) are dropped here.
    };
    assert_eq!(before_entries, log_entries[2..].to_vec());

    let (mut log, mut sm) = open_retrying(dir.path());
    assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new_committed(2, 1)));
    assert_eq!(log.read_committed().await.unwrap(), Some(log_id(2, 1, 8)));
    let state = log.get_log_state().await.unwrap();
    assert_eq!(state, before_log_state);
    assert_eq!(state.last_purged_log_id, Some(log_id(1, 1, 2)));
    assert_eq!(state.last_log_id, Some(log_id(2, 1, 8)));
    assert_eq!(all_entries(&mut log).await, before_entries);

    assert_eq!(sm.applied_state().await.unwrap(), before_applied);
    let after = sm.shared().read().await.clone();
    assert_eq!(after, before_data);
    // Bit-identical, not merely equal.
    assert_eq!(
        serde_json::to_vec(&after).unwrap(),
        serde_json::to_vec(&before_data).unwrap()
    );

    let current = sm.get_current_snapshot().await.unwrap().unwrap();
    assert_eq!(current.meta, before_snapshot.meta);
    assert_eq!(current.snapshot.into_inner(), before_snapshot.snapshot.into_inner());
}

#[tokio::test]
async fn snapshot_moves_the_federation_to_another_node_and_survives_restart() {
    let (dir_a, dir_b) = (TempDir::new().unwrap(), TempDir::new().unwrap());
    let log_entries = sample_log();
    let (_log_a, mut sm_a) = open_retrying(dir_a.path());
    sm_a.apply(log_entries.clone()).await.unwrap();
    let snapshot = sm_a.get_snapshot_builder().await.build_snapshot().await.unwrap();
    let want = sm_a.shared().read().await.clone();
    assert_eq!(snapshot.meta.last_log_id, Some(log_id(2, 1, 8)));

    {
        let (_log_b, mut sm_b) = open_retrying(dir_b.path());
        let mut received = sm_b.begin_receiving_snapshot().await.unwrap();
        assert!(received.get_ref().is_empty());
        *received = Cursor::new(snapshot.snapshot.get_ref().clone());
        sm_b.install_snapshot(&snapshot.meta, received).await.unwrap();
        assert_eq!(*sm_b.shared().read().await, want);
    }

    let (_log_b, mut sm_b) = open_retrying(dir_b.path());
    assert_eq!(*sm_b.shared().read().await, want);
    let current = sm_b.get_current_snapshot().await.unwrap().unwrap();
    assert_eq!(current.meta, snapshot.meta);

    // Applying on after the snapshot works from the installed state.
    let next = entry(3, 9, normal(7_000, report("east", 2, 6_000)));
    let replies = sm_b.apply([next.clone()]).await.unwrap();
    assert!(matches!(
        replies[0].0.as_deref(),
        Some([Ok(Applied::Reported { applied: true, .. })])
    ));
    let mut all = log_entries;
    all.push(next);
    assert_eq!(sm_b.shared().read().await.federation, replay(&all));
}

#[tokio::test]
async fn corrupt_snapshot_is_refused_and_changes_nothing() {
    let dir = TempDir::new().unwrap();
    let log_entries = sample_log();
    let (_log, mut sm) = open_retrying(dir.path());
    sm.apply(log_entries[..5].to_vec()).await.unwrap();
    let good = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
    let before = sm.shared().read().await.clone();
    let before_applied = sm.applied_state().await.unwrap();

    let meta = SnapshotMeta {
        last_log_id: Some(log_id(5, 1, 50)),
        last_membership: StoredMembership::default(),
        snapshot_id: "5-50-1".to_string(),
    };
    // Garbage bytes.
    let garbage = Box::new(Cursor::new(b"\x00not json{".to_vec()));
    assert!(sm.install_snapshot(&meta, garbage).await.is_err());
    // Truncated snapshot.
    let bytes = good.snapshot.get_ref();
    let truncated = Box::new(Cursor::new(bytes[..bytes.len() / 2].to_vec()));
    assert!(sm.install_snapshot(&good.meta, truncated).await.is_err());
    // Well-formed state whose content does not match the meta.
    let mismatched = Box::new(Cursor::new(serde_json::to_vec(&StateMachineData::default()).unwrap()));
    assert!(sm.install_snapshot(&meta, mismatched).await.is_err());

    assert_eq!(*sm.shared().read().await, before);
    assert_eq!(sm.applied_state().await.unwrap(), before_applied);
    assert_eq!(sm.get_current_snapshot().await.unwrap().unwrap().meta, good.meta);
    drop((_log, sm));

    // Nothing reached the disk either.
    let (_log, mut sm) = open_retrying(dir.path());
    assert_eq!(*sm.shared().read().await, before);
    assert_eq!(sm.get_current_snapshot().await.unwrap().unwrap().meta, good.meta);
}

#[tokio::test]
async fn applying_an_entry_twice_is_refused() {
    let dir = TempDir::new().unwrap();
    let (_log, mut sm) = open_retrying(dir.path());
    let log_entries = sample_log();
    sm.apply(log_entries[..4].to_vec()).await.unwrap();
    let before = sm.shared().read().await.clone();
    assert!(sm.apply([log_entries[3].clone()]).await.is_err());
    assert_eq!(*sm.shared().read().await, before);
}

#[tokio::test]
async fn truncate_removes_the_tail_durably() {
    let dir = TempDir::new().unwrap();
    let log_entries = sample_log();
    {
        let (mut log, _sm) = open_retrying(dir.path());
        log.blocking_append(log_entries.clone()).await.unwrap();
        log.truncate(log_id(2, 1, 6)).await.unwrap();
        assert_eq!(all_entries(&mut log).await, log_entries[..5].to_vec());
    }
    let (mut log, _sm) = open_retrying(dir.path());
    assert_eq!(all_entries(&mut log).await, log_entries[..5].to_vec());
    assert_eq!(log.get_log_state().await.unwrap().last_log_id, Some(log_id(2, 1, 5)));
    assert_eq!(log.try_get_log_entries(3..5).await.unwrap(), log_entries[2..4].to_vec());
    assert!(log.try_get_log_entries(5..5).await.unwrap().is_empty());
    assert!(log.try_get_log_entries(9..).await.unwrap().is_empty());
}

/// The committed log id is written now and then, not on every commit: after a restart
/// it is one that was saved (never one that was not), at least the first one saved, and
/// reading it back in the same process gives the latest. Entries appended one at a time
/// (a plain insert, not a batch) survive the restart.
#[tokio::test]
async fn committed_id_is_written_lazily_and_never_ahead_of_what_was_saved() {
    let dir = TempDir::new().unwrap();
    let log_entries = sample_log();
    {
        let (mut log, _sm) = open_retrying(dir.path());
        for e in &log_entries {
            log.blocking_append(vec![e.clone()]).await.unwrap();
        }
        for i in 1..=8 {
            let term = if i <= 2 { 1 } else { 2 };
            log.save_committed(Some(log_id(term, 1, i))).await.unwrap();
            assert_eq!(log.read_committed().await.unwrap(), Some(log_id(term, 1, i)));
        }
    }
    {
        let (mut log, _sm) = open_retrying(dir.path());
        assert_eq!(all_entries(&mut log).await, log_entries);
        let committed = log
            .read_committed()
            .await
            .unwrap()
            .expect("the first committed id is always written");
        assert!((1..=8).contains(&committed.index), "{committed:?}");
        // A commit after the write interval is written again.
        std::thread::sleep(Duration::from_millis(1_100));
        log.save_committed(Some(log_id(2, 1, 8))).await.unwrap();
    }
    let (mut log, _sm) = open_retrying(dir.path());
    assert_eq!(log.read_committed().await.unwrap(), Some(log_id(2, 1, 8)));
}

#[test]
fn open_reports_the_directory() {
    let dir = TempDir::new().unwrap();
    let file = dir.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let err = store::open(&file).unwrap_err();
    let msg = err.to_string();
    assert!(msg.starts_with("create data directory "), "{msg}");
    assert!(msg.contains("not-a-dir"), "{msg}");
    // A directory another store has open: refused, saying so.
    let (_log, _sm) = open_retrying(dir.path());
    let msg = store::open(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("in use: another process holds its lock"), "{msg}");
}

/// The last segment of the log on disk.
fn last_segment(dir: &Path) -> std::path::PathBuf {
    let mut segs: Vec<_> = std::fs::read_dir(dir.join("log"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    segs.sort();
    segs.pop().expect("a segment")
}

/// A write torn by a crash (part of a record, or zeros where a power loss left the file
/// longer than its data) is cut off on open and the log goes on after the last whole
/// entry; a record damaged with whole records after it is an error that names the
/// segment and the offset, and the directory is left as it was.
#[tokio::test]
async fn a_torn_tail_is_cut_and_a_damaged_record_is_an_error() {
    let dir = TempDir::new().unwrap();
    let log_entries = sample_log();
    {
        let (mut log, _sm) = open_retrying(dir.path());
        log.blocking_append(log_entries.clone()).await.unwrap();
    }
    let seg = last_segment(dir.path());
    let whole = std::fs::read(&seg).unwrap();
    for tail in [
        &whole[whole.len() - 40..whole.len() - 3],
        &[0u8; 4096][..],
        &whole[whole.len() - 9..],
    ] {
        let mut torn = whole.clone();
        torn.extend_from_slice(tail);
        std::fs::write(&seg, &torn).unwrap();
        let (mut log, sm) = open_retrying(dir.path());
        assert_eq!(all_entries(&mut log).await, log_entries);
        drop((log, sm));
        assert_eq!(std::fs::read(&seg).unwrap(), whole, "the torn tail is cut off the file");
    }
    // The log goes on after a cut tail.
    {
        let mut torn = whole.clone();
        torn.extend_from_slice(&whole[whole.len() - 40..whole.len() - 3]);
        std::fs::write(&seg, &torn).unwrap();
        let (mut log, sm) = open_retrying(dir.path());
        let next = entry(2, log_entries.len() as u64 + 1, openraft::EntryPayload::Blank);
        log.blocking_append(vec![next.clone()]).await.unwrap();
        drop((log, sm));
        let (mut log, _sm) = open_retrying(dir.path());
        let mut want = log_entries.clone();
        want.push(next);
        assert_eq!(all_entries(&mut log).await, want);
    }
    // One byte changed in the second record: an error naming where, nothing changed.
    let before = std::fs::read(&seg).unwrap();
    let mut bad = before.clone();
    let scanned = store::segments::scan(&before, true, &seg).unwrap();
    let at = usize::try_from(scanned.records[1].0).expect("an offset in memory") + store::segments::RECORD_HEAD + 2;
    bad[at] ^= 0x10;
    std::fs::write(&seg, &bad).unwrap();
    let msg = store::open(dir.path()).unwrap_err().to_string();
    assert!(
        msg.contains(&seg.display().to_string()) && msg.contains(&format!("offset {}", scanned.records[1].0)),
        "{msg}"
    );
    assert!(msg.contains("damage, not a torn write"), "{msg}");
    assert_eq!(
        std::fs::read(&seg).unwrap(),
        bad,
        "a damaged log is left for the operator"
    );
}

/// The command the crash child writes at `index` (deterministic, so the parent can
/// replay it).
fn crash_command(index: u64) -> Command {
    match index {
        1 => policy(),
        2 => register("east", 32),
        i if i % 3 == 0 => report("east", i / 3, 1_000 * (i % 7)),
        _ => Command::Tick,
    }
}

fn crash_entry(index: u64) -> Entry<TypeConfig> {
    entry(1, index, normal(index * 1_000, crash_command(index)))
}

/// Re-applies the log entries after the state machine's last applied one, as openraft
/// does on startup (the applied state is persisted only with snapshots).
async fn catch_up(log: &mut store::LogStore, sm: &mut store::StateMachineStore) {
    let applied = sm.applied_state().await.unwrap().0.map_or(0, |l| l.index);
    let entries = all_entries(log).await;
    let rest: Vec<_> = entries.into_iter().filter(|e| e.log_id.index > applied).collect();
    if !rest.is_empty() {
        sm.apply(rest).await.unwrap();
    }
}

/// Child side of `sigkill_loses_nothing_acknowledged`: appends, applies and votes in a
/// loop, printing each acknowledgement, until killed.
#[tokio::test]
async fn sigkill_child_writer() {
    let Ok(dir) = std::env::var(CRASH_DIR_ENV) else {
        return; // Only meaningful as the child of the SIGKILL test.
    };
    let (mut log, mut sm) = open_retrying(Path::new(&dir));
    let leader = std::env::var_os(CRASH_AS_LEADER_ENV).is_some();
    if leader {
        // Node 1 leading term 1: the crash entries are its own.
        log.claim_for_node(1).await.unwrap();
        log.save_vote(&Vote::new_committed(1, 1)).await.unwrap();
    }
    let start = log
        .get_log_state()
        .await
        .unwrap()
        .last_log_id
        .map_or(1, |l| l.index + 1);
    // What openraft does on startup: re-apply the log after the loaded state.
    catch_up(&mut log, &mut sm).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    // Batches of 1 to 4 entries, as a follower receives them: a kill can tear a write
    // of several records.
    let mut index = start;
    while Instant::now() < deadline {
        let batch: Vec<_> = (index..index + 1 + index % 4).map(crash_entry).collect();
        let last = index + batch.len() as u64 - 1;
        log.blocking_append(batch.clone()).await.unwrap();
        // Past the log's first segment, the leader's appends are acknowledged early.
        assert!(
            !leader || index == 1 || log.durable().borrow().acked_ahead.is_some(),
            "a leader's append was synced in place"
        );
        println!("log {last}");
        for e in batch {
            let i = e.log_id.index;
            sm.apply([e]).await.unwrap();
            println!("applied {i}");
            if i % 5 == 0 && !leader {
                log.save_vote(&Vote::new(i, 1)).await.unwrap();
                println!("vote {i}");
            }
        }
        index = last + 1;
    }
}

#[tokio::test]
async fn sigkill_loses_nothing_acknowledged() {
    sigkill_rounds(false).await;
}

/// The same as a leader, whose appends are acknowledged before their sync: a killed
/// process's writes are still in the page cache, and `open` syncs them, so nothing
/// acknowledged is lost and the torn tail is still cut cleanly. (What a power cut
/// loses of them is never applied or sent as committed: tests/store_flush.rs.)
#[tokio::test]
async fn sigkill_of_a_leader_loses_nothing_acknowledged() {
    sigkill_rounds(true).await;
}

async fn sigkill_rounds(leader: bool) {
    let dir = TempDir::new().unwrap();
    let exe = std::env::current_exe().unwrap();
    let (mut max_log, mut max_applied, mut max_vote) = (0u64, 0u64, 0u64);

    // Many crashes, each resuming from the directory the previous one left, killed after
    // a varying number of entries so that the kill lands at every stage of an append.
    let rounds: Vec<u64> = (0..16u64).map(|r| 9 + (r * 37) % 31).collect();
    for kill_after in rounds.iter().copied() {
        let mut child = Process::new(&exe)
            .args(["sigkill_child_writer", "--exact", "--nocapture", "--test-threads=1"])
            .env(CRASH_DIR_ENV, dir.path())
            .envs(leader.then_some((CRASH_AS_LEADER_ENV, "1")))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut record = |line: &str| {
            let mut parts = line.split(' ');
            let (Some(kind), Some(n)) = (parts.next(), parts.next()) else {
                return;
            };
            let Ok(n) = n.parse::<u64>() else { return };
            match kind {
                "log" => max_log = max_log.max(n),
                "applied" => max_applied = max_applied.max(n),
                "vote" => max_vote = max_vote.max(n),
                _ => {}
            }
        };
        let mut seen = 0;
        while seen < kill_after {
            let Some(line) = lines.next() else { break };
            let line = line.unwrap();
            if line.starts_with("applied ") {
                seen += 1;
            }
            record(&line);
        }
        assert_eq!(seen, kill_after, "child stopped early");
        // `Child::kill` is SIGKILL on Unix: no destructors, no flush at exit.
        child.kill().unwrap();
        // Whatever the child printed before dying was acknowledged: read it all.
        for line in lines {
            record(&line.unwrap());
        }
        child.wait().unwrap();

        let (mut log, mut sm) = open_retrying(dir.path());
        let entries = all_entries(&mut log).await;
        let last = log.get_log_state().await.unwrap().last_log_id.unwrap().index;
        assert!(last >= max_log, "log lost entries: last {last}, acknowledged {max_log}");
        let want: Vec<_> = (1..=last).map(crash_entry).collect();
        assert_eq!(entries, want, "log is not the contiguous prefix written");
        let vote = log.read_vote().await.unwrap().unwrap();
        assert!(vote.leader_id().get_term() >= max_vote, "vote {vote} < {max_vote}");
        // The applied state survives through the log: after the startup catch-up it
        // covers every acknowledged apply.
        catch_up(&mut log, &mut sm).await;
        let applied = sm.applied_state().await.unwrap().0.unwrap().index;
        assert!(applied >= max_applied, "applied {applied} < acknowledged {max_applied}");
        assert_eq!(applied, sm.shared().read().await.last_applied.unwrap().index);
        assert_eq!(
            sm.shared().read().await.federation,
            replay(&want[..usize::try_from(applied).unwrap()])
        );
    }
    let total: u64 = rounds.iter().sum();
    assert!(max_applied >= total, "{} rounds applied {max_applied}", rounds.len());
}

/// A snapshot with bytes changed anywhere: installing it either fails and changes
/// nothing, or installs exactly a state that decodes and matches its meta (a change
/// inside a string can still be valid JSON). Never a panic.
#[test]
fn mutated_snapshots_are_refused_or_installed_whole() {
    use proptest::prelude::*;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = TempDir::new().unwrap();
    let (good, sm) = rt.block_on(async {
        let (_log, mut sm) = open_retrying(dir.path());
        sm.apply(sample_log()[..5].to_vec()).await.unwrap();
        let good = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
        drop(_log);
        (good, sm)
    });
    let bytes = good.snapshot.get_ref().clone();
    let before = rt.block_on(async { sm.shared().read().await.clone() });
    let sm = std::cell::RefCell::new(sm);
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config {
        cases: 64,
        ..Default::default()
    });
    runner
        .run(
            &proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
            |edits| {
                let mut b = bytes.clone();
                for (i, v) in edits {
                    let i = i.index(b.len());
                    b[i] = v;
                }
                let decoded = serde_json::from_slice::<StateMachineData>(&b).ok();
                let mut sm = sm.borrow_mut();
                let r = rt.block_on(sm.install_snapshot(&good.meta, Box::new(Cursor::new(b))));
                let now = rt.block_on(async { sm.shared().read().await.clone() });
                match r {
                    Err(_) => prop_assert_eq!(&now, &before),
                    Ok(()) => {
                        let d = decoded.expect("installed, so it decoded");
                        prop_assert_eq!(&now, &d);
                        prop_assert_eq!(d.last_applied, good.meta.last_log_id);
                    }
                }
                // Put the good one back for the next case.
                rt.block_on(sm.install_snapshot(&good.meta, Box::new(Cursor::new(bytes.clone()))))
                    .unwrap();
                Ok(())
            },
        )
        .unwrap();
}
