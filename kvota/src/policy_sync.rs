//! `kvota policy sync`: the FairnessPolicy sync controller. It runs in the control
//! plane's cluster (a Deployment, leader-elected through a Lease), reads the cluster's
//! `FairnessPolicy` resources and makes the one it follows the federation's policy, so
//! a policy change is a `git push` and a `kubectl apply`.
//!
//! Each round (every `--interval`, as the leader only):
//!
//! 1. list FairnessPolicy resources in both API groups (`kvota.dev`, and the article's
//!    `kvitej.io` where that CRD is installed);
//! 2. choose the one to follow: the one named by `--name`, or the only one there is;
//!    several without `--name` is ambiguous and nothing is applied;
//! 3. check it with the same parser as `kvota policy validate`; an invalid one gets
//!    `Accepted=False, reason Invalid` with every problem and its path in status, and the
//!    federation keeps the policy it has;
//! 4. compare it with the policy in force and apply it through the control plane when
//!    they differ (also when someone changed the federation's policy by hand: the
//!    resource is the source of truth), as an operator identity (`--cp-cert`), so the
//!    audit log names it;
//! 5. write `status` (observed generation, the `Accepted` condition, problems) only when
//!    it changed.
//!
//! The controller has no listening port: nothing to attack, nothing to expose. It exits
//! with an error when it cannot start (no kubeconfig, bad TLS files); everything after
//! that is retried, and logged.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kvota_client::client::Client;
use kvota_fairness::policy::Policy;
use kvota_proto::v1;
use serde_json::{json, Value};

use crate::crd::{Condition, FairnessPolicyStatus, Problem};

/// `kvota policy sync` flags.
#[derive(Debug, Args)]
pub struct SyncArgs {
    /// Kubeconfig of the cluster holding the FairnessPolicy resources (default: in-cluster
    /// service account, then $KUBECONFIG, then ~/.kube/config).
    #[arg(long, env = "KVOTA_KUBECONFIG", value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The FairnessPolicy (cluster-scoped) to follow. Without it, the only one in the
    /// cluster is followed, and several are an error reported in each one's status.
    #[arg(long, env = "KVOTA_POLICY_NAME", value_name = "NAME")]
    pub name: Option<String>,
    /// How often to compare the resource with the federation, e.g. 10s.
    #[arg(long, default_value = "10s", value_parser = parse_interval, value_name = "DURATION")]
    pub interval: Duration,
    /// Elect a leader among replicas through this coordination.k8s.io Lease (in
    /// --namespace); only the leader applies. Without it, this process always acts:
    /// run one replica only.
    #[arg(long, env = "KVOTA_LEADER_LEASE", value_name = "NAME")]
    pub leader_lease: Option<String>,
    /// Namespace of the leader Lease.
    #[arg(long, env = "KVOTA_NAMESPACE", default_value = "kvota-system", value_name = "NS")]
    pub namespace: String,
    /// This replica's name in the Lease (default: $POD_NAME, else the host name).
    #[arg(long, env = "POD_NAME", value_name = "NAME")]
    pub identity: Option<String>,
    /// Do one round and exit: 0 when the policy is in force, 2 when it is invalid or
    /// none could be chosen, 1 when the cluster or the control plane could not be reached.
    #[arg(long)]
    pub once: bool,
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    let ms = kvota_fairness::units::parse_duration_ms(s).map_err(|e| e.to_string())?;
    if !(1_000..=3_600_000).contains(&ms) {
        return Err(format!("`{s}`: use 1s to 1h"));
    }
    Ok(Duration::from_millis(ms))
}

/// Field manager named in the resources' managedFields.
const MANAGER: &str = "kvota-policy-sync";

