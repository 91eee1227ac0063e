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
use kvota_fairness::document::PolicyDocument;
use kvota_fairness::policy::{Policy, PolicyError, PolicyIssue};
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
    /// The FairnessPolicy (cluster-scoped) to follow, as NAME or GROUP/NAME
    /// (`kvota.dev/platform`, `kvitej.io/myfair-cluster`) where both groups hold one of that
    /// name. Without it, the only one in the cluster is followed, and several are an
    /// error reported in each one's status.
    #[arg(long, env = "KVOTA_POLICY_NAME", value_name = "[GROUP/]NAME", value_parser = parse_name)]
    pub name: Option<Selector>,
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

/// Which FairnessPolicy `--name` picks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selector {
    group: Option<&'static str>,
    name: String,
}

impl Selector {
    fn picks(&self, r: &Resource) -> bool {
        r.name == self.name && self.group.is_none_or(|g| g == r.group)
    }
}

impl std::fmt::Display for Selector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.group {
            Some(g) => write!(f, "{g}/{}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

fn parse_name(s: &str) -> Result<Selector, String> {
    let (group, name) = match s.split_once('/') {
        Some((g, n)) => (
            Some(
                GROUPS
                    .iter()
                    .copied()
                    .find(|x| *x == g)
                    .ok_or_else(|| format!("`{g}` is not a FairnessPolicy group; use {}", GROUPS.join(" or ")))?,
            ),
            n,
        ),
        None => (None, s),
    };
    // A cluster-scoped object's name: a DNS subdomain (labels joined by dots, <= 253).
    if name.len() > 253 || !name.split('.').all(kvota_fairness::names::is_dns_label) {
        return Err(format!("`{name}` is not a Kubernetes object name"));
    }
    Ok(Selector {
        group,
        name: name.to_string(),
    })
}

/// The API groups FairnessPolicy is served in: kvota's, and the seed article's.
const GROUPS: [&str; 2] = ["kvota.dev", "kvitej.io"];

/// Most problems written to a resource's status (the rest are counted): a status must
/// stay far below the API server's request limit whatever the spec holds.
const MAX_PROBLEMS: usize = 100;

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
    Rejected {
        reason: &'static str,
        message: String,
        problems: Vec<Problem>,
    },
}

/// One FairnessPolicy as listed: its API, name, generation, the object, its status.
struct Resource {
    api: Api<DynamicObject>,
    group: &'static str,
    name: String,
    generation: Option<i64>,
    resource_version: Option<String>,
    object: Value,
    status: FairnessPolicyStatus,
}

/// `kvota policy sync`: runs until a signal (one round with `--once`), with the
/// control plane at `cp_addrs` (over TLS with `tls`).
pub fn run(
    args: SyncArgs,
    cp_addrs: &[String],
    tls: Option<kvota_client::tls::GrpcTls>,
) -> Result<std::process::ExitCode> {
    if tls.is_none() && !cp_addrs.iter().all(|a| is_loopback(a)) {
        anyhow::bail!(
            "--cp {} is not loopback and no --cp-ca/--cp-cert/--cp-key are given: the controller applies policies, which needs an operator certificate (docs/security.md)",
            cp_addrs.join(",")
        );
    }
    let client = Client::with_tls(cp_addrs, tls).map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    rt.block_on(async move {
        let kube = kube_client(args.kubeconfig.as_deref()).await?;
        let mut sync = Sync {
            kube: kube.clone(),
            cp: client,
            name: args.name.clone(),
            acting_until: None,
        };
        if args.once {
            return Ok(sync.round().await);
        }
        let identity = args
            .identity
            .clone()
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|h| h.trim().to_string())
            })
            .unwrap_or_else(|| format!("policy-sync-{}", std::process::id()));
        let election = args.leader_lease.as_ref().map(|lease| {
            kvota_member_agent::kube::Election::new(
                kube.clone(),
                &args.namespace,
                lease,
                &identity,
                Duration::from_secs(15),
            )
        });
        tracing::info!(
            name = args
                .name
                .as_ref()
                .map_or("(the only one)".to_string(), ToString::to_string),
            interval_s = args.interval.as_secs(),
            leader_lease = args.leader_lease.as_deref().unwrap_or("(none: always acting)"),
            identity,
            "policy sync started"
        );
        sync.run_until_signal(election, args.interval).await;
        tracing::info!("policy sync stopped");
        Ok(std::process::ExitCode::SUCCESS)
    })
}

