//! Starting and stopping one control-plane node.
//!
//! [`start`] takes already-bound listeners ("servers accept an incoming stream"), so
//! tests bind port 0 and the binary binds what the operator asked for.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use kvota_fairness::federation::Command;
use kvota_proto::v1::{admin_server::AdminServer, member_server::MemberServer, raft_server::RaftServer};
use openraft::{Config, SnapshotPolicy};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::metrics::Metrics;
use crate::network::{Network, RaftTransport, MAX_RAFT_MESSAGE_BYTES};
use crate::node::{NodeCtx, Proposed};
use crate::service::{AdminSvc, MemberSvc};
use crate::types::{Node, NodeId, Raft};

/// Largest member/admin message accepted: 4 MiB (a report for 10,000 tenants is about
/// 400 KB). Larger ones are refused with `RESOURCE_EXHAUSTED` before decoding.
pub const MAX_API_MESSAGE_BYTES: usize = 4 << 20;
/// Concurrent requests per connection: bounds the work one client can queue.
pub const MAX_CONCURRENT_PER_CONNECTION: usize = 256;

/// Everything a node needs to know.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// This node's id (> 0, stable for its life).
    pub id: NodeId,
    /// Where Raft log, vote and state machine live.
    pub data_dir: PathBuf,
    /// gRPC address other nodes and clients use to reach this node.
    pub advertise_rpc: String,
    /// HTTP address others use to reach this node's admin port.
    pub advertise_http: String,
    /// Leader heartbeat interval.
    pub heartbeat_ms: u64,
    /// Election timeout range: a follower that hears nothing for a random time in it
    /// starts an election.
    pub election_timeout_min_ms: u64,
    /// Upper end of the election timeout range.
    pub election_timeout_max_ms: u64,
    /// Take a snapshot (and compact the log) after this many entries.
    pub snapshot_every: u64,
    /// The leader recomputes entitlements on this interval even without reports.
    pub tick_ms: u64,
    /// Initialize a new group with these members if this node's storage is empty.
    pub initial_members: Option<BTreeMap<NodeId, Node>>,
    /// Mutual TLS on the gRPC port and to the peers (`None`: plain text).
    pub tls: Option<crate::tls::GrpcTls>,
}

impl ServerConfig {
    /// A configuration with the defaults for everything but identity and addresses.
    pub fn new(id: NodeId, data_dir: PathBuf, advertise_rpc: String, advertise_http: String) -> Self {
        ServerConfig {
            id,
            data_dir,
            advertise_rpc,
            advertise_http,
            // Measured on 2 loaded cores (docs/benchmarks.md): 50/150-300 ms fails over in
            // well under a second with no spurious elections under load; 40/120-240
            // already caused spurious elections, 100/300-600 takes over a second.
            heartbeat_ms: 50,
            election_timeout_min_ms: 150,
            election_timeout_max_ms: 300,
            snapshot_every: 10_000,
            tick_ms: 1_000,
            initial_members: None,
            tls: None,
        }
    }

    fn raft_config(&self) -> Result<Config> {
        let c = Config {
            cluster_name: "kvota".to_string(),
            heartbeat_interval: self.heartbeat_ms,
            election_timeout_min: self.election_timeout_min_ms,
            election_timeout_max: self.election_timeout_max_ms,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(self.snapshot_every),
            // Keep some log after a snapshot so a briefly lagging follower catches up
            // from the log instead of a whole snapshot.
            max_in_snapshot_log_to_keep: 1_000,
            ..Default::default()
        };
        c.validate().context("check Raft timing (heartbeat must be below the election timeout range)")
    }
}

/// A running node.
pub struct ServerHandle {
    /// Node id.
    pub id: NodeId,
    /// The node's shared context (Raft, state, metrics).
    pub ctx: Arc<NodeCtx>,
    /// Bound gRPC address.
    pub rpc_addr: SocketAddr,
    /// Bound HTTP address.
    pub http_addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl std::fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerHandle")
            .field("id", &self.id)
            .field("rpc_addr", &self.rpc_addr)
            .field("http_addr", &self.http_addr)
            .finish_non_exhaustive()
    }
}

impl ServerHandle {
    /// The Raft handle.
    pub fn raft(&self) -> &Raft {
        &self.ctx.raft
    }

