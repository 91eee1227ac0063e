//! `kvota demo`: three GPU clusters kept fair through a morning rush, a partition and a
//! control-plane failover, on one machine, with nothing else installed.
//!
//! What is real: three `kvota server` processes (this binary, spawned as children, each
//! with its own data directory) forming one Raft group on loopback; three member
//! agents with their usage journals, reporting over gRPC and enforcing leases; the
//! admission path (every pod is an AdmissionReview through the webhook code); the
//! partition (a TCP proxy that drops the agent's connections); the leader's death
//! (SIGKILL). What is simulated: the clusters themselves (nodes, a first-fit scheduler,
//! pods that run for a while) and the workload, generated from `--seed`.
//!
//! Children are tied to this process: each reads a pipe from it and exits when it
//! closes, so none outlive the demo, even if it is killed.

mod link;
mod measure;
mod run;
mod scenario;
mod view;

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use kvota_client::client::Client;
use kvota_fairness::lease::LeaseStatus;
use kvota_fairness::policy::{Policy, TENANT_LABEL};
use kvota_fairness::resources::ResourceWeights;
use kvota_fairness::MilliGpue;
use kvota_member_agent::agent::Agent;
use kvota_member_agent::review::Outcome;
use kvota_member_agent::sim::{SimCluster, SimPod};
use kvota_proto::v1;
use link::LinkProxy;
use serde::Serialize;

use measure::{pct, Measures, Sample, TenantMeasures, TenantSummary, UsageCheck};
use scenario::{Arrival, ClusterSpec};

/// The tenants the demo's workload is written for.
pub const TENANTS: [&str; 3] = ["inference", "research", "training"];
/// How often agents report (and so renew their leases), wall clock.
const REPORT_EVERY: Duration = Duration::from_millis(300);
/// How often the demo advances the simulated clusters.
const TICK: Duration = Duration::from_millis(100);
/// Demand younger than this is not yet "starved": one report and one lease round trip,
/// plus one retry of a denied pod, is how fast any control loop can react.
const STARVATION_GRACE_MS: u64 = 2_000;
/// The fastest `--speed`: leases, reports and Raft run in real time; beyond this the
/// compressed jobs become shorter than a few report rounds.
const MAX_SPEED: f64 = 3.0;

/// Options of `kvota demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// How fast the scenario runs: 1 takes about 110 s, 2 about 60 s; `max` (= 3) is the
    /// fastest at which leases and reports (real time) still keep up.
    #[arg(long, default_value = "1", value_parser = parse_speed)]
    speed: f64,
    /// Seed of the workload (which pods, when, where, how long): the same seed replays
    /// the same morning.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// A FairnessPolicy file instead of the article's policy. It must define the tenants
    /// inference, research and training (the workload's teams); others get no load.
    #[arg(long, value_name = "FILE")]
    policy: Option<PathBuf>,
    /// Keep the control plane's and agents' data (and the servers' logs) here instead of
    /// a temporary directory that is removed at the end. Must be empty or not exist.
    #[arg(long, value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Also write the summary (and the timeline) as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Print periodic lines instead of the live table, even on a terminal.
    #[arg(long)]
    plain: bool,
}

fn parse_speed(s: &str) -> Result<f64, String> {
    if s == "max" {
        return Ok(MAX_SPEED);
    }
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number (or `max`)"))?;
    if !(0.25..=MAX_SPEED).contains(&v) {
        return Err(format!("{v} is outside 0.25..={MAX_SPEED}"));
    }
    Ok(v)
}

/// The article's policy, with leases short enough that the partition shows a lease
/// expiring: 6 s at speed 1, shorter when faster, but never under 4 s, because a
/// control-plane failover takes about a second of real time whatever the speed.
fn default_policy_yaml(speed: f64) -> String {
    let duration_ms = real_ms(6_000, speed).max(4_000);
    let margin_ms = duration_ms / 6;
    // Reclaim at the scenario's pace: starved 3 s, pods younger than 10 s spared.
    let starved_ms = real_ms(3_000, speed).max(1_000);
    let min_runtime_ms = real_ms(10_000, speed);
    format!(
        "apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata:
  name: article-demo
spec:
  decayHalfLife: 24h
  lease: {{duration: {duration_ms}ms, clockSkewMargin: {margin_ms}ms}}
  reclaim: {{starvedFor: {starved_ms}ms, minRuntime: {min_runtime_ms}ms}}
  tenants:
  - {{name: training, weight: 40, minShare: 20, maxShare: 60, preemptible: true}}
  - {{name: inference, weight: 50, minShare: 40, maxShare: 80, preemptible: false}}
  - {{name: research, weight: 10, minShare: 5, maxShare: 25, preemptible: true}}
"
    )
}

