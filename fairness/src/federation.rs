//! The control plane's state machine: commands in, leases and audit records out.
//!
//! [`Federation::apply`] is what the Raft state machine calls for every committed log
//! entry (and what the simulator and the chaos tests call directly). It is a pure
//! function of the state and `(now_ms, command)`; `now_ms` is stamped by the leader
//! when it proposes the entry, and the state's clock never runs backwards. A command
//! that fails changes nothing.
//!
//! ## Entitlement in two steps: target and committed
//! The *target* entitlement `E_t` is the fairness model ([`crate::entitlement`]) on
//! current inputs. The *committed* entitlement `Ê_t` is what budgets are cut from, and it
//! moves toward the target by break-before-make:
//! - down at once, but never below what the tenant's leases may still let clusters
//!   admit (`Ê'_t = min(Ê_t, max(E_t, L_t))`, `L_t` the left side of the safety
//!   inequality);
//! - up only into capacity nobody else holds (`sum Ê <= G`), shared in proportion to
//!   the shortfall; or, once [`Federation::enable_small_first`] is on (the control
//!   plane's feature level 8), filling the smallest shortfalls whole first, so that
//!   capacity freed a GPU at a time reaches a tenant as a GPU it can use, not as a
//!   fraction of one spread over every tenant that waits.
//!
//! ## Partition safety
//! For every tenant, at every instant: `sum_c hold_tc <= max(Ê_t, sum_c inuse_tc)` and
//! `sum_t Ê_t <= G`, where `inuse_tc` is the last reported in-use and
//! `hold_tc = max(bound_tc, enforceable_tc)` ([`TenantUsage::hold`]): the reported in-use
//! raised to every budget granted since that report (pods admitted under a lease keep
//! running after it expires), or what the cluster may still admit under any lease it
//! may hold ([`ClusterLeases::enforceable`]). A new budget for cluster `c` is clipped so
//! that the inequality holds given what every *other* cluster may hold
//! ([`Federation::check_safety`] verifies it).

use crate::stamped::Stamped;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::entitlement::{self, Entitlement, TenantInput};
use crate::lease::{ClusterLeases, Lease, TenantBudget, UnknownEpoch};
use crate::names::{ClusterName, TenantName};
use crate::policy::Policy;
use crate::split::{fit_largest, split_tenant};
use crate::{MilliGpue, Millis};

/// Smallest budget change recorded in the audit log (0.1 GPUe), unless a budget starts or
/// stops being zero.
pub const AUDIT_MIN_CHANGE: MilliGpue = 100;
/// Most clusters in one federation.
pub const MAX_CLUSTERS: usize = 1_000;
/// Most tenants one report may carry (a policy has at most this many).
pub const MAX_REPORT_TENANTS: usize = crate::policy::MAX_TENANTS;

/// Most eviction notes one report carries (reclaim is rate limited far below this; an
/// How far past the control plane's clock a report's window may end and still be taken
/// as a window. An agent whose wall clock runs further ahead would otherwise mark its
/// cluster's usage as counted into the future, and every later report would count
/// nothing; such a window is ignored instead (the usage is counted in full, as from an
/// agent that sends no window). Leases do not depend on wall clocks, so a bad clock
/// must not break accounting either.
pub const MAX_WINDOW_AHEAD_MS: u64 = 10 * 60 * 1_000;

/// agent keeps the rest for its next report).
pub const MAX_REPORT_EVICTIONS: usize = 64;

/// Longest text field of an eviction note, in bytes (pod keys, the reason).
pub const MAX_EVICTION_TEXT: usize = 1024;
/// Most admission decisions one report carries (the agent keeps the rest for its next).
pub const MAX_REPORT_DECISIONS: usize = 64;
/// Longest explanation of a decision, in bytes (an agent cuts longer ones).
pub const MAX_DECISION_TEXT: usize = 4096;
/// Admission decisions kept per cluster (oldest dropped; a pod judged again replaces
/// its earlier decision).
pub const DECISIONS_PER_CLUSTER: usize = 512;
/// Most resource names in a cluster's capacity.
pub const MAX_CAPACITY_RESOURCES: usize = 64;

mod audit;
mod grid;
pub use audit::{
    parse_kinds, AuditEvent, AuditRecord, BudgetChange, AUDIT_CAPACITY, BUDGET_COALESCE_MS, CONTROL_PLANE_ACTOR, KINDS,
    KIND_BUDGETS, MAX_ACTOR_LEN, MAX_POLICY_CHANGE_LINES, MAX_VERSION_LEN, POLICY_UNCHANGED,
};
use grid::Grid;

/// Looks keys up in a name-keyed map in ascending order, walking the map once: `n`
/// lookups cost `O(n + len)` comparisons instead of `O(n log len)` (with a thousand
/// tenants, string comparisons in map lookups were most of a report's cost).
struct Ascending<'a, K, V> {
    entries: std::iter::Peekable<std::collections::btree_map::Iter<'a, K, V>>,
    #[cfg(debug_assertions)]
    last: Option<&'a str>,
}

impl<'a, K: AsRef<str>, V> Ascending<'a, K, V> {
    fn new(map: &'a BTreeMap<K, V>) -> Self {
        Ascending {
            entries: map.iter().peekable(),
            #[cfg(debug_assertions)]
            last: None,
        }
    }

    /// The value of `key`; keys must come in ascending order.
    fn get(&mut self, key: &'a str) -> Option<&'a V> {
        #[cfg(debug_assertions)]
        {
            debug_assert!(self.last.is_none_or(|l| l <= key), "keys out of order");
            self.last = Some(key);
        }
        while let Some((k, v)) = self.entries.peek() {
            match k.as_ref().cmp(key) {
                std::cmp::Ordering::Less => {
                    self.entries.next();
                }
                std::cmp::Ordering::Equal => return Some(v),
                std::cmp::Ordering::Greater => return None,
            }
        }
        None
    }
}

/// Calls `f(row, value)` for each entry of `map` whose key is `names[row]`, walking the
/// map and the names in key order together (`order`: the rows sorted by name).
fn join_sorted<'a, K: AsRef<str>, V>(
    names: &[K],
    order: &[usize],
    map: &'a BTreeMap<K, V>,
    mut f: impl FnMut(usize, &'a V),
) {
    let mut entries = map.iter();
    let mut entry = entries.next();
    let mut k = 0;
    while let (Some((key, v)), Some(&row)) = (entry, order.get(k)) {
        match key.as_ref().cmp(names[row].as_ref()) {
            std::cmp::Ordering::Less => entry = entries.next(),
            std::cmp::Ordering::Greater => k += 1,
            std::cmp::Ordering::Equal => {
                f(row, v);
                entry = entries.next();
                k += 1;
            }
        }
    }
}

/// Last reported numbers of one tenant in one cluster, and what it may hold since.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TenantUsage {
    /// Bound plus reserved GPUe, as last reported.
    pub inuse: MilliGpue,
    /// GPUe waiting (queued behind the gate, or recently denied), as last reported.
    pub pending: MilliGpue,
    /// Upper bound of what the tenant may hold in the cluster now: the reported in-use,
    /// raised to every budget granted since that report. Pods admitted under a budget
    /// keep running after its lease expires, so expiry never lowers this; only a newer
    /// report does.
    pub bound: MilliGpue,
    /// GPUe of the tenant's largest pod waiting here, as last reported (`<= pending`;
    /// 0: none waits, or budgets are not sized, see [`Federation::enable_sized_budgets`]).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub largest: MilliGpue,
    /// Of `inuse`, what pods admitted on borrowed GPUs held, as last reported (0 from
    /// agents or a group below feature level 7). `bound` leaves it out.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub borrowed: MilliGpue,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl TenantUsage {
    /// What the control plane must assume the tenant holds in the cluster now:
    /// `max(bound, enforceable)`.
    pub fn hold(&self, enforceable: MilliGpue) -> MilliGpue {
        self.bound.max(self.inuse).max(enforceable)
    }

    /// [`TenantUsage::hold`] without what borrowed pods hold: the tenant's part of the
    /// partition-safety inequality (borrowed pods are bounded by the borrow limits
    /// instead, see docs/fairness-model.md).
    pub fn held_within_budgets(&self, enforceable: MilliGpue) -> MilliGpue {
        self.bound.max(self.inuse_within_budgets()).max(enforceable)
    }

    /// The in-use last reported, without what borrowed pods hold.
    pub fn inuse_within_budgets(&self) -> MilliGpue {
        self.inuse.saturating_sub(self.borrowed)
    }
}

/// One tenant's part of a usage report.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TenantReport {
    /// GPUe x milliseconds used since the previous report (milli-GPUe x ms).
    pub used_milli_gpue_ms: u64,
    /// Bound plus reserved GPUe now.
    pub inuse: MilliGpue,
    /// GPUe waiting now.
    pub pending: MilliGpue,
    /// GPUe of the largest single pod waiting now (0: none; at most `pending`). Absent
    /// from older reports: 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub largest: MilliGpue,
    /// Of `inuse`, GPUe held by pods admitted on borrowed GPUs (at most `inuse`). Absent
    /// from older reports: 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub borrowed: MilliGpue,
}

/// An eviction a member's reclaim loop attempted, carried by its next report into the
/// federation's audit log (so `kvota audit` and `kvota explain tenant` show it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct EvictionNote {
    /// The pod evicted or whose eviction was refused (`namespace/name`).
    pub victim: String,
    /// Its tenant.
    pub victim_tenant: String,
    /// The starved tenant it made room for.
    pub for_tenant: String,
    /// The starved tenant's pod.
    pub for_pod: String,
    /// GPUe the victim held.
    pub milli_gpue: MilliGpue,
    /// Evicted, or blocked (a PodDisruptionBudget refused it; retried later).
    pub outcome: EvictionOutcome,
    /// Why this victim, with the starved tenant's numbers.
    pub why: String,
}

/// What became of an eviction a member's reclaim loop attempted. Written as its word
/// (`evicted`, `blocked`) in log entries, snapshots, messages and metric labels.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum EvictionOutcome {
    /// The pod was evicted.
    #[default]
    Evicted,
    /// A PodDisruptionBudget refused the eviction; reclaim retries later.
    Blocked,
    /// A word no kvota sends, kept as it was read: a log entry that carries one still
    /// decodes, and its report is refused when applied, as it always was.
    Unrecognized(String),
}

