//! The small files of a data directory besides the log: the metadata (vote, owner,
//! purge point), the committed log id, and the current snapshot.
//!
//! ```text
//! meta.json       JSON {format, node_id, vote, last_purged}; replaced whole
//! committed.json  JSON {committed}; replaced whole, not synced (see below)
//! snapshot.kvs    "KVSNAPSH" | format (u32 LE) = 1 | meta length (u32 LE) | data length (u64 LE)
//!                 | CRC-32 of meta and data (u32 LE) | meta (JSON of openraft's SnapshotMeta)
//!                 | data (the JSON of StateMachineData: the snapshot, which is also the state a
//!                 restart loads)
//! ```
//!
//! A file is replaced by writing a temporary file beside it, syncing it, renaming it
//! over the old one and syncing the directory ([`put_in_place`]): a crash leaves the old
//! file or the new one, never a mix. The committed log id skips the syncs: Raft does not
//! need it, openraft saves it on every commit, and a stale or missing one after a crash
//! only means applying fewer entries at startup and learning the rest from the leader.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use openraft::{LogId, SnapshotMeta, Vote};
use serde::{Deserialize, Serialize};

use crate::types::{Node, NodeId};

/// The metadata file's name.
pub const META_FILE: &str = "meta.json";
/// The committed log id's file name.
pub const COMMITTED_FILE: &str = "committed.json";
/// The current snapshot's file name.
pub const SNAPSHOT_FILE: &str = "snapshot.kvs";

/// The snapshot file format this build writes and reads.
pub const SNAPSHOT_FILE_FORMAT: u32 = 1;
const SNAPSHOT_MAGIC: &[u8; 8] = b"KVSNAPSH";
const SNAPSHOT_HEAD: usize = 28;
/// Largest snapshot file read (the state of 1,000 tenants in 64 clusters is a few MiB).
pub const MAX_SNAPSHOT_BYTES: u64 = 1 << 30;

/// The data directory's metadata.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Meta {
    /// The directory layout ([`super::DIR_FORMAT`]).
    pub format: u32,
    /// The node that owns the directory, once claimed.
    #[serde(default)]
    pub node_id: Option<NodeId>,
    /// The last vote saved.
    #[serde(default)]
    pub vote: Option<Vote<NodeId>>,
    /// The last purge point: the log holds nothing at or below it.
    #[serde(default)]
    pub last_purged: Option<LogId<NodeId>>,
}

/// The committed log id as saved.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommittedFile {
    /// The committed log id.
    pub committed: Option<LogId<NodeId>>,
}

/// Syncs a directory, so that names created, renamed or removed in it last.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Replaces `dir/name` with `bytes`: written to a temporary file, synced, renamed into
/// place, the directory synced (`durable`), or the same without the syncs.
pub fn put_in_place(dir: &Path, name: &str, bytes: &[u8], durable: bool) -> std::io::Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        if durable {
            f.sync_all()?;
        }
    }
    std::fs::rename(&tmp, dir.join(name))?;
    if durable {
        sync_dir(dir)?;
    }
    Ok(())
}

/// The bytes of a snapshot file holding `meta` and `data`.
pub fn snapshot_bytes(meta: &SnapshotMeta<NodeId, Node>, data: &[u8]) -> Result<Vec<u8>, String> {
    let meta = serde_json::to_vec(meta).map_err(|e| format!("encode the snapshot's meta: {e}"))?;
    let meta_len = u32::try_from(meta.len()).map_err(|_| "a snapshot meta over 4 GiB".to_string())?;
    let mut h = crc32fast::Hasher::new();
    h.update(&meta);
    h.update(data);
    let mut out = Vec::with_capacity(SNAPSHOT_HEAD + meta.len() + data.len());
    out.extend_from_slice(SNAPSHOT_MAGIC);
    out.extend_from_slice(&SNAPSHOT_FILE_FORMAT.to_le_bytes());
    out.extend_from_slice(&meta_len.to_le_bytes());
    out.extend_from_slice(&(data.len() as u64).to_le_bytes());
    out.extend_from_slice(&h.finalize().to_le_bytes());
    out.extend_from_slice(&meta);
    out.extend_from_slice(data);
    Ok(out)
}

