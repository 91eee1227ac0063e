//! The docker-compose federation (deploy/compose/) from the kvota image, under real
//! faults: `deploy/compose/up` brings up three `kvota server` containers and three
//! `kvota agent --simulate` containers with mutual TLS; pods are admitted through the
//! agents' webhooks; then the leader's container is killed (`docker kill`), one agent's
//! container is cut from the control plane (`docker network disconnect`) until its lease
//! runs out, and reconnected. Throughout, the ledger the agents reported must stay: no
//! tenant's decayed usage and no tenant x cluster showback amount goes down, and the
//! usage the cut-off cluster metered during the partition arrives after it. Then
//! `deploy/compose/down` removes everything, also when the test fails (after printing
//! the containers' logs).
//!
//! Slow (an image, nine containers, a 30 s lease running out), so `cargo test` skips it
//! and `scripts/test` runs it as its own step, on an image of the debug build the other
//! tests ran (`deploy/build-image --from target/debug/kvota --tag kvota-test:dev`,
//! `KVOTA_COMPOSE_IMAGE=kvota-test:dev`):
//! `cargo test -p kvota --test compose -- --ignored --nocapture`. Without docker, a
//! reachable daemon or docker-compose it passes, saying it skipped (KVOTA_COMPOSE_TEST=
//! require makes that a failure). KVOTA_COMPOSE_IMAGE names the image (default
//! kvota:VERSION; `up` builds it if it is missing).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{json, Value};

const CLUSTERS: [&str; 3] = ["east", "west", "north"];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn compose_dir() -> PathBuf {
    repo().join("deploy/compose")
}

/// Runs `cmd` to completion within `limit` (killed after it); status, stdout, stderr.
fn run(cmd: &mut Command, limit: Duration) -> (bool, String, String) {
    let what = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("start {what}: {e}"));
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let o = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let e = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (out, err) = (o.join().unwrap_or_default(), e.join().unwrap_or_default());
    match status {
        Some(s) => (s.success(), out, err),
        None => (
            false,
            out,
            format!("{err}\n(killed: no answer within {limit:?}: {what})"),
        ),
    }
}

/// Why this machine cannot run the test, if it cannot.
fn unavailable() -> Option<String> {
    match Command::new("docker")
        .args(["version", "--format", "{{.Server.Version}}"])
        .output()
    {
        Err(e) => return Some(format!("docker not found ({e})")),
        Ok(o) if !o.status.success() => {
            return Some(format!(
                "the Docker daemon is unreachable: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ))
        }
        Ok(_) => {}
    }
    let compose = Command::new("docker-compose")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success())
        || Command::new("docker")
            .args(["compose", "version"])
            .output()
            .is_ok_and(|o| o.status.success());
    (!compose).then(|| "docker-compose not found".to_string())
}

/// A base port whose ten ports (see `deploy/compose/up --help`) are free now.
fn free_port_base() -> u16 {
    let seed = u16::try_from(std::process::id() % 150).unwrap_or(0);
    for i in 0..150u16 {
        let base = 20_000 + ((seed + i) % 150) * 200;
        let ports = [1, 2, 3, 101, 102, 103, 41, 42, 43].map(|o| base + o);
        if ports
            .iter()
            .all(|p| std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        {
            return base;
        }
    }
    panic!("no free port range for the federation");
}

/// The federation under test; `down` when dropped, with the logs first if the test
/// failed.
struct Federation {
    project: String,
    state: PathBuf,
    _tmp: tempfile::TempDir,
    base: u16,
    rt: tokio::runtime::Runtime,
    tls: Arc<rustls::ClientConfig>,
    started: Instant,
}

impl Drop for Federation {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("==== compose test failed: container states and logs ====");
            let (_, ps, _) = run(
                Command::new("docker").args([
                    "ps",
                    "-a",
                    "--filter",
                    &format!("label=com.docker.compose.project={}", self.project),
                ]),
                Duration::from_secs(30),
            );
            eprintln!("{ps}");
            let (_, out, err) = run(
                self.compose()
                    .args(["logs", "--no-color", "--timestamps", "--tail", "150"]),
                Duration::from_secs(60),
            );
            eprintln!("{out}{err}");
        }
        let (ok, out, err) = run(
            Command::new(compose_dir().join("down"))
                .arg("--project")
                .arg(&self.project)
                .arg("--state")
                .arg(&self.state),
            Duration::from_secs(120),
        );
        eprintln!(
            "[{:>5.1}s] deploy/compose/down: {}",
            self.started.elapsed().as_secs_f64(),
            if ok { "done" } else { "FAILED" }
        );
        if !ok {
            eprintln!("{out}{err}");
        }
    }
}

