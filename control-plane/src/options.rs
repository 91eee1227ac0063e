//! The control-plane node's command-line options.

use std::path::PathBuf;

use crate::server::ServerConfig;

/// A node's options, as `kvota server` takes them (each with its environment
/// variable): the binary flattens this struct into its command and builds the node's
/// [`ServerConfig`] with [`ServerOptions::config`].
#[derive(Clone, Debug, clap::Args)]
pub struct ServerOptions {
    /// This node's id: a number > 0, unique in the group and stable for the node's life
    /// (required: a default would quietly make every node without one node 1). The data
    /// directory remembers it and refuses to start under another id.
    #[arg(long, env = "KVOTA_NODE_ID")]
    pub id: u64,
    /// Directory for the Raft log, vote and state machine (created if missing). Keep it
    /// on durable storage: a node restarts from it.
    #[arg(long, env = "KVOTA_DATA_DIR", default_value = "./kvota-data")]
    pub data_dir: PathBuf,
    /// Address to serve the gRPC API on (member and admin services: agents and
    /// operators).
    #[arg(long, env = "KVOTA_LISTEN", default_value = "127.0.0.1:7401")]
    pub listen: String,
    /// Address to serve Raft on (the other control-plane nodes only; with TLS it accepts
    /// node certificates only).
    #[arg(long, env = "KVOTA_RAFT_LISTEN", default_value = "127.0.0.1:7601")]
    pub raft_listen: String,
    /// Address to serve HTTP on: /healthz, /readyz, /metrics, /api/v1/...
    #[arg(long, env = "KVOTA_HTTP", default_value = "127.0.0.1:7501")]
    pub http: String,
    /// gRPC API address other nodes and agents use to reach this node (default: --listen).
    #[arg(long, env = "KVOTA_ADVERTISE")]
    pub advertise: Option<String>,
    /// Raft address the other nodes use to reach this node (default: --raft-listen).
    #[arg(long, env = "KVOTA_ADVERTISE_RAFT")]
    pub advertise_raft: Option<String>,
    /// HTTP address others use to reach this node (default: --http).
    #[arg(long, env = "KVOTA_ADVERTISE_HTTP")]
    pub advertise_http: Option<String>,
    /// Initialize a new group if the data directory is empty. Give every initial member
    /// with --member (this node included); without --member, a one-node group.
    /// Harmless on restart: an initialized directory ignores it.
    #[arg(long)]
    pub init: bool,
    /// An initial member for --init: ID=GRPC_ADDR,HTTP_ADDR,RAFT_ADDR, e.g.
    /// `2=10.0.0.2:7401,10.0.0.2:7501,10.0.0.2:7601`. Repeat for each member.
    #[arg(long = "member", value_name = "ID=GRPC,HTTP,RAFT")]
    pub members: Vec<String>,
    /// Leader heartbeat interval, milliseconds. openraft also makes it the deadline of
    /// every replication RPC: keep it above the round trip between control-plane nodes,
    /// or the leader cannot commit and writes stall until another node takes over. The
    /// default suits one LAN; across zones or regions raise it, and the election
    /// timeouts to several heartbeats.
    #[arg(long, env = "KVOTA_HEARTBEAT_MS", default_value_t = 50)]
    pub heartbeat_ms: u64,
    /// Lower bound of the election timeout, milliseconds (a follower that hears no
    /// leader for a random time between min and max starts an election).
    #[arg(long, env = "KVOTA_ELECTION_TIMEOUT_MIN_MS", default_value_t = 150)]
    pub election_timeout_min_ms: u64,
    /// Upper bound of the election timeout, milliseconds.
    #[arg(long, env = "KVOTA_ELECTION_TIMEOUT_MAX_MS", default_value_t = 300)]
    pub election_timeout_max_ms: u64,
    /// Take a snapshot and compact the log after this many entries.
    #[arg(long, env = "KVOTA_SNAPSHOT_EVERY", default_value_t = 10_000)]
    pub snapshot_every: u64,
    /// Entries kept in the log behind a snapshot, so that a follower that fell a little
    /// behind catches up from the log instead of receiving the whole snapshot (a new
    /// node, or one further behind, receives the snapshot).
    #[arg(long, env = "KVOTA_SNAPSHOT_CATCHUP_ENTRIES", default_value_t = 1_000)]
    pub snapshot_catchup_entries: u64,
    /// How often the leader recomputes entitlements without new reports, milliseconds.
    #[arg(long, env = "KVOTA_TICK_MS", default_value_t = 1_000)]
    pub tick_ms: u64,
    /// PEM bundle of the federation's CA (or, while rotating it, old and new CA): serve
    /// every port over TLS and authorize each caller by the identity in its certificate
    /// (node, cluster, operator, viewer; see docs/security.md). Needs --tls-cert and
    /// --tls-key. The three files are reread when they change.
    #[arg(long, env = "KVOTA_TLS_CA", value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// PEM certificate of this node: `kvota certs issue --role node --name <id>` (its
    /// identity must be this node's id). Presented on every port and to the peers.
    #[arg(long, env = "KVOTA_TLS_CERT", value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "KVOTA_TLS_KEY", value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Allow plain text (no TLS, no identities) on addresses other than loopback.
    /// Anyone who reaches the ports can then report usage, change the policy, join the
    /// group or forge Raft traffic: only for a network where every host is trusted.
    #[arg(long, env = "KVOTA_INSECURE")]
    pub insecure: bool,
    /// Connections one address may hold open on the gRPC API port at once (agents of
    /// many clusters may share one egress address: keep it above their number).
    #[arg(long, env = "KVOTA_MAX_CONNECTIONS_PER_PEER", default_value_t = 256)]
    pub max_connections_per_peer: usize,
    /// Free space (MiB) the data directory's file system must keep: below it the node
    /// is not ready and says why, before writes fail.
    #[arg(long, env = "KVOTA_MIN_FREE_DISK_MB", default_value_t = 64)]
    pub min_free_disk_mb: u64,
}

impl ServerOptions {
    /// The node's configuration from these options and the addresses it advertises
    /// (`(gRPC, HTTP, Raft)`). TLS, the initial members and the connection limits' fit
    /// to the open-files limit are the caller's: they read files and the process's
    /// limits.
    pub fn config(&self, (advertise_rpc, advertise_http, advertise_raft): (String, String, String)) -> ServerConfig {
        let mut cfg = ServerConfig::new(
            self.id,
            self.data_dir.clone(),
            advertise_rpc,
            advertise_http,
            advertise_raft,
        );
        cfg.insecure = self.insecure;
        cfg.limits.api.max_connections_per_peer = self.max_connections_per_peer.max(1);
        cfg.min_free_disk_bytes = self.min_free_disk_mb.saturating_mul(1 << 20);
        cfg.heartbeat_ms = self.heartbeat_ms;
        cfg.election_timeout_min_ms = self.election_timeout_min_ms;
        cfg.election_timeout_max_ms = self.election_timeout_max_ms;
        cfg.snapshot_every = self.snapshot_every;
        cfg.snapshot_catchup_entries = self.snapshot_catchup_entries;
        cfg.tick_ms = self.tick_ms;
        cfg
    }
}
