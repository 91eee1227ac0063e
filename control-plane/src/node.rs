//! One control-plane node: its Raft handle, its view of the replicated state, and the
//! write path that any gRPC handler uses (propose here if leader, else forward).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvota_fairness::federation::{Applied, Command, CommandError};
use openraft::error::{ClientWriteError, RaftError};
use openraft::ServerState;
use tokio::sync::{mpsc, oneshot, Mutex, RwLock, Semaphore};
use tonic::transport::Channel;

use crate::metrics::Metrics;
use tracing::Instrument as _;

use crate::store::StateMachineData;
use crate::types::{Node as NodeAddr, NodeId, Raft};

pub use kvota_proto::{FORWARDED_HEADER, LEADER_HEADER};

/// How long a write may wait for commit before the caller gets `UNAVAILABLE`: a few
/// election timeouts, so a write survives one failover but never hangs.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Writes waiting for the batcher. Past this the node answers `RESOURCE_EXHAUSTED`
/// instead of queueing without bound: 4,096 is seconds of reports from a thousand
/// clusters, far more than one leader commits between two batches.
pub const WRITE_QUEUE: usize = 4_096;
/// Batches proposed and not yet committed at once. More lets the leader pipeline
/// appends; 4 keeps a burst from piling up behind a slow disk.
pub const BATCHES_IN_FLIGHT: usize = 4;
/// Weight budget of one batch (a command weighs 1 + the tenants it carries): five
/// 1,000-tenant reports, about 150 KiB as a log entry, so that
/// [`crate::server::MAX_ENTRIES_PER_APPEND`] entries make an AppendEntries a follower can
/// take within a heartbeat interval (a command heavier than the budget is a batch of its
/// own). Small reports still batch by the thousand.
pub const BATCH_WEIGHT: usize = 5_000;

/// One write waiting to be batched.
struct Pending {
    command: Command,
    /// Who asked (for the audit log), when known.
    actor: Option<String>,
    reply: oneshot::Sender<Result<Proposed, tonic::Status>>,
    /// The proposer's span (a gRPC call's), which the batch's span follows from.
    span: tracing::Span,
}

fn weight(c: &Command) -> usize {
    match c {
        Command::Report(r) => 1 + r.tenants.len(),
        Command::ApplyPolicy(p) => 1 + p.tenants.len(),
        _ => 1,
    }
}

/// The node shared by all handlers.
pub struct NodeCtx {
    /// This node's id.
    pub id: NodeId,
    /// Raft.
    pub raft: Raft,
    /// The applied state (read locally; a follower may lag by what is in flight).
    pub state: Arc<RwLock<StateMachineData>>,
    /// Metrics registry and handles.
    pub metrics: Metrics,
    /// Who may call what (identities from certificates, when TLS is on).
    pub authz: crate::auth::Authz,
    /// This node's wall clock and its readings of the voters' clocks.
    pub clock: Arc<crate::clock::TimeKeeper>,
    channels: Mutex<HashMap<String, Channel>>,
    writes: mpsc::Sender<Pending>,
    tls: Option<kvota_client::tls::GrpcTls>,
    /// Set once, the first time this process has applied its log (see [`readiness`]).
    caught_up: std::sync::atomic::AtomicBool,
    /// Why the node cannot serve any more (its Raft core stopped); set once.
    fatal: std::sync::OnceLock<String>,
    /// The data directory's file system is below its free-space reserve.
    disk_low: std::sync::atomic::AtomicBool,
    /// Samples of the federation for the dashboard's charts (see [`crate::view`]).
    pub history: std::sync::Mutex<crate::view::History>,
    /// What the Raft port and the clients to the peers check messages against.
    pub guard: Arc<crate::guard::Guard>,
    /// Why the node cannot follow its group for now (its leader, in a term, sent
    /// entries it cannot read); cleared when it is sent entries it reads, or follows
    /// another leader or term.
    stalled: std::sync::Mutex<Option<(NodeId, u64, String)>>,
}

