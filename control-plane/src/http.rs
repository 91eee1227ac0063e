//! The HTTP admin port: `/healthz`, `/readyz`, `/metrics`, and a small JSON API
//! (`/api/v1/status`, `/api/v1/tenants`, `/api/v1/clusters`, `/api/v1/audit`).

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

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
        .with_state(ctx)
}

/// Alive: the process answers. (Raft trouble shows in `/readyz`, not here, so an
/// orchestrator does not restart a node that is merely partitioned.)
async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready: part of a quorum with a known leader, and caught up (see `NodeCtx::ready_checked`).
async fn readyz(State(ctx): State<Arc<NodeCtx>>) -> Response {
    match ctx.ready_checked().await {
        Ok(()) => (StatusCode::OK, "ready\n").into_response(),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n")).into_response(),
    }
}

async fn metrics(State(ctx): State<Arc<NodeCtx>>) -> Response {
    let raft = ctx.raft.metrics().borrow().clone();
    let state = ctx.state.read().await;
    let body = ctx.metrics.render(&raft, &state.federation);
    (
        [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
        body,
    )
        .into_response()
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
