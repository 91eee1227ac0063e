//! The previous format of the usage journal (format version 0): a sled database in the
//! agent's data directory, trees `reports` (big-endian sequence -> JSON report) and
//! `meta` (`last_seq`, `lease`). Read once, when an upgraded agent first opens its
//! directory, then moved aside (see [`crate::journal`]).

use std::path::Path;

use kvota_fairness::federation::UsageReport;
use kvota_fairness::lease::Lease;

use crate::journal::JournalError;

/// What a version-0 journal held.
#[derive(Debug)]
pub struct Old {
    /// Unacknowledged reports, in order.
    pub reports: Vec<UsageReport>,
    /// The last sequence number written.
    pub last_seq: u64,
    /// The last lease saved.
    pub lease: Option<Lease>,
}

/// Where the old files go after the migration.
pub const RETIRED: &str = "sled-journal.migrated";

fn is_v0(dir: &Path) -> bool {
    dir.join("db").is_file() && dir.join("conf").is_file()
}

fn err(what: &'static str) -> impl FnOnce(sled::Error) -> JournalError {
    move |e| JournalError::Corrupt { what, why: format!("the previous (sled) journal: {e}") }
}

/// Reads the version-0 journal in `dir`, if there is one.
pub fn read(dir: &Path) -> Result<Option<Old>, JournalError> {
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
            serde_json::from_slice::<UsageReport>(&v)
                .map_err(|e| JournalError::Corrupt { what: "report", why: format!("in the previous (sled) journal: {e}") })?,
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
        Some(v) => Some(
            serde_json::from_slice(&v)
                .map_err(|e| JournalError::Corrupt { what: "lease", why: format!("in the previous (sled) journal: {e}") })?,
        ),
    };
    Ok(Some(Old { reports, last_seq, lease }))
}

/// Moves the version-0 files into [`RETIRED`] (after the new journal holds their
/// contents durably), so they are not read again and nothing is deleted.
pub fn retire(dir: &Path) -> Result<(), JournalError> {
    let to = dir.join(RETIRED);
    std::fs::create_dir_all(&to).map_err(|source| JournalError::Io { what: "create", path: to.clone(), source })?;
    let entries = std::fs::read_dir(dir).map_err(|source| JournalError::Io { what: "list", path: dir.to_path_buf(), source })?;
    for e in entries.flatten() {
        let name = e.file_name();
        let n = name.to_string_lossy();
        if n == "db" || n == "conf" || n == "blobs" || n.starts_with("snap.") {
            let dest = to.join(&name);
            std::fs::rename(e.path(), &dest).map_err(|source| JournalError::Io { what: "move aside", path: e.path(), source })?;
        }
    }
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| JournalError::Io { what: "sync directory", path: dir.to_path_buf(), source })
}
