//! Mutual TLS on the control plane's gRPC port: one CA signs every party's certificate
//! (the servers, the agents, the operators' CLI). A server with TLS accepts only clients
//! that present a certificate from that CA, and its peers, agents and CLI check the
//! server's certificate against it (its names must include the host they dial). So only
//! holders of a certificate can report usage, change the policy or join the Raft group.
//!
//! Certificates are read once at start; rotate them by restarting (one node at a time).

use std::path::{Path, PathBuf};

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// A bad certificate, key or CA file: which file, and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("read the {what} {}: {source}", path.display())]
    Read {
        /// Which file ("CA certificate", ...).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file holds no usable PEM of the expected kind.
    #[error("the {what} {}: {why}", path.display())]
    Invalid {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What is wrong, in words.
        why: String,
    },
}

/// The CA to trust and this party's certificate and key (PEM).
#[derive(Clone, Debug)]
pub struct GrpcTls {
    ca: Certificate,
    identity: Identity,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { what, path: path.to_path_buf(), source })
}

fn certificates(what: &'static str, path: &Path, pem: &[u8]) -> Result<(), TlsError> {
    let invalid = |why: String| TlsError::Invalid { what, path: path.to_path_buf(), why };
    let mut n = 0;
    for c in CertificateDer::pem_slice_iter(pem) {
        c.map_err(|e| invalid(format!("not a PEM certificate: {e}")))?;
        n += 1;
    }
    if n == 0 {
        return Err(invalid("holds no PEM certificate (-----BEGIN CERTIFICATE-----)".to_string()));
    }
    Ok(())
}

impl GrpcTls {
    /// Reads and checks the three PEM files: `ca` (the CA certificate(s) to trust),
    /// `cert` (this party's certificate chain) and `key` (its private key).
    pub fn from_files(ca: &Path, cert: &Path, key: &Path) -> Result<GrpcTls, TlsError> {
        let ca_pem = read("CA certificate", ca)?;
        let cert_pem = read("certificate", cert)?;
        let key_pem = read("private key", key)?;
        certificates("CA certificate", ca, &ca_pem)?;
        certificates("certificate", cert, &cert_pem)?;
        PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Invalid {
            what: "private key",
            path: key.to_path_buf(),
            why: format!("no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
        })?;
        Ok(GrpcTls { ca: Certificate::from_pem(ca_pem), identity: Identity::from_pem(cert_pem, key_pem) })
    }

    /// The server side: present our certificate, require one from the CA.
    pub fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.identity.clone()).client_ca_root(self.ca.clone())
    }

    /// The client side: check the server against the CA, present our certificate.
    pub fn client(&self) -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(self.ca.clone()).identity(self.identity.clone())
    }
}

/// An endpoint for the gRPC address `host:port`: `https` with `tls`, else `http`.
pub fn endpoint(addr: &str, tls: Option<&GrpcTls>) -> Result<Endpoint, String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let ep = Endpoint::from_shared(format!("{scheme}://{addr}")).map_err(|e| format!("bad address {addr}: {e}"))?;
    match tls {
        Some(t) => ep.tls_config(t.client()).map_err(|e| format!("TLS settings for {addr}: {e}")),
        None => Ok(ep),
    }
}
