//! Webhook benchmark: AdmissionReviews per second over HTTPS keep-alive, then p50/p99
//! latency at half that rate, for kvota's webhook and, in the same run, for a bare
//! axum + rustls server that answers every request with a fixed response (the ceiling of
//! the stack: same TLS configuration, same hyper connection handling, no review work).
//!
//! The review is a real pod shape (two containers and an init container, one asking for
//! a GPU) in a governed namespace, sent with `dryRun: true` so that every request runs
//! the whole decision (parse, tenant mapping, GPUe, decide) without piling up
//! reservations.
//!
//! Throughput is measured in rounds that alternate which server goes first (ceiling,
//! kvota; kvota, ceiling; ...), so load from other jobs that comes and goes lands on
//! both; each round gives a ratio and the median is reported. The process's CPU time
//! per request (user + system, from `/proc/self/stat`) is reported beside it: it moves
//! less with load than requests per second do.
//!
//! Run: `cargo bench -p kvota-member-agent --bench webhook`
//! Knobs: BENCH_SECONDS (per measurement, default 10), BENCH_ROUNDS (throughput rounds,
//! default 5, each of BENCH_SECONDS / 2 per server), BENCH_CONNECTIONS (default 32).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::post;
use axum::Router;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use kvota_fairness::measures::percentile;
use kvota_member_agent::metrics::AgentMetrics;
use kvota_member_agent::webhook::{self, WebhookCtx, WebhookTls};
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::json;

mod common;

fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d)
}

fn client_config(ca: &[u8]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from(ca.to_vec())).expect("root");
    Arc::new(
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(port: u16, cfg: Arc<rustls::ClientConfig>) -> Sender {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    tcp.set_nodelay(true).expect("nodelay");
    let tls = tokio_rustls::TlsConnector::from(cfg)
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await
        .expect("tls");
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .expect("h1");
    tokio::spawn(conn);
    send
}

async fn one(send: &mut Sender, body: &Bytes) -> bool {
    let req = hyper::Request::builder()
        .method("POST")
        .uri("/validate")
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(body.clone()))
        .expect("request");
    match send.send_request(req).await {
        Ok(resp) => resp.status().is_success() && resp.into_body().collect().await.is_ok(),
        Err(_) => false,
    }
}

/// The process's CPU time so far (user + system), in seconds, or `None` off Linux.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which is in parentheses and may hold spaces):
    // state is field 3, utime 14, stime 15, in clock ticks (100 per second on Linux).
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// One closed-loop measurement: requests per second and CPU µs per request.
struct Rate {
    per_sec: f64,
    cpu_us: Option<f64>,
}

