//! Certificates, keys and trust bundles read from PEM files, and reread when the files
//! change.
//!
//! A [`TlsSource`] holds what one party presents (its certificate chain and key) and
//! what it trusts (a bundle of one or more CA certificates). [`TlsSource::reload_if_changed`]
//! rereads the files when their modification times change; a new set that does not load
//! (a half-written file, an expired certificate, a key that does not match) is refused
//! and the previous one stays in use, so rotation never breaks a running party. Rotating
//! the CA: put old and new CA in the bundle everywhere, then reissue, then drop the old.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use rustls::RootCertStore;

use crate::identity::{self, Identity, Role};

/// Largest PEM file read (a bundle of a few hundred CA certificates fits easily).
pub const MAX_PEM_BYTES: u64 = 1 << 20;

/// How often running parties look at their certificate files for changes.
pub const RELOAD_CHECK: Duration = Duration::from_secs(2);

/// A bad certificate, key or CA file: which file, and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("read the {what} {}: {source}", path.display())]
    Read {
        /// Which file ("CA bundle", "certificate", "private key").
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file does not hold what it should.
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

/// Where a party's TLS files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsPaths {
    /// PEM bundle of the CA certificates to trust (one or more; during a CA rotation,
    /// old and new). `None`: trusts nothing (a webhook that verifies no clients).
    pub ca: Option<PathBuf>,
    /// PEM certificate chain this party presents (leaf first).
    pub cert: PathBuf,
    /// PEM private key of `cert` (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// One loaded set of files.
#[derive(Debug)]
pub struct Loaded {
    /// Increases with every successful load of the same source.
    pub generation: u64,
    /// The CA certificates trusted (empty without a CA file).
    pub roots: Arc<RootCertStore>,
    /// This party's chain and signing key.
    pub certified: Arc<CertifiedKey>,
    /// The kvota identity in this party's certificate (`None`: it names none, e.g. a
    /// webhook's serving certificate).
    pub identity: Option<Identity>,
    /// When this party's certificate expires (Unix seconds).
    pub not_after_unix: i64,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    let err = |source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(err)?;
    if meta.len() > MAX_PEM_BYTES {
        return Err(TlsError::Invalid {
            what,
            path: path.to_path_buf(),
            why: format!("{} bytes; a PEM file here is at most {MAX_PEM_BYTES}", meta.len()),
        });
    }
    std::fs::read(path).map_err(err)
}

/// Every certificate in a PEM file (at least one).
pub fn read_certificates(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(what, path)?;
    let invalid = |why: String| TlsError::Invalid {
        what,
        path: path.to_path_buf(),
        why,
    };
    let mut out = Vec::new();
    for c in CertificateDer::pem_slice_iter(&pem) {
        out.push(c.map_err(|e| invalid(format!("not a PEM certificate: {e}")))?);
    }
    if out.is_empty() {
        return Err(invalid(
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".to_string(),
        ));
    }
    Ok(out)
}

/// A trust bundle: every certificate in the file must be a usable trust anchor.
pub fn read_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let certs = read_certificates("CA bundle", path)?;
    let mut roots = RootCertStore::empty();
    for (i, c) in certs.into_iter().enumerate() {
        roots.add(c).map_err(|e| TlsError::Invalid {
            what: "CA bundle",
            path: path.to_path_buf(),
            why: format!("certificate {} is not a usable CA certificate: {e}", i + 1),
        })?;
    }
    Ok(roots)
}

