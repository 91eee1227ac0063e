//! The harness of the real-process fault tests: prerequisites, the `kvota` binary, the
//! federation (three `kvota server` and three `kvota agent` processes, each in its own
//! network namespace), reading state through the CLI and HTTP, and the checks run after
//! every scenario. See `docs/testing.md`.

pub mod delay;
pub mod http;
pub mod load;
pub mod net;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use http::{http_get_within, Metrics, Webhook};
use load::{Book, TENANTS};
use net::Net;

/// `KVOTA_CHAOS_REAL=skip` turns a missing prerequisite into a printed skip.
pub const SKIP_VAR: &str = "KVOTA_CHAOS_REAL";

/// GPUs per simulated cluster (`--simulate 2x4`); three clusters make the federation.
pub const CLUSTER_GPUS: u64 = 8;
/// Federation capacity, milli-GPUe.
pub const CAPACITY_MILLI: u64 = 3 * CLUSTER_GPUS * 1000;
/// The policy's lease duration and margin, milliseconds (short, so expiry fits a test).
pub const LEASE_MS: u64 = 3_000;
/// Clock-skew margin of the policy, milliseconds.
pub const MARGIN_MS: u64 = 300;

/// The policy: three tenants whose demand always exceeds their share, so caps and
/// budgets bind. The half-life is so long that decay over a test run (under 2^-1e-5)
/// is below the ledger's rounding: the ledger must equal the agents' reported usage.
pub const POLICY: &str = "apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: real-faults}
spec:
  decayHalfLife: 100000h
  lease: {duration: 3s, clockSkewMargin: 300ms}
  tenants:
  - {name: inference, weight: 50, minShare: 30, maxShare: 70, namespaces: [serving]}
  - {name: research, weight: 10, minShare: 10, maxShare: 30, namespaces: [lab]}
  - {name: training, weight: 40, minShare: 20, maxShare: 50, namespaces: [ml]}
";

/// maxShare of each tenant in [`POLICY`], basis points.
pub fn max_share_caps() -> BTreeMap<String, u64> {
    [("inference", 7_000u64), ("research", 3_000), ("training", 5_000)]
        .into_iter()
        .map(|(t, bp)| (t.to_string(), CAPACITY_MILLI * bp / 10_000))
        .collect()
}

/// Log lines printed per process when a scenario fails.
const LOG_LINES: usize = 40;

/// The servers' Raft timing.
#[derive(Clone, Copy, Debug)]
pub enum Timing {
    /// The demo's etcd-like timeouts (100 ms heartbeat, 600-1200 ms election): six
    /// processes fsync on one shared disk here, and the defaults (50 ms, 150-300 ms) are
    /// for a quiet LAN.
    Lan,
    /// For links with round trips of a few hundred milliseconds: openraft 0.9 gives each
    /// replication RPC the heartbeat interval as its deadline, so the heartbeat must
    /// exceed the round trip or no leader can commit (see `kvota server --help`).
    Wan,
}

impl Timing {
    fn flags(self) -> [&'static str; 6] {
        match self {
            Timing::Lan => [
                "--heartbeat-ms",
                "100",
                "--election-timeout-min-ms",
                "600",
                "--election-timeout-max-ms",
                "1200",
            ],
            Timing::Wan => [
                "--heartbeat-ms",
                "500",
                "--election-timeout-min-ms",
                "2500",
                "--election-timeout-max-ms",
                "5000",
            ],
        }
    }
}

/// Cluster names of the agents a1, a2, a3.
pub const CLUSTERS: [&str; 3] = ["east", "west", "north"];

