//! `kvota agent`: one member cluster's agent. Registers with the control plane, reports
//! usage through its journal, enforces leases, and serves the admission webhook over
//! HTTPS.
//!
//! Inventory: the Kubernetes inventory (kube-rs watchers) is not built yet; `--simulate`
//! runs the agent against a simulated cluster whose scheduler binds every pod the
//! webhook admits (first fit by GPUe) and lets it run for `--simulate-pod-seconds`. Real
//! AdmissionReviews sent to the webhook drive it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvota_fairness::lease::LeaseStatus;
use kvota_fairness::resources::NVIDIA_GPU;
use kvota_member_agent::agent::Agent;
use kvota_member_agent::metrics::AgentMetrics;
use kvota_member_agent::state::PodRec;
use kvota_member_agent::persist::{FileStore, StateStore};
use kvota_member_agent::webhook::{self, WebhookCtx, WebhookTls};
use tokio::sync::watch;

/// Options of `kvota agent`.
#[derive(Debug, Args)]
pub struct AgentArgs {
    /// This member cluster's id (a DNS label: 1-63 lowercase letters, digits and '-'), unique in the federation.
    #[arg(long, env = "KVOTA_CLUSTER")]
    pub(crate) cluster: String,
    /// Directory for the usage journal and the last lease (created if missing). Keep it
    /// on durable storage: unacknowledged usage is resent from it after a restart.
    #[arg(long, env = "KVOTA_AGENT_DATA_DIR", default_value = "./kvota-agent")]
    pub(crate) data_dir: PathBuf,
    /// Address the HTTPS admission webhook listens on (/validate, /mutate, /healthz,
    /// /readyz, /metrics).
    #[arg(long, env = "KVOTA_WEBHOOK_LISTEN", default_value = "0.0.0.0:8443")]
    pub(crate) webhook_listen: String,
    /// PEM certificate chain of the webhook (reread when the file changes).
    #[arg(long, env = "KVOTA_TLS_CERT")]
    pub(crate) tls_cert: PathBuf,
    /// PEM private key of the webhook (reread when the file changes).
    #[arg(long, env = "KVOTA_TLS_KEY")]
    pub(crate) tls_key: PathBuf,
    /// PEM bundle of the CA that signs the Kubernetes API server's client certificate
    /// for webhooks (its AdmissionConfiguration's kubeconfig): with it, /validate and
    /// /mutate answer only the API server, and a forged review from anything else in
    /// the cluster is refused. Reread when the file changes.
    #[arg(long, env = "KVOTA_WEBHOOK_CLIENT_CA", value_name = "FILE")]
    pub(crate) webhook_client_ca: Option<PathBuf>,
    /// Connections one address may hold open on the webhook port at once (the API
    /// server keeps a pool per instance; anything else gets far fewer in practice).
    #[arg(long, env = "KVOTA_WEBHOOK_MAX_CONNECTIONS_PER_PEER", default_value_t = 512)]
    pub(crate) webhook_max_connections_per_peer: usize,
    /// How often usage is reported (each report also renews the lease), milliseconds.
    /// Keep it well under the policy's lease duration (default 30 s).
    #[arg(long, env = "KVOTA_REPORT_INTERVAL_MS", default_value_t = 5_000)]
    pub(crate) report_interval_ms: u64,
    /// Run against a simulated cluster instead of Kubernetes: node groups COUNTxGPUS,
    /// comma separated, e.g. `4x8,2x4`.
    #[arg(long, value_name = "NODES")]
    pub(crate) simulate: Option<String>,
    /// Kubeconfig of the member cluster. Default: the in-cluster service account when
    /// running in a pod, else $KUBECONFIG or ~/.kube/config.
    #[arg(long, env = "KVOTA_KUBECONFIG", conflicts_with = "simulate")]
    pub(crate) kubeconfig: Option<PathBuf>,
    /// Run several replicas safely: only the holder of this coordination.k8s.io Lease
    /// admits, reports, releases gates and reclaims; the others stand by (not ready).
    /// Without it this agent assumes it is the only replica.
    #[arg(long, env = "KVOTA_LEADER_LEASE", value_name = "NAME", conflicts_with = "simulate")]
    pub(crate) leader_lease: Option<String>,
    /// Namespace of the leader Lease (usually the agent's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "kvota-system")]
    pub(crate) leader_lease_namespace: String,
    /// This replica's identity in the Lease (usually the pod name). Default: host name
    /// and process id.
    #[arg(long, env = "POD_NAME")]
    pub(crate) identity: Option<String>,
    /// ConfigMap (in --leader-lease-namespace) where the leader keeps what a restarted or
    /// standby agent needs to go on enforcing at once: the policy, the lease and its
    /// remaining life, how far usage is counted. Without Kubernetes (--simulate), a file
    /// in --data-dir. If you change the name, change it in the agent's RBAC Role too
    /// (deploy/kubernetes/agent/10-rbac.yaml: resourceNames).
    #[arg(long, env = "KVOTA_STATE_CONFIGMAP", default_value = "kvota-agent-state")]
    pub(crate) state_configmap: String,
    /// How long a simulated pod runs once bound, seconds.
    #[arg(long, default_value_t = 600)]
    pub(crate) simulate_pod_seconds: u64,
}

