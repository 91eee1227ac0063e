//! Durable Raft storage: the log store and the state-machine store (openraft 0.9
//! storage v2), in a data directory of kvota's own layout.
//!
//! # Layout 2
//!
//! ```text
//! LOCK            held (flock) by the process that has the directory open
//! meta.json       layout number, owning node, vote, purge point        (files.rs)
//! committed.json  the committed log id, written lazily                  (files.rs)
//! snapshot.kvs    the current snapshot, which is also the state a restart loads
//! log/            the Raft log: append-only segment files               (segments.rs)
//! ```
//!
//! Log entries are stored as the protobuf `RaftEntry` of the Raft port
//! (`proto/kvota/raft/v1/raft.proto`, converted in [`crate::wire`]), so an entry reads
//! the same on disk and on the wire, its format number inside. A follower's append is
//! one write and one `fdatasync` of the active segment before openraft hears it is done;
//! the leader's own appends are acknowledged after the write, synced by a flusher thread
//! while the entries travel to the followers, and applied only once synced (see
//! [`flush`] for why that is safe). The vote, the purge point and a snapshot are each
//! written to a temporary file, synced and renamed into place. Applying entries writes
//! nothing: the log is the durable record,
//! a restart loads the last snapshot and openraft re-applies the committed entries after
//! it (the state machine is deterministic, so the result is the same).
//!
//! Layout 1 (a sled database, earlier builds) is migrated on open: everything is read
//! out of sled and written in layout 2, `meta.json` last (a crash before it makes the
//! next open migrate again), and sled's files are moved into `sled-layout-1.migrated/`.
//! See [`sled_v1`].

// openraft's traits fix the error type to `StorageError` (over 200 bytes); the private
// helpers return it too so `?` needs no conversions.
#![allow(clippy::result_large_err)]

pub mod files;
pub mod flush;
pub mod segments;
pub mod sled_v1;

use std::fmt;
use std::fs::File;
use std::io::{self, Cursor};
use std::ops::{Bound, RangeBounds};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};

use kvota_fairness::federation::Federation;
use kvota_proto::raft::v1 as pb;
use openraft::storage::{LogFlushed, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    DefensiveError, EntryPayload, ErrorSubject, LogId, LogState, OptionalSend, RaftLogReader, RaftSnapshotBuilder,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership, Violation, Vote,
};
use prost::Message;
use serde::{Deserialize, Serialize};
use tokio::sync::{Mutex, RwLock};

use self::files::{CommittedFile, Meta, COMMITTED_FILE, META_FILE, SNAPSHOT_FILE};
use self::flush::{Durable, Flusher};
use self::segments::{SegmentError, SegmentLog};
use crate::feature::FeatureLevel;
use crate::types::{Node, NodeId, Response, TypeConfig};

/// The Raft log entry type stored here.
type Entry = openraft::Entry<TypeConfig>;

/// The newest data-directory layout this build opens (described at the top of this
/// module), recorded in `meta.json`. Layout 1 was a sled database; it is migrated.
pub const DIR_FORMAT: u32 = 2;

/// The directory of log segments inside a data directory.
const LOG_DIR: &str = "log";
const LOCK_FILE: &str = "LOCK";

/// Why [`open`] failed: the directory could not be opened, or what it holds could not
/// be read back. No store exists then; the directory is left for an operator to inspect.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A file operation failed.
    #[error("{what} {}: {source}", path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// What the system said.
        source: io::Error,
    },
    /// Another process has the directory open.
    #[error("{} is in use: another process holds its lock (a kvota server still running on it?); each node needs a directory of its own", path.display())]
    Locked {
        /// The data directory.
        path: PathBuf,
    },
    /// sled failed while a layout-1 directory was read for migration.
    #[error("data directory: {what}: {source}")]
    Sled {
        /// What was being done.
        what: &'static str,
        /// What sled reported.
        source: sled::Error,
    },
    /// The Raft log does not open (damage, or a segment of a newer format).
    #[error(transparent)]
    Log(#[from] SegmentError),
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

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// The newest snapshot format this build writes and reads: the JSON of
/// [`StateMachineData`], `format` its first field. Snapshots written before formats were
/// stamped carry none and are format 1.
pub const SNAPSHOT_FORMAT: u32 = 1;

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
    /// The group's feature level.
    #[serde(default)]
    pub feature_level: FeatureLevel,
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
            feature_level: FeatureLevel::BASE,
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
    pub fn decode(bytes: &[u8], feature_max: FeatureLevel) -> Result<StateMachineData, String> {
        #[derive(Deserialize)]
        struct Head {
            #[serde(default = "format_1")]
            format: u32,
            #[serde(default)]
            feature_level: FeatureLevel,
        }
        let head: Head = serde_json::from_slice(bytes).map_err(|e| format!("snapshot: {e}"))?;
        if head.format > SNAPSHOT_FORMAT || head.format == 0 {
            return Err(format!(
                "snapshot format {} is not one this node reads (1 to {SNAPSHOT_FORMAT}): it was written by a newer kvota; upgrade this node",
                head.format
            ));
        }
        if head.feature_level > feature_max {
            return Err(crate::entry::newer_feature_level(head.feature_level, feature_max));
        }
        serde_json::from_slice(bytes).map_err(|e| format!("snapshot: {e}"))
    }
}

