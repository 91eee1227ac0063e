//! Who a certificate names: one SPIFFE ID per certificate, as a URI SAN.
//!
//! ```text
//! spiffe://<trust-domain>/node/<id>          a control-plane node (Raft, forwarding)
//! spiffe://<trust-domain>/cluster/<name>     a member cluster's agent
//! spiffe://<trust-domain>/operator/<name>    a person or pipeline that changes things
//! spiffe://<trust-domain>/viewer/<name>      a person, dashboard or scraper that reads
//! ```
//!
//! The trust domain is the federation's name (`kvota certs init --trust-domain`); a
//! party accepts only identities of its own trust domain, which it reads from its own
//! certificate. Names follow the rules of what they name: a node id is a number > 0, a
//! cluster name is the cluster id of the federation (a DNS label), an operator or viewer
//! name is 1 to 128 of `a-z A-Z 0-9 . - _ @`.

use std::fmt;
use std::str::FromStr;

/// The longest trust domain accepted (SPIFFE allows 255 bytes).
pub const MAX_TRUST_DOMAIN: usize = 255;
/// The longest operator or viewer name accepted.
pub const MAX_PERSON_NAME: usize = 128;

/// What an identity may do. Every RPC and HTTP route names the roles it admits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// A control-plane node: Raft traffic and writes forwarded by another node.
    Node,
    /// A member cluster's agent: the member service, for its own cluster only.
    Cluster,
    /// Policy and membership changes, and everything a viewer may read.
    Operator,
    /// Reads: status, tenants, clusters, audit, metrics, the dashboard.
    Viewer,
}

impl Role {
    /// Every role, in the order of the URI scheme's documentation.
    pub const ALL: [Role; 4] = [Role::Node, Role::Cluster, Role::Operator, Role::Viewer];

    /// The path segment naming the role (`node`, `cluster`, `operator`, `viewer`).
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Node => "node",
            Role::Cluster => "cluster",
            Role::Operator => "operator",
            Role::Viewer => "viewer",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = IdentityError;
    fn from_str(s: &str) -> Result<Role, IdentityError> {
        Role::ALL.into_iter().find(|r| r.as_str() == s).ok_or_else(|| {
            IdentityError(format!(
                "unknown role `{}` (node, cluster, operator or viewer)",
                clip(s)
            ))
        })
    }
}

/// Why a string is not a kvota identity.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct IdentityError(pub String);

/// One party of the federation, as its certificate names it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Identity {
    trust_domain: String,
    role: Role,
    name: String,
}

fn clip(s: &str) -> String {
    s.chars().take(64).collect()
}

/// A SPIFFE trust domain: 1-255 of lowercase letters, digits, `.`, `-`, `_`.
pub fn check_trust_domain(td: &str) -> Result<(), IdentityError> {
    if td.is_empty() || td.len() > MAX_TRUST_DOMAIN {
        return Err(IdentityError(format!(
            "trust domain must be 1 to {MAX_TRUST_DOMAIN} bytes"
        )));
    }
    if !td
        .bytes()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'.' | b'-' | b'_'))
    {
        return Err(IdentityError(format!(
            "trust domain `{}`: use lowercase letters, digits, '.', '-' and '_'",
            clip(td)
        )));
    }
    Ok(())
}

/// Checks a name for `role` (see the module docs).
pub fn check_name(role: Role, name: &str) -> Result<(), IdentityError> {
    let ok = match role {
        Role::Node => name.parse::<u64>().is_ok_and(|n| n > 0) && !name.starts_with('0') && !name.starts_with('+'),
        Role::Cluster => kvota_fairness::names::is_dns_label(name),
        Role::Operator | Role::Viewer => {
            !name.is_empty()
                && name.len() <= MAX_PERSON_NAME
                && name
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'_' | b'@'))
        }
    };
    if ok {
        return Ok(());
    }
    let rule = match role {
        Role::Node => "a node id: a number > 0 without leading zeros".to_string(),
        Role::Cluster => format!("a cluster id: {}", kvota_fairness::names::DNS_LABEL_RULE),
        Role::Operator | Role::Viewer => format!("1 to {MAX_PERSON_NAME} of letters, digits, '.', '-', '_' and '@'"),
    };
    Err(IdentityError(format!("{role} name `{}` is not {rule}", clip(name))))
}

impl Identity {
    /// An identity, checked.
    pub fn new(trust_domain: &str, role: Role, name: &str) -> Result<Identity, IdentityError> {
        check_trust_domain(trust_domain)?;
        check_name(role, name)?;
        Ok(Identity {
            trust_domain: trust_domain.to_string(),
            role,
            name: name.to_string(),
        })
    }

    /// The node identity `node/<id>`.
    pub fn node(trust_domain: &str, id: u64) -> Result<Identity, IdentityError> {
        Identity::new(trust_domain, Role::Node, &id.to_string())
    }

    /// The federation this identity belongs to.
    pub fn trust_domain(&self) -> &str {
        &self.trust_domain
    }

