//! The Raft port's protobuf schema (`proto/kvota/raft/v1/raft.proto`) to and from openraft's
//! types: the Raft transport's messages and a log entry, whose commands travel as a
//! batch ([`batch_to`], [`batch_from`]). Each command's own conversion is
//! [`kvota_proto::log`]'s, beside the member API's.
//!
//! Decoding is structural: it checks that what a message must carry is there, that
//! enumerations hold known values and that a membership is well formed, and names the
//! field when not ([`WireError`]). It does not re-validate names or numbers a command
//! carries: those were validated when the command was proposed, and a log entry must
//! read the same on every node, whatever a later build's validation rules. Ranges and
//! consistency that openraft's engine relies on are checked after decoding
//! ([`crate::guard`]).
//!
//! A log entry's format travels in [`pb::LogBatch::format`]; one newer than this build
//! reads is [`WireError::NewerFormat`]. The Raft port reads the format before decoding
//! ([`newest_entry_format`]) and refuses such entries; from the leader the node follows
//! they make it unready, never stop it.

use std::collections::{BTreeMap, BTreeSet};

use kvota_proto::convert::Invalid;
use kvota_proto::log;
use kvota_proto::raft::v1 as pb;
use openraft::error::{InstallSnapshotError, SnapshotMismatch};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::{
    CommittedLeaderId, EntryPayload, LogId, Membership, SnapshotMeta, SnapshotSegmentId, StoredMembership, Vote,
};

use crate::types::{newer_entry_format, Node, NodeId, Request, TypeConfig, LOG_FORMAT};

/// A log entry as openraft holds it.
pub type Entry = openraft::Entry<TypeConfig>;

/// Why a message could not be decoded. Nothing of it reached openraft.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A field the message must carry is absent.
    #[error("{0}: missing")]
    Missing(String),
    /// A field holds something this build cannot take.
    #[error("{field}: {why}")]
    Invalid {
        /// Its path in the message, e.g. `entries[2].normal.commands[0]`.
        field: String,
        /// What is wrong.
        why: String,
    },
    /// A log entry of a format newer than this build reads.
    #[error("{field}: {}", newer_entry_format(*.format))]
    NewerFormat {
        /// The entry's path in the message.
        field: String,
        /// The format it carries.
        format: u32,
    },
}

/// A log command [`log::command_from`] could not read: the field it names.
impl From<Invalid> for WireError {
    fn from(e: Invalid) -> Self {
        WireError::Invalid {
            field: e.field,
            why: e.why,
        }
    }
}

fn missing(field: impl Into<String>) -> WireError {
    WireError::Missing(field.into())
}

fn invalid(field: impl Into<String>, why: impl Into<String>) -> WireError {
    WireError::Invalid {
        field: field.into(),
        why: why.into(),
    }
}

fn need<T>(v: Option<T>, field: impl Into<String>) -> Result<T, WireError> {
    v.ok_or_else(|| missing(field))
}

// ------------------------------------------------------------------ Raft's own types

fn vote_to(v: &Vote<NodeId>) -> pb::RaftVote {
    pb::RaftVote {
        term: v.leader_id.term,
        node_id: v.leader_id.node_id,
        committed: v.committed,
    }
}

fn vote_from(v: Option<pb::RaftVote>, field: &str) -> Result<Vote<NodeId>, WireError> {
    let v = need(v, field)?;
    Ok(if v.committed {
        Vote::new_committed(v.term, v.node_id)
    } else {
        Vote::new(v.term, v.node_id)
    })
}

fn log_id_to(id: &LogId<NodeId>) -> pb::RaftLogId {
    pb::RaftLogId {
        term: id.leader_id.term,
        node_id: id.leader_id.node_id,
        index: id.index,
    }
}

fn log_id_from(id: pb::RaftLogId) -> LogId<NodeId> {
    LogId::new(CommittedLeaderId::new(id.term, id.node_id), id.index)
}

fn opt_log_id_to(id: Option<&LogId<NodeId>>) -> Option<pb::RaftLogId> {
    id.map(log_id_to)
}

