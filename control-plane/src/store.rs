//! Durable Raft storage on sled: the log store and the state-machine store
//! (openraft 0.9 storage v2).
//!
//! One [`sled::Db`] holds three trees:
//! - `logs`: log entries keyed by the big-endian `u64` index, so key order is index order;
//! - `meta`: the vote, the committed log id and the last purged log id;
//! - `state`: the state machine (`sm`) and the current snapshot (`snapshot_meta`,
//!   `snapshot_data`).
//!
//! Values are serde_json. Every write that openraft relies on surviving a crash (vote,
//! appended entries, truncation, purge, committed log id, applied state, installed
//! snapshot) is followed by a flush of the database and an `fdatasync` of its data file
//! before the call returns, and before an append is acknowledged through
//! [`LogFlushed`]: sled's own flush only issues `sync_file_range` (not enough for a power
//! loss) and its background fsync runs every 500 ms, so neither is relied upon. A
//! process killed with SIGKILL, or a machine that loses power, restarts with
//! everything it acknowledged.
//!
//! The persisted state machine and a snapshot share one format, [`StateMachineData`] as
//! JSON, so installing a snapshot is "decode, check, write the same bytes as the state".

// openraft's traits fix the error type to `StorageError` (over 200 bytes); the private
// helpers return it too so `?` needs no conversions.
#![allow(clippy::result_large_err)]

use std::fmt;
use std::io;
use std::io::Cursor;
use std::ops::Bound;
use std::ops::RangeBounds;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvota_fairness::federation::Federation;
use openraft::storage::{LogFlushed, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    DefensiveError, EntryPayload, ErrorSubject, LogId, LogState, OptionalSend, RaftLogReader,
    RaftSnapshotBuilder, SnapshotMeta, StorageError, StorageIOError, StoredMembership, Violation,
    Vote,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, RwLock};

use crate::types::{Node, NodeId, Request, Response, TypeConfig};

/// The Raft log entry type stored here.
type Entry = openraft::Entry<TypeConfig>;

const LOGS_TREE: &str = "logs";
const META_TREE: &str = "meta";
const STATE_TREE: &str = "state";

const VOTE_KEY: &[u8] = b"vote";
const NODE_ID_KEY: &[u8] = b"node_id";
const COMMITTED_KEY: &[u8] = b"committed";
const LAST_PURGED_KEY: &[u8] = b"last_purged_log_id";
const SM_KEY: &[u8] = b"sm";
const SNAPSHOT_META_KEY: &[u8] = b"snapshot_meta";
const SNAPSHOT_DATA_KEY: &[u8] = b"snapshot_data";

/// Why [`open`] or [`open_db`] failed: the directory could not be opened, or what it
/// holds could not be read back. No store exists then; the directory is left for an
/// operator to inspect.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// sled could not open the directory (missing permissions, another process holds
    /// its lock, unreadable files).
    #[error("open data directory {}: {source}", path.display())]
    Open {
        /// The data directory.
        path: PathBuf,
        /// What sled reported.
        source: sled::Error,
    },
    /// sled failed while reading or preparing the stored state.
    #[error("data directory: {what}: {source}")]
    Sled {
        /// What was being done.
        what: &'static str,
        /// What sled reported.
        source: sled::Error,
    },
    /// The directory holds another node's log and vote: starting under another id would
    /// vote twice in one term and could lose committed entries.
    #[error(
        "it belongs to node {stored}, not node {requested}: start node {stored} from it, \
         or give node {requested} a directory of its own (each node needs its own, kept for its life)"
    )]
    OtherNode {
        /// The id recorded when the directory was first used.
        stored: NodeId,
        /// The id this process was started with.
        requested: NodeId,
    },
    /// The directory was written by a newer kvota, in a layout this one does not know.
    #[error("{what} is format {found}, newer than this kvota reads ({reads}): run the newer kvota on it, or restore a backup made by this one")]
    Newer {
        /// What.
        what: &'static str,
        /// The format found.
        found: u32,
        /// The newest format this build reads.
        reads: u32,
    },
    /// A stored value does not decode: the directory is damaged or was written by an
    /// incompatible version.
    #[error("data directory holds a corrupt {what}: {why}")]
    Corrupt {
        /// Which value.
        what: &'static str,
        /// Why it does not decode.
        why: String,
    },
}

/// The newest snapshot format this build writes and reads: the JSON of
/// [`StateMachineData`], `format` its first field. Snapshots written before formats were
/// stamped carry none and are format 1.
pub const SNAPSHOT_FORMAT: u32 = 1;

/// The snapshot format a group at feature level `level` writes (as
/// [`crate::types::entry_format_for`] for log entries).
pub fn snapshot_format_for(level: u32) -> u32 {
    if level <= 1 {
        1
    } else {
        SNAPSHOT_FORMAT
    }
}

