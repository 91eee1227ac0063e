//! A fake control-plane node on the Raft port: it presents a node certificate, accepts
//! only node certificates, and answers Raft calls as the test says ([`Answers`]),
//! including with replies no correct node gives. It answers clock readings with this
//! machine's clock (so the real nodes can still stamp entries).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvota_client::tls::GrpcTls;
use kvota_proto::raft::v1 as pb;
use kvota_tls::Role;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

/// What the fake node answers.
pub trait Answers: Send + Sync + 'static {
    /// To an AppendEntries.
    fn append_entries(&self, req: pb::AppendEntriesRequest) -> Result<pb::AppendEntriesReply, Status>;
    /// To a Vote.
    fn vote(&self, req: pb::VoteRequest) -> Result<pb::VoteReply, Status>;
    /// To an InstallSnapshot chunk.
    fn install_snapshot(&self, req: pb::InstallSnapshotRequest) -> Result<pb::InstallSnapshotReply, Status>;
}

struct Service(Arc<dyn Answers>);

#[tonic::async_trait]
impl pb::raft_server::Raft for Service {
    async fn append_entries(
        &self,
        request: Request<pb::AppendEntriesRequest>,
    ) -> Result<Response<pb::AppendEntriesReply>, Status> {
        self.0.append_entries(request.into_inner()).map(Response::new)
    }

    async fn vote(&self, request: Request<pb::VoteRequest>) -> Result<Response<pb::VoteReply>, Status> {
        self.0.vote(request.into_inner()).map(Response::new)
    }

    async fn install_snapshot(
        &self,
        request: Request<pb::InstallSnapshotRequest>,
    ) -> Result<Response<pb::InstallSnapshotReply>, Status> {
        self.0.install_snapshot(request.into_inner()).map(Response::new)
    }

    async fn clock(&self, _: Request<pb::Empty>) -> Result<Response<pb::ClockReply>, Status> {
        let wall_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Ok(Response::new(pb::ClockReply {
            wall_ms,
            feature_level_max: kvota_control_plane::feature::FeatureLevel::NEWEST.get(),
        }))
    }
}

/// Serves `answers` on `addr` (a node's Raft address, free again once that node
/// stopped; retried for up to 10 s) with `party`'s node certificate, until the returned
/// sender says stop.
pub async fn serve(addr: &str, party: &GrpcTls, answers: Arc<dyn Answers>) -> watch::Sender<bool> {
    let tls = kvota_tls::ServerTls {
        serving: party.source().clone(),
        groups: vec![kvota_tls::TrustGroup {
            label: "federation",
            source: party.source().clone(),
            names_identities: true,
        }],
        mandatory: true,
        roles: Some(vec![Role::Node]),
        alpn: vec![b"h2".to_vec()],
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let tcp = loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => break l,
            Err(e) => assert!(Instant::now() < deadline, "bind {addr}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let listener = kvota_tls::Listener::new(
        "raft",
        tcp,
        Some(tls),
        kvota_tls::Limits::default(),
        Arc::new(|_, _| {}),
    );
    let (stop, rx) = watch::channel(false);
    let mut until = rx.clone();
    let server = tonic::transport::Server::builder()
        .add_service(pb::raft_server::RaftServer::new(Service(answers)))
        .serve_with_incoming_shutdown(listener.incoming(rx), async move {
            let _ = until.wait_for(|s| *s).await;
        });
    tokio::spawn(server);
    stop
}
