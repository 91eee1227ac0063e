//! Operator commands against a running control plane: `status`, `policy apply|get`,
//! `tenants`, `clusters`, `explain tenant`, `audit`, `members ...`, `cluster remove`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use kvota_client::client::Client;
use kvota_fairness::federation::{Command, Federation, TenantReport, UsageReport};
use kvota_fairness::names::TenantName;
use kvota_fairness::units::format_gpue;

/// Where the control plane is.
#[derive(Debug, Args, Clone)]
pub struct Cp {
    /// Control-plane gRPC addresses (any nodes; the client follows the leader), comma
    /// separated.
    #[arg(
        long = "cp",
        env = "KVOTA_CONTROL_PLANE",
        value_delimiter = ',',
        default_value = "127.0.0.1:7401",
        global = true
    )]
    pub addrs: Vec<String>,
    /// PEM file with the CA the control plane's certificates chain to: talk to it over
    /// mutual TLS (with --cp-cert and --cp-key; servers started with --tls-*).
    #[arg(long, env = "KVOTA_CP_CA", value_name = "FILE", global = true)]
    pub cp_ca: Option<PathBuf>,
    /// PEM certificate to present to the control plane (signed by that CA).
    #[arg(long, env = "KVOTA_CP_CERT", value_name = "FILE", global = true)]
    pub cp_cert: Option<PathBuf>,
    /// PEM private key of --cp-cert.
    #[arg(long, env = "KVOTA_CP_KEY", value_name = "FILE", global = true)]
    pub cp_key: Option<PathBuf>,
}

impl Cp {
    /// The mutual-TLS settings: all three files, or none (plain text).
    pub fn tls(&self) -> Result<Option<kvota_client::tls::GrpcTls>> {
        tls_from(
            "--cp",
            self.cp_ca.as_deref(),
            self.cp_cert.as_deref(),
            self.cp_key.as_deref(),
        )
    }
}

/// Reads `<flag>-ca`, `<flag>-cert` and `<flag>-key` if all are given; none: `None`.
pub fn tls_from(
    flag: &str,
    ca: Option<&std::path::Path>,
    cert: Option<&std::path::Path>,
    key: Option<&std::path::Path>,
) -> Result<Option<kvota_client::tls::GrpcTls>> {
    match (ca, cert, key) {
        (None, None, None) => Ok(None),
        (Some(ca), Some(cert), Some(key)) => kvota_client::tls::GrpcTls::from_files(ca, cert, key)
            .map(Some)
            .map_err(|e| anyhow::anyhow!("{e}")),
        _ => {
            let missing: Vec<String> = [("ca", ca.is_none()), ("cert", cert.is_none()), ("key", key.is_none())]
                .iter()
                .filter(|(_, m)| *m)
                .map(|(n, _)| format!("{flag}-{n}"))
                .collect();
            anyhow::bail!(
                "mutual TLS needs {flag}-ca, {flag}-cert and {flag}-key together; missing: {}",
                missing.join(", ")
            )
        }
    }
}
mod audit;
mod explain;
mod members;
mod policy;
mod read;
mod snapshot;
mod usage;

pub use audit::{audit, AuditFilter};
pub use explain::{explain, ExplainCmd};
pub use members::{cluster_remove, members, MembersCmd};
pub use policy::{policy_apply, policy_diff, policy_get, ApplyArgs};
pub use read::{clusters, status, tenants};
pub use snapshot::{snapshot, SnapshotCmd};
pub use usage::{parse_when, usage, UsageArgs, When};

/// How a read command prints its answer (`-o`): `json` and `yaml` are the HTTP API's
/// schema (`kvota_control_plane::view`), the same whoever asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// For people: aligned columns or sentences.
    Table,
    /// One JSON document, as the HTTP API answers.
    Json,
    /// The same as YAML.
    Yaml,
}

