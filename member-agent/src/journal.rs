//! The agent's usage journal: every report is written to disk, with its sequence number,
//! *before* it is sent, and kept until the control plane acknowledged it. After a
//! partition or a restart the agent resends what is left, unchanged and in order; the
//! control plane applies each `(cluster, seq)` at most once, so usage is never lost and
//! never counted twice. The last lease received is kept too, so a restarted agent knows
//! its epoch (and enforces the lease's fallbacks) at once.

use std::path::{Path, PathBuf};

use kvota_fairness::federation::UsageReport;
use kvota_fairness::lease::Lease;

/// Reports kept at most. At one report per 5 s this is about 11 days of partition; past
/// it the oldest reports are still kept and new ones are refused, so nothing acknowledged
/// is ever dropped silently (the agent reports the backlog as an error).
pub const MAX_BACKLOG: usize = 200_000;

const LAST_SEQ: &[u8] = b"last_seq";
const LEASE: &[u8] = b"lease";

/// Journal failures.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    /// The directory could not be opened.
    #[error("open usage journal {path}: {source}")]
    Open {
        /// Directory.
        path: PathBuf,
        /// Cause.
        source: sled::Error,
    },
    /// A read or write failed.
    #[error("usage journal: {what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Cause.
        source: sled::Error,
    },
    /// A stored value does not decode (disk damage or a foreign directory).
    #[error("usage journal: {what} is corrupt: {why}")]
    Corrupt {
        /// What.
        what: &'static str,
        /// Why.
        why: String,
    },
    /// Too many unacknowledged reports.
    #[error("usage journal holds {0} unacknowledged reports (limit {MAX_BACKLOG}); the control plane has been unreachable too long")]
    Full(usize),
}

/// The journal: a sled directory.
#[derive(Clone)]
pub struct Journal {
    db: sled::Db,
    reports: sled::Tree,
    meta: sled::Tree,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal").field("backlog", &self.reports.len()).finish()
    }
}

fn io(what: &'static str) -> impl FnOnce(sled::Error) -> JournalError {
    move |source| JournalError::Io { what, source }
}

impl Journal {
    /// Opens (or creates) the journal in `path`.
    pub fn open(path: &Path) -> Result<Journal, JournalError> {
        let db = sled::Config::new()
            .path(path)
            .open()
            .map_err(|source| JournalError::Open { path: path.to_path_buf(), source })?;
        let reports = db.open_tree("reports").map_err(io("open reports"))?;
        let meta = db.open_tree("meta").map_err(io("open meta"))?;
        Ok(Journal { db, reports, meta })
    }

    /// The last sequence number written (0: none yet).
    pub fn last_seq(&self) -> Result<u64, JournalError> {
        match self.meta.get(LAST_SEQ).map_err(io("read last seq"))? {
            None => Ok(0),
            Some(v) => {
                let b: [u8; 8] = v.as_ref().try_into().map_err(|_| JournalError::Corrupt {
                    what: "last sequence number",
                    why: format!("{} bytes", v.len()),
                })?;
                Ok(u64::from_be_bytes(b))
            }
        }
    }

    /// Assigns the next sequence number to the report `build` makes, writes it durably
    /// (fsync) and returns it, ready to send.
    pub fn write(&self, build: impl FnOnce(u64) -> UsageReport) -> Result<UsageReport, JournalError> {
        let backlog = self.reports.len();
        if backlog >= MAX_BACKLOG {
            return Err(JournalError::Full(backlog));
        }
        let seq = self.last_seq()? + 1;
        let mut report = build(seq);
        report.seq = seq;
        let bytes = serde_json::to_vec(&report).map_err(|e| JournalError::Corrupt { what: "report", why: e.to_string() })?;
        let mut batch = sled::Batch::default();
        batch.insert(&seq.to_be_bytes(), bytes);
        self.reports.apply_batch(batch).map_err(io("write report"))?;
        self.meta.insert(LAST_SEQ, &seq.to_be_bytes()).map_err(io("write last seq"))?;
        self.db.flush().map_err(io("flush"))?;
        Ok(report)
    }

    /// Gives the unacknowledged reports consecutive sequence numbers starting at
    /// `first` (keeping their order and contents) and continues numbering after them.
    /// Returns how many were renumbered.
    pub fn renumber_from(&self, first: u64) -> Result<usize, JournalError> {
        self.renumber_keeping(first, |_| true).map(|(kept, _)| kept)
    }

    /// [`Journal::renumber_from`] for the reports `keep` accepts; the others are dropped.
    /// Returns how many were kept and how many dropped.
    pub fn renumber_keeping(&self, first: u64, keep: impl Fn(&UsageReport) -> bool) -> Result<(usize, usize), JournalError> {
        let all = self.unacked(usize::MAX)?;
        let total = all.len();
        let mut batch = sled::Batch::default();
        for r in &all {
            batch.remove(&r.seq.to_be_bytes());
        }
        let reports: Vec<UsageReport> = all.into_iter().filter(|r| keep(r)).collect();
        let mut last = first.saturating_sub(1);
        for (i, r) in reports.iter().enumerate() {
            let mut r = r.clone();
            r.seq = first + u64::try_from(i).unwrap_or(u64::MAX);
            last = r.seq;
            let bytes = serde_json::to_vec(&r).map_err(|e| JournalError::Corrupt { what: "report", why: e.to_string() })?;
            batch.insert(&r.seq.to_be_bytes(), bytes);
        }
        self.reports.apply_batch(batch).map_err(io("renumber reports"))?;
        self.meta.insert(LAST_SEQ, &last.to_be_bytes()).map_err(io("write last seq"))?;
        self.db.flush().map_err(io("flush"))?;
        Ok((reports.len(), total - reports.len()))
    }