/// A client of the API server `kubeconfig` names (default: in-cluster, or the usual
/// places).
async fn kube_client(kubeconfig: Option<&std::path::Path>) -> Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("read kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .with_context(|| format!("use kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer().await.context(
            "find the Kubernetes API server (no in-cluster service account, $KUBECONFIG or ~/.kube/config); pass --kubeconfig",
        )?,
    };
    kube::Client::try_from(config).context("build the Kubernetes client")
}

/// Turns true at Ctrl-C or SIGTERM (one listener for the whole run, so a signal during
/// a round is not lost).
fn stop_on_signal() -> tokio::sync::watch::Receiver<bool> {
    let (stop_tx, stop) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate() => {}
        }
        let _ = stop_tx.send(true);
    });
    stop
}

impl Sync {
    /// Runs a round every `interval` while this replica leads (always without an
    /// election) until a signal; gives the Lease up at the end.
    async fn run_until_signal(&mut self, mut election: Option<kvota_member_agent::kube::Election>, interval: Duration) {
        let mut stop = stop_on_signal();
        let mut leading = election.is_none();
        let mut next_round = tokio::time::Instant::now();
        while !*stop.borrow() {
            if let Some(e) = election.as_mut() {
                leading = elect(e, leading).await;
            }
            if leading && tokio::time::Instant::now() >= next_round {
                // A round ends before this replica's leadership could: writes after that
                // could race the next leader's.
                self.acting_until = election.as_ref().and_then(|e| e.leading_until());
                let left = self
                    .acting_until
                    .map(|t| t.saturating_duration_since(std::time::Instant::now()));
                let round = self.round();
                match left {
                    Some(left) => tokio::select! {
                        r = tokio::time::timeout(left, round) => {
                            if r.is_err() {
                                tracing::warn!("policy sync: round cut off where this replica's leadership would run out; the next round goes on");
                            }
                        }
                        _ = stop.changed() => break,
                    },
                    None => tokio::select! {
                        _ = round => {}
                        _ = stop.changed() => break,
                    },
                }
                next_round = tokio::time::Instant::now() + interval;
            }
            let wait = election.as_ref().map_or(interval, |e| e.period().min(interval));
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.changed() => break,
            }
        }
        if let Some(e) = election.as_mut() {
            if let Err(err) = e.release().await {
                tracing::warn!(error = %err, "policy sync: could not give the Lease up; a standby takes over when it runs out");
            }
        }
    }
}

