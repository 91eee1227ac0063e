//! Raft traffic between control-plane nodes over gRPC (`kvota.raft.v1.Raft`), on each node's
//! own Raft listener.
//!
//! Every message is protobuf (`proto/kvota/raft/v1/raft.proto`), converted to and from
//! openraft's types in [`crate::wire`]. Every call has a deadline (openraft's
//! `hard_ttl`); a node that cannot be reached, or whose Raft core has stopped, is
//! reported as `Unreachable` so openraft backs off instead of hammering it.
//!
//! What enters openraft is checked first ([`crate::guard`]): with TLS, the sender named
//! in a message must be the node of the caller's certificate (node 2 cannot speak for
//! node 3) and a member of the group; terms, log indexes and snapshot offsets must lie
//! in ranges the engine handles, with headroom; and every reply must answer the request
//! that was sent. A reply that does not is counted
//! (`kvota_raft_replies_refused_total`) and reported to openraft as an unreachable peer.
//!
//! A snapshot arrives in chunks, in order, into memory here, and reaches openraft only
//! whole and only once it decodes as a snapshot this build reads: a bad one is refused
//! and cannot stop the node's Raft core (openraft stops it on any storage error).
//!
//! Log entries of a format this node does not read (or a raise to a feature level it
//! does not support) are refused, never applied; sent by its leader, they make the node
//! unready with a message naming the leader and the format until entries it reads
//! arrive. No message from a peer stops a node.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use prost::Message as _;

use kvota_proto::raft::v1 as pb;
use kvota_proto::raft::v1::raft_client::RaftClient;
use kvota_proto::raft::v1::raft_server::Raft as RaftService;
use kvota_proto::raft::v1::{ClockReply, Empty};
use kvota_tls::{Expect, PeerInfo};
use openraft::error::{Fatal, InstallSnapshotError, RPCError, RaftError, RemoteError, Timeout, Unreachable};
use openraft::network::{RPCOption, RPCTypes, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::{LogId, Vote};
use tonic::transport::Channel;
use tracing::Instrument as _;

use crate::guard::{self, Guard, Refused, SentAppend, SentChunk, MAX_SNAPSHOT_BYTES};
use crate::metrics::Metrics;
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
/// entry) was sent 6-9 MiB at a time, never made it, and never caught up. A slow peer
/// gets less still (see [`AppendWindow`]).
pub const MAX_APPEND_BYTES: usize = 128 << 10;

/// The smallest byte limit [`AppendWindow`] shrinks to (one entry still goes alone).
pub const MIN_APPEND_BYTES: usize = 8 << 10;

/// How many bytes of log entries the next AppendEntries to one peer may carry.
///
/// A message that is not answered within openraft's deadline is dropped and the same
/// range sent again; if the peer (or this node, converting and encrypting) is too slow
/// for [`MAX_APPEND_BYTES`] in that time, it would be sent the same range for ever, and
/// the follower, hearing no leader, would call elections. So a message that ran out of
/// time halves the window (down to [`MIN_APPEND_BYTES`]); one answered within half
/// the deadline widens it by a quarter again (up to [`MAX_APPEND_BYTES`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AppendWindow {
    bytes: usize,
}

impl Default for AppendWindow {
    fn default() -> Self {
        AppendWindow {
            bytes: MAX_APPEND_BYTES,
        }
    }
}

impl AppendWindow {
    /// The current limit, bytes.
    pub fn bytes(self) -> usize {
        self.bytes
    }

    /// The last message ran out of time.
    pub fn timed_out(&mut self) {
        self.bytes = std::cmp::max(self.bytes / 2, MIN_APPEND_BYTES);
    }

    /// The last message was answered after `took`, of a deadline `deadline`.
    pub fn answered(&mut self, took: Duration, deadline: Duration) {
        if took >= deadline {
            self.timed_out();
        } else if took < deadline / 2 {
            self.bytes = std::cmp::min(
                self.bytes + std::cmp::max(self.bytes / 4, MIN_APPEND_BYTES),
                MAX_APPEND_BYTES,
            );
        }
    }
}

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
    pub held_back: Arc<std::sync::atomic::AtomicBool>,
    /// The checks' view of this node (replies are checked against it).
    pub guard: Arc<Guard>,
    /// Where refused replies are counted.
    pub metrics: Metrics,
    /// What each peer acknowledged holding, under which vote (see [`Acked`]).
    pub acked: Acked,
}

