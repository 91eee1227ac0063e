//! What operators read, in one schema for the HTTP API and the CLI's `-o json|yaml`:
//! every read answer is a serde type here, built from the same gRPC reply (or the same
//! function behind it) whoever asks ([`StatusView`], [`TenantsView`], [`ClusterView`],
//! [`UsageView`], [`DecisionsView`]).
//!
//! [`FederationView`]: the federation as the dashboard and the metrics read it, one
//! snapshot of the replicated state in base units (GPU-equivalents as floats, seconds, ratios 0 to 1), computed once from
//! [`Federation`] and shared by the Prometheus exposition ([`crate::metrics`]) and the
//! dashboard's JSON (`/api/v1/overview`, [`crate::http`]), so the two never disagree.
//!
//! Also [`History`]: a bounded ring of samples of that view, taken on this node every
//! [`HISTORY_INTERVAL`], for the dashboard's charts (`/api/v1/history`). It is not
//! replicated: every node samples the same replicated state, and a restarted node starts
//! an empty chart.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use kvota_fairness::federation::Federation;
use kvota_proto::v1;
use serde::{Deserialize, Serialize};

/// GPU-equivalents from thousandths.
pub fn gpus(milli: u64) -> f64 {
    milli as f64 / 1000.0
}

/// What the score shown beside each tenant means, in the words the dashboard, the CLI
/// and the demo print with it: one definition everywhere
/// ([`kvota_fairness::measures::tenant_score`]).
pub const SCORE_DEFINITION: &str = "fairness score: in use (running + admitted) against entitled, as shares of \
     capacity; 1.00 within 20 % of the entitlement, falling to 0.00 at 40 % off (the article's score)";

/// Per tenant (in `tenants`' order): GPUe running (on a node, as the agents report it)
/// and GPUe waiting, over every cluster.
pub fn in_use_split(fed: &Federation, tenants: &[kvota_fairness::names::TenantName]) -> Vec<(u64, u64)> {
    let row: std::collections::HashMap<&str, usize> =
        tenants.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
    let mut out = vec![(0u64, 0u64); tenants.len()];
    for rec in fed.clusters().values() {
        for (t, u) in rec.usage.iter() {
            if let Some(o) = row.get(t.as_str()).and_then(|&i| out.get_mut(i)) {
                o.0 = o.0.saturating_add(rec.running(t));
                o.1 = o.1.saturating_add(u.pending);
            }
        }
    }
    out
}

/// One tenant's row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TenantRow {
    /// Tenant name.
    pub tenant: String,
    /// Policy weight (1.0 = one share); 0 for a tenant that left the policy but still
    /// holds leases.
    pub weight: f64,
    /// Committed entitlement: what the leases give it now.
    pub entitlement_gpus: f64,
    /// The plan's target (where the entitlement converges).
    pub target_gpus: f64,
    /// In use in every cluster: running plus admitted, what its budgets count.
    pub inuse_gpus: f64,
    /// Of in use: running, on a node.
    pub running_gpus: f64,
    /// Of in use: admitted, not yet running (reservations, pods not yet bound).
    pub admitted_gpus: f64,
    /// Reported waiting demand in every cluster (queued, or denied recently).
    pub pending_gpus: f64,
    /// The minimum share it can claim now (its min share, capped at what it asks for).
    pub guarantee_gpus: f64,
    /// Decayed usage (GPU-equivalent seconds).
    pub decayed_usage_gpu_seconds: f64,
    /// `(in use - entitlement) / capacity`, -1 to 1.
    pub drift_ratio: f64,
    /// [`SCORE_DEFINITION`].
    pub fairness_score: f64,
    /// Budget per cluster in the cluster's newest lease (clusters without one omitted).
    pub budgets: BTreeMap<String, f64>,
}

/// Where a cluster's lease stands, as the control plane sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LeaseState {
    /// Never issued one (not yet reported).
    None,
    /// In force with more than a fifth of its life left.
    Fresh,
    /// In force, a fifth of its life or less left: the cluster has not renewed.
    Expiring,
    /// Every lease has run out: the cluster enforces its safe budgets (fallback).
    Fallback,
}

/// One member cluster's row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterRow {
    /// Cluster name.
    pub cluster: String,
    /// Capacity under the policy's GPU weights.
    pub capacity_gpus: f64,
    /// In use it last reported: running plus admitted.
    pub inuse_gpus: f64,
    /// Of in use: running, on a node.
    pub running_gpus: f64,
    /// Of in use: admitted, not yet running.
    pub admitted_gpus: f64,
    /// Waiting it last reported.
    pub pending_gpus: f64,
    /// Seconds since its last report was applied (control-plane clock); none before one.
    pub report_age_seconds: Option<f64>,
    /// Its lease's state.
    pub lease: LeaseState,
    /// Newest lease epoch issued (0: none).
    pub lease_epoch: u64,
    /// Seconds the newest lease has left (0 once run out); none without a lease.
    pub lease_remaining_seconds: Option<f64>,
    /// The policy revision its agent enforces (none: its agent has not said).
    pub policy_revision: Option<u64>,
    /// Its agent's version, as the agent said.
    pub agent_version: Option<String>,
    /// The newest feature level its agent's build supports.
    pub agent_feature_level: Option<u32>,
    /// How often its agent reports (seconds).
    pub report_interval_seconds: Option<f64>,
}

