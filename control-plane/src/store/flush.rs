//! The leader's `fdatasync` off the commit path, and what makes that safe.
//!
//! openraft 0.9 replicates an entry only after the leader's log store reports the
//! append flushed, so with the flush inside `append` a commit costs the leader's
//! `fdatasync` and then a follower's, one after the other. etcd overlaps them: its leader
//! sends the entries to the followers while it writes them to its own disk, and counts
//! itself towards the quorum early. What keeps that safe is that nothing learns an entry
//! is committed before the leader's own write is durable: etcd hands out the next batch
//! of committed entries, and the messages that carry the commit index, only after the
//! write of the batch before.
//!
//! kvota does the same with openraft 0.9:
//!
//! - **The leader acknowledges its own appends after the write and before the sync.**
//!   [`super::LogStore`]'s `append` writes, queues a sync with this module's flusher
//!   thread and fires openraft's callback at once, but only for entries this node made as
//!   the leader of its current, committed vote. A follower's append is synced before it
//!   is acknowledged, as before: the leader counts that acknowledgement as a durable copy.
//! - **Nothing committed becomes visible before it is durable here.** The state machine
//!   applies an entry (which answers the client, grants leases and feeds reads) only
//!   once this node's log is durable through it ([`Durable`], awaited in `apply`), and
//!   the commit index the leader sends its followers goes no further than its durable log
//!   ([`clamp_commit`], in the Raft network), so no follower applies it earlier either.
//! - **The commit index saved to disk stays within the durable log** (`save_committed`),
//!   so a restart never looks for committed entries a power cut took.
//! - **A restarted leader campaigns for a new term.** Its vote reads back uncommitted
//!   (`read_vote`): openraft 0.9 would otherwise restore the leadership in the same term,
//!   and a leader whose disk lost entries it had already sent would make new entries
//!   under log ids its followers hold with other contents (they skip entries whose ids
//!   they have).
//! - **A commit index held back goes out once the sync is done**, by a heartbeat
//!   (`server.rs`), not only with the next write.
//!
//! So when an entry is first seen as committed, the leader and the follower whose
//! acknowledgement completed the quorum have both synced it: a quorum of durable copies,
//! as Raft requires. If the leader dies before its sync, the entry may be lost, but then
//! nobody was told it was committed, and the client's call failed (an outcome every Raft
//! client must already handle). A failed sync stops the node: the state machine refuses
//! to apply past it and openraft shuts the Raft core down (the sync error is logged), the
//! log takes no more appends and the durable mark moves no further (a later sync can
//! succeed although the kernel dropped the pages the failed one held), as etcd and
//! PostgreSQL stop on a failed WAL sync rather than carry on with a log that may not be
//! on disk.

use std::fs::File;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use openraft::LogId;
use tokio::sync::watch;

use crate::types::NodeId;

/// How far this node's Raft log is durable.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Durable {
    /// Every entry through this one is on disk (`None`: nothing is known to be).
    pub upto: Option<LogId<NodeId>>,
    /// The highest index acknowledged to openraft before its sync (the leader's own
    /// appends); `None` when there never was one since the last cut.
    pub acked_ahead: Option<u64>,
    /// A sync failed: nothing written since is known to be durable, and nothing more
    /// will become so.
    pub failed: Option<String>,
}

impl Durable {
    /// Whether the entry at `index` is durable.
    pub fn covers(&self, index: u64) -> bool {
        self.upto.is_some_and(|u| u.index >= index)
    }

    /// Whether entries up to `last` may be applied: every one of them that was
    /// acknowledged before its sync is durable. (Entries acknowledged after their sync
    /// are durable already, and the state machine is never asked to apply an entry the
    /// log did not take.)
    pub fn may_apply(&self, last: u64) -> bool {
        self.acked_ahead.is_none_or(|a| self.covers(last.min(a)))
    }
}

/// The commit index a leader may send a follower: `committed`, but no further than its
/// own durable log (`durable`), so a follower never applies an entry before the leader
/// has it on disk. Both are log ids of the leader's log, so the smaller one is committed
/// too; `None` (no commit index) is smaller than any.
pub fn clamp_commit(committed: Option<LogId<NodeId>>, durable: &Durable) -> Option<LogId<NodeId>> {
    match (committed, durable.upto) {
        (Some(c), Some(d)) if d.index < c.index => Some(d),
        (Some(_), None) => None,
        (c, _) => c,
    }
}

/// The flusher: a thread that syncs what the leader's appends queued, and the
/// [`Durable`] mark every waiter watches. Cloning gives another handle to it.
#[derive(Clone)]
pub(crate) struct Flusher {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Flusher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flusher")
            .field("durable", &*self.shared.durable.borrow())
            .finish_non_exhaustive()
    }
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    durable: watch::Sender<Durable>,
}