    /// What it may do.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The node id, cluster id or person's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The node id, for a node identity.
    pub fn node_id(&self) -> Option<u64> {
        (self.role == Role::Node).then(|| self.name.parse().ok()).flatten()
    }

    /// The SPIFFE URI: `spiffe://<trust-domain>/<role>/<name>`.
    pub fn uri(&self) -> String {
        format!("spiffe://{}/{}/{}", self.trust_domain, self.role, self.name)
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri())
    }
}

impl FromStr for Identity {
    type Err = IdentityError;
    /// Parses `spiffe://<trust-domain>/<role>/<name>` and nothing else (no query, no
    /// fragment, no port, no user, exactly two path segments).
    fn from_str(uri: &str) -> Result<Identity, IdentityError> {
        let bad = |why: &str| IdentityError(format!("`{}` is not a kvota identity: {why}", clip(uri)));
        if uri.len() > MAX_TRUST_DOMAIN + MAX_PERSON_NAME + 32 {
            return Err(bad("too long"));
        }
        let rest = uri
            .strip_prefix("spiffe://")
            .ok_or_else(|| bad("it must start with spiffe://"))?;
        let mut parts = rest.split('/');
        let (td, role, name) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(td), Some(role), Some(name), None) => (td, role, name),
            _ => return Err(bad("expected spiffe://<trust-domain>/<role>/<name>")),
        };
        let role: Role = role.parse().map_err(|e: IdentityError| bad(&e.0))?;
        Identity::new(td, role, name).map_err(|e| bad(&e.0))
    }
}

/// The kvota identity in a DER certificate, if it carries exactly one URI SAN that is a
/// kvota identity. A certificate with several such URIs names no one (which of them
/// would it act as?); URIs of other schemes are ignored.
pub fn from_certificate(der: &[u8]) -> Result<Option<Identity>, IdentityError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| IdentityError(format!("certificate does not parse: {e}")))?;
    let mut found: Option<Identity> = None;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| IdentityError(format!("certificate's subjectAltName does not parse: {e}")))?;
    let Some(san) = san else { return Ok(None) };
    for name in &san.value.general_names {
        if let x509_parser::extensions::GeneralName::URI(u) = name {
            if !u.starts_with("spiffe://") {
                continue;
            }
            let id: Identity = u.parse()?;
            if found.is_some() {
                return Err(IdentityError(
                    "certificate carries more than one spiffe:// URI".to_string(),
                ));
            }
            found = Some(id);
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn identities_round_trip_and_name_their_parts() {
        let id: Identity = "spiffe://prod.gpu/node/3".parse().expect("parse");
        assert_eq!(
            (id.trust_domain(), id.role(), id.name(), id.node_id()),
            ("prod.gpu", Role::Node, "3", Some(3))
        );
        assert_eq!(id.uri(), "spiffe://prod.gpu/node/3");
        let c = Identity::new("kvota", Role::Cluster, "gpu-east").expect("ok");
        assert_eq!(c.to_string().parse::<Identity>().expect("back"), c);
        assert_eq!(c.node_id(), None);
        let o: Identity = "spiffe://kvota/operator/alice@example.com"
            .parse()
            .expect("email-like name");
        assert_eq!(o.role(), Role::Operator);
    }

    #[test]
    fn malformed_identities_are_refused_with_the_reason() {
        for (uri, why) in [
            ("https://kvota/node/1", "spiffe://"),
            ("spiffe://kvota/node", "expected spiffe://"),
            ("spiffe://kvota/node/1/x", "expected spiffe://"),
            ("spiffe://kvota/admin/root", "unknown role"),
            ("spiffe://kvota/node/0", "node id"),
            ("spiffe://kvota/node/01", "node id"),
            ("spiffe://kvota/node/18446744073709551616", "node id"),
            ("spiffe://kvota/cluster/Gpu_East", "cluster id"),
            ("spiffe://kvota/cluster/", "cluster id"),
            ("spiffe://KVOTA/viewer/bob", "trust domain"),
            ("spiffe:///viewer/bob", "trust domain"),
            ("spiffe://kvota/viewer/bob smith", "letters"),
            ("spiffe://kvota:443/viewer/bob", "trust domain"),
            ("spiffe://kvota/viewer/bob?x=1", "letters"),
        ] {
            let e = uri.parse::<Identity>().expect_err(uri);
            assert!(e.0.contains(why), "{uri}: {e}");
        }
    }

    proptest! {
        /// Whatever the string, parsing answers (no panic), and what parses prints back
        /// to the same string.
        #[test]
        fn parsing_any_string_never_panics_and_round_trips(s in ".{0,80}", tail in "[a-z0-9/.@_-]{0,30}") {
            for cand in [s.clone(), format!("spiffe://{tail}"), format!("spiffe://kvota/{tail}")] {
                if let Ok(id) = cand.parse::<Identity>() {
                    prop_assert_eq!(id.uri(), cand);
                }
            }
        }
    }
}