/// Open (or create) the data directory at `path` and return its log store and
/// state-machine store.
///
/// Holds on success: the state machine is the last snapshot (or empty), and the log is
/// what was last acknowledged (a torn, unacknowledged tail cut off). Only one process may
/// have a directory open at a time (a lock on `LOCK`). A layout-1 (sled) directory is
/// migrated first.
pub fn open(path: &Path) -> Result<(LogStore, StateMachineStore), StoreError> {
    open_for(path, FeatureLevel::NEWEST)
}

/// [`open`] for a node that supports feature levels up to `feature_max` (a state
/// persisted at a higher level is refused as written by a newer kvota).
pub fn open_for(path: &Path, feature_max: FeatureLevel) -> Result<(LogStore, StateMachineStore), StoreError> {
    let lock = lock_dir(path)?;
    let meta = open_meta(path)?;

    refuse_older_builds(path)?;

    let (mut log, opened) = SegmentLog::open(&path.join(LOG_DIR))?;
    if let Some(p) = meta.last_purged {
        // Segments a crash kept after the purge point was recorded; records of a partly
        // purged segment out of sight.
        log.purge(p.index)?;
    }
    if opened.cut > 0 {
        tracing::warn!(dir = %path.display(), bytes = opened.cut, "the Raft log's torn tail was cut off");
    }
    let committed = read_committed(path);

    let (data, current) = read_snapshot(path, feature_max)?;

    // Everything the log holds now was synced (`SegmentLog::open` syncs the last
    // segment, which a killed process may have written without syncing).
    let durable_upto = last_log_id(&log, meta.last_purged).map_err(|e| StoreError::Corrupt {
        what: "Raft log",
        why: e.to_string(),
    })?;
    let committed = match committed {
        Some(c) if durable_upto.is_none_or(|d| d.index < c.index) => {
            // Saved committed ids stay within the durable log; one past it means the log
            // lost its tail (a power cut, a damaged disk): start from the snapshot and let
            // the leader tell what is committed.
            tracing::warn!(dir = %path.display(), committed = %c, last = ?durable_upto, "the saved committed log id is past the end of the Raft log; ignoring it");
            None
        }
        c => c,
    };
    let flush = Flusher::new(durable_upto);
    let durable = flush.subscribe();
    let dir = Arc::new(Dir {
        path: path.to_path_buf(),
        _lock: lock,
    });
    let log_store = LogStore {
        inner: Arc::new(LogInner {
            dir: Arc::clone(&dir),
            log: std::sync::Mutex::new(log),
            meta: std::sync::Mutex::new(meta),
            committed: std::sync::Mutex::new(Committed {
                latest: committed,
                ..Committed::default()
            }),
            flush,
        }),
    };
    let sm_store = StateMachineStore {
        durable,
        dir,
        data: Arc::new(RwLock::new(data)),
        current: Arc::new(Mutex::new(current)),
        feature_max,
        next_id: Arc::new(AtomicU64::new(unique_seed())),
    };
    Ok((log_store, sm_store))
}

/// Creates the data directory if needed and takes its lock (a second process gets
/// [`StoreError::Locked`]).
fn lock_dir(path: &Path) -> Result<File, StoreError> {
    std::fs::create_dir_all(path).map_err(io_err("create data directory", path))?;
    let lock_path = path.join(LOCK_FILE);
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io_err("open", &lock_path))?;
    match rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => {}
        Err(rustix::io::Errno::WOULDBLOCK) => {
            return Err(StoreError::Locked {
                path: path.to_path_buf(),
            })
        }
        Err(e) => return Err(io_err("lock", &lock_path)(e.into())),
    }
    Ok(lock)
}

/// The directory's metadata: read, migrated from layout 1, or written for a new
/// directory (refused if the directory holds a log or a snapshot without it).
fn open_meta(path: &Path) -> Result<Meta, StoreError> {
    let meta = match read_meta(path)? {
        Some(meta) => {
            if sled_v1::is_layout_1(path) {
                // Migrated, but the old files were not moved aside yet.
                sled_v1::retire(path)?;
            }
            meta
        }
        None if sled_v1::is_layout_1(path) => migrate(path)?,
        None => {
            // A new directory, unless it holds a log or a snapshot: then its metadata
            // (the vote among it) is lost, and starting empty could vote twice in a term.
            let log = path.join(LOG_DIR);
            let has_log = std::fs::read_dir(&log).is_ok_and(|mut d| d.next().is_some());
            if has_log || path.join(SNAPSHOT_FILE).exists() {
                return Err(StoreError::Corrupt {
                    what: "data directory",
                    why: format!(
                        "{} is missing while the directory holds a Raft log or snapshot: the vote it kept is lost; \
                         remove this node from the group and add it back with an empty directory, or restore a backup",
                        META_FILE
                    ),
                });
            }
            let meta = Meta {
                format: DIR_FORMAT,
                ..Meta::default()
            };
            write_meta(path, &meta)?;
            meta
        }
    };
    Ok(meta)
}