/// How far the applied index may trail the last log index for a starting node to count
/// as caught up: a few batches in flight, not a replay.
pub const CATCH_UP_SLACK: u64 = 64;

/// What a node's Raft metrics say about serving. `caught_up` is whether this process
/// has applied its log since it started; it is `Some(true)` once that happened, whatever
/// the lag later (so readiness does not flap under load).
///
/// Ready: a leader that heard from a quorum within 3 s and has applied its log, or a
/// follower or learner that knows a leader and has caught up. A node restarted with a
/// long log replays it after the snapshot (up to `snapshot_every` entries, seconds on a
/// slow machine); reporting it ready before that would let a rolling restart take down
/// the next node while this one cannot yet serve, and if it then became leader every
/// write would wait for the replay. (A follower's own log cannot show what it has not
/// received yet, e.g. after its volume was wiped: [`NodeCtx::ready_checked`] compares
/// it with the leader's before the first time it counts as caught up.)
pub fn readiness(
    state: ServerState,
    leader: Option<NodeId>,
    millis_since_quorum_ack: Option<u64>,
    last_log_index: Option<u64>,
    last_applied_index: Option<u64>,
    caught_up: bool,
) -> Result<(), String> {
    let (log, applied) = (last_log_index.unwrap_or(0), last_applied_index.unwrap_or(0));
    let replayed = caught_up || log.saturating_sub(applied) <= CATCH_UP_SLACK;
    match (state, leader) {
        (ServerState::Leader, _) => match millis_since_quorum_ack {
            Some(ms) if ms < 3_000 && replayed => Ok(()),
            Some(ms) if ms < 3_000 => Err(format!(
                "leader still applying its log: applied {applied} of {log} log entries"
            )),
            Some(ms) => Err(format!("leader without a quorum ack for {ms} ms")),
            None => Err("leader that has not yet heard from a quorum".to_string()),
        },
        (_, Some(_)) if replayed => Ok(()),
        (_, Some(_)) => Err(format!("catching up: applied {applied} of {log} log entries")),
        (state, None) => Err(format!("{state:?} with no known leader")),
    }
}

/// Whether a follower that has applied through `mine` has caught up with a leader that
/// has applied through `leaders` (within [`CATCH_UP_SLACK`]).
pub fn caught_up_with_leader(mine: u64, leaders: u64) -> Result<(), String> {
    if mine.saturating_add(CATCH_UP_SLACK) >= leaders {
        Ok(())
    } else {
        Err(format!("catching up: applied {mine} log entries, the leader {leaders}"))
    }
}

/// How long a readiness probe waits for the leader's answer (probes time out in 1 s).
pub const READY_PROBE_LEADER_TIMEOUT: Duration = Duration::from_millis(300);

impl std::fmt::Debug for NodeCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCtx").field("id", &self.id).finish_non_exhaustive()
    }
}

/// Outcome of a write attempted on this node.
#[derive(Debug)]
pub enum Proposed {
    /// Committed and applied; the state machine's answer.
    Done(Result<Applied, CommandError>),
    /// This node is not the leader; the leader is at this gRPC address.
    Forward(String),
}

impl NodeCtx {
    /// A node context; starts its write batcher (must be called inside a Tokio runtime).
    /// `tls`: the node's certificate; with it every caller is authorized by identity.
    pub fn new(
        id: NodeId,
        raft: Raft,
        state: Arc<RwLock<StateMachineData>>,
        metrics: Metrics,
        tls: Option<kvota_client::tls::GrpcTls>,
        clock: Arc<crate::clock::TimeKeeper>,
        guard: Arc<crate::guard::Guard>,
    ) -> Self {
        let (writes, queue) = mpsc::channel(WRITE_QUEUE);
        tokio::spawn(batcher(raft.clone(), clock.clone(), state.clone(), queue));
        NodeCtx {
            id,
            raft,
            state,
            authz: crate::auth::Authz::new(tls.is_some(), metrics.clone()),
            metrics,
            clock,
            channels: Mutex::new(HashMap::new()),
            writes,
            tls,
            caught_up: std::sync::atomic::AtomicBool::new(false),
            fatal: std::sync::OnceLock::new(),
            disk_low: std::sync::atomic::AtomicBool::new(false),
            history: std::sync::Mutex::new(crate::view::History::default()),
            guard,
            stalled: std::sync::Mutex::new(None),
        }
    }