    /// Unacknowledged reports, oldest first (at most `limit`).
    pub fn unacked(&self, limit: usize) -> Result<Vec<UsageReport>, JournalError> {
        self.reports
            .iter()
            .take(limit)
            .map(|item| {
                let (_, v) = item.map_err(io("read reports"))?;
                serde_json::from_slice(&v).map_err(|e| JournalError::Corrupt { what: "report", why: e.to_string() })
            })
            .collect()
    }

    /// Number of unacknowledged reports.
    pub fn backlog(&self) -> usize {
        self.reports.len()
    }

    /// The control plane applied every report up to `seq` (it acknowledged `seq`, or
    /// asked for `seq + 1` next): drop them. Not flushed: should they reappear after a
    /// crash, resending them is answered as a duplicate and changes nothing.
    pub fn ack_through(&self, seq: u64) -> Result<(), JournalError> {
        let mut batch = sled::Batch::default();
        for item in self.reports.range(..=seq.to_be_bytes()) {
            let (k, _) = item.map_err(io("read reports"))?;
            batch.remove(k);
        }
        self.reports.apply_batch(batch).map_err(io("drop acknowledged reports"))
    }

    /// Keeps the lease last received (fsync), for a restart.
    pub fn save_lease(&self, lease: &Lease) -> Result<(), JournalError> {
        let bytes = serde_json::to_vec(lease).map_err(|e| JournalError::Corrupt { what: "lease", why: e.to_string() })?;
        self.meta.insert(LEASE, bytes).map_err(io("write lease"))?;
        self.db.flush().map_err(io("flush"))?;
        Ok(())
    }

    /// The lease last saved, if any.
    pub fn load_lease(&self) -> Result<Option<Lease>, JournalError> {
        match self.meta.get(LEASE).map_err(io("read lease"))? {
            None => Ok(None),
            Some(v) => serde_json::from_slice(&v)
                .map(Some)
                .map_err(|e| JournalError::Corrupt { what: "lease", why: e.to_string() }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvota_fairness::federation::TenantReport;
    use kvota_fairness::lease::{AgentLease, LeaseStatus, TenantBudget};
    use std::collections::BTreeMap;

    /// Reopens a journal closed a moment ago in this same process: sled's background
    /// flusher may still hold the directory lock briefly after the last handle is dropped
    /// (a restarted agent is a new process, whose exit released it).
    fn reopen(dir: &Path) -> Journal {
        let mut tries = 0;
        loop {
            match Journal::open(dir) {
                Ok(j) => return j,
                Err(e) if tries < 50 && e.to_string().contains("lock") => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
                Err(e) => panic!("reopen {}: {e}", dir.display()),
            }
        }
    }

    fn report(used: u64) -> impl FnOnce(u64) -> UsageReport {
        move |seq| UsageReport {
            cluster: "east".into(),
            seq,
            held_epoch: 3,
            capacity: None,
            tenants: [("training".to_string(), TenantReport { used_milli_gpue_ms: used, inuse: 1_000, pending: 0 })].into(),
            evictions: Vec::new(),
            window: None,
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
        let j = reopen(dir.path());
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
        let j = reopen(dir.path());
        let left = j.unacked(100).expect("read");
        assert_eq!(left.iter().map(|r| r.seq).collect::<Vec<_>>(), [2, 3]);
        assert_eq!(left[0].tenants["training"].used_milli_gpue_ms, 20, "resent unchanged");
        // Numbering continues after a restart, even with everything acknowledged.
        j.ack_through(3).expect("ack");
        assert_eq!(j.backlog(), 0);
        drop(j);
        let j = reopen(dir.path());
        assert_eq!(j.write(report(40)).expect("w").seq, 4);
    }

    #[test]
    fn a_restarted_agent_enforces_the_saved_lease_fallback_at_once() {
        let dir = tempfile::tempdir().expect("tmp");
        let lease = Lease {
            cluster: "east".into(),
            epoch: 7,
            duration_ms: 30_000,
            margin_ms: 3_000,
            issued_at_ms: 1,
            budgets: [("training".to_string(), TenantBudget { budget: 8_000, fallback: 3_000, entitlement: 9_000 })]
                .into_iter()
                .collect::<BTreeMap<_, _>>(),
        };
        Journal::open(dir.path()).expect("open").save_lease(&lease).expect("save");
        let back = reopen(dir.path()).load_lease().expect("load").expect("some");
        assert_eq!(back, lease);
        let agent = AgentLease::restored(back);
        assert_eq!(agent.held_epoch(), 7);
        assert_eq!(agent.status(0), LeaseStatus::Safe);
        assert_eq!(agent.budget("training", 0), 3_000);
    }

    #[test]
    fn corrupt_values_are_reported_not_panicked_on() {
        let dir = tempfile::tempdir().expect("tmp");
        let j = Journal::open(dir.path()).expect("open");
        j.meta.insert(LAST_SEQ, &b"abc"[..]).expect("poke");
        assert!(matches!(j.last_seq(), Err(JournalError::Corrupt { .. })));
        j.meta.insert(LEASE, &b"{"[..]).expect("poke");
        assert!(matches!(j.load_lease(), Err(JournalError::Corrupt { .. })));
    }
}