/// The newest data-directory layout this build opens (the trees and keys described at
/// the top of this module), recorded in the directory under `meta/format`.
pub const DIR_FORMAT: u32 = 1;

const DIR_FORMAT_KEY: &[u8] = b"format";

/// The replicated state: what the state machine has applied and the resulting
/// [`Federation`].
///
/// Holds: `federation` is exactly the result of applying, in order, every normal entry
/// up to and including `last_applied` (directly or through an installed snapshot);
/// `last_membership` is the last membership entry at or before `last_applied`;
/// `feature_level` is the highest level a `raise_feature_level` among those entries
/// asked for (1 before any). Its JSON form is both the persisted state machine and the
/// snapshot format.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StateMachineData {
    /// The snapshot format ([`SNAPSHOT_FORMAT`] when written by this build).
    #[serde(default = "format_1")]
    pub format: u32,
    /// The group's feature level (see [`crate::types::FEATURE_LEVEL`]).
    #[serde(default = "format_1")]
    pub feature_level: u32,
    /// The last log entry applied, `None` before the first.
    pub last_applied: Option<LogId<NodeId>>,
    /// The last membership applied (with its log id).
    pub last_membership: StoredMembership<NodeId, Node>,
    /// The deterministic state machine.
    pub federation: Federation,
}

fn format_1() -> u32 {
    1
}

impl Default for StateMachineData {
    fn default() -> Self {
        StateMachineData {
            format: SNAPSHOT_FORMAT,
            feature_level: 1,
            last_applied: None,
            last_membership: StoredMembership::default(),
            federation: Federation::default(),
        }
    }
}

impl StateMachineData {
    /// Decodes a snapshot (or the persisted state) of a node that supports feature
    /// levels up to `feature_max`: the format and level first, so that one this build
    /// cannot read is refused with a clear error instead of misread.
    pub fn decode(bytes: &[u8], feature_max: u32) -> Result<StateMachineData, String> {
        #[derive(Deserialize)]
        struct Head {
            #[serde(default = "format_1")]
            format: u32,
            #[serde(default = "format_1")]
            feature_level: u32,
        }
        let head: Head = serde_json::from_slice(bytes).map_err(|e| format!("snapshot: {e}"))?;
        if head.format > SNAPSHOT_FORMAT || head.format == 0 {
            return Err(format!(
                "snapshot format {} is not one this node reads (1 to {SNAPSHOT_FORMAT}): it was written by a newer kvota; upgrade this node",
                head.format
            ));
        }
        if head.feature_level > feature_max {
            return Err(newer_feature_level(head.feature_level, feature_max));
        }
        serde_json::from_slice(bytes).map_err(|e| format!("snapshot: {e}"))
    }
}

/// Why a node cannot follow the group (the text a stopped node logs).
pub fn newer_feature_level(level: u32, feature_max: u32) -> String {
    format!(
        "the federation runs at feature level {level}, and this node supports up to {feature_max}: \
         upgrade this node's kvota (every voter must support a level before the leader raises it; \
         a node added later must be as new)"
    )
}

/// Open (or create) the data directory at `path` and return its log store and
/// state-machine store, which share the one sled database.
///
/// Holds on success: the state machine is the one last persisted (as of the last
/// acknowledged `apply` or `install_snapshot`), and the log is what was last
/// acknowledged. Only one process may have a directory open at a time (sled locks it).
pub fn open(path: &Path) -> Result<(LogStore, StateMachineStore), StoreError> {
    open_for(path, crate::types::FEATURE_LEVEL)
}

/// [`open`] for a node that supports feature levels up to `feature_max` (a state
/// persisted at a higher level is refused as written by a newer kvota).
pub fn open_for(path: &Path, feature_max: u32) -> Result<(LogStore, StateMachineStore), StoreError> {
    let db = sled::Config::new()
        .path(path)
        .open()
        .map_err(|source| StoreError::Open {
            path: path.to_path_buf(),
            source,
        })?;
    // sled's data file, synced after every flush (see `Disk`).
    let data = path.join("db");
    let file = std::fs::File::open(&data).map_err(|e| StoreError::Open {
        path: data.clone(),
        source: sled::Error::Io(e),
    })?;
    let blobs = Some(Arc::new(BlobSync { dir: path.join("blobs"), synced: std::sync::Mutex::new(Default::default()) }));
    open_disk(Disk { db, file: Some(Arc::new(file)), blobs }, feature_max)
}

