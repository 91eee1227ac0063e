//! Operator commands against a running control plane: `status`, `policy apply|get`,
//! `tenants`, `clusters`, `explain tenant`, `audit`, `members ...`, `cluster remove`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use kvota_client::client::Client;
use kvota_fairness::units::{format_duration_ms, format_gpue};
use kvota_fairness::federation::{Command, Federation, TenantReport, UsageReport};
use kvota_fairness::policy::Policy;
use kvota_fairness::names::TenantName;
use kvota_proto::v1;

/// Where the control plane is.
#[derive(Debug, Args, Clone)]
pub struct Cp {
    /// Control-plane gRPC addresses (any nodes; the client follows the leader), comma
    /// separated.
    #[arg(long = "cp", env = "KVOTA_CONTROL_PLANE", value_delimiter = ',', default_value = "127.0.0.1:7401", global = true)]
    pub addrs: Vec<String>,
    /// PEM file with the CA the control plane's certificates chain to: talk to it over
    /// mutual TLS (with --cp-cert and --cp-key; servers started with --tls-*).
    #[arg(long, env = "KVOTA_CP_CA", value_name = "FILE", global = true)]
    pub cp_ca: Option<PathBuf>,
    /// PEM certificate to present to the control plane (signed by that CA).
    #[arg(long, env = "KVOTA_CP_CERT", value_name = "FILE", global = true)]
    pub cp_cert: Option<PathBuf>,
    /// PEM private key of --cp-cert.
    #[arg(long, env = "KVOTA_CP_KEY", value_name = "FILE", global = true)]
    pub cp_key: Option<PathBuf>,
}

impl Cp {
    /// The mutual-TLS settings: all three files, or none (plain text).
    pub fn tls(&self) -> Result<Option<kvota_client::tls::GrpcTls>> {
        tls_from("--cp", self.cp_ca.as_deref(), self.cp_cert.as_deref(), self.cp_key.as_deref())
    }
}

/// Reads `<flag>-ca`, `<flag>-cert` and `<flag>-key` if all are given; none: `None`.
pub fn tls_from(
    flag: &str,
    ca: Option<&std::path::Path>,
    cert: Option<&std::path::Path>,
    key: Option<&std::path::Path>,
) -> Result<Option<kvota_client::tls::GrpcTls>> {
    match (ca, cert, key) {
        (None, None, None) => Ok(None),
        (Some(ca), Some(cert), Some(key)) => kvota_client::tls::GrpcTls::from_files(ca, cert, key)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("{e}")),
        _ => {
            let missing: Vec<String> = [("ca", ca.is_none()), ("cert", cert.is_none()), ("key", key.is_none())]
                .iter()
                .filter(|(_, m)| *m)
                .map(|(n, _)| format!("{flag}-{n}"))
                .collect();
            anyhow::bail!("mutual TLS needs {flag}-ca, {flag}-cert and {flag}-key together; missing: {}", missing.join(", "))
        }
    }
}

/// `kvota members ...`
#[derive(Debug, Subcommand)]
pub enum MembersCmd {
    /// List the control plane's members: id, voter or learner, which one leads, and
    /// their gRPC, Raft and HTTP addresses, as the answering node knows them.
    List {
        /// JSON and YAML: an array of {id, voter, leader, rpc, raft, http}, the
        /// `members` of `/api/v1/status`.
        #[command(flatten)]
        out: OutputArg,
    },
    /// Initialize a new group from a node that started without --init. Give every
    /// initial member, including that node. With TLS, each other member must answer at
    /// its Raft address with its own node certificate.
    Init {
        /// ID=GRPC_ADDR,HTTP_ADDR,RAFT_ADDR; repeat for each member.
        #[arg(long = "member", value_name = "ID=GRPC,HTTP,RAFT", required = true)]
        members: Vec<String>,
    },
    /// Add a node as a learner (it receives the log but does not vote). Then waits, up
    /// to --wait, until the node says it has caught up (it has applied what the leader
    /// had: its /readyz), printing its progress. With TLS, the leader first checks that
    /// the Raft address answers with the certificate of node --id.
    AddLearner {
        /// The new node's id.
        #[arg(long)]
        id: u64,
        /// Its gRPC API address.
        #[arg(long)]
        rpc: String,
        /// Its Raft address (its --advertise-raft).
        #[arg(long)]
        raft: String,
        /// Its HTTP address.
        #[arg(long, default_value = "")]
        http: String,
        /// How long to wait for the node to catch up, in seconds (0: do not wait). A
        /// new node of a large federation is sent a snapshot of the whole state first.
        #[arg(long, value_name = "SECONDS", default_value_t = 600)]
        wait: u64,
    },
    /// Set the voters (promote learners, demote or remove voters).
    SetVoters {
        /// Node ids of the new voter set, comma separated.
        #[arg(long, value_delimiter = ',', required = true)]
        voters: Vec<u64>,
        /// Keep nodes dropped from the voter set as learners instead of removing them.
        #[arg(long)]
        keep_as_learners: bool,
    },
}

/// `kvota explain ...`
#[derive(Debug, Subcommand)]
pub enum ExplainCmd {
    /// Every number behind a tenant's entitlement and budgets.
    Tenant {
        /// Tenant name.
        name: String,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Why a pod was admitted, queued or denied. Agents send their decisions about GPU
    /// pods to the control plane with their usage reports, so any node answers (the
    /// last 512 decisions per cluster are kept); without a reported decision, the
    /// numbers of the pod's tenant. With --agent and --agent-ca, the agent itself
    /// answers, also with where the pod stands now.
    Pod {
        /// NAMESPACE/NAME, as in the denial or queue message.
        pod: String,
        /// Only the decision of this member cluster's agent (default: every cluster's).
        #[arg(long, value_name = "CLUSTER", conflicts_with = "agent")]
        cluster: Option<String>,
        /// The agent's webhook address, e.g. https://kvota-agent.kvota-system.svc:443 or,
        /// through `kubectl -n kvota-system port-forward svc/kvota-agent 8443:443`,
        /// https://localhost:8443 (with --agent-tls-name).
        #[arg(long, env = "KVOTA_AGENT", value_name = "URL")]
        agent: Option<String>,
        /// PEM file with the CA the agent's serving certificate chains to (the webhook's
        /// caBundle).
        #[arg(long, env = "KVOTA_AGENT_CA", value_name = "FILE", requires = "agent")]
        agent_ca: Option<std::path::PathBuf>,
        /// Name to verify the agent's certificate for (default: the host in --agent).
        #[arg(long, value_name = "NAME", requires = "agent")]
        agent_tls_name: Option<String>,
        /// JSON and YAML: the agent's answer with --agent; else the reported decisions,
        /// `{kept, decisions: [{cluster, pod, tenant, verdict, gpus, at_ms, text}]}`, as
        /// the HTTP API's `/api/v1/decisions` answers.
        #[command(flatten)]
        out: OutputArg,
    },
}

/// How a read command prints its answer (`-o`): `json` and `yaml` are the HTTP API's
/// schema (`kvota_control_plane::view`), the same whoever asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// For people: aligned columns or sentences.
    Table,
    /// One JSON document, as the HTTP API answers.
    Json,
    /// The same as YAML.
    Yaml,
}

