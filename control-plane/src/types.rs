//! The Raft type configuration: what a log entry carries and what applying it returns.

use std::collections::BTreeMap;
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
        write!(
            f,
            "rpc={} http={} raft={}",
            self.rpc_addr, self.http_addr, self.raft_addr
        )
    }
}

/// The newest log-entry format this build writes and reads. Format 1 is the JSON of
/// [`Request`]; entries written before formats were stamped carry no `format` field and
/// are format 1.
pub const LOG_FORMAT: u32 = 1;

/// A log entry's payload: state-machine commands stamped by the leader that proposed
/// them, applied in order. Time enters the state machine only through this stamp, so
/// replaying the log gives the same state on every node.
///
/// One entry carries every command that queued up while the previous entry was being
/// committed (group commit): one log append and one fsync for many writes.
///
/// Encoded as JSON with `format` as the first field, and decoded by reading the format
/// first: an entry of a format newer than [`LOG_FORMAT`] is refused with an error that
/// says so (a node must stop rather than misread it), and unknown fields are refused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Request {
    /// The entry's format ([`LOG_FORMAT`] when written by this build).
    pub format: u32,
    /// Leader's clock (Unix milliseconds) when it proposed the entry.
    pub now_ms: u64,
    /// The commands, applied in this order.
    pub commands: Vec<Command>,
    /// Raises the group's feature level ([`crate::feature::FeatureLevel`]) to this, once
    /// applied (the leader adds it when every voter has said it supports that level). A node that does not support it
    /// stops when it applies the entry, with an error that says to upgrade it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raise_feature_level: Option<u32>,
    /// Who asked for each command, by its index in `commands` (`role/name` of the
    /// caller's certificate), for the audit log. Written from feature level 2 only
    /// ([`crate::feature::FeatureLevel::RECORDS`]): an older node refuses an entry with this field.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub actors: BTreeMap<u32, String>,
}

impl Request {
    /// An entry of the current format carrying `commands` stamped `now_ms`.
    pub fn new(now_ms: u64, commands: Vec<Command>) -> Request {
        Request {
            format: LOG_FORMAT,
            now_ms,
            commands,
            raise_feature_level: None,
            actors: BTreeMap::new(),
        }
    }
}

/// Why a log entry's format cannot be read by this build (the text a stopped node logs).
pub fn newer_entry_format(found: u32) -> String {
    format!(
        "log entry format {found} is newer than this node reads (up to {LOG_FORMAT}): the group was raised \
         to a feature level this build does not support; upgrade this node's kvota"
    )
}

impl<'de> Deserialize<'de> for Request {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{Error, IgnoredAny, MapAccess, Visitor};

        /// A field name, read without an allocation unless it is unknown.
        enum Field {
            Format,
            NowMs,
            Commands,
            Raise,
            Actors,
            Other(String),
        }
        impl<'de> Deserialize<'de> for Field {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct F;
                impl Visitor<'_> for F {
                    type Value = Field;
                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("a field name")
                    }
                    fn visit_str<E: Error>(self, v: &str) -> Result<Field, E> {
                        Ok(match v {
                            "format" => Field::Format,
                            "now_ms" => Field::NowMs,
                            "commands" => Field::Commands,
                            "raise_feature_level" => Field::Raise,
                            "actors" => Field::Actors,
                            other => Field::Other(other.to_owned()),
                        })
                    }
                }
                d.deserialize_identifier(F)
            }
        }

        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Request;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a kvota log entry (an object with format, now_ms, commands)")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Request, A::Error> {
                let mut format: Option<u32> = None;
                let mut now_ms: Option<u64> = None;
                let mut commands: Option<Vec<Command>> = None;
                let mut raise: Option<Option<u32>> = None;
                let mut actors: Option<BTreeMap<u32, String>> = None;
                while let Some(key) = map.next_key::<Field>()? {
                    match key {
                        Field::Format => {
                            if format.is_some() {
                                return Err(A::Error::duplicate_field("format"));
                            }
                            let f: u32 = map.next_value()?;
                            if f > LOG_FORMAT {
                                // Whatever follows may mean something else: stop here.
                                return Err(A::Error::custom(newer_entry_format(f)));
                            }
                            if f == 0 {
                                return Err(A::Error::custom("log entry format 0 does not exist"));
                            }
                            format = Some(f);
                        }
                        Field::NowMs if now_ms.is_none() => now_ms = Some(map.next_value()?),
                        Field::Commands if commands.is_none() => commands = Some(map.next_value()?),
                        Field::Raise if raise.is_none() => raise = Some(map.next_value()?),
                        Field::Actors if actors.is_none() => actors = Some(map.next_value()?),
                        Field::Actors => return Err(A::Error::duplicate_field("actors")),
                        Field::NowMs => return Err(A::Error::duplicate_field("now_ms")),
                        Field::Commands => return Err(A::Error::duplicate_field("commands")),
                        Field::Raise => return Err(A::Error::duplicate_field("raise_feature_level")),
                        Field::Other(other) => {
                            let _: IgnoredAny = map.next_value()?;
                            return Err(A::Error::custom(format!(
                                "log entry: unknown field `{other}` (written by a newer kvota? this node reads formats up to {LOG_FORMAT})"
                            )));
                        }
                    }
                }
                Ok(Request {
                    // Entries written before formats were stamped: format 1.
                    format: format.unwrap_or(1),
                    now_ms: now_ms.ok_or_else(|| A::Error::missing_field("now_ms"))?,
                    commands: commands.ok_or_else(|| A::Error::missing_field("commands"))?,
                    raise_feature_level: raise.flatten(),
                    actors: actors.unwrap_or_default(),
                })
            }
        }
        d.deserialize_map(V)
    }
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
        if let Some(l) = self.raise_feature_level {
            write!(f, ", raise the feature level to {l}")?;
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
