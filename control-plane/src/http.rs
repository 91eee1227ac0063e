//! The HTTP admin port: `/healthz`, `/readyz`, `/metrics`, and a small JSON API
//! (`/api/v1/status`, `/api/v1/tenants`, `/api/v1/clusters`, `/api/v1/audit`).
//!
//! With TLS the port serves the node's certificate and asks for a client certificate:
//! `/healthz` and `/readyz` answer anyone (probes carry none), everything else only
//! viewers, operators and nodes (see [`crate::auth`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
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
        "/metrics" | "/api/v1/status" | "/api/v1/tenants" | "/api/v1/clusters" | "/api/v1/audit" => path.to_string(),
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
            let who = req.extensions().get::<PeerInfo>().map_or_else(|| "unknown".to_string(), |p| p.addr.to_string());
            let msg = "a client certificate of a viewer, operator or node is required";
            ctx.authz.note("http", &route, "unauthenticated", &who, msg);
            (StatusCode::UNAUTHORIZED, format!("{msg}\n")).into_response()
        }
    }
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
    let ready = ctx.ready_checked().await.is_ok();
    let m = ctx.raft.metrics().borrow().clone();
    let state = ctx.state.read().await;
    Json(serde_json::json!({
        "node_id": ctx.id,
        "role": crate::metrics::role_name(&m),
        "term": m.current_term,
        "leader_id": m.current_leader,
        "last_log_index": m.last_log_index,
        "last_applied_index": m.last_applied.map(|l| l.index),
        "ready": ready,
        "state_time_ms": state.federation.now_ms(),
        "policy": state.federation.policy().map(|p| p.name.clone()),
        "clusters": state.federation.clusters().len(),
        "feature_level": state.feature_level,
        "feature_level_max": ctx.clock.own_feature_max(),
    }))
    .into_response()
}

async fn tenants(State(ctx): State<Arc<NodeCtx>>) -> Response {
    let state = ctx.state.read().await;
    let fed = &state.federation;
    let list: Vec<_> = fed
        .policy()
        .map(|p| p.tenants.iter().filter_map(|t| fed.explain_tenant(&t.name)).collect())
        .unwrap_or_default();
    Json(list).into_response()
}

async fn clusters(State(ctx): State<Arc<NodeCtx>>) -> Response {
    let state = ctx.state.read().await;
    Json(state.federation.clusters()).into_response()
}

async fn audit(State(ctx): State<Arc<NodeCtx>>) -> Response {
    let state = ctx.state.read().await;
    let list: Vec<_> = state.federation.audit().collect();
    Json(list).into_response()
}
