//! The agent's runtime: what `kvota agent` runs. [`Config`] says what; [`serve_simulated`]
//! runs the agent against a simulated cluster, [`kubernetes::serve`] against a Kubernetes
//! cluster. Both serve the webhook ([`start_webhook`]) and run the report loop
//! ([`report_loop`], with the policy fetched beside it); the Kubernetes mode adds the
//! inventory's watchers, the controller and the leader election. The flags are the
//! agent's own ([`AgentOptions`]); the `kvota` binary flattens them into its `agent`
//! command, checks them and builds the [`Config`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use kvota_fairness::lease::LeaseStatus;
use kvota_fairness::resources::NVIDIA_GPU;
use tokio::sync::watch;

use crate::agent::Agent;
use crate::metrics::AgentMetrics;
use crate::persist::{FileStore, StateStore};
use crate::state::PodRec;
use crate::webhook::{self, WebhookCtx, WebhookTls};
use kvota_fairness::names::ClusterName;

pub mod kubernetes;
mod options;

pub use options::AgentOptions;

/// What to run: the options of `kvota agent`, checked, and what the binary derives
/// from them and from its shared `--cp*` flags.
#[derive(Clone, Debug)]
pub struct Config {
    /// This member cluster's id (`options.cluster`, parsed).
    pub cluster: ClusterName,
    /// The control plane's gRPC addresses (any nodes).
    pub cp_addrs: Vec<String>,
    /// Connection limits of the webhook port (sized to the open-files limit:
    /// `kvota_tls::listen::fit_to_file_limit`).
    pub webhook_limits: kvota_tls::Limits,
    /// The options as given.
    pub options: AgentOptions,
}

/// Runs the agent against a simulated cluster of `nodes` (GPUs per node) until Ctrl-C or
/// SIGTERM.
pub async fn serve_simulated(args: Config, nodes: Vec<u64>, tls: WebhookTls) -> Result<()> {
    let capacity: BTreeMap<String, u64> = [(NVIDIA_GPU.to_string(), nodes.iter().sum::<u64>() * 1000)].into();
    let store: Arc<dyn StateStore> = Arc::new(FileStore::in_dir(&args.options.data_dir));
    let (agent, stop_tx, stop, server) = start_webhook(&args, capacity, tls, None, store).await?;
    agent.starts_reporting();
    tracing::info!(
        "kvota agent: cluster {} ({} GPUs simulated on {} nodes), webhook https://{} (/validate, /mutate), control plane {}; Ctrl-C to stop",
        args.cluster,
        nodes.iter().sum::<u64>(),
        nodes.len(),
        args.options.webhook_listen,
        args.cp_addrs.join(",")
    );
    let leading = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let reporter = tokio::spawn(report_loop(
        agent.clone(),
        Duration::from_millis(args.options.report_interval_ms),
        leading,
        stop.clone(),
    ));
    let sim = tokio::spawn(simulated_cluster(
        agent.clone(),
        nodes,
        Duration::from_secs(args.options.simulate_pod_seconds),
        stop,
    ));
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
pub async fn start_webhook(
    args: &Config,
    capacity: BTreeMap<String, u64>,
    tls: WebhookTls,
    held: Option<String>,
    store: Arc<dyn StateStore>,
) -> Result<(
    Arc<Agent>,
    watch::Sender<bool>,
    watch::Receiver<bool>,
    tokio::task::JoinHandle<()>,
)> {
    let agent = Arc::new(
        Agent::open_with_tls(
            &args.cluster,
            capacity,
            &args.options.data_dir,
            &args.cp_addrs,
            tls.federation.clone().map(kvota_client::tls::GrpcTls::from_source),
        )
        .map_err(|e| {
            anyhow::anyhow!(
                "open the agent's data directory {}: {}",
                args.options.data_dir.display(),
                e
            )
        })?,
    );
    agent.state().set_held(held);
    // What the last leader kept: enforcement goes on at once, before the control plane
    // answers (a restart or a takeover during a partition).
    agent.set_state_store(store.clone(), &replica_identity(args));
    restore_kept_state(&agent, store.as_ref()).await;
    let listener = tokio::net::TcpListener::bind(&args.options.webhook_listen)
        .await
        .map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::AddrInUse {
                "; another process uses it: pick another --webhook-listen"
            } else {
                ""
            };
            anyhow::anyhow!("listen for the webhook on {}: {e}{hint}", args.options.webhook_listen)
        })?;
    let metrics = AgentMetrics::new();
    let (stop_tx, stop) = watch::channel(false);
    // The federation certificate (to the control plane, and trusted on the webhook's
    // read routes) is reread when its files change, like the webhook's own.
    if let Some(f) = tls.federation.clone() {
        let (m, source) = (metrics.clone(), f.clone());
        m.certificate("client", &source);
        tokio::spawn(f.watch(
            "federation certificate",
            move |ok| {
                m.tls_reload(ok);
                m.certificate("client", &source);
            },
            stop.clone(),
        ));
    }
    let ctx = WebhookCtx::with_tls(agent.clone(), metrics.clone(), &tls);
    ctx.set_admission_hold(Duration::from_millis(args.options.admission_hold_ms));
    let app = webhook::router(ctx);
    let limits = args.webhook_limits.clone();
    metrics.connection_limits(kvota_tls::listen::file_limit(), limits.max_connections);
    let server = tokio::spawn(webhook::serve_tls(listener, tls, app, metrics, limits, stop.clone()));
    Ok((agent, stop_tx, stop, server))
}

