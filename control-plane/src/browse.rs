//! `Admin.Browse`: the dashboard's HTTP answers through the gRPC port, for
//! `kvota dashboard` (a local proxy in the manner of `kubectl proxy`).
//!
//! The request runs through the same router as the HTTP port ([`crate::http::router`]),
//! with the gRPC caller's identity, so what a viewer may read is decided in one place.
//! Only `GET` of the dashboard's paths: `/`, `/ui...` and `/api/v1/...`.

use std::sync::Arc;
use std::time::Duration;

use kvota_proto::v1;
use kvota_tls::PeerInfo;
use tonic::{Request, Status};
use tower::ServiceExt as _;

use crate::node::NodeCtx;

/// Longest path and query taken: the dashboard's longest (a pod search) is under 400.
pub const MAX_PATH: usize = 2_048;
/// Largest answer sent: an overview of 10,000 tenants in 1,000 clusters' budgets fits.
pub const MAX_BODY: usize = 64 << 20;
/// How long one answer may take (the overview waits up to 2 s to follow the leader).
const TIMEOUT: Duration = Duration::from_secs(10);
/// Headers of the HTTP answer passed on: what the page's safety and the dashboard's
/// reads rely on.
const HEADERS: [&str; 6] = [
    "content-security-policy",
    "x-frame-options",
    "referrer-policy",
    "cache-control",
    "location",
    "kvota-stale-read",
];

/// Whether `path` is one the dashboard reads.
fn allowed(path: &str) -> bool {
    let (route, _) = path.split_once('?').unwrap_or((path, ""));
    let shaped = path.len() <= MAX_PATH && path.bytes().all(|b| b.is_ascii_graphic());
    shaped && (route == "/" || route == "/ui" || route.starts_with("/ui/") || route.starts_with("/api/v1/"))
}

/// Answers `request` as the HTTP port answers a GET of its path.
pub async fn answer(ctx: &Arc<NodeCtx>, request: Request<v1::BrowseRequest>) -> Result<v1::BrowseReply, Status> {
    let peer = request.extensions().get::<PeerInfo>().cloned();
    let path = request.into_inner().path;
    if !allowed(&path) {
        return Err(Status::invalid_argument(format!(
            "path `{}`: the dashboard's paths are /ui/... and /api/v1/... (at most {MAX_PATH} bytes)",
            path.chars().take(64).collect::<String>()
        )));
    }
    let mut req = axum::http::Request::get(&path)
        .body(axum::body::Body::empty())
        .map_err(|e| Status::invalid_argument(format!("path: {e}")))?;
    if let Some(p) = peer {
        req.extensions_mut().insert(p);
    }
    let res = tokio::time::timeout(TIMEOUT, crate::http::router(ctx.clone()).oneshot(req))
        .await
        .map_err(|_| Status::deadline_exceeded(format!("{path} took more than {} s", TIMEOUT.as_secs())))?
        .map_err(|e: std::convert::Infallible| Status::internal(e.to_string()))?;
    let (parts, body) = res.into_parts();
    let body = axum::body::to_bytes(body, MAX_BODY)
        .await
        .map_err(|e| Status::resource_exhausted(format!("{path}: the answer is larger than {MAX_BODY} bytes: {e}")))?;
    let text = |v: &axum::http::HeaderValue| v.to_str().ok().map(str::to_string);
    Ok(v1::BrowseReply {
        status: u32::from(parts.status.as_u16()),
        content_type: parts
            .headers
            .get(axum::http::header::CONTENT_TYPE)
            .and_then(text)
            .unwrap_or_default(),
        body: body.to_vec(),
        headers: HEADERS
            .iter()
            .filter_map(|h| Some((h.to_string(), parts.headers.get(*h).and_then(text)?)))
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_dashboards_paths_are_browsed() {
        for ok in [
            "/",
            "/ui",
            "/ui/",
            "/ui/app.js",
            "/api/v1/overview",
            "/api/v1/audit?limit=50&kind=lease",
        ] {
            assert!(allowed(ok), "{ok}");
        }
        for bad in [
            "/metrics",
            "/healthz",
            "",
            "api/v1/x",
            "/api/v1/x y",
            "/uix",
            "/api/v2/x",
            "/api/v1/\u{7f}",
        ] {
            assert!(!allowed(bad), "{bad}");
        }
        assert!(!allowed(&format!("/api/v1/{}", "a".repeat(MAX_PATH))));
    }
}
