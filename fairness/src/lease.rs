//! Leases: what a cluster may admit, for how long, and how both sides account for it.
//!
//! A [`Lease`] is issued by the control-plane leader, committed through Raft before it
//! is sent, and sent only as the answer to an agent's request. Two halves of one rule:
//!
//! - **Agent side** ([`AgentLease`]): enforce a lease until `t_request + duration - margin`
//!   on the agent's monotonic clock, `t_request` being when the agent *sent* the request
//!   the lease answers (a late lease expires early, never late); never go back to an
//!   older epoch; after expiry enforce the lease's per-tenant `fallback` until a newer
//!   lease arrives.
//! - **Control-plane side** ([`ClusterLeases`]): every lease of epoch `>=` the
//!   cluster's acknowledged epoch may be the one the agent holds. Until
//!   `issued_at + duration` (control-plane clock) it may be enforcing the lease's budget;
//!   after that, at most its fallback. [`ClusterLeases::enforceable`] is the largest of
//!   these: an upper bound on what the cluster can admit right now, as long as clock
//!   rates differ by less than `margin / duration`.
//!
//! The fallback of a tenant is `min(safe budget, budget)`: the guarantee-sized safe budget
//! (docs/guarantees.md D1), but never more than the lease itself granted. Taking the minimum keeps the
//! partition-safety inequality true even for a tenant whose entitlement is below its safe
//! budgets (see `docs/fairness-model.md`, "Why the fallback is capped").

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::names::{ClusterName, TenantName};
use crate::{MilliGpue, Millis};

/// Most leases the control plane keeps open (issued, not yet superseded by an
/// acknowledgement) per cluster. Past it, the newest lease is renewed instead of a new
/// epoch being issued. 64 covers minutes of lost responses at one report per second.
pub const MAX_OPEN_LEASES: usize = 64;

/// One tenant's numbers inside a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TenantBudget {
    /// GPUe the tenant may hold in this cluster while the lease is in force.
    pub budget: MilliGpue,
    /// GPUe it may hold after the lease expired, until a newer lease arrives.
    pub fallback: MilliGpue,
    /// The tenant's federation-wide committed entitlement when the lease was issued
    /// (informational: for messages and explanations, not for enforcement).
    pub entitlement: MilliGpue,
    /// GPUe the tenant may hold here *beyond* its budget as borrowed capacity: idle GPUs
    /// lent to a preemptible tenant, evicted first when a tenant within its budget needs
    /// the room (see [`crate::admission::borrow_room`]). The control plane sets it to
    /// this cluster's part of the room between the tenant's entitlement and its maxShare
    /// of the federation, so a tenant's budgets and borrow limits together never pass its
    /// maxShare; 0 for a non-preemptible tenant, and from a control plane below the
    /// feature level that lends. Absent from the encoding when 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub borrow: MilliGpue,
    /// The most the tenant may ever hold in one cluster: `maxShare x G` (federation
    /// capacity), so a pod larger than it is refused at once as one that can never fit.
    /// 0: unknown (a control plane below the feature level that lends).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ceiling: MilliGpue,
}

fn is_zero(v: &MilliGpue) -> bool {
    *v == 0
}

/// A lease as the agent receives it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// The cluster it was issued to.
    pub cluster: ClusterName,
    /// Per-cluster epoch, starting at 1; a larger epoch supersedes a smaller one.
    pub epoch: u64,
    /// Lease duration (policy).
    pub duration_ms: Millis,
    /// Clock-skew margin the agent subtracts (policy).
    pub margin_ms: Millis,
    /// Control-plane time the lease was issued or last renewed (informational).
    pub issued_at_ms: Millis,
    /// Per-tenant budgets; tenants missing here have budget and fallback 0.
    pub budgets: BTreeMap<TenantName, TenantBudget>,
}

/// Why a lease cannot be enforced as it stands (read from the network, the journal or
/// the state kept in the cluster): the field and what is wrong with it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {why}")]
pub struct InvalidLease {
    /// The field, as `budgets[TENANT].fallback`.
    pub field: String,
    /// What is wrong.
    pub why: String,
}