fn load_policy(args: &DemoArgs) -> Result<(String, Policy)> {
    let yaml = match &args.policy {
        None => default_policy_yaml(args.speed),
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("read --policy {}: check the path and that it is readable", p.display()))?,
    };
    let policy = match Policy::from_yaml(&yaml) {
        Ok(p) => p,
        Err(e) => bail!(
            "{} is not a valid FairnessPolicy (`kvota policy validate FILE` shows the same): {e}",
            args.policy
                .as_deref()
                .map_or_else(|| "the demo policy".to_string(), |p| p.display().to_string())
        ),
    };
    let missing: Vec<&str> = TENANTS.iter().copied().filter(|t| policy.tenant(t).is_none()).collect();
    if !missing.is_empty() {
        bail!(
            "the demo's workload belongs to the tenants {}; the policy lacks {} (add them, or run without --policy)",
            TENANTS.join(", "),
            missing.join(", ")
        );
    }
    Ok((yaml, policy))
}

fn prepare_dir(args: &DemoArgs) -> Result<(PathBuf, Option<tempfile::TempDir>)> {
    match &args.data_dir {
        Some(d) => {
            if d.exists() {
                let mut entries = std::fs::read_dir(d).with_context(|| {
                    format!(
                        "--data-dir {}: cannot read it; pick a directory you can write",
                        d.display()
                    )
                })?;
                if entries.next().is_some() {
                    bail!(
                        "--data-dir {} is not empty: the demo starts a new federation; give an empty or new directory",
                        d.display()
                    );
                }
            }
            std::fs::create_dir_all(d).with_context(|| {
                format!(
                    "--data-dir {}: cannot create it; pick a directory you can write",
                    d.display()
                )
            })?;
            let probe = d.join(".kvota-write-test");
            std::fs::write(&probe, b"ok").with_context(|| {
                format!(
                    "--data-dir {}: cannot write there; pick a directory you can write",
                    d.display()
                )
            })?;
            let _ = std::fs::remove_file(probe);
            Ok((d.clone(), None))
        }
        None => {
            let t = tempfile::Builder::new().prefix("kvota-demo-").tempdir().context(
                "create a temporary directory (is TMPDIR writable?); or pass --data-dir to a writable directory",
            )?;
            Ok((t.path().to_path_buf(), Some(t)))
        }
    }
}

/// Runs the demo.
pub fn run(args: DemoArgs) -> Result<ExitCode> {
    let (yaml, policy) = load_policy(&args)?;
    if let Some(j) = &args.json {
        if let Some(parent) = j.parent().filter(|p| !p.as_os_str().is_empty()) {
            if !parent.is_dir() {
                bail!("--json {}: directory {} does not exist", j.display(), parent.display());
            }
        }
    }
    let (dir, tmp) = prepare_dir(&args)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    let result = rt.block_on(demo(&args, yaml, policy, &dir));
    rt.shutdown_timeout(Duration::from_secs(2));
    match result {
        Ok(code) if code == ExitCode::from(1) => {
            if let Some(t) = tmp {
                let kept = t.keep();
                eprintln!(
                    "kvota demo: a check failed; logs and data kept in {} for a look",
                    kept.display()
                );
            }
            Ok(code)
        }
        Ok(code) => Ok(code),
        Err(e) => {
            if let Some(t) = tmp {
                let kept = t.keep();
                eprintln!("kvota demo: logs and data kept in {} for a look", kept.display());
            }
            Err(e)
        }
    }
}

/// One `kvota server` child.
struct CpProc {
    id: u64,
    rpc: String,
    raft: String,
    http: String,
    dir: PathBuf,
    log: PathBuf,
    child: Option<tokio::process::Child>,
    _stdin: Option<tokio::process::ChildStdin>,
}

