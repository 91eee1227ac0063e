//! The HTTP admin port: `/healthz`, `/readyz`, `/metrics`, a small JSON API
//! (`/api/v1/status`, `/api/v1/tenants`, `/api/v1/clusters`, `/api/v1/audit`,
//! `/api/v1/explain/tenant`, `/api/v1/decisions`, `/api/v1/usage`, `/api/v1/overview`,
//! `/api/v1/history`; the answers are the types of [`crate::view`], the same JSON the
//! CLI prints with `-o json`) and the dashboard (`/ui/`, its assets embedded
//! in the binary: no CDN, no build step, works offline; see [`crate::view`]).
//!
//! The dashboard's reads follow the leader: `/api/v1/overview` passes
//! [`NodeCtx::read_barrier`] first and says how fresh its answer is.
//!
//! With TLS the port serves the node's certificate and asks for a client certificate:
//! `/healthz` and `/readyz` answer anyone (probes carry none), everything else only
//! viewers, operators and nodes (see [`crate::auth`]).

use std::sync::Arc;

use axum::extract::{Query, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use kvota_tls::http::answer;
use kvota_tls::PeerInfo;

use crate::node::NodeCtx;

/// The admin router over `ctx`.
pub fn router(ctx: Arc<NodeCtx>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/v1/status", get(status))
        .route("/api/v1/tenants", get(tenants))
        .route("/api/v1/clusters", get(clusters))
        .route("/api/v1/audit", get(audit))
        .route("/api/v1/overview", get(overview))
        .route("/api/v1/history", get(history))
        .route("/api/v1/usage", get(usage))
        .route("/api/v1/decisions", get(decisions))
        .route("/api/v1/explain/tenant", get(explain_tenant))
        .route("/", get(|| async { axum::response::Redirect::to("/ui/") }))
        .route("/ui", get(|| async { axum::response::Redirect::to("/ui/") }))
        .route("/ui/", get(|| async { asset("text/html; charset=utf-8", UI_HTML) }))
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", UI_JS) }),
        )
        .route(
            "/ui/app.css",
            get(|| async { asset("text/css; charset=utf-8", UI_CSS) }),
        )
        .layer(axum::middleware::from_fn(no_store))
        .layer(axum::middleware::from_fn_with_state(ctx.clone(), guard))
        .with_state(ctx)
}

/// Probes are open; every other route needs a reader's identity (with TLS).
async fn guard(State(ctx): State<Arc<NodeCtx>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if !ctx.authz.enabled() || path == "/healthz" || path == "/readyz" {
        return next.run(req).await;
    }
    let id = req.extensions().get::<PeerInfo>().and_then(|p| p.identity.clone());
    // Routes are few and fixed: the label set stays bounded (unknown paths are "other").
    let route = match path {
        "/metrics"
        | "/api/v1/status"
        | "/api/v1/tenants"
        | "/api/v1/clusters"
        | "/api/v1/audit"
        | "/api/v1/overview"
        | "/api/v1/history"
        | "/api/v1/usage"
        | "/api/v1/decisions"
        | "/api/v1/explain/tenant"
        | "/"
        | "/ui"
        | "/ui/"
        | "/ui/app.js"
        | "/ui/app.css" => path.to_string(),
        _ => "other".to_string(),
    };
    match id {
        Some(i) if kvota_tls::verify::admits(&i, crate::auth::READ) => next.run(req).await,
        Some(i) => {
            let msg = format!("{i} may not read {route}; a viewer, operator or node certificate may");
            ctx.authz.note("http", &route, "role", &i.to_string(), &msg);
            (StatusCode::FORBIDDEN, format!("{msg}\n")).into_response()
        }
        None => {
            let who = req
                .extensions()
                .get::<PeerInfo>()
                .map_or_else(|| "unknown".to_string(), |p| p.addr.to_string());
            let msg = "a client certificate of a viewer, operator or node is required";
            ctx.authz.note("http", &route, "unauthenticated", &who, msg);
            (StatusCode::UNAUTHORIZED, format!("{msg}\n")).into_response()
        }
    }
}

/// The dashboard's page, script and style sheet, compiled into the binary.
const UI_HTML: &str = include_str!("ui/index.html");
const UI_JS: &str = include_str!("ui/app.js");
const UI_CSS: &str = include_str!("ui/app.css");

