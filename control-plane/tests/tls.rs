//! Identities and authorization on every port of a 3-node control plane with TLS (real
//! sockets, real certificates from `kvota_tls::issue`): each role gets what it may and
//! nothing more, a cluster acts only for itself, the Raft port serves nodes only and a
//! node speaks only for itself, the HTTP port's probes are open and its data is not,
//! and a member is added only at an address that proves to be that node.

use std::time::Duration;

use kvota_client::client::Client;
use kvota_client::tls::{GrpcTls, TlsError};
use kvota_fairness::policy::Policy;
use kvota_proto::v1;
use kvota_testkit::{anonymous, http_get, Cluster, Pki};
use kvota_tls::Role;
use tonic::Code;

async fn apply_policy(c: &Client) -> Result<v1::PolicyReply, tonic::Status> {
    let yaml = Policy::article_example_yaml().to_string();
    c.call(|ch| {
        let yaml = yaml.clone();
        async move {
            Ok(Client::admin(ch)
                .apply_policy(v1::PolicyRequest { yaml })
                .await?
                .into_inner())
        }
    })
    .await
}

fn registration(cluster: &str) -> v1::RegisterRequest {
    v1::RegisterRequest {
        cluster: cluster.to_string(),
        capacity: vec![v1::Resource {
            name: "nvidia.com/gpu".into(),
            quantity_milli: 8_000,
        }],
        labels: Default::default(),
    }
}

async fn register(c: &Client, cluster: &str) -> Result<v1::LeaseReply, tonic::Status> {
    let req = registration(cluster);
    c.call(|ch| {
        let req = req.clone();
        async move { Ok(Client::member(ch).register(req).await?.into_inner()) }
    })
    .await
}

async fn report(c: &Client, cluster: &str, seq: u64, held: u64) -> Result<v1::ReportReply, tonic::Status> {
    let req = v1::ReportRequest {
        cluster: cluster.to_string(),
        seq,
        held_epoch: held,
        tenants: vec![v1::TenantUsage {
            tenant: "training".into(),
            used_milli_gpue_ms: 1_000,
            inuse_milli_gpue: 1_000,
            pending_milli_gpue: 0,
            largest_pending_milli_gpue: 0,
            borrowed_milli_gpue: 0,
        }],
        ..Default::default()
    };
    kvota_testkit::send_report(c, &req).await
}

async fn status(c: &Client) -> Result<v1::StatusReply, tonic::Status> {
    c.call(|ch| async move { Ok(Client::admin(ch).status(v1::Empty {}).await?.into_inner()) })
        .await
}

fn client(endpoints: &[String], party: GrpcTls) -> Client {
    let c = Client::with_tls(endpoints, Some(party)).expect("client");
    c.set_call_timeout(Duration::from_secs(2));
    c
}

