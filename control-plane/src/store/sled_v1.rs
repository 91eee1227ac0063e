//! Data-directory layout 1, read once to migrate it: the sled database earlier builds
//! kept the Raft log, the vote and the snapshot in.
//!
//! Layout 1 is one sled database with three trees: `logs` (each entry as JSON, keyed by
//! its big-endian index), `meta` (`vote`, `node_id`, `committed`, `last_purged_log_id`,
//! `format`, each JSON but the format, a `u32` LE) and `state` (`snapshot_meta` and
//! `snapshot_data`, JSON; `sm`, the same bytes as the snapshot's data).

use std::path::Path;

use openraft::{LogId, SnapshotMeta, Vote};

use super::{StoreError, DIR_FORMAT};
use crate::types::{Node, NodeId};
use crate::wire::Entry;

/// The files sled keeps in a directory (its database file, configuration, blobs and
/// snapshots of its own).
pub fn is_layout_1(dir: &Path) -> bool {
    dir.join("db").is_file() && dir.join("conf").is_file()
}

/// What a layout-1 directory holds.
#[derive(Debug, Default)]
pub struct Layout1 {
    /// The node that owns it.
    pub node_id: Option<NodeId>,
    /// The last vote.
    pub vote: Option<Vote<NodeId>>,
    /// The committed log id as last written.
    pub committed: Option<LogId<NodeId>>,
    /// The purge point.
    pub last_purged: Option<LogId<NodeId>>,
    /// The log entries above the purge point, in order.
    pub entries: Vec<Entry>,
    /// The current snapshot.
    pub snapshot: Option<(SnapshotMeta<NodeId, Node>, Vec<u8>)>,
}

fn sled_err(what: &'static str) -> impl Fn(sled::Error) -> StoreError {
    move |source| StoreError::Sled { what, source }
}

fn json<T: serde::de::DeserializeOwned>(what: &'static str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt {
        what,
        why: format!("in the layout-1 (sled) directory: {e}"),
    })
}

/// Reads everything a layout-1 directory holds. Changes nothing.
pub fn read(dir: &Path) -> Result<Layout1, StoreError> {
    let db = sled::Config::new()
        .path(dir)
        .open()
        .map_err(|source| StoreError::Sled {
            what: "open the layout-1 (sled) directory (another process may hold its lock)",
            source,
        })?;
    let meta = db.open_tree("meta").map_err(sled_err("open tree"))?;
    let logs = db.open_tree("logs").map_err(sled_err("open tree"))?;
    let state = db.open_tree("state").map_err(sled_err("open tree"))?;
    if let Some(v) = meta.get("format").map_err(sled_err("read the layout"))? {
        let found = <[u8; 4]>::try_from(v.as_ref())
            .map(u32::from_le_bytes)
            .map_err(|_| StoreError::Corrupt {
                what: "data directory format",
                why: format!("{} bytes where 4 were written", v.len()),
            })?;
        if found != 1 {
            return Err(StoreError::Newer {
                what: "data directory",
                found,
                reads: DIR_FORMAT,
            });
        }
    }
    let get = |key: &str| meta.get(key).map_err(sled_err("read the directory's metadata"));
    let mut out = Layout1 {
        node_id: get("node_id")?.map(|b| json("node id", &b)).transpose()?,
        vote: get("vote")?.map(|b| json("vote", &b)).transpose()?,
        committed: get("committed")?
            .map(|b| json::<Option<LogId<NodeId>>>("committed log id", &b))
            .transpose()?
            .flatten(),
        last_purged: get("last_purged_log_id")?
            .map(|b| json("last purged log id", &b))
            .transpose()?,
        ..Layout1::default()
    };
    let above = out.last_purged.map_or(0, |p| p.index + 1);
    for kv in logs.range(above.to_be_bytes()..) {
        let (k, v) = kv.map_err(sled_err("read the log"))?;
        let index = <[u8; 8]>::try_from(k.as_ref())
            .map(u64::from_be_bytes)
            .map_err(|_| StoreError::Corrupt {
                what: "log key",
                why: format!("{} bytes where 8 were written", k.len()),
            })?;
        let entry: Entry = json("log entry", &v)?;
        if entry.log_id.index != index {
            return Err(StoreError::Corrupt {
                what: "log entry",
                why: format!("entry {} stored at index {index}", entry.log_id),
            });
        }
        if let Some(prev) = out.entries.last() {
            if prev.log_id.index + 1 != index {
                return Err(StoreError::Corrupt {
                    what: "log",
                    why: format!("a hole between index {} and {index}", prev.log_id.index),
                });
            }
        }
        out.entries.push(entry);
    }
    let m = state.get("snapshot_meta").map_err(sled_err("read the snapshot"))?;
    let d = state.get("snapshot_data").map_err(sled_err("read the snapshot"))?;
    out.snapshot = match (m, d) {
        (Some(m), Some(d)) => Some((json("snapshot meta", &m)?, d.to_vec())),
        (None, None) => None,
        _ => {
            return Err(StoreError::Corrupt {
                what: "snapshot",
                why: "its meta and data are not both present".into(),
            })
        }
    };
    Ok(out)
}

/// Moves sled's files out of `dir` into `dir/sled-layout-1.migrated/` (kept, not
/// deleted, until an operator removes them).
pub fn retire(dir: &Path) -> Result<(), StoreError> {
    let aside = dir.join(RETIRED);
    let io = |what: &'static str, path: &Path| {
        let path = path.to_path_buf();
        move |source| StoreError::Io { what, path, source }
    };
    std::fs::create_dir_all(&aside).map_err(io("create", &aside))?;
    for entry in std::fs::read_dir(dir).map_err(io("read directory", dir))? {
        let entry = entry.map_err(io("read directory", dir))?;
        let name = entry.file_name();
        let n = name.to_string_lossy();
        if n == "db" || n == "conf" || n == "blobs" || n.starts_with("snap.") {
            std::fs::rename(entry.path(), aside.join(&name)).map_err(io("move aside", &entry.path()))?;
        }
    }
    super::files::sync_dir(dir).map_err(io("sync directory", dir))
}

/// Where a migrated layout-1 directory's files go.
pub const RETIRED: &str = "sled-layout-1.migrated";
