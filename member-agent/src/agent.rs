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

use kvota_client::client::Client;
use kvota_fairness::federation::{UsageReport, UsageWindow};
use kvota_fairness::lease::{AgentLease, Lease};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::Policy;
use kvota_proto::v1;
use tonic::{Code, Status};

use crate::journal::Journal;
use crate::state::AgentState;

/// Reports sent per round at most (the rest wait for the next round), so a long backlog
/// after a partition drains steadily without one huge burst.
pub const MAX_RESEND_PER_ROUND: usize = 256;

/// How far back a standby keeps its readings of metered usage: what it can report for
/// the time between the old leader's last applied report and its own takeover. Far
/// longer than a report interval plus a leader Lease.
pub const STANDBY_HISTORY_MS: u64 = 15 * 60 * 1_000;

/// Readings kept at most (one per report round while standing by).
const STANDBY_MARKS: usize = 4_096;

/// The wall clock in Unix milliseconds: report windows are compared across replicas.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Whether the control plane has counted `report` already, when it applied the
/// cluster's reports through sequence `last_seq` and their usage through wall-clock
/// `through_ms` (0: no report with a window yet): a window that ends by then is counted
/// (this replica's, applied, or the other replica's covering the same time); a report
/// without a window (an older version wrote it) was applied if its number was.
pub fn already_counted(report: &UsageReport, last_seq: u64, through_ms: u64) -> bool {
    match report.window {
        Some(w) => through_ms > 0 && w.end_ms <= through_ms,
        None => report.seq <= last_seq,
    }
}

/// Usage per tenant (milli-GPUe x ms) of the pods that ran in the cluster between two
/// wall-clock instants (Unix ms), from the pods' own start and finish times: how the
/// agent recovers usage no agent process metered (see [`Agent::set_history`]).
#[derive(Clone)]
pub struct History(pub Arc<dyn Fn(u64, u64) -> BTreeMap<TenantName, u64> + Send + Sync>);

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("History")
    }
}

/// A standby's reading of its usage meter.
#[derive(Clone, Debug)]
struct Mark {
    unix_ms: u64,
    used: BTreeMap<TenantName, u64>,
}

/// One member cluster's agent.
#[derive(Debug)]
pub struct Agent {
    cluster: ClusterName,
    capacity: Mutex<BTreeMap<String, u64>>,
    capacity_changed: std::sync::atomic::AtomicBool,
    renumber_on_conflict: std::sync::atomic::AtomicBool,
    state: Arc<Mutex<AgentState>>,
    journal: Journal,
    client: Client,
    start: Instant,
    written_usage: Mutex<BTreeMap<TenantName, u64>>,
    /// Wall-clock start of the usage the next report carries.
    window_start: Mutex<u64>,
    /// Readings of the usage meter while standing by (oldest first).
    marks: Mutex<std::collections::VecDeque<Mark>>,
    /// Took over; the first report must first find where the old leader's usage ends.
    takeover_pending: std::sync::atomic::AtomicBool,
    /// Where the enforcement state is kept for the next process (`crate::persist`).
    store: Mutex<Option<Arc<dyn crate::persist::StateStore>>>,
    /// This replica's name in the persisted state.
    identity: Mutex<String>,
    /// Highest report sequence acknowledged, and the end of its window (Unix ms): the
    /// cluster's usage is counted through there.
    acked: Mutex<(u64, u64)>,
    /// Pods' run times, to recover usage no process metered.
    history: Mutex<Option<History>>,
    /// The lease epoch the state store holds (`u64::MAX` without a store): reports
    /// acknowledge no newer epoch than this (see [`Agent::persist`]).
    kept_epoch: std::sync::atomic::AtomicU64,
    /// Whether `meter_start` is known (see [`Agent::set_history`]).
    meter_known: std::sync::atomic::AtomicBool,
    /// Consecutive failed saves of the enforcement state.
    save_failures: std::sync::atomic::AtomicU64,
    /// Consecutive failed policy fetches (see [`Agent::policy_fetch_failures`]).
    policy_failures: std::sync::atomic::AtomicU64,
    /// Wall-clock instant from which this process's meter counts (its first listing of
    /// the cluster's pods).
    meter_start: std::sync::atomic::AtomicU64,
    /// Report rounds that have read the admission state (numbered from 1; read and
    /// bumped under the state's lock).
    rounds_taken: std::sync::atomic::AtomicU64,
    /// The number of the latest report round that completed (its reports acknowledged
    /// and their lease adopted).
    rounds_done: tokio::sync::watch::Sender<u64>,
    /// Whether the last report round completed (reports reach the control plane).
    last_round_ok: std::sync::atomic::AtomicBool,
    /// Held while a lease is taken and written to the journal, so that two adoptions
    /// cannot leave the journal behind the lease held. Never taken by the admission
    /// path: the journal's fdatasync happens outside the state's lock.
    adopting: Mutex<()>,
    /// The lease epoch the journal holds: reports acknowledge no newer epoch than this
    /// (a process restarted from this journal must never find an older lease than the
    /// one the control plane was told it holds).
    journaled_epoch: std::sync::atomic::AtomicU64,
    /// Notes a report round took for a report the journal then refused (a full disk):
    /// the next round carries them first.
    unwritten_notes: Mutex<(Vec<kvota_fairness::federation::EvictionNote>, Vec<kvota_fairness::federation::PodDecision>)>,
}


/// How long a read or write of the kept state may take: a slow API server must not hold
/// up the report round that follows (or the start of enforcement).
pub const STATE_STORE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

fn store_timeout(store: &dyn crate::persist::StateStore) -> crate::persist::PersistError {
    crate::persist::PersistError::Store { store: store.describe(), why: format!("no answer within {STATE_STORE_TIMEOUT:?}") }
}

fn journal_err(e: crate::journal::JournalError) -> Status {
    Status::internal(e.to_string())
}

/// Marks the error of a report round that failed only because the journal refused the
/// round's own report (no space on the device, or the journal at its backlog limit),
/// after the reports it holds went out and were answered (or there were none).
const JOURNAL_REFUSED: &str = "kvota-journal-refused";

/// Whether a report round failed only because the journal refused its own report: the
/// control plane was not the problem, so the report loop does not back off (see
/// [`crate::runtime`]). Set by the agent on its own errors, never read from the wire.
pub fn journal_refused(s: &Status) -> bool {
    s.metadata().contains_key(JOURNAL_REFUSED)
}

/// `s`, marked as [`journal_refused`].
pub(crate) fn mark_journal_refused(mut s: Status) -> Status {
    s.metadata_mut().insert(JOURNAL_REFUSED, tonic::metadata::MetadataValue::from_static("1"));
    s
}

