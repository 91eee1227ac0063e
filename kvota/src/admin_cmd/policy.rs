//! `kvota policy apply|get|diff`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use kvota_fairness::policy::Policy;

use anyhow::{bail, Context, Result};
use kvota_client::client::Client;
use kvota_proto::v1;

use super::*;

/// `kvota policy apply`'s arguments.
#[derive(Debug, clap::Args)]
pub struct ApplyArgs {
    /// Path to a FairnessPolicy YAML file.
    pub file: PathBuf,
    /// Then wait until every connected member cluster enforces the new revision (its
    /// agent says so in its reports). A cluster whose lease has expired (cut off) is
    /// named and not waited for: it enforces its safe budgets and fetches the policy
    /// when it reports again.
    #[arg(long)]
    pub wait: bool,
    /// How long --wait waits: a duration such as 60s or 5m.
    #[arg(long, default_value = "60s", value_parser = parse_timeout, requires = "wait")]
    pub timeout: std::time::Duration,
}

fn parse_timeout(s: &str) -> std::result::Result<std::time::Duration, String> {
    kvota_fairness::units::parse_duration_ms(s)
        .map(std::time::Duration::from_millis)
        .map_err(|e| format!("`{s}`: {e}"))
}

/// Exit status of `policy apply --wait` when every connected cluster enforces the
/// revision but cut-off clusters were not waited for.
pub const EXIT_CUT_OFF: u8 = 3;
/// Exit status of `policy apply --wait` when connected clusters still lag at the timeout.
pub const EXIT_TIMED_OUT: u8 = 4;

/// Where a member cluster stands against a policy revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Standing {
    /// Its agent enforces the revision (or a newer one).
    Enforces,
    /// Connected, its agent on an older revision (0: one it does not know the number of).
    Behind(u64),
    /// Connected, its agent says nothing of revisions (older than feature level 6).
    Silent,
    /// Every lease ran out (control-plane clock, Unix ms, of when; 0: not noted): it
    /// enforces its safe budgets until it reports again.
    CutOff(u64),
}

/// Every cluster's standing against `revision`, in name order.
pub fn standings(clusters: &[v1::ClusterInfo], revision: u64) -> Vec<(String, Standing)> {
    clusters
        .iter()
        .map(|c| {
            let s = match &c.status {
                _ if c.unreachable => Standing::CutOff(c.cut_off_since_ms),
                Some(st) if st.policy_revision >= revision => Standing::Enforces,
                Some(st) => Standing::Behind(st.policy_revision),
                None => Standing::Silent,
            };
            (c.cluster.clone(), s)
        })
        .collect()
}

fn standing_words(s: &Standing, revision: u64) -> String {
    match s {
        Standing::Enforces => format!("enforces revision {revision}"),
        Standing::Behind(0) => "connected; its agent has not fetched a numbered policy yet".to_string(),
        Standing::Behind(r) => format!("connected, on revision {r}"),
        Standing::Silent => {
            "connected; its agent does not say which policy it enforces (a kvota agent older than feature level 6)"
                .to_string()
        }
        Standing::CutOff(0) => "cut off (its lease expired): on its safe budgets, not waited for".to_string(),
        Standing::CutOff(since) => format!(
            "cut off since {} (its lease expired): on its safe budgets, not waited for",
            rfc3339(*since)
        ),
    }
}

