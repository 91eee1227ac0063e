//! Reads of the federation as it stands: `status`, `tenants`, `clusters`.

use anyhow::Result;
use kvota_client::client::Client;
use kvota_fairness::units::{format_duration_ms, format_gpue};
use kvota_proto::v1;

use super::*;

/// `kvota status`
pub fn status(cp: &Cp, o: OutputArg) -> Result<()> {
    let c = client(cp)?;
    let s = rt()?
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    if o.print(&kvota_control_plane::view::StatusView::from(&s))? {
        return Ok(());
    }
    out!(
        "node {} is {} (term {}){}",
        s.node_id,
        s.role,
        s.term,
        if s.ready { "" } else { ", not ready" }
    );
    if s.leader_id == 0 {
        out!("leader: none known (election in progress or no quorum)");
    } else {
        out!("leader: node {} at {}", s.leader_id, s.leader_rpc_addr);
    }
    out!("log: last index {}, applied {}", s.last_log_index, s.last_applied_index);
    if s.feature_level != 0 {
        out!(
            "feature level: {} (this node supports up to {})",
            s.feature_level,
            s.feature_level_max
        );
    }
    out!(
        "policy: {}; {} member cluster(s)",
        if s.policy.is_empty() {
            "none (apply one: kvota policy apply FILE)"
        } else {
            &s.policy
        },
        s.clusters
    );
    out!("members:");
    for m in &s.members {
        out!(
            "  {:>3}  {:<8} grpc {:<22} raft {:<22} http {}",
            m.id,
            if m.voter { "voter" } else { "learner" },
            m.rpc_addr,
            m.raft_addr,
            m.http_addr
        );
    }
    Ok(())
}

/// What the columns of `kvota tenants` and `kvota clusters` count.
const COLUMNS_NOTE: &str = "RUNNING: on a node; ADMITTED: admitted, not yet running (reservations: budgets \
count them with RUNNING); WAITING: queued, or denied recently";

/// `kvota tenants`
pub fn tenants(cp: &Cp, o: OutputArg) -> Result<()> {
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).list_tenants(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    if o.print(&kvota_control_plane::view::TenantsView::from(&r))? {
        return Ok(());
    }
    if r.tenants.is_empty() {
        out!("no policy is in force");
        return Ok(());
    }
    out!("federation capacity: {} GPUe", format_gpue(r.capacity_milli_gpue));
    out!(
        "{:<16} {:>7} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>7} {:>5}",
        "TENANT",
        "WEIGHT",
        "MIN",
        "MAX",
        "RUNNING",
        "ADMITTED",
        "WAITING",
        "TARGET",
        "ENTITLED",
        "DRIFT",
        "SCORE"
    );
    for t in &r.tenants {
        out!(
            "{:<16} {:>7} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6.1}% {:>5.2}",
            t.tenant,
            format_gpue(t.weight_milli),
            pct_bp(t.min_share_bp),
            pct_bp(t.max_share_bp),
            format_gpue(t.running_milli_gpue),
            format_gpue(t.admitted_milli_gpue),
            format_gpue(t.waiting_milli_gpue),
            format_gpue(t.target_milli_gpue),
            format_gpue(t.entitlement_milli_gpue),
            t.drift_ppm as f64 / 10_000.0,
            t.fairness_score
        );
    }
    out!("GPUe. {COLUMNS_NOTE}.");
    out!(
        "DRIFT: (in use - entitled) / capacity. SCORE: {}.",
        kvota_control_plane::view::SCORE_DEFINITION
    );
    Ok(())
}

/// `kvota clusters`
pub fn clusters(cp: &Cp, o: OutputArg) -> Result<()> {
    let c = client(cp)?;
    let r = rt()?
        .block_on(c.call(|ch| async move { Ok(Client::admin(ch).list_clusters(v1::Empty {}).await?.into_inner()) }))
        .map_err(|e| status_err(cp, e))?;
    let list: Vec<kvota_control_plane::view::ClusterView> = r.clusters.iter().map(Into::into).collect();
    if o.print(&list)? {
        return Ok(());
    }
    if r.clusters.is_empty() {
        out!("no member clusters registered yet");
        return Ok(());
    }
    if r.policy_revision > 0 {
        out!(
            "policy revision {} in force since {}",
            r.policy_revision,
            rfc3339(r.policy_since_ms)
        );
    }
    out!(
        "{:<16} {:>9} {:>9} {:>9} {:>9} {:>13} {:<24} {:>8} {:<14} {:>5}",
        "CLUSTER",
        "CAPACITY",
        "RUNNING",
        "ADMITTED",
        "WAITING",
        "LAST REPORT",
        "LEASE",
        "POLICY",
        "AGENT",
        "LEVEL"
    );
    for c in &r.clusters {
        cluster_row(c, &r);
    }
    out!("GPUe. {COLUMNS_NOTE}. POLICY: the revision its agent enforces (* behind the one in force).");
    for c in &r.clusters {
        out!("{}:", c.cluster);
        for t in &c.tenants {
            out!(
                "  {:<16} running {:>8}  admitted {:>8}  waiting {:>8}  budget {:>8}  safe {:>8}  may enforce {:>8}",
                t.tenant,
                format_gpue(t.running_milli_gpue),
                format_gpue(t.inuse_milli_gpue.saturating_sub(t.running_milli_gpue)),
                format_gpue(t.pending_milli_gpue),
                format_gpue(t.budget_milli_gpue),
                format_gpue(t.fallback_milli_gpue),
                format_gpue(t.enforceable_milli_gpue)
            );
        }
    }
    Ok(())
}

/// One cluster's line of `kvota clusters`.
fn cluster_row(c: &v1::ClusterInfo, r: &v1::ListClustersReply) {
    let sum = |f: fn(&v1::ClusterTenant) -> u64| c.tenants.iter().map(f).fold(0u64, u64::saturating_add);
    let (inuse, running) = (sum(|t| t.inuse_milli_gpue), sum(|t| t.running_milli_gpue));
    let ago = if c.last_report_ms == 0 {
        "never".to_string()
    } else {
        format!(
            "{} ago",
            format_duration_ms(r.state_time_ms.saturating_sub(c.last_report_ms))
        )
    };
    let lease = if c.unreachable {
        "CUT OFF: safe budgets".to_string()
    } else {
        format!("epoch {} (acked {})", c.last_epoch, c.acked_epoch)
    };
    let (policy, agent, level) = match &c.status {
        Some(s) => (
            format!(
                "{}{}",
                s.policy_revision,
                if s.policy_revision < r.policy_revision { "*" } else { "" }
            ),
            s.agent_version.clone(),
            s.feature_level.to_string(),
        ),
        None => ("-".to_string(), "-".to_string(), "-".to_string()),
    };
    out!(
        "{:<16} {:>9} {:>9} {:>9} {:>9} {:>13} {:<24} {:>8} {:<14} {:>5}",
        c.cluster,
        format_gpue(c.capacity_milli_gpue),
        format_gpue(running),
        format_gpue(inuse.saturating_sub(running)),
        format_gpue(sum(|t| t.pending_milli_gpue)),
        ago,
        lease,
        policy,
        agent,
        level
    );
}
