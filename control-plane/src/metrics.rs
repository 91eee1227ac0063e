//! Prometheus metrics of a control-plane node (one registry, prefix `kvota`).

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

use crate::types::{Node, NodeId};

/// Label set naming a tenant.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabel {
    /// Tenant name.
    pub tenant: String,
}

/// Label set naming an outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    /// `applied`, `duplicate`, `rejected`, `forwarded`.
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
    apply_seconds: Histogram,
    reports: Family<OutcomeLabel, Counter>,
    role: Family<RoleLabel, Gauge>,
    term: Gauge,
    last_log_index: Gauge,
    last_applied_index: Gauge,
    leader_id: Gauge,
    entitlement: Family<TenantLabel, Gauge>,
    target: Family<TenantLabel, Gauge>,
    inuse: Family<TenantLabel, Gauge>,
    drift: Family<TenantLabel, Gauge>,
    capacity: Gauge,
    clusters: Gauge,
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
        let entitlement = Family::<TenantLabel, Gauge>::default();
        let target = Family::<TenantLabel, Gauge>::default();
        let inuse = Family::<TenantLabel, Gauge>::default();
        let drift = Family::<TenantLabel, Gauge>::default();
        let (capacity, clusters) = (Gauge::default(), Gauge::default());
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
        r.register(
            "tenant_entitlement_milli_gpue",
            "Committed entitlement per tenant (budgets are cut from it), milli-GPUe",
            entitlement.clone(),
        );
        r.register(
            "tenant_target_milli_gpue",
            "Target entitlement per tenant from the fairness model, milli-GPUe",
            target.clone(),
        );
        r.register("tenant_inuse_milli_gpue", "Reported in-use GPUe per tenant, milli-GPUe", inuse.clone());
        r.register(
            "tenant_drift_ppm",
            "In-use share minus entitled share per tenant, parts per million of capacity",
            drift.clone(),
        );
        r.register("federation_capacity_milli_gpue", "Federation capacity, milli-GPUe", capacity.clone());
        r.register("clusters", "Registered member clusters", clusters.clone());
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
            apply_seconds,
            reports,
            role,
            term,
            last_log_index,
            last_applied_index,
            leader_id,
            entitlement,
            target,
            inuse,
            drift,
            capacity,
            clusters,
            denied,
            refused,
            tls_reloads,
            disk_free_bytes,
            disk_low,
            fatal,
        }
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

    /// Refreshes gauges from Raft and the state machine, then encodes the registry.
    pub fn render(&self, raft: &RaftMetrics<NodeId, Node>, fed: &Federation) -> String {
        for r in ["leader", "follower", "candidate", "learner", "shutdown"] {
            let v = i64::from(role_name(raft) == r);
            self.role.get_or_create(&RoleLabel { role: r.to_string() }).set(v);
        }
        let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        self.term.set(g(raft.current_term));
        self.last_log_index.set(g(raft.last_log_index.unwrap_or(0)));
        self.last_applied_index.set(g(raft.last_applied.map_or(0, |l| l.index)));
        self.leader_id.set(g(raft.current_leader.unwrap_or(0)));
        let plan = fed.plan();
        self.capacity.set(g(plan.capacity));
        self.clusters.set(g(fed.clusters().len() as u64));
        self.entitlement.clear();
        self.target.clear();
        self.inuse.clear();
        self.drift.clear();
        for (i, name) in plan.tenants.iter().enumerate() {
            let l = TenantLabel { tenant: name.clone() };
            let committed = fed.committed().get(name).copied().unwrap_or(0);
            let inuse = plan.inuse.get(i).copied().unwrap_or(0);
            self.entitlement.get_or_create(&l).set(g(committed));
            self.target
                .get_or_create(&l)
                .set(g(plan.entitlements.get(i).map_or(0, |e| e.total)));
            self.inuse.get_or_create(&l).set(g(inuse));
            self.drift
                .get_or_create(&l)
                .set(kvota_fairness::measures::drift_ppm(inuse, committed, plan.capacity));
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