/// Whether this machine can run the tests: `Ok(true)` yes; `Ok(false)` no, and
/// `KVOTA_CHAOS_REAL=skip` says to skip (printed); otherwise a panic saying what is
/// missing. `extra` names further tools a scenario needs.
pub fn prerequisites(scenario: &str, extra: &[&str]) -> bool {
    let mut missing = Vec::new();
    let uid = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
        s.lines().find_map(|l| {
            l.strip_prefix("Uid:")
                .map(|v| v.split_whitespace().next().unwrap_or("").to_string())
        })
    });
    if uid.as_deref() != Some("0") {
        missing.push("root (network namespaces and links need CAP_NET_ADMIN; run as root)".to_string());
    }
    for tool in std::iter::once(&"ip").chain(extra) {
        let ok = Command::new(tool)
            .arg(if *tool == "ip" { "-V" } else { "--version" })
            .output()
            .is_ok_and(|o| o.status.success());
        if !ok {
            missing.push(format!(
                "`{tool}` (Debian: apt-get install {})",
                if *tool == "ip" { "iproute2" } else { tool }
            ));
        }
    }
    if missing.is_empty() {
        return true;
    }
    let msg = format!(
        "real-process fault test `{scenario}` cannot run here; missing: {}",
        missing.join("; ")
    );
    if std::env::var(SKIP_VAR).as_deref() == Ok("skip") {
        eprintln!("SKIPPED ({SKIP_VAR}=skip): {msg}");
        return false;
    }
    panic!("{msg}. Set {SKIP_VAR}=skip to skip these tests on such a machine.");
}

/// The `kvota` binary to test.
///
/// `KVOTA_BIN` if set. Otherwise `kvota` in this test's own target profile directory
/// (`<target>/<profile>/deps/real_faults-*` -> `<target>/<profile>/kvota`), which
/// `cargo test --workspace` has just built (the `kvota` crate's own tests need it).
/// `CARGO_BIN_EXE_kvota` exists only inside the crate that owns the binary, so this
/// crate finds it by path. If it is missing or older than any source it is built from,
/// the test runs `cargo build -p kvota --bin kvota` for that target directory and
/// profile first, so a lone `cargo test -p kvota-chaos-tests --test real_faults` tests
/// the current code. (Cargo runs test binaries after releasing its build lock.) The
/// build is skipped when the binary is fresh because `-p kvota` alone resolves features
/// differently from `--workspace` and would rebuild half the tree.
pub fn kvota_bin() -> PathBuf {
    if let Ok(p) = std::env::var("KVOTA_BIN") {
        let p = PathBuf::from(p);
        assert!(p.is_file(), "KVOTA_BIN={} is not a file", p.display());
        return p;
    }
    let exe = std::env::current_exe().expect("the test binary's own path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test binary in <target>/<profile>/deps");
    let target_dir = profile_dir.parent().expect("<target>/<profile>");
    let bin = profile_dir.join("kvota");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let built = std::fs::metadata(&bin).and_then(|m| m.modified()).ok();
    let newest_source = ["kvota", "member-agent", "control-plane", "fairness", "proto"]
        .iter()
        .filter_map(|c| newest_mtime(&root.join(c)))
        .chain(newest_mtime(&root.join("Cargo.lock")))
        .max();
    if matches!((built, newest_source), (Some(b), Some(s)) if b >= s) {
        return bin;
    }
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_string(),
        Some(p) => p.to_string(),
    };
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    eprintln!(
        "real_faults: building {} (missing or older than its sources)",
        bin.display()
    );
    let out = Command::new(&cargo)
        .args([
            "build",
            "--quiet",
            "-p",
            "kvota",
            "--bin",
            "kvota",
            "--profile",
            &profile,
        ])
        .arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(target_dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("run `{cargo} build -p kvota` to get the binary under test: {e} (or set KVOTA_BIN)")
        });
    assert!(
        out.status.success(),
        "`cargo build -p kvota --profile {profile}` failed (set KVOTA_BIN to use a built binary):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        bin.is_file(),
        "built kvota, but {} is missing (cross target? set KVOTA_BIN)",
        bin.display()
    );
    bin
}

/// The newest modification time of a file under `path` (sources: `src/`, `Cargo.toml`,
/// `build.rs`, `.proto` files; `target` and hidden directories skipped).
fn newest_mtime(path: &Path) -> Option<std::time::SystemTime> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.is_file() {
        return meta.modified().ok();
    }
    std::fs::read_dir(path)
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            !name.starts_with('.') && name != "target" && name != "tests" && name != "benches"
        })
        .filter_map(|e| newest_mtime(&e.path()))
        .max()
}