/// The dashboard loads nothing from elsewhere and runs no inline script: a tenant or
/// cluster name (or anything else the page shows) can never become code.
const UI_CSP: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; \
                      base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, UI_CSP),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        body,
    )
        .into_response()
}

/// Every answer: not cached (state changes by the second; assets change with the
/// binary), and never sniffed into another type.
async fn no_store(req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let h = res.headers_mut();
    h.insert(header::CACHE_CONTROL, header::HeaderValue::from_static("no-store"));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    res
}

/// Alive: the process answers and its Raft core runs. (Raft trouble that can pass, such
/// as a partition, shows in `/readyz` only, so an orchestrator does not restart a node
/// that is merely cut off; a stopped Raft core cannot pass, and the process exits.)
async fn healthz(State(ctx): State<Arc<NodeCtx>>) -> Response {
    answer::probe(ctx.fatal().map_or(Ok(()), Err), "ok", "broken")
}

/// Ready: part of a quorum with a known leader, and caught up (see `NodeCtx::ready_checked`).
async fn readyz(State(ctx): State<Arc<NodeCtx>>) -> Response {
    answer::probe(ctx.ready_checked().await, "ready", "not ready")
}

async fn metrics(State(ctx): State<Arc<NodeCtx>>) -> Response {
    let raft = ctx.raft.metrics().borrow().clone();
    let state = ctx.state.read().await;
    answer::openmetrics(ctx.metrics.render(&raft, &state.federation))
}

async fn status(State(ctx): State<Arc<NodeCtx>>) -> Response {
    Json(crate::view::StatusView::from(&crate::service::status_reply(&ctx).await)).into_response()
}

/// `/api/v1/overview`: the node, how fresh the read is, and the federation.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Overview {
    /// The node that answered.
    pub node: crate::view::StatusView,
    /// Whether the read followed the leader.
    pub read: crate::node::ReadFreshness,
    /// The federation.
    pub federation: crate::view::FederationView,
}

async fn overview(State(ctx): State<Arc<NodeCtx>>) -> Response {
    let read = ctx.read_barrier().await;
    let node = crate::view::StatusView::from(&crate::service::status_reply(&ctx).await);
    let federation = crate::view::FederationView::of(&ctx.state.read().await.federation);
    Json(Overview { node, read, federation }).into_response()
}

/// Query of `/api/v1/usage`: `since_ms`, `until_ms` (ms since the Unix epoch; default
/// the last 24 hours of the federation's clock), `by` (`tenant`, `cluster`, both
/// comma-separated, or empty for one total; default `tenant`).
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct UsageQuery {
    since_ms: Option<u64>,
    until_ms: Option<u64>,
    by: Option<String>,
}

/// `by` as (tenant, cluster), or why not.
pub fn parse_group_by(by: &str) -> Result<(bool, bool), String> {
    let (mut tenant, mut cluster) = (false, false);
    for part in by.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part {
            "tenant" => tenant = true,
            "cluster" => cluster = true,
            other => {
                return Err(format!(
                    "by: `{}` is not tenant or cluster",
                    other.chars().take(32).collect::<String>()
                ))
            }
        }
    }
    Ok((tenant, cluster))
}

async fn usage(State(ctx): State<Arc<NodeCtx>>, Query(q): Query<UsageQuery>) -> Response {
    let (by_tenant, by_cluster) = match parse_group_by(q.by.as_deref().unwrap_or("tenant")) {
        Ok(b) => b,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response(),
    };
    let state = ctx.state.read().await;
    let fed = &state.federation;
    let until_ms = q.until_ms.unwrap_or_else(|| fed.now_ms());
    let req = kvota_proto::v1::UsageRequest {
        since_ms: q.since_ms.unwrap_or_else(|| until_ms.saturating_sub(24 * 3_600_000)),
        until_ms,
        by_tenant,
        by_cluster,
    };
    match crate::service::usage_reply(fed, &req) {
        Ok(r) => Json(crate::view::UsageView::from(&r)).into_response(),
        Err(s) => (StatusCode::BAD_REQUEST, format!("{}\n", s.message())).into_response(),
    }
}