impl Federation {
    fn say(&self, what: &str) {
        eprintln!("[{:>5.1}s] {what}", self.started.elapsed().as_secs_f64());
    }

    fn compose(&self) -> Command {
        let mut c = if Command::new("docker-compose")
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            Command::new("docker-compose")
        } else {
            let mut c = Command::new("docker");
            c.arg("compose");
            c
        };
        c.arg("--project-name")
            .arg(&self.project)
            .arg("--file")
            .arg(compose_dir().join("docker-compose.yml"));
        if self.state.join("compose.env").exists() {
            c.arg("--env-file").arg(self.state.join("compose.env"));
        }
        c
    }

    fn certs(&self) -> PathBuf {
        self.state.join("certs")
    }

    fn port_grpc(&self, node: u64) -> u16 {
        self.base + u16::try_from(node).expect("node id")
    }

    fn port_http(&self, node: u64) -> u16 {
        self.base + 100 + u16::try_from(node).expect("node id")
    }

    fn port_agent(&self, cluster: &str) -> u16 {
        self.base + 41 + u16::try_from(CLUSTERS.iter().position(|c| *c == cluster).expect("cluster")).expect("index")
    }

    fn container(&self, service: &str) -> String {
        let (ok, out, err) = run(self.compose().args(["ps", "-q", service]), Duration::from_secs(30));
        let id = out.trim().to_string();
        assert!(ok && !id.is_empty(), "no container for service {service}: {err}");
        id
    }

    fn docker(&self, args: &[&str]) {
        let (ok, out, err) = run(Command::new("docker").args(args), Duration::from_secs(60));
        assert!(ok, "docker {}: {out}{err}", args.join(" "));
    }

    /// `kvota ARGS -o json` against `node` (its own view), as the operator.
    fn cli(&self, node: u64, args: &[&str]) -> Result<Value, String> {
        let certs = self.certs();
        let (ok, out, err) = run(
            Command::new(env!("CARGO_BIN_EXE_kvota"))
                .args(args)
                .args(["-o", "json", "--cp", &format!("127.0.0.1:{}", self.port_grpc(node))])
                .arg("--cp-ca")
                .arg(certs.join("ca.crt"))
                .arg("--cp-cert")
                .arg(certs.join("operator-admin.crt"))
                .arg("--cp-key")
                .arg(certs.join("operator-admin.key")),
            Duration::from_secs(30),
        );
        if !ok {
            return Err(format!("kvota {}: {}", args.join(" "), err.trim()));
        }
        serde_json::from_str(&out).map_err(|e| format!("kvota {}: {e}: {out}", args.join(" ")))
    }

    /// `kvota ARGS` against `node` as the operator, its table output (empty on failure).
    fn cli_text(&self, node: u64, args: &[&str]) -> String {
        let certs = self.certs();
        let (_, out, err) = run(
            Command::new(env!("CARGO_BIN_EXE_kvota"))
                .args(args)
                .args(["--cp", &format!("127.0.0.1:{}", self.port_grpc(node))])
                .arg("--cp-ca")
                .arg(certs.join("ca.crt"))
                .arg("--cp-cert")
                .arg(certs.join("operator-admin.crt"))
                .arg("--cp-key")
                .arg(certs.join("operator-admin.key")),
            Duration::from_secs(30),
        );
        format!("{out}{err}")
    }

    /// An HTTPS request to 127.0.0.1:`port` as the viewer (or with no certificate).
    fn https(&self, port: u16, method: &str, path: &str, body: Vec<u8>, viewer: bool) -> Result<(u16, String), String> {
        let cfg = if viewer {
            self.tls.clone()
        } else {
            Arc::new(client_config(&self.certs(), false))
        };
        self.rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(15), https(port, cfg, method, path, body))
                .await
                .map_err(|_| format!("{method} {path} on port {port}: no answer within 15 s"))?
        })
    }

    /// GET `path` on a node's HTTP port as the viewer, as JSON.
    fn api(&self, node: u64, path: &str) -> Result<Value, String> {
        let (code, body) = self.https(self.port_http(node), "GET", path, Vec::new(), true)?;
        if code != 200 {
            return Err(format!("{path} on node {node}: {code} {body}"));
        }
        serde_json::from_str(&body).map_err(|e| format!("{path}: {e}: {body}"))
    }

    /// An agent's `/metrics` as the viewer.
    fn agent_metrics(&self, cluster: &str) -> Result<String, String> {
        match self.https(self.port_agent(cluster), "GET", "/metrics", Vec::new(), true)? {
            (200, body) => Ok(body),
            (code, body) => Err(format!("{cluster} /metrics: {code} {body}")),
        }
    }

    /// Submits a pod to `cluster`'s agent until it is admitted (the first reviews raise
    /// demand; budgets follow within a report round or two).
    fn admit(&self, cluster: &str, namespace: &str, name: &str, gpus: u32) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        while Instant::now() < deadline {
            match self.https(
                self.port_agent(cluster),
                "POST",
                "/validate",
                review(name, namespace, gpus),
                false,
            ) {
                Ok((200, body)) => {
                    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                    if v.pointer("/response/allowed") == Some(&Value::Bool(true)) {
                        return;
                    }
                    last = body;
                }
                Ok((code, body)) => last = format!("{code} {body}"),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        panic!("{namespace}/{name} ({gpus} GPUs) was never admitted by {cluster} within 60 s; last answer: {last}");
    }

    /// The leader, if every node answers, is ready and names the same one.
    fn agreed_leader(&self) -> Result<u64, String> {
        let st = self.statuses();
        let leaders: Vec<Option<u64>> = st
            .values()
            .map(|s| s["leader_id"].as_u64().filter(|_| s["ready"] == Value::Bool(true)))
            .collect();
        match leaders.as_slice() {
            [Some(a), Some(b), Some(c)] if a == b && b == c => Ok(*a),
            _ => Err(format!(
                "nodes {:?} see leaders {leaders:?} (None: not ready or no leader)",
                st.keys().collect::<Vec<_>>()
            )),
        }
    }

    /// Every node's own status, by node id (those that answer).
    fn statuses(&self) -> BTreeMap<u64, Value> {
        (1..=3)
            .filter_map(|n| self.cli(n, &["status"]).ok().map(|s| (n, s)))
            .collect()
    }
}

