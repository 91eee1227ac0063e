//! The audit log: what happened to the federation and why, as operators read it.
//!
//! Records live in the replicated state ([`Federation`]), so every node answers the same.
//! Below the operator view (feature level 6, [`Federation::enable_operator_view`]) the log
//! is the ring of the last [`AUDIT_CAPACITY`] records it always was. From it on:
//! - events the control plane sees outside the commands are recorded too
//!   ([`Federation::note`]: a new leader, a membership change, a restore), and so are a
//!   cluster's leases running out and coming back ([`AuditEvent::LeaseExpired`],
//!   [`AuditEvent::LeaseRenewed`]);
//! - a cluster's budget changes within a minute go into one record
//!   ([`AuditEvent::BudgetsChanged`] with `until_ms`), the first `from` and the last `to`
//!   of each tenant kept;
//! - records are kept by the policy's `spec.audit` (age and size, [`AuditRecord::size`]):
//!   past the size, budget changes go first, then the oldest of the rest.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{EvictionNote, Federation};
use crate::names::ClusterName;
use crate::{MilliGpue, Millis};

/// Audit records kept below the operator view (oldest dropped first). From it on the
/// policy's `spec.audit` bounds the log instead.
pub const AUDIT_CAPACITY: usize = 1_000;
/// Budget changes of one cluster within this long go into one record.
pub const BUDGET_COALESCE_MS: Millis = 60_000;
/// Most lines of a policy's changes kept in its record (the rest counted in one line).
pub const MAX_POLICY_CHANGE_LINES: usize = 40;

/// The one change line of a policy applied again as it was: the revision in force stays.
pub const POLICY_UNCHANGED: &str = "unchanged";
/// Longest agent version string kept.
pub const MAX_VERSION_LEN: usize = 64;

/// The actor of records the control plane makes on its own (new lease budgets).
pub const CONTROL_PLANE_ACTOR: &str = "kvota";
/// Longest actor name kept.
pub const MAX_ACTOR_LEN: usize = 256;

/// One budget change, for the audit log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BudgetChange {
    /// Tenant.
    pub tenant: String,
    /// Budget in the previous lease.
    pub from: MilliGpue,
    /// Budget in the new lease.
    pub to: MilliGpue,
    /// Why, in words.
    pub why: String,
}

/// An audit record: why something changed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AuditRecord {
    /// Monotonic record number.
    pub seq: u64,
    /// Control-plane time.
    pub at_ms: Millis,
    /// What happened.
    pub event: AuditEvent,
    /// Who made it happen: `operator/NAME` (a policy, a removal), `cluster/NAME` (a
    /// registration, an eviction), `kvota` (budgets the control plane changed); none
    /// for records from before feature level 2 or a control plane without TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actor: Option<String>,
}

impl AuditRecord {
    /// What the record counts against `spec.audit.maxSize`: its text plus a fixed 64
    /// bytes for its numbers, close to its size in a snapshot and the same on every node.
    pub fn size(&self) -> u64 {
        let text = |s: &str| s.len() as u64;
        let event = match &self.event {
            AuditEvent::PolicyApplied { name, changes, .. } => {
                text(name) + changes.iter().map(|c| text(c) + 4).sum::<u64>()
            }
            AuditEvent::ClusterRegistered { cluster, .. }
            | AuditEvent::ClusterRemoved { cluster }
            | AuditEvent::LeaseExpired { cluster, .. }
            | AuditEvent::LeaseRenewed { cluster, .. } => text(cluster),
            AuditEvent::Eviction { cluster, note } => {
                text(cluster)
                    + text(&note.victim)
                    + text(&note.victim_tenant)
                    + text(&note.for_tenant)
                    + text(&note.for_pod)
                    + text(&note.why)
            }
            AuditEvent::BudgetsChanged { cluster, changes, .. } => {
                text(cluster) + changes.iter().map(|c| text(&c.tenant) + text(&c.why) + 24).sum::<u64>()
            }
            AuditEvent::NodeAdded { rpc_addr, .. } => text(rpc_addr),
            AuditEvent::LeaderChanged { .. }
            | AuditEvent::NodeRemoved { .. }
            | AuditEvent::NodeRole { .. }
            | AuditEvent::SnapshotRestored { .. } => 0,
        };
        64 + self.actor.as_deref().map_or(0, text) + event
    }
}

