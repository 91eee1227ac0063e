//! The Raft port's protobuf schema (`proto/kvota/raft/v1/raft.proto`) to and from openraft's
//! and the fairness core's types: the one place the Raft transport and the replicated
//! log's wire form are converted.
//!
//! Decoding is structural: it checks that what a message must carry is there, that
//! enumerations hold known values and that a membership is well formed, and names the
//! field when not ([`WireError`]). It does not re-validate names or numbers a command
//! carries: those were validated when the command was proposed, and a log entry must
//! read the same on every node, whatever a later build's validation rules. Ranges that
//! openraft's engine cannot handle are checked after decoding (`network::check_*`).
//!
//! A log entry's format travels in [`pb::LogBatch::format`]; one newer than this build
//! reads is [`WireError::NewerFormat`], which the receiving side turns into a stop when
//! the group's leader sent it.

use std::collections::{BTreeMap, BTreeSet};

use kvota_fairness::admission::Verdict;
use kvota_fairness::federation::{Command, EvictionNote, EvictionOutcome, PodDecision, TenantReport, UsageReport, UsageWindow};
use kvota_fairness::policy::{AdmissionMode, LeaseConfig, LendWhen, Policy, ReclaimConfig, ShowbackConfig, TenantPolicy};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::resources::ResourceWeights;
use kvota_proto::raft::v1 as pb;
use openraft::error::{InstallSnapshotError, SnapshotMismatch};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::{CommittedLeaderId, EntryPayload, LogId, Membership, SnapshotMeta, SnapshotSegmentId, StoredMembership, Vote};

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

fn missing(field: impl Into<String>) -> WireError {
    WireError::Missing(field.into())
}

fn invalid(field: impl Into<String>, why: impl Into<String>) -> WireError {
    WireError::Invalid { field: field.into(), why: why.into() }
}

/// A cluster's name in a log entry: every writer parsed it before proposing, so
/// another is a damaged or foreign entry.
fn cluster_name(name: String, field: &str) -> Result<ClusterName, WireError> {
    ClusterName::parse(name).map_err(|e| invalid(field, e.to_string()))
}

/// A tenant's name in a log entry (see [`cluster_name`]).
fn tenant_name(name: String, field: &str) -> Result<TenantName, WireError> {
    TenantName::parse(name).map_err(|e| invalid(field, e.to_string()))
}

fn need<T>(v: Option<T>, field: impl Into<String>) -> Result<T, WireError> {
    v.ok_or_else(|| missing(field))
}

// ------------------------------------------------------------------ Raft's own types

fn vote_to(v: &Vote<NodeId>) -> pb::RaftVote {
    pb::RaftVote { term: v.leader_id.term, node_id: v.leader_id.node_id, committed: v.committed }
}

fn vote_from(v: Option<pb::RaftVote>, field: &str) -> Result<Vote<NodeId>, WireError> {
    let v = need(v, field)?;
    Ok(if v.committed { Vote::new_committed(v.term, v.node_id) } else { Vote::new(v.term, v.node_id) })
}

fn log_id_to(id: &LogId<NodeId>) -> pb::RaftLogId {
    pb::RaftLogId { term: id.leader_id.term, node_id: id.leader_id.node_id, index: id.index }
}

fn log_id_from(id: pb::RaftLogId) -> LogId<NodeId> {
    LogId::new(CommittedLeaderId::new(id.term, id.node_id), id.index)
}

fn opt_log_id_to(id: Option<&LogId<NodeId>>) -> Option<pb::RaftLogId> {
    id.map(log_id_to)
}

fn membership_to(m: &Membership<NodeId, Node>) -> pb::RaftMembership {
    pb::RaftMembership {
        configs: m.get_joint_config().iter().map(|c| pb::RaftVoterSet { voters: c.iter().copied().collect() }).collect(),
        nodes: m
            .nodes()
            .map(|(id, n)| (*id, pb::RaftNode { rpc_addr: n.rpc_addr.clone(), http_addr: n.http_addr.clone(), raft_addr: n.raft_addr.clone() }))
            .collect(),
    }
}

