//! The leader acknowledges its own appends before syncing them, and the store keeps
//! that safe (`kvota_control_plane::store::flush`): a follower's append is synced before
//! it is acknowledged, the state machine applies nothing acknowledged ahead of its sync
//! until the sync is done, and a cut waits for the sync of what it cuts.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use kvota_control_plane::store::{self, LogStore, StateMachineStore};
use kvota_control_plane::types::TypeConfig;
use openraft::storage::{RaftLogStorage, RaftLogStorageExt, RaftStateMachine};
use openraft::testing::log_id;
use openraft::{Entry, RaftLogReader, Vote};
use tempfile::TempDir;

mod common;
use common::*;

/// The sample log with every entry made by `leader` (in its terms).
fn log_of(leader: u64) -> Vec<Entry<TypeConfig>> {
    sample_log()
        .into_iter()
        .map(|mut e| {
            e.log_id = log_id(e.log_id.leader_id.term, leader, e.log_id.index);
            e
        })
        .collect()
}

/// The sample log as node 1 leading term 2 makes it: every entry its own.
fn own_log() -> Vec<Entry<TypeConfig>> {
    sample_log()
        .into_iter()
        .map(|mut e| {
            e.log_id = log_id(2, 1, e.log_id.index);
            e
        })
        .collect()
}

async fn open_as(dir: &TempDir, node: u64, vote: Vote<u64>) -> (LogStore, StateMachineStore) {
    let (mut log, sm) = store::open(dir.path()).unwrap();
    log.claim_for_node(node).await.unwrap();
    log.save_vote(&vote).await.unwrap();
    (log, sm)
}