/// Kinds of audit records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AuditEvent {
    /// A policy came into force.
    PolicyApplied {
        /// Its name.
        name: String,
        /// Number of tenants.
        tenants: usize,
        /// The policy revision it made (from feature level 6; 0 before): a policy
        /// that changes nothing keeps the revision in force.
        #[serde(default, skip_serializing_if = "is_zero")]
        revision: u64,
        /// What it changed, in the policy's own words (`spec.decayHalfLife: 24h -> 6h`),
        /// at most [`MAX_POLICY_CHANGE_LINES`] lines (from feature level 6).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        changes: Vec<String>,
    },
    /// A cluster registered or changed capacity.
    ClusterRegistered {
        /// Cluster id.
        cluster: String,
        /// Capacity in GPUe.
        capacity_gpue: MilliGpue,
        /// Its first registration: the cluster joined the federation (recorded from
        /// feature level 6; false before and for a change of capacity).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        joined: bool,
    },
    /// A cluster was removed.
    ClusterRemoved {
        /// Cluster id.
        cluster: String,
    },
    /// A member's reclaim loop evicted a pod (or a PodDisruptionBudget refused it) to
    /// restore a starved tenant's guarantee.
    Eviction {
        /// Cluster id.
        cluster: String,
        /// What the agent reported.
        note: EvictionNote,
    },
    /// A new lease epoch changed budgets.
    BudgetsChanged {
        /// Cluster id.
        cluster: String,
        /// New epoch (the last one, when several were coalesced).
        epoch: u64,
        /// What changed and why (per tenant: the first `from`, the last `to`).
        changes: Vec<BudgetChange>,
        /// The last change coalesced into this record (from feature level 6; none: one
        /// lease's changes).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        until_ms: Option<Millis>,
    },
    /// Every lease of a cluster ran out: it enforces its safe budgets until it reports
    /// again (a partition, a stopped agent).
    LeaseExpired {
        /// Cluster id.
        cluster: String,
        /// Its last applied report (control-plane clock; none: never reported).
        last_report_ms: Option<Millis>,
    },
    /// A cluster whose leases had run out reported again and holds a lease.
    LeaseRenewed {
        /// Cluster id.
        cluster: String,
        /// How long it was cut off.
        cut_off_ms: Millis,
    },
    /// A control-plane node became the leader.
    LeaderChanged {
        /// The new leader's node id.
        node: u64,
        /// Its term.
        term: u64,
    },
    /// A node joined the control plane's membership.
    NodeAdded {
        /// Its id.
        node: u64,
        /// A voter (else a learner).
        voter: bool,
        /// Its gRPC address.
        rpc_addr: String,
    },
    /// A node left the membership.
    NodeRemoved {
        /// Its id.
        node: u64,
    },
    /// A member became a voter, or a voter a learner.
    NodeRole {
        /// Its id.
        node: u64,
        /// A voter now (else a learner).
        voter: bool,
    },
    /// The federation was restored from a backup (`kvota snapshot restore`).
    SnapshotRestored {
        /// The log index the backup was taken at.
        applied_index: u64,
        /// When it was taken (the taking node's wall clock, Unix ms).
        taken_at_ms: u64,
        /// The node that took it.
        taken_by: u64,
    },
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// The kinds `kvota audit --kind` and the HTTP API's `kind=` name, in the order they are
/// listed: every kind but [`KIND_BUDGETS`] is shown by default.
pub const KINDS: [&str; 8] = [
    "policy",
    "cluster",
    "lease",
    "leader",
    "node",
    "reclaim",
    "snapshot",
    KIND_BUDGETS,
];
/// The kind of budget changes, hidden unless asked for.
pub const KIND_BUDGETS: &str = "budgets";

impl AuditEvent {
    /// Whether the event is about `tenant` (a policy concerns every tenant).
    pub fn concerns(&self, tenant: &str) -> bool {
        match self {
            AuditEvent::PolicyApplied { .. } => true,
            AuditEvent::Eviction { note, .. } => note.victim_tenant == tenant || note.for_tenant == tenant,
            AuditEvent::BudgetsChanged { changes, .. } => changes.iter().any(|c| c.tenant == tenant),
            _ => false,
        }
    }