    /// This node's TLS (its node certificate), if the group uses TLS.
    pub fn tls(&self) -> Option<&kvota_client::tls::GrpcTls> {
        self.tls.as_ref()
    }

    /// Marks the node broken for good (its Raft core stopped): it is neither healthy nor
    /// ready from now on, and its process exits.
    pub fn set_fatal(&self, why: String) {
        if self.fatal.set(why.clone()).is_ok() {
            self.metrics.set_fatal();
            tracing::error!(reason = %why, "the Raft core has stopped: this node cannot serve; exiting so that its supervisor restarts it");
        }
    }

    /// Why the node is broken for good, if it is.
    pub fn fatal(&self) -> Option<&str> {
        self.fatal.get().map(String::as_str)
    }

    /// The node cannot follow its group for now, and why (logged once per change): its
    /// leader `from`, in `term`, sent entries it cannot read. It stays up, refuses what it
    /// cannot read, and is not ready while it follows that leader in that term.
    pub fn set_stalled(&self, from: NodeId, term: u64, why: String) {
        let mut s = self.stalled.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if s.as_ref().map(|(_, _, w)| w.as_str()) != Some(why.as_str()) {
            tracing::error!(reason = %why, "this node cannot follow its group: it refuses what it cannot read and is not ready");
            self.metrics.set_stalled(true);
            *s = Some((from, term, why));
        }
    }

    /// The node follows its group again.
    pub fn clear_stalled(&self) {
        let mut s = self.stalled.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if s.take().is_some() {
            self.metrics.set_stalled(false);
            tracing::info!("this node follows its group again");
        }
    }

    /// Why the node cannot follow its group for now, if it cannot: only while it still
    /// follows the leader, in the term, that sent what it cannot read.
    pub fn stalled(&self) -> Option<String> {
        let (from, term, why) = self
            .stalled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()?;
        let m = self.raft.metrics().borrow().clone();
        if m.current_leader == Some(from) && m.current_term == term {
            return Some(why);
        }
        self.clear_stalled();
        None
    }

    /// Records whether the data directory's file system is below its reserve.
    pub fn set_disk_low(&self, low: bool) {
        self.disk_low.store(low, std::sync::atomic::Ordering::Relaxed);
    }

    /// The voters of the membership in force.
    pub fn voters(&self) -> BTreeSet<NodeId> {
        self.raft
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .voter_ids()
            .collect()
    }

    /// Proposes `command` if this node leads; otherwise says where the leader is.
    /// Commands queued together are committed as one log entry (group commit).
    pub async fn propose(&self, command: Command) -> Result<Proposed, tonic::Status> {
        self.propose_as(command, None).await
    }