/// Restores what the last leader kept, and says what is enforced until the control
/// plane answers.
async fn restore_kept_state(agent: &Agent, store: &dyn StateStore) {
    match agent.restore().await {
        Ok(Some(s)) => tracing::info!(
            store = %store.describe(),
            writer = %s.writer,
            epoch = s.lease.as_ref().map_or(0, |l| l.epoch),
            policy = s.policy.as_ref().map(|p| p.name.clone()).unwrap_or_default(),
            "enforcing the policy and lease kept in the cluster until the control plane answers"
        ),
        Ok(None) => {
            tracing::info!(store = %store.describe(), "no agent state kept yet: every budget is 0 (GPU pods refused) until the control plane answers")
        }
        Err(e) => {
            tracing::warn!(error = %e, "agent state not used (left as it is for a person to look at); enforcing the fallback budgets of the lease in this replica's journal, if any, else 0, until the control plane answers")
        }
    }
}

/// This replica's name (the pod's, or host and process).
pub fn replica_identity(args: &Config) -> String {
    args.options.identity.clone().unwrap_or_else(|| {
        format!(
            "{}-{}",
            std::env::var("HOSTNAME").unwrap_or_else(|_| "agent".into()),
            std::process::id()
        )
    })
}

/// How soon after a report round one brought forward by waiting demand may start: a
/// fifth of the interval, at least 100 ms (so a flood of denials costs at most five
/// reports per interval).
pub fn early_gap(every: Duration) -> Duration {
    (every / 5).max(Duration::from_millis(100))
}

/// Registers, fetches the policy, then reports every `every` (sooner when a pod is denied
/// or queued, see [`early_gap`]); retries with backoff and jitter, and logs what a person
/// on call needs: lease changes, expiry, backlog. A standby replica (`leading` false)
/// reports nothing and keeps readings of what it meters, so that on taking over it
/// reports what the old leader did not.
pub async fn report_loop(
    agent: Arc<Agent>,
    every: Duration,
    leading: Arc<std::sync::atomic::AtomicBool>,
    mut stop: watch::Receiver<bool>,
) {
    // The policy is fetched on its own: a fetch that hangs on an unreachable control
    // plane (up to every attempt's deadline) must not hold back the journal write that
    // starts each report round (a real-fault test caught a cut with nothing journaled).
    agent.policy_watch().set_interval(every);
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
        let started = tokio::time::Instant::now();
        let result = async {
            if !registered {
                agent.register().await?;
                registered = true;
                tracing::info!(cluster = %agent.cluster(), "registered with the control plane");
            }
            agent.report_once().await
        }
        .await;
        round += 1;
        log_round(&agent, &result, failures);
        failures = crate::round::failures_after(&result, failures);
        persist_state(&agent).await;
        last_status = log_lease_change(&agent, last_status);
        // Backoff with jitter while failing (`round::next_round_in_ms`). While reports
        // get through, a pod denied or queued here (demand the control plane has not
        // seen) brings the next round forward, to no sooner than a fifth of the interval
        // after this one: a tenant without budget here gets one within a round trip.
        let jitter = u64::from(std::process::id().wrapping_add(u32::try_from(round % 997).unwrap_or(0))) % 250;
        let every_ms = u64::try_from(every.as_millis()).unwrap_or(u64::MAX);
        let wait = Duration::from_millis(crate::round::next_round_in_ms(every_ms, failures, jitter));
        let next = async {
            if failures == 0 {
                agent.next_round(started, every, early_gap(every)).await;
            } else {
                tokio::time::sleep(wait).await;
            }
        };
        tokio::select! {
            _ = next => {}
            _ = async { let _ = stop.wait_for(|s| *s).await; } => break,
        }
    }
    let _ = policy.await;
}