impl Lease {
    /// Checks what every reader of a lease relies on: epochs start at 1, the margin is at
    /// most half the duration (so a lease is enforceable for some time after its request
    /// was sent), and no tenant's fallback exceeds its budget (the fallback is the part
    /// of the budget kept after expiry). Every decoder of a lease calls this.
    pub fn validate(&self) -> Result<(), InvalidLease> {
        let bad = |field: String, why: &str| InvalidLease {
            field,
            why: why.to_string(),
        };
        if self.epoch == 0 {
            return Err(bad("epoch".into(), "epochs start at 1"));
        }
        if self.margin_ms.saturating_mul(2) > self.duration_ms {
            return Err(bad("margin_ms".into(), "more than half the duration"));
        }
        if let Some((t, _)) = self.budgets.iter().find(|(_, b)| b.fallback > b.budget) {
            return Err(bad(format!("budgets[{t}].fallback"), "fallback exceeds the budget"));
        }
        Ok(())
    }

    /// Budget of `tenant` while in force.
    pub fn budget(&self, tenant: &str) -> MilliGpue {
        self.budgets.get(tenant).map_or(0, |b| b.budget)
    }
    /// Fallback of `tenant` after expiry.
    pub fn fallback(&self, tenant: &str) -> MilliGpue {
        self.budgets.get(tenant).map_or(0, |b| b.fallback)
    }
    /// Ceiling of `tenant` ([`TenantBudget::ceiling`]; 0: unknown).
    pub fn ceiling(&self, tenant: &str) -> MilliGpue {
        self.budgets.get(tenant).map_or(0, |b| b.ceiling)
    }
    /// Borrow limit of `tenant` ([`TenantBudget::borrow`]).
    pub fn borrow(&self, tenant: &str) -> MilliGpue {
        self.budgets.get(tenant).map_or(0, |b| b.borrow)
    }
}

/// How the agent's lease stands at some instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum LeaseStatus {
    /// Never received a lease: every tenant's budget is 0 (fail closed).
    None,
    /// In force with plenty of time left.
    Fresh {
        /// Until the agent stops enforcing the budget.
        remaining_ms: Millis,
    },
    /// In force, with less than a third of its life left: renewals are late.
    Expiring {
        /// Until the agent stops enforcing the budget.
        remaining_ms: Millis,
    },
    /// Expired: enforcing the fallback (safe budget) until a newer lease arrives.
    Safe,
}

impl fmt::Display for LeaseStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LeaseStatus::None => f.write_str("no lease"),
            LeaseStatus::Fresh { remaining_ms } => {
                write!(f, "fresh ({} left)", crate::units::format_duration_ms(*remaining_ms))
            }
            LeaseStatus::Expiring { remaining_ms } => {
                write!(f, "expiring ({} left)", crate::units::format_duration_ms(*remaining_ms))
            }
            LeaseStatus::Safe => f.write_str("expired, enforcing safe budgets"),
        }
    }
}

/// What [`AgentLease::on_lease`] did with a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseUpdate {
    /// A newer epoch: now enforced.
    Adopted,
    /// The same epoch again: its validity was extended if the new anchor is later.
    Renewed,
    /// An older epoch than the one held: ignored (epochs never go back).
    Stale,
    /// For another cluster, or the same epoch with different budgets: ignored.
    Rejected,
}

/// The agent's side of the lease rule. Pure: the caller passes its monotonic clock.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentLease {
    cluster: ClusterName,
    held: Option<Lease>,
    /// Agent-monotonic time until which the held lease's budgets apply; `None` once
    /// the lease came from disk (the monotonic clock does not survive a restart).
    valid_until_ms: Option<Millis>,
}

impl AgentLease {
    /// An agent for `cluster` that holds no lease yet.
    pub fn new(cluster: ClusterName) -> Self {
        AgentLease {
            cluster,
            held: None,
            valid_until_ms: None,
        }
    }

