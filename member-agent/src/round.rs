//! The report round's protocol, without IO: a state machine that takes what happened
//! ([`Input`]) and says what to do next ([`Effect`]), one step at a time.
//!
//! Every decision of the agent's link to the control plane lives here: build a report,
//! journal it before it is sent, send what the journal holds in order, adopt an answer's
//! lease (written to the journal before it is enforced), acknowledge, follow a sequence
//! gap, carry a refused write's usage into the next round, drain a full journal,
//! renumber after a takeover, re-register, and how long to back off. No tonic, kube,
//! file or clock is inside: [`crate::agent::Agent`] runs the effects against the real
//! journal, client and clock, and the deterministic chaos world runs the same machine
//! against a simulated disk, network and clock. So the code that carries kvota's
//! promise across faults is the code the simulation checks.
//!
//! A program (a report round, a registration, a restore) starts with one of the
//! `begin_*` methods, which returns its first [`Effect`]; the driver carries it out and
//! calls [`Reporter::resume`] with the outcome, until [`Effect::Finish`]. One program
//! runs at a time. Effects that need no outcome ([`Effect::Enforce`],
//! [`Effect::GiveBack`]) are resumed with [`Input::Done`].
//!
//! Holds, whatever the order of outcomes:
//! - a report is sent only once the journal holds it (it is read back from the journal);
//! - a lease is enforced only once the journal holds it (a lease restored from the
//!   state kept in the cluster excepted: that state holds it), and a report acknowledges
//!   no newer epoch than the journal and the kept state hold, so a restarted process
//!   never enforces an older epoch than the control plane was told it holds;
//! - usage taken for a report the journal refused goes back to the meter, and the
//!   reports the journal holds are still sent (a full journal drains only through their
//!   acknowledgements, and leases are renewed only in their answers);
//! - epochs never go back ([`AgentLease`]).

use std::collections::{BTreeMap, VecDeque};

use kvota_fairness::federation::{EvictionNote, PodDecision, TenantReport, UsageReport, UsageWindow};
use kvota_fairness::lease::{AgentLease, Lease, LeaseUpdate};
use kvota_fairness::names::{ClusterName, TenantName};
use kvota_fairness::Millis;

/// Reports sent per round at most (the rest wait for the next round), so a long backlog
/// after a partition drains steadily without one huge burst.
pub const MAX_RESEND_PER_ROUND: usize = 256;

/// The report round's fault switches: bugs of this code, turned on only by the chaos
/// world's tests that show the checker catches each (`fault-injection`, a feature no
/// release build enables). Without the feature every switch is off and compiled out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Reports leave the journal when sent, not when acknowledged, and a sequence gap
    /// is "repaired" by renumbering from the control plane's expectation.
    pub ack_on_send: bool,
    /// Reports acknowledge the lease held even before the kept state holds it.
    pub ack_unkept: bool,
    /// A lease taken is enforced before the journal holds it.
    pub enforce_unjournaled: bool,
    /// The usage taken for a report the journal refuses is dropped.
    pub drop_refused_report: bool,
    /// A round whose report the journal refuses ends there, without sending what the
    /// journal holds (a journal at its backlog limit never drains).
    pub stop_on_refused_report: bool,
}

impl Faults {
    #[cfg(feature = "fault-injection")]
    fn on(&self) -> Faults {
        *self
    }
    #[cfg(not(feature = "fault-injection"))]
    fn on(&self) -> Faults {
        Faults::default()
    }
}

/// A journal operation that failed (the journal's error in words, and whether it was a
/// refusal for lack of room).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalFault(pub String);

/// Why a call to the control plane got no usable answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallError {
    /// No node answered in time (or the connection failed).
    Unreachable(String),
    /// A node answered with an error.
    Refused(String),
    /// A node answered with something this agent cannot take (a lease that fails its
    /// checks, an answer without one).
    BadAnswer(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Unreachable(m) => write!(f, "control plane unreachable: {m}"),
            CallError::Refused(m) => write!(f, "control plane refused: {m}"),
            CallError::BadAnswer(m) => write!(f, "unusable answer from the control plane: {m}"),
        }
    }
}

/// What the control plane knows of this cluster (`DescribeCluster`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClusterInfo {
    /// The last report sequence it applied.
    pub last_seq: u64,
    /// Up to when (agent wall clock, Unix ms) it counted the cluster's usage (0: no
    /// windowed report yet).
    pub reported_through_ms: u64,
}

/// The answer to one report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Applied (or a duplicate, `applied: false`), with the cluster's lease.
    Lease {
        /// False for a sequence number applied before.
        applied: bool,
        /// The lease, checked ([`Lease::validate`]).
        lease: Lease,
    },
    /// Not the sequence number the control plane expects next (`expected`, if it said).
    Gap {
        /// The number it expects.
        expected: Option<u64>,
    },
    /// The cluster is not registered.
    NotRegistered,
    /// No usable answer.
    Failed(CallError),
}

/// What a round took from the admission state for its report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Taken {
    /// Agent wall clock (Unix ms) when taken: the report window's end.
    pub wall_ms: u64,
    /// Per-tenant usage since the last round, and in-use, waiting, largest waiting pod.
    pub tenants: BTreeMap<TenantName, TenantReport>,
    /// Evictions since the last round.
    pub evictions: Vec<EvictionNote>,
    /// Admission decisions since the last round.
    pub decisions: Vec<PodDecision>,
    /// The cluster's capacity, if it changed since it was last reported.
    pub capacity: Option<BTreeMap<String, u64>>,
}

/// What happened, for the step that waits on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// An effect that needs no outcome was carried out.
    Done,
    /// [`Effect::SaveLease`]: the journal's fdatasync returned.
    LeaseSaved(Result<(), JournalFault>),
    /// [`Effect::Describe`].
    Described(Result<ClusterInfo, CallError>),
    /// [`Effect::Renumber`]: reports kept and dropped.
    Renumbered(Result<(usize, usize), JournalFault>),
    /// [`Effect::RebaseMeter`]: where the next report's usage window starts.
    MeterRebased {
        /// Agent wall clock, Unix ms.
        window_start_ms: u64,
    },
    /// [`Effect::TakeUsage`].
    Taken(Taken),
    /// [`Effect::WriteReport`]: the report as journaled (its sequence number assigned).
    Written(Result<UsageReport, JournalFault>),
    /// [`Effect::ReadUnacked`].
    Unacked(Result<Vec<UsageReport>, JournalFault>),
    /// [`Effect::Send`]: the answer, and when (agent monotonic ms) the request was sent.
    Answered {
        /// When the request was sent: the lease's anchor.
        sent_ms: Millis,
        /// The answer.
        answer: Answer,
    },
    /// [`Effect::AckThrough`].
    Acked(Result<(), JournalFault>),
    /// [`Effect::Register`]: the lease, and when the request was sent.
    Registered {
        /// When the request was sent.
        sent_ms: Millis,
        /// The lease, or why none came.
        result: Result<Lease, CallError>,
    },
}