/// Logs a round's outcome (`failures`: rounds failed in a row before it).
fn log_round(agent: &Agent, result: &Result<(), crate::round::RoundError>, failures: u32) {
    match result {
        Ok(()) if failures > 0 => tracing::info!(
            after_failures = failures,
            "control plane reachable again; journal drained"
        ),
        Ok(()) => {}
        // Already logged by the round, with what it keeps for the next one.
        Err(e) if !e.backs_off() => {}
        Err(e) => {
            tracing::warn!(error = %e, failures = failures + 1, backlog = agent.backlog(), "report not delivered; kept in the journal")
        }
    }
}

/// The leader keeps what the next process needs to go on enforcing.
async fn persist_state(agent: &Agent) {
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
}

/// Logs the lease's status when its kind changed from `last` (`none`, `fresh`,
/// `expiring`, `safe`); returns the kind now.
fn log_lease_change(agent: &Agent, last: &'static str) -> &'static str {
    let st = agent.state();
    let status = st.lease.status(st.now_ms());
    let kind = match status {
        LeaseStatus::None => "none",
        LeaseStatus::Fresh { .. } => "fresh",
        LeaseStatus::Expiring { .. } => "expiring",
        LeaseStatus::Safe => "safe",
    };
    if kind != last {
        match status {
            LeaseStatus::Safe => tracing::warn!(
                epoch = st.lease.held_epoch(),
                "lease expired: enforcing safe budgets until the control plane answers"
            ),
            _ => tracing::info!(epoch = st.lease.held_epoch(), lease = %status, "lease"),
        }
    }
    kind
}

/// Fetches the policy every `every` (retrying sooner, with backoff, until the first
/// fetch succeeds), and at once when a control-plane answer names a newer revision than
/// the one in force ([`crate::revision::PolicyWatch`]); a standby replica keeps it
/// current too, ready to take over.
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
                tracing::warn!(error = %e, failures, "policy not fetched; the last one known stays in force");
            }
        }
        let wait = if !fetched {
            Duration::from_millis(250u64 << failures.min(5))
        } else if failures == 0 && agent.policy_watch().behind() {
            // The node that answered has not applied the newer policy yet: soon again.
            Duration::from_millis(250)
        } else {
            every
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            // A newer revision is in force: fetch now (after a failure, not sooner than
            // the backoff allows, unless no policy was ever fetched: an answer naming a
            // revision says the control plane is reachable and now has one, so a cluster
            // started before the policy was applied does not sit out its backoff).
            _ = agent.policy_watch().fetch_due(), if failures == 0 || !fetched => {}
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
        }
    }
}

/// The simulated cluster: releases gated pods as budget frees (the gate controller),
/// binds admitted pods first-fit by GPUe, finishes them after `run_for`.
async fn simulated_cluster(agent: Arc<Agent>, nodes: Vec<u64>, run_for: Duration, mut stop: watch::Receiver<bool>) {
    let mut free: Vec<u64> = nodes.iter().map(|g| g * 1000).collect();
    let mut running: BTreeMap<kvota_fairness::names::PodKey, (usize, u64, u64)> = BTreeMap::new();
    let run_ms = u64::try_from(run_for.as_millis()).unwrap_or(u64::MAX);
    loop {
        {
            let mut st = agent.state();
            let now = st.now_ms();
            let done: Vec<kvota_fairness::names::PodKey> = running
                .iter()
                .filter(|(_, r)| r.2 <= now)
                .map(|(k, _)| k.clone())
                .collect();
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
            for r in &released {
                st.note_wait(&r.tenant, r.queued_at_ms);
            }
            for (key, tenant, gpue) in st.reservations() {
                if running.contains_key(&key) {
                    continue;
                }
                if let Some(n) = free.iter().position(|&f| f >= gpue) {
                    free[n] -= gpue;
                    st.pod_bound(
                        &key,
                        PodRec {
                            tenant: Some(tenant),
                            gpue,
                        },
                    );
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

/// Returns on Ctrl-C or SIGTERM.
pub async fn wait_for_signal() {
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