/// Waits until `f` returns `Some` (checking every 500 ms), at most `within`.
fn wait<T>(what: &str, within: Duration, mut f: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + within;
    loop {
        match f() {
            Ok(v) => return v,
            Err(e) => assert!(
                Instant::now() < deadline,
                "timed out after {within:?} waiting for {what}; last: {e}"
            ),
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn client_config(certs: &Path, viewer: bool) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(certs.join("ca.crt")).expect("ca.crt"))
        .expect("CA");
    let b = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots);
    if viewer {
        let chain =
            vec![CertificateDer::from_pem_file(certs.join("viewer-dashboard.crt")).expect("viewer certificate")];
        let key = PrivateKeyDer::from_pem_file(certs.join("viewer-dashboard.key")).expect("viewer key");
        b.with_client_auth_cert(chain, key).expect("client certificate")
    } else {
        b.with_no_client_auth()
    }
}

/// One HTTP/1 request over TLS to 127.0.0.1:`port`, checking the server as `localhost`
/// (the names `up` gives node and webhook certificates besides their identities).
async fn https(
    port: u16,
    cfg: Arc<rustls::ClientConfig>,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, String), String> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect {port}: {e}"))?;
    let tls = tokio_rustls::TlsConnector::from(cfg)
        .connect(ServerName::try_from("localhost").map_err(|e| e.to_string())?, tcp)
        .await
        .map_err(|e| format!("TLS to {port}: {e}"))?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes()
        .to_vec();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

fn review(name: &str, ns: &str, gpus: u32) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": format!("uid-{name}"), "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": ns, "name": name, "operation": "CREATE",
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]}}}
    }))
    .expect("json")
}

fn u64_at(v: &Value, pointer: &str) -> u64 {
    v.pointer(pointer)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("no number at {pointer} in {v}"))
}

/// Decayed usage per tenant (`/api/v1/tenants`).
fn decayed(tenants: &Value) -> BTreeMap<String, u64> {
    tenants["tenants"]
        .as_array()
        .expect("tenants")
        .iter()
        .map(|t| {
            (
                t["tenant"].as_str().expect("tenant").to_string(),
                u64_at(t, "/decayed_usage_milli_gpue_ms"),
            )
        })
        .collect()
}

