//! Starting and stopping one control-plane node.
//!
//! [`start`] takes already-bound listeners ("servers accept an incoming stream"), so
//! tests bind port 0 and the binary binds what the operator asked for. A node has three:
//! the gRPC API (member and admin services), Raft (node certificates only) and HTTP
//! (probes, metrics, the JSON API). Each accepts through `kvota_tls::Listener`, with
//! its connection limits; with TLS each authenticates callers by certificate.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvota_fairness::federation::Command;
use kvota_proto::raft::v1::raft_server::RaftServer;
use kvota_proto::v1::{admin_server::AdminServer, member_server::MemberServer};
use kvota_tls::http::HttpLimits;
use kvota_tls::{Limits, Listener, Role, ServerTls, TrustGroup};
use openraft::{Config, SnapshotPolicy};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::clock::{TimeKeeper, WallClock};
use crate::metrics::Metrics;
use crate::network::{Network, RaftTransport, MAX_RAFT_MESSAGE_BYTES};
use crate::node::{NodeCtx, Proposed};
use crate::service::{AdminSvc, MemberSvc};
use crate::types::{Node, NodeId, Raft};

pub use kvota_proto::MAX_API_MESSAGE_BYTES;
/// Concurrent requests per connection: bounds the work one client can queue.
pub const MAX_CONCURRENT_PER_CONNECTION: usize = 256;
/// HTTP/2 streams open at once per gRPC connection: an agent or the CLI has one or two.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 64;
/// Largest header block of a gRPC request (16 KiB): ours carry a few short fields.
pub const MAX_GRPC_HEADER_BYTES: u32 = 16 << 10;
/// The longest a gRPC call on the API port may take, body included: longer than any
/// handler needs (`AddLearner` waits up to 60 s for a learner to catch up), and a
/// request that dribbles its body in is cut off.
pub const API_REQUEST_TIMEOUT: Duration = Duration::from_secs(70);
/// The longest a Raft call may take on the receiving side: a 64 MiB snapshot chunk on a
/// slow link; openraft's own deadlines on the sending side are much shorter.
pub const RAFT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the data directory's free space is checked.
pub const DISK_CHECK: Duration = Duration::from_secs(1);
/// Default free-space reserve of the data directory's file system: below it the node is
/// not ready (and says why) before writes start failing.
pub const DEFAULT_MIN_FREE_DISK_BYTES: u64 = 64 << 20;

/// The connection limits of a node's three listeners.
#[derive(Clone, Debug)]
pub struct PortLimits {
    /// The gRPC API: agents and operators. Many clusters may share one egress address,
    /// so the per-address limit is generous.
    pub api: Limits,
    /// Raft: a handful of peers, each with one or two connections.
    pub raft: Limits,
    /// HTTP: probes, scrapers, the CLI.
    pub http: Limits,
    /// HTTP request limits.
    pub http_requests: HttpLimits,
}

impl Default for PortLimits {
    fn default() -> Self {
        PortLimits {
            api: Limits {
                max_connections: 4_096,
                max_connections_per_peer: 256,
                ..Limits::default()
            },
            raft: Limits {
                max_connections: 256,
                max_connections_per_peer: 32,
                ..Limits::default()
            },
            http: Limits {
                max_connections: 1_024,
                max_connections_per_peer: 64,
                ..Limits::default()
            },
            http_requests: HttpLimits::default(),
        }
    }
}

