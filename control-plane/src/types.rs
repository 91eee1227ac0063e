//! The Raft type configuration: what a log entry carries and what applying it returns.

use std::fmt;
use std::io::Cursor;

use kvota_fairness::federation::{Applied, Command, CommandError};
use serde::{Deserialize, Serialize};

/// A control-plane node's id (stable for the node's life; chosen by the operator).
pub type NodeId = u64;

/// How to reach a control-plane node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    /// gRPC API address (`host:port`): the member and admin services.
    pub rpc_addr: String,
    /// HTTP admin address (`host:port`): health, readiness, metrics.
    pub http_addr: String,
    /// Raft address (`host:port`): the node's own listener for Raft traffic, which serves
    /// node certificates only. Empty in memberships written before it existed: such a
    /// member cannot be reached for Raft and must be added again (`kvota members
    /// add-learner`).
    #[serde(default)]
    pub raft_addr: String,
}

impl fmt::Display for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rpc={} http={} raft={}", self.rpc_addr, self.http_addr, self.raft_addr)
    }
}

/// A log entry's payload: state-machine commands stamped by the leader that proposed
/// them, applied in order. Time enters the state machine only through this stamp, so
/// replaying the log gives the same state on every node.
///
/// One entry carries every command that queued up while the previous entry was being
/// committed (group commit): one log append and one fsync for many writes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    /// Leader's clock (Unix milliseconds) when it proposed the entry.
    pub now_ms: u64,
    /// The commands, applied in this order.
    pub commands: Vec<Command>,
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} command(s) @{}", self.commands.len(), self.now_ms)?;
        if let Some(first) = self.commands.first() {
            let what = match first {
                Command::ApplyPolicy(p) => format!("apply-policy {}", p.name),
                Command::RegisterCluster { cluster, .. } => format!("register {cluster}"),
                Command::RemoveCluster { cluster } => format!("remove {cluster}"),
                Command::Report(r) => format!("report {} seq {}", r.cluster, r.seq),
                Command::Tick => "tick".to_string(),
            };
            write!(f, ", first: {what}")?;
        }
        Ok(())
    }
}

/// What applying an entry returned: the state machine's answer to each command, in
/// order (success or refusal). Membership and blank entries answer `None`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Response(pub Option<Vec<Result<Applied, CommandError>>>);

openraft::declare_raft_types!(
    /// kvota's Raft types.
    pub TypeConfig:
        D = Request,
        R = Response,
        NodeId = NodeId,
        Node = Node,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The Raft handle.
pub type Raft = openraft::Raft<TypeConfig>;