/// Build the two stores on an already opened sled database (e.g. a temporary one in
/// tests). Same guarantees as [`open`].
pub fn open_db(db: sled::Db) -> Result<(LogStore, StateMachineStore), StoreError> {
    open_disk(Disk { db, file: None, blobs: None }, crate::types::FEATURE_LEVEL)
}

fn open_disk(db: Disk, feature_max: u32) -> Result<(LogStore, StateMachineStore), StoreError> {
    let tree = |name: &'static str| {
        db.open_tree(name).map_err(|source| StoreError::Sled {
            what: "open tree",
            source,
        })
    };
    let logs = tree(LOGS_TREE)?;
    let meta = tree(META_TREE)?;
    let state = tree(STATE_TREE)?;
    check_dir_format(&meta)?;

    let log_store = LogStore {
        db: db.clone(),
        logs,
        meta,
        committed: Arc::default(),
    };
    log_store.drop_purged_leftovers()?;

    let data = match state.get(SM_KEY).map_err(|source| StoreError::Sled {
        what: "read the state machine",
        source,
    })? {
        Some(bytes) => StateMachineData::decode(&bytes, feature_max)
            .map_err(|why| StoreError::Corrupt { what: "state machine", why })?,
        None => StateMachineData::default(),
    };

    let sm_store = StateMachineStore {
        db,
        state,
        data: Arc::new(RwLock::new(data)),
        snapshot_lock: Arc::new(Mutex::new(())),
        feature_max,
    };
    Ok((log_store, sm_store))
}

/// Records [`DIR_FORMAT`] in a directory that has none (new, or written before the
/// layout had a number, which is layout 1) and refuses one of a newer layout.
fn check_dir_format(meta: &sled::Tree) -> Result<(), StoreError> {
    let sled_err = |source| StoreError::Sled { what: "data directory format", source };
    match meta.get(DIR_FORMAT_KEY).map_err(sled_err)? {
        Some(v) => {
            let found = <[u8; 4]>::try_from(v.as_ref()).map(u32::from_le_bytes).map_err(|_| StoreError::Corrupt {
                what: "data directory format",
                why: format!("{} bytes where 4 were written", v.len()),
            })?;
            if found > DIR_FORMAT {
                return Err(StoreError::Newer { what: "data directory", found, reads: DIR_FORMAT });
            }
            Ok(())
        }
        None => {
            // Made durable with the first write that is flushed (every write openraft
            // relies on is); until then a crash leaves a directory without it, which is
            // layout 1 all the same.
            meta.insert(DIR_FORMAT_KEY, &DIR_FORMAT.to_le_bytes()).map_err(sled_err)?;
            Ok(())
        }
    }
}

/// The sled key of log index `index`: big-endian, so byte order is index order.
fn log_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

/// The log index a `logs` key stands for, `None` if the key is not 8 bytes.
fn key_index(key: &[u8]) -> Option<u64> {
    let bytes: [u8; 8] = key.try_into().ok()?;
    Some(u64::from_be_bytes(bytes))
}

/// The sled database and, for one on disk, its data file and blob directory. sled 0.34's
/// `flush` writes the log with `sync_file_range`, which flushes neither the disk's write
/// cache nor the file's metadata: that survives a killed process but not a power loss.
/// So every flush here is followed by an `fdatasync` of the data file. sled writes values
/// larger than a segment allows (a big snapshot, a large batch of entries) to files of
/// their own under `blobs/`, which its flush does not sync at all: each new one is
/// synced too, and the directory that names it.
#[derive(Clone)]
struct Disk {
    db: sled::Db,
    file: Option<Arc<std::fs::File>>,
    blobs: Option<Arc<BlobSync>>,
}

/// sled's blob files synced so far (names still present in the directory).
#[derive(Debug)]
struct BlobSync {
    dir: PathBuf,
    synced: std::sync::Mutex<std::collections::HashSet<std::ffi::OsString>>,
}

impl BlobSync {
    /// `fdatasync`s every blob file not synced yet, then the directory if any was new.
    fn sync_new(&self) -> Result<(), io::Error> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut synced = self.synced.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut present = std::collections::HashSet::new();
        let mut new = false;
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            if !synced.contains(&name) {
                match std::fs::File::open(entry.path()) {
                    Ok(f) => f.sync_data()?,
                    // Collected by sled since it was listed: nothing to keep.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e),
                }
                new = true;
            }
            present.insert(name);
        }
        *synced = present;
        drop(synced);
        if new {
            std::fs::File::open(&self.dir)?.sync_all()?;
        }
        Ok(())
    }
}

impl std::ops::Deref for Disk {
    type Target = sled::Db;
    fn deref(&self) -> &sled::Db {
        &self.db
    }
}

