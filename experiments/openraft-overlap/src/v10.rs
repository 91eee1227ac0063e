//! The same three nodes as [`crate::v09`] on openraft 0.10.0-alpha.37: same log file,
//! same state machine, same direct-call network, same timing; only the traits differ.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io;
use std::ops::RangeBounds;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use futures::{Stream, TryStreamExt};
use o10::error::{RPCError, ReplicationClosed, StreamingError, Unreachable};
use o10::network::RPCOption;
use o10::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, VoteRequest, VoteResponse,
};
use o10::storage::{EntryResponder, IOFlushed, RaftLogStorage, RaftStateMachine};
use o10::type_config::alias::{
    EntryOf, LogIdOf, SnapshotMetaOf, SnapshotOf, StoredMembershipOf, VoteOf,
};
use o10::{
    BasicNode, EntryPayload, LogState, OptionalSend, RaftLogReader, RaftNetworkFactory,
    RaftNetworkV2, RaftSnapshotBuilder, SnapshotMeta, StoredMembership,
};

use crate::disk::{Flush, LogFile};
use crate::Req;

o10::declare_raft_types!(
    pub C10:
        D = Req,
        R = u64,
);

pub type Raft10 = o10::Raft<C10, Machine>;

struct Log {
    entries: Mutex<BTreeMap<u64, EntryOf<C10>>>,
    vote: Mutex<Option<VoteOf<C10>>>,
    purged: Mutex<Option<LogIdOf<C10>>>,
    file: LogFile,
    dir: PathBuf,
}

#[derive(Clone)]
pub struct LogStore(Arc<Log>);

impl RaftLogReader<C10> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + fmt::Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<EntryOf<C10>>, io::Error> {
        Ok(self
            .0
            .entries
            .lock()
            .unwrap()
            .range((range.start_bound().cloned(), range.end_bound().cloned()))
            .map(|(_, e)| e.clone())
            .collect())
    }

    async fn read_vote(&mut self) -> Result<Option<VoteOf<C10>>, io::Error> {
        Ok(*self.0.vote.lock().unwrap())
    }
}

impl RaftLogStorage<C10> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<C10>, io::Error> {
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

    async fn save_vote(&mut self, vote: &VoteOf<C10>) -> Result<(), io::Error> {
        self.0.file.barrier().await?;
        let bytes = serde_json::to_vec(vote)?;
        LogFile::put_durably(&self.0.dir.join("vote"), &bytes)?;
        *self.0.vote.lock().unwrap() = Some(*vote);
        Ok(())
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<C10>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = EntryOf<C10>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let (mut bytes, mut records) = (Vec::new(), 0u64);
        {
            let mut map = self.0.entries.lock().unwrap();
            for entry in entries {
                serde_json::to_writer(&mut bytes, &entry)?;
                bytes.push(b'\n');
                records += 1;
                map.insert(entry.log_id.index, entry);
            }
        }
        self.0
            .file
            .append(records, bytes, Box::new(move |r| callback.io_completed(r)))
            .await
    }

    async fn truncate_after(&mut self, last: Option<LogIdOf<C10>>) -> Result<(), io::Error> {
        let keep_to = last.map(|l| l.index);
        self.0
            .entries
            .lock()
            .unwrap()
            .retain(|&i, _| keep_to.is_some_and(|k| i <= k));
        Ok(())
    }

    async fn purge(&mut self, log_id: LogIdOf<C10>) -> Result<(), io::Error> {
        self.0
            .entries
            .lock()
            .unwrap()
            .retain(|&i, _| i > log_id.index);
        *self.0.purged.lock().unwrap() = Some(log_id);
        Ok(())
    }
}

/// Sums the requests' values, as [`crate::v09::Machine`] does.
#[derive(Clone, Default)]
pub struct Machine(Arc<Mutex<Applied>>);

/// Last applied log id, membership, sum.
type Applied = (Option<LogIdOf<C10>>, StoredMembershipOf<C10>, u64);

