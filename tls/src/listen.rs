//! Accepting connections with limits: how many at once, how many from one address,
//! how long a TLS handshake may take and how long a connection may stay silent before
//! its first request. Every listener of kvota (gRPC, Raft, HTTP, the webhook) accepts
//! through this, so one client cannot hold a port's connections or file descriptors.
//!
//! A connection that gets past the limits and the handshake becomes a [`Conn`] carrying
//! [`PeerInfo`]: the peer's address and, for a client certificate that a trust group
//! vouches for, which group and the kvota identity it names. Handlers authorize from it.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::Stream;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

use crate::identity::{Identity, Role};
use crate::material::TlsSource;
use crate::verify::{admits, classify, ClientVerifier, TrustGroup};

/// Limits of one listener. Each default says why its number.
#[derive(Clone, Debug)]
pub struct Limits {
    /// A TLS handshake is a few round trips; 10 s covers a slow, lossy link, and a
    /// client that takes longer is holding a descriptor for nothing.
    pub handshake_timeout: Duration,
    /// Time from accepting (or the end of the handshake) to the first [`FIRST_BYTES`]
    /// bytes of a request (an HTTP/2 preface is 24; an HTTP/1 request line is longer):
    /// every real client sends them at once; one that sends nothing, or a dribble, is
    /// holding a descriptor.
    pub first_byte_timeout: Duration,
    /// Connections open at once on this listener; past it new ones are closed at once.
    /// Below the process's file limit, so the other listeners and the data files keep
    /// their descriptors whatever one port receives.
    pub max_connections: usize,
    /// Connections open at once from one IP address: one client (or a misbehaving
    /// one) cannot take a listener's whole allowance.
    pub max_connections_per_peer: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            handshake_timeout: Duration::from_secs(10),
            first_byte_timeout: Duration::from_secs(10),
            max_connections: 4_096,
            max_connections_per_peer: 256,
        }
    }
}

/// How many bytes must arrive within [`Limits::first_byte_timeout`]: the HTTP/2
/// connection preface.
pub const FIRST_BYTES: usize = 24;

/// Why a connection was closed before it carried a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Refusal {
    /// The listener was at [`Limits::max_connections`].
    TooManyConnections,
    /// The peer was at [`Limits::max_connections_per_peer`].
    TooManyFromPeer,
    /// No handshake within [`Limits::handshake_timeout`].
    HandshakeTimeout,
    /// The handshake failed (no certificate where one is required, an unknown CA, an
    /// expired certificate, not TLS at all...).
    HandshakeFailed,
    /// A verified certificate of a role this listener does not serve (the Raft port
    /// serves nodes only).
    WrongRole,
    /// Nothing received within [`Limits::first_byte_timeout`].
    Silent,
}

impl Refusal {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::TooManyConnections => "too_many_connections",
            Refusal::TooManyFromPeer => "too_many_from_peer",
            Refusal::HandshakeTimeout => "handshake_timeout",
            Refusal::HandshakeFailed => "handshake_failed",
            Refusal::WrongRole => "wrong_role",
            Refusal::Silent => "silent",
        }
    }
}

/// Told about every refused connection: `(listener name, reason)`. For metrics.
pub type OnRefusal = Arc<dyn Fn(&'static str, Refusal) + Send + Sync>;

/// TLS on a listener: what it presents and which clients it accepts.
#[derive(Clone, Debug)]
pub struct ServerTls {
    /// The certificate and key presented (reloaded when the files change).
    pub serving: Arc<TlsSource>,
    /// Whose client certificates are accepted (none: no client certificates asked for).
    pub groups: Vec<TrustGroup>,
    /// A client without a certificate is refused in the handshake.
    pub mandatory: bool,
    /// Only clients whose identity has one of these roles stay connected (`None`: any
    /// client the handshake accepted; authorization is then per request).
    pub roles: Option<Vec<Role>>,
    /// ALPN protocols offered (`h2` for gRPC; `h2`, `http/1.1` for HTTP).
    pub alpn: Vec<Vec<u8>>,
}

impl ServerTls {
    /// The rustls configuration: built once, it reads the files in force at each
    /// handshake.
    pub fn config(&self) -> Arc<rustls::ServerConfig> {
        let builder = rustls::ServerConfig::builder_with_provider(crate::provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .expect("the ring provider supports TLS 1.2 and 1.3");
        let builder = if self.groups.is_empty() {
            builder.with_no_client_auth()
        } else {
            builder.with_client_cert_verifier(Arc::new(ClientVerifier::new(self.groups.clone(), self.mandatory)))
        };
        let mut cfg = builder.with_cert_resolver(Arc::new(Resolver(self.serving.clone())));
        cfg.alpn_protocols = self.alpn.clone();
        Arc::new(cfg)
    }
}

/// Presents the certificate in force.
#[derive(Debug)]
struct Resolver(Arc<TlsSource>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current().certified.clone())
    }
}