impl Agent {
    /// An agent for `cluster` with `capacity` (resource name -> quantity milli), its
    /// journal in `dir`, talking to the control plane at `endpoints`. A lease saved by a
    /// previous run is enforced at once (its fallbacks, until the control plane answers).
    pub fn open(cluster: &ClusterName, capacity: BTreeMap<String, u64>, dir: &Path, endpoints: &[String]) -> Result<Agent, Status> {
        Agent::open_with_tls(cluster, capacity, dir, endpoints, None)
    }

    /// [`Agent::open`], talking to the control plane over mutual TLS if `tls` is given.
    pub fn open_with_tls(
        cluster: &ClusterName,
        capacity: BTreeMap<String, u64>,
        dir: &Path,
        endpoints: &[String],
        tls: Option<kvota_client::tls::GrpcTls>,
    ) -> Result<Agent, Status> {
        let journal = Journal::open(dir).map_err(journal_err)?;
        let lease = match journal.load_lease().map_err(journal_err)? {
            Some(l) if l.cluster == *cluster => AgentLease::restored(l),
            _ => AgentLease::new(cluster.clone()),
        };
        let journaled_epoch = lease.held_epoch();
        let weights = kvota_fairness::resources::ResourceWeights::new();
        let state = AgentState::new(cluster.clone(), weights.capacity_gpue_milli(&capacity), lease);
        Ok(Agent {
            cluster: cluster.clone(),
            capacity: Mutex::new(capacity),
            capacity_changed: std::sync::atomic::AtomicBool::new(false),
            renumber_on_conflict: std::sync::atomic::AtomicBool::new(false),
            state: Arc::new(Mutex::new(state)),
            journal,
            client: Client::with_tls(endpoints, tls)?,
            start: Instant::now(),
            written_usage: Mutex::new(BTreeMap::new()),
            window_start: Mutex::new(unix_ms()),
            marks: Mutex::new(std::collections::VecDeque::new()),
            takeover_pending: std::sync::atomic::AtomicBool::new(false),
            store: Mutex::new(None),
            identity: Mutex::new(cluster.to_string()),
            acked: Mutex::new((0, 0)),
            history: Mutex::new(None),
            meter_start: std::sync::atomic::AtomicU64::new(unix_ms()),
            kept_epoch: std::sync::atomic::AtomicU64::new(u64::MAX),
            save_failures: std::sync::atomic::AtomicU64::new(0),
            policy_failures: std::sync::atomic::AtomicU64::new(0),
            meter_known: std::sync::atomic::AtomicBool::new(true),
            rounds_taken: std::sync::atomic::AtomicU64::new(0),
            rounds_done: tokio::sync::watch::Sender::new(0),
            last_round_ok: std::sync::atomic::AtomicBool::new(false),
            adopting: Mutex::new(()),
            unwritten_notes: Mutex::new((Vec::new(), Vec::new())),
            journaled_epoch: std::sync::atomic::AtomicU64::new(journaled_epoch),
        })
    }