/// Make everything written to `disk` so far durable. Runs on the blocking pool: an
/// fsync can take milliseconds and must not stall the Raft tasks sharing the runtime.
async fn flush(disk: &Disk) -> Result<(), io::Error> {
    let disk = disk.clone();
    match tokio::task::spawn_blocking(move || {
        disk.db.flush().map_err(io::Error::from)?;
        if let Some(f) = &disk.file {
            f.sync_data()?;
        }
        match &disk.blobs {
            Some(b) => b.sync_new(),
            None => Ok(()),
        }
    })
    .await
    {
        Ok(r) => r,
        Err(join) => Err(io::Error::other(join)),
    }
}

/// Decode the entry stored under `key`, checking that it is the entry the key says.
fn decode_entry(key: &[u8], value: &[u8]) -> Result<Entry, StorageError<NodeId>> {
    let index = key_index(key).ok_or_else(|| {
        StorageIOError::read_logs(openraft::AnyError::error(format!(
            "log key of {} bytes, expected 8",
            key.len()
        )))
    })?;
    let entry: Entry =
        serde_json::from_slice(value).map_err(|e| StorageIOError::read_log_at_index(index, &e))?;
    if entry.log_id.index != index {
        return Err(StorageIOError::read_log_at_index(
            index,
            openraft::AnyError::error(format!(
                "entry stored at index {index} is entry {}",
                entry.log_id
            )),
        )
        .into());
    }
    Ok(entry)
}

/// The Raft log and the vote: [`RaftLogStorage`] (and its own [`RaftLogReader`]).
///
/// Holds: entries are contiguous from `last_purged_log_id + 1` (or the first entry) to
/// the last entry; every write is on disk before the call that made it returns (for
/// `append`, before the [`LogFlushed`] callback fires). Cloning gives another handle
/// to the same log (the log reader is such a clone).
#[derive(Clone)]
pub struct LogStore {
    db: Disk,
    logs: sled::Tree,
    meta: sled::Tree,
    committed: Arc<std::sync::Mutex<Committed>>,
}

/// The committed log id: the latest in memory, written to `meta` only now and then
/// (see [`COMMITTED_WRITE_EVERY`]).
#[derive(Debug, Default)]
struct Committed {
    latest: Option<LogId<NodeId>>,
    written_index: u64,
    written_at: Option<std::time::Instant>,
}

/// The committed log id is written to disk after this many more commits or this much
/// time, not on every commit: each write cost a device write of its own at the next log
/// flush (sled writes it in a buffer of its own), which was a third of every append's
/// disk time. A stale committed id after a restart only means applying fewer entries at
/// startup and learning the rest from the leader (Raft does not need it at all).
const COMMITTED_WRITE_EVERY: (u64, std::time::Duration) = (1_000, std::time::Duration::from_secs(1));

impl fmt::Debug for LogStore {
    // sled's own `Debug` for a tree dumps every node; keep it short.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LogStore")
            .field("entries", &self.logs.len())
            .finish_non_exhaustive()
    }
}