/// The snapshot file's state and metadata, or the empty state when there is none.
#[allow(clippy::type_complexity)]
fn read_snapshot(
    path: &Path,
    feature_max: FeatureLevel,
) -> Result<(StateMachineData, Option<SnapshotMeta<NodeId, Node>>), StoreError> {
    let snapshot_path = path.join(SNAPSHOT_FILE);
    if let Ok(m) = std::fs::metadata(&snapshot_path) {
        if m.len() > files::MAX_SNAPSHOT_BYTES {
            return Err(StoreError::Corrupt {
                what: "snapshot file",
                why: format!(
                    "{} bytes, more than the {} a snapshot may hold",
                    m.len(),
                    files::MAX_SNAPSHOT_BYTES
                ),
            });
        }
    }
    let (data, current) = match std::fs::read(&snapshot_path) {
        Ok(bytes) => {
            let (meta, data) = files::snapshot_from_bytes(&bytes).map_err(|e| match e {
                files::SnapshotFileError::Newer(found) => StoreError::Newer {
                    what: "snapshot file",
                    found,
                    reads: files::SNAPSHOT_FILE_FORMAT,
                },
                files::SnapshotFileError::Damaged(why) => StoreError::Corrupt {
                    what: "snapshot file",
                    why,
                },
            })?;
            let state = StateMachineData::decode(&data, feature_max).map_err(|why| StoreError::Corrupt {
                what: "state machine",
                why,
            })?;
            (state, Some(meta))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => (StateMachineData::default(), None),
        Err(e) => return Err(io_err("read", &snapshot_path)(e)),
    };
    Ok((data, current))
}

/// A number no earlier process's snapshot ids used (the clock in nanoseconds).
fn unique_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn read_meta(path: &Path) -> Result<Option<Meta>, StoreError> {
    let p = path.join(META_FILE);
    let bytes = match std::fs::read(&p) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err("read", &p)(e)),
    };
    #[derive(Deserialize)]
    struct Head {
        format: u32,
    }
    let head: Head = serde_json::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
        what: "data directory metadata (meta.json)",
        why: e.to_string(),
    })?;
    if head.format > DIR_FORMAT {
        return Err(StoreError::Newer {
            what: "data directory",
            found: head.format,
            reads: DIR_FORMAT,
        });
    }
    if head.format < 2 {
        return Err(StoreError::Corrupt {
            what: "data directory metadata (meta.json)",
            why: format!("layout {} in a file layout 2 introduced", head.format),
        });
    }
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| StoreError::Corrupt {
            what: "data directory metadata (meta.json)",
            why: e.to_string(),
        })
}

fn write_meta(path: &Path, meta: &Meta) -> Result<(), StoreError> {
    let bytes = serde_json::to_vec(meta).map_err(|e| StoreError::Corrupt {
        what: "data directory metadata",
        why: e.to_string(),
    })?;
    files::put_in_place(path, META_FILE, &bytes, true).map_err(io_err("write", &path.join(META_FILE)))
}

/// The committed log id as last written; `None` when missing or unreadable (it need not
/// survive a crash, see [`files`]).
fn read_committed(path: &Path) -> Option<LogId<NodeId>> {
    let bytes = std::fs::read(path.join(COMMITTED_FILE)).ok()?;
    match serde_json::from_slice::<CommittedFile>(&bytes) {
        Ok(c) => c.committed,
        Err(e) => {
            tracing::info!(error = %e, "the saved committed log id does not read (a crash while it was written); the leader will tell");
            None
        }
    }
}

/// Removes what layout 2 writes besides the lock: for a directory with no `meta.json`,
/// whose files can only be what a cut-short migration left.
fn clear_layout_2(path: &Path) -> Result<(), StoreError> {
    let log = path.join(LOG_DIR);
    if log.exists() {
        std::fs::remove_dir_all(&log).map_err(io_err("remove", &log))?;
    }
    for name in [COMMITTED_FILE, SNAPSHOT_FILE] {
        let p = path.join(name);
        match std::fs::remove_file(&p) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("remove", &p)(e)),
        }
    }
    Ok(())
}

/// Writes what a layout-1 directory holds in layout 2, `meta.json` last, then moves
/// sled's files aside.
fn migrate(path: &Path) -> Result<Meta, StoreError> {
    let old = sled_v1::read(path)?;
    clear_layout_2(path)?;
    let (mut log, _) = SegmentLog::open(&path.join(LOG_DIR))?;
    if let Some(first) = old.entries.first() {
        let payloads: Vec<Vec<u8>> = old
            .entries
            .iter()
            .map(|e| crate::wire::entry_to(e).encode_to_vec())
            .collect();
        log.append(first.log_id.index, &payloads)?
            .sync_data()
            .map_err(io_err("fdatasync", &path.join(LOG_DIR)))?;
    }
    if let Some((meta, data)) = &old.snapshot {
        let bytes = files::snapshot_bytes(meta, data).map_err(|why| StoreError::Corrupt { what: "snapshot", why })?;
        files::put_in_place(path, SNAPSHOT_FILE, &bytes, true).map_err(io_err("write", &path.join(SNAPSHOT_FILE)))?;
    }
    let c = serde_json::to_vec(&CommittedFile {
        committed: old.committed,
    })
    .unwrap_or_default();
    files::put_in_place(path, COMMITTED_FILE, &c, true).map_err(io_err("write", &path.join(COMMITTED_FILE)))?;
    let meta = Meta {
        format: DIR_FORMAT,
        node_id: old.node_id,
        vote: old.vote,
        last_purged: old.last_purged,
    };
    write_meta(path, &meta)?;
    // sled lets go of its directory lock when its threads notice the last handle gone;
    // moving its files does not need the lock.
    sled_v1::retire(path)?;
    tracing::info!(dir = %path.display(), entries = old.entries.len(), snapshot = old.snapshot.is_some(), "data directory migrated from layout 1 (sled) to layout 2; the old files are in {}", sled_v1::RETIRED);
    Ok(meta)
}