    /// An agent restarted with `lease` read back from its disk: the epoch is known (so
    /// older leases stay refused) but its validity is not, so the fallback applies at
    /// once until the control plane answers.
    pub fn restored(lease: Lease) -> Self {
        AgentLease {
            cluster: lease.cluster.clone(),
            held: Some(lease),
            valid_until_ms: None,
        }
    }

    /// Takes a lease that answered a request sent at `request_sent_ms` (agent clock).
    pub fn on_lease(&mut self, lease: Lease, request_sent_ms: Millis) -> LeaseUpdate {
        if lease.cluster != self.cluster {
            return LeaseUpdate::Rejected;
        }
        let until = request_sent_ms.saturating_add(lease.duration_ms.saturating_sub(lease.margin_ms));
        match &self.held {
            Some(h) if lease.epoch < h.epoch => LeaseUpdate::Stale,
            Some(h) if lease.epoch == h.epoch => {
                if lease.budgets != h.budgets {
                    // The same epoch read back from an older agent's save, which did not
                    // keep the borrow limits and ceilings (fields it did not know): the
                    // budgets are what counts; take the limits from the control plane.
                    let same_budgets = lease.budgets.len() == h.budgets.len()
                        && lease.budgets.iter().zip(&h.budgets).all(|((a, x), (b, y))| {
                            a == b && (x.budget, x.fallback, x.entitlement) == (y.budget, y.fallback, y.entitlement)
                        });
                    let h_lacks_limits = h.budgets.values().all(|b| b.borrow == 0 && b.ceiling == 0);
                    if !(same_budgets && h_lacks_limits) {
                        return LeaseUpdate::Rejected;
                    }
                    self.held = Some(lease);
                }
                self.valid_until_ms = Some(self.valid_until_ms.map_or(until, |u| u.max(until)));
                LeaseUpdate::Renewed
            }
            _ => {
                self.held = Some(lease);
                self.valid_until_ms = Some(until);
                LeaseUpdate::Adopted
            }
        }
    }

    /// The epoch held (0: none). Sent with every report as the acknowledgement.
    pub fn held_epoch(&self) -> u64 {
        self.held.as_ref().map_or(0, |l| l.epoch)
    }

    /// The lease held, if any (for persistence and display).
    pub fn lease(&self) -> Option<&Lease> {
        self.held.as_ref()
    }

    /// The lease's standing at `now_ms` (agent clock).
    pub fn status(&self, now_ms: Millis) -> LeaseStatus {
        let Some(lease) = &self.held else {
            return LeaseStatus::None;
        };
        match self.valid_until_ms {
            Some(until) if now_ms < until => {
                let remaining_ms = until - now_ms;
                if remaining_ms.saturating_mul(3) <= lease.duration_ms {
                    LeaseStatus::Expiring { remaining_ms }
                } else {
                    LeaseStatus::Fresh { remaining_ms }
                }
            }
            _ => LeaseStatus::Safe,
        }
    }

    /// Until when (agent clock) the held lease's budgets apply; `None` without a lease
    /// or with one whose validity is unknown (read back from disk).
    pub fn valid_until(&self) -> Option<Millis> {
        self.held.as_ref().and(self.valid_until_ms)
    }

