//! Prometheus metrics of an agent (prefix `kvota_agent`): admissions by tenant and
//! outcome, admission latency, admission waits per tenant, gate queue depth, lease state
//! and time to expiry, lending and borrowed GPUs, failed policy fetches, journal backlog
//! and last written report, usage reported per tenant, budgets and in-use per tenant,
//! certificate reloads, reclaim evictions. In Prometheus conventions: GPU-equivalents as
//! floats (`_gpus`), time in `_seconds`. docs/metrics.md lists every series.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use kvota_fairness::lease::LeaseStatus;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::review::Outcome;

use crate::agent::Agent;

/// A gauge of a float (GPU-equivalents, seconds).
type FGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

/// A histogram per tenant, with the buckets of [`wait_histogram`].
type WaitFamily = Family<TenantLabel, Histogram, fn() -> Histogram>;

/// Admission waits: 1 s to about 9 hours (a pod denied until a report round, a queue
/// drained by the next lease, a tenant held back for hours).
fn wait_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 16))
}

/// Label set of `kvota_agent_build_info`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabel {
    /// The kvota version.
    pub version: String,
}

/// Tenant and outcome of an admission.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct AdmissionLabel {
    /// Tenant (`-` for pods no tenant owns).
    pub tenant: String,
    /// `allowed`, `denied`, `queued`, `passed`, `error`, `busy`.
    pub outcome: String,
}

/// A tenant.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabel {
    /// Tenant name.
    pub tenant: String,
}

/// A lease state or an outcome.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    /// `none`, `fresh`, `expiring`, `safe`; or `ok`/`error` for reloads.
    pub state: String,
}

/// A certificate the agent presents.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CertLabel {
    /// `served` (the webhook's, to the API server) or `client` (the cluster's, to the
    /// control plane).
    pub r#use: String,
    /// Its kvota identity, or the names it carries.
    pub identity: String,
}

/// A reason (refused calls and connections) or a map (shed entries).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// `not_apiserver`, `not_viewer`; a connection refusal (`kvota_tls::Refusal`); or
    /// `denied`, `reservations`, `queue` for shed entries.
    pub reason: String,
}

/// The review outcomes (the `outcome` label of admissions), in the order of
/// [`AdmissionCounters`].
const OUTCOMES: [Outcome; 7] = Outcome::ALL;

/// The admissions counters created so far, by tenant then outcome: a review finds its
/// counter with a lookup by `&str`, without building a label (two Strings) and hashing
/// it. As bounded as the family itself: one entry per tenant the policy names, and `-`.
type AdmissionCounters = Arc<RwLock<HashMap<String, [Option<Counter>; OUTCOMES.len()]>>>;

/// The agent's metrics. Cloning shares them.
#[derive(Clone, Debug)]
pub struct AgentMetrics {
    registry: Arc<Registry>,
    admissions: Family<AdmissionLabel, Counter>,
    admission_counters: AdmissionCounters,
    latency: Histogram,
    queue: Family<TenantLabel, Gauge>,
    waits: WaitFamily,
    budget: Family<TenantLabel, FGauge>,
    inuse: Family<TenantLabel, FGauge>,
    lease_state: Family<StateLabel, Gauge>,
    lease_remaining: FGauge,
    lease_epoch: Gauge,
    lending: Gauge,
    borrowed: Family<TenantLabel, FGauge>,
    backlog: Gauge,
    last_seq: Gauge,
    state_save_failures: Gauge,
    policy_fetch_failures: Gauge,
    reported_usage: Family<TenantLabel, Counter<f64, std::sync::atomic::AtomicU64>>,
    tls_reloads: Family<StateLabel, Counter>,
    certificates: Family<CertLabel, Gauge>,
    evictions: Family<AdmissionLabel, Counter>,
    denied_calls: Family<ReasonLabel, Counter>,
    refused_connections: Family<ReasonLabel, Counter>,
    shed: Family<ReasonLabel, Counter>,
    holds: Family<ReasonLabel, Counter>,
    open_files_limit: Gauge,
    webhook_max_connections: Gauge,
    /// Tenants the per-tenant gauges were last set for: one a new policy drops has its
    /// series removed, not left at its last value.
    shown: Arc<std::sync::Mutex<Vec<kvota_fairness::names::TenantName>>>,
}