/// Everything a node needs to know.
#[derive(Clone)]
pub struct ServerConfig {
    /// This node's id (> 0, stable for its life).
    pub id: NodeId,
    /// Where Raft log, vote and state machine live.
    pub data_dir: PathBuf,
    /// gRPC API address clients use to reach this node.
    pub advertise_rpc: String,
    /// HTTP address others use to reach this node's admin port.
    pub advertise_http: String,
    /// Raft address the other nodes use to reach this node.
    pub advertise_raft: String,
    /// Leader heartbeat interval.
    pub heartbeat_ms: u64,
    /// Election timeout range: a follower that hears nothing for a random time in it
    /// starts an election.
    pub election_timeout_min_ms: u64,
    /// Upper end of the election timeout range.
    pub election_timeout_max_ms: u64,
    /// Take a snapshot (and compact the log) after this many entries.
    pub snapshot_every: u64,
    /// Entries kept in the log behind a snapshot for followers that lag a little.
    pub snapshot_catchup_entries: u64,
    /// The leader recomputes entitlements on this interval even without reports; every
    /// node reads the voters' clocks on it.
    pub tick_ms: u64,
    /// Initialize a new group with these members if this node's storage is empty.
    pub initial_members: Option<BTreeMap<NodeId, Node>>,
    /// Mutual TLS on every port and to the peers (`None`: plain text, no identities).
    pub tls: Option<kvota_client::tls::GrpcTls>,
    /// Allow plain text on listeners that are not loopback (a trusted network only).
    pub insecure: bool,
    /// Connection limits of the listeners.
    pub limits: PortLimits,
    /// The node's wall clock (tests give nodes wrong ones).
    pub wall_clock: WallClock,
    /// Below this many free bytes on the data directory's file system the node is not
    /// ready.
    pub min_free_disk_bytes: u64,
    /// The newest feature level this node supports ([`crate::feature::FeatureLevel::NEWEST`]
    /// in every build): tests of the upgrade gate set it lower to pose as an older build.
    /// Only with the `test-hooks` feature, which no release build enables.
    #[cfg(feature = "test-hooks")]
    pub feature_level_max: crate::feature::FeatureLevel,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("id", &self.id)
            .field("data_dir", &self.data_dir)
            .field("advertise_rpc", &self.advertise_rpc)
            .field("advertise_raft", &self.advertise_raft)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl ServerConfig {
    /// The newest feature level this node supports.
    fn feature_max(&self) -> crate::feature::FeatureLevel {
        #[cfg(feature = "test-hooks")]
        {
            self.feature_level_max
        }
        #[cfg(not(feature = "test-hooks"))]
        {
            crate::feature::FeatureLevel::NEWEST
        }
    }

    /// A configuration with the defaults for everything but identity and addresses.
    pub fn new(
        id: NodeId,
        data_dir: PathBuf,
        advertise_rpc: String,
        advertise_http: String,
        advertise_raft: String,
    ) -> Self {
        ServerConfig {
            id,
            data_dir,
            advertise_rpc,
            advertise_http,
            advertise_raft,
            // Measured on 2 loaded cores (docs/benchmarks.md): 50/150-300 ms fails over in
            // well under a second with no spurious elections under load; 40/120-240
            // already caused spurious elections, 100/300-600 takes over a second.
            heartbeat_ms: 50,
            election_timeout_min_ms: 150,
            election_timeout_max_ms: 300,
            snapshot_every: 10_000,
            snapshot_catchup_entries: 1_000,
            tick_ms: 1_000,
            initial_members: None,
            tls: None,
            insecure: false,
            limits: PortLimits::default(),
            wall_clock: crate::clock::system_wall_clock(),
            min_free_disk_bytes: DEFAULT_MIN_FREE_DISK_BYTES,
            #[cfg(feature = "test-hooks")]
            feature_level_max: crate::feature::FeatureLevel::NEWEST,
        }
    }

    /// This node as a member of the group.
    pub fn node(&self) -> Node {
        Node {
            rpc_addr: self.advertise_rpc.clone(),
            http_addr: self.advertise_http.clone(),
            raft_addr: self.advertise_raft.clone(),
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
            max_in_snapshot_log_to_keep: self.snapshot_catchup_entries,
            max_payload_entries: MAX_ENTRIES_PER_APPEND,
            ..Default::default()
        };
        c.validate()
            .context("check Raft timing (heartbeat must be below the election timeout range)")
    }
}

/// Log entries openraft reads for one AppendEntries at most (its default is 300). The
/// network sends a prefix of them of at most [`crate::network::MAX_APPEND_BYTES`]; reading
/// many more than fit would be wasted work on every round.
pub const MAX_ENTRIES_PER_APPEND: u64 = 32;

/// A node's three bound listeners.
#[derive(Debug)]
pub struct Listeners {
    /// gRPC API (member and admin services).
    pub api: TcpListener,
    /// Raft between nodes.
    pub raft: TcpListener,
    /// HTTP: health, readiness, metrics, JSON.
    pub http: TcpListener,
}

impl Listeners {
    /// Binds all three on 127.0.0.1 with ports chosen by the system (tests).
    pub async fn loopback() -> std::io::Result<Listeners> {
        Ok(Listeners {
            api: TcpListener::bind("127.0.0.1:0").await?,
            raft: TcpListener::bind("127.0.0.1:0").await?,
            http: TcpListener::bind("127.0.0.1:0").await?,
        })
    }
}

/// A running node.
pub struct ServerHandle {
    /// Node id.
    pub id: NodeId,
    /// The node's shared context (Raft, state, metrics).
    pub ctx: Arc<NodeCtx>,
    /// Bound gRPC API address.
    pub rpc_addr: SocketAddr,
    /// Bound Raft address.
    pub raft_addr: SocketAddr,
    /// Bound HTTP address.
    pub http_addr: SocketAddr,
    shutdown: watch::Sender<bool>,
    broken: watch::Receiver<bool>,
    tasks: JoinSet<()>,
    log: crate::store::LogStore,
}

impl std::fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerHandle")
            .field("id", &self.id)
            .field("rpc_addr", &self.rpc_addr)
            .field("raft_addr", &self.raft_addr)
            .field("http_addr", &self.http_addr)
            .finish_non_exhaustive()
    }
}