/// `-o table|json|yaml` (and the older `--json`).
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct OutputArg {
    /// Output: table (for people), json or yaml (the HTTP API's schema).
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    output: Output,
    /// The same as `-o json`.
    #[arg(long, hide = true)]
    json: bool,
}

impl OutputArg {
    /// The format asked for.
    pub fn format(&self) -> Output {
        if self.json {
            Output::Json
        } else {
            self.output
        }
    }

    /// Prints `v` as JSON or YAML and says so (`true`); `false`: print a table.
    fn print<T: serde::Serialize>(&self, v: &T) -> Result<bool> {
        match self.format() {
            Output::Table => Ok(false),
            Output::Json => {
                out!("{}", serde_json::to_string_pretty(v).context("encode JSON")?);
                Ok(true)
            }
            Output::Yaml => {
                outp!("{}", yaml(v)?);
                Ok(true)
            }
        }
    }
}

/// `v` as YAML with the JSON document's shape: through a JSON value, so an enum is a
/// map as in the JSON (not a YAML tag) and both outputs read the same.
fn yaml<T: serde::Serialize>(v: &T) -> Result<String> {
    let doc = serde_json::to_value(v).context("encode")?;
    serde_yaml_ng::to_string(&doc).context("encode YAML")
}

fn client(cp: &Cp) -> Result<Client> {
    Client::with_tls(&cp.addrs, cp.tls()?).map_err(|e| anyhow::anyhow!("{}", e.message()))
}

fn rt() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")
}

fn status_err(cp: &Cp, e: tonic::Status) -> anyhow::Error {
    // The transport's own words, down the source chain (TLS alerts are in there).
    let mut detail = e.message().to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let text = s.to_string();
        if !detail.contains(&text) {
            detail = format!("{detail}: {text}");
        }
        source = s.source();
    }
    // Not an answer from a server but the connection failing: refused, timed out, or a
    // peer that does not speak the same protocol (plain text against TLS: an h2 error).
    let transport = matches!(e.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded)
        || e.message().starts_with("h2 protocol error")
        || e.message().starts_with("transport error");
    let tls_hint = if cp.cp_ca.is_some() {
        "\n  (with TLS: --cp-ca must be the CA that signed the servers' certificates, their names must include the host in --cp, and --cp-cert must be signed by the CA the servers trust)"
    } else {
        "\n  (if the servers use mutual TLS (`kvota server --tls-*`), give --cp-ca, --cp-cert and --cp-key)"
    };
    match e.code() {
        _ if transport => anyhow::anyhow!(
            "control plane at {} is unavailable: {detail}\n  (is `kvota server` running there? set --cp or KVOTA_CONTROL_PLANE){tls_hint}",
            cp.addrs.join(","),
        ),
        _ => anyhow::anyhow!("{}", e.message()),
    }
}

fn pct_bp(bp: u32) -> String {
    if bp % 100 == 0 { format!("{}%", bp / 100) } else { format!("{}.{:02}%", bp / 100, bp % 100) }
}

/// `kvota status`
pub fn status(cp: &Cp, o: OutputArg) -> Result<()> {
    let c = client(cp)?;
    let s = rt()?
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    if o.print(&kvota_control_plane::view::StatusView::from(&s))? {
        return Ok(());
    }
    out!("node {} is {} (term {}){}", s.node_id, s.role, s.term, if s.ready { "" } else { ", not ready" });
    if s.leader_id == 0 {
        out!("leader: none known (election in progress or no quorum)");
    } else {
        out!("leader: node {} at {}", s.leader_id, s.leader_rpc_addr);
    }
    out!("log: last index {}, applied {}", s.last_log_index, s.last_applied_index);
    if s.feature_level != 0 {
        out!("feature level: {} (this node supports up to {})", s.feature_level, s.feature_level_max);
    }
    out!(
        "policy: {}; {} member cluster(s)",
        if s.policy.is_empty() { "none (apply one: kvota policy apply FILE)" } else { &s.policy },
        s.clusters
    );
    out!("members:");
    for m in &s.members {
        out!(
            "  {:>3}  {:<8} grpc {:<22} raft {:<22} http {}",
            m.id,
            if m.voter { "voter" } else { "learner" },
            m.rpc_addr,
            m.raft_addr,
            m.http_addr
        );
    }
    Ok(())
}

/// `kvota policy apply FILE`
pub fn policy_apply(cp: &Cp, file: &PathBuf) -> Result<std::process::ExitCode> {
    let yaml = std::fs::read_to_string(file).with_context(|| format!("read policy file {}", file.display()))?;
    if let Err(e) = kvota_fairness::policy::Policy::from_yaml(&yaml) {
        eprintln!("{}: {e}", file.display());
        return Ok(std::process::ExitCode::from(2));
    }
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| {
            let yaml = yaml.clone();
            async move { Ok(Client::admin(ch).apply_policy(v1::PolicyRequest { yaml }).await?.into_inner()) }
        }))
        .map_err(|e| status_err(cp, e))?;
    out!("policy `{}` with {} tenants is in force", r.name, r.tenants);
    Ok(std::process::ExitCode::SUCCESS)
}

/// `kvota policy get`
pub fn policy_get(cp: &Cp, o: OutputArg) -> Result<()> {
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    if r.name.is_empty() {
        bail!("no policy is in force; apply one with `kvota policy apply FILE`");
    }
    // Checked before it is printed: what `policy apply` would make of it.
    kvota_fairness::policy::Policy::from_yaml(&r.yaml).map_err(|e| anyhow::anyhow!("the policy from the control plane does not load: {e}"))?;
    if o.format() == Output::Json {
        // The same document as JSON (a YAML reader, `policy apply` among them, reads it).
        let doc: serde_json::Value = serde_yaml_ng::from_str(&r.yaml).context("the policy document")?;
        out!("{}", serde_json::to_string_pretty(&doc).context("encode JSON")?);
    } else {
        outp!("{}", r.yaml);
    }
    Ok(())
}