    /// Takes `lease` as another process of this agent held it, enforceable until
    /// `valid_until_ms` on this process's clock (`None`: its validity is unknown, so only
    /// its fallback applies). Epochs never go back: an older lease than the one held is
    /// ignored; the same epoch keeps the later validity.
    pub fn restore_anchored(&mut self, lease: Lease, valid_until_ms: Option<Millis>) -> LeaseUpdate {
        if lease.cluster != self.cluster {
            return LeaseUpdate::Rejected;
        }
        match &self.held {
            Some(h) if lease.epoch < h.epoch => LeaseUpdate::Stale,
            Some(h) if lease.epoch == h.epoch => {
                if lease.budgets != h.budgets {
                    return LeaseUpdate::Rejected;
                }
                self.valid_until_ms = match (self.valid_until_ms, valid_until_ms) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    (a, b) => a.or(b),
                };
                LeaseUpdate::Renewed
            }
            _ => {
                self.held = Some(lease);
                self.valid_until_ms = valid_until_ms;
                LeaseUpdate::Adopted
            }
        }
    }

    /// What `tenant` may hold in this cluster at `now_ms`: the budget while the lease is
    /// in force, the fallback after, 0 without a lease.
    pub fn budget(&self, tenant: &str, now_ms: Millis) -> MilliGpue {
        match (&self.held, self.status(now_ms)) {
            (None, _) => 0,
            (Some(l), LeaseStatus::Safe) if !crate::faults::on(|f| f.ignore_expiry) => l.fallback(tenant),
            (Some(l), _) => l.budget(tenant),
        }
    }
}

/// A lease as the control plane remembers it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IssuedLease {
    /// Its epoch.
    pub epoch: u64,
    /// Its budgets.
    pub budgets: BTreeMap<TenantName, TenantBudget>,
    /// Control-plane time it was issued or last renewed.
    pub issued_at_ms: Millis,
    /// Control-plane time after which no agent can still be enforcing its budget:
    /// latest issue/renewal time plus the full duration.
    pub expires_at_ms: Millis,
}

/// Acknowledgement of an epoch that was never issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("acknowledged lease epoch {acked} was never issued (latest issued is {latest})")]
pub struct UnknownEpoch {
    /// The epoch the agent claimed.
    pub acked: u64,
    /// The latest epoch issued to that cluster.
    pub latest: u64,
}

/// The control plane's book of one cluster's leases.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ClusterLeases {
    /// Latest epoch issued (0: none yet).
    pub last_epoch: u64,
    /// Highest epoch the agent reported holding.
    pub acked_epoch: u64,
    /// Leases of epoch `>= acked_epoch` (oldest first): any may be the one held.
    pub open: Vec<IssuedLease>,
}

impl ClusterLeases {
    /// The agent holds `epoch` or newer: older leases are provably superseded.
    pub fn ack(&mut self, epoch: u64) -> Result<(), UnknownEpoch> {
        if epoch > self.last_epoch {
            return Err(UnknownEpoch {
                acked: epoch,
                latest: self.last_epoch,
            });
        }
        if epoch > self.acked_epoch {
            self.acked_epoch = epoch;
            self.open.retain(|l| l.epoch >= epoch);
        }
        Ok(())
    }

    /// Checks an acknowledgement without applying it.
    pub fn check_ack(&self, epoch: u64) -> Result<(), UnknownEpoch> {
        if epoch > self.last_epoch {
            Err(UnknownEpoch {
                acked: epoch,
                latest: self.last_epoch,
            })
        } else {
            Ok(())
        }
    }

    /// The newest lease issued, if any.
    pub fn latest(&self) -> Option<&IssuedLease> {
        self.open.last()
    }

    /// Upper bound of what the cluster may enforce for `tenant` at `now_ms` (CP clock).
    /// A cluster that was never issued a lease enforces 0.
    pub fn enforceable(&self, tenant: &str, now_ms: Millis) -> MilliGpue {
        self.open
            .iter()
            .map(|l| {
                let b = l.budgets.get(tenant).copied().unwrap_or_default();
                if now_ms < l.expires_at_ms {
                    b.budget.max(b.fallback)
                } else {
                    b.fallback
                }
            })
            .max()
            .unwrap_or(0)
    }

    /// True when no open lease can still be in force: the agent enforces fallbacks only.
    pub fn all_expired(&self, now_ms: Millis) -> bool {
        self.open.iter().all(|l| now_ms >= l.expires_at_ms)
    }

