//! Mutual TLS on the gRPC port, with real sockets and real certificates (rcgen): three
//! nodes elect, replicate and forward writes over TLS; a client with a certificate from
//! the cluster's CA gets in; plain text, no certificate, or a certificate from another CA
//! does not, and nothing changes. Bad PEM files are refused with the file named.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use kvota_control_plane::client::Client;
use kvota_control_plane::server::{start, ServerConfig, ServerHandle};
use kvota_control_plane::tls::{GrpcTls, TlsError};
use kvota_control_plane::types::Node;
use kvota_fairness::policy::Policy;
use kvota_proto::v1;
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use tokio::net::TcpListener;

/// A CA, and a certificate signed by it for `127.0.0.1`, written as PEM files into
/// `dir` (`ca.pem`, `<name>.pem`, `<name>-key.pem`).
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(dir: &Path) -> Ca {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).expect("self-sign");
        std::fs::write(dir.join("ca.pem"), cert.pem()).expect("write ca");
        Ca { cert, key }
    }

    fn issue(&self, dir: &Path, name: &str) -> GrpcTls {
        let key = KeyPair::generate().expect("key");
        let params = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).expect("params");
        let cert = params.signed_by(&key, &self.cert, &self.key).expect("sign");
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).expect("write cert");
        std::fs::write(dir.join(format!("{name}-key.pem")), key.serialize_pem()).expect("write key");
        GrpcTls::from_files(&dir.join("ca.pem"), &dir.join(format!("{name}.pem")), &dir.join(format!("{name}-key.pem")))
            .expect("load")
    }
}

async fn cluster(tmp: &Path, ca: &Ca) -> (Vec<ServerHandle>, Vec<String>) {
    let mut listeners = Vec::new();
    let mut members = BTreeMap::new();
    for id in 1..=3u64 {
        let rpc = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let http = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        members.insert(id, Node { rpc_addr: rpc.local_addr().expect("a").to_string(), http_addr: http.local_addr().expect("a").to_string() });
        listeners.push((rpc, http));
    }
    let mut nodes = Vec::new();
    for (i, (rpc, http)) in listeners.into_iter().enumerate() {
        let id = i as u64 + 1;
        let m = &members[&id];
        let mut cfg = ServerConfig::new(id, tmp.join(format!("node{id}")), m.rpc_addr.clone(), m.http_addr.clone());
        cfg.tls = Some(ca.issue(tmp, &format!("node{id}")));
        if id == 1 {
            cfg.initial_members = Some(members.clone());
        }
        nodes.push(start(cfg, rpc, http).await.expect("start"));
    }
    (nodes, members.values().map(|m| m.rpc_addr.clone()).collect())
}

async fn apply_policy(c: &Client) -> Result<v1::PolicyReply, tonic::Status> {
    let yaml = Policy::article_example_yaml().to_string();
    c.call(|ch| {
        let yaml = yaml.clone();
        async move { Ok(Client::admin(ch).apply_policy(v1::PolicyRequest { yaml }).await?.into_inner()) }
    })
    .await
}

fn intruder() -> v1::RegisterRequest {
    v1::RegisterRequest {
        cluster: "intruder".to_string(),
        capacity: vec![v1::Resource { name: "nvidia.com/gpu".into(), quantity_milli: 8_000 }],
        labels: Default::default(),
    }
}

/// Whether a client with this TLS setup can register a cluster at `addr`.
async fn got_in(addr: &str, tls: tonic::transport::ClientTlsConfig) -> bool {
    let ep = tonic::transport::Endpoint::from_shared(format!("https://{addr}"))
        .expect("endpoint")
        .tls_config(tls)
        .expect("tls")
        .connect_timeout(Duration::from_secs(2))
        .timeout(Duration::from_secs(2));
    match ep.connect().await {
        Err(_) => false,
        Ok(ch) => v1::member_client::MemberClient::new(ch).register(intruder()).await.is_ok(),
    }
}