impl ServerHandle {
    /// The Raft handle.
    pub fn raft(&self) -> &Raft {
        &self.ctx.raft
    }

    /// How far this node's Raft log is durable ([`crate::store::flush`]).
    pub fn durable(&self) -> watch::Receiver<crate::store::flush::Durable> {
        self.log.durable()
    }

    /// Holds back the syncs of this node's early-acknowledged appends (as leader) until
    /// the guard goes: for tests (the `test-hooks` feature).
    #[cfg(feature = "test-hooks")]
    pub fn hold_flushes_for_test(&self) -> crate::store::flush::FlushHold {
        self.log.hold_flushes_for_test()
    }

    /// Resolves when the node is broken for good (its Raft core stopped), with why;
    /// never resolves for a node that works. The binary exits non-zero on it.
    pub async fn broken(&self) -> String {
        let mut rx = self.broken.clone();
        let _ = rx.wait_for(|b| *b).await;
        self.ctx.fatal().unwrap_or("the Raft core stopped").to_string()
    }

    /// Stops serving, stops Raft, waits for every task. The data directory is closed
    /// when the last handle to the store is dropped.
    pub async fn shutdown(mut self) {
        let _ = self.shutdown.send(true);
        let _ = self.ctx.raft.shutdown().await;
        while self.tasks.join_next().await.is_some() {}
    }
}

fn on_refusal(metrics: &Metrics) -> kvota_tls::listen::OnRefusal {
    let m = metrics.clone();
    Arc::new(move |listener, why| m.refused(listener, why.as_str()))
}

/// Refuses plain text on an address other than loopback unless `insecure`.
fn check_plain_text(cfg: &ServerConfig, addrs: &[(&str, SocketAddr)]) -> Result<()> {
    if cfg.tls.is_some() {
        return Ok(());
    }
    if cfg.insecure {
        tracing::warn!("plain text with --insecure: anyone who reaches these ports can report usage, change the policy, join the group or forge Raft traffic; use it on a trusted network only");
        return Ok(());
    }
    for (what, addr) in addrs {
        if !kvota_tls::listen::is_loopback(addr) {
            anyhow::bail!(
                "the {what} listener is on {addr}, which is not loopback, and TLS is off: anyone who reaches it could report usage, change the policy or join the group. \
                 Give --tls-ca, --tls-cert and --tls-key (`kvota certs --help`), or --insecure on a trusted network"
            );
        }
    }
    Ok(())
}

/// What [`start`] opened before serving: the node's context and its log store, and the
/// flag the network sets when a commit index it sent was held back for the log's sync.
struct Opened {
    ctx: Arc<NodeCtx>,
    log: crate::store::LogStore,
    held_back: Arc<std::sync::atomic::AtomicBool>,
}