impl CpProc {
    fn spawn(&mut self, exe: &Path, init: Option<&[String]>) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("open log file {}", self.log.display()))?;
        let mut cmd = tokio::process::Command::new(exe);
        cmd.arg("server")
            .args([
                "--id",
                &self.id.to_string(),
                "--listen",
                &self.rpc,
                "--raft-listen",
                &self.raft,
                "--http",
                &self.http,
            ])
            .args(["--tick-ms", "250", "--exit-with-parent"])
            // Three servers and three agent journals share one disk here; an election
            // needs two fsyncs in a row, so the demo uses etcd-like timeouts rather than
            // the aggressive defaults (see docs/demo.md).
            .args([
                "--heartbeat-ms",
                "100",
                "--election-timeout-min-ms",
                "600",
                "--election-timeout-max-ms",
                "1200",
            ])
            .arg("--data-dir")
            .arg(&self.dir)
            // KVOTA_DEMO_SERVER_LOG sets the servers' RUST_LOG (their logs are cpN.log).
            .env(
                "RUST_LOG",
                std::env::var("KVOTA_DEMO_SERVER_LOG").unwrap_or_else(|_| "info,openraft=warn".to_string()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .kill_on_drop(true);
        if let Some(members) = init {
            cmd.arg("--init");
            for m in members {
                cmd.args(["--member", m]);
            }
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("start control-plane node {} ({})", self.id, exe.display()))?;
        self._stdin = child.stdin.take();
        self.child = Some(child);
        Ok(())
    }

    async fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill().await;
        }
        self._stdin = None;
    }

    /// If the process has exited: why, with the end of its log.
    fn exited(&mut self) -> Option<String> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(3).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        Some(format!(
            "control-plane node {} exited ({status}): {}",
            self.id,
            tail.join(" | ")
        ))
    }
}

fn free_addr() -> Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("find a free loopback port")?;
    Ok(l.local_addr().context("read a local address")?.to_string())
}

/// Starts three servers on free loopback ports and waits for a leader. A port found free
/// can be taken by another program before the server binds it; then the attempt is
/// thrown away (fresh directories, fresh ports) and made again.
async fn start_control_plane(exe: &Path, dir: &Path) -> Result<(Vec<CpProc>, Vec<(u64, Client)>, u64)> {
    let mut attempt = 0;
    'attempt: loop {
        attempt += 1;
        let mut procs = Vec::new();
        for id in 1..=3u64 {
            let node_dir = dir.join(format!("cp{id}"));
            if node_dir.exists() {
                std::fs::remove_dir_all(&node_dir).with_context(|| format!("clear {}", node_dir.display()))?;
            }
            procs.push(CpProc {
                id,
                rpc: free_addr()?,
                raft: free_addr()?,
                http: free_addr()?,
                dir: node_dir,
                log: dir.join(format!("cp{id}.log")),
                child: None,
                _stdin: None,
            });
        }
        let members: Vec<String> = procs
            .iter()
            .map(|p| format!("{}={},{},{}", p.id, p.rpc, p.http, p.raft))
            .collect();
        for (i, p) in procs.iter_mut().enumerate() {
            p.spawn(exe, if i == 0 { Some(&members) } else { None })?;
        }
        let node_clients = clients_of(&procs)?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut failed = None;
            for p in &mut procs {
                if let Some(why) = p.exited() {
                    failed = Some(why);
                }
            }
            if let Some(why) = failed {
                for p in &mut procs {
                    p.kill().await;
                }
                if why.contains("already in use") && attempt < 3 {
                    continue 'attempt;
                }
                bail!("{why}");
            }
            if let Some((id, _, _)) = find_leader(&node_clients).await {
                return Ok((procs, node_clients, id));
            }
            if Instant::now() > deadline {
                bail!(
                    "the control plane elected no leader within 30 s; see the logs cp1.log..cp3.log in {}",
                    dir.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The control plane as the demo last saw it.
#[derive(Clone, Debug, Default)]
struct CpView {
    seq: u64,
    capacity: MilliGpue,
    tenants: BTreeMap<String, v1::TenantInfo>,
    leader: Option<u64>,
    term: u64,
}

async fn timed<T>(f: impl std::future::Future<Output = Result<T, tonic::Status>>) -> Option<T> {
    tokio::time::timeout(Duration::from_millis(700), f).await.ok()?.ok()
}

async fn status_of(c: &Client) -> Option<v1::StatusReply> {
    timed(c.call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) })).await
}

async fn tenants_of(c: &Client) -> Option<v1::ListTenantsReply> {
    timed(c.call(|ch| async move { Ok(Client::admin(ch).list_tenants(v1::Empty {}).await?.into_inner()) })).await
}

