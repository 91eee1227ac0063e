//! A 3-node control plane in one test process over real loopback gRPC and real data
//! directories: election, policy, reports from several clusters, the same state on
//! every node, a leader killed mid-stream, restart from disk, and bad input.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvota_client::client::Client;
use kvota_control_plane::server::{start, Listeners};
use kvota_fairness::federation::AuditEvent;
use kvota_fairness::policy::Policy;
use kvota_proto::v1;
use kvota_testkit::{config, node_of, Cluster};
use tonic::Code;

fn idx(id: u64) -> usize {
    usize::try_from(id - 1).expect("small id")
}

async fn apply_policy(c: &Client, yaml: &str) -> Result<v1::PolicyReply, tonic::Status> {
    let yaml = yaml.to_string();
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

async fn register(c: &Client, cluster: &str, gpus: u64) -> v1::Lease {
    let req = v1::RegisterRequest {
        cluster: cluster.to_string(),
        capacity: vec![v1::Resource {
            name: "nvidia.com/gpu".into(),
            quantity_milli: gpus * 1000,
        }],
        labels: Default::default(),
    };
    c.call(|ch| {
        let req = req.clone();
        async move { Ok(Client::member(ch).register(req).await?.into_inner()) }
    })
    .await
    .expect("register")
    .lease
    .expect("lease")
}

fn report(cluster: &str, seq: u64, held: u64, used: u64) -> v1::ReportRequest {
    v1::ReportRequest {
        cluster: cluster.to_string(),
        seq,
        held_epoch: held,
        tenants: vec![
            v1::TenantUsage {
                tenant: "training".into(),
                used_milli_gpue_ms: used,
                inuse_milli_gpue: 4000,
                pending_milli_gpue: 8000,
                largest_pending_milli_gpue: 0,
                borrowed_milli_gpue: 0,
            },
            v1::TenantUsage {
                tenant: "inference".into(),
                used_milli_gpue_ms: used / 2,
                inuse_milli_gpue: 2000,
                pending_milli_gpue: 0,
                largest_pending_milli_gpue: 0,
                borrowed_milli_gpue: 0,
            },
        ],
        capacity: vec![],
        evictions: vec![],
        decisions: vec![],
        window_start_ms: 0,
        window_end_ms: 0,
        gap_in_reply: false,
        status: None,
    }
}

async fn send(c: &Client, r: &v1::ReportRequest) -> Result<v1::ReportReply, tonic::Status> {
    c.call(|ch| {
        let r = r.clone();
        async move { Ok(Client::member(ch).report(r).await?.into_inner()) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_replicate_identical_state_and_survive_leader_loss() {
    let mut cl = Cluster::start(3).await;
    cl.leader(Duration::from_secs(10)).await;
    cl.feature_level(
        kvota_control_plane::feature::FeatureLevel::OPERATOR_VIEW,
        Duration::from_secs(20),
    )
    .await;
    let client = Client::new(&cl.endpoints()).expect("client");

    apply_policy(&client, Policy::article_example_yaml())
        .await
        .expect("policy");
    let mut held = BTreeMap::new();
    for (c, g) in [("east", 32), ("west", 32), ("edge", 16)] {
        held.insert(c, register(&client, c, g).await.epoch);
    }

    // A stream of reports from three clusters; the leader dies in the middle.
    let mut seq: BTreeMap<&str, u64> = BTreeMap::new();
    let mut acked_usage: BTreeMap<&str, u64> = BTreeMap::new();
    let mut killed = None;
    for round in 1..=30u64 {
        if round == 12 {
            let leader = cl.leader(Duration::from_secs(5)).await;
            cl.stop(leader).await;
            killed = Some(leader);
        }
        for c in ["east", "west", "edge"] {
            let s = seq.entry(c).or_insert(0);
            *s += 1;
            let r = report(c, *s, held[c], 1_000 * round);
            let reply = send(&client, &r)
                .await
                .unwrap_or_else(|e| panic!("report {c} #{s}: {e}"));
            assert!(reply.applied, "{c} #{s} must be applied once");
            held.insert(c, reply.lease.expect("lease").epoch);
            *acked_usage.entry(c).or_default() += 1_000 * round + 500 * round;
        }
    }
    // Resending acknowledged reports changes nothing.
    for c in ["east", "west"] {
        let r = report(c, 5, 0, 1_000 * 5);
        let reply = send(&client, &r).await.expect("duplicate");
        assert!(!reply.applied, "a duplicate must not be applied again");
    }
    let feds = cl.converged(Duration::from_secs(10)).await;
    assert_eq!(feds.len(), 2);
    let fed = &feds[0];
    for c in ["east", "west", "edge"] {
        assert_eq!(fed.clusters()[c].last_seq, 30, "{c}");
    }
    // The ledger holds every acknowledged report's usage exactly once (decay over a
    // few seconds of a 24 h half-life is below one part in 10^4).
    let total: u64 = acked_usage.values().sum();
    let ledger: u64 = fed.ledger().entries().values().map(|u| u.value_milli_gpue_ms).sum();
    assert!(
        ledger <= total && ledger * 10_000 >= total * 9_999,
        "ledger {ledger} vs reported {total}"
    );
    assert!(fed.check_safety().is_empty());

    // The killed node restarts from its directory and catches up to the same state.
    let killed = killed.expect("killed");
    cl.restart(killed).await;
    let feds = cl.converged(Duration::from_secs(15)).await;
    assert_eq!(feds.len(), 3);
    // The audit log tells the failover: a leader other than the killed node took over.
    let leaders: Vec<u64> = feds[0]
        .audit()
        .filter_map(|r| match r.event {
            AuditEvent::LeaderChanged { node, .. } => Some(node),
            _ => None,
        })
        .collect();
    assert!(
        leaders.last().is_some_and(|l| *l != killed),
        "leader changes {leaders:?} after {killed} was killed"
    );

    // Every node answers reads with the same numbers.
    for m in cl.members.values() {
        let one = Client::new(std::slice::from_ref(&m.rpc_addr)).expect("client");
        let t = one
            .call(|ch| async move { Ok(Client::admin(ch).list_tenants(v1::Empty {}).await?.into_inner()) })
            .await
            .expect("tenants");
        assert_eq!(t.capacity_milli_gpue, 80_000);
        assert_eq!(t.tenants.len(), 3);
    }

    // Stop everything; start again from disk: identical state.
    let before = cl.federation(1).await;
    for id in 1..=3 {
        cl.stop(id).await;
    }
    for id in 1..=3 {
        cl.restart(id).await;
    }
    cl.leader(Duration::from_secs(10)).await;
    // A restarted node applies its log only as far as the commit index it last wrote
    // (every second at most); the rest follows once the new leader commits in its term.
    // Wait for the state to reach where it was, not merely for the nodes to agree.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let after = loop {
        let feds = cl.converged(Duration::from_secs(10)).await;
        if feds[0].now_ms() >= before.now_ms() {
            break feds;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the restarted nodes never caught up with the state before the restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // Ticks after the restart may advance the clock; compare what was there before.
    assert_eq!(
        after[0].clusters().keys().collect::<Vec<_>>(),
        before.clusters().keys().collect::<Vec<_>>()
    );
    assert_eq!(
        after[0].ledger(),
        before.ledger(),
        "the ledger after a restart (clock {}) differs from before (clock {})",
        after[0].now_ms(),
        before.now_ms()
    );
    assert_eq!(after[0].policy(), before.policy());
    for c in ["east", "west", "edge"] {
        assert_eq!(after[0].clusters()[c].last_seq, before.clusters()[c].last_seq);
    }
    cl.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_gets_a_clear_status_and_changes_nothing() {
    let mut cl = Cluster::start(3).await;
    cl.leader(Duration::from_secs(10)).await;
    let client = Client::new(&cl.endpoints()).expect("client");

    // Reports before any policy.
    let e = send(&client, &report("east", 1, 0, 1)).await.expect_err("no policy");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");

    // An invalid policy lists its problems; nothing is applied.
    let e = apply_policy(&client, "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: x}\nspec:\n  tenants:\n  - {name: a, weight: -1}\n  - {name: a}\n")
        .await
        .expect_err("invalid");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("spec.tenants[0].weight") && e.message().contains("duplicate"),
        "{}",
        e.message()
    );
    apply_policy(&client, Policy::article_example_yaml())
        .await
        .expect("policy");
    let held = register(&client, "east", 8).await.epoch;
    let before = cl.converged(Duration::from_secs(5)).await.remove(0);

    // Unknown cluster.
    let e = send(&client, &report("nowhere", 1, 0, 1)).await.expect_err("unknown");
    assert_eq!(e.code(), Code::NotFound, "{e}");
    // Malformed fields.
    let mut bad = report("east", 1, held, 1);
    bad.tenants[0].tenant = "Not A Tenant".into();
    let e = send(&client, &bad).await.expect_err("bad tenant");
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    let e = send(&client, &report("East!", 1, held, 1)).await.expect_err("bad id");
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    // A gap in sequence numbers says where to resume.
    let e = send(&client, &report("east", 3, held, 1)).await.expect_err("gap");
    assert_eq!(e.code(), Code::FailedPrecondition, "{e}");
    assert_eq!(
        e.metadata().get("kvota-expected-seq").and_then(|v| v.to_str().ok()),
        Some("1")
    );
    // An agent that reads gaps from the reply gets it there, from the leader and from a
    // follower that forwards the report alike.
    for endpoint in cl.endpoints() {
        let one = Client::new(std::slice::from_ref(&endpoint)).expect("client");
        let mut r = report("east", 3, held, 1);
        r.gap_in_reply = true;
        let reply = send(&one, &r).await.expect("a gap in the reply");
        assert_eq!(
            (reply.expected_seq, reply.applied, reply.lease.is_none()),
            (1, false, true),
            "{endpoint}"
        );
    }
    // An acknowledgement of an epoch never issued.
    let e = send(&client, &report("east", 1, 999, 1)).await.expect_err("epoch");
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    // Oversized: more than the 4 MiB message limit.
    let mut huge = report("east", 1, held, 1);
    huge.tenants = (0..200_000)
        .map(|i| v1::TenantUsage {
            tenant: format!("tenant-{i:08}"),
            ..Default::default()
        })
        .collect();
    let e = send(&client, &huge).await.expect_err("oversized");
    assert!(
        matches!(
            e.code(),
            Code::OutOfRange | Code::ResourceExhausted | Code::InvalidArgument
        ),
        "{e}"
    );

    let after = cl.converged(Duration::from_secs(5)).await.remove(0);
    assert_eq!(
        before.clusters()["east"],
        after.clusters()["east"],
        "refused reports changed nothing"
    );
    assert_eq!(before.ledger(), after.ledger());

    // Duplicate sequence numbers are answered but not applied.
    let first = send(&client, &report("east", 1, held, 10)).await.expect("first");
    assert!(first.applied);
    let again = send(&client, &report("east", 1, held, 10)).await.expect("again");
    assert!(!again.applied);

    // No quorum: two of three nodes down; the survivor answers UNAVAILABLE, in time.
    let leader = cl.leader(Duration::from_secs(5)).await;
    let others: Vec<u64> = (1..=3).filter(|&i| i != leader).collect();
    cl.stop(others[0]).await;
    cl.stop(leader).await;
    let survivor = others[1];
    let lone = Client::new(&[cl.members[&survivor].rpc_addr.clone()]).expect("client");
    let started = Instant::now();
    let e = send(&lone, &report("east", 2, held, 1)).await.expect_err("no quorum");
    assert!(matches!(e.code(), Code::Unavailable | Code::DeadlineExceeded), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "gave up after {:?}",
        started.elapsed()
    );
    cl.shutdown().await;
}

/// A plain HTTP/1.1 GET on loopback (no client library needed for three endpoints).
async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect http");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.expect("write");
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn membership_changes_and_admin_http() {
    let mut cl = Cluster::start(3).await;
    cl.leader(Duration::from_secs(10)).await;
    let client = Client::new(&cl.endpoints()).expect("client");
    apply_policy(&client, Policy::article_example_yaml())
        .await
        .expect("policy");
    register(&client, "east", 8).await;
    // Followers serve their applied state: wait until every node has the policy.
    cl.converged(Duration::from_secs(10)).await;

    // Health, readiness and metrics on every node.
    for m in cl.members.values() {
        assert_eq!(http_get(&m.http_addr, "/healthz").await.0, 200);
        let (code, body) = http_get(&m.http_addr, "/readyz").await;
        assert_eq!(code, 200, "{body}");
        let (code, metrics) = http_get(&m.http_addr, "/metrics").await;
        assert_eq!(code, 200);
        for name in [
            "kvota_raft_term",
            "kvota_raft_role",
            "kvota_tenant_entitlement_gpus",
            "kvota_apply_duration_seconds",
        ] {
            assert!(
                metrics.contains(name),
                "{name} missing from /metrics of {}",
                m.http_addr
            );
        }
        let (code, json) = http_get(&m.http_addr, "/api/v1/tenants").await;
        assert_eq!(code, 200);
        let v: serde_json::Value = serde_json::from_str(&json).expect("tenants json");
        assert_eq!(v["tenants"].as_array().map(Vec::len), Some(3), "{v}");
    }

    // A fourth node joins as a learner, is promoted, then node 1 is removed.
    let listeners = Listeners::loopback().await.expect("bind");
    let fourth = node_of(&listeners);
    let dir = cl.tmp.path().join("node4");
    let n4 = start(config(4, dir, &fourth), listeners).await.expect("start node 4");
    let req = v1::AddLearnerRequest {
        node: Some(v1::NodeInfo {
            id: 4,
            rpc_addr: fourth.rpc_addr.clone(),
            http_addr: fourth.http_addr.clone(),
            raft_addr: fourth.raft_addr.clone(),
            voter: false,
        }),
    };
    let st = client
        .call(|ch| {
            let req = req.clone();
            async move { Ok(Client::admin(ch).add_learner(req).await?.into_inner()) }
        })
        .await
        .expect("add learner");
    assert!(st.members.iter().any(|m| m.id == 4 && !m.voter), "{:?}", st.members);
    // The learner has the replicated state.
    let deadline = Instant::now() + Duration::from_secs(10);
    while n4.ctx.state.read().await.federation.clusters().get("east").is_none() {
        assert!(Instant::now() < deadline, "learner did not catch up");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // It is ready once it has applied what the leader has (asked over gRPC, since its
    // own log cannot show what it has not received), and says why until then.
    let leader_applied = {
        let l = cl.leader(Duration::from_secs(5)).await;
        let m = cl.nodes[idx(l)]
            .as_ref()
            .expect("leader runs")
            .raft()
            .metrics()
            .borrow()
            .clone();
        m.last_applied.map_or(0, |l| l.index)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (code, body) = http_get(&fourth.http_addr, "/readyz").await;
        if code == 200 {
            break;
        }
        assert!(body.contains("catching up") || body.contains("leader"), "{body}");
        assert!(Instant::now() < deadline, "learner never ready: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let applied = n4.ctx.raft.metrics().borrow().last_applied.map_or(0, |l| l.index);
    assert!(
        applied + kvota_control_plane::node::CATCH_UP_SLACK >= leader_applied,
        "ready at {applied} of {leader_applied}"
    );
    let promote = v1::ChangeMembershipRequest {
        voters: vec![1, 2, 3, 4],
        retain: false,
    };
    let st = client
        .call(|ch| {
            let r = promote.clone();
            async move { Ok(Client::admin(ch).change_membership(r).await?.into_inner()) }
        })
        .await
        .expect("promote");
    assert_eq!(st.members.iter().filter(|m| m.voter).count(), 4, "{:?}", st.members);
    let shrink = v1::ChangeMembershipRequest {
        voters: vec![2, 3, 4],
        retain: false,
    };
    let st = client
        .call(|ch| {
            let r = shrink.clone();
            async move { Ok(Client::admin(ch).change_membership(r).await?.into_inner()) }
        })
        .await
        .expect("remove node 1");
    let ids: Vec<u64> = st.members.iter().map(|m| m.id).collect();
    assert_eq!(ids, [2, 3, 4], "{:?}", st.members);
    // Node 1 can go; the group of 2, 3, 4 still takes writes.
    cl.stop(1).await;
    let c234 = Client::new(&[cl.members[&2].rpc_addr.clone(), fourth.rpc_addr.clone()]).expect("client");
    register(&c234, "west", 8).await;
    let bad = v1::ChangeMembershipRequest {
        voters: vec![],
        retain: false,
    };
    let e = c234
        .call(|ch| {
            let r = bad.clone();
            async move { Ok(Client::admin(ch).change_membership(r).await?.into_inner()) }
        })
        .await
        .expect_err("empty voter set");
    assert_eq!(e.code(), Code::InvalidArgument);
    n4.shutdown().await;
    cl.shutdown().await;
}

/// When the leader's process is gone (its port refuses connections), a survivor calls an
/// election as soon as the leader lease has run out on every follower, instead of
/// waiting for its own election timer on top of the lease. The timing is stretched so
/// the two are seconds apart: lease 4 s (election_timeout_max), timers 2-4 s. openraft
/// alone needs lease + timer >= 6 s after the last heartbeat (>= 5.8 s after the stop);
/// the watchdog about 4.02 s after the last heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn survivors_of_a_dead_leader_elect_when_the_lease_ends_not_after_their_timers() {
    let mut c = Cluster::start_with(3, None, |cfg| {
        cfg.heartbeat_ms = 200;
        cfg.election_timeout_min_ms = 2_000;
        cfg.election_timeout_max_ms = 4_000;
    })
    .await;
    let old = c.leader(Duration::from_secs(30)).await;
    // Every follower has heard the leader (and so holds its lease) before it dies.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let stopped = Instant::now();
    c.stop(old).await;
    let new = c.leader(Duration::from_secs(15)).await;
    let took = stopped.elapsed();
    assert_ne!(new, old);
    assert!(
        took >= Duration::from_millis(3_700),
        "elected {took:?} after the stop: before the old leader's lease ran out"
    );
    assert!(
        took < Duration::from_millis(5_500),
        "elected {took:?} after the stop: no sooner than openraft's own timers would"
    );
    c.shutdown().await;
}

/// A year ahead of the system clock: a node whose clock took a bad step.
fn a_year_ahead() -> kvota_control_plane::clock::WallClock {
    let year = 365 * 24 * 3_600_000u64;
    let real = kvota_control_plane::clock::system_wall_clock();
    std::sync::Arc::new(move || real() + year)
}

fn unix_ms() -> u64 {
    u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis(),
    )
    .expect("ms")
}

/// The federation's time is the median of the voters' clocks: node 1, a year ahead, is
/// made leader and stamps entries, yet the replicated clock stays with the others (and
/// keeps moving), so nothing freezes once node 1's clock is fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_with_a_clock_far_ahead_cannot_move_the_federations_time() {
    let cl = Cluster::start_with(3, None, |cfg| {
        if cfg.id == 1 {
            cfg.wall_clock = a_year_ahead();
        }
    })
    .await;
    cl.leader(Duration::from_secs(10)).await;
    // Make node 1 the leader.
    let deadline = Instant::now() + Duration::from_secs(20);
    while cl.leader(Duration::from_secs(5)).await != 1 {
        assert!(Instant::now() < deadline, "node 1 never became leader");
        let _ = cl.node(1).raft().trigger().elect().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let client = Client::new(&cl.endpoints()).expect("client");
    apply_policy(&client, Policy::article_example_yaml())
        .await
        .expect("policy");
    register(&client, "east", 8).await;
    // Ticks and writes, stamped by node 1, for a few seconds.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let first = cl.federation(1).await.now_ms();
    register(&client, "west", 8).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(cl.leader(Duration::from_secs(5)).await, 1, "node 1 still leads");
    let later = cl.federation(1).await.now_ms();
    let real = unix_ms();
    assert!(
        later.abs_diff(real) < 10_000,
        "the federation's clock is {} ms off real time",
        i128::from(later) - i128::from(real)
    );
    assert!(later > first, "time stood still: {first} -> {later}");
    cl.shutdown().await;
}

/// A Raft core that stops without being asked (a storage error, a panic) makes the node
/// unhealthy and unready, counts it, and the handle says so (the binary then exits
/// non-zero, for its supervisor to restart it).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_raft_core_that_stops_fails_health_and_the_node_says_it_is_broken() {
    let cl = Cluster::start(3).await;
    let leader = cl.leader(Duration::from_secs(10)).await;
    let victim = if leader == 3 { 2 } else { 3 };
    let http = cl.members[&victim].http_addr.clone();
    let plain = kvota_tls::connect::Connector::new(None);
    assert_eq!(
        kvota_testkit::http_get(&plain, &http, "/healthz")
            .await
            .expect("healthz")
            .0,
        200
    );
    // Stop the core behind the node's back.
    cl.node(victim).raft().shutdown().await.expect("stop the core");
    let why = tokio::time::timeout(Duration::from_secs(5), cl.node(victim).broken())
        .await
        .expect("noticed within 5 s");
    assert!(why.contains("Raft core"), "{why}");
    let (code, body) = kvota_testkit::http_get(&plain, &http, "/healthz")
        .await
        .expect("healthz");
    assert!(code == 503 && body.contains("broken"), "{code} {body}");
    let (code, body) = kvota_testkit::http_get(&plain, &http, "/readyz").await.expect("readyz");
    assert!(code == 503 && body.contains("broken"), "{code} {body}");
    let (_, metrics) = kvota_testkit::http_get(&plain, &http, "/metrics")
        .await
        .expect("metrics");
    assert!(metrics.contains("kvota_raft_fatal 1"), "{metrics}");
    // The others go on.
    let others: Vec<String> = cl
        .members
        .iter()
        .filter(|(id, _)| **id != victim)
        .map(|(_, m)| m.rpc_addr.clone())
        .collect();
    apply_policy(&Client::new(&others).expect("client"), Policy::article_example_yaml())
        .await
        .expect("the others take writes");
    cl.shutdown().await;
}

/// At feature level 3 the group lends: leases carry each preemptible tenant's borrow
/// limit and every tenant's ceiling (maxShare of the federation) over real gRPC, and
/// every node computes the same ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leases_carry_borrow_limits_once_the_group_lends() {
    let cl = Cluster::start(3).await;
    cl.leader(Duration::from_secs(10)).await;
    cl.feature_level(
        kvota_control_plane::feature::FeatureLevel::LENDING,
        Duration::from_secs(20),
    )
    .await;
    let client = Client::new(&cl.endpoints()).expect("client");
    apply_policy(&client, Policy::article_example_yaml())
        .await
        .expect("policy");
    let held = register(&client, "east", 32).await.epoch;
    let lease = send(&client, &report("east", 1, held, 0))
        .await
        .expect("report")
        .lease
        .expect("lease");
    let by: BTreeMap<&str, &v1::TenantBudget> = lease.budgets.iter().map(|b| (b.tenant.as_str(), b)).collect();
    // 32 GPUs: training's maxShare is 60 % (19.2), its demand 12; inference is not
    // preemptible and never borrows.
    let training = by["training"];
    assert_eq!(training.ceiling_milli_gpue, 19_200);
    assert_eq!(
        training.borrow_milli_gpue,
        19_200 - training.entitlement_milli_gpue,
        "{training:?}"
    );
    assert!(training.borrow_milli_gpue > 0);
    assert_eq!(
        (by["inference"].borrow_milli_gpue, by["inference"].ceiling_milli_gpue),
        (0, 25_600)
    );
    for id in 1..=3 {
        assert!(cl.federation(id).await.lends(), "node {id} lends");
    }
    cl.shutdown().await;
}

/// Two tenants on two clusters of 16 GPUs; `train` may hold at most 25 % (8 GPUs).
const SIZED_POLICY: &str = include_str!("../../fairness/tests/fixtures/sized.yaml");

fn supports_3(c: &mut kvota_control_plane::server::ServerConfig) {
    c.feature_level_max = kvota_control_plane::feature::FeatureLevel::LENDING;
}

/// `train` waits with one 8-GPU job in `east` and 2-GPU pods in `west` (8 GPUs pending
/// in each); after three rounds of reports, its budgets (east, west) and what every node
/// keeps of east's largest waiting pod.
async fn sized_round(cl: &Cluster) -> ((u64, u64), Vec<u64>) {
    let client = Client::new(&cl.endpoints()).expect("client");
    apply_policy(&client, SIZED_POLICY).await.expect("policy");
    let mut held = [
        register(&client, "east", 16).await.epoch,
        register(&client, "west", 16).await.epoch,
    ];
    let mut budgets = [0u64; 2];
    for seq in 1..=3 {
        for (i, (cluster, largest)) in [("east", 8_000), ("west", 2_000)].into_iter().enumerate() {
            let usage = v1::TenantUsage {
                tenant: "train".into(),
                pending_milli_gpue: 8_000,
                largest_pending_milli_gpue: largest,
                ..Default::default()
            };
            let r = v1::ReportRequest {
                cluster: cluster.into(),
                seq,
                held_epoch: held[i],
                tenants: vec![usage],
                ..Default::default()
            };
            let lease = send(&client, &r).await.expect("report").lease.expect("lease");
            held[i] = lease.epoch;
            budgets[i] = lease
                .budgets
                .iter()
                .find(|b| b.tenant == "train")
                .map_or(0, |b| b.budget_milli_gpue);
        }
    }
    let mut kept = Vec::new();
    for id in 1..=3 {
        kept.push(cl.federation(id).await.clusters()["east"].usage["train"].largest);
    }
    ((budgets[0], budgets[1]), kept)
}

/// At feature level 4 budgets are sized to waiting pods over real gRPC: the largest
/// waiting pod travels in reports and in log entries, every node keeps it, and the split
/// gives the 8-GPU job room in its cluster. A group held at level 3 (a voter of an older
/// build) keeps none of it and splits as before, so old and new replicas agree.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn budgets_are_sized_to_the_largest_waiting_pod_once_the_group_runs_level_4() {
    let cl = Cluster::start(3).await;
    cl.leader(Duration::from_secs(10)).await;
    cl.feature_level(
        kvota_control_plane::feature::FeatureLevel::SIZED,
        Duration::from_secs(20),
    )
    .await;
    let (budgets, kept) = sized_round(&cl).await;
    assert_eq!(budgets, (8_000, 0), "the job's cluster holds train's whole entitlement");
    assert_eq!(kept, [8_000; 3], "every node keeps the largest waiting pod");
    for id in 1..=3 {
        assert!(cl.federation(id).await.sizes_budgets(), "node {id} sizes budgets");
    }
    cl.shutdown().await;

    let cl = Cluster::start_with(3, None, supports_3).await;
    cl.leader(Duration::from_secs(10)).await;
    cl.feature_level(
        kvota_control_plane::feature::FeatureLevel::LENDING,
        Duration::from_secs(20),
    )
    .await;
    let (budgets, kept) = sized_round(&cl).await;
    assert_eq!(budgets, (4_000, 4_000), "level 3: in proportion to pending demand");
    assert_eq!(kept, [0; 3], "level 3: not kept");
    cl.shutdown().await;
}

/// A follower that was down while reports naming a thousand tenants piled up (each log
/// entry 20-30 KiB) catches up once it is back, and the group keeps committing: the
/// leader sends it a bounded number of bytes per AppendEntries, which openraft gives
/// only a heartbeat interval (50 ms) to be answered. With openraft's default of 300
/// entries a message, such a follower was sent the same 6-9 MiB again and again and
/// never caught up. On a loaded machine even 128 KiB ran out of time; the late answers
/// were taken for an unreachable peer (half a second without heartbeats), so the
/// follower called elections and the leader's term climbed while it stayed behind:
/// messages that run out of time now shrink the next ones and are retried at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_behind_on_large_reports_catches_up() {
    const TENANTS: usize = 1_000;
    let mut cl = Cluster::start(3).await;
    let leader = cl.leader(Duration::from_secs(10)).await;
    let client = Client::new(&cl.endpoints()).expect("client");
    let mut yaml = String::from(
        "apiVersion: kvota.dev/v1alpha1\nkind: FairnessPolicy\nmetadata: {name: big}\nspec:\n  tenants:\n",
    );
    for i in 0..TENANTS {
        yaml.push_str(&format!("  - {{name: team-{i:04}, weight: 1}}\n"));
    }
    apply_policy(&client, &yaml).await.expect("policy");
    let mut held = register(&client, "east", 4_096).await.epoch;
    let behind = if leader == 3 { 2 } else { 3 };
    cl.stop(behind).await;
    let big = |seq: u64, held: u64| v1::ReportRequest {
        tenants: (0..TENANTS)
            .map(|i| {
                let u = 1_000 + ((i as u64 * 7 + seq * 13) % 2_000);
                v1::TenantUsage {
                    tenant: format!("team-{i:04}"),
                    used_milli_gpue_ms: u * 5_000,
                    inuse_milli_gpue: u,
                    pending_milli_gpue: u / 2,
                    largest_pending_milli_gpue: 0,
                    borrowed_milli_gpue: 0,
                }
            })
            .collect(),
        ..report("east", seq, held, 0)
    };
    for seq in 1..=400 {
        let reply = send(&client, &big(seq, held))
            .await
            .unwrap_or_else(|e| panic!("report {seq} with one follower down: {e}"));
        held = reply.lease.map_or(held, |l| l.epoch);
    }
    let target = cl
        .node(leader)
        .raft()
        .metrics()
        .borrow()
        .last_applied
        .map_or(0, |l| l.index);
    cl.restart(behind).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let applied = cl
            .node(behind)
            .raft()
            .metrics()
            .borrow()
            .last_applied
            .map_or(0, |l| l.index);
        if applied >= target {
            break;
        }
        if Instant::now() >= deadline {
            let m = cl.node(behind).raft().metrics().borrow().clone();
            let l = cl.node(leader).raft().metrics().borrow().clone();
            panic!("node {behind} applied {applied} of {target} log entries within 30 s (its last log {:?}; the leader's replication {:?})", m.last_log_index, l.replication);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // And the group commits with it: the other follower stopped, the caught-up one is
    // the quorum.
    let other = (1..=3).find(|n| *n != leader && *n != behind).expect("a third node");
    cl.stop(other).await;
    send(&client, &big(401, held))
        .await
        .expect("a report committed by the leader and the caught-up follower");
    cl.shutdown().await;
}

/// The leader's own appends are acknowledged before their sync (`store::flush`), so the
/// followers receive an entry while the leader's disk syncs it; and nothing applies it
/// before that sync is done: the leader does not answer the write, and the commit index
/// it sends its followers stops at its durable log, so no follower applies it either.
/// The test holds the leader's syncs back to see both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn followers_receive_an_entry_during_the_leaders_sync_and_apply_it_after() {
    let cl = Cluster::start(3).await;
    let leader = cl.leader(Duration::from_secs(10)).await;
    let client = Client::new(&cl.endpoints()).expect("client");
    apply_policy(&client, Policy::article_example_yaml())
        .await
        .expect("policy");
    let held = register(&client, "east", 64).await.epoch;
    send(&client, &report("east", 1, held, 1_000)).await.expect("report 1");
    let followers: Vec<u64> = (1..=3).filter(|n| *n != leader).collect();
    let metrics = |n: u64| cl.node(n).raft().metrics().borrow().clone();

    let hold = cl.node(leader).hold_flushes_for_test();
    // A sync that was running when the hold began still finishes.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let durable = cl.node(leader).durable().borrow().upto.map_or(0, |l| l.index);
    let write = tokio::spawn({
        let client = client.clone();
        async move { send(&client, &report("east", 2, held, 2_000)).await }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while followers
        .iter()
        .any(|f| metrics(*f).last_log_index.unwrap_or(0) <= durable)
    {
        assert!(
            Instant::now() < deadline,
            "the followers did not receive entries past {durable} while the leader's sync was held"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!write.is_finished(), "the write was answered before the leader's sync");
    // Read again: on a loaded machine a sync begun before the hold may have ended late.
    // Entries appended under the hold are past it either way.
    let durable = cl.node(leader).durable().borrow().upto.map_or(0, |l| l.index);
    assert!(followers
        .iter()
        .all(|f| metrics(*f).last_log_index.unwrap_or(0) > durable));
    for n in (1..=3).chain([leader]) {
        let applied = metrics(n).last_applied.map_or(0, |l| l.index);
        assert!(
            applied <= durable,
            "node {n} applied entry {applied}, past the leader's durable log ({durable})"
        );
    }
    hold.release();
    let reply = tokio::time::timeout(Duration::from_secs(10), write)
        .await
        .expect("answered once synced")
        .expect("task");
    reply.expect("report 2 committed");
    let deadline = Instant::now() + Duration::from_secs(10);
    while followers
        .iter()
        .any(|f| metrics(*f).last_applied.map_or(0, |l| l.index) <= durable)
    {
        assert!(
            Instant::now() < deadline,
            "the followers did not apply past {durable} after the sync"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cl.shutdown().await;
}
