//! Serving an axum router over a [`Listener`](crate::Listener)'s connections with HTTP
//! limits: how long the request head may take to arrive, how many header fields, how
//! large the read buffer. Each request carries the connection's
//! [`PeerInfo`](crate::PeerInfo) as an extension, for the routes' authorization.

use std::io;
use std::time::Duration;

use futures::{Stream, StreamExt};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::sync::watch;

use crate::listen::Conn;

/// HTTP limits of one listener. Each default says why its number.
#[derive(Clone, Debug)]
pub struct HttpLimits {
    /// The request line and headers must arrive within this: a real client sends them
    /// in one go; a client dribbling them holds a connection (slowloris).
    pub header_read_timeout: Duration,
    /// Header fields per request: clients here send about ten.
    pub max_headers: usize,
    /// Largest HTTP/1 read buffer, which bounds the request head: 64 KiB.
    pub max_buf_size: usize,
    /// HTTP/2 streams at once per connection.
    pub max_concurrent_streams: u32,
    /// Largest HTTP/2 header list, in bytes.
    pub max_header_list_size: u32,
    /// How long open connections get to finish when the server stops.
    pub shutdown_grace: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            header_read_timeout: Duration::from_secs(5),
            max_headers: 64,
            max_buf_size: 64 << 10,
            max_concurrent_streams: 256,
            max_header_list_size: 16 << 10,
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// Serves `app` on every connection `incoming` yields until `stop` turns true.
pub async fn serve<S>(incoming: S, app: axum::Router, limits: HttpLimits, mut stop: watch::Receiver<bool>)
where
    S: Stream<Item = io::Result<Conn>> + Send + 'static,
{
    let mut incoming = std::pin::pin!(incoming);
    loop {
        let conn = tokio::select! {
            _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
            c = incoming.next() => match c {
                None => return,
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "connection not accepted");
                    continue;
                }
                Some(Ok(c)) => c,
            },
        };
        let peer = conn.peer().clone();
        let app = app.clone();
        let limits = limits.clone();
        let mut stop = stop.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(peer.clone());
                tower::ServiceExt::oneshot(app.clone(), req)
            });
            let mut builder = auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.header_read_timeout)
                .max_headers(limits.max_headers)
                .max_buf_size(limits.max_buf_size);
            builder
                .http2()
                .timer(TokioTimer::new())
                .max_concurrent_streams(limits.max_concurrent_streams)
                .max_header_list_size(limits.max_header_list_size)
                .keep_alive_interval(Duration::from_secs(30));
            let conn = builder.serve_connection(TokioIo::new(conn), service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "HTTP connection ended with an error");
                    }
                }
                _ = async { let _ = stop.wait_for(|s| *s).await; } => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(limits.shutdown_grace, conn).await;
                }
            }
        });
    }
}

/// The answers of the routes every kvota server has (`/healthz`, `/readyz`,
/// `/metrics`), one wording and one content type for the control plane and the agent.
pub mod answer {
    use axum::http::{header, StatusCode};
    use axum::response::{IntoResponse, Response};

    /// A probe's answer: 200 with `ok` (say, "ok" or "ready"), or 503 with
    /// `<bad>: <why>` (say, "broken" or "not ready"), each a line of text.
    pub fn probe<E: std::fmt::Display>(state: Result<(), E>, ok: &str, bad: &str) -> Response {
        match state {
            Ok(()) => (StatusCode::OK, format!("{ok}\n")).into_response(),
            Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{bad}: {why}\n")).into_response(),
        }
    }

    /// Metrics in the OpenMetrics text format, as Prometheus asks for them.
    pub fn openmetrics(text: String) -> Response {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response()
    }
}