/// Builds before layout 2 open the directory as a sled database, which would find it
/// empty and start the node with no vote and no log: it could vote twice in a term.
/// sled opens its database file `db`; a directory of that name makes such a build fail
/// to open the directory instead (with "Is a directory"), and says why to whoever looks.
fn refuse_older_builds(path: &Path) -> Result<(), StoreError> {
    let guard = path.join("db");
    let note = guard.join("README");
    if note.is_file() {
        return Ok(());
    }
    std::fs::create_dir_all(&guard).map_err(io_err("create", &guard))?;
    let text = "This data directory is kvota layout 2 (see meta.json). The `db` directory only\n\
                keeps kvota builds from before layout 2, which kept a sled database here, from\n\
                opening it as an empty one. Do not remove it.\n";
    files::put_in_place(&guard, "README", text.as_bytes(), true).map_err(io_err("write", &note))?;
    files::sync_dir(path).map_err(io_err("sync directory", path))
}

/// A data directory held open (its lock released when the last store handle goes).
#[derive(Debug)]
struct Dir {
    path: PathBuf,
    _lock: File,
}

/// Runs blocking file work on the blocking pool: an fsync can take milliseconds and
/// must not stall the Raft tasks sharing the runtime.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, io::Error> {
    tokio::task::spawn_blocking(f).await.map_err(io::Error::other)
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The Raft log and the vote: [`RaftLogStorage`] (and its own [`RaftLogReader`]).
///
/// Holds: entries are contiguous from `last_purged_log_id + 1` (or the first entry) to
/// the last entry; every write is on disk before the call that made it returns (for
/// `append`, before the [`LogFlushed`] callback fires), except the leader's appends of
/// its own entries, which are on disk once [`LogStore::durable`] covers them (the state
/// machine and the Raft network wait for that: see [`flush`]). Cloning gives another
/// handle to the same log (the log reader is such a clone).
#[derive(Clone)]
pub struct LogStore {
    inner: Arc<LogInner>,
}

struct LogInner {
    dir: Arc<Dir>,
    log: std::sync::Mutex<SegmentLog>,
    meta: std::sync::Mutex<Meta>,
    committed: std::sync::Mutex<Committed>,
    flush: Flusher,
}

impl Drop for LogInner {
    fn drop(&mut self) {
        self.flush.stop();
    }
}

/// The committed log id: the latest in memory, written to disk only now and then
/// (see [`COMMITTED_WRITE_EVERY`]).
#[derive(Debug, Default)]
struct Committed {
    latest: Option<LogId<NodeId>>,
    written_index: u64,
    written_at: Option<std::time::Instant>,
}

/// The committed log id is written after this many more commits or this much time, not
/// on every commit (openraft saves it on every one, in its core loop).
const COMMITTED_WRITE_EVERY: (u64, std::time::Duration) = (1_000, std::time::Duration::from_secs(1));

impl fmt::Debug for LogStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let log = lock(&self.inner.log);
        f.debug_struct("LogStore")
            .field("first", &log.first_index())
            .field("last", &log.last_index())
            .finish_non_exhaustive()
    }
}

fn log_read_err(e: impl std::fmt::Display) -> StorageError<NodeId> {
    StorageIOError::read_logs(openraft::AnyError::error(e.to_string())).into()
}

fn log_write_err(e: impl std::fmt::Display) -> StorageError<NodeId> {
    StorageIOError::write_logs(openraft::AnyError::error(e.to_string())).into()
}

/// Decodes the record of log index `index`, checking that it is the entry it claims.
fn decode_entry(index: u64, bytes: &[u8]) -> Result<Entry, StorageError<NodeId>> {
    let at = |e: String| -> StorageError<NodeId> {
        StorageIOError::read_log_at_index(index, openraft::AnyError::error(e)).into()
    };
    let raw = pb::RaftEntry::decode(bytes).map_err(|e| at(format!("log entry: {e}")))?;
    let entry = crate::wire::entry_from(raw, "log entry").map_err(|e| at(e.to_string()))?;
    if entry.log_id.index != index {
        return Err(at(format!("entry stored at index {index} is entry {}", entry.log_id)));
    }
    Ok(entry)
}