/// Opens the data directory and starts Raft on it; a saved state out of range gives the
/// listeners back in [`Parked`] instead (see [`crate::saved`]).
async fn open_node(cfg: &ServerConfig, listeners: Listeners) -> Result<(Opened, Listeners)> {
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("create data directory {}", cfg.data_dir.display()))?;
    let (log_store, mut sm_store) = crate::store::open_for(&cfg.data_dir.join("raft"), cfg.feature_max())
        .with_context(|| format!("open data directory {}", cfg.data_dir.display()))?;
    log_store
        .claim_for_node(cfg.id)
        .await
        .with_context(|| format!("data directory {}", cfg.data_dir.display()))?;
    let mut log_check = log_store.clone();
    let saved = crate::saved::check(&mut log_check, &mut sm_store, cfg.id, &cfg.data_dir)
        .await
        .with_context(|| format!("read data directory {}", cfg.data_dir.display()))?;
    if let Err(why) = saved {
        return Err(anyhow::Error::new(Parked { why, listeners }));
    }
    let state = sm_store.shared();
    let held_back = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let metrics = Metrics::new();
    let guard = Arc::new(crate::guard::Guard::default());
    let network = Network {
        tls: cfg.tls.clone(),
        durable: log_store.durable(),
        held_back: Arc::clone(&held_back),
        guard: Arc::clone(&guard),
        metrics: metrics.clone(),
        acked: crate::network::Acked::default(),
    };
    let log = log_store.clone();
    let raft = Raft::new(cfg.id, Arc::new(cfg.raft_config()?), network, log_store, sm_store)
        .await
        .context("start Raft")?;
    guard.attach(raft.metrics());
    let clock = Arc::new(TimeKeeper::new(cfg.id, cfg.wall_clock.clone()));
    clock.set_own_feature_max(cfg.feature_max());
    metrics.connection_limits(
        kvota_tls::listen::file_limit(),
        &[
            ("grpc", cfg.limits.api.max_connections),
            ("raft", cfg.limits.raft.max_connections),
            ("http", cfg.limits.http.max_connections),
        ],
    );
    let ctx = Arc::new(NodeCtx::new(
        cfg.id,
        raft,
        state,
        metrics,
        cfg.tls.clone(),
        clock,
        guard,
    ));
    Ok((Opened { ctx, log, held_back }, listeners))
}

/// Initializes a new group with `cfg.initial_members` (`--init`) if the data directory
/// holds none yet.
async fn initialize_if_asked(cfg: &ServerConfig, raft: &Raft) -> Result<()> {
    let Some(members) = &cfg.initial_members else {
        return Ok(());
    };
    if raft.is_initialized().await.context("read Raft state")? {
        tracing::info!("data directory already holds a group; --init ignored");
        return Ok(());
    }
    if !members.contains_key(&cfg.id) {
        anyhow::bail!("--init members must include this node (id {})", cfg.id);
    }
    if let Some((id, _)) = members.iter().find(|(_, n)| n.raft_addr.is_empty()) {
        anyhow::bail!("--init member {id} has no Raft address");
    }
    raft.initialize(members.clone()).await.context("initialize the group")?;
    tracing::info!(members = members.len(), "initialized a new control-plane group");
    Ok(())
}

/// Starts a node on the given listeners.
pub async fn start(cfg: ServerConfig, listeners: Listeners) -> Result<ServerHandle> {
    let rpc_addr = listeners.api.local_addr().context("read gRPC listen address")?;
    let raft_addr = listeners.raft.local_addr().context("read Raft listen address")?;
    let http_addr = listeners.http.local_addr().context("read HTTP listen address")?;
    check_start(&cfg, &[("gRPC", rpc_addr), ("Raft", raft_addr), ("HTTP", http_addr)])?;
    let (opened, listeners) = open_node(&cfg, listeners).await?;
    let Opened { ctx, log, held_back } = opened;
    let raft = ctx.raft.clone();
    initialize_if_asked(&cfg, &raft).await?;

    let (shutdown, rx) = watch::channel(false);
    let (broken_tx, broken) = watch::channel(false);
    let mut tasks = JoinSet::new();
    let contact = Arc::new(crate::watchdog::LeaderContact::default());
    spawn_servers(&cfg, &ctx, listeners, contact.clone(), &mut tasks, &rx);
    // A commit index held back for the leader's sync (`store::flush`) goes out as soon
    // as the sync is done, not with the next write or heartbeat.
    tasks.spawn(push_held_back_commits(
        raft.clone(),
        log.durable(),
        held_back,
        rx.clone(),
    ));

    // Fast failover when the leader's process is gone (see `watchdog`).
    let (heartbeat, election_max) = (cfg.heartbeat_ms, cfg.election_timeout_max_ms);
    let (heartbeat, election_max) = (Duration::from_millis(heartbeat), Duration::from_millis(election_max));
    tasks.spawn(crate::watchdog::run(
        raft.clone(),
        contact,
        cfg.id,
        heartbeat,
        election_max,
        rx.clone(),
    ));

    spawn_watchers(&cfg, &ctx, &mut tasks, &rx, broken_tx);

    // Every node reads the voters' clocks; the leader recomputes on a timer so budgets
    // move as leases expire and usage decays.
    tasks.spawn(tick_loop(
        ctx.clone(),
        Duration::from_millis(cfg.tick_ms.max(50)),
        rx.clone(),
    ));

    // Samples of the federation for the dashboard's charts.
    tasks.spawn(sample_history(ctx.clone(), rx));

    tracing::info!(id = cfg.id, %rpc_addr, %raft_addr, %http_addr, tls = cfg.tls.is_some(), data_dir = %cfg.data_dir.display(), "control-plane node started");
    Ok(ServerHandle {
        id: cfg.id,
        ctx,
        rpc_addr,
        raft_addr,
        http_addr,
        shutdown,
        broken,
        tasks,
        log,
    })
}