/// The whole federation at one instant of the replicated clock.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FederationView {
    /// The replicated clock (ms since the Unix epoch, the voters' median).
    pub state_time_ms: u64,
    /// Name of the policy in force.
    pub policy: Option<String>,
    /// Its revision (0: below feature level 6, or no policy).
    pub policy_revision: u64,
    /// Federation capacity.
    pub capacity_gpus: f64,
    /// In use over every cluster: running plus admitted.
    pub inuse_gpus: f64,
    /// Of in use: running, on a node.
    pub running_gpus: f64,
    /// Of in use: admitted, not yet running.
    pub admitted_gpus: f64,
    /// Waiting over every cluster.
    pub pending_gpus: f64,
    /// `running / capacity` (0 without capacity): what the GPUs do, not what is promised.
    pub utilization: f64,
    /// The lowest tenant fairness score (1 without tenants).
    pub fairness_score: f64,
    /// [`SCORE_DEFINITION`], for whoever shows the score.
    pub score_definition: String,
    /// Tenants: the policy's, by name (the order the policy keeps them in), then any that left it but hold leases.
    pub tenants: Vec<TenantRow>,
    /// Clusters in name order.
    pub clusters: Vec<ClusterRow>,
}

impl FederationView {
    /// Reads `fed` once.
    pub fn of(fed: &Federation) -> FederationView {
        Self::read(fed, true)
    }

    /// [`FederationView::of`] without each tenant's budgets per cluster (`budgets` left
    /// empty): what the metrics and the history read, every few seconds under the
    /// state's read lock, so it must not cost `tenants x clusters` map entries.
    pub fn summary(fed: &Federation) -> FederationView {
        Self::read(fed, false)
    }

    fn read(fed: &Federation, with_budgets: bool) -> FederationView {
        let plan = fed.plan();
        let tenants = tenant_rows(fed, &plan, with_budgets);
        let clusters: Vec<ClusterRow> = fed.clusters().iter().map(|(n, rec)| cluster_row(fed, n, rec)).collect();
        let sum = |f: fn(&ClusterRow) -> f64| clusters.iter().map(f).sum::<f64>();
        let (inuse, running) = (sum(|c| c.inuse_gpus), sum(|c| c.running_gpus));
        let capacity = gpus(plan.capacity);
        FederationView {
            state_time_ms: fed.now_ms(),
            policy: fed.policy().map(|p| p.name.clone()),
            policy_revision: fed.policy_revision().0,
            capacity_gpus: capacity,
            inuse_gpus: inuse,
            running_gpus: running,
            admitted_gpus: sum(|c| c.admitted_gpus),
            pending_gpus: sum(|c| c.pending_gpus),
            utilization: if plan.capacity == 0 {
                0.0
            } else {
                (running / capacity).min(1.0)
            },
            fairness_score: tenants.iter().map(|t| t.fairness_score).fold(1.0, f64::min),
            score_definition: SCORE_DEFINITION.to_string(),
            tenants,
            clusters,
        }
    }
}

/// Every tenant's row of the plan.
fn tenant_rows(fed: &Federation, plan: &kvota_fairness::federation::Plan, with_budgets: bool) -> Vec<TenantRow> {
    let policy = fed.policy();
    let split = in_use_split(fed, &plan.tenants);
    // Each tenant's budget in the newest lease of every cluster that has one.
    let mut budgets: Vec<BTreeMap<String, f64>> =
        vec![BTreeMap::new(); if with_budgets { plan.tenants.len() } else { 0 }];
    if with_budgets {
        for (c, rec) in fed.clusters() {
            let Some(l) = rec.leases.latest() else { continue };
            for (i, name) in plan.tenants.iter().enumerate() {
                budgets[i].insert(c.to_string(), gpus(l.budgets.get(name).map_or(0, |b| b.budget)));
            }
        }
    }
    let mut budgets = budgets.into_iter();
    let mut rows = Vec::with_capacity(plan.tenants.len());
    for (i, name) in plan.tenants.iter().enumerate() {
        let committed = fed.committed().get(name).copied().unwrap_or(0);
        let inuse = plan.inuse.get(i).copied().unwrap_or(0);
        let (running, waiting) = split.get(i).copied().unwrap_or_default();
        let running = running.min(inuse);
        // The plan lists the policy's tenants first, by name (the policy sorts them).
        let spec = policy.and_then(|p| p.tenants.get(i)).filter(|t| &t.name == name);
        let min_share = spec.map_or(0, |t| {
            u64::try_from(u128::from(plan.capacity) * u128::from(t.min_share_bp) / 10_000).unwrap_or(u64::MAX)
        });
        rows.push(TenantRow {
            tenant: name.to_string(),
            weight: spec.map_or(0.0, |t| t.weight_milli as f64 / 1000.0),
            entitlement_gpus: gpus(committed),
            target_gpus: gpus(plan.entitlements.get(i).map_or(0, |e| e.total)),
            inuse_gpus: gpus(inuse),
            running_gpus: gpus(running),
            admitted_gpus: gpus(inuse - running),
            pending_gpus: gpus(waiting),
            guarantee_gpus: gpus(min_share.min(inuse.saturating_add(waiting))),
            // The ledger keeps milli-GPUe x ms.
            decayed_usage_gpu_seconds: plan.usage.get(i).copied().unwrap_or(0) as f64 / 1e6,
            drift_ratio: kvota_fairness::measures::drift_ppm(inuse, committed, plan.capacity) as f64 / 1e6,
            fairness_score: kvota_fairness::measures::tenant_score(inuse, committed, plan.capacity),
            budgets: budgets.next().unwrap_or_default(),
        });
    }
    rows
}

