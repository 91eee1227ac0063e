//! Raft traffic between control-plane nodes over gRPC (`kvota.raft.v1.Raft`), on each node's
//! own Raft listener.
//!
//! Every message is protobuf (`proto/kvota/raft/v1/raft.proto`), converted to and from
//! openraft's types in [`crate::wire`]. Every call has a deadline (openraft's
//! `hard_ttl`); a node that cannot be reached, or whose Raft core has stopped, is
//! reported as `Unreachable` so openraft backs off instead of hammering it.
//!
//! What enters openraft is checked first ([`check_append`], [`check_vote`],
//! [`check_snapshot`]): with TLS, the sender named in the message must be the node of
//! the caller's certificate (node 2 cannot speak for node 3); and terms, log indexes and
//! snapshot offsets must lie in ranges the engine handles. openraft increments terms and
//! indexes without overflow checks, so one message with term `u64::MAX` used to move
//! the group to that term and make the next election panic every node's Raft core.

use std::time::Duration;

use prost::Message as _;

use kvota_proto::raft::v1 as pb;
use kvota_proto::raft::v1::raft_client::RaftClient;
use kvota_proto::raft::v1::raft_server::Raft as RaftService;
use kvota_proto::raft::v1::{ClockReply, Empty};
use kvota_tls::{Expect, PeerInfo};
use openraft::error::{Fatal, InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::{LogId, Vote};
use tonic::transport::Channel;

use crate::store::flush::{clamp_commit, Durable};
use crate::types::{Node, NodeId, Raft, TypeConfig};
use crate::wire::{self, WireError};

/// Largest Raft message accepted (snapshot chunks and entry batches): 64 MiB. A
/// snapshot of a 10,000-tenant, 1,000-cluster federation is well below that.
pub const MAX_RAFT_MESSAGE_BYTES: usize = 64 << 20;

/// Log entries sent in one AppendEntries stop at this many encoded bytes (a single
/// larger entry goes alone). openraft 0.9 gives an AppendEntries the heartbeat interval
/// (50 ms by default) to be sent, appended, synced and answered, then sends the same
/// range again: a follower behind on reports naming a thousand tenants (20-30 KiB an
/// entry) was sent 6-9 MiB at a time, never made it, and never caught up.
pub const MAX_APPEND_BYTES: usize = 128 << 10;

/// Largest term or log index accepted from a peer: 2^48. A group that holds an
/// election every second reaches it in nine million years; far below `u64::MAX`, so
/// the engine's `term + 1` and `index + 1` never overflow.
pub const MAX_TERM_OR_INDEX: u64 = 1 << 48;

/// Largest snapshot received (offset plus chunk): 1 GiB. It is held in memory while it
/// arrives; a state machine of the documented limits is far smaller.
pub const MAX_SNAPSHOT_BYTES: u64 = 1 << 30;

/// Connection timeout to a peer: long enough for a loaded loopback, short enough that an
/// election is not held up by a dead peer.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Builds clients to peers.
#[derive(Clone, Debug)]
pub struct Network {
    /// Mutual TLS to the peers (with the node's own certificate), if the group uses it.
    pub tls: Option<kvota_client::tls::GrpcTls>,
    /// How far this node's log is durable ([`crate::store::LogStore::durable`]): the
    /// commit index sent to followers goes no further (see [`crate::store::flush`]).
    pub durable: tokio::sync::watch::Receiver<Durable>,
    /// Set when a commit index sent was held back by the durable log; the node sends a
    /// heartbeat once the log's sync moves on (`server.rs`).
    pub held_back: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &Node) -> PeerClient {
        PeerClient {
            target,
            addr: node.raft_addr.clone(),
            client: None,
            tls: self.tls.clone(),
            durable: self.durable.clone(),
            held_back: std::sync::Arc::clone(&self.held_back),
        }
    }
}

