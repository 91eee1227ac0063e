//! A hostile client on the same network, against a real federation: three `kvota
//! server` processes and a `kvota agent` (simulated cluster; no Kubernetes API server
//! runs here) over real TLS sockets, certificates from the federation's CA.
//!
//! After each attack the federation must still have one leader, the same term (unless
//! the attacker held a node certificate), an unchanged ledger, and must answer a normal
//! request. Cases: no certificate, another CA's, an expired one; a cluster certificate
//! calling admin methods or the Raft port; cluster A reporting and acknowledging as B;
//! a viewer applying a policy; a member added at an arbitrary address; an oversized
//! message; a node certificate forging AppendEntries with term u64::MAX, then the leader
//! killed (a new one must be elected); half-finished connections on the gRPC and webhook
//! ports until the limits bite (a real report and a real review still answered within
//! a second); forged and oversized reviews, huge quantities, a forged DELETE; and
//! certificates rotated on disk under a running server and agent with no failed request.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use kvota_client::client::Client;
use kvota_client::tls::GrpcTls;
use kvota_proto::v1;
use kvota_testkit::procs::{free_ports, server_command, specs, Procs, ServerSpec};
use kvota_testkit::{Files, Pki};
use kvota_tls::issue::Kind;
use kvota_tls::{Expect, Role};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Code;

mod limits;
mod raft;
mod reload;

const POLICY: &str = "apiVersion: kvota.dev/v1alpha1
kind: FairnessPolicy
metadata: {name: hostile}
spec:
  lease: {duration: 4s, clockSkewMargin: 400ms}
  tenants:
  - {name: training, weight: 40, minShare: 20, maxShare: 60, namespaces: [ml]}
  - {name: inference, weight: 50, minShare: 40, maxShare: 80, namespaces: [serving]}
";

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kvota"))
}

/// Three servers with TLS, their CA, and clients of any role.
struct Fed {
    pki: Pki,
    tmp: tempfile::TempDir,
    specs: Vec<ServerSpec>,
    procs: Procs,
    node_files: Vec<Files>,
    /// Flags every server gets besides the usual ones.
    extra: Vec<String>,
}

/// Election timeouts of 1 to 2 s (heartbeats stay at 50 ms), for the tests that take an
/// unmoved term as evidence that an attack changed nothing: with the default 150 to
/// 300 ms, a 2-core machine busy with other tests let a follower miss heartbeats and
/// start an election of its own (the term moved from 2 to 4 with no attack to blame).
const STEADY: &[&str] = &["--election-timeout-min-ms", "1000", "--election-timeout-max-ms", "2000"];

impl Fed {
    async fn start() -> Fed {
        Fed::start_with(&[]).await
    }

    async fn start_with(extra: &[&str]) -> Fed {
        let pki = Pki::new("hostile.test");
        let tmp = tempfile::tempdir().expect("tmp");
        let specs = specs(3, tmp.path());
        let node_files: Vec<Files> = specs.iter().map(|s| pki.files(Role::Node, &s.id.to_string())).collect();
        let mut fed = Fed {
            pki,
            tmp,
            specs,
            procs: Procs::default(),
            node_files,
            extra: extra.iter().map(|s| (*s).to_string()).collect(),
        };
        for i in 0..3 {
            let c = fed.spawn(i, i == 0);
            fed.procs.0.push(Some(c));
        }
        let op = fed.client(Role::Operator, "alice");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if apply_policy(&op).await.is_ok() {
                break;
            }
            assert!(Instant::now() < deadline, "no leader took the policy\n{}", fed.logs());
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        fed
    }

    fn spawn(&self, i: usize, init: bool) -> Child {
        let f = &self.node_files[i];
        let extra: Vec<String> = [
            "--tick-ms",
            "300",
            "--max-connections-per-peer",
            "32",
            "--tls-ca",
            f.ca.to_str().expect("utf8"),
            "--tls-cert",
            f.cert.to_str().expect("utf8"),
            "--tls-key",
            f.key.to_str().expect("utf8"),
        ]
        .map(String::from)
        .into_iter()
        .chain(self.extra.iter().cloned())
        .collect();
        server_command(&bin(), &self.specs[i], &self.specs, init, &extra)
            .spawn()
            .expect("spawn kvota server")
    }

    fn endpoints(&self) -> Vec<String> {
        self.specs.iter().map(|s| s.rpc.clone()).collect()
    }

    fn party(&self, role: Role, name: &str) -> GrpcTls {
        self.pki.party(role, name)
    }

    fn client(&self, role: Role, name: &str) -> Client {
        let c = Client::with_tls(&self.endpoints(), Some(self.party(role, name))).expect("client");
        c.set_call_timeout(Duration::from_secs(3));
        c
    }

    fn logs(&self) -> String {
        self.specs
            .iter()
            .map(|s| {
                format!(
                    "--- node {}:\n{}",
                    s.id,
                    std::fs::read_to_string(s.log()).unwrap_or_default()
                )
            })
            .collect()
    }

