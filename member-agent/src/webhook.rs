//! The admission webhook over HTTPS: `POST /validate` and `POST /mutate` take
//! `admission.k8s.io/v1` AdmissionReviews; `GET /healthz`, `/readyz` and `/metrics` serve
//! probes and Prometheus on the same port.
//!
//! TLS is rustls with the certificate and key read from PEM files; [`TlsFiles`] rereads
//! them when they change (cert-manager rotates them in place), keeping the old pair
//! if the new one does not load, and says so in the log and in
//! `kvota_agent_tls_reloads{state="error"}`.
//!
//! Every review answers with a well-formed AdmissionReview: an oversized or malformed
//! body gets a 400-coded review (the `uid` echoed when it could be read), and when more
//! than [`MAX_IN_FLIGHT`] reviews are being judged the next waits at most
//! [`BUSY_WAIT`] and is then told the agent is busy, so nothing queues without bound and
//! nothing hangs past the API server's timeout.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::agent::Agent;
use crate::metrics::AgentMetrics;
use crate::review::{error_reply, judge, parse, Endpoint, MAX_REVIEW_BYTES};

/// Reviews judged at once; more wait (briefly) for a slot. Judging takes microseconds
/// under one lock, so this bounds memory (bodies held), not throughput.
pub const MAX_IN_FLIGHT: usize = 512;
/// How long a review waits for a slot before it is answered "busy".
pub const BUSY_WAIT: Duration = Duration::from_secs(2);
/// Oversized bodies are read and discarded up to this many bytes before answering.
pub const DRAIN_LIMIT: usize = 4 * MAX_REVIEW_BYTES;
/// A TLS handshake that takes longer than this is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the certificate files are checked for changes.
pub const RELOAD_CHECK: Duration = Duration::from_secs(2);

/// A problem with the certificate or key.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("read {path}: {source}")]
    Read {
        /// File.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds no PEM certificate.
    #[error("{0}: no PEM certificate (expected -----BEGIN CERTIFICATE-----)")]
    NoCertificate(PathBuf),
    /// The file holds no PEM private key.
    #[error("{0}: no PEM private key (expected PKCS#8, PKCS#1 or SEC1)")]
    NoKey(PathBuf),
    /// rustls refused the pair.
    #[error("certificate {cert} with key {key}: {why}")]
    Rejected {
        /// Certificate file.
        cert: PathBuf,
        /// Key file.
        key: PathBuf,
        /// rustls's reason (e.g. the key does not match the certificate).
        why: String,
    },
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.to_path_buf(), source })
}

/// Loads a certificate chain and key into a rustls server configuration (HTTP/1.1 and
/// HTTP/2 by ALPN).
pub fn load_tls(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let cert_pem = read(cert)?;
    let key_pem = read(key)?;
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&cert_pem).filter_map(Result::ok).collect();
    if chain.is_empty() {
        return Err(TlsError::NoCertificate(cert.to_path_buf()));
    }
    let key_der = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::NoKey(key.to_path_buf()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key_der))
        .map_err(|e| TlsError::Rejected { cert: cert.to_path_buf(), key: key.to_path_buf(), why: e.to_string() })?;
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The certificate and key files, and the configuration last loaded from them.
#[derive(Debug)]
pub struct TlsFiles {
    cert: PathBuf,
    key: PathBuf,
    current: RwLock<(Arc<rustls::ServerConfig>, Option<SystemTime>, Option<SystemTime>)>,
}

fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

impl TlsFiles {
    /// Loads both files; an error here is fatal (the agent cannot serve without them).
    pub fn load(cert: &Path, key: &Path) -> Result<TlsFiles, TlsError> {
        let (c, k) = (mtime(cert), mtime(key));
        let cfg = load_tls(cert, key)?;
        Ok(TlsFiles { cert: cert.to_path_buf(), key: key.to_path_buf(), current: RwLock::new((cfg, c, k)) })
    }

    /// The configuration to use for the next connection.
    pub fn config(&self) -> Arc<rustls::ServerConfig> {
        self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner).0.clone()
    }

    /// Reloads if either file changed: `Ok(true)` reloaded, `Ok(false)` unchanged, `Err`
    /// the new files did not load (the previous pair stays in use; retried when the files
    /// change again).
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let (c, k) = (mtime(&self.cert), mtime(&self.key));
        {
            let cur = self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            if cur.1 == c && cur.2 == k {
                return Ok(false);
            }
        }
        let loaded = load_tls(&self.cert, &self.key);
        let mut cur = self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Remember these times either way: a broken pair is reported once, not every check.
        cur.1 = c;
        cur.2 = k;
        cur.0 = loaded?;
        Ok(true)
    }
}

