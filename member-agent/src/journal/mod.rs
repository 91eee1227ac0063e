//! The agent's usage journal: every report is written to disk, with its sequence number,
//! *before* it is sent, and kept until the control plane acknowledged it. After a
//! partition or a restart the agent resends what is left, unchanged and in order; the
//! control plane applies each `(cluster, seq)` at most once, so usage is never lost and
//! never counted twice. The last lease received is kept too, so a restarted agent knows
//! its epoch (and enforces the lease's fallbacks) at once.
//!
//! # Format (version 2)
//!
//! One append-only file, `journal.kvj`, in the agent's data directory:
//!
//! ```text
//! header   "KVJ\0" | format version (u32 LE) = 2
//! record   payload length (u32 LE) | CRC-32 of kind and payload (u32 LE) | kind (u8) | payload
//! kinds    2 ack         u64 LE: every report up to this sequence is acknowledged
//!          4 last seq    u64 LE: numbering goes on after this (written when compacting)
//!          5 report      protobuf kvota.v1.ReportRequest: the report as it is sent
//!          6 lease       protobuf kvota.v1.Lease: the lease last received
//! ```
//!
//! Reports and leases are stored as the protobuf messages they travel in, the one
//! serialized form of each (`proto/`), checked on reading as a message from the network
//! is. Format 1 held them as JSON of the core types (kinds 1 and 3); a format-1 file is
//! read and rewritten in format 2 when the journal opens (an agent of format 1 refuses a
//! format-2 file as newer; see docs/operations.md, "Upgrades").
//!
//! Every write that matters (a report, a lease) is followed by `fdatasync` before the
//! call returns; so is the creation of the file and every compaction (write a new file,
//! sync it, rename it over the old one, sync the directory). Acknowledgements are
//! appended without a sync: one lost in a crash only makes the agent resend a report
//! the control plane answers as a duplicate.
//!
//! Opening reads the file through. A record cut short at the end of the file, or a
//! last record whose checksum fails (a write torn by a crash or power loss), is cut off
//! and the file truncated there: it was never acknowledged, since its sync had not
//! returned. A record whose checksum fails with more records after it is damage, not a
//! torn write: opening fails with an error naming the offset, and nothing is changed.
//! A file of a newer format version than this agent knows is refused, not misread.
//!
//! The logic runs over a [`Disk`]: the agent's [`FileDisk`], or a simulated one (the
//! chaos world's, with delays, failed and torn writes and crashes).
//!
//! An agent of an earlier version kept its journal in a sled database in the same
//! directory. This crate does not read sled (a member cluster's agent carries no storage
//! engine of the control plane's); the `kvota` binary reads such a journal before the
//! agent opens its directory and hands it to [`Journal::import`].

mod disk;
mod format;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use kvota_fairness::federation::UsageReport;
use kvota_fairness::lease::Lease;

#[cfg(any(test, feature = "fault-injection"))]
pub use self::disk::MemDisk;
pub use self::disk::{Disk, FileDisk};
use self::format::{corrupt, frame, HEADER_LEN, KIND_ACK, KIND_LAST_SEQ, KIND_LEASE, KIND_REPORT, RECORD_HEAD};
pub use self::format::{scan, Record, Scan, FORMAT_VERSION, MAX_RECORD_BYTES};

/// Reports kept at most. At one report per 5 s this is about 11 days of partition; past
/// it the oldest reports are still kept and new ones are refused, so nothing acknowledged
/// is ever dropped silently (the agent reports the backlog as an error).
pub const MAX_BACKLOG: usize = 200_000;

/// The journal's file name in the agent's data directory.
pub const FILE: &str = "journal.kvj";

/// Compact once the file is this large and at least twice what it holds live.
const COMPACT_MIN_BYTES: u64 = 4 << 20;

/// Journal failures.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The file could not be opened, read, written or synced.
    #[error("usage journal {file}: {what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        file: String,
        /// Cause.
        source: std::io::Error,
    },
    /// The file holds something that does not decode (disk damage or a foreign file).
    #[error("usage journal: {what} is corrupt: {why}")]
    Corrupt {
        /// What.
        what: &'static str,
        /// Why.
        why: String,
    },
    /// The file was written by a newer kvota.
    #[error("usage journal {file} is format version {found}, newer than this agent reads ({FORMAT_VERSION}): run the newer agent, or move the file aside (its unacknowledged usage would be lost)")]
    Newer {
        /// The file.
        file: String,
        /// Its version.
        found: u32,
    },
    /// Too many unacknowledged reports.
    #[error("usage journal holds {held} unacknowledged reports (limit {limit}); the control plane has been unreachable too long")]
    Full {
        /// Reports held.
        held: usize,
        /// The journal's limit.
        limit: usize,
    },
}

