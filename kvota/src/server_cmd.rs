//! `kvota server`: run one control-plane node until Ctrl-C or SIGTERM.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvota_control_plane::server::{start, Listeners, ServerConfig};
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
    /// Address to serve the gRPC API on (member and admin services: agents and
    /// operators).
    #[arg(long, env = "KVOTA_LISTEN", default_value = "127.0.0.1:7401")]
    listen: String,
    /// Address to serve Raft on (the other control-plane nodes only; with TLS it accepts
    /// node certificates only).
    #[arg(long, env = "KVOTA_RAFT_LISTEN", default_value = "127.0.0.1:7601")]
    raft_listen: String,
    /// Address to serve HTTP on: /healthz, /readyz, /metrics, /api/v1/...
    #[arg(long, env = "KVOTA_HTTP", default_value = "127.0.0.1:7501")]
    http: String,
    /// gRPC API address other nodes and agents use to reach this node (default: --listen).
    #[arg(long, env = "KVOTA_ADVERTISE")]
    advertise: Option<String>,
    /// Raft address the other nodes use to reach this node (default: --raft-listen).
    #[arg(long, env = "KVOTA_ADVERTISE_RAFT")]
    advertise_raft: Option<String>,
    /// HTTP address others use to reach this node (default: --http).
    #[arg(long, env = "KVOTA_ADVERTISE_HTTP")]
    advertise_http: Option<String>,
    /// Initialize a new group if the data directory is empty. Give every initial member
    /// with --member (this node included); without --member, a one-node group.
    /// Harmless on restart: an initialized directory ignores it.
    #[arg(long)]
    init: bool,
    /// An initial member for --init: ID=GRPC_ADDR,HTTP_ADDR,RAFT_ADDR, e.g.
    /// `2=10.0.0.2:7401,10.0.0.2:7501,10.0.0.2:7601`. Repeat for each member.
    #[arg(long = "member", value_name = "ID=GRPC,HTTP,RAFT")]
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
    /// Entries kept in the log behind a snapshot, so that a follower that fell a little
    /// behind catches up from the log instead of receiving the whole snapshot (a new
    /// node, or one further behind, receives the snapshot).
    #[arg(long, env = "KVOTA_SNAPSHOT_CATCHUP_ENTRIES", default_value_t = 1_000)]
    snapshot_catchup_entries: u64,
    /// How often the leader recomputes entitlements without new reports, milliseconds.
    #[arg(long, env = "KVOTA_TICK_MS", default_value_t = 1_000)]
    tick_ms: u64,
    /// PEM bundle of the federation's CA (or, while rotating it, old and new CA): serve
    /// every port over TLS and authorize each caller by the identity in its certificate
    /// (node, cluster, operator, viewer; see docs/security.md). Needs --tls-cert and
    /// --tls-key. The three files are reread when they change.
    #[arg(long, env = "KVOTA_TLS_CA", value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// PEM certificate of this node: `kvota certs issue --role node --name <id>` (its
    /// identity must be this node's id). Presented on every port and to the peers.
    #[arg(long, env = "KVOTA_TLS_CERT", value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "KVOTA_TLS_KEY", value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// Allow plain text (no TLS, no identities) on addresses other than loopback.
    /// Anyone who reaches the ports can then report usage, change the policy, join the
    /// group or forge Raft traffic: only for a network where every host is trusted.
    #[arg(long, env = "KVOTA_INSECURE")]
    insecure: bool,
    /// Connections one address may hold open on the gRPC API port at once (agents of
    /// many clusters may share one egress address: keep it above their number).
    #[arg(long, env = "KVOTA_MAX_CONNECTIONS_PER_PEER", default_value_t = 256)]
    max_connections_per_peer: usize,
    /// Free space (MiB) the data directory's file system must keep: below it the node
    /// is not ready and says why, before writes fail.
    #[arg(long, env = "KVOTA_MIN_FREE_DISK_MB", default_value_t = 64)]
    min_free_disk_mb: u64,
    /// Stop when standard input reaches end of file: a parent that starts servers (the
    /// demo) gives each a pipe, so they exit with it even if it is killed.
    #[arg(long, hide = true)]
    exit_with_parent: bool,
}

