//! Sizing measurement: memory (RSS) and CPU of one control-plane node as a function of
//! tenants (T) and member clusters (C), with every cluster reporting on the agents'
//! cadence (one report per cluster every 5 s).
//!
//! For each (T, C) row it starts a fresh group of real `kvota server` processes on
//! loopback (3 nodes by default, plain text, default server flags: 1 s leader tick,
//! snapshot every 10 000 entries), applies a generated policy of T tenants, registers C
//! clusters, and then acts as those C member agents: each sends its report every 5 s
//! (staggered over the interval, as independent agents are), naming every tenant with
//! some GPUs in use and some pending, a back-to-back usage window, and acknowledging the
//! lease epoch it was last answered with. Each agent's client lists the leader first, so
//! the reports go straight to the leader (no follower forwarding).
//!
//! Phases per row: warm-up (two report rounds, not measured), the measured window
//! (default 60 s), then an idle window with reports stopped (ticks only, same state), to
//! separate the leader's fixed per-second cost from the per-report cost. The leader's VmRSS
//! (`/proc/PID/status`) and CPU time (utime + stime of `/proc/PID/stat`) are sampled every
//! second; followers' too. `/proc/loadavg` is read before and after each row: the machine
//! is shared, so read the latency columns with the load in mind (CPU time is much less
//! sensitive to it than latency is).
//!
//! Run: `cargo bench -p kvota --bench sizing` (full grid), or
//! `cargo bench -p kvota --bench sizing -- --quick` (one small row, short windows; also
//! what `cargo test --benches` runs, since it passes no `--bench`).
//! Last, a new node joins: it is started empty and added as a learner, and the time
//! until it says it is ready (it has applied what the leader had, as `kvota members
//! add-learner` waits for) is reported, with whether it was sent a snapshot (its data directory
//! holds one) or only the log. The group snapshots every 10,000 entries by default, so
//! a short run catches up from the log; `BENCH_SNAPSHOT_EVERY=500
//! BENCH_SNAPSHOT_CATCHUP=0` makes the servers snapshot and purge their log during the
//! run, so the new node is sent a snapshot of the whole state (the window's numbers
//! then include taking those snapshots).
//!
//! Knobs: BENCH_GRID (default `10x3,100x8,1000x16,1000x64`, TxC), BENCH_NODES (3 or 1),
//! BENCH_WINDOW_SECS (60), BENCH_IDLE_SECS (15), BENCH_INTERVAL_MS (5000),
//! BENCH_CLUSTER_GPUS (GPUs per member cluster, default 256), BENCH_SNAPSHOT_EVERY and
//! BENCH_SNAPSHOT_CATCHUP (the servers' `--snapshot-every` and
//! `--snapshot-catchup-entries`; their defaults when unset).

use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvota_client::client::Client;
use kvota_proto::v1;
use kvota_testkit::procs::{server_command, specs, Procs, ServerSpec};
use prost::Message;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Clock ticks per second for `/proc/PID/stat` (no libc calls here: ask getconf).
fn clk_tck() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100)
}

