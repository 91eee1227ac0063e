//! Prometheus metrics of a control-plane node (one registry, prefix `kvota`), in
//! Prometheus conventions: GPU-equivalents as floats (`_gpus`), time in `_seconds`,
//! ratios 0 to 1. Per-tenant and per-cluster series are bounded by the policy's tenants
//! and the registered clusters. docs/metrics.md lists every series.

use std::sync::Arc;
use std::time::Duration;

use kvota_fairness::federation::Federation;
use openraft::RaftMetrics;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A gauge of a float (GPU-equivalents, seconds, ratios).
type FGauge = Gauge<f64, std::sync::atomic::AtomicU64>;
/// A counter of a float (seconds).
type FCounter = Counter<f64, std::sync::atomic::AtomicU64>;

use crate::types::{Node, NodeId};

/// Label set naming a tenant.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabel {
    /// Tenant name.
    pub tenant: String,
}

/// Label set naming a cluster.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ClusterLabel {
    /// Cluster name.
    pub cluster: String,
}

/// Label set of `kvota_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabel {
    /// The kvota version.
    pub version: String,
    /// The newest feature level this build supports.
    pub feature_level_max: String,
}

/// Label set naming an outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `applied`, `duplicate`, `rejected`.
    pub outcome: String,
}

/// Label set naming a Raft role.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleLabel {
    /// `leader`, `follower`, `candidate`, `learner`, `shutdown`.
    pub role: String,
}

/// Label set of a refused call.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeniedLabel {
    /// `member`, `admin`, `raft`, `http`.
    pub service: String,
    /// The RPC method or HTTP route.
    pub method: String,
    /// `unauthenticated`, `role`, `cluster_mismatch`, `not_forwarded`, `sender_mismatch`,
    /// `out_of_range`.
    pub reason: String,
}

/// Label set of a connection closed before it carried a request.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabel {
    /// `grpc`, `raft`, `http`.
    pub listener: String,
    /// See `kvota_tls::Refusal`.
    pub reason: String,
}

/// Label set of a TLS files reload.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabel {
    /// `ok` or `error`.
    pub state: String,
}