/// Serves the gRPC API, Raft and HTTP on their listeners until `rx` turns true.
fn spawn_servers(
    cfg: &ServerConfig,
    ctx: &Arc<NodeCtx>,
    listeners: Listeners,
    contact: Arc<crate::watchdog::LeaderContact>,
    tasks: &mut JoinSet<()>,
    rx: &watch::Receiver<bool>,
) {
    let refusal = on_refusal(&ctx.metrics);

    // gRPC API: member and admin services. With TLS every client needs a certificate.
    let api = Listener::new(
        "grpc",
        listeners.api,
        node_tls(cfg, None),
        cfg.limits.api.clone(),
        refusal.clone(),
    );
    tasks.spawn(serve_api(ctx.clone(), api, rx.clone()));

    // Raft: its own port, node certificates only (dropped after the handshake otherwise).
    let raft_tls = node_tls(cfg, Some(vec![Role::Node]));
    let raft_listener = Listener::new(
        "raft",
        listeners.raft,
        raft_tls,
        cfg.limits.raft.clone(),
        refusal.clone(),
    );
    tasks.spawn(serve_raft(ctx.clone(), contact, raft_listener, rx.clone()));

    // HTTP: client certificates optional (probes carry none); routes authorize.
    let http = Listener::new("http", listeners.http, http_tls(cfg), cfg.limits.http.clone(), refusal);
    tasks.spawn(kvota_tls::http::serve(
        http.incoming(rx.clone()),
        crate::http::router(ctx.clone()),
        cfg.limits.http_requests.clone(),
        rx.clone(),
    ));
}

/// The watchers of a running node: certificate files, the Raft core, free disk space.
fn spawn_watchers(
    cfg: &ServerConfig,
    ctx: &Arc<NodeCtx>,
    tasks: &mut JoinSet<()>,
    rx: &watch::Receiver<bool>,
    broken_tx: watch::Sender<bool>,
) {
    // Certificates, key and CA bundle reread when they change.
    if let Some(tls) = &cfg.tls {
        let (m, source) = (ctx.metrics.clone(), tls.source().clone());
        certificate_expiry(&m, &source);
        tasks.spawn(tls.source().clone().watch(
            "node certificate",
            move |ok| {
                m.tls_reload(ok);
                certificate_expiry(&m, &source);
            },
            rx.clone(),
        ));
    }

    // A Raft core that stops (a storage error, a panic) cannot come back in this process.
    tasks.spawn(watch_raft_core(ctx.clone(), rx.clone(), broken_tx));

    // The data directory's free space.
    tasks.spawn(watch_disk(
        ctx.clone(),
        cfg.data_dir.clone(),
        cfg.min_free_disk_bytes,
        rx.clone(),
    ));
}

