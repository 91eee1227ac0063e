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
    /// `unauthenticated`, `role`, `cluster_mismatch`, `not_forwarded`; for Raft
    /// messages `sender_mismatch`, `not_a_member`, `out_of_range`, `inconsistent`,
    /// `newer_format`, `bad_snapshot` (see `guard::Refused`).
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

/// Label set of a peer's Raft reply that was refused.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplyLabel {
    /// `AppendEntries`, `Vote`, `InstallSnapshot`.
    pub method: String,
    /// `out_of_range`, `inconsistent`, `undecodable`.
    pub reason: String,
}

/// Label set naming a listener.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabel {
    /// `grpc`, `raft`, `http`.
    pub listener: String,
}

/// Label set of a cluster's agent.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AgentLabel {
    /// Cluster name.
    pub cluster: String,
    /// The agent's version, as it said.
    pub version: String,
    /// The newest feature level its build supports.
    pub feature_level: String,
}

/// Label set of a certificate this process holds.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertLabel {
    /// `served` (presented to clients) or `client` (presented to servers).
    pub r#use: String,
    /// Its kvota identity (`spiffe://...`), or its first name when it names none.
    pub identity: String,
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
    term: FGauge,
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
    view: ViewGauges,
    certificates: Family<CertLabel, Gauge>,
    denied: Family<DeniedLabel, Counter>,
    refused: Family<RefusedLabel, Counter>,
    tls_reloads: Family<ReloadLabel, Counter>,
    disk_free_bytes: Gauge,
    disk_low: Gauge,
    fatal: Gauge,
    replies_refused: Family<ReplyLabel, Counter>,
    stalled: Gauge,
    open_files_limit: Gauge,
    max_connections: Family<ListenerLabel, Gauge>,
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
        let m = Metrics {
            registry: Arc::new(Registry::default()),
            rendering: Arc::default(),
            // 100 µs .. ~3 s: a commit on loopback is ~1 ms; seconds mean trouble.
            apply_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 16)),
            reports: Default::default(),
            role: Default::default(),
            term: Default::default(),
            last_log_index: Default::default(),
            last_applied_index: Default::default(),
            leader_id: Default::default(),
            has_leader: Default::default(),
            entitlement: Default::default(),
            target: Default::default(),
            inuse: Default::default(),
            pending: Default::default(),
            guarantee: Default::default(),
            decayed: Default::default(),
            drift: Default::default(),
            score: Default::default(),
            federation_score: Default::default(),
            violation: Default::default(),
            starved: Default::default(),
            capacity: Default::default(),
            clusters: Default::default(),
            cluster_capacity: Default::default(),
            cluster_inuse: Default::default(),
            cluster_report_age: Default::default(),
            cluster_unreachable: Default::default(),
            view: ViewGauges::register(&mut r),
            certificates: Default::default(),
            denied: Default::default(),
            refused: Default::default(),
            tls_reloads: Default::default(),
            disk_free_bytes: Default::default(),
            disk_low: Default::default(),
            fatal: Default::default(),
            replies_refused: Default::default(),
            stalled: Default::default(),
            open_files_limit: Default::default(),
            max_connections: Default::default(),
        };
        m.register_raft(&mut r);
        m.register_tenants(&mut r);
        m.register_clusters(&mut r);
        m.register_process(&mut r);
        Metrics {
            registry: Arc::new(r),
            ..m
        }
    }

    /// The node's Raft state and its commits.
    fn register_raft(&self, r: &mut Registry) {
        r.register(
            "apply_duration_seconds",
            "Time from proposing a command to its answer from the state machine",
            self.apply_seconds.clone(),
        );
        r.register("reports", "Usage reports received, by outcome", self.reports.clone());
        r.register("raft_role", "1 for this node's current Raft role", self.role.clone());
        r.register("raft_term", "Current Raft term", self.term.clone());
        r.register(
            "raft_last_log_index",
            "Index of the last log entry",
            self.last_log_index.clone(),
        );
        r.register(
            "raft_last_applied_index",
            "Index of the last applied entry",
            self.last_applied_index.clone(),
        );
        r.register(
            "raft_leader_id",
            "Id of the known leader (0: none)",
            self.leader_id.clone(),
        );
        r.register(
            "raft_has_leader",
            "1 while this node knows a leader",
            self.has_leader.clone(),
        );
        r.register(
            "raft_fatal",
            "1 once the Raft core has stopped (the process exits)",
            self.fatal.clone(),
        );
        r.register(
            "raft_replies_refused",
            "Peers' Raft replies refused because they do not answer the request sent, by method and reason",
            self.replies_refused.clone(),
        );
        r.register(
            "raft_stalled",
            "1 while this node refuses log entries from its leader that it cannot read (it is not ready)",
            self.stalled.clone(),
        );
        r.register(
            "open_files_limit",
            "The process's soft limit on open files (0: unlimited), which the connection limits stay below",
            self.open_files_limit.clone(),
        );
        r.register(
            "listener_max_connections",
            "Connections each listener accepts at once",
            self.max_connections.clone(),
        );
    }

    /// Per tenant, from the replicated state.
    fn register_tenants(&self, r: &mut Registry) {
        r.register(
            "tenant_entitlement_gpus",
            "Committed entitlement per tenant (budgets are cut from it), GPU-equivalents",
            self.entitlement.clone(),
        );
        r.register(
            "tenant_target_gpus",
            "Target entitlement per tenant from the fairness model, GPU-equivalents",
            self.target.clone(),
        );
        r.register(
            "tenant_inuse_gpus",
            "Reported in-use (bound plus reserved) per tenant, GPU-equivalents",
            self.inuse.clone(),
        );
        r.register(
            "tenant_pending_gpus",
            "Reported waiting demand per tenant (queued or recently denied), GPU-equivalents",
            self.pending.clone(),
        );
        r.register(
            "tenant_guarantee_gpus",
            "What the tenant is guaranteed now: its minShare of capacity, up to its reported demand (in use plus waiting), GPU-equivalents",
            self.guarantee.clone(),
        );
        r.register(
            "tenant_decayed_usage_gpu_seconds",
            "Decayed usage per tenant (the fairness model's input), GPU-equivalent seconds",
            self.decayed.clone(),
        );
        r.register(
            "tenant_drift_ratio",
            "In-use share minus entitled share per tenant, as a fraction of capacity (-1 to 1)",
            self.drift.clone(),
        );
        r.register(
            "tenant_fairness_score",
            "Fairness score per tenant: 1 while its in-use share is near its entitled share, falling to 0",
            self.score.clone(),
        );
        r.register(
            "fairness_score",
            "The lowest tenant fairness score (1 with no tenants)",
            self.federation_score.clone(),
        );
        r.register(
            "tenant_share_violation_seconds",
            "Federation time a tenant held more than its entitlement (in use above entitled), seconds",
            self.violation.clone(),
        );
        r.register(
            "tenant_starved_seconds",
            "Federation time a tenant held less than its guarantee while it asked for more (in use below min(min share, in use + waiting)), seconds",
            self.starved.clone(),
        );
    }

    /// Per member cluster, from the replicated state.
    fn register_clusters(&self, r: &mut Registry) {
        r.register(
            "federation_capacity_gpus",
            "Federation capacity, GPU-equivalents",
            self.capacity.clone(),
        );
        r.register("clusters", "Registered member clusters", self.clusters.clone());
        r.register(
            "cluster_capacity_gpus",
            "Capacity per member cluster, GPU-equivalents",
            self.cluster_capacity.clone(),
        );
        r.register(
            "cluster_inuse_gpus",
            "Reported in-use per member cluster (all tenants), GPU-equivalents",
            self.cluster_inuse.clone(),
        );
        r.register(
            "cluster_report_age_seconds",
            "Since the cluster's last applied report, on the federation's clock (absent before its first)",
            self.cluster_report_age.clone(),
        );
        r.register(
            "cluster_unreachable",
            "1 while every lease of the cluster has expired: it enforces its safe budgets until it calls again",
            self.cluster_unreachable.clone(),
        );
    }

    /// The process: its build, refusals, certificates, disk.
    fn register_process(&self, r: &mut Registry) {
        let build = Family::<BuildLabel, Gauge>::default();
        build
            .get_or_create(&BuildLabel {
                version: env!("CARGO_PKG_VERSION").to_string(),
                feature_level_max: crate::feature::FeatureLevel::NEWEST.to_string(),
            })
            .set(1);
        r.register(
            "build_info",
            "1, labelled with this build's version and the newest feature level it supports",
            build,
        );
        r.register(
            "certificate_expiry_timestamp_seconds",
            "When each certificate this process presents expires (Unix seconds), by use (served, client) and identity",
            self.certificates.clone(),
        );
        r.register(
            "auth_denied",
            "Calls refused by authentication or authorization, by service, method and reason",
            self.denied.clone(),
        );
        r.register(
            "connections_refused",
            "Connections closed before carrying a request, by listener and reason",
            self.refused.clone(),
        );
        r.register(
            "tls_reloads",
            "Reloads of this node's certificate, key and CA bundle from disk, by outcome",
            self.tls_reloads.clone(),
        );
        r.register(
            "disk_free_bytes",
            "Free bytes on the data directory's file system",
            self.disk_free_bytes.clone(),
        );
        r.register(
            "disk_low",
            "1 while the data directory's file system is below its free-space reserve",
            self.disk_low.clone(),
        );
    }

    /// Adds federation time a tenant spent above its entitlement and below its guarantee
    /// (see [`crate::view::ShareTimes`]).
    pub fn add_share_time(&self, tenant: &str, violation_seconds: f64, starved_seconds: f64) {
        let l = TenantLabel {
            tenant: tenant.to_string(),
        };
        self.violation.get_or_create(&l).inc_by(violation_seconds);
        self.starved.get_or_create(&l).inc_by(starved_seconds);
    }

    /// Counts a refused call.
    pub fn denied(&self, service: &str, method: &str, reason: &str) {
        self.denied
            .get_or_create(&DeniedLabel {
                service: service.to_string(),
                method: method.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a refused connection.
    pub fn refused(&self, listener: &str, reason: &str) {
        self.refused
            .get_or_create(&RefusedLabel {
                listener: listener.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a reload of the TLS files.
    pub fn tls_reload(&self, ok: bool) {
        self.tls_reloads
            .get_or_create(&ReloadLabel {
                state: if ok { "ok" } else { "error" }.to_string(),
            })
            .inc();
    }

    /// The data directory's free space, and whether it is below the reserve.
    pub fn disk(&self, free_bytes: u64, low: bool) {
        self.disk_free_bytes.set(i64::try_from(free_bytes).unwrap_or(i64::MAX));
        self.disk_low.set(i64::from(low));
    }

    /// A certificate this node presents: its use (`served`, `client`), whom it names,
    /// and when it expires (Unix seconds).
    pub fn certificate(&self, r#use: &str, identity: &str, not_after_unix: i64) {
        self.certificates
            .get_or_create(&CertLabel {
                r#use: r#use.to_string(),
                identity: identity.to_string(),
            })
            .set(not_after_unix);
    }

    /// The Raft core stopped.
    pub fn set_fatal(&self) {
        self.fatal.set(1);
    }

    /// Counts a peer's Raft reply that was refused.
    pub fn reply_refused(&self, method: &str, reason: &str) {
        self.replies_refused
            .get_or_create(&ReplyLabel {
                method: method.to_string(),
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Whether the node refuses its leader's entries it cannot read.
    pub fn set_stalled(&self, stalled: bool) {
        self.stalled.set(i64::from(stalled));
    }

    /// The open-files limit and each listener's connection limit.
    pub fn connection_limits(&self, open_files: Option<u64>, listeners: &[(&str, usize)]) {
        self.open_files_limit
            .set(open_files.map_or(0, |n| i64::try_from(n).unwrap_or(i64::MAX)));
        for (name, max) in listeners {
            self.max_connections
                .get_or_create(&ListenerLabel {
                    listener: (*name).to_string(),
                })
                .set(i64::try_from(*max).unwrap_or(i64::MAX));
        }
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
        // As a float: precise to 2^53, in magnitude beyond.
        #[allow(clippy::cast_precision_loss)]
        self.term.set(raft.current_term as f64);
        self.last_log_index.set(g(raft.last_log_index.unwrap_or(0)));
        self.last_applied_index.set(g(raft.last_applied.map_or(0, |l| l.index)));
        self.leader_id.set(g(raft.current_leader.unwrap_or(0)));
        self.has_leader.set(i64::from(raft.current_leader.is_some()));
        let view = crate::view::FederationView::summary(fed);
        self.capacity.set(view.capacity_gpus);
        self.clusters.set(g(fed.clusters().len() as u64));
        for family in [
            &self.entitlement,
            &self.target,
            &self.inuse,
            &self.pending,
            &self.guarantee,
            &self.decayed,
            &self.drift,
            &self.score,
        ] {
            family.clear();
        }
        for t in &view.tenants {
            let l = TenantLabel {
                tenant: t.tenant.clone(),
            };
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
            let l = ClusterLabel {
                cluster: c.cluster.clone(),
            };
            self.cluster_capacity.get_or_create(&l).set(c.capacity_gpus);
            self.cluster_inuse.get_or_create(&l).set(c.inuse_gpus);
            if let Some(age) = c.report_age_seconds {
                self.cluster_report_age.get_or_create(&l).set(age);
            }
            self.cluster_unreachable
                .get_or_create(&l)
                .set(i64::from(c.lease == crate::view::LeaseState::Fallback));
        }
        self.view.set(&view, fed);
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// The series of the operator view (feature level 6): what runs against what is
/// admitted, and which policy revision each cluster enforces.
#[derive(Clone, Debug, Default)]
struct ViewGauges {
    running: Family<TenantLabel, FGauge>,
    admitted: Family<TenantLabel, FGauge>,
    federation_running: FGauge,
    utilization: FGauge,
    cluster_running: Family<ClusterLabel, FGauge>,
    cluster_admitted: Family<ClusterLabel, FGauge>,
    policy_revision: Gauge,
    cluster_revision: Family<ClusterLabel, Gauge>,
    cluster_lag: Family<ClusterLabel, FGauge>,
    cluster_interval: Family<ClusterLabel, FGauge>,
    agent: Family<AgentLabel, Gauge>,
}

impl ViewGauges {
    fn register(r: &mut Registry) -> ViewGauges {
        let g = ViewGauges::default();
        r.register(
            "tenant_running_gpus",
            "Of a tenant's in-use, running: on a node, as the agents report (all of it from agents that do not say), GPU-equivalents",
            g.running.clone(),
        );
        r.register(
            "tenant_admitted_gpus",
            "Of a tenant's in-use, admitted and not yet running (reservations, pods not yet bound), GPU-equivalents",
            g.admitted.clone(),
        );
        r.register(
            "federation_running_gpus",
            "GPU-equivalents running over every cluster",
            g.federation_running.clone(),
        );
        r.register(
            "federation_utilization_ratio",
            "Running GPU-equivalents over capacity (0 to 1)",
            g.utilization.clone(),
        );
        r.register(
            "cluster_running_gpus",
            "GPU-equivalents running per member cluster",
            g.cluster_running.clone(),
        );
        r.register(
            "cluster_admitted_gpus",
            "GPU-equivalents admitted and not yet running per member cluster",
            g.cluster_admitted.clone(),
        );
        r.register(
            "policy_revision",
            "The revision of the policy in force (0 below feature level 6)",
            g.policy_revision.clone(),
        );
        r.register(
            "cluster_policy_revision",
            "The policy revision each cluster's agent enforces, as it last reported",
            g.cluster_revision.clone(),
        );
        r.register(
            "cluster_policy_lag_seconds",
            "How long a cluster's agent has enforced an older policy revision than the one in force (0: current), seconds",
            g.cluster_lag.clone(),
        );
        r.register(
            "cluster_report_interval_seconds",
            "How often each cluster's agent reports, as it said, seconds",
            g.cluster_interval.clone(),
        );
        r.register(
            "cluster_agent",
            "1 per member cluster, labelled with its agent's version and the newest feature level its build supports",
            g.agent.clone(),
        );
        g
    }

    fn set(&self, view: &crate::view::FederationView, fed: &Federation) {
        for family in [&self.running, &self.admitted] {
            family.clear();
        }
        for t in &view.tenants {
            let l = TenantLabel {
                tenant: t.tenant.clone(),
            };
            self.running.get_or_create(&l).set(t.running_gpus);
            self.admitted.get_or_create(&l).set(t.admitted_gpus);
        }
        self.federation_running.set(view.running_gpus);
        self.utilization.set(view.utilization);
        let (revision, since_ms) = fed.policy_revision();
        self.policy_revision.set(i64::try_from(revision).unwrap_or(i64::MAX));
        for family in [
            &self.cluster_running,
            &self.cluster_admitted,
            &self.cluster_lag,
            &self.cluster_interval,
        ] {
            family.clear();
        }
        self.cluster_revision.clear();
        self.agent.clear();
        for c in &view.clusters {
            let l = ClusterLabel {
                cluster: c.cluster.clone(),
            };
            self.cluster_running.get_or_create(&l).set(c.running_gpus);
            self.cluster_admitted.get_or_create(&l).set(c.admitted_gpus);
            let (Some(rev), Some(version), Some(level), Some(every)) = (
                c.policy_revision,
                c.agent_version.as_ref(),
                c.agent_feature_level,
                c.report_interval_seconds,
            ) else {
                continue;
            };
            self.cluster_revision
                .get_or_create(&l)
                .set(i64::try_from(rev).unwrap_or(i64::MAX));
            let lag_ms = if rev < revision {
                view.state_time_ms.saturating_sub(since_ms)
            } else {
                0
            };
            self.cluster_lag.get_or_create(&l).set(lag_ms as f64 / 1000.0);
            self.cluster_interval.get_or_create(&l).set(every);
            self.agent
                .get_or_create(&AgentLabel {
                    cluster: c.cluster.clone(),
                    version: version.clone(),
                    feature_level: level.to_string(),
                })
                .set(1);
        }
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