    /// Every answering node's (role, term, leader); nodes the test stopped are not asked
    /// (a dead address costs the client its retries).
    async fn statuses(&self) -> Vec<(u64, String, u64, u64)> {
        let viewer = self.party(Role::Viewer, "watch");
        let mut out = Vec::new();
        let running = self.procs.0.iter().map(Option::is_some).chain(std::iter::repeat(true));
        for (s, _) in self.specs.iter().zip(running).filter(|(_, r)| *r) {
            let c = Client::with_tls(std::slice::from_ref(&s.rpc), Some(viewer.clone())).expect("client");
            c.set_call_timeout(Duration::from_secs(1));
            let r = tokio::time::timeout(
                Duration::from_secs(2),
                c.call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) }),
            )
            .await;
            if let Ok(Ok(st)) = r {
                out.push((s.id, st.role, st.term, st.leader_id));
            }
        }
        out
    }

    /// One leader every answering node agrees on (waiting a little for it): (leader, term).
    async fn one_leader(&self) -> (u64, u64) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let st = self.statuses().await;
            let leaders: Vec<&(u64, String, u64, u64)> = st.iter().filter(|s| s.1 == "leader").collect();
            if leaders.len() == 1 && st.len() >= 2 && st.iter().all(|s| s.3 == leaders[0].0 && s.2 == leaders[0].2) {
                return (leaders[0].0, leaders[0].2);
            }
            assert!(
                Instant::now() < deadline,
                "no single agreed leader: {st:?}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The ledger as far as clients can change it: each cluster's sequence, epochs,
    /// counted-through time and reported per-tenant numbers.
    async fn ledger(&self) -> Vec<String> {
        let op = self.client(Role::Viewer, "ledger");
        let r = op
            .call(|ch| async move { Ok(Client::admin(ch).list_clusters(v1::Empty {}).await?.into_inner()) })
            .await
            .expect("clusters");
        r.clusters
            .iter()
            .map(|c| {
                let tenants: Vec<String> = c
                    .tenants
                    .iter()
                    .map(|t| format!("{}:{}:{}", t.tenant, t.inuse_milli_gpue, t.pending_milli_gpue))
                    .collect();
                format!(
                    "{} seq={} epochs={}/{} through={} cap={} tenants={}",
                    c.cluster,
                    c.last_seq,
                    c.acked_epoch,
                    c.last_epoch,
                    c.reported_through_ms,
                    c.capacity_milli_gpue,
                    tenants.join(",")
                )
            })
            .collect()
    }
}

async fn apply_policy(c: &Client) -> Result<v1::PolicyReply, tonic::Status> {
    c.call(|ch| async move {
        Ok(Client::admin(ch)
            .apply_policy(v1::PolicyRequest {
                yaml: POLICY.to_string(),
            })
            .await?
            .into_inner())
    })
    .await
}

async fn register(c: &Client, cluster: &str) -> Result<v1::Lease, tonic::Status> {
    let req = v1::RegisterRequest {
        cluster: cluster.into(),
        capacity: vec![v1::Resource {
            name: "nvidia.com/gpu".into(),
            quantity_milli: 16_000,
        }],
        labels: Default::default(),
    };
    c.call(|ch| {
        let req = req.clone();
        async move { Ok(Client::member(ch).register(req).await?.into_inner()) }
    })
    .await
    .map(|r| r.lease.unwrap_or_default())
}

fn report_req(cluster: &str, seq: u64, held: u64, tenants: usize) -> v1::ReportRequest {
    v1::ReportRequest {
        cluster: cluster.into(),
        seq,
        held_epoch: held,
        tenants: (0..tenants)
            .map(|i| v1::TenantUsage {
                tenant: if i == 0 {
                    "training".into()
                } else {
                    format!("pad-{i:07}")
                },
                used_milli_gpue_ms: 1_000,
                inuse_milli_gpue: 2_000,
                pending_milli_gpue: 1_000,
                largest_pending_milli_gpue: 1_000,
                borrowed_milli_gpue: 0,
            })
            .collect(),
        ..Default::default()
    }
}

async fn report(c: &Client, req: v1::ReportRequest) -> Result<v1::ReportReply, tonic::Status> {
    c.call(|ch| {
        let req = req.clone();
        async move { Ok(Client::member(ch).report(req).await?.into_inner()) }
    })
    .await
}

/// A member of the federation carrying on: its next report is applied, in time.
struct Member {
    client: Client,
    cluster: &'static str,
    seq: u64,
    epoch: u64,
}

impl Member {
    async fn join(fed: &Fed, cluster: &'static str) -> Member {
        let client = fed.client(Role::Cluster, cluster);
        let lease = register(&client, cluster).await.expect("register");
        let mut m = Member {
            client,
            cluster,
            seq: 0,
            epoch: lease.epoch,
        };
        m.report().await;
        m
    }

    /// Reports once; it must be applied within a second.
    async fn report(&mut self) {
        self.seq += 1;
        let t0 = Instant::now();
        let r = report(&self.client, report_req(self.cluster, self.seq, self.epoch, 1))
            .await
            .expect("a normal report");
        assert!(r.applied, "report {} of {} not applied", self.seq, self.cluster);
        assert!(
            t0.elapsed() < Duration::from_secs(1),
            "a normal report took {:?}",
            t0.elapsed()
        );
        self.epoch = r.lease.map_or(self.epoch, |l| l.epoch);
    }
}