/// One cluster's row.
fn cluster_row(
    fed: &Federation,
    name: &kvota_fairness::names::ClusterName,
    rec: &kvota_fairness::federation::ClusterRecord,
) -> ClusterRow {
    let now = fed.now_ms();
    let (mut inuse, mut running, mut pending) = (0u64, 0u64, 0u64);
    for (t, u) in rec.usage.iter() {
        inuse = inuse.saturating_add(u.inuse);
        running = running.saturating_add(rec.running(t));
        pending = pending.saturating_add(u.pending);
    }
    let newest = rec.leases.latest();
    let lease = match newest {
        None if rec.leases.last_epoch == 0 => LeaseState::None,
        _ if fed.cluster_unreachable(rec) => LeaseState::Fallback,
        None => LeaseState::None,
        Some(l) => {
            let life = l.expires_at_ms.saturating_sub(l.issued_at_ms);
            if l.expires_at_ms.saturating_sub(now).saturating_mul(5) <= life {
                LeaseState::Expiring
            } else {
                LeaseState::Fresh
            }
        }
    };
    let status = rec.status.as_ref();
    ClusterRow {
        cluster: name.to_string(),
        capacity_gpus: gpus(rec.capacity_gpue),
        inuse_gpus: gpus(inuse),
        running_gpus: gpus(running),
        admitted_gpus: gpus(inuse.saturating_sub(running)),
        pending_gpus: gpus(pending),
        report_age_seconds: rec.last_report_ms.map(|at| now.saturating_sub(at) as f64 / 1000.0),
        lease,
        lease_epoch: rec.leases.last_epoch,
        lease_remaining_seconds: newest.map(|l| l.expires_at_ms.saturating_sub(now) as f64 / 1000.0),
        policy_revision: status.map(|s| s.policy_revision),
        agent_version: status.map(|s| s.agent_version.clone()),
        agent_feature_level: status.map(|s| s.feature_level),
        report_interval_seconds: status.map(|s| s.report_interval_ms as f64 / 1000.0),
    }
}

/// Per tenant, time above its entitlement and below its guarantee, measured on the
/// replicated clock between samples of the view ([`kvota_fairness::measures::ShareClock`]):
/// the state at one sample holds until the next; a clock standing still (no quorum)
/// adds nothing.
#[derive(Debug, Default)]
pub struct ShareTimes {
    clocks: BTreeMap<String, kvota_fairness::measures::ShareClock>,
}

impl ShareTimes {
    /// Observes `view`; calls `add(tenant, violation_seconds, starved_seconds)` with the
    /// time each tenant spent in each state since the previous observation.
    pub fn observe(&mut self, view: &FederationView, mut add: impl FnMut(&str, f64, f64)) {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let milli = |g: f64| (g * 1000.0).round().max(0.0) as u64;
        let listed: std::collections::BTreeSet<&str> = view.tenants.iter().map(|r| r.tenant.as_str()).collect();
        self.clocks.retain(|t, _| listed.contains(t.as_str()));
        for t in &view.tenants {
            let clock = self.clocks.entry(t.tenant.clone()).or_default();
            let (v0, s0) = (clock.violation_ms, clock.starved_ms);
            // Starved: in use below min(demand, guarantee), where the view's guarantee
            // is already min(min share, in use + waiting).
            clock.observe(
                view.state_time_ms,
                milli(t.inuse_gpus),
                milli(t.entitlement_gpus),
                u64::MAX,
                milli(t.guarantee_gpus),
            );
            let (dv, ds) = (clock.violation_ms - v0, clock.starved_ms - s0);
            if dv > 0 || ds > 0 || clock.observed_ms == 0 {
                add(&t.tenant, dv as f64 / 1000.0, ds as f64 / 1000.0);
            }
        }
    }
}

