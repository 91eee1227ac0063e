//! Feature levels: what the replicated state of a group holds and what its log entries
//! carry, raised one level at a time once every member reads the next.
//!
//! The replicated state records the level the group runs at
//! ([`crate::store::StateMachineData::feature_level`]). The leader raises it only once
//! every voter and learner reports support for a newer level over the Raft port
//! (`Clock`), in a log entry's `raise_feature_level`; the raise takes effect after that
//! entry's own commands. So a group in a rolling upgrade keeps writing what its oldest
//! member reads, and turns a feature on at the same log index on every node.
//!
//! Every question of the form "may the group do X yet" is a method of [`FeatureLevel`];
//! the table [`FeatureLevel::ALL`] says what each level enables, in words, for the docs
//! and `kvota status`.

use std::fmt;

use kvota_fairness::federation::{Command, Federation};
use kvota_fairness::policy::Policy;
use serde::{Deserialize, Serialize};

/// A feature level of the replicated state (1 for a group that never raised it).
///
/// Serialized as the bare number, as the state machine's `feature_level` always was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct FeatureLevel(u32);

impl FeatureLevel {
    /// Level 1: log entries and snapshots of format 1; the state the first builds kept.
    pub const BASE: FeatureLevel = FeatureLevel(1);
    /// Level 2: the state keeps records (showback: undecayed usage in hourly buckets;
    /// the agents' reported admission decisions; who asked for each command), and a
    /// policy may set `spec.showback`.
    pub const RECORDS: FeatureLevel = FeatureLevel(2);
    /// Level 3: leases lend idle GPUs to preemptible tenants (each such tenant's budget
    /// comes with a borrow limit, a protobuf field older agents ignore), and a policy may
    /// turn `spec.reclaim.lendIdle` off.
    pub const LENDING: FeatureLevel = FeatureLevel(3);
    /// Level 4: budgets are sized to waiting pods (the state keeps each report's
    /// largest waiting pod per tenant, a protobuf field older nodes drop, and the split
    /// makes room for it).
    pub const SIZED: FeatureLevel = FeatureLevel(4);
    /// Level 5: a policy may set `spec.reclaim.lendWhen` (a field of the replicated
    /// policy that older nodes drop).
    pub const LEND_WHEN: FeatureLevel = FeatureLevel(5);
    /// Level 6: the operator view. The state keeps the policy's revision (leases and
    /// report answers name it), each cluster's status as its agent reports it (build,
    /// policy revision enforced, report interval, GPUe running; report fields older
    /// nodes drop), a cluster's leases running out and coming back, the control plane's
    /// own events (leaders, members, restores) and budget changes coalesced per cluster
    /// per minute in the audit log, kept by age and size; a policy may set `spec.audit`.
    pub const OPERATOR_VIEW: FeatureLevel = FeatureLevel(6);
    /// Level 7: log entries carry what each tenant's borrowed pods hold in a report (a
    /// protobuf field older nodes drop), so the state machine checks its accounting
    /// with borrowed usage left out; and leases keep lending within maxShare
    /// federation-wide (borrow limits from what a tenant may hold, budgets and limits
    /// leaving room for what its other clusters may admit), which changes the leases a
    /// replica cuts, so older builds must not apply it.
    pub const BORROWED: FeatureLevel = FeatureLevel(7);
    /// Level 8: committed entitlement rises into free capacity by filling the smallest
    /// shortfalls whole first, not in proportion to the shortfall
    /// ([`Federation::enable_small_first`]), which changes the leases a replica cuts, so
    /// older builds must not apply it.
    pub const SMALL_FIRST: FeatureLevel = FeatureLevel(8);
    /// The newest level this build supports.
    pub const NEWEST: FeatureLevel = FeatureLevel::SMALL_FIRST;

