//! The real `kvota agent` binary against a real one-node `kvota server`: HTTPS reviews
//! decided from the lease, usage reaching the control plane, and enforcement that goes on
//! (falling back to safe budgets) after the control plane is killed. The cluster is the
//! agent's simulated one (`--simulate`): no Kubernetes API server runs here.

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};

#[path = "../../member-agent/tests/support/fake_apiserver.rs"]
mod fake_apiserver;
/// The demo's fault proxy (`kvota demo` ships it; the binary has no library to import).
/// This test does not ask whether a link is cut, as the demo does.
#[path = "../src/demo/link.rs"]
#[allow(dead_code)]
mod link;

use kvota_testkit::procs::{free_ports, Procs};

/// A temp directory with a self-signed webhook certificate (tls.crt, tls.key), and free
/// ports for a server (rpc, http) and an agent's webhook.
struct Env {
    tmp: tempfile::TempDir,
    rpc: String,
    http: String,
    hook: u16,
    ca: Vec<u8>,
}

fn env() -> Env {
    let tmp = tempfile::tempdir().expect("tmp");
    let ports = free_ports(3);
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("rcgen");
    std::fs::write(tmp.path().join("tls.crt"), cert.cert.pem()).expect("w");
    std::fs::write(tmp.path().join("tls.key"), cert.key_pair.serialize_pem()).expect("w");
    Env {
        tmp,
        rpc: format!("127.0.0.1:{}", ports[0]),
        http: format!("127.0.0.1:{}", ports[1]),
        hook: ports[2],
        ca: cert.cert.der().to_vec(),
    }
}

fn kvota() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvota"))
}

const POLICY: &str = "apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: agent-test}
spec:
  lease: {duration: 3s, clockSkewMargin: 300ms}
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, namespaces: [ml]}
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, namespaces: [serving]}
";

fn review(uid: &str, ns: &str, gpus: u32) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": ns, "name": uid, "operation": "CREATE",
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": uid, "namespace": ns},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]}}}
    }))
    .expect("json")
}

async fn https(port: u16, ca: &[u8], method: &str, path: &str, body: Vec<u8>) -> Result<(u16, Vec<u8>), String> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from(ca.to_vec()))
        .map_err(|e| e.to_string())?;
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("localhost").map_err(|e| e.to_string())?, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
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
    Ok((status, body))
}

async fn wait_for<F, Fut>(what: &str, within: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A kubeconfig at `dir/kubeconfig` for the fake API server at `url`.
fn write_kubeconfig(dir: &std::path::Path, url: &str) {
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"{url}\"}}\n\
         users:\n- name: agent\n  user: {{token: test}}\ncontexts:\n- name: fake\n  context: {{cluster: fake, user: agent}}\n\
         current-context: fake\n"
    );
    std::fs::write(dir.join("kubeconfig"), kubeconfig).expect("write kubeconfig");
}

/// A one-node `kvota server` with its data in `dir/cp`, logging to `dir/server.log`.
fn one_node_server(dir: &std::path::Path, rpc: &str, http: &str) -> Child {
    one_node_server_cmd(dir, rpc, http).spawn().expect("spawn server")
}

/// [`one_node_server`]'s command, for a caller that adds flags or environment.
fn one_node_server_cmd(dir: &std::path::Path, rpc: &str, http: &str) -> Command {
    let mut c = kvota();
    c.args([
        "server",
        "--id",
        "1",
        "--init",
        "--listen",
        rpc,
        "--http",
        http,
        "--raft-listen",
        "127.0.0.1:0",
        "--tick-ms",
        "200",
    ])
    .arg("--data-dir")
    .arg(dir.join("cp"))
    .stdout(Stdio::null())
    .stderr(Stdio::from(std::fs::File::create(dir.join("server.log")).expect("log")));
    c
}