/// What to do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Write the lease to the journal (fdatasync); answer [`Input::LeaseSaved`].
    SaveLease(Lease),
    /// Enforce this lease state from now on (the admission state's lease); [`Input::Done`].
    Enforce(AgentLease),
    /// Ask the control plane what it knows of the cluster; [`Input::Described`].
    Describe,
    /// Renumber the journal's unacknowledged reports from `first`, dropping those the
    /// control plane counted already (`counted`: its last applied sequence and how far
    /// it counted usage, [`already_counted`]); [`Input::Renumbered`].
    Renumber {
        /// The first new number.
        first: u64,
        /// Drop the reports already counted by this (`None`: keep all).
        counted: Option<ClusterInfo>,
    },
    /// After a takeover: start the usage meter where the cluster's counted usage ends
    /// (`info`: what the control plane said, `None` if it could not be asked;
    /// `acked_through_ms`: how far this process's acknowledged reports counted);
    /// [`Input::MeterRebased`].
    RebaseMeter {
        /// What the control plane knows of the cluster.
        info: Option<ClusterInfo>,
        /// The end of the window of the last report acknowledged to this process.
        acked_through_ms: u64,
    },
    /// Take the usage, capacity change and at most this many eviction and decision
    /// notes from the admission state (the rest stay there for the next report);
    /// [`Input::Taken`].
    TakeUsage {
        /// Eviction notes to take at most.
        evictions: usize,
        /// Decision notes to take at most.
        decisions: usize,
    },
    /// Write this report durably (the journal assigns its sequence number);
    /// [`Input::Written`].
    WriteReport(UsageReport),
    /// Give this usage (per tenant, milli-GPUe x ms) and capacity change back to the
    /// meter for the next round; [`Input::Done`].
    GiveBack {
        /// Usage taken for a report that was not written.
        usage: BTreeMap<TenantName, u64>,
        /// The capacity change it carried.
        capacity: Option<BTreeMap<String, u64>>,
    },
    /// Read at most this many unacknowledged reports, oldest first; [`Input::Unacked`].
    ReadUnacked(usize),
    /// Send this report (as read back from the journal); [`Input::Answered`].
    Send(UsageReport),
    /// Drop the reports through this sequence from the journal; [`Input::Acked`].
    AckThrough(u64),
    /// Register the cluster (its capacity); [`Input::Registered`].
    Register,
    /// The program ended.
    Finish(Result<(), RoundError>),
}

/// Why a round did not complete.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RoundError {
    /// After a takeover or start, the first report waits for the first listing of the
    /// cluster's pods and for the policy (the usage gap cannot be sized before).
    #[error("the first report waits for the agent's first listing of the cluster's pods and for the policy")]
    NotReady,
    /// The journal failed (not this round's own report: that is [`RoundError::Refused`]).
    #[error("usage journal: {}", .0 .0)]
    Journal(JournalFault),
    /// The journal refused this round's own report (no room on the device, or the
    /// backlog at its limit); the reports it holds went out and were answered (or there
    /// were none). The round's usage waits for the next round.
    #[error("the usage journal refused this round's report (its usage waits for the next round): {}", .0 .0)]
    Refused(JournalFault),
    /// No usable answer from the control plane.
    #[error("{0}")]
    Call(CallError),
    /// The control plane expects another sequence number than the journal's next.
    #[error("sequence gap: report {sent} sent, the control plane expects {}", expected.map_or_else(|| "another".to_string(), |e| e.to_string()))]
    Gap {
        /// The report sent.
        sent: u64,
        /// What it expects.
        expected: Option<u64>,
    },
    /// After a takeover the journal's reports were renumbered to follow the control
    /// plane's sequence; they go out next round.
    #[error("reports renumbered after a takeover; sending them next round")]
    Renumbered,
    /// The control plane did not know the cluster; it was registered again.
    #[error("the control plane did not know this cluster; registered it again")]
    NotRegistered,
}

impl RoundError {
    /// Whether the next round should wait longer (the control plane is the problem). A
    /// round that failed only because the journal refused its own report still sent what
    /// the journal holds and had it answered: backing off would not free the disk, and
    /// would let the lease, renewed only in report answers, run out.
    pub fn backs_off(&self) -> bool {
        !matches!(self, RoundError::Refused(_))
    }
}

/// Report rounds failed in a row, for the backoff, after a round's `result`.
pub fn failures_after(result: &Result<(), RoundError>, failures: u32) -> u32 {
    match result {
        Ok(()) => 0,
        Err(e) if !e.backs_off() => 0,
        Err(_) => failures.saturating_add(1),
    }
}

/// How long to wait before the next round after `failures` failed rounds in a row:
/// the interval, then 2x, 4x, up to 8x, plus `jitter_ms` while failing (so agents cut
/// off together do not come back in step).
pub fn next_round_in_ms(every_ms: u64, failures: u32, jitter_ms: u64) -> u64 {
    let factor = 1u64 << failures.min(3);
    every_ms.saturating_mul(factor) + if failures > 0 { jitter_ms } else { 0 }
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

/// How long a lease kept in the cluster may still be enforced by a new process: what
/// was left of its life when kept (`usable_until_unix_ms` on the writer's wall clock)
/// minus the margin again (the writer's clock may run ahead of this one's), and never
/// longer than any process could from a request sent now.
pub fn restorable_for_ms(lease: &Lease, usable_until_unix_ms: u64, unix_now_ms: u64) -> u64 {
    usable_until_unix_ms
        .saturating_sub(unix_now_ms)
        .saturating_sub(lease.margin_ms)
        .min(lease.duration_ms.saturating_sub(lease.margin_ms.saturating_mul(2)))
}

/// What comes after a lease was taken.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Then {
    /// Acknowledge report `seq` (window ending `end_ms`) and go on sending.
    Ack { seq: u64, end_ms: u64 },
    /// A duplicate right after a takeover: ask where the control plane stands, renumber.
    Conflict,
    /// End the program with this.
    Finish(Result<(), RoundError>),
}

/// Where a program stands: the input it waits for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Stage {
    Idle,
    Rejournaling,
    Describing {
        conflict: bool,
    },
    Following {
        conflict: bool,
        info: Option<ClusterInfo>,
    },
    Rebasing,
    Taking,
    Writing {
        usage: BTreeMap<TenantName, u64>,
        capacity: Option<BTreeMap<String, u64>>,
        window: UsageWindow,
        notes: Notes,
    },
    GivingBack,
    Reading,
    Sending(UsageReport),
    EnforcingFirst {
        held: Lease,
        next: AgentLease,
        kept_elsewhere: bool,
        then: Then,
    },
    SavingLease {
        next: AgentLease,
        epoch: u64,
        kept_elsewhere: bool,
        then: Then,
    },
    Enforcing {
        result: Result<(), JournalFault>,
        then: Then,
    },
    Acking {
        seq: u64,
        end_ms: u64,
        settles_conflict: bool,
    },
    AckedOnSend,
    RenumberingGap {
        sent: u64,
        expected: u64,
    },
    Registering {
        finish: Result<(), RoundError>,
    },
}

type Notes = (Vec<EvictionNote>, Vec<PodDecision>);

/// The agent's side of the report protocol (see the module docs).
#[derive(Clone, Debug)]
pub struct Reporter {
    cluster: ClusterName,
    lease: AgentLease,
    journaled_epoch: u64,
    kept_epoch: u64,
    acked_seq: u64,
    acked_through_ms: u64,
    renumber_on_conflict: bool,
    takeover_pending: bool,
    window_start_ms: u64,
    unwritten: Notes,
    refused: Option<JournalFault>,
    queue: VecDeque<UsageReport>,
    pending_ready: bool,
    stage: Stage,
    faults: Faults,
}