    /// [`NodeCtx::propose`] on behalf of `actor` (`role/name`), whom the audit records
    /// the command makes will name (from feature level 2).
    pub async fn propose_as(&self, command: Command, actor: Option<String>) -> Result<Proposed, tonic::Status> {
        let started = Instant::now();
        let (reply, answer) = oneshot::channel();
        self.writes
            .try_send(Pending {
                command,
                actor,
                reply,
                span: tracing::Span::current(),
            })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => tonic::Status::resource_exhausted(
                    "the control plane has too many writes queued; retry with backoff",
                ),
                mpsc::error::TrySendError::Closed(_) => tonic::Status::unavailable("this node is shutting down"),
            })?;
        let result = match tokio::time::timeout(WRITE_TIMEOUT, answer).await {
            Err(_) => Err(tonic::Status::unavailable(
                "the write was not committed in time; the control plane may have lost its quorum",
            )),
            Ok(Err(_)) => Err(tonic::Status::unavailable("this node is shutting down")),
            Ok(Ok(r)) => r,
        };
        if matches!(result, Ok(Proposed::Done(_))) {
            self.metrics.observe_apply(started.elapsed());
        }
        result
    }

    /// A channel to another node's gRPC address (cached).
    pub async fn channel(&self, addr: &str) -> Result<Channel, tonic::Status> {
        let mut map = self.channels.lock().await;
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let c = kvota_client::tls::channel(
            addr,
            self.tls.as_ref(),
            kvota_tls::Expect::AnyNode,
            Duration::from_millis(500),
            WRITE_TIMEOUT,
        )
        .map_err(|e| tonic::Status::internal(format!("leader address: {e}")))?;
        map.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Forgets a cached channel (after it failed).
    pub async fn drop_channel(&self, addr: &str) {
        self.channels.lock().await.remove(addr);
    }

    /// Current leader id and address, if known.
    pub fn leader(&self) -> Option<(NodeId, NodeAddr)> {
        let m = self.raft.metrics().borrow().clone();
        let id = m.current_leader?;
        let node = m.membership_config.membership().get_node(&id).cloned()?;
        Some((id, node))
    }

    /// Ready as far as this node's own metrics tell (see [`readiness`]); a leader that
    /// has applied its log counts as caught up from then on.
    pub fn ready(&self) -> Result<(), String> {
        use std::sync::atomic::Ordering;
        if let Some(why) = self.fatal() {
            return Err(format!("broken: {why}"));
        }
        if self.disk_low.load(Ordering::Relaxed) {
            return Err("the data directory's file system is below its free-space reserve".to_string());
        }
        if let Some(why) = self.stalled() {
            return Err(why);
        }
        if let Some(tls) = &self.tls {
            tls.source().check_served().map_err(|why| {
                format!("this node's certificate cannot complete a handshake with the federation's CA: {why}")
            })?;
        }
        let m = self.raft.metrics().borrow().clone();
        let caught_up = self.caught_up.load(Ordering::Relaxed);
        let r = readiness(
            m.state,
            m.current_leader,
            m.millis_since_quorum_ack,
            m.last_log_index,
            m.last_applied.map(|l| l.index),
            caught_up,
        );
        // A leader's log holds everything committed: applied it, it has caught up. A
        // follower's may lack what it has not received yet; `ready_checked` asks.
        if r.is_ok() && !caught_up && m.state == ServerState::Leader {
            self.caught_up.store(true, Ordering::Relaxed);
        }
        r
    }

    /// Ready, for `/readyz`: [`NodeCtx::ready`], and a follower or learner that has not
    /// yet caught up since its process started compares how far it has applied with the
    /// leader (one `Status` call, at most [`READY_PROBE_LEADER_TIMEOUT`]); from then on
    /// it stays caught up, so lag under load does not make it flap.
    pub async fn ready_checked(&self) -> Result<(), String> {
        use std::sync::atomic::Ordering;
        self.ready()?;
        self.no_raise_pending().await?;
        if self.caught_up.load(Ordering::Relaxed) {
            return Ok(());
        }
        let (id, node) = self.leader().ok_or_else(|| "no known leader".to_string())?;
        if id == self.id {
            return Ok(());
        }
        let ask = async {
            let ch = self.channel(&node.rpc_addr).await?;
            Ok::<_, tonic::Status>(
                kvota_proto::v1::admin_client::AdminClient::new(ch)
                    .status(kvota_proto::v1::Empty {})
                    .await?
                    .into_inner(),
            )
        };
        let leaders = match tokio::time::timeout(READY_PROBE_LEADER_TIMEOUT, ask).await {
            Ok(Ok(st)) => st.last_applied_index,
            Ok(Err(e)) => {
                return Err(format!(
                    "cannot compare logs with the leader (node {id} at {}): {}",
                    node.rpc_addr,
                    e.message()
                ))
            }
            Err(_) => {
                return Err(format!(
                    "cannot compare logs with the leader (node {id} at {}): no answer in time",
                    node.rpc_addr
                ))
            }
        };
        let mine = self.raft.metrics().borrow().last_applied.map_or(0, |l| l.index);
        caught_up_with_leader(mine, leaders)?;
        self.caught_up.store(true, Ordering::Relaxed);
        Ok(())
    }
}