fn denied(r: Result<impl std::fmt::Debug, tonic::Status>, code: Code, says: &str) {
    match r {
        Err(s) => assert!(
            s.code() == code && s.message().contains(says),
            "expected {code:?} saying `{says}`, got {s:?}"
        ),
        Ok(v) => panic!("expected {code:?}, got {v:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_role_gets_what_it_may_and_a_cluster_acts_only_for_itself() {
    let pki = Pki::new("gpu.example");
    let cl = Cluster::start_with(3, Some(&pki), |_| {}).await;
    let leader = cl.leader(Duration::from_secs(15)).await;
    let eps = cl.endpoints();
    let follower = if leader == 1 { 2 } else { 1 };
    let follower_ep = vec![cl.members[&follower].rpc_addr.clone()];

    // An operator, through a follower (forwarded to the leader over TLS as a node).
    let operator = client(&follower_ep, pki.party(Role::Operator, "alice"));
    apply_policy(&operator)
        .await
        .expect("an operator applies the policy through a follower");
    // A cluster registers and reports for itself, also through a follower.
    let east = client(&follower_ep, pki.party(Role::Cluster, "east"));
    let lease = register(&east, "east")
        .await
        .expect("east registers")
        .lease
        .expect("lease");
    report(&east, "east", 1, lease.epoch).await.expect("east reports");
    // ... and reads the policy it enforces.
    east.call(|ch| async move { Ok(Client::admin(ch).get_policy(v1::Empty {}).await?.into_inner()) })
        .await
        .expect("get policy");

    // East may not act as west: register, report (an acknowledgement as another
    // cluster would discard its leases), or describe it.
    denied(
        register(&east, "west").await,
        Code::PermissionDenied,
        "may act only for cluster `east`, not `west`",
    );
    denied(report(&east, "west", 1, 0).await, Code::PermissionDenied, "not `west`");
    let desc = east
        .call(|ch| async move {
            Ok(Client::member(ch)
                .describe_cluster(v1::DescribeClusterRequest { cluster: "west".into() })
                .await?
                .into_inner())
        })
        .await;
    denied(desc, Code::PermissionDenied, "not `west`");
    // A cluster reads no federation-wide data and changes no policy.
    denied(status(&east).await, Code::PermissionDenied, "may not call admin.Status");
    denied(
        apply_policy(&east).await,
        Code::PermissionDenied,
        "may not call admin.ApplyPolicy",
    );

    // A viewer reads and changes nothing.
    let viewer = client(&eps, pki.party(Role::Viewer, "grafana"));
    assert_eq!(status(&viewer).await.expect("a viewer reads status").members.len(), 3);
    denied(
        apply_policy(&viewer).await,
        Code::PermissionDenied,
        "may not call admin.ApplyPolicy",
    );
    let rm = viewer
        .call(|ch| async move {
            Ok(Client::admin(ch)
                .remove_cluster(v1::DescribeClusterRequest { cluster: "east".into() })
                .await?
                .into_inner())
        })
        .await;
    denied(rm, Code::PermissionDenied, "RemoveCluster");
    denied(
        register(&viewer, "viewer-cluster").await,
        Code::PermissionDenied,
        "Register",
    );
    // A backup holds the whole state: operators only.
    let save = |c: Client| async move {
        c.call(|ch| async move { Ok(Client::admin(ch).save_snapshot(v1::Empty {}).await?.into_inner()) })
            .await
    };
    denied(
        save(viewer.clone()).await,
        Code::PermissionDenied,
        "may not call admin.SaveSnapshot",
    );
    denied(
        save(east.clone()).await,
        Code::PermissionDenied,
        "may not call admin.SaveSnapshot",
    );
    // A cluster reads neither other clusters' decisions nor the showback.
    let usage = east
        .call(|ch| async move {
            Ok(Client::admin(ch)
                .usage(v1::UsageRequest {
                    since_ms: 0,
                    until_ms: 0,
                    by_tenant: true,
                    by_cluster: true,
                })
                .await?
                .into_inner())
        })
        .await;
    denied(usage, Code::PermissionDenied, "may not call admin.Usage");
    let explain = east
        .call(|ch| async move {
            Ok(Client::admin(ch)
                .explain_pod(v1::ExplainPodRequest {
                    pod: "ml/a".into(),
                    cluster: String::new(),
                })
                .await?
                .into_inner())
        })
        .await;
    denied(explain, Code::PermissionDenied, "may not call admin.ExplainPod");
    viewer
        .call(|ch| async move {
            Ok(Client::admin(ch)
                .usage(v1::UsageRequest {
                    since_ms: 0,
                    until_ms: 0,
                    by_tenant: true,
                    by_cluster: false,
                })
                .await?
                .into_inner())
        })
        .await
        .expect("a viewer reads the showback");
    let backup = save(operator.clone()).await.expect("an operator saves a backup");
    assert!(backup.follows_leader && !backup.backup.is_empty(), "{}", backup.note);
    // An operator reports no usage (only clusters do).
    denied(
        report(&operator, "east", 2, 0).await,
        Code::PermissionDenied,
        "member.Report",
    );
    // A node certificate may make writes only as forwarded calls.
    let node = client(&eps, pki.party(Role::Node, "2"));
    denied(
        apply_policy(&node).await,
        Code::PermissionDenied,
        "only as a forwarded call",
    );

    // Strangers: plain text, and a certificate of another CA, do not get through the
    // handshake (the client sees the connection fail).
    let plain = Client::new(&eps).expect("client");
    plain.set_call_timeout(Duration::from_millis(500));
    assert!(register(&plain, "intruder").await.is_err(), "plain text got in");
    let other = Pki::new("gpu.example");
    let stranger = client(&eps, other.party(Role::Operator, "mallory"));
    assert!(apply_policy(&stranger).await.is_err(), "another CA's operator got in");

    // Nothing refused changed anything, and the refusals are counted by reason.
    let feds = cl.converged(Duration::from_secs(10)).await;
    for f in &feds {
        assert_eq!(f.clusters().keys().collect::<Vec<_>>(), vec!["east"]);
        assert_eq!(f.clusters()["east"].last_seq, 1);
    }
    let metrics: String = (1..=3)
        .map(|id| {
            cl.node(id)
                .ctx
                .metrics
                .render(&cl.node(id).raft().metrics().borrow(), &feds[0])
        })
        .collect();
    for reason in ["cluster_mismatch", "role", "not_forwarded"] {
        assert!(
            metrics.contains(&format!("reason=\"{reason}\"")),
            "no {reason} in\n{metrics}"
        );
    }
    cl.shutdown().await;
}

/// The audit log names who did what, from the certificate: an operator's policy applied
/// through a follower (forwarded as a node, the operator named to the leader) is
/// `operator/alice` on every node; a cluster's registration `cluster/east`; the budgets
/// the control plane then changes `kvota`; and the log filters by actor and tenant. A
/// node cannot be named as the actor by a caller that is not a node.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_audit_log_names_its_actors_from_their_certificates() {
    let pki = Pki::new("gpu.example");
    let cl = Cluster::start_with(3, Some(&pki), |_| {}).await;
    let leader = cl.leader(Duration::from_secs(15)).await;
    cl.feature_level(
        kvota_control_plane::feature::FeatureLevel::RECORDS,
        Duration::from_secs(20),
    )
    .await;
    let follower = if leader == 1 { 2 } else { 1 };
    let follower_ep = vec![cl.members[&follower].rpc_addr.clone()];
    let operator = client(&follower_ep, pki.party(Role::Operator, "alice"));
    apply_policy(&operator)
        .await
        .expect("alice applies the policy through a follower");
    let east = client(&follower_ep, pki.party(Role::Cluster, "east"));
    register(&east, "east").await.expect("east registers");
    let feds = cl.converged(Duration::from_secs(10)).await;
    for fed in &feds {
        let actors: Vec<(&str, Option<&str>)> = fed
            .audit()
            .map(|r| match &r.event {
                kvota_fairness::federation::AuditEvent::PolicyApplied { .. } => ("policy", r.actor.as_deref()),
                kvota_fairness::federation::AuditEvent::ClusterRegistered { .. } => ("register", r.actor.as_deref()),
                kvota_fairness::federation::AuditEvent::BudgetsChanged { .. } => ("budgets", r.actor.as_deref()),
                _ => ("other", r.actor.as_deref()),
            })
            .collect();
        assert!(actors.contains(&("policy", Some("operator/alice"))), "{actors:?}");
        assert!(actors.contains(&("register", Some("cluster/east"))), "{actors:?}");
        assert!(
            actors
                .iter()
                .filter(|(k, _)| *k == "budgets")
                .all(|(_, a)| *a == Some("kvota")),
            "{actors:?}"
        );
    }
    // Filtered over gRPC, as `kvota audit --actor` asks.
    let viewer = client(&cl.endpoints(), pki.party(Role::Viewer, "grafana"));
    let by = |actor: &'static str, tenant: &'static str| {
        let viewer = viewer.clone();
        async move {
            viewer
                .call(|ch| async move {
                    Ok(Client::admin(ch)
                        .audit_log(v1::AuditLogRequest {
                            limit: 0,
                            tenant: tenant.into(),
                            actor: actor.into(),
                            since_ms: 0,
                            kinds: vec!["all".into()],
                        })
                        .await?
                        .into_inner())
                })
                .await
                .expect("audit")
                .entries
        }
    };
    // Bob names alice in the header a forwarding node uses: only nodes are believed.
    let bob = client(&cl.endpoints(), pki.party(Role::Operator, "bob"));
    bob.call(|ch| async move {
        let mut req = tonic::Request::new(v1::PolicyRequest {
            yaml: kvota_fairness::policy::Policy::article_example_yaml().to_string(),
        });
        req.metadata_mut()
            .insert("kvota-actor", "operator/alice".parse().expect("ascii"));
        Ok(Client::admin(ch).apply_policy(req).await?.into_inner())
    })
    .await
    .expect("bob applies");
    assert_eq!(by("operator/bob", "").await.len(), 1, "bob's policy is bob's");
    let alice = by("operator/alice", "").await;
    assert_eq!(alice.len(), 1, "{alice:?}");
    assert!(by("operator/mallory", "").await.is_empty());
    assert!(
        by("", "training").await.iter().all(|r| r.actor != "cluster/east"),
        "a registration is about no tenant"
    );
    let bad = viewer
        .call(|ch| async move {
            Ok(Client::admin(ch)
                .audit_log(v1::AuditLogRequest {
                    tenant: "Not A Name".into(),
                    ..Default::default()
                })
                .await?
                .into_inner())
        })
        .await;
    denied(bad, Code::InvalidArgument, "not a tenant name");
    cl.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_raft_port_serves_nodes_only_and_each_only_as_itself() {
    let pki = Pki::new("kvota");
    let cl = Cluster::start_with(3, Some(&pki), |_| {}).await;
    let leader = cl.leader(Duration::from_secs(15)).await;
    let term = cl.node(leader).raft().metrics().borrow().current_term;
    let target = if leader == 3 { 2 } else { 3 };
    let raft_addr = cl.members[&target].raft_addr.clone();

    // An operator (or a cluster) cannot even stay connected to the Raft port.
    for (role, name) in [(Role::Operator, "alice"), (Role::Cluster, "east")] {
        let party = pki.party(role, name);
        let ch = kvota_client::tls::channel(
            &raft_addr,
            Some(&party),
            kvota_tls::Expect::Node(target),
            Duration::from_secs(1),
            Duration::from_secs(2),
        )
        .expect("channel");
        let r = kvota_proto::raft::v1::raft_client::RaftClient::new(ch)
            .clock(kvota_proto::raft::v1::Empty {})
            .await;
        assert!(r.is_err(), "{role} was served on the Raft port");
    }
    // The API port does not serve Raft at all.
    let node1 = pki.party(Role::Node, "1");
    let ch = kvota_client::tls::channel(
        &cl.members[&target].rpc_addr,
        Some(&node1),
        kvota_tls::Expect::Node(target),
        Duration::from_secs(1),
        Duration::from_secs(2),
    )
    .expect("channel");
    let r = kvota_proto::raft::v1::raft_client::RaftClient::new(ch)
        .clock(kvota_proto::raft::v1::Empty {})
        .await;
    assert_eq!(r.expect_err("no Raft on the API port").code(), Code::Unimplemented);

    // A node certificate speaking for another node is refused before openraft sees it.
    let impostor = if leader == 1 { 2 } else { 1 };
    let impostor = pki.party(Role::Node, &impostor.to_string());
    let mut raft =
        kvota_control_plane::network::raft_client(&raft_addr, target, Some(&impostor), Duration::from_secs(2))
            .expect("client");
    let forged = kvota_proto::raft::v1::AppendEntriesRequest {
        vote: Some(kvota_proto::raft::v1::RaftVote {
            term: term + 100,
            node_id: leader,
            committed: true,
        }),
        ..Default::default()
    };
    let r = raft.append_entries(forged).await;
    let s = r.expect_err("a node may not send as the leader");
    assert!(
        s.code() == Code::InvalidArgument && s.message().contains("as node"),
        "{s:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    for n in cl.nodes.iter().flatten() {
        let t = n.raft().metrics().borrow().current_term;
        assert!(t < term + 100, "node {} moved to the forged term {t}", n.id);
    }
    cl.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_probes_are_open_and_everything_else_needs_a_readers_certificate() {
    let pki = Pki::new("kvota");
    let cl = Cluster::start_with(3, Some(&pki), |_| {}).await;
    cl.leader(Duration::from_secs(15)).await;
    let http = cl.members[&1].http_addr.clone();
    let viewer = pki.party(Role::Viewer, "prometheus");
    let probe = anonymous(&viewer);
    assert_eq!(http_get(&probe, &http, "/healthz").await.expect("healthz").0, 200);
    let (code, _) = http_get(&probe, &http, "/readyz").await.expect("readyz");
    assert!(code == 200 || code == 503, "{code}");
    for path in [
        "/metrics",
        "/api/v1/tenants",
        "/api/v1/status",
        "/api/v1/overview",
        "/api/v1/history",
        "/api/v1/usage",
        "/api/v1/decisions?pod=a/b",
        "/api/v1/explain/tenant?tenant=training",
        "/api/v1/audit",
        "/",
        "/ui/",
        "/ui/app.js",
        "/nothing-here",
    ] {
        let (code, body) = http_get(&probe, &http, path).await.expect("answer");
        assert_eq!(code, 401, "{path} without a certificate: {body}");
    }
    // The dashboard's data, read by a viewer from whichever node this is: the read
    // follows the leader over the nodes' own mTLS.
    let reader = viewer.connector(kvota_tls::Expect::AnyNode);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (code, body) = http_get(&reader, &http, "/api/v1/overview").await.expect("overview");
        assert_eq!(code, 200, "{body}");
        let o: serde_json::Value = serde_json::from_str(&body).expect("json");
        if o["read"]["follows_leader"] == true {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a viewer's read never followed the leader: {o}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (code, body) = http_get(&reader, &http, "/ui/").await.expect("dashboard");
    assert!(code == 200 && body.contains("<title>kvota"), "{code}: {body}");
    let (code, body) = http_get(&viewer.connector(kvota_tls::Expect::AnyNode), &http, "/metrics")
        .await
        .expect("metrics");
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("kvota_auth_denied_total"), "{body}");
    // The node's certificate: when it expires, as served and as the client of its peers.
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    for r#use in ["served", "client"] {
        let line =
            format!("kvota_certificate_expiry_timestamp_seconds{{use=\"{use}\",identity=\"spiffe://kvota/node/1\"}} ");
        let value: f64 = body
            .lines()
            .find_map(|l| l.strip_prefix(&line))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no `{line}`: {body}"));
        assert!(value > now + 86_400.0, "{use}: expires at {value}, now {now}");
    }
    // The same pages through the gRPC port (`kvota dashboard`): readers only, the
    // dashboard's paths only, and the same answer as the HTTP port.
    let browse = |party: GrpcTls, path: &'static str| {
        let c = client(&cl.endpoints(), party);
        async move {
            c.call(|ch| async move {
                Ok(Client::admin(ch)
                    .browse(v1::BrowseRequest { path: path.into() })
                    .await?
                    .into_inner())
            })
            .await
        }
    };
    let page = browse(pki.party(Role::Viewer, "ann"), "/ui/")
        .await
        .expect("a viewer browses");
    assert_eq!(page.status, 200);
    assert!(page.content_type.starts_with("text/html") && String::from_utf8_lossy(&page.body).contains("<title>kvota"));
    assert!(
        page.headers["content-security-policy"].starts_with("default-src 'none'"),
        "{:?}",
        page.headers
    );
    let missing = browse(pki.party(Role::Viewer, "ann"), "/api/v1/explain/tenant?tenant=nobody")
        .await
        .expect("answered");
    assert_eq!(missing.status, 404);
    denied(
        browse(pki.party(Role::Cluster, "east"), "/ui/").await,
        Code::PermissionDenied,
        "Browse",
    );
    denied(
        browse(pki.party(Role::Viewer, "ann"), "/metrics").await,
        Code::InvalidArgument,
        "/ui/... and /api/v1/...",
    );
    let east = pki.party(Role::Cluster, "east");
    for path in ["/api/v1/tenants", "/api/v1/usage", "/api/v1/decisions?pod=a/b", "/ui/"] {
        let (code, body) = http_get(&east.connector(kvota_tls::Expect::AnyNode), &http, path)
            .await
            .expect("answer");
        assert_eq!(code, 403, "a cluster reads no federation-wide data: {path}: {body}");
    }
    // Plain HTTP to a TLS port gets nowhere.
    let plain = kvota_tls::connect::Connector::new(None);
    assert!(!matches!(http_get(&plain, &http, "/metrics").await, Ok((200, _))));
    cl.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_is_added_only_where_that_node_answers() {
    let pki = Pki::new("kvota");
    let cl = Cluster::start_with(3, Some(&pki), |_| {}).await;
    cl.leader(Duration::from_secs(15)).await;
    let operator = client(&cl.endpoints(), pki.party(Role::Operator, "alice"));
    // "Node 4" at node 2's Raft address: node 2's certificate says node 2.
    let two = cl.members[&2].clone();
    let add = |raft_addr: String| {
        let req = v1::AddLearnerRequest {
            node: Some(v1::NodeInfo {
                id: 4,
                rpc_addr: "127.0.0.1:1".into(),
                http_addr: String::new(),
                raft_addr,
                voter: false,
            }),
        };
        let operator = operator.clone();
        async move {
            operator
                .call(|ch| {
                    let req = req.clone();
                    async move { Ok(Client::admin(ch).add_learner(req).await?.into_inner()) }
                })
                .await
        }
    };
    denied(add(two.raft_addr.clone()).await, Code::FailedPrecondition, "not node 4");
    // An address where nothing listens (the leader must not be sent anywhere).
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .to_string();
    denied(add(closed).await, Code::FailedPrecondition, "is not verified");
    let st = status(&operator).await.expect("status");
    assert_eq!(st.members.len(), 3, "{:?}", st.members);
    cl.shutdown().await;
}

#[test]
fn bad_certificate_files_are_refused_naming_the_file() {
    let pki = Pki::new("kvota");
    let f = pki.files(Role::Node, "1");
    let dir = pki.dir();
    let missing = dir.join("missing.pem");
    let junk = dir.join("junk.pem");
    std::fs::write(&junk, "not a certificate\n").expect("write");
    let cases = [
        (&f.ca, &missing, &f.key, "read the certificate", "missing.pem"),
        (&junk, &f.cert, &f.key, "the CA bundle", "junk.pem"),
        (&f.ca, &junk, &f.key, "the certificate", "junk.pem"),
        (&f.ca, &f.cert, &f.cert, "the private key", "node-1.crt"),
    ];
    for (c, crt, k, what, file) in cases {
        let e = GrpcTls::from_files(c, crt, k).expect_err(what);
        let text = e.to_string();
        assert!(text.contains(what) && text.contains(file), "{what}: {text}");
        assert_eq!(matches!(e, TlsError::Read { .. }), file == "missing.pem", "{text}");
    }
    // A certificate naming no kvota identity (a webhook's) cannot be a party's.
    let hook = pki
        .ca()
        .issue(
            &kvota_tls::issue::Kind::Webhook,
            "kvota-agent.kvota-system.svc",
            &[],
            &[],
            30,
        )
        .expect("issue");
    let w = pki.write("webhook", &hook);
    let e = GrpcTls::from_files(&w.ca, &w.cert, &w.key).expect_err("no identity");
    assert!(e.to_string().contains("names no kvota identity"), "{e}");
}