impl EvictionOutcome {
    /// The outcome named by `word`.
    pub fn parse(word: &str) -> EvictionOutcome {
        match word {
            "evicted" => EvictionOutcome::Evicted,
            "blocked" => EvictionOutcome::Blocked,
            other => EvictionOutcome::Unrecognized(other.to_string()),
        }
    }

    /// Its word.
    pub fn as_str(&self) -> &str {
        match self {
            EvictionOutcome::Evicted => "evicted",
            EvictionOutcome::Blocked => "blocked",
            EvictionOutcome::Unrecognized(w) => w,
        }
    }
}

impl fmt::Display for EvictionOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl Serialize for EvictionOutcome {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for EvictionOutcome {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let word = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(EvictionOutcome::parse(&word))
    }
}

impl EvictionNote {
    fn validate(&self, i: usize) -> Result<(), CommandError> {
        let invalid = |why: String| CommandError::Invalid {
            what: format!("report evictions[{i}]"),
            why,
        };
        for (name, v) in [
            ("victim", self.victim.as_str()),
            ("victim_tenant", self.victim_tenant.as_str()),
            ("for_tenant", self.for_tenant.as_str()),
            ("for_pod", self.for_pod.as_str()),
            ("outcome", self.outcome.as_str()),
            ("why", self.why.as_str()),
        ] {
            if v.len() > MAX_EVICTION_TEXT {
                return Err(invalid(format!(
                    "{name} is {} bytes; at most {MAX_EVICTION_TEXT}",
                    v.len()
                )));
            }
        }
        if let EvictionOutcome::Unrecognized(word) = &self.outcome {
            return Err(invalid(format!("outcome `{word}`: `evicted` or `blocked`")));
        }
        Ok(())
    }
}

/// An admission decision a member's agent made about a GPU pod, carried by its next
/// report so `kvota explain pod` works from any control-plane node, long after.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodDecision {
    /// The pod (`namespace/name`).
    pub pod: String,
    /// Its tenant.
    pub tenant: String,
    /// Allow, queue or deny.
    pub verdict: crate::admission::Verdict,
    /// GPUe the pod asked for.
    pub milli_gpue: MilliGpue,
    /// When the agent decided (its wall clock, Unix ms).
    pub at_ms: u64,
    /// The numbers behind it, in sentences (at most [`MAX_DECISION_TEXT`] bytes).
    pub text: String,
}

impl PodDecision {
    /// Fit to keep: a `namespace/name` of DNS names, a tenant name, a bounded text.
    pub fn is_valid(&self) -> bool {
        let pod_ok = crate::names::PodKey::parse(self.pod.as_str()).is_ok_and(|k| !k.is_provisional());
        pod_ok && crate::names::is_dns_label(&self.tenant) && self.text.len() <= MAX_DECISION_TEXT
    }
}

/// Reads a report's tenants, keeping those whose name is a DNS label. Builds before
/// 2026-12-04 let a member report a tenant named like `team-` (a looser check at the
/// gRPC port) into the log; applying such a report ignored it, as no policy can name it.
/// Dropping it when the entry is read leaves every replica in the state it reached
/// then, where refusing it would stop a node replaying that log.
pub fn tenants_that_are_labels<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<TenantName, TenantReport>, D::Error> {
    let raw = BTreeMap::<String, TenantReport>::deserialize(d)?;
    Ok(raw
        .into_iter()
        .filter_map(|(name, r)| TenantName::parse(name).ok().map(|n| (n, r)))
        .collect())
}

/// A member's usage report; its answer carries the cluster's lease.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageReport {
    /// Reporting cluster.
    pub cluster: ClusterName,
    /// Per-cluster sequence number: the first is 1, each next one is exactly one more.
    pub seq: u64,
    /// Lease epoch the agent holds (its acknowledgement; 0 = none).
    pub held_epoch: u64,
    /// New capacity per resource (quantity milli), if it changed.
    pub capacity: Option<BTreeMap<String, u64>>,
    /// Per-tenant numbers; tenants the policy does not know are ignored. Decoding keeps
    /// only names that are DNS labels ([`tenants_that_are_labels`]).
    #[serde(deserialize_with = "tenants_that_are_labels")]
    pub tenants: BTreeMap<TenantName, TenantReport>,
    /// Evictions since the previous report (at most [`MAX_REPORT_EVICTIONS`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evictions: Vec<EvictionNote>,
    /// Admission decisions since the previous report (at most [`MAX_REPORT_DECISIONS`]);
    /// kept per cluster once the federation keeps records ([`Federation::enable_records`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub decisions: Vec<PodDecision>,
    /// The span of time the usage was metered over, on the reporting agent's wall clock.
    /// `None` (older agents): counted in full. See [`UsageWindow`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<UsageWindow>,
    /// The agent and its cluster as the agent sees them when it sends the report (none
    /// from older agents; kept from feature level 6, [`Federation::enable_operator_view`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ClusterStatus>,
}

/// What a cluster's agent says about itself and its cluster with each report, for the
/// people running the federation: its build, the policy revision it enforces, how often
/// it reports, and what runs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct ClusterStatus {
    /// The agent's version (at most [`MAX_VERSION_LEN`] bytes).
    pub agent_version: String,
    /// The newest feature level the agent's build supports.
    pub feature_level: u32,
    /// The policy revision the agent enforces (0: none it knows the revision of).
    pub policy_revision: u64,
    /// How often the agent reports (ms).
    pub report_interval_ms: u64,
    /// GPUe of the tenant's pods running: on a node, bound by the scheduler (the rest of
    /// its in-use is admitted and not yet running: reservations). At most its in-use.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub running: BTreeMap<TenantName, MilliGpue>,
}

impl ClusterStatus {
    /// The status as the state keeps it: a version cut to [`MAX_VERSION_LEN`] bytes of
    /// printable ASCII, each tenant's running at most its in-use in `usage` (a report
    /// of more is read as all of it running), tenants without in-use left out.
    fn kept(mut self, usage: &BTreeMap<TenantName, TenantUsage>) -> ClusterStatus {
        self.agent_version = self
            .agent_version
            .chars()
            .filter(|c| c.is_ascii_graphic())
            .take(MAX_VERSION_LEN)
            .collect();
        self.running = std::mem::take(&mut self.running)
            .into_iter()
            .filter_map(|(t, r)| {
                let inuse = usage.get(&t).map_or(0, |u| u.inuse);
                (inuse > 0 && r > 0).then(|| (t, r.min(inuse)))
            })
            .collect();
        self
    }
}

/// When a report's usage happened (Unix milliseconds on the agent's wall clock).
///
/// A cluster's reports normally cover back-to-back windows. Two agent replicas take turns
/// reporting for one cluster: the one taking over reports what it metered while standing
/// by since the other's last applied report (so a takeover loses nothing), and the part of
/// a window that an applied report already covered is not counted again: the usage is
/// cut pro rata to the uncovered part (see [`UsageWindow::uncovered`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct UsageWindow {
    /// Start of the metering (exclusive of anything reported before it by this agent).
    pub start_ms: u64,
    /// When the report was written.
    pub end_ms: u64,
}

impl UsageWindow {
    /// The share of `used` that falls after `covered_through` (a cluster's earlier
    /// reports' latest window end), assuming usage spread evenly over the window. A
    /// window entirely covered counts nothing; one starting at or after it counts all;
    /// an empty or backwards window (a clock step) counts all unless it ends by then.
    pub fn uncovered(&self, used: u64, covered_through: Option<u64>) -> u64 {
        let Some(through) = covered_through else { return used };
        if self.end_ms <= through {
            return 0;
        }
        if self.start_ms >= through || self.end_ms <= self.start_ms {
            return used;
        }
        let span = u128::from(self.end_ms - self.start_ms);
        let fresh = u128::from(self.end_ms - through);
        u64::try_from(u128::from(used) * fresh / span).unwrap_or(used)
    }
}

/// A state-machine command.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Replace the policy (already validated by [`Policy::from_yaml`]).
    ApplyPolicy(Policy),
    /// Add a cluster or update its capacity and labels; answered with a lease.
    RegisterCluster {
        /// Cluster id.
        cluster: ClusterName,
        /// Capacity per resource name, quantity in thousandths.
        capacity: BTreeMap<String, u64>,
        /// Free-form labels.
        labels: BTreeMap<String, String>,
    },
    /// Forget a cluster (its leases must have expired).
    RemoveCluster {
        /// Cluster id.
        cluster: ClusterName,
    },
    /// A usage report; answered with a lease.
    Report(UsageReport),
    /// Advance time and recompute committed entitlements.
    Tick,
}

/// What a successful command produced.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Applied {
    /// The policy is in force.
    PolicyApplied,
    /// The cluster is registered; send it this lease.
    Registered(Lease),
    /// The cluster is gone.
    Removed,
    /// The report was applied (or was a duplicate, `applied: false`); send this lease.
    Reported {
        /// False for a duplicate sequence number: nothing was counted again.
        applied: bool,
        /// The lease to send back.
        lease: Lease,
    },
    /// Time advanced.
    Ticked,
}

/// Why a command was refused. Nothing changed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum CommandError {
    /// No policy has been applied yet.
    #[error("no policy is in force; apply one first (kvota policy apply FILE)")]
    NoPolicy,
    /// Unknown cluster id.
    #[error("cluster `{0}` is not registered")]
    UnknownCluster(String),
    /// A report skipped sequence numbers: the member must resend from `expected`.
    #[error("report sequence {got} from cluster `{cluster}` skips ahead; resend from {expected}")]
    SequenceGap {
        /// Cluster id.
        cluster: String,
        /// The next sequence number the control plane will accept.
        expected: u64,
        /// What was sent.
        got: u64,
    },
    /// The report acknowledged an epoch that was never issued.
    #[error("cluster `{cluster}`: {source}")]
    UnknownEpoch {
        /// Cluster id.
        cluster: String,
        /// Details.
        source: UnknownEpoch,
    },
    /// Malformed input.
    #[error("invalid {what}: {why}")]
    Invalid {
        /// What was invalid.
        what: String,
        /// Why.
        why: String,
    },
    /// A cluster that may still be enforcing a lease cannot be removed.
    #[error(
        "cluster `{cluster}` may still enforce a lease until {} ({} from now); remove it after that",
        crate::units::format_unix_ms(*until_ms),
        crate::units::format_duration_ms(*left_ms)
    )]
    LeaseInForce {
        /// Cluster id.
        cluster: String,
        /// When its last lease expires (control-plane clock, Unix ms).
        until_ms: Millis,
        /// How long that is from the refusal.
        #[serde(default)]
        left_ms: Millis,
    },
}