impl RaftSnapshotBuilder<C10> for Machine {
    type SnapshotData = Vec<u8>;

    async fn build_snapshot(&mut self) -> Result<SnapshotOf<C10, Vec<u8>>, io::Error> {
        let (last, membership, sum) = self.0.lock().unwrap().clone();
        let meta = SnapshotMeta {
            last_log_id: last,
            last_membership: membership,
        };
        Ok(o10::Snapshot {
            meta,
            snapshot: sum.to_le_bytes().to_vec(),
        })
    }
}

impl RaftStateMachine<C10> for Machine {
    type SnapshotData = Vec<u8>;
    type SnapshotBuilder = Machine;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogIdOf<C10>>, StoredMembershipOf<C10>), io::Error> {
        let g = self.0.lock().unwrap();
        Ok((g.0, g.1.clone()))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<C10>, io::Error>> + Unpin + OptionalSend,
    {
        while let Some((entry, responder)) = entries.try_next().await? {
            let sum = {
                let mut g = self.0.lock().unwrap();
                g.0 = Some(entry.log_id);
                match entry.payload {
                    EntryPayload::Normal(r) => g.2 = g.2.wrapping_add(r.value),
                    EntryPayload::Membership(m) => {
                        g.1 = StoredMembership::new(Some(entry.log_id), m)
                    }
                    EntryPayload::Blank => {}
                }
                g.2
            };
            if let Some(r) = responder {
                r.send(sum);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMetaOf<C10>,
        snapshot: Vec<u8>,
    ) -> Result<(), io::Error> {
        let sum = u64::from_le_bytes(
            snapshot
                .get(..8)
                .and_then(|s| s.try_into().ok())
                .unwrap_or_default(),
        );
        *self.0.lock().unwrap() = (meta.last_log_id, meta.last_membership.clone(), sum);
        Ok(())
    }

    async fn get_current_snapshot(
        &mut self,
    ) -> Result<Option<SnapshotOf<C10, Vec<u8>>>, io::Error> {
        Ok(None)
    }
}

type Router = Arc<Mutex<HashMap<u64, Raft10>>>;

pub struct Net {
    router: Router,
}

pub struct Peer {
    target: u64,
    router: Router,
}

impl Peer {
    fn raft(&self) -> Result<Raft10, Unreachable<C10>> {
        self.router
            .lock()
            .unwrap()
            .get(&self.target)
            .cloned()
            .ok_or_else(|| Unreachable::from_string(format!("no node {}", self.target)))
    }
}

impl RaftNetworkFactory<C10> for Net {
    type Network = Peer;
    async fn new_client(&mut self, target: u64, _node: &BasicNode) -> Peer {
        Peer {
            target,
            router: Arc::clone(&self.router),
        }
    }
}

impl RaftNetworkV2<C10> for Peer {
    type SnapshotData = Vec<u8>;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C10>,
        _option: RPCOption,
    ) -> Result<AppendEntriesResponse<C10>, RPCError<C10>> {
        let raft = self.raft()?;
        raft.append_entries(rpc)
            .await
            .map_err(|e| RPCError::Unreachable(Unreachable::new(&e)))
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<C10>,
        _option: RPCOption,
    ) -> Result<VoteResponse<C10>, RPCError<C10>> {
        let raft = self.raft()?;
        raft.vote(rpc)
            .await
            .map_err(|e| RPCError::Unreachable(Unreachable::new(&e)))
    }

    async fn full_snapshot(
        &mut self,
        vote: VoteOf<C10>,
        snapshot: SnapshotOf<C10, Vec<u8>>,
        _cancel: impl std::future::Future<Output = ReplicationClosed> + OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<C10>, StreamingError<C10>> {
        let raft = self.raft()?;
        raft.install_full_snapshot(vote, snapshot)
            .await
            .map_err(|e| StreamingError::Unreachable(Unreachable::new(&e)))
    }
}

crate::cluster_fn!(o10, Raft10);
