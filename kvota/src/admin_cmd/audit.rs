//! `kvota audit`: the federation's audit log, as sentences.

use anyhow::{Context, Result};
use kvota_client::client::Client;
use kvota_fairness::federation::{AuditEvent, EvictionOutcome, POLICY_UNCHANGED};
use kvota_fairness::units::{format_duration_ms, format_gpue};
use kvota_proto::v1;

use super::*;

/// `kvota audit`'s filters.
#[derive(Debug)]
pub struct AuditFilter {
    /// The newest this many (0: all kept).
    pub limit: u32,
    /// About this tenant.
    pub tenant: Option<String>,
    /// By this actor.
    pub actor: Option<String>,
    /// From this time on.
    pub since: Option<When>,
    /// Of these kinds (empty: every kind but budgets).
    pub kinds: Vec<String>,
}

/// `kvota audit`
pub fn audit(cp: &Cp, f: &AuditFilter, o: OutputArg) -> Result<()> {
    let since_ms = match f.since {
        None => 0,
        Some(When::Now) => wall_ms(),
        Some(When::At(t)) => t,
        Some(When::Ago(d)) => wall_ms().saturating_sub(d),
    };
    let req = v1::AuditLogRequest {
        limit: f.limit,
        tenant: f.tenant.clone().unwrap_or_default(),
        actor: f.actor.clone().unwrap_or_default(),
        since_ms,
        kinds: f.kinds.clone(),
    };
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| {
            let req = req.clone();
            async move { Ok(Client::admin(ch).audit_log(req).await?.into_inner()) }
        }))
        .map_err(|e| status_err(cp, e))?;
    let records = r
        .entries
        .into_iter()
        .enumerate()
        .map(|(i, rec)| {
            kvota_fairness::federation::AuditRecord::try_from(rec)
                .with_context(|| format!("audit record {i} from the control plane"))
        })
        .collect::<Result<Vec<_>>>()?;
    if o.print(&records)? {
        return Ok(());
    }
    if records.is_empty() {
        let filtered = !(req.tenant.is_empty() && req.actor.is_empty() && since_ms == 0 && req.kinds.is_empty());
        out!("no audit records{}", if filtered { " match" } else { "" });
    }
    for rec in &records {
        out!(
            "{}  #{:<6} {:<20} {}",
            rfc3339(rec.at_ms),
            rec.seq,
            rec.actor.as_deref().unwrap_or("-"),
            audit_sentence(&rec.event)
        );
    }
    if req.kinds.is_empty() {
        out!("(budget changes are hidden: --kind budgets shows them, --kind all every kind)");
    }
    Ok(())
}

/// One audit event in words (the dashboard's timeline says the same).
pub fn audit_sentence(e: &AuditEvent) -> String {
    match e {
        AuditEvent::PolicyApplied {
            name,
            tenants,
            revision,
            changes,
        } if changes.len() == 1 && changes[0] == POLICY_UNCHANGED => {
            format!("policy {name} applied again unchanged; revision {revision} stays in force ({tenants} tenants)")
        }
        AuditEvent::PolicyApplied {
            name,
            tenants,
            revision,
            changes,
        } => {
            let rev = if *revision > 0 {
                format!(" as revision {revision}")
            } else {
                String::new()
            };
            let what = if changes.is_empty() {
                String::new()
            } else {
                format!(": {}", changes.join("; "))
            };
            format!("policy {name} came into force{rev} ({tenants} tenants){what}")
        }
        AuditEvent::ClusterRegistered {
            cluster,
            capacity_gpue,
            joined,
        } => format!(
            "cluster {cluster} {} with {} GPUe",
            if *joined { "joined" } else { "registered" },
            format_gpue(*capacity_gpue)
        ),
        AuditEvent::ClusterRemoved { cluster } => format!("cluster {cluster} was removed"),
        AuditEvent::Eviction { cluster, note } => format!(
            "in {cluster}, reclaim {} {} of {} ({} GPUe) for {}'s {}: {}",
            if note.outcome == EvictionOutcome::Blocked {
                "could not evict (a PodDisruptionBudget refused)"
            } else {
                "evicted"
            },
            note.victim,
            note.victim_tenant,
            format_gpue(note.milli_gpue),
            note.for_tenant,
            note.for_pod,
            note.why
        ),
        AuditEvent::BudgetsChanged {
            cluster,
            epoch,
            changes,
            until_ms,
        } => budgets_sentence(cluster, *epoch, changes, *until_ms),
        other => control_plane_sentence(other),
    }
}

fn budgets_sentence(
    cluster: &str,
    epoch: u64,
    changes: &[kvota_fairness::federation::BudgetChange],
    until_ms: Option<u64>,
) -> String {
    let parts: Vec<String> = changes
        .iter()
        .map(|c| {
            format!(
                "{} {} -> {} ({})",
                c.tenant,
                format_gpue(c.from),
                format_gpue(c.to),
                c.why
            )
        })
        .collect();
    let when = until_ms.map_or_else(String::new, |u| format!(" (changes until {})", rfc3339(u)));
    format!(
        "cluster {cluster} got lease epoch {epoch}{when}: {}",
        if parts.is_empty() {
            "budgets renewed".to_string()
        } else {
            parts.join("; ")
        }
    )
}

/// The events of leases, leaders, members and restores.
fn control_plane_sentence(e: &AuditEvent) -> String {
    match e {
        AuditEvent::LeaseExpired {
            cluster,
            last_report_ms,
        } => format!(
            "cluster {cluster} is cut off: its every lease ran out and it enforces its safe budgets (last report {})",
            last_report_ms.map_or_else(|| "never".to_string(), rfc3339)
        ),
        AuditEvent::LeaseRenewed { cluster, cut_off_ms } => format!(
            "cluster {cluster} is back after {} cut off: it reported and holds a lease again",
            format_duration_ms(*cut_off_ms)
        ),
        AuditEvent::LeaderChanged { node, term } => format!("node {node} became the leader (term {term})"),
        AuditEvent::NodeAdded { node, voter, rpc_addr } => format!(
            "node {node} ({rpc_addr}) joined the control plane as a {}",
            if *voter { "voter" } else { "learner" }
        ),
        AuditEvent::NodeRemoved { node } => format!("node {node} left the control plane"),
        AuditEvent::NodeRole { node, voter } => {
            format!("node {node} is now a {}", if *voter { "voter" } else { "learner" })
        }
        AuditEvent::SnapshotRestored {
            applied_index,
            taken_at_ms,
            taken_by,
        } => format!(
            "the federation was restored from a backup node {taken_by} took at {} (log index {applied_index})",
            rfc3339(*taken_at_ms)
        ),
        other => format!("{other:?}"),
    }
}
