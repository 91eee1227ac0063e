//! `kvota certs`: a federation CA and the certificates of its parties.

use std::io::Write as _;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use kvota_tls::issue::{new_ca, Ca, Issued, Kind};
use kvota_tls::Role;

/// `kvota certs ...`
#[derive(Debug, Subcommand)]
pub enum CertsCmd {
    /// Create the federation's CA (`ca.crt`, `ca.key`) in --dir. Refuses to replace an
    /// existing one: every certificate of the federation chains to it.
    Init(InitArgs),
    /// Issue a certificate and key signed by the CA in --dir, written as
    /// `<role>-<name>.crt` and `.key` (or --out). Replaces those files if they exist,
    /// atomically, so a running server or agent picks the new pair up.
    Issue(IssueArgs),
    /// Print what a certificate names: identity, names, validity, issuer.
    Show {
        /// PEM certificate file.
        file: PathBuf,
    },
    /// List the certificates (`*.crt`) in --dir: whom each names, when it expires, and
    /// which expire within --warn-days. Exit status 0; 3: one has expired or expires
    /// within --warn-days (for a cron job or a CI check).
    List(ListArgs),
    /// Renew certificates: issue each again with the same identity and names for
    /// --days more, with a new key, signed by the CA in --dir, replacing the
    /// certificate and its key (`FILE.key` beside it) atomically, so a running server
    /// or agent picks them up.
    Renew(RenewArgs),
    /// Write a certificate, its key and the CA as a PKCS#12 bundle (`.p12`), the form
    /// browsers and operating systems import client certificates in: for opening a
    /// node's dashboard directly (`https://NODE:HTTP-PORT/ui/`) with a viewer
    /// certificate. `kvota dashboard` needs none of this.
    P12(P12Args),
}

/// Options of `kvota certs list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Directory of the certificates.
    #[arg(long, default_value = "./kvota-certs")]
    dir: PathBuf,
    /// Mark certificates that expire within this many days.
    #[arg(long, default_value_t = 14)]
    warn_days: u32,
}

/// Options of `kvota certs renew`.
#[derive(Debug, Args)]
pub struct RenewArgs {
    /// PEM certificate files to renew (each with its key as `<stem>.key` beside it).
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// Directory holding the CA (`ca.crt`, `ca.key`) that signs the new certificates.
    #[arg(long, default_value = "./kvota-certs")]
    dir: PathBuf,
    /// Validity in days (default: 365 for nodes, clusters and webhooks, 90 for
    /// operators and viewers).
    #[arg(long)]
    days: Option<u32>,
}

/// Options of `kvota certs p12`.
#[derive(Debug, Args)]
pub struct P12Args {
    /// PEM certificate (a viewer's or an operator's).
    #[arg(long)]
    cert: PathBuf,
    /// Its PEM private key (PKCS#8, as `kvota certs issue` writes).
    #[arg(long)]
    key: PathBuf,
    /// The CA certificate to include, so the bundle carries the chain.
    #[arg(long)]
    ca: Option<PathBuf>,
    /// Where to write the bundle (mode 0600; not overwritten unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Read the bundle's password from this file (its first line). Without it (or
    /// KVOTA_P12_PASSWORD), a random password is made and printed once.
    #[arg(long, value_name = "FILE")]
    password_file: Option<PathBuf>,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
}

/// Options of `kvota certs init`.
#[derive(Debug, Args)]
pub struct InitArgs {
    /// Directory for the CA files (created if missing).
    #[arg(long, default_value = "./kvota-certs")]
    dir: PathBuf,
    /// The federation's name in every identity (spiffe://<trust-domain>/...): lowercase
    /// letters, digits, '.', '-', '_'.
    #[arg(long, default_value = "kvota")]
    trust_domain: String,
    /// Validity in days.
    #[arg(long, default_value_t = 3650)]
    days: u32,
}

/// What a certificate is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum CertRole {
    /// A control-plane node; --name is its node id.
    Node,
    /// A member cluster's agent; --name is the cluster id.
    Cluster,
    /// A person or pipeline that changes the policy and membership.
    Operator,
    /// A person, dashboard or Prometheus that reads.
    Viewer,
    /// An agent's admission webhook (server certificate for the Kubernetes API server);
    /// --name is its DNS name, e.g. kvota-agent.kvota-system.svc.
    Webhook,
}