/// What one round made of one resource.
#[derive(Clone, Debug, PartialEq)]
enum Verdict {
    /// In force on the federation (`reason`: Applied or InSync).
    Accepted { reason: &'static str, message: String },
    /// Not applied: `reason` says why (Invalid, NotSelected, Ambiguous, Refused, Unreachable).
    Rejected { reason: &'static str, message: String, problems: Vec<Problem> },
}

/// One FairnessPolicy as listed: its API, name, generation, the object, its status.
struct Resource {
    api: Api<DynamicObject>,
    group: &'static str,
    name: String,
    generation: Option<i64>,
    object: Value,
    status: FairnessPolicyStatus,
}

/// `kvota policy sync`.
pub fn run(args: SyncArgs, cp: &crate::admin_cmd::Cp) -> Result<std::process::ExitCode> {
    let tls = cp.tls()?;
    if tls.is_none() && !cp.addrs.iter().all(|a| is_loopback(a)) {
        anyhow::bail!(
            "--cp {} is not loopback and no --cp-ca/--cp-cert/--cp-key are given: the controller applies policies, which needs an operator certificate (docs/security.md)",
            cp.addrs.join(",")
        );
    }
    let client = Client::with_tls(&cp.addrs, tls).map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().context("start the async runtime")?;
    rt.block_on(async move {
        let config = match &args.kubeconfig {
            Some(path) => {
                let kc = kube::config::Kubeconfig::read_from(path).with_context(|| format!("read kubeconfig {}", path.display()))?;
                kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                    .await
                    .with_context(|| format!("use kubeconfig {}", path.display()))?
            }
            None => kube::Config::infer()
                .await
                .context("find the Kubernetes API server (no in-cluster service account, $KUBECONFIG or ~/.kube/config); pass --kubeconfig")?,
        };
        let kube = kube::Client::try_from(config).context("build the Kubernetes client")?;
        let mut sync = Sync { kube: kube.clone(), cp: client, name: args.name.clone() };
        if args.once {
            return Ok(sync.round().await);
        }
        let identity = args
            .identity
            .clone()
            .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_string()))
            .unwrap_or_else(|| format!("policy-sync-{}", std::process::id()));
        let mut election = args
            .leader_lease
            .as_ref()
            .map(|lease| kvota_member_agent::kube::Election::new(kube.clone(), &args.namespace, lease, &identity, Duration::from_secs(15)));
        tracing::info!(
            name = args.name.as_deref().unwrap_or("(the only one)"),
            interval_s = args.interval.as_secs(),
            leader_lease = args.leader_lease.as_deref().unwrap_or("(none: always acting)"),
            identity,
            "policy sync started"
        );
        let mut leading = election.is_none();
        let mut next_round = tokio::time::Instant::now();
        loop {
            if let Some(e) = election.as_mut() {
                match e.step().await {
                    Ok(now) => {
                        if now != leading {
                            tracing::info!(leader = now, holder = e.holder().unwrap_or(""), "policy sync leadership changed");
                        }
                        leading = now;
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "policy sync: leader election failed; not acting until it works");
                        leading = false;
                    }
                }
            }
            if leading && tokio::time::Instant::now() >= next_round {
                sync.round().await;
                next_round = tokio::time::Instant::now() + args.interval;
            }
            let wait = election.as_ref().map_or(args.interval, |e| e.period().min(args.interval));
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = tokio::signal::ctrl_c() => break,
                _ = terminate() => break,
            }
        }
        if let Some(e) = election.as_mut() {
            let _ = e.release().await;
        }
        tracing::info!("policy sync stopped");
        Ok(std::process::ExitCode::SUCCESS)
    })
}

async fn terminate() {
    #[cfg(unix)]
    if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        s.recv().await;
        return;
    }
    std::future::pending::<()>().await;
}

fn is_loopback(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).trim_start_matches('[').trim_end_matches(']');
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

struct Sync {
    kube: kube::Client,
    cp: Client,
    name: Option<String>,
}