/// One registered member cluster.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterRecord {
    /// Capacity per resource name (quantity milli).
    pub capacity: BTreeMap<String, u64>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Capacity in GPUe under the current policy's weights.
    pub capacity_gpue: MilliGpue,
    /// Last applied report sequence (0: none).
    pub last_seq: u64,
    /// When the last report was applied (control-plane clock).
    pub last_report_ms: Option<Millis>,
    /// Last reported numbers per tenant (stamped: the plan's grid keeps a column of it
    /// until it changes).
    pub usage: Stamped<BTreeMap<TenantName, TenantUsage>>,
    /// The lease book (stamped, as `usage`).
    pub leases: Stamped<ClusterLeases>,
    /// Latest end of an applied report's usage window (agent wall clock, Unix ms):
    /// usage up to here is counted. `None` until a report with a window is applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reported_through_ms: Option<u64>,
    /// The last status its agent sent (from feature level 6; `None` before, and from
    /// agents that send none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ClusterStatus>,
}

impl ClusterRecord {
    /// GPUe of `tenant`'s pods running here: as its agent last said, or (an agent that
    /// says nothing of it) all of its in-use.
    pub fn running(&self, tenant: &str) -> MilliGpue {
        let inuse = self.usage.get(tenant).map_or(0, |u| u.inuse);
        match &self.status {
            Some(s) => s.running.get(tenant).copied().unwrap_or(0).min(inuse),
            None => inuse,
        }
    }
}

/// The numbers behind every tenant's entitlement at one instant.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Federation capacity `G`.
    pub capacity: MilliGpue,
    /// Tenants in name order: policy tenants, then retiring ones (no longer in the
    /// policy but still holding leases).
    pub tenants: Vec<TenantName>,
    /// Model outputs per policy tenant (retiring ones get the default).
    pub entitlements: Vec<Entitlement>,
    /// Demand used per tenant (effective, with burst headroom and unreachable clusters).
    pub demand: Vec<MilliGpue>,
    /// Decayed usage per tenant.
    pub usage: Vec<u64>,
    /// `sum_c inuse_tc` per tenant.
    pub inuse: Vec<MilliGpue>,
    /// `L_t = sum_c hold_tc` per tenant: what its clusters may hold now.
    pub held: Vec<MilliGpue>,
    /// Committed entitlement per tenant after this step.
    pub committed: Vec<MilliGpue>,
}

/// A violation of the partition-safety invariant (should never exist).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SafetyViolation {
    /// Tenant, or `*` for the capacity bound.
    pub tenant: String,
    /// Left side.
    pub held: MilliGpue,
    /// Right side.
    pub bound: MilliGpue,
}

/// The federation's replicated state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Federation {
    policy: Option<Policy>,
    clusters: BTreeMap<ClusterName, ClusterRecord>,
    ledger: crate::decay::Ledger,
    committed: BTreeMap<TenantName, MilliGpue>,
    /// Target entitlements of the last plan (derived, kept so grants need no replan).
    targets: BTreeMap<TenantName, MilliGpue>,
    now_ms: Millis,
    /// Shared, never changed once written: a copy of the state (a snapshot takes one
    /// under the state-machine task) copies pointers, not a thousand records. Serializes
    /// as the records themselves.
    audit: VecDeque<std::sync::Arc<AuditRecord>>,
    audit_seq: u64,
    /// Undecayed usage in hourly buckets; kept from the moment the control plane turns
    /// records on ([`Federation::enable_records`], at its feature level 2), absent before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    showback: Option<crate::showback::Showback>,
    /// The last admission decisions each cluster reported, oldest first (kept with the
    /// showback, from [`Federation::enable_records`] on).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    decisions: BTreeMap<ClusterName, VecDeque<PodDecision>>,
    /// Whether leases lend: carry borrow limits ([`TenantBudget::borrow`]) so that
    /// agents may admit preemptible tenants' pods into idle GPUs beyond their budgets.
    /// Turned on at one point of the log ([`Federation::enable_lending`], the control
    /// plane's feature level 3), absent (off) before, so replicas stay identical.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    lending: bool,
    /// Whether leases keep lending within maxShare federation-wide: borrow limits come
    /// from what the tenant may hold (not only its entitlement), and budgets and limits
    /// leave room for what its other clusters may hold or admit under any open lease.
    /// Turned on at one point of the log ([`Federation::enable_borrow_cap`], the control
    /// plane's feature level 7), absent (off) before, so replicas of an older build
    /// applying the same entries cut the same leases.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    borrow_cap: bool,
    /// Whether budgets are sized to waiting pods: reports' largest waiting pod is kept
    /// and the split makes room for it ([`crate::split::fit_largest`]). Turned on at one
    /// point of the log ([`Federation::enable_sized_budgets`], the control plane's
    /// feature level 4), absent (off) before, so replicas stay identical.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    sized: bool,
    /// Whether committed entitlement rises into free capacity by filling the smallest
    /// shortfalls whole first (rather than in proportion to the shortfall). Turned on at
    /// one point of the log ([`Federation::enable_small_first`], the control plane's
    /// feature level 8), absent (off) before, so replicas stay identical.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    small_first: bool,
    /// Whether the state keeps what operators read beyond the plan: the policy's
    /// revision, each cluster's status, the audit log's new events, coalesced budget
    /// changes and `spec.audit` retention. Turned on at one point of the log
    /// ([`Federation::enable_operator_view`], the control plane's feature level 6),
    /// absent (off) before, so replicas stay identical.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    operator_view: bool,
    /// The revision of the policy in force: 1 for the policy in force when the operator
    /// view was turned on (or the first applied after), one more for each policy that
    /// changed it. 0 without the operator view or a policy.
    #[serde(default, skip_serializing_if = "is_zero")]
    policy_revision: u64,
    /// When that revision came into force (control-plane clock).
    #[serde(default, skip_serializing_if = "is_zero")]
    policy_since_ms: Millis,
    /// Clusters held as cut off (every lease run out), with when their last lease
    /// expired, until they report again (kept from the operator view on).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    cut_off: BTreeMap<ClusterName, Millis>,
    /// The audit log's size (derived, never part of the state).
    #[serde(skip)]
    audit_size: audit::AuditBytes,
    /// Who the command being applied is from (see [`Federation::apply_as`]); set only
    /// during one apply, never part of the state.
    #[serde(skip)]
    actor: Option<String>,
    /// The grid's columns as last read (derived, never part of the state).
    #[serde(skip)]
    grid_cache: GridCache,
}

/// The grid's columns kept between reports: a report changes its own cluster's usage
/// and leases, so the other clusters' columns are reused as long as their stamps (see
/// [`Stamped`]) and the plan's tenants are unchanged. Derived data: a copy of the
/// federation starts without it, it never serializes, and it takes no part in equality.
#[derive(Default)]
struct GridCache(std::sync::Mutex<Grid>);

impl Clone for GridCache {
    fn clone(&self) -> Self {
        GridCache::default()
    }
}

impl PartialEq for GridCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for GridCache {}

impl std::fmt::Debug for GridCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GridCache")
    }
}

impl Federation {
    /// An empty federation: no policy, no clusters.
    pub fn new() -> Self {
        Self::default()
    }

    /// Starts keeping records (if not kept yet): from now on every counted usage is
    /// also recorded, undecayed, in hourly buckets (the showback), and the admission
    /// decisions reports carry are kept per cluster. Every replica must turn them on at
    /// the same point of the log (the control plane does so when its feature level
    /// reaches 2), so their states stay identical.
    pub fn enable_records(&mut self) {
        if self.showback.is_none() {
            self.showback = Some(crate::showback::Showback::new());
        }
    }

    /// Starts lending: from the next lease on, every preemptible tenant's budget comes
    /// with a borrow limit, its cluster's part of `maxShare x G - entitlement` (in
    /// proportion to the cluster's capacity). Every replica must turn it on at the same
    /// point of the log (the control plane does so when its feature level reaches 3).
    pub fn enable_lending(&mut self) {
        self.lending = true;
    }

    /// Starts keeping lending within maxShare federation-wide (see the field
    /// `borrow_cap`; docs/fairness-model.md, "Lending idle GPUs"). Every replica must
    /// turn it on at the same point of the log (the control plane does so when its
    /// feature level reaches 7).
    pub fn enable_borrow_cap(&mut self) {
        self.borrow_cap = true;
    }

    /// Whether lending is kept within maxShare (see [`Self::enable_borrow_cap`]).
    pub fn caps_borrowing(&self) -> bool {
        self.borrow_cap
    }

    /// Starts filling the smallest shortfalls first: from the next plan on, free
    /// capacity raises committed entitlements toward their targets in ascending order of
    /// the shortfall (ties in name order), each as far as the capacity goes, instead of
    /// in proportion to the shortfall. With many tenants short by a pod each, the
    /// proportional rule hands each a fraction of every GPU that frees, and none a pod
    /// until as many GPUs have freed as tenants wait. Every replica must turn it on at
    /// the same point of the log (the control plane does so when its feature level
    /// reaches 8).
    pub fn enable_small_first(&mut self) {
        self.small_first = true;
    }

    /// Whether free capacity fills the smallest shortfalls first (see
    /// [`Self::enable_small_first`]).
    pub fn fills_small_first(&self) -> bool {
        self.small_first
    }