/// The node that says it leads, and its client.
async fn find_leader(nodes: &[(u64, Client)]) -> Option<(u64, u64, &Client)> {
    for (id, c) in nodes {
        if let Some(s) = status_of(c).await {
            if s.role == "leader" {
                return Some((*id, s.term, c));
            }
        }
    }
    None
}

/// Polls the leader for entitlements, ten times a second.
fn spawn_poller(
    nodes: Vec<(u64, Client)>,
    view: Arc<Mutex<CpView>>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while !stop.load(Ordering::SeqCst) {
            if let Some((id, term, c)) = find_leader(&nodes).await {
                if let Some(t) = tenants_of(c).await {
                    let mut v = view.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    v.seq += 1;
                    v.capacity = t.capacity_milli_gpue;
                    v.tenants = t.tenants.into_iter().map(|x| (x.tenant.clone(), x)).collect();
                    v.leader = Some(id);
                    v.term = term;
                }
            } else {
                let mut v = view.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                v.leader = None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

/// A member cluster: its agent, its simulated cluster, and the proxies between the
/// agent and each control-plane node.
struct Member {
    spec: ClusterSpec,
    agent: Arc<Agent>,
    sim: SimCluster,
    capacity: MilliGpue,
    proxies: Vec<LinkProxy>,
    lease_kind: &'static str,
}

fn lease_kind(s: LeaseStatus) -> &'static str {
    match s {
        LeaseStatus::None => "none",
        LeaseStatus::Fresh { .. } => "fresh",
        LeaseStatus::Expiring { .. } => "expiring",
        LeaseStatus::Safe => "safe",
    }
}

/// The demo's output: what happened, measured.
#[derive(Debug, Serialize)]
pub struct Summary {
    /// Workload seed.
    pub seed: u64,
    /// Scenario speed.
    pub speed: f64,
    /// Wall-clock length of the scenario, seconds.
    pub duration_s: f64,
    /// Federation capacity, GPUe.
    pub capacity_gpue: f64,
    /// Per tenant.
    pub tenants: BTreeMap<String, TenantSummary>,
    /// Mean GPUe bound / capacity.
    pub gpu_utilization: f64,
    /// Admissions judged for over-admission.
    pub admissions_checked: u64,
    /// Admissions beyond `max(committed entitlement, held)` (must be 0).
    pub over_admissions: u64,
    /// GPUe admitted beyond entitlement, summed (must be 0).
    pub over_admitted_gpue: f64,
    /// Admissions beyond maxShare (must be 0).
    pub over_max_share: u64,
    /// Ledger against measured usage.
    pub usage: UsageCheck,
    /// Seconds from the burst until every tenant was fair (stable 2 s); None: never.
    pub recovery_after_burst_s: Option<f64>,
    /// Seconds from healing the partition until every tenant was fair.
    pub recovery_after_partition_s: Option<f64>,
    /// Whether the partitioned cluster's lease expired into safe budgets while cut off.
    pub partition_lease_expired: bool,
    /// Seconds from killing the leader until another node led.
    pub failover_s: Option<f64>,
    /// The killed node caught up after its restart.
    pub killed_node_rejoined: bool,
    /// Pods evicted by reclaim, per victim tenant.
    pub evictions: BTreeMap<String, u64>,
    /// GPUe-seconds of work the evicted pods lost (since their last checkpoint).
    pub eviction_lost_gpue_s: f64,
    /// Fairness over time.
    pub timeline: Vec<Sample>,
}

struct Open {
    tenant: String,
    gpue: MilliGpue,
    first_ms: u64,
    cluster: usize,
    resource: &'static str,
    count: u32,
}

/// A non-negative duration in ms from a float (speeds are in 0.25..=3, times far below
/// 2^53 ms).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn ms_of(v: f64) -> u64 {
    v.max(0.0) as u64
}

fn real_ms(scenario_ms: u64, speed: f64) -> u64 {
    ms_of(scenario_ms as f64 / speed)
}

/// One client per control-plane node (status and reads from that very node).
fn clients_of(procs: &[CpProc]) -> Result<Vec<(u64, Client)>> {
    procs
        .iter()
        .map(|p| Client::new(std::slice::from_ref(&p.rpc)).map(|c| (p.id, c)))
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("control-plane address: {}", e.message()))
}