/// One process of the federation, in its namespace, its stderr in a log file.
#[derive(Debug)]
pub struct Proc {
    /// `s1`, `a2`, ...
    pub name: String,
    ns: String,
    args: Vec<String>,
    /// Its log file.
    pub log: PathBuf,
    child: Option<Child>,
    // Servers run with --exit-with-parent: they exit when this pipe closes, so none
    // outlives the test even when it is killed.
    stdin: Option<ChildStdin>,
}

impl Proc {
    fn start(&mut self, bin: &Path) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("open a process log");
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.ns])
            .arg(bin)
            .args(&self.args)
            .env("RUST_LOG", "info,openraft=warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        // `ip netns exec` execs the program: the child's pid is kvota's own.
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("start {} in {}: {e}", self.name, self.ns));
        self.stdin = child.stdin.take();
        self.child = Some(child);
    }

    /// The process id (while running).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends `sig` (`-STOP`, `-CONT`, `-KILL`).
    pub fn signal(&self, sig: &str) {
        let pid = self.pid().unwrap_or_else(|| panic!("{} is not running", self.name));
        net::sh("kill", &[sig, &pid.to_string()]).unwrap_or_else(|e| panic!("signal {}: {e}", self.name));
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.stdin = None;
    }

    /// If it exited: how.
    fn exited(&mut self) -> Option<String> {
        self.child.as_mut()?.try_wait().ok()?.map(|s| s.to_string())
    }

    fn tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// The federation under test. Dropping it kills every process and removes the network;
/// when dropped during a panic it first prints each process's last log lines.
#[derive(Debug)]
pub struct Fed {
    /// Scenario name, for failure output.
    pub scenario: String,
    /// Servers s1..s3, then agents a1..a3 (fields drop in order: processes before the
    /// network).
    pub procs: Vec<Proc>,
    /// Webhook clients of the agents, by cluster name.
    pub hooks: Vec<(String, Webhook)>,
    /// The namespaces.
    pub net: Net,
    /// Control-plane gRPC addresses, comma separated (for `--cp`).
    pub cp: String,
    bin: PathBuf,
    /// Logs and data directories; kept (not deleted) when the scenario fails.
    dir: Option<tempfile::TempDir>,
    started: Instant,
    notes: Vec<String>,
}