impl JournalError {
    /// Whether the journal refused a write for lack of room (the device full, or the
    /// backlog at its limit), as opposed to damage or a device that fails otherwise.
    pub fn is_refusal(&self) -> bool {
        match self {
            JournalError::Full { .. } => true,
            JournalError::Io { .. } | JournalError::Corrupt { .. } | JournalError::Newer { .. } => false,
        }
    }
}

/// What was found when opening (for the log).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Opened {
    /// Bytes of a torn last record cut off.
    pub torn_bytes: u64,
    /// The file was of format 1 and was rewritten in the current format.
    pub migrated_from: Option<u32>,
}

/// What a journal of an earlier format held, for [`Journal::import`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Imported {
    /// Unacknowledged reports, in order.
    pub reports: Vec<UsageReport>,
    /// The last sequence number written.
    pub last_seq: u64,
    /// The last lease saved.
    pub lease: Option<Lease>,
}

/// How a journal is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options {
    /// Unacknowledged reports kept at most ([`MAX_BACKLOG`] by default).
    pub max_backlog: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            max_backlog: MAX_BACKLOG,
        }
    }
}

struct Inner {
    disk: Box<dyn Disk>,
    /// Unacknowledged reports: sequence -> where the record's payload is.
    index: BTreeMap<u64, (u64, u32)>,
    last_seq: u64,
    lease: Option<Lease>,
    /// File length (where the next record goes).
    len: u64,
    /// Bytes of the live records (reports kept, lease, header).
    live: u64,
    max_backlog: usize,
}

/// What readers that must not wait on the disk see of the journal (metrics, logs):
/// published each time the lock is released.
#[derive(Debug, Default)]
struct Seen {
    backlog: std::sync::atomic::AtomicUsize,
    last_seq: std::sync::atomic::AtomicU64,
}

