//! The agent's link to the control plane: register, fetch the policy, report usage
//! through the journal, adopt leases.
//!
//! The protocol's decisions live in [`crate::round`] (a state machine without IO);
//! [`Agent`] is the adapter that carries out its effects against the real journal,
//! the gRPC client, the admission state and the clock. Every report is journaled before
//! it is sent and resent, unchanged and in order, until acknowledged. A lease is
//! anchored at the agent-monotonic time its request was *sent*, so a late answer
//! expires early, never late.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use kvota_client::client::Client;
use kvota_fairness::federation::UsageReport;
use kvota_fairness::lease::{AgentLease, Lease};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::policy::Policy;
use kvota_proto::v1;
use tonic::{Code, Status};

use crate::journal::{Journal, JournalError};
use crate::round::{Answer, CallError, ClusterInfo, Effect, Input, JournalFault, Reporter, RoundError, Taken};
use crate::state::AgentState;

pub use crate::round::{already_counted, MAX_RESEND_PER_ROUND};

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

/// Why the agent could not start, or fetch the policy.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The usage journal could not be opened.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// The control plane's endpoints or TLS settings are unusable.
    #[error("control-plane client: {0}")]
    Client(String),
    /// No policy could be fetched, or the control plane's policy does not load here.
    #[error("{0}")]
    Policy(CallError),
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
    state: Arc<Mutex<AgentState>>,
    journal: Journal,
    client: Client,
    start: Instant,
    written_usage: Mutex<BTreeMap<TenantName, u64>>,
    /// The report protocol (decisions only; this type carries out its effects).
    reporter: Mutex<Reporter>,
    /// One program of the protocol at a time (a round, a registration, a restore).
    program: tokio::sync::Mutex<()>,
    /// Readings of the usage meter while standing by (oldest first).
    marks: Mutex<std::collections::VecDeque<Mark>>,
    /// Where the enforcement state is kept for the next process (`crate::persist`).
    store: Mutex<Option<Arc<dyn crate::persist::StateStore>>>,
    /// This replica's name in the persisted state.
    identity: Mutex<String>,
    /// Pods' run times, to recover usage no process metered.
    history: Mutex<Option<History>>,
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
    /// The policy revision enforced here, and what a newer one wakes.
    policy_watch: crate::revision::PolicyWatch,
}

/// How long a read or write of the kept state may take: a slow API server must not hold
/// up the report round that follows (or the start of enforcement).
pub const STATE_STORE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

fn store_timeout(store: &dyn crate::persist::StateStore) -> crate::persist::PersistError {
    crate::persist::PersistError::Store {
        store: store.describe(),
        why: format!("no answer within {STATE_STORE_TIMEOUT:?}"),
    }
}

fn fault(e: JournalError) -> JournalFault {
    JournalFault(e.to_string())
}

/// A call's failure as the protocol sees it.
fn call_error(s: &Status) -> CallError {
    match s.code() {
        Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown => {
            CallError::Unreachable(s.message().to_string())
        }
        _ => CallError::Refused(s.message().to_string()),
    }
}

/// A report's answer as the protocol sees it: a sequence gap in either form (the reply
/// field, or the error older control planes send), an unknown cluster, a lease checked.
fn answer_of(result: Result<v1::ReportReply, Status>) -> Answer {
    match result {
        Ok(reply) if reply.expected_seq > 0 => Answer::Gap {
            expected: Some(reply.expected_seq),
        },
        Ok(reply) => match reply.lease.map(Lease::try_from) {
            Some(Ok(lease)) => Answer::Lease {
                applied: reply.applied,
                lease,
            },
            Some(Err(e)) => Answer::Failed(CallError::BadAnswer(format!("bad lease: {e}"))),
            None => Answer::Failed(CallError::BadAnswer("answer carried no lease".into())),
        },
        Err(s) if s.code() == Code::NotFound => Answer::NotRegistered,
        Err(s) => match gap_of(&s) {
            Some(expected) => Answer::Gap {
                expected: Some(expected),
            },
            None => Answer::Failed(call_error(&s)),
        },
    }
}

/// The expected number of a sequence gap in the error form older control planes send
/// (`FAILED_PRECONDITION` with `kvota-expected-seq`).
fn gap_of(s: &Status) -> Option<u64> {
    if s.code() != Code::FailedPrecondition {
        return None;
    }
    s.metadata().get("kvota-expected-seq")?.to_str().ok()?.parse().ok()
}

impl Agent {
    /// An agent for `cluster` with `capacity` (resource name -> quantity milli), its
    /// journal in `dir`, talking to the control plane at `endpoints`. A lease saved by a
    /// previous run is enforced at once (its fallbacks, until the control plane answers).
    pub fn open(
        cluster: &ClusterName,
        capacity: BTreeMap<String, u64>,
        dir: &Path,
        endpoints: &[String],
    ) -> Result<Agent, AgentError> {
        Agent::open_with_tls(cluster, capacity, dir, endpoints, None)
    }

