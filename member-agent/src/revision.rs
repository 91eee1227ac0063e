//! Which policy revision the agent enforces, and reacting to a newer one at once.
//!
//! From feature level 6 the control plane names the revision of the policy in force in
//! every lease answer (`ReportReply.policy_revision`, `LeaseReply.policy_revision`) and
//! in `GetPolicy`. An answer naming a newer revision than the agent's wakes the policy
//! fetch at once (instead of its next periodic round), and a fetched newer revision
//! brings the next report forward, so the control plane learns within a round trip that
//! the cluster enforces it: each report carries the agent's [`ClusterStatus`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

use kvota_fairness::federation::ClusterStatus;
use kvota_fairness::names::TenantName;
use kvota_fairness::MilliGpue;
use tokio::sync::Notify;

/// The newest feature level of the control plane this build of the agent reads (the
/// control plane's `FeatureLevel::NEWEST`; the `kvota` binary checks they agree).
pub const FEATURE_LEVEL: u32 = 8;

/// The agent's version, as it reports it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The policy revision the agent enforces and the signals a newer one raises.
#[derive(Debug, Default)]
pub struct PolicyWatch {
    /// The revision of the policy in force here (0: unknown, or none yet).
    revision: AtomicU64,
    /// The newest revision a control-plane answer named.
    seen: AtomicU64,
    /// Woken when an answer names a newer revision than the one in force: fetch now.
    fetch: Notify,
    /// Woken when a newer policy came into force: report soon.
    report: Notify,
    /// How often the agent reports (ms), as its report loop runs.
    interval_ms: AtomicU64,
}

impl PolicyWatch {
    /// A control-plane answer named `revision` as the one in force: if the agent
    /// enforces an older one, the policy fetch is woken.
    pub fn saw(&self, revision: u64) {
        if revision == 0 {
            return;
        }
        self.seen.fetch_max(revision, Ordering::SeqCst);
        if revision > self.revision.load(Ordering::SeqCst) {
            self.fetch.notify_one();
        }
    }

    /// A fetched policy of `revision` is now in force; true when it is newer than the
    /// one before (then the next report is brought forward).
    pub fn enforce(&self, revision: u64) -> bool {
        let before = self.revision.swap(revision, Ordering::SeqCst);
        let newer = revision != before;
        if newer {
            self.report.notify_one();
        }
        newer
    }

    /// The revision in force here (0: unknown).
    pub fn revision(&self) -> u64 {
        self.revision.load(Ordering::SeqCst)
    }

    /// Whether an answer named a newer revision than the one in force.
    pub fn behind(&self) -> bool {
        self.seen.load(Ordering::SeqCst) > self.revision()
    }

    /// Waits until an answer names a newer revision (at once if one did since).
    pub async fn fetch_due(&self) {
        self.fetch.notified().await;
    }

    /// Waits until a newer policy came into force (at once if one did since).
    pub async fn report_due(&self) {
        self.report.notified().await;
    }

    /// Records how often the agent reports.
    pub fn set_interval(&self, every: std::time::Duration) {
        self.interval_ms
            .store(u64::try_from(every.as_millis()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// The status a report carries: this build, the revision in force, the report
    /// interval and `running` (GPUe on a node per tenant).
    pub fn status(&self, running: BTreeMap<TenantName, MilliGpue>) -> ClusterStatus {
        ClusterStatus {
            agent_version: VERSION.to_string(),
            feature_level: FEATURE_LEVEL,
            policy_revision: self.revision(),
            report_interval_ms: self.interval_ms.load(Ordering::SeqCst),
            running,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_newer_revision_wakes_the_fetch_and_a_fetched_one_the_report() {
        let w = PolicyWatch::default();
        w.enforce(3);
        w.saw(3);
        w.saw(0);
        let quiet = tokio::time::timeout(Duration::from_millis(50), w.fetch_due()).await;
        assert!(quiet.is_err(), "the revision in force, or none named: no fetch");
        assert!(!w.behind());
        w.saw(4);
        assert!(w.behind());
        tokio::time::timeout(Duration::from_secs(1), w.fetch_due())
            .await
            .expect("a newer revision wakes the fetch");
        // The report wake from `enforce(3)` is still pending: take it.
        tokio::time::timeout(Duration::from_secs(1), w.report_due())
            .await
            .expect("first");
        assert!(w.enforce(4), "a newer revision");
        tokio::time::timeout(Duration::from_secs(1), w.report_due())
            .await
            .expect("a newer policy brings the report forward");
        assert!(!w.enforce(4), "the same revision again");
        assert!(tokio::time::timeout(Duration::from_millis(50), w.report_due())
            .await
            .is_err());
        w.set_interval(Duration::from_secs(5));
        let s = w.status([(TenantName::from_static("a"), 2_000)].into());
        assert_eq!(
            (s.policy_revision, s.report_interval_ms, s.feature_level),
            (4, 5_000, FEATURE_LEVEL)
        );
    }
}
