//! The agent against a Kubernetes cluster: the inventory from kube-rs watchers, the gate
//! controller and reclaim through the API, and (with a leader Lease) leader election
//! among replicas. The pieces live in [`crate::kube`]; this file runs them as loops next
//! to the webhook and the reporter.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::agent::Agent;
use crate::agent::History;
use crate::inventory::Inventory;
use crate::kube::{
    actions_config, ConfigMapStore, Controller, Election, KubeActions, KubeInventory, RoleMarker, ROLE_LABEL,
};
use crate::webhook::WebhookTls;
use anyhow::{Context, Result};
use tokio::sync::watch;

use super::{report_loop, start_webhook, wait_for_signal, Config};

/// How often the controller syncs state and releases gates.
const SYNC_EVERY: Duration = Duration::from_secs(1);
/// How often reclaim runs (its own damping limits evictions further).
const RECLAIM_EVERY: Duration = Duration::from_secs(5);

async fn kube_config(args: &Config) -> Result<kube::Config> {
    match &args.options.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("--kubeconfig {}: cannot read it as a kubeconfig", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("--kubeconfig {}: no usable context", path.display()))
        }
        None => kube::Config::infer().await.context(
            "no Kubernetes configuration found (not in a pod, no $KUBECONFIG or ~/.kube/config): pass --kubeconfig, \
             or run against a simulated cluster with --simulate NODES (e.g. --simulate 4x8)",
        ),
    }
}

/// Runs the agent against the Kubernetes cluster until Ctrl-C or SIGTERM.
pub async fn serve(args: Config, tls: WebhookTls) -> Result<()> {
    let config = kube_config(&args).await?;
    let server_url = config.cluster_url.to_string();
    let watch_client = kube::Client::try_from(config.clone()).context("build the Kubernetes client")?;
    let action_client = kube::Client::try_from(actions_config(config)).context("build the Kubernetes client")?;
    let held = Some("the agent has not listed the cluster's nodes and pods yet".to_string());
    let store: Arc<dyn crate::persist::StateStore> = Arc::new(ConfigMapStore::new(
        action_client.clone(),
        &args.options.leader_lease_namespace,
        &args.options.state_configmap,
    ));
    let (agent, stop_tx, stop, server) = start_webhook(&args, BTreeMap::new(), tls, held, store).await?;

    let clock = agent.clone();
    let inventory = KubeInventory::new(Arc::new(move || clock.now_ms()));
    recover_history_from_pods(&agent, &inventory);
    let watchers = tokio::spawn(inventory.clone().run(watch_client.clone(), stop.clone()));
    tracing::info!(
        "kvota agent: cluster {} on Kubernetes {server_url}, webhook https://{} (/validate, /mutate), control plane {}; {}; Ctrl-C to stop",
        args.cluster,
        args.options.webhook_listen,
        args.cp_addrs.join(","),
        match &args.options.leader_lease {
            Some(l) => format!("replicas elect a leader through Lease {}/{l}", args.options.leader_lease_namespace),
            None => "single replica".to_string(),
        }
    );
    // Nothing is registered before the first listing: the capacity is not known.
    if !first_listing(&inventory, &stop, &server_url).await {
        return Ok(());
    }
    let leading = Arc::new(AtomicBool::new(args.options.leader_lease.is_none()));
    if args.options.leader_lease.is_none() {
        agent.starts_reporting();
    }
    if args.options.leader_lease.is_some() {
        let mut st = agent.state();
        st.set_held(Some(
            "this agent replica is a standby until it wins the leader Lease".into(),
        ));
        st.set_standby(true);
    }
    let elector = args
        .options
        .leader_lease
        .clone()
        .map(|name| start_election(&args, &name, &watch_client, &agent, &leading, &stop));
    let mut controller = Controller::new(inventory.clone(), KubeActions::new(action_client, "kvota-agent"));
    // The first sync before the first report: it sets the capacity listed, which the
    // registration carries (the control loop and the reporter start together, and a
    // registration ahead of the loop's first sync announced 0 GPUs).
    controller.sync(&agent);
    let control = tokio::spawn(control_loop(controller, agent.clone(), leading.clone(), stop.clone()));
    let reporter = tokio::spawn(report_loop(
        agent.clone(),
        Duration::from_millis(args.options.report_interval_ms),
        leading,
        stop,
    ));
    wait_for_signal().await;
    tracing::info!("kvota agent: stopping");
    let _ = stop_tx.send(true);
    let mut tasks = vec![server, watchers, control, reporter];
    tasks.extend(elector);
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    Ok(())
}

/// Usage no agent process metered (all replicas down, or a new leader that started
/// after the old one's last report) is recovered from the pods' run times.
fn recover_history_from_pods(agent: &Arc<Agent>, inventory: &Arc<KubeInventory>) {
    let (inv, a) = (inventory.clone(), Arc::downgrade(agent));
    agent.set_history(History(Arc::new(move |from, to| {
        let Some(a) = a.upgrade() else { return BTreeMap::new() };
        inv.usage_between(from, to, |ns| a.state().tenant_of_namespace(ns))
    })));
}

/// Waits for the inventory's first listing; false if stopped first.
async fn first_listing(inventory: &KubeInventory, stop: &watch::Receiver<bool>, server_url: &str) -> bool {
    let mut waited = 0u32;
    while !inventory.synced() {
        tokio::time::sleep(Duration::from_millis(200)).await;
        waited += 1;
        if waited % 50 == 0 {
            tracing::warn!("still waiting for the first listing of nodes, pods and namespaces from {server_url}");
        }
        if *stop.borrow() {
            return false;
        }
    }
    true
}