/// What the handlers share.
#[derive(Debug)]
pub struct WebhookCtx {
    /// The agent whose state judges.
    pub agent: Arc<Agent>,
    /// Its metrics.
    pub metrics: AgentMetrics,
    permits: Semaphore,
}

impl WebhookCtx {
    /// Handlers' shared state.
    pub fn new(agent: Arc<Agent>, metrics: AgentMetrics) -> Arc<WebhookCtx> {
        Arc::new(WebhookCtx { agent, metrics, permits: Semaphore::new(MAX_IN_FLIGHT) })
    }
}

fn review_response(status: StatusCode, body: Vec<u8>) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
}

fn busy_reply() -> Vec<u8> {
    let v = serde_json::json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {"uid": "", "allowed": false, "status": {"code": 429, "message": "kvota: the agent is busy; retry"}}
    });
    serde_json::to_vec(&v).unwrap_or_default()
}

async fn handle(ctx: Arc<WebhookCtx>, endpoint: Endpoint, body: Body) -> Response {
    let started = Instant::now();
    // A free slot is taken at once (no timer armed); only a full agent waits, at most
    // BUSY_WAIT, in the semaphore's queue (while it has waiters, try_acquire fails).
    let _permit = match ctx.permits.try_acquire() {
        Ok(permit) => permit,
        Err(_) => match tokio::time::timeout(BUSY_WAIT, ctx.permits.acquire()).await {
            Ok(Ok(permit)) => permit,
            _ => {
                ctx.metrics.admission(None, "busy", started.elapsed().as_secs_f64());
                return review_response(StatusCode::TOO_MANY_REQUESTS, busy_reply());
            }
        },
    };
    let bytes = match read_body(body).await {
        Ok(b) => b,
        Err(why) => {
            let r = error_reply("", &why);
            ctx.metrics.admission(None, r.outcome, started.elapsed().as_secs_f64());
            return review_response(StatusCode::PAYLOAD_TOO_LARGE, r.body);
        }
    };
    // Parse outside the lock; only the decision and its effect hold it; the answer is
    // written after.
    let parsed = parse(&bytes);
    drop(bytes);
    let answer = {
        let mut st = ctx.agent.state();
        judge(parsed, endpoint, &mut *st)
    };
    let r = answer.render();
    ctx.metrics.admission(r.tenant.as_deref(), r.outcome, started.elapsed().as_secs_f64());
    if r.outcome == "denied" || r.outcome == "error" {
        tracing::debug!(tenant = ?r.tenant, outcome = r.outcome, "admission review");
    }
    // A review is always answered 200 with the verdict inside, except for bodies that
    // were not reviews at all, which get 400 (the API server logs both the same way).
    let status = if r.outcome == "error" { StatusCode::BAD_REQUEST } else { StatusCode::OK };
    review_response(status, r.body)
}

/// Reads at most [`MAX_REVIEW_BYTES`]. A larger body is read on and discarded up to
/// [`DRAIN_LIMIT`] (for [`BUSY_WAIT`] at most) so that the client, still sending, gets
/// the answer instead of a reset connection; beyond that the connection is dropped.
async fn read_body(body: Body) -> Result<Bytes, String> {
    use futures::FutureExt as _;
    use http_body_util::BodyExt as _;
    let mut body = body;
    // A body in one frame (the usual case) is kept as received; only a body in several
    // frames is copied into one buffer.
    let mut single: Option<Bytes> = None;
    let mut buf: Vec<u8> = Vec::new();
    let mut total = 0usize;
    let deadline = Instant::now() + BUSY_WAIT;
    loop {
        // A frame already received is taken without arming a timer.
        let next = match body.frame().now_or_never() {
            Some(next) => next,
            None => match tokio::time::timeout_at(deadline.into(), body.frame()).await {
                Err(_) => return Err(format!("body not received within {BUSY_WAIT:?}")),
                Ok(next) => next,
            },
        };
        let frame = match next {
            None => break,
            Some(Err(e)) => return Err(format!("body unreadable: {e}")),
            Some(Ok(f)) => f,
        };
        let Ok(data) = frame.into_data() else { continue };
        total = total.saturating_add(data.len());
        if total <= MAX_REVIEW_BYTES {
            if single.is_none() && buf.is_empty() {
                single = Some(data);
            } else {
                if let Some(first) = single.take() {
                    buf.extend_from_slice(&first);
                }
                buf.extend_from_slice(&data);
            }
        } else if total > DRAIN_LIMIT {
            break;
        }
    }
    if total > MAX_REVIEW_BYTES {
        return Err(format!("body of {total}+ bytes is larger than {MAX_REVIEW_BYTES} bytes"));
    }
    Ok(single.unwrap_or_else(|| Bytes::from(buf)))
}

