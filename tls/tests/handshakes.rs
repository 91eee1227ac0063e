//! Real TLS handshakes over loopback sockets between kvota's listener and connector:
//! identities, refusals (no certificate, another CA, expired, not yet valid, wrong
//! role, wrong node), the connection limits, and certificate and CA rotation on disk.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kvota_tls::connect::{client_config, Connector};
use kvota_tls::issue::{new_ca, Ca, Kind};
use kvota_tls::{Expect, Limits, Listener, PeerInfo, Refusal, Role, ServerTls, TlsPaths, TlsSource, TrustGroup};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

struct Pki {
    dir: tempfile::TempDir,
    ca: Ca,
    ca_pem: String,
}

impl Pki {
    fn new(td: &str) -> Pki {
        let dir = tempfile::tempdir().expect("tmp");
        let ca = new_ca(td, 30).expect("ca");
        std::fs::write(dir.path().join("ca.crt"), &ca.cert_pem).expect("write");
        Pki {
            ca: Ca::from_pem(&ca.cert_pem, &ca.key_pem).expect("load ca"),
            ca_pem: ca.cert_pem,
            dir,
        }
    }

    fn write(&self, file: &str, kind: Kind, name: &str) -> TlsPaths {
        let issued = self.ca.issue(&kind, name, &[], &[], 30).expect("issue");
        self.write_pem(file, &issued.cert_pem, &issued.key_pem)
    }

    fn write_pem(&self, file: &str, cert: &str, key: &str) -> TlsPaths {
        let (c, k) = (
            self.dir.path().join(format!("{file}.crt")),
            self.dir.path().join(format!("{file}.key")),
        );
        std::fs::write(&c, cert).expect("write");
        std::fs::write(&k, key).expect("write");
        TlsPaths {
            ca: Some(self.dir.path().join("ca.crt")),
            cert: c,
            key: k,
        }
    }

    fn party(&self, role: Role, name: &str) -> Arc<TlsSource> {
        TlsSource::load(self.write(&format!("{role}-{name}"), Kind::Party(role), name)).expect("load")
    }
}

struct Server {
    addr: SocketAddr,
    peers: mpsc::UnboundedReceiver<PeerInfo>,
    refused: Arc<Mutex<Vec<Refusal>>>,
    _stop: watch::Sender<bool>,
}

/// A listener whose connections answer "pong" to the first bytes they receive.
async fn serve(tls: Option<ServerTls>, limits: Limits) -> Server {
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = tcp.local_addr().expect("addr");
    let refused = Arc::new(Mutex::new(Vec::new()));
    let r = refused.clone();
    let listener = Listener::new(
        "test",
        tcp,
        tls,
        limits,
        Arc::new(move |_, why| r.lock().expect("lock").push(why)),
    );
    let (stop, rx) = watch::channel(false);
    let (tx, peers) = mpsc::unbounded_channel();
    let mut incoming = Box::pin(listener.incoming(rx));
    tokio::spawn(async move {
        while let Some(c) = incoming.next().await {
            let Ok(mut conn) = c else { continue };
            let _ = tx.send(conn.peer().clone());
            tokio::spawn(async move {
                let mut buf = [0u8; 16];
                if matches!(conn.read(&mut buf).await, Ok(n) if n > 0) {
                    let _ = conn.write_all(b"pong").await;
                    let _ = conn.flush().await;
                    // Hold the connection open until the client goes.
                    let _ = conn.read(&mut buf).await;
                }
            });
        }
    });
    Server {
        addr,
        peers,
        refused,
        _stop: stop,
    }
}

fn node_server(pki: &Pki, roles: Option<Vec<Role>>, mandatory: bool) -> ServerTls {
    let serving = pki.party(Role::Node, "1");
    ServerTls {
        serving: serving.clone(),
        groups: vec![TrustGroup {
            label: "federation",
            source: serving,
            names_identities: true,
        }],
        mandatory,
        roles,
        alpn: Vec::new(),
    }
}

