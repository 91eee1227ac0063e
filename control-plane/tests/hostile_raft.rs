//! A group of real nodes in this process (real sockets, TLS, data directories) against
//! Raft peers that do not play by the rules, and the terms no attack may strand it at.
//!
//! - Fuzzed requests: arbitrary AppendEntries, Vote and InstallSnapshot messages (terms
//!   and indexes from the interesting values: the bounds, the ceiling, `u64::MAX`),
//!   sent over the Raft port with member and non-member node certificates, for a
//!   bounded time: no node's Raft core stops, and the group writes afterwards.
//! - Fuzzed replies: a fake node 3 answers the others' Raft calls with arbitrary replies
//!   (while elections and snapshots are provoked): the same.
//! - A node cut off long enough to run thousands of elections rejoins; a learner added
//!   to a group deep in the last 2^40 terms catches up.
//!
//! A failing fuzz case is printed; the run is deterministic (proptest's deterministic
//! runner), so `cargo test -p kvota-control-plane --test hostile_raft` replays it.

#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvota_client::client::Client;
use kvota_control_plane::guard::{term_ceiling, unix_ms, MAX_FREE_INDEX, MAX_FREE_TERM, MAX_INDEX, MAX_TERM};
use kvota_proto::raft::v1 as pb;
use kvota_proto::v1;
use kvota_testkit::{Cluster, Pki};
use kvota_tls::Role;
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;

/// How long each fuzz target runs (it also stops after `FUZZ_CASES`).
const FUZZ_FOR: Duration = Duration::from_secs(8);
const FUZZ_CASES: usize = 10_000;

fn term() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => 0u64..12,
        1 => Just(1 << 48),
        1 => Just(MAX_FREE_TERM - 1),
        1 => Just(MAX_FREE_TERM),
        1 => Just(MAX_FREE_TERM + 1),
        1 => Just(MAX_FREE_TERM + (1 << 39)),
        1 => Just(MAX_TERM),
        1 => Just(u64::MAX),
    ]
}

fn index() -> impl Strategy<Value = u64> {
    prop_oneof![
        6 => 0u64..64,
        1 => Just(1 << 40),
        1 => Just(MAX_FREE_INDEX),
        1 => Just(MAX_FREE_INDEX + 1),
        1 => Just(MAX_INDEX),
        1 => Just(u64::MAX),
    ]
}

fn raft_vote() -> impl Strategy<Value = pb::RaftVote> {
    (term(), 0u64..5, any::<bool>()).prop_map(|(term, node_id, committed)| pb::RaftVote {
        term,
        node_id,
        committed,
    })
}

fn log_id() -> impl Strategy<Value = pb::RaftLogId> {
    (term(), 0u64..5, index()).prop_map(|(term, node_id, index)| pb::RaftLogId { term, node_id, index })
}

fn membership() -> impl Strategy<Value = pb::RaftMembership> {
    (
        proptest::collection::vec(proptest::collection::vec(0u64..5, 0..4), 0..3),
        proptest::collection::btree_set(0u64..5, 0..4),
    )
        .prop_map(|(configs, nodes)| pb::RaftMembership {
            configs: configs.into_iter().map(|voters| pb::RaftVoterSet { voters }).collect(),
            nodes: nodes
                .into_iter()
                .map(|n| {
                    (
                        n,
                        pb::RaftNode {
                            rpc_addr: format!("127.0.0.1:{}", 1_000 + n),
                            http_addr: String::new(),
                            raft_addr: format!("127.0.0.1:{}", 2_000 + n),
                        },
                    )
                })
                .collect(),
        })
}

