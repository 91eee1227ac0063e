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

struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0")).collect();
    held.iter().map(|l| l.local_addr().expect("addr").port()).collect()
}

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
    roots.add(CertificateDer::from(ca.to_vec())).map_err(|e| e.to_string())?;
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("localhost").map_err(|e| e.to_string())?, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls)).await.map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes().to_vec();
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

fn cli_json(cp: &str, args: &[&str]) -> Option<Value> {
    let out = kvota().args(args).args(["--json", "--cp", cp]).output().ok()?;
    serde_json::from_slice(&out.stdout).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_serves_reviews_reports_usage_and_keeps_enforcing_without_the_control_plane() {
    let Env { tmp, rpc, http, hook, ca } = env();
    let log = |name: &str| Stdio::from(std::fs::File::create(tmp.path().join(name)).expect("log"));

    let server = kvota()
        .args(["server", "--id", "1", "--init", "--listen", &rpc, "--http", &http, "--raft-listen", "127.0.0.1:0", "--tick-ms", "200"])
        .arg("--data-dir")
        .arg(tmp.path().join("cp"))
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log("server.log"))
        .spawn()
        .expect("spawn server");
    let mut procs = Procs(vec![server]);
    std::fs::write(tmp.path().join("p.yaml"), POLICY).expect("w");
    let mut applied = false;
    for _ in 0..100 {
        let out = kvota().args(["policy", "apply"]).arg(tmp.path().join("p.yaml")).args(["--cp", &rpc]).output().expect("apply");
        if out.status.success() {
            applied = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(applied, "policy apply never succeeded");

    let agent = kvota()
        .args(["agent", "--cluster", "east", "--cp", &rpc, "--webhook-listen", &format!("127.0.0.1:{hook}")])
        .args(["--report-interval-ms", "300", "--simulate", "2x4", "--simulate-pod-seconds", "3600"])
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
    procs.0.push(agent);
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
            let (status, body) = https(hook, &ca, "POST", "/validate", review(&format!("t{round}-{i}"), "ml", 1)).await.expect("review");
            assert_eq!(status, 200);
            let r: Value = serde_json::from_slice(&body).expect("json");
            assert_eq!(r["response"]["uid"], format!("t{round}-{i}"));
            if r["response"]["allowed"] == true {
                admitted += 1;
                admitted_pod = format!("ml/t{round}-{i}");
            } else {
                denial = r["response"]["status"]["message"].as_str().unwrap_or_default().to_string();
                denied_pod = format!("ml/t{round}-{i}");
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    assert!((1..=4).contains(&admitted), "admitted {admitted} one-GPU pods; maxShare allows 4");
    assert!(denial.contains("training") && denial.contains("kvota explain"), "{denial}");

    // The command the denial names explains it, from the agent's record of the decision.
    let explain = |pod: &str, agent: bool| {
        let mut c = kvota();
        c.args(["explain", "pod", pod, "--cp", &rpc]);
        if agent {
            c.args(["--agent", &format!("https://127.0.0.1:{hook}"), "--agent-tls-name", "localhost", "--agent-ca"]);
            c.arg(tmp.path().join("tls.crt"));
        }
        let out = c.output().expect("explain pod");
        (out.status.success(), String::from_utf8_lossy(&out.stdout).to_string(), String::from_utf8_lossy(&out.stderr).to_string())
    };
    let (ok, text, err) = explain(&denied_pod, true);
    assert!(ok, "{err}");
    assert!(text.contains(&format!("pod {denied_pod} requests 1 GPUe")) && text.contains("tenant training in cluster east"), "{text}");
    assert!(text.contains("Deny") && text.contains("against budget") && text.contains("now: denied"), "{text}");
    let (ok, text, err) = explain(&admitted_pod, true);
    assert!(ok && text.contains("Allow") && (text.contains("now: bound") || text.contains("now: admitted")), "{text}{err}");
    let (ok, _, err) = explain("ml/never-created", true);
    assert!(!ok && err.contains("has not judged pod ml/never-created"), "{err}");
    // Without an agent: the tenant's numbers from the control plane, and how to ask the agent.
    let (ok, text, err) = explain(&denied_pod, false);
    assert!(ok && text.contains("belongs to tenant `training`") && text.contains("--agent https://"), "{text}{err}");
    let (ok, _, err) = explain("no-slash", false);
    assert!(!ok && err.contains("expected NAMESPACE/NAME"), "{err}");

    // The control plane sees the cluster and the usage.
    wait_for("the control plane to see training's pods", Duration::from_secs(10), || async {
        cli_json(&rpc, &["tenants"]).is_some_and(|v| {
            v["tenants"].as_array().is_some_and(|ts| {
                ts.iter().any(|t| t["tenant"] == "training" && t["inuse_milli_gpue"].as_u64() == Some(admitted * 1000))
            })
        })
    })
    .await;

    // What the agent reported is what the ledger holds. Read the control plane first:
    // the agent's counters only grow, so read after it they bound it from above (its
    // sequence, and its undecayed usage meter above the decayed ledger).
    wait_for("the ledger to match the agent's reports", Duration::from_secs(10), || async {
        let east = cli_json(&rpc, &["clusters"]).and_then(|v| v.as_array()?.first()?["last_seq"].as_u64());
        let ledger = cli_json(&rpc, &["tenants"]).and_then(|v| {
            v["tenants"].as_array()?.iter().find(|t| t["tenant"] == "training")?["decayed_usage_milli_gpue_ms"].as_u64()
        });
        let Ok((_, m)) = https(hook, &ca, "GET", "/metrics", vec![]).await else { return false };
        let m = String::from_utf8_lossy(&m).to_string();
        let metric = |name: &str| m.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse::<u64>().ok());
        let seq = metric("kvota_agent_journal_last_seq ");
        let used = metric(r#"kvota_agent_reported_usage_milli_gpue_milliseconds_total{tenant="training"} "#);
        matches!((east, seq), (Some(e), Some(s)) if e > 0 && e <= s) && matches!((ledger, used), (Some(l), Some(u)) if l > 0 && l <= u)
    })
    .await;

    // Kill the control plane: the agent keeps answering, and after the 3 s lease it
    // enforces its safe budget (fallback), visible in its metrics.
    procs.0[0].kill().expect("kill server");
    let _ = procs.0[0].wait();
    wait_for("lease to expire into safe budgets", Duration::from_secs(10), || async {
        https(hook, &ca, "GET", "/metrics", vec![])
            .await
            .is_ok_and(|(_, m)| String::from_utf8_lossy(&m).contains(r#"kvota_agent_lease_state{state="safe"} 1"#))
    })
    .await;
    let (status, body) = https(hook, &ca, "POST", "/validate", review("after-cp", "ml", 1)).await.expect("review");
    assert_eq!(status, 200);
    let r: Value = serde_json::from_slice(&body).expect("json");
    assert_eq!(r["response"]["allowed"], false, "safe budget (20 % x 8 GPUs = 1.6) is below what training holds: {r}");
    let (_, m) = https(hook, &ca, "GET", "/metrics", vec![]).await.expect("metrics");
    let m = String::from_utf8_lossy(&m);
    assert!(m.contains("kvota_agent_journal_backlog"), "{m}");

    // SIGTERM: a clean stop.
    let pid = procs.0[1].id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().expect("kill").success());
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(status) = procs.0[1].try_wait().expect("wait") {
            assert!(status.success(), "agent exit: {status}");
            break;
        }
        assert!(Instant::now() < deadline, "agent did not stop on SIGTERM");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn agent_flags_are_checked_before_anything_starts() {
    let tmp = tempfile::tempdir().expect("tmp");
    let run = |args: &[&str]| {
        let out = kvota().args(["agent", "--tls-cert", "/nonexistent.crt", "--tls-key", "/nonexistent.key"]).args(args).output().expect("run");
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    assert!(run(&["--cluster", "east"]).contains("/nonexistent.crt"), "certificates are checked first");
    assert!(run(&["--cluster", "east", "--simulate", "1x8", "--kubeconfig", "/k"]).contains("cannot be used with"));
    assert!(run(&["--cluster", "East!", "--simulate", "1x8"]).contains("--cluster"));
    assert!(run(&["--cluster", "east", "--simulate", "8"]).contains("COUNTxGPUS"));
    assert!(run(&["--cluster", "east", "--simulate", "1x8"]).contains("/nonexistent.crt"));
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
        api.put(Kind::Node, json!({"metadata": {"name": n}, "spec": {"unschedulable": cordoned},
            "status": {"allocatable": {"nvidia.com/gpu": gpus.to_string()}}}));
    }
    api.put(Kind::Namespace, json!({"metadata": {"name": "ml"}}));
    // Training's pod from before the agent existed: bound, running, 4 GPUs.
    api.put(Kind::Pod, json!({"metadata": {"name": "old", "namespace": "ml"},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]},
        "status": {"phase": "Running"}}));

    let Env { tmp, rpc, http, hook, ca } = env();
    let kubeconfig = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster: {{server: \"{}\"}}\n\
         users:\n- name: agent\n  user: {{token: test}}\ncontexts:\n- name: fake\n  context: {{cluster: fake, user: agent}}\n\
         current-context: fake\n",
        api.url
    );
    std::fs::write(tmp.path().join("kubeconfig"), kubeconfig).expect("w");
    let log = |name: &str| Stdio::from(std::fs::File::create(tmp.path().join(name)).expect("log"));
    let server = kvota()
        .args(["server", "--id", "1", "--init", "--listen", &rpc, "--http", &http, "--raft-listen", "127.0.0.1:0", "--tick-ms", "200"])
        .arg("--data-dir")
        .arg(tmp.path().join("cp"))
        .stdout(Stdio::null())
        .stderr(log("server.log"))
        .spawn()
        .expect("spawn server");
    let mut procs = Procs(vec![server]);
    std::fs::write(tmp.path().join("p.yaml"), POLICY).expect("w");
    wait_for("policy applied", Duration::from_secs(20), || async {
        kvota().args(["policy", "apply"]).arg(tmp.path().join("p.yaml")).args(["--cp", &rpc]).output().is_ok_and(|o| o.status.success())
    })
    .await;
    let agent = kvota()
        .args(["agent", "--cluster", "east", "--cp", &rpc, "--webhook-listen", &format!("127.0.0.1:{hook}")])
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
    procs.0.push(agent);
    let agent_log = || std::fs::read_to_string(tmp.path().join("agent.log")).unwrap_or_default();
    wait_for("agent ready", Duration::from_secs(30), || async {
        matches!(https(hook, &ca, "GET", "/readyz", vec![]).await, Ok((200, _)))
    })
    .await;
    let clusters = cli_json(&rpc, &["clusters"]).expect("clusters json");
    let text = clusters.to_string();
    assert!(text.contains("east") && text.contains("8000"), "8 schedulable GPUs registered (cordoned n3 not counted): {text}");

    // maxShare 60 % of 8 GPUs = 4.8: the 4-GPU pod already running leaves room for no
    // further whole GPU, however often training asks.
    for i in 0..6 {
        let (status, body) = https(hook, &ca, "POST", "/validate", review(&format!("k{i}"), "ml", 1)).await.expect("review");
        assert_eq!(status, 200);
        let r: Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(r["response"]["allowed"], false, "pod k{i} admitted past maxShare: {r}\nagent log:\n{}", agent_log());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // The pod finishes: its GPUs are free and training is admitted again.
    let mut done = api.get(Kind::Pod, "ml/old").expect("pod");
    done["status"]["phase"] = json!("Succeeded");
    api.put(Kind::Pod, done);
    wait_for("admission after the pod finished", Duration::from_secs(20), || async {
        let Ok((_, body)) = https(hook, &ca, "POST", "/validate", review("after", "ml", 1)).await else { return false };
        serde_json::from_slice::<Value>(&body).is_ok_and(|r| r["response"]["allowed"] == true)
    })
    .await;
    drop(procs);
}