impl LogStore {
    /// Records `id` as the node owning this directory on first use, and refuses a
    /// directory first used by another node. Durable before it returns.
    pub async fn claim_for_node(&self, id: NodeId) -> Result<(), StoreError> {
        let sled_err = |what, source| StoreError::Sled { what, source };
        match self.meta.get(NODE_ID_KEY).map_err(|e| sled_err("read the node id", e))? {
            Some(bytes) => {
                let stored: NodeId = serde_json::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
                    what: "node id",
                    why: e.to_string(),
                })?;
                if stored == id {
                    Ok(())
                } else {
                    Err(StoreError::OtherNode { stored, requested: id })
                }
            }
            None => {
                let bytes = serde_json::to_vec(&id).map_err(|e| StoreError::Corrupt {
                    what: "node id",
                    why: e.to_string(),
                })?;
                self.meta.insert(NODE_ID_KEY, bytes).map_err(|e| sled_err("record the node id", e))?;
                flush(&self.db).await.map_err(|e| StoreError::Sled {
                    what: "flush the node id",
                    source: sled::Error::Io(e),
                })
            }
        }
    }

    /// Read and decode a `meta` value; `subject` tags errors.
    fn read_meta<T: serde::de::DeserializeOwned>(
        &self,
        key: &[u8],
        subject: ErrorSubject<NodeId>,
    ) -> Result<Option<T>, StorageError<NodeId>> {
        let Some(bytes) = self
            .meta
            .get(key)
            .map_err(|e| StorageIOError::new(subject.clone(), openraft::ErrorVerb::Read, &e))?
        else {
            return Ok(None);
        };
        let value = serde_json::from_slice(&bytes)
            .map_err(|e| StorageIOError::new(subject, openraft::ErrorVerb::Read, &e))?;
        Ok(Some(value))
    }

    /// Encode and write a `meta` value, then fsync; `subject` tags errors.
    async fn write_meta<T: Serialize>(
        &self,
        key: &[u8],
        value: &T,
        subject: ErrorSubject<NodeId>,
    ) -> Result<(), StorageError<NodeId>> {
        let write_err = |e: &dyn std::error::Error| {
            StorageIOError::new(
                subject.clone(),
                openraft::ErrorVerb::Write,
                openraft::AnyError::error(e),
            )
        };
        let bytes = serde_json::to_vec(value).map_err(|e| write_err(&e))?;
        self.meta.insert(key, bytes).map_err(|e| write_err(&e))?;
        flush(&self.db).await.map_err(|e| write_err(&e))?;
        Ok(())
    }

    fn last_purged(&self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        self.read_meta(LAST_PURGED_KEY, ErrorSubject::Logs)
    }

    /// Remove entries at or below the last purged index that a crash between recording
    /// the purge and deleting the entries may have left (harmless, but they would show
    /// through `try_get_log_entries`).
    fn drop_purged_leftovers(&self) -> Result<(), StoreError> {
        let stored = self
            .meta
            .get(LAST_PURGED_KEY)
            .map_err(|source| StoreError::Sled {
                what: "read the last purged log id",
                source,
            })?;
        let Some(stored) = stored else {
            return Ok(());
        };
        let purged: LogId<NodeId> =
            serde_json::from_slice(&stored).map_err(|e| StoreError::Corrupt {
                what: "last purged log id",
                why: e.to_string(),
            })?;
        let mut batch = sled::Batch::default();
        for item in self.logs.range(..=log_key(purged.index)) {
            let (key, _) = item.map_err(|source| StoreError::Sled {
                what: "scan purged log entries",
                source,
            })?;
            batch.remove(key);
        }
        self.logs
            .apply_batch(batch)
            .map_err(|source| StoreError::Sled {
                what: "remove purged log entries",
                source,
            })
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    /// Entries in `range` that are present, in index order (missing ones are skipped,
    /// as openraft allows).
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + fmt::Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError<NodeId>> {
        // Normalise to `[start, end)` with `end == None` meaning unbounded, so an empty
        // or inverted range never reaches sled.
        let start = match range.start_bound() {
            Bound::Included(&i) => i,
            Bound::Excluded(&i) => match i.checked_add(1) {
                Some(i) => i,
                None => return Ok(Vec::new()),
            },
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&i) => i.checked_add(1),
            Bound::Excluded(&i) => Some(i),
            Bound::Unbounded => None,
        };
        let iter = match end {
            Some(end) if start >= end => return Ok(Vec::new()),
            Some(end) => self.logs.range(log_key(start)..log_key(end)),
            None => self.logs.range(log_key(start)..),
        };
        let mut entries = Vec::new();
        for item in iter {
            let (key, value) = item.map_err(|e| StorageIOError::read_logs(&e))?;
            entries.push(decode_entry(&key, &value)?);
        }
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<NodeId>> {
        let last_purged_log_id = self.last_purged()?;
        let last_entry = match self
            .logs
            .last()
            .map_err(|e| StorageIOError::read_logs(&e))?
        {
            Some((key, value)) => Some(decode_entry(&key, &value)?.log_id),
            None => None,
        };
        // `max`: after a crash mid-purge only entries at or below the purge point may
        // remain, and then the purge point is the last log id.
        let last_log_id = std::cmp::max(last_entry, last_purged_log_id);
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        self.write_meta(VOTE_KEY, vote, ErrorSubject::Vote).await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        self.read_meta(VOTE_KEY, ErrorSubject::Vote)
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<NodeId>>,
    ) -> Result<(), StorageError<NodeId>> {
        // Not flushed: openraft awaits this on every commit, in its core loop, and the
        // value need not be durable. A stale one after a crash only means re-applying
        // fewer entries at startup and learning the rest from the leader. Written only
        // every COMMITTED_WRITE_EVERY; the next log append's flush (or sled's background
        // flush) persists it.
        {
            let mut c = self.committed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            c.latest = committed;
            let index = committed.map_or(0, |l| l.index);
            let due = index < c.written_index
                || index - c.written_index >= COMMITTED_WRITE_EVERY.0
                || c.written_at.is_none_or(|t| t.elapsed() >= COMMITTED_WRITE_EVERY.1);
            if !due {
                return Ok(());
            }
            c.written_index = index;
            c.written_at = Some(std::time::Instant::now());
        }
        let bytes = serde_json::to_vec(&committed).map_err(|e| {
            StorageIOError::new(ErrorSubject::Store, openraft::ErrorVerb::Write, openraft::AnyError::error(&e))
        })?;
        self.meta.insert(COMMITTED_KEY, bytes).map_err(|e| {
            StorageIOError::new(ErrorSubject::Store, openraft::ErrorVerb::Write, openraft::AnyError::error(&e))
        })?;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        let latest = self.committed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).latest;
        if latest.is_some() {
            return Ok(latest);
        }
        // Stored as `Option<LogId>`, so a saved `None` reads back as `None` too.
        Ok(self
            .read_meta::<Option<LogId<NodeId>>>(COMMITTED_KEY, ErrorSubject::Store)?
            .flatten())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        // One batch: sled applies it atomically, so a crash leaves all of it or none
        // (never a hole). A single entry is a plain insert, atomic by itself: a batch
        // adds a manifest record that costs a device write of its own at the flush.
        let mut encoded = Vec::new();
        for entry in entries {
            let bytes = serde_json::to_vec(&entry)
                .map_err(|e| StorageIOError::write_log_entry(entry.log_id, &e))?;
            encoded.push((log_key(entry.log_id.index), bytes));
        }
        if encoded.len() == 1 {
            let (key, bytes) = encoded.remove(0);
            self.logs.insert(key, bytes).map_err(|e| StorageIOError::write_logs(&e))?;
        } else {
            let mut batch = sled::Batch::default();
            for (key, bytes) in encoded {
                batch.insert(&key, bytes);
            }
            self.logs
                .apply_batch(batch)
                .map_err(|e| StorageIOError::write_logs(&e))?;
        }
        // Acknowledge only once on disk: openraft counts this node towards the quorum
        // as soon as the callback fires.
        match flush(&self.db).await {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                let err = StorageIOError::write_logs(&e);
                callback.log_io_completed(Err(e));
                Err(err.into())
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        // Atomic: the log never ends up with a hole at the truncation point.
        self.remove_durably(log_key(log_id.index)..).await
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        // Record the purge point first, durably: if we crash before the entries are
        // gone, the log state is still right (and `open` removes the leftovers).
        // Deleting first could instead leave a log whose first entry is not
        // `last_purged + 1`.
        self.write_meta(LAST_PURGED_KEY, &log_id, ErrorSubject::Logs)
            .await?;
        self.remove_durably(..=log_key(log_id.index)).await
    }
}