/// `kvota policy apply FILE [--wait]`: applies the policy, prints what was committed
/// and which clusters enforce it; with --wait, waits for every connected cluster.
pub fn policy_apply(cp: &Cp, a: &ApplyArgs) -> Result<std::process::ExitCode> {
    let yaml = std::fs::read_to_string(&a.file).with_context(|| format!("read policy file {}", a.file.display()))?;
    let new = match Policy::from_yaml(&yaml) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{}: {e}", a.file.display());
            return Ok(std::process::ExitCode::from(2));
        }
    };
    let c = client(cp)?;
    let rt = rt()?;
    let (before, r) = rt
        .block_on(async {
            let before = c
                .call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) })
                .await?;
            let r = c
                .call(|ch| {
                    let yaml = yaml.clone();
                    async move {
                        Ok(Client::admin(ch)
                            .apply_policy(v1::PolicyRequest { yaml })
                            .await?
                            .into_inner())
                    }
                })
                .await?;
            Ok::<_, tonic::Status>((before, r))
        })
        .map_err(|e| status_err(cp, e))?;
    let applied_at = std::time::Instant::now();
    print_committed(&before, &r, &new);
    if new.maps_no_namespace() {
        eprintln!("{}", crate::cli::NO_NAMESPACE_NOTE);
    }
    if r.revision == 0 {
        if a.wait {
            bail!("--wait needs the control plane at feature level 6 (policy revisions): every node must run a kvota that supports it (`kvota status`)");
        }
        return Ok(std::process::ExitCode::SUCCESS);
    }
    let clusters = rt
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).list_clusters(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    let now = standings(&clusters.clusters, r.revision);
    if now.is_empty() {
        out!("no member clusters registered yet");
        return Ok(std::process::ExitCode::SUCCESS);
    }
    out!("member clusters:");
    for (name, s) in &now {
        out!("  {name:<20} {}", standing_words(s, r.revision));
    }
    if !a.wait {
        return Ok(std::process::ExitCode::SUCCESS);
    }
    rt.block_on(wait_enforced(cp, &c, r.revision, now, applied_at, a.timeout))
}

/// Prints what `apply` committed: the revision and, against `before`, what changed.
fn print_committed(before: &v1::PolicyReply, r: &v1::PolicyReply, new: &Policy) {
    if r.revision == 0 {
        out!("policy `{}` with {} tenants is in force", r.name, r.tenants);
        return;
    }
    if before.revision == r.revision {
        out!(
            "policy `{}` with {} tenants changes nothing: revision {} stays in force",
            r.name,
            r.tenants,
            r.revision
        );
        return;
    }
    out!(
        "committed policy `{}` with {} tenants as revision {}",
        r.name,
        r.tenants,
        r.revision
    );
    let old = Policy::from_yaml(&before.yaml).ok();
    let changes = match &old {
        Some(old) => kvota_fairness::policy::describe_changes(old, new, 40),
        None => vec!["the federation's first policy".to_string()],
    };
    for ch in changes {
        out!("  {ch}");
    }
}

/// Waits until every connected cluster enforces `revision` (polling the control plane),
/// printing each as it does; cut-off clusters are named, not waited for.
async fn wait_enforced(
    cp: &Cp,
    c: &Client,
    revision: u64,
    mut last: Vec<(String, Standing)>,
    since: std::time::Instant,
    within: std::time::Duration,
) -> Result<std::process::ExitCode> {
    let pending = |s: &[(String, Standing)]| {
        s.iter()
            .any(|(_, x)| matches!(x, Standing::Behind(_) | Standing::Silent))
    };
    while pending(&last) && since.elapsed() < within {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        let clusters = c
            .call(|ch| async move { Ok(Client::admin(ch).list_clusters(v1::Empty {}).await?.into_inner()) })
            .await
            .map_err(|e| status_err(cp, e))?;
        let now = standings(&clusters.clusters, revision);
        for (name, s) in &now {
            let was = last.iter().find(|(n, _)| n == name).map(|(_, x)| x);
            if was != Some(s) {
                out!(
                    "  {name:<20} {} ({:.1} s after the commit)",
                    standing_words(s, revision),
                    since.elapsed().as_secs_f64()
                );
            }
        }
        last = now;
    }
    let named = |want: fn(&Standing) -> bool| -> Vec<&str> {
        last.iter().filter(|(_, s)| want(s)).map(|(n, _)| n.as_str()).collect()
    };
    let lagging = named(|s| matches!(s, Standing::Behind(_) | Standing::Silent));
    let cut_off = named(|s| matches!(s, Standing::CutOff(_)));
    let took = since.elapsed().as_secs_f64();
    if !lagging.is_empty() {
        eprintln!(
            "kvota: timed out after {:.1} s: still not on revision {revision}: {}{}",
            took,
            lagging.join(", "),
            if cut_off.is_empty() {
                String::new()
            } else {
                format!("; cut off, not waited for: {}", cut_off.join(", "))
            }
        );
        return Ok(std::process::ExitCode::from(EXIT_TIMED_OUT));
    }
    if !cut_off.is_empty() {
        out!(
            "every connected cluster enforces revision {revision} ({took:.1} s after the commit); cut off, not waited for: {}",
            cut_off.join(", ")
        );
        return Ok(std::process::ExitCode::from(EXIT_CUT_OFF));
    }
    out!("every member cluster enforces revision {revision} ({took:.1} s after the commit)");
    Ok(std::process::ExitCode::SUCCESS)
}

