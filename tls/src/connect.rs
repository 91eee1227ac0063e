//! The client side: dialling a control-plane node over TCP, with TLS that presents this
//! party's certificate and accepts only the server identity expected, as a connector
//! tonic channels use ("clients accept a connector").

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::client::ResolvesClientCert;
use rustls::pki_types::ServerName;
use rustls::sign::CertifiedKey;
use rustls::SignatureScheme;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::identity::Identity;
use crate::material::TlsSource;
use crate::verify::{Expect, ServerIdentityVerifier};

/// Presents this party's certificate in force.
#[derive(Debug)]
struct ClientResolver(Arc<TlsSource>);

impl ResolvesClientCert for ClientResolver {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current().certified.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// A rustls client configuration that presents `source`'s certificate and accepts a
/// server only if its chain leads to `source`'s bundle and it is `expect`. Built once;
/// reloaded files apply to the next handshake.
pub fn client_config(source: Arc<TlsSource>, expect: Expect, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(crate::provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
        .expect("the ring provider supports TLS 1.2 and 1.3")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ServerIdentityVerifier::new(source.clone(), expect)))
        .with_client_cert_resolver(Arc::new(ClientResolver(source)));
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(cfg)
}

/// A dialled connection, plain or TLS.
#[derive(Debug)]
pub enum ClientIo {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP.
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl AsyncRead for ClientIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match &mut *self {
            ClientIo::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ClientIo::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match &mut *self {
            ClientIo::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ClientIo::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut *self {
            ClientIo::Plain(s) => Pin::new(s).poll_flush(cx),
            ClientIo::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut *self {
            ClientIo::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ClientIo::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Dials `host:port` of a URI, with TLS if configured.
#[derive(Clone, Debug)]
pub struct Connector {
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl Connector {
    /// Plain TCP (`None`) or TLS with `tls`.
    pub fn new(tls: Option<Arc<rustls::ClientConfig>>) -> Self {
        Connector { tls }
    }

    /// Dials `addr` (`host:port`).
    pub async fn dial(&self, addr: &str) -> io::Result<ClientIo> {
        let stream = TcpStream::connect(addr).await?;
        let _ = stream.set_nodelay(true);
        let Some(cfg) = &self.tls else {
            return Ok(ClientIo::Plain(stream));
        };
        let host = addr
            .rsplit_once(':')
            .map_or(addr, |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']');
        // The name is sent as SNI only; the verifier checks identities, not names.
        let name = ServerName::try_from(host.to_string())
            .unwrap_or_else(|_| ServerName::try_from("kvota").expect("a valid DNS name"));
        let tls = tokio_rustls::TlsConnector::from(cfg.clone())
            .connect(name, stream)
            .await?;
        Ok(ClientIo::Tls(Box::new(tls)))
    }
}

impl tower::Service<Uri> for Connector {
    type Response = TokioIo<ClientIo>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<ClientIo>>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let auth = uri
                .authority()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("no host:port in {uri}")))?;
            let addr = match auth.port_u16() {
                Some(_) => auth.as_str().to_string(),
                None => format!("{}:443", auth.host()),
            };
            this.dial(&addr).await.map(TokioIo::new)
        })
    }
}

/// How often an idle or busy client connection is pinged (HTTP/2 PING), and how long a
/// ping may go unanswered before the connection counts as dead and the next call dials
/// anew. Without it a connection cut silently (a partition that drops packets) looks
/// alive until each call's own timeout, call after call.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// See [`KEEPALIVE_INTERVAL`].
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// A lazily connecting gRPC channel to `addr` (`host:port`) through `connector`, with
/// the given connect timeout and per-request timeout, pinging its connection (see
/// [`KEEPALIVE_INTERVAL`]).
pub fn channel(
    addr: &str,
    connector: &Connector,
    connect_timeout: Duration,
    request_timeout: Duration,
) -> Result<Channel, String> {
    let ep = Endpoint::from_shared(format!("http://{addr}")).map_err(|e| format!("bad address {addr}: {e}"))?;
    Ok(ep
        .connect_timeout(connect_timeout)
        .timeout(request_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .connect_with_connector_lazy(connector.clone()))
}

/// Dials `addr` and completes a TLS handshake that accepts only `expect`, returning the
/// identity the server presented. Used before making an address a Raft member: the
/// leader must not be sent to dial whatever address it is given.
pub async fn probe(addr: &str, source: Arc<TlsSource>, expect: Expect, timeout: Duration) -> Result<Identity, String> {
    let connector = Connector::new(Some(client_config(source, expect.clone(), &[b"h2"])));
    let io = match tokio::time::timeout(timeout, connector.dial(addr)).await {
        Err(_) => return Err(format!("{addr} did not complete a TLS handshake within {timeout:?}")),
        Ok(Err(e)) => return Err(format!("{addr}: {e}")),
        Ok(Ok(io)) => io,
    };
    let ClientIo::Tls(tls) = io else {
        return Err("no TLS configured".to_string());
    };
    let leaf = tls.get_ref().1.peer_certificates().and_then(|c| c.first().cloned());
    let leaf = leaf.ok_or_else(|| format!("{addr} presented no certificate"))?;
    crate::identity::from_certificate(&leaf)
        .map_err(|e| e.0)?
        .ok_or_else(|| format!("{addr} presented a certificate with no kvota identity; expected {expect}"))
}