impl LogStore {
    /// Removes the log entries in `range` in one atomic sled batch, then fsyncs.
    async fn remove_durably<R>(&self, range: R) -> Result<(), StorageError<NodeId>>
    where
        R: RangeBounds<[u8; 8]>,
    {
        let mut batch = sled::Batch::default();
        for item in self.logs.range(range) {
            let (key, _) = item.map_err(|e| StorageIOError::write_logs(&e))?;
            batch.remove(key);
        }
        self.logs
            .apply_batch(batch)
            .map_err(|e| StorageIOError::write_logs(&e))?;
        flush(&self.db)
            .await
            .map_err(|e| StorageIOError::write_logs(&e))?;
        Ok(())
    }
}

/// The state machine and its snapshots: [`RaftStateMachine`].
///
/// Holds: the in-memory [`StateMachineData`] equals what is persisted under `sm` once
/// `apply` or `install_snapshot` returns (both fsync before returning); the current
/// snapshot (if any) is persisted with its meta and bytes together.
pub struct StateMachineStore {
    db: Disk,
    state: sled::Tree,
    data: Arc<RwLock<StateMachineData>>,
    /// Serialises writes of the current snapshot (from snapshot builders, which run
    /// concurrently with the state machine, and from `install_snapshot`) and reads of
    /// it, so meta and bytes always match and a newer snapshot is never replaced by an
    /// older build.
    snapshot_lock: Arc<Mutex<()>>,
    /// The newest feature level this node supports ([`crate::types::FEATURE_LEVEL`]
    /// unless a test poses as a newer build).
    feature_max: u32,
}

impl fmt::Debug for StateMachineStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StateMachineStore").finish_non_exhaustive()
    }
}

impl StateMachineStore {
    /// A read handle on the live state, for serving reads without going through Raft.
    ///
    /// Holds: what a reader sees under the lock is a state some prefix of the log
    /// produced (`last_applied` and `federation` always agree); it may be ahead of what
    /// is on disk only while an `apply` batch is being persisted. Hold the lock briefly:
    /// `apply` waits for readers.
    pub fn shared(&self) -> Arc<RwLock<StateMachineData>> {
        Arc::clone(&self.data)
    }

    /// The newest feature level this node supports (given to [`open_for`]).
    pub fn feature_max(&self) -> u32 {
        self.feature_max
    }
}