impl Sync {
    /// One round; the exit code `--once` reports.
    async fn round(&mut self) -> std::process::ExitCode {
        let resources = match self.list().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "policy sync: cannot list FairnessPolicy resources; retrying next round");
                return std::process::ExitCode::from(1);
            }
        };
        let chosen: Vec<usize> = match &self.name {
            Some(n) => resources.iter().enumerate().filter(|(_, r)| &r.name == n).map(|(i, _)| i).collect(),
            None => (0..resources.len()).collect(),
        };
        let mut verdicts: BTreeMap<usize, Verdict> = BTreeMap::new();
        let mut code = std::process::ExitCode::from(2);
        match chosen.as_slice() {
            [] => match &self.name {
                Some(n) => tracing::warn!(name = n, "policy sync: no FairnessPolicy `{n}` in the cluster; the federation keeps its policy"),
                None => tracing::info!("policy sync: no FairnessPolicy in the cluster; the federation keeps its policy"),
            },
            [one] => {
                let v = self.follow(&resources[*one]).await;
                code = match &v {
                    Verdict::Accepted { .. } => std::process::ExitCode::SUCCESS,
                    Verdict::Rejected { reason: "Unreachable", .. } => std::process::ExitCode::from(1),
                    Verdict::Rejected { .. } => std::process::ExitCode::from(2),
                };
                verdicts.insert(*one, v);
            }
            several => {
                let names: Vec<String> = several.iter().map(|i| format!("{} ({})", resources[*i].name, resources[*i].group)).collect();
                let message = format!(
                    "{} FairnessPolicy resources ({}) and the sync controller was given no --name: none is applied; delete all but one, or name one with --name",
                    several.len(),
                    names.join(", ")
                );
                tracing::warn!("policy sync: {message}");
                for i in several {
                    verdicts.insert(*i, Verdict::Rejected { reason: "Ambiguous", message: message.clone(), problems: Vec::new() });
                }
            }
        }
        if let Some(followed) = chosen.first().filter(|_| chosen.len() == 1) {
            for i in 0..resources.len() {
                if i != *followed {
                    let message = format!(
                        "the federation follows FairnessPolicy `{}` ({}); this one is not applied",
                        resources[*followed].name, resources[*followed].group
                    );
                    verdicts.insert(i, Verdict::Rejected { reason: "NotSelected", message, problems: Vec::new() });
                }
            }
        } else if self.name.is_some() {
            for i in 0..resources.len() {
                verdicts.entry(i).or_insert_with(|| Verdict::Rejected {
                    reason: "NotSelected",
                    message: format!("the sync controller follows FairnessPolicy `{}` only", self.name.as_deref().unwrap_or("")),
                    problems: Vec::new(),
                });
            }
        }
        for (i, v) in verdicts {
            if let Err(e) = write_status(&resources[i], &v).await {
                tracing::warn!(policy = resources[i].name, error = %e, "policy sync: cannot write status; retrying next round");
            }
        }
        code
    }

    async fn list(&self) -> Result<Vec<Resource>> {
        let mut out = Vec::new();
        for (group, optional) in [("kvota.dev", false), ("kvitej.io", true)] {
            let ar = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, "v1alpha1", "FairnessPolicy"), "fairnesspolicies");
            let api: Api<DynamicObject> = Api::all_with(self.kube.clone(), &ar);
            let list = match api.list(&ListParams::default()).await {
                Ok(l) => l,
                // The article's group is optional: its CRD may not be installed.
                Err(kube::Error::Api(s)) if optional && s.code == 404 => continue,
                Err(e) => return Err(e).with_context(|| format!("list fairnesspolicies.{group}")),
            };
            for o in list.items {
                let object = serde_json::to_value(&o).context("a FairnessPolicy as JSON")?;
                let status = object
                    .get("status")
                    .and_then(|s| serde_json::from_value::<FairnessPolicyStatus>(s.clone()).ok())
                    .unwrap_or_default();
                out.push(Resource {
                    api: api.clone(),
                    group,
                    name: o.metadata.name.clone().unwrap_or_default(),
                    generation: o.metadata.generation,
                    object,
                    status,
                });
            }
        }
        Ok(out)
    }

    /// Checks the followed resource and brings the federation to it.
    async fn follow(&self, r: &Resource) -> Verdict {
        // The resource as it is, through the same parser as a policy file (JSON is YAML).
        let text = r.object.to_string();
        let policy = match Policy::from_yaml(&text) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(policy = r.name, generation = r.generation, "policy sync: {e}");
                return Verdict::Rejected {
                    reason: "Invalid",
                    message: format!("the policy is invalid ({} problem{}); the federation keeps its policy", e.issues.len(), if e.issues.len() == 1 { "" } else { "s" }),
                    problems: e.issues.into_iter().map(|i| Problem { path: i.path, message: i.message }).collect(),
                };
            }
        };
        let in_force = self
            .cp
            .call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) })
            .await;
        let in_force = match in_force {
            Ok(reply) => Policy::from_yaml(&reply.yaml).ok(),
            Err(s) => return unreachable_or_refused(&r.name, &s),
        };
        if in_force.as_ref() == Some(&policy) {
            return Verdict::Accepted {
                reason: "InSync",
                message: format!("in force on the federation ({} tenants)", policy.tenants.len()),
            };
        }
        if in_force.is_some() {
            tracing::info!(policy = r.name, generation = r.generation, "policy sync: the federation's policy differs from the resource; applying the resource");
        }
        let yaml = policy.to_yaml();
        let applied = self
            .cp
            .call(|ch| {
                let yaml = yaml.clone();
                async move { Ok(Client::admin(ch).apply_policy(v1::PolicyRequest { yaml }).await?.into_inner()) }
            })
            .await;
        match applied {
            Ok(reply) => {
                tracing::info!(policy = r.name, generation = r.generation, tenants = reply.tenants, "policy sync: applied to the federation");
                Verdict::Accepted {
                    reason: "Applied",
                    message: format!("applied to the federation ({} tenants)", reply.tenants),
                }
            }
            Err(s) => unreachable_or_refused(&r.name, &s),
        }
    }
}