/// A client to one peer; connects lazily and reconnects after failures.
#[derive(Debug)]
pub struct PeerClient {
    target: NodeId,
    addr: String,
    client: Option<RaftClient<Channel>>,
    tls: Option<kvota_client::tls::GrpcTls>,
    durable: tokio::sync::watch::Receiver<Durable>,
    held_back: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

type RpcResult<T, E> = Result<T, RPCError<NodeId, Node, E>>;

/// A Raft client to `addr`, which must be node `target` (with TLS).
pub fn raft_client(addr: &str, target: NodeId, tls: Option<&kvota_client::tls::GrpcTls>, timeout: Duration) -> Result<RaftClient<Channel>, String> {
    if addr.is_empty() {
        return Err(format!(
            "node {target} has no Raft address in the membership (it was added by a kvota that served Raft on the API port); add it again with its --advertise-raft address"
        ));
    }
    let channel = kvota_client::tls::channel(addr, tls, Expect::Node(target), CONNECT_TIMEOUT, timeout)?;
    Ok(RaftClient::new(channel)
        .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES))
}

impl PeerClient {
    async fn client<E: std::error::Error>(&mut self) -> RpcResult<RaftClient<Channel>, E> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        // The per-request deadline is set on each call (openraft's hard TTL).
        let c = raft_client(&self.addr, self.target, self.tls.as_ref(), Duration::from_secs(60))
            .map_err(|e| RPCError::Unreachable(Unreachable::new(&std::io::Error::other(e))))?;
        self.client = Some(c.clone());
        Ok(c)
    }

    /// One call: send `request` with a deadline; a transport failure or a peer whose
    /// Raft core has stopped is `Unreachable` (openraft backs off).
    async fn call<Resp, E, F, Fut>(&mut self, option: &RPCOption, send: F) -> RpcResult<Resp, RaftError<NodeId, E>>
    where
        E: std::error::Error,
        F: FnOnce(RaftClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let client = self.client().await?;
        let reply = match tokio::time::timeout(option.hard_ttl(), send(client)).await {
            Err(elapsed) => {
                return Err(RPCError::Unreachable(Unreachable::new(&elapsed)));
            }
            Ok(Err(status)) => {
                // Drop the channel so the next call reconnects.
                self.client = None;
                return Err(RPCError::Unreachable(Unreachable::new(&status)));
            }
            Ok(Ok(reply)) => reply.into_inner(),
        };
        Ok(reply)
    }
}

fn with_deadline<T>(msg: T, option: &RPCOption) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(option.hard_ttl());
    r
}