async fn demo(args: &DemoArgs, yaml: String, policy: Policy, dir: &Path) -> Result<ExitCode> {
    let tty = !args.plain && std::io::stdout().is_terminal();
    let mut out = view::Out::new(tty);
    let exe = std::env::current_exe().context("find the kvota executable to start the control plane")?;
    out.line(&format!(
        "kvota demo: 3 control-plane nodes and 3 member clusters on this machine; seed {}, speed {}x (about {:.0} s); data in {}",
        args.seed,
        args.speed,
        real_ms(scenario::END_MS, args.speed) as f64 / 1000.0 + 8.0,
        dir.display()
    ));
    let (procs, node_clients, leader) = start_control_plane(&exe, dir).await?;
    let endpoints: Vec<String> = procs.iter().map(|p| p.rpc.clone()).collect();
    apply_policy(&endpoints, &yaml).await?;
    out.event(
        0,
        &format!(
            "control plane up: node {leader} leads; policy `{}` applied",
            policy.name
        ),
    );
    let fleet = join_fleet(&endpoints, dir, args.speed, &mut out).await?;
    // Background: agents report (renewing leases); the demo watches the control plane.
    let stop = Arc::new(AtomicBool::new(false));
    let reporters = spawn_reporters(&fleet, &stop);
    let cp_view = Arc::new(Mutex::new(CpView::default()));
    let poller = spawn_poller(node_clients, cp_view.clone(), stop.clone());
    let mut run = run::Run::new(args, &policy, out, tty, exe, procs, fleet, cp_view);
    let t0 = Instant::now();
    let interrupted = run.play(t0).await?;
    let run_ms = u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX);
    // Wind down: stop the load.
    stop.store(true, Ordering::SeqCst);
    for r in reporters {
        let _ = tokio::time::timeout(Duration::from_secs(3), r).await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), poller).await;
    run.out.finish();
    if interrupted {
        for p in &mut run.procs {
            p.kill().await;
        }
        eprintln!("kvota demo: interrupted; every process it started is stopped");
        return Ok(ExitCode::from(130));
    }
    finish(args, &policy, run, run_ms).await
}

/// Applies the demo's policy.
async fn apply_policy(endpoints: &[String], yaml: &str) -> Result<()> {
    let admin = Client::new(endpoints).map_err(|e| anyhow::anyhow!("control-plane address: {}", e.message()))?;
    let applied = admin
        .call(|ch| {
            let y = yaml.to_string();
            async move {
                Ok(Client::admin(ch)
                    .apply_policy(v1::PolicyRequest { yaml: y })
                    .await?
                    .into_inner())
            }
        })
        .await
        .map_err(|e| anyhow::anyhow!("apply the policy: {}", e.message()))?;
    if !applied.problems.is_empty() {
        bail!("the control plane rejected the policy: {:?}", applied.problems);
    }
    Ok(())
}

/// The member clusters: an agent and a simulated cluster each, reaching the control
/// plane through proxies (so the partition can cut them).
async fn join_fleet(endpoints: &[String], dir: &Path, speed: f64, out: &mut view::Out) -> Result<Vec<Member>> {
    let weights = ResourceWeights::new();
    let mut fleet: Vec<Member> = Vec::new();
    for spec in scenario::clusters() {
        let sim = SimCluster::with_nodes(spec.nodes.clone());
        let mut proxies = Vec::new();
        for e in endpoints {
            proxies.push(LinkProxy::start(e.clone()).await.context("start a loopback proxy")?);
        }
        let via: Vec<String> = proxies.iter().map(|p| p.addr().to_string()).collect();
        let agent = join_agent(&spec, &sim, dir, &via, speed).await?;
        let capacity = weights.capacity_gpue_milli(&sim.capacity_milli());
        let text = format!(
            "cluster {} joined: {} ({})",
            spec.name,
            spec.description,
            view::gpue(capacity)
        );
        out.event(0, &text);
        fleet.push(Member {
            spec,
            agent: Arc::new(agent),
            sim,
            capacity,
            proxies,
            lease_kind: "none",
        });
    }
    Ok(fleet)
}

