//! The agent's link to the control plane: register, fetch the policy, report usage
//! through the journal, adopt leases.
//!
//! Every report is journaled before it is sent and resent, unchanged and in order, until
//! acknowledged. A lease is anchored at the agent-monotonic time its request was *sent*,
//! so a late answer expires early, never late.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvota_control_plane::client::Client;
use kvota_fairness::federation::UsageReport;
use kvota_fairness::lease::{AgentLease, Lease};
use kvota_fairness::policy::Policy;
use kvota_proto::v1;
use tonic::{Code, Status};

use crate::journal::Journal;
use crate::state::AgentState;

/// Reports sent per round at most (the rest wait for the next round), so a long backlog
/// after a partition drains steadily without one huge burst.
pub const MAX_RESEND_PER_ROUND: usize = 256;

/// One member cluster's agent.
#[derive(Debug)]
pub struct Agent {
    cluster: String,
    capacity: Mutex<BTreeMap<String, u64>>,
    capacity_changed: std::sync::atomic::AtomicBool,
    renumber_on_conflict: std::sync::atomic::AtomicBool,
    state: Arc<Mutex<AgentState>>,
    journal: Journal,
    client: Client,
    start: Instant,
    written_usage: Mutex<BTreeMap<String, u64>>,
}

fn journal_err(e: crate::journal::JournalError) -> Status {
    Status::internal(e.to_string())
}

impl Agent {
    /// An agent for `cluster` with `capacity` (resource name -> quantity milli), its
    /// journal in `dir`, talking to the control plane at `endpoints`. A lease saved by a
    /// previous run is enforced at once (its fallbacks, until the control plane answers).
    pub fn open(cluster: &str, capacity: BTreeMap<String, u64>, dir: &Path, endpoints: &[String]) -> Result<Agent, Status> {
        let journal = Journal::open(dir).map_err(journal_err)?;
        let lease = match journal.load_lease().map_err(journal_err)? {
            Some(l) if l.cluster == cluster => AgentLease::restored(l),
            _ => AgentLease::new(cluster),
        };
        let weights = kvota_fairness::resources::ResourceWeights::new();
        let state = AgentState::new(cluster, weights.capacity_gpue_milli(&capacity), lease);
        Ok(Agent {
            cluster: cluster.to_string(),
            capacity: Mutex::new(capacity),
            capacity_changed: std::sync::atomic::AtomicBool::new(false),
            renumber_on_conflict: std::sync::atomic::AtomicBool::new(false),
            state: Arc::new(Mutex::new(state)),
            journal,
            client: Client::new(endpoints)?,
            start: Instant::now(),
            written_usage: Mutex::new(BTreeMap::new()),
        })
    }