    /// Starts sizing budgets: from the next report on, each tenant's largest waiting pod
    /// per cluster is kept, and the split across clusters gives the largest one that
    /// fits the tenant's entitlement room in its own cluster. Every replica must turn it
    /// on at the same point of the log (the control plane does so when its feature level
    /// reaches 4).
    pub fn enable_sized_budgets(&mut self) {
        self.sized = true;
    }

    /// Starts the operator view (if not on yet): from now on the policy in force has a
    /// revision that leases and clusters are measured against, each report's cluster
    /// status is kept, the audit log records leases running out and coming back (and the
    /// control plane's own events, [`Self::note`]), coalesces budget changes per cluster
    /// per minute and is kept by the policy's `spec.audit`. Every replica must turn it on
    /// at the same point of the log (the control plane does so when its feature level
    /// reaches 6).
    pub fn enable_operator_view(&mut self) {
        if self.operator_view {
            return;
        }
        self.operator_view = true;
        if self.policy.is_some() {
            self.policy_revision = 1;
            self.policy_since_ms = self.now_ms;
        }
    }

    /// Whether the operator view is on (see [`Self::enable_operator_view`]).
    pub fn operator_view(&self) -> bool {
        self.operator_view
    }

    /// The revision of the policy in force and since when it is in force (control-plane
    /// clock); 0 without the operator view or a policy.
    pub fn policy_revision(&self) -> (u64, Millis) {
        (self.policy_revision, self.policy_since_ms)
    }

    /// Whether budgets are sized to waiting pods (see [`Self::enable_sized_budgets`]).
    pub fn sizes_budgets(&self) -> bool {
        self.sized
    }

    /// Whether leases lend (see [`Self::enable_lending`]).
    pub fn lends(&self) -> bool {
        self.lending
    }

    /// Whether records are kept (see [`Self::enable_records`]).
    pub fn keeps_records(&self) -> bool {
        self.showback.is_some()
    }

    /// The kept decisions about `pod` (`namespace/name`), newest first, in `cluster` or
    /// in every cluster.
    pub fn pod_decisions(&self, pod: &str, cluster: Option<&str>) -> Vec<(&str, &PodDecision)> {
        let mut out: Vec<(&str, &PodDecision)> = self
            .decisions
            .iter()
            .filter(|(c, _)| cluster.is_none_or(|want| want == c.as_str()))
            .flat_map(|(c, ds)| ds.iter().filter(|d| d.pod == pod).map(move |d| (c.as_str(), d)))
            .collect();
        out.sort_by(|a, b| b.1.at_ms.cmp(&a.1.at_ms).then_with(|| a.0.cmp(b.0)));
        out
    }

    /// Keeps `cluster`'s reported decisions (valid ones; a pod judged again replaces its
    /// earlier decision), at most [`DECISIONS_PER_CLUSTER`].
    fn keep_decisions(&mut self, cluster: &ClusterName, decisions: Vec<PodDecision>) {
        if !self.keeps_records() || decisions.is_empty() {
            return;
        }
        let book = self.decisions.entry(cluster.clone()).or_default();
        for d in decisions.into_iter().filter(PodDecision::is_valid) {
            book.retain(|k| k.pod != d.pod);
            book.push_back(d);
            while book.len() > DECISIONS_PER_CLUSTER {
                book.pop_front();
            }
        }
    }

    /// The showback, if kept.
    pub fn showback(&self) -> Option<&crate::showback::Showback> {
        self.showback.as_ref()
    }

    /// Drops showback buckets past the policy's retention.
    fn prune_showback(&mut self) {
        if let (Some(sb), Some(p)) = (&mut self.showback, &self.policy) {
            sb.prune(self.now_ms, p.showback.retention_ms);
        }
    }

    /// The policy in force.
    pub fn policy(&self) -> Option<&Policy> {
        self.policy.as_ref()
    }
    /// Registered clusters by id.
    pub fn clusters(&self) -> &BTreeMap<ClusterName, ClusterRecord> {
        &self.clusters
    }
    /// The decayed usage ledger.
    pub fn ledger(&self) -> &crate::decay::Ledger {
        &self.ledger
    }
    /// Committed entitlements by tenant.
    pub fn committed(&self) -> &BTreeMap<TenantName, MilliGpue> {
        &self.committed
    }
    /// The state's clock (largest command time applied).
    pub fn now_ms(&self) -> Millis {
        self.now_ms
    }
    /// Audit records, oldest first.
    pub fn audit(&self) -> impl DoubleEndedIterator<Item = &AuditRecord> {
        self.audit.iter().map(|r| &**r)
    }
    /// Federation capacity in GPUe.
    pub fn capacity(&self) -> MilliGpue {
        self.clusters
            .values()
            .fold(0u64, |a, c| a.saturating_add(c.capacity_gpue))
    }

    /// Applies one command at leader-stamped time `now_ms`. On error nothing changed.
    pub fn apply(&mut self, now_ms: Millis, cmd: Command) -> Result<Applied, CommandError> {
        let now = now_ms.max(self.now_ms);
        match cmd {
            Command::ApplyPolicy(p) => {
                self.apply_policy(now, p);
                Ok(Applied::PolicyApplied)
            }
            Command::RegisterCluster {
                cluster,
                capacity,
                labels,
            } => self.register(now, cluster, capacity, labels),
            Command::RemoveCluster { cluster } => self.remove(now, &cluster),
            Command::Report(r) => self.report(now, r),
            Command::Tick => {
                self.now_ms = now;
                self.prune_showback();
                self.note_expired_leases();
                self.prune_audit();
                if self.policy.is_some() {
                    self.commit_plan();
                }
                Ok(Applied::Ticked)
            }
        }
    }

    fn apply_policy(&mut self, now: Millis, p: Policy) {
        self.now_ms = now;
        let weights = p.resource_weights.clone();
        for c in self.clusters.values_mut() {
            c.capacity_gpue = weights.capacity_gpue_milli(&c.capacity);
        }
        let tenants: BTreeSet<&str> = p.tenants.iter().map(|t| t.name.as_str()).collect();
        self.ledger.retain(|t| tenants.contains(t));
        let (mut revision, mut changes) = (0, Vec::new());
        if self.operator_view {
            // The first policy changes no earlier one: its record says nothing more.
            match &self.policy {
                Some(old) if *old == p => changes = vec![POLICY_UNCHANGED.to_string()],
                Some(old) => changes = crate::policy::describe_changes(old, &p, MAX_POLICY_CHANGE_LINES),
                None => {}
            }
            if self.policy.as_ref() != Some(&p) {
                self.policy_revision += 1;
                self.policy_since_ms = now;
            }
            revision = self.policy_revision;
        }
        self.record(AuditEvent::PolicyApplied {
            name: p.name.clone(),
            tenants: p.tenants.len(),
            revision,
            changes,
        });
        self.policy = Some(p);
        self.commit_plan();
    }

    fn register(
        &mut self,
        now: Millis,
        cluster: ClusterName,
        capacity: BTreeMap<String, u64>,
        labels: BTreeMap<String, String>,
    ) -> Result<Applied, CommandError> {
        validate_capacity(&capacity)?;
        if !self.clusters.contains_key(cluster.as_str()) && self.clusters.len() >= MAX_CLUSTERS {
            return Err(CommandError::Invalid {
                what: "registration".to_string(),
                why: format!("the federation already has {MAX_CLUSTERS} clusters"),
            });
        }
        self.now_ms = now;
        let capacity_gpue = self.weights().capacity_gpue_milli(&capacity);
        let joined = self.operator_view && !self.clusters.contains_key(cluster.as_str());
        let rec = self.clusters.entry(cluster.clone()).or_insert_with(|| ClusterRecord {
            capacity: BTreeMap::new(),
            labels: BTreeMap::new(),
            capacity_gpue: 0,
            last_seq: 0,
            last_report_ms: None,
            usage: Stamped::default(),
            leases: Stamped::default(),
            reported_through_ms: None,
            status: None,
        });
        let changed = rec.capacity != capacity || rec.labels != labels;
        rec.capacity = capacity;
        rec.labels = labels;
        rec.capacity_gpue = capacity_gpue;
        if changed {
            self.record(AuditEvent::ClusterRegistered {
                cluster: cluster.to_string(),
                capacity_gpue,
                joined,
            });
        }
        if self.policy.is_some() {
            self.commit_plan();
        }
        let lease = self.grant(&cluster);
        self.note_renewed_lease(&cluster);
        Ok(Applied::Registered(lease))
    }

    fn remove(&mut self, now: Millis, cluster: &str) -> Result<Applied, CommandError> {
        let rec = self
            .clusters
            .get(cluster)
            .ok_or_else(|| CommandError::UnknownCluster(cluster.to_string()))?;
        if !rec.leases.all_expired(now) {
            let until_ms = rec.leases.open.iter().map(|l| l.expires_at_ms).max().unwrap_or(now);
            return Err(CommandError::LeaseInForce {
                cluster: cluster.to_string(),
                until_ms,
                left_ms: until_ms.saturating_sub(now),
            });
        }
        self.now_ms = now;
        self.clusters.remove(cluster);
        self.decisions.remove(cluster);
        self.cut_off.remove(cluster);
        self.record(AuditEvent::ClusterRemoved {
            cluster: cluster.to_string(),
        });
        if self.policy.is_some() {
            self.commit_plan();
        }
        Ok(Applied::Removed)
    }

    fn report(&mut self, now: Millis, r: UsageReport) -> Result<Applied, CommandError> {
        let expected = self.check_report(&r)?;
        // Validated: from here on nothing fails.
        self.now_ms = now;
        let applied = r.seq == expected || (r.seq < expected && crate::faults::on(|f| f.double_apply_resent));
        let cluster = r.cluster.clone();
        if let Some(rec) = self.clusters.get_mut(&cluster) {
            // An acknowledgement is a fact about the agent whatever the sequence number.
            let _ = rec.leases.ack(r.held_epoch);
        }
        if applied {
            self.count_report(now, r)?;
        }
        // The plan is committed before the grant (a committed plan changes neither
        // usage nor leases, so the grant reads the same grid).
        self.commit_plan();
        let lease = self.grant(&cluster);
        self.note_renewed_lease(&cluster);
        Ok(Applied::Reported { applied, lease })
    }

