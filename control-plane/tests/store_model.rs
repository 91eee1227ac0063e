//! The log store against a model of the log: after any sequence of appends (in new
//! terms or not), truncations and purges, every range read, including ranges that
//! straddle the first or the last entry, gives exactly what the model holds; and after a
//! reopen (everything read back from the segment files) the same, with the same last
//! log id.

#![allow(clippy::unwrap_used)]

use std::path::Path;

use kvota_control_plane::store::{self, LogStore, StateMachineStore};
use kvota_control_plane::types::TypeConfig;
use openraft::storage::{RaftLogStorage, RaftLogStorageExt};
use openraft::{Entry, EntryPayload, RaftLogReader};
use proptest::prelude::*;
use tempfile::TempDir;

mod common;
use common::*;

#[derive(Clone, Debug)]
enum Op {
    /// Append this many entries, in a new term when the flag says so.
    Append(u8, bool),
    /// Truncate at the entry this far from the last one (modulo the entries held).
    Truncate(u8),
    /// Purge up to the entry this far from the first one held (modulo the entries held).
    Purge(u8),
    /// Read a range, its ends picked from the indexes around the log.
    Read(u16, u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u8..=80, any::<bool>()).prop_map(|(n, t)| Op::Append(n, t)),
        1 => any::<u8>().prop_map(Op::Truncate),
        1 => any::<u8>().prop_map(Op::Purge),
        4 => (any::<u16>(), any::<u16>()).prop_map(|(a, b)| Op::Read(a, b)),
    ]
}

/// What the log holds: entries after `purged`, in order.
#[derive(Default)]
struct Model {
    entries: Vec<Entry<TypeConfig>>,
    purged: u64,
    term: u64,
}

impl Model {
    fn last(&self) -> u64 {
        self.entries.last().map_or(self.purged, |e| e.log_id.index)
    }

    fn range(&self, lo: u64, hi: u64) -> Vec<Entry<TypeConfig>> {
        self.entries
            .iter()
            .filter(|e| e.log_id.index >= lo && e.log_id.index < hi)
            .cloned()
            .collect()
    }
}

/// An entry of every kind the log carries: blank, and commands of different sizes.
fn payload(index: u64) -> EntryPayload<TypeConfig> {
    match index % 4 {
        0 => EntryPayload::Blank,
        1 => normal(index, register("east", index)),
        _ => normal(index, report("east", index, 1_000 * (index % 9))),
    }
}

/// Opens the store, waiting for a previous handle's lock (the blocking pool may hold
/// the last handle a moment longer).
fn open(path: &Path) -> (LogStore, StateMachineStore) {
    for _ in 0..100 {
        match store::open(path) {
            Ok(s) => return s,
            Err(e) if e.to_string().contains("lock") => std::thread::sleep(std::time::Duration::from_millis(50)),
            Err(e) => panic!("open {}: {e}", path.display()),
        }
    }
    panic!("{} stayed locked", path.display())
}

async fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dir = TempDir::new().unwrap();
    let mut model = Model {
        term: 1,
        ..Model::default()
    };
    let mut checks = Vec::new();
    {
        let (mut log, _sm) = open(dir.path());
        for op in ops {
            match op {
                Op::Append(n, new_term) => {
                    if new_term {
                        model.term += 1;
                    }
                    let from = model.last() + 1;
                    let batch: Vec<_> = (from..from + u64::from(n))
                        .map(|i| entry(model.term, i, payload(i)))
                        .collect();
                    log.blocking_append(batch.clone()).await.unwrap();
                    model.entries.extend(batch);
                }
                Op::Truncate(back) if !model.entries.is_empty() => {
                    let at = model.entries.len() - 1 - usize::from(back) % model.entries.len();
                    log.truncate(model.entries[at].log_id).await.unwrap();
                    model.entries.truncate(at);
                }
                Op::Purge(ahead) if !model.entries.is_empty() => {
                    let at = usize::from(ahead) % model.entries.len();
                    let id = model.entries[at].log_id;
                    log.purge(id).await.unwrap();
                    model.entries.drain(..=at);
                    model.purged = id.index;
                }
                Op::Truncate(_) | Op::Purge(_) => {}
                Op::Read(a, b) => {
                    // Ends anywhere from a little before the first entry held to a
                    // little after the last, so reads straddle every boundary.
                    let span = model.last() - model.purged + 8;
                    let lo = model.purged.saturating_sub(3) + u64::from(a) % span;
                    let hi = lo + u64::from(b) % span;
                    let got = log.try_get_log_entries(lo..hi).await.unwrap();
                    prop_assert_eq!(
                        &got,
                        &model.range(lo, hi),
                        "read {}..{} (log {}..={})",
                        lo,
                        hi,
                        model.purged + 1,
                        model.last()
                    );
                    checks.push((lo, hi));
                }
            }
        }
        let all = log.try_get_log_entries(..).await.unwrap();
        prop_assert_eq!(&all, &model.entries);
    }
    // Reopened: every read from the segment files, and the same answers.
    let (mut log, _sm) = open(dir.path());
    prop_assert_eq!(&log.try_get_log_entries(..).await.unwrap(), &model.entries);
    for (lo, hi) in checks {
        prop_assert_eq!(
            &log.try_get_log_entries(lo..hi).await.unwrap(),
            &model.range(lo, hi),
            "read {}..{} after reopening",
            lo,
            hi
        );
    }
    let state = log.get_log_state().await.unwrap();
    prop_assert_eq!(state.last_log_id.map(|l| l.index).unwrap_or(0), model.last());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn reads_agree_with_a_model_of_the_log(ops in proptest::collection::vec(op(), 1..48)) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(run(ops))?;
    }
}
