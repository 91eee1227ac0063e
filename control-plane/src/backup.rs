//! Backups of the replicated state: `kvota snapshot save` asks a node (the read follows
//! the leader) for its applied state in a versioned file; `kvota snapshot restore`
//! writes that state into a new data directory as the snapshot of a one-node group, so
//! `kvota server` on it boots a working federation, which then grows with `kvota
//! members add-learner` and `set-voters`.
//!
//! The file (format 1) is one JSON object:
//!
//! ```text
//! {"kind": "kvota-backup", "format": 1, "taken_at_ms": ..., "node_id": ..., "applied_index": ...,
//!  "feature_level": ..., "state": { the state machine's snapshot, with its own format } }
//! ```
//!
//! A newer backup format, or a state of a newer format or feature level than this build
//! reads, is refused with a message saying so; nothing is written then.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use std::path::Path;

use crate::feature::FeatureLevel;
use openraft::storage::RaftStateMachine;
use openraft::{CommittedLeaderId, LogId, Membership, SnapshotMeta, StoredMembership};
use serde::{Deserialize, Serialize};

use crate::store::StateMachineData;
use crate::types::{Node, NodeId};

/// The newest backup format this build writes and reads.
pub const BACKUP_FORMAT: u32 = 1;
/// The `kind` of a backup file.
pub const BACKUP_KIND: &str = "kvota-backup";
/// Largest backup file read (the state is bounded well below it).
pub const MAX_BACKUP_BYTES: usize = 1 << 30;

/// A backup file's header and state.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Backup {
    /// Always [`BACKUP_KIND`].
    pub kind: String,
    /// The backup format ([`BACKUP_FORMAT`] when written by this build).
    pub format: u32,
    /// When it was taken (the node's wall clock, ms since the Unix epoch).
    pub taken_at_ms: u64,
    /// The node that answered.
    pub node_id: NodeId,
    /// The last log index applied to the state saved.
    pub applied_index: u64,
    /// The group's feature level then.
    pub feature_level: FeatureLevel,
    /// The state machine's snapshot (see [`StateMachineData`]).
    pub state: serde_json::Value,
}

/// What a backup holds, in a sentence's worth of numbers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    /// The last log index applied to the state.
    pub applied_index: u64,
    /// The policy in force.
    pub policy: Option<String>,
    /// Its tenants.
    pub tenants: usize,
    /// Registered clusters.
    pub clusters: usize,
    /// The feature level.
    pub feature_level: FeatureLevel,
    /// The replicated clock.
    pub state_time_ms: u64,
}

impl Summary {
    fn of(data: &StateMachineData) -> Summary {
        let fed = &data.federation;
        Summary {
            applied_index: data.last_applied.map_or(0, |l| l.index),
            policy: fed.policy().map(|p| p.name.clone()),
            tenants: fed.policy().map_or(0, |p| p.tenants.len()),
            clusters: fed.clusters().len(),
            feature_level: data.feature_level,
            state_time_ms: fed.now_ms(),
        }
    }
}

/// `data` as a backup file taken by `node_id` at `now_ms`.
pub fn encode(data: &StateMachineData, node_id: NodeId, now_ms: u64) -> Result<Vec<u8>, String> {
    let mut data = data.clone();
    data.format = data.feature_level.snapshot_format();
    let backup = Backup {
        kind: BACKUP_KIND.to_string(),
        format: BACKUP_FORMAT,
        taken_at_ms: now_ms,
        node_id,
        applied_index: data.last_applied.map_or(0, |l| l.index),
        feature_level: data.feature_level,
        state: serde_json::to_value(&data).map_err(|e| format!("encode the state: {e}"))?,
    };
    serde_json::to_vec(&backup).map_err(|e| format!("encode the backup: {e}"))
}

/// Reads a backup file: its header and its state, checked (a newer format or feature
/// level than `feature_max` is refused).
pub fn decode(bytes: &[u8], feature_max: FeatureLevel) -> Result<(Backup, StateMachineData), String> {
    if bytes.len() > MAX_BACKUP_BYTES {
        return Err(format!("{} bytes; a backup is at most {MAX_BACKUP_BYTES}", bytes.len()));
    }
    #[derive(Deserialize)]
    struct Head {
        kind: Option<String>,
        format: Option<u32>,
    }
    let head: Head =
        serde_json::from_slice(bytes).map_err(|e| format!("not a kvota backup (not a JSON object: {e})"))?;
    if head.kind.as_deref() != Some(BACKUP_KIND) {
        return Err(format!(
            "not a kvota backup (kind {:?}, expected {BACKUP_KIND:?})",
            head.kind.unwrap_or_default()
        ));
    }
    match head.format {
        Some(f) if f > BACKUP_FORMAT => {
            return Err(format!(
            "backup format {f} is newer than this kvota reads (up to {BACKUP_FORMAT}): restore it with a newer kvota"
        ))
        }
        Some(0) | None => return Err("the backup names no format".to_string()),
        Some(_) => {}
    }
    let backup: Backup = serde_json::from_slice(bytes).map_err(|e| format!("a damaged backup: {e}"))?;
    let state_bytes = serde_json::to_vec(&backup.state).map_err(|e| format!("a damaged backup: {e}"))?;
    let data = StateMachineData::decode(&state_bytes, feature_max)?;
    if data.last_applied.map_or(0, |l| l.index) != backup.applied_index {
        return Err(format!(
            "a damaged backup: its header says log index {}, its state {}",
            backup.applied_index,
            data.last_applied.map_or(0, |l| l.index)
        ));
    }
    Ok((backup, data))
}