/// Validity of a DER certificate as Unix seconds `(not_before, not_after)`.
pub fn validity(der: &[u8]) -> Result<(i64, i64), String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| format!("does not parse: {e}"))?;
    let v = cert.validity();
    Ok((v.not_before.timestamp(), v.not_after.timestamp()))
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Whether `chain` (leaf first) leads to one of `roots` at `now` for what a certificate
/// of `role` is used for: a node's serves and dials, every other role only dials.
fn chains_to(roots: &RootCertStore, chain: &[CertificateDer<'static>], role: Role, now: i64) -> Result<(), String> {
    let at = rustls::pki_types::UnixTime::since_unix_epoch(Duration::from_secs(u64::try_from(now).unwrap_or(0)));
    let usages = match role {
        Role::Node => vec![webpki::KeyUsage::server_auth(), webpki::KeyUsage::client_auth()],
        _ => vec![webpki::KeyUsage::client_auth()],
    };
    for usage in usages {
        crate::verify::verify_chain(roots, chain, usage, at)
            .map_err(|e| format!("does not chain to the CA bundle ({e})"))?;
    }
    Ok(())
}

/// Reads and checks one set of files: the chain parses, the key matches its leaf, the
/// leaf is valid now and names at most one kvota identity, the CA bundle (if any) holds
/// only usable CA certificates, and a certificate that names a federation identity
/// (node, cluster, operator, viewer) chains to that bundle: one from another CA would
/// be served or presented while every peer refuses it.
pub fn load(paths: &TlsPaths, generation: u64) -> Result<Loaded, TlsError> {
    let roots = match &paths.ca {
        Some(ca) => read_roots(ca)?,
        None => RootCertStore::empty(),
    };
    let chain = read_certificates("certificate", &paths.cert)?;
    let key_pem = read("private key", &paths.key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Invalid {
        what: "private key",
        path: paths.key.clone(),
        why: format!("no usable PEM private key (PKCS#8, PKCS#1 or SEC1): {e}"),
    })?;
    let cert_err = |why: String| TlsError::Invalid {
        what: "certificate",
        path: paths.cert.clone(),
        why,
    };
    let leaf = chain.first().ok_or_else(|| cert_err("empty chain".to_string()))?;
    let (not_before, not_after) = validity(leaf).map_err(cert_err)?;
    let now = unix_now();
    if now < not_before {
        return Err(cert_err(format!(
            "is not valid yet (valid from Unix time {not_before}; now {now}): check this machine's clock"
        )));
    }
    if now > not_after {
        return Err(cert_err(format!(
            "expired (valid until Unix time {not_after}; now {now}): issue a new one"
        )));
    }
    let identity = identity::from_certificate(leaf).map_err(|e| cert_err(e.0))?;
    let provider = crate::provider();
    let signer = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| TlsError::Invalid {
            what: "private key",
            path: paths.key.clone(),
            why: format!("not a key this build can sign with: {e}"),
        })?;
    if let Some(id) = &identity {
        chains_to(&roots, &chain, id.role(), now).map_err(|why| {
            cert_err(format!(
                "names {id} but {why}: a federation identity must be issued by the federation's CA ({})",
                paths
                    .ca
                    .as_ref()
                    .map_or_else(|| "no CA bundle given".to_string(), |p| p.display().to_string())
            ))
        })?;
    }
    let certified = CertifiedKey::new(chain, signer);
    certified.keys_match().map_err(|e| TlsError::Invalid {
        what: "private key",
        path: paths.key.clone(),
        why: format!("does not belong to the certificate {}: {e}", paths.cert.display()),
    })?;
    Ok(Loaded {
        generation,
        roots: Arc::new(roots),
        certified: Arc::new(certified),
        identity,
        not_after_unix: not_after,
    })
}

/// What tells a file changed: modification time, length and inode (a file replaced
/// within the file system's timestamp granularity, or a Kubernetes Secret volume's
/// symlink swap, still shows).
type Stamp = Option<(SystemTime, u64, u64)>;

