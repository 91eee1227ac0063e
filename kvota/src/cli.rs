//! Command-line interface: argument types and dispatch.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use kvota_fairness::federation::{Applied, Command, Federation, TenantReport, UsageReport};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::Policy;
use kvota_fairness::units::{format_gpue, parse_quantity_milli};

/// kvota keeps GPU sharing fair across several Kubernetes clusters.
///
/// Run a control plane with `kvota server`, then operate it with `kvota status`,
/// `kvota policy apply`, `kvota tenants`, `kvota clusters`, `kvota explain tenant`.
/// Logs go to stderr; set RUST_LOG (e.g. RUST_LOG=kvota=debug) for more.
#[derive(Debug, Parser)]
#[command(name = "kvota", version, about, long_about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    command: Cmd,
    #[command(flatten)]
    cp: crate::admin_cmd::Cp,
    /// How log lines on stderr look: `text` for people, `json` (one object per line,
    /// with the span fields such as cluster, seq and tenant) for a log pipeline.
    /// RUST_LOG sets what is logged.
    #[arg(long, global = true, value_enum, default_value = "text", env = "KVOTA_LOG_FORMAT")]
    pub(crate) log_format: LogFormat,
}

/// The log line format (`--log-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run a control-plane node (one of 3 or 5 forming a Raft group).
    Server(crate::server_cmd::ServerArgs),
    /// Repair a stopped node's data directory whose saved Raft vote is out of range
    /// (`kvota server` then stays up but not ready, and says to run this): the vote is
    /// replaced by one for the node itself at a term in range. Offline: stop the node
    /// first.
    RepairVote(crate::server_cmd::RepairVoteArgs),
    /// Run a member cluster's agent: usage reports, lease enforcement, the HTTPS
    /// admission webhook, reclaim; on Kubernetes (in-cluster or --kubeconfig) or on a simulated
    /// cluster (--simulate).
    Agent(crate::agent_cmd::AgentArgs),
    /// Serve the dashboard on this machine: a local proxy (127.0.0.1 only) that reads the
    /// federation with your certificate (the same --cp and --cp-* flags as every
    /// command) and prints its URL; works through `kubectl port-forward` of a node's
    /// gRPC port. See docs/operations.md, "The dashboard".
    Dashboard(crate::dashboard_cmd::DashboardArgs),
    /// Show the control-plane node's Raft role, leader, log and members.
    Status {
        #[command(flatten)]
        out: crate::admin_cmd::OutputArg,
    },
    /// Work with FairnessPolicy files and the policy in force.
    #[command(subcommand)]
    Policy(PolicyCmd),
    /// List tenants: demand, in use, target and committed entitlement, drift, score.
    Tenants {
        #[command(flatten)]
        out: crate::admin_cmd::OutputArg,
    },
    /// List member clusters: capacity, last report, lease epochs, budgets per tenant.
    Clusters {
        #[command(flatten)]
        out: crate::admin_cmd::OutputArg,
    },
    /// Explain the numbers behind a decision.
    #[command(subcommand)]
    Explain(crate::admin_cmd::ExplainCmd),
    /// Print the audit log (why budgets changed, policies, registrations, evictions),
    /// oldest first.
    Audit {
        /// Most recent records to show (0: all kept).
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// Only records about this tenant (its budgets, its evictions, policies).
        #[arg(long)]
        tenant: Option<String>,
        /// Only records by this actor: operator/NAME, cluster/NAME or kvota (the control
        /// plane itself).
        #[arg(long)]
        actor: Option<String>,
        /// Only records from this time on: an RFC 3339 time, a date, or a duration
        /// before now (24h).
        #[arg(long, value_parser = crate::admin_cmd::parse_when)]
        since: Option<crate::admin_cmd::When>,
        /// Only records of these kinds, comma separated: policy, cluster (joined,
        /// removed), lease (a cluster cut off, and back), leader, node (members added,
        /// removed), reclaim (evictions), snapshot (restores), budgets; `all` for every
        /// kind. Default: every kind but budgets (one record per cluster per minute of
        /// budget changes, many).
        #[arg(long, value_delimiter = ',', value_parser = parse_kind)]
        kind: Vec<String>,
        #[command(flatten)]
        out: crate::admin_cmd::OutputArg,
    },
    /// Showback: GPU-hours each tenant used in each cluster over a period, undecayed,
    /// from the hourly buckets the control plane keeps (whole hours; retention is the
    /// policy's `spec.showback.retention`, 100 days by default). The same JSON as the
    /// HTTP API's `/api/v1/usage`.
    Usage(crate::admin_cmd::UsageArgs),
    /// Back up the federation's replicated state, or restore a backup into a new data
    /// directory.
    #[command(subcommand)]
    Snapshot(crate::admin_cmd::SnapshotCmd),
    /// Make the federation's CA and the certificates of its nodes, clusters, operators,
    /// viewers and webhooks (mutual TLS by identity; see docs/security.md).
    #[command(subcommand)]
    Certs(crate::certs_cmd::CertsCmd),
    /// List or change the control plane's Raft membership.
    #[command(subcommand)]
    Members(crate::admin_cmd::MembersCmd),
    /// Manage member clusters.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Compute entitlements and per-cluster budgets offline for a policy and a
    /// hypothetical federation ("what would kvota do?"). Uses the same fairness core as
    /// the control plane.
    Whatif(WhatifArgs),
    /// See kvota keep three GPU clusters fair on this machine: a 3-node control plane
    /// (child processes), three agents with simulated clusters, a morning burst, a
    /// partition and a leader killed; then a measured summary.
    Demo(crate::demo::DemoArgs),
    /// Replay a GPU cluster trace (Philly, Alibaba, or your own CSV) offline under
    /// kvota's policy and four baselines (round robin, strict priority, static
    /// reservation, elastic DRF) and compare the article's measures: delay at
    /// admission, share violation, inference SLA, recovery, fairness, utilization.
    Sim(crate::sim_cmd::SimArgs),
    /// Print a completion script for a shell, e.g. `source <(kvota completions bash)`,
    /// or save it where the shell looks (`kvota completions bash >
    /// /etc/bash_completion.d/kvota`; zsh: a directory on `$fpath`, as `_kvota`).
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        shell: clap_complete::Shell,
    },
}