impl LogStore {
    /// Records `id` as the node owning this directory on first use, and refuses a
    /// directory first used by another node. Durable before it returns.
    pub async fn claim_for_node(&self, id: NodeId) -> Result<(), StoreError> {
        let mut meta = lock(&self.inner.meta).clone();
        match meta.node_id {
            Some(stored) if stored == id => Ok(()),
            Some(stored) => Err(StoreError::OtherNode { stored, requested: id }),
            None => {
                meta.node_id = Some(id);
                let path = self.inner.dir.path.clone();
                let m = meta.clone();
                blocking(move || write_meta(&path, &m))
                    .await
                    .map_err(io_err("write", &self.inner.dir.path.join(META_FILE)))??;
                *lock(&self.inner.meta) = meta;
                Ok(())
            }
        }
    }

    /// Changes the metadata with `f` and writes it durably; memory changes only once it
    /// is on disk.
    async fn update_meta(
        &self,
        subject: ErrorSubject<NodeId>,
        f: impl FnOnce(&mut Meta),
    ) -> Result<(), StorageError<NodeId>> {
        let mut meta = lock(&self.inner.meta).clone();
        f(&mut meta);
        let path = self.inner.dir.path.clone();
        let m = meta.clone();
        let err = |e: String| -> StorageError<NodeId> {
            StorageIOError::new(
                subject.clone(),
                openraft::ErrorVerb::Write,
                openraft::AnyError::error(e),
            )
            .into()
        };
        blocking(move || write_meta(&path, &m))
            .await
            .map_err(|e| err(e.to_string()))?
            .map_err(|e| err(e.to_string()))?;
        *lock(&self.inner.meta) = meta;
        Ok(())
    }

    fn last_purged(&self) -> Option<LogId<NodeId>> {
        lock(&self.inner.meta).last_purged
    }

    /// How far this log is durable, followed: the state machine applies an entry only
    /// once it is covered, and the leader's commit index to its followers goes no
    /// further (see [`flush`]).
    pub fn durable(&self) -> tokio::sync::watch::Receiver<Durable> {
        self.inner.flush.subscribe()
    }

    /// Holds the syncs of the leader's early-acknowledged appends back until the guard
    /// goes: for tests of what waits for them (the `test-hooks` feature).
    #[cfg(feature = "test-hooks")]
    pub fn hold_flushes_for_test(&self) -> flush::FlushHold {
        self.inner.flush.hold()
    }

    /// The leader id of this node's current vote when the vote is committed and names
    /// this node: the entries it appends under that id are its own, as leader.
    fn leading_as(&self) -> Option<openraft::CommittedLeaderId<NodeId>> {
        let meta = lock(&self.inner.meta);
        let (vote, me) = (meta.vote?, meta.node_id?);
        (vote.is_committed() && vote.leader_id().node_id == me).then_some(*vote.leader_id())
    }
}

/// The log id of the last entry: the last record's, or the purge point when that is
/// past it (after a snapshot was installed).
fn last_log_id(
    log: &SegmentLog,
    last_purged: Option<LogId<NodeId>>,
) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
    let last = match log.last_index() {
        Some(i) => log.read(i, i + 1).map_err(log_read_err)?.pop(),
        None => None,
    };
    let last_entry = match last {
        Some((i, b)) => Some(decode_entry(i, &b)?.log_id),
        None => None,
    };
    Ok(std::cmp::max(last_entry, last_purged))
}