/// One step of the leader election; whether this replica leads now (`was`: before).
async fn elect(e: &mut kvota_member_agent::kube::Election, was: bool) -> bool {
    match e.step().await {
        Ok(now) => {
            if now != was {
                tracing::info!(
                    leader = now,
                    holder = e.holder().unwrap_or(""),
                    "policy sync leadership changed"
                );
            }
            now
        }
        Err(err) => {
            tracing::warn!(error = %err, "policy sync: leader election failed; not acting until it works");
            false
        }
    }
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
    let host = addr
        .rsplit_once(':')
        .map_or(addr, |(h, _)| h)
        .trim_start_matches('[')
        .trim_end_matches(']');
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

struct Sync {
    kube: kube::Client,
    cp: Client,
    name: Option<Selector>,
    /// While leader-elected: this replica acts only until then (no write after it).
    acting_until: Option<std::time::Instant>,
}

impl Sync {
    /// Whether this replica may still write (it leads, or runs alone).
    fn acting(&self) -> bool {
        self.acting_until.is_none_or(|t| std::time::Instant::now() < t)
    }

    /// One round, in a `reconcile` span (the selector given, the resource followed and
    /// its generation once known); the exit code `--once` reports.
    async fn round(&mut self) -> std::process::ExitCode {
        use tracing::Instrument as _;
        let span = tracing::info_span!(
            "reconcile",
            name = self.name.as_ref().map_or(String::new(), ToString::to_string),
            policy = tracing::field::Empty,
            generation = tracing::field::Empty,
        );
        self.reconcile().instrument(span).await
    }

    async fn reconcile(&mut self) -> std::process::ExitCode {
        let resources = match self.list().await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("policy sync: cannot list FairnessPolicy resources ({e:#}); retrying next round");
                return std::process::ExitCode::from(1);
            }
        };
        let chosen: Vec<usize> = match &self.name {
            Some(n) => resources
                .iter()
                .enumerate()
                .filter(|(_, r)| n.picks(r))
                .map(|(i, _)| i)
                .collect(),
            None => (0..resources.len()).collect(),
        };
        let mut verdicts: BTreeMap<usize, Verdict> = BTreeMap::new();
        let mut code = std::process::ExitCode::from(2);
        match chosen.as_slice() {
            [] => match &self.name {
                Some(n) => tracing::warn!(
                    "policy sync: no FairnessPolicy `{n}` in the cluster; the federation keeps its policy"
                ),
                None => {
                    tracing::info!("policy sync: no FairnessPolicy in the cluster; the federation keeps its policy")
                }
            },
            [one] => {
                let v = self.follow(&resources[*one]).await;
                code = match &v {
                    Verdict::Accepted { .. } => std::process::ExitCode::SUCCESS,
                    Verdict::Rejected {
                        reason: "Unreachable", ..
                    } => std::process::ExitCode::from(1),
                    Verdict::Rejected { .. } => std::process::ExitCode::from(2),
                };
                verdicts.insert(*one, v);
            }
            several => self.ambiguous(&resources, several, &mut verdicts),
        }
        self.not_selected(&resources, &chosen, &mut verdicts);
        for (i, v) in verdicts {
            if !self.acting() {
                tracing::warn!("policy sync: leadership ran out during the round; status left to the next leader");
                break;
            }
            if let Err(e) = write_status(&resources[i], &v).await {
                tracing::warn!(
                    policy = resources[i].name,
                    "policy sync: cannot write status ({e:#}); retrying next round"
                );
            }
        }
        code
    }

    /// Several resources chosen: none is applied, each is told why.
    fn ambiguous(&self, resources: &[Resource], several: &[usize], verdicts: &mut BTreeMap<usize, Verdict>) {
        let names: Vec<String> = several
            .iter()
            .map(|i| format!("{} ({})", resources[*i].name, resources[*i].group))
            .collect();
        let message = match &self.name {
            None => format!(
                "{} FairnessPolicy resources ({}) and the sync controller was given no --name: none is applied; delete all but one, or name one with --name",
                several.len(),
                names.join(", ")
            ),
            Some(n) => format!(
                "--name {n} matches {} FairnessPolicy resources ({}): none is applied; name one with --name GROUP/NAME",
                several.len(),
                names.join(", ")
            ),
        };
        tracing::warn!("policy sync: {message}");
        for i in several {
            verdicts.insert(
                *i,
                Verdict::Rejected {
                    reason: "Ambiguous",
                    message: message.clone(),
                    problems: Vec::new(),
                },
            );
        }
    }

    /// Every resource not followed is told so (with one followed, or a --name given).
    fn not_selected(&self, resources: &[Resource], chosen: &[usize], verdicts: &mut BTreeMap<usize, Verdict>) {
        if let Some(followed) = chosen.first().filter(|_| chosen.len() == 1) {
            for i in 0..resources.len() {
                if i != *followed {
                    let message = format!(
                        "the federation follows FairnessPolicy `{}` ({}); this one is not applied",
                        resources[*followed].name, resources[*followed].group
                    );
                    verdicts.insert(
                        i,
                        Verdict::Rejected {
                            reason: "NotSelected",
                            message,
                            problems: Vec::new(),
                        },
                    );
                }
            }
        } else if self.name.is_some() {
            for i in 0..resources.len() {
                verdicts.entry(i).or_insert_with(|| Verdict::Rejected {
                    reason: "NotSelected",
                    message: format!(
                        "the sync controller follows FairnessPolicy `{}` only",
                        self.name.as_ref().map_or(String::new(), ToString::to_string)
                    ),
                    problems: Vec::new(),
                });
            }
        }
    }

    async fn list(&self) -> Result<Vec<Resource>> {
        let mut out = Vec::new();
        let mut missing = Vec::new();
        for group in GROUPS {
            let ar = ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk(group, "v1alpha1", "FairnessPolicy"),
                "fairnesspolicies",
            );
            let api: Api<DynamicObject> = Api::all_with(self.kube.clone(), &ar);
            let list = match api.list(&ListParams::default()).await {
                Ok(l) => l,
                // That group's CRD is not installed (the article's is optional).
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    missing.push(group);
                    continue;
                }
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
                    resource_version: o.metadata.resource_version.clone(),
                    object,
                    status,
                });
            }
        }
        match missing.as_slice() {
            [] => {}
            ["kvitej.io"] => tracing::debug!("CRD fairnesspolicies.kvitej.io (the article's group) is not installed"),
            _ => {
                let names: Vec<String> = missing.iter().map(|g| format!("fairnesspolicies.{g}")).collect();
                let msg = format!(
                    "the CRD {} is not installed in this cluster: install deploy/kubernetes/base/crd (`kvota policy crd | kubectl apply -f -`)",
                    names.join(" and ")
                );
                if missing.len() == GROUPS.len() {
                    anyhow::bail!(msg);
                }
                tracing::warn!("policy sync: {msg}");
            }
        }
        Ok(out)
    }

    /// Checks the followed resource and brings the federation to it.
    async fn follow(&self, r: &Resource) -> Verdict {
        let span = tracing::Span::current();
        span.record("policy", r.name.as_str());
        if let Some(g) = r.generation {
            span.record("generation", g);
        }
        let policy = match checked_policy(r) {
            Ok(p) => p,
            Err(verdict) => return verdict,
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
            tracing::info!(
                policy = r.name,
                generation = r.generation,
                "policy sync: the federation's policy differs from the resource; applying the resource"
            );
        }
        if !self.acting() {
            return Verdict::Rejected {
                reason: "Unreachable",
                message: "leadership ran out before the policy could be applied; the next leader applies it"
                    .to_string(),
                problems: Vec::new(),
            };
        }
        let yaml = policy.to_yaml();
        let applied = self
            .cp
            .call(|ch| {
                let yaml = yaml.clone();
                async move {
                    Ok(Client::admin(ch)
                        .apply_policy(v1::PolicyRequest { yaml })
                        .await?
                        .into_inner())
                }
            })
            .await;
        match applied {
            Ok(reply) => {
                tracing::info!(
                    policy = r.name,
                    generation = r.generation,
                    tenants = reply.tenants,
                    "policy sync: applied to the federation"
                );
                Verdict::Accepted {
                    reason: "Applied",
                    message: format!("applied to the federation ({} tenants)", reply.tenants),
                }
            }
            Err(s) => unreachable_or_refused(&r.name, &s),
        }
    }
}