impl Default for AgentMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl AgentMetrics {
    /// Registers everything.
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("kvota_agent");
        let m = AgentMetrics {
            registry: Arc::new(Registry::default()),
            admissions: Family::default(),
            admission_counters: AdmissionCounters::default(),
            // 10 µs .. ~160 ms: a decision is microseconds; milliseconds mean contention.
            latency: Histogram::new(exponential_buckets(0.000_01, 2.0, 15)),
            queue: Family::default(),
            waits: WaitFamily::new_with_constructor(wait_histogram),
            budget: Family::default(),
            inuse: Family::default(),
            lease_state: Family::default(),
            lease_remaining: FGauge::default(),
            lease_epoch: Gauge::default(),
            lending: Gauge::default(),
            borrowed: Family::default(),
            backlog: Gauge::default(),
            last_seq: Gauge::default(),
            state_save_failures: Gauge::default(),
            policy_fetch_failures: Gauge::default(),
            reported_usage: Family::default(),
            tls_reloads: Family::default(),
            certificates: Family::default(),
            evictions: Family::default(),
            denied_calls: Family::default(),
            refused_connections: Family::default(),
            shed: Family::default(),
            holds: Family::default(),
            open_files_limit: Gauge::default(),
            webhook_max_connections: Gauge::default(),
            shown: Arc::default(),
        };
        m.register_admission(&mut r);
        m.register_lease(&mut r);
        m.register_reports(&mut r);
        m.register_security(&mut r);
        let build = Family::<BuildLabel, Gauge>::default();
        build
            .get_or_create(&BuildLabel {
                version: env!("CARGO_PKG_VERSION").to_string(),
            })
            .set(1);
        r.register("build_info", "1, labelled with this build's version", build);
        AgentMetrics {
            registry: Arc::new(r),
            ..m
        }
    }

    /// Admissions: outcomes, latency, queues, waits, budgets and use per tenant.
    fn register_admission(&self, r: &mut Registry) {
        r.register(
            "admissions",
            "Admission reviews answered, by tenant and outcome",
            self.admissions.clone(),
        );
        r.register(
            "admission_duration_seconds",
            "Time to judge one review (parse, decide, record)",
            self.latency.clone(),
        );
        r.register(
            "queue_depth",
            "Pods waiting behind the scheduling gate, per tenant",
            self.queue.clone(),
        );
        r.register(
            "admission_wait_seconds",
            "Per tenant, how long pods that were denied or queued first waited until admitted (from the first denial or the queueing); pods admitted at once are not counted here",
            self.waits.clone(),
        );
        r.register(
            "budget_gpus",
            "Budget enforced now per tenant (the lease's, or the safe one), GPU-equivalents",
            self.budget.clone(),
        );
        r.register(
            "inuse_gpus",
            "Bound plus reserved per tenant, GPU-equivalents",
            self.inuse.clone(),
        );
    }

    /// The lease: its state, time left, epoch, lending and borrowing.
    fn register_lease(&self, r: &mut Registry) {
        r.register(
            "lease_state",
            "1 for the lease's current state (none, fresh, expiring, safe)",
            self.lease_state.clone(),
        );
        r.register(
            "lease_remaining_seconds",
            "Until the held lease stops being enforced (0: expired or none)",
            self.lease_remaining.clone(),
        );
        r.register("lease_epoch", "Epoch of the held lease", self.lease_epoch.clone());
        r.register(
            "lending",
            "1 while this agent lends idle GPUs to preemptible tenants over their budgets (the policy's spec.reclaim.lendIdle and lendWhen at the lease's current state), else 0",
            self.lending.clone(),
        );
        r.register(
            "borrowed_gpus",
            "Per tenant, GPU-equivalents held by pods this agent admitted on borrowed (lent) GPUs: the first victims of reclaim",
            self.borrowed.clone(),
        );
    }

    /// Usage reports, state saves and policy fetches.
    fn register_reports(&self, r: &mut Registry) {
        r.register(
            "journal_backlog",
            "Usage reports written but not acknowledged by the control plane",
            self.backlog.clone(),
        );
        r.register(
            "state_save_failures",
            "Consecutive report rounds whose enforcement state could not be kept in the cluster (kvota-agent-state); while above 0 no newer lease is acknowledged, so the control plane cannot lower budgets elsewhere",
            self.state_save_failures.clone(),
        );
        r.register(
            "policy_fetch_failures",
            "Policy fetches in a row that failed (the control plane unreachable, or its policy uses a field this build does not know); the last policy loaded stays in force",
            self.policy_fetch_failures.clone(),
        );
        r.register(
            "journal_last_seq",
            "Sequence number of the last usage report written (the control plane's last_seq once the backlog is 0)",
            self.last_seq.clone(),
        );
        r.register(
            "reported_usage_gpu_seconds",
            "Usage written into reports since the agent started, per tenant, GPU-equivalent seconds (the ledger's undecayed input)",
            self.reported_usage.clone(),
        );
    }

    /// Certificates, refused calls and connections, shedding, evictions and holds.
    fn register_security(&self, r: &mut Registry) {
        r.register(
            "tls_reloads",
            "Certificate reloads, by outcome",
            self.tls_reloads.clone(),
        );
        r.register(
            "certificate_expiry_timestamp_seconds",
            "When each certificate the agent presents expires (Unix seconds), by use (served, client) and identity",
            self.certificates.clone(),
        );
        r.register(
            "evictions",
            "Reclaim eviction attempts by victim tenant and outcome (evicted, blocked by a PodDisruptionBudget)",
            self.evictions.clone(),
        );
        r.register(
            "calls_refused",
            "Webhook calls refused for the caller's certificate, by reason",
            self.denied_calls.clone(),
        );
        r.register(
            "connections_refused",
            "Webhook connections closed before a request, by reason (limits, timeouts, handshakes)",
            self.refused_connections.clone(),
        );
        r.register(
            "shed",
            "Admission entries dropped or refused because a bounded map was full, by map",
            self.shed.clone(),
        );
        r.register(
            "admission_holds",
            "First denials for lack of budget held for the report round they triggered, by how the hold ended (admitted, denied, timeout, full, other)",
            self.holds.clone(),
        );
        r.register(
            "open_files_limit",
            "The process's soft limit on open files (0: unlimited), which the webhook's connection limit stays below",
            self.open_files_limit.clone(),
        );
        r.register(
            "webhook_max_connections",
            "Connections the webhook accepts at once",
            self.webhook_max_connections.clone(),
        );
    }

    /// Counts one review.
    pub fn admission(&self, tenant: Option<&str>, outcome: Outcome, seconds: f64) {
        let tenant = tenant.unwrap_or("-");
        let label = || AdmissionLabel {
            tenant: tenant.to_string(),
            outcome: outcome.as_str().to_string(),
        };
        match OUTCOMES.iter().position(|o| *o == outcome) {
            Some(i) => {
                let counters = self.admission_counters.read().unwrap_or_else(PoisonError::into_inner);
                if let Some(counter) = counters.get(tenant).and_then(|c| c[i].as_ref()) {
                    counter.inc();
                } else {
                    drop(counters);
                    let counter = self.admissions.get_or_create(&label()).clone();
                    counter.inc();
                    let mut counters = self.admission_counters.write().unwrap_or_else(PoisonError::into_inner);
                    counters.entry(tenant.to_string()).or_default()[i] = Some(counter);
                }
            }
            None => {
                self.admissions.get_or_create(&label()).inc();
            }
        }
        self.latency.observe(seconds);
    }

    /// The open-files limit and the webhook's connection limit.
    pub fn connection_limits(&self, open_files: Option<u64>, webhook: usize) {
        self.open_files_limit
            .set(open_files.map_or(0, |n| i64::try_from(n).unwrap_or(i64::MAX)));
        self.webhook_max_connections
            .set(i64::try_from(webhook).unwrap_or(i64::MAX));
    }

    /// Exports when the certificate `source` holds expires, as used for `use` (`served`,
    /// `client`); called at start and after each reload.
    pub fn certificate(&self, r#use: &str, source: &kvota_tls::TlsSource) {
        let loaded = source.current();
        let identity = match &loaded.identity {
            Some(id) => id.to_string(),
            None => loaded
                .certified
                .cert
                .first()
                .and_then(|c| kvota_tls::material::describe(c).ok())
                .map(|n| n.sans.join(","))
                .unwrap_or_default(),
        };
        self.certificates
            .get_or_create(&CertLabel {
                r#use: r#use.to_string(),
                identity,
            })
            .set(loaded.not_after_unix);
    }

    /// Counts a certificate reload.
    pub fn tls_reload(&self, ok: bool) {
        self.tls_reloads
            .get_or_create(&StateLabel {
                state: if ok { "ok" } else { "error" }.to_string(),
            })
            .inc();
    }

    /// Counts a webhook call refused for its caller.
    pub fn denied(&self, reason: &str) {
        self.denied_calls
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Counts a held review by its result: `admitted` (judged again after the report round
    /// and allowed), `denied` (judged again, still over budget), `timeout` (no report
    /// round completed in time), `full` (too many reviews held already; not held), `other`
    /// (judged again into another answer: the agent stood down, or its books were full).
    pub fn admission_hold(&self, result: &str) {
        self.holds
            .get_or_create(&ReasonLabel {
                reason: result.to_string(),
            })
            .inc();
    }

    /// Counts a webhook connection refused.
    pub fn connection_refused(&self, reason: &str) {
        self.refused_connections
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    /// Brings the gauges up to date from the agent and renders the text format.
    pub fn render(&self, agent: &Agent) -> String {
        {
            let mut st = agent.state();
            for (tenant, waited_ms) in st.take_waits() {
                self.waits
                    .get_or_create(&TenantLabel {
                        tenant: tenant.into_string(),
                    })
                    .observe(waited_ms as f64 / 1000.0);
            }
            let now = st.now_ms();
            let status = st.lease.status(now);
            for s in ["none", "fresh", "expiring", "safe"] {
                let on = match (s, status) {
                    ("none", LeaseStatus::None)
                    | ("fresh", LeaseStatus::Fresh { .. })
                    | ("expiring", LeaseStatus::Expiring { .. })
                    | ("safe", LeaseStatus::Safe) => 1,
                    _ => 0,
                };
                self.lease_state
                    .get_or_create(&StateLabel { state: s.to_string() })
                    .set(on);
            }
            let remaining = match status {
                LeaseStatus::Fresh { remaining_ms } | LeaseStatus::Expiring { remaining_ms } => remaining_ms,
                _ => 0,
            };
            self.lease_remaining.set(remaining as f64 / 1000.0);
            self.lease_epoch
                .set(i64::try_from(st.lease.held_epoch()).unwrap_or(i64::MAX));
            self.lending.set(i64::from(st.lends_now()));
            let tenants = st.tenants();
            {
                let mut shown = self.shown.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                for gone in shown.iter().filter(|t| !tenants.contains(t)) {
                    let l = TenantLabel {
                        tenant: gone.to_string(),
                    };
                    self.queue.remove(&l);
                    self.budget.remove(&l);
                    self.inuse.remove(&l);
                    self.borrowed.remove(&l);
                }
                shown.clone_from(&tenants);
            }
            for t in tenants {
                let l = TenantLabel { tenant: t.to_string() };
                self.queue
                    .get_or_create(&l)
                    .set(i64::try_from(st.queued(&t)).unwrap_or(i64::MAX));
                self.budget
                    .get_or_create(&l)
                    .set(st.lease.budget(&t, now) as f64 / 1000.0);
                self.inuse.get_or_create(&l).set(st.inuse(&t) as f64 / 1000.0);
                self.borrowed
                    .get_or_create(&l)
                    .set(st.borrowed_gpue(&t) as f64 / 1000.0);
            }
            for (map, n) in st.shed_counts() {
                let c = self.shed.get_or_create(&ReasonLabel {
                    reason: (*map).to_string(),
                });
                c.inc_by(n.saturating_sub(c.get()));
            }
            for ((tenant, outcome), n) in st.eviction_counts() {
                let c = self.evictions.get_or_create(&AdmissionLabel {
                    tenant: tenant.to_string(),
                    outcome: outcome.to_string(),
                });
                c.inc_by(n.saturating_sub(c.get()));
            }
        }
        self.backlog.set(i64::try_from(agent.backlog()).unwrap_or(i64::MAX));
        self.last_seq.set(i64::try_from(agent.last_seq()).unwrap_or(i64::MAX));
        self.state_save_failures
            .set(i64::try_from(agent.state_save_failures()).unwrap_or(i64::MAX));
        self.policy_fetch_failures
            .set(i64::try_from(agent.policy_fetch_failures()).unwrap_or(i64::MAX));
        for (tenant, used) in agent.written_usage() {
            // Written usage only grows (milli-GPUe x ms); the counter follows it.
            let c = self.reported_usage.get_or_create(&TenantLabel {
                tenant: tenant.into_string(),
            });
            let delta = used as f64 / 1e6 - c.get();
            if delta > 0.0 {
                c.inc_by(delta);
            }
        }
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each certificate the agent presents is exported with its use, whom it names and
    /// when it expires, as its files hold it.
    #[test]
    fn a_certificates_expiry_is_exported() {
        let dir = tempfile::tempdir().expect("tmp");
        let ca_pem = kvota_tls::issue::new_ca("kvota", 30).expect("ca");
        let ca = kvota_tls::issue::Ca::from_pem(&ca_pem.cert_pem, &ca_pem.key_pem).expect("ca loads");
        let issued = ca
            .issue(
                &kvota_tls::issue::Kind::Party(kvota_tls::Role::Cluster),
                "east",
                &[],
                &[],
                20,
            )
            .expect("issue");
        let (cert, key) = (dir.path().join("c.crt"), dir.path().join("c.key"));
        std::fs::write(&cert, &issued.cert_pem).expect("write");
        std::fs::write(&key, &issued.key_pem).expect("write");
        // A federation identity must chain to the CA bundle it is loaded with.
        let bundle = dir.path().join("ca.crt");
        std::fs::write(&bundle, &ca_pem.cert_pem).expect("write");
        let source = kvota_tls::TlsSource::load(kvota_tls::TlsPaths {
            ca: Some(bundle),
            cert,
            key,
        })
        .expect("load");
        let m = AgentMetrics::new();
        m.certificate("client", &source);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &m.registry).expect("encode");
        let want = format!(
            "kvota_agent_certificate_expiry_timestamp_seconds{{use=\"client\",identity=\"spiffe://kvota/cluster/east\"}} {}",
            source.current().not_after_unix
        );
        assert!(text.contains(&want), "{text}");
    }
}