    /// Checks a report against the state: a policy, a registered cluster, its bounds,
    /// no gap in the sequence, an epoch that was issued. Returns the sequence number the
    /// cluster's next report must carry.
    fn check_report(&self, r: &UsageReport) -> Result<u64, CommandError> {
        if self.policy.is_none() {
            return Err(CommandError::NoPolicy);
        }
        let rec = self
            .clusters
            .get(&r.cluster)
            .ok_or_else(|| CommandError::UnknownCluster(r.cluster.to_string()))?;
        if r.seq == 0 {
            return Err(CommandError::Invalid {
                what: "report".to_string(),
                why: "sequence numbers start at 1".to_string(),
            });
        }
        if r.tenants.len() > MAX_REPORT_TENANTS {
            return Err(CommandError::Invalid {
                what: "report".to_string(),
                why: format!("{} tenants; at most {MAX_REPORT_TENANTS}", r.tenants.len()),
            });
        }
        if let Some(cap) = &r.capacity {
            validate_capacity(cap)?;
        }
        if r.evictions.len() > MAX_REPORT_EVICTIONS {
            return Err(CommandError::Invalid {
                what: "report".to_string(),
                why: format!("{} evictions; at most {MAX_REPORT_EVICTIONS}", r.evictions.len()),
            });
        }
        if r.decisions.len() > MAX_REPORT_DECISIONS {
            return Err(CommandError::Invalid {
                what: "report".to_string(),
                why: format!("{} decisions; at most {MAX_REPORT_DECISIONS}", r.decisions.len()),
            });
        }
        for (i, e) in r.evictions.iter().enumerate() {
            e.validate(i)?;
        }
        let expected = rec.last_seq + 1;
        if r.seq > expected {
            return Err(CommandError::SequenceGap {
                cluster: r.cluster.to_string(),
                expected,
                got: r.seq,
            });
        }
        rec.leases
            .check_ack(r.held_epoch)
            .map_err(|source| CommandError::UnknownEpoch {
                cluster: r.cluster.to_string(),
                source,
            })?;
        Ok(expected)
    }

    /// Counts an applied report: its usage (the ledger and the showback, for the part of
    /// its window not counted yet), the cluster's numbers, status, evictions and
    /// decisions.
    fn count_report(&mut self, now: Millis, mut r: UsageReport) -> Result<(), CommandError> {
        let weights = self.weights().clone();
        let rec = self
            .clusters
            .get_mut(&r.cluster)
            .ok_or_else(|| CommandError::UnknownCluster(r.cluster.to_string()))?;
        rec.last_seq = r.seq;
        rec.last_report_ms = Some(now);
        if let Some(cap) = r.capacity {
            rec.capacity_gpue = weights.capacity_gpue_milli(&cap);
            rec.capacity = cap;
        }
        let covered = rec.reported_through_ms;
        let window = r.window.filter(|w| w.end_ms <= now.saturating_add(MAX_WINDOW_AHEAD_MS));
        if let Some(w) = window {
            rec.reported_through_ms = Some(covered.map_or(w.end_ms, |c| c.max(w.end_ms)));
        }
        let tenants = std::mem::take(&mut r.tenants);
        let policy_tenants = self.policy.as_ref().map_or(&[][..], |p| &p.tenants[..]);
        let counted = Counted {
            cluster: &r.cluster,
            window,
            covered,
            now,
            sized: self.sized,
        };
        let (usage, ledger) = counted.tenants(tenants, policy_tenants, self.showback.as_mut());
        self.ledger.add_ascending(usage.iter().map(|(t, _)| t).zip(ledger), now);
        *rec.usage = usage.into_iter().collect();
        if self.operator_view {
            if let Some(status) = r.status.take() {
                rec.status = Some(status.kept(&rec.usage));
            }
        }
        // The snapshot is from when the report was written; since then the agent may
        // have admitted up to any lease it may hold (epoch >= its acknowledgement).
        raise_bounds(rec);
        for note in r.evictions {
            self.record(AuditEvent::Eviction {
                cluster: r.cluster.to_string(),
                note,
            });
        }
        self.keep_decisions(&r.cluster, r.decisions);
        Ok(())
    }

    fn weights(&self) -> &crate::resources::ResourceWeights {
        static DEFAULT: std::sync::OnceLock<crate::resources::ResourceWeights> = std::sync::OnceLock::new();
        match &self.policy {
            Some(p) => &p.resource_weights,
            None => DEFAULT.get_or_init(crate::resources::ResourceWeights::new),
        }
    }

    /// Applies `cmd` on behalf of `actor` (`role/name` of the caller's certificate, as
    /// the control plane authenticated it), which the audit records it makes carry.
    pub fn apply_as(&mut self, now_ms: Millis, cmd: Command, actor: Option<String>) -> Result<Applied, CommandError> {
        self.actor = actor.filter(|a| a.len() <= MAX_ACTOR_LEN);
        let result = self.apply(now_ms, cmd);
        self.actor = None;
        result
    }