/// Write `meta` + `bytes` as the current snapshot (and, with `also_state`, the same
/// bytes as the persisted state machine), in one atomic batch, then fsync. With
/// `only_if_newer`, an existing snapshot with a later `last_log_id` is kept instead.
/// The caller holds the snapshot lock.
async fn persist_snapshot(
    db: &Disk,
    tree: &sled::Tree,
    meta: &SnapshotMeta<NodeId, Node>,
    bytes: &[u8],
    also_state: bool,
    only_if_newer: bool,
) -> Result<(), StorageError<NodeId>> {
    let signature = || Some(meta.signature());
    if only_if_newer {
        if let Some(existing) = tree
            .get(SNAPSHOT_META_KEY)
            .map_err(|e| StorageIOError::read_snapshot(signature(), &e))?
        {
            let existing: SnapshotMeta<NodeId, Node> = serde_json::from_slice(&existing)
                .map_err(|e| StorageIOError::read_snapshot(signature(), &e))?;
            if existing.last_log_id > meta.last_log_id {
                return Ok(());
            }
        }
    }
    let meta_bytes =
        serde_json::to_vec(meta).map_err(|e| StorageIOError::write_snapshot(signature(), &e))?;
    let mut batch = sled::Batch::default();
    batch.insert(SNAPSHOT_META_KEY, meta_bytes);
    batch.insert(SNAPSHOT_DATA_KEY, bytes);
    if also_state {
        batch.insert(SM_KEY, bytes);
    }
    tree.apply_batch(batch)
        .map_err(|e| StorageIOError::write_snapshot(signature(), &e))?;
    flush(db)
        .await
        .map_err(|e| StorageIOError::write_snapshot(signature(), &e))?;
    Ok(())
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = SledSnapshotBuilder;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, Node>), StorageError<NodeId>> {
        let data = self.data.read().await;
        Ok((data.last_applied, data.last_membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Response>, StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut replies = Vec::new();
        {
            let mut data = self.data.write().await;
            for entry in entries {
                // Applying an entry twice would not be idempotent (a second
                // registration issues another lease), and nodes would diverge; refuse
                // rather than corrupt. A storage error stops this Raft node.
                if Some(entry.log_id) <= data.last_applied {
                    return Err(DefensiveError::new(
                        ErrorSubject::Apply(entry.log_id),
                        Violation::ApplyNonConsecutive {
                            prev: data.last_applied,
                            next: entry.log_id,
                        },
                    )
                    .into());
                }
                let previous = data.last_applied;
                let _span = tracing::debug_span!("apply", index = entry.log_id.index, term = entry.log_id.leader_id.term).entered();
                data.last_applied = Some(entry.log_id);
                let reply = match entry.payload {
                    EntryPayload::Blank => Response(None),
                    EntryPayload::Normal(Request { now_ms, commands, raise_feature_level, actors, .. }) => {
                        // Checked before anything of the entry is applied: a node that
                        // cannot run at the new level stops here, its state untouched
                        // by this entry (openraft applies it again after an upgrade).
                        if let Some(level) = raise_feature_level {
                            let max = self.feature_max();
                            if level > max {
                                data.last_applied = previous;
                                return Err(StorageIOError::apply(
                                    entry.log_id,
                                    openraft::AnyError::error(crate::store::newer_feature_level(level, max)),
                                )
                                .into());
                            }
                        }
                        let answers = commands
                            .into_iter()
                            .enumerate()
                            .map(|(i, c)| {
                                let actor = u32::try_from(i).ok().and_then(|i| actors.get(&i)).cloned();
                                data.federation.apply_as(now_ms, c, actor)
                            })
                            .collect();
                        if let Some(level) = raise_feature_level {
                            if level > data.feature_level {
                                tracing::info!(from = data.feature_level, to = level, "feature level raised");
                                data.feature_level = level;
                            }
                            if data.feature_level >= crate::types::RECORDS_LEVEL {
                                data.federation.enable_records();
                            }
                            if data.feature_level >= crate::types::LENDING_LEVEL {
                                data.federation.enable_lending();
                            }
                            if data.feature_level >= crate::types::SIZED_LEVEL {
                                data.federation.enable_sized_budgets();
                            }
                        }
                        Response(Some(answers))
                    }
                    EntryPayload::Membership(membership) => {
                        data.last_membership =
                            StoredMembership::new(Some(entry.log_id), membership);
                        Response(None)
                    }
                };
                replies.push(reply);
            }
        }
        // The applied state is not written here: the log is the durable record. A restart
        // loads the last snapshot and openraft re-applies the committed entries after it
        // (the state machine is deterministic, so the result is the same). Writing the
        // whole state and an fsync per batch cost more than the log append itself.
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        // openraft calls this on the state-machine task, between applies: the state read
        // here is exactly "everything up to last_applied", consistent with its header.
        let bytes = {
            let data = self.data.read().await;
            // Stamped with the format this level writes, whatever format the state was
            // read from.
            let mut data = data.clone();
            data.format = snapshot_format_for(data.feature_level);
            serde_json::to_vec(&data).map_err(|e| e.to_string())
        };
        SledSnapshotBuilder {
            db: self.db.clone(),
            state: self.state.clone(),
            snapshot_lock: Arc::clone(&self.snapshot_lock),
            bytes,
        }
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, Node>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let bytes = snapshot.into_inner();
        // Decode and check everything before touching disk or memory: a bad snapshot
        // must leave the state machine as it was.
        let new = StateMachineData::decode(&bytes, self.feature_max())
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), openraft::AnyError::error(e)))?;
        if new.last_applied != meta.last_log_id || new.last_membership != meta.last_membership {
            return Err(StorageIOError::read_snapshot(
                Some(meta.signature()),
                openraft::AnyError::error(format!(
                    "snapshot content (last applied {:?}, membership {:?}) does not match its \
                     meta {}",
                    new.last_applied, new.last_membership, meta
                )),
            )
            .into());
        }
        {
            let _guard = self.snapshot_lock.lock().await;
            persist_snapshot(&self.db, &self.state, meta, &bytes, true, false).await?;
        }
        *self.data.write().await = new;
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        let _guard = self.snapshot_lock.lock().await;
        let read_err = |e: &dyn std::error::Error| {
            StorageIOError::read_snapshot(None, openraft::AnyError::error(e))
        };
        let meta = self
            .state
            .get(SNAPSHOT_META_KEY)
            .map_err(|e| read_err(&e))?;
        let data = self
            .state
            .get(SNAPSHOT_DATA_KEY)
            .map_err(|e| read_err(&e))?;
        match (meta, data) {
            (None, None) => Ok(None),
            (Some(meta), Some(data)) => {
                let meta: SnapshotMeta<NodeId, Node> =
                    serde_json::from_slice(&meta).map_err(|e| read_err(&e))?;
                Ok(Some(Snapshot {
                    meta,
                    snapshot: Box::new(Cursor::new(data.to_vec())),
                }))
            }
            // Both are written in one batch; one without the other means damage.
            _ => Err(StorageIOError::read_snapshot(
                None,
                openraft::AnyError::error("snapshot meta and data are not both present"),
            )
            .into()),
        }
    }
}