impl NodeCtx {
    /// A leader is not ready while every member supports a newer feature level than the
    /// group runs at: the raise rides on its next entry (a tick within a fraction of a
    /// second), and until then a policy that needs the newer level would be refused. So
    /// `kvota server --init` reports ready only with the group at the newest level its
    /// members share. A member that has not answered a clock reading lately leaves the
    /// level unknown: no raise is due then, and that does not hold readiness back.
    async fn no_raise_pending(&self) -> Result<(), String> {
        let m = self.raft.metrics().borrow().clone();
        if m.state != ServerState::Leader {
            return Ok(());
        }
        let members: BTreeSet<NodeId> = m.membership_config.membership().nodes().map(|(id, _)| *id).collect();
        let level = self.state.read().await.feature_level;
        match self.clock.voters_support(&members) {
            Some(support) if support > level => Err(format!(
                "raising the feature level from {level} to {support} (every member supports it)"
            )),
            _ => Ok(()),
        }
    }
}

/// How fresh a read served by this node is (see [`NodeCtx::read_barrier`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReadFreshness {
    /// The state read has applied everything the leader had applied when the read began
    /// (on the leader: everything committed, with its leadership confirmed by a quorum).
    pub follows_leader: bool,
    /// The index of the last log entry applied to the state read.
    pub applied_index: u64,
    /// Why the read may be stale, when it may.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// How long a read waits to catch up with the leader before it serves what this node has.
pub const READ_BARRIER_TIMEOUT: Duration = Duration::from_secs(2);

impl NodeCtx {
    /// Makes a read follow the leader, in the manner of Raft's read index: the leader
    /// confirms its leadership with a quorum and waits until it has applied everything
    /// committed; a follower asks the leader how far it has applied and waits until it
    /// has applied as far. Within [`READ_BARRIER_TIMEOUT`]; if that fails (no leader,
    /// a partition, a slow follower), the read goes on with this node's own state and
    /// the answer says why it may be stale, rather than failing a dashboard or a probe.
    pub async fn read_barrier(&self) -> ReadFreshness {
        let outcome = tokio::time::timeout(READ_BARRIER_TIMEOUT, self.catch_up_with_leader()).await;
        let applied_index = self.raft.metrics().borrow().last_applied.map_or(0, |l| l.index);
        let note = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(why)) => Some(why),
            Err(_) => Some(format!(
                "could not catch up with the leader within {} s",
                READ_BARRIER_TIMEOUT.as_secs()
            )),
        };
        ReadFreshness {
            follows_leader: note.is_none(),
            applied_index,
            note,
        }
    }

    async fn catch_up_with_leader(&self) -> Result<(), String> {
        let (id, node) = self.leader().ok_or_else(|| "this node knows no leader".to_string())?;
        if id == self.id {
            return self
                .raft
                .ensure_linearizable()
                .await
                .map(|_| ())
                .map_err(|e| format!("leadership not confirmed by a quorum: {e}"));
        }
        let ch = self
            .channel(&node.rpc_addr)
            .await
            .map_err(|e| e.message().to_string())?;
        let leaders = kvota_proto::v1::admin_client::AdminClient::new(ch)
            .status(kvota_proto::v1::Empty {})
            .await
            .map_err(|e| {
                format!(
                    "the leader (node {id} at {}) did not answer: {}",
                    node.rpc_addr,
                    e.message()
                )
            })?
            .into_inner()
            .last_applied_index;
        self.raft
            .wait(Some(READ_BARRIER_TIMEOUT))
            .applied_index_at_least(Some(leaders), "read barrier")
            .await
            .map(|_| ())
            .map_err(|e| format!("applying the leader's log up to {leaders}: {e}"))
    }
}