    /// The audit records (oldest first) that concern `tenant`, were made by `actor` and
    /// are not older than `since_ms`; each filter only when given.
    pub fn audit_filtered<'a>(
        &'a self,
        tenant: Option<&'a str>,
        actor: Option<&'a str>,
        since_ms: Option<Millis>,
    ) -> impl Iterator<Item = &'a AuditRecord> + 'a {
        self.audit.iter().map(|r| &**r).filter(move |r| {
            since_ms.is_none_or(|s| r.at_ms >= s)
                && actor.is_none_or(|a| r.actor.as_deref() == Some(a))
                && tenant.is_none_or(|t| r.event.concerns(t))
        })
    }

    /// Whether every lease of `rec` has expired now (see [`Self::is_unreachable`]): the
    /// cluster enforces its safe budgets until it calls again.
    pub fn cluster_unreachable(&self, rec: &ClusterRecord) -> bool {
        Self::is_unreachable(rec, self.now_ms)
    }

    /// Clusters whose every lease has expired (control-plane view): they may enforce only
    /// fallbacks, and the control plane cannot change that until they call again.
    fn is_unreachable(rec: &ClusterRecord, now: Millis) -> bool {
        rec.leases.last_epoch > 0 && rec.leases.all_expired(now)
    }

    /// Brings the grid (see [`grid`]) up to date with the state and calls `f` with it.
    /// Its rows are the plan's tenants: the policy's, in policy order, then any tenant no
    /// longer in the policy that still has committed entitlement.
    ///
    /// The kept grid is used when it is free; a caller that finds it in use (another
    /// thread reading the same state) reads a grid of its own rather than wait.
    fn with_grid<R>(&self, f: impl FnOnce(&Grid) -> R) -> R {
        let mut own = None;
        let mut kept = match self.grid_cache.0.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => {
                // A panic left it half updated: start it afresh.
                let mut g = p.into_inner();
                *g = Grid::default();
                self.grid_cache.0.clear_poison();
                Some(g)
            }
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        let grid: &mut Grid = match kept.as_deref_mut() {
            Some(g) => g,
            None => own.insert(Grid::default()),
        };
        let tenants = self.policy.as_ref().map_or(&[][..], |p| &p.tenants[..]);
        // Committed tenants not in the policy, found by walking both in name order.
        let mut in_policy = tenants.iter().peekable();
        let retiring: Vec<&TenantName> = match self.policy {
            None => Vec::new(),
            Some(_) => self
                .committed
                .iter()
                .filter(|(n, &v)| {
                    while in_policy.next_if(|t| t.name < **n).is_some() {}
                    v > 0 && in_policy.peek().is_none_or(|t| t.name != **n)
                })
                .map(|(n, _)| n)
                .collect(),
        };
        let rows = tenants
            .iter()
            .map(|t| (&t.name, t.burst_factor_milli))
            .chain(retiring.iter().map(|n| (*n, 1_000)));
        grid.refresh(rows, &self.clusters, self.now_ms);
        f(grid)
    }

    /// The committed entitlement of each of `names` (the policy's `policy_tenants`
    /// first, then retiring ones): down at once (not below what leases still hold in
    /// `held`), then up into free capacity in proportion to the shortfall.
    fn committed_entitlements(
        &self,
        names: &[TenantName],
        policy_tenants: usize,
        entitlements: &[Entitlement],
        held: &[u64],
        capacity: MilliGpue,
    ) -> Vec<u64> {
        // Committed entitlement: down at once (not below what leases still hold), then up
        // into free capacity in proportion to the shortfall (smallest shortfalls whole
        // first from feature level 8, see `fill_small_first`).
        // Names come in two ascending runs: the policy's tenants, then retiring ones.
        let mut run = Ascending::new(&self.committed);
        let mut committed: Vec<u64> = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                if i == policy_tenants {
                    run = Ascending::new(&self.committed);
                }
                let prev = run.get(n).copied().unwrap_or(0);
                prev.min(entitlements[i].total.max(held[i]))
            })
            .collect();
        let used_total: u128 = committed.iter().map(|&c| u128::from(c)).sum();
        let free = u128::from(capacity).saturating_sub(used_total);
        let shortfall: Vec<u64> = committed
            .iter()
            .zip(entitlements)
            .map(|(&c, e)| e.total.saturating_sub(c))
            .collect();
        let short_total: u128 = shortfall.iter().map(|&s| u128::from(s)).sum();
        if short_total > 0 && free > 0 && self.small_first {
            fill_small_first(&mut committed, &shortfall, free);
        } else if short_total > 0 && free > 0 {
            let give = free.min(short_total);
            let mut cum: u128 = 0;
            let mut before: u128 = 0;
            for (c, s) in committed.iter_mut().zip(&shortfall) {
                cum += u128::from(*s);
                let through = give * cum / short_total;
                *c += u64::try_from(through - before).unwrap_or(0);
                before = through;
            }
        }
        committed
    }

    /// Computes the plan at the state's clock without changing anything.
    pub fn plan(&self) -> Plan {
        self.with_grid(|grid| self.plan_with(grid))
    }

    /// [`Federation::plan`] over the grid, up to date. `O(T)` plus the entitlement
    /// model: the grid keeps each tenant's sums over the clusters.
    fn plan_with(&self, grid: &Grid) -> Plan {
        let names = grid.names().to_vec();
        let now = self.now_ms;
        let capacity = self.capacity();
        let Some(policy) = &self.policy else {
            return Plan {
                capacity,
                tenants: Vec::new(),
                entitlements: Vec::new(),
                demand: Vec::new(),
                usage: Vec::new(),
                inuse: Vec::new(),
                held: Vec::new(),
                committed: Vec::new(),
            };
        };
        let mut inputs = Vec::with_capacity(policy.tenants.len());
        let mut demand = Vec::with_capacity(names.len());
        let mut usage = Vec::with_capacity(names.len());
        let mut inuse = Vec::with_capacity(names.len());
        let mut held = Vec::with_capacity(names.len());
        // The policy's tenants come first, in name order, as the ledger is.
        let mut ledger = Ascending::new(self.ledger.entries());
        for (i, name) in names.iter().enumerate() {
            let tp = policy.tenants.get(i);
            let (d, u, h) = grid.sums(i);
            let used = tp.map_or(0, |t| ledger.get(name).map_or(0, |e| e.at(now, t.decay_half_life_ms)));
            if let Some(t) = tp {
                inputs.push(TenantInput {
                    weight_milli: t.weight_milli,
                    min_share_bp: t.min_share_bp,
                    max_share_bp: t.max_share_bp,
                    demand: d,
                    usage: used,
                });
            }
            demand.push(d);
            usage.push(used);
            inuse.push(u);
            held.push(h);
        }
        let mut entitlements = entitlement::compute(capacity, &inputs);
        entitlements.resize(names.len(), Entitlement::default());

        let committed = self.committed_entitlements(&names, policy.tenants.len(), &entitlements, &held, capacity);
        Plan {
            capacity,
            tenants: names,
            entitlements,
            demand,
            usage,
            inuse,
            held,
            committed,
        }
    }

    fn commit_plan(&mut self) {
        let plan = self.with_grid(|grid| self.plan_with(grid));
        // In place: the tenants rarely change, so most keys are there already.
        for (n, e) in plan.tenants.iter().zip(&plan.entitlements) {
            match self.targets.get_mut(n) {
                Some(v) => *v = e.total,
                None => {
                    self.targets.insert(n.clone(), e.total);
                }
            }
        }
        if self.targets.len() != plan.tenants.len() {
            let keep: BTreeSet<&str> = plan.tenants.iter().map(TenantName::as_str).collect();
            self.targets.retain(|n, _| keep.contains(n.as_str()));
        }
        // Every tenant with committed entitlement is one of the plan's.
        for (n, &c) in plan.tenants.iter().zip(&plan.committed) {
            if c == 0 {
                self.committed.remove(n);
            } else if let Some(v) = self.committed.get_mut(n) {
                *v = c;
            } else {
                self.committed.insert(n.clone(), c);
            }
        }
    }

    /// Budgets the split would give `cluster` now, before the safety clip, per tenant
    /// (policy tenants only): each tenant's `min(committed, target)` split by
    /// [`split_tenant`].
    pub fn desired_budgets(&self, cluster: &str) -> BTreeMap<TenantName, MilliGpue> {
        let (Some(pos), Some(policy)) = (self.clusters.keys().position(|c| c == cluster), &self.policy) else {
            return BTreeMap::new();
        };
        let want = self.with_grid(|grid| self.desired_budgets_with(pos, grid));
        policy.tenants.iter().map(|t| t.name.clone()).zip(want).collect()
    }

    /// [`Federation::desired_budgets`] for the cluster at `pos` (in cluster id order),
    /// one per policy tenant in policy order (the grid's first rows).
    ///
    /// The one part of a report's cost that grows with `T x C`: placing a tenant's
    /// largest waiting pod ([`fit_largest`]) needs every cluster's headroom, so each
    /// tenant's row is split whole. The grid keeps the rows as the split reads them
    /// (16 bytes a cell, contiguous), so this streams through memory without copying.
    fn desired_budgets_with(&self, pos: usize, grid: &Grid) -> Vec<MilliGpue> {
        let Some(policy) = &self.policy else { return Vec::new() };
        let mut split = vec![0u64; grid.clusters()];
        let (mut committed_of, mut target_of) = (Ascending::new(&self.committed), Ascending::new(&self.targets));
        policy
            .tenants
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let (cells, largest) = grid.split_row(i);
                if cells.len() != split.len() {
                    return 0; // every policy tenant has a whole row
                }
                // Cut from min(committed, target): a committed entitlement above target
                // must be able to fall, which it does only once budgets stop holding it up.
                let amount = committed_of
                    .get(&t.name)
                    .copied()
                    .unwrap_or(0)
                    .min(target_of.get(&t.name).copied().unwrap_or(0));
                split_tenant(amount, cells, &mut split);
                if largest.iter().any(|&b| b > 0) {
                    fit_largest(amount, cells, largest, &mut split);
                }
                split.get(pos).copied().unwrap_or(0)
            })
            .collect()
    }

    /// The safe budget `S_tc = floor(minShare_t * G_c)`: `sum_c S_tc <= minShare_t * G`.
    pub fn safe_budget(&self, tenant: &str, cluster: &str) -> MilliGpue {
        match (&self.policy, self.clusters.get(cluster)) {
            (Some(p), Some(rec)) => p
                .tenant(tenant)
                .map_or(0, |t| entitlement::share_of(rec.capacity_gpue, t.min_share_bp)),
            _ => 0,
        }
    }

    /// A preemptible tenant's borrow limit in `cluster`:
    /// `floor((maxShare x G - committed) x G_c / G)`. Summed over the clusters it is at
    /// most `maxShare x G - committed`, so budgets (at most `committed` together) and
    /// borrowed capacity never take the tenant past its maxShare under the leases of one
    /// plan. 0 for a non-preemptible tenant: borrowed pods must be evictable.
    pub fn borrow_limit(&self, tenant: &str, cluster: &str, committed: MilliGpue) -> MilliGpue {
        let (Some(p), Some(rec)) = (&self.policy, self.clusters.get(cluster)) else {
            return 0;
        };
        p.tenant(tenant)
            .map_or(0, |t| borrow_of(p, t, rec.capacity_gpue, self.capacity(), committed))
    }

    /// `maxShare x G` of `tenant`: more than it may ever hold anywhere (0 without a policy).
    pub fn ceiling(&self, tenant: &str) -> MilliGpue {
        let Some(t) = self.policy.as_ref().and_then(|p| p.tenant(tenant)) else {
            return 0;
        };
        entitlement::share_of(self.capacity(), t.max_share_bp)
    }

    /// Cuts and records the lease for `cluster` (which must exist), after the last plan
    /// was committed. `O(T)` besides the split ([`Federation::desired_budgets_with`]):
    /// what the tenant's other clusters may hold comes from the grid's row sums.
    fn grant(&mut self, cluster: &ClusterName) -> Lease {
        let now = self.now_ms;
        let (duration_ms, margin_ms) = self.policy.as_ref().map_or(
            (
                crate::policy::defaults::LEASE_DURATION_MS,
                crate::policy::defaults::CLOCK_SKEW_MARGIN_MS,
            ),
            |p| (p.lease.duration_ms, p.lease.clock_skew_margin_ms),
        );
        let rows = self.grant_rows(cluster);
        let total = self.capacity();
        let capacity_here = self.clusters.get(cluster).map_or(0, |r| r.capacity_gpue);
        let mut budgets = BTreeMap::new();
        // Changes as numbers; their explanations are written only if the audit log takes
        // them (budgets drift a little at every report, and formatting a sentence per
        // tenant per report was a large part of a report's cost with many tenants).
        let mut changes: Vec<BudgetDelta<'_>> = Vec::new();
        let prev = self
            .clusters
            .get(cluster)
            .and_then(|r| r.leases.latest())
            .map(|l| &l.budgets);
        let tenants = self.policy.as_ref().map_or(&[][..], |p| &p.tenants[..]);
        // The policy's tenants are in name order, as are these maps.
        let (mut committed_of, mut target_of) = (Ascending::new(&self.committed), Ascending::new(&self.targets));
        let mut prev_of = prev.map(Ascending::new);
        for (t, row) in tenants.iter().zip(&rows) {
            let tenant = &t.name;
            let committed = committed_of.get(tenant).copied().unwrap_or(0);
            let target = target_of.get(tenant).copied().unwrap_or(0);
            let (b, bound) = self.tenant_budget(t, row, committed, target, (total, capacity_here));
            let old = prev_of.as_mut().and_then(|p| p.get(tenant)).map_or(0, |p| p.budget);
            if old != b.budget {
                changes.push((tenant, old, b.budget, row.want, bound, row.inuse_here, committed));
            }
            budgets.insert(tenant.clone(), b);
        }
        let Some(rec) = self.clusters.get_mut(cluster) else {
            // Callers pass registered clusters only; an empty lease admits nothing.
            return Lease {
                cluster: cluster.clone(),
                epoch: 0,
                duration_ms,
                margin_ms,
                issued_at_ms: now,
                budgets: BTreeMap::new(),
            };
        };
        let before = rec.leases.last_epoch;
        let lease = rec.leases.issue(cluster, budgets, now, duration_ms, margin_ms);
        // Whatever any open lease allows may be admitted from now until the next report.
        raise_bounds(rec);
        if lease.epoch > before {
            if let Some(changes) = notable_changes(changes) {
                self.record_budgets(cluster, lease.epoch, changes);
            }
        }
        lease
    }

    /// Per policy tenant, what [`Federation::grant`] needs of the grid for `cluster`
    /// (empty for an unknown cluster).
    fn grant_rows(&self, cluster: &ClusterName) -> Vec<GrantRow> {
        match self.clusters.keys().position(|c| c == cluster) {
            Some(pos) => self.with_grid(|grid| {
                let want = self.desired_budgets_with(pos, grid);
                want.into_iter()
                    .enumerate()
                    .map(|(i, w)| GrantRow {
                        want: w,
                        rest: grid.hold_except(i, pos),
                        inuse_here: grid.cell(i, pos).usage.inuse,
                        held: grid.hold_total(i),
                        reach: grid.reach_except(i, pos),
                    })
                    .collect()
            }),
            None => Vec::new(),
        }
    }

    /// Tenant `t`'s budget in a new lease (and the bound that held it back), given its
    /// committed entitlement and target and `(total, capacity_here)` capacities.
    fn tenant_budget(
        &self,
        t: &crate::policy::TenantPolicy,
        row: &GrantRow,
        committed: MilliGpue,
        target: MilliGpue,
        (total, capacity_here): (MilliGpue, MilliGpue),
    ) -> (TenantBudget, MilliGpue) {
        let GrantRow {
            want,
            rest,
            held,
            reach,
            ..
        } = *row;
        // A new budget never lets the tenant's clusters together reach past
        // min(committed, target). Not `max(committed, inuse_sum)`: the reported
        // in-use is stale (pods finished since), and a tenant already above its
        // entitlement (a policy lowered its maxShare, or demand moved) would refill
        // up to what it last reported, above its entitlement and cap.
        let bound = committed.min(target).saturating_sub(rest);
        // And the tenant's clusters together, borrowing included, never past its
        // maxShare: a borrow limit of an older lease still standing elsewhere holds
        // budget increases back here until it is superseded (break before make).
        let cap_room = entitlement::share_of(total, t.max_share_bp).saturating_sub(reach);
        let budget = if crate::faults::on(|f| f.make_before_break) {
            want
        } else {
            want.min(bound).min(if self.lending && self.borrow_cap {
                cap_room
            } else {
                u64::MAX
            })
        };
        // The safe budget (see `safe_budget`).
        let fallback = entitlement::share_of(capacity_here, t.min_share_bp).min(budget);
        let (borrow, ceiling) = match (&self.policy, self.lending) {
            (Some(p), true) => (
                // From what the tenant may hold, if that is more than its
                // entitlement (pods above budgets moved elsewhere): borrowing
                // never takes it past its maxShare.
                if self.borrow_cap {
                    borrow_of(p, t, capacity_here, total, committed.max(held)).min(cap_room.saturating_sub(budget))
                } else {
                    borrow_of(p, t, capacity_here, total, committed)
                },
                entitlement::share_of(total, t.max_share_bp),
            ),
            _ => (0, 0),
        };
        let b = TenantBudget {
            budget,
            fallback,
            entitlement: committed,
            borrow,
            ceiling,
        };
        (b, bound)
    }

    /// Checks the partition-safety invariant at the state's clock; empty when it holds.
    pub fn check_safety(&self) -> Vec<SafetyViolation> {
        let now = self.now_ms;
        let mut out = Vec::new();
        let mut names: BTreeSet<&str> = self.committed.keys().map(TenantName::as_str).collect();
        for rec in self.clusters.values() {
            for l in &rec.leases.open {
                names.extend(l.budgets.keys().map(TenantName::as_str));
            }
        }
        for name in names {
            let mut held = 0u64;
            let mut inuse = 0u64;
            for rec in self.clusters.values() {
                // Borrowed pods are left out: they stand outside the inequality,
                // bounded by the borrow limits (docs/fairness-model.md).
                let tu = rec.usage.get(name).copied().unwrap_or_default();
                held = held.saturating_add(tu.held_within_budgets(rec.leases.enforceable(name, now)));
                inuse = inuse.saturating_add(tu.inuse_within_budgets());
            }
            let bound = self.committed.get(name).copied().unwrap_or(0).max(inuse);
            if held > bound {
                out.push(SafetyViolation {
                    tenant: name.to_string(),
                    held,
                    bound,
                });
            }
        }
        let total: u64 = self.committed.values().fold(0, |a, &c| a.saturating_add(c));
        if total > self.capacity() {
            out.push(SafetyViolation {
                tenant: "*".to_string(),
                held: total,
                bound: self.capacity(),
            });
        }
        out
    }
}