impl RaftLogReader<TypeConfig> for LogStore {
    /// Entries in `range` that are present, in index order (missing ones are skipped,
    /// as openraft allows).
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + fmt::Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError<NodeId>> {
        let start = match range.start_bound() {
            Bound::Included(&i) => i,
            Bound::Excluded(&i) => match i.checked_add(1) {
                Some(i) => i,
                None => return Ok(Vec::new()),
            },
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&i) => i.saturating_add(1),
            Bound::Excluded(&i) => i,
            Bound::Unbounded => u64::MAX,
        };
        let start = start.max(self.last_purged().map_or(0, |p| p.index.saturating_add(1)));
        if start >= end {
            return Ok(Vec::new());
        }
        // Reads come from the page cache; they run inline, as sled's did.
        let records = lock(&self.inner.log).read(start, end).map_err(log_read_err)?;
        records.iter().map(|(i, b)| decode_entry(*i, b)).collect()
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<NodeId>> {
        let last_purged_log_id = self.last_purged();
        let last_log_id = last_log_id(&lock(&self.inner.log), last_purged_log_id)?;
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError<NodeId>> {
        let vote = *vote;
        self.update_meta(ErrorSubject::Vote, move |m| m.vote = Some(vote)).await
    }

    /// The saved vote; one that made this node leader comes back uncommitted. openraft
    /// would otherwise restore the leadership in the same term at startup, and a leader's
    /// log may have lost entries it acknowledged before their sync (`flush`) while its
    /// followers hold them: it would then make new entries under the same log ids. As
    /// a candidate it must win a new term, whose entries replace those. The vote for
    /// itself stays, so it still votes for nobody else in the old term.
    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError<NodeId>> {
        let meta = lock(&self.inner.meta);
        Ok(meta.vote.map(|v| match meta.node_id {
            Some(me) if v.is_committed() && v.leader_id().node_id == me => Vote::new(v.leader_id().term, me),
            _ => v,
        }))
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> Result<(), StorageError<NodeId>> {
        // Not synced and written only every COMMITTED_WRITE_EVERY: see `files`.
        {
            let mut c = lock(&self.inner.committed);
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
        // Never past this node's durable log: the leader commits entries whose own sync
        // may still be running (`flush`), and a power cut could lose those while this
        // file survives; a restart would then look for committed entries it lacks.
        let committed = flush::clamp_commit(committed, &self.inner.flush.now());
        let bytes = serde_json::to_vec(&CommittedFile { committed }).map_err(|e| {
            StorageIOError::new(
                ErrorSubject::Store,
                openraft::ErrorVerb::Write,
                openraft::AnyError::error(&e),
            )
        })?;
        // A small write and a rename, no sync: cheap enough for the core's loop.
        files::put_in_place(&self.inner.dir.path, COMMITTED_FILE, &bytes, false).map_err(|e| {
            StorageIOError::new(
                ErrorSubject::Store,
                openraft::ErrorVerb::Write,
                openraft::AnyError::error(&e),
            )
        })?;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
        Ok(lock(&self.inner.committed).latest)
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError<NodeId>>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        if let Some(why) = self.inner.flush.now().failed {
            // A sync failed: what this log holds may not be on disk; take nothing more.
            callback.log_io_completed(Err(io::Error::other(why.clone())));
            return Err(log_write_err(why));
        }
        let leading = self.leading_as();
        let mut own = true;
        let mut first = None;
        let mut last = None;
        let mut payloads = Vec::new();
        for entry in entries {
            let want = first.map(|f: u64| f + payloads.len() as u64);
            if want.is_some_and(|w| w != entry.log_id.index) {
                let e = log_write_err(format!("entries to append are not consecutive at {}", entry.log_id));
                callback.log_io_completed(Err(io::Error::other("entries to append are not consecutive")));
                return Err(e);
            }
            first.get_or_insert(entry.log_id.index);
            own &= leading == Some(entry.log_id.leader_id);
            last = Some(entry.log_id);
            payloads.push(crate::wire::entry_to(&entry).encode_to_vec());
        }
        let (Some(first), Some(last)) = (first, last) else {
            callback.log_io_completed(Ok(()));
            return Ok(());
        };
        if own {
            // This node's own entries as the leader of its committed vote: write them
            // here (into the page cache), hand the sync to the flusher and acknowledge,
            // so openraft replicates while the disk syncs. Safe because nothing applies
            // them, here or on a follower, before the sync is done (`flush`). A write
            // that starts a segment (a create, a rename, syncs) goes the slow way.
            let written = {
                let mut log = lock(&self.inner.log);
                if log.needs_new_segment(first) {
                    None
                } else {
                    Some(log.append(first, &payloads).map_err(|e| e.to_string()))
                }
            };
            if let Some(written) = written {
                let queued = written.and_then(|file| self.inner.flush.queue(last, file));
                return match queued {
                    Ok(()) => {
                        callback.log_io_completed(Ok(()));
                        Ok(())
                    }
                    Err(e) => {
                        callback.log_io_completed(Err(io::Error::other(e.clone())));
                        Err(log_write_err(e))
                    }
                };
            }
        }
        // One write, then one fdatasync of that file, then the acknowledgement: openraft
        // counts this node towards the quorum as soon as the callback fires.
        let inner = Arc::clone(&self.inner);
        let done = blocking(move || -> Result<(), String> {
            let file = lock(&inner.log).append(first, &payloads).map_err(|e| e.to_string())?;
            file.sync_data().map_err(|e| format!("fdatasync the Raft log: {e}"))
        })
        .await
        .map_err(|e| e.to_string())
        .and_then(|r| r);
        match done {
            Ok(()) => {
                self.inner.flush.synced(last);
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(io::Error::other(e.clone())));
                Err(log_write_err(e))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        // Wait for any sync of the old tail first, so it cannot move the durable mark
        // past the cut once it finishes; the mark then ends at the entry before the cut.
        let inner = Arc::clone(&self.inner);
        let purged = self.last_purged();
        let upto = blocking(move || -> Result<Option<LogId<NodeId>>, StorageError<NodeId>> {
            inner.flush.idle().map_err(log_write_err)?;
            let mut log = lock(&inner.log);
            log.truncate(log_id.index).map_err(log_write_err)?;
            last_log_id(&log, purged)
        })
        .await
        .map_err(log_write_err)??;
        self.inner.flush.reset(upto);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<(), StorageError<NodeId>> {
        // Record the purge point first, durably: if we crash before the segments are
        // gone, the log state is still right (and `open` removes the leftovers).
        self.update_meta(ErrorSubject::Logs, move |m| m.last_purged = Some(log_id))
            .await?;
        let inner = Arc::clone(&self.inner);
        blocking(move || lock(&inner.log).purge(log_id.index))
            .await
            .map_err(log_write_err)?
            .map_err(log_write_err)
    }
}

/// The state machine and its snapshots: [`RaftStateMachine`].
///
/// Holds: the current snapshot file, when there is one, is the state a restart loads;
/// `current` is its meta.
pub struct StateMachineStore {
    /// How far the log is durable: an entry is applied only once it is (see [`flush`]).
    durable: tokio::sync::watch::Receiver<Durable>,
    dir: Arc<Dir>,
    data: Arc<RwLock<StateMachineData>>,
    /// The current snapshot's meta. Its lock serialises writes of the snapshot file
    /// (from snapshot builders, which run concurrently with the state machine, and from
    /// `install_snapshot`) and reads of it, so a newer snapshot is never replaced by an
    /// older build.
    current: Arc<Mutex<Option<SnapshotMeta<NodeId, Node>>>>,
    /// The newest feature level this node supports ([`crate::feature::FeatureLevel::NEWEST`]
    /// unless a test poses as a newer build).
    feature_max: FeatureLevel,
    next_id: Arc<AtomicU64>,
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
    /// produced (`last_applied` and `federation` always agree). Hold the lock briefly:
    /// `apply` waits for readers.
    pub fn shared(&self) -> Arc<RwLock<StateMachineData>> {
        Arc::clone(&self.data)
    }

    /// The newest feature level this node supports (given to [`open_for`]).
    pub fn feature_max(&self) -> FeatureLevel {
        self.feature_max
    }
}

/// Writes `meta` + `data` as the snapshot file, durably. With `only_if_newer`, a current
/// snapshot with a later `last_log_id` is kept instead. The caller holds `current`'s lock
/// and passes what it guards.
async fn persist_snapshot(
    dir: &Dir,
    current: &mut Option<SnapshotMeta<NodeId, Node>>,
    meta: &SnapshotMeta<NodeId, Node>,
    data: &[u8],
    only_if_newer: bool,
) -> Result<(), StorageError<NodeId>> {
    let err = |e: String| -> StorageError<NodeId> {
        StorageIOError::write_snapshot(Some(meta.signature()), openraft::AnyError::error(e)).into()
    };
    if only_if_newer && current.as_ref().is_some_and(|c| c.last_log_id > meta.last_log_id) {
        return Ok(());
    }
    let bytes = files::snapshot_bytes(meta, data).map_err(err)?;
    let path = dir.path.clone();
    blocking(move || files::put_in_place(&path, SNAPSHOT_FILE, &bytes, true))
        .await
        .map_err(|e| err(e.to_string()))?
        .map_err(|e| err(format!("write {SNAPSHOT_FILE}: {e}")))?;
    *current = Some(meta.clone());
    Ok(())
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = SnapshotBuilder;

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
        let entries: Vec<Entry> = entries.into_iter().collect();
        if let Some(last) = entries.last() {
            let last = last.log_id.index;
            // The leader acknowledged its own append before syncing it (`flush`): wait
            // for the sync, so no entry is applied (answered, granted, read) before this
            // node holds it durably. A no-op on followers, which sync before acknowledging.
            let ready = self
                .durable
                .wait_for(|d| d.failed.is_some() || d.may_apply(last))
                .await
                .map(|d| d.failed.clone());
            let failed = match ready {
                Ok(failed) => failed,
                Err(_) => Some("the Raft log store was closed".to_string()),
            };
            if let Some(why) = failed {
                return Err(StorageIOError::write_logs(openraft::AnyError::error(why)).into());
            }
        }
        let mut replies = Vec::new();
        {
            let mut data = self.data.write().await;
            for entry in entries {
                // Applying an entry twice would not be idempotent (a second
                // registration issues another lease), and nodes would diverge; refuse
                // rather than corrupt. A storage error stops this Raft node.
                if crate::entry::check_next(data.last_applied.map(|l| l.index), entry.log_id.index).is_err() {
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
                let _span =
                    tracing::debug_span!("apply", index = entry.log_id.index, term = entry.log_id.leader_id.term)
                        .entered();
                data.last_applied = Some(entry.log_id);
                let reply = match entry.payload {
                    EntryPayload::Blank => {
                        let leader = entry.log_id.leader_id;
                        crate::entry::apply_blank(&mut data.federation, leader.term, leader.node_id);
                        Response(None)
                    }
                    EntryPayload::Normal(req) => {
                        let supported = self.feature_max();
                        let StateMachineData {
                            federation,
                            feature_level,
                            ..
                        } = &mut *data;
                        match crate::entry::apply(federation, feature_level, req, supported) {
                            Ok(answers) => Response(Some(answers)),
                            Err(too_new) => {
                                // Nothing of the entry was applied; openraft applies it
                                // again after an upgrade.
                                data.last_applied = previous;
                                return Err(StorageIOError::apply(
                                    entry.log_id,
                                    openraft::AnyError::error(too_new.to_string()),
                                )
                                .into());
                            }
                        }
                    }
                    EntryPayload::Membership(membership) => {
                        let old = data.last_membership.membership().clone();
                        crate::entry::apply_membership(&mut data.federation, &old, &membership);
                        data.last_membership = StoredMembership::new(Some(entry.log_id), membership);
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
        // Only a copy is taken here; serializing it (seconds of CPU for a large
        // federation) happens in `build_snapshot`, which openraft runs as a task of its
        // own while applies go on.
        let mut data = self.data.read().await.clone();
        // Stamped with the format this level writes, whatever format the state was read
        // from.
        data.format = data.feature_level.snapshot_format();
        SnapshotBuilder {
            dir: Arc::clone(&self.dir),
            current: Arc::clone(&self.current),
            unique: self.next_id.fetch_add(1, Ordering::Relaxed),
            data: Some(data),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError<NodeId>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, Node>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<NodeId>> {
        let bytes = snapshot.into_inner();
        // Decode and check everything before touching disk or memory: a bad snapshot
        // must leave the state machine as it was. (The Raft port checked it the same
        // way before openraft saw it: a peer's bad snapshot never gets here.)
        let new = decode_snapshot(meta, &bytes, self.feature_max())
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), openraft::AnyError::error(e)))?;
        {
            let mut current = self.current.lock().await;
            persist_snapshot(&self.dir, &mut current, meta, &bytes, false).await?;
        }
        *self.data.write().await = new;
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError<NodeId>> {
        let current = self.current.lock().await;
        if current.is_none() {
            return Ok(None);
        }
        let path = self.dir.path.join(SNAPSHOT_FILE);
        let read_err = |e: String| -> StorageError<NodeId> {
            StorageIOError::read_snapshot(None, openraft::AnyError::error(e)).into()
        };
        let bytes = blocking(move || std::fs::read(path))
            .await
            .map_err(|e| read_err(e.to_string()))?
            .map_err(|e| read_err(format!("read {SNAPSHOT_FILE}: {e}")))?;
        let (meta, data) = files::snapshot_from_bytes(&bytes).map_err(|e| read_err(e.to_string()))?;
        Ok(Some(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        }))
    }
}

/// Whether `bytes` are a snapshot this node can install for `meta`: they decode as a
/// state of a format and feature level it reads (up to `feature_max`), and say what the
/// meta says (last applied log id, membership). The Raft port asks before a received
/// snapshot reaches openraft, which stops the node's Raft core on any storage error.
pub fn check_snapshot_data(
    meta: &SnapshotMeta<NodeId, Node>,
    bytes: &[u8],
    feature_max: FeatureLevel,
) -> Result<(), String> {
    decode_snapshot(meta, bytes, feature_max).map(|_| ())
}

fn decode_snapshot(
    meta: &SnapshotMeta<NodeId, Node>,
    bytes: &[u8],
    feature_max: FeatureLevel,
) -> Result<StateMachineData, String> {
    let new = StateMachineData::decode(bytes, feature_max)?;
    if new.last_applied != meta.last_log_id || new.last_membership != meta.last_membership {
        return Err(format!(
            "snapshot content (last applied {:?}, membership {:?}) does not match its meta {}",
            new.last_applied, new.last_membership, meta
        ));
    }
    Ok(new)
}

/// Builds snapshots of the state machine (openraft runs it alongside `apply`).
///
/// Holds: a snapshot is the state machine as it was when the builder was made (between
/// two applies), its bytes and meta from one serialization. Building persists it durably,
/// as the current snapshot and the state a restart loads, before openraft may purge the
/// log up to it; unless a newer one was installed meanwhile.
pub struct SnapshotBuilder {
    dir: Arc<Dir>,
    current: Arc<Mutex<Option<SnapshotMeta<NodeId, Node>>>>,
    unique: u64,
    /// A copy of the state machine as it was when the builder was made (taken by the
    /// build).
    data: Option<StateMachineData>,
}

impl fmt::Debug for SnapshotBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SnapshotBuilder")
            .field("last_applied", &self.data.as_ref().map(|d| d.last_applied))
            .finish_non_exhaustive()
    }
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError<NodeId>> {
        let err = |e: String| -> StorageError<NodeId> {
            StorageIOError::read_state_machine(openraft::AnyError::error(e)).into()
        };
        let data = self
            .data
            .take()
            .ok_or_else(|| err("snapshot already built".to_string()))?;
        let (last_applied, last_membership) = (data.last_applied, data.last_membership.clone());
        // Off the async workers: encoding a large state would hold one of them for a
        // second, and with it heartbeats (a leader lost its leadership that way).
        let bytes = blocking(move || serde_json::to_vec(&data))
            .await
            .map_err(|e| err(e.to_string()))?
            .map_err(|e| err(e.to_string()))?;
        // The clock at open plus a counter: two builds at the same log id, even across
        // restarts, get distinct snapshot ids.
        let unique = self.unique;
        let snapshot_id = match last_applied {
            Some(id) => format!("{}-{}-{unique}", id.leader_id.term, id.index),
            None => format!("none-{unique}"),
        };
        let meta = SnapshotMeta {
            last_log_id: last_applied,
            last_membership,
            snapshot_id,
        };
        {
            let mut current = self.current.lock().await;
            persist_snapshot(&self.dir, &mut current, &meta, &bytes, true).await?;
        }
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}
