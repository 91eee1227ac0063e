//! What a node's data directory holds, checked before its Raft core starts: a saved vote
//! or log id out of the range this build accepts ([`crate::guard`]) would make openraft
//! panic (a vote of term `u64::MAX` overflows at the next election), again at every
//! restart. Earlier builds could save one (a forged reply's vote was saved unchecked),
//! and so could a damaged or tampered disk. Such a node does not start its Raft core:
//! `kvota server` stays up, healthy and not ready, saying what is wrong and how to
//! recover ([`OutOfRange`]), instead of crashing in a loop under its supervisor.
//!
//! The vote alone is repaired offline with [`repair_vote`] (`kvota repair-vote`); a log
//! that holds ids out of range is not repaired: the node is added back with an empty
//! directory.

use std::path::Path;

use openraft::storage::{RaftLogStorage, RaftStateMachine};
use openraft::{LogId, Vote};

use crate::guard::{MAX_INDEX, MAX_TERM};
use crate::store::{LogStore, StateMachineStore, StoreError};
use crate::types::NodeId;

/// The term a repaired vote gets (unless the node's own log holds a later one): above
/// every term a node of an earlier build could have voted in as a member of a working
/// group (those builds accepted terms up to 2^48 from their peers, and a node adds one
/// per election of its own), and far below the headroom.
pub const REPAIRED_TERM_FLOOR: u64 = 1 << 49;

/// A data directory whose saved state this build does not start Raft on.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OutOfRange {
    /// The saved vote's term is above [`MAX_TERM`].
    #[error(
        "the vote saved in {dir} is of term {term}, above the largest this build accepts ({MAX_TERM}): it was \
         written by an earlier kvota or after a forged message. Stop this node, run `kvota repair-vote --id {id} \
         --data-dir {dir}`, and start it again"
    )]
    Vote {
        /// The term saved.
        term: u64,
        /// The node.
        id: NodeId,
        /// The data directory (as given to `kvota server`).
        dir: String,
    },
    /// A log id the directory holds (its log, purge point, committed or applied log id)
    /// is out of range.
    #[error(
        "the {what} saved in {dir} is {log_id}, out of the range this build accepts (terms up to {MAX_TERM}, \
         indexes up to {MAX_INDEX}): the directory is damaged or was written after a forged message. Move it \
         aside and add this node back with an empty one (`kvota members add-learner`, then `kvota members \
         set-voters`), or restore a backup"
    )]
    LogId {
        /// Which log id.
        what: &'static str,
        /// It.
        log_id: String,
        /// The data directory.
        dir: String,
    },
}

fn in_range(id: &LogId<NodeId>) -> bool {
    id.leader_id.term <= MAX_TERM && id.index <= MAX_INDEX
}

/// Checks the saved vote and log ids of node `id`'s data directory `dir` (opened as
/// `log` and `sm`). A storage error is reported as such by the caller (`Err` of the outer
/// result).
pub async fn check(
    log: &mut LogStore,
    sm: &mut StateMachineStore,
    id: NodeId,
    dir: &Path,
) -> Result<Result<(), OutOfRange>, openraft::StorageError<NodeId>> {
    let dir = dir.display().to_string();
    let state = log.get_log_state().await?;
    let committed = log.read_committed().await?;
    let (applied, _) = sm.applied_state().await?;
    let ids = [
        ("last log id", state.last_log_id),
        ("purge point", state.last_purged_log_id),
        ("committed log id", committed),
        ("applied log id", applied),
    ];
    for (what, log_id) in ids {
        if let Some(l) = log_id.filter(|l| !in_range(l)) {
            return Ok(Err(OutOfRange::LogId {
                what,
                log_id: l.to_string(),
                dir,
            }));
        }
    }
    if let Some(v) = log.read_vote().await? {
        if v.leader_id().get_term() > MAX_TERM {
            return Ok(Err(OutOfRange::Vote {
                term: v.leader_id().get_term(),
                id,
                dir,
            }));
        }
    }
    Ok(Ok(()))
}

/// What [`repair_vote`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Repaired {
    /// The vote was in range: nothing written.
    NothingToDo(Option<Vote<NodeId>>),
    /// The vote out of range was replaced.
    Replaced {
        /// The vote found.
        was: Vote<NodeId>,
        /// The vote written: for itself, uncommitted, at [`REPAIRED_TERM_FLOOR`] or its
        /// log's last term if later.
        now: Vote<NodeId>,
    },
}

/// Why [`repair_vote`] could not repair.
#[derive(Debug, thiserror::Error)]
pub enum RepairError {
    /// The directory does not open, or is another node's.
    #[error("{0}")]
    Store(#[from] StoreError),
    /// Reading or writing it failed.
    #[error("{0}")]
    Storage(#[from] openraft::StorageError<NodeId>),
    /// Its log is out of range too: a vote cannot fix that.
    #[error("{0}")]
    Log(OutOfRange),
}

/// Replaces the saved vote of node `id`'s store at `raft_dir` (`DATA_DIR/raft`), if it is
/// out of range, with a vote for itself at a term in range; offline (the directory is
/// locked while the node runs). The node then campaigns from that term and follows
/// whichever term the group is at.
pub async fn repair_vote(raft_dir: &Path, id: NodeId) -> Result<Repaired, RepairError> {
    let (mut log, mut sm) = crate::store::open(raft_dir)?;
    log.claim_for_node(id).await?;
    let dir = raft_dir.parent().unwrap_or(raft_dir);
    let vote = log.read_vote().await?;
    match check(&mut log, &mut sm, id, dir).await? {
        Ok(()) => Ok(Repaired::NothingToDo(vote)),
        Err(e @ OutOfRange::LogId { .. }) => Err(RepairError::Log(e)),
        Err(OutOfRange::Vote { .. }) => {
            let was = vote.unwrap_or_default();
            let last_term = log.get_log_state().await?.last_log_id.map_or(0, |l| l.leader_id.term);
            let now = Vote::new(std::cmp::max(REPAIRED_TERM_FLOOR, last_term), id);
            log.save_vote(&now).await?;
            Ok(Repaired::Replaced { was, now })
        }
    }
}