    /// The agent's monotonic clock, milliseconds since it started.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The admission state, locked and brought up to the current time.
    pub fn state(&self) -> MutexGuard<'_, AgentState> {
        let mut s = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        s.set_now(self.now_ms());
        s
    }

    /// Cluster id.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    /// Capacity per resource (quantity thousandths) as last registered or reported.
    pub fn capacity(&self) -> BTreeMap<String, u64> {
        self.capacity.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// The cluster's capacity changed (the inventory saw nodes come, go or be
    /// cordoned): the next report carries it to the control plane.
    pub fn set_capacity(&self, capacity: BTreeMap<String, u64>) {
        let mut c = self.capacity.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if *c != capacity {
            tracing::info!(cluster = %self.cluster, ?capacity, "cluster capacity changed; reporting it");
            *c = capacity;
            self.capacity_changed.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Drops the usage metered so far without reporting it: a standby replica meters
    /// what it sees but only the leader reports, so a standby that becomes leader must
    /// not report what the old leader already did.
    pub fn discard_usage(&self) {
        let _ = self.state().take_usage();
    }

    /// This replica just became the cluster's leader, taking over from another whose
    /// reports used their own sequence numbers: until the control plane acknowledges one
    /// of ours, a sequence conflict renumbers our unacknowledged reports to follow the
    /// last one it applied, instead of taking them for duplicates.
    pub fn took_over(&self) {
        self.renumber_on_conflict.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Reports written but not yet acknowledged.
    pub fn backlog(&self) -> usize {
        self.journal.backlog()
    }

    /// Sequence number of the last report written to the journal (0: none yet).
    pub fn last_seq(&self) -> u64 {
        self.journal.last_seq().unwrap_or(0)
    }

    /// Usage written into reports so far, per tenant (milli-GPUe x ms).
    pub fn written_usage(&self) -> BTreeMap<String, u64> {
        self.written_usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    fn adopt(&self, lease: Option<v1::Lease>, sent_ms: u64) -> Result<(), Status> {
        let lease = lease.ok_or_else(|| Status::internal("answer carried no lease"))?;
        let lease = Lease::try_from(lease).map_err(|e| Status::internal(format!("bad lease from the control plane: {e}")))?;
        // An answer that comes later than the lease's usable life (duration - margin from
        // the send) renews nothing; give up on a silent node after two thirds of it and
        // try the next one while a renewal can still arrive in time. (Half was too short
        // for a 3 s lease over links with 200 ms of delay: slow answers timed out.)
        self.client.set_call_timeout(std::time::Duration::from_millis(lease.duration_ms.saturating_sub(lease.margin_ms) * 2 / 3));
        let mut s = self.state();
        s.lease.on_lease(lease.clone(), sent_ms);
        if s.lease.held_epoch() == lease.epoch {
            self.journal.save_lease(&lease).map_err(journal_err)?;
        }
        Ok(())
    }

    /// Registers the cluster (capacity) and adopts the answering lease.
    pub async fn register(&self) -> Result<(), Status> {
        let req = v1::RegisterRequest {
            cluster: self.cluster.clone(),
            capacity: kvota_proto::convert::resources(&self.capacity()),
            labels: Default::default(),
        };
        let sent = self.now_ms();
        let reply = self
            .client
            .call(|ch| {
                let req = req.clone();
                async move { Ok(Client::member(ch).register(req).await?.into_inner()) }
            })
            .await?;
        self.adopt(reply.lease, sent)
    }

    /// Fetches the policy in force.
    pub async fn fetch_policy(&self) -> Result<(), Status> {
        let reply = self
            .client
            .call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) })
            .await?;
        if reply.name.is_empty() {
            return Err(Status::failed_precondition("the control plane has no policy yet"));
        }
        let p: Policy = serde_json::from_str(&reply.json).map_err(|e| Status::internal(format!("decode policy: {e}")))?;
        self.state().set_policy(p);
        Ok(())
    }

    /// Writes a report of usage since the last one into the journal, then sends every
    /// unacknowledged report in order. On error the reports stay for the next round.
    pub async fn report_once(&self) -> Result<(), Status> {
        let (held, tenants, evictions) = {
            let mut s = self.state();
            (s.lease.held_epoch(), s.take_usage(), s.take_eviction_notes(kvota_fairness::federation::MAX_REPORT_EVICTIONS))
        };
        let written = self
            .journal
            .write(|seq| UsageReport {
                cluster: self.cluster.clone(),
                seq,
                held_epoch: held,
                capacity: self.capacity_changed.swap(false, std::sync::atomic::Ordering::SeqCst).then(|| self.capacity()),
                tenants,
                evictions,
            })
            .map_err(journal_err)?;
        {
            let mut w = self.written_usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for (t, r) in &written.tenants {
                *w.entry(t.clone()).or_default() += r.used_milli_gpue_ms;
            }
        }
        for report in self.journal.unacked(MAX_RESEND_PER_ROUND).map_err(journal_err)? {
            let wire = v1::ReportRequest::from(&report);
            let sent = self.now_ms();
            let result = self
                .client
                .call(|ch| {
                    let wire = wire.clone();
                    async move { Ok(Client::member(ch).report(wire).await?.into_inner()) }
                })
                .await;
            match result {
                Ok(reply) => {
                    self.adopt(reply.lease, sent)?;
                    self.journal.ack_through(report.seq).map_err(journal_err)?;
                    self.renumber_on_conflict.store(false, std::sync::atomic::Ordering::SeqCst);
                }
                Err(s) if s.code() == Code::FailedPrecondition => {
                    let expected = s
                        .metadata()
                        .get("kvota-expected-seq")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok());
                    if let Some(e) = expected.filter(|_| self.renumber_on_conflict.load(std::sync::atomic::Ordering::SeqCst)) {
                        let n = self.journal.renumber_from(e).map_err(journal_err)?;
                        tracing::info!(from = e, reports = n, "took over from another replica: reports renumbered to follow the control plane's sequence");
                        return Err(s);
                    }
                    match expected {
                        // The control plane already applied everything before `e`.
                        Some(e) if e > report.seq => self.journal.ack_through(e - 1).map_err(journal_err)?,
                        _ => return Err(s),
                    }
                }
                Err(s) if s.code() == Code::NotFound => {
                    self.register().await?;
                    return Err(s);
                }
                Err(s) => return Err(s),
            }
        }
        Ok(())
    }
}