/// A membership: one voter set, or two during a joint change; none empty; every voter
/// with its addresses. With `empty_ok`, also openraft's empty default (no voter set, no
/// node), which a snapshot taken before any membership was applied carries.
fn membership_from(m: Option<pb::RaftMembership>, field: &str, empty_ok: bool) -> Result<Membership<NodeId, Node>, WireError> {
    let m = need(m, field)?;
    if empty_ok && m.configs.is_empty() && m.nodes.is_empty() {
        return Ok(Membership::default());
    }
    if m.configs.is_empty() || m.configs.len() > 2 {
        return Err(invalid(format!("{field}.configs"), format!("{} voter sets; a membership has one, or two during a change", m.configs.len())));
    }
    let nodes: BTreeMap<NodeId, Node> = m
        .nodes
        .into_iter()
        .map(|(id, n)| (id, Node { rpc_addr: n.rpc_addr, http_addr: n.http_addr, raft_addr: n.raft_addr }))
        .collect();
    let mut configs = Vec::with_capacity(m.configs.len());
    for (i, c) in m.configs.into_iter().enumerate() {
        let set: BTreeSet<NodeId> = c.voters.into_iter().collect();
        if set.is_empty() {
            return Err(invalid(format!("{field}.configs[{i}]"), "an empty voter set"));
        }
        if let Some(v) = set.iter().find(|v| !nodes.contains_key(v)) {
            return Err(invalid(format!("{field}.configs[{i}]"), format!("voter {v} has no entry in nodes")));
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
    pb::RaftEntry { log_id: Some(log_id_to(&e.log_id)), payload: Some(payload) }
}

/// One log entry from its wire form; `field` names it in errors.
pub fn entry_from(e: pb::RaftEntry, field: &str) -> Result<Entry, WireError> {
    let log_id = log_id_from(need(e.log_id, format!("{field}.log_id"))?);
    let payload = match e.payload {
        None => return Err(invalid(format!("{field}.payload"), "absent, or of a kind this build does not know")),
        Some(pb::raft_entry::Payload::Blank(_)) => EntryPayload::Blank,
        Some(pb::raft_entry::Payload::Normal(b)) => EntryPayload::Normal(batch_from(b, &format!("{field}.normal"))?),
        Some(pb::raft_entry::Payload::Membership(m)) => EntryPayload::Membership(membership_from(Some(m), &format!("{field}.membership"), false)?),
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
    let entries = r.entries.into_iter().enumerate().map(|(i, e)| entry_from(e, &format!("entries[{i}]"))).collect::<Result<Vec<_>, _>>()?;
    Ok(AppendEntriesRequest { vote, prev_log_id: r.prev_log_id.map(log_id_from), entries, leader_commit: r.leader_commit.map(log_id_from) })
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
        AppendEntriesResponse::PartialSuccess(m) => R::PartialSuccess(pb::RaftPartialSuccess { matching: opt_log_id_to(m.as_ref()) }),
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
    pb::VoteRequest { vote: Some(vote_to(&r.vote)), last_log_id: opt_log_id_to(r.last_log_id.as_ref()) }
}

/// Vote from its wire form.
pub fn vote_request_from(r: pb::VoteRequest) -> Result<VoteRequest<NodeId>, WireError> {
    Ok(VoteRequest { vote: vote_from(r.vote, "vote")?, last_log_id: r.last_log_id.map(log_id_from) })
}

/// Vote's answer in its wire form.
pub fn vote_reply_to(r: &VoteResponse<NodeId>) -> pb::VoteReply {
    pb::VoteReply { vote: Some(vote_to(&r.vote)), vote_granted: r.vote_granted, last_log_id: opt_log_id_to(r.last_log_id.as_ref()) }
}

/// Vote's answer from its wire form.
pub fn vote_reply_from(r: pb::VoteReply) -> Result<VoteResponse<NodeId>, WireError> {
    Ok(VoteResponse { vote: vote_from(r.vote, "vote")?, vote_granted: r.vote_granted, last_log_id: r.last_log_id.map(log_id_from) })
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
pub fn snapshot_reply_from(r: pb::InstallSnapshotReply) -> Result<Result<InstallSnapshotResponse<NodeId>, InstallSnapshotError>, WireError> {
    use pb::install_snapshot_reply::Result as R;
    Ok(match need(r.result, "result")? {
        R::Vote(v) => Ok(InstallSnapshotResponse { vote: vote_from(Some(v), "vote")? }),
        R::Mismatch(m) => Err(InstallSnapshotError::SnapshotMismatch(SnapshotMismatch {
            expect: SnapshotSegmentId { id: m.expect_id, offset: m.expect_offset },
            got: SnapshotSegmentId { id: m.got_id, offset: m.got_offset },
        })),
    })
}

// ------------------------------------------------------------------ the replicated log

/// One log entry's commands in wire form.
pub fn batch_to(r: &Request) -> pb::LogBatch {
    pb::LogBatch {
        format: r.format,
        now_ms: r.now_ms,
        commands: r.commands.iter().map(command_to).collect(),
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
        return Err(WireError::NewerFormat { field: field.to_string(), format: b.format });
    }
    let commands = b
        .commands
        .into_iter()
        .enumerate()
        .map(|(i, c)| command_from(c, &format!("{field}.commands[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Request { format: b.format, now_ms: b.now_ms, commands, raise_feature_level: b.raise_feature_level, actors: b.actors })
}

fn command_to(c: &Command) -> pb::LogCommand {
    use pb::log_command::Command as C;
    let command = match c {
        Command::ApplyPolicy(p) => C::ApplyPolicy(policy_to(p)),
        Command::RegisterCluster { cluster, capacity, labels } => {
            C::RegisterCluster(pb::LogRegister { cluster: cluster.to_string(), capacity_milli: capacity.clone().into_iter().collect(), labels: labels.clone().into_iter().collect() })
        }
        Command::RemoveCluster { cluster } => C::RemoveCluster(pb::LogRemove { cluster: cluster.to_string() }),
        Command::Report(r) => C::Report(report_to(r)),
        Command::Tick => C::Tick(pb::Empty {}),
    };
    pb::LogCommand { command: Some(command) }
}

fn command_from(c: pb::LogCommand, field: &str) -> Result<Command, WireError> {
    use pb::log_command::Command as C;
    Ok(match c.command {
        None => return Err(invalid(field, "absent, or a command this build does not know")),
        Some(C::ApplyPolicy(p)) => Command::ApplyPolicy(policy_from(p, &format!("{field}.apply_policy"))?),
        Some(C::RegisterCluster(r)) => Command::RegisterCluster { cluster: cluster_name(r.cluster, &format!("{field}.register_cluster.cluster"))?, capacity: r.capacity_milli.into_iter().collect(), labels: r.labels.into_iter().collect() },
        Some(C::RemoveCluster(r)) => Command::RemoveCluster { cluster: cluster_name(r.cluster, &format!("{field}.remove_cluster.cluster"))? },
        Some(C::Report(r)) => Command::Report(report_from(r, &format!("{field}.report"))?),
        Some(C::Tick(_)) => Command::Tick,
    })
}

fn policy_to(p: &Policy) -> pb::LogPolicy {
    pb::LogPolicy {
        name: p.name.clone(),
        api_version: p.api_version.clone(),
        default_tenant: p.default_tenant.as_ref().map(ToString::to_string),
        lease_duration_ms: p.lease.duration_ms,
        lease_clock_skew_margin_ms: p.lease.clock_skew_margin_ms,
        reclaim: Some(pb::LogReclaim {
            enabled: p.reclaim.enabled,
            starved_for_ms: p.reclaim.starved_for_ms,
            max_evictions_per_minute: p.reclaim.max_evictions_per_minute,
            max_evictions_per_minute_per_tenant: p.reclaim.max_evictions_per_minute_per_tenant,
            min_runtime_ms: p.reclaim.min_runtime_ms,
            no_lend_idle: !p.reclaim.lend_idle,
            lend_only_cut_off: p.reclaim.lend_when == LendWhen::CutOff,
        }),
        resource_weights_milli: p.resource_weights.explicit().clone().into_iter().collect(),
        tenants: p.tenants.iter().map(tenant_to).collect(),
        // Absent when default: an entry is then the same bytes as before the field existed.
        showback_retention_ms: (p.showback != ShowbackConfig::default()).then_some(p.showback.retention_ms),
    }
}

fn policy_from(p: pb::LogPolicy, field: &str) -> Result<Policy, WireError> {
    let reclaim = p.reclaim.map_or_else(ReclaimConfig::default, |r| ReclaimConfig {
        enabled: r.enabled,
        starved_for_ms: r.starved_for_ms,
        max_evictions_per_minute: r.max_evictions_per_minute,
        max_evictions_per_minute_per_tenant: r.max_evictions_per_minute_per_tenant,
        min_runtime_ms: r.min_runtime_ms,
        lend_idle: !r.no_lend_idle,
        lend_when: if r.lend_only_cut_off { LendWhen::CutOff } else { LendWhen::Always },
    });
    let mut resource_weights = ResourceWeights::new();
    for (name, w) in p.resource_weights_milli {
        resource_weights.set(&name, w);
    }
    let tenants = p
        .tenants
        .into_iter()
        .enumerate()
        .map(|(i, t)| tenant_from(t, &format!("{field}.tenants[{i}]")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Policy {
        name: p.name,
        api_version: p.api_version,
        default_tenant: p.default_tenant.map(|t| tenant_name(t, &format!("{field}.default_tenant"))).transpose()?,
        lease: LeaseConfig { duration_ms: p.lease_duration_ms, clock_skew_margin_ms: p.lease_clock_skew_margin_ms },
        reclaim,
        showback: p.showback_retention_ms.map_or_else(ShowbackConfig::default, |retention_ms| ShowbackConfig { retention_ms }),
        resource_weights,
        tenants,
    })
}

fn tenant_to(t: &TenantPolicy) -> pb::LogTenant {
    pb::LogTenant {
        name: t.name.to_string(),
        weight_milli: t.weight_milli,
        min_share_bp: t.min_share_bp,
        max_share_bp: t.max_share_bp,
        preemptible: t.preemptible,
        decay_half_life_ms: t.decay_half_life_ms,
        namespaces: t.namespaces.clone(),
        namespace_selector: t.namespace_selector.clone().into_iter().collect(),
        admission: match t.admission {
            AdmissionMode::Reject => pb::LogAdmission::Reject,
            AdmissionMode::Queue => pb::LogAdmission::Queue,
        }
        .into(),
        max_queued: t.max_queued,
        burst_factor_milli: t.burst_factor_milli,
    }
}

fn tenant_from(t: pb::LogTenant, field: &str) -> Result<TenantPolicy, WireError> {
    let admission = match pb::LogAdmission::try_from(t.admission) {
        Ok(pb::LogAdmission::Reject) => AdmissionMode::Reject,
        Ok(pb::LogAdmission::Queue) => AdmissionMode::Queue,
        Err(_) => return Err(invalid(format!("{field}.admission"), format!("admission mode {} is not one this build knows", t.admission))),
    };
    Ok(TenantPolicy {
        name: tenant_name(t.name, &format!("{field}.name"))?,
        weight_milli: t.weight_milli,
        min_share_bp: t.min_share_bp,
        max_share_bp: t.max_share_bp,
        preemptible: t.preemptible,
        decay_half_life_ms: t.decay_half_life_ms,
        namespaces: t.namespaces,
        namespace_selector: t.namespace_selector.into_iter().collect(),
        admission,
        max_queued: t.max_queued,
        burst_factor_milli: t.burst_factor_milli,
    })
}

fn report_to(r: &UsageReport) -> pb::LogReport {
    pb::LogReport {
        cluster: r.cluster.to_string(),
        seq: r.seq,
        held_epoch: r.held_epoch,
        capacity: r.capacity.as_ref().map(|c| pb::LogCapacity { milli: c.clone().into_iter().collect() }),
        tenants: r
            .tenants
            .iter()
            .map(|(name, t)| (name.to_string(), pb::LogTenantUsage { used_milli_gpue_ms: t.used_milli_gpue_ms, inuse_milli_gpue: t.inuse, pending_milli_gpue: t.pending, largest_pending_milli_gpue: t.largest }))
            .collect(),
        evictions: r
            .evictions
            .iter()
            .map(|e| pb::LogEviction {
                victim: e.victim.clone(),
                victim_tenant: e.victim_tenant.clone(),
                for_tenant: e.for_tenant.clone(),
                for_pod: e.for_pod.clone(),
                milli_gpue: e.milli_gpue,
                outcome: e.outcome.to_string(),
                why: e.why.clone(),
            })
            .collect(),
        window: r.window.map(|w| pb::LogWindow { start_ms: w.start_ms, end_ms: w.end_ms }),
        decisions: r
            .decisions
            .iter()
            .map(|d| pb::LogDecision {
                pod: d.pod.clone(),
                tenant: d.tenant.clone(),
                verdict: d.verdict.as_str().to_string(),
                milli_gpue: d.milli_gpue,
                at_ms: d.at_ms,
                text: d.text.clone(),
            })
            .collect(),
    }
}

fn report_from(r: pb::LogReport, field: &str) -> Result<UsageReport, WireError> {
    Ok(UsageReport {
        cluster: cluster_name(r.cluster, &format!("{field}.cluster"))?,
        seq: r.seq,
        held_epoch: r.held_epoch,
        capacity: r.capacity.map(|c| c.milli.into_iter().collect()),
        tenants: r
            .tenants
            .into_iter()
            // A tenant that is no DNS label is dropped, as the log's JSON reader drops it
            // (see `tenants_that_are_labels`): applying the report ignored it anyway.
            .filter_map(|(name, t)| {
                let name = TenantName::parse(name).ok()?;
                Some((name, TenantReport { used_milli_gpue_ms: t.used_milli_gpue_ms, inuse: t.inuse_milli_gpue, pending: t.pending_milli_gpue, largest: t.largest_pending_milli_gpue }))
            })
            .collect(),
        evictions: r
            .evictions
            .into_iter()
            .map(|e| EvictionNote {
                victim: e.victim,
                victim_tenant: e.victim_tenant,
                for_tenant: e.for_tenant,
                for_pod: e.for_pod,
                milli_gpue: e.milli_gpue,
                outcome: EvictionOutcome::parse(&e.outcome),
                why: e.why,
            })
            .collect(),
        window: r.window.map(|w| UsageWindow { start_ms: w.start_ms, end_ms: w.end_ms }),
        // A verdict word this build does not know is dropped here, the same way on every
        // node (decisions are a record, not a fact the plan depends on).
        decisions: r
            .decisions
            .into_iter()
            .filter_map(|d| {
                Some(PodDecision {
                    verdict: Verdict::parse(&d.verdict)?,
                    pod: d.pod,
                    tenant: d.tenant,
                    milli_gpue: d.milli_gpue,
                    at_ms: d.at_ms,
                    text: d.text,
                })
            })
            .collect(),
    })
}
