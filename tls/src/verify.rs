//! Certificate verification by identity rather than by host name.
//!
//! Federation parties check each other's certificate chain against their CA bundle and
//! then the kvota identity it names (see [`crate::identity`]): an agent or the CLI
//! accepts only a control-plane node of its own trust domain, a node dialling a peer
//! for Raft accepts only that peer's node id. Host names and addresses in certificates
//! are not looked at, so nodes can move without reissuing certificates, and a stolen
//! certificate of one role cannot stand in for another.
//!
//! Both verifiers read the trust bundle in force at each handshake, so a reloaded
//! bundle (CA rotation) applies to the next connection without rebuilding anything.

use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, Error, RootCertStore, SignatureScheme};

use crate::identity::{Identity, Role};
use crate::material::TlsSource;

/// webpki's verdict in rustls's terms, so handshakes fail with the usual messages
/// ("invalid peer certificate: Expired").
fn pki_error(e: webpki::Error) -> Error {
    use webpki::Error as W;
    let c = match e {
        W::CertExpired { .. } => CertificateError::Expired,
        W::CertNotValidYet { .. } => CertificateError::NotValidYet,
        W::UnknownIssuer => CertificateError::UnknownIssuer,
        W::InvalidSignatureForPublicKey | W::UnsupportedSignatureAlgorithmForPublicKeyContext(_) => {
            CertificateError::BadSignature
        }
        W::RequiredEkuNotFoundContext(_) => CertificateError::InvalidPurpose,
        W::BadDer | W::BadDerTime | W::TrailingData(_) => CertificateError::BadEncoding,
        other => CertificateError::Other(rustls::OtherError(Arc::new(PkiError(other.to_string())))),
    };
    Error::InvalidCertificate(c)
}

#[derive(Debug)]
struct PkiError(String);
impl std::fmt::Display for PkiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for PkiError {}

/// Whether the chain (leaf first) leads to one of `roots`, valid at `now`, for `usage`.
pub fn verify_chain(
    roots: &RootCertStore,
    chain: &[CertificateDer<'_>],
    usage: webpki::KeyUsage,
    now: UnixTime,
) -> Result<(), Error> {
    let (leaf, intermediates) = chain.split_first().ok_or(Error::NoCertificatesPresented)?;
    if roots.is_empty() {
        return Err(Error::InvalidCertificate(CertificateError::UnknownIssuer));
    }
    let cert = webpki::EndEntityCert::try_from(leaf).map_err(pki_error)?;
    cert.verify_for_usage(
        crate::provider().signature_verification_algorithms.all,
        &roots.roots,
        intermediates,
        now,
        usage,
        None,
        None,
    )
    .map(|_| ())
    .map_err(pki_error)
}

/// Which server identity a client accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// Any control-plane node of the trust domain (agents, the CLI, forwarding).
    AnyNode,
    /// Exactly this node (Raft to a peer; adding a member).
    Node(u64),
}

impl std::fmt::Display for Expect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Expect::AnyNode => f.write_str("a control-plane node"),
            Expect::Node(id) => write!(f, "node {id}"),
        }
    }
}

/// The identity check a client makes after the chain verified: the leaf names a node
/// of `trust_domain`, and the node `expect` names.
pub fn check_server_identity(
    leaf: &CertificateDer<'_>,
    trust_domain: &str,
    expect: &Expect,
) -> Result<Identity, Error> {
    let refuse =
        |why: String| Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(Arc::new(PkiError(why)))));
    let id = crate::identity::from_certificate(leaf)
        .map_err(|e| refuse(e.0))?
        .ok_or_else(|| {
            refuse(format!(
                "the server's certificate names no kvota identity; expected {expect}"
            ))
        })?;
    if id.trust_domain() != trust_domain {
        return Err(refuse(format!(
            "the server is {id}, of another trust domain than ours ({trust_domain})"
        )));
    }
    match (expect, id.node_id()) {
        (Expect::AnyNode, Some(_)) => Ok(id),
        (Expect::Node(want), Some(got)) if *want == got => Ok(id),
        _ => Err(refuse(format!("the server is {id}, not {expect}"))),
    }
}

/// A client's check of a control-plane server: chain to the trust bundle in force,
/// then [`check_server_identity`].
#[derive(Debug)]
pub struct ServerIdentityVerifier {
    trust: Arc<TlsSource>,
    expect: Expect,
}

impl ServerIdentityVerifier {
    /// Verifies servers against `trust`'s bundle and its own trust domain.
    pub fn new(trust: Arc<TlsSource>, expect: Expect) -> Self {
        ServerIdentityVerifier { trust, expect }
    }
}