/// Whether a thread of this process is named `name` (Linux) within 5 s: a new thread
/// names itself once it runs, a moment after it was spawned.
fn thread_named(name: &str) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let found = std::fs::read_dir("/proc/self/task")
            .unwrap()
            .any(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).is_ok_and(|c| c.trim() == name));
        if found || std::time::Instant::now() >= deadline {
            return found;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A follower's append is on disk when openraft hears it is done: the leader counts that
/// acknowledgement as a durable copy. Also for entries of this node's own making when its
/// vote is no longer its own (a leader that stepped down and is sent its old entries back).
#[tokio::test]
async fn a_follower_acknowledges_only_what_it_synced() {
    for (vote, made_by) in [
        (Vote::new_committed(2, 2), 2),
        (Vote::new_committed(2, 2), 1),
        (Vote::new(3, 1), 1),
    ] {
        let dir = TempDir::new().unwrap();
        let (mut log, _sm) = open_as(&dir, 1, vote).await;
        let entries = log_of(made_by);
        let durable = log.durable();
        assert!(!durable.borrow().covers(1));
        // The first append creates the first segment; the next one writes at its end.
        log.blocking_append(entries[..1].to_vec()).await.unwrap();
        log.blocking_append(entries[1..5].to_vec()).await.unwrap();
        let now = durable.borrow().clone();
        assert!(
            now.covers(5),
            "vote {vote}, entries by node {made_by}: acknowledged before its sync: {now:?}"
        );
        assert_eq!(now.acked_ahead, None, "vote {vote}, entries by node {made_by}");
    }
}

/// The leader's own entries are acknowledged at once, synced by the flusher thread
/// shortly after, and readable all along; the state machine applies them once synced.
#[tokio::test]
async fn the_leader_acknowledges_its_own_entries_then_syncs_them() {
    let dir = TempDir::new().unwrap();
    let entries = own_log();
    {
        let (mut log, mut sm) = open_as(&dir, 1, Vote::new_committed(2, 1)).await;
        let mut durable = log.durable();
        // The first append creates the log's first segment, which is synced in place.
        log.blocking_append(entries[..1].to_vec()).await.unwrap();
        assert_eq!(durable.borrow().acked_ahead, None);
        log.blocking_append(entries[1..].to_vec()).await.unwrap();
        assert_eq!(
            durable.borrow().acked_ahead,
            Some(8),
            "the leader's append did not take the early acknowledgement"
        );
        assert!(thread_named("kvota-log-flush"), "no flusher thread");
        assert_eq!(log.try_get_log_entries(..).await.unwrap(), entries);
        tokio::time::timeout(Duration::from_secs(10), durable.wait_for(|d| d.covers(8)))
            .await
            .unwrap()
            .unwrap();
        let replies = sm.apply(entries.clone()).await.unwrap();
        assert_eq!(replies.len(), entries.len());
    }
    let (mut log, _sm) = store::open(dir.path()).unwrap();
    assert_eq!(log.try_get_log_entries(..).await.unwrap(), entries);
    assert!(log.durable().borrow().covers(8));
}

/// The state machine waits for the sync of an entry acknowledged ahead of it, and only
/// for that: an entry the log synced before acknowledging applies at once.
#[tokio::test]
async fn apply_waits_for_the_sync_of_an_early_acknowledged_entry() {
    let dir = TempDir::new().unwrap();
    let entries = log_of(1);
    // Entries 1-4 as a follower takes them (synced, then acknowledged); then this node
    // leads, and its own entries 5-8 are acknowledged while their sync is held back.
    let (mut log, mut sm) = open_as(&dir, 1, Vote::new_committed(1, 2)).await;
    log.blocking_append(log_of(2)[..4].to_vec()).await.unwrap();
    log.save_vote(&Vote::new_committed(2, 1)).await.unwrap();
    let held = log.hold_flushes_for_test();
    log.blocking_append(entries[4..].to_vec()).await.unwrap();
    let d = log.durable().borrow().clone();
    assert_eq!(d.acked_ahead, Some(8));
    assert!(d.covers(4) && !d.covers(5), "{d:?}");

    sm.apply(log_of(2)[..4].to_vec()).await.unwrap();
    let mut sm_task = tokio::spawn(async move {
        sm.apply(entries[4..6].to_vec()).await.unwrap();
        sm
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !sm_task.is_finished(),
        "entry 6 was applied while its sync was held back"
    );
    held.release();
    let sm = tokio::time::timeout(Duration::from_secs(10), &mut sm_task)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(sm.shared().read().await.last_applied, Some(log_id(2, 1, 6)));
    assert!(log.durable().borrow().covers(8));
}

/// A cut after early-acknowledged entries waits for their sync, then the mark ends at
/// the entry before the cut, with nothing acknowledged ahead any more.
#[tokio::test]
async fn a_cut_leaves_the_mark_at_the_entry_before_it() {
    let dir = TempDir::new().unwrap();
    let entries = own_log();
    let (mut log, _sm) = open_as(&dir, 1, Vote::new_committed(2, 1)).await;
    log.blocking_append(entries[..1].to_vec()).await.unwrap();
    log.blocking_append(entries[1..].to_vec()).await.unwrap();
    assert_eq!(log.durable().borrow().acked_ahead, Some(8));
    log.truncate(log_id(2, 1, 6)).await.unwrap();
    let d = log.durable().borrow().clone();
    assert_eq!((d.upto, d.acked_ahead), (Some(log_id(2, 1, 5)), None));
    assert_eq!(log.try_get_log_entries(..).await.unwrap(), entries[..5].to_vec());
    // A new leader's entries after the cut are taken as a follower's.
    log.save_vote(&Vote::new_committed(3, 2)).await.unwrap();
    let mut next = entries[5].clone();
    next.log_id = log_id(3, 2, 6);
    log.blocking_append(vec![next]).await.unwrap();
    let d = log.durable().borrow().clone();
    assert!(d.covers(6) && d.acked_ahead.is_none(), "{d:?}");
}

/// The committed log id saved to disk never runs past the durable log: the leader
/// commits entries whose own sync may still be running, and a power cut could lose them
/// while the file survives. One found past the log's end on open is ignored.
#[tokio::test]
async fn the_saved_commit_index_stays_within_the_durable_log() {
    let dir = TempDir::new().unwrap();
    let entries = log_of(1);
    {
        let (mut log, _sm) = open_as(&dir, 1, Vote::new_committed(1, 2)).await;
        log.blocking_append(log_of(2)[..4].to_vec()).await.unwrap();
        log.save_vote(&Vote::new_committed(2, 1)).await.unwrap();
        let _held = log.hold_flushes_for_test();
        log.blocking_append(entries[4..].to_vec()).await.unwrap();
        assert!(!log.durable().borrow().covers(5));
        log.save_committed(Some(log_id(2, 1, 8))).await.unwrap();
        assert_eq!(
            log.read_committed().await.unwrap(),
            Some(log_id(2, 1, 8)),
            "in memory, the commit as openraft gave it"
        );
    }
    {
        let (mut log, _sm) = store::open(dir.path()).unwrap();
        assert_eq!(
            log.read_committed().await.unwrap(),
            Some(log_id(1, 2, 4)),
            "saved: only as far as the log was durable"
        );
        assert_eq!(
            log.try_get_log_entries(..).await.unwrap().len(),
            8,
            "the held syncs ran when the store closed"
        );
        // A saved id past the log's end (the log lost its tail) is ignored on open.
        std::thread::sleep(Duration::from_millis(1_100));
        log.save_committed(Some(log_id(2, 1, 8))).await.unwrap();
        log.truncate(log_id(2, 1, 6)).await.unwrap();
    }
    let (mut log, _sm) = store::open(dir.path()).unwrap();
    assert_eq!(log.read_committed().await.unwrap(), None);
}

/// A vote that made this node leader reads back uncommitted after a restart, so openraft
/// does not restore the leadership in the same term: the leader's log may have lost
/// entries it acknowledged before their sync while its followers hold them, and it would
/// make new ones under the same log ids. Other votes read back as saved.
#[tokio::test]
async fn a_restarted_leader_does_not_lead_its_old_term_again() {
    for (vote, back) in [
        (Vote::new_committed(4, 1), Vote::new(4, 1)),
        (Vote::new_committed(4, 2), Vote::new_committed(4, 2)),
        (Vote::new(5, 1), Vote::new(5, 1)),
    ] {
        let dir = TempDir::new().unwrap();
        {
            let (mut log, _sm) = open_as(&dir, 1, vote).await;
            assert_eq!(log.read_vote().await.unwrap(), Some(back));
        }
        let (mut log, _sm) = store::open(dir.path()).unwrap();
        assert_eq!(log.read_vote().await.unwrap(), Some(back), "saved {vote}");
    }
}
