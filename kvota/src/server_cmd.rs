//! `kvota server`: run one control-plane node until Ctrl-C or SIGTERM.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvota_control_plane::server::{start, ServerConfig};
use kvota_control_plane::types::Node;

/// Options of `kvota server`.
#[derive(Debug, Args)]
pub struct ServerArgs {
    /// This node's id: a number > 0, unique in the group and stable for the node's life
    /// (required: a default would quietly make every node without one node 1). The data
    /// directory remembers it and refuses to start under another id.
    #[arg(long, env = "KVOTA_NODE_ID")]
    id: u64,
    /// Directory for the Raft log, vote and state machine (created if missing). Keep it
    /// on durable storage: a node restarts from it.
    #[arg(long, env = "KVOTA_DATA_DIR", default_value = "./kvota-data")]
    data_dir: PathBuf,
    /// Address to serve gRPC on (member, admin and Raft services).
    #[arg(long, env = "KVOTA_LISTEN", default_value = "127.0.0.1:7401")]
    listen: String,
    /// Address to serve HTTP on: /healthz, /readyz, /metrics, /api/v1/...
    #[arg(long, env = "KVOTA_HTTP", default_value = "127.0.0.1:7501")]
    http: String,
    /// gRPC address other nodes and agents use to reach this node (default: --listen).
    #[arg(long, env = "KVOTA_ADVERTISE")]
    advertise: Option<String>,
    /// HTTP address others use to reach this node (default: --http).
    #[arg(long, env = "KVOTA_ADVERTISE_HTTP")]
    advertise_http: Option<String>,
    /// Initialize a new group if the data directory is empty. Give every initial member
    /// with --member (this node included); without --member, a one-node group.
    /// Harmless on restart: an initialized directory ignores it.
    #[arg(long)]
    init: bool,
    /// An initial member for --init: ID=GRPC_ADDR[,HTTP_ADDR], e.g.
    /// `2=10.0.0.2:7401,10.0.0.2:7501`. Repeat for each member.
    #[arg(long = "member", value_name = "ID=GRPC[,HTTP]")]
    members: Vec<String>,
    /// Leader heartbeat interval, milliseconds. openraft also makes it the deadline of
    /// every replication RPC: keep it above the round trip between control-plane nodes,
    /// or the leader cannot commit and writes stall until another node takes over. The
    /// default suits one LAN; across zones or regions raise it, and the election
    /// timeouts to several heartbeats.
    #[arg(long, env = "KVOTA_HEARTBEAT_MS", default_value_t = 50)]
    heartbeat_ms: u64,
    /// Lower bound of the election timeout, milliseconds (a follower that hears no
    /// leader for a random time between min and max starts an election).
    #[arg(long, env = "KVOTA_ELECTION_TIMEOUT_MIN_MS", default_value_t = 150)]
    election_timeout_min_ms: u64,
    /// Upper bound of the election timeout, milliseconds.
    #[arg(long, env = "KVOTA_ELECTION_TIMEOUT_MAX_MS", default_value_t = 300)]
    election_timeout_max_ms: u64,
    /// Take a snapshot and compact the log after this many entries.
    #[arg(long, env = "KVOTA_SNAPSHOT_EVERY", default_value_t = 10_000)]
    snapshot_every: u64,
    /// How often the leader recomputes entitlements without new reports, milliseconds.
    #[arg(long, env = "KVOTA_TICK_MS", default_value_t = 1_000)]
    tick_ms: u64,
    /// PEM file with the CA that signs every certificate in the federation (servers,
    /// agents, operators): serve gRPC over mutual TLS, accepting only clients and peers
    /// with a certificate from it. Needs --tls-cert and --tls-key; without all three the
    /// gRPC port is plain text (logged as a warning). Certificates are read at start.
    #[arg(long, env = "KVOTA_TLS_CA", value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// PEM certificate of this node, signed by --tls-ca; its names must include the host
    /// of --advertise (peers, agents and the CLI check it). Also presented to the peers.
    #[arg(long, env = "KVOTA_TLS_CERT", value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "KVOTA_TLS_KEY", value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// Stop when standard input reaches end of file: a parent that starts servers (the
    /// demo) gives each a pipe, so they exit with it even if it is killed.
    #[arg(long, hide = true)]
    exit_with_parent: bool,
}