/// Per policy tenant, what the grid says for a lease on one cluster: the desired
/// budget, what its other clusters may hold, its in-use here, what it may hold
/// everywhere, and what its other clusters may hold or admit with borrowing.
#[derive(Clone, Copy)]
struct GrantRow {
    want: MilliGpue,
    rest: MilliGpue,
    inuse_here: MilliGpue,
    held: MilliGpue,
    reach: MilliGpue,
}

/// A budget change as numbers: (tenant, from, to, want, bound, in-use, committed).
type BudgetDelta<'a> = (&'a TenantName, u64, u64, u64, u64, u64, u64);

/// The changes with their explanations, if any is one a person would care about:
/// budgets follow decayed usage, so they drift by a few milli-GPUe between reports, and
/// only notable changes go into the audit log.
fn notable_changes(changes: Vec<BudgetDelta<'_>>) -> Option<Vec<BudgetChange>> {
    let notable = changes
        .iter()
        .any(|&(_, from, to, ..)| from.abs_diff(to) >= AUDIT_MIN_CHANGE || from == 0 || to == 0);
    notable.then(|| {
        changes
            .into_iter()
            .map(|(tenant, from, to, want, bound, inuse, committed)| BudgetChange {
                tenant: tenant.to_string(),
                from,
                to,
                why: explain_change(from, to, want, bound, inuse, committed),
            })
            .collect()
    })
}

/// What [`Federation::count_report`] counts a report's tenants with: the cluster, the
/// report's window (if not ahead of the clock), how far the cluster's usage was
/// counted before it, the clock, and whether budgets are sized.
struct Counted<'a> {
    cluster: &'a ClusterName,
    window: Option<UsageWindow>,
    covered: Option<Millis>,
    now: Millis,
    sized: bool,
}

impl Counted<'_> {
    /// The report's tenants that the policy has, as usage (in name order) and as ledger
    /// entries (usage not counted before, half-life); the usage goes into the showback
    /// too.
    #[allow(clippy::type_complexity)]
    fn tenants(
        &self,
        tenants: BTreeMap<TenantName, TenantReport>,
        policy_tenants: &[crate::policy::TenantPolicy],
        mut showback: Option<&mut crate::showback::Showback>,
    ) -> (Vec<(TenantName, TenantUsage)>, Vec<(u64, Millis)>) {
        // The report's tenants and the policy's are both in name order: walk them
        // together, keep the policy's, and build the usage map from them in order.
        let mut policy_tenants = policy_tenants.iter().peekable();
        let mut usage = Vec::with_capacity(tenants.len());
        let mut ledger = Vec::with_capacity(tenants.len());
        for (tenant, tr) in tenants {
            while policy_tenants.next_if(|t| t.name < tenant).is_some() {}
            let Some(t) = policy_tenants.next_if(|t| t.name == tenant) else {
                continue;
            };
            let used = self.window.map_or(tr.used_milli_gpue_ms, |w| {
                w.uncovered(tr.used_milli_gpue_ms, self.covered)
            });
            if let Some(sb) = showback.as_deref_mut() {
                // The uncovered part of the window, on the agent's clock (checked
                // above not to run ahead of ours); without one, now.
                let (start, end) = self.window.map_or((self.now, self.now), |w| {
                    (w.start_ms.max(self.covered.unwrap_or(0)), w.end_ms)
                });
                sb.record(&tenant, self.cluster, used, start, end);
            }
            ledger.push((used, t.decay_half_life_ms));
            usage.push((
                tenant,
                TenantUsage {
                    inuse: tr.inuse,
                    pending: tr.pending,
                    // Borrowed pods stand outside the budgets (see
                    // `TenantUsage::held_within_budgets`); the in-use still counts them,
                    // so what a grant leaves room for is unchanged.
                    bound: tr.inuse - tr.borrowed.min(tr.inuse),
                    // Kept only once every replica sizes budgets (older ones drop
                    // the field when they decode the entry).
                    largest: if self.sized { tr.largest.min(tr.pending) } else { 0 },
                    borrowed: tr.borrowed.min(tr.inuse),
                },
            ));
        }
        (usage, ledger)
    }
}

/// Raises `committed` into `free` capacity smallest shortfall first, ties by position
/// (name order): each filled whole while capacity lasts, the last one in part.
fn fill_small_first(committed: &mut [u64], shortfall: &[u64], free: u128) {
    let mut order: Vec<usize> = (0..shortfall.len()).filter(|&i| shortfall[i] > 0).collect();
    order.sort_unstable_by_key(|&i| (shortfall[i], i));
    let mut left = free;
    for i in order {
        let take = u128::from(shortfall[i]).min(left);
        if take == 0 {
            break;
        }
        committed[i] += u64::try_from(take).unwrap_or(0);
        left -= take;
    }
}

/// A preemptible tenant's borrow limit in a cluster of `capacity` out of `total` (see
/// [`Federation::borrow_limit`]).
fn borrow_of(
    p: &Policy,
    t: &crate::policy::TenantPolicy,
    capacity: MilliGpue,
    total: MilliGpue,
    committed: MilliGpue,
) -> MilliGpue {
    if !(p.reclaim.enabled && p.reclaim.lend_idle && t.preemptible) {
        return 0; // lent GPUs could never be taken back; borrowed pods must be evictable
    }
    let room = entitlement::share_of(total, t.max_share_bp).saturating_sub(committed);
    let part = (u128::from(room) * u128::from(capacity))
        .checked_div(u128::from(total))
        .unwrap_or(0);
    u64::try_from(part).unwrap_or(0)
}

/// Raises every tenant's in-use bound in `rec` to the budgets of its open leases.
fn raise_bounds(rec: &mut ClusterRecord) {
    let usage: &mut BTreeMap<TenantName, TenantUsage> = &mut rec.usage;
    for l in &rec.leases.open {
        // Both maps are in name order: walk them together, add the missing after.
        let mut missing = Vec::new();
        let mut entries = usage.iter_mut().peekable();
        for (tenant, b) in l.budgets.iter().filter(|(_, b)| b.budget > 0) {
            while entries.next_if(|(k, _)| *k < tenant).is_some() {}
            match entries.next_if(|(k, _)| *k == tenant) {
                Some((_, u)) => u.bound = u.bound.max(b.budget),
                None => missing.push((tenant.clone(), b.budget)),
            }
        }
        for (tenant, budget) in missing {
            let u = usage.entry(tenant).or_default();
            u.bound = u.bound.max(budget);
        }
    }
}