/// The federation as the control plane reports it (clusters with each tenant's in-use
/// and waiting GPUe, tenants' decayed usage), rebuilt offline under `policy` at `now_ms`:
/// what the fairness core would make of today's state under that policy.
fn rebuilt(policy: &Policy, clusters: &[v1::ClusterInfo], tenants: &[v1::TenantInfo], now_ms: u64) -> Result<Federation> {
    let mut fed = Federation::new();
    fed.apply(now_ms, Command::ApplyPolicy(policy.clone())).map_err(|e| anyhow::anyhow!("apply the policy offline: {e}"))?;
    for (i, c) in clusters.iter().enumerate() {
        use kvota_proto::convert::{cluster_id, tenant_name};
        let capacity = kvota_proto::convert::capacity("capacity", &c.capacity).map_err(|e| anyhow::anyhow!("cluster {}: {e}", c.cluster))?;
        let cluster = cluster_id("cluster", &c.cluster).map_err(|e| anyhow::anyhow!("the control plane's answer: {e}"))?;
        fed.apply(now_ms, Command::RegisterCluster { cluster: cluster.clone(), capacity, labels: BTreeMap::new() })
            .map_err(|e| anyhow::anyhow!("cluster {}: {e}", c.cluster))?;
        let mut report: BTreeMap<TenantName, TenantReport> = c
            .tenants
            .iter()
            .map(|t| {
                let name = tenant_name("tenant", &t.tenant).map_err(|e| anyhow::anyhow!("cluster {}: {e}", c.cluster))?;
                Ok((name, TenantReport { used_milli_gpue_ms: 0, inuse: t.inuse_milli_gpue, pending: t.pending_milli_gpue, largest: 0 }))
            })
            .collect::<Result<_>>()?;
        // The ledger's decayed usage goes in with the first cluster's report.
        if i == 0 {
            for t in tenants {
                let name = tenant_name("tenant", &t.tenant).map_err(|e| anyhow::anyhow!("the control plane's answer: {e}"))?;
                report.entry(name).or_default().used_milli_gpue_ms = t.decayed_usage;
            }
        }
        let r = UsageReport { cluster, seq: 1, held_epoch: 0, capacity: None, tenants: report, evictions: Vec::new(), decisions: Vec::new(), window: None };
        fed.apply(now_ms, Command::Report(r)).map_err(|e| anyhow::anyhow!("cluster {}: {e}", c.cluster))?;
    }
    Ok(fed)
}

/// Target entitlement per tenant under the plan of `fed`.
fn targets(fed: &Federation) -> BTreeMap<TenantName, u64> {
    let plan = fed.plan();
    plan.tenants.iter().cloned().zip(plan.entitlements.iter().map(|e| e.total)).collect()
}

/// Fields that differ between two policies, as `path: old -> new` (tenants by name).
fn policy_changes(old: &Policy, new: &Policy) -> Result<Vec<String>> {
    fn walk(path: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<String>) {
        use serde_json::Value;
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
                for k in keys {
                    let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                    walk(&p, x.get(k).unwrap_or(&Value::Null), y.get(k).unwrap_or(&Value::Null), out);
                }
            }
            _ if a != b => out.push(format!("{path}: {a} -> {b}")),
            _ => {}
        }
    }
    let by_name = |p: &Policy| -> Result<BTreeMap<TenantName, serde_json::Value>> {
        p.tenants.iter().map(|t| Ok((t.name.clone(), serde_json::to_value(t)?))).collect()
    };
    let (mut a, mut b) = (serde_json::to_value(old)?, serde_json::to_value(new)?);
    for v in [&mut a, &mut b] {
        if let Some(o) = v.as_object_mut() {
            o.remove("tenants");
        }
    }
    let mut out = Vec::new();
    walk("", &a, &b, &mut out);
    let (ta, tb) = (by_name(old)?, by_name(new)?);
    for name in ta.keys().chain(tb.keys()).collect::<std::collections::BTreeSet<_>>() {
        match (ta.get(name), tb.get(name)) {
            (Some(x), Some(y)) => walk(&format!("tenants[{name}]"), x, y, &mut out),
            (None, Some(_)) => out.push(format!("tenants[{name}]: added")),
            (Some(_), None) => out.push(format!("tenants[{name}]: removed")),
            (None, None) => {}
        }
    }
    Ok(out)
}

/// `kvota policy diff FILE`: what applying `new` would change, in the policy's fields and
/// in every tenant's target entitlement for the federation as it is now.
pub fn policy_diff(cp: &Cp, new: &Policy, json: bool) -> Result<()> {
    let c = client(cp)?;
    let rt = rt()?;
    let (current, clusters, tenants) = rt
        .block_on(async {
            let p = c.call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) }).await?;
            let cl = c.call(|ch| async move { Ok(Client::admin(ch).list_clusters(v1::Empty {}).await?.into_inner()) }).await?;
            let t = c.call(|ch| async move { Ok(Client::admin(ch).list_tenants(v1::Empty {}).await?.into_inner()) }).await?;
            Ok::<_, tonic::Status>((p, cl, t))
        })
        .map_err(|e| status_err(cp, e))?;
    let old = if current.name.is_empty() {
        None
    } else {
        Some(Policy::from_yaml(&current.yaml).map_err(|e| anyhow::anyhow!("the policy from the control plane does not load: {e}"))?)
    };
    // One instant for both: the ledger's numbers as read, no decay between them.
    let now = 0;
    let after = targets(&rebuilt(new, &clusters.clusters, &tenants.tenants, now)?);
    let before = match &old {
        Some(p) => targets(&rebuilt(p, &clusters.clusters, &tenants.tenants, now)?),
        None => BTreeMap::new(),
    };
    let changes = match &old {
        Some(p) => policy_changes(p, new)?,
        None => vec![format!("no policy in force: `{}` would be the first", new.name)],
    };
    let names: std::collections::BTreeSet<&TenantName> = before.keys().chain(after.keys()).collect();
    if json {
        let rows: Vec<serde_json::Value> = names
            .iter()
            .map(|n| serde_json::json!({"tenant": n, "target_milli_gpue_now": before.get(*n), "target_milli_gpue_after": after.get(*n)}))
            .collect();
        out!("{}", serde_json::to_string_pretty(&serde_json::json!({"changes": changes, "entitlements": rows}))?);
        return Ok(());
    }
    if changes.is_empty() {
        out!("no field changes: the file is the policy in force");
    } else {
        out!("policy changes:");
        for ch in &changes {
            out!("  {ch}");
        }
    }
    let capacity = format_gpue(tenants.capacity_milli_gpue);
    let n = clusters.clusters.len();
    out!("target entitlements for today's federation ({capacity} GPUe, {n} cluster{}), now -> after applying:", if n == 1 { "" } else { "s" });
    out!("  {:<20} {:>10} {:>10} {:>10}", "TENANT", "NOW", "AFTER", "CHANGE");
    for n in names {
        let (a, b) = (before.get(n).copied(), after.get(n).copied());
        let cell = |v: Option<u64>| v.map_or_else(|| "-".to_string(), format_gpue);
        let delta = i128::from(b.unwrap_or(0)) - i128::from(a.unwrap_or(0));
        let sign = if delta > 0 { "+" } else if delta < 0 { "-" } else { "" };
        out!("  {:<20} {:>10} {:>10} {:>10}", n, cell(a), cell(b), format!("{sign}{}", format_gpue(u64::try_from(delta.unsigned_abs()).unwrap_or(u64::MAX))));
    }
    Ok(())
}