/// Refuses a configuration the node cannot start with: id 0, plain text off loopback,
/// a certificate naming another node, no advertised Raft address.
fn check_start(cfg: &ServerConfig, addrs: &[(&str, SocketAddr)]) -> Result<()> {
    if cfg.id == 0 {
        anyhow::bail!("node id must be greater than 0");
    }
    check_plain_text(cfg, addrs)?;
    if let Some(tls) = &cfg.tls {
        let me = tls.identity();
        if me.as_ref().and_then(|i| i.node_id()) != Some(cfg.id) {
            anyhow::bail!(
                "the certificate {} names {}, not node {}: give this node a certificate of its own (`kvota certs issue --role node --name {}`)",
                tls.source().paths().cert.display(),
                me.map_or_else(|| "no kvota identity".to_string(), |i| i.to_string()),
                cfg.id,
                cfg.id
            );
        }
    }
    if cfg.advertise_raft.is_empty() {
        anyhow::bail!("the node needs a Raft address others can reach (--advertise-raft)");
    }
    Ok(())
}

/// TLS of the gRPC and Raft ports: a federation certificate is mandatory, and `roles`
/// (if any) limits who may connect.
fn node_tls(cfg: &ServerConfig, roles: Option<Vec<Role>>) -> Option<ServerTls> {
    cfg.tls.as_ref().map(|t| ServerTls {
        serving: t.source().clone(),
        groups: vec![TrustGroup {
            label: "federation",
            source: t.source().clone(),
            names_identities: true,
        }],
        mandatory: true,
        roles,
        alpn: vec![b"h2".to_vec()],
    })
}

/// Serves the member and admin gRPC services until `stop` turns true.
async fn serve_api(ctx: Arc<NodeCtx>, api: Listener, stop: watch::Receiver<bool>) {
    let grpc = tonic::transport::Server::builder()
        .timeout(API_REQUEST_TIMEOUT)
        .concurrency_limit_per_connection(MAX_CONCURRENT_PER_CONNECTION)
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_max_header_list_size(MAX_GRPC_HEADER_BYTES)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .tcp_nodelay(true)
        // One span per call, named by its method, so that what a handler logs (and the
        // write it proposes) can be followed back to the call.
        .trace_fn(|req| tracing::info_span!("grpc", method = req.uri().path()))
        .add_service(MemberServer::new(MemberSvc::new(ctx.clone())).max_decoding_message_size(MAX_API_MESSAGE_BYTES))
        .add_service(AdminServer::new(AdminSvc::new(ctx)).max_decoding_message_size(MAX_API_MESSAGE_BYTES));
    let incoming = api.incoming(stop.clone());
    if let Err(e) = grpc.serve_with_incoming_shutdown(incoming, stopped(stop)).await {
        tracing::error!(error = %e, "gRPC server stopped");
    }
}

/// Serves Raft between nodes until `stop` turns true.
async fn serve_raft(
    ctx: Arc<NodeCtx>,
    contact: Arc<crate::watchdog::LeaderContact>,
    listener: Listener,
    stop: watch::Receiver<bool>,
) {
    let raft_server = tonic::transport::Server::builder()
        .timeout(RAFT_REQUEST_TIMEOUT)
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_max_header_list_size(MAX_GRPC_HEADER_BYTES)
        .tcp_nodelay(true)
        .add_service(
            RaftServer::new(RaftTransport::new(ctx, contact))
                .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES),
        );
    let incoming = listener.incoming(stop.clone());
    if let Err(e) = raft_server.serve_with_incoming_shutdown(incoming, stopped(stop)).await {
        tracing::error!(error = %e, "Raft server stopped");
    }
}

/// Resolves once `stop` turns true (or its sender is gone).
async fn stopped(mut stop: watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Sends a heartbeat as soon as the log is durable if a commit index was held back
/// for the sync, so followers learn it without waiting for the next write.
async fn push_held_back_commits(
    raft: Raft,
    mut durable: watch::Receiver<crate::store::flush::Durable>,
    held_back: Arc<std::sync::atomic::AtomicBool>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            changed = durable.changed() => {
                if changed.is_err() {
                    return;
                }
                if held_back.swap(false, std::sync::atomic::Ordering::Relaxed) {
                    let _ = raft.trigger().heartbeat().await;
                }
            }
            () = async { let _ = stop.wait_for(|s| *s).await; } => return,
        }
    }
}

