//! The admission webhook over HTTPS: `POST /validate` and `POST /mutate` take
//! `admission.k8s.io/v1` AdmissionReviews; `GET /healthz`, `/readyz` and `/metrics` serve
//! probes and Prometheus on the same port.
//!
//! TLS is rustls with the certificate and key read from PEM files, reread when they
//! change (cert-manager rotates them in place), keeping the old pair if the new one does
//! not load, and saying so in the log and in `kvota_agent_tls_reloads{state="error"}`.
//! Connections are accepted within limits (`kvota_tls::Listener`: per address, in all,
//! handshake and first-byte timeouts) and requests within HTTP limits (header read
//! timeout, header count); who may call which route is in [`WebhookTls`].
//!
//! Every review answers with a well-formed AdmissionReview: an oversized or malformed
//! body gets a 400-coded review (the `uid` echoed when it could be read), and when more
//! than [`MAX_IN_FLIGHT`] reviews are being judged the next waits at most
//! [`BUSY_WAIT`] and is then told the agent is busy, so nothing queues without bound and
//! nothing hangs past the API server's timeout.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kvota_tls::http::answer;
use kvota_tls::http::HttpLimits;
use kvota_tls::{Limits, Listener, PeerInfo, Role, ServerTls, TlsPaths, TlsSource, TrustGroup};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::agent::Agent;
use crate::metrics::AgentMetrics;
use crate::review::{error_reply, judge, parse, Endpoint, Outcome, MAX_REVIEW_BYTES};

/// Reviews judged at once; more wait (briefly) for a slot. Judging takes microseconds
/// under one lock, so this bounds memory (bodies held), not throughput.
pub const MAX_IN_FLIGHT: usize = 512;
/// How long a review waits for a slot before it is answered "busy".
pub const BUSY_WAIT: Duration = Duration::from_secs(2);
/// How long a pod's first denial for lack of budget is held, by default, for the report
/// round it triggers (see [`crate::review::Answer::may_wait`]): an early
/// report and its lease take about one round trip to the control plane, after at most
/// the early-report gap. Well below the webhook's `timeoutSeconds` (5 in the shipped
/// configuration).
pub const DEFAULT_ADMISSION_HOLD: Duration = Duration::from_secs(2);
/// The longest hold `kvota agent --admission-hold-ms` accepts: the API server gives up
/// on the webhook after its `timeoutSeconds` (at most 30; 5 in the shipped manifests).
pub const MAX_ADMISSION_HOLD: Duration = Duration::from_secs(4);
/// Reviews held at once; beyond that a first denial is answered at once.
pub const MAX_HELD: usize = 128;
/// A held review is answered at most this long after it arrived, whatever the hold
/// (time spent waiting for a slot and for the body counts): the API server stops
/// waiting after the webhook's `timeoutSeconds` (5 in the shipped manifests), and a
/// review judged again after that could reserve budget for a pod it never created.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(4);
/// Oversized bodies are read and discarded up to this many bytes before answering.
pub const DRAIN_LIMIT: usize = 4 * MAX_REVIEW_BYTES;

pub use kvota_tls::TlsError;

/// The webhook's TLS: what it presents, and whose client certificates count.
///
/// - `serving`: the webhook's certificate and key (reread when the files change), and,
///   as its CA bundle, the CA that signs the Kubernetes API server's client certificate
///   (`--webhook-client-ca`). With it, `/validate` and `/mutate` answer only clients
///   whose certificate chains to that CA: a forged review from anyone else is refused.
/// - `federation`: the agent's own federation TLS (`--cp-ca/--cp-cert/--cp-key`). With
///   it, `/metrics`, `/explain` and `/reclaims` answer only viewers, operators and
///   nodes of the federation (by the identity in their certificate).
///
/// `/healthz` and `/readyz` answer anyone: kubelet probes carry no certificate.
#[derive(Clone, Debug)]
pub struct WebhookTls {
    /// Certificate, key and (optionally) the API server's client CA.
    pub serving: Arc<TlsSource>,
    /// The federation's CA and this agent's identity, if it has them.
    pub federation: Option<Arc<TlsSource>>,
}