/// `kvota tenants`
pub fn tenants(cp: &Cp, o: OutputArg) -> Result<()> {
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).list_tenants(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    if o.print(&kvota_control_plane::view::TenantsView::from(&r))? {
        return Ok(());
    }
    if r.tenants.is_empty() {
        out!("no policy is in force");
        return Ok(());
    }
    out!("federation capacity: {} GPUe", format_gpue(r.capacity_milli_gpue));
    out!(
        "{:<16} {:>7} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>7} {:>5}",
        "TENANT", "WEIGHT", "MIN", "MAX", "DEMAND", "IN USE", "TARGET", "ENTITLED", "DRIFT", "SCORE"
    );
    for t in &r.tenants {
        out!(
            "{:<16} {:>7} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>6.1}% {:>5.2}",
            t.tenant,
            format_gpue(t.weight_milli),
            pct_bp(t.min_share_bp),
            pct_bp(t.max_share_bp),
            format_gpue(t.demand_milli_gpue),
            format_gpue(t.inuse_milli_gpue),
            format_gpue(t.target_milli_gpue),
            format_gpue(t.entitlement_milli_gpue),
            t.drift_ppm as f64 / 10_000.0,
            t.fairness_score
        );
    }
    Ok(())
}

/// `kvota clusters`
pub fn clusters(cp: &Cp, o: OutputArg) -> Result<()> {
    let c = client(cp)?;
    let (r, st) = rt()?
        .block_on(async {
            let r = c
                .call(|ch| async move { Ok(Client::admin(ch).list_clusters(v1::Empty {}).await?.into_inner()) })
                .await?;
            let st = c
                .call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) })
                .await?;
            Ok::<_, tonic::Status>((r, st))
        })
        .map_err(|e| status_err(cp, e))?;
    let list: Vec<kvota_control_plane::view::ClusterView> = r.clusters.iter().map(Into::into).collect();
    if o.print(&list)? {
        return Ok(());
    }
    if r.clusters.is_empty() {
        out!("no member clusters registered yet");
        return Ok(());
    }
    for c in &r.clusters {
        let ago = if c.last_report_ms == 0 {
            "never reported".to_string()
        } else {
            format!("last report {} ago", format_duration_ms(st.state_time_ms.saturating_sub(c.last_report_ms)))
        };
        out!(
            "{}: {} GPUe, {ago}, lease epoch {} (acknowledged {}){}",
            c.cluster,
            format_gpue(c.capacity_milli_gpue),
            c.last_epoch,
            c.acked_epoch,
            if c.unreachable { ", UNREACHABLE: lease expired, safe budgets apply" } else { "" }
        );
        for t in &c.tenants {
            out!(
                "  {:<16} in use {:>8}  pending {:>8}  budget {:>8}  safe {:>8}  may enforce {:>8}",
                t.tenant,
                format_gpue(t.inuse_milli_gpue),
                format_gpue(t.pending_milli_gpue),
                format_gpue(t.budget_milli_gpue),
                format_gpue(t.fallback_milli_gpue),
                format_gpue(t.enforceable_milli_gpue)
            );
        }
    }
    Ok(())
}

/// `kvota explain tenant NAME`
pub fn explain(cp: &Cp, cmd: &ExplainCmd) -> Result<()> {
    let (name, o) = match cmd {
        ExplainCmd::Tenant { name, out } => (name, out),
        ExplainCmd::Pod { pod, cluster, agent, agent_ca, agent_tls_name, out } => {
            return explain_pod(cp, pod, cluster.as_deref(), agent.as_deref(), agent_ca.as_deref(), agent_tls_name.clone(), *out)
        }
    };
    let c = client(cp)?;
    let tenant = name.clone();
    let r = rt()?
        .block_on(c.call(|ch| {
            let tenant = tenant.clone();
            async move { Ok(Client::admin(ch).explain_tenant(v1::ExplainTenantRequest { tenant }).await?.into_inner()) }
        }))
        .map_err(|e| status_err(cp, e))?;
    if o.format() != Output::Table {
        o.print(&explanation(r)?)?;
    } else {
        out!("{}", r.text);
    }
    Ok(())
}