/// Starts the election on Lease `name` (and the pod's role label, if the pod's name is
/// known).
fn start_election(
    args: &Config,
    name: &str,
    watch_client: &kube::Client,
    agent: &Arc<Agent>,
    leading: &Arc<AtomicBool>,
    stop: &watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let identity = args.options.identity.clone().unwrap_or_else(|| {
        format!(
            "{}-{}",
            std::env::var("HOSTNAME").unwrap_or_else(|_| "agent".into()),
            std::process::id()
        )
    });
    // The pod's role label steers the webhook Service to the leader; it needs the
    // pod's own name (POD_NAME from the downward API).
    let marker = match &args.options.identity {
        Some(pod) => Some(RoleMarker::new(
            watch_client.clone(),
            &args.options.leader_lease_namespace,
            pod,
        )),
        None => {
            tracing::warn!("no --identity/POD_NAME: this replica cannot label its pod with its role ({ROLE_LABEL}); a Service selecting the leader by that label will not find it");
            None
        }
    };
    let e = Election::new(
        watch_client.clone(),
        &args.options.leader_lease_namespace,
        name,
        &identity,
        Duration::from_secs(15),
    );
    tokio::spawn(election_loop(e, marker, agent.clone(), leading.clone(), stop.clone()))
}

/// Syncs the state every second; the leader also releases gates and reclaims.
/// Each round runs in a `controller` span (the cluster, the round's number, whether
/// this replica leads), so what a release or an eviction logs can be told apart by round.
async fn control_loop(mut c: Controller, agent: Arc<Agent>, leading: Arc<AtomicBool>, mut stop: watch::Receiver<bool>) {
    use tracing::Instrument as _;
    let mut last_reclaim = tokio::time::Instant::now();
    let mut round = 0u64;
    loop {
        round += 1;
        let leads = leading.load(Ordering::SeqCst);
        let span = tracing::info_span!("controller", cluster = %agent.cluster(), round, leading = leads);
        async {
            c.sync(&agent);
            if leads {
                let r = c.release_gates(&agent).await;
                if !r.ungated.is_empty() {
                    tracing::info!(pods = r.ungated.len(), "gates removed as budget freed");
                }
                if last_reclaim.elapsed() >= RECLAIM_EVERY {
                    last_reclaim = tokio::time::Instant::now();
                    let _ = c.reclaim(&agent).await;
                }
            }
        }
        .instrument(span)
        .await;
        tokio::select! {
            _ = tokio::time::sleep(SYNC_EVERY) => {}
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
        }
    }
}

/// Keeps the Lease; on every change of role says so, and holds or resumes admission.
/// Each round's role change runs in an `election` span (the Lease, its holder, whether
/// this replica leads).
async fn election_loop(
    mut e: Election,
    marker: Option<RoleMarker>,
    agent: Arc<Agent>,
    leading: Arc<AtomicBool>,
    mut stop: watch::Receiver<bool>,
) {
    use tracing::Instrument as _;
    let mut was = false;
    // The role the pod's label says, once set (retried every round until it is).
    let mut labelled: Option<bool> = None;
    loop {
        let now = match e.step().await {
            Ok(l) => l,
            Err(err) => {
                tracing::warn!(error = %err, "leader Lease not reachable");
                e.is_leader()
            }
        };
        let span = tracing::info_span!(
            "election",
            lease = e.lease_name(),
            holder = e.holder().unwrap_or(""),
            leading = now
        );
        async {
            take_role(&agent, &e, now, was).await;
            if now != was {
                leading.store(now, Ordering::SeqCst);
            }
            if let Some(m) = marker.as_ref().filter(|_| labelled != Some(now)) {
                let r = if now { m.lead().await } else { m.stand_by().await };
                match r {
                    Ok(()) => labelled = Some(now),
                    Err(err) => {
                        tracing::warn!(error = %err, role = if now { "leader" } else { "standby" }, "could not label this pod with its role; retrying")
                    }
                }
            }
        }
        .instrument(span)
        .await;
        was = now;
        let stopping = tokio::select! {
            _ = tokio::time::sleep(e.period()) => false,
            _ = async { let _ = stop.wait_for(|s| *s).await; } => true,
        };
        if stopping {
            step_down(&mut e, marker.as_ref()).await;
            return;
        }
    }
}

/// Acts on the election's outcome: on a change of role says so and holds or resumes
/// admission; a standby keeps saying who leads.
async fn take_role(agent: &Agent, e: &Election, now: bool, was: bool) {
    if now == was {
        if !now {
            let who = e.holder().unwrap_or("nobody yet").to_string();
            agent
                .state()
                .set_held(Some(format!("this agent replica is a standby (the leader is {who})")));
        }
        return;
    }
    if now {
        tracing::info!("this replica leads: it admits, reports, releases gates and reclaims");
        // The old leader's latest lease and policy, so enforcement goes on under
        // the lease it held even while the control plane is unreachable.
        if let Err(e) = agent.restore().await {
            tracing::warn!(error = %e, "taking over without the state the old leader kept");
        }
        agent.took_over();
        let mut st = agent.state();
        st.set_standby(false);
        st.set_held(None);
    } else {
        let who = e.holder().unwrap_or("nobody yet").to_string();
        tracing::info!(leader = %who, "this replica stands by");
        let mut st = agent.state();
        st.set_standby(true);
        st.set_held(Some(format!("this agent replica is a standby (the leader is {who})")));
    }
}

/// On the way out: label the pod standby and give the Lease up.
async fn step_down(e: &mut Election, marker: Option<&RoleMarker>) {
    if let Some(m) = marker {
        if let Err(err) = m.stand_by().await {
            tracing::warn!(error = %err, "could not label this pod standby on the way out");
        }
    }
    if let Err(err) = e.release().await {
        tracing::warn!(error = %err, "could not release the leader Lease; a standby takes over when it lapses");
    }
}
