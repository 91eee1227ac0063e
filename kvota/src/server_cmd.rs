//! `kvota server`: run one control-plane node until Ctrl-C or SIGTERM.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvota_control_plane::options::ServerOptions;
use kvota_control_plane::server::{start, Listeners, ServerConfig};
use kvota_control_plane::types::Node;
use kvota_control_plane::types::NodeId;

/// Options of `kvota server`: the node's own ([`ServerOptions`], defined by the control
/// plane), and how the process ends.
#[derive(Debug, Args)]
pub struct ServerArgs {
    #[command(flatten)]
    node: ServerOptions,
    /// Stop when standard input reaches end of file: a parent that starts servers (the
    /// demo) gives each a pipe, so they exit with it even if it is killed.
    #[arg(long, hide = true)]
    exit_with_parent: bool,
}

/// Options of `kvota repair-vote`.
#[derive(Debug, Args)]
pub struct RepairVoteArgs {
    /// The node's id (the data directory must be this node's).
    #[arg(long, env = "KVOTA_NODE_ID")]
    id: NodeId,
    /// The node's data directory, as given to `kvota server --data-dir`.
    #[arg(long, env = "KVOTA_DATA_DIR", default_value = "./kvota-data")]
    data_dir: PathBuf,
}

/// `kvota repair-vote`: with the node stopped, replaces a saved vote whose term is out
/// of range (the node then refuses to start Raft, and says to run this) with a vote
/// for itself at a term in range.
pub fn repair_vote(args: RepairVoteArgs) -> Result<()> {
    use kvota_control_plane::saved::{repair_vote, Repaired};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    let raft_dir = args.data_dir.join("raft");
    let done = rt
        .block_on(repair_vote(&raft_dir, args.id))
        .with_context(|| format!("repair the vote in {}", args.data_dir.display()))?;
    match done {
        Repaired::NothingToDo(v) => println!(
            "the vote saved in {} is in range ({}): nothing to repair",
            args.data_dir.display(),
            v.map_or_else(|| "none".to_string(), |v| v.to_string())
        ),
        Repaired::Replaced { was, now } => println!(
            "the vote saved in {} was {was}; it is now {now}. Start the node again: it campaigns from term {} and \
             follows whichever term its group is at",
            args.data_dir.display(),
            now.leader_id().get_term()
        ),
    }
    Ok(())
}

/// `ID=GRPC,HTTP,RAFT` (HTTP may be empty: `ID=GRPC,,RAFT`).
pub(crate) fn parse_member(spec: &str) -> Result<(u64, Node)> {
    let usage = || {
        format!("--member {spec}: expected ID=GRPC_ADDR,HTTP_ADDR,RAFT_ADDR (e.g. 2=10.0.0.2:7401,10.0.0.2:7501,10.0.0.2:7601)")
    };
    let (id, addrs) = spec.split_once('=').with_context(usage)?;
    let id: u64 = id
        .parse()
        .ok()
        .filter(|&i| i > 0)
        .with_context(|| format!("--member {spec}: `{id}` is not a node id (a number > 0)"))?;
    let parts: Vec<&str> = addrs.split(',').map(str::trim).collect();
    let [rpc, http, raft] = parts[..] else {
        bail!("{}", usage())
    };
    if rpc.is_empty() || raft.is_empty() {
        bail!("{}: the gRPC and Raft addresses are required", usage());
    }
    Ok((
        id,
        Node {
            rpc_addr: rpc.to_string(),
            http_addr: http.to_string(),
            raft_addr: raft.to_string(),
        },
    ))
}

async fn bind(addr: &str, what: &str, flag: &str) -> Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                format!("; another process uses it (another kvota server?): stop it or pick another {flag}")
            }
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

