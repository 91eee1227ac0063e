//! The HTTPS webhook as the API server meets it: real rustls on a real socket, a
//! keep-alive HTTP/1.1 client, certificates generated for the test (rcgen) and rotated
//! on disk while serving.

use kvota_fairness::names::PodKey;
use kvota_fairness::names::{ClusterName, TenantName};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes_body::Full;
use hyper::body::Bytes;
use hyper::Request;
use hyper_util::rt::TokioIo;
use kvota_fairness::lease::{Lease, TenantBudget};
use kvota_fairness::policy::Policy;
use kvota_member_agent::agent::Agent;
use kvota_member_agent::metrics::AgentMetrics;
use kvota_member_agent::webhook::{self, TlsError, WebhookCtx, WebhookTls};
use rustls_pki_types::{CertificateDer, ServerName};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};

mod bytes_body {
    pub use http_body_util::Full;
}

const POLICY: &str = "
apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: t}
spec:
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, namespaces: [ml]}
  - {name: research, weight: 10, admission: queue, maxQueued: 2, namespaces: [lab]}
";

fn write_cert(dir: &Path, name: &str) -> Vec<u8> {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string(), name.to_string()]).expect("rcgen");
    std::fs::write(dir.join("tls.crt"), cert.cert.pem()).expect("write cert");
    std::fs::write(dir.join("tls.key"), cert.key_pair.serialize_pem()).expect("write key");
    cert.cert.der().to_vec()
}

struct Served {
    addr: std::net::SocketAddr,
    agent: Arc<Agent>,
    _stop: tokio::sync::watch::Sender<bool>,
}

async fn serve(dir: &Path) -> Served {
    serve_holding(dir, webhook::DEFAULT_ADMISSION_HOLD).await
}

/// [`serve`] with first denials held at most `hold`.
async fn serve_holding(dir: &Path, hold: Duration) -> Served {
    let agent = Arc::new(
        Agent::open(
            &ClusterName::from_static("east"),
            [("nvidia.com/gpu".to_string(), 32_000)].into(),
            &dir.join("journal"),
            &["127.0.0.1:9".to_string()],
        )
        .expect("agent"),
    );
    {
        let mut st = agent.state();
        st.set_policy(Policy::from_yaml(POLICY).expect("policy"));
        let budgets: BTreeMap<TenantName, TenantBudget> = [
            (
                TenantName::from_static("training"),
                TenantBudget {
                    budget: 2_000,
                    fallback: 1_000,
                    entitlement: 9_000,
                    borrow: 0,
                    ceiling: 0,
                },
            ),
            (
                TenantName::from_static("research"),
                TenantBudget {
                    budget: 1_000,
                    fallback: 0,
                    entitlement: 1_000,
                    borrow: 0,
                    ceiling: 0,
                },
            ),
        ]
        .into();
        let now = st.now_ms();
        st.lease.on_lease(
            Lease {
                cluster: ClusterName::from_static("east"),
                epoch: 1,
                duration_ms: 600_000,
                margin_ms: 1_000,
                issued_at_ms: 0,
                budgets,
            },
            now,
        );
    }
    let metrics = AgentMetrics::new();
    let tls = WebhookTls::load(&dir.join("tls.crt"), &dir.join("tls.key"), None, None).expect("tls");
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let (stop, rx) = tokio::sync::watch::channel(false);
    let ctx = WebhookCtx::new(agent.clone(), metrics.clone());
    ctx.set_admission_hold(hold);
    let app = webhook::router(ctx);
    tokio::spawn(webhook::serve_tls(l, tls, app, metrics, webhook::default_limits(), rx));
    Served {
        addr,
        agent,
        _stop: stop,
    }
}

/// A TLS client that trusts exactly `ca` (the self-signed server certificate).
struct Conn {
    send: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    peer_cert: Vec<u8>,
}