/// What a backup file holds.
pub fn summary(bytes: &[u8], feature_max: FeatureLevel) -> Result<Summary, String> {
    decode(bytes, feature_max).map(|(_, data)| Summary::of(&data))
}

/// Writes the backup `bytes` into the new data directory `dir` as node `id` (reachable
/// at `node`'s addresses), the only voter of its group: the state is installed as the
/// group's snapshot at log index 1 of term 1 (the old group's log ids mean nothing to
/// the new one), and `kvota server --id ID --data-dir DIR` (without `--init`) starts
/// from it. `dir` must not hold a data directory yet.
pub async fn restore(
    bytes: &[u8],
    dir: &Path,
    id: NodeId,
    node: Node,
    feature_max: FeatureLevel,
) -> Result<Summary, String> {
    let (head, mut data) = decode(bytes, feature_max)?;
    let summary = Summary::of(&data);
    // From the operator view on, the restored federation's audit log says so.
    data.federation
        .note(kvota_fairness::federation::AuditEvent::SnapshotRestored {
            applied_index: head.applied_index,
            taken_at_ms: head.taken_at_ms,
            taken_by: head.node_id,
        });
    let raft_dir = dir.join("raft");
    if raft_dir.exists() && std::fs::read_dir(&raft_dir).map_or(true, |mut d| d.next().is_some()) {
        return Err(format!(
            "{} already holds a data directory; restore into a new one (a restore never overwrites a node's data)",
            dir.display()
        ));
    }
    let log_id = LogId::new(CommittedLeaderId::new(1, id), 1);
    let membership = Membership::new(vec![BTreeSet::from([id])], BTreeMap::from([(id, node)]));
    data.last_applied = Some(log_id);
    data.last_membership = StoredMembership::new(Some(log_id), membership);
    data.format = data.feature_level.snapshot_format();
    let snapshot = serde_json::to_vec(&data).map_err(|e| format!("encode the state: {e}"))?;
    let (log_store, mut sm) =
        crate::store::open_for(&raft_dir, feature_max).map_err(|e| format!("create {}: {e}", raft_dir.display()))?;
    log_store.claim_for_node(id).await.map_err(|e| e.to_string())?;
    let meta = SnapshotMeta {
        last_log_id: data.last_applied,
        last_membership: data.last_membership.clone(),
        snapshot_id: format!("restored-{}", summary.applied_index),
    };
    sm.install_snapshot(&meta, Box::new(Cursor::new(snapshot)))
        .await
        .map_err(|e| format!("install the state: {e}"))?;
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> Vec<u8> {
        let mut data = StateMachineData::default();
        let policy = kvota_fairness::policy::Policy::from_yaml(kvota_fairness::policy::Policy::article_example_yaml())
            .expect("policy");
        let _ = data
            .federation
            .apply(1_000, kvota_fairness::federation::Command::ApplyPolicy(policy));
        data.last_applied = Some(LogId::new(CommittedLeaderId::new(3, 1), 42));
        encode(&data, 1, 5_000).expect("encode")
    }

    #[test]
    fn a_backup_reads_back_and_strangers_are_refused() {
        let bytes = sample();
        let (head, data) = decode(&bytes, FeatureLevel::NEWEST).expect("decode");
        assert_eq!((head.format, head.applied_index, head.node_id), (BACKUP_FORMAT, 42, 1));
        assert_eq!(data.federation.policy().map(|p| p.tenants.len()), Some(3));
        let s = summary(&bytes, FeatureLevel::NEWEST).expect("summary");
        assert_eq!((s.applied_index, s.tenants, s.clusters), (42, 3, 0));
        let text = String::from_utf8(bytes.clone()).expect("utf8");
        for (bad, says) in [
            ("[]".to_string(), "not a kvota backup"),
            (text.replacen("kvota-backup", "something", 1), "not a kvota backup"),
            (
                text.replacen("\"format\":1", "\"format\":9", 1),
                "newer than this kvota reads",
            ),
            (
                text.replacen("\"applied_index\":42", "\"applied_index\":41", 1),
                "header says log index 41",
            ),
            (text.replacen("\"kind\"", "\"extra\":1,\"kind\"", 1), "damaged"),
        ] {
            let e = decode(bad.as_bytes(), FeatureLevel::NEWEST).expect_err(says);
            assert!(e.contains(says), "{says}: {e}");
        }
    }

    proptest! {
        /// Arbitrary bytes, or a backup with a byte changed or cut short: an answer (the
        /// state, or why not), never a panic.
        #[test]
        fn damaged_backups_never_panic(junk in prop::collection::vec(any::<u8>(), 0..256), at in any::<prop::sample::Index>(), byte in any::<u8>(), cut in any::<bool>()) {
            let _ = decode(&junk, FeatureLevel::NEWEST);
            let mut b = sample();
            let i = at.index(b.len());
            if cut { b.truncate(i) } else { b[i] = byte }
            let _ = decode(&b, FeatureLevel::NEWEST);
        }
    }
}