    /// Its kind (one of [`KINDS`]).
    pub fn kind(&self) -> &'static str {
        match self {
            AuditEvent::PolicyApplied { .. } => "policy",
            AuditEvent::ClusterRegistered { .. } | AuditEvent::ClusterRemoved { .. } => "cluster",
            AuditEvent::LeaseExpired { .. } | AuditEvent::LeaseRenewed { .. } => "lease",
            AuditEvent::LeaderChanged { .. } => "leader",
            AuditEvent::NodeAdded { .. } | AuditEvent::NodeRemoved { .. } | AuditEvent::NodeRole { .. } => "node",
            AuditEvent::Eviction { .. } => "reclaim",
            AuditEvent::SnapshotRestored { .. } => "snapshot",
            AuditEvent::BudgetsChanged { .. } => KIND_BUDGETS,
        }
    }

    /// The party the event implies when no caller is named: the cluster it is about,
    /// or the control plane itself.
    fn implied_actor(&self) -> Option<String> {
        match self {
            AuditEvent::ClusterRegistered { cluster, .. }
            | AuditEvent::Eviction { cluster, .. }
            | AuditEvent::LeaseRenewed { cluster, .. } => Some(format!("cluster/{cluster}")),
            AuditEvent::BudgetsChanged { .. }
            | AuditEvent::LeaseExpired { .. }
            | AuditEvent::LeaderChanged { .. }
            | AuditEvent::NodeAdded { .. }
            | AuditEvent::NodeRemoved { .. }
            | AuditEvent::NodeRole { .. } => Some(CONTROL_PLANE_ACTOR.to_string()),
            AuditEvent::PolicyApplied { .. }
            | AuditEvent::ClusterRemoved { .. }
            | AuditEvent::SnapshotRestored { .. } => None,
        }
    }
}

/// Parses a `--kind` list (`policy,lease`; `all`: every kind, budgets too; empty: the
/// default, every kind but budgets) into the kinds to show.
pub fn parse_kinds(list: &str) -> Result<Vec<&'static str>, String> {
    let mut out = Vec::new();
    for word in list.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        if word == "all" {
            return Ok(KINDS.to_vec());
        }
        match KINDS.iter().find(|k| **k == word) {
            Some(k) if !out.contains(k) => out.push(*k),
            Some(_) => {}
            None => {
                return Err(format!(
                    "kind `{}`: one of {} or all",
                    word.chars().take(32).collect::<String>(),
                    KINDS.join(", ")
                ))
            }
        }
    }
    if out.is_empty() {
        out = KINDS.iter().copied().filter(|k| *k != KIND_BUDGETS).collect();
    }
    Ok(out)
}

/// The audit log's size as counted, kept beside the records and never part of the
/// state: a copy or a freshly read state counts afresh when it next needs it.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct AuditBytes(Option<u64>);

impl PartialEq for AuditBytes {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for AuditBytes {}

impl Federation {
    /// Records `event` at the state's clock, by the actor of the command being applied
    /// (or the one the event implies).
    pub(super) fn record(&mut self, event: AuditEvent) {
        self.audit_seq += 1;
        // Who: the caller the control plane names (an operator's certificate), else
        // the party the event implies. Kept with the records (feature level 2) only, so
        // a group below it writes the records every member writes.
        let actor = if self.keeps_records() {
            self.actor.clone().or_else(|| event.implied_actor())
        } else {
            None
        };
        let record = AuditRecord {
            seq: self.audit_seq,
            at_ms: self.now_ms,
            event,
            actor,
        };
        if !self.operator_view {
            if self.audit.len() >= AUDIT_CAPACITY {
                self.audit.pop_front();
            }
            self.audit.push_back(Arc::new(record));
            return;
        }
        let size = record.size();
        let bytes = self.audit_bytes();
        self.audit.push_back(Arc::new(record));
        self.audit_size = AuditBytes(Some(bytes + size));
        self.prune_audit();
    }

    /// Records an event the control plane saw outside the commands: a new leader, a
    /// membership change, a restore from a backup. From the operator view (feature level
    /// 6) on; before, nothing is recorded, as a node of an older build records nothing.
    pub fn note(&mut self, event: AuditEvent) {
        if self.operator_view {
            self.record(event);
        }
    }

    /// The audit log's size as [`AuditRecord::size`] counts it.
    fn audit_bytes(&mut self) -> u64 {
        match self.audit_size.0 {
            Some(b) => b,
            None => {
                let b = self.audit.iter().map(|r| r.size()).sum();
                self.audit_size = AuditBytes(Some(b));
                b
            }
        }
    }

    /// Drops records past the policy's `spec.audit`: older than its retention, then,
    /// while over its size, the oldest budget changes, then the oldest of the rest. Past
    /// the size it frees a tenth more than needed, so a full log is pruned now and then,
    /// not at every record.
    pub(super) fn prune_audit(&mut self) {
        if !self.operator_view {
            return;
        }
        let cfg = self.policy.as_ref().map(|p| p.audit).unwrap_or_default();
        let horizon = self.now_ms.saturating_sub(cfg.retention_ms);
        let mut bytes = self.audit_bytes();
        while self.audit.front().is_some_and(|r| r.at_ms < horizon) {
            if let Some(r) = self.audit.pop_front() {
                bytes = bytes.saturating_sub(r.size());
            }
        }
        if bytes > cfg.max_bytes {
            let target = cfg.max_bytes - cfg.max_bytes / 10;
            let mut excess = bytes - target;
            self.audit.retain(|r| {
                if excess > 0 && r.event.kind() == KIND_BUDGETS {
                    let s = r.size();
                    excess = excess.saturating_sub(s);
                    bytes = bytes.saturating_sub(s);
                    false
                } else {
                    true
                }
            });
            while bytes > target {
                let Some(r) = self.audit.pop_front() else { break };
                bytes = bytes.saturating_sub(r.size());
            }
        }
        self.audit_size = AuditBytes(Some(bytes));
    }