fn membership_to(m: &Membership<NodeId, Node>) -> pb::RaftMembership {
    pb::RaftMembership {
        configs: m
            .get_joint_config()
            .iter()
            .map(|c| pb::RaftVoterSet {
                voters: c.iter().copied().collect(),
            })
            .collect(),
        nodes: m
            .nodes()
            .map(|(id, n)| {
                (
                    *id,
                    pb::RaftNode {
                        rpc_addr: n.rpc_addr.clone(),
                        http_addr: n.http_addr.clone(),
                        raft_addr: n.raft_addr.clone(),
                    },
                )
            })
            .collect(),
    }
}

/// A membership: one voter set, or two during a joint change; none empty; every voter
/// with its addresses. With `empty_ok`, also openraft's empty default (no voter set, no
/// node), which a snapshot taken before any membership was applied carries.
fn membership_from(
    m: Option<pb::RaftMembership>,
    field: &str,
    empty_ok: bool,
) -> Result<Membership<NodeId, Node>, WireError> {
    let m = need(m, field)?;
    if empty_ok && m.configs.is_empty() && m.nodes.is_empty() {
        return Ok(Membership::default());
    }
    if m.configs.is_empty() || m.configs.len() > 2 {
        return Err(invalid(
            format!("{field}.configs"),
            format!(
                "{} voter sets; a membership has one, or two during a change",
                m.configs.len()
            ),
        ));
    }
    let nodes: BTreeMap<NodeId, Node> = m
        .nodes
        .into_iter()
        .map(|(id, n)| {
            (
                id,
                Node {
                    rpc_addr: n.rpc_addr,
                    http_addr: n.http_addr,
                    raft_addr: n.raft_addr,
                },
            )
        })
        .collect();
    let mut configs = Vec::with_capacity(m.configs.len());
    for (i, c) in m.configs.into_iter().enumerate() {
        let set: BTreeSet<NodeId> = c.voters.into_iter().collect();
        if set.is_empty() {
            return Err(invalid(format!("{field}.configs[{i}]"), "an empty voter set"));
        }
        if let Some(v) = set.iter().find(|v| !nodes.contains_key(v)) {
            return Err(invalid(
                format!("{field}.configs[{i}]"),
                format!("voter {v} has no entry in nodes"),
            ));
        }
        configs.push(set);
    }
    Ok(Membership::new(configs, nodes))
}

/// One log entry in its wire form.
pub fn entry_to(e: &Entry) -> pb::RaftEntry {
    let payload = match &e.payload {
        EntryPayload::Blank => pb::raft_entry::Payload::Blank(pb::Empty {}),
        EntryPayload::Normal(r) => pb::raft_entry::Payload::Normal(batch_to(r)),
        EntryPayload::Membership(m) => pb::raft_entry::Payload::Membership(membership_to(m)),
    };
    pb::RaftEntry {
        log_id: Some(log_id_to(&e.log_id)),
        payload: Some(payload),
    }
}

/// One log entry from its wire form; `field` names it in errors.
pub fn entry_from(e: pb::RaftEntry, field: &str) -> Result<Entry, WireError> {
    let log_id = log_id_from(need(e.log_id, format!("{field}.log_id"))?);
    let payload = match e.payload {
        None => {
            return Err(invalid(
                format!("{field}.payload"),
                "absent, or of a kind this build does not know",
            ))
        }
        Some(pb::raft_entry::Payload::Blank(_)) => EntryPayload::Blank,
        Some(pb::raft_entry::Payload::Normal(b)) => EntryPayload::Normal(batch_from(b, &format!("{field}.normal"))?),
        Some(pb::raft_entry::Payload::Membership(m)) => {
            EntryPayload::Membership(membership_from(Some(m), &format!("{field}.membership"), false)?)
        }
    };
    Ok(Entry { log_id, payload })
}

/// AppendEntries in its wire form.
pub fn append_to(r: &AppendEntriesRequest<TypeConfig>) -> pb::AppendEntriesRequest {
    pb::AppendEntriesRequest {
        vote: Some(vote_to(&r.vote)),
        prev_log_id: opt_log_id_to(r.prev_log_id.as_ref()),
        entries: r.entries.iter().map(entry_to).collect(),
        leader_commit: opt_log_id_to(r.leader_commit.as_ref()),
    }
}