/// Who is on the other end of a connection.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    /// The peer's address.
    pub addr: SocketAddr,
    /// Whether the connection is TLS.
    pub tls: bool,
    /// Trust groups whose CA the peer's client certificate chains to.
    pub trusted_by: Vec<&'static str>,
    /// The kvota identity of the peer's certificate, if a group that names identities
    /// vouched for it and it is of this listener's trust domain.
    pub identity: Option<Identity>,
}

impl PeerInfo {
    /// Whether the peer may act as one of `roles`.
    pub fn admits(&self, roles: &[Role]) -> bool {
        self.identity.as_ref().is_some_and(|i| admits(i, roles))
    }
}

/// Per-address connection counts, shared by a listener's connections.
#[derive(Debug, Default)]
struct PeerCounts(Mutex<HashMap<IpAddr, usize>>);

/// A connection's place in its listener's limits; given back when it closes.
#[derive(Debug)]
struct Slot {
    counts: Arc<PeerCounts>,
    ip: IpAddr,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut m = self.counts.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = m.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// An accepted connection within its listener's limits.
pub struct Conn {
    io: Io,
    peer: PeerInfo,
    silent: Option<Pin<Box<tokio::time::Sleep>>>,
    on_silent: Option<(&'static str, OnRefusal)>,
    /// Bytes read so far, counted until [`FIRST_BYTES`].
    read_so_far: usize,
    _slot: Slot,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("peer", &self.peer).finish_non_exhaustive()
    }
}

impl Conn {
    /// Who is on the other end.
    pub fn peer(&self) -> &PeerInfo {
        &self.peer
    }
}

impl AsyncRead for Conn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if let Some(deadline) = this.silent.as_mut() {
            if deadline.as_mut().poll(cx).is_ready() {
                if let Some((name, on)) = this.on_silent.take() {
                    on(name, Refusal::Silent);
                }
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no request within the first-byte timeout",
                )));
            }
        }
        let before = buf.filled().len();
        let r = match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        };
        if matches!(r, Poll::Ready(Ok(()))) && this.silent.is_some() {
            this.read_so_far += buf.filled().len() - before;
            if this.read_so_far >= FIRST_BYTES {
                this.silent = None;
                this.on_silent = None;
            }
        }
        r
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = PeerInfo;
    fn connect_info(&self) -> PeerInfo {
        self.peer.clone()
    }
}

/// Logs refusals at most once per [`LOG_EVERY`] per listener, with how many were not
/// logged: a flood of bad connections must not flood the log (the metric counts all).
const LOG_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug)]
struct RefusalLog {
    last: Mutex<(Option<Instant>, u64)>,
}

impl RefusalLog {
    fn note(&self, name: &str, peer: SocketAddr, reason: Refusal, detail: &str) {
        let mut g = self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let now = Instant::now();
        if g.0.is_some_and(|t| now.duration_since(t) < LOG_EVERY) {
            g.1 += 1;
            return;
        }
        let suppressed = std::mem::take(&mut g.1);
        g.0 = Some(now);
        drop(g);
        tracing::warn!(listener = name, %peer, reason = reason.as_str(), detail, suppressed, "connection refused");
    }
}

