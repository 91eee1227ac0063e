//! `kvota dashboard`: the dashboard on this machine, in the manner of `kubectl proxy`
//! and `linkerd viz dashboard`.
//!
//! A local HTTP server on a loopback address only, which answers each `GET` of the
//! dashboard's paths by asking the control plane over its gRPC port (`Admin.Browse`)
//! with the operator's or viewer's certificate: the same `--cp`, `--cp-ca`,
//! `--cp-cert`, `--cp-key` (and `KVOTA_*` variables) as every other command. So the
//! browser needs no client certificate and no name the node's certificate carries, and
//! one `kubectl port-forward` of the gRPC port is enough.
//!
//! Only requests that name this server by a loopback host (`127.0.0.1:PORT`,
//! `localhost:PORT`, `[::1]:PORT`) are answered: a web page elsewhere cannot reach it
//! through a DNS name it points at 127.0.0.1 (DNS rebinding), as `kubectl proxy`'s
//! `--accept-hosts` guards.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use kvota_client::client::Client;
use kvota_proto::v1;

/// Largest answer taken from the control plane (as `Admin.Browse` sends at most).
const MAX_ANSWER: usize = kvota_control_plane::browse::MAX_BODY;

/// `kvota dashboard`'s arguments.
#[derive(Debug, clap::Args)]
pub struct DashboardArgs {
    /// Where to serve the dashboard: a loopback address only (127.0.0.1, ::1); port 0
    /// picks a free one.
    #[arg(long, default_value = "127.0.0.1:7480", env = "KVOTA_DASHBOARD_LISTEN")]
    pub listen: SocketAddr,
    /// Open the dashboard in this machine's browser (`$BROWSER`, `xdg-open` or `open`).
    #[arg(long)]
    pub open: bool,
}

struct Proxy {
    client: Client,
    /// The port served: requests must name it with a loopback host.
    port: u16,
}

/// Runs `kvota dashboard` until interrupted.
pub fn run(a: &DashboardArgs, cp: &crate::admin_cmd::Cp) -> Result<std::process::ExitCode> {
    if !a.listen.ip().is_loopback() {
        bail!(
            "--listen {}: the dashboard proxy serves on a loopback address only (127.0.0.1 or ::1); it reads the federation with your certificate, so anyone who can reach it reads as you. To share the dashboard, give others a viewer certificate (`kvota certs issue --role viewer`)",
            a.listen
        );
    }
    let client = Client::with_tls(&cp.addrs, cp.tls()?).map_err(|e| anyhow::anyhow!("{}", e.message()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("start the async runtime")?;
    rt.block_on(serve(a, cp, client))
}

async fn serve(a: &DashboardArgs, cp: &crate::admin_cmd::Cp, client: Client) -> Result<std::process::ExitCode> {
    // The control plane must answer before the URL is printed: a wrong --cp or
    // certificate is said here, not as an error page in the browser.
    let first = client
        .call(|ch| async move {
            Ok(Client::admin(ch)
                .browse(v1::BrowseRequest {
                    path: "/api/v1/status".into(),
                })
                .await?
                .into_inner())
        })
        .await
        .map_err(|e| crate::admin_cmd::status_err(cp, e))?;
    if first.status != 200 {
        bail!(
            "the control plane refused the dashboard's reads (HTTP {}): {}",
            first.status,
            String::from_utf8_lossy(&first.body).trim()
        );
    }
    let listener = tokio::net::TcpListener::bind(a.listen)
        .await
        .with_context(|| format!("listen on {}", a.listen))?;
    let local = listener.local_addr().context("the address served")?;
    let proxy = Arc::new(Proxy {
        client,
        port: local.port(),
    });
    let app = axum::Router::new().fallback(forward).with_state(proxy);
    let url = format!("http://{local}/ui/");
    // Said once; a server goes on if nobody reads its output any more (`out!` would
    // end the process on a closed pipe).
    {
        use std::io::Write as _;
        let mut o = std::io::stdout();
        let _ = writeln!(o, "kvota dashboard: {url}");
        let _ = writeln!(o, "  reading the federation at {} (Ctrl-C to stop)", cp.addrs.join(","));
        let _ = o.flush();
    }
    if a.open {
        open_browser(&url);
    }
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("serve the dashboard")?;
    Ok(std::process::ExitCode::SUCCESS)
}

/// Whether `host` (a request's Host header) names this server by a loopback name.
fn loopback_host(host: &str, port: u16) -> bool {
    let (name, p) = match host.rsplit_once(':') {
        Some((n, p)) => (n, p.parse::<u16>().ok()),
        None => (host, None),
    };
    let name = name.trim_start_matches('[').trim_end_matches(']');
    p == Some(port) && (name == "localhost" || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback()))
}

/// Answers one request through `Admin.Browse`.
async fn forward(State(proxy): State<Arc<Proxy>>, req: Request) -> Response {
    if req.method() != Method::GET {
        return (StatusCode::METHOD_NOT_ALLOWED, "the dashboard only reads\n").into_response();
    }
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    if !loopback_host(host, proxy.port) {
        return (
            StatusCode::FORBIDDEN,
            "kvota dashboard answers requests to 127.0.0.1, localhost or [::1] only\n",
        )
            .into_response();
    }
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
    let answer = proxy
        .client
        .call(|ch| {
            let path = path.clone();
            async move {
                Ok(Client::admin(ch)
                    .max_decoding_message_size(MAX_ANSWER + 4096)
                    .browse(v1::BrowseRequest { path })
                    .await?
                    .into_inner())
            }
        })
        .await;
    match answer {
        Ok(a) => reply(a),
        Err(s) => (
            StatusCode::BAD_GATEWAY,
            format!("the control plane did not answer {path}: {}\n", s.message()),
        )
            .into_response(),
    }
}

/// The control plane's answer as an HTTP response, with its headers and no caching.
fn reply(a: v1::BrowseReply) -> Response {
    let status = u16::try_from(a.status)
        .ok()
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::BAD_GATEWAY);
    let mut res = (status, a.body).into_response();
    let h = res.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&a.content_type) {
        h.insert(header::CONTENT_TYPE, v);
    }
    for (k, v) in &a.headers {
        if let (Ok(k), Ok(v)) = (header::HeaderName::from_bytes(k.as_bytes()), HeaderValue::from_str(v)) {
            h.insert(k, v);
        }
    }
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    res
}

/// Opens `url` in a browser when this machine has one (`$BROWSER`, `xdg-open`, `open`);
/// says so when it has none.
fn open_browser(url: &str) {
    let candidates: Vec<String> = std::env::var("BROWSER")
        .ok()
        .into_iter()
        .chain(["xdg-open".to_string(), "open".to_string()])
        .collect();
    for c in candidates {
        if std::process::Command::new(&c)
            .arg(url)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .is_ok()
        {
            return;
        }
    }
    eprintln!("kvota: no browser found on this machine (set $BROWSER); open {url} yourself");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_names_of_this_port_are_answered() {
        for ok in ["127.0.0.1:7480", "localhost:7480", "[::1]:7480", "127.0.0.2:7480"] {
            assert!(loopback_host(ok, 7480), "{ok}");
        }
        for bad in [
            "127.0.0.1:80",
            "127.0.0.1",
            "evil.example:7480",
            "localhost.evil.example:7480",
            "",
            "10.0.0.1:7480",
        ] {
            assert!(!loopback_host(bad, 7480), "{bad}");
        }
    }
}