/// The resource's policy document, checked as a policy file is, or the verdict that
/// rejects it with its problems (at most [`MAX_PROBLEMS`] listed).
fn checked_policy(r: &Resource) -> Result<Policy, Verdict> {
    // The parts of the resource that are the policy document (not its status, nor
    // metadata beyond the name), checked as a policy file is.
    let doc = json!({
        "apiVersion": r.object.get("apiVersion"),
        "kind": r.object.get("kind"),
        "metadata": { "name": r.name },
        "spec": r.object.get("spec"),
    });
    let checked = match serde_json::from_value::<PolicyDocument>(doc) {
        Ok(d) => Policy::from_document(&d),
        Err(e) => Err(PolicyError {
            issues: vec![PolicyIssue {
                path: "spec".to_string(),
                message: e.to_string(),
            }],
        }),
    };
    match checked {
        Ok(p) => Ok(p),
        Err(e) => {
            tracing::warn!(policy = r.name, generation = r.generation, "policy sync: {e}");
            let n = e.issues.len();
            let mut problems: Vec<Problem> = e
                .issues
                .into_iter()
                .take(MAX_PROBLEMS)
                .map(|i| Problem {
                    path: i.path,
                    message: i.message,
                })
                .collect();
            if n > MAX_PROBLEMS {
                problems.push(Problem {
                    path: "(more)".to_string(),
                    message: format!(
                        "and {} more problems; `kvota policy validate` on the document lists them all",
                        n - MAX_PROBLEMS
                    ),
                });
            }
            Err(Verdict::Rejected {
                reason: "Invalid",
                message: format!(
                    "the policy is invalid ({n} problem{}); the federation keeps its policy",
                    if n == 1 { "" } else { "s" }
                ),
                problems,
            })
        }
    }
}

