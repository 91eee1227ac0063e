//! What a peer may make this node's Raft core do: every Raft message and every reply to
//! one is checked here before openraft sees it.
//!
//! openraft 0.9 trusts its peers. It increments terms and indexes without overflow
//! checks (`term + 1` on a term of `u64::MAX` panics), it `unwrap`s a `Conflict` answer to
//! a request that carried no `prev_log_id`, and it only `debug_assert`s that a partial
//! success lies within what was sent, that a higher vote is higher, that a follower's
//! log never goes back and that a log id inside the committed log is the committed one.
//! So a node certificate in the wrong hands could panic every other node's core, or
//! move the group to a term from which no election can follow. The checks here make
//! every such message a refusal (a request) or a network error (a reply), counted and
//! logged, and leave openraft only what a correct peer could have sent.
//!
//! # Terms and indexes with headroom
//!
//! Terms and indexes are `u64` in every format (the Raft port, the log segments,
//! `meta.json`), so the ceiling is `u64::MAX`. Any term up to [`MAX_FREE_TERM`]
//! (2^64 − 2^40 − 1) is accepted from any peer, whatever this node's own term: openraft
//! 0.9 has no pre-vote, so a node cut off for a day comes back thousands of terms ahead,
//! and a new learner starts at term 0; both must join. The last [`TERM_HEADROOM`]
//! (2^40) terms below the ceiling open with time: at wall-clock time `t`, terms up to
//! [`term_ceiling`]`(t)` are accepted, ten more each second since
//! [`HEADROOM_EPOCH_UNIX_MS`] (2026-01-01). Every node opens the same terms at the same
//! time (within its clock's skew), so no attack can leave one honest node deeper than
//! another will follow: a compromised voter can move the group straight to the
//! ceiling of the moment, and from there ten terms a second, faster than honest
//! elections (a candidate waits an election timeout, 150 ms or more, between them) but
//! never past what every node accepts a moment later. The headroom lasts 3,400 years.
//! Indexes: a snapshot is the only message that moves a log's index by more than the
//! entries it carries; it may go to [`MAX_FREE_INDEX`] (2^63), and above that at most
//! [`SNAPSHOT_INDEX_STEP`] past this node's log; nothing is accepted above
//! [`MAX_INDEX`].

use std::collections::BTreeSet;
use std::sync::{Mutex, OnceLock, PoisonError};

use openraft::error::SnapshotMismatch;
use openraft::raft::{AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotResponse, VoteRequest, VoteResponse};
use openraft::{LogId, RaftMetrics, SnapshotMeta, Vote};

use crate::types::{Node, NodeId, TypeConfig};

/// Terms below the ceiling (`u64::MAX`) that open with time only.
pub const TERM_HEADROOM: u64 = 1 << 40;

/// The largest term accepted from a peer whatever the time and this node's own term.
pub const MAX_FREE_TERM: u64 = u64::MAX - TERM_HEADROOM;

/// No term above this is accepted at all: the rest of the range is left for this node's
/// own elections (openraft adds one per election, unchecked).
pub const MAX_TERM: u64 = u64::MAX - (1 << 16);

/// When the headroom starts to open (2026-01-01T00:00:00Z, Unix milliseconds).
pub const HEADROOM_EPOCH_UNIX_MS: u64 = 1_767_225_600_000;

/// How many milliseconds of wall-clock time open one more term of the headroom: ten
/// terms a second, more than any group elects (an election timeout is 150 ms or more),
/// so honest elections are never held back for long; 2^40 terms last 3,400 years.
pub const HEADROOM_MS_PER_TERM: u64 = 100;

/// The largest term accepted from a peer at wall-clock time `now_unix_ms`.
pub fn term_ceiling(now_unix_ms: u64) -> u64 {
    let opened = now_unix_ms.saturating_sub(HEADROOM_EPOCH_UNIX_MS) / HEADROOM_MS_PER_TERM;
    MAX_FREE_TERM.saturating_add(opened).min(MAX_TERM)
}

/// Now, in Unix milliseconds (this node's wall clock).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Whether a peer may bring `term` (a vote's) to a node at term `current` at wall-clock
/// time `now_unix_ms` (see the module docs).
pub fn admit_term(what: &str, term: u64, current: u64, now_unix_ms: u64) -> Result<(), Refused> {
    if term <= MAX_FREE_TERM || term <= current {
        return Ok(());
    }
    if term > MAX_TERM {
        return Err(out_of_range(format!(
            "{what} term {term} is above the largest accepted ({MAX_TERM})"
        )));
    }
    let ceiling = term_ceiling(now_unix_ms);
    if term > ceiling {
        return Err(out_of_range(format!(
            "{what} term {term} is above {ceiling}: the last {TERM_HEADROOM} terms below the ceiling open ten a \
             second, and this one opens in {} s (check this node's clock if that is wrong)",
            (term - ceiling).saturating_mul(HEADROOM_MS_PER_TERM) / 1_000
        )));
    }
    Ok(())
}

/// The largest log index a snapshot may move this node's log to, whatever the log holds.
/// Appends only extend a log by the entries they carry (each must follow the one
/// before), so only a snapshot jumps: at a million entries a second, the 2^63 indexes
/// left above it last 290,000 years.
pub const MAX_FREE_INDEX: u64 = 1 << 63;

/// Above [`MAX_FREE_INDEX`], how far past this node's last log index a snapshot may go: far
/// more than a follower ever lags (a leader snapshots every 10,000 entries), far too little
/// to walk to [`MAX_INDEX`] in any number of snapshots.
pub const SNAPSHOT_INDEX_STEP: u64 = 1 << 24;