/// After an attack: one leader, the same term (unless `term_may_move`), the same ledger,
/// and a normal report still applied in time.
async fn intact(
    fed: &Fed,
    what: &str,
    before: &(u64, u64, Vec<String>),
    member: &mut Member,
    term_may_move: bool,
) -> (u64, u64, Vec<String>) {
    let (leader, term) = fed.one_leader().await;
    if !term_may_move {
        assert_eq!(term, before.1, "{what}: the term moved");
    }
    let ledger = fed.ledger().await;
    assert_eq!(ledger, before.2, "{what}: the ledger changed");
    member.report().await;
    (leader, term, fed.ledger().await)
}

/// A tonic channel to `addr` presenting an arbitrary certificate chain (bypassing the
/// checks `GrpcTls` makes on its own files, so expired ones can be presented), and
/// verifying the server as a node of `trust`.
fn raw_channel(addr: &str, cert_pem: &str, key_pem: &str, trust: &GrpcTls) -> tonic::transport::Channel {
    use rustls::pki_types::pem::PemObject;
    let chain: Vec<rustls::pki_types::CertificateDer<'static>> =
        rustls::pki_types::CertificateDer::pem_slice_iter(cert_pem.as_bytes())
            .map(|c| c.expect("pem"))
            .collect();
    let key = rustls::pki_types::PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("key");
    let mut cfg = rustls::ClientConfig::builder_with_provider(kvota_tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(kvota_tls::verify::ServerIdentityVerifier::new(
            trust.source().clone(),
            Expect::AnyNode,
        )))
        .with_client_auth_cert(chain, key)
        .expect("client cert");
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    let conn = kvota_tls::connect::Connector::new(Some(Arc::new(cfg)));
    kvota_tls::connect::channel(addr, &conn, Duration::from_secs(2), Duration::from_secs(3)).expect("channel")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_and_wrong_roles_change_nothing() {
    let fed = Fed::start_with(STEADY).await;
    let mut east = Member::join(&fed, "east").await;
    let mut west = Member::join(&fed, "west").await;
    west.report().await;
    let (leader, term) = fed.one_leader().await;
    let mut seen = (leader, term, fed.ledger().await);
    let leader_rpc = fed.specs[usize::try_from(leader - 1).expect("id")].rpc.clone();

    // No certificate: plain text, and TLS without a client certificate.
    let plain = Client::new(&fed.endpoints()).expect("client");
    plain.set_call_timeout(Duration::from_millis(500));
    assert!(register(&plain, "intruder").await.is_err());
    let viewer = fed.party(Role::Viewer, "v");
    let anon = kvota_testkit::anonymous(&viewer);
    let ch = kvota_tls::connect::channel(&leader_rpc, &anon, Duration::from_secs(1), Duration::from_secs(2))
        .expect("channel");
    assert!(v1::admin_client::AdminClient::new(ch)
        .apply_policy(v1::PolicyRequest { yaml: POLICY.into() })
        .await
        .is_err());
    seen = intact(&fed, "no certificate", &seen, &mut east, false).await;

    // A certificate from another CA (same trust domain name, other key).
    let other = Pki::new("hostile.test");
    let mallory = Client::with_tls(&fed.endpoints(), Some(other.party(Role::Operator, "mallory"))).expect("client");
    mallory.set_call_timeout(Duration::from_millis(800));
    assert!(apply_policy(&mallory).await.is_err());
    seen = intact(&fed, "another CA", &seen, &mut east, false).await;

    // An expired operator certificate from the right CA.
    let now = time::OffsetDateTime::now_utc();
    let old = fed
        .pki
        .ca()
        .issue_between(
            &Kind::Party(Role::Operator),
            "retired",
            &[],
            &[],
            now - time::Duration::days(30),
            now - time::Duration::days(1),
        )
        .expect("issue");
    let r = v1::admin_client::AdminClient::new(raw_channel(&leader_rpc, &old.cert_pem, &old.key_pem, &viewer))
        .apply_policy(v1::PolicyRequest { yaml: POLICY.into() })
        .await;
    assert!(r.is_err(), "an expired certificate got in");
    seen = intact(&fed, "an expired certificate", &seen, &mut east, false).await;

    // A cluster certificate calling admin methods, and the Raft port.
    let r = apply_policy(&east.client).await;
    assert_eq!(
        r.expect_err("a cluster applies no policy").code(),
        Code::PermissionDenied
    );
    let r = east
        .client
        .call(|ch| async move {
            Ok(Client::admin(ch)
                .remove_cluster(v1::DescribeClusterRequest { cluster: "west".into() })
                .await?
                .into_inner())
        })
        .await;
    assert_eq!(
        r.expect_err("a cluster removes no cluster").code(),
        Code::PermissionDenied
    );
    let east_tls = fed.party(Role::Cluster, "east");
    let raft =
        kvota_control_plane::network::raft_client(&fed.specs[1].raft, 2, Some(&east_tls), Duration::from_secs(2))
            .expect("client");
    let forged = kvota_proto::raft::v1::VoteRequest {
        vote: Some(kvota_proto::raft::v1::RaftVote {
            term: 1_000,
            node_id: 1,
            committed: false,
        }),
        last_log_id: None,
    };
    let r = raft.clone().vote(forged).await;
    assert!(r.is_err(), "a cluster was served on the Raft port");
    seen = intact(&fed, "a cluster at admin and Raft", &seen, &mut east, false).await;

    // Cluster east reporting and acknowledging as west: refused, west's leases intact.
    let r = report(&east.client, report_req("west", 99, u64::MAX / 2, 1)).await;
    assert_eq!(r.expect_err("east reports as west").code(), Code::PermissionDenied);
    let r = register(&east.client, "west").await;
    assert_eq!(r.expect_err("east registers as west").code(), Code::PermissionDenied);
    seen = intact(&fed, "east as west", &seen, &mut east, false).await;

    // A viewer applying a policy.
    let v = fed.client(Role::Viewer, "grafana");
    let e = apply_policy(&v).await.expect_err("a viewer applies no policy");
    assert!(
        e.code() == Code::PermissionDenied && e.message().contains("viewer/grafana may not call admin.ApplyPolicy"),
        "{e:?}"
    );
    seen = intact(&fed, "a viewer applying a policy", &seen, &mut east, false).await;

    // Adding a member at an arbitrary address: the leader would not stream the log to it.
    let op = fed.client(Role::Operator, "alice");
    op.set_call_timeout(Duration::from_secs(8)); // the leader's check waits up to 5 s
    for addr in [
        "127.0.0.1:1".to_string(),
        fed.specs[1].raft.clone(),
        "198.51.100.7:7601".to_string(),
    ] {
        let req = v1::AddLearnerRequest {
            node: Some(v1::NodeInfo {
                id: 9,
                rpc_addr: "127.0.0.1:2".into(),
                http_addr: String::new(),
                raft_addr: addr.clone(),
                voter: false,
            }),
        };
        let r = op.call(|ch| {
            let req = req.clone();
            async move { Ok(Client::admin(ch).add_learner(req).await?.into_inner()) }
        });
        let e = tokio::time::timeout(Duration::from_secs(20), r)
            .await
            .expect("answered")
            .expect_err("an arbitrary address");
        assert_eq!(e.code(), Code::FailedPrecondition, "{addr}: {e:?}");
    }
    let members = op
        .call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) })
        .await
        .expect("status")
        .members;
    assert_eq!(members.len(), 3, "{members:?}");
    seen = intact(&fed, "adding a member at an arbitrary address", &seen, &mut east, false).await;

    // An oversized report (over the 4 MiB message limit).
    let big = report_req("east", east.seq + 1, east.epoch, 60_000);
    let r = report(&east.client, big).await;
    let code = r.expect_err("an oversized report").code();
    assert!(
        matches!(code, Code::ResourceExhausted | Code::OutOfRange | Code::InvalidArgument),
        "{code:?}"
    );
    intact(&fed, "an oversized report", &seen, &mut east, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_huge_term_is_refused_and_a_killed_leader_is_replaced() {
    let mut fed = Fed::start_with(STEADY).await;
    let mut east = Member::join(&fed, "east").await;
    let (leader, term) = fed.one_leader().await;
    let seen = (leader, term, fed.ledger().await);
    // The attacker holds a node certificate (node 2's key leaked, say). Aimed at the
    // leader: term u64::MAX as itself, and as the leader.
    let attacker_id = if leader == 2 { 3 } else { 2 };
    let attacker = fed.party(Role::Node, &attacker_id.to_string());
    let target = &fed.specs[usize::try_from(leader - 1).expect("id")];
    let raft = kvota_control_plane::network::raft_client(&target.raft, leader, Some(&attacker), Duration::from_secs(2))
        .expect("client");
    for sender in [attacker_id, leader] {
        let forged = kvota_proto::raft::v1::AppendEntriesRequest {
            vote: Some(kvota_proto::raft::v1::RaftVote {
                term: u64::MAX,
                node_id: sender,
                committed: true,
            }),
            ..Default::default()
        };
        let r = raft.clone().append_entries(forged).await;
        let e = r.expect_err("forged AppendEntries");
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        let vote = kvota_proto::raft::v1::VoteRequest {
            vote: Some(kvota_proto::raft::v1::RaftVote {
                term: u64::MAX,
                node_id: sender,
                committed: false,
            }),
            last_log_id: None,
        };
        let r = raft.clone().vote(vote).await;
        assert_eq!(r.expect_err("forged Vote").code(), Code::InvalidArgument);
    }
    let seen = intact(&fed, "a forged term u64::MAX", &seen, &mut east, false).await;
    // An ordinary restart (the leader killed): the survivors elect a new leader.
    let killed = seen.0;
    fed.procs.kill(usize::try_from(killed - 1).expect("id"));
    let t0 = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(20);
    let (new_leader, new_term) = loop {
        let st = fed.statuses().await;
        if let Some(l) = st.iter().find(|s| s.1 == "leader" && s.0 != killed) {
            break (l.0, l.2);
        }
        assert!(
            Instant::now() < deadline,
            "no new leader after killing node {killed}: {st:?}\n{}",
            fed.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(new_term < 1 << 48, "term {new_term}");
    eprintln!(
        "new leader {new_leader} (term {new_term}) {:?} after the kill",
        t0.elapsed()
    );
    apply_policy(&fed.client(Role::Operator, "alice"))
        .await
        .expect("writes work after the failover");
    east.report().await;
    // Every survivor is healthy (its Raft core runs).
    for s in fed.specs.iter().filter(|s| s.id != killed) {
        let (code, body) = kvota_testkit::http_get(
            &kvota_testkit::anonymous(&fed.party(Role::Viewer, "v")),
            &s.http,
            "/healthz",
        )
        .await
        .expect("healthz");
        assert_eq!(code, 200, "node {}: {body}", s.id);
    }
    // And the killed node comes back and follows.
    let c = fed.spawn(usize::try_from(killed - 1).expect("id"), false);
    fed.procs.0[usize::try_from(killed - 1).expect("id")] = Some(c);
    let deadline = Instant::now() + Duration::from_secs(20);
    while fed.statuses().await.len() < 3 {
        assert!(
            Instant::now() < deadline,
            "node {killed} did not come back\n{}",
            fed.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A webhook client: HTTPS verifying the agent's certificate against `ca_pem` (for the
/// name `localhost`), presenting `client` (PEM pair) if given.
fn hook_config(ca_pem: &str, client: Option<(&str, &str)>) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(c.expect("pem")).expect("root");
    }
    let b = rustls::ClientConfig::builder_with_provider(kvota_tls::provider())
        .with_safe_default_protocol_versions()
        .expect("v")
        .with_root_certificates(roots);
    Arc::new(match client {
        None => b.with_no_client_auth(),
        Some((c, k)) => b
            .with_client_auth_cert(
                rustls::pki_types::CertificateDer::pem_slice_iter(c.as_bytes())
                    .map(|c| c.expect("pem"))
                    .collect(),
                rustls::pki_types::PrivateKeyDer::from_pem_slice(k.as_bytes()).expect("key"),
            )
            .expect("client cert"),
    })
}

async fn https(
    addr: SocketAddr,
    cfg: &Arc<rustls::ClientConfig>,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), String> {
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(cfg.clone())
        .connect(rustls::pki_types::ServerName::try_from("localhost").expect("name"), tcp)
        .await
        .map_err(|e| e.to_string())?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "localhost")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = send.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes()
        .to_vec();
    Ok((status, body))
}

fn review(uid: &str, ns: &str, op: &str, gpus: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": ns, "name": uid, "operation": op,
            "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": uid, "namespace": ns},
                "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": gpus}}}]}}}
    }))
    .expect("json")
}