fn unreachable_or_refused(name: &str, s: &tonic::Status) -> Verdict {
    let unreachable = matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown
    );
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
        Verdict::Rejected {
            reason,
            message,
            problems,
        } => ("False", *reason, message.clone(), problems.clone()),
    };
    let old = r.status.conditions.iter().find(|c| c.type_ == "Accepted");
    // Applied earlier and still in force: the condition that says so stays as it is.
    let still = reason == "InSync" && old.is_some_and(|c| c.status == "True" && c.observed_generation == r.generation);
    let unchanged = still
        || r.status.observed_generation == r.generation
            && r.status.problems == problems
            && old.is_some_and(|c| {
                c.status == status
                    && c.reason == reason
                    && c.message == message
                    && c.observed_generation == r.generation
            });
    if unchanged {
        return Ok(());
    }
    // The transition time moves only when the status itself flips.
    let since = match old {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => kvota_member_agent::kube::format_time(
            i64::try_from(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
            )
            .unwrap_or(0),
        ),
    };
    let mut conditions: Vec<Condition> = r
        .status
        .conditions
        .iter()
        .filter(|c| c.type_ != "Accepted")
        .cloned()
        .collect();
    conditions.push(Condition {
        type_: "Accepted".to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: r.generation,
        last_transition_time: since,
    });
    let next = FairnessPolicyStatus {
        observed_generation: r.generation,
        conditions,
        problems,
    };
    patch_status(r, &next).await
}

/// Patches the resource's status to `next`, onto the version that was judged.
async fn patch_status(r: &Resource, next: &FairnessPolicyStatus) -> Result<()> {
    // Merge patch: `problems: null` clears the list once the policy is valid again.
    let mut body = serde_json::to_value(next).context("status as JSON")?;
    if next.problems.is_empty() {
        body["problems"] = Value::Null;
    }
    // Only onto the version this verdict is about: if the resource changed meanwhile,
    // the API server answers 409 and the next round judges the new one.
    let patch = json!({ "metadata": { "resourceVersion": r.resource_version }, "status": body });
    match r
        .api
        .patch_status(
            &r.name,
            &PatchParams {
                field_manager: Some(MANAGER.to_string()),
                ..PatchParams::default()
            },
            &Patch::Merge(patch),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => {
            tracing::info!(
                policy = r.name,
                "policy sync: the resource changed during the round; judged again next round"
            );
            Ok(())
        }
        Err(e) => Err(e).with_context(|| format!("patch the status of FairnessPolicy {}", r.name)),
    }
}