#[derive(Default)]
struct State {
    /// The newest queued sync: after `fdatasync` of this file, everything through the
    /// log id is durable (older queued syncs are folded into it: they were writes to the
    /// same file, or to a segment synced when the log moved on from it).
    want: Option<(LogId<NodeId>, Arc<File>)>,
    /// A sync is running.
    busy: bool,
    /// The thread runs.
    started: bool,
    /// The log store was dropped: finish what is queued, then end.
    stop: bool,
    /// A test holds the syncs back ([`Flusher::hold`]).
    held: bool,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Flusher {
    /// A flusher for a log durable through `upto`.
    pub(crate) fn new(upto: Option<LogId<NodeId>>) -> Flusher {
        let (durable, _) = watch::channel(Durable {
            upto,
            acked_ahead: None,
            failed: None,
        });
        Flusher {
            shared: Arc::new(Shared {
                state: Mutex::new(State::default()),
                changed: Condvar::new(),
                durable,
            }),
        }
    }

    /// Follows the durable mark.
    pub(crate) fn subscribe(&self) -> watch::Receiver<Durable> {
        self.shared.durable.subscribe()
    }

    /// The durable mark now.
    pub(crate) fn now(&self) -> Durable {
        self.shared.durable.borrow().clone()
    }

    /// Queues a sync of `file`, which makes everything through `upto` durable, and
    /// records that entries up to `upto` are acknowledged before it. Refused once a sync
    /// failed.
    pub(crate) fn queue(&self, upto: LogId<NodeId>, file: Arc<File>) -> Result<(), String> {
        if let Some(e) = self.now().failed {
            return Err(e);
        }
        let mut st = lock(&self.shared.state);
        if !st.started {
            let shared = Arc::clone(&self.shared);
            let started = std::thread::Builder::new()
                .name("kvota-log-flush".into())
                .spawn(move || run(&shared));
            if let Err(e) = started {
                let why = format!("start the Raft log's flusher thread: {e}");
                self.shared.durable.send_modify(|d| d.failed = Some(why.clone()));
                return Err(why);
            }
            st.started = true;
        }
        self.shared.durable.send_modify(|d| d.acked_ahead = Some(upto.index));
        st.want = Some((upto, file));
        drop(st);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Records that the caller synced everything through `upto` itself. Ignored once a
    /// sync failed: after a failed `fdatasync` a later one can succeed although the
    /// pages the failed one held are gone (the kernel may have marked them clean).
    pub(crate) fn synced(&self, upto: LogId<NodeId>) {
        advance(&self.shared.durable, upto);
    }

    /// Sets the mark after the log was cut back, with every sync done (see
    /// [`Flusher::idle`]): nothing is acknowledged ahead of its sync any more. Only
    /// lowers the mark once a sync failed.
    pub(crate) fn reset(&self, upto: Option<LogId<NodeId>>) {
        self.shared.durable.send_if_modified(|d| {
            let upto = if d.failed.is_some() {
                std::cmp::min(upto, d.upto)
            } else {
                upto
            };
            let changed = d.upto != upto || d.acked_ahead.is_some();
            d.upto = upto;
            d.acked_ahead = None;
            changed
        });
    }

    /// Blocks until no sync is queued or running, then returns whether the last one
    /// failed. Called before the log is cut back, so a sync of the old tail cannot move
    /// the mark past the cut afterwards.
    pub(crate) fn idle(&self) -> Result<(), String> {
        let mut st = lock(&self.shared.state);
        while st.want.is_some() || st.busy {
            st = self.shared.changed.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
        drop(st);
        match self.now().failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Holds queued syncs back until the returned guard is released or dropped: for
    /// tests, to see what waits for a sync.
    #[cfg(any(test, feature = "test-hooks"))]
    pub(crate) fn hold(&self) -> FlushHold {
        lock(&self.shared.state).held = true;
        FlushHold { flusher: self.clone() }
    }

    /// Ends the thread once what is queued is synced.
    pub(crate) fn stop(&self) {
        lock(&self.shared.state).stop = true;
        self.shared.changed.notify_all();
    }
}

/// Queued syncs are held back while this lives (`Flusher::hold`, tests only).
#[derive(Debug)]
#[must_use = "the syncs are released when this is dropped"]
pub struct FlushHold {
    flusher: Flusher,
}

impl FlushHold {
    /// Lets the queued syncs run.
    pub fn release(self) {}
}

impl Drop for FlushHold {
    fn drop(&mut self) {
        lock(&self.flusher.shared.state).held = false;
        self.flusher.shared.changed.notify_all();
    }
}

/// Moves the mark forward to `upto` (never back, and not at all once a sync failed).
fn advance(durable: &watch::Sender<Durable>, upto: LogId<NodeId>) {
    durable.send_if_modified(|d| {
        let newer = d.failed.is_none() && d.upto.is_none_or(|u| u.index < upto.index);
        if newer {
            d.upto = Some(upto);
        }
        newer
    });
}

fn run(shared: &Shared) {
    let mut st = lock(&shared.state);
    loop {
        let next = if st.held && !st.stop { None } else { st.want.take() };
        let Some((upto, file)) = next else {
            if st.stop && st.want.is_none() {
                return;
            }
            st = shared.changed.wait(st).unwrap_or_else(PoisonError::into_inner);
            continue;
        };
        st.busy = true;
        drop(st);
        let result = file.sync_data();
        drop(file);
        match result {
            Ok(()) => advance(&shared.durable, upto),
            Err(e) => {
                let why = format!("fdatasync the Raft log through entry {upto}: {e}; this node stops applying entries");
                tracing::error!(error = %why, "the Raft log could not be synced");
                shared.durable.send_modify(|d| d.failed = Some(why));
            }
        }
        st = lock(&shared.state);
        st.busy = false;
        shared.changed.notify_all();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use openraft::CommittedLeaderId;
    use proptest::prelude::*;

    fn id(term: u64, index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(term, 1), index)
    }

    proptest! {
        /// The clamped commit index is never past the durable mark nor past the commit
        /// index, and is one of the two (or none).
        #[test]
        fn clamp_never_passes_either(c in proptest::option::of(0u64..100), d in proptest::option::of(0u64..100)) {
            let committed = c.map(|i| id(3, i));
            let durable = Durable { upto: d.map(|i| id(3, i)), acked_ahead: None, failed: None };
            let out = clamp_commit(committed, &durable);
            prop_assert!(out.map(|l| l.index) <= committed.map(|l| l.index));
            prop_assert!(out.is_none() || durable.covers(out.map_or(0, |l| l.index)));
            prop_assert!(out == committed || out == durable.upto || out.is_none());
            // Nothing is held back that is durable and committed.
            if let (Some(ci), Some(di)) = (c, d) {
                prop_assert_eq!(out.map(|l| l.index), Some(ci.min(di)));
            }
        }
    }

    proptest! {
        /// Entries may be applied exactly when each one acknowledged ahead of its sync
        /// is durable.
        #[test]
        fn may_apply_iff_every_early_ack_is_durable(
            last in 0u64..50,
            acked in proptest::option::of(0u64..50),
            upto in proptest::option::of(0u64..50),
        ) {
            let d = Durable { upto: upto.map(|i| id(2, i)), acked_ahead: acked, failed: None };
            let every_early_ack_durable = (0..=last).all(|i| acked.is_none_or(|a| i > a) || d.covers(i));
            prop_assert_eq!(d.may_apply(last), every_early_ack_durable);
        }
    }

    #[test]
    fn a_queued_sync_moves_the_mark_and_idle_waits_for_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = Arc::new(File::create(dir.path().join("f")).unwrap());
        let f = Flusher::new(Some(id(1, 4)));
        let mut rx = f.subscribe();
        f.queue(id(1, 9), Arc::clone(&file)).unwrap();
        assert_eq!(f.now().acked_ahead, Some(9));
        f.idle().unwrap();
        assert!(f.now().covers(9));
        assert!(f.now().may_apply(12));
        assert!(rx.has_changed().unwrap());
        rx.mark_unchanged();
        // An older mark never moves it back; a cut does.
        f.synced(id(1, 7));
        assert!(!rx.has_changed().unwrap());
        f.reset(Some(id(1, 5)));
        assert_eq!(f.now().upto, Some(id(1, 5)));
        assert_eq!(f.now().acked_ahead, None);
        f.stop();
    }

    /// A failed sync (`fdatasync` of /dev/null is refused) is recorded; after it the
    /// mark never moves forward and nothing more is queued.
    #[test]
    fn after_a_failed_sync_the_mark_stays() {
        let null = Arc::new(std::fs::OpenOptions::new().write(true).open("/dev/null").unwrap());
        let f = Flusher::new(Some(id(1, 4)));
        f.queue(id(1, 6), null).unwrap();
        f.idle().unwrap_err();
        let d = f.now();
        assert!(
            d.failed.as_deref().is_some_and(|e| e.contains("through entry")),
            "{d:?}"
        );
        assert_eq!(d.upto, Some(id(1, 4)));
        assert!(!d.may_apply(6) && d.may_apply(4));
        f.synced(id(1, 9));
        f.reset(Some(id(1, 8)));
        assert_eq!(f.now().upto, Some(id(1, 4)));
        let dir = tempfile::tempdir().unwrap();
        let file = Arc::new(File::create(dir.path().join("f")).unwrap());
        assert!(f.queue(id(1, 10), file).is_err());
        f.stop();
    }
}