/// `kvota explain pod`: the agent's record of the decision when an agent is named; the
/// control plane's view of the pod's tenant otherwise.
fn explain_pod(
    cp: &Cp,
    pod: &str,
    cluster: Option<&str>,
    agent: Option<&str>,
    agent_ca: Option<&std::path::Path>,
    tls_name: Option<String>,
    o: OutputArg,
) -> Result<()> {
    let (namespace, name) = pod
        .split_once('/')
        .filter(|(n, p)| !n.is_empty() && !p.is_empty() && !p.contains('/'))
        .with_context(|| format!("`{pod}`: expected NAMESPACE/NAME (as in the admission message)"))?;
    if let Some(base) = agent {
        let ca = agent_ca.context(
            "--agent needs --agent-ca FILE (or KVOTA_AGENT_CA): the CA of the agent's serving certificate, the webhook's caBundle",
        )?;
        // Present the operator's federation certificate when there is one: an agent with
        // federation TLS explains pods only to viewers, operators and nodes.
        let client = cp.cp_cert.clone().zip(cp.cp_key.clone());
        let target = kvota_member_agent::https::Target { base: base.to_string(), ca: ca.to_path_buf(), tls_name, client };
        let path = format!("/explain?pod={}", percent_encode(pod));
        let (status, body) = rt()?
            .block_on(kvota_member_agent::https::get(&target, &path, std::time::Duration::from_secs(10)))
            .map_err(|e| anyhow::anyhow!("ask the agent at {base}: {e}"))?;
        let v: serde_json::Value = serde_json::from_slice(&body)
            .with_context(|| format!("the agent at {base} answered {status} with something that is not JSON; is it a kvota agent?"))?;
        if status != 200 {
            bail!("{}", v["error"].as_str().unwrap_or("the agent could not explain this pod"));
        }
        if !o.print(&v)? {
            let e: kvota_member_agent::state::PodExplanation = serde_json::from_value(v).context("decode the agent's answer")?;
            out!("{}", e.text);
            out!("  decided {} ago; now: {}", kvota_fairness::units::format_duration_ms(e.decided_ago_ms), e.now);
        }
        return Ok(());
    }
    // No agent: the decisions the agents reported, from the control plane.
    let c = client(cp)?;
    let rt = rt()?;
    let req = v1::ExplainPodRequest { pod: pod.to_string(), cluster: cluster.unwrap_or_default().to_string() };
    let reported = rt
        .block_on(c.call(|ch| {
            let req = req.clone();
            async move { Ok(Client::admin(ch).explain_pod(req).await?.into_inner()) }
        }))
        .map_err(|e| status_err(cp, e))?;
    let view = kvota_control_plane::view::DecisionsView::from(&reported);
    if o.print(&view)? {
        return Ok(());
    }
    if !view.decisions.is_empty() {
        let wall = u64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())).unwrap_or(u64::MAX);
        for d in &view.decisions {
            out!("decided by the agent of cluster `{}` {} ago ({}):", d.cluster, kvota_fairness::units::format_duration_ms(wall.saturating_sub(d.at_ms)), rfc3339(d.at_ms));
            out!("{}", d.text);
        }
        out!("where it stands now: kvota explain pod {pod} --agent https://AGENT:PORT --agent-ca CA.crt");
        return Ok(());
    }
    if reported.kept {
        out!("the control plane has no reported decision about {pod}{}: its agent has not judged it, has not reported since, or it was judged more than 512 decisions ago.", cluster.map(|c| format!(" in cluster `{c}`")).unwrap_or_default());
    }
    // Nothing reported: the pod's tenant as the control plane sees it.
    let r = rt
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    if r.name.is_empty() {
        bail!("no policy is in force, so kvota governs no pod; apply one with `kvota policy apply FILE`");
    }
    let policy = kvota_fairness::policy::Policy::from_yaml(&r.yaml).map_err(|e| anyhow::anyhow!("the policy from the control plane does not load: {e}"))?;
    let tenant = policy.tenant_for_namespace(namespace, &std::collections::BTreeMap::new()).map(|t| t.name.to_string());
    let hint = format!(
        "the decision about {namespace}/{name} was made by the agent of its cluster; to read it:\n  kvota explain pod {pod} --agent https://AGENT:PORT --agent-ca CA.crt"
    );
    let Some(tenant) = tenant else {
        out!("namespace `{namespace}` is not listed by any tenant of policy `{}`; if it carries the label kvota.dev/tenant=T (or matches a tenant's namespace selector), run `kvota explain tenant T`.\n{hint}", r.name);
        return Ok(());
    };
    let e = rt
        .block_on(c.call(|ch| {
            let tenant = tenant.clone();
            async move { Ok(Client::admin(ch).explain_tenant(v1::ExplainTenantRequest { tenant }).await?.into_inner()) }
        }))
        .map_err(|e| status_err(cp, e))?;
    out!("pod {pod}: namespace `{namespace}` belongs to tenant `{tenant}`. A GPU pod is admitted in a cluster while the tenant's in use there plus the pod's request stays within its budget there:");
    out!("{}", e.text);
    out!("{hint}");
    Ok(())
}

/// Percent-encodes a query value (pod keys are DNS names and a slash; anything else too).
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// `kvota audit`'s filters.
#[derive(Debug)]
pub struct AuditFilter {
    /// The newest this many (0: all kept).
    pub limit: u32,
    /// About this tenant.
    pub tenant: Option<String>,
    /// By this actor.
    pub actor: Option<String>,
    /// From this time on.
    pub since: Option<When>,
}

/// `kvota audit`
pub fn audit(cp: &Cp, f: &AuditFilter, o: OutputArg) -> Result<()> {
    let wall = u64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())).unwrap_or(u64::MAX);
    let since_ms = match f.since {
        None => 0,
        Some(When::Now) => wall,
        Some(When::At(t)) => t,
        Some(When::Ago(d)) => wall.saturating_sub(d),
    };
    let req = v1::AuditLogRequest { limit: f.limit, tenant: f.tenant.clone().unwrap_or_default(), actor: f.actor.clone().unwrap_or_default(), since_ms };
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| {
            let req = req.clone();
            async move { Ok(Client::admin(ch).audit_log(req).await?.into_inner()) }
        }))
        .map_err(|e| status_err(cp, e))?;
    let records = r
        .entries
        .into_iter()
        .enumerate()
        .map(|(i, rec)| kvota_fairness::federation::AuditRecord::try_from(rec).with_context(|| format!("audit record {i} from the control plane")))
        .collect::<Result<Vec<_>>>()?;
    if o.print(&records)? {
        return Ok(());
    }
    if records.is_empty() {
        out!("no audit records{}", if req.tenant.is_empty() && req.actor.is_empty() && since_ms == 0 { "" } else { " match" });
    }
    for rec in &records {
        out!("{}  #{:<6} {:<20} {}", rfc3339(rec.at_ms), rec.seq, rec.actor.as_deref().unwrap_or("-"), audit_sentence(&rec.event));
    }
    Ok(())
}

/// One audit event in words (the dashboard's timeline says the same).
fn audit_sentence(e: &kvota_fairness::federation::AuditEvent) -> String {
    use kvota_fairness::federation::AuditEvent as E;
    match e {
        E::PolicyApplied { name, tenants } => format!("policy {name} came into force ({tenants} tenants)"),
        E::ClusterRegistered { cluster, capacity_gpue } => format!("cluster {cluster} registered with {} GPUe", format_gpue(*capacity_gpue)),
        E::ClusterRemoved { cluster } => format!("cluster {cluster} was removed"),
        E::Eviction { cluster, note } => format!(
            "in {cluster}, reclaim {} {} of {} ({} GPUe) for {}'s {}: {}",
            if note.outcome == kvota_fairness::federation::EvictionOutcome::Blocked { "could not evict (a PodDisruptionBudget refused)" } else { "evicted" },
            note.victim,
            note.victim_tenant,
            format_gpue(note.milli_gpue),
            note.for_tenant,
            note.for_pod,
            note.why
        ),
        E::BudgetsChanged { cluster, epoch, changes } => {
            let parts: Vec<String> = changes.iter().map(|c| format!("{} {} -> {} ({})", c.tenant, format_gpue(c.from), format_gpue(c.to), c.why)).collect();
            format!("cluster {cluster} got lease epoch {epoch}: {}", if parts.is_empty() { "budgets renewed".to_string() } else { parts.join("; ") })
        }
    }
}