/// AppendEntries from its wire form.
pub fn append_from(r: pb::AppendEntriesRequest) -> Result<AppendEntriesRequest<TypeConfig>, WireError> {
    let vote = vote_from(r.vote, "vote")?;
    let entries = r
        .entries
        .into_iter()
        .enumerate()
        .map(|(i, e)| entry_from(e, &format!("entries[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(AppendEntriesRequest {
        vote,
        prev_log_id: r.prev_log_id.map(log_id_from),
        entries,
        leader_commit: r.leader_commit.map(log_id_from),
    })
}

/// The newest log-entry format among an AppendEntries' entries, read without decoding
/// anything else (`None` without normal entries).
pub fn newest_entry_format(r: &pb::AppendEntriesRequest) -> Option<u32> {
    r.entries
        .iter()
        .filter_map(|e| match &e.payload {
            Some(pb::raft_entry::Payload::Normal(b)) => Some(b.format),
            _ => None,
        })
        .max()
}

/// AppendEntries' answer in its wire form.
pub fn append_reply_to(r: &AppendEntriesResponse<NodeId>) -> pb::AppendEntriesReply {
    use pb::append_entries_reply::Result as R;
    let result = match r {
        AppendEntriesResponse::Success => R::Success(pb::Empty {}),
        AppendEntriesResponse::PartialSuccess(m) => R::PartialSuccess(pb::RaftPartialSuccess {
            matching: opt_log_id_to(m.as_ref()),
        }),
        AppendEntriesResponse::Conflict => R::Conflict(pb::Empty {}),
        AppendEntriesResponse::HigherVote(v) => R::HigherVote(vote_to(v)),
    };
    pb::AppendEntriesReply { result: Some(result) }
}

/// AppendEntries' answer from its wire form.
pub fn append_reply_from(r: pb::AppendEntriesReply) -> Result<AppendEntriesResponse<NodeId>, WireError> {
    use pb::append_entries_reply::Result as R;
    Ok(match need(r.result, "result")? {
        R::Success(_) => AppendEntriesResponse::Success,
        R::PartialSuccess(p) => AppendEntriesResponse::PartialSuccess(p.matching.map(log_id_from)),
        R::Conflict(_) => AppendEntriesResponse::Conflict,
        R::HigherVote(v) => AppendEntriesResponse::HigherVote(vote_from(Some(v), "higher_vote")?),
    })
}

/// Vote in its wire form.
pub fn vote_request_to(r: &VoteRequest<NodeId>) -> pb::VoteRequest {
    pb::VoteRequest {
        vote: Some(vote_to(&r.vote)),
        last_log_id: opt_log_id_to(r.last_log_id.as_ref()),
    }
}

/// Vote from its wire form.
pub fn vote_request_from(r: pb::VoteRequest) -> Result<VoteRequest<NodeId>, WireError> {
    Ok(VoteRequest {
        vote: vote_from(r.vote, "vote")?,
        last_log_id: r.last_log_id.map(log_id_from),
    })
}

/// Vote's answer in its wire form.
pub fn vote_reply_to(r: &VoteResponse<NodeId>) -> pb::VoteReply {
    pb::VoteReply {
        vote: Some(vote_to(&r.vote)),
        vote_granted: r.vote_granted,
        last_log_id: opt_log_id_to(r.last_log_id.as_ref()),
    }
}

/// Vote's answer from its wire form.
pub fn vote_reply_from(r: pb::VoteReply) -> Result<VoteResponse<NodeId>, WireError> {
    Ok(VoteResponse {
        vote: vote_from(r.vote, "vote")?,
        vote_granted: r.vote_granted,
        last_log_id: r.last_log_id.map(log_id_from),
    })
}

/// InstallSnapshot in its wire form.
pub fn snapshot_to(r: &InstallSnapshotRequest<TypeConfig>) -> pb::InstallSnapshotRequest {
    pb::InstallSnapshotRequest {
        vote: Some(vote_to(&r.vote)),
        meta: Some(pb::RaftSnapshotMeta {
            last_log_id: opt_log_id_to(r.meta.last_log_id.as_ref()),
            membership_log_id: opt_log_id_to(r.meta.last_membership.log_id().as_ref()),
            membership: Some(membership_to(r.meta.last_membership.membership())),
            snapshot_id: r.meta.snapshot_id.clone(),
        }),
        offset: r.offset,
        data: r.data.clone(),
        done: r.done,
    }
}

/// InstallSnapshot from its wire form.
pub fn snapshot_from(r: pb::InstallSnapshotRequest) -> Result<InstallSnapshotRequest<TypeConfig>, WireError> {
    let vote = vote_from(r.vote, "vote")?;
    let meta = need(r.meta, "meta")?;
    let membership = membership_from(meta.membership, "meta.membership", true)?;
    Ok(InstallSnapshotRequest {
        vote,
        meta: SnapshotMeta {
            last_log_id: meta.last_log_id.map(log_id_from),
            last_membership: StoredMembership::new(meta.membership_log_id.map(log_id_from), membership),
            snapshot_id: meta.snapshot_id,
        },
        offset: r.offset,
        data: r.data,
        done: r.done,
    })
}

/// InstallSnapshot's answer (or its refusal of a chunk out of sequence) in wire form.
pub fn snapshot_reply_to(r: Result<&InstallSnapshotResponse<NodeId>, &SnapshotMismatch>) -> pb::InstallSnapshotReply {
    use pb::install_snapshot_reply::Result as R;
    let result = match r {
        Ok(ok) => R::Vote(vote_to(&ok.vote)),
        Err(m) => R::Mismatch(pb::RaftSnapshotMismatch {
            expect_id: m.expect.id.clone(),
            expect_offset: m.expect.offset,
            got_id: m.got.id.clone(),
            got_offset: m.got.offset,
        }),
    };
    pb::InstallSnapshotReply { result: Some(result) }
}

/// InstallSnapshot's answer from its wire form: the receiver's vote, or the chunk it
/// expected instead.
pub fn snapshot_reply_from(
    r: pb::InstallSnapshotReply,
) -> Result<Result<InstallSnapshotResponse<NodeId>, InstallSnapshotError>, WireError> {
    use pb::install_snapshot_reply::Result as R;
    Ok(match need(r.result, "result")? {
        R::Vote(v) => Ok(InstallSnapshotResponse {
            vote: vote_from(Some(v), "vote")?,
        }),
        R::Mismatch(m) => Err(InstallSnapshotError::SnapshotMismatch(SnapshotMismatch {
            expect: SnapshotSegmentId {
                id: m.expect_id,
                offset: m.expect_offset,
            },
            got: SnapshotSegmentId {
                id: m.got_id,
                offset: m.got_offset,
            },
        })),
    })
}

// ------------------------------------------------------------------ the replicated log

/// One log entry's commands in wire form.
pub fn batch_to(r: &Request) -> pb::LogBatch {
    pb::LogBatch {
        format: r.format,
        now_ms: r.now_ms,
        commands: r.commands.iter().map(pb::LogCommand::from).collect(),
        raise_feature_level: r.raise_feature_level,
        actors: r.actors.clone(),
    }
}

/// One log entry's commands from wire form: of a format this build reads (1 to
/// [`LOG_FORMAT`]), every command of a known kind.
pub fn batch_from(b: pb::LogBatch, field: &str) -> Result<Request, WireError> {
    if b.format == 0 {
        return Err(invalid(format!("{field}.format"), "log entry format 0 does not exist"));
    }
    if b.format > LOG_FORMAT {
        return Err(WireError::NewerFormat {
            field: field.to_string(),
            format: b.format,
        });
    }
    let commands = b
        .commands
        .into_iter()
        .enumerate()
        .map(|(i, c)| log::command_from(c, &format!("{field}.commands[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Request {
        format: b.format,
        now_ms: b.now_ms,
        commands,
        raise_feature_level: b.raise_feature_level,
        actors: b.actors,
    })
}