    /// Issues `budgets` at `now_ms`: renews the newest lease if its budgets are the same
    /// (or too many leases are open), else opens a new epoch. Returns the lease to send.
    pub fn issue(
        &mut self,
        cluster: &ClusterName,
        budgets: BTreeMap<TenantName, TenantBudget>,
        now_ms: Millis,
        duration_ms: Millis,
        margin_ms: Millis,
    ) -> Lease {
        let expires_at_ms = now_ms.saturating_add(duration_ms);
        let renew = match self.open.last() {
            Some(l) => l.budgets == budgets || self.open.len() >= MAX_OPEN_LEASES,
            None => false,
        };
        if renew {
            if let Some(l) = self.open.last_mut() {
                l.issued_at_ms = now_ms;
                l.expires_at_ms = l.expires_at_ms.max(expires_at_ms);
                return Lease {
                    cluster: cluster.clone(),
                    epoch: l.epoch,
                    duration_ms,
                    margin_ms,
                    issued_at_ms: now_ms,
                    budgets: l.budgets.clone(),
                };
            }
        }
        self.last_epoch += 1;
        self.open.push(IssuedLease {
            epoch: self.last_epoch,
            budgets: budgets.clone(),
            issued_at_ms: now_ms,
            expires_at_ms,
        });
        Lease {
            cluster: cluster.clone(),
            epoch: self.last_epoch,
            duration_ms,
            margin_ms,
            issued_at_ms: now_ms,
            budgets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budgets(b: u64, f: u64) -> BTreeMap<TenantName, TenantBudget> {
        [(
            TenantName::from_static("t"),
            TenantBudget {
                budget: b,
                fallback: f,
                entitlement: b,
                borrow: 0,
                ceiling: 0,
            },
        )]
        .into()
    }

    fn lease(epoch: u64, b: u64, f: u64) -> Lease {
        Lease {
            cluster: ClusterName::from_static("c1"),
            epoch,
            duration_ms: 30_000,
            margin_ms: 3_000,
            issued_at_ms: 0,
            budgets: budgets(b, f),
        }
    }

    #[test]
    fn agent_expires_at_request_plus_duration_minus_margin() {
        let mut a = AgentLease::new(ClusterName::from_static("c1"));
        assert_eq!(a.budget("t", 0), 0);
        assert_eq!(a.status(0), LeaseStatus::None);
        assert_eq!(a.on_lease(lease(1, 10, 4), 1_000), LeaseUpdate::Adopted);
        assert_eq!(a.budget("t", 27_999), 10);
        assert_eq!(a.budget("t", 28_000), 4);
        assert_eq!(a.status(28_000), LeaseStatus::Safe);
        assert!(matches!(
            a.status(25_000),
            LeaseStatus::Expiring { remaining_ms: 3_000 }
        ));
        assert!(matches!(a.status(2_000), LeaseStatus::Fresh { remaining_ms: 26_000 }));
    }

    #[test]
    fn late_lease_expires_early_and_old_epochs_are_ignored() {
        let mut a = AgentLease::new(ClusterName::from_static("c1"));
        // Answer to a request sent at t=0 arrives at t=40s: already expired.
        a.on_lease(lease(2, 10, 4), 0);
        assert_eq!(a.budget("t", 40_000), 4);
        assert_eq!(a.on_lease(lease(1, 99, 99), 39_000), LeaseUpdate::Stale);
        assert_eq!(a.held_epoch(), 2);
        // Renewal of the same epoch from a later request extends it.
        assert_eq!(a.on_lease(lease(2, 10, 4), 39_000), LeaseUpdate::Renewed);
        assert_eq!(a.budget("t", 40_000), 10);
        // Same epoch with other budgets is a protocol violation: ignored.
        assert_eq!(a.on_lease(lease(2, 50, 4), 39_500), LeaseUpdate::Rejected);
        assert_eq!(a.budget("t", 40_000), 10);
        let mut other = lease(3, 1, 1);
        other.cluster = ClusterName::from_static("c2");
        assert_eq!(a.on_lease(other, 0), LeaseUpdate::Rejected);
    }

    #[test]
    fn the_same_epoch_with_limits_an_older_save_lacked_is_a_renewal() {
        let mut a = AgentLease::restored(lease(5, 8_000, 2_000));
        let mut with = lease(5, 8_000, 2_000);
        if let Some(b) = with.budgets.get_mut("t") {
            b.borrow = 3_000;
            b.ceiling = 20_000;
        }
        assert_eq!(a.on_lease(with.clone(), 0), LeaseUpdate::Renewed);
        assert_eq!(a.lease().map(|l| l.borrow("t")), Some(3_000));
        // Other differences under the same epoch are still refused.
        let mut other = with.clone();
        if let Some(b) = other.budgets.get_mut("t") {
            b.budget = 9_000;
        }
        assert_eq!(a.on_lease(other, 0), LeaseUpdate::Rejected);
        let mut changed = with;
        if let Some(b) = changed.budgets.get_mut("t") {
            b.borrow = 1_000;
        }
        assert_eq!(
            a.on_lease(changed, 0),
            LeaseUpdate::Rejected,
            "limits differ from limits held"
        );
    }

    #[test]
    fn restored_lease_enforces_fallback_and_refuses_older() {
        let mut a = AgentLease::restored(lease(5, 10, 3));
        assert_eq!(a.status(0), LeaseStatus::Safe);
        assert_eq!(a.budget("t", 0), 3);
        assert_eq!(a.on_lease(lease(4, 10, 3), 0), LeaseUpdate::Stale);
        assert_eq!(a.on_lease(lease(5, 10, 3), 0), LeaseUpdate::Renewed);
        assert_eq!(a.budget("t", 1), 10);
    }

    #[test]
    fn a_lease_restored_from_another_process_keeps_epochs_and_the_shorter_life() {
        let mut a = AgentLease::restored(lease(5, 10, 3));
        assert_eq!(a.valid_until(), None);
        // The same epoch, with a known validity: enforced until then.
        assert_eq!(a.restore_anchored(lease(5, 10, 3), Some(9_000)), LeaseUpdate::Renewed);
        assert_eq!(a.budget("t", 8_999), 10);
        assert_eq!(a.budget("t", 9_000), 3);
        // An older epoch is not taken; a newer one is, with its own validity.
        assert_eq!(a.restore_anchored(lease(4, 99, 99), Some(50_000)), LeaseUpdate::Stale);
        assert_eq!(a.restore_anchored(lease(6, 20, 5), None), LeaseUpdate::Adopted);
        assert_eq!(a.status(0), LeaseStatus::Safe, "validity unknown: fallback at once");
        assert_eq!(a.budget("t", 0), 5);
        let mut other = lease(7, 1, 1);
        other.cluster = ClusterName::from_static("c2");
        assert_eq!(a.restore_anchored(other, Some(1)), LeaseUpdate::Rejected);
    }

    #[test]
    fn control_plane_counts_every_lease_that_may_be_held() {
        let mut b = ClusterLeases::default();
        let l1 = b.issue(&ClusterName::from_static("c1"), budgets(10, 4), 0, 30_000, 3_000);
        assert_eq!(l1.epoch, 1);
        // Same budgets: a renewal, not a new epoch.
        assert_eq!(
            b.issue(&ClusterName::from_static("c1"), budgets(10, 4), 5_000, 30_000, 3_000)
                .epoch,
            1
        );
        assert_eq!(b.open[0].expires_at_ms, 35_000);
        // A decrease: both epochs may be held until the agent acknowledges 2.
        let l2 = b.issue(&ClusterName::from_static("c1"), budgets(6, 4), 6_000, 30_000, 3_000);
        assert_eq!(l2.epoch, 2);
        assert_eq!(b.enforceable("t", 7_000), 10);
        b.ack(2).expect("issued");
        assert_eq!(b.enforceable("t", 7_000), 6);
        // After expiry only the fallback remains.
        assert_eq!(b.enforceable("t", 36_000), 4);
        assert!(b.all_expired(36_000));
        assert_eq!(b.ack(9), Err(UnknownEpoch { acked: 9, latest: 2 }));
        // Unknown tenant: nothing.
        assert_eq!(b.enforceable("nobody", 7_000), 0);
    }
}
