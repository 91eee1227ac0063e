//! Raft traffic between control-plane nodes over gRPC (`kvota.v1.Raft`).
//!
//! openraft's own request and response types travel as JSON inside a `RaftPayload`;
//! the gRPC service only carries bytes. Every call has a deadline (openraft's
//! `hard_ttl`), and a node that cannot be reached is reported as `Unreachable` so
//! openraft backs off instead of hammering it.

use std::time::Duration;

use kvota_proto::v1::raft_client::RaftClient;
use kvota_proto::v1::raft_server::Raft as RaftService;
use kvota_proto::v1::RaftPayload;
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tonic::transport::Channel;

use crate::types::{Node, NodeId, Raft, TypeConfig};

/// Largest Raft message accepted (snapshot chunks and entry batches): 64 MiB. A
/// snapshot of a 10,000-tenant, 1,000-cluster federation is well below that.
pub const MAX_RAFT_MESSAGE_BYTES: usize = 64 << 20;

/// Connection timeout to a peer: long enough for a loaded loopback, short enough that an
/// election is not held up by a dead peer.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Builds clients to peers.
#[derive(Clone, Debug, Default)]
pub struct Network {
    /// Mutual TLS to the peers (with the node's own certificate), if the port uses it.
    pub tls: Option<crate::tls::GrpcTls>,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: NodeId, node: &Node) -> PeerClient {
        PeerClient {
            target,
            addr: node.rpc_addr.clone(),
            client: None,
            tls: self.tls.clone(),
        }
    }
}

/// A client to one peer; connects lazily and reconnects after failures.
#[derive(Debug)]
pub struct PeerClient {
    target: NodeId,
    addr: String,
    client: Option<RaftClient<Channel>>,
    tls: Option<crate::tls::GrpcTls>,
}

type RpcResult<T, E> = Result<T, RPCError<NodeId, Node, E>>;

fn encode<T: Serialize>(v: &T) -> Result<RaftPayload, NetworkError> {
    serde_json::to_vec(v)
        .map(|data| RaftPayload { data })
        .map_err(|e| NetworkError::new(&e))
}

fn decode<T: DeserializeOwned>(p: &RaftPayload) -> Result<T, NetworkError> {
    serde_json::from_slice(&p.data).map_err(|e| NetworkError::new(&e))
}

impl PeerClient {
    async fn client<E: std::error::Error>(&mut self) -> RpcResult<RaftClient<Channel>, E> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let endpoint = crate::tls::endpoint(&self.addr, self.tls.as_ref())
            .map_err(|e| RPCError::Unreachable(Unreachable::new(&std::io::Error::other(e))))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true);
        let channel = endpoint.connect_lazy();
        let c = RaftClient::new(channel)
            .max_decoding_message_size(MAX_RAFT_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_RAFT_MESSAGE_BYTES);
        self.client = Some(c.clone());
        Ok(c)
    }

    /// One call: encode, send with a deadline, decode `Result<Resp, RaftError<E>>`.
    async fn call<Req, Resp, E>(
        &mut self,
        method: Method,
        req: &Req,
        option: &RPCOption,
    ) -> RpcResult<Resp, RaftError<NodeId, E>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let payload = encode(req).map_err(RPCError::Network)?;
        let mut client = self.client().await?;
        let mut request = tonic::Request::new(payload);
        request.set_timeout(option.hard_ttl());
        let fut = async {
            match method {
                Method::Append => client.append_entries(request).await,
                Method::Vote => client.vote(request).await,
                Method::Snapshot => client.install_snapshot(request).await,
            }
        };
        let reply = match tokio::time::timeout(option.hard_ttl(), fut).await {
            Err(elapsed) => {
                return Err(RPCError::Unreachable(Unreachable::new(&elapsed)));
            }
            Ok(Err(status)) => {
                // Drop the channel so the next call reconnects.
                self.client = None;
                return Err(RPCError::Unreachable(Unreachable::new(&status)));
            }
            Ok(Ok(reply)) => reply.into_inner(),
        };
        let result: Result<Resp, RaftError<NodeId, E>> = decode(&reply).map_err(RPCError::Network)?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

#[derive(Clone, Copy, Debug)]
enum Method {
    Append,
    Vote,
    Snapshot,
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<NodeId>, RaftError<NodeId>> {
        self.call(Method::Append, &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>> {
        self.call(Method::Snapshot, &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<NodeId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<NodeId>, RaftError<NodeId>> {
        self.call(Method::Vote, &rpc, &option).await
    }
}

/// The receiving side: hands each payload to the local Raft node.
#[derive(Clone)]
pub struct RaftTransport {
    raft: Raft,
    contact: std::sync::Arc<crate::watchdog::LeaderContact>,
}

impl std::fmt::Debug for RaftTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RaftTransport")
    }
}

impl RaftTransport {
    /// Serves Raft traffic for `raft`, noting in `contact` when a leader was last heard.
    pub fn new(raft: Raft, contact: std::sync::Arc<crate::watchdog::LeaderContact>) -> Self {
        RaftTransport { raft, contact }
    }
}

fn bad_payload(e: serde_json::Error) -> tonic::Status {
    tonic::Status::invalid_argument(format!("malformed Raft payload: {e}"))
}

fn reply<T: Serialize>(v: &T) -> Result<tonic::Response<RaftPayload>, tonic::Status> {
    serde_json::to_vec(v)
        .map(|data| tonic::Response::new(RaftPayload { data }))
        .map_err(|e| tonic::Status::internal(format!("encode Raft reply: {e}")))
}

#[tonic::async_trait]
impl RaftService for RaftTransport {
    async fn append_entries(
        &self,
        request: tonic::Request<RaftPayload>,
    ) -> Result<tonic::Response<RaftPayload>, tonic::Status> {
        let rpc: AppendEntriesRequest<TypeConfig> =
            serde_json::from_slice(&request.into_inner().data).map_err(bad_payload)?;
        if let Some(leader) = rpc.vote.leader_id().voted_for() {
            self.contact.heard(leader);
        }
        reply(&self.raft.append_entries(rpc).await)
    }

    async fn vote(&self, request: tonic::Request<RaftPayload>) -> Result<tonic::Response<RaftPayload>, tonic::Status> {
        let rpc: VoteRequest<NodeId> = serde_json::from_slice(&request.into_inner().data).map_err(bad_payload)?;
        reply(&self.raft.vote(rpc).await)
    }

    async fn install_snapshot(
        &self,
        request: tonic::Request<RaftPayload>,
    ) -> Result<tonic::Response<RaftPayload>, tonic::Status> {
        let rpc: InstallSnapshotRequest<TypeConfig> =
            serde_json::from_slice(&request.into_inner().data).map_err(bad_payload)?;
        reply(&self.raft.install_snapshot(rpc).await)
    }
}