fn parse_member(spec: &str) -> Result<(u64, Node)> {
    let (id, addrs) = spec
        .split_once('=')
        .with_context(|| format!("--member {spec}: expected ID=GRPC_ADDR[,HTTP_ADDR]"))?;
    let id: u64 = id
        .parse()
        .ok()
        .filter(|&i| i > 0)
        .with_context(|| format!("--member {spec}: `{id}` is not a node id (a number > 0)"))?;
    let (rpc, http) = match addrs.split_once(',') {
        Some((r, h)) => (r.to_string(), h.to_string()),
        None => (addrs.to_string(), String::new()),
    };
    if rpc.is_empty() {
        bail!("--member {spec}: the gRPC address is missing");
    }
    Ok((id, Node { rpc_addr: rpc, http_addr: http }))
}

async fn bind(addr: &str, what: &str, flag: &str) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => format!(
                "; another process uses it (another kvota server?): stop it or pick another {flag}"
            ),
            std::io::ErrorKind::PermissionDenied => "; ports below 1024 need privileges".to_string(),
            _ => String::new(),
        };
        anyhow::anyhow!("listen for {what} on {addr}: {e}{hint}")
    })
}

/// Runs the node until a signal arrives.
pub fn run(args: ServerArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    rt.block_on(serve(args))
}

async fn serve(args: ServerArgs) -> Result<()> {
    if args.id == 0 {
        bail!("--id must be greater than 0");
    }
    let tls = crate::admin_cmd::tls_from("--tls", args.tls_ca.as_deref(), args.tls_cert.as_deref(), args.tls_key.as_deref())?;
    let rpc = bind(&args.listen, "gRPC", "--listen").await?;
    let http = bind(&args.http, "HTTP", "--http").await?;
    let advertise = args.advertise.clone().unwrap_or_else(|| args.listen.clone());
    let advertise_http = args.advertise_http.clone().unwrap_or_else(|| args.http.clone());
    let mut cfg = ServerConfig::new(args.id, args.data_dir.clone(), advertise.clone(), advertise_http.clone());
    cfg.heartbeat_ms = args.heartbeat_ms;
    cfg.election_timeout_min_ms = args.election_timeout_min_ms;
    cfg.election_timeout_max_ms = args.election_timeout_max_ms;
    cfg.snapshot_every = args.snapshot_every;
    cfg.tick_ms = args.tick_ms;
    cfg.tls = tls;
    if args.init {
        let mut members = BTreeMap::new();
        for m in &args.members {
            let (id, node) = parse_member(m)?;
            if members.insert(id, node).is_some() {
                bail!("--member: node id {id} is given twice");
            }
        }
        members.entry(args.id).or_insert(Node {
            rpc_addr: advertise,
            http_addr: advertise_http,
        });
        cfg.initial_members = Some(members);
    } else if !args.members.is_empty() {
        bail!("--member only makes sense with --init");
    }
    let handle = start(cfg, rpc, http).await?;
    eprintln!(
        "kvota server: node {} serving gRPC on {} and HTTP on {} (data in {}); Ctrl-C to stop",
        args.id,
        handle.rpc_addr,
        handle.http_addr,
        args.data_dir.display()
    );
    if !handle.raft().is_initialized().await.unwrap_or(true) {
        eprintln!(
            "kvota server: this node belongs to no group yet: it waits for a leader to add it \
             (`kvota members add-learner --id {} --rpc {}`), or start it with --init to create a new group",
            args.id, handle.rpc_addr
        );
    }
    if args.exit_with_parent {
        // A plain thread, not the runtime's blocking pool: the runtime would wait for a
        // read that never ends when the server stops for another reason.
        let (tx, stdin_closed) = tokio::sync::oneshot::channel::<()>();
        std::thread::spawn(move || {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin();
            // Reads until end of file or an error: either way the parent is gone.
            while matches!(std::io::Read::read(&mut stdin, &mut sink), Ok(n) if n > 0) {}
            let _ = tx.send(());
        });
        tokio::select! {
            _ = wait_for_signal() => {}
            _ = stdin_closed => eprintln!("kvota server: the parent process is gone"),
        }
    } else {
        wait_for_signal().await;
    }
    eprintln!("kvota server: stopping");
    handle.shutdown().await;
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