/// Sends "ping", expects "pong": the connection works end to end.
async fn ping(connector: &Connector, addr: SocketAddr) -> Result<(), String> {
    let mut io = connector.dial(&addr.to_string()).await.map_err(|e| e.to_string())?;
    io.write_all(b"ping").await.map_err(|e| e.to_string())?;
    let mut buf = [0u8; 4];
    match tokio::time::timeout(Duration::from_secs(5), io.read_exact(&mut buf)).await {
        Ok(Ok(_)) if &buf == b"pong" => Ok(()),
        Ok(Ok(_)) => Err(format!("got {buf:?}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err("no answer".to_string()),
    }
}

fn connector(source: Arc<TlsSource>, expect: Expect) -> Connector {
    Connector::new(Some(client_config(source, expect, &[])))
}

/// A client configuration presenting any PEM pair, without the checks `TlsSource` makes
/// (so a test can present an expired certificate).
fn raw_connector(cert_pem: &str, key_pem: &str) -> Connector {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .map(|c| c.expect("pem"))
        .collect();
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("key");
    let cfg = rustls::ClientConfig::builder_with_provider(kvota_tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAny))
        .with_client_auth_cert(chain, key)
        .expect("client cert");
    Connector::new(Some(Arc::new(cfg)))
}

/// Accepts any server: the raw connector's tests are about the server refusing the
/// client, not about the client's check (which other tests cover).
#[derive(Debug)]
struct AcceptAny;
impl rustls::client::danger::ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(m, c, d, &kvota_tls::provider().signature_verification_algorithms)
    }
    fn verify_tls13_signature(
        &self,
        m: &[u8],
        c: &CertificateDer<'_>,
        d: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(m, c, d, &kvota_tls::provider().signature_verification_algorithms)
    }
    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        kvota_tls::provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

async fn next_peer(s: &mut Server) -> PeerInfo {
    tokio::time::timeout(Duration::from_secs(5), s.peers.recv())
        .await
        .expect("a connection")
        .expect("open")
}

fn refused(s: &Server) -> Vec<Refusal> {
    s.refused.lock().expect("lock").clone()
}

#[tokio::test]
async fn each_role_is_identified_and_the_server_is_verified_as_a_node() {
    let pki = Pki::new("prod.gpu");
    let mut s = serve(Some(node_server(&pki, None, true)), Limits::default()).await;
    for (role, name) in [
        (Role::Cluster, "gpu-east"),
        (Role::Operator, "alice"),
        (Role::Viewer, "grafana"),
        (Role::Node, "2"),
    ] {
        let c = connector(pki.party(role, name), Expect::AnyNode);
        ping(&c, s.addr).await.unwrap_or_else(|e| panic!("{role}: {e}"));
        let peer = next_peer(&mut s).await;
        let id = peer.identity.expect("identity");
        assert_eq!((id.role(), id.name(), id.trust_domain()), (role, name, "prod.gpu"));
        assert_eq!(peer.trusted_by, vec!["federation"]);
    }
    // Expecting node 1 (the server) works; expecting node 2 refuses it.
    let viewer = pki.party(Role::Viewer, "v");
    ping(&connector(viewer.clone(), Expect::Node(1)), s.addr)
        .await
        .expect("node 1");
    let e = ping(&connector(viewer, Expect::Node(2)), s.addr)
        .await
        .expect_err("not node 2");
    assert!(e.contains("spiffe://prod.gpu/node/1, not node 2"), "{e}");
}

#[tokio::test]
async fn a_server_that_is_no_node_or_of_another_federation_is_refused_by_clients() {
    let pki = Pki::new("kvota");
    let serving = pki.party(Role::Cluster, "imposter");
    let tls = ServerTls {
        serving: serving.clone(),
        groups: Vec::new(),
        mandatory: false,
        roles: None,
        alpn: Vec::new(),
    };
    let s = serve(Some(tls), Limits::default()).await;
    let e = ping(&connector(pki.party(Role::Viewer, "v"), Expect::AnyNode), s.addr)
        .await
        .expect_err("a cluster is no node");
    // Refused for its key usage (client only) or, failing that, for its identity.
    assert!(
        e.contains("InvalidPurpose") || e.contains("not a control-plane node"),
        "{e}"
    );

    let other = Pki::new("other");
    let s = serve(Some(node_server(&other, None, false)), Limits::default()).await;
    let e = ping(&connector(pki.party(Role::Viewer, "v"), Expect::AnyNode), s.addr)
        .await
        .expect_err("another CA");
    assert!(e.contains("UnknownIssuer"), "{e}");
}

