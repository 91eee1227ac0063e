//! `kvota agent`: one member cluster's agent. The agent's options are its own
//! ([`kvota_member_agent::runtime::AgentOptions`]); this file checks them (and the
//! certificates) and builds the [`kvota_member_agent::runtime::Config`];
//! the runtime (`kvota_member_agent::runtime`) registers with the control plane,
//! reports usage through its journal, enforces leases and serves the admission webhook
//! over HTTPS, against a Kubernetes cluster or, with `--simulate`, a simulated one.

use anyhow::{bail, Context, Result};
use clap::Args;
use kvota_member_agent::runtime::{self, AgentOptions, Config};
use kvota_member_agent::webhook::WebhookTls;

/// Options of `kvota agent`: the agent's own ([`AgentOptions`], defined by the member
/// agent; `--cp*` are the binary's, shared with the other commands that call the control
/// plane).
#[derive(Debug, Args)]
pub struct AgentArgs {
    #[command(flatten)]
    pub(crate) options: AgentOptions,
}

/// `4x8,2x4` -> [8, 8, 8, 8, 4, 4].
fn parse_nodes(spec: &str) -> Result<Vec<u64>> {
    let mut nodes = Vec::new();
    for group in spec.split(',').map(str::trim).filter(|g| !g.is_empty()) {
        let (count, gpus) = group
            .split_once('x')
            .with_context(|| format!("--simulate {spec}: `{group}` is not COUNTxGPUS (e.g. 4x8)"))?;
        let count: u64 = count
            .parse()
            .with_context(|| format!("--simulate: `{count}` in `{group}` is not a node count"))?;
        let gpus: u64 = gpus
            .parse()
            .with_context(|| format!("--simulate: `{gpus}` in `{group}` is not a GPU count"))?;
        if count == 0 || gpus == 0 || count > 10_000 || gpus > 64 {
            bail!("--simulate: `{group}`: 1..=10000 nodes of 1..=64 GPUs");
        }
        nodes.extend(std::iter::repeat_n(gpus, usize::try_from(count).unwrap_or(0)));
    }
    if nodes.is_empty() {
        bail!("--simulate {spec}: no nodes (e.g. --simulate 4x8)");
    }
    Ok(nodes)
}

/// The cluster's name, once the flags that need more than clap's checks pass.
fn check_flags(args: &AgentOptions) -> Result<kvota_fairness::names::ClusterName> {
    let Ok(cluster) = kvota_fairness::names::ClusterName::parse(args.cluster.as_str()) else {
        bail!(
            "--cluster `{}`: use {}",
            args.cluster,
            kvota_fairness::names::DNS_LABEL_RULE
        );
    };
    if args.report_interval_ms < 100 {
        bail!("--report-interval-ms {}: at least 100", args.report_interval_ms);
    }
    let max_hold = kvota_member_agent::webhook::MAX_ADMISSION_HOLD.as_millis();
    if u128::from(args.admission_hold_ms) > max_hold {
        bail!(
            "--admission-hold-ms {}: at most {max_hold} (the API server stops waiting for the webhook after its timeoutSeconds, 5 in the shipped manifests); 0 turns holding off",
            args.admission_hold_ms
        );
    }
    let gap = kvota_member_agent::runtime::early_gap(std::time::Duration::from_millis(args.report_interval_ms));
    if args.admission_hold_ms > 0 && gap.as_millis() >= u128::from(args.admission_hold_ms) {
        tracing::warn!(
            admission_hold_ms = args.admission_hold_ms,
            early_report_gap_ms = u64::try_from(gap.as_millis()).unwrap_or(u64::MAX),
            "an early report comes no sooner than a fifth of --report-interval-ms after the last one, which is longer than --admission-hold-ms: held first denials will time out; lower the interval or raise the hold"
        );
    }
    Ok(cluster)
}