impl ServerCertVerifier for ServerIdentityVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        let loaded = self.trust.current();
        let mut chain = Vec::with_capacity(1 + intermediates.len());
        chain.push(end_entity.clone());
        chain.extend(intermediates.iter().cloned());
        verify_chain(&loaded.roots, &chain, webpki::KeyUsage::server_auth(), now)?;
        let td = loaded
            .identity
            .as_ref()
            .map(|i| i.trust_domain().to_string())
            .ok_or_else(|| {
                Error::General(
                    "our own certificate names no kvota identity, so no trust domain to check against".into(),
                )
            })?;
        check_server_identity(end_entity, &td, &self.expect)?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &crate::provider().signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &crate::provider().signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        crate::provider().signature_verification_algorithms.supported_schemes()
    }
}

/// A set of CAs a server trusts for client certificates, and whether identities in
/// certificates it verifies count (only the federation's CA may name kvota identities;
/// a cluster's own CA, trusted for the API server's calls, must not).
#[derive(Clone, Debug)]
pub struct TrustGroup {
    /// What the group is, in logs and in [`crate::PeerInfo::trusted_by`]: `federation`,
    /// `apiserver`.
    pub label: &'static str,
    /// Whose bundle.
    pub source: Arc<TlsSource>,
    /// Identities (SPIFFE URIs) in certificates of this group are believed.
    pub names_identities: bool,
}

/// A server's check of client certificates: the chain leads to any trust group's
/// bundle in force. Optional or mandatory per listener; which group vouched, and the
/// identity, are worked out after the handshake ([`classify`]).
#[derive(Debug)]
pub struct ClientVerifier {
    groups: Vec<TrustGroup>,
    mandatory: bool,
}

impl ClientVerifier {
    /// Accepts clients whose chain leads to any of `groups`; without a certificate only
    /// if not `mandatory`.
    pub fn new(groups: Vec<TrustGroup>, mandatory: bool) -> Self {
        ClientVerifier { groups, mandatory }
    }
}

impl ClientCertVerifier for ClientVerifier {
    fn offer_client_auth(&self) -> bool {
        !self.groups.is_empty()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // No hints: the bundles change at run time, and each party has one certificate.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, Error> {
        let mut chain = Vec::with_capacity(1 + intermediates.len());
        chain.push(end_entity.clone());
        chain.extend(intermediates.iter().cloned());
        let mut last = Error::InvalidCertificate(CertificateError::UnknownIssuer);
        for g in &self.groups {
            match verify_chain(&g.source.current().roots, &chain, webpki::KeyUsage::client_auth(), now) {
                Ok(()) => return Ok(ClientCertVerified::assertion()),
                // Expired or not yet valid says more than "unknown issuer" from another group.
                Err(e @ Error::InvalidCertificate(CertificateError::Expired | CertificateError::NotValidYet)) => {
                    last = e
                }
                Err(e) if matches!(last, Error::InvalidCertificate(CertificateError::UnknownIssuer)) => last = e,
                Err(_) => {}
            }
        }
        Err(last)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &crate::provider().signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &crate::provider().signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        crate::provider().signature_verification_algorithms.supported_schemes()
    }
}

/// Who a verified client is: the groups whose bundle its chain leads to, and its kvota
/// identity if a group that names identities vouched for it and the identity is of that
/// group's trust domain (the trust domain of the group's own certificate).
pub fn classify(chain: &[CertificateDer<'_>], groups: &[TrustGroup]) -> (Vec<&'static str>, Option<Identity>) {
    let now = UnixTime::now();
    let mut trusted_by = Vec::new();
    let mut identity = None;
    for g in groups {
        let loaded = g.source.current();
        if verify_chain(&loaded.roots, chain, webpki::KeyUsage::client_auth(), now).is_ok() {
            trusted_by.push(g.label);
            if g.names_identities && identity.is_none() {
                let td = loaded.identity.as_ref().map(|i| i.trust_domain().to_string());
                identity = chain
                    .first()
                    .and_then(|leaf| crate::identity::from_certificate(leaf).ok().flatten())
                    .filter(|id| td.as_deref() == Some(id.trust_domain()));
            }
        }
    }
    (trusted_by, identity)
}

/// Whether `identity` may act as `role` (an operator may also read as a viewer).
pub fn admits(identity: &Identity, roles: &[Role]) -> bool {
    roles.contains(&identity.role()) || (identity.role() == Role::Operator && roles.contains(&Role::Viewer))
}