    /// [`Agent::open`], talking to the control plane over mutual TLS if `tls` is given.
    pub fn open_with_tls(
        cluster: &ClusterName,
        capacity: BTreeMap<String, u64>,
        dir: &Path,
        endpoints: &[String],
        tls: Option<kvota_client::tls::GrpcTls>,
    ) -> Result<Agent, AgentError> {
        let journal = Journal::open(dir)?;
        Agent::on_journal(cluster, capacity, journal, endpoints, tls)
    }

    /// [`Agent::open_with_tls`] on a journal already open (tests of a misbehaving disk).
    pub fn on_journal(
        cluster: &ClusterName,
        capacity: BTreeMap<String, u64>,
        journal: Journal,
        endpoints: &[String],
        tls: Option<kvota_client::tls::GrpcTls>,
    ) -> Result<Agent, AgentError> {
        let lease = match journal.load_lease() {
            Some(l) if l.cluster == *cluster => AgentLease::restored(l),
            _ => AgentLease::new(cluster.clone()),
        };
        let weights = kvota_fairness::resources::ResourceWeights::new();
        let mut state = AgentState::new(cluster.clone(), weights.capacity_gpue_milli(&capacity), lease.clone());
        // The monotonic clock starts now: decisions are stamped on the wall clock.
        state.set_wall_offset(unix_ms());
        let client = Client::with_tls(endpoints, tls).map_err(|s| AgentError::Client(s.message().to_string()))?;
        Ok(Agent {
            cluster: cluster.clone(),
            capacity: Mutex::new(capacity),
            capacity_changed: std::sync::atomic::AtomicBool::new(false),
            state: Arc::new(Mutex::new(state)),
            journal,
            client,
            start: Instant::now(),
            written_usage: Mutex::new(BTreeMap::new()),
            reporter: Mutex::new(Reporter::new(cluster.clone(), lease, unix_ms())),
            program: tokio::sync::Mutex::new(()),
            marks: Mutex::new(std::collections::VecDeque::new()),
            store: Mutex::new(None),
            identity: Mutex::new(cluster.to_string()),
            history: Mutex::new(None),
            meter_start: std::sync::atomic::AtomicU64::new(unix_ms()),
            save_failures: std::sync::atomic::AtomicU64::new(0),
            policy_failures: std::sync::atomic::AtomicU64::new(0),
            meter_known: std::sync::atomic::AtomicBool::new(true),
            rounds_taken: std::sync::atomic::AtomicU64::new(0),
            rounds_done: tokio::sync::watch::Sender::new(0),
            last_round_ok: std::sync::atomic::AtomicBool::new(false),
            policy_watch: crate::revision::PolicyWatch::default(),
        })
    }

    /// The policy revision this agent enforces and what a newer one wakes.
    pub fn policy_watch(&self) -> &crate::revision::PolicyWatch {
        &self.policy_watch
    }