/// Options of `kvota certs issue`.
#[derive(Debug, Args)]
pub struct IssueArgs {
    /// Directory holding the CA (`ca.crt`, `ca.key`); the new files go there too unless
    /// --out says otherwise.
    #[arg(long, default_value = "./kvota-certs")]
    dir: PathBuf,
    /// What the certificate is for.
    #[arg(long, value_enum)]
    role: CertRole,
    /// The node id, cluster id, person's name, or the webhook's DNS name.
    #[arg(long)]
    name: String,
    /// Extra DNS name to include (repeatable). kvota checks identities, not names; other
    /// tools (curl, Prometheus) may check these.
    #[arg(long)]
    dns: Vec<String>,
    /// Extra IP address to include (repeatable).
    #[arg(long)]
    ip: Vec<IpAddr>,
    /// Validity in days (default: 365 for nodes, clusters and webhooks, 90 for
    /// operators and viewers).
    #[arg(long)]
    days: Option<u32>,
    /// Path prefix of the files to write (`<out>.crt`, `<out>.key`).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Runs `kvota certs`.
pub fn run(cmd: CertsCmd) -> Result<std::process::ExitCode> {
    match cmd {
        CertsCmd::Init(a) => init(&a),
        CertsCmd::Issue(a) => issue(&a),
        CertsCmd::Show { file } => show(&file),
        CertsCmd::List(a) => return list(&a),
        CertsCmd::Renew(a) => renew(&a),
        CertsCmd::P12(a) => p12(&a),
    }
    .map(|()| std::process::ExitCode::SUCCESS)
}

/// Writes `text` to `path` through a temporary file and a rename, so a reader never sees
/// half a file; `secret` files get mode 0600.
fn write_atomically(path: &Path, text: &str, secret: bool) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()
    ));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&tmp)
        .with_context(|| format!("write {}", tmp.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("write {}", tmp.display()))?;
    f.sync_all().with_context(|| format!("sync {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("rename {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

fn init(a: &InitArgs) -> Result<()> {
    let (crt, key) = (a.dir.join("ca.crt"), a.dir.join("ca.key"));
    if key.exists() || crt.exists() {
        bail!(
            "{} already holds a CA: every certificate of the federation chains to it, so a new one would lock everyone out. \
             To rotate it, make the new CA in another directory, put both CA certificates in the bundle everyone trusts, reissue, then drop the old (docs/security.md)",
            a.dir.display()
        );
    }
    let ca = new_ca(&a.trust_domain, a.days).map_err(|e| anyhow::anyhow!("{e}"))?;
    write_atomically(&key, &ca.key_pem, true)?;
    write_atomically(&crt, &ca.cert_pem, false)?;
    out!(
        "CA of trust domain `{}` written: {} (share it), {} (keep it secret and offline)",
        a.trust_domain,
        crt.display(),
        key.display()
    );
    Ok(())
}

fn issue(a: &IssueArgs) -> Result<()> {
    let read = |p: PathBuf| {
        std::fs::read_to_string(&p).with_context(|| format!("read {} (make a CA with `kvota certs init`)", p.display()))
    };
    let ca =
        Ca::from_pem(&read(a.dir.join("ca.crt"))?, &read(a.dir.join("ca.key"))?).map_err(|e| anyhow::anyhow!("{e}"))?;
    let kind = match a.role {
        CertRole::Node => Kind::Party(Role::Node),
        CertRole::Cluster => Kind::Party(Role::Cluster),
        CertRole::Operator => Kind::Party(Role::Operator),
        CertRole::Viewer => Kind::Party(Role::Viewer),
        CertRole::Webhook => Kind::Webhook,
    };
    let days = a.days.unwrap_or_else(|| kind.default_days());
    let issued: Issued = ca
        .issue(&kind, &a.name, &a.dns, &a.ip, days)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let stem = a.out.clone().unwrap_or_else(|| {
        let role = format!("{:?}", a.role).to_lowercase();
        a.dir.join(format!("{role}-{}", a.name))
    });
    let (crt, key) = (stem.with_extension("crt"), stem.with_extension("key"));
    write_atomically(&key, &issued.key_pem, true)?;
    write_atomically(&crt, &issued.cert_pem, false)?;
    match &kind {
        Kind::Party(role) => out!(
            "{} written for spiffe://{}/{role}/{} (valid {days} days), key {}",
            crt.display(),
            ca.trust_domain(),
            a.name,
            key.display()
        ),
        Kind::Webhook => out!(
            "{} written for DNS name {} (valid {days} days), key {}",
            crt.display(),
            a.name,
            key.display()
        ),
    }
    Ok(())
}

fn show(file: &Path) -> Result<()> {
    let certs = kvota_tls::material::read_certificates("certificate", file).map_err(|e| anyhow::anyhow!("{e}"))?;
    for (i, der) in certs.iter().enumerate() {
        let (_, not_after) =
            kvota_tls::material::validity(der).map_err(|e| anyhow::anyhow!("certificate {}: {e}", i + 1))?;
        let identity =
            kvota_tls::identity::from_certificate(der).map_err(|e| anyhow::anyhow!("certificate {}: {e}", i + 1))?;
        let names = kvota_tls::material::describe(der).map_err(|e| anyhow::anyhow!("certificate {}: {e}", i + 1))?;
        out!("certificate {} of {}:", i + 1, certs.len());
        out!(
            "  identity:  {}",
            identity.map_or_else(|| "none (not a kvota party)".to_string(), |i| i.to_string())
        );
        out!("  subject:   {}", names.subject);
        out!("  issuer:    {}", names.issuer);
        out!(
            "  names:     {}",
            if names.sans.is_empty() {
                "-".to_string()
            } else {
                names.sans.join(", ")
            }
        );
        out!(
            "  valid:     {} .. {}{}",
            names.valid_from,
            names.valid_until,
            expiry_note(not_after)
        );
    }
    Ok(())
}

fn expiry_note(not_after: i64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let days = (not_after - now) / 86_400;
    if not_after < now {
        "  EXPIRED".to_string()
    } else {
        format!("  ({days} days left)")
    }
}

/// `kvota certs list`
fn list(a: &ListArgs) -> Result<std::process::ExitCode> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(&a.dir)
        .with_context(|| format!("read {}", a.dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "crt"))
        .collect();
    files.sort();
    if files.is_empty() {
        out!("no certificates (*.crt) in {}", a.dir.display());
        return Ok(std::process::ExitCode::SUCCESS);
    }
    let now = unix_now();
    let mut due = 0;
    let width = files
        .iter()
        .filter_map(|f| f.file_name().map(|n| n.to_string_lossy().len()))
        .max()
        .unwrap_or(4);
    out!("{:<width$} {:<48} {:<20} {:>6}", "FILE", "NAMES", "NOT AFTER", "DAYS");
    for f in &files {
        let der = kvota_tls::material::read_certificates("certificate", f)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .remove(0);
        let (_, not_after) =
            kvota_tls::material::validity(&der).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?;
        // A party's identity; else (a webhook's, the CA) the names it carries.
        let who = match kvota_tls::identity::from_certificate(&der) {
            Ok(Some(id)) => id.to_string(),
            _ => kvota_tls::material::describe(&der)
                .map(|n| n.sans.join(","))
                .unwrap_or_default(),
        };
        let days = (not_after - now).div_euclid(86_400);
        let mark = if not_after <= now {
            "  EXPIRED"
        } else if days < i64::from(a.warn_days) {
            "  renew soon"
        } else {
            ""
        };
        if !mark.is_empty() {
            due += 1;
        }
        out!(
            "{:<width$} {:<48} {:<20} {:>6}{mark}",
            f.file_name().map(|n| n.to_string_lossy()).unwrap_or_default(),
            who,
            kvota_fairness::units::format_unix_ms(u64::try_from(not_after).unwrap_or(0) * 1000),
            days
        );
    }
    if due > 0 {
        out!(
            "{due} certificate(s) expired or expiring within {} days: kvota certs renew FILE... --dir CA-DIR",
            a.warn_days
        );
        return Ok(std::process::ExitCode::from(3));
    }
    Ok(std::process::ExitCode::SUCCESS)
}

fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// What a certificate was issued as: its kind, name, DNS names and IP addresses.
fn issued_as(der: &[u8]) -> Result<(Kind, String, Vec<String>, Vec<IpAddr>)> {
    let names = kvota_tls::material::describe(der).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut dns: Vec<String> = names
        .sans
        .iter()
        .filter_map(|s| s.strip_prefix("DNS:"))
        .map(str::to_string)
        .collect();
    let ips: Vec<IpAddr> = names
        .sans
        .iter()
        .filter_map(|s| s.strip_prefix("IP:")?.parse().ok())
        .collect();
    match kvota_tls::identity::from_certificate(der).map_err(|e| anyhow::anyhow!("{e}"))? {
        Some(id) => Ok((Kind::Party(id.role()), id.name().to_string(), dns, ips)),
        None if !dns.is_empty() => {
            let name = dns.remove(0);
            Ok((Kind::Webhook, name, dns, ips))
        }
        None => bail!("it names no kvota identity and no DNS name: not a certificate `kvota certs` issues"),
    }
}

/// `kvota certs renew`
fn renew(a: &RenewArgs) -> Result<()> {
    let read = |p: PathBuf| {
        std::fs::read_to_string(&p).with_context(|| format!("read {} (the CA that signs the renewals)", p.display()))
    };
    let ca =
        Ca::from_pem(&read(a.dir.join("ca.crt"))?, &read(a.dir.join("ca.key"))?).map_err(|e| anyhow::anyhow!("{e}"))?;
    for f in &a.files {
        let der = kvota_tls::material::read_certificates("certificate", f)
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .remove(0);
        let (kind, name, dns, ips) = issued_as(&der).with_context(|| format!("{}", f.display()))?;
        let days = a.days.unwrap_or_else(|| kind.default_days());
        let issued = ca
            .issue(&kind, &name, &dns, &ips, days)
            .map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?;
        let key = f.with_extension("key");
        write_atomically(&key, &issued.key_pem, true)?;
        write_atomically(f, &issued.cert_pem, false)?;
        out!("{} renewed for {days} days (key {})", f.display(), key.display());
    }
    Ok(())
}

/// `kvota certs p12`
fn p12(a: &P12Args) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    if a.out.exists() && !a.force {
        bail!("{} exists; pass --force to replace it", a.out.display());
    }
    let mut chain: Vec<Vec<u8>> = kvota_tls::material::read_certificates("certificate", &a.cert)
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .into_iter()
        .map(|c| c.to_vec())
        .collect();
    if let Some(ca) = &a.ca {
        for c in kvota_tls::material::read_certificates("CA certificate", ca).map_err(|e| anyhow::anyhow!("{e}"))? {
            chain.push(c.to_vec());
        }
    }
    let pem = std::fs::read(&a.key).with_context(|| format!("read {}", a.key.display()))?;
    let key = kvota_tls::p12::pkcs8_from_pem(&pem).map_err(|e| anyhow::anyhow!("{}: {e}", a.key.display()))?;
    let name = match kvota_tls::identity::from_certificate(&chain[0]).map_err(|e| anyhow::anyhow!("{e}"))? {
        Some(id) => format!("kvota {id}"),
        None => "kvota".to_string(),
    };
    let (password, made) = match (&a.password_file, std::env::var("KVOTA_P12_PASSWORD")) {
        (Some(f), _) => (
            std::fs::read_to_string(f)
                .with_context(|| format!("read {}", f.display()))?
                .lines()
                .next()
                .unwrap_or_default()
                .to_string(),
            false,
        ),
        (None, Ok(p)) => (p, false),
        (None, Err(_)) => (random_password()?, true),
    };
    let bytes = kvota_tls::p12::bundle(&chain, &key, &name, &password).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&a.out)
        .with_context(|| format!("write {}", a.out.display()))?;
    f.write_all(&bytes)
        .with_context(|| format!("write {}", a.out.display()))?;
    f.sync_all().with_context(|| format!("sync {}", a.out.display()))?;
    out!(
        "{} written ({name}, {} certificate(s) and the key)",
        a.out.display(),
        chain.len()
    );
    if made {
        out!("password (shown once; the browser asks for it when importing): {password}");
    }
    Ok(())
}

/// 20 random letters and digits: about 119 bits.
fn random_password() -> Result<String> {
    const ALPHABET: &[u8] = b"ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz23456789";
    let mut raw = [0u8; 20];
    getrandom(&mut raw)?;
    Ok(raw
        .iter()
        .map(|b| ALPHABET[usize::from(*b) % ALPHABET.len()] as char)
        .collect())
}

fn getrandom(buf: &mut [u8]) -> Result<()> {
    use std::io::Read as _;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .context("read random bytes")
}