/// In use per tenant (`/api/v1/tenants`).
fn inuse(tenants: &Value) -> BTreeMap<String, u64> {
    tenants["tenants"]
        .as_array()
        .expect("tenants")
        .iter()
        .map(|t| {
            (
                t["tenant"].as_str().expect("tenant").to_string(),
                u64_at(t, "/inuse_milli_gpue"),
            )
        })
        .collect()
}

/// Showback per (tenant, cluster), milli-GPUe x ms (`/api/v1/usage?by=tenant,cluster`).
fn showback(usage: &Value) -> BTreeMap<(String, String), u64> {
    assert_eq!(
        usage["kept"],
        Value::Bool(true),
        "showback is kept (feature level 2): {usage}"
    );
    usage["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            (
                (
                    r["tenant"].as_str().expect("tenant").to_string(),
                    r["cluster"].as_str().expect("cluster").to_string(),
                ),
                u64_at(r, "/milli_gpue_ms"),
            )
        })
        .collect()
}

/// Every amount of `before` is still there in `after` (none went down), in decayed terms
/// allowing `decay` (the fraction a ledger entry may lose to its half-life meanwhile).
fn kept<K: Ord + std::fmt::Debug>(
    what: &str,
    before: &BTreeMap<K, u64>,
    after: &BTreeMap<K, u64>,
    decay: f64,
) -> Result<(), String> {
    for (k, b) in before {
        let a = after.get(k).copied().unwrap_or(0);
        if (a as f64) < (*b as f64) * (1.0 - decay) {
            return Err(format!("{what} {k:?} went down: {b} before, {a} now"));
        }
    }
    Ok(())
}

fn metric(metrics: &str, line_start: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

fn cluster<'a>(clusters: &'a Value, name: &str) -> Option<&'a Value> {
    clusters.as_array()?.iter().find(|c| c["cluster"] == name)
}