/// Group commit: takes every write queued so far (up to [`BATCH_WEIGHT`]), proposes them
/// as one entry, and hands each caller its own answer; up to [`BATCHES_IN_FLIGHT`]
/// entries are in flight at once, and whatever queues meanwhile forms the next batch.
async fn batcher(
    raft: Raft,
    clock: Arc<crate::clock::TimeKeeper>,
    state: Arc<RwLock<StateMachineData>>,
    mut queue: mpsc::Receiver<Pending>,
) {
    let in_flight = Arc::new(Semaphore::new(BATCHES_IN_FLIGHT));
    while let Some(first) = queue.recv().await {
        let Ok(permit) = in_flight.clone().acquire_owned().await else {
            return;
        };
        // Take what queued while we waited for the permit: the fuller the pipe, the
        // bigger the batch.
        let mut w = weight(&first.command);
        let mut batch = vec![first];
        while w < BATCH_WEIGHT {
            match queue.try_recv() {
                Ok(p) => {
                    w += weight(&p.command);
                    batch.push(p);
                }
                Err(_) => break,
            }
        }
        let (raft, clock, state) = (raft.clone(), clock.clone(), state.clone());
        let span = tracing::info_span!("commit", commands = batch.len());
        for p in &batch {
            span.follows_from(&p.span);
        }
        tokio::spawn(async move {
            let mut actors = BTreeMap::new();
            let mut commands = Vec::with_capacity(batch.len());
            let mut replies = Vec::with_capacity(batch.len());
            for (i, p) in batch.into_iter().enumerate() {
                if let (Some(a), Ok(i)) = (p.actor, u32::try_from(i)) {
                    actors.insert(i, a);
                }
                commands.push(p.command);
                replies.push(p.reply);
            }
            let n = commands.len();
            let voters: BTreeSet<NodeId> = raft.metrics().borrow().membership_config.membership().voter_ids().collect();
            let Some(now_ms) = stamp(&clock, &voters, &state, CLOCK_WAIT).await else {
                drop(permit);
                let why = "the federation has no time yet: a majority of the voters has not answered a clock reading (see the Raft port); retry shortly";
                for reply in replies {
                    let _ = reply.send(Err(tonic::Status::unavailable(why)));
                }
                return;
            };
            let level = state.read().await.feature_level;
            // Every member (voters and learners) supports a newer feature level than the
            // group runs at: this entry raises it (entries in flight may carry the same
            // raise; applying it again changes nothing).
            let members: BTreeSet<NodeId> = raft.metrics().borrow().membership_config.membership().nodes().map(|(id, _)| *id).collect();
            let support = clock.voters_support(&members);
            let req = crate::entry::prepare(level, now_ms, commands, actors, support);
            if let Some(to) = req.raise_feature_level {
                tracing::info!(from = level.get(), to, "every voter supports a newer feature level; raising it");
            }
            let outcome = raft.client_write(req).await;
            drop(permit);
            match outcome {
                Ok(resp) => match resp.data.0 {
                    Some(results) if results.len() == n => {
                        for (reply, r) in replies.into_iter().zip(results) {
                            let _ = reply.send(Ok(Proposed::Done(r)));
                        }
                    }
                    other => {
                        let why = format!("state machine gave {other:?} for {n} commands");
                        for reply in replies {
                            let _ = reply.send(Err(tonic::Status::internal(why.clone())));
                        }
                    }
                },
                Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                    for reply in replies {
                        let _ = reply.send(match &f.leader_node {
                            Some(node) => Ok(Proposed::Forward(node.rpc_addr.clone())),
                            None => Err(no_leader()),
                        });
                    }
                }
                Err(e) => {
                    let why = format!("Raft cannot take writes: {e}");
                    for reply in replies {
                        let _ = reply.send(Err(tonic::Status::unavailable(why.clone())));
                    }
                }
            }
        }.instrument(span));
    }
}