/// How often a node samples the view for the charts.
pub const HISTORY_INTERVAL: Duration = Duration::from_secs(5);
/// Samples kept: one hour at [`HISTORY_INTERVAL`].
pub const HISTORY_POINTS: usize = 720;
/// Tenants whose series are kept per sample: the first this many by name. A
/// sample keeps 12 bytes per tenant (the names are shared between samples while the
/// policy stays), so the ring stays under 9 MB.
pub const HISTORY_TENANTS: usize = 1_000;

/// A number kept for a chart: single precision (GPU counts well within it) halves the
/// ring's size.
#[allow(clippy::cast_possible_truncation)]
fn chart(x: f64) -> f32 {
    x as f32
}

/// One tenant's numbers in one sample: entitlement, in use, target (GPUs).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TenantPoint {
    /// Committed entitlement.
    pub entitlement_gpus: f32,
    /// In use.
    pub inuse_gpus: f32,
    /// The plan's target.
    pub target_gpus: f32,
}

/// One sample of the federation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The replicated clock at the sample.
    pub at_ms: u64,
    /// Federation capacity.
    pub capacity_gpus: f32,
    /// In use over every cluster.
    pub inuse_gpus: f32,
    /// The lowest tenant fairness score.
    pub fairness_score: f32,
    /// Tenant names, shared with the previous sample while they stay the same.
    pub names: std::sync::Arc<[String]>,
    /// Per tenant, in the order of `names` (at most [`HISTORY_TENANTS`]).
    pub tenants: Vec<TenantPoint>,
}

/// A bounded ring of samples, oldest first.
#[derive(Debug, Default)]
pub struct History {
    samples: VecDeque<Sample>,
}

/// What `/api/v1/history` answers: the federation's totals, and one tenant's series when
/// asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HistoryView {
    /// Seconds between samples.
    pub interval_seconds: f64,
    /// The tenant asked for, if any.
    pub tenant: Option<String>,
    /// Oldest first.
    pub points: Vec<HistoryPoint>,
}

/// One point of [`HistoryView`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HistoryPoint {
    /// The replicated clock at the sample.
    pub at_ms: u64,
    /// Federation capacity.
    pub capacity_gpus: f32,
    /// In use over every cluster.
    pub inuse_gpus: f32,
    /// The lowest tenant fairness score.
    pub fairness_score: f32,
    /// The tenant's numbers (absent when no tenant was asked for, or it had none then).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<TenantPoint>,
}

impl History {
    /// Adds a sample of `view`, unless the replicated clock has not moved since the
    /// last one (a node without a quorum keeps time standing: nothing new to draw) or
    /// has never been set (a node that has applied nothing yet).
    pub fn sample(&mut self, view: &FederationView) {
        if view.state_time_ms == 0 || self.samples.back().is_some_and(|s| s.at_ms >= view.state_time_ms) {
            return;
        }
        let kept = &view.tenants[..view.tenants.len().min(HISTORY_TENANTS)];
        let names = match self.samples.back() {
            Some(s) if s.names.iter().eq(kept.iter().map(|t| &t.tenant)) => s.names.clone(),
            _ => kept.iter().map(|t| t.tenant.clone()).collect(),
        };
        let tenants = kept
            .iter()
            .map(|t| TenantPoint {
                entitlement_gpus: chart(t.entitlement_gpus),
                inuse_gpus: chart(t.inuse_gpus),
                target_gpus: chart(t.target_gpus),
            })
            .collect();
        if self.samples.len() == HISTORY_POINTS {
            self.samples.pop_front();
        }
        self.samples.push_back(Sample {
            at_ms: view.state_time_ms,
            capacity_gpus: chart(view.capacity_gpus),
            inuse_gpus: chart(view.inuse_gpus),
            fairness_score: chart(view.fairness_score),
            names,
            tenants,
        });
    }

    /// Samples kept.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// No samples yet.
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// The series, with `tenant`'s numbers when given.
    pub fn view(&self, tenant: Option<&str>) -> HistoryView {
        HistoryView {
            interval_seconds: HISTORY_INTERVAL.as_secs_f64(),
            tenant: tenant.map(str::to_string),
            points: self
                .samples
                .iter()
                .map(|s| HistoryPoint {
                    at_ms: s.at_ms,
                    capacity_gpus: s.capacity_gpus,
                    inuse_gpus: s.inuse_gpus,
                    fairness_score: s.fairness_score,
                    tenant: tenant
                        .and_then(|t| s.names.iter().position(|n| n == t))
                        .and_then(|i| s.tenants.get(i).copied()),
                })
                .collect(),
        }
    }
}

/// A control-plane member, as `kvota status` and `kvota members list` print it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemberView {
    /// Node id.
    pub id: u64,
    /// A voter (else a learner).
    pub voter: bool,
    /// The leader, as the answering node knows it.
    pub leader: bool,
    /// gRPC address.
    pub rpc: String,
    /// Raft address.
    pub raft: String,
    /// HTTP address (the dashboard's).
    pub http: String,
}