    /// Every level this build knows, oldest first, with what it enables.
    pub const ALL: [(FeatureLevel, &'static str); 8] = [
        (FeatureLevel::BASE, "log entries and snapshots of format 1"),
        (
            FeatureLevel::RECORDS,
            "showback, the agents' reported decisions and the actors of audit records are kept; \
             a policy may set spec.showback",
        ),
        (
            FeatureLevel::LENDING,
            "leases lend idle GPUs to preemptible tenants; a policy may set spec.reclaim.lendIdle",
        ),
        (
            FeatureLevel::SIZED,
            "budgets are sized to each tenant's largest waiting pod",
        ),
        (FeatureLevel::LEND_WHEN, "a policy may set spec.reclaim.lendWhen"),
        (
            FeatureLevel::OPERATOR_VIEW,
            "policy revisions, each cluster's agent status and what runs, lease expiries, leaders, \
             members and restores in the audit log, budget changes coalesced per minute; \
             a policy may set spec.audit",
        ),
        (
            FeatureLevel::BORROWED,
            "reports carry borrowed usage apart, left out of the partition-safety check; \
             lending stays within maxShare federation-wide",
        ),
        (
            FeatureLevel::SMALL_FIRST,
            "free capacity goes to the smallest shortfalls of committed entitlement first",
        ),
    ];

    /// The level numbered `n` (a number read from disk or from a peer; levels above
    /// [`FeatureLevel::NEWEST`] exist in newer builds, and 0 reads as the base level).
    pub const fn new(n: u32) -> FeatureLevel {
        if n == 0 {
            FeatureLevel::BASE
        } else {
            FeatureLevel(n)
        }
    }

    /// The level's number.
    pub const fn get(self) -> u32 {
        self.0
    }

    /// The state keeps records: showback, reported decisions, the actors of commands.
    pub fn keeps_records(self) -> bool {
        self >= FeatureLevel::RECORDS
    }

    /// Leases lend idle GPUs to preemptible tenants.
    pub fn lends(self) -> bool {
        self >= FeatureLevel::LENDING
    }

    /// Budgets are sized to waiting pods, so log entries carry each report's largest
    /// waiting pod.
    pub fn sizes_budgets(self) -> bool {
        self >= FeatureLevel::SIZED
    }

    /// The state keeps the operator view (policy revisions, cluster status, the audit
    /// log's events and retention), so log entries carry each report's cluster status.
    pub fn keeps_operator_view(self) -> bool {
        self >= FeatureLevel::OPERATOR_VIEW
    }

    /// Log entries carry each report's borrowed usage.
    pub fn carries_borrowed(self) -> bool {
        self >= FeatureLevel::BORROWED
    }

    /// Free capacity fills the smallest shortfalls of committed entitlement first.
    pub fn fills_small_first(self) -> bool {
        self >= FeatureLevel::SMALL_FIRST
    }

    /// The log-entry format a group at this level writes: format 1 at level 1, the
    /// newest this build writes above it (a newer format may be written only once the
    /// level says every member reads it).
    pub fn entry_format(self) -> u32 {
        if self <= FeatureLevel::BASE {
            1
        } else {
            crate::types::LOG_FORMAT
        }
    }

    /// The snapshot format a group at this level writes (as [`Self::entry_format`]).
    pub fn snapshot_format(self) -> u32 {
        if self <= FeatureLevel::BASE {
            1
        } else {
            crate::store::SNAPSHOT_FORMAT
        }
    }

    /// Turns on, in the state machine, what this level's state does. Idempotent; called
    /// after an entry that raises the level has been applied, and again for entries in
    /// flight that carry the same raise.
    pub fn enable_in(self, federation: &mut Federation) {
        if self.keeps_records() {
            federation.enable_records();
        }
        if self.lends() {
            federation.enable_lending();
        }
        if self.sizes_budgets() {
            federation.enable_sized_budgets();
        }
        if self.keeps_operator_view() {
            federation.enable_operator_view();
        }
        if self.carries_borrowed() {
            federation.enable_borrow_cap();
        }
        if self.fills_small_first() {
            federation.enable_small_first();
        }
    }

    /// The first setting of `policy` a group at this level cannot replicate (a node
    /// below the level would drop it from the replicated policy): its YAML path and the
    /// level it needs.
    pub fn policy_refusal(self, policy: &Policy) -> Option<(&'static str, FeatureLevel)> {
        let gated = [
            (!policy.showback.is_default(), "spec.showback", FeatureLevel::RECORDS),
            (
                !policy.reclaim.lend_idle,
                "spec.reclaim.lendIdle",
                FeatureLevel::LENDING,
            ),
            (
                !policy.reclaim.lend_when.is_always(),
                "spec.reclaim.lendWhen",
                FeatureLevel::LEND_WHEN,
            ),
            (!policy.audit.is_default(), "spec.audit", FeatureLevel::OPERATOR_VIEW),
        ];
        gated
            .into_iter()
            .find(|&(set, _, needs)| set && self < needs)
            .map(|(_, what, needs)| (what, needs))
    }

    /// Strips from `commands` what a member at this level does not read (the leader's
    /// batcher, before it proposes them): below [`Self::SIZED`] no replica reads a
    /// report's largest waiting pod, below [`Self::OPERATOR_VIEW`] its cluster status,
    /// below [`Self::BORROWED`] its borrowed usage, so the log does not carry them.
    pub fn strip(self, commands: &mut [Command]) {
        let (sized, borrowed) = (self.sizes_budgets(), self.carries_borrowed());
        for c in commands {
            if let Command::Report(r) = c {
                if !(sized && borrowed) {
                    for t in r.tenants.values_mut() {
                        if !sized {
                            t.largest = 0;
                        }
                        if !borrowed {
                            t.borrowed = 0;
                        }
                    }
                }
                if !self.keeps_operator_view() {
                    r.status = None;
                }
            }
        }
    }
}

impl Default for FeatureLevel {
    fn default() -> Self {
        FeatureLevel::BASE
    }
}

impl fmt::Display for FeatureLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_ordered_and_each_enables_what_it_says() {
        let numbers: Vec<u32> = FeatureLevel::ALL.iter().map(|(l, _)| l.get()).collect();
        assert_eq!(numbers, vec![1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(FeatureLevel::ALL.last().map(|(l, _)| *l), Some(FeatureLevel::NEWEST));
        assert!(!FeatureLevel::BASE.keeps_records());
        assert!(FeatureLevel::RECORDS.keeps_records() && !FeatureLevel::RECORDS.lends());
        assert!(FeatureLevel::LENDING.lends() && !FeatureLevel::LENDING.sizes_budgets());
        assert!(FeatureLevel::SIZED.sizes_budgets() && !FeatureLevel::LEND_WHEN.keeps_operator_view());
        assert!(FeatureLevel::OPERATOR_VIEW.keeps_operator_view());
        assert_eq!(FeatureLevel::new(0), FeatureLevel::BASE);
        assert_eq!(FeatureLevel::BASE.entry_format(), 1);
    }

    #[test]
    fn enabling_a_level_turns_on_every_feature_below_it_and_no_other() {
        let mut fed = Federation::new();
        FeatureLevel::RECORDS.enable_in(&mut fed);
        assert!(fed.keeps_records() && !fed.lends() && !fed.sizes_budgets());
        FeatureLevel::SIZED.enable_in(&mut fed);
        assert!(fed.keeps_records() && fed.lends() && fed.sizes_budgets() && !fed.operator_view());
        FeatureLevel::OPERATOR_VIEW.enable_in(&mut fed);
        // Below level 7 leases are cut as a build of level 6 cuts them.
        assert!(fed.operator_view() && !fed.caps_borrowing());
        FeatureLevel::BORROWED.enable_in(&mut fed);
        assert!(fed.caps_borrowing() && !fed.fills_small_first());
        FeatureLevel::SMALL_FIRST.enable_in(&mut fed);
        assert!(fed.fills_small_first());
    }

    #[test]
    fn a_policy_setting_is_refused_below_its_level_only() {
        let mut p = Policy::from_yaml(
            "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: p}\nspec:\n  tenants:\n  - {name: a, weight: 1}\n",
        )
        .expect("policy");
        assert_eq!(FeatureLevel::BASE.policy_refusal(&p), None);
        p.reclaim.lend_idle = false;
        assert_eq!(
            FeatureLevel::RECORDS.policy_refusal(&p),
            Some(("spec.reclaim.lendIdle", FeatureLevel::LENDING))
        );
        assert_eq!(FeatureLevel::LENDING.policy_refusal(&p), None);
        p.audit.retention_ms = 3_600_000;
        assert_eq!(
            FeatureLevel::LEND_WHEN.policy_refusal(&p),
            Some(("spec.audit", FeatureLevel::OPERATOR_VIEW))
        );
        assert_eq!(FeatureLevel::OPERATOR_VIEW.policy_refusal(&p), None);
    }
}
