//! The earliest format of the agent's usage journal (format version 0): a sled database
//! in the agent's data directory, trees `reports` (big-endian sequence -> JSON report)
//! and `meta` (`last_seq`, `lease`). `kvota agent` reads it once, before the agent opens
//! its directory, hands it to [`Journal::import`] and moves the old files aside. It lives
//! here, not in `kvota-member-agent`, so that the agent library needs no sled: this
//! binary links sled anyway, for the control plane.

use std::path::Path;

use kvota_fairness::federation::UsageReport;
use kvota_member_agent::journal::{Imported, Journal, JournalError};

/// Where the old files go after the migration.
pub const RETIRED: &str = "sled-journal.migrated";

fn is_v0(dir: &Path) -> bool {
    dir.join("db").is_file() && dir.join("conf").is_file()
}

fn err(what: &'static str) -> impl FnOnce(sled::Error) -> JournalError {
    move |e| JournalError::Corrupt {
        what,
        why: format!("the previous (sled) journal: {e}"),
    }
}

/// Migrates a version-0 journal in `dir`, if there is one and no journal of the current
/// format: its reports, last sequence number and lease are written to the new journal
/// (durably), then the old files move into [`RETIRED`]. Returns how many reports moved.
pub fn migrate(dir: &Path) -> Result<Option<usize>, JournalError> {
    if Journal::exists_in(dir) {
        return Ok(None);
    }
    let Some(old) = read(dir)? else { return Ok(None) };
    let n = old.reports.len();
    drop(Journal::import(dir, old)?);
    retire(dir)?;
    tracing::info!(reports = n, "usage journal migrated from the earliest (sled) format");
    Ok(Some(n))
}

/// Reads the version-0 journal in `dir`, if there is one.
fn read(dir: &Path) -> Result<Option<Imported>, JournalError> {
    if !is_v0(dir) {
        return Ok(None);
    }
    let db = sled::Config::new().path(dir).open().map_err(err("open"))?;
    let reports_tree = db.open_tree("reports").map_err(err("reports"))?;
    let meta = db.open_tree("meta").map_err(err("meta"))?;
    let mut reports = Vec::new();
    for item in reports_tree.iter() {
        let (_, v) = item.map_err(err("reports"))?;
        reports.push(
            serde_json::from_slice::<UsageReport>(&v).map_err(|e| JournalError::Corrupt {
                what: "report",
                why: format!("in the previous (sled) journal: {e}"),
            })?,
        );
    }
    let last_seq = match meta.get(b"last_seq").map_err(err("last seq"))? {
        None => 0,
        Some(v) => u64::from_be_bytes(v.as_ref().try_into().map_err(|_| JournalError::Corrupt {
            what: "last sequence number",
            why: format!("{} bytes in the previous (sled) journal", v.len()),
        })?),
    };
    let lease = match meta.get(b"lease").map_err(err("lease"))? {
        None => None,
        Some(v) => Some(serde_json::from_slice(&v).map_err(|e| JournalError::Corrupt {
            what: "lease",
            why: format!("in the previous (sled) journal: {e}"),
        })?),
    };
    Ok(Some(Imported {
        reports,
        last_seq,
        lease,
    }))
}

