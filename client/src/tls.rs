//! Mutual TLS between the parties of the federation, by identity (see `kvota_tls`):
//! every certificate comes from the federation's CA and names one
//! `spiffe://<trust-domain>/<role>/<name>`. A node serves its gRPC API, its Raft port and
//! its HTTP port with its node certificate; agents, operators and viewers present
//! theirs, and each request is authorized by role ([`crate::auth`]). Clients accept a
//! server only if it is a node of their trust domain (the Raft client: only the node it
//! means to reach), whatever its address.
//!
//! Certificate, key and CA bundle are reread when the files change (see
//! [`kvota_tls::TlsSource`]); a new connection uses what is in force.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kvota_tls::connect::{client_config, Connector};
use kvota_tls::{Expect, Identity, TlsPaths, TlsSource};
use tonic::transport::Channel;

pub use kvota_tls::TlsError;

/// This party's TLS files (loaded; reread on change). Cheap to clone.
#[derive(Clone, Debug)]
pub struct GrpcTls {
    source: Arc<TlsSource>,
}

impl GrpcTls {
    /// Reads and checks the three PEM files: `ca` (the CA bundle to trust), `cert` (this
    /// party's certificate chain, which must name a kvota identity) and `key`.
    pub fn from_files(ca: &Path, cert: &Path, key: &Path) -> Result<GrpcTls, TlsError> {
        let source = TlsSource::load(TlsPaths {
            ca: Some(ca.to_path_buf()),
            cert: cert.to_path_buf(),
            key: key.to_path_buf(),
        })?;
        if source.identity().is_none() {
            return Err(TlsError::Invalid {
                what: "certificate",
                path: cert.to_path_buf(),
                why: "names no kvota identity (a URI SAN spiffe://<trust-domain>/<role>/<name>); issue it with `kvota certs issue`".into(),
            });
        }
        Ok(GrpcTls { source })
    }

    /// A party's TLS from files already loaded (shared with whatever else uses them, so
    /// one watcher reloads them for all).
    pub fn from_source(source: Arc<TlsSource>) -> GrpcTls {
        GrpcTls { source }
    }

    /// The files and what is loaded from them.
    pub fn source(&self) -> &Arc<TlsSource> {
        &self.source
    }

    /// This party's identity.
    pub fn identity(&self) -> Option<Identity> {
        self.source.identity()
    }

    /// A connector presenting this party's certificate and accepting only `expect`.
    pub fn connector(&self, expect: Expect) -> Connector {
        Connector::new(Some(client_config(self.source.clone(), expect, &[b"h2"])))
    }
}

/// A lazily connecting channel to the gRPC address `addr` (`host:port`): mutual TLS
/// accepting only `expect` with `tls`, plain text without.
pub fn channel(
    addr: &str,
    tls: Option<&GrpcTls>,
    expect: Expect,
    connect_timeout: Duration,
    request_timeout: Duration,
) -> Result<Channel, String> {
    let connector = match tls {
        Some(t) => t.connector(expect),
        None => Connector::new(None),
    };
    kvota_tls::connect::channel(addr, &connector, connect_timeout, request_timeout)
}