/// No log index above this is accepted.
pub const MAX_INDEX: u64 = u64::MAX - (1 << 32);

/// Largest snapshot received (offset plus chunk): 1 GiB. It is held in memory while it
/// arrives; a state machine of the documented limits is far smaller.
pub const MAX_SNAPSHOT_BYTES: u64 = 1 << 30;

/// Why a Raft message, or a reply to one, was refused before it reached openraft.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// The metric's reason: `sender_mismatch`, `not_a_member`, `out_of_range`,
    /// `inconsistent`, `newer_format`, `bad_snapshot`.
    pub reason: &'static str,
    /// In words.
    pub why: String,
}

pub(crate) fn out_of_range(why: String) -> Refused {
    Refused {
        reason: "out_of_range",
        why,
    }
}

pub(crate) fn inconsistent(why: String) -> Refused {
    Refused {
        reason: "inconsistent",
        why,
    }
}

/// What the checks need to know of this node: read from its Raft metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Local {
    /// Its id.
    pub id: NodeId,
    /// Its current term.
    pub term: u64,
    /// Its current vote.
    pub vote: Vote<NodeId>,
    /// A log id it committed (the last it applied, or one it committed since): at or
    /// below its index, the log is settled.
    pub applied: Option<LogId<NodeId>>,
    /// The index of its last log entry.
    pub last_log_index: Option<u64>,
    /// The leader it knows.
    pub leader: Option<NodeId>,
    /// The members (voters and learners) of the membership in force: empty before the
    /// node belongs to a group.
    pub members: BTreeSet<NodeId>,
    /// Its voters.
    pub voters: BTreeSet<NodeId>,
    /// The log id of the membership in force, and whether it is the same membership as
    /// `members` describes (kept to compare a snapshot's).
    pub membership_log_id: Option<LogId<NodeId>>,
}

impl Local {
    /// From the node's Raft metrics.
    pub fn of(m: &RaftMetrics<NodeId, Node>) -> Local {
        Local {
            id: m.id,
            term: m.current_term,
            vote: m.vote,
            applied: m.last_applied,
            last_log_index: m.last_log_index,
            leader: m.current_leader,
            members: m.membership_config.membership().nodes().map(|(id, _)| *id).collect(),
            voters: m.membership_config.membership().voter_ids().collect(),
            membership_log_id: *m.membership_config.log_id(),
        }
    }
}

/// The checks' view of the node: its metrics (once Raft runs), and what it has
/// committed. Shared by the Raft port (requests) and the clients to the peers (replies).
#[derive(Debug, Default)]
pub struct Guard {
    metrics: OnceLock<tokio::sync::watch::Receiver<RaftMetrics<NodeId, Node>>>,
    /// A log id this node has committed, as the Raft port saw openraft take it (ahead
    /// of the metrics, which tell only what was applied).
    committed: Mutex<Option<LogId<NodeId>>>,
}

impl Guard {
    /// Starts reading the node's state from its Raft metrics.
    pub fn attach(&self, metrics: tokio::sync::watch::Receiver<RaftMetrics<NodeId, Node>>) {
        let _ = self.metrics.set(metrics);
    }

    /// The node as it is now; before Raft runs, a node at term 0 with nothing.
    pub fn local(&self) -> Local {
        let mut local = self.metrics.get().map(|m| Local::of(&m.borrow())).unwrap_or_default();
        let committed = *self.committed.lock().unwrap_or_else(PoisonError::into_inner);
        local.applied = std::cmp::max(local.applied, committed);
        local
    }

    /// This node has committed `id` (an AppendEntries it answered with success, a
    /// snapshot it installed).
    pub fn committed(&self, id: Option<LogId<NodeId>>) {
        let mut c = self.committed.lock().unwrap_or_else(PoisonError::into_inner);
        *c = std::cmp::max(*c, id);
    }

    /// Whether a peer may bring `term` to this node now ([`admit_term`]).
    pub fn admit_term(&self, what: &str, term: u64, local: &Local) -> Result<(), Refused> {
        admit_term(what, term, local.term, unix_ms())
    }
}

fn check_index(what: &str, index: u64) -> Result<(), Refused> {
    if index > MAX_INDEX {
        return Err(out_of_range(format!(
            "{what} index {index} is above the largest accepted ({MAX_INDEX})"
        )));
    }
    Ok(())
}

/// A log id a message carries: of no later term than the sender's vote (`max_term`), an
/// index in range, and, at or below the index this node has applied, no later than the
/// log id it applied (what is applied is committed: a log id there is either the one
/// this node holds or an earlier one a stale message carries, never a later one).
fn check_log_id(what: &str, id: Option<&LogId<NodeId>>, max_term: u64, local: &Local) -> Result<(), Refused> {
    let Some(id) = id else { return Ok(()) };
    if id.leader_id.term > max_term {
        return Err(out_of_range(format!(
            "{what} {id} is of a term after the sender's ({max_term})"
        )));
    }
    check_index(what, id.index)?;
    if let Some(applied) = local.applied {
        // A log only grows later: at or below a committed entry's index no later log id
        // than it, past it no earlier one.
        let at_or_below = id.index <= applied.index;
        if (at_or_below && *id > applied) || (!at_or_below && *id < applied) {
            return Err(inconsistent(format!(
                "{what} {id} contradicts the committed log (this node applied {applied})"
            )));
        }
    }
    Ok(())
}