/// Moves the version-0 files into [`RETIRED`] (after the new journal holds their
/// contents durably), so they are not read again and nothing is deleted.
fn retire(dir: &Path) -> Result<(), JournalError> {
    let to = dir.join(RETIRED);
    std::fs::create_dir_all(&to).map_err(|source| JournalError::Io {
        what: "create",
        file: to.display().to_string(),
        source,
    })?;
    let entries = std::fs::read_dir(dir).map_err(|source| JournalError::Io {
        what: "list",
        file: dir.display().to_string(),
        source,
    })?;
    for e in entries.flatten() {
        let name = e.file_name();
        let n = name.to_string_lossy();
        if n == "db" || n == "conf" || n == "blobs" || n.starts_with("snap.") {
            let dest = to.join(&name);
            std::fs::rename(e.path(), &dest).map_err(|source| JournalError::Io {
                what: "move aside",
                file: e.path().display().to_string(),
                source,
            })?;
        }
    }
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| JournalError::Io {
            what: "sync directory",
            file: dir.display().to_string(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use kvota_fairness::federation::{TenantReport, UsageReport};
    use kvota_fairness::lease::{Lease, TenantBudget};
    use kvota_fairness::names::{ClusterName, TenantName};
    use kvota_member_agent::journal::Journal;

    use super::*;

    fn report(seq: u64) -> UsageReport {
        UsageReport {
            cluster: ClusterName::from_static("east"),
            seq,
            held_epoch: 1,
            capacity: None,
            tenants: (0..3)
                .map(|i| {
                    (
                        TenantName::parse(format!("tenant-{i:05}")).expect("name"),
                        TenantReport {
                            used_milli_gpue_ms: seq * 1_000 + i,
                            inuse: i,
                            pending: 0,
                            largest: 0,
                            borrowed: 0,
                        },
                    )
                })
                .collect(),
            evictions: Vec::new(),
            decisions: Vec::new(),
            window: None,
            status: None,
        }
    }

    fn migrate_then_open(dir: &Path) -> Result<Journal, JournalError> {
        assert_eq!(migrate(dir)?, Some(2));
        Journal::open(dir)
    }

    #[test]
    fn a_journal_of_the_previous_sled_format_is_migrated() {
        let dir = tempfile::tempdir().expect("tmp");
        let lease = Lease {
            cluster: ClusterName::from_static("east"),
            epoch: 4,
            duration_ms: 30_000,
            margin_ms: 3_000,
            issued_at_ms: 10,
            budgets: [(
                TenantName::from_static("training"),
                TenantBudget {
                    budget: 2_000,
                    fallback: 1_000,
                    entitlement: 3_000,
                    borrow: 0,
                    ceiling: 0,
                },
            )]
            .into_iter()
            .collect::<BTreeMap<_, _>>(),
        };
        {
            // Written the way the previous agent wrote it.
            let db = sled::Config::new().path(dir.path()).open().expect("sled");
            let reports = db.open_tree("reports").expect("tree");
            let meta = db.open_tree("meta").expect("tree");
            for seq in [5u64, 6] {
                reports
                    .insert(seq.to_be_bytes(), serde_json::to_vec(&report(seq)).expect("json"))
                    .expect("insert");
            }
            meta.insert(b"last_seq", &6u64.to_be_bytes()).expect("insert");
            meta.insert(b"lease", serde_json::to_vec(&lease).expect("json"))
                .expect("insert");
            db.flush().expect("flush");
        }
        // A migration that fails part-way (here its temporary file cannot be created)
        // leaves no journal behind, so the next start imports again instead of finding an
        // empty journal that hides the old one.
        std::fs::create_dir(dir.path().join("journal.kvj.tmp")).expect("obstacle");
        let mut tries = 0;
        let e = loop {
            match migrate(dir.path()) {
                Err(e) if tries < 50 && e.to_string().contains("lock") => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => break e,
                Ok(n) => panic!("migrated {n:?} past the obstacle"),
            }
        };
        assert!(
            !Journal::exists_in(dir.path()),
            "a failed import leaves no journal behind: {e}"
        );
        assert!(dir.path().join("db").is_file(), "the old journal is still in place");
        std::fs::remove_dir(dir.path().join("journal.kvj.tmp")).expect("remove obstacle");
        // sled lets go of its lock when its background threads notice; retry briefly.
        let mut tries = 0;
        let j = loop {
            match migrate_then_open(dir.path()) {
                Ok(j) => break j,
                Err(e) if tries < 50 && e.to_string().contains("lock") => {
                    tries += 1;
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(e) => panic!("migrate: {e}"),
            }
        };
        assert_eq!(j.unacked(10).expect("read"), vec![report(5), report(6)]);
        assert_eq!(j.load_lease(), Some(lease.clone()));
        assert_eq!(j.write(report).expect("w").seq, 7, "numbering goes on");
        assert!(
            dir.path().join("sled-journal.migrated").join("db").is_file(),
            "old files moved aside, not deleted"
        );
        assert!(!dir.path().join("db").exists());
        drop(j);
        // Opened again: read from the new file; nothing migrated twice.
        let j = Journal::open(dir.path()).expect("reopen");
        assert_eq!(migrate(dir.path()).expect("again"), None, "nothing migrated twice");
        assert_eq!(
            j.unacked(10).expect("read").iter().map(|r| r.seq).collect::<Vec<_>>(),
            [5, 6, 7]
        );
        assert_eq!(j.load_lease(), Some(lease));
    }

    #[test]
    fn a_directory_without_the_old_format_is_left_alone() {
        let dir = tempfile::tempdir().expect("tmp");
        assert_eq!(migrate(dir.path()).expect("migrate"), None);
        assert!(!Journal::exists_in(dir.path()), "nothing created");
        let j = Journal::open(dir.path()).expect("open");
        j.write(report).expect("write");
        drop(j);
        assert_eq!(migrate(dir.path()).expect("migrate"), None);
        assert!(
            Journal::import(dir.path(), Imported::default()).is_err(),
            "an import never overwrites a journal"
        );
        assert_eq!(Journal::open(dir.path()).expect("open").last_seq(), 1);
    }
}