/// Sizes the listeners' connection limits below the open-files limit `files`, leaving a
/// reserve for the data files and the connections to the peers, and says so.
fn fit_limits(cfg: &mut ServerConfig, files: Option<u64>) {
    let l = &mut cfg.limits;
    // The API serves every agent and operator; Raft a few peers; HTTP probes and scrapes.
    let shrunk =
        kvota_tls::listen::fit_to_file_limit(files, &mut [(&mut l.api, 8), (&mut l.raft, 2), (&mut l.http, 2)]);
    tracing::info!(
        open_files_limit = ?files,
        grpc = l.api.max_connections,
        grpc_per_peer = l.api.max_connections_per_peer,
        raft = l.raft.max_connections,
        raft_per_peer = l.raft.max_connections_per_peer,
        http = l.http.max_connections,
        http_per_peer = l.http.max_connections_per_peer,
        "connection limits {}",
        if shrunk {
            "fit to the open-files limit, with a reserve for the data files and outgoing connections"
        } else {
            "at their defaults, below the open-files limit"
        }
    );
    if files.is_some_and(|f| f < 1_024) {
        tracing::warn!(open_files_limit = ?files, "the open-files limit is low: raise it (ulimit -n, LimitNOFILE=) to at least 1024");
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
    if args.node.id == 0 {
        bail!("--id must be greater than 0");
    }
    let tls = crate::admin_cmd::tls_from(
        "--tls",
        args.node.tls_ca.as_deref(),
        args.node.tls_cert.as_deref(),
        args.node.tls_key.as_deref(),
    )?;
    let files = kvota_tls::listen::raise_file_limit();
    let api = bind(&args.node.listen, "gRPC", "--listen").await?;
    let raft = bind(&args.node.raft_listen, "Raft", "--raft-listen").await?;
    let http = bind(&args.node.http, "HTTP", "--http").await?;
    let advertise = args
        .node
        .advertise
        .clone()
        .unwrap_or_else(|| advertised(&args.node.listen, &api));
    let advertise_raft = args
        .node
        .advertise_raft
        .clone()
        .unwrap_or_else(|| advertised(&args.node.raft_listen, &raft));
    let advertise_http = args
        .node
        .advertise_http
        .clone()
        .unwrap_or_else(|| advertised(&args.node.http, &http));
    let mut cfg = args
        .node
        .config((advertise.clone(), advertise_http.clone(), advertise_raft.clone()));
    fit_limits(&mut cfg, files);
    cfg.tls = tls;
    cfg.initial_members = initial_members(
        &args.node,
        Node {
            rpc_addr: advertise,
            http_addr: advertise_http,
            raft_addr: advertise_raft,
        },
    )?;
    let handle = match start(cfg.clone(), Listeners { api, raft, http }).await {
        Ok(h) => h,
        Err(e) => match e.downcast::<kvota_control_plane::server::Parked>() {
            Ok(parked) => return parked_until_signal(&cfg, parked).await,
            Err(e) => return Err(e),
        },
    };
    log_started(&args.node, &handle).await;
    if let Some(why) = wait_for_stop(&handle, args.exit_with_parent).await {
        return broken(handle, why).await;
    }
    tracing::info!("kvota server: stopping");
    handle.shutdown().await;
    Ok(())
}

/// The group's first members with `--init` (this node among them), `None` without.
fn initial_members(args: &ServerOptions, me: Node) -> Result<Option<BTreeMap<NodeId, Node>>> {
    if !args.init {
        if !args.members.is_empty() {
            bail!("--member only makes sense with --init");
        }
        return Ok(None);
    }
    let mut members = BTreeMap::new();
    for m in &args.members {
        let (id, node) = parse_member(m)?;
        if members.insert(id, node).is_some() {
            bail!("--member: node id {id} is given twice");
        }
    }
    members.entry(args.id).or_insert(me);
    Ok(Some(members))
}

/// Says where the node serves, and how to add it to a group if it is in none.
async fn log_started(args: &ServerOptions, handle: &kvota_control_plane::server::ServerHandle) {
    tracing::info!(
        id = args.id,
        tls = handle.ctx.tls().is_some(),
        "kvota server: node {} serving gRPC on {}, Raft on {} and HTTP on {}{} (data in {}); Ctrl-C to stop",
        args.id,
        handle.rpc_addr,
        handle.raft_addr,
        handle.http_addr,
        if handle.ctx.tls().is_some() {
            " over mutual TLS"
        } else {
            " in plain text"
        },
        args.data_dir.display()
    );
    if !handle.raft().is_initialized().await.unwrap_or(true) {
        tracing::info!(
            "kvota server: this node belongs to no group yet: it waits for a leader to add it \
             (`kvota members add-learner --id {} --rpc {} --raft {}`), or start it with --init to create a new group",
            args.id,
            handle.rpc_addr,
            handle.raft_addr
        );
    }
}

/// Waits for a signal (or, with `exit_with_parent`, for stdin to close); `Some` if the
/// node broke first.
async fn wait_for_stop(handle: &kvota_control_plane::server::ServerHandle, exit_with_parent: bool) -> Option<String> {
    if exit_with_parent {
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
            why = handle.broken() => return Some(why),
        }
    } else {
        tokio::select! {
            _ = wait_for_signal() => {}
            why = handle.broken() => return Some(why),
        }
    }
    None
}

/// The data directory holds a vote or log id out of range: serve the probes (healthy,
/// not ready, saying why and how to recover) until a signal, rather than exit and be
/// restarted into the same state by the supervisor.
async fn parked_until_signal(cfg: &ServerConfig, parked: kvota_control_plane::server::Parked) -> Result<()> {
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    let serving = kvota_control_plane::server::serve_parked(cfg, parked, stop);
    tokio::pin!(serving);
    tokio::select! {
        _ = wait_for_signal() => {}
        _ = &mut serving => return Ok(()),
    }
    let _ = stop_tx.send(true);
    serving.await;
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