/// The last log id each peer acknowledged holding (a success, a partial success, an
/// installed snapshot), under the leader vote it was acknowledged to. openraft keeps
/// the same record per leadership and asserts that it never goes back; it outlives one
/// [`PeerClient`] (openraft makes a client per replication stream and per leadership
/// check), so it is kept here.
#[derive(Clone, Debug, Default)]
pub struct Acked(Arc<Mutex<AckedMap>>);

/// Per peer: the leader vote, and the last log id acknowledged under it.
type AckedMap = HashMap<NodeId, (Vote<NodeId>, LogId<NodeId>)>;

impl Acked {
    fn get(&self, target: NodeId, vote: &Vote<NodeId>) -> Option<LogId<NodeId>> {
        let m = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        m.get(&target).filter(|(v, _)| v == vote).map(|(_, l)| *l)
    }

    fn record(&self, target: NodeId, vote: &Vote<NodeId>, id: Option<LogId<NodeId>>) {
        let Some(id) = id else { return };
        let mut m = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        match m.get_mut(&target) {
            Some((v, l)) if v == vote => *l = std::cmp::max(*l, id),
            _ => {
                m.insert(target, (*vote, id));
            }
        }
    }
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
            held_back: Arc::clone(&self.held_back),
            guard: Arc::clone(&self.guard),
            metrics: self.metrics.clone(),
            acked: self.acked.clone(),
            window: AppendWindow::default(),
            unanswered: false,
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
    held_back: Arc<std::sync::atomic::AtomicBool>,
    guard: Arc<Guard>,
    metrics: Metrics,
    acked: Acked,
    /// How much the next AppendEntries may carry.
    window: AppendWindow,
    /// An AppendEntries is under way: still set when the next one starts means openraft
    /// dropped it at its deadline.
    unanswered: bool,
}

type RpcResult<T, E> = Result<T, RPCError<NodeId, Node, E>>;