#[derive(Debug, Subcommand)]
enum ClusterCmd {
    /// Forget a member cluster whose leases have all expired.
    Remove {
        /// Cluster id.
        name: String,
    },
}

#[derive(Debug, Subcommand)]
enum PolicyCmd {
    /// Validate a policy file and make it the policy in force (every node, through Raft);
    /// print what was committed (its revision and what changed) and which member
    /// clusters enforce it. Exit status 0; 2: the file is invalid; 1: the control plane
    /// refused it or could not be reached; with --wait, 3: every connected cluster
    /// enforces it and cut-off clusters (named) were not waited for, 4: timed out with
    /// connected clusters (named) still on an older revision.
    Apply(crate::admin_cmd::ApplyArgs),
    /// Print the policy in force as a FairnessPolicy document, every field written out
    /// (defaults included): `kvota policy apply` takes it back unchanged, in either form
    /// (`-o yaml`, the default and `table`; `-o json`, the same document as JSON).
    Get {
        #[command(flatten)]
        out: crate::admin_cmd::OutputArg,
    },
    /// Show what applying a policy file would change, before applying it: the fields that
    /// differ from the policy in force, and every tenant's target entitlement now and
    /// after, computed by the fairness core for the federation as it is now (capacity,
    /// in use, waiting, decayed usage). Changes nothing. Exit status 0; 2: the file is
    /// invalid; 1: the control plane could not be read.
    Diff {
        /// Path to a FairnessPolicy YAML file.
        file: PathBuf,
        /// Print JSON: {changes: [...], entitlements: [{tenant, target_milli_gpue_now,
        /// target_milli_gpue_after}]}.
        #[arg(long)]
        json: bool,
    },
    /// Check a policy file and list every problem with its field path.
    /// Exit status 0: valid; 2: invalid; 1: the file could not be read.
    Validate {
        /// Path to a FairnessPolicy YAML file.
        file: PathBuf,
        /// Print the result as JSON (the parsed policy, or the list of problems).
        #[arg(long)]
        json: bool,
    },
    /// Print the CustomResourceDefinitions of the FairnessPolicy resource (in the
    /// `kvota.dev` group and the seed article's `kvitej.io`), generated from the same
    /// types the policy parser uses: `kvota policy crd | kubectl apply -f -`.
    Crd,
    /// Run the FairnessPolicy sync controller: follow a FairnessPolicy resource in a
    /// Kubernetes cluster and make it the federation's policy (GitOps: `git push`, then
    /// `kubectl apply`). Its verdict is written to the resource's status (`kubectl get
    /// fairnesspolicies`). Needs an operator certificate (--cp-ca/--cp-cert/--cp-key)
    /// unless the control plane is on loopback.
    Sync(kvota_policy_sync::SyncArgs),
}