/// A listening socket with its limits and TLS settings.
pub struct Listener {
    name: &'static str,
    inner: TcpListener,
    tls: Option<ServerTls>,
    limits: Limits,
    on_refusal: OnRefusal,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("name", &self.name)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// How many accepted connections may wait to be taken by the server: a few hundred,
/// while the server takes each at once.
const ACCEPTED_QUEUE: usize = 256;

fn normalize(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

impl Listener {
    /// `name` names the listener in logs and metrics (`grpc`, `raft`, `http`, `webhook`);
    /// `tls` `None` serves plain TCP (loopback or `--insecure` only; the caller checks).
    pub fn new(
        name: &'static str,
        inner: TcpListener,
        tls: Option<ServerTls>,
        limits: Limits,
        on_refusal: OnRefusal,
    ) -> Listener {
        Listener {
            name,
            inner,
            tls,
            limits,
            on_refusal,
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// Accepts until `stop` turns true; yields connections that passed the limits, the
    /// handshake and the role check. Handshakes run concurrently, so a slow one does not
    /// hold up others.
    pub fn incoming(self, mut stop: watch::Receiver<bool>) -> impl Stream<Item = io::Result<Conn>> + Send + 'static {
        let (tx, rx) = mpsc::channel::<io::Result<Conn>>(ACCEPTED_QUEUE);
        let Listener {
            name,
            inner,
            tls,
            limits,
            on_refusal,
        } = self;
        let gate = Arc::new(Gate {
            name,
            config: tls.as_ref().map(|t| tokio_rustls::TlsAcceptor::from(t.config())),
            tls,
            counts: Arc::new(PeerCounts::default()),
            total: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            on_refusal,
            log: RefusalLog {
                last: Mutex::new((None, 0)),
            },
        });
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
                    a = inner.accept() => a,
                };
                let (stream, addr) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors and the like: back off instead of spinning.
                        tracing::warn!(listener = name, error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Some(slot) = gate.slot(addr) else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                tokio::spawn(gate.clone().handshake(stream, addr, slot, tx.clone()));
            }
        });
        tokio_stream::wrappers::ReceiverStream::new(rx)
    }
}

/// What a listener's accept loop checks each connection with.
struct Gate {
    name: &'static str,
    config: Option<tokio_rustls::TlsAcceptor>,
    tls: Option<ServerTls>,
    limits: Limits,
    on_refusal: OnRefusal,
    log: RefusalLog,
    counts: Arc<PeerCounts>,
    total: Arc<Semaphore>,
}

impl Gate {
    fn refuse(&self, addr: SocketAddr, reason: Refusal, detail: &str) {
        (self.on_refusal)(self.name, reason);
        self.log.note(self.name, addr, reason, detail);
    }

    /// A place for a connection from `addr` within the listener's and the peer's
    /// connection limits, or `None` (refused and logged).
    fn slot(&self, addr: SocketAddr) -> Option<Slot> {
        let Ok(permit) = self.total.clone().try_acquire_owned() else {
            self.refuse(addr, Refusal::TooManyConnections, "listener at its connection limit");
            return None;
        };
        let ip = normalize(addr.ip());
        {
            let mut m = self.counts.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let n = m.entry(ip).or_insert(0);
            if *n >= self.limits.max_connections_per_peer {
                drop(m);
                self.refuse(addr, Refusal::TooManyFromPeer, "peer at its connection limit");
                return None;
            }
            *n += 1;
        }
        Some(Slot {
            counts: self.counts.clone(),
            ip,
            _permit: permit,
        })
    }

    /// Runs the TLS handshake and the role check (if TLS), then hands the connection
    /// to the server.
    async fn handshake(
        self: Arc<Self>,
        stream: TcpStream,
        addr: SocketAddr,
        slot: Slot,
        tx: mpsc::Sender<io::Result<Conn>>,
    ) {
        let (io, peer) = match (&self.config, &self.tls) {
            (Some(acceptor), Some(tls)) => {
                let s = match tokio::time::timeout(self.limits.handshake_timeout, acceptor.accept(stream)).await {
                    Err(_) => return self.refuse(addr, Refusal::HandshakeTimeout, "no TLS handshake in time"),
                    Ok(Err(e)) => return self.refuse(addr, Refusal::HandshakeFailed, &handshake_error(&e)),
                    Ok(Ok(s)) => s,
                };
                let chain = s.get_ref().1.peer_certificates().map(<[_]>::to_vec).unwrap_or_default();
                let (trusted_by, identity) = if chain.is_empty() {
                    (Vec::new(), None)
                } else {
                    classify(&chain, &tls.groups)
                };
                if let Some(roles) = &tls.roles {
                    if !identity.as_ref().is_some_and(|i| admits(i, roles)) {
                        let who = identity.map_or_else(|| "no kvota identity".to_string(), |i| i.to_string());
                        return self.refuse(addr, Refusal::WrongRole, &format!("{who} may not use this port"));
                    }
                }
                (
                    Io::Tls(Box::new(s)),
                    PeerInfo {
                        addr,
                        tls: true,
                        trusted_by,
                        identity,
                    },
                )
            }
            _ => (
                Io::Plain(stream),
                PeerInfo {
                    addr,
                    tls: false,
                    trusted_by: Vec::new(),
                    identity: None,
                },
            ),
        };
        let conn = Conn {
            io,
            peer,
            silent: Some(Box::pin(tokio::time::sleep(self.limits.first_byte_timeout))),
            on_silent: Some((self.name, self.on_refusal.clone())),
            read_so_far: 0,
            _slot: slot,
        };
        let _ = tx.send(Ok(conn)).await;
    }
}

