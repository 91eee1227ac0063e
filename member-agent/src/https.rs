//! A small HTTPS GET client for talking to an agent's port from the CLI
//! (`kvota explain pod --agent`): rustls with exactly the CA the operator names, no
//! system roots, bounded time and body size.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Limited};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};

/// Largest answer read.
pub const MAX_BODY: usize = 1 << 20;

/// Where to connect and whom to trust.
#[derive(Clone, Debug)]
pub struct Target {
    /// `https://host:port` (a path, if any, is ignored).
    pub base: String,
    /// PEM file with the CA (or self-signed certificate) the agent's certificate chains to.
    pub ca: std::path::PathBuf,
    /// Name to verify the certificate for; default: the URL's host.
    pub tls_name: Option<String>,
    /// A client certificate and key to present (PEM files): an agent with federation TLS
    /// answers `/explain` only to viewers, operators and nodes.
    pub client: Option<(std::path::PathBuf, std::path::PathBuf)>,
}

fn host_port(base: &str) -> Result<(String, u16), String> {
    let rest = base
        .strip_prefix("https://")
        .ok_or_else(|| format!("{base}: the agent's address must start with https://"))?;
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.is_empty() {
        return Err(format!("{base}: no host"));
    }
    // [v6]:port, host:port, or host.
    if let Some(v6) = authority.strip_prefix('[') {
        let (h, p) = v6
            .split_once(']')
            .ok_or_else(|| format!("{base}: unclosed [ in the address"))?;
        let port = match p.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| format!("{base}: bad port `{p}`"))?,
            None => 443,
        };
        return Ok((h.to_string(), port));
    }
    match authority.rsplit_once(':') {
        Some((h, p)) => Ok((h.to_string(), p.parse().map_err(|_| format!("{base}: bad port `{p}`"))?)),
        None => Ok((authority.to_string(), 443)),
    }
}

fn roots(ca: &Path) -> Result<rustls::RootCertStore, String> {
    let pem = std::fs::read(ca).map_err(|e| format!("read the CA file {}: {e}", ca.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&pem) {
        let c = c.map_err(|e| format!("{}: not a PEM certificate: {e}", ca.display()))?;
        roots
            .add(c)
            .map_err(|e| format!("{}: unusable certificate: {e}", ca.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("{}: no certificate in it", ca.display()));
    }
    Ok(roots)
}

/// GETs `path_and_query` from the target; returns the status code and body.
pub async fn get(t: &Target, path_and_query: &str, timeout: Duration) -> Result<(u16, Vec<u8>), String> {
    tokio::time::timeout(timeout, get_inner(t, path_and_query))
        .await
        .map_err(|_| format!("{} did not answer within {timeout:?}", t.base))?
}

async fn get_inner(t: &Target, path_and_query: &str) -> Result<(u16, Vec<u8>), String> {
    let (host, port) = host_port(&t.base)?;
    let name = t.tls_name.clone().unwrap_or_else(|| host.clone());
    let server_name = ServerName::try_from(name.clone())
        .map_err(|e| format!("`{name}` is not a name to verify a certificate for: {e}"))?;
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots(&t.ca)?);
    let cfg = match &t.client {
        None => cfg.with_no_client_auth(),
        Some((cert, key)) => {
            let read = |p: &Path| std::fs::read(p).map_err(|e| format!("read {}: {e}", p.display()));
            let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read(cert)?)
                .collect::<Result<_, _>>()
                .map_err(|e| format!("{}: not a PEM certificate: {e}", cert.display()))?;
            let key_der = rustls_pki_types::PrivateKeyDer::from_pem_slice(&read(key)?)
                .map_err(|e| format!("{}: no usable private key: {e}", key.display()))?;
            cfg.with_client_auth_cert(chain, key_der)
                .map_err(|e| format!("{} with {}: {e}", cert.display(), key.display()))?
        }
    };
    let tcp = tokio::net::TcpStream::connect((host.as_str(), port))
        .await
        .map_err(|e| format!("connect to {host}:{port}: {e}"))?;
    let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
        .connect(server_name, tcp)
        .await
        .map_err(|e| {
            format!(
                "TLS with {host}:{port} (verifying `{name}` against {}): {e}",
                t.ca.display()
            )
        })?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::get(path_and_query)
        .header(hyper::header::HOST, format!("{host}:{port}"))
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let resp = send
        .send_request(req)
        .await
        .map_err(|e| format!("request to {host}:{port}: {e}"))?;
    let status = resp.status().as_u16();
    let body = Limited::new(resp.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| format!("read the answer: {e}"))?
        .to_bytes();
    Ok((status, body.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_and_bad_ones_are_explained() {
        assert_eq!(
            host_port("https://agent.kvota-system:8443").expect("ok"),
            ("agent.kvota-system".into(), 8443)
        );
        assert_eq!(host_port("https://agent/explain").expect("ok"), ("agent".into(), 443));
        assert_eq!(host_port("https://[::1]:9443").expect("ok"), ("::1".into(), 9443));
        for bad in [
            "http://agent:8443",
            "agent:8443",
            "https://",
            "https://agent:port",
            "https://[::1",
        ] {
            assert!(host_port(bad).is_err(), "{bad}");
        }
    }
}