/// `kvota snapshot ...`
#[derive(Debug, clap::Subcommand)]
pub enum SnapshotCmd {
    /// Save the federation's replicated state (policy, ledger, clusters and their leases,
    /// showback, decisions, audit log) to FILE, as the leader has applied it. Operators
    /// only. The file is versioned; `kvota snapshot restore` reads it.
    Save {
        /// Where to write the backup (not overwritten unless --force).
        file: PathBuf,
        /// Replace FILE if it exists.
        #[arg(long)]
        force: bool,
    },
    /// Write a backup into a NEW data directory as a one-node federation (no control
    /// plane needed): then start `kvota server` on that directory without --init, and
    /// grow it with `kvota members add-learner` and `kvota members set-voters`. Agents
    /// keep their journals: what they reported after the backup was taken is reported
    /// again only if they still hold it, so take backups often.
    Restore {
        /// The backup file (`kvota snapshot save`).
        file: PathBuf,
        /// The new node's id.
        #[arg(long)]
        id: u64,
        /// The new node's data directory (must not hold one yet).
        #[arg(long)]
        data_dir: PathBuf,
        /// The new node's addresses, as for `kvota server --member`:
        /// ID=GRPC_ADDR,HTTP_ADDR,RAFT_ADDR (the ID must be --id).
        #[arg(long, value_name = "ID=GRPC,HTTP,RAFT")]
        member: String,
    },
}

/// `kvota snapshot ...`
pub fn snapshot(cp: &Cp, cmd: &SnapshotCmd) -> Result<()> {
    match cmd {
        SnapshotCmd::Save { file, force } => snapshot_save(cp, file, *force),
        SnapshotCmd::Restore { file, id, data_dir, member } => {
            let (mid, node) = crate::server_cmd::parse_member(member)?;
            if mid != *id {
                bail!("--member names node {mid} but --id is {id}: the addresses must be the restored node's own");
            }
            let bytes = read_backup(file)?;
            let rt = rt()?;
            let s = rt
                .block_on(kvota_control_plane::backup::restore(&bytes, data_dir, *id, node.clone(), kvota_control_plane::types::FEATURE_LEVEL))
                .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
            out!(
                "restored the federation as of log index {} (policy {}, {} tenants, {} clusters, feature level {}) into {} as node {id}, its only voter",
                s.applied_index,
                s.policy.as_deref().unwrap_or("none"),
                s.tenants,
                s.clusters,
                s.feature_level,
                data_dir.display()
            );
            out!("start it (without --init):");
            out!(
                "  kvota server --id {id} --data-dir {} --listen {} --http {} --raft-listen {}",
                data_dir.display(),
                node.rpc_addr,
                node.http_addr,
                node.raft_addr
            );
            out!("then grow it: start each new node without --init, and");
            out!("  kvota members add-learner --id N --rpc ... --raft ... --http ... --cp {}", node.rpc_addr);
            out!("  kvota members set-voters --voters {id},N,... --cp {}", node.rpc_addr);
            Ok(())
        }
    }
}

fn read_backup(file: &Path) -> Result<Vec<u8>> {
    let meta = std::fs::metadata(file).with_context(|| format!("read {}", file.display()))?;
    if meta.len() > kvota_control_plane::backup::MAX_BACKUP_BYTES as u64 {
        bail!("{}: {} bytes; a backup is at most {}", file.display(), meta.len(), kvota_control_plane::backup::MAX_BACKUP_BYTES);
    }
    std::fs::read(file).with_context(|| format!("read {}", file.display()))
}

/// `kvota snapshot save FILE`: fetched whole, checked, then written durably (a
/// temporary file beside FILE, fdatasync, renamed into place, the directory synced).
fn snapshot_save(cp: &Cp, file: &Path, force: bool) -> Result<()> {
    use std::io::Write as _;
    if file.exists() && !force {
        bail!("{} exists; pass --force to replace it", file.display());
    }
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| async move {
            Ok(Client::admin(ch)
                .max_decoding_message_size(kvota_control_plane::backup::MAX_BACKUP_BYTES)
                .save_snapshot(v1::Empty {})
                .await?
                .into_inner())
        }))
        .map_err(|e| status_err(cp, e))?;
    let s = kvota_control_plane::backup::summary(&r.backup, kvota_control_plane::types::FEATURE_LEVEL)
        .map_err(|e| anyhow::anyhow!("the control plane sent a backup this kvota cannot read: {e}"))?;
    if !r.follows_leader {
        eprintln!("kvota: warning: the answering node could not confirm it was caught up with the leader ({}); the backup may miss the latest writes", r.note);
    }
    let dir = file.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp = dir.join(format!(".{}.partial", file.file_name().map_or("kvota-backup".into(), |n| n.to_string_lossy())));
    {
        let mut f = std::fs::File::create(&tmp).with_context(|| format!("create {}", tmp.display()))?;
        f.write_all(&r.backup).with_context(|| format!("write {}", tmp.display()))?;
        f.sync_data().with_context(|| format!("sync {}", tmp.display()))?;
    }
    std::fs::rename(&tmp, file).with_context(|| format!("move {} to {}", tmp.display(), file.display()))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    out!(
        "saved the federation as of log index {} (policy {}, {} tenants, {} cluster{}, feature level {}) to {} ({} bytes)",
        s.applied_index,
        s.policy.as_deref().unwrap_or("none"),
        s.tenants,
        s.clusters,
        if s.clusters == 1 { "" } else { "s" },
        s.feature_level,
        file.display(),
        r.backup.len()
    );
    Ok(())
}