    /// Stops serving, stops Raft, waits for every task. The data directory is closed
    /// when the last handle to the store is dropped.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        let _ = self.ctx.raft.shutdown().await;
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Starts a node on the given listeners.
pub async fn start(cfg: ServerConfig, rpc: TcpListener, http: TcpListener) -> Result<ServerHandle> {
    if cfg.id == 0 {
        anyhow::bail!("node id must be greater than 0");
    }
    let rpc_addr = rpc.local_addr().context("read gRPC listen address")?;
    let http_addr = http.local_addr().context("read HTTP listen address")?;
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("create data directory {}", cfg.data_dir.display()))?;
    let (log_store, sm_store) = crate::store::open(&cfg.data_dir.join("raft"))
        .with_context(|| format!("open data directory {}", cfg.data_dir.display()))?;
    log_store
        .claim_for_node(cfg.id)
        .await
        .with_context(|| format!("data directory {}", cfg.data_dir.display()))?;
    let state = sm_store.shared();
    let raft = Raft::new(cfg.id, Arc::new(cfg.raft_config()?), Network { tls: cfg.tls.clone() }, log_store, sm_store)
        .await
        .context("start Raft")?;
    let ctx = Arc::new(NodeCtx::new(cfg.id, raft.clone(), state, Metrics::new(), cfg.tls.clone()));

    if let Some(members) = &cfg.initial_members {
        if raft.is_initialized().await.context("read Raft state")? {
            tracing::info!("data directory already holds a group; --init ignored");
        } else {
            if !members.contains_key(&cfg.id) {
                anyhow::bail!("--init members must include this node (id {})", cfg.id);
            }
            raft.initialize(members.clone())
                .await
                .context("initialize the group")?;
            tracing::info!(members = members.len(), "initialized a new control-plane group");
        }
    }

    let (shutdown, rx) = watch::channel(false);
    let mut tasks = JoinSet::new();

    let contact = Arc::new(crate::watchdog::LeaderContact::default());
    // gRPC: member, admin and Raft services on one port.
    let mut builder = tonic::transport::Server::builder();
    match &cfg.tls {
        Some(t) => builder = builder.tls_config(t.server()).context("set up TLS on the gRPC port")?,
        None => tracing::warn!(
            "gRPC without TLS: anyone who can reach the gRPC port can report usage, change the policy or join the group; give --tls-ca, --tls-cert and --tls-key outside a trusted network"
        ),
    }
    let grpc = builder
        .concurrency_limit_per_connection(MAX_CONCURRENT_PER_CONNECTION)
        .tcp_nodelay(true)
        .add_service(
            MemberServer::new(MemberSvc::new(ctx.clone()))
                .max_decoding_message_size(MAX_API_MESSAGE_BYTES),
        )
        .add_service(
            AdminServer::new(AdminSvc::new(ctx.clone())).max_decoding_message_size(MAX_API_MESSAGE_BYTES),
        )
        .add_service(
            RaftServer::new(RaftTransport::new(raft.clone(), contact.clone()))
                .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES),
        );
    let mut stop = rx.clone();
    tasks.spawn(async move {
        // tonic applies `tcp_nodelay` only to listeners it binds itself, not to an
        // incoming stream it is given: without this, Nagle holds back the second small
        // write of a reply (HTTP/2 DATA after HEADERS) until the peer's delayed ACK,
        // 40 ms on Linux. That was the whole 1-client p99 (docs/benchmarks.md).
        let incoming = tonic::transport::server::TcpIncoming::from(rpc).with_nodelay(Some(true));
        let until = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = grpc.serve_with_incoming_shutdown(incoming, until).await {
            tracing::error!(error = %e, "gRPC server stopped");
        }
    });

    // Fast failover when the leader's process is gone (see `watchdog`).
    tasks.spawn(crate::watchdog::run(
        raft.clone(),
        contact,
        cfg.id,
        Duration::from_millis(cfg.heartbeat_ms),
        Duration::from_millis(cfg.election_timeout_max_ms),
        rx.clone(),
    ));

    // HTTP admin port.
    let app = crate::http::router(ctx.clone());
    let mut stop = rx.clone();
    tasks.spawn(async move {
        let until = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        if let Err(e) = axum::serve(http, app).with_graceful_shutdown(until).await {
            tracing::error!(error = %e, "HTTP server stopped");
        }
    });

    // Leader loop: recompute on a timer so budgets move as leases expire and usage decays.
    let tick_ctx = ctx.clone();
    let tick = Duration::from_millis(cfg.tick_ms.max(50));
    let mut stop = rx;
    tasks.spawn(async move {
        let mut every = tokio::time::interval(tick);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            let leading = tick_ctx.raft.metrics().borrow().state == openraft::ServerState::Leader;
            if leading {
                match tick_ctx.propose(Command::Tick).await {
                    Ok(Proposed::Done(_)) | Ok(Proposed::Forward(_)) => {}
                    Err(e) => tracing::debug!(error = %e, "leader tick not committed"),
                }
            }
        }
    });

    tracing::info!(id = cfg.id, %rpc_addr, %http_addr, data_dir = %cfg.data_dir.display(), "control-plane node started");
    Ok(ServerHandle {
        id: cfg.id,
        ctx,
        rpc_addr,
        http_addr,
        shutdown,
        tasks,
    })
}