/// `-o table|json|yaml` (and the older `--json`).
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct OutputArg {
    /// Output: table (for people), json or yaml (the HTTP API's schema).
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    output: Output,
    /// The same as `-o json`.
    #[arg(long, hide = true)]
    json: bool,
}

impl OutputArg {
    /// The format asked for.
    pub fn format(&self) -> Output {
        if self.json {
            Output::Json
        } else {
            self.output
        }
    }

    /// Prints `v` as JSON or YAML and says so (`true`); `false`: print a table.
    fn print<T: serde::Serialize>(&self, v: &T) -> Result<bool> {
        match self.format() {
            Output::Table => Ok(false),
            Output::Json => {
                out!("{}", serde_json::to_string_pretty(v).context("encode JSON")?);
                Ok(true)
            }
            Output::Yaml => {
                outp!("{}", yaml(v)?);
                Ok(true)
            }
        }
    }
}

/// `v` as YAML with the JSON document's shape: through a JSON value, so an enum is a
/// map as in the JSON (not a YAML tag) and both outputs read the same.
fn yaml<T: serde::Serialize>(v: &T) -> Result<String> {
    let doc = serde_json::to_value(v).context("encode")?;
    serde_yaml_ng::to_string(&doc).context("encode YAML")
}

fn client(cp: &Cp) -> Result<Client> {
    Client::with_tls(&cp.addrs, cp.tls()?).map_err(|e| anyhow::anyhow!("{}", e.message()))
}

fn rt() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the async runtime")
}

/// A failed call as an operator reads it: what went wrong and what to check.
pub fn status_err(cp: &Cp, e: tonic::Status) -> anyhow::Error {
    // The transport's own words, down the source chain (TLS alerts are in there).
    let mut detail = e.message().to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let text = s.to_string();
        if !detail.contains(&text) {
            detail = format!("{detail}: {text}");
        }
        source = s.source();
    }
    // Not an answer from a server but the connection failing: refused, timed out, or a
    // peer that does not speak the same protocol (plain text against TLS: an h2 error).
    let transport = matches!(e.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded)
        || e.message().starts_with("h2 protocol error")
        || e.message().starts_with("transport error");
    let tls_hint = if cp.cp_ca.is_some() {
        "\n  (with TLS: --cp-ca must be the CA that signed the servers' certificates, their names must include the host in --cp, and --cp-cert must be signed by the CA the servers trust)"
    } else {
        "\n  (if the servers use mutual TLS (`kvota server --tls-*`), give --cp-ca, --cp-cert and --cp-key)"
    };
    // An HTTP server answered (a node's HTTP port, or another web server): its answer
    // carries no gRPC status.
    let http = detail.contains("grpc-status header missing")
        || detail.contains("mapped from HTTP status")
        || detail.contains("invalid content-type");
    match e.code() {
        _ if http => anyhow::anyhow!(
            "{} answered HTTP, not gRPC: --cp takes control-plane nodes' gRPC addresses (`kvota server --listen`, port 7401 in the examples), not their HTTP ones (`--http`, 7501: the dashboard, /metrics); the answer: {detail}",
            cp.addrs.join(","),
        ),
        _ if transport => anyhow::anyhow!(
            "control plane at {} is unavailable: {detail}\n  (is `kvota server` running there? set --cp or KVOTA_CONTROL_PLANE){tls_hint}",
            cp.addrs.join(","),
        ),
        _ => anyhow::anyhow!("{}", e.message()),
    }
}

fn pct_bp(bp: u32) -> String {
    if bp % 100 == 0 {
        format!("{}%", bp / 100)
    } else {
        format!("{}.{:02}%", bp / 100, bp % 100)
    }
}

/// An RFC 3339 time (UTC, seconds) for `ms` since the Unix epoch.
pub fn rfc3339(ms: u64) -> String {
    kvota_fairness::units::format_unix_ms(ms)
}

/// This machine's wall clock, ms since the Unix epoch.
pub fn wall_ms() -> u64 {
    u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis()),
    )
    .unwrap_or(u64::MAX)
}