    /// The number of report rounds that have read the admission state so far. Read it
    /// with the state's lock held (see [`Agent::state`]) right after a decision, and
    /// every round after the mark carries what that decision recorded.
    pub fn rounds_taken(&self) -> u64 {
        self.rounds_taken.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether the last report round completed: reports reach the control plane, so a
    /// round started now is expected to come back (false before the first round).
    pub fn reports_flow(&self) -> bool {
        self.last_round_ok.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Makes the agent believe its last report round completed (tests of the webhook's
    /// hold, which needs one, without a control plane).
    #[cfg(test)]
    pub(crate) fn pretend_reports_flow(&self) {
        self.last_round_ok.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The number of the latest report round that completed (see [`Agent::round_after`]).
    pub fn rounds_done(&self) -> u64 {
        *self.rounds_done.borrow()
    }

    /// Waits, at most `max`, until a report round numbered above `mark` completes (its
    /// lease adopted); returns whether one did.
    pub async fn round_after(&self, mark: u64, max: std::time::Duration) -> bool {
        let mut done = self.rounds_done.subscribe();
        let waited = tokio::time::timeout(max, done.wait_for(|&n| n > mark)).await;
        matches!(waited, Ok(Ok(_)))
    }

    /// Keeps the enforcement state in `store` (see [`crate::persist`]); `identity` names
    /// this replica in it.
    pub fn set_state_store(&self, store: Arc<dyn crate::persist::StateStore>, identity: &str) {
        *self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(store);
        self.kept_epoch.store(0, std::sync::atomic::Ordering::SeqCst);
        *self.identity.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = identity.to_string();
    }

    /// How to find the usage of pods that ran while no process metered them (see
    /// [`History`]).
    /// Until [`Agent::meter_started`] says where this process's meter starts, the
    /// takeover is not settled (the gap before it could not be sized).
    pub fn set_history(&self, history: History) {
        *self.history.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(history);
        self.meter_known.store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// This process's meter counts from `unix_ms` on (its first listing of the pods).
    pub fn meter_started(&self, unix_ms: u64) {
        self.meter_start.store(unix_ms, std::sync::atomic::Ordering::SeqCst);
        self.meter_known.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The state to keep for the next process, as this one sees it now.
    pub fn member_state(&self) -> crate::persist::MemberState {
        let st = self.state();
        let now = st.now_ms();
        let unix_now = unix_ms();
        let usable_until = st
            .lease
            .valid_until()
            .filter(|u| *u > now)
            .map_or(0, |u| unix_now.saturating_add(u - now));
        let (acked_seq, counted_through) = *self.acked.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        crate::persist::MemberState {
            format: crate::persist::FORMAT_VERSION,
            cluster: self.cluster.clone(),
            writer: self.identity.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone(),
            written_unix_ms: unix_now,
            policy: crate::review::AdmissionState::policy(&*st).cloned(),
            lease: st.lease.lease().cloned(),
            lease_usable_until_unix_ms: usable_until,
            acked_seq,
            counted_through_unix_ms: counted_through,
        }
    }

    /// Writes the enforcement state to the store (the leader, after each report round).
    ///
    /// A lease is acknowledged to the control plane (a report's `held_epoch`) only once
    /// the store holds it: the control plane stops counting older leases at that
    /// acknowledgement, so a next process must never restore one of them. While saving
    /// fails, reports keep acknowledging the epoch the store holds (safe: the control
    /// plane goes on counting every newer lease too).
    pub async fn persist(&self) -> Result<(), crate::persist::PersistError> {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let Some(store) = store else { return Ok(()) };
        let state = self.member_state();
        let epoch = state.lease.as_ref().map_or(0, |l| l.epoch);
        let saved = match crate::persist::encode(&state) {
            Ok(bytes) => match tokio::time::timeout(STATE_STORE_TIMEOUT, store.save(bytes)).await {
                Ok(r) => r,
                Err(_) => Err(store_timeout(&*store)),
            },
            Err(e) => Err(e),
        };
        if let Err(e) = saved {
            self.save_failures.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            return Err(e);
        }
        self.save_failures.store(0, std::sync::atomic::Ordering::SeqCst);
        self.kept_epoch.fetch_max(epoch, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// Report rounds in a row whose state could not be saved (0: the last save worked).
    pub fn state_save_failures(&self) -> u64 {
        self.save_failures.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The epoch a report acknowledges: the lease held, but no newer one than the state
    /// store holds (see [`Agent::persist`]) or the journal holds (see [`Agent::adopt`]).
    fn acknowledged_epoch(&self, held: u64) -> u64 {
        held.min(self.kept_epoch.load(std::sync::atomic::Ordering::SeqCst))
            .min(self.journaled_epoch.load(std::sync::atomic::Ordering::SeqCst))
    }

    /// The epoch the next report acknowledges, as [`Agent::acknowledged_epoch`] gives it.
    pub fn acknowledges(&self) -> u64 {
        let held = self.state().lease.held_epoch();
        self.acknowledged_epoch(held)
    }

    /// Reads the enforcement state another process of this agent kept and takes what is
    /// newer than what this one has: the policy if it has none, the lease (never an
    /// older epoch) enforceable for what is left of its life minus the margin, and how
    /// far the cluster's usage is counted. `Ok(None)`: nothing kept yet. An error (a
    /// state that does not decode, of a newer format or another cluster) changes
    /// nothing: the agent goes on with what its own journal holds.
    pub async fn restore(&self) -> Result<Option<crate::persist::MemberState>, crate::persist::PersistError> {
        let store = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let Some(store) = store else { return Ok(None) };
        let loaded = tokio::time::timeout(STATE_STORE_TIMEOUT, store.load()).await.map_err(|_| store_timeout(&*store))?;
        let Some(bytes) = loaded? else { return Ok(None) };
        let kept = crate::persist::decode(&bytes, &store.describe(), &self.cluster)?;
        let unix_now = unix_ms();
        {
            let mut st = self.state();
            if crate::review::AdmissionState::policy(&*st).is_none() {
                if let Some(p) = &kept.policy {
                    st.set_policy(p.clone());
                }
            }
        }
        if let Some(lease) = &kept.lease {
            self.kept_epoch.fetch_max(lease.epoch, std::sync::atomic::Ordering::SeqCst);
            // The other process's wall clock may run ahead of ours: take the margin
            // off again, so this one never enforces the lease longer than it could.
            // And never longer than any process could from a request sent now
            // (a clock far ahead, or an edited state, says nothing more).
            let left = kept
                .lease_usable_until_unix_ms
                .saturating_sub(unix_now)
                .saturating_sub(lease.margin_ms)
                .min(lease.duration_ms.saturating_sub(lease.margin_ms.saturating_mul(2)));
            let now = self.now_ms();
            let until = (left > 0).then(|| now.saturating_add(left));
            let taken = self.take_lease(|held| held.restore_anchored(lease.clone(), until), true);
            tracing::info!(epoch = lease.epoch, enforceable_ms = left, held = self.state().lease.held_epoch(), writer = %kept.writer, "restored the lease kept in the cluster");
            if let Err(e) = taken {
                // Enforced all the same; reports go on acknowledging the epoch the
                // journal holds until a lease is written there.
                tracing::warn!(epoch = lease.epoch, error = %e.message(), "the restored lease could not be written to the journal");
            }
        }
        let mut acked = self.acked.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        acked.0 = acked.0.max(kept.acked_seq);
        acked.1 = acked.1.max(kept.counted_through_unix_ms);
        Ok(Some(kept))
    }

    /// The agent's monotonic clock, milliseconds since it started.
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Waits until a pod is denied or queued here (at once if one was since the last
    /// call): demand the next report should carry early.
    pub async fn demand_waiting(&self) {
        let signal = self.state().demand_signal();
        signal.notified().await;
    }

    /// Waits `every` for the next report round, or less once demand is waiting (a pod
    /// denied or queued): then the round starts no sooner than `min_gap` after the last
    /// one, so a flood of denials costs at most one report per `min_gap`.
    pub async fn next_round(&self, last: tokio::time::Instant, every: std::time::Duration, min_gap: std::time::Duration) {
        let due = last + every;
        tokio::select! {
            _ = tokio::time::sleep_until(due) => {}
            _ = self.demand_waiting() => {
                tokio::time::sleep_until((last + min_gap).min(due)).await;
            }
        }
    }

    /// The admission state, locked and brought up to the current time.
    pub fn state(&self) -> MutexGuard<'_, AgentState> {
        let mut s = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        s.set_now(self.now_ms());
        s
    }

    /// Cluster id.
    pub fn cluster(&self) -> &ClusterName {
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

    /// A standby's round: it meters what it sees but only the leader reports, so it
    /// keeps a reading of its meter (the last [`STANDBY_HISTORY_MS`] of them) instead.
    /// Taking over, it reports what it metered since the reading nearest before the old
    /// leader's last applied report ended (see [`Agent::took_over`]).
    pub fn stand_by(&self) {
        let used = self.state().usage_so_far();
        let now = unix_ms();
        let mut marks = self.marks.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        while marks.len() >= STANDBY_MARKS
            || marks.front().is_some_and(|m| now.saturating_sub(m.unix_ms) > STANDBY_HISTORY_MS)
        {
            marks.pop_front();
        }
        marks.push_back(Mark { unix_ms: now, used });
    }

    /// This replica just became the cluster's leader, taking over from another.
    ///
    /// - Its reports used their own sequence numbers: until the control plane
    ///   acknowledges one of ours, a sequence conflict renumbers our unacknowledged
    ///   reports to follow the last one it applied, instead of taking them for duplicates.
    /// - Usage: the next report first asks the control plane up to when the cluster's
    ///   usage is counted, and carries what this replica metered since its reading
    ///   nearest before that (nothing between the old leader's last report and now is
    ///   lost; the control plane does not count the overlap twice).
    pub fn took_over(&self) {
        if let Some(store) = self.store.lock().unwrap_or_else(std::sync::PoisonError::into_inner).as_ref() {
            store.rearm();
        }
        self.renumber_on_conflict.store(true, std::sync::atomic::Ordering::SeqCst);
        self.takeover_pending.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Numbers this replica's unsent reports after the last one the control plane
    /// applied for the cluster (the old leader's numbers: a lower one would be taken for
    /// a duplicate and dropped, a higher one for a gap). Reports whose window the
    /// cluster's counted usage already covers are dropped instead: applied before (this
    /// replica's own, its acknowledgement lost in a crash) or covered by the other's.
    fn follow(&self, info: &v1::ClusterInfo) -> Result<(), Status> {
        let (through, last) = (info.reported_through_ms, info.last_seq);
        let (kept, dropped) = self
            .journal
            .renumber_keeping(last + 1, |r| !already_counted(r, last, through))
            .map_err(journal_err)?;
        tracing::info!(from = last + 1, reports = kept, already_counted = dropped, "took over: unsent reports numbered to follow the control plane's sequence");
        Ok(())
    }

    /// What the control plane knows of this cluster (any node's applied state).
    async fn describe(&self) -> Result<v1::ClusterInfo, Status> {
        let req = v1::DescribeClusterRequest { cluster: self.cluster.to_string() };
        self.client
            .call(|ch| {
                let req = req.clone();
                async move { Ok(Client::member(ch).describe_cluster(req).await?.into_inner()) }
            })
            .await
    }

    /// This process starts reporting for the cluster (it started, or took over from
    /// another replica): its first report first finds where the cluster's counted usage
    /// ends (see [`Agent::settle_takeover`]).
    pub fn starts_reporting(&self) {
        self.takeover_pending.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Where the cluster's usage is counted through, as far as this process knows
    /// without the control plane: its acknowledged reports, the state kept in the
    /// cluster, and the end of the last report its journal holds.
    fn counted_through_locally(&self) -> u64 {
        let acked = self.acked.lock().unwrap_or_else(std::sync::PoisonError::into_inner).1;
        let journaled = self.journal.unacked(usize::MAX).ok().and_then(|r| r.last().and_then(|r| r.window)).map_or(0, |w| w.end_ms);
        acked.max(journaled)
    }

    /// Starts this leader's usage where the cluster's counted usage ends (see
    /// [`Agent::took_over`]). Without an answer from the control plane it starts at its
    /// oldest reading: the control plane cuts what an applied report already covered.
    ///
    /// If this process began metering only after that point (it started after the old
    /// leader's last report, or every replica was down for a while), the gap is recovered
    /// from the pods' own run times ([`Agent::set_history`]): usage of every pod that
    /// ran in it, including pods that started and finished while no agent ran (as long
    /// as the cluster still lists them: a pod deleted while no agent ran is not seen).
    ///
    /// Returns false, changing nothing, while that cannot be done yet: the gap could not
    /// be sized (where this process's meter starts is not known) or its pods not mapped
    /// to tenants (no policy yet). No report may be written before (its window would
    /// overlap the gap's).
    async fn settle_takeover(&self) -> bool {
        use std::sync::atomic::Ordering;
        if !self.takeover_pending.load(Ordering::SeqCst) {
            return true;
        }
        let has_history = self.history.lock().unwrap_or_else(std::sync::PoisonError::into_inner).is_some();
        if has_history
            && (!self.meter_known.load(Ordering::SeqCst) || crate::review::AdmissionState::policy(&*self.state()).is_none())
        {
            return false;
        }
        if !self.takeover_pending.swap(false, Ordering::SeqCst) {
            return true;
        }
        let info = self.describe().await;
        if let Ok(i) = &info {
            if let Err(e) = self.follow(i) {
                tracing::warn!(error = %e, "took over: could not renumber the journal; the first answers will");
            }
        }
        let marks: Vec<Mark> = self.marks.lock().unwrap_or_else(std::sync::PoisonError::into_inner).drain(..).collect();
        let chosen = match &info {
            // Counted through `t`: the latest reading at or before it, else the oldest.
            Ok(i) if i.reported_through_ms > 0 => {
                marks.iter().rev().find(|m| m.unix_ms <= i.reported_through_ms).or(marks.first())
            }
            // Reports without windows (an older agent): what they covered is unknown, and
            // nothing would cut an overlap; count from now, as that agent did.
            Ok(i) if i.last_seq > 0 => marks.last(),
            // Never reported (everything metered is new), or no answer (the control
            // plane cuts whatever the old leader's reports covered).
            Ok(_) | Err(_) => marks.first(),
        };
        // Counted through here: by the control plane, or by this process's own reports
        // (its journal's backlog will be delivered, so only what follows it is missing).
        let local = self.counted_through_locally();
        let counted = match &info {
            Ok(i) if i.reported_through_ms > 0 => Some(i.reported_through_ms.max(local)),
            Ok(i) if i.last_seq > 0 => None,
            _ => Some(local).filter(|t| *t > 0),
        };
        let from_ms = match chosen {
            Some(mark) => {
                self.state().rebase_usage(&mark.used);
                mark.unix_ms
            }
            None => self.meter_start.load(Ordering::SeqCst),
        };
        let history = self.history.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let start = match (counted, history) {
            (Some(t), Some(h)) if t < from_ms => {
                let gap = (h.0)(t, from_ms);
                let total: u64 = gap.values().sum();
                tracing::info!(from_ms = t, to_ms = from_ms, usage_milli_gpue_ms = total, "usage no agent metered recovered from the pods' run times");
                self.state().add_usage(&gap);
                t
            }
            _ => from_ms,
        };
        *self.window_start.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = start;
        let Some(mark) = chosen else { return true };
        match info {
            Ok(i) => tracing::info!(
                counted_through_ms = i.reported_through_ms,
                from_ms = mark.unix_ms,
                "took over: reporting the usage metered while standing by since the old leader's last report"
            ),
            Err(e) => tracing::warn!(
                error = %e,
                from_ms = mark.unix_ms,
                "took over without reaching the control plane: reporting usage since the oldest reading (the control plane cuts any overlap)"
            ),
        }
        true
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
    pub fn written_usage(&self) -> BTreeMap<TenantName, u64> {
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
        self.take_lease(|l| l.on_lease(lease.clone(), sent_ms), false)
    }

    /// Takes a lease: `update` decides on a copy of the lease state; if it takes the
    /// lease, the lease is written to the journal (fdatasync) without the admission
    /// state's lock, and only then enforced. Reviews meanwhile are judged under the lease
    /// before it, never wait on the disk, and a process restarted from the journal never
    /// finds an older epoch than one this process enforced (CONTRACT.md: an agent never
    /// goes back to an older epoch). The journal's epoch is the newest a report
    /// acknowledges. `kept_elsewhere`: the lease comes from the state kept in the cluster,
    /// so it is enforced even if the journal cannot take it (each report round writes it
    /// again until the journal holds it, [`Agent::rejournal`]: a restart that cannot read
    /// the kept state must not find an older epoch for long). A renewal of an epoch the
    /// journal holds is enforced even if its write fails.
    fn take_lease(&self, update: impl Fn(&mut AgentLease) -> kvota_fairness::lease::LeaseUpdate, kept_elsewhere: bool) -> Result<(), Status> {
        use kvota_fairness::lease::LeaseUpdate;
        let _one_at_a_time = self.adopting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let before = self.state().lease.clone();
        let mut next = before.clone();
        let held = match update(&mut next) {
            LeaseUpdate::Adopted | LeaseUpdate::Renewed => next.lease().cloned(),
            LeaseUpdate::Stale | LeaseUpdate::Rejected => None,
        };
        let Some(held) = held else { return Ok(()) };
        let saved = self.journal.save_lease(&held).map_err(journal_err);
        if saved.is_ok() {
            self.journaled_epoch.store(held.epoch, std::sync::atomic::Ordering::SeqCst);
        }
        let journal_has_it = self.journaled_epoch.load(std::sync::atomic::Ordering::SeqCst) >= held.epoch;
        if saved.is_ok() || kept_elsewhere || journal_has_it {
            let mut s = self.state();
            // Only this function moves the lease, one call at a time; should anything
            // else have moved it meanwhile, the update applies to what is there now.
            if s.lease == before {
                s.lease = next;
            } else {
                update(&mut s.lease);
            }
        }
        saved
    }

    /// Registers the cluster (capacity) and adopts the answering lease.
    pub async fn register(&self) -> Result<(), Status> {
        let req = v1::RegisterRequest {
            cluster: self.cluster.to_string(),
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

    /// Fetches the policy in force. A failure (the control plane unreachable or without
    /// a policy, or a policy this build refuses) leaves the last policy loaded in force
    /// and is counted ([`Agent::policy_fetch_failures`]).
    pub async fn fetch_policy(&self) -> Result<(), Status> {
        let fetched = self.fetch_policy_once().await;
        match &fetched {
            Ok(()) => self.policy_failures.store(0, std::sync::atomic::Ordering::SeqCst),
            Err(_) => {
                self.policy_failures.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        fetched
    }

    /// Policy fetches in a row that failed (0: the last one worked, or none was tried).
    /// A policy that uses a field newer than this build keeps it above 0 until the agent
    /// is upgraded: the agent never enforces a policy it would refuse.
    pub fn policy_fetch_failures(&self) -> u64 {
        self.policy_failures.load(std::sync::atomic::Ordering::SeqCst)
    }

    async fn fetch_policy_once(&self) -> Result<(), Status> {
        let reply = self
            .client
            .call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) })
            .await?;
        if reply.name.is_empty() {
            return Err(Status::failed_precondition("the control plane has no policy yet"));
        }
        // The document is validated here as any policy is: an agent never enforces a
        // policy it would have refused.
        let p = Policy::from_yaml(&reply.yaml).map_err(|e| Status::internal(format!("the policy from the control plane does not load: {e}")))?;
        self.state().set_policy(p);
        Ok(())
    }

    /// Writes a report of usage since the last one into the journal, then sends every
    /// unacknowledged report in order. On error the reports stay for the next round.
    pub async fn report_once(&self) -> Result<(), Status> {
        use tracing::Instrument as _;
        let span = tracing::info_span!("report", cluster = %self.cluster, seq = tracing::field::Empty);
        let result = self.report_round(&span).instrument(span.clone()).await;
        self.last_round_ok.store(result.is_ok(), std::sync::atomic::Ordering::SeqCst);
        result
    }

    /// Writes the lease held to the journal if the journal holds an older epoch (a lease
    /// restored from the kept state whose write failed).
    fn rejournal(&self) {
        let _one_at_a_time = self.adopting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let held = self.state().lease.lease().cloned();
        let Some(held) = held else { return };
        if self.journaled_epoch.load(std::sync::atomic::Ordering::SeqCst) >= held.epoch {
            return;
        }
        match self.journal.save_lease(&held) {
            Ok(()) => self.journaled_epoch.store(held.epoch, std::sync::atomic::Ordering::SeqCst),
            Err(e) => tracing::warn!(epoch = held.epoch, error = %e, "the lease enforced is still not in the journal; retrying next round"),
        }
    }

    async fn report_round(&self, span: &tracing::Span) -> Result<(), Status> {
        self.rejournal();
        if !self.settle_takeover().await {
            return Err(Status::unavailable(
                "the first report waits for the agent's first listing of the cluster's pods and for the policy",
            ));
        }
        let (round, held, tenants, evictions, decisions, window) = {
            let mut s = self.state();
            let round = self.rounds_taken.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
            let end = unix_ms();
            let mut start = self.window_start.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let window = UsageWindow { start_ms: *start, end_ms: end };
            *start = end;
            // Notes a refused write left behind go first (no more than a report takes).
            let (mut evictions, mut decisions) = {
                let mut kept = self.unwritten_notes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let e = kept.0.len().min(kvota_fairness::federation::MAX_REPORT_EVICTIONS);
                let d = kept.1.len().min(kvota_fairness::federation::MAX_REPORT_DECISIONS);
                (kept.0.drain(..e).collect::<Vec<_>>(), kept.1.drain(..d).collect::<Vec<_>>())
            };
            evictions.extend(s.take_eviction_notes(kvota_fairness::federation::MAX_REPORT_EVICTIONS.saturating_sub(evictions.len())));
            decisions.extend(s.take_decision_notes(kvota_fairness::federation::MAX_REPORT_DECISIONS.saturating_sub(decisions.len())));
            (round, self.acknowledged_epoch(s.lease.held_epoch()), s.take_usage(), evictions, decisions, window)
        };
        let capacity = self.capacity_changed.swap(false, std::sync::atomic::Ordering::SeqCst).then(|| self.capacity());
        let taken: BTreeMap<TenantName, u64> = tenants.iter().map(|(t, r)| (t.clone(), r.used_milli_gpue_ms)).collect();
        let notes = (evictions.clone(), decisions.clone());
        let refused = match self.journal.write(|seq| UsageReport {
            cluster: self.cluster.clone(),
            seq,
            held_epoch: held,
            capacity: capacity.clone(),
            tenants,
            evictions,
            decisions,
            window: Some(window),
        }) {
            Ok(written) => {
                span.record("seq", written.seq);
                let mut w = self.written_usage.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                for (t, r) in &written.tenants {
                    *w.entry(t.clone()).or_default() += r.used_milli_gpue_ms;
                }
                None
            }
            Err(e) => {
                // Nothing taken for the report is lost: the next round carries it.
                self.state().add_usage(&taken);
                let mut start = self.window_start.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                if *start == window.end_ms {
                    *start = window.start_ms;
                }
                if capacity.is_some() {
                    self.capacity_changed.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                {
                    // Before any a concurrent round left (the older notes first).
                    let mut kept = self.unwritten_notes.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                    kept.0.splice(0..0, notes.0);
                    kept.1.splice(0..0, notes.1);
                }
                tracing::warn!(error = %e, "the usage journal refused this round's report; its usage stays metered for the next round, and the reports it holds are sent");
                Some(e)
            }
        };
        // The reports the journal holds go out even when it refused this round's: a
        // journal full after a long partition drains only through their acknowledgements,
        // and leases are renewed only in their answers.
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
                Ok(reply) if !reply.applied && self.renumber_on_conflict.load(std::sync::atomic::Ordering::SeqCst) => {
                    // Taken for a duplicate right after a takeover: the old leader's
                    // reports used this number (the node we asked had not applied its
                    // last ones yet), or it was ours and applied before a crash lost
                    // the acknowledgement; `follow` tells the two apart by the window.
                    self.adopt(reply.lease, sent)?;
                    let info = self.describe().await?;
                    self.follow(&info)?;
                    return Err(Status::aborted("reports renumbered after a takeover; sending them next round"));
                }
                Ok(reply) => {
                    tracing::debug!(sent = report.seq, applied = reply.applied, epoch = reply.lease.as_ref().map_or(0, |l| l.epoch), "report acknowledged");
                    self.adopt(reply.lease, sent)?;
                    self.journal.ack_through(report.seq).map_err(journal_err)?;
                    {
                        let mut acked = self.acked.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                        acked.0 = acked.0.max(report.seq);
                        acked.1 = acked.1.max(report.window.map_or(0, |w| w.end_ms));
                    }
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
        if let Some(e) = refused {
            // Not a completed round: what this round metered is not in a report yet.
            return Err(mark_journal_refused(journal_err(e)));
        }
        self.rounds_done.send_if_modified(|done| {
            let newer = round > *done;
            *done = (*done).max(round);
            newer
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(seq: u64, window: Option<(u64, u64)>) -> UsageReport {
        UsageReport {
            cluster: ClusterName::from_static("c"),
            seq,
            held_epoch: 0,
            capacity: None,
            tenants: BTreeMap::new(),
            evictions: Vec::new(),
            decisions: Vec::new(),
            window: window.map(|(start_ms, end_ms)| UsageWindow { start_ms, end_ms }),
        }
    }

    #[test]
    fn a_report_is_counted_when_its_window_ends_by_what_the_control_plane_counted() {
        // Ours, applied before a crash lost the acknowledgement: window ends by `through`.
        assert!(already_counted(&report(7, Some((10, 20))), 9, 20));
        // Written after the counted usage ends: not counted, whatever its number.
        assert!(!already_counted(&report(3, Some((10, 25))), 9, 20));
        assert!(!already_counted(&report(12, Some((20, 30))), 9, 20));
        // No windowed report applied yet: nothing windowed is counted.
        assert!(!already_counted(&report(1, Some((0, 5))), 9, 0));
        // Older reports without a window: by number.
        assert!(already_counted(&report(9, None), 9, 20));
        assert!(!already_counted(&report(10, None), 9, 20));
    }

    fn lease(epoch: u64, budget: u64) -> v1::Lease {
        let budgets = [(TenantName::from_static("training"), kvota_fairness::lease::TenantBudget { budget, fallback: 1_000, entitlement: budget, borrow: 0, ceiling: 0 })];
        v1::Lease::from(&Lease { cluster: ClusterName::from_static("east"), epoch, duration_ms: 60_000, margin_ms: 1_000, issued_at_ms: 0, budgets: budgets.into_iter().collect() })
    }

    /// Taking a lease writes it to the journal (an fdatasync) without holding the
    /// admission state, then enforces it: reviews are judged, under the lease before it,
    /// while the disk syncs; the new epoch is neither enforced nor acknowledged before
    /// the journal holds it, so a restart never goes back to an older epoch.
    #[test]
    fn a_lease_is_journaled_outside_the_admission_state_then_enforced_and_acknowledged() {
        let dir = tempfile::tempdir().expect("tmp");
        let agent = Arc::new(Agent::open(&ClusterName::from_static("east"), BTreeMap::new(), dir.path(), &["http://127.0.0.1:1".to_string()]).expect("open"));
        agent.adopt(Some(lease(1, 2_000)), agent.now_ms()).expect("first lease");
        assert_eq!(agent.acknowledges(), 1);

        let slow_disk = agent.journal.hold();
        let taking = std::thread::spawn({
            let agent = Arc::clone(&agent);
            move || agent.adopt(Some(lease(2, 5_000)), agent.now_ms())
        });
        // While the write waits on the disk, reviews take the state's lock at once and
        // find the lease before (the new one is not durable yet) ...
        let deadline = Instant::now() + std::time::Duration::from_millis(300);
        while Instant::now() < deadline {
            let seen = agent.state.try_lock().ok().map(|s| (s.lease.held_epoch(), s.lease.budget("training", agent.now_ms())));
            assert_eq!(seen, Some((1, 2_000)), "the admission state was locked, or held a lease its journal lacks");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // ... and no report acknowledges the new epoch.
        assert_eq!(agent.acknowledges(), 1);
        assert!(!taking.is_finished());
        drop(slow_disk);
        taking.join().expect("no panic").expect("second lease");
        assert_eq!(agent.state().lease.budget("training", agent.now_ms()), 5_000, "enforced once written");
        assert_eq!(agent.acknowledges(), 2);
        drop(agent);
        let again = Agent::open(&ClusterName::from_static("east"), BTreeMap::new(), dir.path(), &["http://127.0.0.1:1".to_string()]).expect("reopen");
        assert_eq!(again.state().lease.held_epoch(), 2, "the journal holds the lease taken");
    }

    /// Stands in for the control plane's member service (the fault under test, a
    /// journal that refuses writes, can be injected only inside this crate; the real
    /// control plane's answers are tested in `kvota/tests/agent_e2e.rs`): while `down` it
    /// refuses every report, then acknowledges each one with a lease, recording its
    /// sequence number.
    struct Member {
        down: Arc<std::sync::atomic::AtomicBool>,
        applied: Arc<Mutex<Vec<u64>>>,
    }

    #[tonic::async_trait]
    impl v1::member_server::Member for Member {
        async fn register(&self, _: tonic::Request<v1::RegisterRequest>) -> Result<tonic::Response<v1::LeaseReply>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
        async fn report(&self, r: tonic::Request<v1::ReportRequest>) -> Result<tonic::Response<v1::ReportReply>, Status> {
            if self.down.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(Status::internal("the control plane is down (test)"));
            }
            self.applied.lock().expect("lock").push(r.into_inner().seq);
            Ok(tonic::Response::new(v1::ReportReply { applied: true, lease: Some(lease(1, 2_000)) }))
        }
        async fn describe_cluster(&self, _: tonic::Request<v1::DescribeClusterRequest>) -> Result<tonic::Response<v1::ClusterInfo>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    /// Starts a [`Member`], down at first, on a loopback port: its `down` switch, the
    /// sequence numbers it applied, and its address.
    async fn serve_member() -> (Arc<std::sync::atomic::AtomicBool>, Arc<Mutex<Vec<u64>>>, std::net::SocketAddr) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let applied = Arc::new(Mutex::new(Vec::new()));
        let member = Member { down: Arc::clone(&down), applied: Arc::clone(&applied) };
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(v1::member_server::MemberServer::new(member))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        (down, applied, addr)
    }

    /// A round whose report the journal refuses still sends the reports the journal
    /// holds: a journal full after a long partition drains only through their
    /// acknowledgements (and leases are renewed only in their answers). The round still
    /// fails, and its own usage waits for the next one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_refused_report_still_sends_the_reports_the_journal_holds() {
        let (down, applied, addr) = serve_member().await;
        let dir = tempfile::tempdir().expect("tmp");
        let agent = Agent::open(&ClusterName::from_static("east"), BTreeMap::new(), dir.path(), &[format!("http://{addr}")]).expect("open");
        let training = TenantName::from_static("training");
        for _ in 0..2 {
            agent.state().add_usage(&[(training.clone(), 1_000)].into());
            let e = agent.report_once().await.expect_err("the control plane is down");
            assert!(!journal_refused(&e), "a failure to reach the control plane is not the journal's: {e}");
        }
        assert_eq!(agent.backlog(), 2, "two reports wait in the journal");

        down.store(false, std::sync::atomic::Ordering::SeqCst);
        agent.journal.fail_report_writes(true);
        agent.state().add_usage(&[(training.clone(), 500)].into());
        let e = agent.report_once().await.expect_err("the journal refused this round's report");
        assert!(e.message().contains("no space left"), "{e}");
        assert!(journal_refused(&e), "the journal's own failure, the control plane answered: {e}");
        assert_eq!(*applied.lock().expect("lock"), [1, 2], "the journal's reports went out");
        assert_eq!(agent.backlog(), 0, "and were acknowledged");
        assert_eq!(agent.state().lease.held_epoch(), 1, "their answers' lease was taken");
        assert_eq!(agent.state().usage_so_far().get(&training), Some(&500), "this round's usage waits");

        agent.journal.fail_report_writes(false);
        agent.report_once().await.expect("a round with room on the disk");
        assert_eq!(*applied.lock().expect("lock"), [1, 2, 3]);
    }

    /// A journal at its backlog limit (`MAX_BACKLOG`, lowered to 2 here): while the
    /// control plane is cut off, a round's report is refused and its usage waits, and
    /// the round fails as unreachable (the loop backs off); once the control plane
    /// answers, the refused round drains the journal and renews the lease, and fails
    /// only as the journal's (the loop keeps its cadence); the next round's report
    /// carries every refused round's usage.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_journal_at_its_backlog_limit_drains_and_loses_nothing() {
        let (down, applied, addr) = serve_member().await;
        let dir = tempfile::tempdir().expect("tmp");
        let agent = Agent::open(&ClusterName::from_static("east"), BTreeMap::new(), dir.path(), &[format!("http://{addr}")]).expect("open");
        agent.journal.set_test_max_backlog(2);
        let training = TenantName::from_static("training");
        for _ in 0..2 {
            agent.state().add_usage(&[(training.clone(), 1_000)].into());
            let _ = agent.report_once().await.expect_err("the control plane is down");
        }
        assert_eq!(agent.backlog(), 2, "the journal is at its limit");

        agent.state().add_usage(&[(training.clone(), 300)].into());
        let e = agent.report_once().await.expect_err("cut off, and the journal full");
        assert!(!journal_refused(&e), "the control plane did not answer: the loop backs off ({e})");
        assert_eq!(agent.backlog(), 2, "nothing written beyond the limit");
        assert_eq!(agent.state().usage_so_far().get(&training), Some(&300), "the refused round's usage waits");

        down.store(false, std::sync::atomic::Ordering::SeqCst);
        agent.state().add_usage(&[(training.clone(), 200)].into());
        let e = agent.report_once().await.expect_err("the journal refuses this round's report");
        assert!(e.message().contains("unacknowledged reports"), "{e}");
        assert!(journal_refused(&e), "only the journal refused: the loop keeps its cadence ({e})");
        assert_eq!(*applied.lock().expect("lock"), [1, 2], "the journal drained");
        assert_eq!(agent.backlog(), 0);
        assert_eq!(agent.state().lease.held_epoch(), 1, "the answers renewed the lease");
        assert_eq!(agent.state().usage_so_far().get(&training), Some(&500), "both refused rounds' usage waits");

        agent.report_once().await.expect("room in the journal again");
        assert_eq!(*applied.lock().expect("lock"), [1, 2, 3]);
        assert_eq!(agent.state().usage_so_far().get(&training), None, "reported");
    }

    /// A journal write that waits on the disk (here: on the journal, held as a slow
    /// fdatasync would hold it) does not stall the runtime's other tasks, even with one
    /// worker thread: the webhook shares the runtime with the report loop.
    #[test]
    fn a_write_waiting_on_the_disk_does_not_stall_other_tasks() {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime");
        let dir = tempfile::tempdir().expect("tmp");
        let agent = Arc::new(Agent::open(&ClusterName::from_static("east"), BTreeMap::new(), dir.path(), &["http://127.0.0.1:1".to_string()]).expect("open"));
        let ticks = Arc::new(std::sync::atomic::AtomicU64::new(0));
        rt.spawn({
            let ticks = Arc::clone(&ticks);
            async move {
                loop {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                    ticks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                }
            }
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        let slow_disk = agent.journal.hold();
        let adopted = rt.spawn({
            let agent = Arc::clone(&agent);
            async move { agent.adopt(Some(lease(1, 2_000)), agent.now_ms()) }
        });
        std::thread::sleep(std::time::Duration::from_millis(50));
        let before = ticks.load(std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(300));
        let during = ticks.load(std::sync::atomic::Ordering::SeqCst) - before;
        // The metrics' view of the journal does not wait either.
        assert_eq!((agent.backlog(), agent.last_seq()), (0, 0));
        assert!(!adopted.is_finished(), "the write waits for the disk");
        drop(slow_disk);
        rt.block_on(adopted).expect("no panic").expect("lease taken");
        assert!(during >= 20, "the other task ran {during} times in 300 ms while the write waited");
    }

    /// A report the journal refuses (a full disk) loses nothing the round took for it:
    /// the usage, the window it covers, a capacity change and the decision notes all go
    /// into the next round's report.
    #[tokio::test]
    async fn a_report_the_journal_refuses_loses_nothing_it_took() {
        use crate::review::AdmissionState as _;
        let dir = tempfile::tempdir().expect("tmp");
        let agent = Agent::open(&ClusterName::from_static("east"), [("nvidia.com/gpu".to_string(), 8_000)].into(), dir.path(), &["http://127.0.0.1:1".to_string()]).expect("open");
        let training = TenantName::from_static("training");
        {
            let mut st = agent.state();
            let yaml = "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: t}\nspec:\n  tenants:\n  - {name: training, weight: 1, namespaces: [ml]}\n";
            st.set_policy(Policy::from_yaml(yaml).expect("policy"));
            st.add_usage(&[(training.clone(), 5_000)].into());
            let pod = kvota_fairness::admission::PodRequest { namespace: "ml".into(), name: "p".into(), gpue: 1_000 };
            let view = st.view("training");
            let decision = kvota_fairness::admission::decide(&pod, &view);
            st.remember(&kvota_fairness::names::PodKey::new("ml", "p").expect("key"), &pod, &view, &decision);
            let at_ms = st.now_ms();
            st.record_eviction(crate::state::ReclaimRecord {
                at_ms,
                for_tenant: training.clone(),
                for_pod: kvota_fairness::names::PodKey::new("ml", "p").expect("key"),
                victim: kvota_fairness::names::PodKey::new("ml", "old").expect("key"),
                victim_tenant: training.clone(),
                gpue: 1_000,
                outcome: kvota_fairness::federation::EvictionOutcome::Evicted,
                why: "test".into(),
            });
        }
        agent.set_capacity([("nvidia.com/gpu".to_string(), 16_000)].into());
        let start = *agent.window_start.lock().expect("lock");
        agent.journal.fail_report_writes(true);
        let e = agent.report_once().await.expect_err("the journal refuses the report");
        assert!(e.message().contains("no space left"), "{e}");
        assert_eq!(agent.state().usage_so_far().get(&training), Some(&5_000), "usage put back");
        assert_eq!(*agent.window_start.lock().expect("lock"), start, "the window not moved on");
        assert_eq!(agent.journal.unacked(10).expect("unacked").len(), 0);

        agent.state().add_usage(&[(training.clone(), 1_000)].into());
        agent.journal.fail_report_writes(false);
        let _ = agent.report_once().await; // no control plane: written, not delivered
        let written = agent.journal.unacked(10).expect("unacked");
        assert_eq!(written.len(), 1);
        let r = &written[0];
        assert_eq!(r.tenants.get(&training).map(|t| t.used_milli_gpue_ms), Some(6_000));
        assert_eq!(r.window.map(|w| w.start_ms), Some(start));
        assert_eq!(r.capacity.as_ref().and_then(|c| c.get("nvidia.com/gpu")), Some(&16_000));
        assert_eq!(r.decisions.iter().map(|d| d.pod.as_str()).collect::<Vec<_>>(), ["ml/p"]);
        assert_eq!(r.evictions.iter().map(|e| e.victim.as_str()).collect::<Vec<_>>(), ["ml/old"]);
    }

    /// When the journal cannot take a lease: one from the control plane is neither
    /// enforced nor acknowledged; one restored from the kept state is enforced (the kept
    /// state has it) but acknowledged only once a report round has written it to the
    /// journal; a renewal of an epoch the journal holds is enforced.
    #[test]
    fn a_lease_the_journal_cannot_take_is_enforced_only_where_a_restart_finds_it() {
        let dir = tempfile::tempdir().expect("tmp");
        let agent = Agent::open(&ClusterName::from_static("east"), BTreeMap::new(), dir.path(), &["http://127.0.0.1:1".to_string()]).expect("open");
        agent.adopt(Some(lease(1, 2_000)), agent.now_ms()).expect("first lease");
        agent.journal.fail_lease_writes(true);
        assert!(agent.adopt(Some(lease(2, 5_000)), agent.now_ms()).is_err(), "the write failed");
        let held = agent.state().lease.held_epoch();
        assert_eq!((held, agent.acknowledges()), (1, 1), "not enforced, not acknowledged");
        // The same epoch renewed: the journal has it, so the renewal holds.
        assert!(agent.adopt(Some(lease(1, 2_000)), agent.now_ms()).is_err());
        assert_eq!(agent.state().lease.held_epoch(), 1);
        // From the kept state: enforced, not acknowledged until it is journaled.
        let kept = Lease::try_from(lease(3, 6_000)).expect("lease");
        let until = agent.now_ms() + 30_000;
        assert!(agent.take_lease(|l| l.restore_anchored(kept.clone(), Some(until)), true).is_err());
        let held = agent.state().lease.held_epoch();
        assert_eq!((held, agent.acknowledges()), (3, 1));
        agent.rejournal();
        assert_eq!(agent.acknowledges(), 1, "still failing");
        agent.journal.fail_lease_writes(false);
        agent.rejournal();
        assert_eq!(agent.acknowledges(), 3, "written by the next round");
        drop(agent);
        let again = Agent::open(&ClusterName::from_static("east"), BTreeMap::new(), dir.path(), &["http://127.0.0.1:1".to_string()]).expect("reopen");
        assert_eq!(again.state().lease.held_epoch(), 3);
    }

    /// A lease refused (the same epoch with other budgets) is neither held nor written.
    #[test]
    fn a_refused_lease_is_not_journaled() {
        let dir = tempfile::tempdir().expect("tmp");
        let agent = Agent::open(&ClusterName::from_static("east"), BTreeMap::new(), dir.path(), &["http://127.0.0.1:1".to_string()]).expect("open");
        agent.adopt(Some(lease(3, 2_000)), agent.now_ms()).expect("lease");
        agent.adopt(Some(lease(3, 9_000)), agent.now_ms()).expect("refused, no error");
        drop(agent);
        let again = Agent::open(&ClusterName::from_static("east"), BTreeMap::new(), dir.path(), &["http://127.0.0.1:1".to_string()]).expect("reopen");
        assert_eq!(again.journal.load_lease().expect("load").map(|l| l.budgets["training"].budget), Some(2_000));
    }
}