/// What a message's log ids are checked against: this node's committed log if openraft
/// would act on them (the message's vote is at least this node's), else nothing (openraft
/// answers an older leader with its newer vote before it reads a log id, and that
/// answer is how a stale leader learns it is one).
fn against(vote: &Vote<NodeId>, local: &Local) -> Local {
    if matches!(
        vote.partial_cmp(&local.vote),
        Some(std::cmp::Ordering::Greater | std::cmp::Ordering::Equal)
    ) {
        local.clone()
    } else {
        Local::default()
    }
}

/// The vote a message carries: its term admitted, committed or not as the message
/// needs, and (with `sender`, the caller's certificate) the sender's own, from a member
/// of this node's group (any sender before it has one: a new learner hears first from a
/// leader it does not know yet).
fn check_sender(
    vote: &Vote<NodeId>,
    committed: bool,
    sender: Option<NodeId>,
    local: &Local,
    guard: &Guard,
) -> Result<(), Refused> {
    guard.admit_term("vote", vote.leader_id().get_term(), local)?;
    if vote.is_committed() != committed {
        return Err(inconsistent(format!(
            "{} vote ({vote}) where {} one belongs",
            if vote.is_committed() {
                "a committed"
            } else {
                "an uncommitted"
            },
            if committed {
                "a leader's committed"
            } else {
                "a candidate's uncommitted"
            }
        )));
    }
    let claimed = vote.leader_id().voted_for();
    if local.id != 0 && claimed == Some(local.id) {
        // Only this node speaks as itself; openraft would make it leader on such a word.
        return Err(Refused {
            reason: "sender_mismatch",
            why: format!("a message as this node ({}) itself", local.id),
        });
    }
    if let Some(sender) = sender {
        if claimed != Some(sender) {
            return Err(Refused {
                reason: "sender_mismatch",
                why: format!(
                    "node {sender} sent a message as node {}",
                    claimed.map_or_else(|| "?".to_string(), |c| c.to_string())
                ),
            });
        }
        if !local.members.is_empty() && !local.members.contains(&sender) {
            return Err(Refused {
                reason: "not_a_member",
                why: format!("node {sender} is not a member of this node's group"),
            });
        }
    }
    Ok(())
}

/// AppendEntries: the leader's committed vote, then the log ids: in range, of no later
/// term than the vote, consistent with the committed log, entries numbered one after
/// another from `prev_log_id`.
pub fn check_append(
    rpc: &AppendEntriesRequest<TypeConfig>,
    sender: Option<NodeId>,
    local: &Local,
    guard: &Guard,
) -> Result<(), Refused> {
    check_sender(&rpc.vote, true, sender, local, guard)?;
    let term = rpc.vote.leader_id().get_term();
    let local = &against(&rpc.vote, local);
    check_log_id("prev_log_id", rpc.prev_log_id.as_ref(), term, local)?;
    if let Some(c) = &rpc.leader_commit {
        // Only compared with this node's log (openraft commits no further than it
        // holds), so only the range matters.
        check_log_id("leader_commit", Some(c), term, &Local::default())?;
    }
    let mut last_leader = rpc.prev_log_id.map(|l| l.leader_id);
    let mut next = rpc.prev_log_id.map_or(Some(0), |l| l.index.checked_add(1));
    for e in &rpc.entries {
        check_log_id("entry", Some(&e.log_id), term, local)?;
        if Some(e.log_id.index) != next {
            return Err(out_of_range(format!(
                "entry {} where entry index {} belongs",
                e.log_id,
                next.map_or_else(|| "(none)".to_string(), |n| n.to_string())
            )));
        }
        if Some(e.log_id.leader_id) < last_leader {
            return Err(out_of_range(format!(
                "entry {} is of an earlier leader than the one before it",
                e.log_id
            )));
        }
        last_leader = Some(e.log_id.leader_id);
        next = e.log_id.index.checked_add(1);
    }
    Ok(())
}

/// The commit index to hand openraft for an AppendEntries. openraft commits
/// `min(accepted, leader_commit)` and takes that log id as committed whether or not the
/// follower's log holds it there; so a commit index must be one of the log ids the
/// message carries (`prev_log_id` or an entry), or below them and no later than
/// `prev_log_id` (a leader's log only grows later). One past the entries carried is
/// followed no further than them: the follower commits the rest with a later message.
pub fn check_leader_commit(rpc: &AppendEntriesRequest<TypeConfig>) -> Result<Option<LogId<NodeId>>, Refused> {
    let Some(c) = rpc.leader_commit else { return Ok(None) };
    let Some(last) = rpc.entries.last().map(|e| e.log_id).or(rpc.prev_log_id) else {
        // Nothing carried, nothing known to match: nothing to commit.
        return Ok(None);
    };
    if c.index > last.index {
        return Ok(Some(last));
    }
    let carried = rpc
        .prev_log_id
        .iter()
        .chain(rpc.entries.iter().map(|e| &e.log_id))
        .find(|l| l.index == c.index);
    match (carried, rpc.prev_log_id) {
        (Some(l), _) if *l == c => Ok(Some(c)),
        (Some(l), _) => Err(inconsistent(format!("leader_commit {c} where the message carries {l}"))),
        (None, Some(prev)) if c <= prev => Ok(Some(c)),
        (None, _) => Err(inconsistent(format!(
            "leader_commit {c} is later than the log the message follows ({})",
            show(rpc.prev_log_id.as_ref())
        ))),
    }
}

/// Vote: the candidate's uncommitted vote, and its last log id no later than it.
pub fn check_vote(
    rpc: &VoteRequest<NodeId>,
    sender: Option<NodeId>,
    local: &Local,
    guard: &Guard,
) -> Result<(), Refused> {
    check_sender(&rpc.vote, false, sender, local, guard)?;
    // The candidate's log is only compared with this node's: range only.
    check_log_id(
        "last_log_id",
        rpc.last_log_id.as_ref(),
        rpc.vote.leader_id().get_term(),
        &Local::default(),
    )
}