    /// Records a cluster's budget changes: into the cluster's record of the last minute
    /// when there is one (from the operator view on), else a new record.
    pub(super) fn record_budgets(&mut self, cluster: &ClusterName, epoch: u64, changes: Vec<BudgetChange>) {
        if self.operator_view && self.coalesce_budgets(cluster, epoch, &changes) {
            return;
        }
        self.record(AuditEvent::BudgetsChanged {
            cluster: cluster.to_string(),
            epoch,
            changes,
            until_ms: None,
        });
    }

    /// Merges `changes` into `cluster`'s budget record of the last
    /// [`BUDGET_COALESCE_MS`]; false when there is none.
    fn coalesce_budgets(&mut self, cluster: &ClusterName, epoch: u64, changes: &[BudgetChange]) -> bool {
        let now = self.now_ms;
        let found = self
            .audit
            .iter()
            .rev()
            .take_while(|r| r.at_ms.saturating_add(BUDGET_COALESCE_MS) > now)
            .position(|r| matches!(&r.event, AuditEvent::BudgetsChanged { cluster: c, .. } if c == cluster.as_str()));
        let Some(back) = found else { return false };
        let at = self.audit.len() - 1 - back;
        let Some(slot) = self.audit.get_mut(at) else {
            return false;
        };
        let before = slot.size();
        let record = Arc::make_mut(slot);
        if let AuditEvent::BudgetsChanged {
            epoch: e,
            changes: kept,
            until_ms,
            ..
        } = &mut record.event
        {
            *e = epoch;
            *until_ms = Some(now);
            for c in changes {
                match kept.iter_mut().find(|k| k.tenant == c.tenant) {
                    Some(k) => {
                        k.to = c.to;
                        k.why.clone_from(&c.why);
                    }
                    None => kept.push(c.clone()),
                }
            }
        }
        let after = record.size();
        let bytes = self.audit_bytes();
        self.audit_size = AuditBytes(Some(bytes.saturating_sub(before) + after));
        true
    }

    /// From the operator view on: records each cluster whose every lease has now run out
    /// ([`AuditEvent::LeaseExpired`]) and remembers since when, until it reports again.
    pub(super) fn note_expired_leases(&mut self) {
        if !self.operator_view {
            return;
        }
        let now = self.now_ms;
        let expired: Vec<(ClusterName, Millis, Option<Millis>)> = self
            .clusters
            .iter()
            .filter(|(c, rec)| !self.cut_off.contains_key(c.as_str()) && Self::is_unreachable(rec, now))
            .map(|(c, rec)| {
                let since = rec.leases.open.iter().map(|l| l.expires_at_ms).max().unwrap_or(now);
                (c.clone(), since, rec.last_report_ms)
            })
            .collect();
        for (cluster, since, last_report_ms) in expired {
            self.cut_off.insert(cluster.clone(), since);
            self.record(AuditEvent::LeaseExpired {
                cluster: cluster.to_string(),
                last_report_ms,
            });
        }
    }

    /// A cluster that was cut off holds a lease again: records how long it was cut off.
    pub(super) fn note_renewed_lease(&mut self, cluster: &ClusterName) {
        if let Some(since) = self.cut_off.remove(cluster.as_str()) {
            let cut_off_ms = self.now_ms.saturating_sub(since);
            self.record(AuditEvent::LeaseRenewed {
                cluster: cluster.to_string(),
                cut_off_ms,
            });
        }
    }

    /// The clusters the control plane holds as cut off (every lease run out), with when
    /// their last lease expired; kept from the operator view on.
    pub fn cut_off(&self) -> &std::collections::BTreeMap<ClusterName, Millis> {
        &self.cut_off
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_parse_to_the_default_all_or_a_list() {
        let default = parse_kinds("").expect("default");
        assert!(!default.contains(&KIND_BUDGETS) && default.len() == KINDS.len() - 1);
        assert_eq!(parse_kinds("all").expect("all").len(), KINDS.len());
        assert_eq!(
            parse_kinds("lease, budgets,lease").expect("list"),
            vec!["lease", "budgets"]
        );
        let e = parse_kinds("leases").expect_err("unknown");
        assert!(e.contains("one of policy, cluster") && e.contains("or all"), "{e}");
    }
}