/// One cluster's agent, registered with the policy fetched and its namespaces known.
async fn join_agent(spec: &ClusterSpec, sim: &SimCluster, dir: &Path, via: &[String], speed: f64) -> Result<Agent> {
    let agent = Agent::open(
        &kvota_fairness::names::ClusterName::from_static(spec.name),
        sim.capacity_milli(),
        &dir.join(format!("agent-{}", spec.name)),
        via,
    )
    .map_err(|e| anyhow::anyhow!("open agent {}: {e}", spec.name))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = match agent.register().await {
            Ok(()) => agent.fetch_policy().await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match r {
            Ok(()) => break,
            Err(e) if Instant::now() > deadline => bail!("agent {} could not register: {e}", spec.name),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    {
        let mut st = agent.state();
        for t in TENANTS {
            st.set_namespace(t, [(TENANT_LABEL.to_string(), t.to_string())].into());
        }
        // A denial counts as demand until the owner's next retry would have refreshed it
        // (with compressed time, the production default of a minute would hold stale
        // demand for the whole scenario).
        st.set_denied_demand_ttl(real_ms(3 * scenario::RETRY_MS, speed));
    }
    Ok(agent)
}

/// Each agent reports as `kvota agent` does: every [`REPORT_EVERY`], sooner once a pod
/// was denied or queued.
fn spawn_reporters(fleet: &[Member], stop: &Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<()>> {
    fleet
        .iter()
        .map(|m| {
            let (a, stop) = (m.agent.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    let started = tokio::time::Instant::now();
                    let _ = tokio::time::timeout(Duration::from_secs(2), a.report_once()).await;
                    let gap = kvota_member_agent::runtime::early_gap(REPORT_EVERY);
                    a.next_round(started, REPORT_EVERY, gap).await;
                }
            })
        })
        .collect()
}

/// After the scenario: drain every journal, read the ledger, check the killed node
/// rejoined, then the summary (and `--json`); exit 1 when a safety check failed.
async fn finish(args: &DemoArgs, policy: &Policy, mut run: run::Run<'_>, run_ms: u64) -> Result<ExitCode> {
    run.out
        .line("scenario over; draining the agents' journals and reading the ledger...");
    drain(&run.fleet).await;
    let node_clients = clients_of(&run.procs)?;
    let mut ledger = None;
    let deadline = Instant::now() + Duration::from_secs(10);
    while ledger.is_none() && Instant::now() < deadline {
        if let Some((_, _, c)) = find_leader(&node_clients).await {
            ledger = tenants_of(c).await;
        }
        if ledger.is_none() {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let ledger = ledger.context("the control plane did not answer at the end of the demo")?;
    let rejoined = match run.killed {
        Some((i, _, _)) => caught_up(&node_clients, run.procs[i].id).await,
        None => false,
    };
    let summary = summarize(
        args,
        policy,
        &run.fleet,
        &run.measures,
        &run.open,
        &ledger,
        run.capacity,
        run_ms,
        run.failover_ms,
        rejoined,
        run.partition_lease_expired,
    );
    for p in &mut run.procs {
        p.kill().await;
    }
    run.out.line(&view::summary_text(&summary));
    if let Some(j) = &args.json {
        let text = serde_json::to_string_pretty(&summary).context("encode the summary")?;
        std::fs::write(j, text).with_context(|| format!("write --json {}", j.display()))?;
        run.out.line(&format!("summary written to {}", j.display()));
    }
    let ok = summary.over_admissions == 0
        && summary.over_max_share == 0
        && summary.usage.lost_gpue_s == 0.0
        && summary.usage.double_counted_gpue_s == 0.0
        && summary.usage.unacknowledged_reports == 0;
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Every agent sends what its journal holds (the partition healed), within 20 s.
async fn drain(fleet: &[Member]) {
    for m in fleet {
        m.proxies.iter().for_each(|p| p.set_cut(false));
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    for m in fleet {
        while Instant::now() < deadline {
            let r = tokio::time::timeout(Duration::from_secs(3), m.agent.report_once()).await;
            if matches!(r, Ok(Ok(()))) && m.agent.backlog() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// Whether node `id` has applied (within 50 entries) what the furthest node has.
async fn caught_up(nodes: &[(u64, Client)], id: u64) -> bool {
    let mut applied = Vec::new();
    for (_, c) in nodes {
        applied.push(status_of(c).await.map(|s| (s.node_id, s.last_applied_index)));
    }
    let max_applied = applied.iter().flatten().map(|(_, a)| *a).max().unwrap_or(0);
    let mine = applied.iter().flatten().find(|(n, _)| *n == id).map_or(0, |(_, a)| *a);
    mine > 0 && mine + 50 >= max_applied
}

/// GPUe on a node per tenant, over every cluster (the agents' bound pods).
fn running_by_tenant(fleet: &[Member]) -> BTreeMap<String, MilliGpue> {
    let mut out = BTreeMap::new();
    for m in fleet {
        let st = m.agent.state();
        for t in TENANTS {
            *out.entry(t.to_string()).or_insert(0) += st.bound(t);
        }
    }
    out
}

/// Federation-wide in-use (bound + reserved) per tenant, from the agents' state, less
/// what runs on borrowed GPUs: lent idle capacity is outside the entitlement by design
/// (reclaimable, and bounded by the leases' borrow limits), so over-admission is judged
/// on the rest.
fn totals(fleet: &[Member]) -> BTreeMap<String, MilliGpue> {
    let mut m = BTreeMap::new();
    for member in fleet {
        let st = member.agent.state();
        for t in TENANTS {
            *m.entry(t.to_string()).or_insert(0) += st.inuse(t).saturating_sub(st.borrowed_gpue(t));
        }
    }
    m
}

fn submit(
    m: &mut Member,
    a: &Arrival,
    speed: f64,
    weights: &ResourceWeights,
    open: &mut BTreeMap<String, Open>,
    now: u64,
    lease_e: &mut BTreeMap<String, MilliGpue>,
) -> (Outcome, Option<u64>) {
    let pod = SimPod {
        namespace: a.tenant.to_string(),
        name: a.name.clone(),
        resource: a.resource.to_string(),
        count: a.count,
        duration_ms: real_ms(a.duration_ms, speed).max(1),
        priority: a.priority,
    };
    open.entry(pod.key()).or_insert_with(|| Open {
        tenant: a.tenant.to_string(),
        gpue: weights.gpue_milli(a.resource, u64::from(a.count) * 1000),
        first_ms: now,
        cluster: a.cluster,
        resource: a.resource,
        count: a.count,
    });
    let mut st = m.agent.state();
    let (outcome, may_wait) = m.sim.submit_reviewed(&mut st, &pod);
    // Read under the state's lock, as the webhook does: rounds after it carry the denial.
    // Not held while reports fail (the webhook does not hold then either).
    let mark = (may_wait && m.agent.reports_flow()).then(|| m.agent.rounds_taken());
    if outcome == Outcome::Allowed {
        let e = st
            .lease
            .lease()
            .and_then(|l| l.budgets.get(a.tenant))
            .map_or(0, |b| b.entitlement);
        let slot = lease_e.entry(a.tenant.to_string()).or_insert(0);
        *slot = (*slot).max(e);
    }
    (outcome, mark)
}

/// What the agents wrote into their journals, per tenant (milli-GPUe x ms).
fn produced_usage(fleet: &[Member]) -> BTreeMap<String, u64> {
    let mut produced: BTreeMap<String, u64> = BTreeMap::new();
    for member in fleet {
        for (t, u) in member.agent.written_usage() {
            *produced.entry(t.into_string()).or_insert(0) += u;
        }
    }
    produced
}

/// Of a tenant's usage `prod` (as produced) and `led` (as the ledger holds it), over a
/// run of `run_ms` with a decay half-life of `half_life` ms: what decay may have taken,
/// what is lost beyond that, and what is counted twice (milli-GPUe x ms).
fn usage_gaps(prod: f64, led: f64, half_life: f64, run_ms: u64) -> (f64, f64, f64) {
    // The ledger decays each report from when it arrived; the most it can have lost
    // is the whole amount decayed over the whole run.
    let allowance = prod * (1.0 - (-(run_ms as f64 + 30_000.0) / half_life).exp2());
    // One milli-GPUe x ms of rounding per report applied, at most.
    let rounding = 10_000.0;
    let lost = (prod - allowance - led - rounding).max(0.0);
    let double = (led - prod - rounding).max(0.0);
    (allowance, lost, double)
}

/// GPUe-seconds of work the evicted pods lost, all clusters together.
fn eviction_lost_gpue_s(fleet: &[Member]) -> f64 {
    fleet
        .iter()
        .flat_map(|f| f.sim.eviction_cost().values())
        .map(|c| c.lost_gpue_ms as f64 / 1e6)
        .sum()
}

/// Pods evicted per tenant, all clusters together.
fn evictions_per_tenant(fleet: &[Member]) -> BTreeMap<String, u64> {
    fleet
        .iter()
        .flat_map(|f| f.sim.eviction_cost().iter())
        .fold(BTreeMap::new(), |mut acc, (t, c)| {
            *acc.entry(t.to_string()).or_insert(0) += c.pods;
            acc
        })
}

/// One tenant's line of the summary: its measures, pods still waiting, its score at
/// the end (from the ledger, if it has one there), and its usage as produced and as
/// the ledger holds it (GPUe x s).
fn tenant_summary(
    tm: &TenantMeasures,
    waiting: usize,
    at_end: Option<f64>,
    used_gpue_s: f64,
    ledger_gpue_s: f64,
) -> TenantSummary {
    TenantSummary {
        pods_started: tm.delays_ms.len(),
        pods_waiting_at_end: waiting,
        delay_p50_ms: pct(&tm.delays_ms, 50),
        delay_p99_ms: pct(&tm.delays_ms, 99),
        share_violation_ms: tm.clock.violation_ms,
        share_violation_fraction: tm.clock.violation_fraction(),
        starved_below_guarantee_ms: tm.clock.starved_ms,
        mean_fairness_score: if tm.score_n == 0 {
            1.0
        } else {
            tm.score_sum / tm.score_n as f64
        },
        fairness_score_at_end: at_end.unwrap_or(tm.score_last.unwrap_or(1.0)),
        pods_denied: tm.denied_pods.len(),
        denial_answers: tm.denial_answers,
        used_gpue_s,
        ledger_gpue_s,
    }
}

#[allow(clippy::too_many_arguments)]
fn summarize(
    args: &DemoArgs,
    policy: &Policy,
    fleet: &[Member],
    m: &Measures,
    open: &BTreeMap<String, Open>,
    ledger: &v1::ListTenantsReply,
    capacity: MilliGpue,
    run_ms: u64,
    failover_ms: Option<u64>,
    rejoined: bool,
    partition_lease_expired: bool,
) -> Summary {
    let produced = produced_usage(fleet);
    let ledger_of: BTreeMap<String, u64> = ledger
        .tenants
        .iter()
        .map(|t| (t.tenant.clone(), t.decayed_usage))
        .collect();
    let to_s = |milli_ms: f64| milli_ms / 1e6;
    let (mut prod_sum, mut ledger_sum, mut allowance_sum, mut lost_sum, mut double_sum) = (0.0, 0.0, 0.0, 0.0, 0.0);
    let mut tenants = BTreeMap::new();
    for t in TENANTS {
        let tm = m.tenants.get(t).cloned().unwrap_or_default();
        let prod = produced.get(t).copied().unwrap_or(0) as f64;
        let led = ledger_of.get(t).copied().unwrap_or(0) as f64;
        let half_life = policy.tenant(t).map_or(86_400_000, |p| p.decay_half_life_ms) as f64;
        let (allowance, lost, double) = usage_gaps(prod, led, half_life, run_ms);
        prod_sum += prod;
        ledger_sum += led;
        allowance_sum += allowance;
        lost_sum += lost;
        double_sum += double;
        let at_end = ledger.tenants.iter().find(|x| x.tenant == t).map(|x| x.fairness_score);
        let waiting = open.values().filter(|o| o.tenant == t).count();
        tenants.insert(
            t.to_string(),
            tenant_summary(&tm, waiting, at_end, to_s(prod), to_s(led)),
        );
    }
    Summary {
        seed: args.seed,
        speed: args.speed,
        duration_s: run_ms as f64 / 1000.0,
        capacity_gpue: capacity as f64 / 1000.0,
        tenants,
        gpu_utilization: if m.util_den > 0.0 { m.util_num / m.util_den } else { 0.0 },
        admissions_checked: m.admissions_checked,
        over_admissions: m.over_admissions,
        over_admitted_gpue: m.over_admitted_milli as f64 / 1000.0,
        over_max_share: m.over_max_share,
        usage: UsageCheck {
            produced_gpue_s: to_s(prod_sum),
            ledger_gpue_s: to_s(ledger_sum),
            decay_allowance_gpue_s: to_s(allowance_sum),
            lost_gpue_s: to_s(lost_sum),
            double_counted_gpue_s: to_s(double_sum),
            unacknowledged_reports: fleet.iter().map(|f| f.agent.backlog()).sum(),
        },
        recovery_after_burst_s: m.after_burst.done_ms.map(|v| v as f64 / 1000.0),
        recovery_after_partition_s: m.after_partition.done_ms.map(|v| v as f64 / 1000.0),
        partition_lease_expired,
        failover_s: failover_ms.map(|v| v as f64 / 1000.0),
        killed_node_rejoined: rejoined,
        evictions: evictions_per_tenant(fleet),
        eviction_lost_gpue_s: eviction_lost_gpue_s(fleet),
        timeline: m.timeline.clone(),
    }
}