/// How long a write waits for a majority's clock readings before it is stamped without
/// one (the tick reads the voters' clocks every second, so a new leader has them within
/// about a second).
pub const CLOCK_WAIT: Duration = Duration::from_secs(3);

/// The stamp for a batch: the voters' median clock, waiting up to `wait` for it.
/// Without one, 0 (time stands still), unless the federation has never had a time
/// (its applied clock is 0): a command applied at time 0 would record usage and lease expiries at
/// 1970, and the first real stamp would then decay that usage to nothing and end those
/// leases at once. Such a write is refused (`None`) instead.
async fn stamp(
    clock: &crate::clock::TimeKeeper,
    voters: &BTreeSet<NodeId>,
    state: &RwLock<StateMachineData>,
    wait: Duration,
) -> Option<u64> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if let Some(t) = clock.quorum_now(voters) {
            return Some(t);
        }
        if tokio::time::Instant::now() >= deadline {
            let timeless = state.read().await.federation.now_ms() == 0;
            return if timeless { None } else { Some(0) };
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The status every caller gets when no leader is known.
pub fn no_leader() -> tonic::Status {
    tonic::Status::unavailable(
        "no control-plane leader is known right now (election in progress or no quorum); retry shortly",
    )
}

/// The metadata key of a sequence gap's expected number, for agents that do not read
/// it from the reply (`ReportRequest.gap_in_reply` unset).
pub const EXPECTED_SEQ_KEY: &str = "kvota-expected-seq";

/// A sequence gap as the error older agents read: `FAILED_PRECONDITION` with the
/// expected number in [`EXPECTED_SEQ_KEY`].
pub fn sequence_gap(expected: u64, message: String) -> tonic::Status {
    let mut s = tonic::Status::failed_precondition(message);
    if let Ok(v) = expected.to_string().parse() {
        s.metadata_mut().insert(EXPECTED_SEQ_KEY, v);
    }
    s
}

/// The expected number of a sequence gap in the error form ([`sequence_gap`]).
pub fn gap_of(s: &tonic::Status) -> Option<u64> {
    if s.code() != tonic::Code::FailedPrecondition {
        return None;
    }
    s.metadata().get(EXPECTED_SEQ_KEY)?.to_str().ok()?.parse().ok()
}

/// Turns a state-machine refusal into a gRPC status.
pub fn refusal(e: CommandError) -> tonic::Status {
    match &e {
        CommandError::NoPolicy => tonic::Status::failed_precondition(e.to_string()),
        CommandError::UnknownCluster(_) => tonic::Status::not_found(e.to_string()),
        CommandError::SequenceGap { expected, .. } => sequence_gap(*expected, e.to_string()),
        CommandError::UnknownEpoch { .. } | CommandError::Invalid { .. } => {
            tonic::Status::invalid_argument(e.to_string())
        }
        CommandError::LeaseInForce { .. } => tonic::Status::failed_precondition(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A federation that has never had a time refuses a write it cannot stamp (usage at
    /// 1970 would decay to nothing at the first real stamp); one that has a time stamps
    /// 0 (standstill); with a majority's readings the stamp is their median, and a
    /// reading that arrives while the write waits is used.
    #[tokio::test]
    async fn a_write_without_a_majoritys_clock_waits_then_stands_still_or_is_refused() {
        let voters: BTreeSet<NodeId> = [1, 2, 3].into();
        let keeper = Arc::new(crate::clock::TimeKeeper::new(1, Arc::new(|| 5_000_000)));
        let state = RwLock::new(StateMachineData::default());
        let short = Duration::from_millis(100);
        assert_eq!(
            stamp(&keeper, &voters, &state, short).await,
            None,
            "no time yet: refused"
        );
        state
            .write()
            .await
            .federation
            .apply(4_000_000, Command::Tick)
            .expect("tick");
        assert_eq!(
            stamp(&keeper, &voters, &state, short).await,
            Some(0),
            "a time exists: standstill"
        );
        let late = keeper.clone();
        let reader = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            late.record(2, 5_000_000, Duration::ZERO);
        });
        let t = stamp(&keeper, &voters, &state, Duration::from_secs(5))
            .await
            .expect("a majority");
        assert!((5_000_000..5_001_000).contains(&t), "{t}");
        reader.await.expect("reader");
    }

    #[test]
    fn a_follower_replaying_its_log_is_not_ready_until_it_catches_up_then_stays_ready() {
        let f = ServerState::Follower;
        // Restarted: knows the leader, 9,000 entries still to apply.
        let err = readiness(f, Some(1), None, Some(10_000), Some(1_000), false)
            .err()
            .unwrap_or_default();
        assert!(err.contains("catching up: applied 1000 of 10000"), "{err}");
        // Within the slack: ready.
        assert_eq!(
            readiness(f, Some(1), None, Some(10_000), Some(10_000 - CATCH_UP_SLACK), false),
            Ok(())
        );
        // Once caught up, a lag under load does not make it flap.
        assert_eq!(readiness(f, Some(1), None, Some(10_000), Some(1_000), true), Ok(()));
        // No leader: never ready, caught up or not.
        assert!(readiness(f, None, None, Some(5), Some(5), true).is_err());
        // An empty log (a new node) is caught up.
        assert_eq!(
            readiness(ServerState::Learner, Some(1), None, None, None, false),
            Ok(())
        );
    }

    #[test]
    fn a_follower_is_caught_up_only_within_the_slack_of_the_leaders_applied_log() {
        // A wiped follower: its own log is empty (nothing to replay), the leader has
        // applied 5,000 entries: not caught up until the snapshot and entries arrive.
        let err = caught_up_with_leader(0, 5_000).err().unwrap_or_default();
        assert!(err.contains("applied 0 log entries, the leader 5000"), "{err}");
        assert_eq!(caught_up_with_leader(5_000 - CATCH_UP_SLACK, 5_000), Ok(()));
        assert!(caught_up_with_leader(5_000 - CATCH_UP_SLACK - 1, 5_000).is_err());
        // Ahead of the leader's answer (it was read a moment ago): caught up.
        assert_eq!(caught_up_with_leader(5_010, 5_000), Ok(()));
    }

    #[test]
    fn a_leader_is_ready_only_with_a_recent_quorum_and_its_log_applied() {
        let l = ServerState::Leader;
        // Elected while still applying its log: writes would wait for the replay.
        let err = readiness(l, Some(1), Some(100), Some(10_000), Some(1_000), false)
            .err()
            .unwrap_or_default();
        assert!(
            err.contains("leader still applying its log: applied 1000 of 10000"),
            "{err}"
        );
        assert_eq!(
            readiness(l, Some(1), Some(100), Some(10_000), Some(1_000), true),
            Ok(())
        );
        assert_eq!(readiness(l, Some(1), Some(100), Some(9), Some(9), true), Ok(()));
        let err = readiness(l, Some(1), Some(3_000), Some(9), Some(9), true)
            .err()
            .unwrap_or_default();
        assert!(err.contains("3000 ms"), "{err}");
        assert!(readiness(l, Some(1), None, Some(9), Some(9), true).is_err());
    }
}