    fn reporter(&self) -> MutexGuard<'_, Reporter> {
        self.reporter.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Turns the report protocol's fault switches on (the chaos and fault tests).
    #[cfg(feature = "fault-injection")]
    pub fn set_faults(&self, faults: crate::round::Faults) {
        self.reporter().set_faults(faults);
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
        self.reporter().keeps_state();
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
        let (acked_seq, counted_through) = self.reporter().acked();
        let st = self.state();
        let now = st.now_ms();
        let unix_now = unix_ms();
        let usable_until = st
            .lease
            .valid_until()
            .filter(|u| *u > now)
            .map_or(0, |u| unix_now.saturating_add(u - now));
        crate::persist::MemberState {
            format: crate::persist::FORMAT_VERSION,
            cluster: self.cluster.clone(),
            writer: self
                .identity
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
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
        let store = self
            .store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
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
        self.reporter().kept(epoch);
        Ok(())
    }

    /// Report rounds in a row whose state could not be saved (0: the last save worked).
    pub fn state_save_failures(&self) -> u64 {
        self.save_failures.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The epoch the next report acknowledges: the lease held, but no newer one than the
    /// state store holds (see [`Agent::persist`]) or the journal holds.
    pub fn acknowledges(&self) -> u64 {
        self.reporter().acknowledges()
    }

    /// Reads the enforcement state another process of this agent kept and takes what is
    /// newer than what this one has: the policy if it has none, the lease (never an
    /// older epoch) enforceable for what is left of its life minus the margin, and how
    /// far the cluster's usage is counted. `Ok(None)`: nothing kept yet. An error (a
    /// state that does not decode, of a newer format or another cluster) changes
    /// nothing: the agent goes on with what its own journal holds.
    pub async fn restore(&self) -> Result<Option<crate::persist::MemberState>, crate::persist::PersistError> {
        let store = self
            .store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let Some(store) = store else { return Ok(None) };
        let loaded = tokio::time::timeout(STATE_STORE_TIMEOUT, store.load())
            .await
            .map_err(|_| store_timeout(&*store))?;
        let Some(bytes) = loaded? else { return Ok(None) };
        let kept = crate::persist::decode(&bytes, &store.describe(), &self.cluster)?;
        {
            let mut st = self.state();
            if crate::review::AdmissionState::policy(&*st).is_none() {
                if let Some(p) = &kept.policy {
                    st.set_policy(p.clone());
                }
            }
        }
        if let Some(lease) = &kept.lease {
            let left = crate::round::restorable_for_ms(lease, kept.lease_usable_until_unix_ms, unix_ms());
            let now = self.now_ms();
            let until = (left > 0).then(|| now.saturating_add(left));
            let taken = self.run(|r| r.begin_restore(lease.clone(), until), None).await;
            tracing::info!(epoch = lease.epoch, enforceable_ms = left, held = self.state().lease.held_epoch(), writer = %kept.writer, "restored the lease kept in the cluster");
            if let Err(e) = taken {
                // Enforced all the same; reports go on acknowledging the epoch the
                // journal holds until a lease is written there.
                tracing::warn!(epoch = lease.epoch, error = %e, "the restored lease could not be written to the journal");
            }
        }
        self.reporter()
            .restore_acked(kept.acked_seq, kept.counted_through_unix_ms);
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
    pub async fn next_round(
        &self,
        last: tokio::time::Instant,
        every: std::time::Duration,
        min_gap: std::time::Duration,
    ) {
        let due = last + every;
        tokio::select! {
            _ = tokio::time::sleep_until(due) => {}
            _ = self.demand_waiting() => {
                tokio::time::sleep_until((last + min_gap).min(due)).await;
            }
            // A newer policy came into force: the control plane hears it soon.
            _ = self.policy_watch.report_due() => {
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
        self.capacity
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
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
            || marks
                .front()
                .is_some_and(|m| now.saturating_sub(m.unix_ms) > STANDBY_HISTORY_MS)
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
        if let Some(store) = self
            .store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
        {
            store.rearm();
        }
        self.state().reclassify_next_sync();
        self.reporter().took_over();
    }

    /// This process starts reporting for the cluster (it started, or took over from
    /// another replica): its first report first finds where the cluster's counted usage
    /// ends (see [`Agent::rebase_meter`]).
    pub fn starts_reporting(&self) {
        self.reporter().starts_reporting();
    }

    /// Whether a takeover can be settled now: where this process's meter starts is
    /// known and, with pods' run times to recover a gap from, a policy maps them to
    /// tenants.
    fn ready_to_settle(&self) -> bool {
        let has_history = self
            .history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some();
        !has_history
            || (self.meter_known.load(std::sync::atomic::Ordering::SeqCst)
                && crate::review::AdmissionState::policy(&*self.state()).is_some())
    }

    /// Where the cluster's usage is counted through, as far as this process knows
    /// without the control plane: its acknowledged reports, the state kept in the
    /// cluster, and the end of the last report its journal holds.
    fn counted_through_locally(&self, acked_through_ms: u64) -> u64 {
        let journaled = self
            .journal
            .unacked(usize::MAX)
            .ok()
            .and_then(|r| r.last().and_then(|r| r.window))
            .map_or(0, |w| w.end_ms);
        acked_through_ms.max(journaled)
    }

    /// Starts this leader's usage where the cluster's counted usage ends (see
    /// [`Agent::took_over`]); returns where the next report's window starts. Without an
    /// answer from the control plane it starts at its oldest reading: the control plane
    /// cuts what an applied report already covered.
    ///
    /// If this process began metering only after that point (it started after the old
    /// leader's last report, or every replica was down for a while), the gap is recovered
    /// from the pods' own run times ([`Agent::set_history`]): usage of every pod that
    /// ran in it, including pods that started and finished while no agent ran (as long
    /// as the cluster still lists them: a pod deleted while no agent ran is not seen).
    fn rebase_meter(&self, info: Option<ClusterInfo>, acked_through_ms: u64) -> u64 {
        let marks: Vec<Mark> = self
            .marks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain(..)
            .collect();
        let chosen = match info {
            // Counted through `t`: the latest reading at or before it, else the oldest.
            Some(i) if i.reported_through_ms > 0 => marks
                .iter()
                .rev()
                .find(|m| m.unix_ms <= i.reported_through_ms)
                .or(marks.first()),
            // Reports without windows (an older agent): what they covered is unknown, and
            // nothing would cut an overlap; count from now, as that agent did.
            Some(i) if i.last_seq > 0 => marks.last(),
            // Never reported (everything metered is new), or no answer (the control
            // plane cuts whatever the old leader's reports covered).
            _ => marks.first(),
        };
        // Counted through here: by the control plane, or by this process's own reports
        // (its journal's backlog will be delivered, so only what follows it is missing).
        let local = self.counted_through_locally(acked_through_ms);
        let counted = match info {
            Some(i) if i.reported_through_ms > 0 => Some(i.reported_through_ms.max(local)),
            Some(i) if i.last_seq > 0 => None,
            _ => Some(local).filter(|t| *t > 0),
        };
        let from_ms = match chosen {
            Some(mark) => {
                self.state().rebase_usage(&mark.used);
                mark.unix_ms
            }
            None => self.meter_start.load(std::sync::atomic::Ordering::SeqCst),
        };
        let history = self
            .history
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let start = match (counted, history) {
            (Some(t), Some(h)) if t < from_ms => {
                let gap = (h.0)(t, from_ms);
                let total: u64 = gap.values().sum();
                tracing::info!(
                    from_ms = t,
                    to_ms = from_ms,
                    usage_milli_gpue_ms = total,
                    "usage no agent metered recovered from the pods' run times"
                );
                self.state().add_usage(&gap);
                t
            }
            _ => from_ms,
        };
        if let Some(mark) = chosen {
            log_takeover(info, mark.unix_ms);
        }
        start
    }

    /// Reports written but not yet acknowledged.
    pub fn backlog(&self) -> usize {
        self.journal.backlog()
    }

    /// Sequence number of the last report written to the journal (0: none yet).
    pub fn last_seq(&self) -> u64 {
        self.journal.last_seq()
    }

    /// Usage written into reports so far, per tenant (milli-GPUe x ms).
    pub fn written_usage(&self) -> BTreeMap<TenantName, u64> {
        self.written_usage
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Registers the cluster (capacity) and adopts the answering lease.
    pub async fn register(&self) -> Result<(), RoundError> {
        self.run(Reporter::begin_register, None).await
    }

    /// Fetches the policy in force. A failure (the control plane unreachable or without
    /// a policy, or a policy this build refuses) leaves the last policy loaded in force
    /// and is counted ([`Agent::policy_fetch_failures`]).
    pub async fn fetch_policy(&self) -> Result<(), AgentError> {
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

    async fn fetch_policy_once(&self) -> Result<(), AgentError> {
        let reply = self
            .client
            .call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) })
            .await
            .map_err(|s| AgentError::Policy(call_error(&s)))?;
        if reply.name.is_empty() {
            return Err(AgentError::Policy(CallError::Refused(
                "the control plane has no policy yet".into(),
            )));
        }
        // The document is validated here as any policy is: an agent never enforces a
        // policy it would have refused.
        let p = Policy::from_yaml(&reply.yaml).map_err(|e| {
            AgentError::Policy(CallError::BadAnswer(format!(
                "the policy from the control plane does not load: {e}"
            )))
        })?;
        let name = p.name.clone();
        self.state().set_policy(p);
        if self.policy_watch.enforce(reply.revision) {
            tracing::info!(policy = %name, revision = reply.revision, "policy in force");
        }
        Ok(())
    }

    /// One report round: writes a report of usage since the last one into the journal,
    /// then sends every unacknowledged report in order. On error the reports stay for
    /// the next round.
    pub async fn report_once(&self) -> Result<(), RoundError> {
        use tracing::Instrument as _;
        let span = tracing::info_span!("report", cluster = %self.cluster, seq = tracing::field::Empty);
        let ready = self.ready_to_settle();
        let mut round = 0;
        let result = self
            .run(|r| r.begin_round(ready), Some((&span, &mut round)))
            .instrument(span.clone())
            .await;
        self.last_round_ok
            .store(result.is_ok(), std::sync::atomic::Ordering::SeqCst);
        if result.is_ok() {
            self.rounds_done.send_if_modified(|done| {
                let newer = round > *done;
                *done = (*done).max(round);
                newer
            });
        }
        result
    }

    /// Runs one program of the protocol (see [`crate::round`]) to its end, carrying out
    /// each effect. `round`: the report span and where to note the round's number.
    async fn run(
        &self,
        first: impl FnOnce(&mut Reporter) -> Effect,
        mut round: Option<(&tracing::Span, &mut u64)>,
    ) -> Result<(), RoundError> {
        let _one_at_a_time = self.program.lock().await;
        let mut effect = first(&mut self.reporter());
        loop {
            let input = match effect {
                Effect::Finish(result) => return result,
                other => self.perform(other, &mut round).await,
            };
            effect = self.reporter().resume(input);
        }
    }

    async fn perform(&self, effect: Effect, round: &mut Option<(&tracing::Span, &mut u64)>) -> Input {
        match effect {
            Effect::SaveLease(lease) => Input::LeaseSaved(self.journal.save_lease(&lease).map_err(fault)),
            Effect::Enforce(next) => {
                self.state().lease = next;
                Input::Done
            }
            Effect::Describe => Input::Described(self.describe().await),
            Effect::Renumber { first, counted } => Input::Renumbered(self.renumber(first, counted)),
            Effect::RebaseMeter { info, acked_through_ms } => Input::MeterRebased {
                window_start_ms: self.rebase_meter(info, acked_through_ms),
            },
            Effect::TakeUsage { evictions, decisions } => {
                let (n, taken) = self.take_usage(evictions, decisions);
                if let Some((_, r)) = round.as_mut() {
                    **r = n;
                }
                Input::Taken(taken)
            }
            Effect::WriteReport(report) => Input::Written(self.write(report, round.as_ref().map(|(s, _)| *s))),
            Effect::GiveBack { usage, capacity } => {
                self.state().add_usage(&usage);
                if capacity.is_some() {
                    self.capacity_changed.store(true, std::sync::atomic::Ordering::SeqCst);
                }
                Input::Done
            }
            Effect::ReadUnacked(limit) => Input::Unacked(self.journal.unacked(limit).map_err(fault)),
            Effect::Send(report) => self.send(&report).await,
            Effect::AckThrough(seq) => Input::Acked(self.journal.ack_through(seq).map_err(fault)),
            Effect::Register => self.send_registration().await,
            Effect::Finish(_) => Input::Done,
        }
    }

    /// Takes this round's usage, notes and capacity change from the admission state,
    /// numbering the round under the state's lock (see [`Agent::rounds_taken`]).
    fn take_usage(&self, evictions: usize, decisions: usize) -> (u64, Taken) {
        let mut s = self.state();
        let round = self.rounds_taken.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        let capacity = self
            .capacity_changed
            .swap(false, std::sync::atomic::Ordering::SeqCst)
            .then(|| self.capacity());
        let taken = Taken {
            wall_ms: unix_ms(),
            tenants: s.take_usage(),
            evictions: s.take_eviction_notes(evictions),
            decisions: s.take_decision_notes(decisions),
            capacity,
        };
        (round, taken)
    }

    fn write(&self, report: UsageReport, span: Option<&tracing::Span>) -> Result<UsageReport, JournalFault> {
        match self.journal.write(|seq| UsageReport { seq, ..report }) {
            Ok(written) => {
                if let Some(span) = span {
                    span.record("seq", written.seq);
                }
                let mut w = self
                    .written_usage
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                for (t, r) in &written.tenants {
                    *w.entry(t.clone()).or_default() += r.used_milli_gpue_ms;
                }
                Ok(written)
            }
            Err(e) => {
                tracing::warn!(error = %e, "the usage journal refused this round's report; its usage stays metered for the next round, and the reports it holds are sent");
                Err(fault(e))
            }
        }
    }

    fn renumber(&self, first: u64, counted: Option<ClusterInfo>) -> Result<(usize, usize), JournalFault> {
        let keep = |r: &UsageReport| counted.is_none_or(|c| !already_counted(r, c.last_seq, c.reported_through_ms));
        match self.journal.renumber_keeping(first, keep) {
            Ok((kept, dropped)) => {
                tracing::info!(
                    from = first,
                    reports = kept,
                    already_counted = dropped,
                    "reports renumbered to follow the control plane's sequence"
                );
                Ok((kept, dropped))
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not renumber the journal's reports; the first answers will");
                Err(fault(e))
            }
        }
    }

    /// What the control plane knows of this cluster (any node's applied state).
    async fn describe(&self) -> Result<ClusterInfo, CallError> {
        let req = v1::DescribeClusterRequest {
            cluster: self.cluster.to_string(),
        };
        self.client
            .call(|ch| {
                let req = req.clone();
                async move { Ok(Client::member(ch).describe_cluster(req).await?.into_inner()) }
            })
            .await
            .map(|i| ClusterInfo {
                last_seq: i.last_seq,
                reported_through_ms: i.reported_through_ms,
            })
            .map_err(|s| call_error(&s))
    }

    /// GPUe of each policy tenant's pods on a node here, for the report's status.
    fn running(&self) -> BTreeMap<TenantName, kvota_fairness::MilliGpue> {
        let st = self.state();
        let Some(p) = crate::review::AdmissionState::policy(&*st) else {
            return BTreeMap::new();
        };
        p.tenants
            .iter()
            .map(|t| (t.name.clone(), st.bound(&t.name)))
            .filter(|(_, g)| *g > 0)
            .collect()
    }

    async fn send(&self, report: &UsageReport) -> Input {
        let mut wire = v1::ReportRequest::from(report);
        wire.gap_in_reply = true;
        // The agent and its cluster as they are when the report goes out (not
        // journaled: a resent report says how things stand now).
        wire.status = Some((&self.policy_watch.status(self.running())).into());
        let sent_ms = self.now_ms();
        let result = self
            .client
            .call(|ch| {
                let wire = wire.clone();
                async move { Ok(Client::member(ch).report(wire).await?.into_inner()) }
            })
            .await;
        if let Ok(reply) = &result {
            self.policy_watch.saw(reply.policy_revision);
        }
        let answer = answer_of(result);
        match &answer {
            Answer::Lease { applied, lease } => {
                tracing::debug!(sent = report.seq, applied, epoch = lease.epoch, "report acknowledged");
                self.pace_calls(lease);
            }
            Answer::Gap { expected } => {
                tracing::info!(sent = report.seq, ?expected, "sequence gap")
            }
            Answer::NotRegistered | Answer::Failed(_) => {}
        }
        Input::Answered { sent_ms, answer }
    }

    async fn send_registration(&self) -> Input {
        let req = v1::RegisterRequest {
            cluster: self.cluster.to_string(),
            capacity: kvota_proto::convert::resources(&self.capacity()),
            labels: Default::default(),
        };
        let sent_ms = self.now_ms();
        let reply = self
            .client
            .call(|ch| {
                let req = req.clone();
                async move { Ok(Client::member(ch).register(req).await?.into_inner()) }
            })
            .await;
        if let Ok(r) = &reply {
            self.policy_watch.saw(r.policy_revision);
        }
        let result = match reply {
            Ok(r) => match r.lease.map(Lease::try_from) {
                Some(Ok(lease)) => {
                    self.pace_calls(&lease);
                    Ok(lease)
                }
                Some(Err(e)) => Err(CallError::BadAnswer(format!("bad lease: {e}"))),
                None => Err(CallError::BadAnswer("answer carried no lease".into())),
            },
            Err(s) => Err(call_error(&s)),
        };
        Input::Registered { sent_ms, result }
    }

    /// An answer that comes later than the lease's usable life (duration - margin from
    /// the send) renews nothing; give up on a silent node after two thirds of it and
    /// try the next one while a renewal can still arrive in time. (Half was too short
    /// for a 3 s lease over links with 200 ms of delay: slow answers timed out.)
    fn pace_calls(&self, lease: &Lease) {
        self.client.set_call_timeout(std::time::Duration::from_millis(
            lease.duration_ms.saturating_sub(lease.margin_ms) * 2 / 3,
        ));
    }
}

/// Says where a new leader's reports start (`from_ms`), given what the control plane
/// said it counted (`None`: it did not answer).
fn log_takeover(info: Option<ClusterInfo>, from_ms: u64) {
    match info {
        Some(i) => tracing::info!(
            counted_through_ms = i.reported_through_ms,
            from_ms,
            "took over: reporting the usage metered while standing by since the old leader's last report"
        ),
        None => tracing::warn!(
            from_ms,
            "took over without reaching the control plane: reporting usage since the oldest reading (the control plane cuts any overlap)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::{MemDisk, Options};
    use kvota_fairness::lease::TenantBudget;

    fn east() -> ClusterName {
        ClusterName::from_static("east")
    }

    fn lease(epoch: u64, budget: u64) -> v1::Lease {
        let budgets = [(
            TenantName::from_static("training"),
            TenantBudget {
                budget,
                fallback: 1_000.min(budget),
                entitlement: budget,
                borrow: 0,
                ceiling: 0,
            },
        )];
        v1::Lease::from(&Lease {
            cluster: east(),
            epoch,
            duration_ms: 60_000,
            margin_ms: 1_000,
            issued_at_ms: 0,
            budgets: budgets.into_iter().collect(),
        })
    }

    fn agent_on(disk: &MemDisk, options: Options, endpoint: &str) -> Agent {
        let journal = Journal::open_on(Box::new(disk.clone()), options).expect("journal");
        Agent::on_journal(&east(), BTreeMap::new(), journal, &[endpoint.to_string()], None).expect("agent")
    }

    /// Stands in for the control plane's member service (the faults under test, a disk
    /// that stalls or refuses writes, are injected under the journal; the real control
    /// plane's answers are tested in `kvota/tests/agent_e2e.rs`): while `down` it refuses
    /// every call; then it acknowledges each report with the lease of epoch `epoch`,
    /// recording its sequence number, and answers registrations with it too.
    struct Member {
        down: Arc<std::sync::atomic::AtomicBool>,
        epoch: Arc<std::sync::atomic::AtomicU64>,
        applied: Arc<Mutex<Vec<u64>>>,
    }

    impl Member {
        fn up(&self) -> Result<v1::Lease, Status> {
            if self.down.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(Status::unavailable("the control plane is down (test)"));
            }
            Ok(lease(self.epoch.load(std::sync::atomic::Ordering::SeqCst), 2_000))
        }
    }

    #[tonic::async_trait]
    impl v1::member_server::Member for Member {
        async fn register(
            &self,
            _: tonic::Request<v1::RegisterRequest>,
        ) -> Result<tonic::Response<v1::LeaseReply>, Status> {
            Ok(tonic::Response::new(v1::LeaseReply {
                lease: Some(self.up()?),
                policy_revision: Default::default(),
            }))
        }
        async fn report(
            &self,
            r: tonic::Request<v1::ReportRequest>,
        ) -> Result<tonic::Response<v1::ReportReply>, Status> {
            let lease = self.up()?;
            self.applied.lock().expect("lock").push(r.into_inner().seq);
            Ok(tonic::Response::new(v1::ReportReply {
                applied: true,
                lease: Some(lease),
                expected_seq: 0,
                policy_revision: 0,
            }))
        }
        async fn describe_cluster(
            &self,
            _: tonic::Request<v1::DescribeClusterRequest>,
        ) -> Result<tonic::Response<v1::ClusterInfo>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    struct Served {
        down: Arc<std::sync::atomic::AtomicBool>,
        epoch: Arc<std::sync::atomic::AtomicU64>,
        applied: Arc<Mutex<Vec<u64>>>,
        endpoint: String,
    }

    /// Starts a [`Member`], down at first, answering with epoch 1, on a loopback port.
    async fn serve_member() -> Served {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let down = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let epoch = Arc::new(std::sync::atomic::AtomicU64::new(1));
        let applied = Arc::new(Mutex::new(Vec::new()));
        let member = Member {
            down: Arc::clone(&down),
            epoch: Arc::clone(&epoch),
            applied: Arc::clone(&applied),
        };
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(v1::member_server::MemberServer::new(member))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        Served {
            down,
            epoch,
            applied,
            endpoint: format!("http://{addr}"),
        }
    }

    /// Taking a lease writes it to the journal (an fdatasync) without holding the
    /// admission state, then enforces it: reviews are judged, under the lease before it,
    /// while the disk syncs; the new epoch is neither enforced nor acknowledged before
    /// the journal holds it, and a restart from the journal finds it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lease_is_journaled_outside_the_admission_state_then_enforced_and_acknowledged() {
        let cp = serve_member().await;
        cp.down.store(false, std::sync::atomic::Ordering::SeqCst);
        let disk = MemDisk::new();
        let agent = Arc::new(agent_on(&disk, Options::default(), &cp.endpoint));
        agent.register().await.expect("first lease");
        assert_eq!(agent.acknowledges(), 1);

        cp.epoch.store(2, std::sync::atomic::Ordering::SeqCst);
        let slow_disk = disk.stall();
        let taking = tokio::spawn({
            let agent = Arc::clone(&agent);
            async move { agent.register().await }
        });
        // While the write waits on the disk, reviews take the state's lock at once and
        // find the lease before (the new one is not durable yet) ...
        let deadline = Instant::now() + std::time::Duration::from_millis(300);
        while Instant::now() < deadline {
            let seen = agent
                .state
                .try_lock()
                .ok()
                .map(|s| (s.lease.held_epoch(), s.lease.budget("training", agent.now_ms())));
            assert_eq!(
                seen,
                Some((1, 2_000)),
                "the admission state was locked, or held a lease its journal lacks"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // ... and no report acknowledges the new epoch.
        assert_eq!(agent.acknowledges(), 1);
        assert!(!taking.is_finished());
        drop(slow_disk);
        taking.await.expect("no panic").expect("second lease");
        assert_eq!(agent.state().lease.held_epoch(), 2, "enforced once written");
        assert_eq!(agent.acknowledges(), 2);
        drop(agent);
        let again = agent_on(&disk, Options::default(), &cp.endpoint);
        assert_eq!(again.state().lease.held_epoch(), 2, "the journal holds the lease taken");
    }

    /// A journal write that waits on the disk (a slow fdatasync) does not stall the
    /// runtime's other tasks, even with one worker thread: the webhook shares the
    /// runtime with the report loop.
    #[test]
    fn a_write_waiting_on_the_disk_does_not_stall_other_tasks() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let cp = rt.block_on(serve_member());
        cp.down.store(false, std::sync::atomic::Ordering::SeqCst);
        let disk = MemDisk::new();
        let agent = Arc::new(agent_on(&disk, Options::default(), &cp.endpoint));
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
        let slow_disk = disk.stall();
        let adopted = rt.spawn({
            let agent = Arc::clone(&agent);
            async move { agent.register().await }
        });
        std::thread::sleep(std::time::Duration::from_millis(100));
        let before = ticks.load(std::sync::atomic::Ordering::SeqCst);
        std::thread::sleep(std::time::Duration::from_millis(300));
        let during = ticks.load(std::sync::atomic::Ordering::SeqCst) - before;
        // The metrics' view of the journal does not wait either.
        assert_eq!((agent.backlog(), agent.last_seq()), (0, 0));
        assert!(!adopted.is_finished(), "the write waits for the disk");
        drop(slow_disk);
        rt.block_on(adopted).expect("no panic").expect("lease taken");
        assert!(
            during >= 20,
            "the other task ran {during} times in 300 ms while the write waited"
        );
    }

    /// A journal at its backlog limit (2 here): while the control plane is cut off, a
    /// round's report is refused and its usage waits, and the round fails as
    /// unreachable (the loop backs off); once the control plane answers, the refused
    /// round drains the journal and renews the lease, and fails only as the journal's
    /// (the loop keeps its cadence); the next round's report carries every refused
    /// round's usage.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_journal_at_its_backlog_limit_drains_and_loses_nothing() {
        let cp = serve_member().await;
        let agent = agent_on(&MemDisk::new(), Options { max_backlog: 2 }, &cp.endpoint);
        let training = TenantName::from_static("training");
        for _ in 0..2 {
            agent.state().add_usage(&[(training.clone(), 1_000)].into());
            let e = agent.report_once().await.expect_err("the control plane is down");
            assert!(
                e.backs_off(),
                "a failure to reach the control plane is not the journal's: {e}"
            );
        }
        assert_eq!(agent.backlog(), 2, "the journal is at its limit");

        agent.state().add_usage(&[(training.clone(), 300)].into());
        let e = agent.report_once().await.expect_err("cut off, and the journal full");
        assert!(
            e.backs_off(),
            "the control plane did not answer: the loop backs off ({e})"
        );
        assert_eq!(agent.backlog(), 2, "nothing written beyond the limit");
        assert_eq!(
            agent.state().usage_so_far().get(&training),
            Some(&300),
            "the refused round's usage waits"
        );

        cp.down.store(false, std::sync::atomic::Ordering::SeqCst);
        agent.state().add_usage(&[(training.clone(), 200)].into());
        let e = agent
            .report_once()
            .await
            .expect_err("the journal refuses this round's report");
        assert!(e.to_string().contains("unacknowledged reports"), "{e}");
        assert!(
            !e.backs_off(),
            "only the journal refused: the loop keeps its cadence ({e})"
        );
        assert_eq!(*cp.applied.lock().expect("lock"), [1, 2], "the journal drained");
        assert_eq!(agent.backlog(), 0);
        assert_eq!(agent.state().lease.held_epoch(), 1, "the answers renewed the lease");
        assert_eq!(
            agent.state().usage_so_far().get(&training),
            Some(&500),
            "both refused rounds' usage waits"
        );

        agent.report_once().await.expect("room in the journal again");
        assert_eq!(*cp.applied.lock().expect("lock"), [1, 2, 3]);
        assert_eq!(agent.state().usage_so_far().get(&training), None, "reported");
    }

    /// A full disk: a round's report is refused and loses nothing it took (the usage,
    /// the window it covers, a capacity change and the notes all go into the next
    /// round's report); what the journal holds is still sent, and the round ends at the
    /// first answer whose lease the journal cannot record (the report is sent again
    /// later, answered as a duplicate).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_disk_loses_nothing_a_round_took() {
        use crate::review::AdmissionState as _;
        let cp = serve_member().await;
        let disk = MemDisk::new();
        let agent = Agent::on_journal(
            &east(),
            [("nvidia.com/gpu".to_string(), 8_000)].into(),
            Journal::open_on(Box::new(disk.clone()), Options::default()).expect("journal"),
            std::slice::from_ref(&cp.endpoint),
            None,
        )
        .expect("agent");
        let training = TenantName::from_static("training");
        let _ = agent.report_once().await.expect_err("down: written, not delivered");
        {
            let mut st = agent.state();
            let yaml = "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: t}\nspec:\n  tenants:\n  - {name: training, weight: 1, namespaces: [ml]}\n";
            st.set_policy(Policy::from_yaml(yaml).expect("policy"));
            st.add_usage(&[(training.clone(), 5_000)].into());
            let pod = kvota_fairness::admission::PodRequest {
                namespace: "ml".into(),
                name: "p".into(),
                gpue: 1_000,
            };
            let view = st.view("training");
            let decision = kvota_fairness::admission::decide(&pod, &view);
            st.remember(
                &kvota_fairness::names::PodKey::new("ml", "p").expect("key"),
                &pod,
                &view,
                &decision,
            );
        }
        agent.set_capacity([("nvidia.com/gpu".to_string(), 16_000)].into());
        let start = agent.reporter().window_start_ms();
        cp.down.store(false, std::sync::atomic::Ordering::SeqCst);
        disk.fail_writes(true);
        let e = agent.report_once().await.expect_err("the disk is full");
        assert!(e.to_string().contains("no space left"), "{e}");
        assert_eq!(*cp.applied.lock().expect("lock"), [1], "the report it held went out");
        assert_eq!(agent.backlog(), 1, "its acknowledgement could not be recorded");
        assert_eq!(agent.state().lease.held_epoch(), 0, "nor its lease");
        assert_eq!(
            agent.state().usage_so_far().get(&training),
            Some(&5_000),
            "usage put back"
        );
        assert_eq!(agent.reporter().window_start_ms(), start, "the window not moved on");

        disk.fail_writes(false);
        agent.state().add_usage(&[(training.clone(), 1_000)].into());
        agent.report_once().await.expect("room again");
        assert_eq!(*cp.applied.lock().expect("lock"), [1, 1, 2], "resent, then the new one");
        let journal = Journal::open_on(Box::new(disk.clone()), Options::default()).expect("reopen");
        assert_eq!(journal.backlog(), 0);
        assert_eq!(agent.written_usage().get(&training), Some(&6_000), "nothing lost");
        assert_eq!(agent.state().lease.held_epoch(), 1);
    }
}