/// A failed handshake in words an operator can act on.
fn handshake_error(e: &io::Error) -> String {
    let text = e.to_string();
    if text.contains("InvalidContentType") || text.contains("corrupt message") {
        format!("the client does not speak TLS (plain text, or the wrong port?): {text}")
    } else if text.contains("Expired") {
        format!("the client's certificate has expired: {text}")
    } else if text.contains("NotValidYet") {
        format!("the client's certificate is not valid yet (check its clock): {text}")
    } else if text.contains("UnknownIssuer") {
        format!("the client's certificate is not from a trusted CA: {text}")
    } else if text.contains("NoCertificatesPresented") || text.contains("CertificateRequired") {
        format!("the client presented no certificate: {text}")
    } else {
        text
    }
}

/// Whether `addr` (as given to a listen flag) is a loopback address: plain text is
/// allowed there without `--insecure`.
pub fn is_loopback(addr: &SocketAddr) -> bool {
    addr.ip().is_loopback()
}

/// Raises this process's soft limit on open files to its hard limit, and returns the
/// limit in force (`None`: unlimited). Give it to [`fit_to_file_limit`], so a flood on
/// one port cannot take the descriptors the others and the data files need.
pub fn raise_file_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let cur = getrlimit(Resource::Nofile);
    if cur.current != cur.maximum {
        if let Err(e) = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: cur.maximum,
                maximum: cur.maximum,
            },
        ) {
            tracing::debug!(error = %e, "could not raise the open-files limit");
        }
    }
    file_limit()
}

/// This process's soft limit on open files (`None`: unlimited).
pub fn file_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// Descriptors kept out of every listener's reach: the data files (the Raft log's
/// segments, the snapshot, the journal, the kept state), connections this process
/// opens (to the peers, the control plane, the API server), and the runtime's own. At
/// least 256, or an eighth of the limit.
pub fn file_reserve(limit: u64) -> u64 {
    std::cmp::max(256, limit / 8)
}

/// Fewest connections a listener is given however low the limit: enough for a probe, a
/// scrape and a few clients.
pub const MIN_LISTENER_CONNECTIONS: usize = 16;

/// Sizes listeners' connection limits to the open-files limit `limit` (soft): what is
/// left after [`file_reserve`] is shared by weight, and no listener gets more than it
/// was configured with. One address may hold at most a quarter of a listener's
/// connections, so a flood from a few addresses leaves room for everyone else. Returns
/// whether the limits had to shrink.
pub fn fit_to_file_limit(limit: Option<u64>, listeners: &mut [(&mut Limits, u64)]) -> bool {
    let Some(limit) = limit else { return false };
    let available = limit.saturating_sub(file_reserve(limit));
    let total: u64 = listeners.iter().map(|(_, w)| *w).sum::<u64>().max(1);
    let mut shrunk = false;
    for (l, weight) in listeners.iter_mut() {
        let share = usize::try_from(available.saturating_mul(*weight) / total).unwrap_or(usize::MAX);
        let max = share.max(MIN_LISTENER_CONNECTIONS).min(l.max_connections);
        if max < l.max_connections {
            shrunk = true;
            l.max_connections = max;
        }
        let per_peer = (l.max_connections / 4).max(1);
        if l.max_connections_per_peer > per_peer {
            l.max_connections_per_peer = per_peer;
        }
    }
    shrunk
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_follow_the_file_limit_and_leave_a_reserve() {
        let big = || Limits {
            max_connections: 4_096,
            max_connections_per_peer: 512,
            ..Limits::default()
        };
        let (mut a, mut b) = (big(), big());
        assert!(!fit_to_file_limit(None, &mut [(&mut a, 1)]), "unlimited");
        assert_eq!(a.max_connections, 4_096);
        assert!(!fit_to_file_limit(Some(1 << 20), &mut [(&mut a, 1)]), "plenty");
        assert_eq!((a.max_connections, a.max_connections_per_peer), (4_096, 512));
        assert!(fit_to_file_limit(Some(1_024), &mut [(&mut a, 3), (&mut b, 1)]));
        assert_eq!(a.max_connections + b.max_connections, 1_024 - 256);
        assert_eq!((a.max_connections, b.max_connections), (576, 192));
        assert_eq!((a.max_connections_per_peer, b.max_connections_per_peer), (144, 48));
        let mut c = big();
        fit_to_file_limit(Some(100), &mut [(&mut c, 1)]);
        assert_eq!(c.max_connections, MIN_LISTENER_CONNECTIONS);
    }
}