/// A reply that did not decode: the peer speaks another version of the schema.
fn undecodable<E: std::error::Error>(e: &WireError) -> RPCError<NodeId, Node, RaftError<NodeId, E>> {
    RPCError::Network(NetworkError::new(e))
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, RaftError<NodeId>> {
        // openraft gives an AppendEntries one heartbeat interval to be answered (this
        // conversion included) and sends the same range again after a timeout, so a
        // message must be small enough for a follower to decode, append and sync in
        // that time. Convert and send a prefix that fits MAX_APPEND_BYTES (at least one
        // entry) and tell openraft how far it got; the commit index sent goes no further
        // than the entries sent, nor than this leader's durable log (`flush`: a
        // follower must not apply an entry before the leader has synced it).
        let mut entries = Vec::new();
        let mut size = 0;
        for e in &rpc.entries {
            let pe = wire::entry_to(e);
            size += pe.encoded_len();
            if !entries.is_empty() && size > MAX_APPEND_BYTES {
                break;
            }
            entries.push(pe);
        }
        let sent_to = (entries.len() < rpc.entries.len()).then(|| entries.len().checked_sub(1).map(|i| rpc.entries[i].log_id)).flatten();
        let committed = match sent_to {
            Some(last) => std::cmp::min(rpc.leader_commit, Some(last)),
            None => rpc.leader_commit,
        };
        let leader_commit = clamp_commit(committed, &self.durable.borrow());
        if leader_commit != committed {
            self.held_back.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        let head = AppendEntriesRequest { vote: rpc.vote, prev_log_id: rpc.prev_log_id, leader_commit, entries: Vec::new() };
        let mut msg = wire::append_to(&head);
        msg.entries = entries;
        let req = with_deadline(msg, &option);
        let reply = self.call(&option, |mut c| async move { c.append_entries(req).await }).await?;
        match wire::append_reply_from(reply).map_err(|e| undecodable(&e))? {
            AppendEntriesResponse::Success if sent_to.is_some() => Ok(AppendEntriesResponse::PartialSuccess(sent_to)),
            other => Ok(other),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>> {
        let req = with_deadline(wire::snapshot_to(&rpc), &option);
        let reply = self.call(&option, |mut c| async move { c.install_snapshot(req).await }).await?;
        match wire::snapshot_reply_from(reply).map_err(|e| undecodable(&e))? {
            Ok(r) => Ok(r),
            Err(e) => Err(RPCError::RemoteError(RemoteError::new(self.target, RaftError::APIError(e)))),
        }
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, RaftError<NodeId>> {
        let req = with_deadline(wire::vote_request_to(&rpc), &option);
        let reply = self.call(&option, |mut c| async move { c.vote(req).await }).await?;
        wire::vote_reply_from(reply).map_err(|e| undecodable(&e))
    }
}

/// Why a Raft message was refused before it reached openraft.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// `sender_mismatch` or `out_of_range` (the metric's reason).
    pub reason: &'static str,
    /// In words.
    pub why: String,
}

fn out_of_range(why: String) -> Refused {
    Refused { reason: "out_of_range", why }
}

fn check_term(what: &str, term: u64) -> Result<(), Refused> {
    if term > MAX_TERM_OR_INDEX {
        return Err(out_of_range(format!("{what} term {term} is above the largest accepted ({MAX_TERM_OR_INDEX})")));
    }
    Ok(())
}

fn check_log_id(what: &str, id: Option<&LogId<NodeId>>, max_term: u64) -> Result<(), Refused> {
    let Some(id) = id else { return Ok(()) };
    check_term(what, id.leader_id.term)?;
    if id.leader_id.term > max_term {
        return Err(out_of_range(format!("{what} {id} is of a term after the sender's ({max_term})")));
    }
    if id.index > MAX_TERM_OR_INDEX {
        return Err(out_of_range(format!("{what} index {} is above the largest accepted ({MAX_TERM_OR_INDEX})", id.index)));
    }
    Ok(())
}

/// The vote a message carries: in range, and (with `sender`, the caller's certificate)
/// the sender's own.
fn check_sender(vote: &Vote<NodeId>, sender: Option<NodeId>) -> Result<(), Refused> {
    check_term("vote", vote.leader_id().get_term())?;
    if let Some(sender) = sender {
        let claimed = vote.leader_id().voted_for();
        if claimed != Some(sender) {
            return Err(Refused {
                reason: "sender_mismatch",
                why: format!("node {sender} sent a message as node {}", claimed.map_or_else(|| "?".to_string(), |c| c.to_string())),
            });
        }
    }
    Ok(())
}

/// AppendEntries: the leader's vote, then the log ids: in range, of no later term than
/// the vote, entries numbered one after another from `prev_log_id`.
pub fn check_append(rpc: &AppendEntriesRequest<TypeConfig>, sender: Option<NodeId>) -> Result<(), Refused> {
    check_sender(&rpc.vote, sender)?;
    let term = rpc.vote.leader_id().get_term();
    check_log_id("prev_log_id", rpc.prev_log_id.as_ref(), term)?;
    check_log_id("leader_commit", rpc.leader_commit.as_ref(), term)?;
    let mut last_term = rpc.prev_log_id.map_or(0, |l| l.leader_id.term);
    for (next, e) in (rpc.prev_log_id.map_or(0, |l| l.index + 1)..).zip(&rpc.entries) {
        check_log_id("entry", Some(&e.log_id), term)?;
        if e.log_id.index != next {
            return Err(out_of_range(format!("entry {} where entry index {next} belongs", e.log_id)));
        }
        if e.log_id.leader_id.term < last_term {
            return Err(out_of_range(format!("entry {} is of an earlier term than the one before it", e.log_id)));
        }
        last_term = e.log_id.leader_id.term;
    }
    Ok(())
}

/// Vote: the candidate's vote, and its last log id no later than it.
pub fn check_vote(rpc: &VoteRequest<NodeId>, sender: Option<NodeId>) -> Result<(), Refused> {
    check_sender(&rpc.vote, sender)?;
    check_log_id("last_log_id", rpc.last_log_id.as_ref(), rpc.vote.leader_id().get_term())
}

/// InstallSnapshot: the leader's vote, the snapshot's last log id, and the chunk within
/// [`MAX_SNAPSHOT_BYTES`].
pub fn check_snapshot(rpc: &InstallSnapshotRequest<TypeConfig>, sender: Option<NodeId>) -> Result<(), Refused> {
    check_sender(&rpc.vote, sender)?;
    let term = rpc.vote.leader_id().get_term();
    check_log_id("snapshot last_log_id", rpc.meta.last_log_id.as_ref(), term)?;
    let end = rpc.offset.checked_add(rpc.data.len() as u64);
    if end.is_none_or(|e| e > MAX_SNAPSHOT_BYTES) {
        return Err(out_of_range(format!(
            "snapshot chunk at offset {} of {} bytes ends past the largest snapshot accepted ({MAX_SNAPSHOT_BYTES} bytes)",
            rpc.offset,
            rpc.data.len()
        )));
    }
    Ok(())
}

/// The receiving side: checks each payload, then hands it to the local Raft node.
#[derive(Clone)]
pub struct RaftTransport {
    raft: Raft,
    contact: std::sync::Arc<crate::watchdog::LeaderContact>,
    ctx: std::sync::Arc<crate::node::NodeCtx>,
}

impl std::fmt::Debug for RaftTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RaftTransport")
    }
}

impl RaftTransport {
    /// Serves Raft traffic for the node of `ctx`, noting in `contact` when a leader was
    /// last heard.
    pub fn new(ctx: std::sync::Arc<crate::node::NodeCtx>, contact: std::sync::Arc<crate::watchdog::LeaderContact>) -> Self {
        RaftTransport { raft: ctx.raft.clone(), contact, ctx }
    }

    /// The caller's node id from its certificate (`None` without TLS); a caller without
    /// a node identity never gets here with TLS (the listener drops it).
    fn sender<T>(&self, method: &str, req: &tonic::Request<T>) -> Result<Option<NodeId>, tonic::Status> {
        if !self.ctx.authz.enabled() {
            return Ok(None);
        }
        let id = req.extensions().get::<PeerInfo>().and_then(|p| p.identity.clone());
        match id.as_ref().and_then(|i| i.node_id()) {
            Some(n) => Ok(Some(n)),
            None => Err(self.ctx.authz.deny(
                "raft",
                method,
                "role",
                &id.map_or_else(|| "no identity".to_string(), |i| i.to_string()),
                tonic::Status::permission_denied("Raft traffic is for control-plane nodes only"),
            )),
        }
    }

    /// Why this node must stop, if an AppendEntries that carries log entries of a
    /// format newer than this build reads (`format`) comes from `from` as the leader of a
    /// term at least this node's, and `from` is a member of the group as this node knows
    /// it. Anything else that does not decode is only refused: a removed node, a stale
    /// leader or a node of another group with a certificate from the same CA cannot stop
    /// a node this way.
    fn newer_from_leader(&self, vote: Option<&pb::RaftVote>, format: u32, from: NodeId) -> Option<String> {
        let vote = vote?;
        // A term the engine could not handle is refused like any other such message.
        check_term("vote", vote.term).ok()?;
        let m = self.raft.metrics().borrow().clone();
        let member = m.membership_config.membership().nodes().any(|(id, _)| *id == from);
        if vote.node_id != from || vote.term < m.current_term || !member || format <= crate::types::LOG_FORMAT {
            return None;
        }
        Some(format!("replicated from node {from}, leader in term {}: {}", vote.term, crate::types::newer_entry_format(format)))
    }

    fn refuse(&self, method: &str, sender: Option<NodeId>, r: Refused) -> tonic::Status {
        let who = sender.map_or_else(|| "unauthenticated peer".to_string(), |s| format!("node {s}"));
        self.ctx.authz.deny("raft", method, r.reason, &who, tonic::Status::invalid_argument(r.why))
    }
}

fn bad_payload(e: &WireError) -> tonic::Status {
    tonic::Status::invalid_argument(format!("malformed Raft message: {e}"))
}

/// The local Raft core failed or stopped: the sender treats this node as unreachable.
fn core_failed(e: &Fatal<NodeId>) -> tonic::Status {
    tonic::Status::unavailable(format!("this node's Raft core has stopped: {e}"))
}

#[tonic::async_trait]
impl RaftService for RaftTransport {
    async fn append_entries(
        &self,
        request: tonic::Request<pb::AppendEntriesRequest>,
    ) -> Result<tonic::Response<pb::AppendEntriesReply>, tonic::Status> {
        let sender = self.sender("AppendEntries", &request)?;
        let msg = request.into_inner();
        // The group's leader sent entries of a format this build cannot read: the group
        // runs at a feature level this node does not support (it was added, or
        // restarted, as an older build). Stop rather than lag forever.
        if let (Some(from), Some(format)) = (sender, wire::newest_entry_format(&msg)) {
            if let Some(why) = self.newer_from_leader(msg.vote.as_ref(), format, from) {
                self.ctx.set_fatal(why.clone());
                let raft = self.raft.clone();
                tokio::spawn(async move {
                    let _ = raft.shutdown().await;
                });
                return Err(tonic::Status::failed_precondition(why));
            }
        }
        let rpc = wire::append_from(msg).map_err(|e| bad_payload(&e))?;
        check_append(&rpc, sender).map_err(|r| self.refuse("AppendEntries", sender, r))?;
        if let Some(leader) = rpc.vote.leader_id().voted_for() {
            self.contact.heard(leader);
        }
        match self.raft.append_entries(rpc).await {
            Ok(r) => Ok(tonic::Response::new(wire::append_reply_to(&r))),
            Err(RaftError::Fatal(f)) => Err(core_failed(&f)),
            Err(RaftError::APIError(e)) => match e {},
        }
    }

    async fn vote(&self, request: tonic::Request<pb::VoteRequest>) -> Result<tonic::Response<pb::VoteReply>, tonic::Status> {
        let sender = self.sender("Vote", &request)?;
        let rpc = wire::vote_request_from(request.into_inner()).map_err(|e| bad_payload(&e))?;
        check_vote(&rpc, sender).map_err(|r| self.refuse("Vote", sender, r))?;
        match self.raft.vote(rpc).await {
            Ok(r) => Ok(tonic::Response::new(wire::vote_reply_to(&r))),
            Err(RaftError::Fatal(f)) => Err(core_failed(&f)),
            Err(RaftError::APIError(e)) => match e {},
        }
    }

    async fn install_snapshot(
        &self,
        request: tonic::Request<pb::InstallSnapshotRequest>,
    ) -> Result<tonic::Response<pb::InstallSnapshotReply>, tonic::Status> {
        let sender = self.sender("InstallSnapshot", &request)?;
        let rpc = wire::snapshot_from(request.into_inner()).map_err(|e| bad_payload(&e))?;
        check_snapshot(&rpc, sender).map_err(|r| self.refuse("InstallSnapshot", sender, r))?;
        match self.raft.install_snapshot(rpc).await {
            Ok(r) => Ok(tonic::Response::new(wire::snapshot_reply_to(Ok(&r)))),
            Err(RaftError::APIError(InstallSnapshotError::SnapshotMismatch(m))) => {
                Ok(tonic::Response::new(wire::snapshot_reply_to(Err(&m))))
            }
            Err(RaftError::Fatal(f)) => Err(core_failed(&f)),
        }
    }

    async fn clock(&self, request: tonic::Request<Empty>) -> Result<tonic::Response<ClockReply>, tonic::Status> {
        self.sender("Clock", &request)?;
        Ok(tonic::Response::new(ClockReply { wall_ms: self.ctx.clock.wall_ms(), feature_level_max: self.ctx.clock.own_feature_max() }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, EntryPayload};
    use proptest::prelude::*;

    type Entry = openraft::Entry<TypeConfig>;

    fn log_id(term: u64, node: u64, index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(term, node), index)
    }

    fn append(term: u64, leader: u64, prev: Option<(u64, u64)>, entries: &[(u64, u64)]) -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(term, leader),
            prev_log_id: prev.map(|(t, i)| log_id(t, leader, i)),
            entries: entries.iter().map(|&(t, i)| Entry { log_id: log_id(t, leader, i), payload: EntryPayload::Blank }).collect(),
            leader_commit: None,
        }
    }

    #[test]
    fn ordinary_appends_votes_and_snapshots_pass() {
        assert_eq!(check_append(&append(3, 1, Some((2, 9)), &[(2, 10), (3, 11)]), Some(1)), Ok(()));
        assert_eq!(check_append(&append(3, 1, None, &[(1, 0), (3, 1)]), Some(1)), Ok(()));
        assert_eq!(check_append(&append(3, 1, None, &[]), None), Ok(()), "a heartbeat, without TLS");
        let vote = VoteRequest { vote: Vote::new(5, 2), last_log_id: Some(log_id(4, 1, 100)) };
        assert_eq!(check_vote(&vote, Some(2)), Ok(()));
    }

    #[test]
    fn terms_and_indexes_the_engine_cannot_increment_are_refused() {
        let e = check_append(&append(u64::MAX, 1, None, &[]), Some(1)).expect_err("u64::MAX term");
        assert_eq!(e.reason, "out_of_range");
        assert!(e.why.contains("above the largest accepted"), "{}", e.why);
        assert!(check_append(&append(MAX_TERM_OR_INDEX + 1, 1, None, &[]), None).is_err());
        assert!(check_append(&append(MAX_TERM_OR_INDEX, 1, None, &[]), None).is_ok(), "the bound itself is fine");
        assert!(check_append(&append(3, 1, Some((3, u64::MAX)), &[]), Some(1)).is_err(), "index");
        assert!(check_vote(&VoteRequest { vote: Vote::new(u64::MAX, 2), last_log_id: None }, Some(2)).is_err());
        // An entry of a later term than the leader's vote, or a last log id after the
        // candidate's term: inconsistent, refused.
        assert!(check_append(&append(3, 1, None, &[(4, 0)]), Some(1)).is_err());
        assert!(check_vote(&VoteRequest { vote: Vote::new(5, 2), last_log_id: Some(log_id(6, 1, 1)) }, Some(2)).is_err());
        // Entries out of order, with a gap, or going back in term.
        assert!(check_append(&append(3, 1, Some((1, 4)), &[(1, 6)]), Some(1)).is_err(), "gap");
        assert!(check_append(&append(3, 1, Some((1, 4)), &[(1, 5), (1, 5)]), Some(1)).is_err(), "repeat");
        assert!(check_append(&append(3, 1, Some((2, 4)), &[(1, 5)]), Some(1)).is_err(), "term goes back");
    }

    #[test]
    fn a_node_may_speak_only_as_itself() {
        let e = check_append(&append(3, 1, None, &[]), Some(2)).expect_err("node 2 as leader 1");
        assert_eq!(e.reason, "sender_mismatch");
        assert!(e.why.contains("node 2 sent a message as node 1"), "{}", e.why);
        assert!(check_vote(&VoteRequest { vote: Vote::new(5, 3), last_log_id: None }, Some(2)).is_err());
    }

    #[test]
    fn a_snapshot_chunk_past_the_limit_is_refused() {
        let rpc = |offset: u64, len: usize| InstallSnapshotRequest::<TypeConfig> {
            vote: Vote::new_committed(2, 1),
            meta: openraft::SnapshotMeta { last_log_id: Some(log_id(2, 1, 50)), last_membership: Default::default(), snapshot_id: "s".into() },
            offset,
            data: vec![0; len],
            done: false,
        };
        assert!(check_snapshot(&rpc(0, 1024), Some(1)).is_ok());
        assert!(check_snapshot(&rpc(MAX_SNAPSHOT_BYTES - 10, 10), Some(1)).is_ok());
        assert!(check_snapshot(&rpc(MAX_SNAPSHOT_BYTES - 10, 11), Some(1)).is_err());
        assert!(check_snapshot(&rpc(u64::MAX, 1), Some(1)).is_err(), "offset + len overflows");
    }

    proptest! {
        /// Arbitrary bytes as any of the three requests: protobuf decoding, then the
        /// conversion, then the check, each answers with an error or a value (no panic).
        #[test]
        fn any_payload_decodes_or_is_refused_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            use prost::Message;
            if let Ok(m) = pb::AppendEntriesRequest::decode(bytes.as_slice()) {
                let _ = wire::newest_entry_format(&m);
                if let Ok(r) = wire::append_from(m) {
                    let _ = check_append(&r, Some(1));
                }
            }
            if let Ok(Ok(r)) = pb::VoteRequest::decode(bytes.as_slice()).map(wire::vote_request_from) {
                let _ = check_vote(&r, Some(1));
            }
            if let Ok(Ok(r)) = pb::InstallSnapshotRequest::decode(bytes.as_slice()).map(wire::snapshot_from) {
                let _ = check_snapshot(&r, Some(1));
            }
            if let Ok(m) = pb::AppendEntriesReply::decode(bytes.as_slice()) {
                let _ = wire::append_reply_from(m);
            }
            if let Ok(m) = pb::VoteReply::decode(bytes.as_slice()) {
                let _ = wire::vote_reply_from(m);
            }
            if let Ok(m) = pb::InstallSnapshotReply::decode(bytes.as_slice()) {
                let _ = wire::snapshot_reply_from(m);
            }
        }

        /// Well-formed appends with random terms and indexes: whatever passes the check is
        /// within the engine's range and consistent.
        #[test]
        fn what_passes_is_in_range_and_consistent(
            term in prop_oneof![0u64..10, Just(u64::MAX), Just(MAX_TERM_OR_INDEX), Just(MAX_TERM_OR_INDEX + 1)],
            prev in proptest::option::of((0u64..10, prop_oneof![0u64..100, Just(u64::MAX - 1)])),
            entries in proptest::collection::vec((0u64..12, 0u64..120), 0..5),
        ) {
            let r = append(term, 1, prev, &entries);
            if check_append(&r, Some(1)).is_ok() {
                prop_assert!(term <= MAX_TERM_OR_INDEX);
                for (next, e) in (prev.map_or(0, |p| p.1 + 1)..).zip(&r.entries) {
                    prop_assert!(e.log_id.leader_id.term <= term);
                    prop_assert_eq!(e.log_id.index, next);
                }
            }
        }
    }
}