fn cli_json(cp: &str, args: &[&str]) -> Option<Value> {
    let out = kvota().args(args).args(["--json", "--cp", cp]).output().ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

/// `kvota agent` for cluster east on a simulated cluster of 2x4 GPUs, reporting every
/// 300 ms, its webhook on `hook` with the test's certificate, its data in `dir/agent`,
/// stderr to `dir/<log>`; the caller adds the environment and spawns it.
fn sim_agent(dir: &std::path::Path, rpc: &str, hook: u16, log: &str) -> Command {
    sim_agent_every(dir, rpc, hook, log, 300)
}

/// [`sim_agent`] reporting every `interval_ms`.
fn sim_agent_every(dir: &std::path::Path, rpc: &str, hook: u16, log: &str, interval_ms: u64) -> Command {
    let mut c = kvota();
    c.args([
        "agent",
        "--cluster",
        "east",
        "--cp",
        rpc,
        "--webhook-listen",
        &format!("127.0.0.1:{hook}"),
    ])
    .args([
        "--report-interval-ms",
        &interval_ms.to_string(),
        "--simulate",
        "2x4",
        "--simulate-pod-seconds",
        "3600",
    ])
    .arg("--tls-cert")
    .arg(dir.join("tls.crt"))
    .arg("--tls-key")
    .arg(dir.join("tls.key"))
    .arg("--data-dir")
    .arg(dir.join("agent"))
    .stdout(Stdio::null())
    .stderr(Stdio::from(std::fs::File::create(dir.join(log)).expect("log")));
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_serves_reviews_reports_usage_and_keeps_enforcing_without_the_control_plane() {
    let Env {
        tmp,
        rpc,
        http,
        hook,
        ca,
    } = env();

    let server = one_node_server_cmd(tmp.path(), &rpc, &http)
        .env("RUST_LOG", "info")
        .spawn()
        .expect("spawn server");
    let mut procs = Procs::of([server]);
    std::fs::write(tmp.path().join("p.yaml"), POLICY).expect("w");
    let mut applied = false;
    for _ in 0..100 {
        let out = kvota()
            .args(["policy", "apply"])
            .arg(tmp.path().join("p.yaml"))
            .args(["--cp", &rpc])
            .output()
            .expect("apply");
        if out.status.success() {
            applied = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(applied, "policy apply never succeeded");

    let agent = sim_agent(tmp.path(), &rpc, hook, "agent.log")
        .env("RUST_LOG", "info")
        .spawn()
        .expect("spawn agent");
    procs.push(agent);
    wait_for("agent ready", Duration::from_secs(20), || async {
        matches!(https(hook, &ca, "GET", "/readyz", vec![]).await, Ok((200, _)))
    })
    .await;

    // Training's budget here is what the control plane granted for its demand; admit
    // one-GPU pods until the first denial. Denied demand raises the next budget, so
    // retry rounds admit more, never beyond maxShare (60 % of 8 GPUs = 4.8).
    let mut admitted = 0;
    let mut denial = String::new();
    let (mut denied_pod, mut admitted_pod) = (String::new(), String::new());
    for round in 0..20 {
        for i in 0..8 {
            let (status, body) = https(
                hook,
                &ca,
                "POST",
                "/validate",
                review(&format!("t{round}-{i}"), "ml", 1),
            )
            .await
            .expect("review");
            assert_eq!(status, 200);
            let r: Value = serde_json::from_slice(&body).expect("json");
            assert_eq!(r["response"]["uid"], format!("t{round}-{i}"));
            if r["response"]["allowed"] == true {
                admitted += 1;
                admitted_pod = format!("ml/t{round}-{i}");
            } else {
                denial = r["response"]["status"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                denied_pod = format!("ml/t{round}-{i}");
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    assert!(
        (1..=4).contains(&admitted),
        "admitted {admitted} one-GPU pods; maxShare allows 4"
    );
    assert!(
        denial.contains("training") && denial.contains("kvota explain"),
        "{denial}"
    );

    // The command the denial names explains it, from the agent's record of the decision.
    let explain = |pod: &str, agent: bool| {
        let mut c = kvota();
        c.args(["explain", "pod", pod, "--cp", &rpc]);
        if agent {
            c.args([
                "--agent",
                &format!("https://127.0.0.1:{hook}"),
                "--agent-tls-name",
                "localhost",
                "--agent-ca",
            ]);
            c.arg(tmp.path().join("tls.crt"));
        }
        let out = c.output().expect("explain pod");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (ok, text, err) = explain(&denied_pod, true);
    assert!(ok, "{err}");
    assert!(
        text.contains(&format!("pod {denied_pod} requests 1 GPUe")) && text.contains("tenant training in cluster east"),
        "{text}"
    );
    assert!(
        text.contains("Deny") && text.contains("against budget") && text.contains("now: denied"),
        "{text}"
    );
    // The decision's time is this run's, not hours since 1970.
    assert!(!text.contains("1970") && !text.contains("h ago"), "{text}");
    let (ok, text, err) = explain(&admitted_pod, true);
    assert!(
        ok && text.contains("Allow") && (text.contains("now: bound") || text.contains("now: admitted")),
        "{text}{err}"
    );
    let (ok, _, err) = explain("ml/never-created", true);
    assert!(!ok && err.contains("has not judged pod ml/never-created"), "{err}");
    // Without an agent: the decision the agent reported with its usage, from the control
    // plane; for a pod no agent reported, the tenant's numbers and how to ask the agent.
    wait_for(
        "the control plane to know the denial",
        Duration::from_secs(15),
        || async {
            let (ok, text, _) = explain(&denied_pod, false);
            ok && text.contains("decided by the agent of cluster `east`")
                && text.contains(&format!("pod {denied_pod} requests 1 GPUe"))
                && text.contains("Deny")
        },
    )
    .await;
    let (ok, text, err) = explain("ml/never-created", false);
    assert!(
        ok && text.contains("no reported decision")
            && text.contains("belongs to tenant `training`")
            && text.contains("--agent https://"),
        "{text}{err}"
    );
    let (ok, _, err) = explain("no-slash", false);
    assert!(!ok && err.contains("expected NAMESPACE/NAME"), "{err}");

    // The control plane sees the cluster and the usage.
    wait_for(
        "the control plane to see training's pods",
        Duration::from_secs(10),
        || async {
            cli_json(&rpc, &["tenants"]).is_some_and(|v| {
                v["tenants"].as_array().is_some_and(|ts| {
                    ts.iter()
                        .any(|t| t["tenant"] == "training" && t["inuse_milli_gpue"].as_u64() == Some(admitted * 1000))
                })
            })
        },
    )
    .await;

    // What the agent reported is what the ledger holds. Read the control plane first:
    // the agent's counters only grow, so read after it they bound it from above (its
    // sequence, and its undecayed usage meter above the decayed ledger).
    wait_for(
        "the ledger to match the agent's reports",
        Duration::from_secs(10),
        || async {
            let east = cli_json(&rpc, &["clusters"]).and_then(|v| v.as_array()?.first()?["last_seq"].as_u64());
            let ledger = cli_json(&rpc, &["tenants"]).and_then(|v| {
                v["tenants"].as_array()?.iter().find(|t| t["tenant"] == "training")?["decayed_usage_milli_gpue_ms"]
                    .as_u64()
            });
            let Ok((_, m)) = https(hook, &ca, "GET", "/metrics", vec![]).await else {
                return false;
            };
            let m = String::from_utf8_lossy(&m).to_string();
            let metric = |name: &str| {
                m.lines()
                    .find_map(|l| l.strip_prefix(name))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            };
            let seq = metric("kvota_agent_journal_last_seq ");
            // GPU-seconds written, against the ledger's milli-GPUe x ms.
            let used = metric(r#"kvota_agent_reported_usage_gpu_seconds_total{tenant="training"} "#).map(|u| u * 1e6);
            matches!((east, seq), (Some(e), Some(s)) if e > 0 && e as f64 <= s)
                && matches!((ledger, used), (Some(l), Some(u)) if l > 0 && l as f64 <= u * (1.0 + 1e-9))
        },
    )
    .await;

    // Kill the control plane: the agent keeps answering, and after the 3 s lease it
    // enforces its safe budget (fallback), visible in its metrics.
    procs.get(0).expect("running").kill().expect("kill server");
    let _ = procs.get(0).expect("running").wait();
    wait_for("lease to expire into safe budgets", Duration::from_secs(10), || async {
        https(hook, &ca, "GET", "/metrics", vec![])
            .await
            .is_ok_and(|(_, m)| String::from_utf8_lossy(&m).contains(r#"kvota_agent_lease_state{state="safe"} 1"#))
    })
    .await;
    let (status, body) = https(hook, &ca, "POST", "/validate", review("after-cp", "ml", 1))
        .await
        .expect("review");
    assert_eq!(status, 200);
    let r: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(
        r["response"]["allowed"], false,
        "safe budget (20 % x 8 GPUs = 1.6) is below what training holds: {r}"
    );
    let (_, m) = https(hook, &ca, "GET", "/metrics", vec![]).await.expect("metrics");
    let m = String::from_utf8_lossy(&m);
    assert!(m.contains("kvota_agent_journal_backlog"), "{m}");

    // SIGTERM: a clean stop.
    let pid = procs.get(1).expect("running").id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill")
        .success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = procs.get(1).expect("running").try_wait().expect("wait") {
            assert!(status.success(), "agent exit: {status}");
            break;
        }
        assert!(Instant::now() < deadline, "agent did not stop on SIGTERM");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A tenant new to a cluster has no budget there until its demand is reported. Its first
/// pod's denial makes the agent report at once, and the webhook holds that answer for
/// the report round: the lease that comes back has budget, so the pod is admitted about
/// one round trip later instead of being denied and retried. With
/// `--admission-hold-ms 0` the same first pod is denied. With the control plane gone, a
/// held review gets its denial when the hold runs out, and once a round has failed,
/// denials are not held at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_first_pod_waits_one_report_round_instead_of_being_denied() {
    let Env {
        tmp,
        rpc,
        http,
        hook,
        ca,
    } = env();
    let server = one_node_server(tmp.path(), &rpc, &http);
    let mut procs = Procs::of([server]);
    // A lease long enough to stay fresh for a while after the control plane is gone.
    std::fs::write(
        tmp.path().join("p.yaml"),
        POLICY.replace(
            "duration: 3s, clockSkewMargin: 300ms",
            "duration: 30s, clockSkewMargin: 1s",
        ),
    )
    .expect("w");
    wait_for("the policy applied", Duration::from_secs(20), || async {
        kvota()
            .args(["policy", "apply"])
            .arg(tmp.path().join("p.yaml"))
            .args(["--cp", &rpc])
            .output()
            .is_ok_and(|o| o.status.success())
    })
    .await;
    let ready = || async { matches!(https(hook, &ca, "GET", "/readyz", vec![]).await, Ok((200, _))) };
    let first = |uid: &'static str, ns: &'static str| {
        let ca = ca.clone();
        async move {
            let started = Instant::now();
            let (status, body) = https(hook, &ca, "POST", "/validate", review(uid, ns, 1))
                .await
                .expect("review");
            assert_eq!(status, 200);
            let r: Value = serde_json::from_slice(&body).expect("json");
            (
                r["response"]["allowed"] == true,
                r["response"]["status"]["message"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                started.elapsed(),
            )
        }
    };

    // Holding off: inference's first pod is denied, for want of a budget here.
    let mut agent = sim_agent_every(tmp.path(), &rpc, hook, "agent-nohold.log", 2_000);
    agent.args(["--admission-hold-ms", "0"]);
    procs.push(agent.spawn().expect("spawn agent"));
    wait_for("agent ready", Duration::from_secs(20), ready).await;
    let (allowed, message, _) = first("inference-1", "serving").await;
    assert!(!allowed && message.contains("budget of 0 GPUe"), "{message}");
    let pid = procs.get(1).expect("agent").id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill")
        .success());
    let _ = procs.get(1).expect("agent").wait();

    // The default hold: training's first pod is admitted after one report round (the
    // early report comes at most a fifth of the 2 s interval after the denial).
    let mut agent = sim_agent_every(tmp.path(), &rpc, hook, "agent.log", 2_000);
    procs.push(agent.spawn().expect("spawn agent"));
    wait_for("agent ready again", Duration::from_secs(20), ready).await;
    let (allowed, message, took) = first("training-1", "ml").await;
    assert!(allowed, "{message}");
    assert!(message.contains("admitted: tenant `training`"), "{message}");
    assert!(
        took < Duration::from_millis(1_900),
        "held {took:?}: longer than the round it waits for"
    );
    let (_, m) = https(hook, &ca, "GET", "/metrics", vec![]).await.expect("metrics");
    let m = String::from_utf8_lossy(&m);
    assert!(
        m.contains(r#"kvota_agent_admission_holds_total{reason="admitted"} 1"#),
        "{m}"
    );

    // The control plane stops. The next denial is held (the last round worked), its
    // early round fails, and the answer is the denial when the 2 s hold runs out; after
    // that failed round, a denial is answered at once.
    procs.get(0).expect("server").kill().expect("kill server");
    let _ = procs.get(0).expect("server").wait();
    let (allowed, _, took) = first("training-2", "ml").await;
    assert!(
        !allowed && took >= Duration::from_millis(1_900) && took < Duration::from_millis(3_500),
        "held {took:?}"
    );
    // Once a report round has failed (the client tries for a while first), denials are
    // answered at once.
    let mut n = 2;
    wait_for(
        "denials answered at once while reports fail",
        Duration::from_secs(30),
        || {
            n += 1;
            let first = &first;
            async move {
                let uid: &'static str = Box::leak(format!("training-{n}").into_boxed_str());
                let (allowed, _, took) = first(uid, "ml").await;
                assert!(!allowed);
                took < Duration::from_millis(500)
            }
        },
    )
    .await;
    let (_, m) = https(hook, &ca, "GET", "/metrics", vec![]).await.expect("metrics");
    let m = String::from_utf8_lossy(&m);
    let timeouts = m
        .lines()
        .find_map(|l| l.strip_prefix(r#"kvota_agent_admission_holds_total{reason="timeout"} "#))
        .and_then(|v| v.trim().parse::<u64>().ok());
    assert!(timeouts.is_some_and(|n| n >= 1), "{m}");
}

#[test]
fn agent_flags_are_checked_before_anything_starts() {
    let tmp = tempfile::tempdir().expect("tmp");
    let run = |args: &[&str]| {
        let out = kvota()
            .args([
                "agent",
                "--tls-cert",
                "/nonexistent.crt",
                "--tls-key",
                "/nonexistent.key",
            ])
            .args(args)
            .output()
            .expect("run");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    assert!(
        run(&["--cluster", "east"]).contains("/nonexistent.crt"),
        "certificates are checked first"
    );
    assert!(run(&["--cluster", "east", "--simulate", "1x8", "--kubeconfig", "/k"]).contains("cannot be used with"));
    assert!(run(&["--cluster", "East!", "--simulate", "1x8"]).contains("--cluster"));
    assert!(run(&["--cluster", "east", "--simulate", "8"]).contains("COUNTxGPUS"));
    assert!(run(&["--cluster", "east", "--simulate", "1x8"]).contains("/nonexistent.crt"));
    let e = run(&["--cluster", "east", "--simulate", "1x8", "--admission-hold-ms", "5000"]);
    assert!(
        e.contains("--admission-hold-ms 5000: at most 4000") && e.contains("timeoutSeconds"),
        "{e}"
    );
    let _ = tmp;
}

/// `kvota agent` on Kubernetes. No API server can run here, so the cluster is the fake
/// API server of `member-agent/tests/support/fake_apiserver.rs` (list/watch, patches,
/// evictions, Leases), reached through a real kubeconfig file; the agent and the control
/// plane are the real binaries. The agent must register the capacity its watchers list
/// (two nodes of 4 GPUs, one cordoned node) and count a pod it never admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_on_kubernetes_registers_listed_capacity_and_counts_pods_it_did_not_admit() {
    use fake_apiserver::{FakeApi, Kind};
    let api = FakeApi::start().await;
    for (n, gpus, cordoned) in [("n1", 4, false), ("n2", 4, false), ("n3", 8, true)] {
        api.put(
            Kind::Node,
            json!({"metadata": {"name": n}, "spec": {"unschedulable": cordoned},
            "status": {"allocatable": {"nvidia.com/gpu": gpus.to_string()}}}),
        );
    }
    api.put(Kind::Namespace, json!({"metadata": {"name": "ml"}}));
    // Training's pod from before the agent existed: bound, running, 4 GPUs.
    api.put(
        Kind::Pod,
        json!({"metadata": {"name": "old", "namespace": "ml"},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]},
        "status": {"phase": "Running"}}),
    );

    let Env {
        tmp,
        rpc,
        http,
        hook,
        ca,
    } = env();
    write_kubeconfig(tmp.path(), &api.url);
    let log = |name: &str| Stdio::from(std::fs::File::create(tmp.path().join(name)).expect("log"));
    let mut procs = Procs::of([one_node_server(tmp.path(), &rpc, &http)]);
    std::fs::write(tmp.path().join("p.yaml"), POLICY).expect("w");
    wait_for("policy applied", Duration::from_secs(20), || async {
        kvota()
            .args(["policy", "apply"])
            .arg(tmp.path().join("p.yaml"))
            .args(["--cp", &rpc])
            .output()
            .is_ok_and(|o| o.status.success())
    })
    .await;
    let agent = kvota()
        .args([
            "agent",
            "--cluster",
            "east",
            "--cp",
            &rpc,
            "--webhook-listen",
            &format!("127.0.0.1:{hook}"),
        ])
        .args(["--report-interval-ms", "300"])
        .arg("--kubeconfig")
        .arg(tmp.path().join("kubeconfig"))
        .arg("--tls-cert")
        .arg(tmp.path().join("tls.crt"))
        .arg("--tls-key")
        .arg(tmp.path().join("tls.key"))
        .arg("--data-dir")
        .arg(tmp.path().join("agent"))
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log("agent.log"))
        .spawn()
        .expect("spawn agent");
    procs.push(agent);
    let agent_log = || std::fs::read_to_string(tmp.path().join("agent.log")).unwrap_or_default();
    wait_for("agent ready", Duration::from_secs(30), || async {
        matches!(https(hook, &ca, "GET", "/readyz", vec![]).await, Ok((200, _)))
    })
    .await;
    let clusters = cli_json(&rpc, &["clusters"]).expect("clusters json");
    let text = clusters.to_string();
    assert!(
        text.contains("east") && text.contains("8000"),
        "8 schedulable GPUs registered (cordoned n3 not counted): {text}"
    );

    // maxShare 60 % of 8 GPUs = 4.8: the 4-GPU pod already running leaves room for no
    // further whole GPU, however often training asks.
    for i in 0..6 {
        let (status, body) = https(hook, &ca, "POST", "/validate", review(&format!("k{i}"), "ml", 1))
            .await
            .expect("review");
        assert_eq!(status, 200);
        let r: Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(
            r["response"]["allowed"],
            false,
            "pod k{i} admitted past maxShare: {r}\nagent log:\n{}",
            agent_log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The pod finishes: its GPUs are free and training is admitted again.
    let mut done = api.get(Kind::Pod, "ml/old").expect("pod");
    done["status"]["phase"] = json!("Succeeded");
    api.put(Kind::Pod, done);
    wait_for("admission after the pod finished", Duration::from_secs(20), || async {
        let Ok((_, body)) = https(hook, &ca, "POST", "/validate", review("after", "ml", 1)).await else {
            return false;
        };
        serde_json::from_slice::<Value>(&body).is_ok_and(|r| r["response"]["allowed"] == true)
    })
    .await;
    drop(procs);
}

/// The API server's time format for Unix seconds `s`.
fn rfc3339(s: u64) -> String {
    kvota_member_agent::kube::format_time(i64::try_from(s).expect("seconds"))
}

fn unix_now() -> (u64, u64) {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock");
    (d.as_secs(), u64::try_from(d.as_millis()).expect("ms"))
}

/// A GPU pod of tenant training (namespace `ml`) bound to `node`, scheduled at Unix
/// second `start`; finished at `end` if given.
fn gpu_pod(name: &str, node: &str, gpus: u64, start: u64, end: Option<u64>) -> Value {
    let mut status = json!({
        "phase": "Running",
        "startTime": rfc3339(start),
        "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": rfc3339(start)}],
        "containerStatuses": [{"name": "c", "state": {"running": {"startedAt": rfc3339(start)}}}],
    });
    if let Some(end) = end {
        status["phase"] = json!("Succeeded");
        status["containerStatuses"] = json!([{"name": "c", "state": {"terminated": {"exitCode": 0, "startedAt": rfc3339(start), "finishedAt": rfc3339(end)}}}]);
    }
    json!({"metadata": {"name": name, "namespace": "ml"},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]},
        "status": status})
}

/// The issue's "done when", with the real binaries: a cluster is cut off from the
/// control plane (a real TCP proxy drops the link), its agent is killed, and a new agent
/// process, with an empty data directory as a standby on another node would have,
/// starts while the partition lasts. It goes on enforcing at once from the state the
/// first one kept in the cluster (ConfigMap kvota-agent-state): ready without the
/// control plane, it admits training's pods under the still-valid lease up to its
/// budget and not one GPU beyond. A pod that started and finished while no agent ran is
/// recovered from its run times; after the partition heals the ledger equals the usage
/// of every pod that ran within 0.1 %.
///
/// No API server can run here: the cluster is the fake API server of
/// `member-agent/tests/support/fake_apiserver.rs` (list/watch, ConfigMaps with resource
/// versions). The agents meter live pods once a second, so each live pod's start and
/// end are known to about a second; the pod that ran while no agent ran is large (2,048
/// GPUs for 8 s) so that this granularity stays well below 0.1 % of the total.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_agent_during_a_partition_enforces_the_kept_lease_and_recovers_usage_no_agent_saw() {
    use fake_apiserver::{FakeApi, Kind};
    use link::LinkProxy;
    let api = FakeApi::start().await;
    api.put(
        Kind::Node,
        json!({"metadata": {"name": "n1"}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}}),
    );
    api.put(
        Kind::Node,
        json!({"metadata": {"name": "big"}, "status": {"allocatable": {"nvidia.com/gpu": "4096"}}}),
    );
    api.put(Kind::Namespace, json!({"metadata": {"name": "ml"}}));
    let Env {
        tmp,
        rpc,
        http,
        hook,
        ca,
    } = env();
    let ca: &[u8] = &ca;
    write_kubeconfig(tmp.path(), &api.url);
    let log = |name: &str| Stdio::from(std::fs::File::create(tmp.path().join(name)).expect("log"));
    let mut procs = Procs::of([one_node_server(tmp.path(), &rpc, &http)]);
    // A lease that outlives the agent's restart; decay too slow to matter here.
    let policy = "apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: restart-test}
spec:
  decayHalfLife: 100000h
  lease: {duration: 60s, clockSkewMargin: 2s}
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, namespaces: [ml]}
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, namespaces: [serving]}
";
    std::fs::write(tmp.path().join("p.yaml"), policy).expect("w");
    wait_for("policy applied", Duration::from_secs(20), || async {
        kvota()
            .args(["policy", "apply"])
            .arg(tmp.path().join("p.yaml"))
            .args(["--cp", &rpc])
            .output()
            .is_ok_and(|o| o.status.success())
    })
    .await;
    let proxy = LinkProxy::start(rpc.clone()).await.expect("proxy");
    let agent = |dir: &str, logfile: &str| {
        kvota()
            .args([
                "agent",
                "--cluster",
                "east",
                "--cp",
                proxy.addr(),
                "--webhook-listen",
                &format!("127.0.0.1:{hook}"),
            ])
            // Denials are answered at once: the test raises training's demand with
            // refused requests, which a held review could turn into admissions.
            .args([
                "--report-interval-ms",
                "300",
                "--identity",
                dir,
                "--admission-hold-ms",
                "0",
            ])
            .arg("--kubeconfig")
            .arg(tmp.path().join("kubeconfig"))
            .arg("--tls-cert")
            .arg(tmp.path().join("tls.crt"))
            .arg("--tls-key")
            .arg(tmp.path().join("tls.key"))
            .arg("--data-dir")
            .arg(tmp.path().join(dir))
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log(logfile))
            .spawn()
            .expect("spawn agent")
    };
    let read_log = |name: &str| std::fs::read_to_string(tmp.path().join(name)).unwrap_or_default();
    let allowed = |body: &[u8]| serde_json::from_slice::<Value>(body).is_ok_and(|r| r["response"]["allowed"] == true);
    let metric = |m: &str, name: &str| {
        m.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    let metrics = || async {
        https(hook, ca, "GET", "/metrics", vec![])
            .await
            .map(|(_, m)| String::from_utf8_lossy(&m).to_string())
            .unwrap_or_default()
    };

    procs.push(agent("agent-a", "agent-a.log"));
    wait_for("agent A ready", Duration::from_secs(30), || async {
        matches!(https(hook, ca, "GET", "/readyz", vec![]).await, Ok((200, _)))
    })
    .await;

    // Training runs two one-GPU pods admitted by A, and asks for more (refused: demand)
    // until a lease leaves room for at least two more.
    let mut live: Vec<(String, u64, u64)> = Vec::new(); // (name, gpus, created at ms)
    for i in 0..2 {
        let name = format!("a{i}");
        wait_for("an admission by agent A", Duration::from_secs(20), || async {
            https(hook, ca, "POST", "/validate", review(&name, "ml", 1))
                .await
                .is_ok_and(|(_, b)| allowed(&b))
        })
        .await;
        let (s, ms) = unix_now();
        api.put(Kind::Pod, gpu_pod(&name, "n1", 1, s, None));
        live.push((name, 1, ms));
    }
    let mut asked = 0;
    wait_for(
        "a lease with room for more of training",
        Duration::from_secs(30),
        || {
            asked += 1;
            let round = asked;
            async move {
                let m = metrics().await;
                let budget = metric(&m, r#"kvota_agent_budget_gpus{tenant="training"} "#).unwrap_or(0.0);
                let inuse = metric(&m, r#"kvota_agent_inuse_gpus{tenant="training"} "#).unwrap_or(f64::MAX);
                if budget >= inuse + 2.0 {
                    return true;
                }
                // Demand: a request for two more GPUs, refused, raises the next budget.
                let _ = https(hook, ca, "POST", "/validate", review(&format!("want{round}"), "ml", 2)).await;
                false
            }
        },
    )
    .await;
    // A kept its state in the cluster, a round after that lease.
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(
        api.get(Kind::ConfigMap, "kvota-system/kvota-agent-state").is_some(),
        "agent A kept no state; log:\n{}",
        read_log("agent-a.log")
    );

    // Partition, then kill A.
    proxy.set_cut(true);
    tokio::time::sleep(Duration::from_millis(700)).await;
    procs.get(1).expect("running").kill().expect("kill agent A");
    let _ = procs.get(1).expect("running").wait();

    // While no agent runs: a big pod starts and finishes.
    let (now_s, _) = unix_now();
    let (ghost_start, ghost_end) = (now_s + 1, now_s + 9);
    let ghost_gpus = 2_048u64;
    while unix_now().0 <= ghost_end {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    api.put(
        Kind::Pod,
        gpu_pod("ghost", "big", ghost_gpus, ghost_start, Some(ghost_end)),
    );

    // B: a new process with an empty data directory, the partition still on.
    procs.push(agent("agent-b", "agent-b.log"));
    wait_for(
        "agent B ready without the control plane",
        Duration::from_secs(30),
        || async { matches!(https(hook, ca, "GET", "/readyz", vec![]).await, Ok((200, _))) },
    )
    .await;
    let m = metrics().await;
    assert!(
        m.contains(r#"kvota_agent_lease_state{state="fresh"} 1"#),
        "B must enforce the kept lease as still valid:\n{m}"
    );
    let budget = metric(&m, r#"kvota_agent_budget_gpus{tenant="training"} "#).expect("budget");
    let inuse = metric(&m, r#"kvota_agent_inuse_gpus{tenant="training"} "#).expect("inuse");
    assert_eq!(inuse, 2.0, "B sees A's two pods");
    let room = (1..=64usize).take_while(|n| (*n as f64) <= budget - inuse).count();
    assert!(room >= 2, "budget {budget}, in use {inuse}");
    // Pods that fit under the lease are admitted; the first beyond it is refused.
    let mut admitted_after = 0;
    for i in 0..room + 1 {
        let name = format!("b{i}");
        let (status, body) = https(hook, ca, "POST", "/validate", review(&name, "ml", 1))
            .await
            .expect("review");
        assert_eq!(status, 200);
        let r: Value = serde_json::from_slice(&body).expect("json");
        let message = r["response"]["status"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(!message.contains("not judged"), "B judged nothing: {r}");
        if i < room {
            assert_eq!(
                r["response"]["allowed"],
                true,
                "pod {i} fits under the lease (budget {budget}, in use {inuse}): {r}\n{}",
                read_log("agent-b.log")
            );
            let (s, ms) = unix_now();
            api.put(Kind::Pod, gpu_pod(&name, "n1", 1, s, None));
            live.push((name, 1, ms));
            admitted_after += 1;
        } else {
            assert_eq!(
                r["response"]["allowed"], false,
                "over-admission: pod {i} is beyond the budget {budget}: {r}"
            );
            assert!(message.contains("training"), "{message}");
        }
    }
    assert!(admitted_after >= 2);

    // Heal; let everything run a little, then finish every live pod.
    proxy.set_cut(false);
    wait_for(
        "B to report through the healed link",
        Duration::from_secs(30),
        || async { read_log("agent-b.log").contains("usage no agent metered recovered") },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut expected_ms: u128 = u128::from(ghost_gpus * 1_000) * u128::from((ghost_end - ghost_start) * 1_000);
    for (name, gpus, created_ms) in &live {
        let mut p = api.get(Kind::Pod, &format!("ml/{name}")).expect("pod");
        let (s, ms) = unix_now();
        p["status"]["phase"] = json!("Succeeded");
        p["status"]["containerStatuses"] =
            json!([{"name": "c", "state": {"terminated": {"exitCode": 0, "finishedAt": rfc3339(s)}}}]);
        api.put(Kind::Pod, p);
        expected_ms += u128::from(gpus * 1_000) * u128::from(ms - created_ms);
    }
    // The ledger settles once reports cover the finishes (then only decay moves it).
    let ledger = || {
        cli_json(&rpc, &["tenants"]).and_then(|v| {
            v["tenants"].as_array()?.iter().find(|t| t["tenant"] == "training")?["decayed_usage_milli_gpue_ms"].as_u64()
        })
    };
    let mut last = None;
    wait_for("the ledger to settle", Duration::from_secs(30), || {
        let now = ledger();
        // Decay moves it by parts in 10^8 per second: settled is within 10^-6.
        let settled = matches!((now, last), (Some(a), Some(b)) if a > 0 && a.abs_diff(b) * 1_000_000 <= a);
        last = now;
        async move {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            settled
        }
    })
    .await;
    let got = u128::from(last.expect("ledger"));
    let off = got.abs_diff(expected_ms);
    eprintln!(
        "ledger {got} milli-GPUe-ms, pods' usage {expected_ms} (of which {} while no agent ran): off by {:.4} %; {admitted_after} pods admitted by the new agent under a budget of {budget}",
        u128::from(ghost_gpus * 1_000) * u128::from((ghost_end - ghost_start) * 1_000),
        off as f64 * 100.0 / expected_ms as f64
    );
    assert!(
        off * 1_000 <= expected_ms,
        "ledger {got} vs the pods' usage {expected_ms} milli-GPUe-ms: off by {:.3} %\nagent B log:\n{}",
        off as f64 * 100.0 / expected_ms as f64,
        read_log("agent-b.log")
    );
    drop(procs);
}

/// `--log-format json`: every line a JSON object, and one report followed by its span
/// fields from the agent (cluster, sequence number) through the control plane's gRPC
/// call (method, cluster, sequence) to the lease it sent back; an admission decision
/// carries its tenant and outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_follow_a_report_to_its_lease_and_an_admission_to_its_tenant() {
    let Env {
        tmp,
        rpc,
        http,
        hook,
        ca,
    } = env();
    // The server takes the flag (a global one, after its subcommand), the agent the
    // environment variable.
    let server = one_node_server_cmd(tmp.path(), &rpc, &http)
        .args(["--log-format", "json"])
        .env("RUST_LOG", "info,kvota_control_plane=debug")
        .spawn()
        .expect("spawn server");
    let mut procs = Procs::of([server]);
    std::fs::write(tmp.path().join("p.yaml"), POLICY).expect("w");
    wait_for("policy applied", Duration::from_secs(20), || async {
        kvota()
            .args(["policy", "apply"])
            .arg(tmp.path().join("p.yaml"))
            .args(["--cp", &rpc])
            .output()
            .is_ok_and(|o| o.status.success())
    })
    .await;
    let agent = sim_agent(tmp.path(), &rpc, hook, "agent.log")
        .env("KVOTA_LOG_FORMAT", "json")
        .env("RUST_LOG", "info,kvota_member_agent=debug")
        .spawn()
        .expect("spawn agent");
    procs.push(agent);
    wait_for("agent ready", Duration::from_secs(20), || async {
        matches!(https(hook, &ca, "GET", "/readyz", vec![]).await, Ok((200, _)))
    })
    .await;
    let (status, _) = https(hook, &ca, "POST", "/validate", review("j1", "ml", 1))
        .await
        .expect("review");
    assert_eq!(status, 200);

    let lines = |name: &str| -> Vec<Value> {
        std::fs::read_to_string(tmp.path().join(name))
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{name}: not a JSON line ({e}): {l}")))
            .collect()
    };
    let span = |line: &Value, name: &str| -> Option<Value> {
        line["spans"].as_array()?.iter().find(|s| s["name"] == name).cloned()
    };
    wait_for(
        "a lease sent for a report of east, and the report's acknowledgement",
        Duration::from_secs(20),
        || async {
            let server = lines("server.log");
            let agent = lines("agent.log");
            let sent = server.iter().any(|l| {
                l["fields"]["message"] == "lease sent"
                    && span(l, "grpc").is_some_and(|s| s["method"] == "/kvota.v1.Member/Report")
                    && span(l, "report").is_some_and(|s| s["cluster"] == "east" && s["seq"].as_u64().is_some())
            });
            let acked = agent.iter().any(|l| {
                l["fields"]["message"] == "report acknowledged"
                    && span(l, "report").is_some_and(|s| s["cluster"] == "east" && s["seq"].as_u64().is_some())
            });
            sent && acked
        },
    )
    .await;
    let agent = lines("agent.log");
    let decided = agent
        .iter()
        .find(|l| l["fields"]["message"] == "admission decided")
        .unwrap_or_else(|| panic!("no admission line in {agent:?}"));
    let a = span(decided, "admission").expect("admission span");
    assert_eq!(a["tenant"], "training", "{decided}");
    assert!(a["outcome"].as_str().is_some_and(|o| !o.is_empty()), "{decided}");

    // The admin answers are protobuf messages; the CLI prints the same JSON as before.
    let e = cli_json(&rpc, &["explain", "tenant", "training"]).expect("explain tenant --json");
    assert_eq!(e["tenant"], "training", "{e}");
    assert!(
        e["clusters"]
            .as_array()
            .is_some_and(|c| c.iter().any(|p| p["cluster"] == "east")),
        "{e}"
    );
    assert!(e["fairness_score"].as_f64().is_some(), "{e}");
    let out = kvota()
        .args(["audit", "-o", "json", "--cp", &rpc])
        .output()
        .expect("audit");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let records: Vec<Value> = serde_json::from_slice(&out.stdout).expect("a JSON array of records");
    assert!(
        records
            .iter()
            .any(|r| r["event"]["PolicyApplied"]["name"] == "agent-test"),
        "{records:?}"
    );
    assert!(
        records
            .iter()
            .any(|r| r["event"]["ClusterRegistered"]["cluster"] == "east"),
        "{records:?}"
    );
    assert!(
        records.windows(2).all(|w| w[0]["seq"].as_u64() < w[1]["seq"].as_u64()),
        "oldest first: {records:?}"
    );

    // `policy get` prints a document that `policy apply` takes back unchanged.
    let get = || {
        let out = kvota()
            .args(["policy", "get", "--cp", &rpc])
            .output()
            .expect("policy get");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).expect("utf8")
    };
    let first = get();
    assert_eq!(
        kvota_fairness::policy::Policy::from_yaml(&first).expect("loads"),
        kvota_fairness::policy::Policy::from_yaml(POLICY).expect("loads"),
        "{first}"
    );
    std::fs::write(tmp.path().join("got.yaml"), &first).expect("w");
    let out = kvota()
        .args(["policy", "apply"])
        .arg(tmp.path().join("got.yaml"))
        .args(["--cp", &rpc])
        .output()
        .expect("apply");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(get(), first);
    drop(procs);
}