/// The agent of cluster `east` (simulated, 2 nodes of 8 GPUs) with federation TLS and a
/// webhook that verifies the API server's client certificate.
struct AgentProc {
    addr: SocketAddr,
    child: Child,
    log: PathBuf,
    hook: Files,
    cluster: Files,
    apiserver: kvota_tls::issue::Issued,
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_agent(fed: &Fed, apiserver_ca: &Pki) -> AgentProc {
    start_agent_as(fed, apiserver_ca, "east", Some(32), None)
}

/// The agent of cluster `cluster` (simulated, 2 nodes of 8 GPUs), with
/// `--webhook-max-connections-per-peer` if given, under `prlimit --nofile=N:N` if given.
fn start_agent_as(
    fed: &Fed,
    apiserver_ca: &Pki,
    cluster: &str,
    per_peer: Option<usize>,
    nofile: Option<u64>,
) -> AgentProc {
    let port = free_ports(1)[0];
    let hook_issued = fed
        .pki
        .ca()
        .issue(&Kind::Webhook, "localhost", &[], &[], 30)
        .expect("webhook cert");
    let stem = if cluster == "east" {
        "agent".to_string()
    } else {
        format!("agent-{cluster}")
    };
    let hook = fed.pki.write(&format!("webhook-{cluster}"), &hook_issued);
    let cluster_files = fed.pki.files(Role::Cluster, cluster);
    let apiserver = apiserver_ca
        .ca()
        .issue(&Kind::Party(Role::Operator), "kube-apiserver", &[], &[], 30)
        .expect("apiserver cert");
    let log = fed.tmp.path().join(format!("{stem}.log"));
    let s = |p: &Path| p.to_str().expect("utf8").to_string();
    let mut cmd = match nofile {
        Some(n) => {
            let mut c = Command::new("prlimit");
            c.arg(format!("--nofile={n}:{n}")).arg(bin());
            c
        }
        None => Command::new(bin()),
    };
    cmd.args([
        "agent",
        "--cluster",
        cluster,
        "--simulate",
        "2x8",
        "--simulate-pod-seconds",
        "3600",
        "--report-interval-ms",
        "300",
    ])
    .args(["--webhook-listen", &format!("127.0.0.1:{port}")]);
    if let Some(n) = per_peer {
        cmd.args(["--webhook-max-connections-per-peer", &n.to_string()]);
    }
    let child = cmd
        .args(["--tls-cert", &s(&hook.cert), "--tls-key", &s(&hook.key)])
        .args(["--webhook-client-ca", &s(&apiserver_ca.dir().join("ca.crt"))])
        .args([
            "--cp",
            &fed.endpoints().join(","),
            "--cp-ca",
            &s(&cluster_files.ca),
            "--cp-cert",
            &s(&cluster_files.cert),
            "--cp-key",
            &s(&cluster_files.key),
        ])
        .arg("--data-dir")
        .arg(fed.tmp.path().join(&stem))
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).map(Stdio::from).expect("log"))
        .spawn()
        .expect("spawn agent");
    AgentProc {
        addr: format!("127.0.0.1:{port}").parse().expect("addr"),
        child,
        log,
        hook,
        cluster: cluster_files,
        apiserver,
    }
}