fn unreachable_or_refused(name: &str, s: &tonic::Status) -> Verdict {
    let unreachable = matches!(s.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown);
    tracing::warn!(policy = name, code = ?s.code(), message = s.message(), "policy sync: the control plane did not take the policy");
    if unreachable {
        Verdict::Rejected {
            reason: "Unreachable",
            message: format!("the control plane could not be reached ({}); retrying", s.message()),
            problems: Vec::new(),
        }
    } else {
        Verdict::Rejected {
            reason: "Refused",
            message: format!("the control plane refused the policy ({:?}): {}", s.code(), s.message()),
            problems: Vec::new(),
        }
    }
}

/// Writes the status a verdict means, unless the resource already says exactly that.
async fn write_status(r: &Resource, v: &Verdict) -> Result<()> {
    let (status, reason, message, problems) = match v {
        Verdict::Accepted { reason, message } => ("True", *reason, message.clone(), Vec::new()),
        Verdict::Rejected { reason, message, problems } => ("False", *reason, message.clone(), problems.clone()),
    };
    let old = r.status.conditions.iter().find(|c| c.type_ == "Accepted");
    // Applied earlier and still in force: the condition that says so stays as it is.
    let still = reason == "InSync" && old.is_some_and(|c| c.status == "True" && c.observed_generation == r.generation);
    let unchanged = still
        || r.status.observed_generation == r.generation
        && r.status.problems == problems
        && old.is_some_and(|c| c.status == status && c.reason == reason && c.message == message && c.observed_generation == r.generation);
    if unchanged {
        return Ok(());
    }
    // The transition time moves only when the status itself flips.
    let since = match old {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => kvota_member_agent::kube::format_time(
            i64::try_from(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())).unwrap_or(0),
        ),
    };
    let mut conditions: Vec<Condition> = r.status.conditions.iter().filter(|c| c.type_ != "Accepted").cloned().collect();
    conditions.push(Condition {
        type_: "Accepted".to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: r.generation,
        last_transition_time: since,
    });
    let next = FairnessPolicyStatus { observed_generation: r.generation, conditions, problems };
    // Merge patch: `problems: null` clears the list once the policy is valid again.
    let mut body = serde_json::to_value(&next).context("status as JSON")?;
    if next.problems.is_empty() {
        body["problems"] = Value::Null;
    }
    r.api
        .patch_status(&r.name, &PatchParams { field_manager: Some(MANAGER.to_string()), ..PatchParams::default() }, &Patch::Merge(json!({ "status": body })))
        .await
        .with_context(|| format!("patch the status of FairnessPolicy {}", r.name))?;
    Ok(())
}