#[tokio::test]
async fn no_certificate_another_ca_expired_and_future_certificates_are_refused_in_the_handshake() {
    let pki = Pki::new("kvota");
    let s = serve(Some(node_server(&pki, None, true)), Limits::default()).await;
    // No client certificate at all.
    let anon = rustls::ClientConfig::builder_with_provider(kvota_tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("v")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAny))
        .with_no_client_auth();
    assert!(ping(&Connector::new(Some(Arc::new(anon))), s.addr).await.is_err());
    // A certificate from another CA.
    let other = Pki::new("kvota");
    let foreign = other
        .ca
        .issue(&Kind::Party(Role::Operator), "mallory", &[], &[], 30)
        .expect("issue");
    assert!(ping(&raw_connector(&foreign.cert_pem, &foreign.key_pem), s.addr)
        .await
        .is_err());
    // Expired, and not valid yet, from the right CA.
    let now = time::OffsetDateTime::now_utc();
    let day = time::Duration::days(1);
    let expired = pki
        .ca
        .issue_between(&Kind::Party(Role::Operator), "old", &[], &[], now - 3 * day, now - day)
        .expect("issue");
    assert!(ping(&raw_connector(&expired.cert_pem, &expired.key_pem), s.addr)
        .await
        .is_err());
    let future = pki
        .ca
        .issue_between(&Kind::Party(Role::Operator), "soon", &[], &[], now + day, now + 3 * day)
        .expect("issue");
    assert!(ping(&raw_connector(&future.cert_pem, &future.key_pem), s.addr)
        .await
        .is_err());
    // Each was a refused handshake, and a good client still gets through.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(refused(&s), vec![Refusal::HandshakeFailed; 4]);
    ping(&connector(pki.party(Role::Operator, "alice"), Expect::AnyNode), s.addr)
        .await
        .expect("good client");
    // Loading an expired certificate of one's own is refused with the reason.
    let paths = pki.write_pem("expired", &expired.cert_pem, &expired.key_pem);
    let e = TlsSource::load(paths).expect_err("expired");
    assert!(e.to_string().contains("expired"), "{e}");
}

#[tokio::test]
async fn a_port_for_nodes_drops_other_roles_after_the_handshake() {
    let pki = Pki::new("kvota");
    let mut s = serve(Some(node_server(&pki, Some(vec![Role::Node]), true)), Limits::default()).await;
    for (role, name) in [(Role::Cluster, "east"), (Role::Operator, "alice")] {
        assert!(
            ping(&connector(pki.party(role, name), Expect::AnyNode), s.addr)
                .await
                .is_err(),
            "{role}"
        );
    }
    ping(&connector(pki.party(Role::Node, "2"), Expect::AnyNode), s.addr)
        .await
        .expect("a node");
    assert_eq!(next_peer(&mut s).await.identity.and_then(|i| i.node_id()), Some(2));
    assert_eq!(refused(&s), vec![Refusal::WrongRole; 2]);
}

#[tokio::test]
async fn connection_limits_bite_per_peer_and_silent_connections_are_closed() {
    let pki = Pki::new("kvota");
    let limits = Limits {
        handshake_timeout: Duration::from_millis(300),
        first_byte_timeout: Duration::from_millis(300),
        max_connections: 100,
        max_connections_per_peer: 2,
    };
    let s = serve(Some(node_server(&pki, None, false)), limits).await;
    let c = connector(pki.party(Role::Viewer, "v"), Expect::AnyNode);
    // Two connections that stay open (answered, then held).
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut io = c.dial(&s.addr.to_string()).await.expect("dial");
        io.write_all(b"ping").await.expect("w");
        let mut buf = [0u8; 4];
        io.read_exact(&mut buf).await.expect("pong");
        held.push(io);
    }
    // The third from the same address is closed at once.
    assert!(ping(&c, s.addr).await.is_err());
    assert!(refused(&s).contains(&Refusal::TooManyFromPeer), "{:?}", refused(&s));
    // Another address is not limited by them.
    let sock = tokio::net::TcpSocket::new_v4().expect("socket");
    sock.bind("127.0.0.2:0".parse().expect("addr")).expect("bind 127.0.0.2");
    let tcp = sock.connect(s.addr).await.expect("connect");
    drop(tcp);
    // Closing one frees a place.
    drop(held.pop());
    tokio::time::sleep(Duration::from_millis(100)).await;
    ping(&c, s.addr).await.expect("a place is free");
    drop(held);

    // A TCP connection that never starts a handshake, and a TLS one that never sends a
    // request, are both closed after their timeouts.
    let mut raw = tokio::net::TcpStream::connect(s.addr).await.expect("connect");
    let mut buf = [0u8; 1];
    let t0 = std::time::Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(3), raw.read(&mut buf))
        .await
        .expect("closed in time");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    let mut silent = c.dial(&s.addr.to_string()).await.expect("dial");
    let r = tokio::time::timeout(Duration::from_secs(3), silent.read(&mut buf))
        .await
        .expect("closed in time");
    assert!(matches!(r, Ok(0) | Err(_)), "{r:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let got = refused(&s);
    assert!(
        got.contains(&Refusal::HandshakeTimeout) && got.contains(&Refusal::Silent),
        "{got:?}"
    );
}