async fn connect(addr: std::net::SocketAddr, ca: &[u8]) -> Result<Conn, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from(ca.to_vec()))
        .map_err(|e| e.to_string())?;
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("localhost").map_err(|e| e.to_string())?, tcp)
        .await
        .map_err(|e| e.to_string())?;
    let peer_cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    Ok(Conn { send, peer_cert })
}

impl Conn {
    async fn call(&mut self, method: &str, path: &str, body: Vec<u8>) -> (u16, Vec<u8>) {
        let req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "localhost")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("request");
        // HTTP/1: wait until the connection has finished the previous exchange.
        self.send.ready().await.expect("connection ready");
        let resp = self.send.send_request(req).await.expect("send");
        let status = resp.status().as_u16();
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("body")
            .to_bytes()
            .to_vec();
        (status, body)
    }
}

fn pod_review(uid: &str, ns: &str, name: &str, gpus: u32) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": ns,
            "name": name,
            "operation": "CREATE",
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": gpus.to_string()}}}]}}
        }
    }))
    .expect("json")
}

fn response(body: &[u8]) -> Value {
    let v: Value = serde_json::from_slice(body).expect("a JSON AdmissionReview");
    assert_eq!(v["kind"], "AdmissionReview", "{v}");
    assert_eq!(v["apiVersion"], "admission.k8s.io/v1", "{v}");
    v["response"].clone()
}

/// One review of a `gpus`-GPU pod in `ml`: whether it was allowed, and how long the
/// answer took.
async fn timed(c: &mut Conn, uid: &str, name: &str, gpus: u32) -> (bool, Duration) {
    let started = std::time::Instant::now();
    let (status, body) = c.call("POST", "/validate", pod_review(uid, "ml", name, gpus)).await;
    assert_eq!(status, 200);
    (response(&body)["allowed"] == true, started.elapsed())
}