/// `4x8,2x4` -> [8, 8, 8, 8, 4, 4].
fn parse_nodes(spec: &str) -> Result<Vec<u64>> {
    let mut nodes = Vec::new();
    for group in spec.split(',').map(str::trim).filter(|g| !g.is_empty()) {
        let (count, gpus) = group
            .split_once('x')
            .with_context(|| format!("--simulate {spec}: `{group}` is not COUNTxGPUS (e.g. 4x8)"))?;
        let count: u64 = count.parse().with_context(|| format!("--simulate: `{count}` in `{group}` is not a node count"))?;
        let gpus: u64 = gpus.parse().with_context(|| format!("--simulate: `{gpus}` in `{group}` is not a GPU count"))?;
        if count == 0 || gpus == 0 || count > 10_000 || gpus > 64 {
            bail!("--simulate: `{group}`: 1..=10000 nodes of 1..=64 GPUs");
        }
        nodes.extend(std::iter::repeat_n(gpus, usize::try_from(count).unwrap_or(0)));
    }
    if nodes.is_empty() {
        bail!("--simulate {spec}: no nodes (e.g. --simulate 4x8)");
    }
    Ok(nodes)
}

/// Runs the agent until Ctrl-C or SIGTERM.
pub fn run(args: AgentArgs, cp: &crate::admin_cmd::Cp) -> Result<()> {
    if !kvota_fairness::federation::valid_cluster_id(&args.cluster) {
        bail!("--cluster `{}`: use {}", args.cluster, kvota_fairness::names::DNS_LABEL_RULE);
    }
    if args.report_interval_ms < 100 {
        bail!("--report-interval-ms {}: at least 100", args.report_interval_ms);
    }
    let nodes = args.simulate.as_deref().map(parse_nodes).transpose()?;
    // Certificate problems are reported before anything starts.
    let federation = cp.tls()?;
    if let Some(f) = &federation {
        let me = f.identity();
        let ok = me.as_ref().is_some_and(|i| i.role() == kvota_tls::Role::Cluster && i.name() == args.cluster);
        if !ok {
            bail!(
                "--cp-cert {} names {}, but this agent is cluster `{}`: issue it with `kvota certs issue --role cluster --name {}`",
                f.source().paths().cert.display(),
                me.map_or_else(|| "no kvota identity".to_string(), |i| i.to_string()),
                args.cluster,
                args.cluster
            );
        }
    }
    let tls = WebhookTls::load(&args.tls_cert, &args.tls_key, args.webhook_client_ca.as_deref(), federation.map(|f| f.source().clone()))?;
    if cp.cp_ca.is_none() {
        tracing::warn!("no --cp-ca/--cp-cert/--cp-key: the agent talks to the control plane in plain text, without identities (the control plane must run with --insecure unless on loopback)");
    }
    kvota_tls::listen::raise_file_limit();
    if !tls.verifies_apiserver() {
        tracing::warn!("no --webhook-client-ca: /validate and /mutate answer any client that reaches the webhook port; limit it to the API server (deploy/kubernetes NetworkPolicy) or give the API server a client certificate");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("start the async runtime")?;
    match nodes {
        Some(nodes) => rt.block_on(serve(args, cp.clone(), nodes, tls)),
        None => rt.block_on(crate::agent_kube::serve(args, cp.clone(), tls)),
    }
}

async fn serve(args: AgentArgs, cp: crate::admin_cmd::Cp, nodes: Vec<u64>, tls: WebhookTls) -> Result<()> {
    let capacity: BTreeMap<String, u64> = [(NVIDIA_GPU.to_string(), nodes.iter().sum::<u64>() * 1000)].into();
    let store: Arc<dyn StateStore> = Arc::new(FileStore::in_dir(&args.data_dir));
    let (agent, stop_tx, stop, server) = start_webhook(&args, capacity, &cp, tls, None, store).await?;
    agent.starts_reporting();
    tracing::info!(
        "kvota agent: cluster {} ({} GPUs simulated on {} nodes), webhook https://{} (/validate, /mutate), control plane {}; Ctrl-C to stop",
        args.cluster,
        nodes.iter().sum::<u64>(),
        nodes.len(),
        args.webhook_listen,
        cp.addrs.join(",")
    );
    let leading = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let reporter = tokio::spawn(report_loop(agent.clone(), Duration::from_millis(args.report_interval_ms), leading, stop.clone()));
    let sim = tokio::spawn(simulated_cluster(agent.clone(), nodes, Duration::from_secs(args.simulate_pod_seconds), stop));
    wait_for_signal().await;
    tracing::info!("kvota agent: stopping");
    let _ = stop_tx.send(true);
    for t in [server, reporter, sim] {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    Ok(())
}

/// Opens the agent's data directory and serves its webhook; admission starts `held`
/// for that reason if one is given. Returns the agent, the stop switch and the server.
pub(crate) async fn start_webhook(
    args: &AgentArgs,
    capacity: BTreeMap<String, u64>,
    cp: &crate::admin_cmd::Cp,
    tls: WebhookTls,
    held: Option<String>,
    store: Arc<dyn StateStore>,
) -> Result<(Arc<Agent>, watch::Sender<bool>, watch::Receiver<bool>, tokio::task::JoinHandle<()>)> {
    crate::journal_v0::migrate(&args.data_dir)
        .map_err(|e| anyhow::anyhow!("migrate the usage journal in {}: {e}", args.data_dir.display()))?;
    let agent = Arc::new(
        Agent::open_with_tls(&args.cluster, capacity, &args.data_dir, &cp.addrs, tls.federation.clone().map(kvota_client::tls::GrpcTls::from_source))
            .map_err(|e| anyhow::anyhow!("open the agent's data directory {}: {}", args.data_dir.display(), e.message()))?,
    );
    agent.state().set_held(held);
    // What the last leader kept: enforcement goes on at once, before the control plane
    // answers (a restart or a takeover during a partition).
    agent.set_state_store(store.clone(), &replica_identity(args));
    match agent.restore().await {
        Ok(Some(s)) => tracing::info!(
            store = %store.describe(),
            writer = %s.writer,
            epoch = s.lease.as_ref().map_or(0, |l| l.epoch),
            policy = s.policy.as_ref().map(|p| p.name.clone()).unwrap_or_default(),
            "enforcing the policy and lease kept in the cluster until the control plane answers"
        ),
        Ok(None) => tracing::info!(store = %store.describe(), "no agent state kept yet: every budget is 0 (GPU pods refused) until the control plane answers"),
        Err(e) => tracing::warn!(error = %e, "agent state not used (left as it is for a person to look at); enforcing the fallback budgets of the lease in this replica's journal, if any, else 0, until the control plane answers"),
    }
    let listener = tokio::net::TcpListener::bind(&args.webhook_listen).await.map_err(|e| {
        let hint = if e.kind() == std::io::ErrorKind::AddrInUse { "; another process uses it: pick another --webhook-listen" } else { "" };
        anyhow::anyhow!("listen for the webhook on {}: {e}{hint}", args.webhook_listen)
    })?;
    let metrics = AgentMetrics::new();
    let (stop_tx, stop) = watch::channel(false);
    // The federation certificate (to the control plane, and trusted on the webhook's
    // read routes) is reread when its files change, like the webhook's own.
    if let Some(f) = tls.federation.clone() {
        let m = metrics.clone();
        tokio::spawn(f.watch("federation certificate", move |ok| m.tls_reload(ok), stop.clone()));
    }
    let app = webhook::router(WebhookCtx::with_tls(agent.clone(), metrics.clone(), &tls));
    let limits = kvota_tls::Limits { max_connections_per_peer: args.webhook_max_connections_per_peer.max(1), ..webhook::default_limits() };
    let server = tokio::spawn(webhook::serve_tls(listener, tls, app, metrics, limits, stop.clone()));
    Ok((agent, stop_tx, stop, server))
}

/// This replica's name (the pod's, or host and process).
pub(crate) fn replica_identity(args: &AgentArgs) -> String {
    args.identity
        .clone()
        .unwrap_or_else(|| format!("{}-{}", std::env::var("HOSTNAME").unwrap_or_else(|_| "agent".into()), std::process::id()))
}

/// Registers, fetches the policy, then reports every `every`; retries with backoff and
/// jitter, and logs what a person on call needs: lease changes, expiry, backlog.
/// A standby replica (`leading` false) reports nothing and keeps readings of what it
/// meters, so that on taking over it reports what the old leader did not.
pub(crate) async fn report_loop(
    agent: Arc<Agent>,
    every: Duration,
    leading: Arc<std::sync::atomic::AtomicBool>,
    mut stop: watch::Receiver<bool>,
) {
    // The policy is fetched on its own: a fetch that hangs on an unreachable control
    // plane (up to every attempt's deadline) must not hold back the journal write that
    // starts each report round (a real-fault test caught a cut with nothing journaled).
    let policy = tokio::spawn(policy_loop(agent.clone(), every * 12, stop.clone()));
    let mut registered = false;
    let mut failures = 0u32;
    let mut round = 0u64;
    let mut last_status = "none";
    loop {
        if !leading.load(std::sync::atomic::Ordering::SeqCst) {
            agent.stand_by();
            tokio::select! {
                _ = tokio::time::sleep(every) => continue,
                _ = async { let _ = stop.wait_for(|s| *s).await; } => break,
            }
        }
        let result = async {
            if !registered {
                agent.register().await?;
                registered = true;
                tracing::info!(cluster = agent.cluster(), "registered with the control plane");
            }
            agent.report_once().await
        }
        .await;
        round += 1;
        match result {
            Ok(()) => {
                if failures > 0 {
                    tracing::info!(after_failures = failures, "control plane reachable again; journal drained");
                }
                failures = 0;
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e.message(), failures, backlog = agent.backlog(), "report not delivered; kept in the journal");
            }
        }
        // The leader keeps what the next process needs to go on enforcing.
        if let Err(e) = agent.persist().await {
            // Once, then every 20th round: it repeats every round while it lasts.
            let n = agent.state_save_failures();
            if n == 1 || n % 20 == 0 {
                tracing::warn!(
                    error = %e,
                    rounds = n,
                    "could not keep the agent state in the cluster: a restarted or standby agent would start from an older one, and until a save works no newer lease is acknowledged (the control plane keeps counting the older ones, so budgets elsewhere cannot shrink)"
                );
            }
        }
        {
            let st = agent.state();
            let status = st.lease.status(st.now_ms());
            let kind = match status {
                LeaseStatus::None => "none",
                LeaseStatus::Fresh { .. } => "fresh",
                LeaseStatus::Expiring { .. } => "expiring",
                LeaseStatus::Safe => "safe",
            };
            if kind != last_status {
                match status {
                    LeaseStatus::Safe => tracing::warn!(epoch = st.lease.held_epoch(), "lease expired: enforcing safe budgets until the control plane answers"),
                    _ => tracing::info!(epoch = st.lease.held_epoch(), lease = %status, "lease"),
                }
                last_status = kind;
            }
        }
        // Backoff with jitter while failing: every, 2x, 4x ... up to 8x.
        let factor = 1u32 << failures.min(3);
        let jitter = u64::from(std::process::id().wrapping_add(u32::try_from(round % 997).unwrap_or(0))) % 250;
        let wait = every * factor + Duration::from_millis(if failures > 0 { jitter } else { 0 });
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = async { let _ = stop.wait_for(|s| *s).await; } => break,
        }
    }
    let _ = policy.await;
}