/// A node's view of itself and the group: `kvota status -o json`, `/api/v1/status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusView {
    /// The node that answered.
    pub node_id: u64,
    /// Its Raft role: leader, follower, candidate, learner, shutdown.
    pub role: String,
    /// Its Raft term.
    pub term: u64,
    /// The leader it knows (none during an election or without a quorum).
    pub leader_id: Option<u64>,
    /// The leader's gRPC address, if known.
    pub leader_rpc_addr: Option<String>,
    /// The leader's HTTP address (its dashboard), if known.
    pub leader_http_addr: Option<String>,
    /// Last log index.
    pub last_log_index: u64,
    /// Last applied index.
    pub last_applied_index: u64,
    /// Whether `/readyz` would pass.
    pub ready: bool,
    /// The replicated clock, ms since the Unix epoch.
    pub state_time_ms: u64,
    /// Name of the policy in force.
    pub policy: Option<String>,
    /// Registered member clusters.
    pub clusters: u32,
    /// The replicated state's feature level.
    pub feature_level: u32,
    /// The newest feature level the answering node supports.
    pub feature_level_max: u32,
    /// The revision of the policy in force (0: below feature level 6, or none).
    pub policy_revision: u64,
    /// The group's members.
    pub members: Vec<MemberView>,
}

impl From<&v1::StatusReply> for StatusView {
    fn from(s: &v1::StatusReply) -> StatusView {
        let leader = (s.leader_id != 0).then_some(s.leader_id);
        let leader_member = s.members.iter().find(|m| Some(m.id) == leader);
        let text = |x: &str| (!x.is_empty()).then(|| x.to_string());
        StatusView {
            node_id: s.node_id,
            role: s.role.clone(),
            term: s.term,
            leader_id: leader,
            leader_rpc_addr: text(&s.leader_rpc_addr),
            leader_http_addr: leader_member.and_then(|m| text(&m.http_addr)),
            last_log_index: s.last_log_index,
            last_applied_index: s.last_applied_index,
            ready: s.ready,
            state_time_ms: s.state_time_ms,
            policy: text(&s.policy),
            clusters: s.clusters,
            feature_level: s.feature_level,
            feature_level_max: s.feature_level_max,
            policy_revision: s.policy_revision,
            members: s
                .members
                .iter()
                .map(|m| MemberView {
                    id: m.id,
                    voter: m.voter,
                    leader: Some(m.id) == leader,
                    rpc: m.rpc_addr.clone(),
                    raft: m.raft_addr.clone(),
                    http: m.http_addr.clone(),
                })
                .collect(),
        }
    }
}

/// One tenant in `kvota tenants -o json` and `/api/v1/tenants` (GPU-equivalents in
/// thousandths, shares in basis points: exact integers).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TenantView {
    /// Name.
    pub tenant: String,
    /// Policy weight, thousandths.
    pub weight_milli: u64,
    /// Guaranteed share, basis points.
    pub min_share_bp: u32,
    /// Largest share, basis points.
    pub max_share_bp: u32,
    /// Whether its pods may be evicted for others.
    pub preemptible: bool,
    /// Demand the plan used.
    pub demand_milli_gpue: u64,
    /// In use in every cluster: running plus admitted.
    pub inuse_milli_gpue: u64,
    /// Of in use: running, on a node.
    pub running_milli_gpue: u64,
    /// Of in use: admitted, not yet running.
    pub admitted_milli_gpue: u64,
    /// Waiting in every cluster (queued, or denied recently).
    pub waiting_milli_gpue: u64,
    /// The plan's target.
    pub target_milli_gpue: u64,
    /// Committed entitlement.
    pub entitlement_milli_gpue: u64,
    /// `(in use - entitlement) / capacity`, parts per million.
    pub drift_ppm: i64,
    /// 1 when in use matches the entitlement.
    pub fairness_score: f64,
    /// Decayed usage, milli-GPUe x ms.
    pub decayed_usage_milli_gpue_ms: u64,
}

/// `kvota tenants -o json`, `/api/v1/tenants`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TenantsView {
    /// Federation capacity, thousandths of a GPU-equivalent.
    pub capacity_milli_gpue: u64,
    /// The policy's tenants by name (empty without a policy).
    pub tenants: Vec<TenantView>,
}

impl From<&v1::ListTenantsReply> for TenantsView {
    fn from(r: &v1::ListTenantsReply) -> TenantsView {
        TenantsView {
            capacity_milli_gpue: r.capacity_milli_gpue,
            tenants: r
                .tenants
                .iter()
                .map(|t| TenantView {
                    tenant: t.tenant.clone(),
                    weight_milli: t.weight_milli,
                    min_share_bp: t.min_share_bp,
                    max_share_bp: t.max_share_bp,
                    preemptible: t.preemptible,
                    demand_milli_gpue: t.demand_milli_gpue,
                    inuse_milli_gpue: t.inuse_milli_gpue,
                    running_milli_gpue: t.running_milli_gpue,
                    admitted_milli_gpue: t.admitted_milli_gpue,
                    waiting_milli_gpue: t.waiting_milli_gpue,
                    target_milli_gpue: t.target_milli_gpue,
                    entitlement_milli_gpue: t.entitlement_milli_gpue,
                    drift_ppm: t.drift_ppm,
                    fairness_score: t.fairness_score,
                    decayed_usage_milli_gpue_ms: t.decayed_usage,
                })
                .collect(),
        }
    }
}