/// Every `tick`: reads the voters' clocks and, on the leader, proposes a recompute.
async fn tick_loop(ctx: Arc<NodeCtx>, tick: Duration, mut stop: watch::Receiver<bool>) {
    let mut clients = ClockClients::default();
    let mut every = tokio::time::interval(tick);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
        }
        read_clocks(&ctx, &mut clients).await;
        let leading = ctx.raft.metrics().borrow().state == openraft::ServerState::Leader;
        if leading {
            match ctx.propose(Command::Tick).await {
                Ok(Proposed::Done(_)) | Ok(Proposed::Forward(_)) => {}
                Err(e) => tracing::debug!(error = %e, "leader tick not committed"),
            }
        }
    }
}

/// TLS of the HTTP port: client certificates optional (probes carry none); routes
/// authorize.
fn http_tls(cfg: &ServerConfig) -> Option<ServerTls> {
    cfg.tls.as_ref().map(|t| ServerTls {
        serving: t.source().clone(),
        groups: vec![TrustGroup {
            label: "federation",
            source: t.source().clone(),
            names_identities: true,
        }],
        mandatory: false,
        roles: None,
        alpn: vec![b"h2".to_vec(), b"http/1.1".to_vec()],
    })
}

/// [`start`] found the data directory's saved state out of range
/// ([`crate::saved::OutOfRange`]): no Raft core was started. The listeners come back,
/// for [`serve_parked`].
#[derive(Debug, thiserror::Error)]
#[error("{why}")]
pub struct Parked {
    /// What is wrong, and how to recover.
    pub why: crate::saved::OutOfRange,
    /// The listeners [`start`] was given.
    pub listeners: Listeners,
}

/// How often a parked node says again why it does not serve.
pub const PARKED_LOG_EVERY: Duration = Duration::from_secs(60);

/// Serves a node that cannot start its Raft core ([`Parked`]) until `stop` turns true:
/// `/healthz` answers 200 (restarting it changes nothing, so a liveness probe must not
/// keep doing that), `/readyz` and everything else 503 with why and the recovery; the
/// gRPC and Raft ports are closed (clients and peers go to the other nodes). The reason
/// is logged as an error now and every [`PARKED_LOG_EVERY`].
pub async fn serve_parked(cfg: &ServerConfig, parked: Parked, mut stop: watch::Receiver<bool>) {
    let Parked { why, listeners } = parked;
    let why = why.to_string();
    drop(listeners.api);
    drop(listeners.raft);
    let metrics = Metrics::new();
    let http = Listener::new(
        "http",
        listeners.http,
        http_tls(cfg),
        cfg.limits.http.clone(),
        on_refusal(&metrics),
    );
    let probe = why.clone();
    let ready = why.clone();
    let router = axum::Router::new()
        .route(
            "/healthz",
            axum::routing::get(move || {
                let probe = probe.clone();
                async move { format!("ok (not serving: {probe})\n") }
            }),
        )
        .fallback(move || {
            let ready = ready.clone();
            async move {
                (
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    format!("not ready: {ready}\n"),
                )
            }
        });
    let server = tokio::spawn(kvota_tls::http::serve(
        http.incoming(stop.clone()),
        router,
        cfg.limits.http_requests.clone(),
        stop.clone(),
    ));
    let mut every = tokio::time::interval(PARKED_LOG_EVERY);
    loop {
        tokio::select! {
            _ = every.tick() => tracing::error!(reason = %why, "this node does not start its Raft core: it stays up, not ready"),
            _ = stop.wait_for(|s| *s) => break,
        }
    }
    let _ = server.await;
}

/// Samples this node's applied state into its history every
/// [`crate::view::HISTORY_INTERVAL`], the first at once, and counts each tenant's time
/// above its entitlement and below its guarantee (`kvota_tenant_*_seconds_total`).
async fn sample_history(ctx: Arc<NodeCtx>, mut stop: watch::Receiver<bool>) {
    let mut every = tokio::time::interval(crate::view::HISTORY_INTERVAL);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut share = crate::view::ShareTimes::default();
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
        }
        let view = crate::view::FederationView::summary(&ctx.state.read().await.federation);
        ctx.history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .sample(&view);
        if view.state_time_ms > 0 {
            share.observe(&view, |t, v, s| ctx.metrics.add_share_time(t, v, s));
        }
    }
}

