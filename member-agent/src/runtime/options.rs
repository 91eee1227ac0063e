//! The member agent's command-line options.

use std::path::PathBuf;

/// The agent's options, as `kvota agent` takes them (each with its environment
/// variable): the binary flattens this struct into its command, and [`super::Config`]
/// carries it to the runtime.
#[derive(Clone, Debug, clap::Args)]
pub struct AgentOptions {
    /// This member cluster's id (a DNS label: 1-63 lowercase letters, digits and '-'), unique in the federation.
    #[arg(long, env = "KVOTA_CLUSTER")]
    pub cluster: String,
    /// Directory for the usage journal and the last lease (created if missing). Keep it
    /// on durable storage: unacknowledged usage is resent from it after a restart.
    #[arg(long, env = "KVOTA_AGENT_DATA_DIR", default_value = "./kvota-agent")]
    pub data_dir: PathBuf,
    /// Address the HTTPS admission webhook listens on (/validate, /mutate, /healthz,
    /// /readyz, /metrics).
    #[arg(long, env = "KVOTA_WEBHOOK_LISTEN", default_value = "0.0.0.0:8443")]
    pub webhook_listen: String,
    /// PEM certificate chain of the webhook (reread when the file changes).
    #[arg(long, env = "KVOTA_TLS_CERT")]
    pub tls_cert: PathBuf,
    /// PEM private key of the webhook (reread when the file changes).
    #[arg(long, env = "KVOTA_TLS_KEY")]
    pub tls_key: PathBuf,
    /// PEM bundle of the CA that signs the Kubernetes API server's client certificate
    /// for webhooks (its AdmissionConfiguration's kubeconfig): with it, /validate and
    /// /mutate answer only the API server, and a forged review from anything else in
    /// the cluster is refused. Reread when the file changes.
    #[arg(long, env = "KVOTA_WEBHOOK_CLIENT_CA", value_name = "FILE")]
    pub webhook_client_ca: Option<PathBuf>,
    /// Connections one address may hold open on the webhook port at once (the API
    /// server keeps a pool per instance; anything else gets far fewer in practice).
    #[arg(long, env = "KVOTA_WEBHOOK_MAX_CONNECTIONS_PER_PEER", default_value_t = 512)]
    pub webhook_max_connections_per_peer: usize,
    /// How often usage is reported (each report also renews the lease), milliseconds.
    /// Keep it well under the policy's lease duration (default 30 s).
    #[arg(long, env = "KVOTA_REPORT_INTERVAL_MS", default_value_t = 5_000)]
    pub report_interval_ms: u64,
    /// How long the webhook may hold a pod's first denial for lack of budget,
    /// milliseconds: the denial makes the agent report at once, and if the lease that
    /// comes back gives the tenant room here, the pod is admitted instead of denied (a
    /// tenant's first pod in a cluster gets budget about one control-plane round trip
    /// later). 0 answers at once. At most 4000: keep it well under the webhook's
    /// `timeoutSeconds` (5 in the shipped manifests).
    #[arg(long, env = "KVOTA_ADMISSION_HOLD_MS", default_value_t = 2_000)]
    pub admission_hold_ms: u64,
    /// Run against a simulated cluster instead of Kubernetes: node groups COUNTxGPUS,
    /// comma separated, e.g. `4x8,2x4`.
    #[arg(long, value_name = "NODES")]
    pub simulate: Option<String>,
    /// Kubeconfig of the member cluster. Default: the in-cluster service account when
    /// running in a pod, else $KUBECONFIG or ~/.kube/config.
    #[arg(long, env = "KVOTA_KUBECONFIG", conflicts_with = "simulate")]
    pub kubeconfig: Option<PathBuf>,
    /// Run several replicas safely: only the holder of this coordination.k8s.io Lease
    /// admits, reports, releases gates and reclaims; the others stand by (not ready).
    /// Without it this agent assumes it is the only replica.
    #[arg(long, env = "KVOTA_LEADER_LEASE", value_name = "NAME", conflicts_with = "simulate")]
    pub leader_lease: Option<String>,
    /// Namespace of the leader Lease (usually the agent's own).
    #[arg(long, env = "POD_NAMESPACE", default_value = "kvota-system")]
    pub leader_lease_namespace: String,
    /// This replica's identity in the Lease (usually the pod name). Default: host name
    /// and process id.
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// ConfigMap (in --leader-lease-namespace) where the leader keeps what a restarted or
    /// standby agent needs to go on enforcing at once: the policy, the lease and its
    /// remaining life, how far usage is counted. Without Kubernetes (--simulate), a file
    /// in --data-dir. If you change the name, change it in the agent's RBAC Role too
    /// (deploy/kubernetes/agent/10-rbac.yaml: resourceNames).
    #[arg(long, env = "KVOTA_STATE_CONFIGMAP", default_value = "kvota-agent-state")]
    pub state_configmap: String,
    /// How long a simulated pod runs once bound, seconds.
    #[arg(long, default_value_t = 600)]
    pub simulate_pod_seconds: u64,
}