impl AgentProc {
    fn apiserver_config(&self, fed: &Fed) -> Arc<rustls::ClientConfig> {
        hook_config(
            &fed.pki.ca_pem,
            Some((&self.apiserver.cert_pem, &self.apiserver.key_pem)),
        )
    }

    async fn ready(&self, fed: &Fed) {
        let cfg = hook_config(&fed.pki.ca_pem, None);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !matches!(https(self.addr, &cfg, "GET", "/readyz", vec![]).await, Ok((200, _))) {
            assert!(
                Instant::now() < deadline,
                "agent never ready\n{}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A review as the API server sends it; the verdict within the 5 s the webhook
    /// configuration gives the API server (deploy/kubernetes): a later answer is one the
    /// API server has given up on. (A tighter bound is a timing claim, which a loaded
    /// 2-core CI machine broke; what a flood must not do is checked by its own
    /// counters, see limits.rs.)
    async fn judge(&self, fed: &Fed, uid: &str, op: &str, gpus: &str) -> Value {
        let t0 = Instant::now();
        let (status, body) = https(
            self.addr,
            &self.apiserver_config(fed),
            "POST",
            "/validate",
            review(uid, "ml", op, gpus),
        )
        .await
        .expect("review");
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "a real review took {:?}, past the API server's timeout",
            t0.elapsed()
        );
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        serde_json::from_slice(&body).expect("json")
    }

    /// The agent's metrics (a viewer of the federation may read them).
    async fn metrics(&self, fed: &Fed) -> String {
        let v = fed.pki.files(Role::Viewer, "scraper");
        let cfg = hook_config(
            &fed.pki.ca_pem,
            Some((
                &std::fs::read_to_string(&v.cert).expect("cert"),
                &std::fs::read_to_string(&v.key).expect("key"),
            )),
        );
        let (code, body) = https(self.addr, &cfg, "GET", "/metrics", vec![])
            .await
            .expect("metrics");
        assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
        String::from_utf8_lossy(&body).into_owned()
    }
}

fn training_inuse(metrics: &str) -> String {
    metrics
        .lines()
        .find(|l| l.starts_with("kvota_agent_inuse_gpus{tenant=\"training\"}"))
        .unwrap_or("none")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_answers_only_the_api_server_and_forged_reviews_change_nothing() {
    let fed = Fed::start().await;
    let apiserver_ca = Pki::new("kubernetes");
    let agent = start_agent(&fed, &apiserver_ca);
    agent.ready(&fed).await;
    // A tenant's first pod in a cluster waits for the next lease (the denial shows the
    // demand): retry as a controller does.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = agent.judge(&fed, "real-1", "CREATE", "1").await;
        if v["response"]["allowed"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "never admitted: {v}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    tokio::time::sleep(Duration::from_millis(600)).await; // the simulated cluster binds it
    let before = training_inuse(&agent.metrics(&fed).await);
    assert!(before.ends_with(" 1.0"), "{before}");

    // A review from anyone but the API server: no certificate, or one of the federation.
    let stranger = hook_config(&fed.pki.ca_pem, None);
    let (code, body) = https(
        agent.addr,
        &stranger,
        "POST",
        "/validate",
        review("forged", "ml", "CREATE", "8"),
    )
    .await
    .expect("answer");
    assert_eq!(code, 403, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("only from the Kubernetes API server"));
    let op = fed.pki.files(Role::Operator, "alice");
    let fed_client = hook_config(
        &fed.pki.ca_pem,
        Some((
            &std::fs::read_to_string(&op.cert).expect("c"),
            &std::fs::read_to_string(&op.key).expect("k"),
        )),
    );
    let (code, _) = https(
        agent.addr,
        &fed_client,
        "POST",
        "/mutate",
        review("forged2", "ml", "CREATE", "8"),
    )
    .await
    .expect("answer");
    assert_eq!(code, 403);
    // Metrics and explanations are not for strangers either; probes are.
    assert_eq!(
        https(agent.addr, &stranger, "GET", "/metrics", vec![])
            .await
            .expect("answer")
            .0,
        401
    );
    assert_eq!(
        https(agent.addr, &stranger, "GET", "/explain?pod=ml/real-1", vec![])
            .await
            .expect("answer")
            .0,
        401
    );
    assert_eq!(
        https(agent.addr, &stranger, "GET", "/healthz", vec![])
            .await
            .expect("answer")
            .0,
        200
    );

    // Even from the API server's certificate: a DELETE review drops nothing (the watch
    // is the only source of a pod's end), a huge quantity is refused, an oversized body
    // gets a well-formed 413 review.
    let v = agent.judge(&fed, "real-1", "DELETE", "1").await;
    assert_eq!(v["response"]["allowed"], true);
    let v = agent.judge(&fed, "huge", "CREATE", "1000000000").await;
    assert_eq!(v["response"]["allowed"], false, "{v}");
    let msg = v["response"]["status"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        msg.contains("kvota accounts for at most 1000000 GPUe in one pod"),
        "{msg}"
    );
    // A quantity beyond what a u64 of thousandths holds: refused as malformed.
    let (code, body) = https(
        agent.addr,
        &agent.apiserver_config(&fed),
        "POST",
        "/validate",
        review("huger", "ml", "CREATE", "18446744073709551615"),
    )
    .await
    .expect("answer");
    let v: Value = serde_json::from_slice(&body).expect("a review");
    assert!(code == 400 && v["response"]["allowed"] == false, "{code}: {v}");
    let (code, body) = https(
        agent.addr,
        &agent.apiserver_config(&fed),
        "POST",
        "/validate",
        vec![b' '; 5 << 20],
    )
    .await
    .expect("answer");
    assert_eq!(code, 413, "{}", String::from_utf8_lossy(&body));
    let after = training_inuse(&agent.metrics(&fed).await);
    assert_eq!(after, before, "forged reviews changed the accounting");
    // A real review is judged with the running pod still counted (the forged DELETE
    // did not drop it): in use 1 against a budget of 1. Its first denial is held for
    // the report it triggers, whose lease may grow with the new demand: then it is
    // admitted on top of the pod still counted.
    let v = agent.judge(&fed, "real-2", "CREATE", "1").await;
    let msg = v["response"]["status"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let counted = if v["response"]["allowed"] == true {
        msg.contains("holds 1 + 1 = 2")
    } else {
        msg.contains("in use 1 + this pod 1")
    };
    assert!(counted, "{v}");
    let m = agent.metrics(&fed).await;
    assert!(
        m.contains("kvota_agent_calls_refused_total{reason=\"not_apiserver\"} 2"),
        "{m}"
    );
}

/// Opens `n` TCP connections from `from` to `to`, which allows `limit` per address:
/// returns the ones that stayed open and how many the server closed at once (bare
/// connections: before the 10 s handshake timeout could have closed any).
async fn flood(from: &str, to: SocketAddr, n: usize, limit: usize) -> (Vec<tokio::net::TcpStream>, usize) {
    let mut closed = 0;
    let mut bare = Vec::new();
    let started = Instant::now();
    for _ in 0..n {
        let sock = tokio::net::TcpSocket::new_v4().expect("socket");
        sock.bind(format!("{from}:0").parse().expect("addr"))
            .expect("bind the attacker's address");
        let Ok(tcp) = sock.connect(to).await else {
            closed += 1;
            continue;
        };
        // Judged once all are open: a loaded server may accept (and refuse) late.
        bare.push(tcp);
    }
    // Bare connections: looked at until the server has closed those beyond its limit
    // (a loaded server accepts late, seconds late under a full test run), for at most
    // 8 s from the first connection: the handshake timeout (10 s from acceptance) has
    // closed none of them by then, so whatever is closed was refused at once.
    let deadline = started + Duration::from_secs(8);
    let mut open = bare;
    loop {
        let mut still = Vec::with_capacity(open.len());
        for mut tcp in open {
            let mut b = [0u8; 1];
            match tokio::time::timeout(Duration::from_millis(5), tcp.read(&mut b)).await {
                Ok(_) => closed += 1,
                Err(_) => still.push(tcp),
            }
        }
        open = still;
        if closed + limit >= n || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (open, closed)
}

/// Connections a node's gRPC listener refused because their address was at its limit, as
/// the node counts them (`kvota_connections_refused_total`); 0 if it does not answer.
async fn refused_from_peer(fed: &Fed, http: &str) -> f64 {
    let viewer = fed.party(Role::Viewer, "v").connector(Expect::AnyNode);
    let Ok((200, m)) = kvota_testkit::http_get(&viewer, http, "/metrics").await else {
        return 0.0;
    };
    m.lines()
        .filter(|l| {
            l.starts_with("kvota_connections_refused_total{")
                && l.contains("listener=\"grpc\"")
                && l.contains("reason=\"too_many_from_peer\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_finished_connections_hit_the_limits_and_real_requests_are_still_answered() {
    let fed = Fed::start().await;
    let mut west = Member::join(&fed, "west").await;
    let apiserver_ca = Pki::new("kubernetes");
    let agent = start_agent(&fed, &apiserver_ca);
    agent.ready(&fed).await;

    // gRPC: one address opens connections that never start a handshake.
    let leader = fed.one_leader().await.0;
    let api: SocketAddr = fed.specs[usize::try_from(leader - 1).expect("id")]
        .rpc
        .parse()
        .expect("addr");
    let (held_grpc, closed) = flood("127.0.0.2", api, 40, 32).await;
    // What the flood sees closed within 8 s is a refusal, not a handshake timeout (10 s).
    // On a machine loaded enough that the node accepts later than that (seen once, with
    // a build running beside the tests), the node's own count of refusals by reason
    // says the same without that ambiguity.
    if !(held_grpc.len() <= 32 && closed >= 8) {
        let http = fed.specs[usize::try_from(leader - 1).expect("id")].http.clone();
        let deadline = Instant::now() + Duration::from_secs(30);
        let refused = loop {
            let n = refused_from_peer(&fed, &http).await;
            if n >= 8.0 || Instant::now() >= deadline {
                break n;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert!(
            refused >= 8.0,
            "held {}, closed {closed}; the node counts {refused} refused for their address",
            held_grpc.len()
        );
    }
    west.report().await; // a real report, from another address, within a second

    // The webhook: one address opens TLS connections and sends half a request each.
    let half = hook_config(&fed.pki.ca_pem, None);
    // All at once: opened one after another on a loaded machine, the first were cut by
    // the header timeout (5 s) before the last were open, and the limit never bit.
    let held_hook = limits::half_requests(&["127.0.0.3"], agent.addr, 40, &half).await;
    let closed = 40 - held_hook.len();
    // Counted from when the last connection was open: each must be cut within the
    // header timeout and 3 s of slack.
    let t0 = Instant::now();
    assert!(
        held_hook.len() <= 32 && closed >= 8,
        "held {}, closed {closed}",
        held_hook.len()
    );
    let v = agent.judge(&fed, "while-flooded", "CREATE", "1").await;
    assert_eq!(v["response"]["uid"], "while-flooded");
    // The half requests are cut off by the header timeout (5 s), not held for good.
    // (Failed once in a full run on 2 loaded cores with the clock started before the
    // flood: 19 of them cut within 8 s.)
    let mut cut = 0;
    for mut tls in held_hook {
        let mut b = [0u8; 64];
        let wait = Duration::from_secs(8).saturating_sub(t0.elapsed());
        // Closed: end of stream, or an error (closed without a TLS close_notify).
        if tokio::time::timeout(wait, tls.read(&mut b)).await.is_ok() {
            cut += 1;
        }
    }
    assert!(cut >= 20, "only {cut} half requests were cut off within 8 s");
    // The refusals are counted.
    let m = agent.metrics(&fed).await;
    assert!(
        m.contains("kvota_agent_connections_refused_total{reason=\"too_many_from_peer\"}"),
        "{m}"
    );
    drop(held_grpc);
    west.report().await;
    limits::an_agent_under_a_low_file_limit_still_answers(&fed, &apiserver_ca).await;
}

fn rotate(files: &Files, issued: &kvota_tls::issue::Issued) {
    for (path, text) in [(&files.cert, &issued.cert_pem), (&files.key, &issued.key_pem)] {
        let tmp = path.with_extension("new");
        std::fs::write(&tmp, text).expect("write");
        std::fs::rename(&tmp, path).expect("rename");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_rotated_on_disk_are_picked_up_without_a_failed_request() {
    let fed = Fed::start().await;
    let apiserver_ca = Pki::new("kubernetes");
    let agent = start_agent(&fed, &apiserver_ca);
    agent.ready(&fed).await;
    let op = fed.party(Role::Operator, "alice");
    // What each node serves now.
    let leaf = |addr: String, party: GrpcTls| async move {
        let io = party.connector(Expect::AnyNode).dial(&addr).await.expect("dial");
        match io {
            kvota_tls::connect::ClientIo::Tls(t) => t.get_ref().1.peer_certificates().expect("certs")[0].to_vec(),
            kvota_tls::connect::ClientIo::Plain(_) => panic!("plain"),
        }
    };
    let before: Vec<Vec<u8>> = {
        let mut v = Vec::new();
        for s in &fed.specs {
            v.push(leaf(s.rpc.clone(), op.clone()).await);
        }
        v
    };
    let seq_before = fed
        .ledger()
        .await
        .iter()
        .find(|l| l.starts_with("east "))
        .cloned()
        .unwrap_or_default();

    // Requests keep coming while every certificate is replaced: each node's, the
    // agent's federation certificate and its webhook certificate.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let stop = stop.clone();
        let eps = fed.endpoints();
        let op = op.clone();
        let hook_cfg = agent.apiserver_config(&fed);
        let hook_addr = agent.addr;
        tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, Vec::new());
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                i += 1;
                // A fresh client each time: a new connection, a new handshake.
                let c = Client::with_tls(&eps, Some(op.clone())).expect("client");
                match c
                    .call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) })
                    .await
                {
                    Ok(_) => ok += 1,
                    Err(e) => failed.push(format!("status: {e:?}")),
                }
                match https(
                    hook_addr,
                    &hook_cfg,
                    "POST",
                    "/validate",
                    review(&format!("rot-{i}"), "serving", "CREATE", "0"),
                )
                .await
                {
                    Ok((200, _)) => ok += 1,
                    other => failed.push(format!("review: {other:?}")),
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (ok, failed)
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (i, f) in fed.node_files.iter().enumerate() {
        rotate(
            f,
            &fed.pki
                .ca()
                .issue(&Kind::Party(Role::Node), &(i + 1).to_string(), &[], &[], 60)
                .expect("issue"),
        );
    }
    rotate(
        &agent.cluster,
        &fed.pki
            .ca()
            .issue(&Kind::Party(Role::Cluster), "east", &[], &[], 60)
            .expect("issue"),
    );
    rotate(
        &agent.hook,
        &fed.pki
            .ca()
            .issue(&Kind::Webhook, "localhost", &[], &[], 60)
            .expect("issue"),
    );
    // Reloads are checked every 2 s.
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let (ok, failed) = load.await.expect("load");
    assert!(
        failed.is_empty(),
        "{} of {} requests failed across the rotation: {:?}",
        failed.len(),
        ok as usize + failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(ok > 20, "only {ok} requests made");
    for (i, s) in fed.specs.iter().enumerate() {
        let now = leaf(s.rpc.clone(), op.clone()).await;
        assert_ne!(now, before[i], "node {} still serves the old certificate", s.id);
    }
    // The agent's reports went on across its own rotation.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = fed
            .ledger()
            .await
            .iter()
            .find(|l| l.starts_with("east "))
            .cloned()
            .unwrap_or_default();
        if now != seq_before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent stopped reporting: {now}\n{}",
            std::fs::read_to_string(&agent.log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let log = std::fs::read_to_string(&agent.log).unwrap_or_default();
    assert!(log.contains("TLS files reloaded"), "the agent never reloaded:\n{log}");
    reload::certificates_that_cannot_handshake_are_refused_or_unready(&fed).await;
}