async fn register_intruder(c: &Client) -> Result<v1::LeaseReply, tonic::Status> {
    c.call(|ch| async move { Ok(Client::member(ch).register(intruder()).await?.into_inner()) }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_holders_of_a_certificate_from_the_ca_get_in() {
    let tmp = tempfile::tempdir().expect("tmp");
    let ca = Ca::new(tmp.path());
    let (nodes, endpoints) = cluster(tmp.path(), &ca).await;

    // An operator with a certificate: a leader is elected over TLS and the write is
    // replicated; sent to a follower first, it is forwarded to the leader over TLS.
    let admin = Client::with_tls(&endpoints, Some(ca.issue(tmp.path(), "admin"))).expect("client");
    let deadline = Instant::now() + Duration::from_secs(15);
    let leader = loop {
        if let Some(l) = nodes.iter().position(|n| n.raft().metrics().borrow().state == openraft::ServerState::Leader) {
            break l;
        }
        assert!(Instant::now() < deadline, "no leader over TLS");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let follower = (leader + 1) % 3;
    let via_follower = Client::with_tls(&endpoints[follower..=follower], Some(ca.issue(tmp.path(), "admin2"))).expect("client");
    apply_policy(&via_follower).await.expect("policy through a follower, over TLS");
    let deadline = Instant::now() + Duration::from_secs(10);
    for n in &nodes {
        while n.ctx.state.read().await.federation.policy().is_none() {
            assert!(Instant::now() < deadline, "node {} never applied the policy", n.id);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let st = admin
        .call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) })
        .await
        .expect("status over TLS");
    assert_eq!(st.members.len(), 3);

    // Strangers: plain text, no client certificate, a certificate from another CA.
    let plain = Client::new(&endpoints).expect("client");
    plain.set_call_timeout(Duration::from_millis(500));
    assert!(register_intruder(&plain).await.is_err(), "plain text got in");

    // Trusting the cluster's CA (so the server checks out) but presenting no client
    // certificate, or one from another CA: the server refuses the connection.
    let ca_pem = std::fs::read(tmp.path().join("ca.pem")).expect("ca");
    let trust = || tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(&ca_pem));
    assert!(!got_in(&endpoints[leader], trust()).await, "a client without a certificate got in");
    let other_dir = tmp.path().join("other");
    std::fs::create_dir_all(&other_dir).expect("dir");
    let other = Ca::new(&other_dir);
    other.issue(&other_dir, "stranger");
    let identity = tonic::transport::Identity::from_pem(
        std::fs::read(other_dir.join("stranger.pem")).expect("cert"),
        std::fs::read(other_dir.join("stranger-key.pem")).expect("key"),
    );
    assert!(!got_in(&endpoints[leader], trust().identity(identity)).await, "a certificate from another CA got in");
    // The same way in with a certificate from the cluster's CA works (the check above
    // fails for the certificate, not for the way it is made).
    ca.issue(tmp.path(), "ok");
    let identity = tonic::transport::Identity::from_pem(
        std::fs::read(tmp.path().join("ok.pem")).expect("cert"),
        std::fs::read(tmp.path().join("ok-key.pem")).expect("key"),
    );
    let ok = tonic::transport::Endpoint::from_shared(format!("https://{}", endpoints[leader]))
        .expect("endpoint")
        .tls_config(trust().identity(identity))
        .expect("tls")
        .connect()
        .await
        .expect("connect with a good certificate");
    v1::admin_client::AdminClient::new(ok).status(v1::Empty {}).await.expect("status with a good certificate");

    // Nothing the strangers sent was applied.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for n in &nodes {
        assert!(!n.ctx.state.read().await.federation.clusters().contains_key("intruder"), "node {}", n.id);
    }
    for n in nodes {
        n.shutdown().await;
    }
}

#[test]
fn bad_certificate_files_are_refused_naming_the_file() {
    let tmp = tempfile::tempdir().expect("tmp");
    let ca = Ca::new(tmp.path());
    ca.issue(tmp.path(), "node");
    let (ca_pem, cert, key) = (tmp.path().join("ca.pem"), tmp.path().join("node.pem"), tmp.path().join("node-key.pem"));
    let missing = tmp.path().join("missing.pem");
    let junk = tmp.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").expect("write");
    let cases = [
        (&ca_pem, &missing, &key, "read the certificate", "missing.pem"),
        (&junk, &cert, &key, "the CA certificate", "junk.pem"),
        (&ca_pem, &junk, &key, "the certificate", "junk.pem"),
        (&ca_pem, &cert, &cert, "the private key", "node.pem"),
    ];
    for (c, crt, k, what, file) in cases {
        let e = GrpcTls::from_files(c, crt, k).expect_err(what);
        let text = e.to_string();
        assert!(text.contains(what) && text.contains(file), "{what}: {text}");
        assert_eq!(matches!(e, TlsError::Read { .. }), file == "missing.pem", "{text}");
    }
}