fn entry() -> impl Strategy<Value = pb::RaftEntry> {
    use pb::raft_entry::Payload;
    let command = prop_oneof![
        Just(pb::LogCommand { command: None }),
        Just(pb::LogCommand {
            command: Some(pb::log_command::Command::Tick(pb::Empty {}))
        }),
    ];
    let batch = (
        0u32..4,
        proptest::collection::vec(command, 0..3),
        proptest::option::of(0u32..9),
    )
        .prop_map(|(format, commands, raise)| pb::LogBatch {
            format,
            now_ms: 1,
            commands,
            raise_feature_level: raise,
            actors: Default::default(),
        });
    let payload = prop_oneof![
        1 => Just(None),
        3 => Just(Some(Payload::Blank(pb::Empty {}))),
        3 => batch.prop_map(|b| Some(Payload::Normal(b))),
        1 => membership().prop_map(|m| Some(Payload::Membership(m))),
    ];
    (proptest::option::of(log_id()), payload).prop_map(|(log_id, payload)| pb::RaftEntry { log_id, payload })
}

fn append() -> impl Strategy<Value = pb::AppendEntriesRequest> {
    (
        proptest::option::weighted(0.95, raft_vote()),
        proptest::option::of(log_id()),
        proptest::collection::vec(entry(), 0..4),
        proptest::option::of(log_id()),
    )
        .prop_map(|(vote, prev_log_id, entries, leader_commit)| pb::AppendEntriesRequest {
            vote,
            prev_log_id,
            entries,
            leader_commit,
        })
}

fn vote_request() -> impl Strategy<Value = pb::VoteRequest> {
    (
        proptest::option::weighted(0.95, raft_vote()),
        proptest::option::of(log_id()),
    )
        .prop_map(|(vote, last_log_id)| pb::VoteRequest { vote, last_log_id })
}

fn snapshot_chunk() -> impl Strategy<Value = pb::InstallSnapshotRequest> {
    let meta = (
        proptest::option::of(log_id()),
        proptest::option::of(log_id()),
        proptest::option::weighted(0.9, membership()),
        prop_oneof![Just("a".to_string()), Just("b".to_string()), Just(String::new())],
    )
        .prop_map(
            |(last_log_id, membership_log_id, membership, snapshot_id)| pb::RaftSnapshotMeta {
                last_log_id,
                membership_log_id,
                membership,
                snapshot_id,
            },
        );
    (
        proptest::option::weighted(0.95, raft_vote()),
        proptest::option::weighted(0.95, meta),
        prop_oneof![4 => 0u64..256, 1 => Just(1 << 30), 1 => Just(u64::MAX)],
        proptest::collection::vec(any::<u8>(), 0..128),
        any::<bool>(),
    )
        .prop_map(|(vote, meta, offset, data, done)| pb::InstallSnapshotRequest {
            vote,
            meta,
            offset,
            data,
            done,
        })
}

/// One Raft call of any kind.
#[derive(Clone, Debug)]
enum Call {
    Append(pb::AppendEntriesRequest),
    Vote(pb::VoteRequest),
    Snapshot(pb::InstallSnapshotRequest),
}

fn call() -> impl Strategy<Value = Call> {
    prop_oneof![
        3 => append().prop_map(Call::Append),
        2 => vote_request().prop_map(Call::Vote),
        2 => snapshot_chunk().prop_map(Call::Snapshot),
    ]
}

async fn write(c: &Client) -> Result<(), tonic::Status> {
    let yaml = kvota_fairness::policy::Policy::article_example_yaml().to_string();
    c.call(|ch| {
        let yaml = yaml.clone();
        async move {
            Client::admin(ch).apply_policy(v1::PolicyRequest { yaml }).await?;
            Ok(())
        }
    })
    .await
}