/// Polls `f` every 100 ms until it gives `Some`, or fails with `what` and the last reason.
pub async fn eventually<T, F, Fut>(what: &str, within: Duration, mut f: F) -> Result<(T, Duration), String>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, String>>,
{
    let t0 = Instant::now();
    loop {
        match f().await {
            Ok(v) => return Ok((v, t0.elapsed())),
            Err(why) if t0.elapsed() > within => return Err(format!("{what}: not within {within:?}; last: {why}")),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// A server's `/api/v1/status` as JSON.
pub async fn server_status(http_addr: &str) -> Result<Value, String> {
    let (code, body) = http_get_within(http_addr, "/api/v1/status", Duration::from_millis(800)).await?;
    if code != 200 {
        return Err(format!("{http_addr}/api/v1/status: HTTP {code}"));
    }
    serde_json::from_str(&body).map_err(|e| format!("{http_addr}/api/v1/status: {e}"))
}

impl Fed {
    /// Builds the network, starts three servers, applies [`POLICY`], starts three agents
    /// and waits until every webhook is ready. `None`: prerequisites missing and skipped.
    pub async fn start(scenario: &str) -> Option<Fed> {
        Self::start_with(scenario, &[], Timing::Lan).await
    }

    /// As [`Fed::start`], checking for the extra tools `extra` too, with the servers'
    /// Raft timing `timing`.
    pub async fn start_with(scenario: &str, extra: &[&str], timing: Timing) -> Option<Fed> {
        if !prerequisites(scenario, extra) {
            return None;
        }
        let bin = kvota_bin();
        let dir = tempfile::Builder::new()
            .prefix("kvota-real-")
            .tempdir()
            .expect("temp dir");
        let net = Net::build(3, 3).unwrap_or_else(|e| panic!("build the test network for `{scenario}`: {e}"));
        let servers: Vec<net::Host> = net.hosts.iter().filter(|h| h.name.starts_with('s')).cloned().collect();
        let cp: Vec<String> = servers.iter().map(|h| format!("{}:7401", h.addr)).collect();
        let members: Vec<String> = servers
            .iter()
            .enumerate()
            .map(|(i, h)| format!("{}={}:7401,{}:7501,{}:7601", i + 1, h.addr, h.addr, h.addr))
            .collect();
        let mut procs = Vec::new();
        for (i, h) in servers.iter().enumerate() {
            let mut args: Vec<String> = [
                "server",
                "--id",
                &(i + 1).to_string(),
                "--listen",
                &format!("{}:7401", h.addr),
                "--raft-listen",
                &format!("{}:7601", h.addr),
                "--http",
                &format!("{}:7501", h.addr),
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            // Plain text on the test's own private network of namespaces: these scenarios
            // are about faults, not strangers (the hostile-client suite covers those).
            args.extend(["--tick-ms", "300", "--exit-with-parent", "--insecure"].map(String::from));
            args.extend(timing.flags().iter().map(|f| f.to_string()));
            args.push("--data-dir".into());
            args.push(dir.path().join(&h.name).display().to_string());
            if i == 0 {
                args.push("--init".into());
                for m in &members {
                    args.extend(["--member".to_string(), m.clone()]);
                }
            }
            procs.push(Proc {
                name: h.name.clone(),
                ns: h.ns.clone(),
                args,
                log: dir.path().join(format!("{}.log", h.name)),
                child: None,
                stdin: None,
            });
        }
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("make a test certificate");
        std::fs::write(dir.path().join("tls.crt"), cert.cert.pem()).expect("write tls.crt");
        std::fs::write(dir.path().join("tls.key"), cert.key_pair.serialize_pem()).expect("write tls.key");
        std::fs::write(dir.path().join("policy.yaml"), POLICY).expect("write policy.yaml");
        let mut hooks = Vec::new();
        for (i, h) in net.hosts.iter().filter(|h| h.name.starts_with('a')).enumerate() {
            let cluster = CLUSTERS[i];
            let args: Vec<String> = vec![
                "agent".into(),
                "--cluster".into(),
                cluster.into(),
                "--cp".into(),
                cp.join(","),
                "--webhook-listen".into(),
                "0.0.0.0:8443".into(),
                "--report-interval-ms".into(),
                "300".into(),
                "--simulate".into(),
                format!("2x{}", CLUSTER_GPUS / 2),
                // Pods finish after 5 s: budgets keep moving, so the faults meet a
                // federation that is handing GPUe from tenant to tenant.
                "--simulate-pod-seconds".into(),
                "5".into(),
                "--tls-cert".into(),
                dir.path().join("tls.crt").display().to_string(),
                "--tls-key".into(),
                dir.path().join("tls.key").display().to_string(),
                "--data-dir".into(),
                dir.path().join(&h.name).display().to_string(),
            ];
            procs.push(Proc {
                name: h.name.clone(),
                ns: h.ns.clone(),
                args,
                log: dir.path().join(format!("{}.log", h.name)),
                child: None,
                stdin: None,
            });
            let lan = h.lan_addr.clone().expect("agents have a second link");
            hooks.push((
                cluster.to_string(),
                Webhook::new(format!("{lan}:8443"), cert.cert.der()).expect("webhook client"),
            ));
        }
        let dir_path = dir.path().to_path_buf();
        let mut fed = Fed {
            scenario: scenario.to_string(),
            procs,
            hooks,
            net,
            cp: cp.join(","),
            bin,
            dir: Some(dir),
            started: Instant::now(),
            notes: Vec::new(),
        };
        for i in 0..3 {
            let bin = fed.bin.clone();
            fed.procs[i].start(&bin);
        }
        let (leader, t) = fed
            .wait_leader(Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| fed.fail(&e));
        fed.note(format!("control plane up, leader s{leader}, in {t:?}"));
        let policy = dir_path.join("policy.yaml").display().to_string();
        let (_, t) = eventually("apply the policy", Duration::from_secs(20), || async {
            fed.cli(&["policy", "apply", &policy], false).await.map(|_| ())
        })
        .await
        .unwrap_or_else(|e| fed.fail(&e));
        fed.note(format!("policy applied in {t:?}"));
        for i in 3..6 {
            let bin = fed.bin.clone();
            fed.procs[i].start(&bin);
        }
        let hooks = fed.hooks.clone();
        let (_, t) = eventually("every agent's webhook ready", Duration::from_secs(30), || async {
            for (c, h) in &hooks {
                match h.request("GET", "/readyz", Vec::new()).await {
                    Ok((200, _)) => {}
                    other => return Err(format!("{c}: {other:?}")),
                }
            }
            Ok(())
        })
        .await
        .unwrap_or_else(|e| fed.fail(&e));
        fed.note(format!("agents ready in {t:?}"));
        Some(fed)
    }

    /// Records a line for the scenario's summary (printed at the end, and on failure).
    pub fn note(&mut self, line: String) {
        let line = format!("[{:>6.1}s] {line}", self.started.elapsed().as_secs_f64());
        eprintln!("{}: {line}", self.scenario);
        self.notes.push(line);
    }

    /// Fails the scenario with `why` (the drop guard then prints the logs).
    pub fn fail(&self, why: &str) -> ! {
        panic!("scenario `{}` failed: {why}", self.scenario);
    }

    /// The process named `name`.
    pub fn proc(&mut self, name: &str) -> &mut Proc {
        self.procs
            .iter_mut()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no process {name}"))
    }

    /// Restarts a stopped process with its arguments and data directory.
    pub fn restart(&mut self, name: &str) {
        let bin = self.bin.clone();
        let p = self.proc(name);
        p.kill();
        p.start(&bin);
    }

    /// Runs a CLI command against the control plane (`--cp`, plus `--json` if `json`),
    /// from the test's namespace; its stdout as JSON (`Null` if not `json`).
    pub async fn cli(&self, args: &[&str], json: bool) -> Result<Value, String> {
        self.cli_at(&self.cp, args, json).await
    }

    /// As [`Fed::cli`], against the given `--cp` addresses.
    pub async fn cli_at(&self, cp: &str, args: &[&str], json: bool) -> Result<Value, String> {
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.args(args)
            .args(["--cp", cp])
            .kill_on_drop(true)
            .stdin(Stdio::null());
        if json {
            cmd.arg("--json");
        }
        // The CLI's own client retries across nodes for up to about a minute; the test
        // wants an answer or a reason sooner.
        let out = tokio::time::timeout(Duration::from_secs(15), cmd.output())
            .await
            .map_err(|_| format!("`kvota {}` did not finish within 15 s", args.join(" ")))?
            .map_err(|e| format!("run kvota {}: {e}", args.join(" ")))?;
        if !out.status.success() {
            return Err(format!(
                "`kvota {}` failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        if !json {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&out.stdout).map_err(|e| format!("`kvota {}`: not JSON: {e}", args.join(" ")))
    }

    /// Server `i` (0-based): its host.
    pub fn server(&self, i: usize) -> &net::Host {
        &self.net.hosts[i]
    }

    /// The statuses of the running servers, by index (0-based); paused or dead ones are
    /// missing.
    pub async fn statuses(&self) -> BTreeMap<usize, Value> {
        let mut out = BTreeMap::new();
        for i in 0..3 {
            if let Ok(v) = server_status(&format!("{}:7501", self.server(i).addr)).await {
                out.insert(i, v);
            }
        }
        out
    }

    /// Waits for exactly one leader that every answering server agrees on; its 1-based id.
    pub async fn wait_leader(&self, within: Duration) -> Result<(u64, Duration), String> {
        self.wait_leader_without(None, within).await
    }

    /// As [`Fed::wait_leader`], not asking node `frozen` (1-based): a node just sent
    /// SIGSTOP may still answer for a moment on a loaded machine, with what it believed.
    pub async fn wait_leader_without(&self, frozen: Option<u64>, within: Duration) -> Result<(u64, Duration), String> {
        eventually("one leader all answering servers agree on", within, || async {
            let mut st = self.statuses().await;
            if let Some(f) = frozen {
                st.retain(|i, _| u64::try_from(*i + 1).ok() != Some(f));
            }
            let leaders: Vec<u64> = st
                .values()
                .filter(|v| v["role"] == "leader")
                .filter_map(|v| v["node_id"].as_u64())
                .collect();
            let seen: Vec<Option<u64>> = st.values().map(|v| v["leader_id"].as_u64()).collect();
            match leaders.as_slice() {
                [l] if st.len() >= 2 && seen.iter().all(|s| *s == Some(*l)) => Ok(*l),
                _ => Err(format!("leaders {leaders:?}, each node's leader {seen:?}")),
            }
        })
        .await
    }

    /// The leader's gRPC address if one is known, else every server's: the CLI's client
    /// waits out its 8 s call deadline on a node that accepts connections but does not
    /// answer (a paused one), so reads go where an answer is sure.
    pub async fn leader_cp(&self) -> String {
        let st = self.statuses().await;
        st.iter()
            .find(|(_, v)| v["role"] == "leader")
            .map(|(i, _)| format!("{}:7401", self.server(*i).addr))
            .unwrap_or_else(|| self.cp.clone())
    }

    /// Every agent's metrics now (cluster -> metrics).
    pub async fn agent_metrics(&self) -> Result<BTreeMap<String, Metrics>, String> {
        let mut out = BTreeMap::new();
        for (c, h) in &self.hooks {
            out.insert(c.clone(), h.metrics().await?);
        }
        Ok(out)
    }

    /// The control plane's per-cluster records (`kvota clusters --json`) at `cp`.
    pub async fn clusters_at(&self, cp: &str) -> Result<BTreeMap<String, Value>, String> {
        let v = self.cli_at(cp, &["clusters"], true).await?;
        Ok(v.as_array()
            .ok_or("clusters: not a list")?
            .iter()
            .filter_map(|c| Some((c["cluster"].as_str()?.to_string(), c.clone())))
            .collect())
    }

    /// Recovery: every server ready and agreeing on one leader, every agent's lease fresh
    /// and journal drained. Fails the scenario if not within `within`; the time it took.
    pub async fn recover(&mut self, within: Duration) -> Duration {
        let (_, t) = eventually(
            "recovery (servers ready, one leader, leases fresh, journals drained)",
            within,
            || async {
                for i in 0..3 {
                    let addr = format!("{}:7501", self.server(i).addr);
                    match http_get_within(&addr, "/readyz", Duration::from_millis(800)).await {
                        Ok((200, _)) => {}
                        other => return Err(format!("s{} /readyz: {other:?}", i + 1)),
                    }
                }
                self.wait_leader(Duration::ZERO).await?;
                for (c, m) in self.agent_metrics().await? {
                    let (state, backlog) = (m.lease_state(), m.get("kvota_agent_journal_backlog"));
                    if state != "fresh" || backlog != Some(0) {
                        return Err(format!("{c}: lease {state}, backlog {backlog:?}"));
                    }
                }
                Ok(())
            },
        )
        .await
        .unwrap_or_else(|e| self.fail(&e));
        self.note(format!("recovered in {t:?} (bound {within:?})"));
        t
    }

    /// Nothing lost, nothing counted twice: with every journal drained, the control
    /// plane's last sequence per cluster lies between the agent's before and after it was
    /// read, and each tenant's ledger lies between the sum of the agents' reported usage
    /// read before and after it (less decay and rounding, bounded below).
    pub async fn check_ledger(&mut self) {
        let (line, _) = eventually(
            "the ledger equal to the agents' reported usage",
            Duration::from_secs(15),
            || async {
                let before = self.agent_metrics().await?;
                for (c, m) in &before {
                    if m.get("kvota_agent_journal_backlog") != Some(0) {
                        return Err(format!("{c}: backlog {:?}", m.get("kvota_agent_journal_backlog")));
                    }
                }
                // Read from the leader: an acknowledged report is applied there.
                let st = self.statuses().await;
                let leader = st
                    .iter()
                    .find(|(_, v)| v["role"] == "leader")
                    .map(|(i, _)| *i)
                    .ok_or("no leader")?;
                let at = format!("{}:7401", self.server(leader).addr);
                let clusters = self.clusters_at(&at).await?;
                let tenants = self.cli_at(&at, &["tenants"], true).await?;
                let after = self.agent_metrics().await?;
                let mut out = Vec::new();
                for (c, m) in &before {
                    let s0 = m.get("kvota_agent_journal_last_seq").unwrap_or(0);
                    let s1 = after
                        .get(c)
                        .and_then(|m| m.get("kvota_agent_journal_last_seq"))
                        .unwrap_or(0);
                    let cp = clusters
                        .get(c)
                        .and_then(|v| v["last_seq"].as_u64())
                        .ok_or(format!("{c} unknown to the control plane"))?;
                    if !(s0 <= cp && cp <= s1) || s0 == 0 {
                        return Err(format!(
                            "{c}: control plane applied through report {cp}, agent wrote {s0}..{s1} with backlog 0"
                        ));
                    }
                    out.push(format!("{c} seq {cp}"));
                }
                for (t, _) in TENANTS {
                    let series = "kvota_agent_reported_usage_gpu_seconds_total";
                    let u0: u64 = before.values().map(|m| m.tenant_scaled(series, t, 1e6)).sum();
                    let u1: u64 = after.values().map(|m| m.tenant_scaled(series, t, 1e6)).sum();
                    let ledger = tenants["tenants"]
                        .as_array()
                        .and_then(|a| a.iter().find(|x| x["tenant"] == t))
                        .and_then(|x| x["decayed_usage_milli_gpue_ms"].as_u64())
                        .ok_or(format!("{t}: no decayed usage from `kvota tenants --json`"))?;
                    // Decay over minutes of a 100000 h half-life is < 1e-5 of the total;
                    // rounding is at most 1 per applied entry. One report carries at least
                    // 1 GPUe x 300 ms = 300,000 when the tenant runs anything.
                    let slack = u0 / 100_000 + 20_000;
                    if ledger + slack < u0 || ledger > u1 {
                        return Err(format!(
                            "{t}: ledger {ledger}, agents reported {u0}..{u1} (milli-GPUe x ms)"
                        ));
                    }
                    if u0 == 0 {
                        return Err(format!("{t}: no usage reported at all"));
                    }
                    out.push(format!("{t} {:.1} GPUe-s", ledger as f64 / 1e6));
                }
                Ok(out.join(", "))
            },
        )
        .await
        .unwrap_or_else(|e| self.fail(&e));
        self.note(format!("ledger matches the agents: {line}"));
    }

    /// The control plane's own accounting, through `kvota explain tenant --json`: what
    /// leases let clusters hold never exceeds max(committed entitlement, in use), and the
    /// committed entitlement stays within maxShare.
    pub async fn check_cp_accounting(&mut self) {
        let caps = max_share_caps();
        let cp = self.leader_cp().await;
        for (t, _) in TENANTS {
            let v = self
                .cli_at(&cp, &["explain", "tenant", t], true)
                .await
                .unwrap_or_else(|e| self.fail(&e));
            let (held, committed, inuse) = (v["held"].as_u64(), v["committed"].as_u64(), v["inuse"].as_u64());
            let (Some(held), Some(committed), Some(inuse)) = (held, committed, inuse) else {
                self.fail(&format!("explain {t}: missing numbers in {v}"));
            };
            if held > committed.max(inuse) {
                self.fail(&format!("{t}: the control plane's leases may let clusters hold {held} milli-GPUe, above max(committed {committed}, in use {inuse})"));
            }
            if committed > caps[t] {
                self.fail(&format!(
                    "{t}: committed entitlement {committed} milli-GPUe above maxShare x capacity {}",
                    caps[t]
                ));
            }
        }
    }

    /// The load's record: no violation, every review answered, admissions in every
    /// cluster, and (if `since` is given) admissions in every cluster after it.
    pub fn check_book(&mut self, book: &Book, since: Option<Instant>) {
        if !book.violations.is_empty() {
            self.fail(&format!("invariant violations:\n  {}", book.violations.join("\n  ")));
        }
        if book.error_count > 0 {
            self.fail(&format!(
                "{} reviews got no answer; the webhook must answer whatever happens to the control plane:\n  {}",
                book.error_count,
                book.errors.join("\n  ")
            ));
        }
        for c in CLUSTERS {
            let n = book.admissions.iter().filter(|a| a.cluster == c).count();
            let late = since.map(|s| book.admissions.iter().filter(|a| a.cluster == c && a.at > s).count());
            if n == 0 || late == Some(0) {
                self.fail(&format!(
                    "{c}: {n} admissions in all, {late:?} after the fault: the load did not run"
                ));
            }
        }
        // Time each agent spent without a fresh lease (expiring, safe), from the samples.
        let mut unfresh = Vec::new();
        for c in CLUSTERS {
            let states: Vec<&str> = book
                .samples
                .iter()
                .filter(|s| s.cluster == c)
                .map(|s| s.metrics.lease_state())
                .collect();
            let safe = states.iter().filter(|s| **s == "safe").count();
            let expiring = states.iter().filter(|s| **s == "expiring").count();
            if safe + expiring > 0 {
                unfresh.push(format!(
                    "{c} {safe} safe + {expiring} expiring of {} samples",
                    states.len()
                ));
            }
        }
        self.note(format!(
            "leases not fresh: {}",
            if unfresh.is_empty() {
                "never".to_string()
            } else {
                unfresh.join(", ")
            }
        ));
        let peaks: Vec<String> = book
            .peak_inuse
            .iter()
            .map(|(t, p)| {
                format!(
                    "{t} {:.1}/{:.1}",
                    *p as f64 / 1000.0,
                    max_share_caps()[t] as f64 / 1000.0
                )
            })
            .collect();
        self.note(format!(
            "load: {} admitted, {} denied, 0 unanswered; peak federation-wide in use vs maxShare (GPUe): {}",
            book.admissions.len(),
            book.denied,
            peaks.join(", ")
        ));
    }

    /// Fails if a process exited by itself.
    pub fn check_alive(&mut self) {
        let dead: Vec<String> = self
            .procs
            .iter_mut()
            .filter_map(|p| p.exited().map(|s| format!("{} exited: {s}", p.name)))
            .collect();
        if !dead.is_empty() {
            self.fail(&dead.join("; "));
        }
    }

    /// Prints the scenario's notes (a passing run's record of timings).
    pub fn finish(&mut self) {
        let total = self.started.elapsed();
        self.note(format!("scenario passed in {total:?}"));
    }
}

impl Drop for Fed {
    fn drop(&mut self) {
        // KVOTA_REAL_LOGS=1 prints the logs of a passing scenario too.
        if std::thread::panicking() || std::env::var("KVOTA_REAL_LOGS").as_deref() == Ok("1") {
            let verdict = if std::thread::panicking() { "failed" } else { "passed" };
            let mut err = std::io::stderr().lock();
            let _ = writeln!(
                err,
                "\n==== scenario `{}` {verdict}; network: {}",
                self.scenario,
                self.net.describe()
            );
            for n in &self.notes {
                let _ = writeln!(err, "  {n}");
            }
            for p in &self.procs {
                let _ = writeln!(
                    err,
                    "---- {} (pid {:?}, log {}), last {LOG_LINES} lines:\n{}",
                    p.name,
                    p.pid(),
                    p.log.display(),
                    p.tail(LOG_LINES)
                );
            }
            if std::thread::panicking() {
                if let Some(d) = self.dir.take() {
                    let _ = writeln!(err, "logs and data directories kept in {}", d.keep().display());
                }
            }
            let _ = writeln!(err, "==== end of `{}`", self.scenario);
        }
        for p in &mut self.procs {
            if let Some(pid) = p.pid() {
                // A stopped process dies of SIGKILL too; CONT first so nothing lingers.
                let _ = net::sh("kill", &["-CONT", &pid.to_string()]);
            }
            p.kill();
        }
    }
}