/// Refuses a federation certificate that is not this cluster's.
fn check_cluster_cert(federation: Option<&kvota_client::tls::GrpcTls>, cluster: &str) -> Result<()> {
    if let Some(f) = federation {
        let me = f.identity();
        let ok = me
            .as_ref()
            .is_some_and(|i| i.role() == kvota_tls::Role::Cluster && i.name() == cluster);
        if !ok {
            bail!(
                "--cp-cert {} names {}, but this agent is cluster `{}`: issue it with `kvota certs issue --role cluster --name {}`",
                f.source().paths().cert.display(),
                me.map_or_else(|| "no kvota identity".to_string(), |i| i.to_string()),
                cluster,
                cluster
            );
        }
    }
    Ok(())
}

/// The webhook port's connection limits, fit to the open-files limit.
fn webhook_limits(max_connections_per_peer: usize) -> kvota_tls::Limits {
    let files = kvota_tls::listen::raise_file_limit();
    let mut webhook_limits = kvota_tls::Limits {
        max_connections_per_peer: max_connections_per_peer.max(1),
        ..kvota_member_agent::webhook::default_limits()
    };
    let shrunk = kvota_tls::listen::fit_to_file_limit(files, &mut [(&mut webhook_limits, 1)]);
    tracing::info!(
        open_files_limit = ?files,
        webhook_max_connections = webhook_limits.max_connections,
        webhook_max_connections_per_peer = webhook_limits.max_connections_per_peer,
        "connection limits {}",
        if shrunk {
            "fit to the open-files limit, with a reserve for the journal, the kept state and outgoing connections"
        } else {
            "at their defaults, below the open-files limit"
        }
    );
    webhook_limits
}

/// Runs the agent until Ctrl-C or SIGTERM.
pub fn run(args: AgentArgs, cp: &crate::admin_cmd::Cp) -> Result<()> {
    let cluster = check_flags(&args.options)?;
    let nodes = args.options.simulate.as_deref().map(parse_nodes).transpose()?;
    // Certificate problems are reported before anything starts.
    let federation = cp.tls()?;
    check_cluster_cert(federation.as_ref(), &args.options.cluster)?;
    let tls = WebhookTls::load(
        &args.options.tls_cert,
        &args.options.tls_key,
        args.options.webhook_client_ca.as_deref(),
        federation.map(|f| f.source().clone()),
    )?;
    if cp.cp_ca.is_none() {
        tracing::warn!("no --cp-ca/--cp-cert/--cp-key: the agent talks to the control plane in plain text, without identities (the control plane must run with --insecure unless on loopback)");
    }
    let webhook_limits = webhook_limits(args.options.webhook_max_connections_per_peer);
    if !tls.verifies_apiserver() {
        tracing::warn!("no --webhook-client-ca: /validate and /mutate answer any client that reaches the webhook port; limit it to the API server (deploy/kubernetes NetworkPolicy) or give the API server a client certificate");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    crate::journal_v0::migrate(&args.options.data_dir)
        .map_err(|e| anyhow::anyhow!("migrate the usage journal in {}: {e}", args.options.data_dir.display()))?;
    let config = Config {
        cluster,
        cp_addrs: cp.addrs.clone(),
        webhook_limits,
        options: args.options,
    };
    match nodes {
        Some(nodes) => rt.block_on(runtime::serve_simulated(config, nodes, tls)),
        None => rt.block_on(runtime::kubernetes::serve(config, tls)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_groups_parse_and_bad_ones_are_explained() {
        assert_eq!(parse_nodes("2x8,1x4").expect("ok"), vec![8, 8, 4]);
        for bad in ["", "8", "0x8", "2x0", "axb", "2x100"] {
            assert!(parse_nodes(bad).is_err(), "{bad}");
        }
    }

    /// The agent reports the newest feature level its build reads; the binary holds
    /// both sides, so they are one number.
    #[test]
    fn the_agents_feature_level_is_the_control_planes() {
        assert_eq!(
            kvota_member_agent::revision::FEATURE_LEVEL,
            kvota_control_plane::feature::FeatureLevel::NEWEST.get()
        );
    }
}