impl Reporter {
    /// The protocol for `cluster`, enforcing `lease` (read from the journal, which
    /// holds it), metering from `window_start_ms` (agent wall clock). Without a state
    /// store, the kept state never limits what reports acknowledge.
    pub fn new(cluster: ClusterName, lease: AgentLease, window_start_ms: u64) -> Reporter {
        Reporter {
            journaled_epoch: lease.held_epoch(),
            cluster,
            lease,
            kept_epoch: u64::MAX,
            acked_seq: 0,
            acked_through_ms: 0,
            renumber_on_conflict: false,
            takeover_pending: false,
            window_start_ms,
            unwritten: (Vec::new(), Vec::new()),
            refused: None,
            queue: VecDeque::new(),
            pending_ready: false,
            stage: Stage::Idle,
            faults: Faults::default(),
        }
    }

    /// Turns fault switches on (only with the `fault-injection` feature; otherwise they
    /// stay off).
    pub fn set_faults(&mut self, faults: Faults) {
        self.faults = faults;
    }

    /// The cluster.
    pub fn cluster(&self) -> &ClusterName {
        &self.cluster
    }

    /// The lease state enforced (what [`Effect::Enforce`] last gave).
    pub fn lease(&self) -> &AgentLease {
        &self.lease
    }

    /// The epoch the next report acknowledges: the lease held, but no newer one than
    /// the journal and the kept state hold.
    pub fn acknowledges(&self) -> u64 {
        let held = self.lease.held_epoch();
        let kept = if self.faults.on().ack_unkept {
            u64::MAX
        } else {
            self.kept_epoch
        };
        held.min(kept).min(self.journaled_epoch)
    }

    /// The epoch the journal holds.
    pub fn journaled_epoch(&self) -> u64 {
        self.journaled_epoch
    }

    /// The highest report sequence acknowledged, and the end of its window (Unix ms).
    pub fn acked(&self) -> (u64, u64) {
        (self.acked_seq, self.acked_through_ms)
    }

    /// Takes what the kept state says was acknowledged (it may know more).
    pub fn restore_acked(&mut self, seq: u64, through_ms: u64) {
        self.acked_seq = self.acked_seq.max(seq);
        self.acked_through_ms = self.acked_through_ms.max(through_ms);
    }

    /// The state is kept in the cluster: from now on a report acknowledges no newer
    /// epoch than the kept state holds ([`Reporter::kept`]).
    pub fn keeps_state(&mut self) {
        self.kept_epoch = 0;
    }

    /// The kept state now holds a lease of `epoch`.
    pub fn kept(&mut self, epoch: u64) {
        self.kept_epoch = self.kept_epoch.max(epoch);
    }

    /// This process starts reporting: its first report first finds where the cluster's
    /// counted usage ends. Until the control plane applies one of its reports, a
    /// sequence conflict renumbers as after a takeover: its journal may number behind
    /// the control plane (one lost with its disk starts again at 1), and the answer to
    /// that first question may have come from a node behind the leader or not at all.
    pub fn starts_reporting(&mut self) {
        self.renumber_on_conflict = true;
        self.takeover_pending = true;
    }

    /// This replica took over from another: until the control plane acknowledges one
    /// of its reports, a sequence conflict renumbers its reports to follow the last one
    /// the control plane applied, instead of taking them for duplicates.
    pub fn took_over(&mut self) {
        self.renumber_on_conflict = true;
        self.takeover_pending = true;
    }

    /// Whether the next round must first settle a takeover ([`Effect::RebaseMeter`]).
    pub fn settling(&self) -> bool {
        self.takeover_pending
    }

    /// Where the next report's usage window starts (agent wall clock).
    pub fn window_start_ms(&self) -> u64 {
        self.window_start_ms
    }

    /// Starts a report round. `ready`: the agent can settle a takeover now (it knows
    /// where its meter starts and has a policy); if a takeover waits and it cannot,
    /// the round ends with [`RoundError::NotReady`].
    pub fn begin_round(&mut self, ready: bool) -> Effect {
        self.refused = None;
        self.queue.clear();
        // A lease restored from the kept state that the journal could not take is
        // written again each round, until the journal holds it.
        if let Some(held) = self.lease.lease().filter(|l| l.epoch > self.journaled_epoch).cloned() {
            self.stage = Stage::Rejournaling;
            self.pending_ready = ready;
            return Effect::SaveLease(held);
        }
        self.settle(ready)
    }

    fn settle(&mut self, ready: bool) -> Effect {
        if !self.takeover_pending {
            return self.take_usage();
        }
        if !ready {
            return self.finish(Err(RoundError::NotReady));
        }
        self.takeover_pending = false;
        self.stage = Stage::Describing { conflict: false };
        Effect::Describe
    }

    /// Starts a registration: the answer's lease is taken like a report's.
    pub fn begin_register(&mut self) -> Effect {
        self.stage = Stage::Registering { finish: Ok(()) };
        Effect::Register
    }

    /// Starts taking a lease kept in the cluster by an earlier process, enforceable
    /// until `until_ms` on this process's monotonic clock (`None`: its fallbacks only).
    /// It is enforced even if the journal cannot take it (the kept state holds it).
    pub fn begin_restore(&mut self, lease: Lease, until_ms: Option<Millis>) -> Effect {
        self.kept_epoch = self.kept_epoch.max(lease.epoch);
        let mut next = self.lease.clone();
        let update = next.restore_anchored(lease, until_ms);
        self.take(next, update, true, Then::Finish(Ok(())))
    }

    /// The next step, given what happened.
    pub fn resume(&mut self, input: Input) -> Effect {
        let stage = std::mem::replace(&mut self.stage, Stage::Idle);
        match (stage, input) {
            (Stage::Rejournaling, Input::LeaseSaved(r)) => self.rejournaled(r.is_ok()),
            (Stage::Describing { conflict }, Input::Described(r)) => self.described(conflict, r),
            (Stage::Following { conflict, info }, Input::Renumbered(r)) => self.followed(conflict, info, r),
            (Stage::Rebasing, Input::MeterRebased { window_start_ms }) => {
                self.window_start_ms = window_start_ms;
                self.take_usage()
            }
            (Stage::Taking, Input::Taken(t)) => self.write(t),
            (
                Stage::Writing {
                    usage,
                    capacity,
                    window,
                    notes,
                },
                Input::Written(r),
            ) => self.written(r, usage, capacity, window, notes),
            (Stage::GivingBack, Input::Done) => self.after_write(),
            (Stage::Reading, Input::Unacked(r)) => self.unacked_read(r),
            (Stage::AckedOnSend, Input::Acked(_)) => self.send_current(),
            (Stage::Sending(report), Input::Answered { sent_ms, answer }) => self.answered(report, sent_ms, answer),
            (
                Stage::SavingLease {
                    next,
                    epoch,
                    kept_elsewhere,
                    then,
                },
                Input::LeaseSaved(r),
            ) => self.lease_saved(next, epoch, kept_elsewhere, then, r),
            (Stage::Enforcing { result, then }, Input::Done) => self.after_lease(result, then),
            (
                Stage::EnforcingFirst {
                    held,
                    next,
                    kept_elsewhere,
                    then,
                },
                Input::Done,
            ) => self.save_lease(held, next, kept_elsewhere, then),
            (
                Stage::Acking {
                    seq,
                    end_ms,
                    settles_conflict,
                },
                Input::Acked(r),
            ) => self.acked_through(seq, end_ms, settles_conflict, r),
            (Stage::RenumberingGap { sent, expected }, Input::Renumbered(r)) => {
                let why = r.map_or_else(RoundError::Journal, |_| RoundError::Gap {
                    sent,
                    expected: Some(expected),
                });
                self.finish(Err(why))
            }
            (Stage::Registering { finish }, Input::Registered { sent_ms, result }) => {
                self.registered(sent_ms, result, finish)
            }
            (stage, input) => {
                // A driver bug: an outcome for a step not taken. End the program
                // rather than act on it.
                let why = format!("report round: {input:?} does not answer {stage:?}");
                self.finish(Err(RoundError::Journal(JournalFault(why))))
            }
        }
    }