/// `(VmRSS KiB, utime + stime in ticks)` of process `pid`.
fn sample(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces): state is field 3, utime 14,
    // stime 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some((rss, utime + stime))
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn dir_bytes(p: &Path) -> u64 {
    let mut total = 0;
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => total += dir_bytes(&e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

/// A small deterministic generator, so every run reports the same shapes.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn tenant(i: usize, t: usize) -> String {
    let width = t.saturating_sub(1).to_string().len().max(3);
    format!("t{i:0width$}")
}

/// T tenants, weights 1..=4, and a guarantee for each (50% of capacity in all).
fn policy_yaml(t: usize) -> String {
    let min_bp = 5_000 / t.max(1);
    let mut y = String::from("apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata:\n  name: sizing\nspec:\n  decayHalfLife: \"24h\"\n  tenants:\n");
    for i in 0..t {
        let w = 1 + mix(i as u64) % 4;
        y.push_str(&format!(
            "  - {{name: {}, weight: {w}, minShare: {}.{:02}}}\n",
            tenant(i, t),
            min_bp / 100,
            min_bp % 100
        ));
    }
    y
}

/// Cluster `c`'s report number `seq`: every tenant, about 90% of the cluster's GPUs in
/// use, spread unevenly over the tenants and moving a little from report to report, and
/// some pending demand, metered over `window`.
fn report(
    cluster: &str,
    c: usize,
    seq: u64,
    epoch: u64,
    t: usize,
    gpus_milli: u64,
    window: (u64, u64),
) -> v1::ReportRequest {
    let weights: Vec<u64> = (0..t).map(|i| 1 + mix((c * 100_003 + i) as u64) % 16).collect();
    let total: u64 = weights.iter().sum();
    let busy = gpus_milli * 9 / 10;
    let ms = window.1.saturating_sub(window.0);
    let tenants = (0..t)
        .map(|i| {
            let jitter = mix(seq ^ ((c * 7_919 + i) as u64) << 20) % 200; // +-10%
            let inuse = (busy * weights[i] / total.max(1)) * (900 + jitter) / 1_000;
            let pending = inuse * (mix(seq.wrapping_add(i as u64)) % 60) / 100;
            v1::TenantUsage {
                tenant: tenant(i, t),
                used_milli_gpue_ms: inuse * ms,
                inuse_milli_gpue: inuse,
                pending_milli_gpue: pending,
                largest_pending_milli_gpue: 0,
                borrowed_milli_gpue: 0,
            }
        })
        .collect();
    v1::ReportRequest {
        cluster: cluster.to_string(),
        seq,
        held_epoch: epoch,
        tenants,
        capacity: vec![],
        evictions: vec![],
        decisions: vec![],
        window_start_ms: window.0,
        window_end_ms: window.1,
        gap_in_reply: false,
        status: None,
    }
}

fn spawn_kvota(s: &ServerSpec, all: &[ServerSpec], init: bool) -> Child {
    let mut extra = Vec::new();
    for (var, flag) in [
        ("BENCH_SNAPSHOT_EVERY", "--snapshot-every"),
        ("BENCH_SNAPSHOT_CATCHUP", "--snapshot-catchup-entries"),
    ] {
        if let Ok(v) = std::env::var(var) {
            extra.extend([flag.to_string(), v]);
        }
    }
    let mut cmd = server_command(Path::new(env!("CARGO_BIN_EXE_kvota")), s, all, init, &extra);
    cmd.env("RUST_LOG", "error").stderr(Stdio::null());
    cmd.spawn().expect("spawn kvota server")
}

#[derive(Default)]
struct Stats {
    /// Latency of each answered report, microseconds, with whether it was in the window.
    lat_us: Mutex<Vec<u64>>,
    sent: AtomicU64,
    errors: AtomicU64,
    req_bytes: AtomicU64,
    reply_bytes: AtomicU64,
}

struct Row {
    t: usize,
    c: usize,
    idle_rss_mib: f64,
    warm_rss_mib: f64,
    end_rss_mib: f64,
    max_rss_mib: f64,
    follower_rss_mib: f64,
    cpu_pct: f64,
    idle_cpu_pct: f64,
    follower_cpu_pct: f64,
    ms_per_report: f64,
    marginal_ms_per_report: f64,
    reports: u64,
    expected: u64,
    errors: u64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    req_kib: f64,
    reply_kib: f64,
    disk_mib: f64,
    load_before: String,
    load_after: String,
    leader_changed: bool,
    /// Seconds until a new node had caught up, and whether it was sent a snapshot.
    catchup: Option<(f64, bool)>,
    /// The new node's RSS once caught up (MiB).
    catchup_rss_mib: f64,
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn cpu_secs(ticks: u64, tck: u64) -> f64 {
    ticks as f64 / tck as f64
}

struct Cfg {
    nodes: usize,
    warm_rounds: u64,
    window: Duration,
    idle: Duration,
    interval: Duration,
    gpus_milli: u64,
    tck: u64,
}

async fn run_row(tmp: &Path, t: usize, c: usize, cfg: &Cfg) -> Row {
    let load_before = loadavg();
    let dir = tmp.join(format!("t{t}-c{c}"));
    // One more than the group: the node that joins at the end.
    let mut specs = specs(cfg.nodes + 1, &dir);
    let joiner = specs.pop().expect("one more spec");
    let rpcs: Vec<String> = specs.iter().map(|s| s.rpc.clone()).collect();
    let mut procs = Procs(
        (0..cfg.nodes)
            .map(|i| Some(spawn_kvota(&specs[i], &specs, i == 0)))
            .collect(),
    );
    let leader = kvota_testkit::procs::leader(&rpcs, Duration::from_millis(500), Duration::from_secs(30)).await;
    let pids: Vec<u32> = procs.0.iter().map(|p| p.as_ref().map_or(0, Child::id)).collect();
    let leader_pid = pids[leader];
    // Leader first: the agents' calls go straight to it.
    let mut order = vec![rpcs[leader].clone()];
    order.extend(
        rpcs.iter()
            .enumerate()
            .filter(|(i, _)| *i != leader)
            .map(|(_, a)| a.clone()),
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_rss = sample(leader_pid).map_or(0, |s| s.0);

    let admin = Client::new(&order).expect("client");
    let yaml = policy_yaml(t);
    kvota_fairness::policy::Policy::from_yaml(&yaml).unwrap_or_else(|e| panic!("generated policy: {e}"));
    admin
        .call(|ch| {
            let yaml = yaml.clone();
            async move {
                Ok(Client::admin(ch)
                    .apply_policy(v1::PolicyRequest { yaml })
                    .await?
                    .into_inner())
            }
        })
        .await
        .expect("apply policy");

    let stats = Arc::new(Stats::default());
    let measuring = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop_at = Arc::new(Mutex::new(None::<Instant>));
    let mut registered = Vec::new();
    for k in 0..c {
        let name = format!("sizing-{k:03}");
        let client = Client::new(&order).expect("client");
        let epoch0 = kvota_testkit::register_gpus(&client, &name, cfg.gpus_milli).await;
        registered.push((k, name, client, epoch0));
    }
    let start = Instant::now() + Duration::from_millis(500);
    let mut agents = Vec::new();
    for (k, name, client, epoch0) in registered {
        let stats = stats.clone();
        let measuring = measuring.clone();
        let stop_at = stop_at.clone();
        let interval = cfg.interval;
        let gpus = cfg.gpus_milli;
        // Staggered over the interval, as independent agents are.
        let offset = interval.mul_f64(k as f64 / c as f64);
        agents.push(tokio::spawn(async move {
            let mut every = tokio::time::interval_at((start + offset).into(), interval);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut epoch = epoch0;
            let mut seq = 0u64;
            let mut from = unix_ms();
            loop {
                every.tick().await;
                if stop_at.lock().expect("lock").is_some_and(|s| Instant::now() >= s) {
                    return;
                }
                seq += 1;
                let to = unix_ms();
                let r = report(&name, k, seq, epoch, t, gpus, (from, to));
                let size = r.encoded_len() as u64;
                let counted = measuring.load(Ordering::Relaxed);
                let t0 = Instant::now();
                let res = client
                    .call(|ch| {
                        let r = r.clone();
                        async move { Ok(Client::member(ch).report(r).await?.into_inner()) }
                    })
                    .await;
                let us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
                match res {
                    Ok(reply) => {
                        from = to;
                        if let Some(l) = &reply.lease {
                            epoch = l.epoch;
                        }
                        if counted {
                            stats.sent.fetch_add(1, Ordering::Relaxed);
                            stats.req_bytes.fetch_add(size, Ordering::Relaxed);
                            stats
                                .reply_bytes
                                .fetch_add(reply.encoded_len() as u64, Ordering::Relaxed);
                            stats.lat_us.lock().expect("lock").push(us);
                        }
                    }
                    Err(e) => {
                        if counted {
                            stats.errors.fetch_add(1, Ordering::Relaxed);
                        }
                        eprintln!("report {name} seq {seq}: {e}");
                    }
                }
            }
        }));
    }

    // Warm-up: a few rounds, not measured.
    tokio::time::sleep_until((start + cfg.interval * u32::try_from(cfg.warm_rounds).unwrap_or(2)).into()).await;
    let w0 = Instant::now();
    let l0 = sample(leader_pid).unwrap_or((0, 0));
    let f0: Vec<(u64, u64)> = pids
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != leader)
        .map(|(_, p)| sample(*p).unwrap_or((0, 0)))
        .collect();
    measuring.store(true, Ordering::Relaxed);
    let mut max_rss = l0.0;
    let mut f_max_rss = f0.iter().map(|s| s.0).max().unwrap_or(0);
    while w0.elapsed() < cfg.window {
        tokio::time::sleep(Duration::from_secs(1).min(cfg.window.saturating_sub(w0.elapsed()))).await;
        if let Some((rss, _)) = sample(leader_pid) {
            max_rss = max_rss.max(rss);
        }
        for (i, p) in pids.iter().enumerate() {
            if i != leader {
                f_max_rss = f_max_rss.max(sample(*p).map_or(0, |s| s.0));
            }
        }
    }
    measuring.store(false, Ordering::Relaxed);
    let l1 = sample(leader_pid).unwrap_or((0, 0));
    let f1: Vec<(u64, u64)> = pids
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != leader)
        .map(|(_, p)| sample(*p).unwrap_or((0, 0)))
        .collect();
    let window_secs = w0.elapsed().as_secs_f64();

    // Stop the agents (an in-flight report finishes), then the ticks-only window.
    *stop_at.lock().expect("lock") = Some(Instant::now());
    for a in agents {
        let _ = a.await;
    }
    let i0 = (Instant::now(), sample(leader_pid).unwrap_or((0, 0)));
    tokio::time::sleep(cfg.idle).await;
    let i1 = (Instant::now(), sample(leader_pid).unwrap_or((0, 0)));
    let idle_secs = (i1.0 - i0.0).as_secs_f64();

    let st = kvota_testkit::procs::status(&rpcs[leader], Duration::from_secs(2)).await;
    let leader_changed = st.is_none_or(|s| s.role != "leader");
    let disk = dir_bytes(&specs[leader].dir);

    // A new node joins and catches up.
    procs.0.push(Some(spawn_kvota(&joiner, &specs, false)));
    let joiner_pid = procs.0.last().and_then(|p| p.as_ref().map(Child::id)).unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let node = v1::NodeInfo {
        id: joiner.id,
        rpc_addr: joiner.rpc.clone(),
        http_addr: joiner.http.clone(),
        raft_addr: joiner.raft.clone(),
        voter: false,
    };
    let t0 = Instant::now();
    let added = admin
        .call(|ch| {
            let node = node.clone();
            async move {
                Ok(Client::admin(ch)
                    .add_learner(v1::AddLearnerRequest { node: Some(node) })
                    .await?
                    .into_inner())
            }
        })
        .await;
    // Caught up: the node says it is ready (it has applied what the leader had), as
    // `kvota members add-learner` waits for it.
    let mut caught_up = added.as_ref().map(|_| ()).map_err(|e| e.to_string());
    while caught_up.is_ok()
        && !kvota_testkit::procs::status(&joiner.rpc, Duration::from_secs(2))
            .await
            .is_some_and(|s| s.ready)
    {
        if t0.elapsed() > Duration::from_secs(300) {
            caught_up = Err("not ready within 300 s".to_string());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let catchup = match caught_up {
        Ok(()) => Some((
            t0.elapsed().as_secs_f64(),
            joiner.dir.join("raft").join("snapshot.kvs").exists(),
        )),
        Err(e) => {
            eprintln!("adding node {} as a learner: {e}", joiner.id);
            None
        }
    };
    let catchup_rss_mib = mib(sample(joiner_pid).map_or(0, |s| s.0));
    drop(procs); // SIGKILLs every node
    let load_after = loadavg();

    let mut lat = std::mem::take(&mut *stats.lat_us.lock().expect("lock"));
    lat.sort_unstable();
    let pct = |p: usize| {
        lat.get((lat.len() * p / 100).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0) as f64
            / 1_000.0
    };
    let reports = stats.sent.load(Ordering::Relaxed);
    let cpu = cpu_secs(l1.1.saturating_sub(l0.1), cfg.tck);
    let idle_cpu = cpu_secs(i1.1 .1.saturating_sub(i0.1 .1), cfg.tck);
    let idle_rate = if idle_secs > 0.0 { idle_cpu / idle_secs } else { 0.0 };
    let f_cpu: f64 = f0
        .iter()
        .zip(&f1)
        .map(|(a, b)| cpu_secs(b.1.saturating_sub(a.1), cfg.tck))
        .sum::<f64>()
        / f0.len().max(1) as f64;
    let per = |x: f64| if reports > 0 { x / reports as f64 } else { 0.0 };
    Row {
        t,
        c,
        idle_rss_mib: mib(idle_rss),
        warm_rss_mib: mib(l0.0),
        end_rss_mib: mib(l1.0),
        max_rss_mib: mib(max_rss),
        follower_rss_mib: mib(f_max_rss),
        cpu_pct: 100.0 * cpu / window_secs,
        idle_cpu_pct: 100.0 * idle_rate,
        follower_cpu_pct: 100.0 * f_cpu / window_secs,
        ms_per_report: per(cpu * 1_000.0),
        marginal_ms_per_report: per((cpu - idle_rate * window_secs).max(0.0) * 1_000.0),
        reports,
        // A report count of one run: far below u64's range.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        expected: (window_secs * c as f64 / cfg.interval.as_secs_f64()).round() as u64,
        errors: stats.errors.load(Ordering::Relaxed),
        p50_ms: pct(50),
        p99_ms: pct(99),
        max_ms: lat.last().copied().unwrap_or(0) as f64 / 1_000.0,
        req_kib: per(stats.req_bytes.load(Ordering::Relaxed) as f64) / 1024.0,
        reply_kib: per(stats.reply_bytes.load(Ordering::Relaxed) as f64) / 1024.0,
        disk_mib: disk as f64 / (1024.0 * 1024.0),
        load_before,
        load_after,
        leader_changed,
        catchup,
        catchup_rss_mib,
    }
}

fn print_table(rows: &[Row], cfg: &Cfg) {
    println!();
    println!(
        "kvota control-plane sizing: {} node(s) on loopback, 1 report per cluster every {} s, measured window {} s after {} warm-up rounds, idle (ticks only) window {} s, {} GPUs per cluster",
        cfg.nodes,
        cfg.interval.as_secs_f64(),
        cfg.window.as_secs(),
        cfg.warm_rounds,
        cfg.idle.as_secs(),
        cfg.gpus_milli / 1_000
    );
    println!(
        "{:>5} {:>4} | {:>7} {:>7} {:>7} {:>7} {:>7} | {:>6} {:>6} {:>6} | {:>7} {:>7} | {:>9} {:>7} {:>7} {:>7} | {:>7} {:>7} {:>6} | {:>14} {:>6} | load before -> after",
        "T", "C", "RSS0", "RSSwarm", "RSSend", "RSSmax", "fol.max", "CPU%", "idle%", "fol%", "ms/rep", "marg.ms", "reports", "p50ms", "p99ms", "maxms", "reqKiB", "repKiB", "diskMiB", "join s (how)", "joinMiB"
    );
    for r in rows {
        println!(
            "{:>5} {:>4} | {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} | {:>6.1} {:>6.1} {:>6.1} | {:>7.2} {:>7.2} | {:>4}/{:<4} {:>7.1} {:>7.1} {:>7.1} | {:>7.1} {:>7.1} {:>6.1} | {:>14} {:>6.1} | {} -> {}{}{}",
            r.t,
            r.c,
            r.idle_rss_mib,
            r.warm_rss_mib,
            r.end_rss_mib,
            r.max_rss_mib,
            r.follower_rss_mib,
            r.cpu_pct,
            r.idle_cpu_pct,
            r.follower_cpu_pct,
            r.ms_per_report,
            r.marginal_ms_per_report,
            r.reports,
            r.expected,
            r.p50_ms,
            r.p99_ms,
            r.max_ms,
            r.req_kib,
            r.reply_kib,
            r.disk_mib,
            match r.catchup {
                Some((secs, true)) => format!("{secs:.2} (snapshot)"),
                Some((secs, false)) => format!("{secs:.2} (log)"),
                None => "failed".to_string(),
            },
            r.catchup_rss_mib,
            r.load_before,
            r.load_after,
            if r.errors > 0 { format!("  ERRORS {}", r.errors) } else { String::new() },
            if r.leader_changed { "  LEADER CHANGED" } else { "" },
        );
    }
    println!("RSS0: leader before any policy/cluster; RSSwarm/RSSend: leader at start/end of the window; fol.max: largest follower RSS seen (MiB).");
    println!("CPU%: leader CPU time / wall time over the window, % of one core; idle%: same with reports stopped (leader ticks only); fol%: mean follower.");
    println!("ms/rep: leader CPU per report (window CPU / reports); marg.ms: the same minus the idle rate (the cost a report adds).");
    println!("reports: answered in the window / expected at the cadence; latency: agent-side call time (includes fsync and replication).");
    println!("join s: a new, empty node added as a learner at the end, until it had caught up (sent a snapshot, or the log only); joinMiB: its RSS then.");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick") || !args.iter().any(|a| a == "--bench");
    let grid_spec = std::env::var("BENCH_GRID").unwrap_or_else(|_| {
        if quick {
            "10x3".into()
        } else {
            "10x3,100x8,1000x16,1000x64".into()
        }
    });
    let grid: Vec<(usize, usize)> = grid_spec
        .split(',')
        .filter_map(|p| {
            let (t, c) = p.trim().split_once('x')?;
            Some((t.parse().ok()?, c.parse().ok()?))
        })
        .collect();
    let cfg = Cfg {
        nodes: usize::try_from(env_u64("BENCH_NODES", 3)).unwrap_or(3),
        warm_rounds: 2,
        window: Duration::from_secs(env_u64("BENCH_WINDOW_SECS", if quick { 10 } else { 60 })),
        idle: Duration::from_secs(env_u64("BENCH_IDLE_SECS", if quick { 3 } else { 15 })),
        interval: Duration::from_millis(env_u64("BENCH_INTERVAL_MS", 5_000)),
        gpus_milli: env_u64("BENCH_CLUSTER_GPUS", 256) * 1_000,
        tck: clk_tck(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let tmp = tempfile::tempdir().expect("tmp");
    let mut rows = Vec::new();
    rt.block_on(async {
        for &(t, c) in &grid {
            eprintln!("row T={t} C={c}: load {} ...", loadavg());
            let r = run_row(tmp.path(), t, c, &cfg).await;
            eprintln!(
                "row T={t} C={c}: RSS {:.1} -> {:.1} MiB, CPU {:.1}% (idle {:.1}%), {:.2} ms/report, p99 {:.1} ms, {}/{} reports, load {} -> {}",
                r.warm_rss_mib, r.end_rss_mib, r.cpu_pct, r.idle_cpu_pct, r.ms_per_report, r.p99_ms, r.reports, r.expected, r.load_before, r.load_after
            );
            rows.push(r);
        }
    });
    print_table(&rows, &cfg);
    // Every row's new node must have caught up: a join that fails is a finding, not a
    // blank in the table.
    if let Some(r) = rows.iter().find(|r| r.catchup.is_none()) {
        eprintln!("row T={} C={}: the new node did not catch up", r.t, r.c);
        std::process::exit(1);
    }
}