/// Builds snapshots of the state machine (openraft runs it alongside `apply`).
///
/// Holds: a snapshot is the state machine as it was when the builder was made (between
/// two applies), its bytes and meta from one serialization. Building persists it, in one
/// fsynced batch, both as the current snapshot and as the state a restart loads, before
/// openraft may purge the log up to it; unless a newer one was installed meanwhile.
pub struct SledSnapshotBuilder {
    db: Disk,
    state: sled::Tree,
    snapshot_lock: Arc<Mutex<()>>,
    /// The state machine, serialized when the builder was made.
    bytes: Result<Vec<u8>, String>,
}

impl fmt::Debug for SledSnapshotBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SledSnapshotBuilder")
            .finish_non_exhaustive()
    }
}

/// The part of [`StateMachineData`] a snapshot's meta needs (serde skips the rest).
#[derive(Deserialize)]
struct AppliedHeader {
    last_applied: Option<LogId<NodeId>>,
    last_membership: StoredMembership<NodeId, Node>,
}

impl RaftSnapshotBuilder<TypeConfig> for SledSnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        let bytes = std::mem::replace(&mut self.bytes, Err("snapshot already built".to_string()))
            .map_err(|e| StorageIOError::read_state_machine(openraft::AnyError::error(e)))?;
        let AppliedHeader {
            last_applied: last_log_id,
            last_membership,
        } = serde_json::from_slice(&bytes).map_err(|e| StorageIOError::read_state_machine(&e))?;
        // sled's id generator never repeats, even across crashes, so two builds at the
        // same log id still get distinct snapshot ids.
        let unique = self
            .db
            .generate_id()
            .map_err(|e| StorageIOError::write_snapshot(None, &e))?;
        let snapshot_id = match last_log_id {
            Some(id) => format!("{}-{}-{unique}", id.leader_id.term, id.index),
            None => format!("none-{unique}"),
        };
        let meta = SnapshotMeta {
            last_log_id,
            last_membership,
            snapshot_id,
        };
        {
            let _guard = self.snapshot_lock.lock().await;
            persist_snapshot(&self.db, &self.state, &meta, &bytes, true, true).await?;
        }
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}