/// A pod's first denial for lack of budget is held only when a report round can bring
/// a new lease: here the agent has never completed one (its control plane's address
/// answers nothing), so the denial is answered at once, as is one that more budget
/// cannot cure (a pod larger than the cluster) and any denial with the hold off. The
/// held path, its timeout and its bound run against a real control plane in
/// `kvota/tests/agent_process.rs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_is_not_held_when_no_report_round_can_answer_it() {
    for hold in [webhook::DEFAULT_ADMISSION_HOLD, Duration::ZERO] {
        let tmp = tempfile::tempdir().expect("tmp");
        let ca = write_cert(tmp.path(), "one");
        let s = serve_holding(tmp.path(), hold).await;
        let mut c = connect(s.addr, &ca).await.expect("connect");
        // Budget 2 GPUs: a 3-GPU pod is over it; 40 GPUs never fit the 32-GPU cluster.
        for (uid, name, gpus) in [("h1", "big", 3), ("h2", "huge", 40)] {
            let (allowed, took) = timed(&mut c, uid, name, gpus).await;
            assert!(
                !allowed && took < Duration::from_millis(300),
                "hold {hold:?}, {name}: answered after {took:?}"
            );
        }
        let (_, m) = c.call("GET", "/metrics", vec![]).await;
        assert!(
            !String::from_utf8_lossy(&m).contains("kvota_agent_admission_holds_total{"),
            "nothing was held"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reviews_over_https_decide_reserve_and_explain() {
    let tmp = tempfile::tempdir().expect("tmp");
    let ca = write_cert(tmp.path(), "one");
    let s = serve(tmp.path()).await;
    let mut c = connect(s.addr, &ca).await.expect("connect");

    // Two one-GPU pods fit the 2-GPU budget on one keep-alive connection; the third is
    // denied with an actionable message.
    for (i, want) in [(1, true), (2, true), (3, false)] {
        let (status, body) = c
            .call(
                "POST",
                "/validate",
                pod_review(&format!("u{i}"), "ml", &format!("p{i}"), 1),
            )
            .await;
        assert_eq!(status, 200);
        let r = response(&body);
        assert_eq!(r["uid"], format!("u{i}"));
        assert_eq!(r["allowed"], want, "{r}");
        if !want {
            let msg = r["status"]["message"].as_str().unwrap_or_default();
            assert!(msg.contains("training") && msg.contains("kvota explain"), "{msg}");
        }
    }
    assert_eq!(s.agent.state().inuse("training"), 2_000, "two reservations");

    // Queue mode: the mutating endpoint gates the pod over budget with a JSONPatch.
    let (status, body) = c.call("POST", "/mutate", pod_review("q1", "lab", "big", 4)).await;
    assert_eq!(status, 200);
    let r = response(&body);
    assert_eq!(
        (r["uid"].as_str(), r["allowed"].as_bool(), r["patchType"].as_str()),
        (Some("q1"), Some(true), Some("JSONPatch"))
    );

    // Garbage and oversized bodies still get a well-formed review.
    let (status, body) = c.call("POST", "/validate", b"{not json".to_vec()).await;
    assert_eq!(status, 400);
    assert_eq!(response(&body)["allowed"], false);
    let (status, body) = c.call("POST", "/validate", vec![b' '; 5 << 20]).await;
    assert_eq!(status, 413);
    assert!(response(&body)["status"]["message"]
        .as_str()
        .unwrap_or_default()
        .contains("larger than"));

    // Probes and metrics on the same port.
    assert_eq!(c.call("GET", "/healthz", vec![]).await.0, 200);
    assert_eq!(c.call("GET", "/readyz", vec![]).await.0, 200);
    let (_, m) = c.call("GET", "/metrics", vec![]).await;
    let m = String::from_utf8_lossy(&m);
    assert!(
        m.contains(r#"kvota_agent_admissions_total{tenant="training",outcome="allowed"} 2"#),
        "{m}"
    );
    assert!(
        m.contains(r#"kvota_agent_admissions_total{tenant="training",outcome="denied"} 1"#),
        "{m}"
    );
    assert!(m.contains(r#"kvota_agent_lease_state{state="fresh"} 1"#), "{m}");
    assert!(m.contains(r#"kvota_agent_queue_depth{tenant="research"} 1"#), "{m}");
    assert!(m.contains("kvota_agent_admission_duration_seconds_count"), "{m}");
    // The policy lends (the default) and nothing is borrowed yet; with lendWhen: cutOff
    // and the lease fresh the agent does not lend.
    assert!(m.contains("kvota_agent_lending 1\n"), "{m}");
    assert!(m.contains(r#"kvota_agent_borrowed_gpus{tenant="training"} 0.0"#), "{m}");
    let cut_off = POLICY.replacen("spec:\n", "spec:\n  reclaim: {lendWhen: cutOff}\n", 1);
    s.agent.state().set_policy(Policy::from_yaml(&cut_off).expect("policy"));
    let (_, m) = c.call("GET", "/metrics", vec![]).await;
    assert!(
        String::from_utf8_lossy(&m).contains("kvota_agent_lending 0\n"),
        "{}",
        String::from_utf8_lossy(&m)
    );
    s.agent.state().set_policy(Policy::from_yaml(POLICY).expect("policy"));
    // A replica whose admission is held (a standby, or an inventory not listed yet)
    // admits nothing, so it lends nothing either.
    s.agent.state().set_held(Some("standby".into()));
    let (_, m) = c.call("GET", "/metrics", vec![]).await;
    assert!(
        String::from_utf8_lossy(&m).contains("kvota_agent_lending 0\n"),
        "{}",
        String::from_utf8_lossy(&m)
    );
    s.agent.state().set_held(None);
    let (_, m) = c.call("GET", "/metrics", vec![]).await;
    assert!(
        String::from_utf8_lossy(&m).contains("kvota_agent_lending 1\n"),
        "{}",
        String::from_utf8_lossy(&m)
    );
    // A policy without `research`: its per-tenant series go, not left at their last
    // values; `training`'s stay; back in the policy, back in the metrics.
    let without = POLICY
        .lines()
        .filter(|l| !l.contains("name: research"))
        .collect::<Vec<_>>()
        .join("\n");
    s.agent.state().set_policy(Policy::from_yaml(&without).expect("policy"));
    let (_, m) = c.call("GET", "/metrics", vec![]).await;
    let m = String::from_utf8_lossy(&m);
    for family in ["queue_depth", "budget_gpus", "inuse_gpus", "borrowed_gpus"] {
        assert!(
            !m.contains(&format!("kvota_agent_{family}{{tenant=\"research\"}}")),
            "{family}: {m}"
        );
        assert!(
            m.contains(&format!("kvota_agent_{family}{{tenant=\"training\"}}")),
            "{family}: {m}"
        );
    }
    s.agent.state().set_policy(Policy::from_yaml(POLICY).expect("policy"));
    let (_, m) = c.call("GET", "/metrics", vec![]).await;
    assert!(
        String::from_utf8_lossy(&m).contains(r#"kvota_agent_budget_gpus{tenant="research"}"#),
        "{}",
        String::from_utf8_lossy(&m)
    );
    // No control plane answers (127.0.0.1:9): a policy fetch fails, is counted, and the
    // policy loaded stays in force.
    assert!(String::from_utf8_lossy(&m).contains("kvota_agent_policy_fetch_failures 0\n"));
    assert!(
        s.agent.fetch_policy().await.is_err(),
        "nothing listens on the control plane's address"
    );
    // (A new connection: the client's retries, about 4 s, outlast the webhook's idle timeout.)
    let mut c = connect(s.addr, &ca).await.expect("connect");
    let (_, m) = c.call("GET", "/metrics", vec![]).await;
    assert!(
        String::from_utf8_lossy(&m).contains("kvota_agent_policy_fetch_failures 1\n"),
        "{}",
        String::from_utf8_lossy(&m)
    );
    assert!(s.agent.state().lends_now(), "the policy loaded is still in force");

    // The reclaim audit log on the same port: empty, then what reclaim recorded.
    let (status, body) = c.call("GET", "/reclaims", vec![]).await;
    assert_eq!((status, body.as_slice()), (200, b"[]".as_slice()));
    s.agent
        .state()
        .record_eviction(kvota_member_agent::state::ReclaimRecord {
            at_ms: 1,
            for_tenant: TenantName::from_static("research"),
            for_pod: PodKey::from_static("lab/small"),
            victim: PodKey::from_static("ml/p1"),
            victim_tenant: TenantName::from_static("training"),
            gpue: 1_000,
            outcome: kvota_fairness::federation::EvictionOutcome::Evicted,
            why: "youngest pod of the most over-entitled tenant".into(),
        });
    let (status, body) = c.call("GET", "/reclaims", vec![]).await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(
        (
            v[0]["victim"].as_str(),
            v[0]["for_tenant"].as_str(),
            v[0]["outcome"].as_str()
        ),
        (Some("ml/p1"), Some("research"), Some("evicted")),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_certificate_is_served_and_a_broken_one_is_not() {
    let tmp = tempfile::tempdir().expect("tmp");
    let first = write_cert(tmp.path(), "one");
    let s = serve(tmp.path()).await;
    assert_eq!(connect(s.addr, &first).await.expect("connect").peer_cert, first);

    // Rotate in place (as cert-manager does); new connections get the new certificate.
    tokio::time::sleep(Duration::from_millis(1_100)).await; // a later mtime on coarse clocks
    let second = write_cert(tmp.path(), "two");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(c) = connect(s.addr, &second).await {
            assert_eq!(c.peer_cert, second);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the rotated certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A broken rotation keeps the last good pair in service.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    std::fs::write(tmp.path().join("tls.crt"), "garbage").expect("write");
    tokio::time::sleep(kvota_tls::material::RELOAD_CHECK + Duration::from_millis(500)).await;
    let mut c = connect(s.addr, &second).await.expect("still the second certificate");
    assert_eq!(c.peer_cert, second);
    let (_, m) = c.call("GET", "/metrics", vec![]).await;
    let m = String::from_utf8_lossy(&m);
    assert!(m.contains(r#"kvota_agent_tls_reloads_total{state="error"} 1"#), "{m}");
    assert!(m.contains(r#"kvota_agent_tls_reloads_total{state="ok"} 1"#), "{m}");
}

/// Raw HTTP/1.1 over TLS: the head and the first part of the body now, the rest after
/// `pause` (or never); returns the response as text.
async fn slow_call(addr: std::net::SocketAddr, ca: &[u8], body: &[u8], sent: usize, pause: Option<Duration>) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from(ca.to_vec())).expect("root");
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let mut tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(ServerName::try_from("localhost").expect("name"), tcp)
        .await
        .expect("tls");
    let head = format!("POST /validate HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len());
    tls.write_all(head.as_bytes()).await.expect("head");
    tls.write_all(&body[..sent]).await.expect("first part");
    tls.flush().await.expect("flush");
    if let Some(pause) = pause {
        tokio::time::sleep(pause).await;
        tls.write_all(&body[sent..]).await.expect("rest");
        tls.flush().await.expect("flush");
    }
    let mut out = Vec::new();
    let read = tokio::time::timeout(webhook::BUSY_WAIT + Duration::from_secs(5), tls.read_to_end(&mut out)).await;
    assert!(
        read.is_ok(),
        "no answer within BUSY_WAIT: {}",
        String::from_utf8_lossy(&out)
    );
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_arriving_late_is_waited_for_and_one_that_stops_is_answered() {
    let tmp = tempfile::tempdir().expect("tmp");
    let ca = write_cert(tmp.path(), "one");
    let s = serve(tmp.path()).await;
    let body = pod_review("late", "ml", "p", 1);
    // The rest of the body comes 300 ms later: the review is judged as usual.
    let answer = slow_call(s.addr, &ca, &body, 10, Some(Duration::from_millis(300))).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains(r#""uid":"late""#), "{answer}");
    // The rest never comes: a well-formed 400-coded review after BUSY_WAIT.
    let started = std::time::Instant::now();
    let answer = slow_call(s.addr, &ca, &body, 10, None).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("not received within"), "{answer}");
    assert!(
        started.elapsed() >= webhook::BUSY_WAIT,
        "answered before BUSY_WAIT: {:?}",
        started.elapsed()
    );
}

#[test]
fn bad_certificate_files_are_named_in_the_error() {
    let tmp = tempfile::tempdir().expect("tmp");
    let (crt, key) = (tmp.path().join("tls.crt"), tmp.path().join("tls.key"));
    let load = |c: &Path, k: &Path| WebhookTls::load(c, k, None, None).map(|_| ());
    assert!(matches!(load(&crt, &key), Err(TlsError::Read { .. })));
    write_cert(tmp.path(), "one");
    std::fs::write(&crt, "not pem").expect("w");
    let e = load(&crt, &key).expect_err("no cert");
    assert!(
        matches!(e, TlsError::Invalid { .. })
            && e.to_string().contains("tls.crt")
            && e.to_string().contains("no PEM certificate"),
        "{e}"
    );
    write_cert(tmp.path(), "one");
    let good_key = std::fs::read(&key).expect("key");
    std::fs::write(&key, "-----BEGIN NOTHING-----\n-----END NOTHING-----\n").expect("w");
    let e = load(&crt, &key).expect_err("no key");
    assert!(
        e.to_string().contains("tls.key") && e.to_string().contains("no usable PEM private key"),
        "{e}"
    );
    // A key from another certificate.
    let other = tempfile::tempdir().expect("tmp");
    write_cert(other.path(), "other");
    std::fs::copy(other.path().join("tls.key"), &key).expect("copy");
    let e = load(&crt, &key).expect_err("mismatched pair");
    assert!(e.to_string().contains("does not belong to the certificate"), "{e}");
    std::fs::write(&key, good_key).expect("w");
    assert!(load(&crt, &key).is_ok());
}
