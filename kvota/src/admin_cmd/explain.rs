//! `kvota explain tenant|pod`.

use anyhow::{bail, Context, Result};
use kvota_client::client::Client;
use kvota_proto::v1;

use super::*;

/// `kvota explain ...`
#[derive(Debug, Subcommand)]
pub enum ExplainCmd {
    /// Every number behind a tenant's entitlement and budgets.
    Tenant {
        /// Tenant name.
        name: String,
        #[command(flatten)]
        out: OutputArg,
    },
    /// Why a pod was admitted, queued or denied. Agents send their decisions about GPU
    /// pods to the control plane with their usage reports, so any node answers (the
    /// last 512 decisions per cluster are kept); without a reported decision, the
    /// numbers of the pod's tenant. With --agent and --agent-ca, the agent itself
    /// answers, also with where the pod stands now.
    Pod {
        /// NAMESPACE/NAME, as in the denial or queue message.
        pod: String,
        /// Only the decision of this member cluster's agent (default: every cluster's).
        #[arg(long, value_name = "CLUSTER", conflicts_with = "agent")]
        cluster: Option<String>,
        /// The agent's webhook address, e.g. https://kvota-agent.kvota-system.svc:443 or,
        /// through `kubectl -n kvota-system port-forward svc/kvota-agent 8443:443`,
        /// https://localhost:8443 (with --agent-tls-name).
        #[arg(long, env = "KVOTA_AGENT", value_name = "URL")]
        agent: Option<String>,
        /// PEM file with the CA the agent's serving certificate chains to (the webhook's
        /// caBundle).
        #[arg(long, env = "KVOTA_AGENT_CA", value_name = "FILE", requires = "agent")]
        agent_ca: Option<std::path::PathBuf>,
        /// Name to verify the agent's certificate for (default: the host in --agent).
        #[arg(long, value_name = "NAME", requires = "agent")]
        agent_tls_name: Option<String>,
        /// JSON and YAML: the agent's answer with --agent; else the reported decisions,
        /// `{kept, decisions: [{cluster, pod, tenant, verdict, gpus, at_ms, text}]}`, as
        /// the HTTP API's `/api/v1/decisions` answers.
        #[command(flatten)]
        out: OutputArg,
    },
}

/// `kvota explain tenant NAME`
pub fn explain(cp: &Cp, cmd: &ExplainCmd) -> Result<()> {
    let (name, o) = match cmd {
        ExplainCmd::Tenant { name, out } => (name, out),
        ExplainCmd::Pod {
            pod,
            cluster,
            agent,
            agent_ca,
            agent_tls_name,
            out,
        } => {
            return explain_pod(
                cp,
                pod,
                cluster.as_deref(),
                agent.as_deref(),
                agent_ca.as_deref(),
                agent_tls_name.clone(),
                *out,
            )
        }
    };
    let c = client(cp)?;
    let tenant = name.clone();
    let r = rt()?
        .block_on(c.call(|ch| {
            let tenant = tenant.clone();
            async move {
                Ok(Client::admin(ch)
                    .explain_tenant(v1::ExplainTenantRequest { tenant })
                    .await?
                    .into_inner())
            }
        }))
        .map_err(|e| status_err(cp, e))?;
    if o.format() != Output::Table {
        o.print(&explanation(r)?)?;
    } else {
        out!("{}", r.text);
    }
    Ok(())
}

/// `kvota explain pod`: the agent's record of the decision when an agent is named; the
/// control plane's view of the pod's tenant otherwise.
fn explain_pod(
    cp: &Cp,
    pod: &str,
    cluster: Option<&str>,
    agent: Option<&str>,
    agent_ca: Option<&std::path::Path>,
    tls_name: Option<String>,
    o: OutputArg,
) -> Result<()> {
    let (namespace, _) = pod
        .split_once('/')
        .filter(|(n, p)| !n.is_empty() && !p.is_empty() && !p.contains('/'))
        .with_context(|| format!("`{pod}`: expected NAMESPACE/NAME (as in the admission message)"))?;
    if let Some(base) = agent {
        return ask_agent(cp, pod, base, agent_ca, tls_name, o);
    }
    // No agent: the decisions the agents reported, from the control plane.
    let c = client(cp)?;
    let rt = rt()?;
    let req = v1::ExplainPodRequest {
        pod: pod.to_string(),
        cluster: cluster.unwrap_or_default().to_string(),
    };
    let reported = rt
        .block_on(c.call(|ch| {
            let req = req.clone();
            async move { Ok(Client::admin(ch).explain_pod(req).await?.into_inner()) }
        }))
        .map_err(|e| status_err(cp, e))?;
    let view = kvota_control_plane::view::DecisionsView::from(&reported);
    if o.print(&view)? {
        return Ok(());
    }
    if !view.decisions.is_empty() {
        for d in &view.decisions {
            out!(
                "decided by the agent of cluster `{}` {}:",
                d.cluster,
                decided_when(d.at_ms, wall_ms())
            );
            out!("{}", d.text);
        }
        out!("where it stands now: kvota explain pod {pod} --agent https://AGENT:PORT --agent-ca CA.crt");
        return Ok(());
    }
    if reported.kept {
        out!("the control plane has no reported decision about {pod}{}: its agent has not judged it, has not reported since, or it was judged more than 512 decisions ago.", cluster.map(|c| format!(" in cluster `{c}`")).unwrap_or_default());
    }
    explain_namespace(cp, &c, &rt, pod, namespace)
}