/// A write goes through within `within`; how long it took.
async fn writes_within(c: &Client, within: Duration, what: &str) -> Duration {
    let t0 = Instant::now();
    loop {
        match write(c).await {
            Ok(()) => return t0.elapsed(),
            Err(e) => assert!(t0.elapsed() < within, "{what}: no write within {within:?}: {e:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// No running node's Raft core has stopped.
fn none_broken(cl: &Cluster, what: &str) {
    for n in cl.nodes.iter().flatten() {
        assert_eq!(n.ctx.fatal(), None, "{what}: node {}'s Raft core stopped", n.id);
    }
}

fn operator(cl: &Cluster, pki: &Pki) -> Client {
    let c = Client::with_tls(&cl.endpoints(), Some(pki.party(Role::Operator, "alice"))).unwrap();
    c.set_call_timeout(Duration::from_secs(2));
    c
}

fn raft_as(cl: &Cluster, pki: &Pki, as_node: u64, to: u64) -> pb::raft_client::RaftClient<tonic::transport::Channel> {
    kvota_control_plane::network::raft_client(
        &cl.members[&to].raft_addr,
        to,
        Some(&pki.party(Role::Node, &as_node.to_string())),
        Duration::from_secs(2),
    )
    .unwrap()
}

/// `c` made to pass more of the checks, so that it reaches openraft: the vote the
/// sender's own, of `term`, committed where a leader's is; an AppendEntries following
/// `applied` with entries numbered from it (and no membership entries).
fn plausible(c: Call, sender: u64, term: u64, applied: Option<openraft::LogId<u64>>) -> Call {
    let vote = |committed| {
        Some(pb::RaftVote {
            term,
            node_id: sender,
            committed,
        })
    };
    match c {
        Call::Append(mut r) => {
            r.vote = vote(true);
            r.prev_log_id = applied.map(|a| pb::RaftLogId {
                term: a.leader_id.term,
                node_id: a.leader_id.node_id,
                index: a.index,
            });
            let first = applied.map_or(0, |a| a.index + 1);
            for (i, e) in r.entries.iter_mut().enumerate() {
                e.log_id = Some(pb::RaftLogId {
                    term,
                    node_id: sender,
                    index: first + i as u64,
                });
                // A membership of other nodes would leave node 1 refusing everyone after.
                if matches!(e.payload, Some(pb::raft_entry::Payload::Membership(_))) {
                    e.payload = Some(pb::raft_entry::Payload::Blank(pb::Empty {}));
                }
            }
            Call::Append(r)
        }
        Call::Vote(mut r) => {
            r.vote = vote(false);
            Call::Vote(r)
        }
        Call::Snapshot(mut r) => {
            r.vote = vote(true);
            Call::Snapshot(r)
        }
    }
}

/// Arbitrary Raft requests, as members 2 and 3 and as node 9 (no member), to node 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fuzzed_raft_requests_never_stop_a_node() {
    let pki = Pki::new("kvota");
    let cl = Cluster::start_with(3, Some(&pki), |_| {}).await;
    cl.leader(Duration::from_secs(10)).await;
    let op = operator(&cl, &pki);
    writes_within(&op, Duration::from_secs(10), "before").await;
    let clients = [
        raft_as(&cl, &pki, 2, 1),
        raft_as(&cl, &pki, 3, 1),
        raft_as(&cl, &pki, 9, 1),
    ];
    let drawn = draw(FUZZ_CASES, (0usize..3, call()));
    let (t0, mut cases) = (Instant::now(), 0);
    let mut answers: HashMap<String, usize> = HashMap::new();
    let mut recent = std::collections::VecDeque::new();
    for (who, c) in drawn {
        if t0.elapsed() > FUZZ_FOR {
            break;
        }
        let mut client = clients[who].clone();
        let c = if cases % 2 == 0 {
            let m = cl.node(1).raft().metrics().borrow().clone();
            plausible(c, [2, 3, 9][who], m.current_term + cases as u64 % 3, m.last_applied)
        } else {
            c
        };
        let answer = match c.clone() {
            Call::Append(r) => client.append_entries(r).await.map(drop),
            Call::Vote(r) => client.vote(r).await.map(drop),
            Call::Snapshot(r) => client.install_snapshot(r).await.map(drop),
        };
        let why = answer.map_or_else(|e| e.message().chars().take(40).collect(), |()| "answered".to_string());
        *answers.entry(why.clone()).or_default() += 1;
        cases += 1;
        let m = cl.node(1).raft().metrics().borrow().clone();
        recent.push_back(format!(
            "case {cases} as node {}: {c:?}: {why}; then term {} vote {} applied {:?}",
            [2, 3, 9][who],
            m.current_term,
            m.vote,
            m.last_applied
        ));
        if recent.len() > 12 {
            recent.pop_front();
        }
        if cl.node(1).ctx.fatal().is_some() {
            panic!(
                "stopped node 1: {:?}\n{}",
                cl.node(1).ctx.fatal(),
                Vec::from(recent).join("\n")
            );
        }
    }
    let mut answers: Vec<(usize, String)> = answers.into_iter().map(|(w, n)| (n, w)).collect();
    answers.sort_unstable_by(|a, b| b.cmp(a));
    eprintln!("{cases} fuzzed requests in {:?}; answers: {answers:?}", t0.elapsed());
    none_broken(&cl, "fuzzed requests");
    let took = writes_within(&op, Duration::from_secs(10), "after fuzzed requests").await;
    eprintln!("a write {took:?} after the fuzzed requests");
    none_broken(&cl, "fuzzed requests");
    cl.shutdown().await;
}

/// `n` values of `strategy` from proptest's deterministic runner, drawn on a thread
/// with a large stack (nested strategies are deep in a debug build).
fn draw<S>(n: usize, strategy: S) -> Vec<S::Value>
where
    S: Strategy + Send + 'static,
    S::Value: Send + 'static,
{
    std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(move || {
            let mut runner = TestRunner::deterministic();
            (0..n)
                .map(|_| strategy.new_tree(&mut runner).unwrap().current())
                .collect()
        })
        .unwrap()
        .join()
        .unwrap()
}

/// Replies a fake node gives: arbitrary, drawn in advance, taken in turn.
struct Fuzzed {
    appends: Vec<pb::AppendEntriesReply>,
    votes: Vec<pb::VoteReply>,
    snapshots: Vec<pb::InstallSnapshotReply>,
    calls: Mutex<HashMap<&'static str, usize>>,
}

impl Fuzzed {
    fn next<T: Clone>(&self, from: &[T], method: &'static str) -> T {
        let mut calls = self.calls.lock().unwrap();
        let n = calls.entry(method).or_default();
        *n += 1;
        from[*n % from.len()].clone()
    }
}

fn append_reply() -> impl Strategy<Value = pb::AppendEntriesReply> {
    use pb::append_entries_reply::Result as R;
    // Conflicts most often: the leader then searches back through a log it dropped
    // (snapshots are frequent), and must send a snapshot.
    let result = prop_oneof![
        1 => Just(None),
        1 => Just(Some(R::Success(pb::Empty {}))),
        6 => Just(Some(R::Conflict(pb::Empty {}))),
        1 => proptest::option::of(log_id())
            .prop_map(|matching| Some(R::PartialSuccess(pb::RaftPartialSuccess { matching }))),
        1 => raft_vote().prop_map(|v| Some(R::HigherVote(v))),
    ];
    result.prop_map(|result| pb::AppendEntriesReply { result })
}

fn vote_reply() -> impl Strategy<Value = pb::VoteReply> {
    (
        proptest::option::weighted(0.95, raft_vote()),
        any::<bool>(),
        proptest::option::of(log_id()),
    )
        .prop_map(|(vote, vote_granted, last_log_id)| pb::VoteReply {
            vote,
            vote_granted,
            last_log_id,
        })
}

fn snapshot_reply() -> impl Strategy<Value = pb::InstallSnapshotReply> {
    use pb::install_snapshot_reply::Result as R;
    let mismatch = (
        prop_oneof![Just("a".to_string()), Just(String::new())],
        prop_oneof![0u64..256, Just(u64::MAX)],
        prop_oneof![Just("a".to_string()), Just(String::new())],
        prop_oneof![0u64..256, Just(u64::MAX)],
    )
        .prop_map(|(expect_id, expect_offset, got_id, got_offset)| {
            R::Mismatch(pb::RaftSnapshotMismatch {
                expect_id,
                expect_offset,
                got_id,
                got_offset,
            })
        });
    prop_oneof![
        Just(None),
        raft_vote().prop_map(|v| Some(R::Vote(v))),
        mismatch.prop_map(Some)
    ]
    .prop_map(|result| pb::InstallSnapshotReply { result })
}

impl kvota_testkit::fake_raft::Answers for Fuzzed {
    fn append_entries(&self, _: pb::AppendEntriesRequest) -> Result<pb::AppendEntriesReply, tonic::Status> {
        Ok(self.next(&self.appends, "AppendEntries"))
    }

    fn vote(&self, _: pb::VoteRequest) -> Result<pb::VoteReply, tonic::Status> {
        Ok(self.next(&self.votes, "Vote"))
    }

    fn install_snapshot(&self, _: pb::InstallSnapshotRequest) -> Result<pb::InstallSnapshotReply, tonic::Status> {
        Ok(self.next(&self.snapshots, "InstallSnapshot"))
    }
}

fn snapshot_often(c: &mut kvota_control_plane::server::ServerConfig) {
    c.snapshot_every = 20;
    c.snapshot_catchup_entries = 0;
}

/// Arbitrary replies from a fake node 3 to nodes 1 and 2, while they write (so they
/// snapshot and drop their logs, and must send node 3 snapshots) and hold elections
/// (node 3's certificate claims a term now and then, then stays silent).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fuzzed_raft_replies_never_stop_a_node() {
    let pki = Pki::new("kvota");
    let mut cl = Cluster::start_with(3, Some(&pki), snapshot_often).await;
    cl.leader(Duration::from_secs(10)).await;
    let op = operator(&cl, &pki);
    writes_within(&op, Duration::from_secs(10), "before").await;
    cl.stop(3).await;
    let fuzzed = Arc::new(Fuzzed {
        appends: draw(FUZZ_CASES, append_reply()),
        votes: draw(FUZZ_CASES, vote_reply()),
        snapshots: draw(FUZZ_CASES, snapshot_reply()),
        calls: Mutex::default(),
    });
    let stop =
        kvota_testkit::fake_raft::serve(&cl.members[&3].raft_addr, &pki.party(Role::Node, "3"), fuzzed.clone()).await;
    // Writes all along; every 1.5 s node 3's certificate claims the next term (the
    // others follow it, hear nothing, and elect again, asking the fake for its vote; the
    // new leader replicates to the fake in between).
    let writer = {
        let op = op.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            while t0.elapsed() < FUZZ_FOR {
                let _ = write(&op).await;
            }
        })
    };
    let t0 = Instant::now();
    while t0.elapsed() < FUZZ_FOR {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let term = (1..=2)
            .map(|id| cl.node(id).raft().metrics().borrow().current_term)
            .max()
            .unwrap();
        for n in [1, 2] {
            let beat = pb::AppendEntriesRequest {
                vote: Some(pb::RaftVote {
                    term: term + 1,
                    node_id: 3,
                    committed: true,
                }),
                ..Default::default()
            };
            let _ = raft_as(&cl, &pki, 3, n).append_entries(beat).await;
        }
        none_broken(&cl, "fuzzed replies");
    }
    writer.await.unwrap();
    let calls = fuzzed.calls.lock().unwrap().clone();
    eprintln!("fuzzed replies for {:?}: {calls:?}", t0.elapsed());
    for method in ["AppendEntries", "Vote", "InstallSnapshot"] {
        assert!(
            calls.get(method).copied().unwrap_or(0) > 0,
            "no {method} reached the fake: {calls:?}"
        );
    }
    let _ = stop.send(true);
    tokio::time::sleep(Duration::from_millis(100)).await;
    cl.set_tweak(|_| {});
    cl.restart(3).await;
    let took = writes_within(&op, Duration::from_secs(10), "after fuzzed replies").await;
    eprintln!("a write {took:?} after the fuzzed replies");
    none_broken(&cl, "fuzzed replies");
    cl.shutdown().await;
}

