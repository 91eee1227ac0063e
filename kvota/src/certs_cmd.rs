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
pub fn run(cmd: CertsCmd) -> Result<()> {
    match cmd {
        CertsCmd::Init(a) => init(&a),
        CertsCmd::Issue(a) => issue(&a),
        CertsCmd::Show { file } => show(&file),
    }
}

/// Writes `text` to `path` through a temporary file and a rename, so a reader never sees
/// half a file; `secret` files get mode 0600.
fn write_atomically(path: &Path, text: &str, secret: bool) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let tmp = dir.join(format!(".{}.tmp", path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&tmp)
        .with_context(|| format!("write {}", tmp.display()))?;
    f.write_all(text.as_bytes()).with_context(|| format!("write {}", tmp.display()))?;
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
    out!("CA of trust domain `{}` written: {} (share it), {} (keep it secret and offline)", a.trust_domain, crt.display(), key.display());
    Ok(())
}

fn issue(a: &IssueArgs) -> Result<()> {
    let read = |p: PathBuf| std::fs::read_to_string(&p).with_context(|| format!("read {} (make a CA with `kvota certs init`)", p.display()));
    let ca = Ca::from_pem(&read(a.dir.join("ca.crt"))?, &read(a.dir.join("ca.key"))?).map_err(|e| anyhow::anyhow!("{e}"))?;
    let kind = match a.role {
        CertRole::Node => Kind::Party(Role::Node),
        CertRole::Cluster => Kind::Party(Role::Cluster),
        CertRole::Operator => Kind::Party(Role::Operator),
        CertRole::Viewer => Kind::Party(Role::Viewer),
        CertRole::Webhook => Kind::Webhook,
    };
    let days = a.days.unwrap_or_else(|| kind.default_days());
    let issued: Issued = ca.issue(&kind, &a.name, &a.dns, &a.ip, days).map_err(|e| anyhow::anyhow!("{e}"))?;
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
        Kind::Webhook => out!("{} written for DNS name {} (valid {days} days), key {}", crt.display(), a.name, key.display()),
    }
    Ok(())
}

fn show(file: &Path) -> Result<()> {
    let certs = kvota_tls::material::read_certificates("certificate", file).map_err(|e| anyhow::anyhow!("{e}"))?;
    for (i, der) in certs.iter().enumerate() {
        let (_, not_after) = kvota_tls::material::validity(der).map_err(|e| anyhow::anyhow!("certificate {}: {e}", i + 1))?;
        let identity = kvota_tls::identity::from_certificate(der).map_err(|e| anyhow::anyhow!("certificate {}: {e}", i + 1))?;
        let names = kvota_tls::material::describe(der).map_err(|e| anyhow::anyhow!("certificate {}: {e}", i + 1))?;
        out!("certificate {} of {}:", i + 1, certs.len());
        out!("  identity:  {}", identity.map_or_else(|| "none (not a kvota party)".to_string(), |i| i.to_string()));
        out!("  subject:   {}", names.subject);
        out!("  issuer:    {}", names.issuer);
        out!("  names:     {}", if names.sans.is_empty() { "-".to_string() } else { names.sans.join(", ") });
        out!("  valid:     {} .. {}{}", names.valid_from, names.valid_until, expiry_note(not_after));
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