/// The journal, locked; publishes what [`Seen`] holds when released.
struct Locked<'a> {
    g: MutexGuard<'a, Inner>,
    seen: &'a Seen,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.g
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        &mut self.g
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.seen
            .backlog
            .store(self.g.index.len(), std::sync::atomic::Ordering::SeqCst);
        self.seen
            .last_seq
            .store(self.g.last_seq, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Runs `f`, which may wait on the disk (an fdatasync, or the journal's lock while
/// another caller's fdatasync runs), without stalling the other tasks of a
/// multi-threaded Tokio runtime: its worker hands them to another thread first
/// (`block_in_place`). Outside a runtime, or on a current-thread one (tests), it just
/// runs.
fn on_disk<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// The journal. Cheap to clone (shared).
#[derive(Clone)]
pub struct Journal {
    inner: Arc<Mutex<Inner>>,
    seen: Arc<Seen>,
    opened: Opened,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal").field("backlog", &self.backlog()).finish()
    }
}

fn io_err(what: &'static str, disk: &dyn Disk) -> impl FnOnce(std::io::Error) -> JournalError {
    let file = disk.describe();
    move |source| JournalError::Io { what, file, source }
}

impl Inner {
    fn append(&mut self, bytes: &[u8], sync: bool) -> Result<u64, JournalError> {
        let at = self.len;
        if let Err(e) = self.disk.write_at(at, bytes) {
            // Leave no half record before the next one: cut back to where it began.
            let _ = self.disk.set_len(at);
            return Err(io_err("write", &*self.disk)(e));
        }
        if sync {
            self.disk.sync().map_err(io_err("fdatasync", &*self.disk))?;
        }
        self.len = at + bytes.len() as u64;
        Ok(at)
    }

    fn read_report(&mut self, offset: u64, len: u32) -> Result<UsageReport, JournalError> {
        let buf = self
            .disk
            .read_at(offset, len as usize)
            .map_err(io_err("read", &*self.disk))?;
        format::decode_report(KIND_REPORT, &buf).map_err(|e| corrupt("report", format!("at offset {offset}: {e}")))
    }

    /// Writes a new file holding only what is live (`reports` in order, the last
    /// sequence number, the lease), durably, in place of the old one.
    fn rewrite(&mut self, reports: &[UsageReport], last_seq: u64) -> Result<(), JournalError> {
        let (bytes, index) = file_bytes(reports, last_seq, self.lease.as_ref())?;
        self.disk.replace(&bytes).map_err(io_err("replace", &*self.disk))?;
        self.index = index;
        self.last_seq = last_seq;
        self.len = bytes.len() as u64;
        self.live = self.len;
        Ok(())
    }

    fn unacked(&mut self, limit: usize) -> Result<Vec<UsageReport>, JournalError> {
        let spots: Vec<(u64, u32)> = self.index.values().take(limit).copied().collect();
        spots.into_iter().map(|(o, l)| self.read_report(o, l)).collect()
    }

    fn maybe_compact(&mut self) -> Result<(), JournalError> {
        if self.len >= COMPACT_MIN_BYTES && self.len >= 2 * self.live.max(1) {
            let all = self.unacked(usize::MAX)?;
            let last = self.last_seq;
            self.rewrite(&all, last)?;
        }
        Ok(())
    }
}

/// A whole journal file holding `reports` (in order), the last sequence number and the
/// lease; with where each report's payload is.
#[allow(clippy::type_complexity)]
fn file_bytes(
    reports: &[UsageReport],
    last_seq: u64,
    lease: Option<&Lease>,
) -> Result<(Vec<u8>, BTreeMap<u64, (u64, u32)>), JournalError> {
    let mut bytes = format::header().to_vec();
    bytes.extend(frame(KIND_LAST_SEQ, &last_seq.to_le_bytes())?);
    if let Some(l) = lease {
        bytes.extend(frame(KIND_LEASE, &format::lease_payload(l))?);
    }
    let mut index = BTreeMap::new();
    for r in reports {
        let payload = format::report_payload(r);
        let offset = (bytes.len() + RECORD_HEAD) as u64;
        let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        bytes.extend(frame(KIND_REPORT, &payload)?);
        index.insert(r.seq, (offset, len));
    }
    Ok((bytes, index))
}

/// What a file's records leave live: unacknowledged reports (where they are), the last
/// sequence number, the lease.
fn replay(inner: &mut Inner, records: Vec<Record>) {
    for rec in records {
        match rec {
            Record::Report { seq, offset, len, .. } => {
                inner.index.insert(seq, (offset, len));
                inner.last_seq = inner.last_seq.max(seq);
            }
            Record::Ack(through) => {
                inner.index.retain(|s, _| *s > through);
            }
            Record::Lease(l) => inner.lease = Some(*l),
            Record::LastSeq(n) => {
                // A compaction (or renumbering) starts numbering here: what came
                // before it in the file is gone.
                inner.last_seq = n;
            }
        }
    }
}

impl Journal {
    /// Opens (or creates) the journal in directory `dir`.
    pub fn open(dir: &Path) -> Result<Journal, JournalError> {
        Journal::open_on(Box::new(FileDisk::new(dir, FILE)), Options::default())
    }

    /// Opens (or creates) the journal on `disk`.
    pub fn open_on(mut disk: Box<dyn Disk>, options: Options) -> Result<Journal, JournalError> {
        let bytes = disk.open().map_err(io_err("open", &*disk))?;
        let file = disk.describe();
        let scan = scan(&bytes, &file)?;
        let mut inner = Inner {
            disk,
            index: BTreeMap::new(),
            last_seq: 0,
            lease: None,
            len: 0,
            live: 0,
            max_backlog: options.max_backlog,
        };
        let mut opened = Opened::default();
        if scan.good_len < HEADER_LEN as u64 {
            // New (or cut before its header): start it, durably, with the directory entry.
            inner.disk.set_len(0).map_err(io_err("truncate", &*inner.disk))?;
            inner.append(&format::header(), true)?;
            inner.disk.sync_dir().map_err(io_err("sync directory", &*inner.disk))?;
        } else {
            if scan.good_len < bytes.len() as u64 {
                opened.torn_bytes = bytes.len() as u64 - scan.good_len;
                inner
                    .disk
                    .set_len(scan.good_len)
                    .map_err(io_err("cut the torn tail", &*inner.disk))?;
                inner.disk.sync().map_err(io_err("fdatasync", &*inner.disk))?;
                tracing::warn!(file = %file, bytes = opened.torn_bytes, "usage journal: cut a torn last record (a write interrupted by a crash; it was never acknowledged)");
            }
            inner.len = scan.good_len;
        }
        if scan.version == 1 {
            migrate_v1(&mut inner, &bytes, scan.records)?;
            opened.migrated_from = Some(1);
            tracing::info!(file = %file, "usage journal: rewritten from format 1 in format {FORMAT_VERSION}");
        } else {
            replay(&mut inner, scan.records);
        }
        inner.live = inner.len;
        let seen = Seen {
            backlog: inner.index.len().into(),
            last_seq: inner.last_seq.into(),
        };
        Ok(Journal {
            inner: Arc::new(Mutex::new(inner)),
            seen: Arc::new(seen),
            opened,
        })
    }

    /// Whether directory `dir` holds a journal file (a new agent's directory does not).
    pub fn exists_in(dir: &Path) -> bool {
        dir.join(FILE).exists()
    }

    /// Creates the journal in `dir` holding what a journal of an earlier format held
    /// (durably, before this returns), for the caller that read that format.
    ///
    /// Refused if `dir` already holds a journal file: that one is newer than anything
    /// an earlier format could hold, and nothing in it is overwritten.
    pub fn import(dir: &Path, old: Imported) -> Result<Journal, JournalError> {
        if Journal::exists_in(dir) {
            return Err(corrupt(
                "import",
                format!(
                    "{} already holds a usage journal; an earlier format is not imported over it",
                    dir.display()
                ),
            ));
        }
        // The whole file is written aside and renamed into place: a crash part-way
        // leaves no journal (the earlier one is imported again at the next start),
        // never an empty one that would hide it.
        let mut disk = FileDisk::new(dir, FILE);
        let last = old.last_seq.max(old.reports.iter().map(|r| r.seq).max().unwrap_or(0));
        let (bytes, _) = file_bytes(&old.reports, last, old.lease.as_ref())?;
        std::fs::create_dir_all(dir).map_err(io_err("create directory", &disk))?;
        disk.replace(&bytes).map_err(io_err("write", &disk))?;
        Journal::open(dir)
    }

    fn lock(&self) -> Locked<'_> {
        Locked {
            g: self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner),
            seen: &self.seen,
        }
    }

    /// What opening found (a torn tail cut, a migration).
    pub fn opened(&self) -> &Opened {
        &self.opened
    }

    /// The last sequence number written (0: none yet). Never waits on the disk.
    pub fn last_seq(&self) -> u64 {
        self.seen.last_seq.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Assigns the next sequence number to the report `build` makes, writes it durably
    /// (fdatasync) and returns it, ready to send. Refused ([`JournalError::Full`]) when
    /// the journal holds its limit of unacknowledged reports.
    pub fn write(&self, build: impl FnOnce(u64) -> UsageReport) -> Result<UsageReport, JournalError> {
        on_disk(|| self.write_locked(build))
    }

    fn write_locked(&self, build: impl FnOnce(u64) -> UsageReport) -> Result<UsageReport, JournalError> {
        let mut g = self.lock();
        let held = g.index.len();
        if held >= g.max_backlog {
            return Err(JournalError::Full {
                held,
                limit: g.max_backlog,
            });
        }
        let seq = g.last_seq + 1;
        let mut report = build(seq);
        report.seq = seq;
        let payload = format::report_payload(&report);
        let bytes = frame(KIND_REPORT, &payload)?;
        let at = g.append(&bytes, true)?;
        g.index.insert(
            seq,
            (
                at + RECORD_HEAD as u64,
                u32::try_from(payload.len()).unwrap_or(u32::MAX),
            ),
        );
        g.last_seq = seq;
        g.live += bytes.len() as u64;
        Ok(report)
    }

    /// Gives the unacknowledged reports consecutive sequence numbers starting at
    /// `first` (keeping their order and contents) and continues numbering after them.
    /// Returns how many were renumbered.
    pub fn renumber_from(&self, first: u64) -> Result<usize, JournalError> {
        self.renumber_keeping(first, |_| true).map(|(kept, _)| kept)
    }

    /// [`Journal::renumber_from`] for the reports `keep` accepts; the others are dropped.
    /// Returns how many were kept and how many dropped. Durable when it returns (the
    /// file is rewritten and synced).
    pub fn renumber_keeping(
        &self,
        first: u64,
        keep: impl Fn(&UsageReport) -> bool,
    ) -> Result<(usize, usize), JournalError> {
        on_disk(|| self.renumber_locked(first, keep))
    }

    fn renumber_locked(&self, first: u64, keep: impl Fn(&UsageReport) -> bool) -> Result<(usize, usize), JournalError> {
        let mut g = self.lock();
        let all = g.unacked(usize::MAX)?;
        let total = all.len();
        let mut reports: Vec<UsageReport> = all.into_iter().filter(|r| keep(r)).collect();
        let mut last = first.saturating_sub(1);
        for (i, r) in reports.iter_mut().enumerate() {
            r.seq = first + u64::try_from(i).unwrap_or(u64::MAX);
            last = r.seq;
        }
        g.rewrite(&reports, last)?;
        Ok((reports.len(), total - reports.len()))
    }

    /// Unacknowledged reports, oldest first (at most `limit`).
    pub fn unacked(&self, limit: usize) -> Result<Vec<UsageReport>, JournalError> {
        on_disk(|| self.lock().unacked(limit))
    }

    /// Number of unacknowledged reports. Never waits on the disk.
    pub fn backlog(&self) -> usize {
        self.seen.backlog.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The control plane applied every report up to `seq` (it acknowledged `seq`, or
    /// asked for `seq + 1` next): drop them. Not synced: should they reappear after a
    /// crash, resending them is answered as a duplicate and changes nothing.
    pub fn ack_through(&self, seq: u64) -> Result<(), JournalError> {
        on_disk(|| self.ack_locked(seq))
    }

    fn ack_locked(&self, seq: u64) -> Result<(), JournalError> {
        let mut g = self.lock();
        if g.index.keys().next().is_none_or(|s| *s > seq) {
            return Ok(());
        }
        let gone: u64 = g
            .index
            .range(..=seq)
            .map(|(_, (_, l))| u64::from(*l) + RECORD_HEAD as u64)
            .sum();
        g.index.retain(|s, _| *s > seq);
        g.live = g.live.saturating_sub(gone);
        g.append(&frame(KIND_ACK, &seq.to_le_bytes())?, false)?;
        g.maybe_compact()
    }

    /// Keeps the lease last received (fdatasync), for a restart.
    pub fn save_lease(&self, lease: &Lease) -> Result<(), JournalError> {
        on_disk(|| {
            let mut g = self.lock();
            let bytes = frame(KIND_LEASE, &format::lease_payload(lease))?;
            g.append(&bytes, true)?;
            g.lease = Some(lease.clone());
            g.maybe_compact()
        })
    }

    /// The lease last saved, if any.
    pub fn load_lease(&self) -> Option<Lease> {
        on_disk(|| self.lock().lease.clone())
    }
}

/// Reads what a format-1 file holds (reports and lease as JSON) and rewrites it, whole
/// and durably, in the current format.
fn migrate_v1(inner: &mut Inner, bytes: &[u8], records: Vec<Record>) -> Result<(), JournalError> {
    let mut reports: BTreeMap<u64, UsageReport> = BTreeMap::new();
    let mut last_seq = 0;
    for rec in records {
        match rec {
            Record::Report { seq, offset, len, kind } => {
                let start = usize::try_from(offset).unwrap_or(usize::MAX);
                let payload = start
                    .checked_add(len as usize)
                    .and_then(|end| bytes.get(start..end))
                    .ok_or_else(|| corrupt("report", format!("at offset {offset}: past the end")))?;
                let r = format::decode_report(kind, payload)
                    .map_err(|e| corrupt("report", format!("at offset {offset}: {e}")))?;
                reports.insert(seq, r);
                last_seq = last_seq.max(seq);
            }
            Record::Ack(through) => reports.retain(|s, _| *s > through),
            Record::Lease(l) => inner.lease = Some(*l),
            Record::LastSeq(n) => last_seq = n,
        }
    }
    let reports: Vec<UsageReport> = reports.into_values().collect();
    inner.rewrite(&reports, last_seq)
}

#[cfg(test)]
mod tests {
    use super::format::header;
    use super::*;
    use kvota_fairness::federation::TenantReport;
    use kvota_fairness::lease::{AgentLease, LeaseStatus, TenantBudget};
    use kvota_fairness::names::ClusterName;
    use kvota_fairness::names::TenantName;
    use proptest::prelude::*;

    fn report(used: u64) -> impl FnOnce(u64) -> UsageReport {
        move |seq| UsageReport {
            cluster: ClusterName::from_static("east"),
            seq,
            held_epoch: 3,
            capacity: None,
            tenants: [(
                TenantName::from_static("training"),
                TenantReport {
                    used_milli_gpue_ms: used,
                    inuse: 1_000,
                    pending: 0,
                    largest: 0,
                    borrowed: 0,
                },
            )]
            .into(),
            evictions: Vec::new(),
            decisions: Vec::new(),
            window: None,
            status: None,
        }
    }

    fn lease() -> Lease {
        Lease {
            cluster: ClusterName::from_static("east"),
            epoch: 7,
            duration_ms: 30_000,
            margin_ms: 3_000,
            issued_at_ms: 1,
            budgets: [(
                TenantName::from_static("training"),
                TenantBudget {
                    budget: 8_000,
                    fallback: 3_000,
                    entitlement: 9_000,
                    borrow: 0,
                    ceiling: 0,
                },
            )]
            .into_iter()
            .collect::<BTreeMap<_, _>>(),
        }
    }

    #[test]
    fn renumbering_keeps_order_drops_what_it_is_told_and_survives_a_restart() {
        let dir = tempfile::tempdir().expect("tmp");
        {
            let j = Journal::open(dir.path()).expect("open");
            for used in [10, 20, 30] {
                j.write(report(used)).expect("w");
            }
            let used = |r: &UsageReport| r.tenants["training"].used_milli_gpue_ms;
            assert_eq!(j.renumber_keeping(10, |r| used(r) != 20).expect("renumber"), (2, 1));
        }
        let j = Journal::open(dir.path()).expect("reopen");
        let left: Vec<(u64, u64)> = j
            .unacked(10)
            .expect("unacked")
            .iter()
            .map(|r| (r.seq, r.tenants["training"].used_milli_gpue_ms))
            .collect();
        assert_eq!(left, vec![(10, 10), (11, 30)]);
        assert_eq!(j.write(report(40)).expect("w").seq, 12, "numbering goes on after them");
        // Nothing left to renumber: the next number still follows `first`.
        j.ack_through(12).expect("ack");
        assert_eq!(j.renumber_from(100).expect("renumber"), 0);
        assert_eq!(j.write(report(50)).expect("w").seq, 100);
        drop(j);
        assert_eq!(
            Journal::open(dir.path())
                .expect("reopen")
                .write(report(60))
                .expect("w")
                .seq,
            101
        );
    }

    #[test]
    fn reports_survive_restarts_until_acknowledged() {
        let dir = tempfile::tempdir().expect("tmp");
        {
            let j = Journal::open(dir.path()).expect("open");
            assert_eq!(j.write(report(10)).expect("w").seq, 1);
            assert_eq!(j.write(report(20)).expect("w").seq, 2);
            assert_eq!(j.write(report(30)).expect("w").seq, 3);
            j.ack_through(1).expect("ack");
        }
        let j = Journal::open(dir.path()).expect("reopen");
        let left = j.unacked(100).expect("read");
        assert_eq!(left.iter().map(|r| r.seq).collect::<Vec<_>>(), [2, 3]);
        assert_eq!(left[0].tenants["training"].used_milli_gpue_ms, 20, "resent unchanged");
        // Numbering continues after a restart, even with everything acknowledged.
        j.ack_through(3).expect("ack");
        assert_eq!(j.backlog(), 0);
        drop(j);
        let j = Journal::open(dir.path()).expect("reopen");
        assert_eq!(j.write(report(40)).expect("w").seq, 4);
    }

    #[test]
    fn a_restarted_agent_enforces_the_saved_lease_fallback_at_once() {
        let dir = tempfile::tempdir().expect("tmp");
        Journal::open(dir.path())
            .expect("open")
            .save_lease(&lease())
            .expect("save");
        let back = Journal::open(dir.path()).expect("reopen").load_lease().expect("some");
        assert_eq!(back, lease());
        let agent = AgentLease::restored(back);
        assert_eq!(agent.held_epoch(), 7);
        assert_eq!(agent.status(0), LeaseStatus::Safe);
        assert_eq!(agent.budget("training", 0), 3_000);
    }

    #[test]
    fn a_torn_last_record_is_cut_and_damage_in_the_middle_is_an_error() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join(FILE);
        {
            let j = Journal::open(dir.path()).expect("open");
            for used in [10, 20, 30] {
                j.write(report(used)).expect("w");
            }
        }
        let good = std::fs::read(&path).expect("read");
        // Cut anywhere inside the last record: reports 1 and 2 survive, the file is
        // truncated to them, and numbering goes on from 3.
        let last_start = {
            let s = scan(&good, "test").expect("scan");
            match s.records.last() {
                Some(Record::Report { offset, .. }) => *offset - RECORD_HEAD as u64,
                other => panic!("{other:?}"),
            }
        };
        for cut in [last_start + 1, last_start + 9, good.len() as u64 - 1] {
            std::fs::write(&path, &good[..usize::try_from(cut).expect("small")]).expect("write");
            let j = Journal::open(dir.path()).expect("open a torn journal");
            assert_eq!(j.opened().torn_bytes, cut - last_start);
            assert_eq!(
                j.unacked(10).expect("read").iter().map(|r| r.seq).collect::<Vec<_>>(),
                [1, 2]
            );
            assert_eq!(
                std::fs::metadata(&path).expect("meta").len(),
                last_start,
                "truncated to the good part"
            );
            assert_eq!(j.write(report(99)).expect("w").seq, 3);
        }
        // A flipped byte in the last record: torn, cut.
        let mut bad = good.clone();
        let n = bad.len();
        bad[n - 2] ^= 0x40;
        std::fs::write(&path, &bad).expect("write");
        assert_eq!(Journal::open(dir.path()).expect("open").backlog(), 2);
        // A flipped byte in the first record, with records after it: an error that says
        // so, and the file left as it was for a person to look at.
        let mut bad = good.clone();
        bad[HEADER_LEN + RECORD_HEAD + 3] ^= 0x40;
        std::fs::write(&path, &bad).expect("write");
        let e = Journal::open(dir.path()).expect_err("damage");
        assert!(
            e.to_string().contains("checksum mismatch at offset 8") && e.to_string().contains("damaged"),
            "{e}"
        );
        assert_eq!(std::fs::read(&path).expect("read"), bad, "nothing changed");
    }

    #[test]
    fn a_newer_format_or_a_foreign_file_is_refused_not_misread() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join(FILE);
        let mut newer = header();
        newer[4..].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        std::fs::write(&path, newer).expect("write");
        let e = Journal::open(dir.path()).expect_err("newer");
        assert!(
            matches!(e, JournalError::Newer { found: 3, .. }) && e.to_string().contains("newer than this agent reads"),
            "{e}"
        );
        std::fs::write(&path, b"{\"not\": \"a journal\"}").expect("write");
        assert!(Journal::open(dir.path())
            .expect_err("foreign")
            .to_string()
            .contains("not a kvota usage journal"));
        // A record of a kind this version does not know.
        let mut unknown = header().to_vec();
        unknown.extend(format::frame(42, b"?").expect("frame"));
        unknown.extend(format::frame(KIND_ACK, &1u64.to_le_bytes()).expect("frame"));
        std::fs::write(&path, unknown).expect("write");
        assert!(Journal::open(dir.path())
            .expect_err("unknown kind")
            .to_string()
            .contains("unknown kind 42"));
    }

    #[test]
    fn the_file_is_compacted_when_mostly_acknowledged_and_loses_nothing_live() {
        let dir = tempfile::tempdir().expect("tmp");
        let j = Journal::open(dir.path()).expect("open");
        j.save_lease(&lease()).expect("lease");
        let big = |seq| {
            let mut r = report(seq)(seq);
            for i in 0..1_000 {
                r.tenants.insert(
                    TenantName::parse(format!("tenant-{i:04}")).expect("name"),
                    TenantReport {
                        used_milli_gpue_ms: seq,
                        inuse: 1,
                        pending: 2,
                        largest: 0,
                        borrowed: 0,
                    },
                );
            }
            r
        };
        let mut sizes = Vec::new();
        for n in 1..=400u64 {
            j.write(big).expect("w");
            if n > 2 {
                j.ack_through(n - 2).expect("ack");
            }
            sizes.push(std::fs::metadata(dir.path().join(FILE)).expect("meta").len());
        }
        let max = sizes.iter().max().copied().unwrap_or(0);
        assert!(max < 3 * COMPACT_MIN_BYTES, "the file grew to {max} bytes");
        assert!(sizes.windows(2).any(|w| w[1] < w[0]), "never compacted");
        drop(j);
        let j = Journal::open(dir.path()).expect("reopen");
        assert_eq!(
            j.unacked(10).expect("read").iter().map(|r| r.seq).collect::<Vec<_>>(),
            [399, 400]
        );
        assert_eq!(j.load_lease(), Some(lease()));
        assert_eq!(j.write(report(1)).expect("w").seq, 401);
    }

    proptest! {
        /// Any bytes at all: scanning answers, never panics, and the good part it
        /// reports is within the input.
        #[test]
        fn scanning_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..2048), with_header in any::<bool>()) {
            let mut input = if with_header { header().to_vec() } else { Vec::new() };
            input.extend(bytes);
            if let Ok(s) = scan(&input, "fuzz") {
                prop_assert!(usize::try_from(s.good_len).is_ok_and(|g| g <= input.len()));
            }
        }

        /// A valid journal with any single byte changed, or cut anywhere: opening either
        /// fails with an error, or yields a prefix of the reports written (never a report
        /// that was not written, never one out of order).
        #[test]
        fn a_damaged_or_cut_journal_yields_a_prefix_or_an_error(
            n in 1usize..6,
            flip in proptest::option::of((any::<prop::sample::Index>(), 1u8..=255)),
            cut in any::<prop::sample::Index>(),
        ) {
            let disk = MemDisk::new();
            {
                let j = Journal::open_on(Box::new(disk.clone()), Options::default()).expect("open");
                for i in 0..n {
                    j.write(report(u64::try_from(i).unwrap_or(0) * 10)).expect("w");
                }
            }
            let mut bytes = disk.bytes();
            if let Some((i, x)) = flip {
                let i = i.index(bytes.len());
                bytes[i] ^= x;
            }
            let keep = cut.index(bytes.len() + 1);
            bytes.truncate(keep);
            let damaged = MemDisk::with_bytes(bytes);
            if let Ok(j) = Journal::open_on(Box::new(damaged), Options::default()) {
                let seqs: Vec<u64> = j.unacked(100).expect("read").iter().map(|r| r.seq).collect();
                let want: Vec<u64> = (1..=u64::try_from(seqs.len()).unwrap_or(0)).collect();
                prop_assert_eq!(seqs, want);
            }
        }
    }
}