/// `kvota usage`'s arguments.
#[derive(Debug, clap::Args)]
pub struct UsageArgs {
    /// Start of the period: an RFC 3339 time (`2026-12-01T00:00:00Z`), a date
    /// (`2026-12-01`, midnight UTC), or a duration before now (`24h`, `7d`, `90m`).
    /// Every hour that overlaps the period counts whole.
    #[arg(long, default_value = "24h", value_parser = parse_when)]
    pub since: When,
    /// End of the period (exclusive): the same forms, or `now`.
    #[arg(long, default_value = "now", value_parser = parse_when)]
    pub until: When,
    /// Group rows by `tenant`, `cluster` or `tenant,cluster`; `none` for one total.
    #[arg(long, default_value = "tenant", value_parser = parse_by)]
    pub by: (bool, bool),
    /// Output: `table` for people, `csv` for a spreadsheet, `json` or `yaml` (the HTTP
    /// API's schema).
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: UsageFormat,
}

/// `kvota usage -o`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum UsageFormat {
    /// Aligned columns with a total.
    Table,
    /// `tenant,cluster,gpu_hours,since,until` with a header.
    Csv,
    /// One JSON object (the HTTP API's `/api/v1/usage`).
    Json,
    /// The same as YAML.
    Yaml,
}

/// A point in time on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// The federation's now.
    Now,
    /// Milliseconds since the Unix epoch.
    At(u64),
    /// This long before now (the CLI's clock).
    Ago(u64),
}

/// Parses `--since` / `--until` (see [`UsageArgs`]).
pub fn parse_when(s: &str) -> Result<When, String> {
    use time::format_description::well_known::Rfc3339;
    let s = s.trim();
    if s == "now" {
        return Ok(When::Now);
    }
    if s.as_bytes().first().is_some_and(u8::is_ascii_digit) && s.len() >= 10 && s.as_bytes().get(4) == Some(&b'-') {
        let full = if s.len() == 10 { format!("{s}T00:00:00Z") } else { s.to_string() };
        let t = time::OffsetDateTime::parse(&full, &Rfc3339)
            .map_err(|e| format!("`{s}` is not an RFC 3339 time or a YYYY-MM-DD date: {e}"))?;
        let ms = t.unix_timestamp_nanos() / 1_000_000;
        return u64::try_from(ms).map(When::At).map_err(|_| format!("`{s}` is before 1970"));
    }
    kvota_fairness::units::parse_duration_ms(s)
        .map(When::Ago)
        .map_err(|e| format!("`{s}` is neither `now`, an RFC 3339 time, a date, nor a duration such as 24h: {e}"))
}

fn parse_by(s: &str) -> Result<(bool, bool), String> {
    if s.trim() == "none" {
        return Ok((false, false));
    }
    let by = kvota_control_plane::http::parse_group_by(s)?;
    if by == (false, false) {
        return Err("name tenant, cluster, both (tenant,cluster) or none".to_string());
    }
    Ok(by)
}

/// An RFC 3339 time (UTC, seconds) for `ms` since the Unix epoch.
fn rfc3339(ms: u64) -> String {
    use time::format_description::well_known::Rfc3339;
    i64::try_from(ms / 1000)
        .ok()
        .and_then(|s| time::OffsetDateTime::from_unix_timestamp(s).ok())
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| format!("{ms} ms"))
}

/// A CSV field: quoted when it holds a comma, a quote or a line break.
fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// `kvota usage`
pub fn usage(cp: &Cp, a: &UsageArgs) -> Result<()> {
    let wall = u64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())).unwrap_or(u64::MAX);
    let ms = |w: When| match w {
        When::Now => 0,
        When::At(t) => t,
        When::Ago(d) => wall.saturating_sub(d),
    };
    let (since_ms, until_ms) = (ms(a.since), ms(a.until));
    if a.since == When::Now {
        bail!("--since now leaves an empty period; give a time or a duration such as 24h");
    }
    if until_ms != 0 && since_ms >= until_ms {
        bail!("--since ({}) must be before --until ({})", rfc3339(since_ms), rfc3339(until_ms));
    }
    let req = v1::UsageRequest { since_ms, until_ms, by_tenant: a.by.0, by_cluster: a.by.1 };
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).usage(req).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    let view = kvota_control_plane::view::UsageView::from(&r);
    match a.output {
        UsageFormat::Json => {
            out!("{}", serde_json::to_string_pretty(&view).context("encode the usage")?);
            return Ok(());
        }
        UsageFormat::Yaml => {
            outp!("{}", yaml(&view)?);
            return Ok(());
        }
        UsageFormat::Table | UsageFormat::Csv => {}
    }
    if !view.kept {
        bail!("the control plane keeps no showback yet: it runs below feature level 2 (every node must run a kvota that supports it; see `kvota status`)");
    }
    let name = |o: &Option<String>| o.clone().unwrap_or_else(|| "*".to_string());
    match a.output {
        UsageFormat::Csv => {
            out!("tenant,cluster,gpu_hours,since,until");
            for row in &view.rows {
                out!(
                    "{},{},{:.6},{},{}",
                    csv_field(&name(&row.tenant)),
                    csv_field(&name(&row.cluster)),
                    row.gpu_hours,
                    rfc3339(view.since_ms),
                    rfc3339(view.until_ms)
                );
            }
        }
        _ => {
            out!("GPU-hours from {} to {} (whole hours, undecayed)", rfc3339(view.since_ms), rfc3339(view.until_ms));
            if let Some(from) = view.kept_from_ms.filter(|f| *f > view.since_ms) {
                out!("note: hours before {} are no longer kept (the policy's spec.showback.retention)", rfc3339(from));
            }
            out!("{:<24} {:<24} {:>14}", "TENANT", "CLUSTER", "GPU-HOURS");
            for row in &view.rows {
                out!("{:<24} {:<24} {:>14.3}", name(&row.tenant), name(&row.cluster), row.gpu_hours);
            }
            out!("{:<24} {:<24} {:>14.3}", "TOTAL", "", view.total_gpu_hours);
        }
    }
    Ok(())
}

/// A tenant's explanation in the core's form (as the HTTP API's
/// `/api/v1/explain/tenant` serves it).
fn explanation(r: v1::ExplainTenantReply) -> Result<kvota_fairness::explain::TenantExplanation> {
    let e = r.explanation.context("the control plane answered without the explanation's numbers (an older kvota?)")?;
    kvota_fairness::explain::TenantExplanation::try_from(e).context("the explanation from the control plane")
}

fn member(spec: &str) -> Result<v1::NodeInfo> {
    let (id, n) = crate::server_cmd::parse_member(spec)?;
    Ok(v1::NodeInfo { id, rpc_addr: n.rpc_addr, http_addr: n.http_addr, raft_addr: n.raft_addr, voter: true })
}