impl WebhookTls {
    /// Loads the webhook's certificate and key, and the API server's client CA if given.
    pub fn load(
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
        federation: Option<Arc<TlsSource>>,
    ) -> Result<WebhookTls, TlsError> {
        let serving = TlsSource::load(TlsPaths {
            ca: client_ca.map(Path::to_path_buf),
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
        })?;
        Ok(WebhookTls { serving, federation })
    }

    /// Whether reviews need the API server's client certificate.
    pub fn verifies_apiserver(&self) -> bool {
        self.serving.paths().ca.is_some()
    }

    fn server_tls(&self) -> ServerTls {
        let mut groups = Vec::new();
        if self.verifies_apiserver() {
            groups.push(TrustGroup {
                label: APISERVER,
                source: self.serving.clone(),
                names_identities: false,
            });
        }
        if let Some(f) = &self.federation {
            groups.push(TrustGroup {
                label: "federation",
                source: f.clone(),
                names_identities: true,
            });
        }
        ServerTls {
            serving: self.serving.clone(),
            groups,
            // Probes carry no certificate: each route decides.
            mandatory: false,
            roles: None,
            alpn: vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        }
    }
}

/// The trust group of the API server's client certificates.
const APISERVER: &str = "apiserver";

/// Connection limits of the webhook port. The API server keeps a pool of connections
/// per instance (HA control planes have a few), so the per-address limit is generous;
/// one other address cannot take more than that, and the total stays far below the
/// process's file limit.
pub fn default_limits() -> Limits {
    Limits {
        max_connections: 4_096,
        max_connections_per_peer: 512,
        ..Limits::default()
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
    apiserver_only: bool,
    federation_only: bool,
    /// How long a first denial may be held (milliseconds; 0: never).
    hold_ms: std::sync::atomic::AtomicU64,
    holds: Semaphore,
}

impl WebhookCtx {
    /// Handlers' shared state, answering anyone on every route (no client
    /// certificates checked: tests, benchmarks, a trusted network).
    pub fn new(agent: Arc<Agent>, metrics: AgentMetrics) -> Arc<WebhookCtx> {
        Arc::new(WebhookCtx {
            agent,
            metrics,
            permits: Semaphore::new(MAX_IN_FLIGHT),
            apiserver_only: false,
            federation_only: false,
            hold_ms: std::sync::atomic::AtomicU64::new(millis(DEFAULT_ADMISSION_HOLD)),
            holds: Semaphore::new(MAX_HELD),
        })
    }

    /// Handlers' shared state, authorizing callers as `tls` says (see [`WebhookTls`]).
    pub fn with_tls(agent: Arc<Agent>, metrics: AgentMetrics, tls: &WebhookTls) -> Arc<WebhookCtx> {
        Arc::new(WebhookCtx {
            agent,
            metrics,
            permits: Semaphore::new(MAX_IN_FLIGHT),
            apiserver_only: tls.verifies_apiserver(),
            federation_only: tls.federation.is_some(),
            hold_ms: std::sync::atomic::AtomicU64::new(millis(DEFAULT_ADMISSION_HOLD)),
            holds: Semaphore::new(MAX_HELD),
        })
    }

    /// Sets how long a pod's first denial for lack of budget is held for the report it
    /// triggers (zero: answered at once; capped at [`MAX_ADMISSION_HOLD`]).
    pub fn set_admission_hold(&self, hold: Duration) {
        self.hold_ms.store(
            millis(hold.min(MAX_ADMISSION_HOLD)),
            std::sync::atomic::Ordering::SeqCst,
        );
    }

    fn admission_hold(&self) -> Duration {
        Duration::from_millis(self.hold_ms.load(std::sync::atomic::Ordering::SeqCst))
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Who may call which route (see [`WebhookTls`]).
async fn guard(
    State(ctx): State<Arc<WebhookCtx>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let peer = req.extensions().get::<PeerInfo>().cloned();
    let path = req.uri().path();
    let refuse = |code: StatusCode, reason: &'static str, msg: String| {
        ctx.metrics.denied(reason);
        tracing::debug!(peer = ?peer.as_ref().map(|p| p.addr), reason, "webhook call refused");
        (code, format!("{msg}\n")).into_response()
    };
    match path {
        "/healthz" | "/readyz" => next.run(req).await,
        "/validate" | "/mutate" if ctx.apiserver_only => {
            if peer.as_ref().is_some_and(|p| p.trusted_by.contains(&APISERVER)) {
                next.run(req).await
            } else {
                refuse(StatusCode::FORBIDDEN, "not_apiserver", "kvota: reviews are accepted only from the Kubernetes API server's client certificate (--webhook-client-ca)".into())
            }
        }
        "/validate" | "/mutate" => next.run(req).await,
        _ if ctx.federation_only => {
            if peer
                .as_ref()
                .is_some_and(|p| p.admits(&[Role::Viewer, Role::Operator, Role::Node]))
            {
                next.run(req).await
            } else {
                refuse(
                    StatusCode::UNAUTHORIZED,
                    "not_viewer",
                    "kvota: a viewer, operator or node certificate of the federation is required".into(),
                )
            }
        }
        _ => next.run(req).await,
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

/// Holds a first denial for lack of budget until the report round it triggered
/// (`mark`) is done, at most `hold`, then judges the same request once more: the new
/// answer if it was judged again, and how long it was held.
async fn hold_for_round(
    ctx: &WebhookCtx,
    bytes: &[u8],
    endpoint: Endpoint,
    span: &tracing::Span,
    mark: u64,
    hold: Duration,
) -> (Option<crate::review::Answer>, Duration) {
    // A first denial for lack of budget made the agent report early; its lease may
    // give the tenant budget here. Hold the answer for that round, then judge the
    // same request once more (see `Answer::may_wait`).
    let Ok(_held) = ctx.holds.try_acquire() else {
        ctx.metrics.admission_hold("full");
        return (None, Duration::ZERO);
    };
    let since = Instant::now();
    let done = ctx.agent.round_after(mark, hold).await;
    let held_for = since.elapsed();
    if !done {
        ctx.metrics.admission_hold("timeout");
        return (None, held_for);
    }
    let again = parse(bytes);
    let answer = span.in_scope(|| {
        let mut st = ctx.agent.state();
        judge(again, endpoint, &mut *st)
    });
    (Some(answer), held_for)
}

/// Counts the answer in the metrics (`judging`: the time spent judging, a hold not
/// included) and fills in the decision's span.
fn record_outcome(
    ctx: &WebhookCtx,
    r: &crate::review::Reviewed,
    rejudged: bool,
    judging: Duration,
    span: &tracing::Span,
    started: Instant,
) {
    if rejudged {
        ctx.metrics.admission_hold(match r.outcome {
            Outcome::Allowed | Outcome::Queued => "admitted",
            Outcome::Denied => "denied",
            // Leadership lost meanwhile (held), the books full (busy): answered so.
            _ => "other",
        });
    }
    // The time spent judging: a hold is counted by its own metric, not here.
    ctx.metrics
        .admission(r.tenant.as_deref(), r.outcome, judging.as_secs_f64());
    if !span.is_disabled() {
        span.record("tenant", r.tenant.as_deref().unwrap_or("-"));
        span.record("outcome", r.outcome.as_str());
        span.in_scope(|| {
            tracing::debug!(
                micros = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                "admission decided"
            )
        });
    }
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
                ctx.metrics
                    .admission(None, Outcome::Busy, started.elapsed().as_secs_f64());
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
    // A span per decision, at debug level: off (one check) unless asked for with
    // RUST_LOG=kvota_member_agent=debug, since this path answers thousands per second.
    let span = tracing::debug_span!("admission", endpoint = ?endpoint, tenant = tracing::field::Empty, outcome = tracing::field::Empty);
    let parsed = parse(&bytes);
    let (mut answer, mark) = span.in_scope(|| {
        let mut st = ctx.agent.state();
        let answer = judge(parsed, endpoint, &mut *st);
        // Read under the same lock: every report round after `mark` carries what the
        // decision recorded.
        (answer, ctx.agent.rounds_taken())
    });
    // No longer than the API server waits, and not while reports fail (the round would
    // not come).
    let hold = ctx
        .admission_hold()
        .min(ANSWER_WITHIN.saturating_sub(started.elapsed()));
    let mut rejudged = false;
    let mut held_for = Duration::ZERO;
    if answer.may_wait() && !hold.is_zero() && ctx.agent.reports_flow() {
        let (again, held) = hold_for_round(&ctx, &bytes, endpoint, &span, mark, hold).await;
        held_for = held;
        if let Some(again) = again {
            answer = again;
            rejudged = true;
        }
    }
    drop(bytes);
    let r = answer.render();
    record_outcome(
        &ctx,
        &r,
        rejudged,
        started.elapsed().saturating_sub(held_for),
        &span,
        started,
    );
    // A review is always answered 200 with the verdict inside, except for bodies that
    // were not reviews at all, which get 400 (the API server logs both the same way).
    let status = if r.outcome == Outcome::Error {
        StatusCode::BAD_REQUEST
    } else {
        StatusCode::OK
    };
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
        return Err(format!(
            "body of {total}+ bytes is larger than {MAX_REVIEW_BYTES} bytes"
        ));
    }
    Ok(single.unwrap_or_else(|| Bytes::from(buf)))
}

async fn validate(State(ctx): State<Arc<WebhookCtx>>, body: Body) -> Response {
    handle(ctx, Endpoint::Validate, body).await
}

async fn mutate(State(ctx): State<Arc<WebhookCtx>>, body: Body) -> Response {
    handle(ctx, Endpoint::Mutate, body).await
}

async fn healthz() -> Response {
    answer::probe(Ok::<(), &str>(()), "ok", "broken")
}

async fn readyz(State(ctx): State<Arc<WebhookCtx>>) -> Response {
    answer::probe(ctx.agent.state().ready(), "ready", "not ready")
}

async fn metrics(State(ctx): State<Arc<WebhookCtx>>) -> Response {
    answer::openmetrics(ctx.metrics.render(&ctx.agent))
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
async fn explain(
    State(ctx): State<Arc<WebhookCtx>>,
    q: Result<axum::extract::Query<ExplainQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let err = |code: StatusCode, msg: String| (code, axum::Json(serde_json::json!({ "error": msg }))).into_response();
    let Some(pod) = q.ok().and_then(|q| q.0.pod).filter(|p| !p.is_empty()) else {
        return err(
            StatusCode::BAD_REQUEST,
            "ask for one pod: /explain?pod=NAMESPACE/NAME".into(),
        );
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
        .layer(axum::middleware::from_fn_with_state(ctx.clone(), guard))
        .with_state(ctx)
}

/// Serves `app` over TLS on `listener`, within `limits`, until `shutdown` turns true;
/// rereads the certificate files when they change.
pub async fn serve_tls(
    listener: TcpListener,
    tls: WebhookTls,
    app: Router,
    metrics: AgentMetrics,
    limits: Limits,
    shutdown: watch::Receiver<bool>,
) {
    let (m, serving) = (metrics.clone(), tls.serving.clone());
    m.certificate("served", &serving);
    tokio::spawn(tls.serving.clone().watch(
        "webhook certificate",
        move |ok| {
            m.tls_reload(ok);
            m.certificate("served", &serving);
        },
        shutdown.clone(),
    ));
    let m = metrics.clone();
    let on_refusal: kvota_tls::listen::OnRefusal = Arc::new(move |_, why| m.connection_refused(why.as_str()));
    let listener = Listener::new("webhook", listener, Some(tls.server_tls()), limits, on_refusal);
    kvota_tls::http::serve(
        listener.incoming(shutdown.clone()),
        app,
        HttpLimits::default(),
        shutdown,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvota_fairness::names::ClusterName;
    use proptest::prelude::*;

    fn ctx() -> (tempfile::TempDir, Arc<WebhookCtx>) {
        let dir = tempfile::tempdir().expect("tmp");
        let agent = Agent::open(
            &ClusterName::from_static("east"),
            [("nvidia.com/gpu".to_string(), 8_000)].into(),
            dir.path(),
            &["127.0.0.1:9".to_string()],
        )
        .expect("agent");
        (dir, WebhookCtx::new(Arc::new(agent), AgentMetrics::new()))
    }

    /// At most [`MAX_HELD`] first denials are held at once: with every slot taken by a
    /// review waiting for a report round that never comes, the next first denials are
    /// answered at once (counted as `full`), and the held ones get their denial when the
    /// hold runs out (counted as `timeout`).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn no_more_than_max_held_reviews_are_held_at_once() {
        use kvota_fairness::lease::{Lease, TenantBudget};
        use kvota_fairness::names::TenantName;
        let dir = tempfile::tempdir().expect("tmp");
        let agent = Arc::new(
            Agent::open(
                &ClusterName::from_static("east"),
                [("nvidia.com/gpu".to_string(), 8_000)].into(),
                dir.path(),
                &["127.0.0.1:9".to_string()],
            )
            .expect("agent"),
        );
        {
            let mut st = agent.state();
            let policy = "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: t}\nspec:\n  tenants:\n  - {name: training, weight: 1, namespaces: [ml]}\n";
            st.set_policy(kvota_fairness::policy::Policy::from_yaml(policy).expect("policy"));
            let budgets = [(
                TenantName::from_static("training"),
                TenantBudget {
                    budget: 1_000,
                    fallback: 0,
                    entitlement: 1_000,
                    borrow: 0,
                    ceiling: 0,
                },
            )]
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
        // Reports seem to flow, but no round ever completes: every held review times out.
        agent.pretend_reports_flow();
        let ctx = WebhookCtx::new(agent, AgentMetrics::new());
        let hold = Duration::from_millis(1_500);
        ctx.set_admission_hold(hold);
        let app = router(ctx);
        let extra = 12;
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..MAX_HELD + extra {
            let review = serde_json::json!({
                "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "request": {"uid": format!("u{i}"), "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": "ml", "name": format!("p{i}"), "operation": "CREATE",
                    "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": format!("p{i}"), "namespace": "ml"},
                        "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}}}
            });
            let req = axum::http::Request::post("/validate")
                .header("content-type", "application/json")
                .body(Body::from(review.to_string()))
                .expect("request");
            let app = app.clone();
            calls.spawn(async move {
                let started = Instant::now();
                let resp = tower::ServiceExt::oneshot(app, req).await.expect("infallible");
                let body = axum::body::to_bytes(resp.into_body(), 1 << 20).await.expect("body");
                let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
                (v["response"]["allowed"] == false, started.elapsed())
            });
        }
        let (mut held, mut at_once) = (0, 0);
        while let Some(r) = calls.join_next().await {
            let (denied, took) = r.expect("task");
            assert!(denied, "a 2-GPU pod over a 1-GPU budget is denied");
            if took >= hold - Duration::from_millis(100) {
                held += 1;
            } else {
                at_once += 1;
            }
        }
        assert_eq!(
            (held, at_once),
            (MAX_HELD, extra),
            "held for the round, answered at once"
        );
        let req = axum::http::Request::get("/metrics")
            .body(Body::empty())
            .expect("request");
        let resp = tower::ServiceExt::oneshot(app, req).await.expect("infallible");
        let m =
            String::from_utf8_lossy(&axum::body::to_bytes(resp.into_body(), 1 << 20).await.expect("body")).to_string();
        assert!(
            m.contains(&format!("kvota_agent_admission_holds_total{{reason=\"full\"}} {extra}")),
            "{m}"
        );
        assert!(
            m.contains(&format!(
                "kvota_agent_admission_holds_total{{reason=\"timeout\"}} {MAX_HELD}"
            )),
            "{m}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
        /// Any path and query string on the read routes: a status code, never a panic;
        /// `/explain` answers 400 without a pod and 404 for one it never judged.
        #[test]
        fn any_query_gets_an_answer(path in prop_oneof![Just("/explain"), Just("/reclaims"), Just("/metrics"), Just("/healthz"), Just("/nope")],
                                    query in "[ -~]{0,60}") {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
            let (_dir, ctx) = ctx();
            let app = router(ctx);
            let encoded: String = query.bytes().map(|b| if b.is_ascii_alphanumeric() || b"=&/%.-_".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") }).collect();
            let Ok(req) = axum::http::Request::get(format!("{path}?{encoded}")).body(Body::empty()) else { return Ok(()) };
            let resp = rt.block_on(tower::ServiceExt::oneshot(app, req)).expect("infallible");
            let code = resp.status().as_u16();
            prop_assert!(matches!(code, 200 | 400 | 404 | 405), "{path}?{encoded}: {code}");
            if path == "/explain" && !encoded.contains("pod=") {
                prop_assert_eq!(code, 400);
            }
        }
    }
}