#[derive(Debug, Args)]
struct WhatifArgs {
    /// FairnessPolicy YAML file. Default: the seed article's three-tenant policy
    /// (training 40 / inference 50 / research 10).
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,
    /// A member cluster as NAME=GPUS (nvidia.com/gpu count), optionally followed by
    /// `,RESOURCE=COUNT` for other GPU resources, e.g. `east=32,nvidia.com/mig-1g.5gb=14`.
    /// Repeat for each cluster.
    #[arg(long = "cluster", value_name = "NAME=GPUS[,RES=N...]", required = true)]
    clusters: Vec<String>,
    /// GPUs a tenant has waiting in a cluster: TENANT@CLUSTER=GPUS. Repeatable.
    #[arg(long = "pending", value_name = "TENANT@CLUSTER=GPUS")]
    pending: Vec<String>,
    /// GPUs a tenant holds (bound) in a cluster: TENANT@CLUSTER=GPUS. Repeatable.
    #[arg(long = "inuse", value_name = "TENANT@CLUSTER=GPUS")]
    inuse: Vec<String>,
    /// Recent GPU-hours of a tenant (already decayed), to see the decay bias:
    /// TENANT=GPU_HOURS. Repeatable.
    #[arg(long = "usage", value_name = "TENANT=GPU_HOURS")]
    usage: Vec<String>,
    /// Also print the full explanation of this tenant's numbers. Repeatable.
    #[arg(long, value_name = "TENANT")]
    explain: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> Result<ExitCode> {
    let cp = cli.cp;
    match cli.command {
        Cmd::Server(args) => crate::server_cmd::run(args).map(|()| ExitCode::SUCCESS),
        Cmd::RepairVote(args) => crate::server_cmd::repair_vote(args).map(|()| ExitCode::SUCCESS),
        Cmd::Agent(args) => crate::agent_cmd::run(args, &cp).map(|()| ExitCode::SUCCESS),
        Cmd::Dashboard(a) => crate::dashboard_cmd::run(&a, &cp),
        Cmd::Status { out } => crate::admin_cmd::status(&cp, out).map(|()| ExitCode::SUCCESS),
        Cmd::Policy(PolicyCmd::Apply(a)) => crate::admin_cmd::policy_apply(&cp, &a),
        Cmd::Policy(PolicyCmd::Get { out }) => crate::admin_cmd::policy_get(&cp, out).map(|()| ExitCode::SUCCESS),
        Cmd::Tenants { out } => crate::admin_cmd::tenants(&cp, out).map(|()| ExitCode::SUCCESS),
        Cmd::Clusters { out } => crate::admin_cmd::clusters(&cp, out).map(|()| ExitCode::SUCCESS),
        Cmd::Explain(e) => crate::admin_cmd::explain(&cp, &e).map(|()| ExitCode::SUCCESS),
        Cmd::Audit {
            limit,
            tenant,
            actor,
            since,
            kind,
            out,
        } => {
            let filter = crate::admin_cmd::AuditFilter {
                limit,
                tenant,
                actor,
                since,
                kinds: kind,
            };
            crate::admin_cmd::audit(&cp, &filter, out).map(|()| ExitCode::SUCCESS)
        }
        Cmd::Usage(args) => crate::admin_cmd::usage(&cp, &args).map(|()| ExitCode::SUCCESS),
        Cmd::Snapshot(s) => crate::admin_cmd::snapshot(&cp, &s).map(|()| ExitCode::SUCCESS),
        Cmd::Members(m) => crate::admin_cmd::members(&cp, &m).map(|()| ExitCode::SUCCESS),
        Cmd::Certs(c) => crate::certs_cmd::run(c),
        Cmd::Cluster(ClusterCmd::Remove { name }) => {
            crate::admin_cmd::cluster_remove(&cp, &name).map(|()| ExitCode::SUCCESS)
        }
        Cmd::Policy(PolicyCmd::Validate { file, json }) => policy_validate(&file, json),
        Cmd::Policy(PolicyCmd::Crd) => {
            out!("{}", kvota_policy_sync::crd::crds_yaml()?.trim_end());
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Policy(PolicyCmd::Sync(args)) => kvota_policy_sync::run(args, &cp.addrs, cp.tls()?),
        Cmd::Policy(PolicyCmd::Diff { file, json }) => match read_policy(&file)? {
            Ok(p) => crate::admin_cmd::policy_diff(&cp, &p, json).map(|()| ExitCode::SUCCESS),
            Err(e) => {
                eprintln!("{}: {e}", file.display());
                Ok(ExitCode::from(2))
            }
        },
        Cmd::Whatif(args) => whatif(args),
        Cmd::Demo(a) => crate::demo::run(a),
        Cmd::Sim(a) => crate::sim_cmd::run(a),
        Cmd::Completions { shell } => {
            let mut cmd = <Cli as clap::CommandFactory>::command();
            // Into memory first: clap_complete panics on a failed write, and a reader
            // that stops early (`| head`) closes the pipe.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut cmd, "kvota", &mut script);
            outp!("{}", String::from_utf8_lossy(&script));
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// One `--kind` word, checked (`all` or a kind of audit record).
fn parse_kind(s: &str) -> std::result::Result<String, String> {
    kvota_fairness::federation::parse_kinds(s).map(|_| s.trim().to_string())
}

fn read_policy(path: &Path) -> Result<std::result::Result<Policy, kvota_fairness::policy::PolicyError>> {
    let meta = std::fs::metadata(path).with_context(|| format!("read policy file {}", path.display()))?;
    if meta.len() > kvota_fairness::policy::MAX_POLICY_BYTES as u64 {
        bail!(
            "policy file {} is {} bytes; the limit is {}",
            path.display(),
            meta.len(),
            kvota_fairness::policy::MAX_POLICY_BYTES
        );
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("read policy file {}", path.display()))?;
    Ok(Policy::from_yaml(&text))
}

fn policy_validate(file: &Path, json: bool) -> Result<ExitCode> {
    match read_policy(file)? {
        Ok(p) => {
            if json {
                out!("{}", serde_json::to_string_pretty(&p)?);
            } else {
                out!(
                    "{}: valid policy `{}` with {} tenants",
                    file.display(),
                    p.name,
                    p.tenants.len()
                );
                if p.maps_no_namespace() {
                    eprintln!("{NO_NAMESPACE_NOTE}");
                }
                for t in &p.tenants {
                    out!(
                        "  {:<20} weight {:>8}  minShare {:>6}  maxShare {:>6}  {}  {}",
                        t.name.as_str(),
                        format_gpue(t.weight_milli),
                        bp(t.min_share_bp),
                        bp(t.max_share_bp),
                        if t.preemptible {
                            "preemptible    "
                        } else {
                            "not preemptible"
                        },
                        t.admission
                    );
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            if json {
                out!("{}", serde_json::to_string_pretty(&e.issues)?);
            } else {
                eprintln!("{}: {e}", file.display());
            }
            Ok(ExitCode::from(2))
        }
    }
}

/// The note a policy that maps no namespace gets (`validate`, `apply`): whose pods it
/// governs, and how to say more.
pub const NO_NAMESPACE_NOTE: &str =
    "note: no tenant lists a namespace (`namespaces`, `namespaceSelector`) and there is no \
`spec.defaultTenant`: agents govern only pods in namespaces labelled kvota.dev/tenant=<tenant>; every other pod passes \
unjudged (deploy/policies/quickstart.yaml maps one namespace per tenant)";

fn bp(v: u32) -> String {
    if v % 100 == 0 {
        format!("{}%", v / 100)
    } else {
        format!("{}.{:02}%", v / 100, v % 100)
    }
}

fn gpus(text: &str, what: &str) -> Result<u64> {
    parse_quantity_milli(text).with_context(|| format!("{what}: `{text}` is not a GPU count"))
}

/// `TENANT@CLUSTER=GPUS`.
fn placed(spec: &str, flag: &str) -> Result<(String, String, u64)> {
    let (lhs, n) = spec
        .split_once('=')
        .with_context(|| format!("--{flag} {spec}: expected TENANT@CLUSTER=GPUS"))?;
    let (tenant, cluster) = lhs
        .split_once('@')
        .with_context(|| format!("--{flag} {spec}: expected TENANT@CLUSTER=GPUS"))?;
    Ok((
        tenant.to_string(),
        cluster.to_string(),
        gpus(n, &format!("--{flag} {spec}"))?,
    ))
}

fn whatif(args: WhatifArgs) -> Result<ExitCode> {
    let policy = match &args.policy {
        Some(p) => match read_policy(p)? {
            Ok(p) => p,
            Err(e) => {
                eprintln!("{}: {e}", p.display());
                return Ok(ExitCode::from(2));
            }
        },
        None => {
            Policy::from_yaml(Policy::article_example_yaml()).map_err(|e| anyhow::anyhow!("built-in policy: {e}"))?
        }
    };
    let mut fed = Federation::new();
    fed.apply(0, Command::ApplyPolicy(policy.clone()))
        .map_err(|e| anyhow::anyhow!("apply policy: {e}"))?;
    let names = whatif_clusters(&mut fed, &args.clusters)?;
    let reports = whatif_reports(&policy, &names, &args)?;
    settle(&mut fed, &names, &reports)?;
    let explanations: Vec<_> = policy
        .tenants
        .iter()
        .filter_map(|t| fed.explain_tenant(&t.name))
        .collect();
    if args.json {
        let budgets: BTreeMap<&ClusterName, _> = fed
            .clusters()
            .iter()
            .map(|(id, rec)| (id, rec.leases.latest().map(|l| l.budgets.clone()).unwrap_or_default()))
            .collect();
        let out = serde_json::json!({ "tenants": explanations, "budgets": budgets });
        out!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(ExitCode::SUCCESS);
    }
    print_whatif(&fed, &policy, names.len(), &explanations);
    for t in &args.explain {
        match explanations.iter().find(|e| &e.tenant == t) {
            Some(e) => out!("\n{e}"),
            None => bail!("--explain {t}: the policy has no tenant `{t}`"),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Registers each `--cluster NAME=GPUS[,RES=N...]`; their names, in the order given.
fn whatif_clusters(fed: &mut Federation, specs: &[String]) -> Result<Vec<ClusterName>> {
    let mut names = Vec::new();
    for spec in specs {
        let mut parts = spec.split(',');
        let first = parts.next().unwrap_or_default();
        let (name, n) = first
            .split_once('=')
            .with_context(|| format!("--cluster {spec}: expected NAME=GPUS"))?;
        let mut capacity = BTreeMap::new();
        capacity.insert("nvidia.com/gpu".to_string(), gpus(n, &format!("--cluster {spec}"))?);
        for extra in parts {
            let (res, q) = extra
                .split_once('=')
                .with_context(|| format!("--cluster {spec}: expected RESOURCE=COUNT after ','"))?;
            capacity.insert(res.to_string(), gpus(q, &format!("--cluster {spec}"))?);
        }
        let name = ClusterName::parse(name.trim()).map_err(|e| anyhow::anyhow!("--cluster {spec}: {e}"))?;
        if names.contains(&name) {
            bail!("--cluster {name} is given twice");
        }
        let cmd = Command::RegisterCluster {
            cluster: name.clone(),
            capacity,
            labels: BTreeMap::new(),
        };
        fed.apply(0, cmd)
            .map_err(|e| anyhow::anyhow!("--cluster {spec}: {e}"))?;
        names.push(name);
    }
    Ok(names)
}

/// What each cluster reports, from `--pending`, `--inuse` and `--usage` (the decayed
/// usage goes with the first cluster's report).
fn whatif_reports(
    policy: &Policy,
    names: &[ClusterName],
    args: &WhatifArgs,
) -> Result<BTreeMap<ClusterName, BTreeMap<TenantName, TenantReport>>> {
    let mut reports: BTreeMap<ClusterName, BTreeMap<TenantName, TenantReport>> = BTreeMap::new();
    for (flag, list) in [("pending", &args.pending), ("inuse", &args.inuse)] {
        for spec in list {
            let (tenant, cluster, n) = placed(spec, flag)?;
            let Some(tenant) = policy.tenant(&tenant).map(|t| t.name.clone()) else {
                bail!("--{flag} {spec}: the policy has no tenant `{tenant}`");
            };
            let Some(cluster) = names.iter().find(|c| **c == cluster).cloned() else {
                bail!("--{flag} {spec}: no --cluster named `{cluster}`");
            };
            let r = reports.entry(cluster).or_default().entry(tenant).or_default();
            if flag == "pending" {
                r.pending = r.pending.saturating_add(n);
            } else {
                r.inuse = r.inuse.saturating_add(n);
            }
        }
    }
    for spec in &args.usage {
        let (tenant, hours) = spec
            .split_once('=')
            .with_context(|| format!("--usage {spec}: expected TENANT=GPU_HOURS"))?;
        let Some(tenant) = policy.tenant(tenant).map(|t| t.name.clone()) else {
            bail!("--usage {spec}: the policy has no tenant `{tenant}`");
        };
        let milli_gpu_hours = gpus(hours, &format!("--usage {spec}"))?;
        let first = names.first().context("no clusters")?;
        let r = reports.entry(first.clone()).or_default().entry(tenant).or_default();
        r.used_milli_gpue_ms = milli_gpu_hours.saturating_mul(3_600_000);
    }
    Ok(reports)
}

/// Every cluster reports in rounds: budgets settle once decreases are acknowledged
/// (break before make), which takes a few rounds. Checks the partition-safety
/// invariant after.
fn settle(
    fed: &mut Federation,
    names: &[ClusterName],
    reports: &BTreeMap<ClusterName, BTreeMap<TenantName, TenantReport>>,
) -> Result<()> {
    let mut held: BTreeMap<ClusterName, u64> = BTreeMap::new();
    for round in 1..=6u64 {
        let now = round * 1_000;
        for name in names {
            let mut tenants = reports.get(name).cloned().unwrap_or_default();
            if round > 1 {
                tenants.values_mut().for_each(|t| t.used_milli_gpue_ms = 0);
            }
            let report = UsageReport {
                cluster: name.clone(),
                seq: round,
                held_epoch: held.get(name).copied().unwrap_or(0),
                capacity: None,
                tenants,
                evictions: Vec::new(),
                decisions: Vec::new(),
                window: None,
                status: None,
            };
            let out = fed
                .apply(now, Command::Report(report))
                .map_err(|e| anyhow::anyhow!("report from {name}: {e}"))?;
            if let Applied::Reported { lease, .. } = out {
                held.insert(name.clone(), lease.epoch);
            }
        }
    }
    let violations = fed.check_safety();
    if !violations.is_empty() {
        bail!("internal error: partition-safety invariant violated: {violations:?}");
    }
    Ok(())
}

/// The table of `whatif`: each tenant's numbers and its budget in each cluster.
fn print_whatif(
    fed: &Federation,
    policy: &Policy,
    clusters: usize,
    explanations: &[kvota_fairness::explain::TenantExplanation],
) {
    out!(
        "federation: {} GPUe in {clusters} clusters, policy `{}`",
        format_gpue(fed.capacity()),
        policy.name
    );
    outp!(
        "{:<16} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "TENANT",
        "IN USE",
        "DEMAND",
        "GUARANTEE",
        "CAP",
        "ENTITLED"
    );
    // Explanations list clusters in id order; so does the header.
    for n in fed.clusters().keys() {
        outp!(" {:>9}", truncate(n, 9));
    }
    out!();
    for e in explanations {
        outp!(
            "{:<16} {:>9} {:>9} {:>9} {:>9} {:>9}",
            truncate(&e.tenant, 16),
            format_gpue(e.inuse),
            format_gpue(e.demand),
            format_gpue(e.guarantee),
            format_gpue(e.cap),
            format_gpue(e.committed),
        );
        for c in &e.clusters {
            outp!(" {:>9}", format_gpue(c.budget));
        }
        out!();
    }
    out!("(GPUe; the per-cluster columns are the budgets in each cluster's lease)");
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars()
            .take(n.saturating_sub(1))
            .chain(std::iter::once('~'))
            .collect()
    }
}