/// `kvota members list`
fn members_list(cp: &Cp, o: OutputArg) -> Result<()> {
    let c = client(cp)?;
    let s = rt()?
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    if o.print(&kvota_control_plane::view::StatusView::from(&s).members)? {
        return Ok(());
    }
    out!("{:>4}  {:<8}  {:<6}  {:<22}  {:<22}  HTTP", "ID", "ROLE", "LEADS", "GRPC", "RAFT");
    for m in &s.members {
        out!(
            "{:>4}  {:<8}  {:<6}  {:<22}  {:<22}  {}",
            m.id,
            if m.voter { "voter" } else { "learner" },
            if m.id == s.leader_id { "yes" } else { "" },
            m.rpc_addr,
            if m.raft_addr.is_empty() { "-" } else { &m.raft_addr },
            if m.http_addr.is_empty() { "-" } else { &m.http_addr },
        );
    }
    if s.leader_id == 0 {
        out!("no leader known to node {} (election in progress or no quorum)", s.node_id);
    }
    Ok(())
}

/// `kvota members ...`
pub fn members(cp: &Cp, cmd: &MembersCmd) -> Result<()> {
    let c = client(cp)?;
    let rt = rt()?;
    let reply = match cmd {
        MembersCmd::List { out } => return members_list(cp, *out),
        MembersCmd::Init { members } => {
            let members = members.iter().map(|m| member(m)).collect::<Result<Vec<_>>>()?;
            rt.block_on(c.call(|ch| {
                let members = members.clone();
                async move { Ok(Client::admin(ch).initialize(v1::InitializeRequest { members }).await?.into_inner()) }
            }))
        }
        MembersCmd::AddLearner { id, rpc, http, raft, wait } => {
            let node = v1::NodeInfo { id: *id, rpc_addr: rpc.clone(), http_addr: http.clone(), raft_addr: raft.clone(), voter: false };
            let reply = rt
                .block_on(c.call(|ch| {
                    let node = node.clone();
                    async move { Ok(Client::admin(ch).add_learner(v1::AddLearnerRequest { node: Some(node) }).await?.into_inner()) }
                }))
                .map_err(|e| status_err(cp, e))?;
            if *wait > 0 {
                rt.block_on(wait_caught_up(cp, &c, *id, rpc, std::time::Duration::from_secs(*wait)))?;
            }
            Ok(reply)
        }
        MembersCmd::SetVoters { voters, keep_as_learners } => rt.block_on(c.call(|ch| {
            let req = v1::ChangeMembershipRequest { voters: voters.clone(), retain: *keep_as_learners };
            async move { Ok(Client::admin(ch).change_membership(req).await?.into_inner()) }
        })),
    }
    .map_err(|e| status_err(cp, e))?;
    out!("membership now:");
    for m in &reply.members {
        out!("  {:>3}  {:<8} grpc {}  raft {}", m.id, if m.voter { "voter" } else { "learner" }, m.rpc_addr, m.raft_addr);
    }
    Ok(())
}

/// Waits until node `id` (gRPC at `rpc`) says it is ready, having applied what the
/// leader had; prints its progress every few seconds. Asks the node itself: the
/// leader's view of a learner is not in the status it serves.
async fn wait_caught_up(cp: &Cp, group: &Client, id: u64, rpc: &str, within: std::time::Duration) -> Result<()> {
    let start = std::time::Instant::now();
    let node = Client::with_tls(&[rpc.to_string()], cp.tls()?).map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let status = |c: &Client| {
        let c = c.clone();
        async move { c.call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) }).await }
    };
    let mut said = std::time::Instant::now();
    loop {
        let mine = status(&node).await;
        if let Ok(st) = &mine {
            if st.ready {
                out!("node {id} has caught up (applied {}) after {:.1} s", st.last_applied_index, start.elapsed().as_secs_f64());
                return Ok(());
            }
        }
        let leader = status(group).await.map(|s| s.last_applied_index).unwrap_or(0);
        let at = match &mine {
            Ok(st) => format!("applied {} of the leader's {leader}", st.last_applied_index),
            Err(e) => format!("not answering at {rpc}: {}", e.message()),
        };
        if start.elapsed() >= within {
            anyhow::bail!(
                "node {id} was added as a learner but has not caught up within {} s ({at}); it goes on catching up: see its log, `kvota members list`, and its /readyz",
                within.as_secs()
            );
        }
        if said.elapsed() >= std::time::Duration::from_secs(5) {
            eprintln!("node {id} catching up: {at}");
            said = std::time::Instant::now();
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
}

/// `kvota cluster remove NAME`
pub fn cluster_remove(cp: &Cp, name: &str) -> Result<()> {
    let c = client(cp)?;
    let cluster = name.to_string();
    rt()?
        .block_on(c.call(|ch| {
            let cluster = cluster.clone();
            async move { Ok(Client::admin(ch).remove_cluster(v1::DescribeClusterRequest { cluster }).await?.into_inner()) }
        }))
        .map_err(|e| status_err(cp, e))?;
    out!("cluster `{name}` removed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn usage_times_and_groups_parse_strictly() {
        assert_eq!(parse_when("now"), Ok(When::Now));
        assert_eq!(parse_when("24h"), Ok(When::Ago(86_400_000)));
        assert_eq!(parse_when("7d"), Ok(When::Ago(7 * 86_400_000)));
        assert_eq!(parse_when("2026-12-01"), Ok(When::At(1_796_083_200_000)));
        assert_eq!(parse_when("2026-12-01T01:00:00Z"), Ok(When::At(1_796_086_800_000)));
        assert_eq!(parse_when("2026-12-01T02:00:00+01:00"), Ok(When::At(1_796_086_800_000)));
        for bad in ["", "yesterday", "2026-13-01", "2026-12-01T25:00:00Z", "1969-12-31T00:00:00Z", "-5h", "24"] {
            assert!(parse_when(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_by("tenant"), Ok((true, false)));
        assert_eq!(parse_by("cluster,tenant"), Ok((true, true)));
        assert_eq!(parse_by("none"), Ok((false, false)));
        assert!(parse_by("team").is_err() && parse_by("").is_err());
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("x\"y"), "\"x\"\"y\"");
        assert_eq!(rfc3339(1_796_086_800_000), "2026-12-01T01:00:00Z");
    }

    proptest! {
        /// Whatever is typed, the parsers answer (a value or a message) and never panic.
        #[test]
        fn usage_arguments_never_panic(s in ".{0,40}", digits in "[0-9]{4}-[0-9]{2}-[0-9]{2}(T[0-9:]{0,10}Z?)?") {
            let _ = parse_when(&s);
            let _ = parse_when(&digits);
            let _ = parse_by(&s);
        }
    }
}