/// `kvota policy get`
pub fn policy_get(cp: &Cp, o: OutputArg) -> Result<()> {
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    if r.name.is_empty() {
        bail!("no policy is in force; apply one with `kvota policy apply FILE`");
    }
    // Checked before it is printed: what `policy apply` would make of it.
    kvota_fairness::policy::Policy::from_yaml(&r.yaml)
        .map_err(|e| anyhow::anyhow!("the policy from the control plane does not load: {e}"))?;
    if o.format() == Output::Json {
        // The same document as JSON (a YAML reader, `policy apply` among them, reads it).
        let doc: serde_json::Value = serde_yaml_ng::from_str(&r.yaml).context("the policy document")?;
        out!("{}", serde_json::to_string_pretty(&doc).context("encode JSON")?);
    } else {
        outp!("{}", r.yaml);
    }
    Ok(())
}

/// The federation as the control plane reports it (clusters with each tenant's in-use
/// and waiting GPUe, tenants' decayed usage), rebuilt offline under `policy` at `now_ms`:
/// what the fairness core would make of today's state under that policy.
fn rebuilt(
    policy: &Policy,
    clusters: &[v1::ClusterInfo],
    tenants: &[v1::TenantInfo],
    now_ms: u64,
) -> Result<Federation> {
    let mut fed = Federation::new();
    fed.apply(now_ms, Command::ApplyPolicy(policy.clone()))
        .map_err(|e| anyhow::anyhow!("apply the policy offline: {e}"))?;
    for (i, c) in clusters.iter().enumerate() {
        use kvota_proto::convert::{cluster_id, tenant_name};
        let capacity = kvota_proto::convert::capacity("capacity", &c.capacity)
            .map_err(|e| anyhow::anyhow!("cluster {}: {e}", c.cluster))?;
        let cluster =
            cluster_id("cluster", &c.cluster).map_err(|e| anyhow::anyhow!("the control plane's answer: {e}"))?;
        fed.apply(
            now_ms,
            Command::RegisterCluster {
                cluster: cluster.clone(),
                capacity,
                labels: BTreeMap::new(),
            },
        )
        .map_err(|e| anyhow::anyhow!("cluster {}: {e}", c.cluster))?;
        let mut report: BTreeMap<TenantName, TenantReport> = c
            .tenants
            .iter()
            .map(|t| {
                let name =
                    tenant_name("tenant", &t.tenant).map_err(|e| anyhow::anyhow!("cluster {}: {e}", c.cluster))?;
                Ok((
                    name,
                    TenantReport {
                        used_milli_gpue_ms: 0,
                        inuse: t.inuse_milli_gpue,
                        pending: t.pending_milli_gpue,
                        largest: 0,
                        borrowed: 0,
                    },
                ))
            })
            .collect::<Result<_>>()?;
        // The ledger's decayed usage goes in with the first cluster's report.
        if i == 0 {
            for t in tenants {
                let name =
                    tenant_name("tenant", &t.tenant).map_err(|e| anyhow::anyhow!("the control plane's answer: {e}"))?;
                report.entry(name).or_default().used_milli_gpue_ms = t.decayed_usage;
            }
        }
        let r = UsageReport {
            cluster,
            seq: 1,
            held_epoch: 0,
            capacity: None,
            tenants: report,
            evictions: Vec::new(),
            decisions: Vec::new(),
            window: None,
            status: None,
        };
        fed.apply(now_ms, Command::Report(r))
            .map_err(|e| anyhow::anyhow!("cluster {}: {e}", c.cluster))?;
    }
    Ok(fed)
}