/// The node's metrics. Cloning shares them.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Arc<Registry>,
    rendering: Arc<std::sync::Mutex<()>>,
    apply_seconds: Histogram,
    reports: Family<OutcomeLabel, Counter>,
    role: Family<RoleLabel, Gauge>,
    term: Gauge,
    last_log_index: Gauge,
    last_applied_index: Gauge,
    leader_id: Gauge,
    has_leader: Gauge,
    entitlement: Family<TenantLabel, FGauge>,
    target: Family<TenantLabel, FGauge>,
    inuse: Family<TenantLabel, FGauge>,
    pending: Family<TenantLabel, FGauge>,
    guarantee: Family<TenantLabel, FGauge>,
    decayed: Family<TenantLabel, FGauge>,
    drift: Family<TenantLabel, FGauge>,
    score: Family<TenantLabel, FGauge>,
    federation_score: FGauge,
    violation: Family<TenantLabel, FCounter>,
    starved: Family<TenantLabel, FCounter>,
    capacity: FGauge,
    clusters: Gauge,
    cluster_capacity: Family<ClusterLabel, FGauge>,
    cluster_inuse: Family<ClusterLabel, FGauge>,
    cluster_report_age: Family<ClusterLabel, FGauge>,
    cluster_unreachable: Family<ClusterLabel, Gauge>,
    denied: Family<DeniedLabel, Counter>,
    refused: Family<RefusedLabel, Counter>,
    tls_reloads: Family<ReloadLabel, Counter>,
    disk_free_bytes: Gauge,
    disk_low: Gauge,
    fatal: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers everything.
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("kvota");
        // 100 µs .. ~3 s: a commit on loopback is ~1 ms; seconds mean trouble.
        let apply_seconds = Histogram::new(exponential_buckets(0.0001, 2.0, 16));
        let reports = Family::<OutcomeLabel, Counter>::default();
        let role = Family::<RoleLabel, Gauge>::default();
        let (term, last_log_index, last_applied_index, leader_id) =
            (Gauge::default(), Gauge::default(), Gauge::default(), Gauge::default());
        let has_leader = Gauge::default();
        let (entitlement, target, inuse, pending, guarantee, decayed, drift, score) = (
            Family::<TenantLabel, FGauge>::default(),
            Family::<TenantLabel, FGauge>::default(),
            Family::<TenantLabel, FGauge>::default(),
            Family::<TenantLabel, FGauge>::default(),
            Family::<TenantLabel, FGauge>::default(),
            Family::<TenantLabel, FGauge>::default(),
            Family::<TenantLabel, FGauge>::default(),
            Family::<TenantLabel, FGauge>::default(),
        );
        let (federation_score, capacity, clusters) = (FGauge::default(), FGauge::default(), Gauge::default());
        let (cluster_capacity, cluster_inuse, cluster_report_age, cluster_unreachable) = (
            Family::<ClusterLabel, FGauge>::default(),
            Family::<ClusterLabel, FGauge>::default(),
            Family::<ClusterLabel, FGauge>::default(),
            Family::<ClusterLabel, Gauge>::default(),
        );
        r.register(
            "apply_duration_seconds",
            "Time from proposing a command to its answer from the state machine",
            apply_seconds.clone(),
        );
        r.register("reports", "Usage reports received, by outcome", reports.clone());
        r.register("raft_role", "1 for this node's current Raft role", role.clone());
        r.register("raft_term", "Current Raft term", term.clone());
        r.register("raft_last_log_index", "Index of the last log entry", last_log_index.clone());
        r.register("raft_last_applied_index", "Index of the last applied entry", last_applied_index.clone());
        r.register("raft_leader_id", "Id of the known leader (0: none)", leader_id.clone());
        r.register("raft_has_leader", "1 while this node knows a leader", has_leader.clone());
        r.register("tenant_entitlement_gpus", "Committed entitlement per tenant (budgets are cut from it), GPU-equivalents", entitlement.clone());
        r.register("tenant_target_gpus", "Target entitlement per tenant from the fairness model, GPU-equivalents", target.clone());
        r.register("tenant_inuse_gpus", "Reported in-use (bound plus reserved) per tenant, GPU-equivalents", inuse.clone());
        r.register("tenant_pending_gpus", "Reported waiting demand per tenant (queued or recently denied), GPU-equivalents", pending.clone());
        r.register(
            "tenant_guarantee_gpus",
            "What the tenant is guaranteed now: its minShare of capacity, up to its reported demand (in use plus waiting), GPU-equivalents",
            guarantee.clone(),
        );
        r.register(
            "tenant_decayed_usage_gpu_seconds",
            "Decayed usage per tenant (the fairness model's input), GPU-equivalent seconds",
            decayed.clone(),
        );
        r.register("tenant_drift_ratio", "In-use share minus entitled share per tenant, as a fraction of capacity (-1 to 1)", drift.clone());
        r.register("tenant_fairness_score", "Fairness score per tenant: 1 while its in-use share is near its entitled share, falling to 0", score.clone());
        r.register("fairness_score", "The lowest tenant fairness score (1 with no tenants)", federation_score.clone());
        let (violation, starved) = (Family::<TenantLabel, FCounter>::default(), Family::<TenantLabel, FCounter>::default());
        r.register(
            "tenant_share_violation_seconds",
            "Federation time a tenant held more than its entitlement (in use above entitled), seconds",
            violation.clone(),
        );
        r.register(
            "tenant_starved_seconds",
            "Federation time a tenant held less than its guarantee while it asked for more (in use below min(min share, in use + waiting)), seconds",
            starved.clone(),
        );
        r.register("federation_capacity_gpus", "Federation capacity, GPU-equivalents", capacity.clone());
        r.register("clusters", "Registered member clusters", clusters.clone());
        r.register("cluster_capacity_gpus", "Capacity per member cluster, GPU-equivalents", cluster_capacity.clone());
        r.register("cluster_inuse_gpus", "Reported in-use per member cluster (all tenants), GPU-equivalents", cluster_inuse.clone());
        r.register(
            "cluster_report_age_seconds",
            "Since the cluster's last applied report, on the federation's clock (absent before its first)",
            cluster_report_age.clone(),
        );
        r.register(
            "cluster_unreachable",
            "1 while every lease of the cluster has expired: it enforces its safe budgets until it calls again",
            cluster_unreachable.clone(),
        );
        let build = Family::<BuildLabel, Gauge>::default();
        build
            .get_or_create(&BuildLabel { version: env!("CARGO_PKG_VERSION").to_string(), feature_level_max: crate::types::FEATURE_LEVEL.to_string() })
            .set(1);
        r.register("build_info", "1, labelled with this build's version and the newest feature level it supports", build);
        let denied = Family::<DeniedLabel, Counter>::default();
        let refused = Family::<RefusedLabel, Counter>::default();
        let tls_reloads = Family::<ReloadLabel, Counter>::default();
        let (disk_free_bytes, disk_low, fatal) = (Gauge::default(), Gauge::default(), Gauge::default());
        r.register("auth_denied", "Calls refused by authentication or authorization, by service, method and reason", denied.clone());
        r.register("connections_refused", "Connections closed before carrying a request, by listener and reason", refused.clone());
        r.register("tls_reloads", "Reloads of this node's certificate, key and CA bundle from disk, by outcome", tls_reloads.clone());
        r.register("disk_free_bytes", "Free bytes on the data directory's file system", disk_free_bytes.clone());
        r.register("disk_low", "1 while the data directory's file system is below its free-space reserve", disk_low.clone());
        r.register("raft_fatal", "1 once the Raft core has stopped (the process exits)", fatal.clone());
        Metrics {
            registry: Arc::new(r),
            rendering: Arc::default(),
            apply_seconds,
            reports,
            role,
            term,
            last_log_index,
            last_applied_index,
            leader_id,
            has_leader,
            entitlement,
            target,
            inuse,
            pending,
            guarantee,
            decayed,
            drift,
            score,
            federation_score,
            violation,
            starved,
            capacity,
            clusters,
            cluster_capacity,
            cluster_inuse,
            cluster_report_age,
            cluster_unreachable,
            denied,
            refused,
            tls_reloads,
            disk_free_bytes,
            disk_low,
            fatal,
        }
    }

    /// Adds federation time a tenant spent above its entitlement and below its guarantee
    /// (see [`crate::view::ShareTimes`]).
    pub fn add_share_time(&self, tenant: &str, violation_seconds: f64, starved_seconds: f64) {
        let l = TenantLabel { tenant: tenant.to_string() };
        self.violation.get_or_create(&l).inc_by(violation_seconds);
        self.starved.get_or_create(&l).inc_by(starved_seconds);
    }

    /// Counts a refused call.
    pub fn denied(&self, service: &str, method: &str, reason: &str) {
        self.denied
            .get_or_create(&DeniedLabel { service: service.to_string(), method: method.to_string(), reason: reason.to_string() })
            .inc();
    }

    /// Counts a refused connection.
    pub fn refused(&self, listener: &str, reason: &str) {
        self.refused.get_or_create(&RefusedLabel { listener: listener.to_string(), reason: reason.to_string() }).inc();
    }

    /// Counts a reload of the TLS files.
    pub fn tls_reload(&self, ok: bool) {
        self.tls_reloads.get_or_create(&ReloadLabel { state: if ok { "ok" } else { "error" }.to_string() }).inc();
    }

    /// The data directory's free space, and whether it is below the reserve.
    pub fn disk(&self, free_bytes: u64, low: bool) {
        self.disk_free_bytes.set(i64::try_from(free_bytes).unwrap_or(i64::MAX));
        self.disk_low.set(i64::from(low));
    }

    /// The Raft core stopped.
    pub fn set_fatal(&self) {
        self.fatal.set(1);
    }

    /// Records one command's propose-to-answer time.
    pub fn observe_apply(&self, d: Duration) {
        self.apply_seconds.observe(d.as_secs_f64());
    }

    /// Counts a report by outcome.
    pub fn report(&self, outcome: &str) {
        self.reports
            .get_or_create(&OutcomeLabel {
                outcome: outcome.to_string(),
            })
            .inc();
    }

    /// Refreshes gauges from Raft and the state machine, then encodes the registry. One
    /// render at a time: the per-tenant and per-cluster families are cleared and filled
    /// again, and a concurrent scrape must not see them half filled.
    pub fn render(&self, raft: &RaftMetrics<NodeId, Node>, fed: &Federation) -> String {
        let _one = self.rendering.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        for r in ["leader", "follower", "candidate", "learner", "shutdown"] {
            let v = i64::from(role_name(raft) == r);
            self.role.get_or_create(&RoleLabel { role: r.to_string() }).set(v);
        }
        let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.term.set(g(raft.current_term));
        self.last_log_index.set(g(raft.last_log_index.unwrap_or(0)));
        self.last_applied_index.set(g(raft.last_applied.map_or(0, |l| l.index)));
        self.leader_id.set(g(raft.current_leader.unwrap_or(0)));
        self.has_leader.set(i64::from(raft.current_leader.is_some()));
        let view = crate::view::FederationView::summary(fed);
        self.capacity.set(view.capacity_gpus);
        self.clusters.set(g(fed.clusters().len() as u64));
        for family in [&self.entitlement, &self.target, &self.inuse, &self.pending, &self.guarantee, &self.decayed, &self.drift, &self.score] {
            family.clear();
        }
        for t in &view.tenants {
            let l = TenantLabel { tenant: t.tenant.clone() };
            self.entitlement.get_or_create(&l).set(t.entitlement_gpus);
            self.target.get_or_create(&l).set(t.target_gpus);
            self.inuse.get_or_create(&l).set(t.inuse_gpus);
            self.pending.get_or_create(&l).set(t.pending_gpus);
            self.guarantee.get_or_create(&l).set(t.guarantee_gpus);
            self.decayed.get_or_create(&l).set(t.decayed_usage_gpu_seconds);
            self.drift.get_or_create(&l).set(t.drift_ratio);
            self.score.get_or_create(&l).set(t.fairness_score);
        }
        self.federation_score.set(view.fairness_score);
        for family in [&self.cluster_capacity, &self.cluster_inuse, &self.cluster_report_age] {
            family.clear();
        }
        self.cluster_unreachable.clear();
        for c in &view.clusters {
            let l = ClusterLabel { cluster: c.cluster.clone() };
            self.cluster_capacity.get_or_create(&l).set(c.capacity_gpus);
            self.cluster_inuse.get_or_create(&l).set(c.inuse_gpus);
            if let Some(age) = c.report_age_seconds {
                self.cluster_report_age.get_or_create(&l).set(age);
            }
            self.cluster_unreachable.get_or_create(&l).set(i64::from(c.lease == crate::view::LeaseState::Fallback));
        }
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Lower-case role name of a node.
pub fn role_name(m: &RaftMetrics<NodeId, Node>) -> &'static str {
    match m.state {
        openraft::ServerState::Leader => "leader",
        openraft::ServerState::Follower => "follower",
        openraft::ServerState::Candidate => "candidate",
        openraft::ServerState::Learner => "learner",
        openraft::ServerState::Shutdown => "shutdown",
    }
}