    /// The first lease is enforced: now journal it.
    fn save_lease(&mut self, held: Lease, next: AgentLease, kept_elsewhere: bool, then: Then) -> Effect {
        self.stage = Stage::SavingLease {
            next,
            epoch: held.epoch,
            kept_elsewhere,
            then,
        };
        Effect::SaveLease(held)
    }

    /// The lease was journaled again (`ok`) or not: the round settles.
    fn rejournaled(&mut self, ok: bool) -> Effect {
        if ok {
            self.journaled_epoch = self.journaled_epoch.max(self.lease.held_epoch());
        }
        let ready = self.pending_ready;
        self.settle(ready)
    }

    /// The unacknowledged reports were read back: send them in order.
    fn unacked_read(&mut self, r: Result<Vec<UsageReport>, JournalFault>) -> Effect {
        match r {
            Ok(reports) => {
                self.queue = reports.into();
                self.send_next()
            }
            Err(e) => self.finish(Err(RoundError::Journal(e))),
        }
    }

    /// Reports through `seq` (ending at `end_ms`) were marked acknowledged.
    fn acked_through(&mut self, seq: u64, end_ms: u64, settles_conflict: bool, r: Result<(), JournalFault>) -> Effect {
        match r {
            Ok(()) => {
                self.acked_seq = self.acked_seq.max(seq);
                self.acked_through_ms = self.acked_through_ms.max(end_ms);
                if settles_conflict {
                    self.renumber_on_conflict = false;
                }
                self.send_next()
            }
            Err(e) => self.finish(Err(RoundError::Journal(e))),
        }
    }

    /// The registration's answer (sent at `sent_ms`); the round then ends with `finish`.
    fn registered(
        &mut self,
        sent_ms: Millis,
        result: Result<Lease, CallError>,
        finish: Result<(), RoundError>,
    ) -> Effect {
        match result {
            Ok(lease) => {
                let mut next = self.lease.clone();
                let update = next.on_lease(lease, sent_ms);
                self.take(next, update, false, Then::Finish(finish))
            }
            Err(e) => self.finish(Err(RoundError::Call(e))),
        }
    }

    fn described(&mut self, conflict: bool, r: Result<ClusterInfo, CallError>) -> Effect {
        match r {
            Ok(info) => {
                self.stage = Stage::Following {
                    conflict,
                    info: Some(info),
                };
                Effect::Renumber {
                    first: info.last_seq + 1,
                    counted: Some(info),
                }
            }
            Err(e) if conflict => self.finish(Err(RoundError::Call(e))),
            // Starting or taking over without an answer: the control plane cuts any
            // overlap of the old leader's reports with ours (report windows), so go on;
            // until one report of ours is applied, a duplicate answer asks again.
            Err(_) => self.rebase(None),
        }
    }

    fn followed(
        &mut self,
        conflict: bool,
        info: Option<ClusterInfo>,
        r: Result<(usize, usize), JournalFault>,
    ) -> Effect {
        if conflict {
            return match r {
                Ok(_) => self.finish(Err(RoundError::Renumbered)),
                Err(e) => self.finish(Err(RoundError::Journal(e))),
            };
        }
        // A journal that could not be renumbered now is renumbered by the first
        // answers instead (the conflict path).
        self.rebase(info)
    }

    fn rebase(&mut self, info: Option<ClusterInfo>) -> Effect {
        self.stage = Stage::Rebasing;
        Effect::RebaseMeter {
            info,
            acked_through_ms: self.acked_through_ms,
        }
    }

    fn take_usage(&mut self) -> Effect {
        use kvota_fairness::federation::{MAX_REPORT_DECISIONS, MAX_REPORT_EVICTIONS};
        self.stage = Stage::Taking;
        Effect::TakeUsage {
            evictions: MAX_REPORT_EVICTIONS.saturating_sub(self.unwritten.0.len()),
            decisions: MAX_REPORT_DECISIONS.saturating_sub(self.unwritten.1.len()),
        }
    }

    fn write(&mut self, t: Taken) -> Effect {
        let window = UsageWindow {
            start_ms: self.window_start_ms,
            end_ms: t.wall_ms,
        };
        self.window_start_ms = t.wall_ms;
        // Notes a refused write left behind go first (no more than a report takes).
        let (mut evictions, mut decisions) = {
            let e = self
                .unwritten
                .0
                .len()
                .min(kvota_fairness::federation::MAX_REPORT_EVICTIONS);
            let d = self
                .unwritten
                .1
                .len()
                .min(kvota_fairness::federation::MAX_REPORT_DECISIONS);
            (
                self.unwritten.0.drain(..e).collect::<Vec<_>>(),
                self.unwritten.1.drain(..d).collect::<Vec<_>>(),
            )
        };
        // The admission state gave no more than fits beside them ([`Effect::TakeUsage`]);
        // anything past a report's limits waits for the next report.
        let room_e = kvota_fairness::federation::MAX_REPORT_EVICTIONS.saturating_sub(evictions.len());
        let room_d = kvota_fairness::federation::MAX_REPORT_DECISIONS.saturating_sub(decisions.len());
        let mut more_e = t.evictions;
        let mut more_d = t.decisions;
        self.unwritten.0.extend(more_e.drain(room_e.min(more_e.len())..));
        self.unwritten.1.extend(more_d.drain(room_d.min(more_d.len())..));
        evictions.extend(more_e);
        decisions.extend(more_d);
        let usage = t
            .tenants
            .iter()
            .map(|(k, r)| (k.clone(), r.used_milli_gpue_ms))
            .collect();
        let report = UsageReport {
            cluster: self.cluster.clone(),
            seq: 0,
            held_epoch: self.acknowledges(),
            capacity: t.capacity.clone(),
            tenants: t.tenants,
            evictions: evictions.clone(),
            decisions: decisions.clone(),
            window: Some(window),
            status: None,
        };
        self.stage = Stage::Writing {
            usage,
            capacity: t.capacity,
            window,
            notes: (evictions, decisions),
        };
        Effect::WriteReport(report)
    }