/// Raft clients for reading the voters' clocks, by node and address (kept: a new TLS
/// connection every tick would cost each pair of nodes a handshake per second).
type ClockClients = std::collections::HashMap<
    (NodeId, String),
    kvota_proto::raft::v1::raft_client::RaftClient<tonic::transport::Channel>,
>;

/// Asks every other voter for its wall clock (at most 500 ms each, all at once) and
/// records the answers (see [`crate::clock`]).
async fn read_clocks(ctx: &Arc<NodeCtx>, clients: &mut ClockClients) {
    let peers: Vec<(NodeId, String)> = {
        let m = ctx.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        membership
            .voter_ids()
            .filter(|v| *v != ctx.id)
            .filter_map(|v| membership.get_node(&v).map(|n| (v, n.raft_addr.clone())))
            .collect()
    };
    clients.retain(|k, _| peers.contains(k));
    let asks = peers.into_iter().filter_map(|(id, addr)| {
        let client = match clients.get(&(id, addr.clone())) {
            Some(c) => c.clone(),
            None => {
                let c = crate::network::raft_client(&addr, id, ctx.tls(), Duration::from_millis(500)).ok()?;
                clients.insert((id, addr), c.clone());
                c
            }
        };
        let ctx = ctx.clone();
        Some(async move {
            let mut client = client;
            let sent = Instant::now();
            if let Ok(Ok(r)) = tokio::time::timeout(
                Duration::from_millis(500),
                client.clock(kvota_proto::raft::v1::Empty {}),
            )
            .await
            {
                let r = r.into_inner();
                ctx.clock.record(id, r.wall_ms, sent.elapsed());
                ctx.clock.record_support(id, r.feature_level_max);
            }
        })
    });
    futures::future::join_all(asks).await;
}

/// Marks the node broken when its Raft core stops without being asked to.
async fn watch_raft_core(ctx: Arc<NodeCtx>, mut stop: watch::Receiver<bool>, broken: watch::Sender<bool>) {
    let mut m = ctx.raft.metrics();
    loop {
        let changed = tokio::select! {
            c = m.changed() => c,
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
        };
        if *stop.borrow() {
            return;
        }
        let why = match changed {
            Err(_) => Some("the Raft core exited".to_string()),
            Ok(()) => {
                let cur = m.borrow_and_update().clone();
                match (&cur.running_state, cur.state) {
                    (Err(e), _) => Some(format!("the Raft core stopped: {e}")),
                    (Ok(()), openraft::ServerState::Shutdown) => Some("the Raft core shut down".to_string()),
                    _ => None,
                }
            }
        };
        if let Some(why) = why {
            ctx.set_fatal(why);
            let _ = broken.send(true);
            return;
        }
    }
}

/// Checks the data directory's free space every [`DISK_CHECK`]: below `min_free` the
/// node is not ready, with a log line when it happens and when it passes.
async fn watch_disk(ctx: Arc<NodeCtx>, dir: PathBuf, min_free: u64, mut stop: watch::Receiver<bool>) {
    let mut low = false;
    let mut every = tokio::time::interval(DISK_CHECK);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
        }
        let free = match rustix::fs::statvfs(&dir) {
            Ok(s) => s.f_bavail.saturating_mul(s.f_frsize),
            Err(e) => {
                tracing::debug!(error = %e, dir = %dir.display(), "statvfs failed");
                continue;
            }
        };
        let now_low = free < min_free;
        ctx.metrics.disk(free, now_low);
        ctx.set_disk_low(now_low);
        if now_low && !low {
            tracing::error!(free_bytes = free, reserve_bytes = min_free, dir = %dir.display(), "the data directory's disk is nearly full: this node is not ready; free space (or grow the volume) before writes fail");
        } else if low && !now_low {
            tracing::info!(free_bytes = free, dir = %dir.display(), "the data directory's disk has room again");
        }
        low = now_low;
    }
}

/// Exports when the node's certificate expires: it serves the gRPC, HTTP and Raft ports
/// and is the client certificate of its calls to peers, so one file, two uses.
fn certificate_expiry(metrics: &Metrics, source: &kvota_tls::TlsSource) {
    let loaded = source.current();
    let identity = loaded.identity.as_ref().map_or_else(String::new, ToString::to_string);
    for r#use in ["served", "client"] {
        metrics.certificate(r#use, &identity, loaded.not_after_unix);
    }
}