fn validate_capacity(capacity: &BTreeMap<String, u64>) -> Result<(), CommandError> {
    if capacity.len() > MAX_CAPACITY_RESOURCES {
        return Err(CommandError::Invalid {
            what: "capacity".to_string(),
            why: format!("{} resource names; at most {MAX_CAPACITY_RESOURCES}", capacity.len()),
        });
    }
    for (name, &q) in capacity {
        if name.is_empty() || name.len() > 253 {
            return Err(CommandError::Invalid {
                what: "capacity".to_string(),
                why: format!("resource name `{name}` must be 1-253 characters"),
            });
        }
        // A million GPUs per resource is far beyond any cluster; larger is corruption.
        if q > 1_000_000_000 {
            return Err(CommandError::Invalid {
                what: "capacity".to_string(),
                why: format!("{name}: {q} thousandths is implausibly large"),
            });
        }
    }
    Ok(())
}

fn explain_change(old: u64, new: u64, want: u64, bound: u64, inuse: u64, committed: u64) -> String {
    use crate::units::format_gpue as g;
    if new < want {
        format!(
            "wanted {} but other clusters may still hold leases for this tenant: only {} is free until they acknowledge lower budgets or their leases expire",
            g(want),
            g(bound)
        )
    } else if new > old {
        format!(
            "demand here (in use {}) and committed entitlement {} allow more",
            g(inuse),
            g(committed)
        )
    } else {
        format!(
            "committed entitlement {} or demand here (in use {}) fell",
            g(committed),
            g(inuse)
        )
    }
}

#[cfg(test)]
mod grid_tests {
    use super::*;
    use crate::entitlement::effective_demand;
    use crate::split::Cell;
    use proptest::prelude::*;

    /// Per row of `names`, per cluster: what a lookup per pair reads (usage and what
    /// the cluster may enforce), and the row's sums (demand, in-use, hold) and split
    /// cells computed from those lookups.
    #[allow(clippy::type_complexity)]
    fn naive(
        fed: &Federation,
        names: &[TenantName],
    ) -> (
        Vec<(TenantUsage, MilliGpue)>,
        Vec<(u64, u64, u64)>,
        Vec<(Cell, MilliGpue)>,
    ) {
        let now = fed.now_ms;
        let (mut cells, mut sums, mut split) = (Vec::new(), Vec::new(), Vec::new());
        for name in names {
            let burst = fed
                .policy
                .as_ref()
                .and_then(|p| p.tenant(name))
                .map_or(1_000, |t| t.burst_factor_milli);
            let (mut d, mut u, mut h) = (0u64, 0u64, 0u64);
            for rec in fed.clusters.values() {
                let tu = rec.usage.get(name.as_str()).copied().unwrap_or_default();
                let enf = rec.leases.enforceable(name, now);
                let unreachable = Federation::is_unreachable(rec, now);
                cells.push((tu, enf));
                let mut cd = effective_demand(tu.inuse, tu.pending, burst);
                if unreachable {
                    cd = cd.max(tu.hold(enf));
                }
                d = d.saturating_add(cd);
                u = u.saturating_add(tu.inuse);
                h = h.saturating_add(tu.hold(enf));
                let cell = if unreachable {
                    Cell::pinned(tu.hold(enf))
                } else {
                    Cell::new(tu.inuse, effective_demand(tu.inuse, tu.pending, burst))
                };
                let big = if unreachable || tu.largest > rec.capacity_gpue {
                    0
                } else {
                    tu.largest
                };
                split.push((cell, big));
            }
            sums.push((d, u, h));
        }
        (cells, sums, split)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        /// The grid, kept between commands and updated a column at a time, holds exactly
        /// what reading every pair afresh gives, whatever the reports, lease expiries,
        /// policy changes and tenants left over from an older policy; and a copy of the
        /// state, which starts with no grid, plans and splits the same.
        #[test]
        fn the_kept_grid_equals_a_fresh_read(
            reports in prop::collection::vec((0usize..3, prop::collection::vec((0usize..6, 0u64..8_000, 0u64..8_000), 0..6), 0u64..200_000), 1..12),
        ) {
            let yaml = "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: t}\nspec:\n  tenants:\n  - {name: b, weight: 1}\n  - {name: a, weight: 2, minShare: 0.2}\n  - {name: d-1, weight: 1, burstFactor: 1.5}\n  - {name: c, weight: 3}\n";
            let mut fed = Federation::default();
            fed.enable_sized_budgets();
            fed.apply(0, Command::ApplyPolicy(crate::policy::Policy::from_yaml(yaml).expect("policy"))).expect("policy");
            let mut seqs = [(1u64, 0u64); 3];
            for (c, seq) in seqs.iter_mut().enumerate() {
                let capacity = [("nvidia.com/gpu".to_string(), 16_000)].into();
                if let Ok(Applied::Registered(l)) = fed.apply(0, Command::RegisterCluster { cluster: ClusterName::parse(format!("k{c}")).expect("name"), capacity, labels: BTreeMap::new() }) {
                    seq.1 = l.epoch;
                }
            }
            let mut now = 0;
            let tenants = ["a", "b", "c", "d-1", "zz-unknown", "0"];
            for (c, usage, dt) in reports {
                now += dt;
                let r = UsageReport {
                    cluster: ClusterName::parse(format!("k{c}")).expect("name"),
                    seq: seqs[c].0,
                    held_epoch: seqs[c].1,
                    capacity: if dt % 7 == 0 { Some([("nvidia.com/gpu".to_string(), 8_000 + dt % 16_000)].into()) } else { None },
                    tenants: usage.iter().map(|(t, inuse, pending)| (TenantName::from_static(tenants[*t]), TenantReport { used_milli_gpue_ms: 0, inuse: *inuse, pending: *pending, largest: (*pending).min(1_000 + inuse % 16_000), borrowed: 0 })).collect(),
                    evictions: Vec::new(),
                    decisions: Vec::new(),
                    window: None,
                    status: None,
                };
                if let Ok(Applied::Reported { lease, .. }) = fed.apply(now, Command::Report(r)) {
                    seqs[c] = (seqs[c].0 + 1, lease.epoch);
                }
                if dt % 5 == 0 {
                    // Another policy now and then: the plan's tenants change (a tenant
                    // leaving the policy stays while it has committed entitlement).
                    // Weighting the GPU differently changes every cluster's capacity.
                    let other = match dt % 3 {
                        0 => yaml.to_string(),
                        1 => yaml.replace("  - {name: b, weight: 1}\n", "  - {name: e, weight: 1}\n"),
                        _ => yaml.replace("spec:\n", "spec:\n  resourceWeights: {nvidia.com/gpu: \"0.1\"}\n"),
                    };
                    let _ = fed.apply(now, Command::ApplyPolicy(crate::policy::Policy::from_yaml(&other).expect("policy")));
                }
                if dt % 11 == 0 {
                    // A cluster registers again with another capacity: its usage and
                    // leases stay, the pods that fit it change.
                    let capacity = [("nvidia.com/gpu".to_string(), 4_000 + dt % 20_000)].into();
                    let _ = fed.apply(now, Command::RegisterCluster { cluster: ClusterName::parse(format!("k{c}")).expect("name"), capacity, labels: BTreeMap::new() });
                }
                if dt % 3 == 0 {
                    // Time passes with no report: leases expire between commands.
                    now += dt;
                    let _ = fed.apply(now, Command::Tick);
                }
                let cells = fed.with_grid(|g| {
                    let rows = g.names().len();
                    let cells: Vec<_> = (0..rows).flat_map(|i| g.row(i).iter().map(|c| (c.usage, c.enforceable)).collect::<Vec<_>>()).collect();
                    let sums: Vec<_> = (0..rows).map(|i| g.sums(i)).collect();
                    let split: Vec<_> = (0..rows).flat_map(|i| { let (c, b) = g.split_row(i); c.iter().copied().zip(b.iter().copied()).collect::<Vec<_>>() }).collect();
                    // Planning while the kept grid is in use reads a grid of its own.
                    let reentrant = fed.plan();
                    (g.names().to_vec(), cells, sums, split, reentrant)
                });
                prop_assert_eq!(&cells.4, &fed.plan());
                let (names, cells, sums, split) = (cells.0, cells.1, cells.2, cells.3);
                prop_assert_eq!(&names, &fed.plan().tenants);
                let (want_cells, want_sums, want_split) = naive(&fed, &names);
                prop_assert_eq!(&cells, &want_cells);
                prop_assert_eq!(&sums, &want_sums);
                prop_assert_eq!(&split, &want_split);
                // A copy starts with no grid: it reads, plans and splits the same.
                let fresh = fed.clone();
                prop_assert_eq!(fresh.plan(), fed.plan());
                for id in fed.clusters.keys() {
                    prop_assert_eq!(fresh.desired_budgets(id), fed.desired_budgets(id));
                }
            }
        }
    }

    /// A stored report (a log entry's JSON, a journal record) whose tenant is no DNS
    /// label, as builds before 2026-12-04 let into the log, is read without it: applying
    /// it ignored that tenant, so every replica reaches the state it reached then.
    #[test]
    fn a_stored_report_reads_without_a_tenant_that_is_no_label() {
        let json = r#"{"cluster":"east","seq":3,"held_epoch":1,"capacity":null,"tenants":{"team-":{"used_milli_gpue_ms":5,"inuse":1000,"pending":0},"training":{"used_milli_gpue_ms":7,"inuse":2000,"pending":0}}}"#;
        let r: UsageReport = serde_json::from_str(json).expect("read");
        assert_eq!(
            r.tenants.keys().map(TenantName::as_str).collect::<Vec<_>>(),
            ["training"]
        );
        assert_eq!(r.tenants["training"].used_milli_gpue_ms, 7);
        // The cluster's name is checked strictly: every build checked it.
        assert!(serde_json::from_str::<UsageReport>(&json.replace("\"east\"", "\"east-\"")).is_err());
    }
}