    fn written(
        &mut self,
        r: Result<UsageReport, JournalFault>,
        usage: BTreeMap<TenantName, u64>,
        capacity: Option<BTreeMap<String, u64>>,
        window: UsageWindow,
        notes: Notes,
    ) -> Effect {
        let Err(e) = r else { return self.after_write() };
        // Nothing taken for the report is lost: the next round carries it.
        if self.window_start_ms == window.end_ms {
            self.window_start_ms = window.start_ms;
        }
        self.unwritten.0.splice(0..0, notes.0);
        self.unwritten.1.splice(0..0, notes.1);
        self.refused = Some(e.clone());
        let faults = self.faults.on();
        if faults.stop_on_refused_report {
            return self.finish(Err(RoundError::Refused(e)));
        }
        let usage = if faults.drop_refused_report {
            BTreeMap::new()
        } else {
            usage
        };
        self.stage = Stage::GivingBack;
        Effect::GiveBack { usage, capacity }
    }

    /// The reports the journal holds go out even when it refused this round's: a
    /// journal full after a long partition drains only through their acknowledgements,
    /// and leases are renewed only in their answers.
    fn after_write(&mut self) -> Effect {
        self.stage = Stage::Reading;
        Effect::ReadUnacked(MAX_RESEND_PER_ROUND)
    }

    fn send_next(&mut self) -> Effect {
        let Some(report) = self.queue.pop_front() else {
            return match self.refused.take() {
                // Not a completed round: what it metered is not in a report yet.
                Some(e) => self.finish(Err(RoundError::Refused(e))),
                None => self.finish(Ok(())),
            };
        };
        if self.faults.on().ack_on_send {
            let seq = report.seq;
            self.queue.push_front(report);
            self.stage = Stage::AckedOnSend;
            return Effect::AckThrough(seq);
        }
        self.stage = Stage::Sending(report.clone());
        Effect::Send(report)
    }

    fn send_current(&mut self) -> Effect {
        match self.queue.pop_front() {
            Some(report) => {
                self.stage = Stage::Sending(report.clone());
                Effect::Send(report)
            }
            None => self.send_next(),
        }
    }

    fn answered(&mut self, report: UsageReport, sent_ms: Millis, answer: Answer) -> Effect {
        match answer {
            Answer::Lease { applied, lease } => {
                let mut next = self.lease.clone();
                let update = next.on_lease(lease, sent_ms);
                let then = if !applied && self.renumber_on_conflict {
                    // Taken for a duplicate right after a takeover: the old leader's
                    // reports used this number (the node asked had not applied its last
                    // ones yet), or it was ours and applied before a crash lost the
                    // acknowledgement; the windows tell the two apart.
                    Then::Conflict
                } else {
                    Then::Ack {
                        seq: report.seq,
                        end_ms: report.window.map_or(0, |w| w.end_ms),
                    }
                };
                self.take(next, update, false, then)
            }
            Answer::Gap { expected } => self.gap(report.seq, expected),
            Answer::NotRegistered => {
                self.stage = Stage::Registering {
                    finish: Err(RoundError::NotRegistered),
                };
                Effect::Register
            }
            Answer::Failed(e) => self.finish(Err(RoundError::Call(e))),
        }
    }

    fn gap(&mut self, sent: u64, expected: Option<u64>) -> Effect {
        match expected {
            Some(e) if self.renumber_on_conflict || (self.faults.on().ack_on_send && e <= sent) => {
                // Took over from another replica: our numbers follow the control plane's.
                self.stage = Stage::RenumberingGap { sent, expected: e };
                Effect::Renumber {
                    first: e,
                    counted: None,
                }
            }
            // The control plane already applied everything before `e`.
            Some(e) if e > sent => {
                self.stage = Stage::Acking {
                    seq: e - 1,
                    end_ms: 0,
                    settles_conflict: false,
                };
                Effect::AckThrough(e - 1)
            }
            _ => self.finish(Err(RoundError::Gap { sent, expected })),
        }
    }

    /// Takes a lease decided on a copy (`next`, after `update`): written to the journal,
    /// then enforced (see [`Effect::SaveLease`]). A renewal of an epoch the journal
    /// holds is enforced even if its write fails; so is a lease kept elsewhere.
    fn take(&mut self, next: AgentLease, update: LeaseUpdate, kept_elsewhere: bool, then: Then) -> Effect {
        let held = match update {
            LeaseUpdate::Adopted | LeaseUpdate::Renewed => next.lease().cloned(),
            LeaseUpdate::Stale | LeaseUpdate::Rejected => None,
        };
        let Some(held) = held else {
            return self.after_lease(Ok(()), then);
        };
        if self.faults.on().enforce_unjournaled {
            self.lease = next.clone();
            self.stage = Stage::EnforcingFirst {
                held,
                next: next.clone(),
                kept_elsewhere,
                then,
            };
            return Effect::Enforce(next);
        }
        self.stage = Stage::SavingLease {
            next,
            epoch: held.epoch,
            kept_elsewhere,
            then,
        };
        Effect::SaveLease(held)
    }

    fn lease_saved(
        &mut self,
        next: AgentLease,
        epoch: u64,
        kept_elsewhere: bool,
        then: Then,
        r: Result<(), JournalFault>,
    ) -> Effect {
        if r.is_ok() {
            self.journaled_epoch = self.journaled_epoch.max(epoch);
        }
        let journal_has_it = self.journaled_epoch >= epoch;
        if self.faults.on().enforce_unjournaled {
            // Enforced already, before the write.
            return self.after_lease(r, then);
        }
        if r.is_ok() || kept_elsewhere || journal_has_it {
            self.lease = next.clone();
            self.stage = Stage::Enforcing { result: r, then };
            return Effect::Enforce(next);
        }
        self.after_lease(r, then)
    }

    fn after_lease(&mut self, result: Result<(), JournalFault>, then: Then) -> Effect {
        match (then, result) {
            (Then::Finish(f), Ok(())) => self.finish(f),
            (Then::Finish(_), Err(e)) => self.finish(Err(RoundError::Journal(e))),
            // The answer's acknowledgement waits for a journal that holds its lease:
            // the round ends, and the report is sent again (answered as a duplicate).
            (_, Err(e)) => self.finish(Err(RoundError::Journal(e))),
            (Then::Ack { seq, end_ms }, Ok(())) => {
                self.stage = Stage::Acking {
                    seq,
                    end_ms,
                    settles_conflict: true,
                };
                Effect::AckThrough(seq)
            }
            (Then::Conflict, Ok(())) => {
                self.stage = Stage::Describing { conflict: true };
                Effect::Describe
            }
        }
    }