fn stamp(p: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::metadata(p).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

/// A party's TLS files, loaded, and reloaded when they change. Cheap to share.
#[derive(Debug)]
pub struct TlsSource {
    paths: TlsPaths,
    current: RwLock<(Arc<Loaded>, [Stamp; 3])>,
    generation: AtomicU64,
}

impl TlsSource {
    /// Loads the files; an error here is fatal for the caller (it cannot serve without them).
    pub fn load(paths: TlsPaths) -> Result<Arc<TlsSource>, TlsError> {
        let times = Self::times(&paths);
        let loaded = load(&paths, 1)?;
        Ok(Arc::new(TlsSource {
            paths,
            current: RwLock::new((Arc::new(loaded), times)),
            generation: AtomicU64::new(1),
        }))
    }

    fn times(paths: &TlsPaths) -> [Stamp; 3] {
        [
            paths.ca.as_deref().and_then(stamp),
            stamp(&paths.cert),
            stamp(&paths.key),
        ]
    }

    /// The files this source reads.
    pub fn paths(&self) -> &TlsPaths {
        &self.paths
    }

    /// What is in force now.
    pub fn current(&self) -> Arc<Loaded> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
            .clone()
    }

    /// Whether the set in force can complete a handshake with the CA bundle in force:
    /// its certificate (if it names a federation identity) chains to the bundle and is
    /// valid now. It may stop being so while the process runs: the certificate expires,
    /// or its files were last loaded before this check existed in the bundle's form.
    pub fn check_served(&self) -> Result<(), String> {
        let cur = self.current();
        let Some(id) = &cur.identity else { return Ok(()) };
        chains_to(&cur.roots, &cur.certified.cert, id.role(), unix_now())
            .map_err(|why| format!("the certificate in force ({id}) {why}"))
    }

    /// This party's kvota identity (from its certificate in force).
    pub fn identity(&self) -> Option<Identity> {
        self.current().identity.clone()
    }

    /// Rereads the files if any changed: `Ok(true)` a new set is in force, `Ok(false)`
    /// nothing changed, `Err` the new files did not load (the previous set stays in
    /// force; tried again when the files change again).
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        let times = Self::times(&self.paths);
        {
            let cur = self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            if cur.1 == times {
                return Ok(false);
            }
        }
        let generation = self.generation.load(Ordering::SeqCst) + 1;
        let loaded = load(&self.paths, generation);
        let mut cur = self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        // Remember these times either way: a broken set is reported once, not every check.
        cur.1 = times;
        let loaded = loaded?;
        if let (Some(old), Some(new)) = (&cur.0.identity, &loaded.identity) {
            if old != new {
                // A party's identity is what others authorize; changing it under a running
                // process would silently change what it may do.
                return Err(TlsError::Invalid {
                    what: "certificate",
                    path: self.paths.cert.clone(),
                    why: format!("names {new}, but this process runs as {old}; restart it to change identity"),
                });
            }
        }
        self.generation.store(generation, Ordering::SeqCst);
        cur.0 = Arc::new(loaded);
        Ok(true)
    }

    /// Checks the files every [`RELOAD_CHECK`] until `stop` turns true, logging each
    /// reload and each refused set; `on_reload(ok)` is called for both (metrics).
    pub async fn watch(
        self: Arc<Self>,
        what: &'static str,
        on_reload: impl Fn(bool) + Send + 'static,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut every = tokio::time::interval(RELOAD_CHECK);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = every.tick() => {}
                _ = async { let _ = stop.wait_for(|s| *s).await; } => return,
            }
            match self.reload_if_changed() {
                Ok(false) => {}
                Ok(true) => {
                    let cur = self.current();
                    tracing::info!(
                        what,
                        generation = cur.generation,
                        not_after_unix = cur.not_after_unix,
                        "TLS files reloaded"
                    );
                    on_reload(true);
                }
                Err(e) => {
                    tracing::error!(what, error = %e, "new TLS files not loaded; the previous ones stay in use");
                    on_reload(false);
                }
            }
        }
    }
}

/// What a certificate names, for people (`kvota certs show`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    /// Subject distinguished name.
    pub subject: String,
    /// Issuer distinguished name.
    pub issuer: String,
    /// Subject alternative names: URIs, DNS names, IP addresses.
    pub sans: Vec<String>,
    /// Start of validity, UTC, for people.
    pub valid_from: String,
    /// End of validity, UTC, for people.
    pub valid_until: String,
}

/// Reads the names of a DER certificate.
pub fn describe(der: &[u8]) -> Result<Names, String> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| format!("does not parse: {e}"))?;
    let mut sans = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                GeneralName::URI(u) => sans.push(format!("URI:{u}")),
                GeneralName::DNSName(d) => sans.push(format!("DNS:{d}")),
                GeneralName::IPAddress(ip) => match ip.len() {
                    4 => sans.push(format!("IP:{}", std::net::Ipv4Addr::new(ip[0], ip[1], ip[2], ip[3]))),
                    16 => {
                        let mut b = [0u8; 16];
                        b.copy_from_slice(ip);
                        sans.push(format!("IP:{}", std::net::Ipv6Addr::from(b)));
                    }
                    _ => {}
                },
                other => sans.push(format!("{other:?}")),
            }
        }
    }
    let v = cert.validity();
    Ok(Names {
        subject: cert.subject().to_string(),
        issuer: cert.issuer().to_string(),
        sans,
        valid_from: v.not_before.to_string(),
        valid_until: v.not_after.to_string(),
    })
}