/// `ID=GRPC,HTTP,RAFT` (HTTP may be empty: `ID=GRPC,,RAFT`).
pub(crate) fn parse_member(spec: &str) -> Result<(u64, Node)> {
    let usage = || format!("--member {spec}: expected ID=GRPC_ADDR,HTTP_ADDR,RAFT_ADDR (e.g. 2=10.0.0.2:7401,10.0.0.2:7501,10.0.0.2:7601)");
    let (id, addrs) = spec.split_once('=').with_context(usage)?;
    let id: u64 = id
        .parse()
        .ok()
        .filter(|&i| i > 0)
        .with_context(|| format!("--member {spec}: `{id}` is not a node id (a number > 0)"))?;
    let parts: Vec<&str> = addrs.split(',').map(str::trim).collect();
    let [rpc, http, raft] = parts[..] else { bail!("{}", usage()) };
    if rpc.is_empty() || raft.is_empty() {
        bail!("{}: the gRPC and Raft addresses are required", usage());
    }
    Ok((id, Node { rpc_addr: rpc.to_string(), http_addr: http.to_string(), raft_addr: raft.to_string() }))
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

/// What to advertise for a listen flag without its --advertise: the flag itself, with
/// the port the system chose when it said port 0.
fn advertised(flag: &str, bound: &tokio::net::TcpListener) -> String {
    match (flag.rsplit_once(':'), bound.local_addr()) {
        (Some((host, "0")), Ok(a)) => format!("{host}:{}", a.port()),
        _ => flag.to_string(),
    }
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
    kvota_tls::listen::raise_file_limit();
    let api = bind(&args.listen, "gRPC", "--listen").await?;
    let raft = bind(&args.raft_listen, "Raft", "--raft-listen").await?;
    let http = bind(&args.http, "HTTP", "--http").await?;
    let advertise = args.advertise.clone().unwrap_or_else(|| advertised(&args.listen, &api));
    let advertise_raft = args.advertise_raft.clone().unwrap_or_else(|| advertised(&args.raft_listen, &raft));
    let advertise_http = args.advertise_http.clone().unwrap_or_else(|| advertised(&args.http, &http));
    let mut cfg = ServerConfig::new(args.id, args.data_dir.clone(), advertise.clone(), advertise_http.clone(), advertise_raft.clone());
    cfg.insecure = args.insecure;
    cfg.limits.api.max_connections_per_peer = args.max_connections_per_peer.max(1);
    cfg.min_free_disk_bytes = args.min_free_disk_mb.saturating_mul(1 << 20);
    cfg.heartbeat_ms = args.heartbeat_ms;
    cfg.election_timeout_min_ms = args.election_timeout_min_ms;
    cfg.election_timeout_max_ms = args.election_timeout_max_ms;
    cfg.snapshot_every = args.snapshot_every;
    cfg.snapshot_catchup_entries = args.snapshot_catchup_entries;
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
            raft_addr: advertise_raft,
        });
        cfg.initial_members = Some(members);
    } else if !args.members.is_empty() {
        bail!("--member only makes sense with --init");
    }
    let handle = start(cfg, Listeners { api, raft, http }).await?;
    tracing::info!(
        id = args.id,
        tls = handle.ctx.tls().is_some(),
        "kvota server: node {} serving gRPC on {}, Raft on {} and HTTP on {}{} (data in {}); Ctrl-C to stop",
        args.id,
        handle.rpc_addr,
        handle.raft_addr,
        handle.http_addr,
        if handle.ctx.tls().is_some() { " over mutual TLS" } else { " in plain text" },
        args.data_dir.display()
    );
    if !handle.raft().is_initialized().await.unwrap_or(true) {
        tracing::info!(
            "kvota server: this node belongs to no group yet: it waits for a leader to add it \
             (`kvota members add-learner --id {} --rpc {} --raft {}`), or start it with --init to create a new group",
            args.id, handle.rpc_addr, handle.raft_addr
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
            _ = stdin_closed => tracing::info!("kvota server: the parent process is gone"),
            why = handle.broken() => return broken(handle, why).await,
        }
    } else {
        tokio::select! {
            _ = wait_for_signal() => {}
            why = handle.broken() => return broken(handle, why).await,
        }
    }
    tracing::info!("kvota server: stopping");
    handle.shutdown().await;
    Ok(())
}

/// The Raft core stopped: nothing in this process can bring it back. Exit non-zero so
/// that the supervisor (systemd, the kubelet) restarts the node from its data directory.
async fn broken(handle: kvota_control_plane::server::ServerHandle, why: String) -> Result<()> {
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), handle.shutdown()).await;
    bail!("the Raft core stopped ({why}); exiting so that the node is restarted from its data directory")
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