/// Why a snapshot file does not read.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotFileError {
    /// Written by a newer kvota.
    #[error("snapshot file format {0} is newer than this kvota reads ({SNAPSHOT_FILE_FORMAT}): run the newer kvota on this directory")]
    Newer(u32),
    /// Not a snapshot file, or damaged.
    #[error("{0}")]
    Damaged(String),
}

/// Reads a snapshot file's bytes: its meta and its data. Never panics, whatever the
/// bytes; every byte is covered by the checksum or checked.
pub fn snapshot_from_bytes(bytes: &[u8]) -> Result<(SnapshotMeta<NodeId, Node>, Vec<u8>), SnapshotFileError> {
    let damaged = |why: String| SnapshotFileError::Damaged(why);
    if bytes.len() < SNAPSHOT_HEAD || &bytes[..8] != SNAPSHOT_MAGIC {
        return Err(damaged(
            "not a kvota snapshot file (too short, or its first bytes are not the snapshot magic)".into(),
        ));
    }
    let u32_at = |at: usize| {
        let mut a = [0u8; 4];
        a.copy_from_slice(&bytes[at..at + 4]);
        u32::from_le_bytes(a)
    };
    let format = u32_at(8);
    if format > SNAPSHOT_FILE_FORMAT {
        return Err(SnapshotFileError::Newer(format));
    }
    if format == 0 {
        return Err(damaged("snapshot file format 0".into()));
    }
    let meta_len = u32_at(12) as usize;
    let mut d = [0u8; 8];
    d.copy_from_slice(&bytes[16..24]);
    let data_len = u64::from_le_bytes(d);
    let sum = u32_at(24);
    let body = &bytes[SNAPSHOT_HEAD..];
    if Some(body.len() as u64) != (meta_len as u64).checked_add(data_len) {
        return Err(damaged(format!(
            "the header announces {meta_len} + {data_len} bytes and the file holds {} after it (cut short or grown)",
            body.len()
        )));
    }
    if crc32fast::hash(body) != sum {
        return Err(damaged("checksum mismatch: the file is damaged".into()));
    }
    let meta: SnapshotMeta<NodeId, Node> =
        serde_json::from_slice(&body[..meta_len]).map_err(|e| damaged(format!("the snapshot's meta: {e}")))?;
    Ok((meta, body[meta_len..].to_vec()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use proptest::prelude::*;

    fn meta() -> SnapshotMeta<NodeId, Node> {
        SnapshotMeta {
            last_log_id: Some(openraft::testing::log_id(2, 1, 40)),
            last_membership: Default::default(),
            snapshot_id: "2-40-x".into(),
        }
    }

    #[test]
    fn a_snapshot_file_reads_back_and_strangers_are_refused() {
        let b = snapshot_bytes(&meta(), b"{\"state\":1}").unwrap();
        assert_eq!(snapshot_from_bytes(&b).unwrap(), (meta(), b"{\"state\":1}".to_vec()));
        let mut newer = b.clone();
        newer[8] = 2;
        assert_eq!(snapshot_from_bytes(&newer).unwrap_err(), SnapshotFileError::Newer(2));
        assert!(snapshot_from_bytes(&b[..b.len() - 1])
            .unwrap_err()
            .to_string()
            .contains("cut short"));
        let mut flipped = b.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(snapshot_from_bytes(&flipped)
            .unwrap_err()
            .to_string()
            .contains("checksum"));
        assert!(snapshot_from_bytes(b"{}")
            .unwrap_err()
            .to_string()
            .contains("not a kvota snapshot"));
    }

    proptest! {
        /// Arbitrary bytes, or a good file changed or cut anywhere: the snapshot as
        /// written or an error, never a panic and never something else.
        #[test]
        fn damaged_snapshot_files_never_read_as_something_else(junk in prop::collection::vec(any::<u8>(), 0..128), at in any::<prop::sample::Index>(), byte in 1u8..=255, cut in any::<bool>()) {
            let _ = snapshot_from_bytes(&junk);
            let good = snapshot_bytes(&meta(), b"{\"state\":[1,2,3]}").unwrap();
            let mut b = good.clone();
            let i = at.index(b.len());
            if cut { b.truncate(i) } else { b[i] ^= byte }
            if let Ok(got) = snapshot_from_bytes(&b) {
                prop_assert_eq!(got, (meta(), b"{\"state\":[1,2,3]}".to_vec()));
                prop_assert!(!cut);
            }
        }
    }
}