/// Closed loop: `conns` connections send back to back for `secs`.
async fn throughput(port: u16, cfg: Arc<rustls::ClientConfig>, conns: usize, secs: f64) -> Rate {
    let body = Bytes::from(common::webhook_body());
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let mut s = connect(port, cfg.clone()).await;
        let (done, stop, body) = (done.clone(), stop.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if one(&mut s, &body).await {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await; // warm up
    let start_count = done.load(Ordering::Relaxed);
    let cpu0 = cpu_seconds();
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let n = done.load(Ordering::Relaxed) - start_count;
    let elapsed = t0.elapsed().as_secs_f64();
    let cpu_us = match (cpu0, cpu_seconds()) {
        (Some(a), Some(b)) if n > 0 => Some((b - a) * 1e6 / n as f64),
        _ => None,
    };
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    Rate {
        per_sec: n as f64 / elapsed,
        cpu_us,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Open loop at `rate`/s spread over `conns` connections: latency p50/p99 in µs.
async fn latency(port: u16, cfg: Arc<rustls::ClientConfig>, conns: usize, rate: f64, secs: u64) -> (u64, u64, usize) {
    let body = Bytes::from(common::webhook_body());
    let per_conn = (rate / conns as f64).max(1.0);
    let gap = Duration::from_secs_f64(1.0 / per_conn);
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let mut s = connect(port, cfg.clone()).await;
        let body = body.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut tick = tokio::time::interval(gap);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let end = Instant::now() + Duration::from_secs(secs);
            while Instant::now() < end {
                tick.tick().await;
                let t = Instant::now();
                if one(&mut s, &body).await {
                    lat.push(u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX));
                }
            }
            lat
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap_or_default());
    }
    let n = all.len();
    (
        percentile(&mut all, 50).unwrap_or(0),
        percentile(&mut all, 99).unwrap_or(0),
        n,
    )
}

fn main() {
    let secs = env_u64("BENCH_SECONDS", 10);
    let conns = usize::try_from(env_u64("BENCH_CONNECTIONS", 32)).unwrap_or(32);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let tmp = tempfile::tempdir().expect("tmp");
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("rcgen");
        std::fs::write(tmp.path().join("tls.crt"), cert.cert.pem()).expect("w");
        std::fs::write(tmp.path().join("tls.key"), cert.key_pair.serialize_pem()).expect("w");
        let ca = cert.cert.der().to_vec();
        let tls = WebhookTls::load(&tmp.path().join("tls.crt"), &tmp.path().join("tls.key"), None, None).expect("tls");
        let (_stop, rx) = tokio::sync::watch::channel(false);

        // kvota's webhook with a policy and a lease in force.
        let agent = Arc::new(common::agent(tmp.path()));
        let metrics = AgentMetrics::new();
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let kvota_port = l.local_addr().expect("addr").port();
        let app = webhook::router(WebhookCtx::new(agent, metrics.clone()));
        tokio::spawn(webhook::serve_tls(l, tls.clone(), app, metrics.clone(), webhook::default_limits(), rx.clone()));

        // The ceiling: same TLS and connection handling, a fixed answer.
        let fixed = Bytes::from(
            serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002", "allowed": true}}))
            .unwrap_or_default(),
        );
        let bare = Router::new().route(
            "/validate",
            post(move |_b: Bytes| {
                let f = fixed.clone();
                async move { ([("content-type", "application/json")], f) }
            }),
        );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let bare_port = l.local_addr().expect("addr").port();
        tokio::spawn(webhook::serve_tls(l, tls, bare, metrics, webhook::default_limits(), rx));

        let cfg = client_config(&ca);
        println!("webhook benchmark: {conns} keep-alive HTTPS connections, {secs} s per measurement, {} cores", std::thread::available_parallelism().map_or(1, |n| n.get()));
        let rounds = env_u64("BENCH_ROUNDS", 5).max(1);
        let per_round = secs as f64 / 2.0;
        let (mut bare, mut kvota) = (Vec::new(), Vec::new());
        println!("| round | ceiling reviews/s | kvota reviews/s | ratio | ceiling CPU us/review | kvota CPU us/review |");
        println!("|---|---|---|---|---|---|");
        for round in 0..rounds {
            let (b, k) = if round % 2 == 0 {
                let b = throughput(bare_port, cfg.clone(), conns, per_round).await;
                (b, throughput(kvota_port, cfg.clone(), conns, per_round).await)
            } else {
                let k = throughput(kvota_port, cfg.clone(), conns, per_round).await;
                (throughput(bare_port, cfg.clone(), conns, per_round).await, k)
            };
            let us = |r: &Rate| r.cpu_us.map_or_else(|| "-".to_string(), |c| format!("{c:.1}"));
            println!("| {} | {:.0} | {:.0} | {:.2} | {} | {} |", round + 1, b.per_sec, k.per_sec, k.per_sec / b.per_sec.max(1.0), us(&b), us(&k));
            bare.push(b);
            kvota.push(k);
        }
        let ratios = median(bare.iter().zip(&kvota).map(|(b, k)| k.per_sec / b.per_sec.max(1.0)).collect());
        let bare_rate = median(bare.iter().map(|r| r.per_sec).collect());
        let kvota_rate = median(kvota.iter().map(|r| r.per_sec).collect());
        let cpu = |v: &[Rate]| {
            let c: Vec<f64> = v.iter().filter_map(|r| r.cpu_us).collect();
            (!c.is_empty()).then(|| median(c))
        };
        let (bare_cpu, kvota_cpu) = (cpu(&bare), cpu(&kvota));

        let (bp50, bp99, bn) = latency(bare_port, cfg.clone(), conns, bare_rate / 2.0, secs).await;
        let (kp50, kp99, kn) = latency(kvota_port, cfg, conns, kvota_rate / 2.0, secs).await;
        println!();
        println!("| server | reviews/s (closed loop, median of {rounds}) | p50 at half rate | p99 at half rate | samples |");
        println!("|---|---|---|---|---|");
        println!("| bare axum + rustls, fixed answer | {bare_rate:.0} | {bp50} us | {bp99} us | {bn} |");
        println!("| kvota webhook (decide, dry run) | {kvota_rate:.0} | {kp50} us | {kp99} us | {kn} |");
        println!("ratio kvota / ceiling (median of the rounds' ratios): {ratios:.2} (target >= 0.8); kvota reviews/s: {kvota_rate:.0} (target >= 20,000)");
        if let (Some(b), Some(k)) = (bare_cpu, kvota_cpu) {
            println!("CPU per review, server and load generator together: ceiling {b:.1} us, kvota {k:.1} us, ratio {:.2}", b / k);
        }
    });
}