/// One tenant's numbers in one cluster (its newest lease, its last report).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterTenantView {
    /// Tenant.
    pub tenant: String,
    /// In use there (last report): running plus admitted.
    pub inuse_milli_gpue: u64,
    /// Of in use: running, on a node.
    pub running_milli_gpue: u64,
    /// Waiting there (last report).
    pub pending_milli_gpue: u64,
    /// Budget in the newest lease.
    pub budget_milli_gpue: u64,
    /// Safe budget in the newest lease (after expiry).
    pub fallback_milli_gpue: u64,
    /// What the cluster may enforce now, over every open lease.
    pub enforceable_milli_gpue: u64,
}

/// One member cluster in `kvota clusters -o json` and `/api/v1/clusters`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterView {
    /// Name.
    pub cluster: String,
    /// Capacity in GPU-equivalents (thousandths) under the policy's weights.
    pub capacity_milli_gpue: u64,
    /// Capacity per resource name (thousandths).
    pub capacity: BTreeMap<String, u64>,
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// Last applied report's sequence number.
    pub last_seq: u64,
    /// When it was applied (the replicated clock; 0: never).
    pub last_report_ms: u64,
    /// Newest lease epoch issued.
    pub last_epoch: u64,
    /// Newest epoch the agent acknowledged.
    pub acked_epoch: u64,
    /// Every lease has run out: the cluster enforces its safe budgets.
    pub unreachable: bool,
    /// When the control plane noted it cut off (none: connected, or below level 6).
    pub cut_off_since_ms: Option<u64>,
    /// Its agent's last status (none: not reported, or below level 6).
    pub agent: Option<AgentView>,
    /// Per tenant.
    pub tenants: Vec<ClusterTenantView>,
}

/// What a cluster's agent last said of itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentView {
    /// Its version.
    pub version: String,
    /// The newest feature level its build supports.
    pub feature_level: u32,
    /// The policy revision it enforces.
    pub policy_revision: u64,
    /// How often it reports (ms).
    pub report_interval_ms: u64,
}

impl From<&v1::ClusterInfo> for ClusterView {
    fn from(c: &v1::ClusterInfo) -> ClusterView {
        ClusterView {
            cluster: c.cluster.clone(),
            capacity_milli_gpue: c.capacity_milli_gpue,
            capacity: c.capacity.iter().map(|r| (r.name.clone(), r.quantity_milli)).collect(),
            labels: c.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            last_seq: c.last_seq,
            last_report_ms: c.last_report_ms,
            last_epoch: c.last_epoch,
            acked_epoch: c.acked_epoch,
            unreachable: c.unreachable,
            cut_off_since_ms: (c.cut_off_since_ms > 0).then_some(c.cut_off_since_ms),
            agent: c.status.as_ref().map(|s| AgentView {
                version: s.agent_version.clone(),
                feature_level: s.feature_level,
                policy_revision: s.policy_revision,
                report_interval_ms: s.report_interval_ms,
            }),
            tenants: c
                .tenants
                .iter()
                .map(|t| ClusterTenantView {
                    tenant: t.tenant.clone(),
                    inuse_milli_gpue: t.inuse_milli_gpue,
                    running_milli_gpue: t.running_milli_gpue,
                    pending_milli_gpue: t.pending_milli_gpue,
                    budget_milli_gpue: t.budget_milli_gpue,
                    fallback_milli_gpue: t.fallback_milli_gpue,
                    enforceable_milli_gpue: t.enforceable_milli_gpue,
                })
                .collect(),
        }
    }
}

/// Showback over a period as `kvota usage -o json` prints it and `/api/v1/usage`
/// answers: one schema for both.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UsageView {
    /// False while the group runs below feature level 2 (no showback kept yet).
    pub kept: bool,
    /// The whole hours covered, `[since_ms, until_ms)`, ms since the Unix epoch.
    pub since_ms: u64,
    /// End of the period (exclusive).
    pub until_ms: u64,
    /// Start of the oldest hour still kept (none: nothing kept yet).
    pub kept_from_ms: Option<u64>,
    /// Sum of the rows.
    pub total_gpu_hours: f64,
    /// Rows in name order.
    pub rows: Vec<UsageViewRow>,
}

/// One row of [`UsageView`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UsageViewRow {
    /// The tenant, when grouped by tenant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// The cluster, when grouped by cluster.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<String>,
    /// GPU-equivalent hours, undecayed.
    pub gpu_hours: f64,
    /// The same, exact: thousandths of a GPU-equivalent x milliseconds.
    pub milli_gpue_ms: u64,
}