fn fast_elections(c: &mut kvota_control_plane::server::ServerConfig) {
    c.heartbeat_ms = 2;
    c.election_timeout_min_ms = 4;
    c.election_timeout_max_ms = 8;
}

/// openraft 0.9 has no pre-vote: a node that cannot reach the others runs election
/// after election, each a term higher. Cut off long enough for thousands, it comes
/// back and rejoins its group (which moves to its term); a learner added to a group
/// deep in the last 2^40 terms catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_back_from_thousands_of_elections_and_a_learner_at_a_high_term_join() {
    let pki = Pki::new("kvota");
    let mut cl = Cluster::start_with(3, Some(&pki), |_| {}).await;
    cl.leader(Duration::from_secs(10)).await;
    let op = operator(&cl, &pki);
    writes_within(&op, Duration::from_secs(10), "before").await;
    let start = cl.node(1).raft().metrics().borrow().current_term;

    // Node 3 alone, with fast timers: its elections find nobody.
    cl.stop(1).await;
    cl.stop(2).await;
    cl.stop(3).await;
    cl.set_tweak(fast_elections);
    cl.restart(3).await;
    let t0 = Instant::now();
    let wanted = start + 2_000;
    loop {
        let term = cl.node(3).raft().metrics().borrow().current_term;
        if term >= wanted {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "only term {term} after {:?}",
            t0.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("node 3 ran {} elections alone in {:?}", wanted - start, t0.elapsed());
    cl.stop(3).await;
    cl.set_tweak(|_| {});
    for id in [1, 2, 3] {
        cl.restart(id).await;
    }
    let took = writes_within(&op, Duration::from_secs(10), "node 3 back").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let terms: Vec<(u64, Option<u64>)> = (1..=3)
            .map(|id| {
                let m = cl.node(id).raft().metrics().borrow().clone();
                (m.current_term, m.current_leader)
            })
            .collect();
        if terms.iter().all(|t| *t == terms[0] && t.1.is_some()) && terms[0].0 >= wanted {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the group did not settle with node 3: {terms:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!("node 3 rejoined: a write {took:?} after the restart");
    none_broken(&cl, "node 3 back");

    // Deep in the headroom: a member's certificate takes the group there (as a
    // compromised node could), the group elects on from it.
    let deep = term_ceiling(unix_ms());
    for n in [1, 3] {
        let beat = pb::AppendEntriesRequest {
            vote: Some(pb::RaftVote {
                term: deep,
                node_id: 2,
                committed: true,
            }),
            ..Default::default()
        };
        let _ = raft_as(&cl, &pki, 2, n).append_entries(beat).await;
    }
    writes_within(&op, Duration::from_secs(10), "deep in the headroom").await;
    let term = cl.node(1).raft().metrics().borrow().current_term;
    assert!(term >= deep, "{term}");

    // A learner at term 0 joins.
    let listeners = kvota_control_plane::server::Listeners::loopback().await.unwrap();
    let node = kvota_testkit::node_of(&listeners);
    let mut cfg = kvota_testkit::config(4, cl.tmp.path().join("node4"), &node);
    cfg.tls = Some(pki.party(Role::Node, "4"));
    let learner = kvota_control_plane::server::start(cfg, listeners).await.unwrap();
    let req = v1::AddLearnerRequest {
        node: Some(v1::NodeInfo {
            id: 4,
            rpc_addr: node.rpc_addr.clone(),
            http_addr: node.http_addr.clone(),
            raft_addr: node.raft_addr.clone(),
            voter: false,
        }),
    };
    op.set_call_timeout(Duration::from_secs(30));
    op.call(|ch| {
        let req = req.clone();
        async move { Ok(Client::admin(ch).add_learner(req).await?.into_inner()) }
    })
    .await
    .expect("the learner added");
    // openraft answers at once for a new node; it catches up meanwhile.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let m = learner.raft().metrics().borrow().clone();
        let leader_applied = cl.node(1).raft().metrics().borrow().last_applied.map_or(0, |l| l.index);
        let applied = m.last_applied.map_or(0, |l| l.index);
        if m.current_term >= deep && applied > 0 && applied + 64 >= leader_applied {
            eprintln!("the learner caught up at term {}, applied {applied}", m.current_term);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the learner is at term {}, applied {applied}; the group applied {leader_applied}",
            m.current_term
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(learner.ctx.fatal(), None);
    none_broken(&cl, "a learner at a high term");
    learner.shutdown().await;
    cl.shutdown().await;
}
