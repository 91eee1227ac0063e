//! `kvota agent`: one member cluster's agent. This file turns the flags into a
//! [`kvota_member_agent::runtime::Config`] after checking them (and the certificates);
//! the runtime (`kvota_member_agent::runtime`) registers with the control plane,
//! reports usage through its journal, enforces leases and serves the admission webhook
//! over HTTPS, against a Kubernetes cluster or, with `--simulate`, a simulated one.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use kvota_member_agent::runtime::{self, Config};
use kvota_member_agent::webhook::WebhookTls;

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
    /// How long the webhook may hold a pod's first denial for lack of budget,
    /// milliseconds: the denial makes the agent report at once, and if the lease that
    /// comes back gives the tenant room here, the pod is admitted instead of denied (a
    /// tenant's first pod in a cluster gets budget about one control-plane round trip
    /// later). 0 answers at once. At most 4000: keep it well under the webhook's
    /// `timeoutSeconds` (5 in the shipped manifests).
    #[arg(long, env = "KVOTA_ADMISSION_HOLD_MS", default_value_t = 2_000)]
    pub(crate) admission_hold_ms: u64,
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
    let Ok(cluster) = kvota_fairness::names::ClusterName::parse(args.cluster.as_str()) else {
        bail!("--cluster `{}`: use {}", args.cluster, kvota_fairness::names::DNS_LABEL_RULE);
    };
    if args.report_interval_ms < 100 {
        bail!("--report-interval-ms {}: at least 100", args.report_interval_ms);
    }
    let max_hold = kvota_member_agent::webhook::MAX_ADMISSION_HOLD.as_millis();
    if u128::from(args.admission_hold_ms) > max_hold {
        bail!(
            "--admission-hold-ms {}: at most {max_hold} (the API server stops waiting for the webhook after its timeoutSeconds, 5 in the shipped manifests); 0 turns holding off",
            args.admission_hold_ms
        );
    }
    let gap = kvota_member_agent::runtime::early_gap(std::time::Duration::from_millis(args.report_interval_ms));
    if args.admission_hold_ms > 0 && gap.as_millis() >= u128::from(args.admission_hold_ms) {
        tracing::warn!(
            admission_hold_ms = args.admission_hold_ms,
            early_report_gap_ms = u64::try_from(gap.as_millis()).unwrap_or(u64::MAX),
            "an early report comes no sooner than a fifth of --report-interval-ms after the last one, which is longer than --admission-hold-ms: held first denials will time out; lower the interval or raise the hold"
        );
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
    crate::journal_v0::migrate(&args.data_dir)
        .map_err(|e| anyhow::anyhow!("migrate the usage journal in {}: {e}", args.data_dir.display()))?;
    let config = Config {
        cluster,
        cp_addrs: cp.addrs.clone(),
        data_dir: args.data_dir,
        webhook_listen: args.webhook_listen,
        webhook_max_connections_per_peer: args.webhook_max_connections_per_peer,
        report_interval_ms: args.report_interval_ms,
        admission_hold_ms: args.admission_hold_ms,
        kubeconfig: args.kubeconfig,
        leader_lease: args.leader_lease,
        leader_lease_namespace: args.leader_lease_namespace,
        identity: args.identity,
        state_configmap: args.state_configmap,
        simulate_pod_seconds: args.simulate_pod_seconds,
    };
    match nodes {
        Some(nodes) => rt.block_on(runtime::serve_simulated(config, nodes, tls)),
        None => rt.block_on(runtime::kubernetes::serve(config, tls)),
    }
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
