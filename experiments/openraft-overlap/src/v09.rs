//! Three openraft 0.9.25 nodes in one process, as kvota configures them (storage-v2), on
//! [`crate::disk::LogFile`]s, talking through direct calls (no sockets: the experiment
//! is about the log's flush, and a network hop would be the same for both versions).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::{self, Cursor};
use std::ops::RangeBounds;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use o9::error::{InstallSnapshotError, RPCError, RaftError, Unreachable};
use o9::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use o9::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use o9::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use o9::{
    BasicNode, Entry, EntryPayload, LogId, OptionalSend, RaftLogReader, RaftSnapshotBuilder,
    SnapshotMeta, StorageError, StorageIOError, StoredMembership, Vote,
};

use crate::disk::{Flush, LogFile};
use crate::Req;

o9::declare_raft_types!(
    pub C9:
        D = Req,
        R = u64,
        NodeId = u64,
        Node = BasicNode,
        Entry = o9::Entry<C9>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = o9::TokioRuntime,
);

pub type Raft9 = o9::Raft<C9>;

fn write_err(e: impl fmt::Display) -> StorageError<u64> {
    StorageIOError::write_logs(o9::AnyError::error(e.to_string())).into()
}

struct Log {
    entries: Mutex<BTreeMap<u64, Entry<C9>>>,
    vote: Mutex<Option<Vote<u64>>>,
    purged: Mutex<Option<LogId<u64>>>,
    file: LogFile,
    dir: PathBuf,
}

#[derive(Clone)]
pub struct LogStore(Arc<Log>);

impl RaftLogReader<C9> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + fmt::Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<C9>>, StorageError<u64>> {
        Ok(self
            .0
            .entries
            .lock()
            .unwrap()
            .range((range.start_bound().cloned(), range.end_bound().cloned()))
            .map(|(_, e)| e.clone())
            .collect())
    }
}

impl RaftLogStorage<C9> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<C9>, StorageError<u64>> {
        let purged = *self.0.purged.lock().unwrap();
        let last = self
            .0
            .entries
            .lock()
            .unwrap()
            .values()
            .next_back()
            .map(|e| e.log_id);
        Ok(LogState {
            last_purged_log_id: purged,
            last_log_id: last.or(purged),
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<u64>) -> Result<(), StorageError<u64>> {
        self.0.file.barrier().await.map_err(write_err)?;
        let bytes = serde_json::to_vec(vote).map_err(write_err)?;
        LogFile::put_durably(&self.0.dir.join("vote"), &bytes).map_err(write_err)?;
        *self.0.vote.lock().unwrap() = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<u64>>, StorageError<u64>> {
        Ok(*self.0.vote.lock().unwrap())
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<C9>,
    ) -> Result<(), StorageError<u64>>
    where
        I: IntoIterator<Item = Entry<C9>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let (mut bytes, mut records) = (Vec::new(), 0u64);
        {
            let mut map = self.0.entries.lock().unwrap();
            for entry in entries {
                serde_json::to_writer(&mut bytes, &entry).map_err(write_err)?;
                bytes.push(b'\n');
                records += 1;
                map.insert(entry.log_id.index, entry);
            }
        }
        self.0
            .file
            .append(
                records,
                bytes,
                Box::new(move |r| callback.log_io_completed(r)),
            )
            .await
            .map_err(write_err)
    }

    async fn truncate(&mut self, log_id: LogId<u64>) -> Result<(), StorageError<u64>> {
        self.0
            .entries
            .lock()
            .unwrap()
            .retain(|&i, _| i < log_id.index);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<u64>) -> Result<(), StorageError<u64>> {
        self.0
            .entries
            .lock()
            .unwrap()
            .retain(|&i, _| i > log_id.index);
        *self.0.purged.lock().unwrap() = Some(log_id);
        Ok(())
    }
}

/// Sums the requests' values: applying costs next to nothing, so the commit path is what
/// is measured.
#[derive(Clone, Default)]
pub struct Machine(Arc<Mutex<Applied>>);

/// Last applied log id, membership, sum.
type Applied = (Option<LogId<u64>>, StoredMembership<u64, BasicNode>, u64);

impl RaftSnapshotBuilder<C9> for Machine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<C9>, StorageError<u64>> {
        let (last, membership, sum) = self.0.lock().unwrap().clone();
        let meta = SnapshotMeta {
            last_log_id: last,
            last_membership: membership,
            snapshot_id: format!("{last:?}"),
        };
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(sum.to_le_bytes().to_vec())),
        })
    }
}

impl RaftStateMachine<C9> for Machine {
    type SnapshotBuilder = Machine;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<u64>>, StoredMembership<u64, BasicNode>), StorageError<u64>> {
        let g = self.0.lock().unwrap();
        Ok((g.0, g.1.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<u64>, StorageError<u64>>
    where
        I: IntoIterator<Item = Entry<C9>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut g = self.0.lock().unwrap();
        let mut out = Vec::new();
        for e in entries {
            g.0 = Some(e.log_id);
            match e.payload {
                EntryPayload::Normal(r) => g.2 = g.2.wrapping_add(r.value),
                EntryPayload::Membership(m) => g.1 = StoredMembership::new(Some(e.log_id), m),
                EntryPayload::Blank => {}
            }
            out.push(g.2);
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(
        &mut self,
    ) -> Result<Box<Cursor<Vec<u8>>>, StorageError<u64>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<u64, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError<u64>> {
        let b = snapshot.into_inner();
        let sum = u64::from_le_bytes(
            b.get(..8)
                .and_then(|s| s.try_into().ok())
                .unwrap_or_default(),
        );
        *self.0.lock().unwrap() = (meta.last_log_id, meta.last_membership.clone(), sum);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<C9>>, StorageError<u64>> {
        Ok(None)
    }
}

type Router = Arc<Mutex<HashMap<u64, Raft9>>>;

pub struct Net {
    router: Router,
}

pub struct Peer {
    target: u64,
    router: Router,
}

impl Peer {
    fn raft<E: std::error::Error>(&self) -> Result<Raft9, Box<RPCError<u64, BasicNode, E>>> {
        self.router
            .lock()
            .unwrap()
            .get(&self.target)
            .cloned()
            .ok_or_else(|| {
                Box::new(RPCError::Unreachable(Unreachable::new(&io::Error::other(
                    format!("no node {}", self.target),
                ))))
            })
    }
}

fn unreachable<E: std::error::Error, F: std::error::Error + 'static>(
    e: F,
) -> RPCError<u64, BasicNode, E> {
    RPCError::Unreachable(Unreachable::new(&e))
}

impl RaftNetworkFactory<C9> for Net {
    type Network = Peer;
    async fn new_client(&mut self, target: u64, _node: &BasicNode) -> Peer {
        Peer {
            target,
            router: Arc::clone(&self.router),
        }
    }
}

impl RaftNetwork<C9> for Peer {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C9>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.raft()
            .map_err(|e| *e)?
            .append_entries(rpc)
            .await
            .map_err(unreachable)
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<C9>,
        _option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<u64>,
        RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>,
    > {
        self.raft()
            .map_err(|e| *e)?
            .install_snapshot(rpc)
            .await
            .map_err(unreachable)
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        _option: RPCOption,
    ) -> Result<VoteResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.raft()
            .map_err(|e| *e)?
            .vote(rpc)
            .await
            .map_err(unreachable)
    }
}

crate::cluster_fn!(o9, Raft9);