/// InstallSnapshot: the leader's committed vote and the snapshot's log ids: in range,
/// consistent with the committed log and with each other, and (above
/// [`MAX_FREE_INDEX`]) no further than [`SNAPSHOT_INDEX_STEP`] past this node's log.
pub fn check_snapshot(
    vote: &Vote<NodeId>,
    meta: &SnapshotMeta<NodeId, Node>,
    sender: Option<NodeId>,
    local: &Local,
    guard: &Guard,
) -> Result<(), Refused> {
    check_sender(vote, true, sender, local, guard)?;
    let term = vote.leader_id().get_term();
    let local = &against(vote, local);
    check_log_id("snapshot last_log_id", meta.last_log_id.as_ref(), term, local)?;
    let membership = meta.last_membership.log_id().as_ref();
    check_log_id("snapshot membership log id", membership, term, local)?;
    if membership > meta.last_log_id.as_ref() {
        return Err(inconsistent(format!(
            "snapshot membership of {} after its last log id {}",
            membership.map_or_else(String::new, ToString::to_string),
            meta.last_log_id.map_or_else(|| "(none)".to_string(), |l| l.to_string())
        )));
    }
    if let Some(last) = &meta.last_log_id {
        let mine = local.last_log_index.unwrap_or(0);
        if last.index > MAX_FREE_INDEX && last.index > mine.saturating_add(SNAPSHOT_INDEX_STEP) {
            return Err(out_of_range(format!(
                "snapshot up to index {} is above {MAX_FREE_INDEX} and more than {SNAPSHOT_INDEX_STEP} past this node's log ({mine})",
                last.index
            )));
        }
    }
    if membership.is_some() && membership == local.membership_log_id.as_ref() {
        let theirs: BTreeSet<NodeId> = meta.last_membership.membership().nodes().map(|(id, _)| *id).collect();
        if theirs != local.members {
            return Err(inconsistent(format!(
                "snapshot membership {} names other members than this node's of the same log id",
                membership.map_or_else(String::new, ToString::to_string)
            )));
        }
    }
    Ok(())
}

// ------------------------------------------------------------------ replies

/// What an AppendEntries sent: the vote, where the entries start, the ids of the
/// entries that went out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SentAppend {
    /// The leader's vote.
    pub vote: Vote<NodeId>,
    /// The log id the entries follow.
    pub prev_log_id: Option<LogId<NodeId>>,
    /// The log ids of the entries sent, in order.
    pub entries: Vec<LogId<NodeId>>,
}

/// An AppendEntries' reply, against what was sent and what the peer acknowledged before
/// under the same vote (`acked`: openraft's record of the follower's log, which must
/// never go back).
pub fn check_append_reply(
    sent: &SentAppend,
    reply: &AppendEntriesResponse<NodeId>,
    acked: Option<LogId<NodeId>>,
    local: &Local,
    guard: &Guard,
) -> Result<(), Refused> {
    match reply {
        AppendEntriesResponse::Success => Ok(()),
        AppendEntriesResponse::PartialSuccess(None) => {
            Err(inconsistent("a partial success that matches nothing".to_string()))
        }
        AppendEntriesResponse::PartialSuccess(m) => {
            let known = m == &sent.prev_log_id || m.as_ref().is_some_and(|m| sent.entries.contains(m));
            if !known {
                return Err(inconsistent(format!(
                    "a partial success up to {} that was not sent (sent {} entries after {})",
                    show(m.as_ref()),
                    sent.entries.len(),
                    show(sent.prev_log_id.as_ref())
                )));
            }
            if m < &acked {
                return Err(inconsistent(format!(
                    "a partial success up to {} behind what the peer acknowledged ({})",
                    show(m.as_ref()),
                    show(acked.as_ref())
                )));
            }
            Ok(())
        }
        AppendEntriesResponse::Conflict => match &sent.prev_log_id {
            None => Err(inconsistent(
                "a conflict with a request that carried no prev_log_id".to_string(),
            )),
            Some(prev) if acked.is_some_and(|a| prev.index <= a.index) => Err(inconsistent(format!(
                "a conflict at {prev}, which the peer acknowledged holding ({})",
                show(acked.as_ref())
            ))),
            Some(_) => Ok(()),
        },
        AppendEntriesResponse::HigherVote(v) => higher_vote(v, &sent.vote, local, guard),
    }
}

fn show(id: Option<&LogId<NodeId>>) -> String {
    id.map_or_else(|| "(none)".to_string(), ToString::to_string)
}

fn higher_vote(v: &Vote<NodeId>, sent: &Vote<NodeId>, local: &Local, guard: &Guard) -> Result<(), Refused> {
    if v <= sent {
        return Err(inconsistent(format!(
            "a higher vote {v} that is not higher than {sent}"
        )));
    }
    not_for_this_node(v, local)?;
    guard.admit_term("reply vote", v.leader_id().get_term(), local)
}

/// A higher vote in a reply never names this node: only this node votes for itself, in
/// the terms it campaigns in, and openraft (taking such a vote as its own) would lead
/// with a vote it does not hold.
fn not_for_this_node(v: &Vote<NodeId>, local: &Local) -> Result<(), Refused> {
    if local.id != 0 && v.leader_id().voted_for() == Some(local.id) {
        return Err(inconsistent(format!(
            "a vote {v} for this node ({}) that it did not ask for",
            local.id
        )));
    }
    Ok(())
}

