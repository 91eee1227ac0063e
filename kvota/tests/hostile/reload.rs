//! Certificates reloaded from disk are checked against the federation's CA: a node
//! certificate of another CA (same trust domain, another key) is refused on reload with
//! the previous set kept and the reason logged, and `/readyz` is unready while the
//! certificate a node serves cannot complete a handshake with the federation's CA (here:
//! it expired under the running node), then ready once a good one is in place.

use super::*;

/// The certificate node `spec` serves now (DER).
async fn served(spec: &ServerSpec, party: &GrpcTls) -> Vec<u8> {
    let io = party.connector(Expect::AnyNode).dial(&spec.rpc).await.expect("dial");
    match io {
        kvota_tls::connect::ClientIo::Tls(t) => t.get_ref().1.peer_certificates().expect("certs")[0].to_vec(),
        kvota_tls::connect::ClientIo::Plain(_) => panic!("plain"),
    }
}

/// Accepts any server certificate, as a kubelet's HTTPS probe does.
#[derive(Debug)]
struct AnyServer;

impl rustls::client::danger::ServerCertVerifier for AnyServer {
    fn verify_server_cert(
        &self,
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &[rustls::pki_types::CertificateDer<'_>],
        _: &rustls::pki_types::ServerName<'_>,
        _: &[u8],
        _: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        Ok(rustls::client::danger::ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &rustls::pki_types::CertificateDer<'_>,
        _: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        Ok(rustls::client::danger::HandshakeSignatureValid::assertion())
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        kvota_tls::provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Node `spec`'s `/readyz`, asked as a kubelet asks: HTTPS without verifying the server.
async fn readyz(spec: &ServerSpec) -> (u16, String) {
    let cfg = rustls::ClientConfig::builder_with_provider(kvota_tls::provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyServer))
        .with_no_client_auth();
    let probe = kvota_tls::connect::Connector::new(Some(Arc::new(cfg)));
    kvota_testkit::http_get(&probe, &spec.http, "/readyz")
        .await
        .unwrap_or((0, String::new()))
}

/// Waits (up to `within`) until `f` holds, saying `what` otherwise.
async fn until<F, Fut>(within: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !f().await {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The case, on a running federation whose node 1 is ready.
pub(super) async fn certificates_that_cannot_handshake_are_refused_or_unready(fed: &Fed) {
    let op = fed.party(Role::Operator, "alice");
    let spec = &fed.specs[0];
    let files = &fed.node_files[0];
    let before = served(spec, &op).await;

    // Node 1's certificate from another CA: refused on reload, the old one kept.
    let other = Pki::new("hostile.test");
    rotate(
        files,
        &other
            .ca()
            .issue(&Kind::Party(Role::Node), "1", &[], &[], 60)
            .expect("issue"),
    );
    until(
        Duration::from_secs(10),
        "the foreign certificate refused, saying why",
        || async {
            std::fs::read_to_string(spec.log())
                .unwrap_or_default()
                .contains("new TLS files not loaded")
        },
    )
    .await;
    let log = std::fs::read_to_string(spec.log()).unwrap_or_default();
    assert!(log.contains("does not chain to the CA bundle"), "{log}");
    assert_eq!(served(spec, &op).await, before, "node 1 serves another certificate");
    let (code, body) = readyz(spec).await;
    assert_eq!(code, 200, "{body}");

    // A certificate that expires under the running node: unready once it has, saying
    // why; ready again with a good one.
    let now = time::OffsetDateTime::now_utc();
    let short = fed
        .pki
        .ca()
        .issue_between(
            &Kind::Party(Role::Node),
            "1",
            &[],
            &[],
            now - time::Duration::days(1),
            now + time::Duration::seconds(5),
        )
        .expect("issue");
    rotate(files, &short);
    until(
        Duration::from_secs(10),
        "the short-lived certificate served",
        || async { served(spec, &op).await != before },
    )
    .await;
    until(
        Duration::from_secs(15),
        "node 1 unready once its certificate expired",
        || async {
            let (code, body) = readyz(spec).await;
            code == 503 && body.contains("cannot complete a handshake with the federation's CA")
        },
    )
    .await;
    rotate(
        files,
        &fed.pki
            .ca()
            .issue(&Kind::Party(Role::Node), "1", &[], &[], 60)
            .expect("issue"),
    );
    until(
        Duration::from_secs(20),
        "node 1 ready again with a good certificate",
        || async { readyz(spec).await.0 == 200 },
    )
    .await;
}