impl From<&kvota_proto::v1::UsageReply> for UsageView {
    fn from(r: &kvota_proto::v1::UsageReply) -> UsageView {
        let text = |s: &str| (!s.is_empty()).then(|| s.to_string());
        UsageView {
            kept: r.kept,
            since_ms: r.since_ms,
            until_ms: r.until_ms,
            kept_from_ms: (r.kept_from_ms > 0).then_some(r.kept_from_ms),
            // Folded from +0.0: a sum of no rows is 0, not the -0.0 `Iterator::sum`
            // starts from (which prints as `-0.000`).
            total_gpu_hours: r.rows.iter().map(|x| x.gpu_hours).fold(0.0, |a, b| a + b),
            rows: r
                .rows
                .iter()
                .map(|x| UsageViewRow {
                    tenant: text(&x.tenant),
                    cluster: text(&x.cluster),
                    gpu_hours: x.gpu_hours,
                    milli_gpue_ms: x.milli_gpue_ms,
                })
                .collect(),
        }
    }
}

/// The kept admission decisions about a pod, as `kvota explain pod -o json` prints them
/// and `/api/v1/decisions` answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecisionsView {
    /// False while the group runs below feature level 2 (no decisions kept yet).
    pub kept: bool,
    /// Newest first.
    pub decisions: Vec<DecisionRow>,
}

/// One decision of [`DecisionsView`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecisionRow {
    /// The member cluster whose agent decided.
    pub cluster: String,
    /// `namespace/name`.
    pub pod: String,
    /// Its tenant.
    pub tenant: String,
    /// `allow`, `queue` or `deny`.
    pub verdict: String,
    /// GPUs the pod asked for.
    pub gpus: f64,
    /// When (the agent's wall clock, ms since the Unix epoch).
    pub at_ms: u64,
    /// The numbers behind it, in sentences.
    pub text: String,
}