#[test]
#[ignore = "docker: scripts/test runs it as its own step, after deploy/build-image"]
fn a_compose_federation_survives_a_killed_leader_and_a_partitioned_cluster_with_its_ledger() {
    if let Some(why) = unavailable() {
        let msg = format!("SKIPPED the compose test: {why}; it needs docker, a reachable daemon and docker-compose");
        assert_ne!(
            std::env::var("KVOTA_COMPOSE_TEST").as_deref(),
            Ok("require"),
            "{msg} (KVOTA_COMPOSE_TEST=require)"
        );
        println!("{msg}");
        return;
    }
    let image = std::env::var("KVOTA_COMPOSE_IMAGE").unwrap_or_else(|_| format!("kvota:{}", env!("CARGO_PKG_VERSION")));
    let tmp = tempfile::tempdir().expect("tmp");
    let state = tmp.path().join("state");
    let mut fed = Federation {
        project: format!("kvota-test-{}", std::process::id()),
        state: state.clone(),
        _tmp: tmp,
        base: free_port_base(),
        rt: tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime"),
        // Replaced below once `up` has made the certificates.
        tls: Arc::new(
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .expect("TLS")
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_no_client_auth(),
        ),
        started: Instant::now(),
    };

    // ---- up
    fed.say(&format!(
        "deploy/compose/up --project {} --port-base {} --image {image}",
        fed.project, fed.base
    ));
    let (ok, out, err) = run(
        Command::new(compose_dir().join("up"))
            .arg("--project")
            .arg(&fed.project)
            .arg("--state")
            .arg(&state)
            .arg("--port-base")
            .arg(fed.base.to_string())
            .arg("--image")
            .arg(&image)
            .args(["--timeout", "120"]),
        // A missing image is built first (a static release build).
        Duration::from_secs(1800),
    );
    eprintln!("{out}{err}");
    assert!(ok, "deploy/compose/up failed");
    assert!(
        out.contains(&format!("https://localhost:{}/ui/", fed.port_http(1))),
        "up prints the dashboard's address"
    );
    assert!(out.contains("kvota.env"), "up says how to use the CLI");
    fed.tls = Arc::new(client_config(&fed.certs(), true));
    fed.say("up: done");

    // ---- health: every node and agent, probes without a certificate; the API with the
    // viewer's; none of it with no certificate.
    for n in 1..=3 {
        for probe in ["/healthz", "/readyz"] {
            let (code, body) = fed
                .https(fed.port_http(n), "GET", probe, Vec::new(), false)
                .expect("probe");
            assert_eq!(code, 200, "node {n} {probe}: {body}");
        }
        let (code, _) = fed
            .https(fed.port_http(n), "GET", "/api/v1/tenants", Vec::new(), false)
            .expect("anonymous");
        assert!(
            code == 401 || code == 403,
            "node {n} answers /api/v1/tenants without a certificate: {code}"
        );
        let (code, page) = fed
            .https(fed.port_http(n), "GET", "/ui/", Vec::new(), true)
            .expect("dashboard");
        assert!(
            code == 200 && page.contains("<html"),
            "node {n} serves the dashboard to the viewer: {code}"
        );
    }
    // `up` waits for every cluster to hold a lease; an agent is ready once it also holds
    // the policy, which it fetches when an answer names the revision in force.
    for c in CLUSTERS {
        wait(&format!("agent {c} ready"), Duration::from_secs(15), || {
            match fed.https(fed.port_agent(c), "GET", "/readyz", Vec::new(), false) {
                Ok((200, _)) => Ok(()),
                Ok((code, body)) => Err(format!("HTTP {code}: {body}")),
                Err(e) => Err(e),
            }
        });
    }
    let leader = wait(
        "every node ready, agreeing on a leader",
        Duration::from_secs(30),
        || fed.agreed_leader(),
    );
    for (n, s) in &fed.statuses() {
        assert_eq!(
            s["policy"], "platform-gpus",
            "node {n} has the policy of deploy/policies/extended.yaml: {s}"
        );
    }
    let tenants = fed.cli(2, &["tenants"]).expect("kvota tenants");
    let mut names: Vec<&str> = tenants["tenants"]
        .as_array()
        .expect("tenants")
        .iter()
        .filter_map(|t| t["tenant"].as_str())
        .collect();
    names.sort_unstable();
    assert_eq!(
        names,
        ["inference", "research", "training"],
        "kvota tenants: the policy's tenants: {tenants}"
    );
    fed.say(&format!(
        "healthy: 3 nodes ready, leader node {leader}, 3 agents ready; kvota tenants lists {names:?}"
    ));

    // ---- workload: inference (namespace serving) and research (the policy's default
    // tenant, namespace lab) in every cluster; simulated pods run 10 minutes once bound.
    let pods: [(&str, &str, u32, u32); 6] = [
        ("east", "serving", 4, 2),
        ("east", "lab", 2, 1),
        ("west", "serving", 2, 2),
        ("west", "lab", 2, 1),
        ("north", "serving", 1, 2),
        ("north", "lab", 1, 1),
    ];
    let mut want: BTreeMap<String, u64> = BTreeMap::new();
    let mut east_gpus = 0u64;
    for (c, ns, count, gpus) in pods {
        for i in 0..count {
            fed.admit(c, ns, &format!("{ns}-{c}-{i}"), gpus);
        }
        let tenant = if ns == "serving" { "inference" } else { "research" };
        *want.entry(tenant.to_string()).or_default() += u64::from(count * gpus) * 1000;
        if c == "east" {
            east_gpus += u64::from(count * gpus);
        }
    }
    fed.say(&format!("admitted: {want:?} milli-GPUe"));
    let before_kill = wait(
        "the federation to count the admitted pods and their usage",
        Duration::from_secs(60),
        || {
            let t = fed.api(1, "/api/v1/tenants")?;
            let u = fed.api(1, "/api/v1/usage?by=tenant,cluster")?;
            let (inuse, decayed, sb) = (inuse(&t), decayed(&t), showback(&u));
            for (tenant, w) in &want {
                if inuse.get(tenant) != Some(w) {
                    return Err(format!("{tenant} in use {:?}, want {w}", inuse.get(tenant)));
                }
                if decayed.get(tenant).copied().unwrap_or(0) == 0 {
                    return Err(format!("{tenant}: no decayed usage yet"));
                }
            }
            for c in CLUSTERS {
                if sb.get(&("inference".to_string(), c.to_string())).copied().unwrap_or(0) == 0 {
                    return Err(format!("no showback for inference in {c} yet: {u}"));
                }
            }
            Ok((decayed, sb))
        },
    );
    fed.say(&format!(
        "ledger: decayed {:?}; showback rows {}",
        before_kill.0,
        before_kill.1.len()
    ));

    // ---- the leader's container killed: a new leader, the ledger intact.
    let old = fed.container(&format!("node{leader}"));
    fed.docker(&["kill", &old]);
    let killed_at = Instant::now();
    fed.say(&format!("docker kill node{leader} (the leader)"));
    let survivors: Vec<u64> = (1..=3).filter(|n| *n != leader).collect();
    let new_leader = wait("a new leader among the survivors", Duration::from_secs(30), || {
        let ids: Vec<Option<u64>> = survivors
            .iter()
            .map(|n| {
                fed.cli(*n, &["status"])
                    .ok()
                    .and_then(|s| s["leader_id"].as_u64().filter(|_| s["ready"] == Value::Bool(true)))
            })
            .collect();
        match ids.as_slice() {
            [Some(a), Some(b)] if a == b && *a != leader => Ok(*a),
            _ => Err(format!("survivors {survivors:?} see leaders {ids:?}")),
        }
    });
    fed.say(&format!(
        "new leader: node {new_leader}, elected {:.1}s after the kill",
        killed_at.elapsed().as_secs_f64()
    ));
    // The agents go on reporting to it (usage grows), and nothing reported before is lost.
    let total = |sb: &BTreeMap<(String, String), u64>| sb.values().sum::<u64>();
    wait(
        "the ledger, intact and growing, on the new leader",
        Duration::from_secs(45),
        || {
            let t = fed.api(new_leader, "/api/v1/tenants")?;
            let u = fed.api(new_leader, "/api/v1/usage?by=tenant,cluster")?;
            let (d, sb) = (decayed(&t), showback(&u));
            // Half-lives are hours (6 h the shortest): a minute decays far less than 1 %.
            kept("decayed usage of", &before_kill.0, &d, 0.01)?;
            kept("showback of", &before_kill.1, &sb, 0.0)?;
            if total(&sb) <= total(&before_kill.1) {
                return Err("no new usage reported since the kill".into());
            }
            Ok(())
        },
    );
    fed.say("ledger intact on the new leader, and growing");
    // The old leader comes back from its volume and follows.
    fed.docker(&["start", &old]);
    let now_leader = wait(
        &format!("node {leader}, restarted, back in the group"),
        Duration::from_secs(60),
        || fed.agreed_leader(),
    );
    fed.say(&format!(
        "node {leader} restarted from its volume: every node ready, leader node {now_leader}"
    ));

    // ---- east cut off from the control plane: it falls back to its safe budgets.
    let before_cut = wait("showback before the partition", Duration::from_secs(30), || {
        Ok(showback(&fed.api(new_leader, "/api/v1/usage?by=tenant,cluster")?))
    });
    let east_before: u64 = before_cut
        .iter()
        .filter(|((_, c), _)| c == "east")
        .map(|(_, v)| v)
        .sum();
    let east = fed.container("east");
    let network = format!("{}_federation", fed.project);
    let cut_since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        .to_string();
    fed.docker(&["network", "disconnect", &network, &east]);
    let cut_at = Instant::now();
    fed.say("docker network disconnect east");
    let clusters = wait(
        "the control plane to see east unreachable (its lease run out)",
        Duration::from_secs(90),
        || {
            let cl = fed.api(new_leader, "/api/v1/clusters")?;
            match cluster(&cl, "east") {
                Some(c) if c["unreachable"] == Value::Bool(true) => Ok(cl),
                Some(c) => Err(format!("east: unreachable {}", c["unreachable"])),
                None => Err(format!("no east in {cl}")),
            }
        },
    );
    fed.say(&format!(
        "east unreachable {:.1}s after the cut",
        cut_at.elapsed().as_secs_f64()
    ));
    for c in ["west", "north"] {
        assert_eq!(
            cluster(&clusters, c).expect(c)["unreachable"],
            Value::Bool(false),
            "{c} still reports: {clusters}"
        );
    }
    let text = fed.cli_text(new_leader, &["clusters"]);
    assert!(
        text.lines().any(|l| l.starts_with("east ") && l.contains("CUT OFF")),
        "kvota clusters says east is unreachable:\n{text}"
    );
    // The agent knows it too: its lease state is `safe`, and it still judges pods.
    let m = wait(
        "east's agent to enforce its safe budgets",
        Duration::from_secs(30),
        || {
            let m = fed.agent_metrics("east")?;
            match metric(&m, "kvota_agent_lease_state{state=\"safe\"}") {
                Some(1.0) => Ok(m),
                v => Err(format!("lease_state safe = {v:?}")),
            }
        },
    );
    assert_eq!(
        metric(&m, "kvota_agent_lease_remaining_seconds"),
        Some(0.0),
        "east's lease has run out"
    );
    // Still ready: it can judge (a policy and a lease, even an expired one).
    let (code, body) = fed
        .https(fed.port_agent("east"), "GET", "/readyz", Vec::new(), false)
        .expect("agent probe");
    assert_eq!(code, 200, "east's agent stays ready while cut off: {body}");
    let (code, body) = fed
        .https(
            fed.port_agent("east"),
            "POST",
            "/validate",
            review("during-cut", "serving", 1),
            false,
        )
        .expect("review");
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    assert!(
        code == 200 && v.pointer("/response/allowed").is_some_and(Value::is_boolean),
        "east judges reviews while cut off: {code} {body}"
    );
    fed.say(&format!(
        "east's agent: lease_state safe, still judging (a review answered allowed={})",
        v.pointer("/response/allowed").expect("allowed")
    ));
    // More partition time for east's pods to run while nobody hears about it.
    std::thread::sleep(Duration::from_secs(5));

    // ---- reconnected: a fresh lease, and the usage metered during the cut arrives.
    fed.docker(&["network", "connect", "--alias", "east", &network, &east]);
    let cut = cut_at.elapsed();
    fed.say(&format!(
        "docker network connect east (cut for {:.1}s)",
        cut.as_secs_f64()
    ));
    wait(
        "east to report again and hold a fresh lease",
        Duration::from_secs(60),
        || {
            let cl = fed.api(new_leader, "/api/v1/clusters")?;
            let c = cluster(&cl, "east").ok_or("no east")?;
            if c["unreachable"] != Value::Bool(false) {
                return Err("east still unreachable".into());
            }
            let m = fed.agent_metrics("east")?;
            match (
                metric(&m, "kvota_agent_lease_state{state=\"fresh\"}"),
                metric(&m, "kvota_agent_journal_backlog"),
            ) {
                (Some(f), Some(b)) if f == 1.0 && b == 0.0 => Ok(()),
                other => Err(format!("east's agent: lease fresh, journal backlog = {other:?}")),
            }
        },
    );
    fed.say(&format!(
        "east recovered {:.1}s after the reconnect",
        (cut_at.elapsed() - cut).as_secs_f64()
    ));
    // What east's agent saw, for the record (its report and lease lines since the cut).
    let (_, out, err) = run(
        Command::new("docker").args(["logs", "--since", &cut_since, &east]),
        Duration::from_secs(30),
    );
    for line in format!("{out}{err}")
        .lines()
        .filter(|l| l.contains("report") || l.contains("lease") || l.contains("reachable"))
    {
        eprintln!("    east| {line}");
    }
    // East's pods (east_gpus GPUs) ran through the whole cut: that usage, journaled by
    // the agent, must now be in the ledger, on top of everything from before.
    let expected = east_gpus * 1000 * u64::try_from(cut.as_millis()).expect("ms");
    wait(
        "the ledger to hold everything, the partition's usage included",
        Duration::from_secs(30),
        || {
            let u = fed.api(new_leader, "/api/v1/usage?by=tenant,cluster")?;
            let t = fed.api(new_leader, "/api/v1/tenants")?;
            let sb = showback(&u);
            kept("showback of", &before_cut, &sb, 0.0)?;
            kept("showback of", &before_kill.1, &sb, 0.0)?;
            kept("decayed usage of", &before_kill.0, &decayed(&t), 0.02)?;
            let east_now: u64 = sb.iter().filter(|((_, c), _)| c == "east").map(|(_, v)| v).sum();
            let grown = east_now.saturating_sub(east_before);
            if (grown as f64) < expected as f64 * 0.95 {
                return Err(format!("east's showback grew by {grown} milli-GPUe x ms since the cut; its {east_gpus} GPUs ran {expected} in the cut alone"));
            }
            Ok(())
        },
    );
    fed.say("ledger intact: nothing lost through the kill and the partition; east's usage during the cut arrived");
    // Every node ready and agreeing, the restarted one included.
    wait(
        "every node ready, agreeing on a leader",
        Duration::from_secs(30),
        || fed.agreed_leader(),
    );
    drop(fed);
}