/// Query of `/api/v1/explain/tenant`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantQuery {
    tenant: String,
}

/// Every number behind a tenant's entitlement (`kvota explain tenant T -o json`).
async fn explain_tenant(State(ctx): State<Arc<NodeCtx>>, Query(q): Query<TenantQuery>) -> Response {
    let state = ctx.state.read().await;
    match state.federation.explain_tenant(&q.tenant) {
        Some(e) => Json(e).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            format!(
                "the policy in force has no tenant `{}`\n",
                q.tenant.chars().take(64).collect::<String>()
            ),
        )
            .into_response(),
    }
}

/// Query of `/api/v1/decisions`: `pod` (`namespace/name`), optionally `cluster`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DecisionsQuery {
    pod: String,
    cluster: Option<String>,
}

async fn decisions(State(ctx): State<Arc<NodeCtx>>, Query(q): Query<DecisionsQuery>) -> Response {
    let read = ctx.read_barrier().await;
    let req = kvota_proto::v1::ExplainPodRequest {
        pod: q.pod,
        cluster: q.cluster.unwrap_or_default(),
    };
    let state = ctx.state.read().await;
    match crate::service::explain_pod_reply(&state.federation, &req) {
        Ok(r) => {
            let mut res = Json(crate::view::DecisionsView::from(&r)).into_response();
            if let Some(note) = read.note {
                if let Ok(v) =
                    header::HeaderValue::from_str(&note.replace(|c: char| !c.is_ascii() || c.is_ascii_control(), " "))
                {
                    res.headers_mut().insert("kvota-stale-read", v);
                }
            }
            res
        }
        Err(s) => (StatusCode::BAD_REQUEST, format!("{}\n", s.message())).into_response(),
    }
}

/// Query of `/api/v1/history`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Filter {
    tenant: Option<String>,
}

async fn history(State(ctx): State<Arc<NodeCtx>>, Query(f): Query<Filter>) -> Response {
    if let Some(t) = &f.tenant {
        if !kvota_fairness::names::is_dns_label(t) {
            return (
                StatusCode::BAD_REQUEST,
                "tenant: not a tenant name (a DNS label of at most 63 characters)\n",
            )
                .into_response();
        }
    }
    let h = ctx
        .history
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .view(f.tenant.as_deref());
    Json(h).into_response()
}

async fn tenants(State(ctx): State<Arc<NodeCtx>>) -> Response {
    let state = ctx.state.read().await;
    Json(crate::view::TenantsView::from(&crate::service::tenants_reply(
        &state.federation,
    )))
    .into_response()
}

async fn clusters(State(ctx): State<Arc<NodeCtx>>) -> Response {
    let state = ctx.state.read().await;
    let list: Vec<crate::view::ClusterView> = crate::service::clusters_reply(&state.federation)
        .clusters
        .iter()
        .map(Into::into)
        .collect();
    Json(list).into_response()
}

/// Query of `/api/v1/audit` (oldest first): `limit` (the newest N), `tenant`, `actor`
/// (e.g. `operator/alice`), `since_ms` (control-plane clock), `kind`; each optional.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditQuery {
    limit: Option<u32>,
    tenant: Option<String>,
    actor: Option<String>,
    since_ms: Option<u64>,
    /// Comma-separated kinds (`lease,policy`; `all`); default: every kind but budgets.
    kind: Option<String>,
}

async fn audit(State(ctx): State<Arc<NodeCtx>>, Query(q): Query<AuditQuery>) -> Response {
    let req = kvota_proto::v1::AuditLogRequest {
        limit: q.limit.unwrap_or(0),
        tenant: q.tenant.unwrap_or_default(),
        actor: q.actor.unwrap_or_default(),
        since_ms: q.since_ms.unwrap_or(0),
        kinds: q
            .kind
            .map(|k| k.split(',').take(16).map(str::to_string).collect())
            .unwrap_or_default(),
    };
    let state = ctx.state.read().await;
    match crate::service::audit_records(&state.federation, &req) {
        Ok(list) => Json(list).into_response(),
        Err(s) => (StatusCode::BAD_REQUEST, format!("{}\n", s.message())).into_response(),
    }
}