/// Target entitlement per tenant under the plan of `fed`.
fn targets(fed: &Federation) -> BTreeMap<TenantName, u64> {
    let plan = fed.plan();
    plan.tenants
        .iter()
        .cloned()
        .zip(plan.entitlements.iter().map(|e| e.total))
        .collect()
}

/// One row per tenant: its target entitlement now, after, and the change.
fn print_target_changes(
    names: &std::collections::BTreeSet<&TenantName>,
    before: &BTreeMap<TenantName, u64>,
    after: &BTreeMap<TenantName, u64>,
) {
    out!("  {:<20} {:>10} {:>10} {:>10}", "TENANT", "NOW", "AFTER", "CHANGE");
    for &n in names {
        let (a, b) = (before.get(n).copied(), after.get(n).copied());
        let cell = |v: Option<u64>| v.map_or_else(|| "-".to_string(), format_gpue);
        let delta = i128::from(b.unwrap_or(0)) - i128::from(a.unwrap_or(0));
        let sign = if delta > 0 {
            "+"
        } else if delta < 0 {
            "-"
        } else {
            ""
        };
        out!(
            "  {:<20} {:>10} {:>10} {:>10}",
            n,
            cell(a),
            cell(b),
            format!(
                "{sign}{}",
                format_gpue(u64::try_from(delta.unsigned_abs()).unwrap_or(u64::MAX))
            )
        );
    }
}

/// `kvota policy diff FILE`: what applying `new` would change, in the policy's fields and
/// in every tenant's target entitlement for the federation as it is now.
pub fn policy_diff(cp: &Cp, new: &Policy, json: bool) -> Result<()> {
    let c = client(cp)?;
    let rt = rt()?;
    let (current, clusters, tenants) = rt
        .block_on(async {
            let p = c
                .call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) })
                .await?;
            let cl = c
                .call(|ch| async move { Ok(Client::admin(ch).list_clusters(v1::Empty {}).await?.into_inner()) })
                .await?;
            let t = c
                .call(|ch| async move { Ok(Client::admin(ch).list_tenants(v1::Empty {}).await?.into_inner()) })
                .await?;
            Ok::<_, tonic::Status>((p, cl, t))
        })
        .map_err(|e| status_err(cp, e))?;
    let old = if current.name.is_empty() {
        None
    } else {
        Some(
            Policy::from_yaml(&current.yaml)
                .map_err(|e| anyhow::anyhow!("the policy from the control plane does not load: {e}"))?,
        )
    };
    // One instant for both: the ledger's numbers as read, no decay between them.
    let now = 0;
    let after = targets(&rebuilt(new, &clusters.clusters, &tenants.tenants, now)?);
    let before = match &old {
        Some(p) => targets(&rebuilt(p, &clusters.clusters, &tenants.tenants, now)?),
        None => BTreeMap::new(),
    };
    let changes = match &old {
        Some(p) => kvota_fairness::policy::describe_changes(p, new, usize::MAX),
        None => vec![format!("no policy in force: `{}` would be the first", new.name)],
    };
    let names: std::collections::BTreeSet<&TenantName> = before.keys().chain(after.keys()).collect();
    if json {
        let rows: Vec<serde_json::Value> = names
            .iter()
            .map(|n| serde_json::json!({"tenant": n, "target_milli_gpue_now": before.get(*n), "target_milli_gpue_after": after.get(*n)}))
            .collect();
        out!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({"changes": changes, "entitlements": rows}))?
        );
        return Ok(());
    }
    if changes.is_empty() {
        out!("no field changes: the file is the policy in force");
    } else {
        out!("policy changes:");
        for ch in &changes {
            out!("  {ch}");
        }
    }
    let capacity = format_gpue(tenants.capacity_milli_gpue);
    let n = clusters.clusters.len();
    out!(
        "target entitlements for today's federation ({capacity} GPUe, {n} cluster{}), now -> after applying:",
        if n == 1 { "" } else { "s" }
    );
    print_target_changes(&names, &before, &after);
    Ok(())
}