    fn finish(&mut self, result: Result<(), RoundError>) -> Effect {
        self.stage = Stage::Idle;
        self.queue.clear();
        Effect::Finish(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvota_fairness::lease::TenantBudget;
    use proptest::prelude::*;

    fn east() -> ClusterName {
        ClusterName::from_static("east")
    }

    fn lease(epoch: u64, budget: u64) -> Lease {
        Lease {
            cluster: east(),
            epoch,
            duration_ms: 60_000,
            margin_ms: 1_000,
            issued_at_ms: 0,
            budgets: [(
                TenantName::from_static("training"),
                TenantBudget {
                    budget,
                    fallback: budget.min(1_000),
                    entitlement: budget,
                    borrow: 0,
                    ceiling: 0,
                },
            )]
            .into_iter()
            .collect(),
        }
    }

    fn report(seq: u64, end_ms: u64) -> UsageReport {
        UsageReport {
            cluster: east(),
            seq,
            held_epoch: 0,
            capacity: None,
            tenants: BTreeMap::new(),
            evictions: Vec::new(),
            decisions: Vec::new(),
            window: Some(UsageWindow {
                start_ms: end_ms.saturating_sub(1_000),
                end_ms,
            }),
            status: Default::default(),
        }
    }

    fn fault() -> JournalFault {
        JournalFault("no space left on device".into())
    }

    /// Runs a program from `first`, answering each effect with `answer`; returns the
    /// effects in order (without the last) and how it finished.
    fn drive(
        r: &mut Reporter,
        first: Effect,
        mut answer: impl FnMut(&Effect) -> Input,
    ) -> (Vec<Effect>, Result<(), RoundError>) {
        let mut seen = Vec::new();
        let mut effect = first;
        for _ in 0..1_000 {
            if let Effect::Finish(result) = effect {
                return (seen, result);
            }
            let input = answer(&effect);
            seen.push(effect);
            effect = r.resume(input);
        }
        panic!("the program did not finish: {seen:?}");
    }

    /// The usual outcome of each effect: everything works, the control plane applies.
    fn works(e: &Effect) -> Input {
        match e {
            Effect::SaveLease(_) => Input::LeaseSaved(Ok(())),
            Effect::Describe => Input::Described(Ok(ClusterInfo::default())),
            Effect::Renumber { .. } => Input::Renumbered(Ok((0, 0))),
            Effect::RebaseMeter { .. } => Input::MeterRebased { window_start_ms: 0 },
            Effect::TakeUsage { .. } => Input::Taken(Taken {
                wall_ms: 5_000,
                ..Taken::default()
            }),
            Effect::WriteReport(r) => Input::Written(Ok(UsageReport { seq: 1, ..r.clone() })),
            Effect::ReadUnacked(_) => Input::Unacked(Ok(vec![report(1, 5_000)])),
            Effect::Send(_) => Input::Answered {
                sent_ms: 0,
                answer: Answer::Lease {
                    applied: true,
                    lease: lease(1, 2_000),
                },
            },
            Effect::AckThrough(_) => Input::Acked(Ok(())),
            Effect::Register => Input::Registered {
                sent_ms: 0,
                result: Ok(lease(1, 2_000)),
            },
            Effect::Enforce(_) | Effect::GiveBack { .. } | Effect::Finish(_) => Input::Done,
        }
    }

    fn kinds(effects: &[Effect]) -> Vec<&'static str> {
        effects
            .iter()
            .map(|e| match e {
                Effect::SaveLease(_) => "save-lease",
                Effect::Enforce(_) => "enforce",
                Effect::Describe => "describe",
                Effect::Renumber { .. } => "renumber",
                Effect::RebaseMeter { .. } => "rebase",
                Effect::TakeUsage { .. } => "take",
                Effect::WriteReport(_) => "write",
                Effect::GiveBack { .. } => "give-back",
                Effect::ReadUnacked(_) => "read",
                Effect::Send(_) => "send",
                Effect::AckThrough(_) => "ack",
                Effect::Register => "register",
                Effect::Finish(_) => "finish",
            })
            .collect()
    }

    fn registered(
        r: &mut Reporter,
        l: Lease,
        saved: Result<(), JournalFault>,
    ) -> (Vec<Effect>, Result<(), RoundError>) {
        let first = r.begin_register();
        drive(r, first, |e| match e {
            Effect::Register => Input::Registered {
                sent_ms: 0,
                result: Ok(l.clone()),
            },
            Effect::SaveLease(_) => Input::LeaseSaved(saved.clone()),
            other => works(other),
        })
    }

    #[test]
    fn a_round_journals_its_report_then_sends_what_the_journal_holds_and_acknowledges_it() {
        let mut r = Reporter::new(east(), AgentLease::new(east()), 4_000);
        let first = r.begin_round(true);
        let (effects, result) = drive(&mut r, first, works);
        assert_eq!(result, Ok(()));
        assert_eq!(
            kinds(&effects),
            ["take", "write", "read", "send", "save-lease", "enforce", "ack"]
        );
        let Some(Effect::WriteReport(written)) = effects.get(1) else {
            panic!("{effects:?}")
        };
        assert_eq!(
            written.window,
            Some(UsageWindow {
                start_ms: 4_000,
                end_ms: 5_000
            }),
            "the window runs from the last report's end"
        );
        assert_eq!(r.acked(), (1, 5_000));
        assert_eq!((r.lease().held_epoch(), r.acknowledges()), (1, 1));
    }

    /// A lease is written to the journal before it is enforced, and a report
    /// acknowledges no epoch the journal does not hold: a restart from the journal never
    /// finds an older epoch than one enforced or acknowledged.
    #[test]
    fn a_lease_is_enforced_and_acknowledged_only_once_the_journal_holds_it() {
        let mut r = Reporter::new(east(), AgentLease::new(east()), 0);
        let first = r.begin_register();
        let Effect::Register = first else { panic!("{first:?}") };
        let save = r.resume(Input::Registered {
            sent_ms: 0,
            result: Ok(lease(1, 2_000)),
        });
        assert_eq!(save, Effect::SaveLease(lease(1, 2_000)));
        assert_eq!(
            (r.lease().held_epoch(), r.acknowledges()),
            (0, 0),
            "not before the write"
        );
        let enforce = r.resume(Input::LeaseSaved(Ok(())));
        assert!(
            matches!(&enforce, Effect::Enforce(l) if l.held_epoch() == 1),
            "{enforce:?}"
        );
        assert_eq!(r.resume(Input::Done), Effect::Finish(Ok(())));
        assert_eq!(r.acknowledges(), 1);
    }

    /// When the journal cannot take a lease: one from the control plane is neither
    /// enforced nor acknowledged; a renewal of an epoch the journal holds is enforced;
    /// one restored from the kept state is enforced (the kept state has it) but
    /// acknowledged only once a round wrote it to the journal.
    #[test]
    fn a_lease_the_journal_cannot_take_is_enforced_only_where_a_restart_finds_it() {
        let mut r = Reporter::new(east(), AgentLease::new(east()), 0);
        assert_eq!(registered(&mut r, lease(1, 2_000), Ok(())).1, Ok(()));
        let (effects, result) = registered(&mut r, lease(2, 5_000), Err(fault()));
        assert!(matches!(result, Err(RoundError::Journal(_))), "{result:?}");
        assert!(!kinds(&effects).contains(&"enforce"), "{effects:?}");
        assert_eq!((r.lease().held_epoch(), r.acknowledges()), (1, 1));
        let (effects, _) = registered(&mut r, lease(1, 2_000), Err(fault()));
        assert!(
            kinds(&effects).contains(&"enforce"),
            "a renewal of a journaled epoch holds"
        );

        let first = r.begin_restore(lease(3, 6_000), Some(30_000));
        let (effects, result) = drive(&mut r, first, |e| match e {
            Effect::SaveLease(_) => Input::LeaseSaved(Err(fault())),
            other => works(other),
        });
        assert!(result.is_err() && kinds(&effects).contains(&"enforce"), "{effects:?}");
        assert_eq!((r.lease().held_epoch(), r.acknowledges()), (3, 1));
        // Each round writes it again until the journal takes it.
        let first = r.begin_round(true);
        assert_eq!(first, Effect::SaveLease(lease(3, 6_000)));
        let next = r.resume(Input::LeaseSaved(Err(fault())));
        assert!(matches!(next, Effect::TakeUsage { .. }), "the round goes on: {next:?}");
        assert_eq!(r.acknowledges(), 1);
        let _ = drive(&mut r, next, |e| match e {
            Effect::ReadUnacked(_) => Input::Unacked(Ok(Vec::new())),
            other => works(other),
        });
        let first = r.begin_round(true);
        assert_eq!(first, Effect::SaveLease(lease(3, 6_000)));
        let _ = r.resume(Input::LeaseSaved(Ok(())));
        assert_eq!(r.acknowledges(), 3, "written by the next round");
    }

    #[test]
    fn a_refused_lease_is_neither_held_nor_written() {
        let mut r = Reporter::new(east(), AgentLease::new(east()), 0);
        let _ = registered(&mut r, lease(3, 2_000), Ok(()));
        let (effects, result) = registered(&mut r, lease(3, 9_000), Ok(()));
        assert_eq!(result, Ok(()));
        assert_eq!(kinds(&effects), ["register"], "the same epoch with other budgets");
        assert_eq!(r.lease().lease().map(|l| l.budget("training")), Some(2_000));
    }

    /// A report the journal refuses loses nothing the round took for it (usage and
    /// capacity go back to the meter, the window does not move on, the notes go into the
    /// next report first), and the reports the journal holds are still sent: the round
    /// fails as the journal's, which does not back the rounds off.
    #[test]
    fn a_refused_report_gives_everything_back_and_still_sends_what_the_journal_holds() {
        let mut r = Reporter::new(east(), AgentLease::new(east()), 1_000);
        let training = TenantName::from_static("training");
        let note = EvictionNote {
            victim: "ml/old".into(),
            ..EvictionNote::default()
        };
        let first = r.begin_round(true);
        let (effects, result) = drive(&mut r, first, |e| match e {
            Effect::TakeUsage { .. } => Input::Taken(Taken {
                wall_ms: 2_000,
                tenants: [(
                    training.clone(),
                    TenantReport {
                        used_milli_gpue_ms: 500,
                        ..TenantReport::default()
                    },
                )]
                .into(),
                evictions: vec![note.clone()],
                decisions: Vec::new(),
                capacity: Some([("nvidia.com/gpu".to_string(), 8_000)].into()),
            }),
            Effect::WriteReport(_) => Input::Written(Err(fault())),
            Effect::ReadUnacked(_) => Input::Unacked(Ok(vec![report(1, 900), report(2, 950)])),
            other => works(other),
        });
        assert!(
            matches!(&result, Err(e @ RoundError::Refused(_)) if !e.backs_off()),
            "{result:?}"
        );
        assert_eq!(
            kinds(&effects),
            [
                "take",
                "write",
                "give-back",
                "read",
                "send",
                "save-lease",
                "enforce",
                "ack",
                "send",
                "save-lease",
                "enforce",
                "ack"
            ]
        );
        assert_eq!(
            effects[2],
            Effect::GiveBack {
                usage: [(training.clone(), 500)].into(),
                capacity: Some([("nvidia.com/gpu".to_string(), 8_000)].into()),
            }
        );
        assert_eq!(r.window_start_ms(), 1_000, "the window does not move on");
        let first = r.begin_round(true);
        let (effects, _) = drive(&mut r, first, works);
        let Some(Effect::WriteReport(next)) = effects.get(1) else {
            panic!("{effects:?}")
        };
        assert_eq!(next.evictions, vec![note], "the refused report's note goes first");
        assert_eq!(next.window.map(|w| w.start_ms), Some(1_000));
    }

    #[test]
    fn a_gap_acknowledges_what_the_control_plane_applied_or_ends_the_round() {
        let mut r = Reporter::new(east(), AgentLease::new(east()), 0);
        let gap = |expected| {
            move |e: &Effect| match e {
                Effect::ReadUnacked(_) => Input::Unacked(Ok(vec![report(5, 1_000)])),
                Effect::Send(_) => Input::Answered {
                    sent_ms: 0,
                    answer: Answer::Gap { expected },
                },
                other => works(other),
            }
        };
        let first = r.begin_round(true);
        let (effects, result) = drive(&mut r, first, gap(Some(7)));
        assert_eq!(result, Ok(()));
        assert!(effects.contains(&Effect::AckThrough(6)), "{effects:?}");
        let first = r.begin_round(true);
        let (_, result) = drive(&mut r, first, gap(Some(3)));
        assert_eq!(
            result,
            Err(RoundError::Gap {
                sent: 5,
                expected: Some(3)
            })
        );
    }

    /// After a takeover the first round asks where the control plane stands, drops the
    /// reports it counted and renumbers the rest after its sequence, and starts the
    /// meter there; a duplicate answer before any report of ours is applied renumbers
    /// again instead of being taken for an acknowledgement.
    #[test]
    fn a_takeover_follows_the_control_planes_sequence() {
        let mut r = Reporter::new(east(), AgentLease::new(east()), 0);
        r.took_over();
        assert_eq!(r.begin_round(false), Effect::Finish(Err(RoundError::NotReady)));
        let info = ClusterInfo {
            last_seq: 10,
            reported_through_ms: 5_000,
        };
        let first = r.begin_round(true);
        let (effects, result) = drive(&mut r, first, |e| match e {
            Effect::Describe => Input::Described(Ok(info)),
            Effect::Send(_) => Input::Answered {
                sent_ms: 0,
                answer: Answer::Lease {
                    applied: false,
                    lease: lease(1, 1_000),
                },
            },
            other => works(other),
        });
        assert_eq!(result, Err(RoundError::Renumbered));
        assert_eq!(
            effects.first().zip(effects.get(1)),
            Some((
                &Effect::Describe,
                &Effect::Renumber {
                    first: 11,
                    counted: Some(info)
                }
            ))
        );
        assert_eq!(
            kinds(&effects)[2..],
            [
                "rebase",
                "take",
                "write",
                "read",
                "send",
                "save-lease",
                "enforce",
                "describe",
                "renumber"
            ]
        );
        // Once a report of ours is applied, a duplicate is an acknowledgement again.
        let first = r.begin_round(true);
        let (effects, result) = drive(&mut r, first, works);
        assert_eq!(result, Ok(()));
        assert!(!kinds(&effects).contains(&"describe"));
    }

    /// A process that starts without learning where the control plane stands (its
    /// describe call failed, or a node behind the leader answered it) may number its
    /// reports behind the control plane's (a journal lost with its disk starts again at
    /// 1): a duplicate answer asks again and renumbers, and is not taken for an
    /// acknowledgement of usage never counted (the chaos soak lost a cluster's usage
    /// this way, seed 218159301589036).
    #[test]
    fn a_start_that_could_not_learn_where_the_count_ends_takes_a_duplicate_for_a_conflict() {
        let info = ClusterInfo {
            last_seq: 41,
            reported_through_ms: 48_000,
        };
        let behind = ClusterInfo {
            last_seq: 0,
            reported_through_ms: 0,
        };
        // The first question unanswered; or answered by a node behind the leader, one
        // that had applied none of the cluster's reports (seed 115159292831527).
        let unanswered = || Input::Described(Err(CallError::Unreachable("cut off".into())));
        let from_behind = || Input::Described(Ok(behind));
        for first_answer in [&unanswered as &dyn Fn() -> Input, &from_behind] {
            let mut r = Reporter::new(east(), AgentLease::new(east()), 0);
            r.starts_reporting();
            let mut asked = 0;
            let first = r.begin_round(true);
            let (effects, result) = drive(&mut r, first, |e| match e {
                Effect::Describe => {
                    asked += 1;
                    if asked == 1 {
                        first_answer()
                    } else {
                        Input::Described(Ok(info))
                    }
                }
                Effect::Send(_) => Input::Answered {
                    sent_ms: 0,
                    answer: Answer::Lease {
                        applied: false,
                        lease: lease(1, 1_000),
                    },
                },
                other => works(other),
            });
            assert_eq!(result, Err(RoundError::Renumbered), "{effects:?}");
            assert!(
                !effects.iter().any(|e| matches!(e, Effect::AckThrough(_))),
                "a duplicate answer acknowledged nothing: {effects:?}"
            );
            assert!(
                effects.contains(&Effect::Renumber {
                    first: 42,
                    counted: Some(info)
                }),
                "{effects:?}"
            );
        }
    }

    #[test]
    fn an_unknown_cluster_registers_again_and_the_round_fails() {
        let mut r = Reporter::new(east(), AgentLease::new(east()), 0);
        let first = r.begin_round(true);
        let (effects, result) = drive(&mut r, first, |e| match e {
            Effect::Send(_) => Input::Answered {
                sent_ms: 0,
                answer: Answer::NotRegistered,
            },
            other => works(other),
        });
        assert_eq!(result, Err(RoundError::NotRegistered));
        assert_eq!(kinds(&effects)[4..], ["register", "save-lease", "enforce"]);
    }

    #[test]
    fn rounds_back_off_while_the_control_plane_fails_but_not_for_a_refused_write() {
        let cut = Err(RoundError::Call(CallError::Unreachable("cut off".into())));
        assert_eq!(failures_after(&cut, 5), 6);
        assert_eq!(failures_after(&Err(RoundError::Refused(fault())), 5), 0);
        assert_eq!(failures_after(&Ok(()), 7), 0);
        assert_eq!(next_round_in_ms(5_000, 0, 99), 5_000);
        assert_eq!(next_round_in_ms(5_000, 1, 99), 10_099);
        assert_eq!(next_round_in_ms(5_000, 9, 0), 40_000, "at most 8x");
    }

    #[test]
    fn a_report_is_counted_when_its_window_ends_by_what_the_control_plane_counted() {
        // Ours, applied before a crash lost the acknowledgement: window ends by `through`.
        assert!(already_counted(&report(7, 20), 9, 20));
        // Written after the counted usage ends: not counted, whatever its number.
        assert!(!already_counted(&report(3, 25), 9, 20));
        // No windowed report applied yet: nothing windowed is counted.
        assert!(!already_counted(&report(1, 5), 9, 0));
        // Older reports without a window: by number.
        let mut old = report(9, 0);
        old.window = None;
        assert!(already_counted(&old, 9, 20));
        old.seq = 10;
        assert!(!already_counted(&old, 9, 20));
    }

    /// One outcome of the kind each effect may have, drawn from `pick`.
    fn any_outcome(e: &Effect, pick: u8) -> Input {
        let ok = pick % 3 != 0;
        match e {
            Effect::SaveLease(_) => Input::LeaseSaved(if ok { Ok(()) } else { Err(fault()) }),
            Effect::Describe => Input::Described(if ok {
                Ok(ClusterInfo {
                    last_seq: u64::from(pick % 4),
                    reported_through_ms: u64::from(pick) * 10,
                })
            } else {
                Err(CallError::Unreachable("x".into()))
            }),
            Effect::Renumber { .. } => Input::Renumbered(if ok { Ok((1, 0)) } else { Err(fault()) }),
            Effect::WriteReport(r) => Input::Written(if ok {
                Ok(UsageReport { seq: 3, ..r.clone() })
            } else {
                Err(fault())
            }),
            Effect::ReadUnacked(_) => {
                Input::Unacked(Ok((1..=u64::from(pick % 4)).map(|s| report(s, s * 10)).collect()))
            }
            Effect::Send(_) => Input::Answered {
                sent_ms: u64::from(pick),
                answer: match pick % 6 {
                    0 => Answer::Gap {
                        expected: Some(u64::from(pick % 5)),
                    },
                    1 => Answer::NotRegistered,
                    2 => Answer::Failed(CallError::Unreachable("x".into())),
                    _ => Answer::Lease {
                        applied: pick % 2 == 0,
                        lease: lease(u64::from(pick % 4) + 1, 1_000 * u64::from(pick % 3)),
                    },
                },
            },
            Effect::AckThrough(_) => Input::Acked(if ok { Ok(()) } else { Err(fault()) }),
            Effect::Register => Input::Registered {
                sent_ms: u64::from(pick),
                result: if ok {
                    Ok(lease(u64::from(pick % 4) + 1, 2_000))
                } else {
                    Err(CallError::Refused("x".into()))
                },
            },
            other => works(other),
        }
    }

    proptest! {
        /// Whatever the outcomes: every program finishes; a lease is enforced only after
        /// a write of it succeeded, or if the journal holds its epoch, or it came from the
        /// kept state; epochs never go back; a report never acknowledges an epoch the
        /// journal does not hold.
        #[test]
        fn whatever_happens_leases_go_to_the_journal_first(picks in proptest::collection::vec(any::<u8>(), 1..400)) {
            let mut r = Reporter::new(east(), AgentLease::new(east()), 0);
            let mut picks = picks.into_iter().cycle().take(2_000);
            let mut last_epoch = 0;
            for program in 0..20u8 {
                let mut effect = match program % 4 {
                    0 => r.begin_register(),
                    1 if program % 7 == 1 => r.begin_restore(lease(u64::from(program), 3_000), Some(10_000)),
                    _ => {
                        if program % 5 == 0 {
                            r.took_over();
                        }
                        r.begin_round(program % 3 != 0)
                    }
                };
                let mut saved_ok: Option<u64> = None;
                let mut steps = 0;
                while !matches!(effect, Effect::Finish(_)) {
                    steps += 1;
                    prop_assert!(steps < 5_000, "the program did not finish");
                    let pick = picks.next().unwrap_or(1);
                    let input = any_outcome(&effect, pick);
                    if let (Effect::SaveLease(l), Input::LeaseSaved(Ok(()))) = (&effect, &input) {
                        saved_ok = Some(l.epoch);
                    }
                    if let Effect::Enforce(next) = &effect {
                        let e = next.held_epoch();
                        prop_assert!(e >= last_epoch, "epoch {e} after {last_epoch}");
                        let restoring = program % 4 == 1 && program % 7 == 1;
                        prop_assert!(
                            saved_ok == Some(e) || r.journaled_epoch() >= e || restoring,
                            "epoch {e} enforced unwritten"
                        );
                        last_epoch = e;
                    }
                    if let Effect::WriteReport(rep) = &effect {
                        prop_assert!(rep.held_epoch <= r.journaled_epoch());
                    }
                    effect = r.resume(input);
                }
                prop_assert!(r.acknowledges() <= r.journaled_epoch());
            }
        }
    }
}