async fn validate(State(ctx): State<Arc<WebhookCtx>>, body: Body) -> Response {
    handle(ctx, Endpoint::Validate, body).await
}

async fn mutate(State(ctx): State<Arc<WebhookCtx>>, body: Body) -> Response {
    handle(ctx, Endpoint::Mutate, body).await
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(ctx): State<Arc<WebhookCtx>>) -> Response {
    match ctx.agent.state().ready() {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n")).into_response(),
    }
}

async fn metrics(State(ctx): State<Arc<WebhookCtx>>) -> Response {
    let text = ctx.metrics.render(&ctx.agent);
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text).into_response()
}

/// The reclaim audit log (newest last): every eviction this agent attempted, who was
/// starved, by how much, and why that victim. The control plane keeps the reported ones
/// too (`kvota audit`, `kvota explain tenant`).
async fn reclaims(State(ctx): State<Arc<WebhookCtx>>) -> Response {
    let records: Vec<crate::state::ReclaimRecord> = ctx.agent.state().reclaim_audit().cloned().collect();
    axum::Json(records).into_response()
}

/// `?pod=namespace/name` for `/explain`.
#[derive(serde::Deserialize)]
struct ExplainQuery {
    pod: Option<String>,
}

/// The last admission decision about one pod, with its numbers and where the pod stands
/// now (what `kvota explain pod NAMESPACE/NAME --agent URL` prints).
async fn explain(State(ctx): State<Arc<WebhookCtx>>, q: Result<axum::extract::Query<ExplainQuery>, axum::extract::rejection::QueryRejection>) -> Response {
    let err = |code: StatusCode, msg: String| (code, axum::Json(serde_json::json!({ "error": msg }))).into_response();
    let Some(pod) = q.ok().and_then(|q| q.0.pod).filter(|p| !p.is_empty()) else {
        return err(StatusCode::BAD_REQUEST, "ask for one pod: /explain?pod=NAMESPACE/NAME".into());
    };
    let found = ctx.agent.state().explain_pod(&pod);
    match found {
        Some(e) => axum::Json(e).into_response(),
        None => err(
            StatusCode::NOT_FOUND,
            format!(
                "this agent has not judged pod {pod} among its last {} decisions (pods without GPUs and dry runs are not judged; a pod created with generateName is known by its generated name)",
                crate::state::DECISIONS_KEPT
            ),
        ),
    }
}

/// The webhook's routes.
pub fn router(ctx: Arc<WebhookCtx>) -> Router {
    Router::new()
        .route("/validate", post(validate))
        .route("/mutate", post(mutate))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/reclaims", get(reclaims))
        .route("/explain", get(explain))
        .with_state(ctx)
}

/// Serves `app` over TLS on `listener` until `shutdown` turns true; rereads the
/// certificate files every [`RELOAD_CHECK`].
pub async fn serve_tls(
    listener: TcpListener,
    tls: Arc<TlsFiles>,
    app: Router,
    metrics: AgentMetrics,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut check = tokio::time::interval(RELOAD_CHECK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let (stream, peer): (tokio::net::TcpStream, SocketAddr) = tokio::select! {
            _ = async { let _ = shutdown.wait_for(|s| *s).await; } => return,
            _ = check.tick() => {
                match tls.reload_if_changed() {
                    Ok(true) => { metrics.tls_reload(true); tracing::info!("webhook certificate reloaded"); }
                    Ok(false) => {}
                    Err(e) => { metrics.tls_reload(false); tracing::error!(error = %e, "new webhook certificate not loaded; still serving the previous one"); }
                }
                continue;
            }
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.config());
        let app = app.clone();
        let mut stop = shutdown.clone();
        tokio::spawn(async move {
            let tls_stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let service = TowerToHyperService::new(app);
            let builder = auto::Builder::new(TokioExecutor::new());
            let conn = builder.serve_connection(TokioIo::new(tls_stream), service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(%peer, error = %e, "webhook connection ended with an error");
                    }
                }
                _ = async { let _ = stop.wait_for(|s| *s).await; } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(Duration::from_secs(5), conn).await;
                }
            }
        });
    }
}