impl From<&kvota_proto::v1::ExplainPodReply> for DecisionsView {
    fn from(r: &kvota_proto::v1::ExplainPodReply) -> DecisionsView {
        DecisionsView {
            kept: r.kept,
            decisions: r
                .decisions
                .iter()
                .filter_map(|c| {
                    let d = c.decision.as_ref()?;
                    Some(DecisionRow {
                        cluster: c.cluster.clone(),
                        pod: d.pod.clone(),
                        tenant: d.tenant.clone(),
                        verdict: d.verdict.clone(),
                        gpus: gpus(d.milli_gpue),
                        at_ms: d.at_ms,
                        text: d.text.clone(),
                    })
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvota_fairness::names::{ClusterName, TenantName};

    /// The view reads every tenant's budget from each cluster's newest lease and its
    /// waiting demand summed over the clusters; the summary is the same without budgets.
    #[test]
    fn the_view_reads_budgets_and_demand_and_the_summary_leaves_out_budgets() {
        use kvota_fairness::federation::{Applied, Command, TenantReport, UsageReport};
        let yaml = "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: p}\nspec:\n  tenants:\n  - {name: b, weight: 1}\n  - {name: a, weight: 2}\n";
        let mut fed = Federation::default();
        fed.apply(
            1,
            Command::ApplyPolicy(kvota_fairness::policy::Policy::from_yaml(yaml).expect("policy")),
        )
        .expect("policy");
        let mut epochs = BTreeMap::new();
        for c in ["x", "y"] {
            let capacity = [("nvidia.com/gpu".to_string(), 8_000)].into();
            if let Ok(Applied::Registered(l)) = fed.apply(
                1,
                Command::RegisterCluster {
                    cluster: ClusterName::parse(c).expect("name"),
                    capacity,
                    labels: BTreeMap::new(),
                },
            ) {
                epochs.insert(c, l.epoch);
            }
        }
        let mut leases = BTreeMap::new();
        for (c, pending) in [("x", 3_000), ("y", 1_000)] {
            let tenants = [
                (
                    TenantName::from_static("a"),
                    TenantReport {
                        used_milli_gpue_ms: 0,
                        inuse: 1_000,
                        pending,
                        largest: 0,
                        borrowed: 0,
                    },
                ),
                (
                    TenantName::from_static("zz"),
                    TenantReport {
                        used_milli_gpue_ms: 0,
                        inuse: 0,
                        pending: 5_000,
                        largest: 0,
                        borrowed: 0,
                    },
                ),
            ]
            .into();
            let r = UsageReport {
                cluster: ClusterName::parse(c).expect("name"),
                seq: 1,
                held_epoch: epochs[c],
                capacity: None,
                tenants,
                evictions: vec![],
                decisions: vec![],
                window: None,
                status: None,
            };
            match fed.apply(2, Command::Report(r)) {
                Ok(Applied::Reported { lease, .. }) => leases.insert(c, lease),
                other => panic!("report: {other:?}"),
            };
        }
        let full = FederationView::of(&fed);
        let a = full.tenants.iter().find(|t| t.tenant == "a").expect("tenant a");
        assert_eq!(
            a.pending_gpus, 4.0,
            "3 + 1 waiting; an unknown tenant's are not counted"
        );
        for (c, lease) in &leases {
            assert_eq!(
                a.budgets.get(*c).copied(),
                Some(gpus(lease.budgets["a"].budget)),
                "cluster {c}"
            );
        }
        assert!(a.budgets.values().any(|&b| b > 0.0), "{:?}", a.budgets);
        let mut without = full.clone();
        without.tenants.iter_mut().for_each(|t| t.budgets.clear());
        assert_eq!(
            serde_json::to_value(FederationView::summary(&fed)).ok(),
            serde_json::to_value(without).ok()
        );
    }

    fn view(at: u64, tenants: usize) -> FederationView {
        FederationView {
            state_time_ms: at,
            policy: Some("p".into()),
            policy_revision: 1,
            capacity_gpus: 8.0,
            inuse_gpus: 2.0,
            running_gpus: 2.0,
            admitted_gpus: 0.0,
            pending_gpus: 0.0,
            utilization: 0.25,
            fairness_score: 1.0,
            score_definition: SCORE_DEFINITION.to_string(),
            tenants: (0..tenants)
                .map(|i| TenantRow {
                    tenant: format!("t{i}"),
                    weight: 1.0,
                    entitlement_gpus: i as f64,
                    target_gpus: 1.0,
                    inuse_gpus: 0.5,
                    running_gpus: 0.5,
                    admitted_gpus: 0.0,
                    pending_gpus: 0.0,
                    guarantee_gpus: 0.0,
                    decayed_usage_gpu_seconds: 0.0,
                    drift_ratio: 0.0,
                    fairness_score: 1.0,
                    budgets: BTreeMap::new(),
                })
                .collect(),
            clusters: vec![],
        }
    }

    /// `kvota usage` on an empty federation totals `0.000`, not `-0.000`.
    #[test]
    fn an_empty_usage_totals_zero_not_minus_zero() {
        let v = UsageView::from(&v1::UsageReply {
            kept: true,
            ..Default::default()
        });
        assert!(v.total_gpu_hours.is_sign_positive(), "{}", v.total_gpu_hours);
        assert_eq!(format!("{:.3}", v.total_gpu_hours), "0.000");
    }

    #[test]
    fn share_times_add_what_each_state_lasted() {
        let mut st = ShareTimes::default();
        let mut seen: BTreeMap<String, (f64, f64)> = BTreeMap::new();
        let mut add = |v: &FederationView| {
            st.observe(v, |t, a, b| {
                let e = seen.entry(t.to_string()).or_default();
                e.0 += a;
                e.1 += b;
            })
        };
        // t0: over its entitlement (in use 0.5 > 0); t0+10 s: starved (0.5 < 2); t0+30 s.
        let mut v = view(10_000, 1);
        add(&v);
        v.state_time_ms = 20_000;
        v.tenants[0].guarantee_gpus = 2.0;
        v.tenants[0].entitlement_gpus = 3.0;
        add(&v);
        v.state_time_ms = 40_000;
        add(&v);
        v.state_time_ms = 40_000;
        add(&v);
        assert_eq!(
            seen["t0"],
            (10.0, 20.0),
            "10 s over, then 20 s starved; a clock that stands adds nothing"
        );
    }

    #[test]
    fn the_history_is_bounded_and_skips_a_clock_that_stands() {
        let mut h = History::default();
        h.sample(&view(0, 2));
        assert!(h.is_empty(), "a clock never set is no time to chart");
        h.sample(&view(1_000, 2));
        h.sample(&view(1_000, 2));
        assert_eq!(h.len(), 1, "the clock stood: no new sample");
        for i in 0..(HISTORY_POINTS as u64 + 10) {
            h.sample(&view(2_000 + i, HISTORY_TENANTS + 5));
        }
        assert_eq!(h.len(), HISTORY_POINTS);
        let v = h.view(Some("t3"));
        assert_eq!(
            v.points.first().map(|p| p.at_ms),
            Some(2_000 + 10),
            "the oldest fell out"
        );
        assert_eq!(
            v.points.last().and_then(|p| p.tenant).map(|t| t.entitlement_gpus),
            Some(3.0)
        );
        let beyond = format!("t{}", HISTORY_TENANTS + 1);
        assert!(
            h.view(Some(&beyond)).points.iter().all(|p| p.tenant.is_none()),
            "tenants past the cap are not kept"
        );
        assert!(h.view(None).points.iter().all(|p| p.tenant.is_none()));
        let mut names = h.samples.iter().map(|s| std::sync::Arc::as_ptr(&s.names));
        let first = names.next();
        assert!(
            names.all(|p| Some(p) == first),
            "unchanged names are shared, not copied"
        );
    }
}