/// A Vote's reply: a granted vote is the candidate's; the voter's vote in range (it is
/// adopted if higher); its last log id no later than its vote.
pub fn check_vote_reply(
    sent: &VoteRequest<NodeId>,
    reply: &VoteResponse<NodeId>,
    local: &Local,
    guard: &Guard,
) -> Result<(), Refused> {
    if reply.vote_granted && reply.vote != sent.vote {
        return Err(inconsistent(format!(
            "a vote granted as {}, not as the {} asked for",
            reply.vote, sent.vote
        )));
    }
    let term = reply.vote.leader_id().get_term();
    if reply.vote > sent.vote {
        not_for_this_node(&reply.vote, local)?;
        guard.admit_term("reply vote", term, local)?;
    }
    check_log_id("reply last_log_id", reply.last_log_id.as_ref(), term, &Local::default())
}

/// An InstallSnapshot chunk that was sent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SentChunk {
    /// The leader's vote.
    pub vote: Vote<NodeId>,
    /// The snapshot's id.
    pub snapshot_id: String,
    /// Where the chunk starts.
    pub offset: u64,
}

/// An InstallSnapshot's reply: the receiver's vote in range, or a mismatch about this
/// snapshot and this chunk.
pub fn check_snapshot_reply(
    sent: &SentChunk,
    reply: &Result<InstallSnapshotResponse<NodeId>, SnapshotMismatch>,
    local: &Local,
    guard: &Guard,
) -> Result<(), Refused> {
    match reply {
        Ok(r) if r.vote > sent.vote => higher_vote(&r.vote, &sent.vote, local, guard),
        Ok(_) => Ok(()),
        Err(m) => {
            if m.got.id != sent.snapshot_id || m.expect.id != sent.snapshot_id || m.got.offset != sent.offset {
                return Err(inconsistent(format!(
                    "a snapshot mismatch ({m}) about another chunk than the one sent ({} at {})",
                    sent.snapshot_id, sent.offset
                )));
            }
            if m.expect.offset > MAX_SNAPSHOT_BYTES {
                return Err(out_of_range(format!(
                    "a snapshot mismatch expecting offset {}, past the largest snapshot",
                    m.expect.offset
                )));
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, EntryPayload, SnapshotSegmentId, StoredMembership};
    use proptest::prelude::*;

    type Entry = openraft::Entry<TypeConfig>;

    fn log_id(term: u64, node: u64, index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(term, node), index)
    }

    fn append(
        term: u64,
        leader: u64,
        prev: Option<(u64, u64)>,
        entries: &[(u64, u64)],
    ) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(term, leader),
            prev_log_id: prev.map(|(t, i)| log_id(t, leader, i)),
            entries: entries
                .iter()
                .map(|&(t, i)| Entry {
                    log_id: log_id(t, leader, i),
                    payload: EntryPayload::Blank,
                })
                .collect(),
            leader_commit: None,
        }
    }

    fn at(term: u64) -> Local {
        Local {
            term,
            ..Local::default()
        }
    }

    fn vote_req(term: u64, node: u64, last: Option<LogId<NodeId>>) -> VoteRequest<NodeId> {
        VoteRequest {
            vote: Vote::new(term, node),
            last_log_id: last,
        }
    }

    #[test]
    fn ordinary_appends_votes_and_snapshots_pass() {
        let h = Guard::default();
        let l = at(3);
        assert_eq!(
            check_append(&append(3, 1, Some((2, 9)), &[(2, 10), (3, 11)]), Some(1), &l, &h),
            Ok(())
        );
        assert_eq!(
            check_append(&append(3, 1, None, &[(1, 0), (3, 1)]), Some(1), &l, &h),
            Ok(())
        );
        assert_eq!(
            check_append(&append(3, 1, None, &[]), None, &l, &h),
            Ok(()),
            "a heartbeat"
        );
        assert_eq!(
            check_vote(&vote_req(5, 2, Some(log_id(4, 1, 100))), Some(2), &l, &h),
            Ok(())
        );
    }

    /// Any term up to MAX_FREE_TERM passes, whatever this node's term (a node back
    /// from a partition, a new learner at term 0); the headroom opens with time.
    #[test]
    fn terms_pass_freely_below_the_headroom_and_open_with_time_within_it() {
        let at = |term: u64, current: u64, now_ms: u64| admit_term("vote", term, current, now_ms);
        let epoch = HEADROOM_EPOCH_UNIX_MS;
        for term in [0, 1, 1 << 48, (1 << 48) + 1, MAX_FREE_TERM - 1, MAX_FREE_TERM] {
            assert_eq!(at(term, 0, epoch), Ok(()), "{term} from term 0");
            assert_eq!(at(term, 0, 0), Ok(()), "{term} whatever the clock");
        }
        assert!(at(MAX_FREE_TERM + 1, 0, epoch).is_err(), "nothing open at the epoch");
        assert!(at(MAX_FREE_TERM + 1, 0, 0).is_err(), "nor before it");
        assert_eq!(at(MAX_FREE_TERM + 1, 0, epoch + 100), Ok(()), "one term per 100 ms");
        assert!(at(MAX_FREE_TERM + 2, 0, epoch + 199).is_err());
        let day = epoch + 86_400_000;
        assert_eq!(term_ceiling(day), MAX_FREE_TERM + 864_000);
        assert_eq!(
            at(MAX_FREE_TERM + 864_000, 5, day),
            Ok(()),
            "a node that was away follows"
        );
        let e = at(MAX_FREE_TERM + 864_001, 5, day).expect_err("not open yet");
        assert!(e.why.contains("opens in 0 s"), "{}", e.why);
        assert!(at(MAX_FREE_TERM + 864_100, 5, day)
            .unwrap_err()
            .why
            .contains("opens in 10 s"));
        assert_eq!(
            at(MAX_FREE_TERM + 900_000, MAX_FREE_TERM + 900_000, day),
            Ok(()),
            "its own term"
        );
        assert!(at(u64::MAX, u64::MAX - 1, u64::MAX).is_err(), "the top");
        assert!(at(MAX_TERM + 1, MAX_TERM, u64::MAX).is_err());
        assert_eq!(term_ceiling(u64::MAX), MAX_TERM);
        // 2^40 terms at ten a second: 3,400 years.
        let years = (TERM_HEADROOM * HEADROOM_MS_PER_TERM / 1_000) / (365 * 86_400);
        assert!(years > 3_400, "{years}");
    }

    #[test]
    fn log_ids_out_of_range_or_against_the_committed_log_are_refused() {
        let h = Guard::default();
        let l = at(3);
        let e = check_append(&append(u64::MAX, 1, None, &[]), Some(1), &l, &h).expect_err("u64::MAX");
        assert_eq!(e.reason, "out_of_range");
        assert!(check_append(&append(3, 1, Some((3, u64::MAX)), &[]), Some(1), &l, &h).is_err());
        assert!(check_append(&append(3, 1, Some((3, MAX_INDEX + 1)), &[]), Some(1), &l, &h).is_err());
        assert!(
            check_append(&append(3, 1, Some((3, MAX_INDEX)), &[]), Some(1), &l, &h).is_ok(),
            "past this node's log: openraft answers a conflict"
        );
        assert!(
            check_append(&append(3, 1, None, &[(4, 0)]), Some(1), &l, &h).is_err(),
            "term after the vote"
        );
        assert!(
            check_append(&append(3, 1, Some((1, 4)), &[(1, 6)]), Some(1), &l, &h).is_err(),
            "gap"
        );
        assert!(
            check_append(&append(3, 1, Some((2, 4)), &[(1, 5)]), Some(1), &l, &h).is_err(),
            "term back"
        );
        // This node applied (2, 1, 50): a log id at or below index 50 of a later term
        // contradicts it; an earlier one is a stale but honest message.
        let applied = Local {
            term: 9,
            applied: Some(log_id(2, 1, 50)),
            ..Local::default()
        };
        let e = check_append(&append(9, 1, Some((9, 40)), &[]), Some(1), &applied, &h).expect_err("rewrite");
        assert_eq!(e.reason, "inconsistent");
        assert!(check_append(&append(9, 1, Some((1, 40)), &[]), Some(1), &applied, &h).is_ok());
        // Past the committed entry, no earlier leader's entry: a log only grows later.
        let e = check_append(&append(9, 1, Some((1, 49)), &[(1, 50), (1, 51)]), Some(1), &applied, &h);
        assert!(e.is_err(), "an entry of term 1 after the committed (2, 50)");
        // An older leader than this node's vote is openraft's to answer with the newer
        // vote (that answer is how it learns it is stale): only ranges are checked.
        let voted = Local {
            vote: Vote::new_committed(9, 3),
            ..applied.clone()
        };
        assert!(
            check_append(&append(1, 1, Some((1, 40)), &[(1, 41), (1, 51)]), Some(1), &voted, &h).is_err(),
            "gap"
        );
        assert!(
            check_append(&append(1, 1, Some((1, 50)), &[(1, 51)]), Some(1), &voted, &h).is_ok(),
            "a stale leader"
        );
        assert!(check_append(&append(9, 1, Some((2, 50)), &[(9, 51)]), Some(1), &applied, &h).is_ok());
        // Votes: a candidate's is uncommitted, a leader's committed.
        let mut committed_vote = vote_req(5, 2, None);
        committed_vote.vote.commit();
        assert!(check_vote(&committed_vote, Some(2), &l, &h).is_err());
        let mut uncommitted = append(3, 1, None, &[]);
        uncommitted.vote = Vote::new(3, 1);
        assert!(check_append(&uncommitted, Some(1), &l, &h).is_err());
        assert!(check_vote(&vote_req(5, 2, Some(log_id(6, 1, 1))), Some(2), &l, &h).is_err());
    }

    #[test]
    fn the_commit_index_is_one_the_message_carries_or_below_it() {
        let mut r = append(6, 1, Some((6, 49)), &[(6, 50)]);
        r.leader_commit = Some(log_id(5, 1, 100));
        assert_eq!(check_leader_commit(&r), Ok(Some(log_id(6, 1, 50))), "past the entries");
        r.leader_commit = Some(log_id(6, 1, 50));
        assert_eq!(check_leader_commit(&r), Ok(Some(log_id(6, 1, 50))));
        r.leader_commit = Some(log_id(6, 1, 49));
        assert_eq!(check_leader_commit(&r), Ok(Some(log_id(6, 1, 49))), "prev");
        r.leader_commit = Some(log_id(5, 1, 30));
        assert_eq!(check_leader_commit(&r), Ok(Some(log_id(5, 1, 30))), "below, earlier");
        r.leader_commit = Some(log_id(9, 1, 30));
        assert!(check_leader_commit(&r).is_err(), "below, but later than prev");
        r.leader_commit = Some(log_id(4, 1, 50));
        assert!(check_leader_commit(&r).is_err(), "not the entry carried there");
        let mut beat = append(6, 1, None, &[]);
        beat.leader_commit = Some(log_id(6, 1, 30));
        assert_eq!(check_leader_commit(&beat), Ok(None), "nothing matched");
    }

    #[test]
    fn a_node_may_speak_only_as_itself_and_only_as_a_member() {
        let h = Guard::default();
        let e = check_append(&append(3, 1, None, &[]), Some(2), &at(3), &h).expect_err("node 2 as 1");
        assert_eq!(e.reason, "sender_mismatch");
        assert!(e.why.contains("node 2 sent a message as node 1"), "{}", e.why);
        let member = Local {
            members: [1, 2, 3].into(),
            ..at(3)
        };
        let e = check_vote(&vote_req(5, 9, None), Some(9), &member, &h).expect_err("node 9");
        assert_eq!(e.reason, "not_a_member");
        assert!(
            check_vote(&vote_req(5, 9, None), Some(9), &at(3), &h).is_ok(),
            "no group yet"
        );
    }

    fn meta(last: Option<LogId<NodeId>>, membership: Option<LogId<NodeId>>) -> SnapshotMeta<NodeId, Node> {
        SnapshotMeta {
            last_log_id: last,
            last_membership: StoredMembership::new(membership, Default::default()),
            snapshot_id: "s".into(),
        }
    }

    #[test]
    fn snapshots_out_of_range_or_inconsistent_are_refused() {
        let h = Guard::default();
        let v = Vote::new_committed(5, 1);
        let l = at(5);
        assert!(check_snapshot(
            &v,
            &meta(Some(log_id(5, 1, 50)), Some(log_id(2, 1, 3))),
            Some(1),
            &l,
            &h
        )
        .is_ok());
        assert!(check_snapshot(
            &v,
            &meta(Some(log_id(5, 1, 50)), Some(log_id(5, 1, 51))),
            Some(1),
            &l,
            &h
        )
        .is_err());
        assert!(check_snapshot(&v, &meta(Some(log_id(5, 1, MAX_FREE_INDEX)), None), Some(1), &l, &h).is_ok());
        assert!(check_snapshot(&v, &meta(Some(log_id(5, 1, MAX_FREE_INDEX + 1)), None), Some(1), &l, &h).is_err());
        let far = Local {
            last_log_index: Some(MAX_FREE_INDEX + 10),
            ..l.clone()
        };
        assert!(check_snapshot(
            &v,
            &meta(Some(log_id(5, 1, MAX_FREE_INDEX + 100)), None),
            Some(1),
            &far,
            &h
        )
        .is_ok());
        assert!(
            check_snapshot(&v, &meta(Some(log_id(6, 1, 50)), None), Some(1), &l, &h).is_err(),
            "term"
        );
    }

    #[test]
    fn replies_must_answer_what_was_sent() {
        let h = Guard::default();
        let l = at(5);
        let sent = SentAppend {
            vote: Vote::new_committed(5, 1),
            prev_log_id: Some(log_id(5, 1, 10)),
            entries: vec![log_id(5, 1, 11), log_id(5, 1, 12)],
        };
        let ok = |r: AppendEntriesResponse<NodeId>, acked: Option<LogId<NodeId>>| {
            check_append_reply(&sent, &r, acked, &l, &h)
        };
        assert!(ok(AppendEntriesResponse::Success, None).is_ok());
        assert!(ok(AppendEntriesResponse::PartialSuccess(Some(log_id(5, 1, 11))), None).is_ok());
        assert!(
            ok(AppendEntriesResponse::PartialSuccess(Some(log_id(5, 1, 13))), None).is_err(),
            "past"
        );
        assert!(
            ok(AppendEntriesResponse::PartialSuccess(Some(log_id(4, 1, 11))), None).is_err(),
            "not sent"
        );
        assert!(
            ok(AppendEntriesResponse::PartialSuccess(None), None).is_err(),
            "before prev"
        );
        assert!(
            ok(
                AppendEntriesResponse::PartialSuccess(Some(log_id(5, 1, 11))),
                Some(log_id(5, 1, 12))
            )
            .is_err(),
            "goes back"
        );
        assert!(ok(AppendEntriesResponse::Conflict, None).is_ok());
        assert!(
            ok(AppendEntriesResponse::Conflict, Some(log_id(5, 1, 10))).is_err(),
            "acked it"
        );
        let mut no_prev = sent.clone();
        no_prev.prev_log_id = None;
        assert!(check_append_reply(&no_prev, &AppendEntriesResponse::Conflict, None, &l, &h).is_err());
        assert!(ok(AppendEntriesResponse::HigherVote(Vote::new(6, 2)), None).is_ok());
        assert!(
            ok(AppendEntriesResponse::HigherVote(Vote::new_committed(5, 1)), None).is_err(),
            "equal"
        );
        assert!(
            ok(AppendEntriesResponse::HigherVote(Vote::new(4, 2)), None).is_err(),
            "lower"
        );
        assert!(
            ok(AppendEntriesResponse::HigherVote(Vote::new(u64::MAX, 2)), None).is_err(),
            "u64::MAX"
        );
        assert!(ok(AppendEntriesResponse::HigherVote(Vote::new(MAX_FREE_TERM, 2)), None).is_ok());

        let asked = vote_req(6, 1, Some(log_id(5, 1, 12)));
        let reply = |vote: Vote<NodeId>, granted: bool, last: Option<LogId<NodeId>>| VoteResponse {
            vote,
            vote_granted: granted,
            last_log_id: last,
        };
        assert!(check_vote_reply(&asked, &reply(Vote::new(6, 1), true, None), &l, &h).is_ok());
        assert!(check_vote_reply(&asked, &reply(Vote::new(6, 2), true, None), &l, &h).is_err());
        assert!(
            check_vote_reply(&asked, &reply(Vote::new(3, 2), false, None), &l, &h).is_ok(),
            "stale log"
        );
        assert!(check_vote_reply(&asked, &reply(Vote::new(u64::MAX, 2), false, None), &l, &h).is_err());
        assert!(check_vote_reply(&asked, &reply(Vote::new(7, 2), false, Some(log_id(8, 2, 1))), &l, &h).is_err());
        let me = Local { id: 1, ..l.clone() };
        let mine = reply(Vote::new_committed(9, 1), false, None);
        assert!(
            check_vote_reply(&asked, &mine, &me, &h).is_err(),
            "a vote for the candidate itself"
        );
        let own = AppendEntriesResponse::HigherVote(Vote::new(9, 1));
        assert!(
            check_append_reply(&sent, &own, None, &me, &h).is_err(),
            "a higher vote for the leader itself"
        );

        let chunk = SentChunk {
            vote: Vote::new_committed(5, 1),
            snapshot_id: "s-1".into(),
            offset: 4096,
        };
        let mismatch = |expect: (&str, u64), got: (&str, u64)| {
            Err(SnapshotMismatch {
                expect: SnapshotSegmentId {
                    id: expect.0.into(),
                    offset: expect.1,
                },
                got: SnapshotSegmentId {
                    id: got.0.into(),
                    offset: got.1,
                },
            })
        };
        assert!(check_snapshot_reply(&chunk, &mismatch(("s-1", 0), ("s-1", 4096)), &l, &h).is_ok());
        assert!(check_snapshot_reply(&chunk, &mismatch(("s-2", 0), ("s-1", 4096)), &l, &h).is_err());
        assert!(check_snapshot_reply(&chunk, &mismatch(("s-1", 0), ("s-1", 0)), &l, &h).is_err());
        assert!(check_snapshot_reply(&chunk, &mismatch(("s-1", u64::MAX), ("s-1", 4096)), &l, &h).is_err());
        let vote = |v: Vote<NodeId>| Ok(InstallSnapshotResponse { vote: v });
        assert!(check_snapshot_reply(&chunk, &vote(Vote::new_committed(5, 1)), &l, &h).is_ok());
        assert!(check_snapshot_reply(&chunk, &vote(Vote::new(u64::MAX, 3)), &l, &h).is_err());
    }

    proptest! {
        /// Arbitrary bytes as any Raft request or reply: protobuf decoding, the conversion,
        /// then the checks (a reply against an ordinary request), each an error or a value,
        /// never a panic.
        #[test]
        fn any_payload_decodes_or_is_refused_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            use kvota_proto::raft::v1 as pb;
            use prost::Message;
            let (g, l) = (Guard::default(), at(5));
            if let Ok(m) = pb::AppendEntriesRequest::decode(bytes.as_slice()) {
                let _ = crate::wire::newest_entry_format(&m);
                if let Ok(r) = crate::wire::append_from(m) {
                    let _ = check_append(&r, Some(1), &l, &g);
                    let _ = check_leader_commit(&r);
                }
            }
            if let Ok(Ok(r)) = pb::VoteRequest::decode(bytes.as_slice()).map(crate::wire::vote_request_from) {
                let _ = check_vote(&r, Some(1), &l, &g);
            }
            if let Ok(Ok(r)) = pb::InstallSnapshotRequest::decode(bytes.as_slice()).map(crate::wire::snapshot_from) {
                let _ = check_snapshot(&r.vote, &r.meta, Some(1), &l, &g);
            }
            let sent = SentAppend {
                vote: Vote::new_committed(5, 1),
                prev_log_id: Some(log_id(5, 1, 10)),
                entries: vec![log_id(5, 1, 11)],
            };
            if let Ok(Ok(r)) = pb::AppendEntriesReply::decode(bytes.as_slice()).map(crate::wire::append_reply_from) {
                let _ = check_append_reply(&sent, &r, Some(log_id(5, 1, 9)), &l, &g);
            }
            if let Ok(Ok(r)) = pb::VoteReply::decode(bytes.as_slice()).map(crate::wire::vote_reply_from) {
                let _ = check_vote_reply(&vote_req(6, 1, None), &r, &l, &g);
            }
            if let Ok(Ok(r)) = pb::InstallSnapshotReply::decode(bytes.as_slice()).map(crate::wire::snapshot_reply_from) {
                let chunk = SentChunk { vote: Vote::new_committed(5, 1), snapshot_id: "s".into(), offset: 0 };
                let r = r.map_err(|e| match e {
                    openraft::error::InstallSnapshotError::SnapshotMismatch(m) => m,
                });
                let _ = check_snapshot_reply(&chunk, &r, &l, &g);
            }
        }

        /// Well-formed appends with random terms and indexes: whatever passes the check is
        /// within the engine's range and consistent.
        #[test]
        fn what_passes_is_in_range_and_consistent(
            term in prop_oneof![0u64..10, Just(u64::MAX), Just(MAX_FREE_TERM), Just(MAX_FREE_TERM + 1), Just(MAX_TERM)],
            prev in proptest::option::of((0u64..10, prop_oneof![0u64..100, Just(u64::MAX - 1)])),
            entries in proptest::collection::vec((0u64..12, 0u64..120), 0..5),
        ) {
            let r = append(term, 1, prev, &entries);
            if check_append(&r, Some(1), &at(5), &Guard::default()).is_ok() {
                prop_assert!(term <= term_ceiling(unix_ms()));
                for (next, e) in (prev.map_or(0, |p| p.1 + 1)..).zip(&r.entries) {
                    prop_assert!(e.log_id.leader_id.term <= term);
                    prop_assert_eq!(e.log_id.index, next);
                    prop_assert!(e.log_id.index <= MAX_INDEX);
                }
            }
        }
    }
}
