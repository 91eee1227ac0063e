//! Clients the test uses to talk to the processes: HTTPS to an agent's webhook (as a
//! Kubernetes API server would, one kept-alive HTTP/1.1 connection), plain HTTP to a
//! server's admin port, and a reader for the Prometheus text format.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use rustls_pki_types::{CertificateDer, ServerName};
use tokio::sync::Mutex;

/// Every request of the test has a deadline: a paused or cut process must show up as a
/// failed check, never as a hung test. The API server's webhook timeout is 10 s; an
/// agent answers in microseconds, so 3 s is generous.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(3);

/// HTTPS to one agent's webhook.
#[derive(Clone)]
pub struct Webhook {
    addr: String,
    tls: tokio_rustls::TlsConnector,
    conn: Arc<Mutex<Option<SendRequest<Full<Bytes>>>>>,
}

impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Webhook({})", self.addr)
    }
}

impl Webhook {
    /// A client for `addr` (`host:port`) trusting the self-signed `ca` (DER), whose
    /// certificate names `localhost`.
    pub fn new(addr: String, ca: &[u8]) -> Result<Webhook, String> {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from(ca.to_vec()))
            .map_err(|e| format!("trust the test CA: {e}"))?;
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS versions: {e}"))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(Webhook {
            addr,
            tls: tokio_rustls::TlsConnector::from(Arc::new(cfg)),
            conn: Arc::new(Mutex::new(None)),
        })
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, String> {
        let tcp = tokio::net::TcpStream::connect(&self.addr)
            .await
            .map_err(|e| format!("connect {}: {e}", self.addr))?;
        let name = ServerName::try_from("localhost").map_err(|e| e.to_string())?;
        let tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS to {}: {e}", self.addr))?;
        let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| format!("HTTP to {}: {e}", self.addr))?;
        tokio::spawn(conn);
        Ok(send)
    }

    /// One request; the connection is reused, and made again after any error.
    pub async fn request(&self, method: &str, path: &str, body: Vec<u8>) -> Result<(u16, Vec<u8>), String> {
        let fut = async {
            let mut slot = self.conn.lock().await;
            let mut send = match slot.take() {
                Some(s) if !s.is_closed() => s,
                _ => self.connect().await?,
            };
            send.ready()
                .await
                .map_err(|e| format!("{}: connection not ready: {e}", self.addr))?;
            let req = hyper::Request::builder()
                .method(method)
                .uri(path)
                .header("host", "localhost")
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(body)))
                .map_err(|e| e.to_string())?;
            let resp = send
                .send_request(req)
                .await
                .map_err(|e| format!("{} {path}: {e}", self.addr))?;
            let status = resp.status().as_u16();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("{} {path}: body: {e}", self.addr))?
                .to_bytes()
                .to_vec();
            *slot = Some(send);
            Ok((status, body))
        };
        tokio::time::timeout(REQUEST_TIMEOUT, fut)
            .await
            .map_err(|_| format!("{} {path}: no answer within {REQUEST_TIMEOUT:?}", self.addr))?
    }

    /// The agent's metrics, parsed.
    pub async fn metrics(&self) -> Result<Metrics, String> {
        match self.request("GET", "/metrics", Vec::new()).await? {
            (200, body) => Ok(Metrics(String::from_utf8_lossy(&body).to_string())),
            (s, body) => Err(format!(
                "{} /metrics: HTTP {s}: {}",
                self.addr,
                String::from_utf8_lossy(&body)
            )),
        }
    }
}

/// GET `path` over plain HTTP/1.1 from `addr` (a server's admin port): status and body.
pub async fn http_get(addr: &str, path: &str) -> Result<(u16, String), String> {
    http_get_within(addr, path, REQUEST_TIMEOUT).await
}

/// As [`http_get`] with its own deadline (a paused process accepts connections in the
/// kernel and never answers: polls use a short one).
pub async fn http_get_within(addr: &str, path: &str, within: Duration) -> Result<(u16, String), String> {
    let fut = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| format!("HTTP to {addr}: {e}"))?;
        tokio::spawn(conn);
        let req = hyper::Request::builder()
            .uri(path)
            .header("host", addr)
            .body(Full::new(Bytes::new()))
            .map_err(|e| e.to_string())?;
        let resp = send.send_request(req).await.map_err(|e| format!("{addr}{path}: {e}"))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{addr}{path}: body: {e}"))?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).to_string()))
    };
    tokio::time::timeout(within, fut)
        .await
        .map_err(|_| format!("{addr}{path}: no answer within {within:?}"))?
}

/// A Prometheus text exposition.
#[derive(Clone, Debug, Default)]
pub struct Metrics(pub String);

impl Metrics {
    /// The value of the series written exactly as `series` (name and labels), e.g.
    /// `kvota_agent_journal_backlog`, as an integer.
    pub fn get(&self, series: &str) -> Option<u64> {
        self.0.lines().find_map(|l| {
            let v = l.strip_prefix(series)?.strip_prefix(' ')?;
            v.trim()
                .parse::<u64>()
                .ok()
                .or_else(|| v.trim().parse::<i64>().ok().map(|x| u64::try_from(x).unwrap_or(0)))
        })
    }

    /// A per-tenant series in base units (GPUs, GPU-seconds) times `scale`, rounded: 1000
    /// gives thousandths of a GPU, 1e6 milli-GPUe x ms. 0 when absent.
    pub fn tenant_scaled(&self, name: &str, tenant: &str, scale: f64) -> u64 {
        let series = format!("{name}{{tenant=\"{tenant}\"}} ");
        self.0
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str())?.trim().parse::<f64>().ok())
            // Clamped to u64's range first: the cast cannot truncate.
            .map_or(0, |v| {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let n = (v * scale).round().clamp(0.0, u64::MAX as f64) as u64;
                n
            })
    }

    /// The lease state the agent reports: `none`, `fresh`, `expiring` or `safe`.
    pub fn lease_state(&self) -> &'static str {
        for s in ["fresh", "expiring", "safe", "none"] {
            if self.get(&format!("kvota_agent_lease_state{{state=\"{s}\"}}")) == Some(1) {
                return s;
            }
        }
        "unknown"
    }
}