/// Fetches the policy every `every` (retrying sooner, with backoff, until the first
/// fetch succeeds); a standby replica keeps it current too, ready to take over.
async fn policy_loop(agent: Arc<Agent>, every: Duration, mut stop: watch::Receiver<bool>) {
    let mut fetched = false;
    let mut failures = 0u32;
    loop {
        match agent.fetch_policy().await {
            Ok(()) => {
                if !fetched {
                    tracing::info!("policy fetched from the control plane");
                }
                fetched = true;
                failures = 0;
            }
            Err(e) => {
                failures += 1;
                tracing::warn!(error = %e.message(), failures, "policy not fetched; the last one known stays in force");
            }
        }
        let wait = if fetched { every } else { Duration::from_millis(250u64 << failures.min(5)) };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
        }
    }
}

/// The simulated cluster: releases gated pods as budget frees (the gate controller),
/// binds admitted pods first-fit by GPUe, finishes them after `run_for`.
async fn simulated_cluster(agent: Arc<Agent>, nodes: Vec<u64>, run_for: Duration, mut stop: watch::Receiver<bool>) {
    let mut free: Vec<u64> = nodes.iter().map(|g| g * 1000).collect();
    let mut running: BTreeMap<String, (usize, u64, u64)> = BTreeMap::new();
    let run_ms = u64::try_from(run_for.as_millis()).unwrap_or(u64::MAX);
    loop {
        {
            let mut st = agent.state();
            let now = st.now_ms();
            let done: Vec<String> = running.iter().filter(|(_, r)| r.2 <= now).map(|(k, _)| k.clone()).collect();
            for k in done {
                if let Some((n, g, _)) = running.remove(&k) {
                    if let Some(f) = free.get_mut(n) {
                        *f += g;
                    }
                }
                st.pod_gone(&k);
            }
            let released = st.release_queue();
            if !released.is_empty() {
                tracing::info!(pods = released.len(), "gates removed as budget freed");
            }
            for (key, tenant, gpue) in st.reservations() {
                if running.contains_key(&key) {
                    continue;
                }
                if let Some(n) = free.iter().position(|&f| f >= gpue) {
                    free[n] -= gpue;
                    st.pod_bound(&key, PodRec { tenant: Some(tenant), gpue });
                    running.insert(key, (n, gpue, now.saturating_add(run_ms)));
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
        }
    }
}

pub(crate) async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_groups_parse_and_bad_ones_are_explained() {
        assert_eq!(parse_nodes("2x8,1x4").expect("ok"), vec![8, 8, 4]);
        for bad in ["", "8", "0x8", "2x0", "axb", "2x100"] {
            assert!(parse_nodes(bad).is_err(), "{bad}");
        }
    }
}
