//! Making a federation CA and certificates for its parties (`kvota certs`).
//!
//! The CA certificate carries its trust domain as a URI SAN (`spiffe://<trust-domain>`,
//! as SPIFFE CAs do), so issuing reads it from there. Keys are ECDSA P-256. Lifetimes
//! by default: the CA 10 years, nodes, clusters and webhooks 1 year, operators and
//! viewers 90 days (people's certificates are the ones that leak).

use std::net::IpAddr;

use rcgen::{
    BasicConstraints, Certificate, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

use crate::identity::{check_trust_domain, Identity, Role};

/// What a certificate is for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A federation party: its kvota identity is the certificate's URI SAN.
    Party(Role),
    /// An agent's admission webhook: a TLS server the Kubernetes API server calls,
    /// verified by DNS name (the `name` and every `--dns`).
    Webhook,
}

impl Kind {
    /// Default lifetime in days.
    pub fn default_days(&self) -> u32 {
        match self {
            Kind::Party(Role::Operator | Role::Viewer) => 90,
            _ => 365,
        }
    }
}

/// A certificate and its key, PEM.
#[derive(Clone, Debug)]
pub struct Issued {
    /// The certificate.
    pub cert_pem: String,
    /// Its private key (keep it secret: write it with mode 0600).
    pub key_pem: String,
}

/// Why issuing failed.
#[derive(Debug, thiserror::Error)]
pub enum IssueError {
    /// A name or the trust domain is not acceptable.
    #[error("{0}")]
    Name(String),
    /// The CA files do not load.
    #[error("the CA: {0}")]
    Ca(String),
    /// rcgen refused.
    #[error("make the certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
}

fn validity(params: &mut CertificateParams, days: u32) {
    let now = time::OffsetDateTime::now_utc();
    // Five minutes of slack for clocks a little behind the issuer's.
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + time::Duration::days(i64::from(days));
}

/// A new CA for `trust_domain`, valid `days` (default 3,650).
pub fn new_ca(trust_domain: &str, days: u32) -> Result<Issued, IssueError> {
    check_trust_domain(trust_domain).map_err(|e| IssueError::Name(e.0))?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, format!("kvota CA {trust_domain}"));
    dn.push(DnType::OrganizationName, "kvota");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.subject_alt_names = vec![SanType::URI(format!("spiffe://{trust_domain}").try_into()?)];
    validity(&mut params, days);
    let key = KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A loaded CA that can sign.
pub struct Ca {
    cert: Certificate,
    key: KeyPair,
    trust_domain: String,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca")
            .field("trust_domain", &self.trust_domain)
            .finish_non_exhaustive()
    }
}

impl Ca {
    /// Loads a CA made by [`new_ca`] from its PEM certificate and key.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca, IssueError> {
        let key = KeyPair::from_pem(key_pem).map_err(|e| IssueError::Ca(format!("key: {e}")))?;
        let params =
            CertificateParams::from_ca_cert_pem(cert_pem).map_err(|e| IssueError::Ca(format!("certificate: {e}")))?;
        let td = params
            .subject_alt_names
            .iter()
            .find_map(|s| match s {
                SanType::URI(u) => u.as_str().strip_prefix("spiffe://").map(str::to_string),
                _ => None,
            })
            .ok_or_else(|| IssueError::Ca("certificate names no trust domain (a spiffe://<trust-domain> URI); make it with `kvota certs init`".into()))?;
        check_trust_domain(&td).map_err(|e| IssueError::Ca(e.0))?;
        // Rebuilt from the same subject and key, it signs exactly as the file's certificate.
        let cert = params
            .self_signed(&key)
            .map_err(|e| IssueError::Ca(format!("key does not sign: {e}")))?;
        Ok(Ca {
            cert,
            key,
            trust_domain: td,
        })
    }

    /// The federation's trust domain.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// A certificate for `name` of `kind`, valid `days`, with extra DNS names and IP
    /// addresses (for tools that check host names; kvota itself checks identities).
    pub fn issue(
        &self,
        kind: &Kind,
        name: &str,
        dns: &[String],
        ips: &[IpAddr],
        days: u32,
    ) -> Result<Issued, IssueError> {
        let now = time::OffsetDateTime::now_utc();
        // Five minutes of slack for clocks a little behind the issuer's.
        self.issue_between(
            kind,
            name,
            dns,
            ips,
            now - time::Duration::minutes(5),
            now + time::Duration::days(i64::from(days)),
        )
    }

    /// [`Ca::issue`] with an explicit validity period (tests make expired and
    /// not-yet-valid certificates with it).
    pub fn issue_between(
        &self,
        kind: &Kind,
        name: &str,
        dns: &[String],
        ips: &[IpAddr],
        not_before: time::OffsetDateTime,
        not_after: time::OffsetDateTime,
    ) -> Result<Issued, IssueError> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        let mut sans = Vec::new();
        match kind {
            Kind::Party(role) => {
                let id = Identity::new(&self.trust_domain, *role, name).map_err(|e| IssueError::Name(e.0))?;
                sans.push(SanType::URI(id.uri().try_into()?));
                params.extended_key_usages = match role {
                    // A node serves (gRPC, Raft, HTTP) and dials its peers.
                    Role::Node => vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth],
                    _ => vec![ExtendedKeyUsagePurpose::ClientAuth],
                };
            }
            Kind::Webhook => {
                if name.is_empty() || name.len() > 253 {
                    return Err(IssueError::Name(format!(
                        "webhook name `{name}`: a DNS name (e.g. kvota-agent.kvota-system.svc)"
                    )));
                }
                sans.push(SanType::DnsName(name.try_into()?));
                params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
            }
        }
        for d in dns {
            sans.push(SanType::DnsName(d.as_str().try_into()?));
        }
        for ip in ips {
            sans.push(SanType::IpAddress(*ip));
        }
        params.subject_alt_names = sans;
        params.not_before = not_before;
        params.not_after = not_after;
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.cert, &self.key)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}