fn leaf_of(io: &kvota_tls::connect::ClientIo) -> Vec<u8> {
    match io {
        kvota_tls::connect::ClientIo::Tls(t) => t.get_ref().1.peer_certificates().expect("certs")[0].to_vec(),
        kvota_tls::connect::ClientIo::Plain(_) => panic!("plain"),
    }
}

fn rewrite(path: &Path, text: &str) {
    // Write beside and rename, as a careful rotation does; the mtime changes either way.
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).expect("write");
    std::fs::rename(&tmp, path).expect("rename");
}

#[tokio::test]
async fn certificates_and_the_ca_rotate_on_disk_without_a_restart() {
    let pki = Pki::new("kvota");
    let tls = node_server(&pki, None, true);
    let serving = tls.serving.clone();
    let s = serve(Some(tls), Limits::default()).await;
    let c = connector(pki.party(Role::Viewer, "v"), Expect::AnyNode);
    let before = leaf_of(&c.dial(&s.addr.to_string()).await.expect("dial"));

    // A new certificate for the same node: served from the next connection on.
    let renewed = pki
        .ca
        .issue(&Kind::Party(Role::Node), "1", &[], &[], 60)
        .expect("issue");
    std::thread::sleep(Duration::from_millis(20));
    rewrite(&serving.paths().cert, &renewed.cert_pem);
    rewrite(&serving.paths().key, &renewed.key_pem);
    assert!(serving.reload_if_changed().expect("reload"));
    let after = leaf_of(&c.dial(&s.addr.to_string()).await.expect("dial"));
    assert_ne!(before, after);
    ping(&c, s.addr).await.expect("works after the reload");

    // A certificate naming another node is refused; the old one stays in force.
    let other = pki
        .ca
        .issue(&Kind::Party(Role::Node), "9", &[], &[], 60)
        .expect("issue");
    std::thread::sleep(Duration::from_millis(20));
    rewrite(&serving.paths().cert, &other.cert_pem);
    rewrite(&serving.paths().key, &other.key_pem);
    let e = serving.reload_if_changed().expect_err("another identity");
    assert!(e.to_string().contains("restart it to change identity"), "{e}");
    assert_eq!(serving.identity().and_then(|i| i.node_id()), Some(1));
    // A half-written key is refused too.
    rewrite(&serving.paths().key, "-----BEGIN PRIVATE KEY-----\nAAAA");
    assert!(serving.reload_if_changed().is_err());
    ping(&c, s.addr).await.expect("still serving the good pair");
    rewrite(&serving.paths().cert, &renewed.cert_pem);
    rewrite(&serving.paths().key, &renewed.key_pem);
    serving.reload_if_changed().expect("good pair again");

    // CA rotation: a client of a new CA is refused until the server's bundle holds both.
    let new_ca = new_ca("kvota", 30).expect("ca2");
    let new = Ca::from_pem(&new_ca.cert_pem, &new_ca.key_pem).expect("load");
    let op = new
        .issue(&Kind::Party(Role::Operator), "bob", &[], &[], 30)
        .expect("issue");
    let dir = tempfile::tempdir().expect("tmp");
    let both = format!("{}{}", pki.ca_pem, new_ca.cert_pem);
    std::fs::write(dir.path().join("ca.crt"), &both).expect("w");
    std::fs::write(dir.path().join("bob.crt"), &op.cert_pem).expect("w");
    std::fs::write(dir.path().join("bob.key"), &op.key_pem).expect("w");
    let bob = TlsSource::load(TlsPaths {
        ca: Some(dir.path().join("ca.crt")),
        cert: dir.path().join("bob.crt"),
        key: dir.path().join("bob.key"),
    })
    .expect("bob");
    let cb = connector(bob, Expect::AnyNode);
    assert!(
        ping(&cb, s.addr).await.is_err(),
        "the server does not trust the new CA yet"
    );
    std::thread::sleep(Duration::from_millis(20));
    rewrite(serving.paths().ca.as_deref().expect("ca"), &both);
    assert!(serving.reload_if_changed().expect("reload"));
    ping(&cb, s.addr).await.expect("trusted through the bundle");
    ping(&c, s.addr).await.expect("the old CA's clients too");
}