/// A Raft client to `addr`, which must be node `target` (with TLS).
pub fn raft_client(
    addr: &str,
    target: NodeId,
    tls: Option<&kvota_client::tls::GrpcTls>,
    timeout: Duration,
) -> Result<RaftClient<Channel>, String> {
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

    /// One call: send `request` with a deadline. A transport failure or a peer whose
    /// Raft core has stopped is `Unreachable` (openraft then backs off for 500 ms); a
    /// call that ran out of time is a `Timeout`, which openraft retries at once. A live
    /// but slow follower must not be taken for an unreachable one: half a second
    /// without heartbeats exceeds its election timeout, and it would call an election
    /// that unseats a healthy leader.
    async fn call<Resp, E, F, Fut>(
        &mut self,
        action: RPCTypes,
        option: &RPCOption,
        send: F,
    ) -> RpcResult<Resp, RaftError<NodeId, E>>
    where
        E: std::error::Error,
        F: FnOnce(RaftClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<Resp>, tonic::Status>>,
    {
        let client = self.client().await?;
        let timeout = || {
            RPCError::Timeout(Timeout {
                action,
                id: self.guard.local().id,
                target: self.target,
                timeout: option.hard_ttl(),
            })
        };
        let reply = match tokio::time::timeout(option.hard_ttl(), send(client)).await {
            Err(_) => return Err(timeout()),
            Ok(Err(status)) if ran_out_of_time(&status) => return Err(timeout()),
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

/// Whether a call failed for its deadline (the client's or the server's), not for the
/// peer or the connection.
fn ran_out_of_time(status: &tonic::Status) -> bool {
    matches!(status.code(), tonic::Code::DeadlineExceeded | tonic::Code::Cancelled)
}

fn with_deadline<T>(msg: T, option: &RPCOption) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(option.hard_ttl());
    r
}

/// How often a refused reply from one peer is logged (the metric counts them all).
const REPLY_LOG_EVERY: Duration = Duration::from_secs(10);

/// When each peer's refused reply was last logged, and how many were not logged since.
static REPLY_LOG: Mutex<Option<HashMap<NodeId, (Instant, u64)>>> = Mutex::new(None);

impl PeerClient {
    /// A reply that does not answer what was sent (or does not decode): counted, logged
    /// (at most every [`REPLY_LOG_EVERY`] per peer) and reported to openraft as an
    /// unreachable peer, so it backs off and never acts on it.
    fn refuse_reply<E: std::error::Error>(&self, method: &'static str, r: &Refused) -> RPCError<NodeId, Node, E> {
        self.metrics.reply_refused(method, r.reason);
        let now = Instant::now();
        let suppressed = {
            let mut g = REPLY_LOG.lock().unwrap_or_else(PoisonError::into_inner);
            let m = g.get_or_insert_with(HashMap::new);
            match m.get_mut(&self.target) {
                Some((at, n)) if now.duration_since(*at) < REPLY_LOG_EVERY => {
                    *n += 1;
                    None
                }
                _ => m.insert(self.target, (now, 0)).map_or(Some(0), |(_, n)| Some(n)),
            }
        };
        if let Some(suppressed) = suppressed {
            tracing::warn!(peer = self.target, method, reason = r.reason, why = %r.why, suppressed, "a peer's Raft reply was refused: it does not answer what was sent");
        }
        RPCError::Unreachable(Unreachable::new(&std::io::Error::other(format!(
            "node {} answered {method} with {}",
            self.target, r.why
        ))))
    }

    fn undecodable<E: std::error::Error>(&self, method: &'static str, e: &WireError) -> RPCError<NodeId, Node, E> {
        self.refuse_reply(
            method,
            &Refused {
                reason: "undecodable",
                why: format!("a reply that does not decode: {e}"),
            },
        )
    }
}

/// Each call runs in a `raft_send` span: the method, the peer, the term of the vote
/// it carries (the leader's or the candidate's), so a write can be followed from the
/// leader to each follower with `--log-format json`.
impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, RaftError<NodeId>> {
        let span = send_span("AppendEntries", self.target, &rpc.vote);
        self.send_append(rpc, option).instrument(span).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>> {
        let span = send_span("InstallSnapshot", self.target, &rpc.vote);
        self.send_snapshot(rpc, option).instrument(span).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, RaftError<NodeId>> {
        let span = send_span("Vote", self.target, &rpc.vote);
        self.send_vote(rpc, option).instrument(span).await
    }
}

/// The span of one Raft call to `peer`.
fn send_span(method: &'static str, peer: NodeId, vote: &Vote<NodeId>) -> tracing::Span {
    tracing::info_span!("raft_send", method, peer, term = vote.leader_id().get_term())
}

impl PeerClient {
    /// The leading entries of `rpc` that fit this peer's window (at least one), encoded;
    /// first shrinks the window if the last AppendEntries was dropped at its deadline.
    fn prefix(&mut self, rpc: &AppendEntriesRequest<TypeConfig>) -> Vec<pb::RaftEntry> {
        if std::mem::take(&mut self.unanswered) {
            self.window.timed_out();
            tracing::debug!(
                peer = self.target,
                bytes = self.window.bytes(),
                "AppendEntries ran out of time: smaller messages"
            );
        }
        let mut entries = Vec::new();
        let mut size = 0;
        for e in &rpc.entries {
            let pe = wire::entry_to(e);
            size += pe.encoded_len();
            if !entries.is_empty() && size > self.window.bytes() {
                break;
            }
            entries.push(pe);
        }
        entries
    }

    /// The commit index to send with entries up to `sent_to` (all of them: `None`): no
    /// further than those, nor than this leader's durable log.
    fn commit_to_send(
        &self,
        leader_commit: Option<LogId<NodeId>>,
        sent_to: Option<LogId<NodeId>>,
    ) -> Option<LogId<NodeId>> {
        let committed = match sent_to {
            Some(last) => std::cmp::min(leader_commit, Some(last)),
            None => leader_commit,
        };
        let clamped = clamp_commit(committed, &self.durable.borrow());
        if clamped != committed {
            self.held_back.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        clamped
    }

    async fn send_append(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, RaftError<NodeId>> {
        // openraft gives an AppendEntries one heartbeat interval to be answered (this
        // conversion included) and sends the same range again after a timeout, so a
        // message must be small enough for a follower to decode, append and sync in
        // that time. Convert and send a prefix that fits this peer's window (at least
        // one entry) and tell openraft how far it got; the commit index sent goes no
        // further than the entries sent, nor than this leader's durable log (`flush`: a
        // follower must not apply an entry before the leader has synced it).
        let entries = self.prefix(&rpc);
        let sent = SentAppend {
            vote: rpc.vote,
            prev_log_id: rpc.prev_log_id,
            entries: rpc.entries[..entries.len()].iter().map(|e| e.log_id).collect(),
        };
        let sent_to = (entries.len() < rpc.entries.len())
            .then(|| sent.entries.last().copied())
            .flatten();
        let leader_commit = self.commit_to_send(rpc.leader_commit, sent_to);
        let head = AppendEntriesRequest {
            vote: rpc.vote,
            prev_log_id: rpc.prev_log_id,
            leader_commit,
            entries: Vec::new(),
        };
        let mut msg = wire::append_to(&head);
        msg.entries = entries;
        let req = with_deadline(msg, &option);
        let started = Instant::now();
        let carries = !sent.entries.is_empty();
        self.unanswered = carries;
        let reply = self
            .call(RPCTypes::AppendEntries, &option, |mut c| async move {
                c.append_entries(req).await
            })
            .await;
        self.unanswered = false;
        if carries {
            self.window.answered(started.elapsed(), option.hard_ttl());
        }
        let reply = reply?;
        let reply = wire::append_reply_from(reply).map_err(|e| self.undecodable("AppendEntries", &e))?;
        let acked = self.acked.get(self.target, &sent.vote);
        guard::check_append_reply(&sent, &reply, acked, &self.guard.local(), &self.guard)
            .map_err(|r| self.refuse_reply("AppendEntries", &r))?;
        match reply {
            AppendEntriesResponse::Success => {
                let last = sent.entries.last().copied().or(sent.prev_log_id);
                self.acked.record(self.target, &sent.vote, last);
                Ok(match sent_to {
                    Some(_) => AppendEntriesResponse::PartialSuccess(sent_to),
                    None => AppendEntriesResponse::Success,
                })
            }
            AppendEntriesResponse::PartialSuccess(m) => {
                self.acked.record(self.target, &sent.vote, m);
                Ok(AppendEntriesResponse::PartialSuccess(m))
            }
            other => Ok(other),
        }
    }

    async fn send_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>> {
        let sent = SentChunk {
            vote: rpc.vote,
            snapshot_id: rpc.meta.snapshot_id.clone(),
            offset: rpc.offset,
        };
        let (done, last) = (rpc.done, rpc.meta.last_log_id);
        let req = with_deadline(wire::snapshot_to(&rpc), &option);
        let reply = self
            .call(RPCTypes::InstallSnapshot, &option, |mut c| async move {
                c.install_snapshot(req).await
            })
            .await?;
        let reply = wire::snapshot_reply_from(reply).map_err(|e| self.undecodable("InstallSnapshot", &e))?;
        let reply = reply.map_err(|e| match e {
            InstallSnapshotError::SnapshotMismatch(m) => m,
        });
        guard::check_snapshot_reply(&sent, &reply, &self.guard.local(), &self.guard)
            .map_err(|r| self.refuse_reply("InstallSnapshot", &r))?;
        match reply {
            Ok(r) => {
                if done && r.vote <= sent.vote {
                    // Installed: openraft counts the peer as holding the snapshot's log.
                    self.acked.record(self.target, &sent.vote, last);
                }
                Ok(r)
            }
            Err(m) => Err(RPCError::RemoteError(RemoteError::new(
                self.target,
                RaftError::APIError(InstallSnapshotError::SnapshotMismatch(m)),
            ))),
        }
    }

    async fn send_vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, RaftError<NodeId>> {
        let req = with_deadline(wire::vote_request_to(&rpc), &option);
        let reply = self
            .call(RPCTypes::Vote, &option, |mut c| async move { c.vote(req).await })
            .await?;
        let reply = wire::vote_reply_from(reply).map_err(|e| self.undecodable("Vote", &e))?;
        guard::check_vote_reply(&rpc, &reply, &self.guard.local(), &self.guard)
            .map_err(|r| self.refuse_reply("Vote", &r))?;
        Ok(reply)
    }
}

/// The span of one Raft request received; `peer` is recorded by
/// [`RaftTransport::sender`].
fn receive_span(method: &'static str, vote: Option<&pb::RaftVote>) -> tracing::Span {
    tracing::info_span!(
        "raft_receive",
        method,
        term = vote.map_or(0, |v| v.term),
        peer = tracing::field::Empty
    )
}

/// A snapshot being received: its chunks so far, in order.
#[derive(Debug)]
struct Receiving {
    vote: Vote<NodeId>,
    meta: openraft::SnapshotMeta<NodeId, Node>,
    data: Vec<u8>,
}

/// The receiving side: checks each payload, then hands it to the local Raft node.
#[derive(Clone)]
pub struct RaftTransport {
    raft: Raft,
    contact: Arc<crate::watchdog::LeaderContact>,
    ctx: Arc<crate::node::NodeCtx>,
    receiving: Arc<tokio::sync::Mutex<Option<Receiving>>>,
}

impl std::fmt::Debug for RaftTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RaftTransport")
    }
}

impl RaftTransport {
    /// Serves Raft traffic for the node of `ctx`, noting in `contact` when a leader was
    /// last heard.
    pub fn new(ctx: Arc<crate::node::NodeCtx>, contact: Arc<crate::watchdog::LeaderContact>) -> Self {
        RaftTransport {
            raft: ctx.raft.clone(),
            contact,
            ctx,
            receiving: Arc::default(),
        }
    }

    /// The caller's node id from its certificate (`None` without TLS), recorded as the
    /// `peer` of the handler's span; a caller without a node identity never gets here
    /// with TLS (the listener drops it).
    fn sender<T>(&self, method: &str, req: &tonic::Request<T>) -> Result<Option<NodeId>, tonic::Status> {
        if !self.ctx.authz.enabled() {
            return Ok(None);
        }
        let id = req.extensions().get::<PeerInfo>().and_then(|p| p.identity.clone());
        match id.as_ref().and_then(|i| i.node_id()) {
            Some(n) => {
                tracing::Span::current().record("peer", n);
                Ok(Some(n))
            }
            None => Err(self.ctx.authz.deny(
                "raft",
                method,
                "role",
                &id.map_or_else(|| "no identity".to_string(), |i| i.to_string()),
                tonic::Status::permission_denied("Raft traffic is for control-plane nodes only"),
            )),
        }
    }

    fn refuse(&self, method: &str, sender: Option<NodeId>, r: Refused) -> tonic::Status {
        let who = sender.map_or_else(|| "unauthenticated peer".to_string(), |s| format!("node {s}"));
        self.ctx
            .authz
            .deny("raft", method, r.reason, &who, tonic::Status::invalid_argument(r.why))
    }

    /// An AppendEntries carries entries this node cannot read (`what`: a newer format, a
    /// raise to a feature level it does not support): refused, never applied. If it
    /// comes from the leader this node follows, in its term (with TLS, as itself), the
    /// node is unready while that lasts: it was left behind by an upgrade, or its leader
    /// is not to be trusted. Anyone else's (a removed node, a stale leader, another
    /// group's node with a certificate of the same CA, a member not leading) is only
    /// refused.
    fn cannot_read(
        &self,
        sender: Option<NodeId>,
        vote: Option<(u64, NodeId)>,
        what: String,
        refusal: String,
    ) -> tonic::Status {
        let local = self.ctx.guard.local();
        let from = sender.or(vote.map(|v| v.1));
        if let (Some(from), Some((term, claimed))) = (from, vote) {
            let leader = claimed == from && from != self.ctx.id && local.leader == Some(from) && term == local.term;
            if leader {
                self.ctx.set_stalled(
                    from,
                    term,
                    format!("node {from}, leader in term {term}, sent {what}: upgrade this node's kvota, or remove node {from} from the group"),
                );
            }
        }
        let why = format!(
            "{refusal}; nothing of it was applied (sent by {})",
            from.map_or_else(|| "an unknown node".to_string(), |f| format!("node {f}"))
        );
        let who = sender.map_or_else(|| "unauthenticated peer".to_string(), |s| format!("node {s}"));
        self.ctx.authz.deny(
            "raft",
            "AppendEntries",
            "newer_format",
            &who,
            tonic::Status::failed_precondition(why),
        )
    }

    /// The largest feature level an entry raises the group to, if this node does not
    /// support it: what it is, and the refusal.
    fn unsupported_raise(&self, rpc: &AppendEntriesRequest<TypeConfig>) -> Option<(String, String)> {
        let supported = self.ctx.clock.own_feature_max();
        let to = rpc
            .entries
            .iter()
            .filter_map(|e| match &e.payload {
                openraft::EntryPayload::Normal(r) => r.raise_feature_level,
                _ => None,
            })
            .max()?;
        (to > supported.get()).then(|| {
            (
                format!("a raise to feature level {to} (this node supports up to {})", supported.get()),
                format!(
                    "a log entry that raises the group to feature level {to}, and this node supports up to {}: upgrade this node's kvota",
                    supported.get()
                ),
            )
        })
    }
}

fn bad_payload(e: &WireError) -> tonic::Status {
    tonic::Status::invalid_argument(format!("malformed Raft message: {e}"))
}

/// The local Raft core failed or stopped: the sender treats this node as unreachable.
fn core_failed(e: &Fatal<NodeId>) -> tonic::Status {
    tonic::Status::unavailable(format!("this node's Raft core has stopped: {e}"))
}

fn snapshot_reply(vote: &Vote<NodeId>) -> tonic::Response<pb::InstallSnapshotReply> {
    tonic::Response::new(wire::snapshot_reply_to(Ok(&InstallSnapshotResponse { vote: *vote })))
}

fn snapshot_mismatch(id: &str, expect: u64, got: u64) -> tonic::Response<pb::InstallSnapshotReply> {
    let m = openraft::error::SnapshotMismatch {
        expect: openraft::SnapshotSegmentId {
            id: id.to_string(),
            offset: expect,
        },
        got: openraft::SnapshotSegmentId {
            id: id.to_string(),
            offset: got,
        },
    };
    tonic::Response::new(wire::snapshot_reply_to(Err(&m)))
}

impl RaftTransport {
    /// One checked snapshot chunk: appended to the snapshot being received (the first
    /// chunk of a snapshot starts it; one out of order is answered with the offset
    /// expected); the last one hands the whole snapshot to openraft once it decodes.
    async fn receive_chunk(
        &self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        sender: Option<NodeId>,
    ) -> Result<tonic::Response<pb::InstallSnapshotReply>, tonic::Status> {
        let mine = self.ctx.guard.local().vote;
        // As openraft does: a chunk of an older leader is answered with this node's vote.
        if !matches!(
            rpc.vote.partial_cmp(&mine),
            Some(std::cmp::Ordering::Greater | std::cmp::Ordering::Equal)
        ) {
            return Ok(snapshot_reply(&mine));
        }
        let mut receiving = self.receiving.lock().await;
        let same = receiving
            .as_ref()
            .is_some_and(|r| r.vote == rpc.vote && r.meta == rpc.meta);
        if !same {
            if rpc.offset != 0 {
                return Ok(snapshot_mismatch(&rpc.meta.snapshot_id, 0, rpc.offset));
            }
            *receiving = Some(Receiving {
                vote: rpc.vote,
                meta: rpc.meta.clone(),
                data: Vec::new(),
            });
        }
        let Some(r) = receiving.as_mut() else {
            return Err(tonic::Status::internal("no snapshot being received"));
        };
        let have = r.data.len() as u64;
        if rpc.offset != have {
            return Ok(snapshot_mismatch(&rpc.meta.snapshot_id, have, rpc.offset));
        }
        r.data.extend_from_slice(&rpc.data);
        if !rpc.done {
            return Ok(snapshot_reply(&mine));
        }
        let Some(whole) = receiving.take() else {
            return Err(tonic::Status::internal("no snapshot being received"));
        };
        drop(receiving);
        crate::store::check_snapshot_data(&whole.meta, &whole.data, self.ctx.clock.own_feature_max()).map_err(
            |why| {
                self.refuse(
                    "InstallSnapshot",
                    sender,
                    Refused {
                        reason: "bad_snapshot",
                        why: format!("snapshot {} does not read: {why}", whole.meta.snapshot_id),
                    },
                )
            },
        )?;
        let snapshot = openraft::storage::Snapshot {
            meta: whole.meta,
            snapshot: Box::new(std::io::Cursor::new(whole.data)),
        };
        let last = snapshot.meta.last_log_id;
        match self.raft.install_full_snapshot(whole.vote, snapshot).await {
            Ok(r) => {
                if r.vote == whole.vote {
                    self.ctx.guard.committed(last);
                }
                Ok(snapshot_reply(&r.vote))
            }
            Err(f) => Err(core_failed(&f)),
        }
    }
}

impl RaftTransport {
    async fn take_append(
        &self,
        request: tonic::Request<pb::AppendEntriesRequest>,
    ) -> Result<tonic::Response<pb::AppendEntriesReply>, tonic::Status> {
        let sender = self.sender("AppendEntries", &request)?;
        let msg = request.into_inner();
        let vote = msg.vote.as_ref().map(|v| (v.term, v.node_id));
        if let Some(format) = wire::newest_entry_format(&msg).filter(|f| *f > crate::types::LOG_FORMAT) {
            let what = format!(
                "log entries of format {format} (this node reads up to {})",
                crate::types::LOG_FORMAT
            );
            return Err(self.cannot_read(sender, vote, what, crate::types::newer_entry_format(format)));
        }
        let rpc = wire::append_from(msg).map_err(|e| bad_payload(&e))?;
        if let Some((what, refusal)) = self.unsupported_raise(&rpc) {
            return Err(self.cannot_read(sender, vote, what, refusal));
        }
        let local = self.ctx.guard.local();
        guard::check_append(&rpc, sender, &local, &self.ctx.guard)
            .map_err(|r| self.refuse("AppendEntries", sender, r))?;
        if let Some(leader) = rpc.vote.leader_id().voted_for() {
            self.contact.heard(leader);
        }
        let mut rpc = rpc;
        rpc.leader_commit = guard::check_leader_commit(&rpc).map_err(|r| self.refuse("AppendEntries", sender, r))?;
        let last = rpc.entries.last().map(|e| e.log_id).or(rpc.prev_log_id);
        let committing = std::cmp::min(rpc.leader_commit, last);
        let carries_entries = !rpc.entries.is_empty();
        match self.raft.append_entries(rpc).await {
            Ok(r) => {
                if matches!(r, AppendEntriesResponse::Success) {
                    // openraft commits at least this much for it, right after answering.
                    self.ctx.guard.committed(committing);
                    if carries_entries {
                        // Entries it reads: whatever it could not read before is behind it.
                        self.ctx.clear_stalled();
                    }
                }
                Ok(tonic::Response::new(wire::append_reply_to(&r)))
            }
            Err(RaftError::Fatal(f)) => Err(core_failed(&f)),
            Err(RaftError::APIError(e)) => match e {},
        }
    }

    async fn take_vote(
        &self,
        request: tonic::Request<pb::VoteRequest>,
    ) -> Result<tonic::Response<pb::VoteReply>, tonic::Status> {
        let sender = self.sender("Vote", &request)?;
        let rpc = wire::vote_request_from(request.into_inner()).map_err(|e| bad_payload(&e))?;
        guard::check_vote(&rpc, sender, &self.ctx.guard.local(), &self.ctx.guard)
            .map_err(|r| self.refuse("Vote", sender, r))?;
        match self.raft.vote(rpc).await {
            Ok(r) => Ok(tonic::Response::new(wire::vote_reply_to(&r))),
            Err(RaftError::Fatal(f)) => Err(core_failed(&f)),
            Err(RaftError::APIError(e)) => match e {},
        }
    }

    async fn take_snapshot(
        &self,
        request: tonic::Request<pb::InstallSnapshotRequest>,
    ) -> Result<tonic::Response<pb::InstallSnapshotReply>, tonic::Status> {
        let sender = self.sender("InstallSnapshot", &request)?;
        let rpc = wire::snapshot_from(request.into_inner()).map_err(|e| bad_payload(&e))?;
        guard::check_snapshot(&rpc.vote, &rpc.meta, sender, &self.ctx.guard.local(), &self.ctx.guard)
            .map_err(|r| self.refuse("InstallSnapshot", sender, r))?;
        let end = rpc.offset.checked_add(rpc.data.len() as u64);
        if end.is_none_or(|e| e > MAX_SNAPSHOT_BYTES) {
            let why = format!(
                "snapshot chunk at offset {} of {} bytes ends past the largest snapshot accepted ({MAX_SNAPSHOT_BYTES} bytes)",
                rpc.offset,
                rpc.data.len()
            );
            return Err(self.refuse("InstallSnapshot", sender, guard::out_of_range(why)));
        }
        self.receive_chunk(rpc, sender).await
    }
}

/// Each handler runs in a `raft_receive` span: the method, the term of the vote the
/// request carries, and the sending peer (filled in once its certificate is read).
#[tonic::async_trait]
impl RaftService for RaftTransport {
    async fn append_entries(
        &self,
        request: tonic::Request<pb::AppendEntriesRequest>,
    ) -> Result<tonic::Response<pb::AppendEntriesReply>, tonic::Status> {
        let span = receive_span("AppendEntries", request.get_ref().vote.as_ref());
        self.take_append(request).instrument(span).await
    }

    async fn vote(
        &self,
        request: tonic::Request<pb::VoteRequest>,
    ) -> Result<tonic::Response<pb::VoteReply>, tonic::Status> {
        let span = receive_span("Vote", request.get_ref().vote.as_ref());
        self.take_vote(request).instrument(span).await
    }

    async fn install_snapshot(
        &self,
        request: tonic::Request<pb::InstallSnapshotRequest>,
    ) -> Result<tonic::Response<pb::InstallSnapshotReply>, tonic::Status> {
        let span = receive_span("InstallSnapshot", request.get_ref().vote.as_ref());
        self.take_snapshot(request).instrument(span).await
    }

    async fn clock(&self, request: tonic::Request<Empty>) -> Result<tonic::Response<ClockReply>, tonic::Status> {
        self.sender("Clock", &request)?;
        Ok(tonic::Response::new(ClockReply {
            wall_ms: self.ctx.clock.wall_ms(),
            feature_level_max: self.ctx.clock.own_feature_max().get(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn peer_at(addr: &str) -> PeerClient {
        let (_, durable) = tokio::sync::watch::channel(Durable::default());
        let mut net = Network {
            tls: None,
            durable,
            held_back: Arc::default(),
            guard: Arc::new(Guard::default()),
            metrics: Metrics::default(),
            acked: Acked::default(),
        };
        let node = Node {
            rpc_addr: addr.to_string(),
            http_addr: String::new(),
            raft_addr: addr.to_string(),
        };
        net.new_client(2, &node).await
    }

    fn heartbeat() -> AppendEntriesRequest<TypeConfig> {
        AppendEntriesRequest {
            vote: Vote::new_committed(1, 1),
            prev_log_id: None,
            leader_commit: None,
            entries: Vec::new(),
        }
    }

    /// A peer that accepts but does not answer within the deadline is a `Timeout`
    /// (openraft retries at once), not `Unreachable` (openraft would leave it alone for
    /// 500 ms, longer than its election timeout, and it would call an election); a
    /// refused connection is `Unreachable`.
    #[tokio::test]
    async fn a_late_answer_is_a_timeout_and_a_refused_connection_unreachable() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let silent = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let mut peer = peer_at(&addr).await;
        let err = peer
            .append_entries(heartbeat(), RPCOption::new(Duration::from_millis(50)))
            .await
            .expect_err("nobody answers");
        assert!(matches!(err, RPCError::Timeout(_)), "{err:?}");
        silent.abort();

        let closed = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = closed.local_addr().expect("addr").to_string();
        drop(closed);
        let mut peer = peer_at(&addr).await;
        let err = peer
            .append_entries(heartbeat(), RPCOption::new(Duration::from_millis(300)))
            .await
            .expect_err("nothing listens");
        assert!(matches!(err, RPCError::Unreachable(_)), "{err:?}");
    }

    #[test]
    fn the_append_window_halves_on_a_timeout_and_widens_on_quick_answers() {
        let deadline = Duration::from_millis(50);
        let mut w = AppendWindow::default();
        assert_eq!(w.bytes(), MAX_APPEND_BYTES);
        w.timed_out();
        assert_eq!(w.bytes(), MAX_APPEND_BYTES / 2);
        w.answered(deadline, deadline);
        assert_eq!(
            w.bytes(),
            MAX_APPEND_BYTES / 4,
            "an answer at the deadline counts as late"
        );
        w.answered(Duration::from_millis(30), deadline);
        assert_eq!(w.bytes(), MAX_APPEND_BYTES / 4, "a slowish answer keeps the window");
        w.answered(Duration::from_millis(5), deadline);
        assert_eq!(w.bytes(), MAX_APPEND_BYTES / 4 + MAX_APPEND_BYTES / 16);
        for _ in 0..20 {
            w.timed_out();
        }
        assert_eq!(w.bytes(), MIN_APPEND_BYTES, "never below the floor");
        for _ in 0..40 {
            w.answered(Duration::from_millis(1), deadline);
        }
        assert_eq!(w.bytes(), MAX_APPEND_BYTES, "never above the ceiling");
    }
}