#[cfg(test)]
mod migration {
    use super::format::{header_of, v1_file};
    use super::*;
    use kvota_fairness::federation::{TenantReport, UsageWindow};
    use kvota_fairness::lease::TenantBudget;
    use kvota_fairness::names::{ClusterName, TenantName};

    fn report(seq: u64) -> UsageReport {
        UsageReport {
            cluster: ClusterName::from_static("east"),
            seq,
            held_epoch: 2,
            capacity: Some([("nvidia.com/gpu".to_string(), 8_000)].into()),
            tenants: [(
                TenantName::from_static("training"),
                TenantReport {
                    used_milli_gpue_ms: seq * 7,
                    inuse: 1_000,
                    pending: 500,
                    largest: 500,
                    borrowed: 0,
                },
            )]
            .into(),
            evictions: Vec::new(),
            decisions: Vec::new(),
            window: Some(UsageWindow {
                start_ms: seq * 1_000,
                end_ms: seq * 1_000 + 999,
            }),
            status: Default::default(),
        }
    }

    /// A journal of format 1 (JSON payloads) opens, is rewritten whole in the current
    /// format, and holds exactly what it held: the unacknowledged reports, unchanged, the
    /// numbering and the lease.
    #[test]
    fn a_format_1_journal_is_rewritten_in_the_current_format_and_loses_nothing() {
        let lease = Lease {
            cluster: ClusterName::from_static("east"),
            epoch: 5,
            duration_ms: 30_000,
            margin_ms: 3_000,
            issued_at_ms: 1,
            budgets: [(
                TenantName::from_static("training"),
                TenantBudget {
                    budget: 8_000,
                    fallback: 3_000,
                    entitlement: 9_000,
                    borrow: 1_000,
                    ceiling: 20_000,
                },
            )]
            .into_iter()
            .collect(),
        };
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join(FILE);
        let reports: Vec<UsageReport> = (1..=3).map(report).collect();
        std::fs::write(&path, v1_file(&reports, 1, Some(&lease))).expect("write");
        let j = Journal::open(dir.path()).expect("a format-1 journal opens");
        assert_eq!(j.opened().migrated_from, Some(1));
        assert_eq!(j.unacked(10).expect("read"), reports[1..].to_vec());
        assert_eq!(j.load_lease(), Some(lease.clone()));
        assert_eq!(j.last_seq(), 3);
        let bytes = std::fs::read(&path).expect("read");
        assert_eq!(bytes[..8], header_of(FORMAT_VERSION), "rewritten in the current format");
        drop(j);
        let j = Journal::open(dir.path()).expect("reopen");
        assert_eq!(j.opened().migrated_from, None);
        assert_eq!(j.unacked(10).expect("read"), reports[1..].to_vec());
        assert_eq!(j.write(report).expect("write").seq, 4);
    }
}