/// `explain pod --agent`: the agent's own record of its decision, and where the pod
/// stands now.
fn ask_agent(
    cp: &Cp,
    pod: &str,
    base: &str,
    agent_ca: Option<&std::path::Path>,
    tls_name: Option<String>,
    o: OutputArg,
) -> Result<()> {
    let ca = agent_ca.context(
        "--agent needs --agent-ca FILE (or KVOTA_AGENT_CA): the CA of the agent's serving certificate, the webhook's caBundle",
    )?;
    // Present the operator's federation certificate when there is one: an agent with
    // federation TLS explains pods only to viewers, operators and nodes.
    let client = cp.cp_cert.clone().zip(cp.cp_key.clone());
    let target = kvota_member_agent::https::Target {
        base: base.to_string(),
        ca: ca.to_path_buf(),
        tls_name,
        client,
    };
    let path = format!("/explain?pod={}", percent_encode(pod));
    let (status, body) = rt()?
        .block_on(kvota_member_agent::https::get(
            &target,
            &path,
            std::time::Duration::from_secs(10),
        ))
        .map_err(|e| anyhow::anyhow!("ask the agent at {base}: {e}"))?;
    let v: serde_json::Value = serde_json::from_slice(&body).with_context(|| {
        format!("the agent at {base} answered {status} with something that is not JSON; is it a kvota agent?")
    })?;
    if status != 200 {
        bail!(
            "{}",
            v["error"].as_str().unwrap_or("the agent could not explain this pod")
        );
    }
    if !o.print(&v)? {
        let e: kvota_member_agent::state::PodExplanation =
            serde_json::from_value(v).context("decode the agent's answer")?;
        out!("{}", e.text);
        out!(
            "  decided {} ago; now: {}",
            kvota_fairness::units::format_duration_ms(e.decided_ago_ms),
            e.now
        );
    }
    Ok(())
}

/// No decision reported: the pod's tenant as the control plane sees it, from its
/// namespace, and how to ask the agent.
fn explain_namespace(cp: &Cp, c: &Client, rt: &tokio::runtime::Runtime, pod: &str, namespace: &str) -> Result<()> {
    let r = rt
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    if r.name.is_empty() {
        bail!("no policy is in force, so kvota governs no pod; apply one with `kvota policy apply FILE`");
    }
    let policy = kvota_fairness::policy::Policy::from_yaml(&r.yaml)
        .map_err(|e| anyhow::anyhow!("the policy from the control plane does not load: {e}"))?;
    let tenant = policy
        .tenant_for_namespace(namespace, &std::collections::BTreeMap::new())
        .map(|t| t.name.to_string());
    let hint = format!(
        "the decision about {pod} was made by the agent of its cluster; to read it:\n  kvota explain pod {pod} --agent https://AGENT:PORT --agent-ca CA.crt"
    );
    let Some(tenant) = tenant else {
        out!("namespace `{namespace}` is not listed by any tenant of policy `{}`; if it carries the label kvota.dev/tenant=T (or matches a tenant's namespace selector), run `kvota explain tenant T`.\n{hint}", r.name);
        return Ok(());
    };
    let e = rt
        .block_on(c.call(|ch| {
            let tenant = tenant.clone();
            async move {
                Ok(Client::admin(ch)
                    .explain_tenant(v1::ExplainTenantRequest { tenant })
                    .await?
                    .into_inner())
            }
        }))
        .map_err(|e| status_err(cp, e))?;
    out!("pod {pod}: namespace `{namespace}` belongs to tenant `{tenant}`. A GPU pod is admitted in a cluster while the tenant's in use there plus the pod's request stays within its budget there:");
    out!("{}", e.text);
    out!("{hint}");
    Ok(())
}

/// Percent-encodes a query value (pod keys are DNS names and a slash; anything else too).
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A tenant's explanation in the core's form (as the HTTP API's
/// `/api/v1/explain/tenant` serves it).
fn explanation(r: v1::ExplainTenantReply) -> Result<kvota_fairness::explain::TenantExplanation> {
    let e = r
        .explanation
        .context("the control plane answered without the explanation's numbers (an older kvota?)")?;
    kvota_fairness::explain::TenantExplanation::try_from(e).context("the explanation from the control plane")
}

/// When a decision was made, as the agent stamped it (`at_ms`, Unix ms), seen at `now`.
/// A stamp before 2001 is no wall-clock time: an agent of a build that stamped its
/// own clock since it started; said as such rather than as decades ago.
fn decided_when(at_ms: u64, now: u64) -> String {
    const PLAUSIBLE_MS: u64 = 978_307_200_000; // 2001-01-01
    if at_ms < PLAUSIBLE_MS {
        return format!(
            "{} after its agent started (the agent stamped its own clock, not the time of day)",
            kvota_fairness::units::format_duration_ms(at_ms)
        );
    }
    if at_ms > now {
        return format!("at {} (the agent's clock is ahead of this machine's)", rfc3339(at_ms));
    }
    format!(
        "{} ago ({})",
        kvota_fairness::units::format_duration_ms(now - at_ms),
        rfc3339(at_ms)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `explain pod` says when a decision was made in words that hold whatever the
    /// agent's stamp: not "499059h ago (1970-01-01T00:01:26Z)".
    #[test]
    fn a_decision_time_is_told_plausibly() {
        let now = 1_796_086_800_000;
        assert_eq!(decided_when(now - 90_000, now), "1m30s ago (2026-12-01T00:58:30Z)");
        let old = decided_when(86_000, now);
        assert!(old.starts_with("1m26s after its agent started"), "{old}");
        assert!(!old.contains("1970"));
        assert!(decided_when(now + 5_000, now).contains("ahead"));
    }
}
